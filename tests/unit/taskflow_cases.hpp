// Shared by the compiler's and the verifier's tests: small layers, real
// routing counts, and the checks every compiled set goes through (the whole
// set together, and each rank alone against the exchange's interface).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "compiler/taskflow.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe::testing {

using namespace hpmoe::taskflow;


// Counts of a real routing of the layer (uniform, Zipf or all-to-one).
inline RoutingCounts counts_for(const LayerConfig& c, const std::string& routing, std::uint64_t seed = 1) {
  const auto ids = forced_selection(c, parse_routing_spec(routing, seed));
  std::vector<double> logits(static_cast<std::size_t>(c.total_tokens() * c.routed_experts), 0.0);
  return routing_counts(c, route<double>(c, logits, std::vector<float>(static_cast<std::size_t>(c.routed_experts), 0.0f), ids));
}

inline LayerConfig small(std::int64_t ranks, std::int64_t tokens) {
  LayerConfig c = preset("tiny");
  c.hidden = 160;        // 3 column tiles, the last ragged
  c.expert_inter = 96;   // gate+up 192 = 3 tiles, down K 96
  c.ranks = ranks;
  c.tokens_per_rank = tokens;
  return c;
}

inline ExpertPlacement contiguous(const LayerConfig& c) { return ExpertPlacement::contiguous(c.routed_experts, c.ranks); }

inline void expect_ok(const std::vector<Program>& programs) {
  const auto report = verify(programs);
  EXPECT_TRUE(report.ok) << report.error;
}

// Compiles every rank's program and proves them both ways: the whole set
// together, and each rank alone against the exchange's interface.
inline std::vector<Program> compile_checked(const LayerConfig& c, const ExpertPlacement& placement, const RoutingCounts& counts,
                                     const Machine& m, Pass pass, Policy policy) {
  auto programs = compile(c, placement, counts, m, pass, policy);
  expect_ok(programs);
  Verifier verifier;
  for (const auto& p : programs) {
    const auto report = verifier.verify_rank(p, c, placement, counts, m);
    EXPECT_TRUE(report.ok) << "rank " << p.rank << " alone: " << report.error;
  }
  return programs;
}


inline std::vector<Program> tiny_programs(Pass pass, std::int64_t ranks = 2, const char* machine = "cpu:1") {
  const LayerConfig c = small(ranks, 150);
  return compile(c, contiguous(c), counts_for(c, "uniform"), parse_machine(machine), pass, Policy::fill);
}

// The per-rank check of every rank of a corrupted tiny set (tiny_programs'
// layer and routing): the first rank's error, or "" if every rank passed.
inline std::string per_rank_error(const std::vector<Program>& programs) {
  const LayerConfig c = small(static_cast<std::int64_t>(programs.size()), 150);
  Verifier verifier;
  for (const auto& p : programs) {
    const auto report = verifier.verify_rank(p, c, contiguous(c), counts_for(c, "uniform"), programs[0].machine);
    if (!report.ok) return report.error;
  }
  return "";
}

// The mutation corpus: a corrupted set must be rejected by the full check and
// by some rank's own check.
inline std::string verify_error(const std::vector<Program>& programs) {
  const auto r = verify(programs);
  EXPECT_FALSE(r.ok) << "the corrupted program was accepted";
  EXPECT_NE(per_rank_error(programs), "") << "every rank alone accepted the corrupted set (full check: " << r.error << ")";
  return r.error;
}

inline std::int32_t first_task(const Program& p, TaskKind kind) {
  for (std::size_t i = 0; i < p.tasks.size(); ++i)
    if (p.tasks[i].kind == kind) return static_cast<std::int32_t>(i);
  ADD_FAILURE() << "no " << name(kind) << " task";
  return 0;
}

// The message of the Error f throws ("" if none).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace hpmoe::testing
