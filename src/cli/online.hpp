#pragma once
// Online placement as a policy fed every step's counts (what each rank
// already exchanges): it revises the placement every `every` steps from the
// last `window` steps, and at once after a step that took more than
// 1 + `drift` times what the placement was expected to take (then from that
// step alone: the drift made the older steps stale). Deterministic: every
// rank feeds it the same counts and gets the same revisions, with no round
// of agreement. A caller applies a revision with Layer::set_placement; with
// a fetching start (fetch_replicas) every revision fetches, so a replica that
// appears or moves has nothing to load.
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "cli/plan.hpp"

namespace hpmoe {

class OnlinePlacement {
 public:
  struct Options {
    std::int64_t window = 8;        // steps a revision looks back over
    std::int64_t every = 10;        // steps between scheduled revisions
    std::int64_t max_changes = 16;  // per revision (revise_placement's limit)
    double drift = 0.25;            // 0: no revision out of schedule
    std::int64_t slots_per_rank = 0;  // 0: one more than the start's largest rank
    // Owners may move (their gradient and optimizer state with them). Off
    // where the caller cannot move them (the PyTorch module: a process's
    // parameters and their optimizer state are the framework's): replicas
    // alone follow the load.
    bool relocate = true;
  };
  OnlinePlacement(const LayerConfig&, ExpertPlacement start, ExpertCostModel, Options);

  // After a step: its counts (P x E). The revision to run the next step
  // with, if this step calls for one (a scheduled one, or a drift).
  std::optional<Revision> observe(std::span<const std::int64_t> counts);

  const ExpertPlacement& placement() const { return current_; }
  // The slowest rank's predicted time of the last observed step under the
  // placement it ran with, and what the placement was expected to take.
  double last_step_s() const { return last_s_; }
  double expected_s() const { return expected_s_; }
  std::int64_t steps() const { return steps_; }
  std::int64_t drifts() const { return drifts_; }

 private:
  LayerConfig config_;
  ExpertPlacement current_;
  ExpertCostModel cost_;
  Options options_;
  std::deque<std::vector<std::int64_t>> recent_;  // the last `window` steps' counts (fewer after a drift)
  std::int64_t steps_ = 0, drifts_ = 0;
  double expected_s_ = -1, last_s_ = 0;
};

}  // namespace hpmoe
