#pragma once
// Shared by the per-rank and per-node exchange tests: a forced routing, its
// counts with the token counts those exchanges need, and the mutation
// corpus's two checks (the whole set and each rank alone).
#include <gtest/gtest.h>

#include <span>
#include <string>
#include <vector>

#include "taskflow_cases.hpp"

namespace hpmoe::testing {

// A layer of the per-node exchange: `ranks` in nodes of `per_node`, 16
// experts top-4.
inline LayerConfig node_layer(std::int64_t ranks, std::int64_t per_node, std::int64_t tokens) {
  LayerConfig c = small(ranks, tokens);
  c.hidden = 256;  // two fp8 scale blocks
  c.routed_experts = 16;
  c.top_k = 4;
  c.exchange = ExchangeMode::rank;
  c.ranks_per_node = per_node;
  c.validate();
  return c;
}

inline RouterOutput<float> routing_of(const LayerConfig& c, const std::string& spec, std::uint64_t seed = 1) {
  const auto ids = forced_selection(c, parse_routing_spec(spec, seed));
  std::vector<float> logits(static_cast<std::size_t>(c.total_tokens() * c.routed_experts), 0.0f);
  return route<float>(c, logits, std::vector<float>(static_cast<std::size_t>(c.routed_experts), 0.0f), ids);
}

// Counts with the per-rank (and per-node) exchange's token counts, for a placement.
inline RoutingCounts rank_counts(const LayerConfig& c, const ExpertPlacement& placement, const std::string& spec,
                                 std::int64_t tile_rows) {
  const auto r = routing_of(c, spec);
  RoutingCounts counts = routing_counts(c, r);
  counts.token_counts = rank_token_counts(c, placement, counts, r, tile_rows);
  return counts;
}

// A corrupted set: the whole-set check and some rank's own check reject it.
inline void expect_rejected(const std::vector<Program>& programs, const LayerConfig& c, const ExpertPlacement& placement,
                            const RoutingCounts& counts, const Machine& m, const char* what) {
  const auto whole = verify(programs);
  EXPECT_FALSE(whole.ok) << what << ": the whole-set check accepted it";
  Verifier verifier;
  std::string alone;
  for (const auto& p : programs)
    if (const auto r = verifier.verify_rank(p, c, placement, counts, m); !r.ok && alone.empty()) alone = r.error;
  EXPECT_NE(alone, "") << what << ": every rank alone accepted it (whole set: " << whole.error << ")";
}

// The mutation corpus's base: a layer's forward and backward programs,
// both proved, on a contiguous placement and uniform routing; and its
// check that a corrupted set is rejected both ways.
struct MutationBase {
  LayerConfig c;
  Machine m = parse_machine("cpu:2:32x64");
  ExpertPlacement placement;
  RoutingCounts counts;
  std::vector<Program> forward, backward;
  explicit MutationBase(const LayerConfig& layer)
      : c(layer), placement(contiguous(layer)), counts(rank_counts(layer, placement, "uniform", m.tile_rows)) {
    forward = compile(c, placement, counts, m, Pass::forward, Policy::critical_path);
    expect_ok(forward);
    backward = compile(c, placement, counts, m, Pass::backward, Policy::critical_path);
    expect_ok(backward);
  }
  void rejected(const std::vector<Program>& programs, const char* what) const {
    expect_rejected(programs, c, placement, counts, m, what);
  }
};

// A program's first task of `kind` that puts to another rank.
inline Task& remote_task(Program& p, TaskKind kind) {
  for (auto& t : p.tasks)
    if (t.kind == kind && t.peer != p.rank) return t;
  ADD_FAILURE() << "no remote " << name(kind);
  return p.tasks.front();
}

// One change to the first remote put of a kind in one rank's program.
struct PutMutation {
  Pass pass;
  int rank;
  TaskKind kind;
  void (*change)(Task&, const Program&);
  const char* what;
};
inline void shorter(Task& t, const Program&) { t.rows -= 1; }
inline void shifted(Task& t, const Program&) { t.row_begin += 1; }
inline void unwaited(Task& t, const Program&) { t.wait_event = -1, t.wait_count = 0; }
inline void next_event(Task& t, const Program&) { t.trigger_event += 1; }

// Each mutation of the forward or backward set, rejected both ways.
template <class Rejected>
void expect_put_mutations_rejected(std::span<const PutMutation> mutations, const std::vector<Program>& forward,
                                   const std::vector<Program>& backward, Rejected&& rejected) {
  for (const auto& m : mutations) {
    auto programs = m.pass == Pass::forward ? forward : backward;
    auto& p = programs[static_cast<std::size_t>(m.rank)];
    m.change(remote_task(p, m.kind), p);
    rejected(programs, m.what);
  }
}

}  // namespace hpmoe::testing
