#include <gtest/gtest.h>

#include <cmath>

#include "hpmoe/error.hpp"
#include "hpmoe/reference.hpp"

using namespace hpmoe;

namespace {
OracleOptions with_backward(std::vector<std::int64_t> tokens = {}) {
  OracleOptions o;
  o.backward = true;
  o.tokens = std::move(tokens);
  return o;
}
}  // namespace

TEST(Oracle, HandComputedTinyLayer) {
  // H 2, I 1, two experts, top-1, softmax, no shared expert, one token.
  LayerConfig c;
  c.hidden = 2;
  c.expert_inter = 1;
  c.routed_experts = 2;
  c.top_k = 1;
  c.tokens_per_rank = 1;
  LayerWeights w;
  w.router = Matrix(2, 2);
  w.router.at(0, 0) = 1;  // logits = [x0, 0] = [1, 0]
  w.expert_bias = {0, 0};
  w.w1 = {Matrix(2, 2), Matrix(2, 2)};
  w.w1[0].at(0, 0) = 1;    // gate = x0
  w.w1[0].at(0, 1) = 0.5;  // up = 0.5 x0 + x1
  w.w1[0].at(1, 1) = 1;
  w.w2 = {Matrix(1, 2), Matrix(1, 2)};
  w.w2[0].at(0, 0) = 2;
  w.w2[0].at(0, 1) = -1;
  LayerInputs in{Matrix(1, 2), Matrix(1, 2)};
  in.x.at(0, 0) = 1;
  in.x.at(0, 1) = 2;
  in.d_out.at(0, 0) = 1;
  in.d_out.at(0, 1) = 3;

  const auto r = reference_layer(c, w, in, with_backward());
  const double g = std::exp(1.0) / (std::exp(1.0) + 1.0);  // gate weight of expert 0
  const double silu1 = 1.0 / (1.0 + std::exp(-1.0));       // silu(1) = 1 * sigmoid(1)
  const double a = silu1 * 2.5;                            // up = 0.5 + 2
  ASSERT_EQ(r.routing.expert[0], 0);
  EXPECT_NEAR(r.routing.weight[0], g, 1e-15);
  EXPECT_NEAR(r.out[0], g * 2 * a, 1e-14);
  EXPECT_NEAR(r.out[1], -g * a, 1e-14);
  // Backward: dy = g * d_out = g [1, 3]; da = dy . W2 row = g (2 - 3) = -g.
  const double da = -g;
  EXPECT_NEAR(r.d_w2[0][0], a * g * 1, 1e-14);
  EXPECT_NEAR(r.d_w2[0][1], a * g * 3, 1e-14);
  const double s = silu1;
  const double d_up = da * silu1;                   // d/d up of silu(gate) * up
  const double d_gate = da * 2.5 * s * (1 + 1 * (1 - s));
  EXPECT_NEAR(r.d_w1[0][0 * 2 + 0], 1 * d_gate, 1e-14);  // x0 * d_gate
  EXPECT_NEAR(r.d_w1[0][1 * 2 + 1], 2 * d_up, 1e-14);    // x1 * d_up
  EXPECT_EQ(r.d_w1[1][0], 0.0);                          // expert 1 untouched
}

namespace {

struct Param {
  const char* name;
  float* value;
};

// Central differences of the oracle's scalar loss against its backward,
// perturbing the float parameters (the actual rounded step is used).
void gradient_check(LayerConfig c, std::uint64_t seed) {
  c.validate();
  LayerWeights w = random_weights(c, seed);
  LayerInputs in = random_inputs(c, seed);
  const auto base = reference_layer(c, w, in, with_backward());
  OracleOptions fixed;
  fixed.forced_ids = base.routing.expert;
  fixed.forced_kept = base.routing.kept;
  auto loss = [&] { return reference_layer(c, w, in, fixed).loss; };

  struct Probe {
    std::string name;
    float* value;
    double analytic;
  };
  std::vector<Probe> probes;
  const std::int64_t H = c.hidden, I = c.expert_inter, E = c.routed_experts;
  for (std::int64_t t : {0L, c.total_tokens() - 1})
    for (std::int64_t i : {0L, H - 1}) probes.push_back({"x", &in.x.at(t, i), base.dx[t * H + i]});
  for (std::int64_t i : {0L, H / 2})
    for (std::int64_t e : {0L, E - 1}) probes.push_back({"router", &w.router.at(i, e), base.d_router[i * E + e]});
  for (std::int64_t e = 0; e < E; e += std::max<std::int64_t>(1, E / 3)) {
    probes.push_back({"w1 gate", &w.w1[e].at(1, 0), base.d_w1[e][1 * 2 * I + 0]});
    probes.push_back({"w1 up", &w.w1[e].at(H - 1, I + 1), base.d_w1[e][(H - 1) * 2 * I + I + 1]});
    probes.push_back({"w2", &w.w2[e].at(I - 1, 2), base.d_w2[e][(I - 1) * H + 2]});
  }
  if (c.shared_experts > 0) {
    const std::int64_t is = c.shared_inter_total();
    probes.push_back({"shared w1", &w.shared_w1.at(2, is), base.d_shared_w1[2 * 2 * is + is]});
    probes.push_back({"shared w2", &w.shared_w2.at(1, 3), base.d_shared_w2[1 * H + 3]});
  }
  for (auto& p : probes) {
    const float original = *p.value;
    const float plus = original + 1e-3f, minus = original - 1e-3f;
    *p.value = plus;
    const double lp = loss();
    *p.value = minus;
    const double lm = loss();
    *p.value = original;
    const double numeric = (lp - lm) / (double(plus) - double(minus));
    EXPECT_NEAR(p.analytic, numeric, 2e-4 * std::max(1.0, std::abs(numeric))) << c.name << " " << p.name;
  }
}

}  // namespace

TEST(OracleGradient, SoftmaxWithSharedExpertsAndBalancingLosses) {
  LayerConfig c = preset("tiny");
  c.aux_loss_coef = 0.05;
  c.z_loss_coef = 0.01;
  gradient_check(c, 5);
}

TEST(OracleGradient, SigmoidGroupedBiasedScaled) {
  LayerConfig c = preset("tiny");
  c.name = "v3-like";
  c.scoring = Scoring::sigmoid;
  c.groups = 4;
  c.groups_kept = 2;
  c.expert_bias = true;
  c.route_scale = 2.5;
  c.normalize_topk = true;
  c.aux_loss_coef = 0.01;
  gradient_check(c, 6);
}

TEST(OracleGradient, CapacityDroppingUnnormalised) {
  LayerConfig c = preset("tiny");
  c.name = "capacity";
  c.normalize_topk = false;
  c.capacity_factor = 0.6;
  c.shared_experts = 0;
  gradient_check(c, 7);
}

TEST(Oracle, SampledTokensMatchFullRun) {
  LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 2);
  const auto in = random_inputs(c, 2);
  const auto full = reference_layer(c, w, in, with_backward());
  const auto part = reference_layer(c, w, in, with_backward({3, 30}));
  for (std::int64_t i = 0; i < c.hidden; ++i) {
    EXPECT_DOUBLE_EQ(part.out[i], full.out[3 * c.hidden + i]);
    EXPECT_DOUBLE_EQ(part.dx[c.hidden + i], full.dx[30 * c.hidden + i]);
  }
  EXPECT_TRUE(part.d_w1.empty());
}

TEST(Oracle, CountsTokensItsOwnRouterWouldRouteDifferently) {
  LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 3);
  const auto in = random_inputs(c, 3);
  const auto own = reference_layer(c, w, in);
  OracleOptions same;
  same.forced_ids = own.routing.expert;
  same.count_own_choice_differences = true;
  EXPECT_EQ(reference_layer(c, w, in, same).own_choice_differences, 0);
  const auto uniform = forced_selection(c, parse_routing_spec("uniform", 1));
  OracleOptions other = same;
  other.forced_ids = uniform;
  EXPECT_GT(reference_layer(c, w, in, other).own_choice_differences, c.total_tokens() / 2);
}

namespace {
Matrix64 widened(const Matrix& m) {
  Matrix64 d(m.rows, m.cols);
  std::copy(m.data.begin(), m.data.end(), d.data.begin());
  return d;
}
}  // namespace

// The float64 entry point runs the same loops: on fp32 values widened to
// double it gives the fp32 entry point's results exactly.
TEST(Oracle, Float64InputsGiveTheSameResultsOnWidenedValues) {
  LayerConfig c = preset("tiny");
  c.aux_loss_coef = 0.05;
  c.scoring = Scoring::sigmoid;
  c.expert_bias = true;
  const auto w = random_weights(c, 9);
  const auto in = random_inputs(c, 9);
  LayerWeights64 w64{widened(w.router), w.expert_bias, {}, {}, widened(w.shared_w1), widened(w.shared_w2)};
  for (std::int64_t e = 0; e < c.routed_experts; ++e) {
    w64.w1.push_back(widened(w.w1[e]));
    w64.w2.push_back(widened(w.w2[e]));
  }
  const LayerInputs64 in64{widened(in.x), widened(in.d_out)};
  const auto a = reference_layer(c, w, in, with_backward());
  const auto b = reference_layer(c, w64, in64, with_backward());
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.d_router, b.d_router);
  EXPECT_EQ(a.d_w1, b.d_w1);
  EXPECT_EQ(a.d_shared_w2, b.d_shared_w2);
  EXPECT_EQ(a.loss, b.loss);

  LayerWeights64 missing = w64;
  missing.w2[3] = Matrix64(1, 1);
  EXPECT_THROW(reference_layer(c, missing, in64), Error);
}
