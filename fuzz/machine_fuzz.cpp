// libFuzzer target: machine models (simulate --machine FILE.json). Any input
// either is rejected with an hpmoe::Error, or gives a model whose
// simulation of a small layer, forward and backward, ends with finite,
// positive times (an absurd figure once made them inf or NaN and broke the
// event loop); nothing else may happen.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"
#include "hpmoe/routing.hpp"
#include "sim/sim.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const hpmoe::sim::MachineModel m = hpmoe::sim::machine_from_json(hpmoe::parse_json(text, "fuzz"));
    hpmoe::sim::SimRequest req;
    req.config = hpmoe::preset("tiny");
    req.config.ranks = 4;
    req.config.tokens_per_rank = 16;
    req.config.validate();
    req.routing = hpmoe::parse_routing_spec("zipf:1.2", 1);
    req.backward = true;
    const hpmoe::sim::SimReport r = hpmoe::sim::simulate(m, req);
    for (const double t : {r.forward.serialized_s, r.forward.interleaved_s, r.backward.serialized_s,
                           r.backward.interleaved_s})
      if (!std::isfinite(t) || t <= 0) std::abort();
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
