#pragma once
// Placement planning, in the library: the per-rank cost model, replicas
// planned from a history of loads, one revision between steps, and the
// online policy that revises as the load moves. A C++ user of the installed
// package plans and revises with these, and applies a placement with
// hpmoe::Layer (Parallel::placement, Layer::set_placement). `hpmoe plan`
// (the command's search with splits and the simulator's check) sits on top.
//
// Online placement (OnlinePlacement) is a policy fed every step's counts
// (what each rank already exchanges): it revises the placement every
// `every` steps from the last `window` steps, and at once after a step that
// took more than 1 + `drift` times what the placement was expected to take
// (then from that step alone: the drift made the older steps stale).
// Deterministic: every rank feeds it the same counts and gets the same
// revisions, with no round of agreement. With a fetching start
// (fetch_replicas) every revision fetches, so a replica that appears or
// moves has nothing to load.
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"

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
  // From a machine model: a name in machines/ (cpu-local, h800, ascend-a3, ...; the installed copies too) or
  // a model file's path; an Error names a model that is not one.
  static ExpertCostModel from_machine(const std::string& machine, const LayerConfig&, bool training,
                                      bool fetched = false);
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

// The exchange scheme the simulator predicts fastest for a layer as it
// runs (its ranks, tokens per rank, dtypes, ranks per node) on a machine
// model (a file, or a name in the installed machines/), under a routing
// ("uniform", "zipf:1.2", ...), forward and, with `backward`, backward:
// what --exchange auto picks (exchange_choice.cpp). The wire dtypes stay
// as given. `why` names the choice and what the other scheme took.
struct ExchangeChoice {
  ExchangeMode exchange = ExchangeMode::assignment;
  std::string why;
};
ExchangeChoice choose_exchange(const LayerConfig&, const std::string& machine = "cpu-local",
                               const std::string& routing = "uniform", bool backward = true);

}  // namespace hpmoe
