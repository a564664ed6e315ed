// libFuzzer target: hpmoe sweep's --vary specs (PATH=V1,V2,...; dotted paths,
// * over arrays, A+B together, numbers or xF scales) applied to the H800
// model's JSON. Any input either is rejected with an hpmoe::Error, or gives
// models that read back and whose simulation of a small layer ends with
// finite, positive times; nothing else may happen. One spec per line.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli/sweep.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/routing.hpp"
#include "sim/sim.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const nlohmann::json h800 = hpmoe::sim::load_machine_json("h800");
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    std::vector<std::pair<std::string, std::vector<std::string>>> vary;
    std::stringstream lines(text);
    for (std::string line; std::getline(lines, line) && vary.size() < 4;) vary.push_back(hpmoe::parse_vary(line));
    std::vector<std::string> first;
    for (const auto& v : vary) first.push_back(v.second.front());
    const hpmoe::sim::MachineModel m = hpmoe::sim::machine_from_json(hpmoe::vary_machine_json(h800, vary, first));
    hpmoe::sim::SimRequest req;
    req.config = hpmoe::preset("tiny");
    req.config.ranks = 2;
    req.config.tokens_per_rank = 16;
    req.config.validate();
    req.routing = hpmoe::parse_routing_spec("uniform", 1);
    req.backward = true;
    const hpmoe::sim::SimReport r = hpmoe::sim::simulate(m, req);
    for (const double t : {r.forward.serialized_s, r.forward.interleaved_s, r.backward.serialized_s, r.backward.interleaved_s})
      if (!std::isfinite(t) || t <= 0) std::abort();
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
