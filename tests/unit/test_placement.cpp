// Expert placement as data: the placement type, any permutation of experts
// over ranks giving bit-identical results, and expert counts that do not
// divide the ranks.
#include <gtest/gtest.h>

#include "source_dir.hpp"
#include "bit_identity.hpp"
#include "taskflow_cases.hpp"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "runtime/interleaved.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/placement.hpp"
#include "cli/run.hpp"

using namespace hpmoe;
using hpmoe::testing::bit_identical;

namespace {

using hpmoe::testing::contains;
using hpmoe::testing::error_of;

std::string mixtral_trace() { return "trace:" + std::string(HPMOE_SOURCE_DIR) + "/data/routing/mixtral-8x7b/coding.json:12"; }

// Mixtral-8x7B's router (8 experts, softmax top-2, no shared expert) at a
// size the fp64 oracle checks in a moment.
LayerConfig small_mixtral(std::int64_t ranks, DType dtype) {
  LayerConfig c = preset("mixtral-8x7b");
  c.hidden = 96;
  c.expert_inter = 80;
  c.ranks = ranks;
  c.tokens_per_rank = 37;
  c.dtype = dtype;
  return c;
}

}  // namespace

TEST(Placement, ContiguousSplitsUnevenCountsAndMatchesEOverL) {
  const auto even = ExpertPlacement::contiguous(8, 4);
  for (std::int64_t e = 0; e < 8; ++e) {
    EXPECT_EQ(even.owner(e), e / 2);
    EXPECT_EQ(even.experts_of(e / 2)[static_cast<std::size_t>(e % 2)], e);
    EXPECT_EQ(even.instance_on(e, e / 2), e);  // without replicas instance e is expert e
  }
  const auto uneven = ExpertPlacement::contiguous(8, 3);
  EXPECT_EQ(uneven.local_count(0), 2);
  EXPECT_EQ(uneven.local_count(1), 3);
  EXPECT_EQ(uneven.local_count(2), 3);
  EXPECT_EQ(uneven.max_local_count(), 3);
  std::int64_t placed = 0;
  for (std::int64_t r = 0; r < 3; ++r)
    for (auto e : uneven.experts_of(r)) {
      EXPECT_EQ(uneven.owner(e), r);
      EXPECT_EQ(uneven.home_count(e), 1);
      ++placed;
    }
  EXPECT_EQ(placed, 8);
}

TEST(Placement, RoundRobinAndRandomAreBalancedPermutations) {
  const auto rr = ExpertPlacement::round_robin(10, 4);
  for (std::int64_t e = 0; e < 10; ++e) EXPECT_EQ(rr.owner(e), e % 4);
  const auto a = ExpertPlacement::random(64, 4, 7), b = ExpertPlacement::random(64, 4, 7), c = ExpertPlacement::random(64, 4, 8);
  EXPECT_EQ(a, b);
  EXPECT_FALSE(a == c);
  EXPECT_FALSE(a == ExpertPlacement::contiguous(64, 4));
  for (std::int64_t r = 0; r < 4; ++r) EXPECT_EQ(a.local_count(r), 16);
}

TEST(Placement, RejectsExpertsPlacedNowhereTwiceOrOnMissingRanks) {
  EXPECT_NE(error_of([] { ExpertPlacement::from_rank_lists(4, {{0, 1}, {2}}); }).find("expert 3 is placed on no rank"),
            std::string::npos);
  EXPECT_NE(error_of([] { ExpertPlacement::from_rank_lists(4, {{0, 1, 2}, {2, 3}}); }).find("expert 2 is placed twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { ExpertPlacement::from_rank_lists(4, {{0, 1, 7}, {2, 3}}); }).find("expert 7, which does not exist"),
            std::string::npos);
  const std::vector<std::int64_t> owner{0, 1, 5, 1};
  EXPECT_NE(error_of([&] { ExpertPlacement::from_owners(2, owner); }).find("rank 5, which does not exist"), std::string::npos);
  EXPECT_NE(error_of([] { ExpertPlacement::from_rank_lists(4, {{0, 1, 2, 3}, {}}); }).find("rank 1 has no experts"),
            std::string::npos);
  EXPECT_NO_THROW(ExpertPlacement::from_rank_lists(4, {{0, 1, 2, 3}, {}}, true));  // asked for explicitly
  EXPECT_NE(error_of([] { ExpertPlacement::contiguous(3, 4); }).find("leaves ranks without experts"), std::string::npos);
  EXPECT_NE(error_of([] { ExpertPlacement::contiguous(8, 2).check_fits(8, 4); }).find("8 experts on 2 ranks"),
            std::string::npos);
}

TEST(Placement, JsonNamesTheFieldAndRoundTrips) {
  const auto p = ExpertPlacement::random(12, 3, 3);
  EXPECT_EQ(placement_from_json(to_json(p), 12, 3, "test"), p);
  const auto owner = placement_from_json(nlohmann::json::parse(R"({"owner": [1, 0, 1, 0]})"), 4, 2, "f");
  EXPECT_EQ(owner.owner(0), 1);
  EXPECT_EQ(owner.experts_of(1)[1], 2);
  auto bad = [](const char* text, std::int64_t ranks = 2) {
    return error_of([&] { placement_from_json(nlohmann::json::parse(text), 4, ranks, "f.json"); });
  };
  EXPECT_NE(bad(R"({"experts_of_rank": [[0, 1], [2, 3], []]})").find("has 3 lists, but the layer has 2 ranks"), std::string::npos);
  EXPECT_NE(bad(R"({"owner": [0, 1, 0]})").find("\"owner\" lists 3 experts"), std::string::npos);
  EXPECT_NE(bad(R"({"experts_of_rank": [[0, "1"], [2, 3]]})").find("experts_of_rank[0][1] must be an integer"),
            std::string::npos);
  EXPECT_NE(bad(R"({"experts": [[0, 1], [2, 3]]})").find("unknown key 'experts'"), std::string::npos);
  EXPECT_EQ(bad(R"({"experts_of_rank": [[0, 1], [2, 3]]})"), "");
  EXPECT_EQ(bad(R"({"experts_of_rank": [[0, 1, 2, 3], []], "allow_empty_ranks": true})"), "");
}

// Any permutation of experts over ranks gives the same outputs and
// gradients, bit for bit, in both executors: each expert's rows, tiles and
// arithmetic, and each token's combine order, do not depend on its rank.
class RandomPlacement : public ::testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(RandomPlacement, IsBitIdenticalToContiguous) {
  const auto [dtype, ranks] = GetParam();
  LayerConfig c = preset("tiny");
  c.hidden = 160;
  c.expert_inter = 96;
  c.routed_experts = 12;
  c.dtype = dtype;
  c.ranks = ranks;
  c.tokens_per_rank = 61;
  const auto w = random_weights(c, 41);
  const auto in = random_inputs(c, 41);
  const auto forced = forced_selection(c, parse_routing_spec("zipf:1.1", 4));
  InterleavedExecutor reference(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 2, .backward = true, .pin = false}));
  StepResult expected;
  reference.step(in, forced, expected);
  for (std::uint64_t seed : {1, 2, 3}) {
    const auto placement = ExpertPlacement::random(c.routed_experts, c.ranks, seed);
    InterleavedExecutor serial(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = true, .pin = false, .placement = placement}));
    RuntimeOptions opt;
    opt.workers_per_rank = 2;
    opt.backward = true;
    opt.pin = false;
    opt.placement = placement;
    InterleavedExecutor inter(c, w, opt);
    StepResult a, b;
    serial.step(in, forced, a);
    inter.step(in, forced, b);
    EXPECT_TRUE(bit_identical(expected.out, a.out)) << "serialized, seed " << seed;
    EXPECT_TRUE(bit_identical(expected.grads, a.grads)) << "serialized, seed " << seed;
    EXPECT_TRUE(bit_identical(expected.out, b.out)) << "interleaved, seed " << seed;
    EXPECT_TRUE(bit_identical(expected.grads, b.grads)) << "interleaved, seed " << seed;
    // The programs hold the placement: rank r runs exactly its experts.
    for (std::int64_t r = 0; r < c.ranks; ++r) {
      const auto& program = inter.programs(taskflow::Pass::forward)[static_cast<std::size_t>(r)];
      const auto mine = placement.experts_of(r);
      EXPECT_TRUE(std::equal(program.local_experts.begin(), program.local_experts.end(), mine.begin(), mine.end()));
      for (const auto& t : program.tasks) {
        if (t.kind == taskflow::TaskKind::gemm_gate_up) {
          EXPECT_EQ(placement.owner(t.expert), r);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, RandomPlacement,
                         ::testing::Combine(::testing::Values(DType::fp32, DType::bf16), ::testing::Values(2, 3, 4)),
                         [](const auto& info) {
                           return to_string(std::get<0>(info.param)) + "_P" + std::to_string(std::get<1>(info.param));
                         });

// Mixtral's 8 experts on 3 ranks (2, 3 and 3 experts), on recorded Mixtral
// routing and on its own router: both executors against the fp64 oracle,
// forward and backward, and bit-identical to each other.
TEST(Placement, MixtralEightExpertsOnThreeRanksMatchesTheOracle) {
  for (auto dtype : {DType::fp32, DType::bf16})
    for (const std::string& routing : {mixtral_trace(), std::string("router")})
      for (const char* placement : {"contiguous", "round-robin"}) {
        RunRequest req;
        req.config = small_mixtral(3, dtype);
        req.routing = parse_routing_spec(routing, 5);
        req.placement = parse_placement(placement, 8, 3);
        req.backward = true;
        req.iterations = 1;
        req.warmup = 0;
        req.verify = VerifyMode::full;
        req.pin = false;
        const RunReport r = run_layer(req);
        EXPECT_TRUE(r.verification.pass) << to_string(dtype) << " " << routing << " " << placement;
        for (const auto& check : r.verification.checks)
          EXPECT_TRUE(check.pass) << check.tensor << " rel L2 " << check.rel_l2 << " (" << placement << ")";
        ASSERT_EQ(r.stats.tokens_per_rank.size(), 3u);
        std::int64_t rows = 0;
        for (auto n : r.stats.tokens_per_rank) rows += n;
        EXPECT_EQ(rows, r.stats.assignments - r.stats.dropped);
      }
}

// Placement files with replicas (slot budgets) and tensor-parallel splits.
TEST(PlacementFile, StatesReplicasAndBudgets) {
  using nlohmann::json;
  const auto parse = [](const json& j) { return placement_from_json(j, 4, 2, "p.json"); };
  const auto error = [&](const json& j) {
    try {
      parse(j);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const auto p = parse(json{{"experts_of_rank", {{0, 1, 2}, {2, 3}}}, {"replicas", true}, {"slots_per_rank", 3}});
  EXPECT_EQ(p.home_count(2), 2);
  EXPECT_EQ(p.owner(2), 0);
  EXPECT_EQ(p.instance_on(2, 1), 3);
  EXPECT_EQ(placement_from_json(to_json(p), 4, 2, "round trip"), p);
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 2}, {2, 3}}}}), "set \"replicas\": true")) << error(json{});
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 2}, {2, 3}}}, {"replicas", true}, {"slots_per_rank", 2}}),
                       "rank 0 holds 3 experts, more than its budget of 2 slots (\"slots_per_rank\"): expert 2 past it"));
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 1}, {2, 3}}}, {"replicas", true}}), "lists expert 1 twice"));
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1}, {1, 2}}}, {"replicas", true}}), "expert 3 is placed on no rank"));
  EXPECT_TRUE(contains(error(json{{"owner", {0, 1, 1, 0}}, {"replicas", true}}), "list replicas in"));
  EXPECT_TRUE(contains(error(json{{"owner", {0, 1, 1, 0}}, {"slots_per_rank", 0}}), "positive integer"));
  EXPECT_TRUE(contains(error(json{{"owner", {0, 0, 0, 1}}, {"slots_per_rank", 2}}), "more than its budget of 2"));
}

TEST(PlacementFile, StatesSplitsThatTileTheIntermediateDimension) {
  using nlohmann::json;
  const auto parse = [](const json& j) { return placement_from_json(j, 4, 2, "p.json"); };
  const auto error = [&](const json& j, std::int64_t inter = 0) {
    try {
      parse(j).check_fits(4, 2, inter);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const json ok{{"experts_of_rank", {{0, 1, 2}, {0, 3}}}, {"splits", {{{"expert", 0}, {"columns", {0, 64, 96}}}}}};
  const auto p = parse(ok);
  EXPECT_TRUE(p.has_splits());
  EXPECT_FALSE(p.has_replicas());
  EXPECT_EQ(p.parts(0), 2);
  EXPECT_EQ(p.part_columns(p.instance_on(0, 1), 96), (std::pair<std::int64_t, std::int64_t>{64, 96}));
  EXPECT_EQ(placement_from_json(to_json(p), 4, 2, "round trip"), p);
  EXPECT_EQ(error(ok, 96), "accepted");
  EXPECT_TRUE(contains(error(ok, 128), "does not tile the intermediate dimension")) << error(ok, 128);
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 2}, {0, 3}}}, {"splits", {{{"expert", 0}, {"columns", {0, 96, 64}}}}}}),
                       "must increase"));
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 2}, {0, 3}}}, {"splits", {{{"expert", 0}, {"columns", {8, 64, 96}}}}}}),
                       "must start at 0"));
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 2}, {3}}}, {"splits", {{{"expert", 0}, {"columns", {0, 64, 96}}}}}}),
                       "split into 2 parts but placed on 1 ranks"));
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 2}, {0, 3}}}, {"splits", {{{"expert", 9}, {"columns", {0, 64, 96}}}}}}),
                       "does not exist"));
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 2}, {0, 3}}}, {"splits", {{{"expert", 0}}}}}), "\"columns\""));
  EXPECT_TRUE(contains(error(json{{"experts_of_rank", {{0, 1, 2}, {0, 3}}}, {"splits", 3}}), "\"splits\" must be a list"));
}
