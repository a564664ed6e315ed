#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "runtime/options.hpp"
#include "hpmoe/step.hpp"
#include "hpmoe/config.hpp"
#include "compiler/taskflow.hpp"
#include "hpmoe/tensors.hpp"
#include "hpmoe/transport.hpp"

namespace hpmoe {
// The serialized schedule of the same engine: the layer the way frameworks
// run it today, one operator at a time (permute, all-to-all, grouped GEMM,
// SwiGLU, grouped GEMM, all-to-all, un-permute + weighted sum), each a
// bulk-synchronous step across the P x W workers (phased: the program's
// tasks by operator, a barrier after each). Each output tile is computed
// whole by one worker, so results do not depend on W and are bit-identical
// to the interleaved schedule's.
inline RuntimeOptions serialized_schedule(RuntimeOptions opt) {
  opt.policy = taskflow::Policy::fill;  // queues are not used: operators run in order
  opt.phased = true;
  return opt;
}

// The interleaved single-launch runtime, in process: every step compiles the
// routing into per-rank tile programs (same tiles, operands and kernels as
// the serialized baseline), verifies them, and runs them in one launch in
// which all P x W workers walk their queues concurrently, waiting on event
// counters and moving rows with put + signal. With backward, a second launch
// runs the backward program; the replicated weights' gradients (router,
// shared experts) are then summed over ranks in rank order.
class InterleavedExecutor {
 public:
  // The executor reads the weights in place (weights_changed below): they
  // must outlive it. hpmoe::Layer owns its copy.
  InterleavedExecutor(const LayerConfig&, const LayerWeights&, RuntimeOptions);
  ~InterleavedExecutor();
  InterleavedExecutor(const InterleavedExecutor&) = delete;
  InterleavedExecutor& operator=(const InterleavedExecutor&) = delete;

  // One step. result.dispatch_to_combine_seconds is the forward launch and
  // result.backward_seconds the backward one; routing, compile and
  // verification are reported as host-side operators.
  void step(const LayerInputs&, std::span<const std::int32_t> forced, StepResult& result);
  StepResult step(const LayerInputs& in, std::span<const std::int32_t> forced = {}) {
    StepResult result;
    step(in, forced, result);
    return result;
  }
  // The same in two calls, as a training framework makes them: forward saves
  // what backward needs in the executor and in `result`; backward runs later
  // on the output gradient, with the same result object. x and d_out are
  // views of the caller's memory ([P T, H], any row stride >= H), read
  // without copies; x must stay alive and unchanged until backward returns.
  void forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& result);
  void backward(MatrixView d_out, StepResult& result);
  // The caller changed the weights this executor was built on, in place
  // (and repacked `packed`, the shared packing, if it gave one): re-read
  // what the executor derives from them. Not between a forward and its
  // backward.
  void weights_changed(std::shared_ptr<const PackedWeights> packed = nullptr);
  // The programs of the last step (one per rank).
  const std::vector<taskflow::Program>& programs(taskflow::Pass = taskflow::Pass::forward) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  bool backward_ = false;
};

}  // namespace hpmoe
