#pragma once
// Test helpers: a runtime step checked against the fp64 oracle under the
// step's own routing.
#include <string>
#include <vector>

#include "cli/run.hpp"
#include "hpmoe/reference.hpp"
#include "runtime/interleaved.hpp"

namespace hpmoe::testing {

// The oracle's options for a step's routing: its experts, what it kept, and
// its gate weights as the step rounded them (with the backward).
inline OracleOptions oracle_options_of(const StepResult& step) {
  OracleOptions oo;
  oo.forced_ids = step.routing.expert;
  oo.forced_kept = step.routing.kept;
  oo.dispatched_gates = step.routing.weight;
  oo.backward = true;
  return oo;
}

// out, dx, the router's gradient and the first `experts` experts' weight
// gradients of a step against the oracle's.
inline std::vector<Comparison> checks_against(const OracleResult& ref, const StepResult& step, DType dtype, std::size_t experts) {
  std::vector<Comparison> checks{compare("out", step.out.data, ref.out, dtype), compare("dx", step.grads.x.data, ref.dx, dtype),
                                 compare("router", step.grads.router.data, ref.d_router, dtype)};
  for (std::size_t e = 0; e < experts; ++e) {
    checks.push_back(compare("w1", step.grads.w1[e].data, ref.d_w1[e], dtype));
    checks.push_back(compare("w2", step.grads.w2[e].data, ref.d_w2[e], dtype));
  }
  return checks;
}

}  // namespace hpmoe::testing
