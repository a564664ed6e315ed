#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "hpmoe/bf16.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"

namespace hpmoe {

// A dense row-major matrix that owns its storage: fp32 for every fast path,
// fp64 for the oracle run on a framework's float64 tensors.
template <class T>
struct DenseMatrix {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<T> data;

  DenseMatrix() = default;
  DenseMatrix(std::int64_t r, std::int64_t c) : rows(r), cols(c), data(static_cast<std::size_t>(r * c), T(0)) {}

  T* row(std::int64_t i) { return data.data() + i * cols; }
  const T* row(std::int64_t i) const { return data.data() + i * cols; }
  T& at(std::int64_t i, std::int64_t j) { return data[static_cast<std::size_t>(i * cols + j)]; }
  T at(std::int64_t i, std::int64_t j) const { return data[static_cast<std::size_t>(i * cols + j)]; }
};
using Matrix = DenseMatrix<float>;
using Matrix64 = DenseMatrix<double>;

// A read-only view of a row-major fp32 matrix in memory someone else owns
// (a framework's tensor): rows x cols, rows `ld` elements apart. Nothing is
// copied; the memory must outlive the use.
struct MatrixView {
  const float* data = nullptr;
  std::int64_t rows = 0, cols = 0, ld = 0;
  const float* row(std::int64_t i) const { return data + i * ld; }
  float at(std::int64_t i, std::int64_t j) const { return data[i * ld + j]; }
};
inline MatrixView view(const Matrix& m) { return MatrixView{m.data.data(), m.rows, m.cols, m.cols}; }
// The same for memory written in place (an output tensor of a framework).
struct MutableMatrixView {
  float* data = nullptr;
  std::int64_t rows = 0, cols = 0, ld = 0;
  float* row(std::int64_t i) const { return data + i * ld; }
  explicit operator bool() const { return data != nullptr; }
};
// The same for bfloat16 memory (a framework's bfloat16 tensor).
struct MutableBf16View {
  bf16* data = nullptr;
  std::int64_t rows = 0, cols = 0, ld = 0;
  explicit operator bool() const { return data != nullptr; }
};

// A read-only view of a row-major bfloat16 matrix (a framework's bfloat16
// tensor), as MatrixView is of a float one.
struct Bf16View {
  const bf16* data = nullptr;
  std::int64_t rows = 0, cols = 0, ld = 0;
};

// Parameters of a layer, in the math layout
// [in, out] (the layer computes x W: h = x W1, y = swiglu(h) W2); the
// safetensors I/O converts to and from the Hugging Face [out, in] layout.
// A process of an expert-parallel run holds the replicated parameters
// (router, bias, shared experts) and only its own experts: w1/w2 have E
// entries, empty (0 x 0) for experts held elsewhere.
struct LayerWeights {
  Matrix router;                    // [H, E]
  std::vector<float> expert_bias;   // [E], selection only
  std::vector<Matrix> w1;           // E x [H, 2I]: columns [0, I) gate, [I, 2I) up; empty if not held
  std::vector<Matrix> w2;           // E x [I, H]; empty if not held
  Matrix shared_w1;                 // [H, 2 Is], same split (empty when no shared experts)
  Matrix shared_w2;                 // [Is, H]
};

// Tokens of the ranks a process hosts, in rank order (all ranks: rank r
// owns rows [r T, (r+1) T)).
struct LayerInputs {
  Matrix x;      // [hosted ranks x T, H]
  Matrix d_out;  // [hosted ranks x T, H], the upstream gradient used by backward
};

// Gradients of what a process holds: its tokens' dx, the replicated
// parameters' (summed over all ranks), its own experts' (w1/w2 empty for
// experts held elsewhere).
struct LayerGradients {
  Matrix x;
  Matrix router;
  std::vector<Matrix> w1;
  std::vector<Matrix> w2;
  Matrix shared_w1;
  Matrix shared_w2;
};

// Deterministic initialisation (seeded); scaled like a trained layer
// (1/sqrt(fan-in)). In bf16 mode every value is rounded to bf16 so that all
// paths see the same numbers. Every tensor has its own seed (from `seed`,
// the tensor and its expert or rank), so the values of an expert or of a
// rank's tokens do not depend on which others are drawn.
LayerWeights random_weights(const LayerConfig&, std::uint64_t seed);
// The replicated parameters and only `experts` (the others empty).
LayerWeights random_weights(const LayerConfig&, std::uint64_t seed, std::span<const std::int32_t> experts);
// Draws expert e of random_weights(c, seed) into w (sized for E experts).
void random_expert(const LayerConfig&, std::uint64_t seed, std::int64_t e, LayerWeights& w);
LayerInputs random_inputs(const LayerConfig&, std::uint64_t seed);
// The tokens of `ranks` only, in that order: [ranks x T, H].
LayerInputs random_inputs(const LayerConfig&, std::uint64_t seed, std::span<const int> ranks);
// Only the router weight and bias of random_weights(c, seed), bit for bit
// (tools that route without running the experts need no more).
LayerWeights random_router(const LayerConfig&, std::uint64_t seed);
LayerGradients zero_gradients(const LayerConfig&);
// For `experts` only and token_rows rows of dx.
LayerGradients zero_gradients(const LayerConfig&, std::span<const std::int32_t> experts, std::int64_t token_rows);

// Whether w holds expert e's weights (not held elsewhere).
bool holds_expert(const LayerWeights&, std::int64_t e);
// Throws Error naming the first of `experts` that w does not hold.
void require_experts(const LayerWeights&, std::span<const std::int32_t> experts, const std::string& holder);

// Throws Error naming the first tensor whose shape does not fit the layer
// (an expert held elsewhere, both matrices empty, fits).
void check_shapes(const LayerConfig&, const LayerWeights&, const LayerInputs&);
void check_weight_shapes(const LayerConfig&, const LayerWeights&);
// A view of tokens (x or d_out) for the whole step: [P T, H], ld >= H.
void check_token_view(const LayerConfig&, const MatrixView&, const std::string& what);

// The Hugging Face names of an MoE block's tensors, relative to the block
// (a checkpoint puts "mlp." or "model.layers.N.mlp." before them, the
// PyTorch module nothing): the one table every reader and writer of those
// names uses (safetensors, the PyTorch module, the converters).
namespace hf_name {
inline const std::string router = "gate.weight";                     // [E, H]
inline const std::string expert_bias = "gate.e_score_correction_bias";  // [E]
inline const std::string shared = "shared_experts";                   // the shared experts' MLP
inline std::string expert(std::int64_t e) { return "experts." + std::to_string(e); }
// An MLP's projections, [out, in] each: gate and up [I, H], down [H, I].
inline const std::string gate_proj = "gate_proj.weight", up_proj = "up_proj.weight", down_proj = "down_proj.weight";
inline std::string projection(const std::string& mlp, const std::string& proj) { return mlp + "." + proj; }
}  // namespace hf_name

// A layer's weights as Hugging Face checkpoints store them ([out, in]),
// as views of the caller's tensors (any row stride).
struct HfMlp {
  MatrixView gate_proj;  // [I, H]
  MatrixView up_proj;    // [I, H]
  MatrixView down_proj;  // [H, I]
};
// The same projections as a bfloat16 model holds them (Layer::update_experts
// packs them for a bf16 layer as they are).
struct HfMlpBf16 {
  Bf16View gate_proj;  // [I, H]
  Bf16View up_proj;    // [I, H]
  Bf16View down_proj;  // [H, I]
};
struct HfMoeBlock {
  MatrixView gate;                                 // [E, H]: mlp.gate.weight
  std::vector<HfMlp> experts;                      // E: mlp.experts.{e}.*; all views empty: not held here
  HfMlp shared;                                    // mlp.shared_experts.* (when the layer has them)
  std::span<const float> e_score_correction_bias;  // [E], or empty for zeros
};
// The same weights in hpmoe's layout (rounded to bf16 for a bf16 layer);
// Error names the tensor whose shape does not fit.
LayerWeights weights_from_hf(const LayerConfig&, const HfMoeBlock&);
// Expert e alone into w (sized for E experts), from its three projections.
void expert_from_hf(const LayerConfig&, std::int64_t e, const HfMlp&, LayerWeights& w);
// Error, naming the tensor, unless expert e's three projections have the
// layer's shapes ([I, H], [I, H], [H, I]) and row strides.
void check_hf_expert(const LayerConfig&, std::int64_t e, const HfMlp&);
void check_hf_expert(const LayerConfig&, std::int64_t e, const HfMlpBf16&);

// A 64-bit fingerprint of what every rank of a run must agree on: the
// layer's configuration, the expert placement, the program format version,
// and the replicated parameters (router weight and bias, shared experts).
// Ranks exchange it with their routing counts every step.
std::uint64_t layer_fingerprint(const LayerConfig&, const ExpertPlacement&, const LayerWeights&);

// Rounds every value to bf16 in place (used when dtype is bf16).
void round_to_bf16(LayerWeights&);
void round_to_bf16(LayerInputs&);

// A small deterministic generator whose output does not depend on the
// standard library's distribution implementations.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  std::uint64_t next() {  // splitmix64
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  std::int64_t below(std::int64_t n) { return static_cast<std::int64_t>(uniform() * double(n)); }
  double normal();

 private:
  std::uint64_t state_;
  double spare_ = 0;  // Box-Muller makes normals in pairs
  bool has_spare_ = false;
};

}  // namespace hpmoe
