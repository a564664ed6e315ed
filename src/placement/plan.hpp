#pragma once
// `hpmoe plan`'s search (src/placement, beside the public planning
// header): a placement with replicas, and splits where they pay, chosen on a
// cost model taken from a machine model, and its effect predicted by the
// simulator.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <functional>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/planning.hpp"
#include "hpmoe/routing.hpp"
#include "sim/sim.hpp"

namespace hpmoe {

// The cost model of a machine model already read (what from_machine loads).
ExpertCostModel cost_model_of(const sim::MachineModel&, const LayerConfig&, bool training, bool fetched = false);

struct PlanRequest {
  LayerConfig config;
  RoutingSpec routing;
  ExpertPlacement start;          // the placement to improve (empty: contiguous)
  std::string machine = "cpu-local";
  std::int64_t steps = 8;         // routed steps of load history (synthetic: one popularity, new draws each step)
  std::uint64_t seed = 1;
  std::int64_t slots_per_rank = 0;  // 0: one more than the start's largest rank
  bool training = true;           // count replicas' weight refresh and gradient reduction
  bool splits = false;            // also consider tensor-parallel splits of hot experts (in-process runs)
  bool replicas = true;           // consider replicas (off with splits: a static hybrid TP/EP mapping)
  // --exchange auto (the default of hpmoe plan): the exchange scheme the
  // simulator predicts fastest at the start placement, then planned under.
  bool choose_exchange = false;
  // --dispatch-dtype auto: the dispatch's wire dtype chosen with it.
  bool choose_dispatch_dtype = false;
};

struct PlanReport {
  LayerConfig config;
  std::string routing, machine;
  ExpertPlacement before, after;
  std::int64_t steps = 0, replicas = 0, split_parts = 0;  // replicas added; split parts added
  // Means over the history's steps: rank max/mean of rows, and the cost
  // model's slowest rank (seconds).
  double imbalance_before = 0, imbalance_after = 0, cost_before = 0, cost_after = 0;
  // The simulator on a step after the history (the same routing's next
  // draw, which the plan did not see): serialized and interleaved makespans
  // (forward + backward, seconds).
  double sim_serialized_before = 0, sim_interleaved_before = 0, sim_serialized_after = 0, sim_interleaved_after = 0;
  // With replicas and splits both allowed: the simulator's interleaved
  // makespan (history's last step) of the hybrid plan and of the
  // replicas-only plan, of which the faster was kept.
  double sim_hybrid = 0, sim_replicas_only = 0;
  // The fullest rank's memory on that step, before and after (capacity 0:
  // the machine model gives none). Not refused: the start often does not fit.
  sim::MemoryUse memory_before, memory_after;
  std::string exchange_choice;  // --exchange auto: the scheme chosen and why
};

// Greedy (EPLB-like, on the cost model): while a rank has a free slot and a
// replica of some expert on some rank lowers the mean slowest-rank time over
// the history (after each step's quota plan, and net of the replica's own
// cost), add the best such replica (ties of the slowest rank broken by the
// time ranks spend above the mean). With `splits`, a move may instead split
// an unreplicated hot expert into one more even column part on that rank
// (HDA-MoE's hybrid), priced the same way; with both kinds of move allowed,
// the search runs with and without splits and the simulator keeps the
// faster plan.
// Progress lines for long plans (a history of thousands of steps, EP 256):
// phases, and per step or per change a line the caller may thin out.
using PlanProgress = std::function<void(const std::string&)>;
PlanReport plan_placement(const PlanRequest&, const PlanProgress& progress = {});
std::string format_report(const PlanReport&);
nlohmann::json to_json(const PlanReport&);

}  // namespace hpmoe
