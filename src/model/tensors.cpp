#include "hpmoe/tensors.hpp"

#include <cmath>
#include <string>

#include "hpmoe/bf16.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe {

double Rng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  // Box-Muller; uniform() < 1 so 1 - u > 0.
  const double u1 = 1.0 - uniform();
  const double u2 = uniform();
  const double radius = std::sqrt(-2.0 * std::log(u1));
  spare_ = radius * std::sin(6.283185307179586 * u2);
  has_spare_ = true;
  return radius * std::cos(6.283185307179586 * u2);
}

namespace {

Matrix random_matrix(std::int64_t rows, std::int64_t cols, double scale, Rng& rng) {
  Matrix m(rows, cols);
  for (auto& v : m.data) v = static_cast<float>(scale * rng.normal());
  return m;
}

void round_all(Matrix& m) {
  for (auto& v : m.data) v = round_to_bf16(v);
}

}  // namespace

namespace {
// The router part of the weights, drawn first from the generator.
LayerWeights router_part(const LayerConfig& c, Rng& rng) {
  LayerWeights w;
  w.router = random_matrix(c.hidden, c.routed_experts, 1.0 / std::sqrt(double(c.hidden)), rng);
  w.expert_bias.assign(static_cast<std::size_t>(c.routed_experts), 0.0f);
  if (c.expert_bias) {
    for (auto& b : w.expert_bias) b = static_cast<float>(0.01 * rng.normal());
  }
  return w;
}
}  // namespace

LayerWeights random_router(const LayerConfig& c, std::uint64_t seed) {
  c.validate();
  Rng rng(seed);
  LayerWeights w = router_part(c, rng);
  if (c.dtype == DType::bf16)
    for (auto& v : w.router.data) v = round_to_bf16(v);
  return w;
}

LayerWeights random_weights(const LayerConfig& c, std::uint64_t seed) {
  c.validate();
  Rng rng(seed);
  LayerWeights w = router_part(c, rng);
  const double in_h = 1.0 / std::sqrt(double(c.hidden));
  for (std::int64_t e = 0; e < c.routed_experts; ++e) {
    w.w1.push_back(random_matrix(c.hidden, 2 * c.expert_inter, in_h, rng));
    w.w2.push_back(random_matrix(c.expert_inter, c.hidden, 1.0 / std::sqrt(double(c.expert_inter)), rng));
  }
  if (c.shared_experts > 0) {
    const std::int64_t is = c.shared_inter_total();
    w.shared_w1 = random_matrix(c.hidden, 2 * is, in_h, rng);
    w.shared_w2 = random_matrix(is, c.hidden, 1.0 / std::sqrt(double(is)), rng);
  }
  if (c.dtype == DType::bf16) round_to_bf16(w);
  return w;
}

LayerInputs random_inputs(const LayerConfig& c, std::uint64_t seed) {
  c.validate();
  Rng rng(seed ^ 0xA5A5A5A5ull);
  LayerInputs in;
  in.x = random_matrix(c.total_tokens(), c.hidden, 1.0, rng);
  in.d_out = random_matrix(c.total_tokens(), c.hidden, 1.0 / std::sqrt(double(c.hidden)), rng);
  if (c.dtype == DType::bf16) round_to_bf16(in);
  return in;
}

LayerGradients zero_gradients(const LayerConfig& c) {
  LayerGradients g;
  g.x = Matrix(c.total_tokens(), c.hidden);
  g.router = Matrix(c.hidden, c.routed_experts);
  for (std::int64_t e = 0; e < c.routed_experts; ++e) {
    g.w1.emplace_back(c.hidden, 2 * c.expert_inter);
    g.w2.emplace_back(c.expert_inter, c.hidden);
  }
  if (c.shared_experts > 0) {
    g.shared_w1 = Matrix(c.hidden, 2 * c.shared_inter_total());
    g.shared_w2 = Matrix(c.shared_inter_total(), c.hidden);
  }
  return g;
}

void round_to_bf16(LayerWeights& w) {
  round_all(w.router);
  for (auto& m : w.w1) round_all(m);
  for (auto& m : w.w2) round_all(m);
  round_all(w.shared_w1);
  round_all(w.shared_w2);
}

void round_to_bf16(LayerInputs& in) {
  round_all(in.x);
  round_all(in.d_out);
}

void check_shapes(const LayerConfig& c, const LayerWeights& w, const LayerInputs& in) {
  auto expect = [](const Matrix& m, std::int64_t r, std::int64_t cl, const std::string& what) {
    if (m.rows != r || m.cols != cl || m.data.size() != static_cast<std::size_t>(r * cl)) {
      throw Error(what + " has shape [" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "], expected [" +
                  std::to_string(r) + ", " + std::to_string(cl) + "]");
    }
  };
  expect(w.router, c.hidden, c.routed_experts, "router weight");
  if (w.expert_bias.size() != static_cast<std::size_t>(c.routed_experts))
    throw Error("expert bias has " + std::to_string(w.expert_bias.size()) + " entries, expected " +
                std::to_string(c.routed_experts));
  if (w.w1.size() != static_cast<std::size_t>(c.routed_experts) ||
      w.w2.size() != static_cast<std::size_t>(c.routed_experts))
    throw Error("expected weights for " + std::to_string(c.routed_experts) + " experts, got " +
                std::to_string(w.w1.size()));
  for (std::int64_t e = 0; e < c.routed_experts; ++e) {
    expect(w.w1[e], c.hidden, 2 * c.expert_inter, "expert " + std::to_string(e) + " gate/up weight");
    expect(w.w2[e], c.expert_inter, c.hidden, "expert " + std::to_string(e) + " down weight");
  }
  if (c.shared_experts > 0) {
    expect(w.shared_w1, c.hidden, 2 * c.shared_inter_total(), "shared expert gate/up weight");
    expect(w.shared_w2, c.shared_inter_total(), c.hidden, "shared expert down weight");
  }
  expect(in.x, c.total_tokens(), c.hidden, "input x");
  expect(in.d_out, c.total_tokens(), c.hidden, "output gradient d_out");
}

}  // namespace hpmoe
