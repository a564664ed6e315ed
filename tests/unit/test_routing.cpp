#include <gtest/gtest.h>
#include <algorithm>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

#include "source_dir.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/routing.hpp"

using namespace hpmoe;

namespace {

LayerConfig small(std::int64_t experts, std::int64_t k, std::int64_t tokens, std::int64_t ranks = 1) {
  LayerConfig c;
  c.hidden = 4;
  c.expert_inter = 2;
  c.routed_experts = experts;
  c.top_k = k;
  c.tokens_per_rank = tokens;
  c.ranks = ranks;
  c.validate();
  return c;
}

std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("hpmoe_test_" + name);
  std::ofstream(path) << text;
  return path.string();
}

std::string trace_file() { return std::string(HPMOE_SOURCE_DIR) + "/data/routing/mixtral-8x7b/coding.json"; }

}  // namespace

TEST(Router, SoftmaxTopKByHand) {
  auto c = small(4, 2, 1);
  const std::vector<double> logits = {1.0, 3.0, 2.0, 0.0};
  const auto r = route<double>(c, logits, std::vector<float>(4, 0.0f));
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + std::exp(0.0);
  ASSERT_EQ(r.expert[0], 1);
  ASSERT_EQ(r.expert[1], 2);
  EXPECT_NEAR(r.weight[0], std::exp(3.0) / z, 1e-15);
  EXPECT_NEAR(r.weight[1], std::exp(2.0) / z, 1e-15);
  EXPECT_NEAR(r.lse[0], std::log(z), 1e-15);
  c.normalize_topk = true;
  c.route_scale = 2.0;
  const auto n = route<double>(c, logits, std::vector<float>(4, 0.0f));
  EXPECT_NEAR(n.weight[0], 2.0 * std::exp(3.0) / (std::exp(3.0) + std::exp(2.0)), 1e-15);
  EXPECT_NEAR(n.weight[0] + n.weight[1], 2.0, 1e-15);
}

TEST(Router, SigmoidAndTiesGoToLowerIds) {
  auto c = small(4, 2, 1);
  c.scoring = Scoring::sigmoid;
  const std::vector<double> logits = {0.5, 2.0, 0.5, 0.5};
  const auto r = route<double>(c, logits, std::vector<float>(4, 0.0f));
  EXPECT_EQ(r.expert[0], 1);
  EXPECT_EQ(r.expert[1], 0);  // three-way tie at 0.5: lowest id
  EXPECT_NEAR(r.weight[0], 1.0 / (1.0 + std::exp(-2.0)), 1e-15);
}

TEST(Router, GroupLimitedSelection) {
  // 8 experts in 4 groups of 2, keep 2 groups. The best single expert (id 6,
  // 5.0) sits in group 3; group 0 holds two good experts.
  auto c = small(8, 2, 1);
  c.groups = 4;
  c.groups_kept = 2;
  c.scoring = Scoring::sigmoid;
  const std::vector<double> logits = {3.0, 2.9, -5, -5, 4.0, -5, 5.0, -5};
  const auto r = route<double>(c, logits, std::vector<float>(8, 0.0f));
  // Group scores (best member): g0 3.0, g1 -5, g2 4.0, g3 5.0 -> keep g3, g2.
  EXPECT_EQ(r.expert[0], 6);
  EXPECT_EQ(r.expert[1], 4);
  // With the selection bias, a group scores by its best two members:
  // g0 = s(3)+s(2.9) beats g3 = s(5)+s(-5) and g2 = s(4)+s(-5).
  c.expert_bias = true;
  const auto b = route<double>(c, logits, std::vector<float>(8, 0.0f));
  std::set<int> chosen{b.expert[0], b.expert[1]};
  EXPECT_TRUE(chosen.count(6));
  EXPECT_TRUE(chosen.count(0));
}

TEST(Router, ExpertBiasChangesSelectionNotWeights) {
  auto c = small(4, 1, 1);
  c.expert_bias = true;
  c.scoring = Scoring::sigmoid;
  const std::vector<double> logits = {1.0, 0.9, -1, -1};
  const std::vector<float> bias = {0.0f, 0.5f, 0.0f, 0.0f};
  const auto r = route<double>(c, logits, bias);
  EXPECT_EQ(r.expert[0], 1);
  EXPECT_NEAR(r.weight[0], 1.0 / (1.0 + std::exp(-0.9)), 1e-15);  // unbiased score
}

TEST(Router, CapacityDropsByProbsOrPosition) {
  // 4 tokens, 2 experts, top-1, capacity factor 0.5 -> capacity ceil(0.5*4/2) = 1.
  auto c = small(2, 1, 4);
  c.capacity_factor = 0.5;
  const std::vector<double> logits = {0.1, 0, 0.3, 0, 0.2, 0, 0, 1};  // tokens 0-2 pick expert 0
  auto r = route<double>(c, logits, std::vector<float>(2, 0.0f));
  EXPECT_EQ(r.dropped, 2);
  EXPECT_EQ(std::vector<std::uint8_t>(r.kept.begin(), r.kept.end()), (std::vector<std::uint8_t>{0, 1, 0, 1}));
  EXPECT_EQ(r.weight[0], 0.0);
  c.drop_policy = DropPolicy::position;
  r = route<double>(c, logits, std::vector<float>(2, 0.0f));
  EXPECT_EQ(std::vector<std::uint8_t>(r.kept.begin(), r.kept.end()), (std::vector<std::uint8_t>{1, 0, 0, 1}));
}

TEST(Router, AuxAndZLossByHand) {
  auto c = small(2, 1, 2);
  c.aux_loss_coef = 0.1;
  c.z_loss_coef = 0.01;
  const std::vector<double> logits = {1.0, 0.0, 0.0, 2.0};
  const auto r = route<double>(c, logits, std::vector<float>(2, 0.0f));
  const double p00 = std::exp(1.0) / (std::exp(1.0) + 1), p11 = std::exp(2.0) / (std::exp(2.0) + 1);
  // counts: expert 0 once, expert 1 once; aux = coef * E / (T^2 K) * sum_e c_e sum_t p_te
  const double aux = 0.1 * 2 / 4.0 * (1 * (p00 + (1 - p11)) + 1 * ((1 - p00) + p11));
  EXPECT_NEAR(r.aux_loss, aux, 1e-15);
  const double l0 = std::log(std::exp(1.0) + 1), l1 = std::log(1 + std::exp(2.0));
  EXPECT_NEAR(r.z_loss, 0.01 * (l0 * l0 + l1 * l1) / 2, 1e-15);
}

// The analytic router backward against central differences of
// L = sum_k g_k w_k + aux + z, with the selection held fixed.
class RouterGradient : public ::testing::TestWithParam<std::tuple<Scoring, bool>> {};

TEST_P(RouterGradient, MatchesFiniteDifferences) {
  auto c = small(6, 3, 3, 2);
  c.scoring = std::get<0>(GetParam());
  c.normalize_topk = std::get<1>(GetParam());
  c.route_scale = 1.7;
  c.aux_loss_coef = 0.3;
  c.z_loss_coef = 0.05;
  std::vector<double> logits(static_cast<std::size_t>(c.total_tokens() * 6));
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(1.3 * double(i)) * 2;
  const std::vector<double> g = {0.3, -1.2, 0.7, 0.5, 0.1, -0.4, 1.1, 0.2, -0.3, 0.8, -0.9, 0.6, 0.25, -0.5, 0.45, 0.9, 0.3, -0.2};
  const std::vector<float> bias(6, 0.0f);
  const auto base = route<double>(c, logits, bias);
  auto loss = [&](const std::vector<double>& l) {
    const auto r = route<double>(c, l, bias, base.expert);
    double s = r.aux_loss + r.z_loss;
    for (std::size_t a = 0; a < r.weight.size(); ++a) s += g[a] * r.weight[a];
    return s;
  };
  for (std::int64_t t = 0; t < c.total_tokens(); ++t) {
    std::vector<double> dl(6);
    router_backward_token<double>(c, base, std::span<const double>(logits.data() + t * 6, 6), t,
                                  std::span<const double>(g.data() + t * 3, 3), dl);
    for (int e = 0; e < 6; ++e) {
      auto plus = logits, minus = logits;
      const double h = 1e-6;
      plus[t * 6 + e] += h;
      minus[t * 6 + e] -= h;
      EXPECT_NEAR(dl[e], (loss(plus) - loss(minus)) / (2 * h), 1e-7) << "token " << t << " expert " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, RouterGradient,
                         ::testing::Combine(::testing::Values(Scoring::softmax, Scoring::sigmoid), ::testing::Bool()));

TEST(SyntheticRouting, UniformZipfHotAreDistinctAndSkewed) {
  auto c = small(16, 4, 2000);
  auto stats_of = [&](const std::string& spec) {
    const auto ids = forced_selection(c, parse_routing_spec(spec, 3));
    for (std::int64_t t = 0; t < c.total_tokens(); ++t) {
      std::set<int> s(ids.begin() + t * 4, ids.begin() + t * 4 + 4);
      EXPECT_EQ(s.size(), 4u) << spec << " token " << t;
    }
    std::vector<double> logits(static_cast<std::size_t>(c.total_tokens() * 16), 0.0);
    return routing_stats(c, ExpertPlacement::contiguous(c.routed_experts, c.ranks), route<double>(c, logits, std::vector<float>(16, 0.0f), ids));
  };
  const auto u = stats_of("uniform");
  const auto z = stats_of("zipf:1.2");
  const auto h = stats_of("hot:0.2");
  EXPECT_LT(u.expert_max_over_mean, 1.15);
  EXPECT_GT(z.expert_gini, u.expert_gini + 0.1);
  EXPECT_NEAR(double(*std::max_element(h.tokens_per_expert.begin(), h.tokens_per_expert.end())) / 8000.0, 0.2, 0.02);
  EXPECT_EQ(forced_selection(c, parse_routing_spec("zipf:1.2", 3)), forced_selection(c, parse_routing_spec("zipf:1.2", 3)));
  EXPECT_NE(forced_selection(c, parse_routing_spec("zipf:1.2", 3)), forced_selection(c, parse_routing_spec("zipf:1.2", 4)));
  EXPECT_THROW(forced_selection(c, parse_routing_spec("hot:0.5", 1)), Error);  // > 1/K
}

TEST(SyntheticRouting, GroupedKeepsEachTokenInItsGroupsAndSpreadsThemEvenly) {
  // DeepEP's benchmark routing: 8 groups of 4 experts, each token in 3 of
  // them, 4 distinct experts drawn among their 12.
  auto c = small(32, 4, 4000);
  c.groups = 8;
  c.groups_kept = 3;
  const auto ids = forced_selection(c, parse_routing_spec("grouped", 5));
  std::vector<double> per_expert(32, 0), per_group(8, 0);
  for (std::int64_t t = 0; t < c.total_tokens(); ++t) {
    std::set<int> experts(ids.begin() + t * 4, ids.begin() + t * 4 + 4), groups;
    for (const int e : experts) groups.insert(e / 4);
    EXPECT_EQ(experts.size(), 4u) << "token " << t;
    EXPECT_LE(groups.size(), 3u) << "token " << t;
    for (const int e : experts) per_expert[static_cast<std::size_t>(e)] += 1;
  }
  const double mean = 4.0 * double(c.total_tokens()) / 32;
  EXPECT_LT(*std::max_element(per_expert.begin(), per_expert.end()) / mean, 1.1);
  EXPECT_GT(*std::min_element(per_expert.begin(), per_expert.end()) / mean, 0.9);
  EXPECT_EQ(ids, forced_selection(c, parse_routing_spec("grouped", 5)));
  c.groups = 1;  // a layer without groups: said, not drawn as uniform in silence
  try {
    forced_selection(c, parse_routing_spec("grouped", 5));
    ADD_FAILURE() << "a layer without groups took routing 'grouped'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use 'uniform'"), std::string::npos) << e.what();
  }
}

TEST(TraceRouting, ReplaysMixtralTraceAndRejectsMisfits) {
  auto c = small(8, 2, 100, 2);
  const auto ids = forced_selection(c, parse_routing_spec("trace:" + trace_file() + ":3", 1));
  ASSERT_EQ(ids.size(), 400u);
  std::int64_t tokens = 0;
  const auto raw = load_trace(trace_file(), "3", 2, 8, &tokens);
  EXPECT_GT(tokens, 10000);
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), raw.begin()));
  // Step k replays the trace's k-th window of 200 tokens, wrapping at its end.
  auto spec = parse_routing_spec("trace:" + trace_file() + ":3", 1);
  spec.step = 2;
  const auto later = forced_selection(c, spec);
  EXPECT_TRUE(std::equal(later.begin(), later.end(), raw.begin() + 2 * 400));
  spec.step = static_cast<std::uint64_t>(tokens);  // k * 200 tokens past a multiple of the trace's length
  const auto wrapped = forced_selection(c, spec);
  for (std::int64_t t = 0; t < 200; ++t)
    for (std::int64_t j = 0; j < 2; ++j)
      ASSERT_EQ(wrapped[static_cast<std::size_t>(t * 2 + j)], raw[static_cast<std::size_t>(((tokens * 200 + t) % tokens) * 2 + j)]);
  EXPECT_THROW(load_trace(trace_file(), "3", 3, 8), Error);     // width differs from top_k
  EXPECT_THROW(load_trace(trace_file(), "3", 2, 4), Error);     // ids beyond the experts
  EXPECT_THROW(load_trace(trace_file(), "99", 2, 8), Error);    // no such layer
  EXPECT_THROW(load_trace("/nonexistent.json", "0", 2, 8), Error);
  EXPECT_THROW(load_trace(write_temp("t1.json", "{\"0\": [[1, 2], [3]"), "0", 2, 8), Error);
  EXPECT_THROW(load_trace(write_temp("t2.json", "{\"0\": [[1, 1]]}"), "0", 2, 8), Error);
  EXPECT_THROW(load_trace(write_temp("t3.json", "{\"0\": [[1, \"a\"]]}"), "0", 2, 8), Error);
  EXPECT_THROW(load_trace(write_temp("t4.json", "{\"0\": []}"), "0", 2, 8), Error);
  EXPECT_THROW(parse_routing_spec("zipf:x", 1), Error);
  EXPECT_THROW(parse_routing_spec("random", 1), Error);
  EXPECT_THROW(parse_routing_spec("hot:2", 1), Error);
}

TEST(RoutingStats, GiniAndMaxOverMean) {
  auto c = small(4, 1, 4);
  std::vector<double> logits(16, 0.0);
  const std::vector<std::int32_t> balanced = {0, 1, 2, 3}, skewed = {0, 0, 0, 0};
  const auto b = routing_stats(c, ExpertPlacement::contiguous(c.routed_experts, c.ranks), route<double>(c, logits, std::vector<float>(4, 0.0f), balanced));
  EXPECT_DOUBLE_EQ(b.expert_gini, 0.0);
  EXPECT_DOUBLE_EQ(b.expert_max_over_mean, 1.0);
  const auto s = routing_stats(c, ExpertPlacement::contiguous(c.routed_experts, c.ranks), route<double>(c, logits, std::vector<float>(4, 0.0f), skewed));
  EXPECT_DOUBLE_EQ(s.expert_gini, 0.75);
  EXPECT_DOUBLE_EQ(s.expert_max_over_mean, 4.0);
}

TEST(ExpertBias, MovesTowardsBalance) {
  std::vector<float> bias(3, 0.0f);
  const std::vector<std::int64_t> load = {10, 5, 0};
  update_expert_bias(bias, load, 0.1);
  EXPECT_FLOAT_EQ(bias[0], -0.1f);
  EXPECT_FLOAT_EQ(bias[1], 0.0f);
  EXPECT_FLOAT_EQ(bias[2], 0.1f);
}

// The force-balanced ideal: every (rank, expert) count equal when T K is a
// multiple of E, each token's choices distinct.
TEST(Routing, BalancedGivesEveryRankAndExpertTheSameCount) {
  LayerConfig c = preset("tiny");
  c.ranks = 3;
  c.tokens_per_rank = 12;  // 12 x 2 = 24 = 3 x 8
  const auto ids = forced_selection(c, parse_routing_spec("balanced", 1));
  std::vector<std::int64_t> count(static_cast<std::size_t>(c.ranks * c.routed_experts), 0);
  for (std::int64_t t = 0; t < c.total_tokens(); ++t) {
    EXPECT_NE(ids[static_cast<std::size_t>(t * 2)], ids[static_cast<std::size_t>(t * 2 + 1)]);
    for (std::int64_t j = 0; j < 2; ++j)
      ++count[static_cast<std::size_t>((t / c.tokens_per_rank) * c.routed_experts + ids[static_cast<std::size_t>(t * 2 + j)])];
  }
  for (const auto n : count) EXPECT_EQ(n, 3);
  EXPECT_EQ(parse_routing_spec("balanced", 1).describe(), "balanced");
}

// Steps of one synthetic routing: the same hot experts, other draws.
TEST(Routing, LaterStepsKeepThePopularityAndDrawAgain) {
  LayerConfig c = preset("tiny");
  c.ranks = 2;
  c.tokens_per_rank = 2000;
  c.routed_experts = 32;
  auto spec = parse_routing_spec("zipf:1.4", 5);
  const auto first = forced_selection(c, spec);
  spec.step = 3;
  const auto later = forced_selection(c, spec);
  EXPECT_NE(first, later);
  const auto hottest = [&](const std::vector<std::int32_t>& ids) {
    std::vector<std::int64_t> n(32, 0);
    for (const auto e : ids) ++n[static_cast<std::size_t>(e)];
    return std::max_element(n.begin(), n.end()) - n.begin();
  };
  EXPECT_EQ(hottest(first), hottest(later));
  spec.step = 0;
  EXPECT_EQ(forced_selection(c, spec), first);  // step 0 is the routing as before steps existed
}

// The soak's routing: a new draw every step, of every kind, repeatable, and
// idle ranks' experts (contiguous blocks) really get nothing.
TEST(MixedRouting, ChangesEveryStepCoversEveryKindAndIdlesRanks) {
  LayerConfig c = preset("tiny");
  c.ranks = 4;
  c.routed_experts = 16;
  c.tokens_per_rank = 32;
  c.validate();
  const RoutingSpec mixed = parse_routing_spec("mixed", 3);
  EXPECT_TRUE(mixed.changes_every_step());
  std::set<RoutingSource> kinds;
  bool idle_seen = false;
  for (std::uint64_t step = 0; step < 64; ++step) {
    const RoutingSpec s = mixed.at_step(c, step);
    kinds.insert(s.source);
    RoutingSpec at = mixed;
    at.step = step;
    const auto ids = forced_selection(c, at);
    EXPECT_EQ(ids, forced_selection(c, at));  // repeatable
    ASSERT_EQ(ids.size(), static_cast<std::size_t>(c.total_tokens() * c.top_k));
    for (std::int64_t t = 0; t < c.total_tokens(); ++t)
      EXPECT_NE(ids[static_cast<std::size_t>(t * 2)], ids[static_cast<std::size_t>(t * 2 + 1)]);
    if (s.idle_blocks != 0) {
      idle_seen = true;
      for (const auto e : ids) EXPECT_EQ((s.idle_blocks >> (e / 4)) & 1, 0u) << "step " << step << " expert " << e;
    }
    if (step > 0) {
      RoutingSpec before = mixed;
      before.step = step - 1;
      EXPECT_NE(ids, forced_selection(c, before));
    }
  }
  EXPECT_TRUE(kinds.count(RoutingSource::uniform) && kinds.count(RoutingSource::zipf) && kinds.count(RoutingSource::hot));
  EXPECT_TRUE(idle_seen);
}
