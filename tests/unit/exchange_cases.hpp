#pragma once
// Shared by the per-rank and per-node exchange tests: a forced routing, its
// counts with the token counts those exchanges need, and the mutation
// corpus's two checks (the whole set and each rank alone).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "taskflow_cases.hpp"

namespace hpmoe::testing {

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

// A program's first task of `kind` that puts to another rank.
inline Task& remote_task(Program& p, TaskKind kind) {
  for (auto& t : p.tasks)
    if (t.kind == kind && t.peer != p.rank) return t;
  ADD_FAILURE() << "no remote " << name(kind);
  return p.tasks.front();
}

}  // namespace hpmoe::testing
