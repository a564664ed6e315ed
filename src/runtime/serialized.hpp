#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/step.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/tensors.hpp"
#include "runtime/options.hpp"

namespace hpmoe {

// The layer the way frameworks run it today: one operator at a time (permute,
// all-to-all, grouped GEMM, SwiGLU, grouped GEMM, all-to-all, un-permute +
// weighted sum), each a bulk-synchronous step across the P x W workers. Ranks
// own their experts, tokens and buffers and exchange data only in the
// all-to-all operators. Each output tile is computed whole by one worker, so
// results do not depend on W and repeat bit for bit.
class SerializedExecutor {
 public:
  // Packs the weights once (bf16 VNNI, transposes for backward).
  SerializedExecutor(const LayerConfig&, const LayerWeights&, RuntimeOptions);
  ~SerializedExecutor();
  SerializedExecutor(const SerializedExecutor&) = delete;
  SerializedExecutor& operator=(const SerializedExecutor&) = delete;

  // One training step (forward, and backward when asked). `forced` replaces
  // the router's expert choice (synthetic or trace routing); empty: router.
  StepResult step(const LayerInputs&, std::span<const std::int32_t> forced = {});
  // The same, reusing `result`'s buffers (outputs and gradients of a large
  // layer are gigabytes; every element is overwritten).
  void step(const LayerInputs&, std::span<const std::int32_t> forced, StepResult& result);
  // Forward and backward as separate calls (see InterleavedExecutor).
  void forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& result);
  void backward(MatrixView d_out, StepResult& result);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hpmoe
