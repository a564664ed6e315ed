// libFuzzer target: the runtime, in process. The input picks a small layer
// and placement as the compiler's target does (fuzz/fuzz_cases.hpp), workers
// per rank, a schedule policy, a routing and whether the backward runs. The
// serialized schedule and the interleaved runtime then run the same step on
// the same weights and tokens: the output and, with the backward, every
// gradient must be bit-identical (the project's promise). What the
// executors refuse when they are built (with an hpmoe::Error) is skipped;
// a step of an accepted layer that fails (a verifier's rejection, the
// watchdog's hang) or differs aborts with the case.
#include <fuzzer/FuzzedDataProvider.h>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_cases.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/schedule.hpp"
#include "hpmoe/tensors.hpp"
#include "runtime/interleaved.hpp"

using namespace hpmoe;

namespace {

bool same(const Matrix& a, const Matrix& b) {
  return a.data.size() == b.data.size() &&
         (a.data.empty() || std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0);
}

// The first tensor of a step that differs between the two schedules, or "".
std::string first_difference(const StepResult& a, const StepResult& b, const LayerConfig& c, bool backward) {
  if (!same(a.out, b.out)) return "out";
  if (!backward) return "";
  if (!same(a.grads.x, b.grads.x)) return "grad x";
  if (!same(a.grads.router, b.grads.router)) return "grad router";
  if (c.shared_experts > 0 && (!same(a.grads.shared_w1, b.grads.shared_w1) || !same(a.grads.shared_w2, b.grads.shared_w2)))
    return "grad shared";
  if (a.grads.w1.size() != b.grads.w1.size()) return "grad w1 count";
  for (std::size_t e = 0; e < a.grads.w1.size(); ++e)
    if (!same(a.grads.w1[e], b.grads.w1[e]) || !same(a.grads.w2[e], b.grads.w2[e])) return "grad of expert " + std::to_string(e);
  return "";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const LayerConfig c = fuzzing::layer_from(in, 6, 40, 16);
  try {
    c.validate();
  } catch (const Error&) {
    return 0;
  }
  RuntimeOptions opt;
  std::string what;
  std::unique_ptr<InterleavedExecutor> serialized, interleaved;
  std::vector<std::int32_t> ids;
  std::uint8_t seed = 0;
  LayerWeights w;  // the executors read the caller's weights: they outlive them
  try {  // what the layer may refuse, with a message, before any step
    opt.placement = fuzzing::placement_from(in, c);
    opt.workers_per_rank = in.ConsumeIntegralInRange<int>(1, 2);
    opt.policy = static_cast<taskflow::Policy>(in.ConsumeIntegralInRange<int>(0, 4));
    opt.backward = in.ConsumeBool();
    opt.pin = false;
    opt.watchdog_seconds = 20;
    const char* routings[] = {"uniform", "zipf:1.2", "hot:0.5", "balanced"};
    const char* routing = routings[in.ConsumeIntegralInRange<int>(0, 3)];
    seed = in.ConsumeIntegral<std::uint8_t>();
    ids = forced_selection(c, parse_routing_spec(routing, seed));
    what = std::string("layer ") + to_json(c).dump() + "\nplacement " + to_json(opt.placement).dump() + "\nrouting " + routing +
           " seed " + std::to_string(seed) + ", " + std::to_string(opt.workers_per_rank) + " workers a rank, " +
           taskflow::name(opt.policy) + (opt.backward ? ", forward and backward" : ", forward");
    if (std::getenv("HPMOE_FUZZ_SAY")) std::fprintf(stderr, "%s\n", what.c_str());  // a crash's case, to reproduce it
    w = random_weights(c, seed + 1u);
    serialized = std::make_unique<InterleavedExecutor>(c, w, serialized_schedule(opt));
    interleaved = std::make_unique<InterleavedExecutor>(c, w, opt);
  } catch (const Error&) {
    return 0;
  }
  try {  // an accepted layer's step must run, and give the same bits both ways
    const LayerInputs inputs = random_inputs(c, seed + 2u);
    const StepResult a = serialized->step(inputs, ids);
    const StepResult b = interleaved->step(inputs, ids);
    if (const std::string differs = first_difference(a, b, c, opt.backward); !differs.empty()) {
      std::fprintf(stderr, "interleaved != serialized (%s)\n%s\n", differs.c_str(), what.c_str());
      std::abort();
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "a step of an accepted layer failed: %s\n%s\n", e.what(), what.c_str());
    std::abort();
  }
  return 0;
}
