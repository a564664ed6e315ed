// Weights instead of tokens (LayerConfig::lend_weights): the lent homes of a
// placement, the quota plan that keeps a lent rank's rows home, the choice
// of what to lend, the programs (proved whole and per rank, every exchange),
// the verifier's mutation corpus for the lend kinds, and the runtime:
// serialized = interleaved bit for bit, the fp64 oracle's checks, and the
// forward's output bit for bit what it is without lending.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "bit_identity.hpp"
#include "compiler/layout.hpp"
#include "exchange_cases.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/reference.hpp"
#include "oracle_checks.hpp"
#include "runtime/interleaved.hpp"

using namespace hpmoe;
using namespace hpmoe::testing;
using hpmoe::testing::bit_identical;

namespace {

// A layer whose zipf routing makes a few experts hot on every rank: with a
// threshold of 20 rows some (expert, rank) pairs are lent, others not.
LayerConfig lend_layer(std::int64_t ranks, std::int64_t tokens, ExchangeMode exchange = ExchangeMode::assignment) {
  LayerConfig c = small(ranks, tokens);
  c.hidden = 128;
  c.expert_inter = 64;
  c.exchange = exchange;
  c.lend_weights = 20;
  c.validate();
  return c;
}

}  // namespace

TEST(Lend, PlacementAddsLentHomesAndKeepsTheOwner) {
  const auto base = ExpertPlacement::contiguous(8, 4);  // rank r owns 2r, 2r + 1
  const ExpertPlacement::Lend lends[] = {{7, 0}, {0, 3}, {1, 3}};
  const auto p = base.with_lent(lends);
  EXPECT_TRUE(p.has_lent());
  EXPECT_EQ(p.instances(), 11);
  EXPECT_EQ(p.owner(7), 3) << "lent to a lower rank, expert 7 keeps its owner";
  EXPECT_EQ(p.owner(0), 0);
  EXPECT_EQ(p.local_count(3), 4);
  EXPECT_EQ(std::vector<std::int32_t>(p.experts_of(3).begin(), p.experts_of(3).end()), (std::vector<std::int32_t>{6, 7, 0, 1}))
      << "lent homes follow the rank's own experts";
  EXPECT_EQ(p.lent_count(3), 2);
  EXPECT_EQ(p.lent_count(1), 0);
  EXPECT_TRUE(p.is_lent(p.instance_on(0, 3)));
  EXPECT_FALSE(p.is_lent(p.instance_on(0, 0)));
  EXPECT_EQ(p.lent_block(p.instance_on(0, 3)), 0);
  EXPECT_EQ(p.lent_block(p.instance_on(1, 3)), 1);
  EXPECT_EQ(p.lent_block(p.instance_on(7, 0)), 0);
  EXPECT_EQ(p.lent_block(p.instance_on(7, 3)), -1);
  EXPECT_EQ(p.without_lent(), base);
  EXPECT_NE(p, base);
  // Refusals name the expert.
  const ExpertPlacement::Lend home[] = {{2, 1}};
  EXPECT_NE(error_of([&] { (void)base.with_lent(home); }).find("expert 2 is already on rank 1"), std::string::npos);
  const ExpertPlacement::Lend twice[] = {{2, 0}, {2, 0}};
  EXPECT_NE(error_of([&] { (void)base.with_lent(twice); }).find("expert 2"), std::string::npos);
  const ExpertPlacement::Lend outside[] = {{9, 0}};
  EXPECT_NE(error_of([&] { (void)base.with_lent(outside); }).find("expert 9"), std::string::npos);
  const nlohmann::json split{{"experts_of_rank", {{0, 1}, {0, 2}, {3, 4}, {5, 6, 7}}}, {"splits", {{{"expert", 0}, {"columns", {0, 32, 64}}}}}};
  const auto with_split = placement_from_json(split, 8, 4, "test");
  const ExpertPlacement::Lend lend_split[] = {{0, 2}};
  EXPECT_NE(error_of([&] { (void)with_split.with_lent(lend_split); }).find("expert 0 is split"), std::string::npos);
}

TEST(Lend, QuotaKeepsALentRanksRowsHome) {
  // Expert 0 replicated on ranks 0 and 1, lent to rank 3; expert 5 lent to rank 0.
  const nlohmann::json j{{"experts_of_rank", {{0, 1, 2}, {0, 3}, {4, 5}, {6, 7}}}, {"replicas", true}};
  const auto base = placement_from_json(j, 8, 4, "test");
  const ExpertPlacement::Lend lends[] = {{0, 3}, {5, 0}};
  const auto p = base.with_lent(lends);
  const std::int64_t P = 4, E = 8, N = p.instances();
  std::vector<std::int64_t> counts(static_cast<std::size_t>(P * E));
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t e = 0; e < E; ++e) counts[static_cast<std::size_t>(s * E + e)] = 10 + 7 * s + 3 * e;
  const auto quota = plan_quotas(p, counts);
  const auto q = [&](std::int64_t s, std::int64_t i) { return quota[static_cast<std::size_t>(s * N + i)]; };
  for (const auto& l : lends) {
    const std::int64_t lent = p.instance_on(l.expert, l.rank);
    for (std::int64_t s = 0; s < P; ++s)
      EXPECT_EQ(q(s, lent), s == l.rank ? counts[static_cast<std::size_t>(s * E + l.expert)] : 0)
          << "a lent home takes its own rank's rows, all of them, and nothing else";
  }
  // Every source's rows of every expert are given out exactly once.
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t e = 0; e < E; ++e) {
      std::int64_t given = 0;
      for (std::int64_t h = 0; h < p.home_count(e); ++h) given += q(s, p.first_instance(e) + h);
      EXPECT_EQ(given, counts[static_cast<std::size_t>(s * E + e)]) << "source " << s << " expert " << e;
    }
}

TEST(Lend, ChoosesWhereARanksOwnRowsReachTheThreshold) {
  LayerConfig c = preset("tiny");
  c.ranks = 2;
  c.tokens_per_rank = 64;
  EXPECT_EQ(c.lend_threshold(), 0) << "off by default";
  c.set("lend_weights", "auto");
  // fp32 tiny: W1 [32, 32] and W2 [16, 32] packed in 64-column panels (12 KiB)
  // against 128 bytes a row each way.
  EXPECT_EQ(c.lend_threshold(), (32 * 64 * 4 + 16 * 64 * 4 + 127) / 128);
  c.set("lend_weights", "7");
  EXPECT_EQ(c.lend_threshold(), 7);
  EXPECT_NE(error_of([&] { c.set("lend_weights", "-3"); }).find("lend_weights"), std::string::npos);
  c.lend_weights = -3;
  EXPECT_NE(error_of([&] { c.validate(); }).find("lend_weights"), std::string::npos);
  c.lend_weights = 7;
  RoutingCounts counts{2, 8, std::vector<std::int64_t>(16, 0), {}};
  counts.counts[0 * 8 + 5] = 7;  // rank 0, expert 5 (rank 1's): lent
  counts.counts[0 * 8 + 6] = 6;  // under the threshold
  counts.counts[1 * 8 + 5] = 30;  // its own: never lent
  counts.counts[1 * 8 + 2] = 9;  // rank 1, expert 2 (rank 0's): lent
  const auto lends = choose_lends(c, contiguous(c), counts);
  EXPECT_EQ(lends, (std::vector<ExpertPlacement::Lend>{{5, 0}, {2, 1}}));
  const Exchange ex(c, contiguous(c), counts, 32);
  EXPECT_EQ(ex.placement().lends(), lends) << "the exchange lends what the choice says";
  EXPECT_EQ(ex.count(0, ex.placement().instance_on(5, 0)), 7);
  EXPECT_EQ(ex.count(0, ex.placement().instance_on(5, 1)), 0) << "rank 0's rows of expert 5 stay home";
  // Only rank 1 borrows: rank 0 declares the lent weights too (no rows), as
  // every put target is declared alike on every rank.
  counts.counts[0 * 8 + 5] = 3;
  ASSERT_EQ(choose_lends(c, contiguous(c), counts), (std::vector<ExpertPlacement::Lend>{{2, 1}}));
  const Machine m = parse_machine("cpu:2:32x64");
  for (const Pass pass : {Pass::forward, Pass::backward}) {
    const auto programs = compile_checked(c, contiguous(c), counts, m, pass, Policy::critical_path);
    ASSERT_NE(programs[0].buffer(BufferId::lent_w), nullptr);
    EXPECT_EQ(programs[0].buffer(BufferId::lent_w)->rows, 0);
    EXPECT_EQ(programs[1].buffer(BufferId::lent_w)->rows, 2);
  }
}

TEST(Lend, ProgramsAreProvedWholeAndPerRankInEveryExchange) {
  const Machine m = parse_machine("cpu:2:32x64");
  for (const ExchangeMode mode : {ExchangeMode::assignment, ExchangeMode::rank}) {
    for (const std::int64_t per_node : {0, 2}) {
      LayerConfig c = lend_layer(4, 96, mode);
      if (per_node > 0 && mode == ExchangeMode::assignment) continue;
      c.ranks_per_node = per_node;
      const auto counts = rank_counts(c, contiguous(c), "zipf:1.5", m.tile_rows);
      const Exchange ex(c, contiguous(c), counts, m.tile_rows);
      const auto lent = static_cast<std::int64_t>(ex.placement().lends().size());
      ASSERT_GT(lent, 0) << "the case must lend";
      for (const Pass pass : {Pass::forward, Pass::backward}) {
        const auto programs = compile_checked(c, contiguous(c), counts, m, pass, Policy::critical_path);
        std::int64_t puts = 0, bytes = 0;
        for (const auto& p : programs)
          for (const auto& t : p.tasks)
            if (t.kind == TaskKind::weight_put || t.kind == TaskKind::grad_weight_put) {
              ++puts;
              bytes += t.cols;
              EXPECT_NE(t.peer, p.rank) << "a rank is never lent its own expert";
            }
        const Dims d{c.hidden, c.expert_inter, 0, c.routed_experts, c.top_k, c.tokens_per_rank, 4};
        EXPECT_EQ(bytes, lent * lent_block_bytes(d, pass)) << "each lent expert's block, whole, once";
        EXPECT_GE(puts, lent * 2) << "two weights a block";
      }
    }
  }
}

TEST(Lend, MutationsOfTheLentWeightsAreRejected) {
  const LayerConfig c = lend_layer(2, 120);
  const Machine m = parse_machine("cpu:2:32x64");
  const auto placement = contiguous(c);
  const auto counts = rank_counts(c, placement, "zipf:1.5", m.tile_rows);
  ASSERT_FALSE(Exchange(c, placement, counts, m.tile_rows).placement().lends().empty());
  const auto forward = compile(c, placement, counts, m, Pass::forward, Policy::critical_path);
  expect_ok(forward);
  const auto backward = compile(c, placement, counts, m, Pass::backward, Policy::critical_path);
  expect_ok(backward);
  const auto rejected = [&](const std::vector<Program>& programs, const char* what) {
    expect_rejected(programs, c, placement, counts, m, what);
  };
  const PutMutation puts[] = {
      {Pass::forward, 0, TaskKind::weight_put, [](Task& t, const Program&) { t.cols -= 64; },
       "a weight piece 64 bytes short: the GEMM reads lent weights nothing wrote"},
      {Pass::forward, 0, TaskKind::weight_put, [](Task& t, const Program&) { t.col_begin += 64; },
       "a weight piece written 64 bytes along, over the next region"},
      {Pass::forward, 0, TaskKind::weight_put, next_event, "a weight piece that signals another event than its block's"},
      {Pass::forward, 0, TaskKind::weight_put, [](Task& t, const Program&) { t.row_begin += 1; },
       "a weight piece into the backward's row of the block"},
      {Pass::backward, 0, TaskKind::grad_weight_put, [](Task& t, const Program&) { t.cols -= 64; },
       "a transposed weight piece short: the data gradient reads unwritten weights"},
  };
  // Not every case has rank 0 lending; mutate the rank that does.
  for (const auto& mu : puts) {
    auto programs = mu.pass == Pass::forward ? forward : backward;
    bool done = false;
    for (auto& p : programs)
      for (auto& t : p.tasks)
        if (!done && t.kind == mu.kind && t.peer != p.rank) {
          mu.change(t, p);
          done = true;
        }
    ASSERT_TRUE(done) << mu.what;
    rejected(programs, mu.what);
  }
  const auto with_relay = [&](const std::vector<Program>& set, TaskKind relay) -> std::pair<std::size_t, std::int32_t> {
    for (std::size_t r = 0; r < set.size(); ++r)
      if (const std::int32_t id = first_task(set[r], relay); id >= 0) return {r, id};
    ADD_FAILURE() << "no " << name(relay);
    return {0, 0};
  };
  {
    auto programs = forward;
    const auto [r, id] = with_relay(programs, TaskKind::weight_relay);
    programs[r].tasks[static_cast<std::size_t>(id)].wait_event = -1;
    programs[r].tasks[static_cast<std::size_t>(id)].wait_count = 0;
    rejected(programs, "a relay that does not wait for the weights: the GEMM may read them before they land");
  }
  {
    auto programs = forward;
    const auto [r, id] = with_relay(programs, TaskKind::weight_relay);
    programs[r].tasks[static_cast<std::size_t>(id)].wait_count -= 1;
    rejected(programs, "a relay that passes on the block one piece early");
  }
  {
    auto programs = backward;
    const auto [r, id] = with_relay(programs, TaskKind::grad_weight_relay);
    programs[r].tasks[static_cast<std::size_t>(id)].trigger_event += 1;
    rejected(programs, "a backward relay that counts towards the next tile instead of its own");
  }
  {
    // The lent slot's GEMMs wait for one arrival fewer: before the relay.
    auto programs = forward;
    const auto [r, id] = with_relay(programs, TaskKind::weight_relay);
    auto& p = programs[r];
    const std::int32_t ev = p.tasks[static_cast<std::size_t>(id)].trigger_event;
    p.events[static_cast<std::size_t>(ev)].required -= 1;
    for (auto& t : p.tasks)
      if (t.wait_event == ev) t.wait_count -= 1;
    p.tasks[static_cast<std::size_t>(id)].trigger_event = -1;
    rejected(programs, "a lent slot's tile that does not count the weights among its arrivals");
  }
}

// Found by lending: with the per-node exchange a forwarder may hold none of
// a source's tokens once that source's rows of a hot expert stay home, and
// then only the relay that passes on the source's routes orders the
// forwarder's sums after them; a rank's own proof sees no other chain.
TEST(Lend, TheForwardersSumsWaitForTheRoutesThemselves) {
  // Three ranks a node: with two, every token the forwarder sums is one of
  // its own (a token only one rank of the node takes goes straight), and
  // its own part puts order the routes before its sums anyway.
  LayerConfig c = lend_layer(6, 96, ExchangeMode::rank);
  c.ranks_per_node = 3;
  const Machine m = parse_machine("cpu:2:32x64");
  const auto placement = contiguous(c);
  const auto counts = rank_counts(c, placement, "zipf:1.5", m.tile_rows);
  auto programs = compile_checked(c, placement, counts, m, Pass::forward, Policy::critical_path);
  bool rejected_alone = false;
  for (auto& p : programs)
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::dispatch_node_relay && t.trigger_event >= 0 &&
          p.events[static_cast<std::size_t>(t.trigger_event)].consumer == TaskKind::combine_node_put) {
        const Task kept = t;
        t.wait_event = -1, t.wait_count = 0;
        Verifier verifier;
        rejected_alone |= !verifier.verify_rank(p, c, placement, counts, m).ok;
        t = kept;
      }
  EXPECT_TRUE(rejected_alone) << "some forwarder's sums race its routes without the relay";
}

// Serialized and interleaved bit for bit, the oracle's checks, and the
// forward's output (and, per assignment, dx) bit for bit the layer's
// without lending: a row's arithmetic does not depend on where it runs.
class LendExecution : public ::testing::TestWithParam<std::tuple<DType, ExchangeMode, int, std::string>> {};

TEST_P(LendExecution, IsBitIdenticalAcrossSchedulesAndToTheLayerWithoutLending) {
  const auto [dtype, exchange, ranks, routing] = GetParam();
  LayerConfig c = lend_layer(ranks, 240 / ranks, exchange);
  c.dtype = dtype;
  c.validate();
  const auto w = random_weights(c, 17);
  const auto in = random_inputs(c, 17);
  const auto forced = forced_selection(c, parse_routing_spec(routing, 3));
  const RuntimeOptions serial_opt = serialized_schedule(RuntimeOptions{.workers_per_rank = 2, .backward = true, .pin = false});
  const RuntimeOptions inter_opt{.workers_per_rank = 2, .backward = true, .policy = taskflow::Policy::critical_path, .pin = false};
  InterleavedExecutor serial(c, w, serial_opt), inter(c, w, inter_opt);
  StepResult a, b;
  serial.step(in, forced, a);
  inter.step(in, forced, b);
  ASSERT_GT(b.lent_experts, 0) << "the case must lend";
  EXPECT_GT(b.forward_lent_bytes, 0);
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  const auto ref = reference_layer(c, w, in, oracle_options_of(b));
  for (const auto& cmp : checks_against(ref, b, dtype, 4)) EXPECT_TRUE(cmp.pass) << cmp.tensor << ": rel L2 " << cmp.rel_l2;
  LayerConfig off = c;
  off.lend_weights = 0;
  InterleavedExecutor plain(off, w, inter_opt);
  StepResult o;
  plain.step(in, forced, o);
  EXPECT_EQ(o.lent_experts, 0);
  if (exchange == ExchangeMode::assignment) {
    // Per assignment the combine sums a token's K rows in k order wherever
    // they ran: the same bits. (The per-rank combine sums per rank first,
    // and a lent row is summed on its own rank: rounding differs.)
    EXPECT_TRUE(bit_identical(o.out, b.out)) << "lending moves where rows run, not what they compute";
    EXPECT_TRUE(bit_identical(o.grads.x, b.grads.x));
  }
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out)) << "second step";
  EXPECT_TRUE(bit_identical(a.grads, b.grads)) << "second step";
}

std::string lend_case_name(const ::testing::TestParamInfo<LendExecution::ParamType>& info) {
  const auto& [dtype, exchange, ranks, routing] = info.param;
  return to_string(dtype) + "_" + to_string(exchange) + "_P" + std::to_string(ranks) + "_" + routing.substr(0, routing.find(':'));
}

INSTANTIATE_TEST_SUITE_P(All, LendExecution,
                         ::testing::Values(std::tuple{DType::fp32, ExchangeMode::assignment, 2, std::string("zipf:1.5")},
                                           std::tuple{DType::fp32, ExchangeMode::assignment, 4, std::string("hot:0.3")},
                                           std::tuple{DType::bf16, ExchangeMode::assignment, 3, std::string("zipf:1.5")},
                                           std::tuple{DType::fp32, ExchangeMode::rank, 4, std::string("zipf:1.5")},
                                           std::tuple{DType::bf16, ExchangeMode::rank, 2, std::string("hot:0.3")}),
                         lend_case_name);

// A split expert beside lent homes (found by fuzz/runtime_fuzz.cpp): lent
// homes of lower experts shift the step's instance numbers, and the host
// wrote a split expert's send rows at its parts' places under the
// placement's own numbering, so some rows' assignments were never written
// (ASan: a wild read; without it, rows from whatever memory held). Both
// schedules, and the oracle.
TEST(Lend, BesideASplitExpertTheSplitRowsAreSent) {
  LayerConfig c = config_from_json(nlohmann::json::parse(
      R"({"capacity_factor":1.75,"dtype":"fp32","expert_inter":64,"grad_dispatch_dtype":"bf16","hidden":256,"lend_weights":2,
          "ranks":5,"routed_experts":6,"shared_experts":0,"tokens_per_rank":18,"top_k":2})"));
  c.validate();
  const auto placement = placement_from_json(
      nlohmann::json::parse(R"({"allow_empty_ranks":true,"experts_of_rank":[[5],[0],[4],[2],[4,3,1]],
                                "splits":[{"columns":[0,8,64],"expert":4}]})"),
      c.routed_experts, c.ranks, "test placement");
  const auto w = random_weights(c, 44);
  const auto in = random_inputs(c, 45);
  const auto forced = forced_selection(c, parse_routing_spec("zipf:1.2", 43));
  RuntimeOptions opt{.workers_per_rank = 2, .backward = true, .policy = taskflow::Policy::interleave_wgrad, .pin = false};
  opt.placement = placement;
  InterleavedExecutor serial(c, w, serialized_schedule(opt)), inter(c, w, opt);
  StepResult a, b;
  serial.step(in, forced, a);
  inter.step(in, forced, b);
  ASSERT_GT(b.lent_experts, 0) << "the case must lend";
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  const auto ref = reference_layer(c, w, in, oracle_options_of(b));
  for (const auto& cmp : checks_against(ref, b, DType::bf16, 4)) EXPECT_TRUE(cmp.pass) << cmp.tensor << ": rel L2 " << cmp.rel_l2;
}

// Replicas that fetch their weights from the owner every step (placement
// "fetch_replicas"): the same puts and relays as a lent home's, a replica's
// quota; the results are bit for bit those of replicas that hold their
// weights (the same rows, tiles and sums), every tensor.
namespace {
ExpertPlacement replicas_of(const LayerConfig& c, bool fetch, bool moved_owners = false) {
  nlohmann::json j{{"experts_of_rank", {{0, 1, 2, 3, 8, 9}, {4, 5, 6, 7, 0, 1}, {8, 9, 10, 11, 4}, {12, 13, 14, 15, 8}}},
                   {"replicas", true},
                   {"fetch_replicas", fetch}};
  // Owners that are not their expert's first home: replicas below them
  // (expert 0 owned by rank 1, 8 and 9 by rank 2).
  if (moved_owners) j["owners"] = {1, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  return placement_from_json(j, c.routed_experts, c.ranks, "test placement");
}
}  // namespace

TEST(FetchedReplicas, PlacementFileAndItsRefusals) {
  LayerConfig c = lend_layer(4, 64);
  c.routed_experts = 16;
  const auto fetched = replicas_of(c, true), held = replicas_of(c, false);
  EXPECT_TRUE(fetched.fetches_replicas());
  EXPECT_FALSE(held.fetches_replicas() || held.has_borrowed());
  EXPECT_NE(fetched, held);
  EXPECT_TRUE(fetched.borrows(fetched.instance_on(0, 1))) << "expert 0's replica on rank 1";
  EXPECT_FALSE(fetched.borrows(fetched.instance_on(0, 0))) << "its owner holds it";
  EXPECT_EQ(fetched.lent_count(1), 2);
  EXPECT_EQ(fetched.lent_count(3), 1);
  EXPECT_EQ(placement_from_json(to_json(fetched), 16, 4, "round trip"), fetched);
  // A fetching placement with no replica yet (an online policy's start) writes a file that reads back.
  const nlohmann::json none_yet{{"experts_of_rank", {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}},
                                {"replicas", true}, {"fetch_replicas", true}};
  const auto start = placement_from_json(none_yet, 16, 4, "p.json");
  EXPECT_TRUE(start.fetches_replicas() && !start.has_replicas());
  EXPECT_EQ(placement_from_json(to_json(start), 16, 4, "round trip"), start);
  const auto refused = [&](const nlohmann::json& j) { return error_of([&] { (void)placement_from_json(j, 16, 4, "p.json"); }); };
  EXPECT_NE(refused({{"experts_of_rank", {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}}, {"fetch_replicas", true}})
                .find("fetch_replicas"),
            std::string::npos);
  EXPECT_NE(refused({{"experts_of_rank", {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}}, {"replicas", true},
                     {"fetch_replicas", "yes"}})
                .find("\"fetch_replicas\" must be true or false"),
            std::string::npos);
  EXPECT_NE(refused({{"owner", {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}}, {"fetch_replicas", true}}).find("fetch_replicas"),
            std::string::npos);
  // Owners given: each must be one of its expert's homes; the file round-trips; the borrowed homes follow the owners.
  const auto moved = replicas_of(c, true, true);
  EXPECT_TRUE(moved.has_moved_owners() && !fetched.has_moved_owners());
  EXPECT_EQ(moved.owner(0), 1);
  EXPECT_TRUE(moved.borrows(moved.instance_on(0, 0))) << "expert 0's replica is now on rank 0, below its owner";
  EXPECT_FALSE(moved.borrows(moved.instance_on(0, 1)));
  EXPECT_EQ(placement_from_json(to_json(moved), 16, 4, "round trip"), moved);
  EXPECT_NE(moved, fetched);
  nlohmann::json bad = to_json(moved);
  bad["owners"][5] = 3;  // expert 5 lives on rank 1 only
  EXPECT_NE(refused(bad).find("expert 5's owner is given as rank 3, which is not one of its homes"), std::string::npos);
  bad["owners"] = {0, 1};
  EXPECT_NE(refused(bad).find("\"owners\" must be a list with one rank per expert"), std::string::npos);
  bad["owners"] = "rank 0";
  EXPECT_NE(refused(bad).find("\"owners\""), std::string::npos);
}

TEST(FetchedReplicas, ProgramsAreProvedAndMutationsRejected) {
  const Machine m = parse_machine("cpu:2:32x64");
  for (const ExchangeMode mode : {ExchangeMode::assignment, ExchangeMode::rank}) {
    LayerConfig c = lend_layer(4, 64, mode);
    c.routed_experts = 16;
    c.lend_weights = 0;
    for (const bool moved_owners : {false, true}) {
    const auto placement = replicas_of(c, true, moved_owners);
    const auto counts = rank_counts(c, placement, "hot:0.4", m.tile_rows);
    for (const Pass pass : {Pass::forward, Pass::backward}) {
      const auto programs = compile_checked(c, placement, counts, m, pass, Policy::critical_path);
      std::int64_t puts = 0;
      for (const auto& p : programs)
        for (const auto& t : p.tasks) puts += t.kind == TaskKind::weight_put || t.kind == TaskKind::grad_weight_put;
      EXPECT_GT(puts, 0) << "the replicas with rows fetch their weights";
      if (mode != ExchangeMode::assignment) continue;
      auto mutated = programs;
      for (auto& p : mutated)
        for (auto& t : p.tasks)
          if (t.kind == TaskKind::weight_relay || t.kind == TaskKind::grad_weight_relay) {
            t.wait_event = -1, t.wait_count = 0;
            break;
          }
      expect_rejected(mutated, c, placement, counts, m, "a fetched replica's relay that does not wait for its weights");
    }
    }
  }
}

class FetchedReplicaExecution : public ::testing::TestWithParam<std::tuple<DType, ExchangeMode>> {};

TEST_P(FetchedReplicaExecution, IsBitForBitTheLayerWithHeldReplicas) {
  const auto [dtype, exchange] = GetParam();
  LayerConfig c = lend_layer(4, 60, exchange);
  c.routed_experts = 16;
  c.lend_weights = 0;
  c.dtype = dtype;
  c.validate();
  const auto w = random_weights(c, 23);
  const auto in = random_inputs(c, 23);
  const auto forced = forced_selection(c, parse_routing_spec("hot:0.4", 5));
  StepResult held, fetched, serial, held_moved, fetched_moved, serial_moved;
  for (auto [placement, result, phased] : {std::tuple{replicas_of(c, false), &held, false},
                                           std::tuple{replicas_of(c, true), &fetched, false},
                                           std::tuple{replicas_of(c, true), &serial, true},
                                           std::tuple{replicas_of(c, false, true), &held_moved, false},
                                           std::tuple{replicas_of(c, true, true), &fetched_moved, false},
                                           std::tuple{replicas_of(c, true, true), &serial_moved, true}}) {
    RuntimeOptions opt{.workers_per_rank = 2, .backward = true, .policy = taskflow::Policy::critical_path, .pin = false,
                       .placement = placement};
    InterleavedExecutor ex(c, w, phased ? serialized_schedule(opt) : opt);
    ex.step(in, forced, *result);
  }
  EXPECT_GT(fetched.forward_put_bytes, held.forward_put_bytes) << "the weights travel";
  EXPECT_TRUE(bit_identical(held.out, fetched.out));
  EXPECT_TRUE(bit_identical(held.grads, fetched.grads));
  EXPECT_TRUE(bit_identical(serial.out, fetched.out));
  EXPECT_TRUE(bit_identical(serial.grads, fetched.grads));
  // Owners that are not their experts' first homes (replicas below them):
  // the same bits again (a replicated expert's partials are summed in
  // rank order whichever home owns it), and its weights come from the owner.
  for (const StepResult* r : {&held_moved, &fetched_moved, &serial_moved}) {
    EXPECT_TRUE(bit_identical(held.out, r->out));
    EXPECT_TRUE(bit_identical(held.grads, r->grads));
  }
  EXPECT_GT(fetched_moved.forward_put_bytes, held_moved.forward_put_bytes);
}

INSTANTIATE_TEST_SUITE_P(All, FetchedReplicaExecution,
                         ::testing::Values(std::tuple{DType::fp32, ExchangeMode::assignment}, std::tuple{DType::bf16, ExchangeMode::assignment},
                                           std::tuple{DType::fp32, ExchangeMode::rank}),
                         [](const auto& info) {
                           return to_string(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param));
                         });
