// The per-step cost of dynamic routing: generating and scheduling one rank's
// program, and verifying programs, for deepseek-v3 (256 experts, top-8,
// hidden 7168, inter 2048) at EP 64 with 4096 tokens per rank.
//
//   build/bench/bench_compile --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// Generation reuses the rank's program and scheduler scratch between steps,
// as a runtime does (a rank recompiles into the same storage every step).
// Verification: the busiest rank's own program by the per-rank proof (what a
// sharded run does), and all 64 ranks' programs at once (the
// --verify-all-ranks audit), with a Verifier kept between steps; each under
// the per-assignment exchange and the per-rank one (`exchange` 1: a token
// once per rank, its experts' rows gathered through relays on arrival).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>

#include "compiler/taskflow.hpp"
#include "hpmoe/routing.hpp"

using namespace hpmoe;
using namespace hpmoe::taskflow;

namespace {

LayerConfig v3(std::int64_t exchange = 0) {
  LayerConfig c = preset("deepseek-v3");
  c.ranks = 64;
  c.tokens_per_rank = 4096;
  c.exchange = exchange ? ExchangeMode::rank : ExchangeMode::assignment;
  return c;
}

const ExpertPlacement& placement() {
  static const ExpertPlacement contiguous = ExpertPlacement::contiguous(v3().routed_experts, v3().ranks);
  return contiguous;
}

const RoutingCounts& counts(int skew) {
  static const RoutingCounts uniform = routing_counts(v3(), forced_selection(v3(), parse_routing_spec("uniform", 1)));
  static const RoutingCounts zipf = routing_counts(v3(), forced_selection(v3(), parse_routing_spec("zipf:1.2", 1)));
  return skew ? zipf : uniform;
}

// The busiest rank under the routing (the one whose compile takes longest):
// the figures are for the worst rank, not the average.
std::int64_t busiest(const RoutingCounts& rc, const LayerConfig& c) {
  std::int64_t best = 0, most = -1;
  for (std::int64_t d = 0; d < c.ranks; ++d) {
    std::int64_t rows = 0;
    for (std::int64_t s = 0; s < c.ranks; ++s)
      for (const std::int64_t e : placement().experts_of(d)) rows += rc.at(s, e);
    if (rows > most) most = rows, best = d;
  }
  return best;
}

// The per-rank exchange's counts carry each source's token blocks too.
RoutingCounts counts_for(const LayerConfig& c, const RoutingCounts& rc, const Machine& m, int skew) {
  if (c.exchange != ExchangeMode::rank) return rc;
  RoutingCounts out = rc;
  const auto routing = route_step(c, parse_routing_spec(skew ? "zipf:1.2" : "uniform", 1), 1);
  out.token_counts = rank_token_counts(c, placement(), rc, routing, m.tile_rows);
  return out;
}

// Machines: 0 = this CPU's layout (2 unified workers, 64 x 64 tiles);
// 1 = an accelerator die in the Ascend A3 layout (24 matrix + 48 vector
// workers) with 128 x 256 output tiles.
Machine machine(std::int64_t which) { return parse_machine(which ? "accel:24:48:128x256" : "cpu:2"); }

void BM_GenerateAndSchedule(benchmark::State& state) {
  const LayerConfig c = v3();
  const auto& rc = counts(static_cast<int>(state.range(0)));
  const Pass pass = state.range(1) ? Pass::backward : Pass::forward;
  const Policy policy = static_cast<Policy>(state.range(2));
  const Machine m = machine(state.range(3));
  const std::int64_t rank = busiest(rc, c);
  Program p;
  ScheduleScratch scratch;
  for (auto _ : state) {
    generate_into(p, c, placement(), rc, m, pass, rank);
    schedule(p, policy, scratch);
    benchmark::DoNotOptimize(p.queue_tasks.data());
  }
  state.counters["tasks"] = static_cast<double>(p.tasks.size());
  state.counters["events"] = static_cast<double>(p.events.size());
}

void BM_VerifyAllRanks(benchmark::State& state) {
  const LayerConfig c = v3(state.range(3));
  const Machine m = machine(state.range(2));
  const auto rc = counts_for(c, counts(static_cast<int>(state.range(0))), m, static_cast<int>(state.range(0)));
  const Pass pass = state.range(1) ? Pass::backward : Pass::forward;
  const auto programs = compile(c, placement(), rc, m, pass, Policy::critical_path);
  std::int64_t tasks = 0;
  for (const auto& p : programs) tasks += static_cast<std::int64_t>(p.tasks.size());
  double total = 0;
  Verifier verifier;
  verifier.verify(programs);  // warm: the per-step verifier keeps its storage
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto report = verifier.verify(programs);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(sec);
    total += sec;
    if (!report.ok) state.SkipWithError(report.error.c_str());
  }
  state.counters["ranks"] = static_cast<double>(programs.size());
  state.counters["tasks_all_ranks"] = static_cast<double>(tasks);
  state.counters["per_rank_ms"] = total / double(state.iterations()) / double(programs.size()) * 1e3;
}

// The per-rank proof (what a sharded run does every step): the busiest
// rank's own program checked against the interface of the counts, with a
// Verifier kept between steps; no other rank's program is generated.
void BM_VerifyOwnRank(benchmark::State& state) {
  const LayerConfig c = v3(state.range(3));
  const Machine m = machine(state.range(2));
  const auto rc = counts_for(c, counts(static_cast<int>(state.range(0))), m, static_cast<int>(state.range(0)));
  const Pass pass = state.range(1) ? Pass::backward : Pass::forward;
  const std::int64_t rank = busiest(rc, c);
  Program p = generate(c, placement(), rc, m, pass, rank);
  schedule(p, Policy::critical_path);
  Verifier verifier;
  verifier.verify_rank(p, c, placement(), rc, m);  // warm
  for (auto _ : state) {
    const auto report = verifier.verify_rank(p, c, placement(), rc, m);
    if (!report.ok) state.SkipWithError(report.error.c_str());
  }
  state.counters["tasks"] = static_cast<double>(p.tasks.size());
}

// The per-step quota plan with EPLB-style redundant slots: one extra slot per
// rank, holding a replica of each of the 64 heaviest experts (on the rank
// after its owner). Every rank computes this after the count exchange.
void BM_PlanQuotas(benchmark::State& state) {
  const LayerConfig c = v3();
  const auto& rc = counts(static_cast<int>(state.range(0)));
  std::vector<std::int64_t> total(static_cast<std::size_t>(c.routed_experts), 0);
  for (std::int64_t s = 0; s < c.ranks; ++s)
    for (std::int64_t e = 0; e < c.routed_experts; ++e) total[static_cast<std::size_t>(e)] += rc.at(s, e);
  std::vector<std::int64_t> order(total.size());
  for (std::size_t e = 0; e < order.size(); ++e) order[e] = static_cast<std::int64_t>(e);
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return total[a] > total[b]; });
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(c.ranks));
  for (std::int64_t r = 0; r < c.ranks; ++r)
    for (const auto e : placement().experts_of(r)) lists[static_cast<std::size_t>(r)].push_back(e);
  for (std::int64_t k = 0; k < c.ranks; ++k) {
    const std::int64_t e = order[static_cast<std::size_t>(k)];
    std::int64_t r = (placement().owner(e) + 1) % c.ranks;
    while (std::find(lists[static_cast<std::size_t>(r)].begin(), lists[static_cast<std::size_t>(r)].end(), e) !=
               lists[static_cast<std::size_t>(r)].end() ||
           static_cast<std::int64_t>(lists[static_cast<std::size_t>(r)].size()) > 4)
      r = (r + 1) % c.ranks;
    lists[static_cast<std::size_t>(r)].push_back(e);
  }
  const auto replicated = ExpertPlacement::from_rank_lists(c.routed_experts, lists,
                                                           ExpertPlacement::Rules{.replicas = true, .slots_per_rank = 5});
  for (auto _ : state) {
    auto q = plan_quotas(replicated, rc.counts);
    benchmark::DoNotOptimize(q.data());
  }
  state.counters["instances"] = static_cast<double>(replicated.instances());
}

}  // namespace

BENCHMARK(BM_PlanQuotas)->ArgNames({"zipf"})->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_VerifyOwnRank)
    ->ArgNames({"zipf", "backward", "accel", "exchange"})
    ->ArgsProduct({{0, 1}, {0, 1}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GenerateAndSchedule)
    ->ArgNames({"zipf", "backward", "policy", "accel"})
    ->ArgsProduct({{0, 1}, {0, 1}, {0, 1, 2, 3}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_VerifyAllRanks)
    ->ArgNames({"zipf", "backward", "accel", "exchange"})
    ->ArgsProduct({{0, 1}, {0, 1}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();

BENCHMARK_MAIN();
