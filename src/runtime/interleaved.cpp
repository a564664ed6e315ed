// InterleavedExecutor: the engine's face (one Interleaved<T> per dtype,
// src/runtime/engine.hpp): hpmoe::Layer's engines (one per step in flight
// and schedule); the tools drive the Layer, the tests reach in here.
#include "runtime/engine.hpp"

#include "hpmoe/error.hpp"

namespace hpmoe {

using detail::Interleaved;

InterleavedExecutor::InterleavedExecutor(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt) {
  c.validate();
  if (opt.workers_per_rank < 1 || opt.workers_per_rank > 256)
    throw Error("workers per rank must be between 1 and 256 (got " + std::to_string(opt.workers_per_rank) + ")");
  if (!(opt.watchdog_seconds > 0)) throw Error("the watchdog time must be positive");
  check_weight_shapes(c, w);
  backward_ = opt.backward;
  if (c.dtype == DType::fp32) impl_ = std::make_unique<Interleaved<float>>(c, w, opt);
  else impl_ = std::make_unique<Interleaved<bf16>>(c, w, opt);
}

InterleavedExecutor::~InterleavedExecutor() = default;

void InterleavedExecutor::step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& result) {
  impl_->forward(view(in.x), forced, result);
  if (backward_) impl_->backward(view(in.d_out), result);
}

void InterleavedExecutor::forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& result) {
  impl_->forward(x, forced, result);
}

void InterleavedExecutor::backward(MatrixView d_out, StepResult& result) { impl_->backward(d_out, result); }

void InterleavedExecutor::weights_changed(std::shared_ptr<const PackedWeights> packed) {
  impl_->weights_changed(std::move(packed));
}

const std::vector<taskflow::Program>& InterleavedExecutor::programs(taskflow::Pass pass) const {
  return pass == taskflow::Pass::forward ? impl_->plan.forward : impl_->plan.backward;
}

}  // namespace hpmoe
