#include "runtime/step_plan.hpp"

#include <chrono>
#include <string>

#include "hpmoe/error.hpp"
#include "ops/access.hpp"

namespace hpmoe::detail {

namespace {

PutBytes put_bytes_to_others(const std::vector<taskflow::Program>& set, std::span<const int> ranks, std::int64_t node_ranks) {
  const auto& table = taskflow::AccessTable::standard();
  double bytes = 0, cross = 0, lent = 0;
  for (const int r : ranks) {
    const taskflow::Program& p = set[static_cast<std::size_t>(r)];
    for (const auto& t : p.tasks)
      if (taskflow::is_put(t.kind) && t.peer != p.rank) {
        const double b = table.work(p, t).bytes;
        bytes += b;
        if (t.peer / node_ranks != p.rank / node_ranks) cross += b;
        if (taskflow::role(t.kind).scheme == taskflow::Scheme::lend) lent += b;
      }
  }
  return {static_cast<std::int64_t>(bytes), static_cast<std::int64_t>(cross), static_cast<std::int64_t>(lent)};
}

}  // namespace

void StepPlanner::lay_out(StepPlan& plan, const LayerConfig& c, const ExpertPlacement& placement, std::int64_t tile_rows,
                          const RouterOutput<float>& routing, std::span<const int> hosted) const {
  plan.exchange.emplace(c, placement, plan.counts, tile_rows);
  plan.slots = taskflow::send_slots(c, *plan.exchange, routing, hosted);
}

void StepPlanner::route(StepPlan& plan, const LayerConfig& c, const RouterOutput<float>& routing,
                        std::span<const int> hosted) const {
  const auto n = static_cast<std::size_t>(c.tokens_per_rank * c.top_k);
  plan.routes.resize(hosted.size());
  for (std::size_t i = 0; i < hosted.size(); ++i)
    plan.routes[i] = taskflow::rank_routes(c, *plan.exchange, hosted[i], std::span<const std::int64_t>(plan.slots).subspan(i * n, n),
                                           std::span<const std::int32_t>(routing.expert).subspan(i * n, n));
}

StepPlanner::Times StepPlanner::compile(StepPlan& plan, const LayerConfig& c, const taskflow::Machine& machine, taskflow::Pass pass,
                          std::span<const int> compiled, std::span<const int> hosted) {
  auto& programs = plan.programs(pass);
  programs.resize(static_cast<std::size_t>(c.ranks));
  for (const int r : compiled) {
    taskflow::generate(programs[static_cast<std::size_t>(r)], c, *plan.exchange, machine, pass, r);
    taskflow::schedule(programs[static_cast<std::size_t>(r)], opt_.policy, schedule_scratch_);
  }
  if (pass == taskflow::Pass::forward && opt_.after_compile) opt_.after_compile(programs);
  (pass == taskflow::Pass::forward ? plan.forward_bytes : plan.backward_bytes) =
      put_bytes_to_others(programs, hosted, c.node_ranks());
  if (!opt_.verify) return {};
  const auto v0 = std::chrono::steady_clock::now();
  taskflow::VerifyReport report;
  if (opt_.whole_set) {
    report = verifier_.verify(programs);
  } else {
    for (const int r : hosted)
      if (report = verifier_.verify_rank(programs[static_cast<std::size_t>(r)], c, *plan.exchange, machine); !report.ok) break;
  }
  if (!report.ok)
    throw Error(std::string(pass == taskflow::Pass::forward ? "the compiled program" : "the compiled backward program") +
                " failed verification: " + report.error);
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - v0).count()};
}

}  // namespace hpmoe::detail
