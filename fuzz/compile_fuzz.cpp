// libFuzzer target: the compiler itself. The input picks a small layer (ranks,
// nodes, tokens, experts, top-k, dtypes, exchange, lending, capacity), a
// placement (contiguous, round-robin or random, with an expert split over
// two ranks, or replicas that may fetch their weights and owners that need
// not be first homes), a machine (CPU or accelerator, put workers, tile sizes),
// a routing, a pass and a schedule policy. Whatever the layer validation
// refuses is skipped; anything the generator refuses must be an
// hpmoe::Error. Every program set it does produce must be proved safe by
// the whole-set check and by each rank's own check: a rejection aborts with
// the verifier's message. (A bug of this kind, forwards queued behind the
// backward's gate-gradient puts, made the per-node exchange's backward at EP
// 256 deadlock in the simulator while every test passed.)
#include <fuzzer/FuzzedDataProvider.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "compiler/taskflow.hpp"
#include "fuzz_cases.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/schedule.hpp"

using namespace hpmoe;
using hpmoe::fuzzing::layer_from;
using hpmoe::fuzzing::placement_from;

namespace {

taskflow::Machine machine_from(FuzzedDataProvider& in, std::string& spec) {
  const int tile_rows = 16 << in.ConsumeIntegralInRange<int>(0, 3), tile_cols = 32 << in.ConsumeIntegralInRange<int>(0, 2);
  spec = in.ConsumeBool() ? "cpu:" + std::to_string(in.ConsumeIntegralInRange<int>(1, 3))
                                      : "accel:" + std::to_string(in.ConsumeIntegralInRange<int>(1, 4)) + ":" +
                                            std::to_string(in.ConsumeIntegralInRange<int>(1, 4));
  spec += ":" + std::to_string(tile_rows) + "x" + std::to_string(tile_cols);
  taskflow::Machine m = taskflow::parse_machine(spec);
  if (spec.rfind("accel", 0) == 0) m.put_workers = in.ConsumeIntegralInRange<int>(0, 3);
  spec += ", " + std::to_string(m.put_workers) + " put workers";
  return m;
}

// Everything needed to compile the set again: the layer, placement, machine, routing, pass and policy.
struct Case {
  const LayerConfig& c;
  const ExpertPlacement& placement;
  std::string machine, routing;
  const char* pass;
  const char* policy;
};

[[noreturn]] void unsafe(const char* check, const std::string& error, const Case& k) {
  std::fprintf(stderr, "compiled programs rejected by the %s check: %s\nlayer %s\nplacement %s\nmachine %s, routing %s, %s, %s\n",
               check, error.c_str(), to_json(k.c).dump().c_str(), to_json(k.placement).dump().c_str(), k.machine.c_str(),
               k.routing.c_str(), k.pass, k.policy);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const LayerConfig c = layer_from(in);
  try {
    c.validate();
  } catch (const Error&) {
    return 0;  // not a layer: the config's own checks (and their fuzz target) cover it
  }
  try {
    const ExpertPlacement placement = placement_from(in, c);
    std::string machine;
    const taskflow::Machine m = machine_from(in, machine);
    const char* routings[] = {"uniform", "zipf:1.2", "hot:0.5", "balanced"};
    const char* routing = routings[in.ConsumeIntegralInRange<int>(0, 3)];
    const std::uint8_t seed = in.ConsumeIntegral<std::uint8_t>();
    const auto spec = parse_routing_spec(routing, seed);
    const auto ids = forced_selection(c, spec);
    std::vector<float> logits(static_cast<std::size_t>(c.total_tokens() * c.routed_experts), 0.0f);
    const auto routed = route<float>(c, logits, std::vector<float>(static_cast<std::size_t>(c.routed_experts), 0.0f), ids);
    auto counts = taskflow::routing_counts(c, routed);
    if (c.exchange == ExchangeMode::rank) counts.token_counts = taskflow::rank_token_counts(c, placement, counts, routed, m.tile_rows);
    const auto pass = in.ConsumeBool() ? taskflow::Pass::backward : taskflow::Pass::forward;
    const auto policy = static_cast<taskflow::Policy>(in.ConsumeIntegralInRange<int>(0, 4));
    const Case k{c, placement, machine, std::string(routing) + " seed " + std::to_string(seed),
                 pass == taskflow::Pass::forward ? "forward" : "backward", taskflow::name(policy)};
    const auto programs = taskflow::compile(c, placement, counts, m, pass, policy);
    if (const auto whole = taskflow::verify(programs); !whole.ok) unsafe("whole-set", whole.error, k);
    taskflow::Verifier verifier;
    for (const auto& p : programs)
      if (const auto own = verifier.verify_rank(p, c, placement, counts, m); !own.ok) unsafe("per-rank", own.error, k);
  } catch (const Error&) {
    // A placement, machine or routing the generator refuses, with a message: fine.
  }
  return 0;
}
