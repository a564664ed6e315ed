#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/tensors.hpp"

namespace hpmoe {

// The fp64 oracle: the whole layer, forward and backward, in plain loops with
// double accumulation. Every fast path is checked against it.
struct OracleOptions {
  // Expert choices and capacity decisions to use instead of the oracle's own
  // (a fast path's, so that near-ties in fp32 cannot flip a choice). Empty:
  // the oracle routes by itself.
  std::span<const std::int32_t> forced_ids;
  std::span<const std::uint8_t> forced_kept;
  // The fast path's fp32 gate weights, [N, K]: where the backward sends dy
  // to the experts in bf16 (LayerConfig::staged_grad_dispatch), the oracle
  // rounds the product these make with d_out, as the fast path does, so that
  // a rounding tie cannot fall the other way. Empty: its own, in fp32.
  std::span<const float> dispatched_gates;
  // Tokens to compute outputs (and dx) for; empty means all. Weight
  // gradients need all tokens.
  std::vector<std::int64_t> tokens;
  bool backward = false;
  // With forced_ids: also route by itself and count the tokens whose choice
  // differs (near-ties between fp32 and fp64 scores).
  bool count_own_choice_differences = false;
};

struct OracleResult {
  RouterOutput<double> routing;
  std::vector<std::int64_t> tokens;  // the rows of out and dx
  std::vector<double> out;           // [tokens, H]
  std::vector<double> dx;            // [tokens, H]
  // With all tokens and backward only:
  std::vector<double> d_router;                 // [H, E]
  std::vector<std::vector<double>> d_w1, d_w2;  // per expert, [H, 2I] and [I, H]
  std::vector<double> d_shared_w1, d_shared_w2;
  // sum over computed tokens of <d_out, out>, plus the balancing losses: the
  // scalar whose gradient backward computes.
  double loss = 0;
  std::int64_t own_choice_differences = 0;
};

OracleResult reference_layer(const LayerConfig&, const LayerWeights&, const LayerInputs&, const OracleOptions& = {});

// The layer in float64 from end to end: parameters and inputs as fp64 (a
// framework's float64 tensors, for gradient checks tighter than fp32 allows),
// the same loops. The bias only selects experts, so it stays fp32 as in
// LayerWeights. Every expert is held (one process, all ranks).
struct LayerWeights64 {
  Matrix64 router;                  // [H, E]
  std::vector<float> expert_bias;   // [E]
  std::vector<Matrix64> w1, w2;     // E x [H, 2I], E x [I, H]
  Matrix64 shared_w1, shared_w2;    // [H, 2 Is], [Is, H]
};
struct LayerInputs64 {
  Matrix64 x, d_out;  // [P x T, H]
};
OracleResult reference_layer(const LayerConfig&, const LayerWeights64&, const LayerInputs64&,
                             const OracleOptions& = {});

}  // namespace hpmoe
