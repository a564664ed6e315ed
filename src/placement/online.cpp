// Online placement: revisions on a schedule and after a drift.
#include "hpmoe/planning.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "hpmoe/error.hpp"

namespace hpmoe {
namespace {

double slowest(const ExpertPlacement& p, std::span<const std::int64_t> counts, const ExpertCostModel& cost) {
  const auto t = rank_seconds(p, counts, cost);
  return t.empty() ? 0.0 : *std::max_element(t.begin(), t.end());
}

}  // namespace

OnlinePlacement::OnlinePlacement(const LayerConfig& c, ExpertPlacement start, ExpertCostModel cost, Options options)
    : config_(c), current_(placement_or_contiguous(std::move(start), c.routed_experts, c.ranks)), cost_(std::move(cost)),
      options_(options) {
  if (options_.window < 1 || options_.every < 1 || options_.max_changes < 0 || !(options_.drift >= 0) ||
      !std::isfinite(options_.drift))
    throw Error("online placement: the window and the revision interval must be at least 1 step, the change limit and "
                "the drift threshold not negative");
  if (options_.slots_per_rank == 0) options_.slots_per_rank = current_.max_local_count() + 1;
  if (options_.slots_per_rank < current_.max_local_count())
    throw Error("online placement: a budget of " + std::to_string(options_.slots_per_rank) + " slots is below the " +
                std::to_string(current_.max_local_count()) + " experts the start puts on one rank");
}

std::optional<Revision> OnlinePlacement::observe(std::span<const std::int64_t> counts) {
  if (static_cast<std::int64_t>(counts.size()) != config_.ranks * config_.routed_experts)
    throw Error("online placement: a step's counts are ranks x experts = " + std::to_string(config_.ranks * config_.routed_experts) +
                " values, got " + std::to_string(counts.size()));
  ++steps_;
  last_s_ = slowest(current_, counts, cost_);
  const bool drifted = options_.drift > 0 && expected_s_ > 0 && last_s_ > (1 + options_.drift) * expected_s_;
  if (drifted) {
    ++drifts_;
    recent_.clear();  // the older steps describe routing that no longer holds
  }
  recent_.emplace_back(counts.begin(), counts.end());
  while (static_cast<std::int64_t>(recent_.size()) > options_.window) recent_.pop_front();
  const bool scheduled = steps_ % options_.every == 0;
  if (!drifted && !scheduled) {
    if (expected_s_ < 0) expected_s_ = last_s_;  // before the first revision: what the start gave the first step
    return std::nullopt;
  }
  // Only a revision needs the window as a contiguous history.
  const std::vector<std::vector<std::int64_t>> window(recent_.begin(), recent_.end());
  Revision r = revise_placement(config_, current_, window, cost_, options_.slots_per_rank, options_.max_changes,
                                double(options_.every), options_.relocate);
  current_ = r.placement;
  double sum = 0;
  for (const auto& step : window) sum += slowest(current_, step, cost_);
  expected_s_ = sum / double(window.size());
  return r;
}

}  // namespace hpmoe
