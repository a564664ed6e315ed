#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "hpmoe/error.hpp"
#include "hpmoe/taskflow.hpp"

using namespace hpmoe;
using namespace hpmoe::taskflow;

namespace {

// Counts of a real routing of the layer (uniform, Zipf or all-to-one).
RoutingCounts counts_for(const LayerConfig& c, const std::string& routing, std::uint64_t seed = 1) {
  const auto ids = forced_selection(c, parse_routing_spec(routing, seed));
  std::vector<double> logits(static_cast<std::size_t>(c.total_tokens() * c.routed_experts), 0.0);
  return routing_counts(c, route<double>(c, logits, std::vector<float>(static_cast<std::size_t>(c.routed_experts), 0.0f), ids));
}

LayerConfig small(std::int64_t ranks, std::int64_t tokens) {
  LayerConfig c = preset("tiny");
  c.hidden = 160;        // 3 column tiles, the last ragged
  c.expert_inter = 96;   // gate+up 192 = 3 tiles, down K 96
  c.ranks = ranks;
  c.tokens_per_rank = tokens;
  return c;
}

void expect_ok(const std::vector<Program>& programs) {
  const auto report = verify(programs);
  EXPECT_TRUE(report.ok) << report.error;
}

}  // namespace

class CompileAll : public ::testing::TestWithParam<std::tuple<Pass, Policy, int, std::string>> {};

TEST_P(CompileAll, VerifiesForEveryPolicyPassAndLayout) {
  const auto [pass, policy, ranks, machine] = GetParam();
  for (const char* routing : {"uniform", "zipf:2.5"}) {
    const LayerConfig c = small(ranks, 150);
    const auto programs = compile(c, counts_for(c, routing), parse_machine(machine), pass, policy);
    ASSERT_EQ(programs.size(), static_cast<std::size_t>(ranks));
    expect_ok(programs);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, CompileAll,
    ::testing::Combine(::testing::Values(Pass::forward, Pass::backward),
                       ::testing::Values(Policy::fill, Policy::rank_rotated, Policy::critical_path, Policy::interleave_wgrad),
                       ::testing::Values(1, 2, 4), ::testing::Values("cpu:1", "cpu:2", "accel:2:3")),
    [](const auto& info) {
      std::string m = std::get<3>(info.param);
      for (auto& ch : m)
        if (ch == ':') ch = '_';
      std::string p = name(std::get<1>(info.param));
      for (auto& ch : p)
        if (ch == '-') ch = '_';
      return std::string(std::get<0>(info.param) == Pass::forward ? "fwd" : "bwd") + "_" + p + "_P" +
             std::to_string(std::get<2>(info.param)) + "_" + m;
    });
