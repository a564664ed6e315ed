#pragma once
// A step planned once, then run. The planner turns the layer and how it
// runs (LayerConfig), the step's placement and routing counts into a plan:
// the exchange's layout, each hosted assignment's send row (and, per rank,
// the per-rank exchange's routes), every compiled rank's programs of both
// passes (generated, scheduled and proved before anything runs), and the
// bytes their puts move. The engine (engine.hpp) binds memory to a plan and
// launches it; a plan does not change while its passes run. The counts
// that make a plan (every rank's, and the per-rank exchange's token counts)
// are exchanged by the engine: a plan never talks to peers.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "compiler/layout.hpp"
#include "compiler/taskflow.hpp"
#include "hpmoe/config.hpp"

namespace hpmoe::detail {

// Bytes a pass's puts carry to other ranks: in all, across nodes, and of
// those, lent weights.
struct PutBytes {
  std::int64_t all = 0, cross_node = 0, lent = 0;
};

struct StepPlan {
  taskflow::RoutingCounts counts;             // every rank's P x E counts (and the per-rank exchange's token counts)
  std::optional<taskflow::Exchange> exchange;  // the step's layout: rows, tiles, events
  std::vector<std::int64_t> slots;            // each hosted assignment's send row (-1: dropped)
  std::vector<taskflow::RankRoutes> routes;   // the per-rank exchange: per hosted rank, its token lists and routes
  std::vector<taskflow::Program> forward, backward;  // per rank; the compiled ones filled
  PutBytes forward_bytes, backward_bytes;     // the hosted ranks' puts

  const taskflow::Exchange& ex() const { return *exchange; }
  // The step's placement: the layer's, with the homes this step lends.
  const ExpertPlacement& placement() const { return exchange->placement(); }
  std::vector<taskflow::Program>& programs(taskflow::Pass pass) { return pass == taskflow::Pass::forward ? forward : backward; }
};

class StepPlanner {
 public:
  struct Options {
    taskflow::Policy policy = taskflow::Policy::critical_path;
    bool verify = true;
    // The whole set of programs proved together (every rank's compiled
    // here); otherwise each hosted rank's own against the exchange's
    // interface of the counts.
    bool whole_set = true;
    // Fault injection (tests): called with the forward programs before the proof.
    std::function<void(std::vector<taskflow::Program>&)> after_compile;
  };
  explicit StepPlanner(Options options) : opt_(std::move(options)) {}

  // The layout from the counts (plan.counts, every rank's): the exchange,
  // and the send row of each of the hosted ranks' assignments.
  void lay_out(StepPlan& plan, const LayerConfig& c, const ExpertPlacement& placement, std::int64_t tile_rows,
               const RouterOutput<float>& routing, std::span<const int> hosted) const;
  // The per-rank exchange's routes of each hosted rank, from the layout,
  // before its token counts are exchanged.
  void route(StepPlan& plan, const LayerConfig& c, const RouterOutput<float>& routing, std::span<const int> hosted) const;
  // The programs of a pass for `compiled` ranks, scheduled, the hosted
  // ranks' put bytes counted, and the set proved; Error when the proof
  // fails. Returns the proof's share of the time.
  struct Times {
    double verify_seconds = 0;
  };
  Times compile(StepPlan& plan, const LayerConfig& c, const taskflow::Machine& machine, taskflow::Pass pass,
               std::span<const int> compiled, std::span<const int> hosted);

 private:
  Options opt_;
  taskflow::ScheduleScratch schedule_scratch_;
  taskflow::Verifier verifier_;
};

}  // namespace hpmoe::detail
