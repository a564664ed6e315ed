#include "hpmoe/tensors.hpp"

#include "common/transpose.hpp"

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "hpmoe/bf16.hpp"
#include "hpmoe/error.hpp"
#include "model/format.hpp"

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
// Every tensor has a seed of its own, derived from the run's seed, the
// tensor's kind and its index (expert or rank): a process that holds only
// some experts or some ranks' tokens draws exactly the values a process
// holding everything draws, without communication.
enum class TensorKind : std::uint64_t { router = 1, expert_bias, w1, w2, shared_w1, shared_w2, x, d_out };
Rng tensor_rng(std::uint64_t seed, TensorKind kind, std::uint64_t index = 0) {
  Rng mix(seed ^ (static_cast<std::uint64_t>(kind) << 56) ^ (index * 0xD1B54A32D192ED03ull));
  return Rng(mix.next());
}

LayerWeights router_part(const LayerConfig& c, std::uint64_t seed) {
  LayerWeights w;
  Rng router_rng = tensor_rng(seed, TensorKind::router);
  w.router = random_matrix(c.hidden, c.routed_experts, 1.0 / std::sqrt(double(c.hidden)), router_rng);
  w.expert_bias.assign(static_cast<std::size_t>(c.routed_experts), 0.0f);
  if (c.expert_bias) {
    Rng bias_rng = tensor_rng(seed, TensorKind::expert_bias);
    for (auto& b : w.expert_bias) b = static_cast<float>(0.01 * bias_rng.normal());
  }
  return w;
}
}  // namespace

LayerWeights random_router(const LayerConfig& c, std::uint64_t seed) {
  c.validate();
  LayerWeights w = router_part(c, seed);
  if (c.dtype == DType::bf16) round_all(w.router);
  return w;
}

void random_expert(const LayerConfig& c, std::uint64_t seed, std::int64_t e, LayerWeights& w) {
  if (e < 0 || e >= c.routed_experts)
    throw Error("expert " + std::to_string(e) + " does not exist (the layer has " + std::to_string(c.routed_experts) + ")");
  w.w1.resize(static_cast<std::size_t>(c.routed_experts));
  w.w2.resize(static_cast<std::size_t>(c.routed_experts));
  Rng r1 = tensor_rng(seed, TensorKind::w1, static_cast<std::uint64_t>(e));
  Rng r2 = tensor_rng(seed, TensorKind::w2, static_cast<std::uint64_t>(e));
  w.w1[e] = random_matrix(c.hidden, 2 * c.expert_inter, 1.0 / std::sqrt(double(c.hidden)), r1);
  w.w2[e] = random_matrix(c.expert_inter, c.hidden, 1.0 / std::sqrt(double(c.expert_inter)), r2);
  if (c.dtype == DType::bf16) {
    round_all(w.w1[e]);
    round_all(w.w2[e]);
  }
}

LayerWeights random_weights(const LayerConfig& c, std::uint64_t seed, std::span<const std::int32_t> experts) {
  LayerWeights w = random_router(c, seed);
  w.w1.resize(static_cast<std::size_t>(c.routed_experts));
  w.w2.resize(static_cast<std::size_t>(c.routed_experts));
  for (const std::int32_t e : experts) random_expert(c, seed, e, w);
  if (c.shared_experts > 0) {
    const std::int64_t is = c.shared_inter_total();
    Rng r1 = tensor_rng(seed, TensorKind::shared_w1), r2 = tensor_rng(seed, TensorKind::shared_w2);
    w.shared_w1 = random_matrix(c.hidden, 2 * is, 1.0 / std::sqrt(double(c.hidden)), r1);
    w.shared_w2 = random_matrix(is, c.hidden, 1.0 / std::sqrt(double(is)), r2);
    if (c.dtype == DType::bf16) {
      round_all(w.shared_w1);
      round_all(w.shared_w2);
    }
  }
  return w;
}

LayerWeights random_weights(const LayerConfig& c, std::uint64_t seed) {
  c.validate();
  std::vector<std::int32_t> all(static_cast<std::size_t>(c.routed_experts));
  for (std::size_t e = 0; e < all.size(); ++e) all[e] = static_cast<std::int32_t>(e);
  return random_weights(c, seed, all);
}

LayerInputs random_inputs(const LayerConfig& c, std::uint64_t seed, std::span<const int> ranks) {
  c.validate();
  const std::int64_t T = c.tokens_per_rank, H = c.hidden;
  LayerInputs in;
  in.x = Matrix(static_cast<std::int64_t>(ranks.size()) * T, H);
  in.d_out = Matrix(static_cast<std::int64_t>(ranks.size()) * T, H);
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= c.ranks)
      throw Error("rank " + std::to_string(ranks[i]) + " does not exist (the layer has " + std::to_string(c.ranks) + ")");
    Rng rx = tensor_rng(seed, TensorKind::x, static_cast<std::uint64_t>(ranks[i]));
    Rng rd = tensor_rng(seed, TensorKind::d_out, static_cast<std::uint64_t>(ranks[i]));
    const double d_scale = 1.0 / std::sqrt(double(H));
    for (std::int64_t j = 0; j < T * H; ++j) in.x.data[static_cast<std::size_t>(std::int64_t(i) * T * H + j)] = static_cast<float>(rx.normal());
    for (std::int64_t j = 0; j < T * H; ++j)
      in.d_out.data[static_cast<std::size_t>(std::int64_t(i) * T * H + j)] = static_cast<float>(d_scale * rd.normal());
  }
  if (c.dtype == DType::bf16) round_to_bf16(in);
  return in;
}

LayerInputs random_inputs(const LayerConfig& c, std::uint64_t seed) {
  std::vector<int> all(static_cast<std::size_t>(c.ranks));
  for (std::size_t r = 0; r < all.size(); ++r) all[r] = static_cast<int>(r);
  return random_inputs(c, seed, all);
}

LayerGradients zero_gradients(const LayerConfig& c, std::span<const std::int32_t> experts, std::int64_t token_rows) {
  LayerGradients g;
  g.x = Matrix(token_rows, c.hidden);
  g.router = Matrix(c.hidden, c.routed_experts);
  g.w1.resize(static_cast<std::size_t>(c.routed_experts));
  g.w2.resize(static_cast<std::size_t>(c.routed_experts));
  for (const std::int32_t e : experts) {
    g.w1[e] = Matrix(c.hidden, 2 * c.expert_inter);
    g.w2[e] = Matrix(c.expert_inter, c.hidden);
  }
  if (c.shared_experts > 0) {
    g.shared_w1 = Matrix(c.hidden, 2 * c.shared_inter_total());
    g.shared_w2 = Matrix(c.shared_inter_total(), c.hidden);
  }
  return g;
}

LayerGradients zero_gradients(const LayerConfig& c) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(c.routed_experts));
  for (std::size_t e = 0; e < all.size(); ++e) all[e] = static_cast<std::int32_t>(e);
  return zero_gradients(c, all, c.total_tokens());
}

namespace {
// FNV-1a over 8-byte words (and the tail), folded with a final mix: fast
// enough for the replicated weights, and every rank computes it the same way.
struct Fingerprint {
  std::uint64_t h = 0xcbf29ce484222325ull;
  void bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      std::uint64_t word;
      std::memcpy(&word, p + i, 8);
      h = (h ^ word) * 0x100000001b3ull;
    }
    for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
    h ^= n;
  }
  void text(const std::string& s) { bytes(s.data(), s.size()); }
  void floats(const std::vector<float>& v) { bytes(v.data(), v.size() * sizeof(float)); }
  std::uint64_t value() const {
    std::uint64_t z = h;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};
}  // namespace

std::uint64_t layer_fingerprint(const LayerConfig& c, const ExpertPlacement& placement, const LayerWeights& w) {
  Fingerprint f;
  f.text("hpmoe layer v" + std::to_string(taskflow::kFormatVersion));
  f.text(to_json(c).dump());
  f.text(to_json(placement).dump());
  f.floats(w.router.data);
  f.floats(w.expert_bias);
  f.floats(w.shared_w1.data);
  f.floats(w.shared_w2.data);
  return f.value();
}

bool holds_expert(const LayerWeights& w, std::int64_t e) {
  return e >= 0 && static_cast<std::size_t>(e) < w.w1.size() && static_cast<std::size_t>(e) < w.w2.size() &&
         w.w1[e].rows > 0 && w.w2[e].rows > 0;
}

void require_experts(const LayerWeights& w, std::span<const std::int32_t> experts, const std::string& holder) {
  for (const std::int32_t e : experts)
    if (!holds_expert(w, e))
      throw Error(holder + " needs expert " + std::to_string(e) + "'s weights, which were not loaded or generated here");
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

namespace {
void expect_hf_shape(const MatrixView& v, std::int64_t rows, std::int64_t cols, const std::string& what) {
  if (v.rows != rows || v.cols != cols || v.ld < cols || (rows * cols > 0 && v.data == nullptr))
    throw Error(what + " has shape [" + std::to_string(v.rows) + ", " + std::to_string(v.cols) + "] (row stride " +
                std::to_string(v.ld) + "), expected [" + std::to_string(rows) + ", " + std::to_string(cols) +
                "] as Hugging Face stores it ([out, in])");
}
// [out, in] views into the [in, out] math layout, at column `col0`.
// In blocks (common/transpose.hpp): writing a whole [out, in] view down the
// columns of m one row at a time touches a new line of m per element (a
// training step converts every weight: this took a quarter of a small
// layer's forward).
void transpose_into(const MatrixView& v, Matrix& m, std::int64_t col0) {
  transpose_blocked(v.data, v.ld, v.rows, v.cols, m.data.data() + col0, m.cols);
}
// One SwiGLU MLP from Hugging Face's three [out, in] projections.
void mlp_from_hf(const LayerConfig& c, const HfMlp& p, std::int64_t inter, const std::string& name, Matrix& w1, Matrix& w2) {
  expect_hf_shape(p.gate_proj, inter, c.hidden, hf_name::projection(name, hf_name::gate_proj));
  expect_hf_shape(p.up_proj, inter, c.hidden, hf_name::projection(name, hf_name::up_proj));
  expect_hf_shape(p.down_proj, c.hidden, inter, hf_name::projection(name, hf_name::down_proj));
  // Every element is written below: matrices of the right shape are reused
  // (a training loop converts changed experts in place every step).
  if (w1.rows != c.hidden || w1.cols != 2 * inter) w1 = Matrix(c.hidden, 2 * inter);
  if (w2.rows != inter || w2.cols != c.hidden) w2 = Matrix(inter, c.hidden);
  transpose_into(p.gate_proj, w1, 0);
  transpose_into(p.up_proj, w1, inter);
  transpose_into(p.down_proj, w2, 0);
  if (c.dtype == DType::bf16) {
    round_all(w1);
    round_all(w2);
  }
}
}  // namespace

void check_hf_expert(const LayerConfig& c, std::int64_t e, const HfMlp& p) {
  const std::string name = "mlp." + hf_name::expert(e);
  expect_hf_shape(p.gate_proj, c.expert_inter, c.hidden, hf_name::projection(name, hf_name::gate_proj));
  expect_hf_shape(p.up_proj, c.expert_inter, c.hidden, hf_name::projection(name, hf_name::up_proj));
  expect_hf_shape(p.down_proj, c.hidden, c.expert_inter, hf_name::projection(name, hf_name::down_proj));
}

void check_hf_expert(const LayerConfig& c, std::int64_t e, const HfMlpBf16& p) {
  // The shapes alone are checked: a float view of the same geometry (its
  // pointer only tested for null) says the same.
  const auto shape = [](const Bf16View& v) {
    return MatrixView{reinterpret_cast<const float*>(v.data), v.rows, v.cols, v.ld};
  };
  check_hf_expert(c, e, HfMlp{shape(p.gate_proj), shape(p.up_proj), shape(p.down_proj)});
}

void expert_from_hf(const LayerConfig& c, std::int64_t e, const HfMlp& mlp, LayerWeights& w) {
  if (e < 0 || e >= c.routed_experts) throw Error("expert " + std::to_string(e) + " is not in the layer");
  w.w1.resize(static_cast<std::size_t>(c.routed_experts));
  w.w2.resize(static_cast<std::size_t>(c.routed_experts));
  mlp_from_hf(c, mlp, c.expert_inter, "mlp." + hf_name::expert(e), w.w1[e], w.w2[e]);
}

LayerWeights weights_from_hf(const LayerConfig& c, const HfMoeBlock& hf) {
  c.validate();
  LayerWeights w;
  expect_hf_shape(hf.gate, c.routed_experts, c.hidden, "mlp." + hf_name::router);
  w.router = Matrix(c.hidden, c.routed_experts);
  transpose_into(hf.gate, w.router, 0);
  if (c.dtype == DType::bf16) round_all(w.router);
  if (!hf.e_score_correction_bias.empty() &&
      hf.e_score_correction_bias.size() != static_cast<std::size_t>(c.routed_experts))
    throw Error("mlp." + hf_name::expert_bias + " has " + std::to_string(hf.e_score_correction_bias.size()) +
                " values, expected " + std::to_string(c.routed_experts));
  w.expert_bias = hf.e_score_correction_bias.empty()
                      ? std::vector<float>(static_cast<std::size_t>(c.routed_experts), 0.0f)
                      : std::vector<float>(hf.e_score_correction_bias.begin(), hf.e_score_correction_bias.end());
  if (hf.experts.size() != static_cast<std::size_t>(c.routed_experts))
    throw Error("Hugging Face weights for " + std::to_string(hf.experts.size()) + " experts, the layer has " +
                std::to_string(c.routed_experts));
  w.w1.resize(hf.experts.size());
  w.w2.resize(hf.experts.size());
  for (std::size_t e = 0; e < hf.experts.size(); ++e) {
    const HfMlp& p = hf.experts[e];
    if (!p.gate_proj.data && !p.up_proj.data && !p.down_proj.data && p.gate_proj.rows == 0 && p.up_proj.rows == 0 &&
        p.down_proj.rows == 0)
      continue;  // not held by this process (all three views empty)
    expert_from_hf(c, static_cast<std::int64_t>(e), p, w);
  }
  if (c.shared_experts > 0) mlp_from_hf(c, hf.shared, c.shared_inter_total(), "mlp." + hf_name::shared, w.shared_w1, w.shared_w2);
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
    if (!holds_expert(w, e) && w.w1[e].data.empty() && w.w2[e].data.empty()) continue;  // held by another process
    expect(w.w1[e], c.hidden, 2 * c.expert_inter, "expert " + std::to_string(e) + " gate/up weight");
    expect(w.w2[e], c.expert_inter, c.hidden, "expert " + std::to_string(e) + " down weight");
  }
  if (c.shared_experts > 0) {
    expect(w.shared_w1, c.hidden, 2 * c.shared_inter_total(), "shared expert gate/up weight");
    expect(w.shared_w2, c.shared_inter_total(), c.hidden, "shared expert down weight");
  }
}

}  // namespace hpmoe
