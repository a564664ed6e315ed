#pragma once
// Test helper: what a fresh engine computes for one step (forward and
// backward), built for exactly that step's tokens, weights and placement;
// what a kept hpmoe::Layer must reproduce bit for bit.
#include <span>

#include "hpmoe/hpmoe.hpp"
#include "runtime/interleaved.hpp"

namespace hpmoe::testing {

inline StepResult fresh_step(LayerConfig c, const LayerWeights& w, const Parallel& p, const LayerInputs& in,
                             std::span<const std::int32_t> forced = {}) {
  c.tokens_per_rank = in.x.rows / c.ranks;
  RuntimeOptions o;
  o.workers_per_rank = p.workers_per_rank;
  o.backward = true;
  o.pin = false;
  o.placement = p.placement;
  o.phased = p.schedule == Schedule::serialized;
  o.policy = o.phased ? taskflow::Policy::fill : p.policy;
  InterleavedExecutor ex(c, w, o);
  StepResult r;
  ex.forward(view(in.x), forced, r);
  ex.backward(view(in.d_out), r);
  return r;
}

}  // namespace hpmoe::testing
