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

namespace hpmoe {

// A layer's weights packed for the tile kernels, to share between executors
// of the same weights (the packing is as large as the weights, twice with
// the transposes backward needs). The weights must outlive it.
struct PackedWeights;
std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig&, const LayerWeights&, bool backward);
// The same for a process that holds only `experts`, brought into w one at a
// time by `fetch` (generated or read from a checkpoint) and released once
// packed, so that the raw and packed copies of all experts never coexist.
using ExpertSource = std::function<void(std::int64_t expert, LayerWeights&)>;
std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig&, LayerWeights&, bool backward,
                                                  std::span<const std::int32_t> experts, const ExpertSource& fetch);

// The operands of the weights a caller changed in place, packed again into
// the same memory: `experts` (every held one when all_experts) and, when
// `replicated`, the router and shared experts. Only for packing that no
// step in flight reads (the caller's to ensure; hpmoe::Layer does).
void repack_weights(const PackedWeights&, const LayerConfig&, std::span<const std::int32_t> experts, bool all_experts,
                    bool replicated);

struct ExecutorOptions {
  int workers_per_rank = 1;  // W
  bool backward = false;
  bool pin = true;
  std::shared_ptr<const PackedWeights> packed{};  // optional, see pack_weights
  bool trace = false;                             // record StepResult::trace
  ExpertPlacement placement{};                    // where the experts live; empty: contiguous
};

// The layer the way frameworks run it today: one operator at a time (permute,
// all-to-all, grouped GEMM, SwiGLU, grouped GEMM, all-to-all, un-permute +
// weighted sum), each a bulk-synchronous step across the P x W workers. Ranks
// own their experts, tokens and buffers and exchange data only in the
// all-to-all operators. Each output tile is computed whole by one worker, so
// results do not depend on W and repeat bit for bit.
class SerializedExecutor {
 public:
  // Packs the weights once (bf16 VNNI, transposes for backward).
  SerializedExecutor(const LayerConfig&, const LayerWeights&, ExecutorOptions);
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
