#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"

namespace hpmoe {

// Where the expert choices of a step come from. `router` is the real
// top-k; the others replace only the choice of experts (the gate weights still
// come from the router's scores, so backward stays meaningful).
// balanced: exactly the same count for every (rank, expert) where T K is a
// multiple of E (the force-balanced ideal).
// grouped: the group-limited router's shape with random scores (DeepEP's
// benchmark routing): each token draws `groups_kept` of the layer's groups
// uniformly, then top_k distinct experts uniformly among their experts.
enum class RoutingSource { router, uniform, balanced, zipf, hot, trace, mixed, grouped };

struct RoutingSpec {
  RoutingSource source = RoutingSource::router;
  double zipf_exponent = 1.2;
  double hot_share = 0.25;         // share of all assignments that go to hot_expert
  std::int64_t hot_expert = 0;
  std::string trace_path;
  std::string trace_layer = "0";
  // A trace with fewer tokens than a step needs is an error unless the spec
  // asks for it to be repeated (trace:FILE[:LAYER]:repeat).
  bool trace_repeat = false;
  std::uint64_t seed = 1;
  // Steps of one synthetic routing share its popularity (which experts are
  // hot, from `seed`) and differ in the draws (step 0: as before steps); a
  // trace's step k reads its k-th window of tokens (wrapping at its end).
  std::uint64_t step = 0;
  // Contiguous blocks of E/P experts (ranks, under the contiguous placement)
  // that get no tokens: bit r for block r (blocks past 63 always get some).
  std::uint64_t idle_blocks = 0;

  std::string describe() const;
  // "mixed": a new routing every step (the soak's): the step's own kind.
  bool changes_every_step() const { return source == RoutingSource::mixed; }
  // The step's routing of a mixed one: uniform, Zipf (exponent 0.5-2, its
  // hot experts moved), one hot expert (up to 90% of its 1/top_k limit), or
  // idle ranks (the experts of 1 to P-1 random contiguous blocks get no
  // tokens; at least top_k experts stay), drawn from (seed, step).
  RoutingSpec at_step(const LayerConfig&, std::uint64_t step) const;
};

// Parses "router", "uniform", "balanced", "zipf[:S]", "hot[:SHARE]", "trace:FILE[:LAYER]", "mixed".
RoutingSpec parse_routing_spec(const std::string& text, std::uint64_t seed);

// Expert ids [N * K] for a non-router source, or empty for the router.
// Trace tokens are used in order and wrap around when N exceeds the trace.
std::vector<std::int32_t> forced_selection(const LayerConfig&, const RoutingSpec&);

// Reads one layer of a recorded routing trace ({"layer": [[e0, e1, ...], ...]}).
// Rejects a trace whose width differs from top_k or whose ids do not fit E.
std::vector<std::int32_t> load_trace(const std::string& path, const std::string& layer, std::int64_t top_k,
                                     std::int64_t experts, std::int64_t* trace_tokens = nullptr);
// The same from a trace's text; `source` names it in errors.
std::vector<std::int32_t> parse_trace(const std::string& text, const std::string& source, const std::string& layer,
                                      std::int64_t top_k, std::int64_t experts, std::int64_t* trace_tokens = nullptr);

// The routing of one step for all ranks' tokens (rank r owns tokens
// [r T, (r+1) T)). Real is double in the oracle and float in the fast path;
// both run this same code.
template <class Real>
struct RouterOutput {
  std::int64_t tokens = 0, experts = 0, top_k = 0;
  std::vector<Real> scores;           // [N, E] softmax or sigmoid of the logits
  std::vector<Real> lse;              // [N] log-sum-exp of the logits (z-loss)
  std::vector<std::int32_t> expert;   // [N, K] chosen experts, best first
  std::vector<Real> weight;           // [N, K] gate weights; 0 where dropped
  std::vector<std::uint8_t> kept;     // [N, K] 0 where capacity dropped it
  std::vector<std::int64_t> selected; // [P, E] choices per rank before dropping (aux loss)
  std::int64_t dropped = 0;
  double aux_loss = 0;                // summed over ranks, coefficient applied
  double z_loss = 0;
};

// Scores, selection (group-limited top-k with bias, or `forced` ids),
// weights, capacity and balancing losses. `forced_kept`, when given, replaces
// the capacity decision (the oracle uses the fast path's to avoid near-tie
// flips). logits: [N, E].
template <class Real>
RouterOutput<Real> route(const LayerConfig&, std::span<const Real> logits, std::span<const float> expert_bias,
                         std::span<const std::int32_t> forced = {}, std::span<const std::uint8_t> forced_kept = {});

// Gradient of the loss with respect to token t's logits, given the gradient
// with respect to its K gate weights (zero where dropped); adds the aux-loss
// and z-loss terms. d_logits: [E].
template <class Real>
void router_backward_token(const LayerConfig&, const RouterOutput<Real>&, std::span<const Real> logits_row,
                           std::int64_t t, std::span<const Real> d_weight_row, std::span<Real> d_logits_row);

// DeepSeek-V3's aux-loss-free update: bias += rate * sign(mean load - load).
void update_expert_bias(std::span<float> bias, std::span<const std::int64_t> load, double rate);

struct RoutingStats {
  std::vector<std::int64_t> tokens_per_expert;  // kept assignments, all ranks
  std::vector<std::int64_t> tokens_per_rank;    // rows each rank's experts receive (split parts: times their column share)
  double expert_max_over_mean = 0;
  double rank_max_over_mean = 0;
  double expert_gini = 0;
  std::int64_t dropped = 0;
  std::int64_t assignments = 0;
};

// tokens_per_rank counts rows by the rank that computes them: the owner of
// each expert, or for a replicated one where the quota plan sends them.
template <class Real>
RoutingStats routing_stats(const LayerConfig&, const ExpertPlacement&, const RouterOutput<Real>&);
// The same from the P x E kept counts (what ranks exchange) and the total dropped.
RoutingStats routing_stats(const LayerConfig&, const ExpertPlacement&, std::span<const std::int64_t> counts,
                           std::int64_t dropped);

// The routing of one step for compiling or simulating: synthetic and trace
// routing without the layer's weights; the router itself (random router
// weights and inputs from `seed`) where the inputs fit in memory.
RouterOutput<float> route_step(const LayerConfig&, const RoutingSpec&, std::uint64_t seed);

}  // namespace hpmoe
