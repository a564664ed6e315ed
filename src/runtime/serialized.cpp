// The serialized baseline: the layer the way frameworks run it, one
// bulk-synchronous operator at a time. It is the interleaved runtime's phased
// mode over the same compiled, verified program: each operator is one task
// kind (operator_order), its tiles shared round-robin by a rank's workers,
// and every worker of every rank meets at a barrier before the next
// operator starts. One program description, one set of operator names, and
// the same arithmetic tile for tile as the interleaved launch.
#include <algorithm>

#include "runtime/executor_parts.hpp"
#include "runtime/serialized.hpp"
#include "hpmoe/error.hpp"
#include "kernels/kernels.hpp"
#include "runtime/interleaved.hpp"

namespace hpmoe {

using namespace detail;

struct SerializedExecutor::Impl {
  Impl(const LayerConfig& c, const LayerWeights& w, const RuntimeOptions& opt) : runtime(c, w, options(opt)) {}

  // The engine's phased schedule: operators in order, so the queue order is not used.
  static RuntimeOptions options(RuntimeOptions opt) {
    opt.policy = taskflow::Policy::fill;
    opt.phased = true;
    return opt;
  }

  InterleavedExecutor runtime;
};

std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig& c, const LayerWeights& w, bool backward) {
  c.validate();
  check_weight_shapes(c, w);
  kernels::init();
  auto p = std::make_shared<PackedWeights>();
  p->weights = &w;
  p->dtype = c.dtype;
  p->backward = backward;
  if (c.dtype == DType::fp32) p->fp32 = pack_layer<float>(c, w, backward);
  else p->bf16_ = pack_layer<bf16>(c, w, backward);
  return p;
}

std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig& c, LayerWeights& w, bool backward,
                                                  std::span<const std::int32_t> experts, const ExpertSource& fetch) {
  c.validate();
  check_weight_shapes(c, w);
  if (!fetch) throw Error("pack_weights: no source of the experts' weights");
  kernels::init();
  auto p = std::make_shared<PackedWeights>();
  p->weights = &w;
  p->dtype = c.dtype;
  p->backward = backward;
  if (c.dtype == DType::fp32) p->fp32 = pack_layer<float>(c, w, backward, experts, fetch);
  else p->bf16_ = pack_layer<bf16>(c, w, backward, experts, fetch);
  return p;
}

void repack_weights(const PackedWeights& packed, const LayerConfig& c, std::span<const std::int32_t> experts,
                    bool all_experts, bool replicated) {
  if (packed.dtype != c.dtype) throw Error("repack: the packing is " + to_string(packed.dtype) + ", the layer " + to_string(c.dtype));
  check_weight_shapes(c, *packed.weights);
  if (c.dtype == DType::fp32) repack_layer<float>(*packed.fp32, c, *packed.weights, packed.backward, experts, all_experts, replicated);
  else repack_layer<bf16>(*packed.bf16_, c, *packed.weights, packed.backward, experts, all_experts, replicated);
}

SerializedExecutor::SerializedExecutor(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt) {
  c.validate();
  if (opt.workers_per_rank < 1 || opt.workers_per_rank > 256)
    throw Error("workers per rank must be between 1 and 256 (got " + std::to_string(opt.workers_per_rank) + ")");
  impl_ = std::make_unique<Impl>(c, w, opt);
}

SerializedExecutor::~SerializedExecutor() = default;

StepResult SerializedExecutor::step(const LayerInputs& in, std::span<const std::int32_t> forced) {
  StepResult result;
  impl_->runtime.step(in, forced, result);
  return result;
}

void SerializedExecutor::step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& result) {
  impl_->runtime.step(in, forced, result);
}

void SerializedExecutor::forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& result) {
  impl_->runtime.forward(x, forced, result);
}

void SerializedExecutor::backward(MatrixView d_out, StepResult& result) { impl_->runtime.backward(d_out, result); }

}  // namespace hpmoe
