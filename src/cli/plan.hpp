#pragma once
// `hpmoe plan`: a placement with replicas from load statistics, chosen on a
// cost model taken from a machine model, and its predicted effect.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <functional>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/routing.hpp"
#include "sim/sim.hpp"

namespace hpmoe {

// The time a rank spends on its experts in one step (TEMPO's max-affine
// shape): an instance of N rows costs its first row tile at the rate with
// weights streamed from memory and every further tile at the reused rate,
// the last tile at its true (short) rows, so weight streaming dominates
// small batches; a rank's time is the sum over its instances. In training a replica
// also costs its rank the refresh of its weights from the owner and the
// reduction of its gradient into the owner's, over the link between them.
// A part of a tensor-parallel split expert costs its share of the columns
// of the whole expert's time on all of its rows (its weights are a share
// too), plus the link time of the rows it receives and returns beyond the
// first part's (dispatch and partial return, and in training their
// gradients); it needs no weight refresh or gradient reduction.
struct ExpertCostModel {
  std::int64_t tile_rows = 64;
  double first_tile_s = 0, tile_s = 0;  // forward + backward GEMMs of one full row tile of an expert, on a rank's units
  // The same for a tile of r rows ([r], r = 0..tile_rows): a short tile
  // (the last of an instance, or a quota that ends mid-tile) costs its true
  // time, affine in its rows at a fixed weight panel (the machine model's
  // interpolation), not a whole tile's.
  std::vector<double> first_tile_rows_s, tile_rows_s;
  double replica_s = 0;                 // per replica per step (training), 0 for inference
  double part_row_s = 0;                // per row of each split part beyond the first: its extra link traffic
  double move_s = 0;                    // once, to give a rank a new home of an expert: its weights over the link
  double weight_bytes = 0;              // an expert's weights in the layer's dtype (what a new home receives)
  double owner_bytes = 0;               // what a moved owner takes along: its weights, fp32 master and Adam's two moments
  // Replicas fetch their weights from the owner every step (a placement's
  // fetch_replicas): replica_s then pays the weights of every pass each step
  // (in training the forward's and the backward's layouts, and the gradient
  // reduction), and a new home costs nothing at the revision.
  bool fetched = false;
  static ExpertCostModel from(const sim::MachineModel&, const LayerConfig&, bool training, bool fetched = false);
  double instance_seconds(std::int64_t rows) const;
};

// Each rank's predicted time in one step under a placement (the step's quota
// plan decides where replicated experts' rows run).
std::vector<double> rank_seconds(const ExpertPlacement&, std::span<const std::int64_t> counts, const ExpertCostModel&);

// A revision of a placement: what it changed and the weight bytes the new
// homes take over the link.
struct Revision {
  ExpertPlacement placement;
  std::int64_t added = 0, dropped = 0, moved = 0, relocated = 0;  // relocated: an owner moved, optimizer state and all
  double bytes_moved = 0;
};

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
};

// Replicas for a layer from a history of steps' counts (each P x E): the
// better on the cost model of the greedy from `start` and the greedy from
// EPLB's construction, each refined by up to 64 adds, drops or moves of
// replicas (plan_placement's search with replicas only).
ExpertPlacement plan_replicas(const LayerConfig&, const ExpertPlacement& start,
                              std::span<const std::vector<std::int64_t>> history, const ExpertCostModel&,
                              std::int64_t slots_per_rank);

// Online placement: one revision between steps, from a sliding window of
// recent steps' counts. At most `max_changes` changes, each the best that
// lowers the window's mean slowest-rank time: a replica added in a free
// slot, dropped, or handed over to another expert on the same rank, or an
// expert relocated from a loaded rank to a free slot. A new home costs its
// weights' bytes over the link once, and a moved owner its fp32 master and
// Adam moments too, spread over `horizon` steps (how long the revision is
// expected to hold). Without `relocate` no owner moves (the gradient and the
// optimizer state stay where they are: only replicas are added, dropped or
// handed over). A fetching placement's revision fetches too. A pure function of its
// arguments: every rank computes the same revision from the same counts,
// with no round of agreement.
Revision revise_placement(const LayerConfig&, const ExpertPlacement& current,
                          std::span<const std::vector<std::int64_t>> window, const ExpertCostModel&,
                          std::int64_t slots_per_rank, std::int64_t max_changes, double horizon,
                          bool relocate = true);

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
