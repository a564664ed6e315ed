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
  check_weight_shapes(c, w);
  check_token_view(c, view(in.x), "input x");
  check_token_view(c, view(in.d_out), "output gradient d_out");
  if (in.x.data.size() != static_cast<std::size_t>(in.x.rows * in.x.cols) ||
      in.d_out.data.size() != static_cast<std::size_t>(in.d_out.rows * in.d_out.cols))
    throw Error("an input matrix holds a different number of values than its shape says");
}

void check_token_view(const LayerConfig& c, const MatrixView& v, const std::string& what) {
  if (v.rows != c.total_tokens() || v.cols != c.hidden)
    throw Error(what + " has shape [" + std::to_string(v.rows) + ", " + std::to_string(v.cols) + "], expected [" +
                std::to_string(c.total_tokens()) + ", " + std::to_string(c.hidden) + "] (ranks x tokens per rank, hidden)");
  if (v.ld < v.cols || (v.rows > 0 && v.data == nullptr))
    throw Error(what + " has a row stride of " + std::to_string(v.ld) + " elements, less than its " +
                std::to_string(v.cols) + " columns (or no data)");
}

LayerWeights weights_from_hf(const LayerConfig& c, const HfMoeBlock& hf) {
  c.validate();
  auto expect = [](const MatrixView& v, std::int64_t rows, std::int64_t cols, const std::string& what) {
    if (v.rows != rows || v.cols != cols || v.ld < cols || (rows * cols > 0 && v.data == nullptr))
      throw Error(what + " has shape [" + std::to_string(v.rows) + ", " + std::to_string(v.cols) + "] (row stride " +
                  std::to_string(v.ld) + "), expected [" + std::to_string(rows) + ", " + std::to_string(cols) +
                  "] as Hugging Face stores it ([out, in])");
  };
  // [out, in] views into the [in, out] math layout, at column `col0`.
  auto transpose_into = [](const MatrixView& v, Matrix& m, std::int64_t col0) {
    for (std::int64_t o = 0; o < v.rows; ++o)
      for (std::int64_t i = 0; i < v.cols; ++i) m.at(i, col0 + o) = v.at(o, i);
  };
  auto mlp = [&](const HfMlp& p, std::int64_t inter, const std::string& name, Matrix& w1, Matrix& w2) {
    expect(p.gate_proj, inter, c.hidden, name + ".gate_proj.weight");
    expect(p.up_proj, inter, c.hidden, name + ".up_proj.weight");
    expect(p.down_proj, c.hidden, inter, name + ".down_proj.weight");
    w1 = Matrix(c.hidden, 2 * inter);
    w2 = Matrix(inter, c.hidden);
    transpose_into(p.gate_proj, w1, 0);
    transpose_into(p.up_proj, w1, inter);
    transpose_into(p.down_proj, w2, 0);
  };
  LayerWeights w;
  expect(hf.gate, c.routed_experts, c.hidden, "mlp.gate.weight");
  w.router = Matrix(c.hidden, c.routed_experts);
  transpose_into(hf.gate, w.router, 0);
  if (!hf.e_score_correction_bias.empty() &&
      hf.e_score_correction_bias.size() != static_cast<std::size_t>(c.routed_experts))
    throw Error("mlp.gate.e_score_correction_bias has " + std::to_string(hf.e_score_correction_bias.size()) +
                " values, expected " + std::to_string(c.routed_experts));
  w.expert_bias = hf.e_score_correction_bias.empty()
                      ? std::vector<float>(static_cast<std::size_t>(c.routed_experts), 0.0f)
                      : std::vector<float>(hf.e_score_correction_bias.begin(), hf.e_score_correction_bias.end());
  if (hf.experts.size() != static_cast<std::size_t>(c.routed_experts))
    throw Error("Hugging Face weights for " + std::to_string(hf.experts.size()) + " experts, the layer has " +
                std::to_string(c.routed_experts));
  w.w1.resize(hf.experts.size());
  w.w2.resize(hf.experts.size());
  for (std::size_t e = 0; e < hf.experts.size(); ++e)
    mlp(hf.experts[e], c.expert_inter, "mlp.experts." + std::to_string(e), w.w1[e], w.w2[e]);
  if (c.shared_experts > 0) mlp(hf.shared, c.shared_inter_total(), "mlp.shared_experts", w.shared_w1, w.shared_w2);
  if (c.dtype == DType::bf16) round_to_bf16(w);
  return w;
}

void check_weight_shapes(const LayerConfig& c, const LayerWeights& w) {
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
}

}  // namespace hpmoe
