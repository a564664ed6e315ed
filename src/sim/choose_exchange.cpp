// --exchange auto: the exchange scheme a layer runs with, chosen by the
// simulator for the machine, EP, model and routing. Each scheme the layer
// allows is simulated as asked (forward, and backward where asked) and the
// fastest fused step wins; the report says which ran and what the others
// would have taken. The wire dtypes stay as given: auto never changes the
// layer's math, only how its rows travel.
#include <algorithm>
#include <cstdio>

#include "hpmoe/error.hpp"
#include "sim/sim.hpp"

namespace hpmoe::sim {

namespace {

double fused_seconds(const SimReport& r) {
  return r.forward.interleaved_s + (r.has_backward ? r.backward.interleaved_s : 0.0);
}

std::string scheme_name(const SimReport& r) {
  if (r.config.exchange == ExchangeMode::assignment) return "per assignment";
  return r.config.forwards() ? "per node" : "per rank";
}

std::string ms(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f ms", seconds * 1e3);
  return text;
}

}  // namespace

SimReport simulate_choosing_exchange(const MachineModel& m, const SimRequest& req) {
  std::vector<SimReport> runs;
  std::string refused;
  for (const ExchangeMode mode : {ExchangeMode::assignment, ExchangeMode::rank}) {
    SimRequest candidate = req;
    candidate.config.exchange = mode;
    try {
      runs.push_back(simulate(m, candidate));
    } catch (const Error& e) {  // a scheme this layer cannot take (a wire dtype it lacks) or that does not fit
      refused += std::string(refused.empty() ? "" : "; ") + (mode == ExchangeMode::assignment ? "per assignment" : "per rank") +
                 " not possible: " + e.what();
    }
  }
  if (runs.empty()) throw Error("--exchange auto: no exchange scheme fits this layer and machine: " + refused);
  const auto best = std::min_element(runs.begin(), runs.end(),
                                     [](const SimReport& a, const SimReport& b) { return fused_seconds(a) < fused_seconds(b); });
  std::string why = scheme_name(*best) + ", the fastest fused step predicted (" + ms(fused_seconds(*best)) +
                    (req.backward ? ", forward + backward" : ", forward") + ")";
  for (const SimReport& other : runs)
    if (&other != &*best) why += "; " + scheme_name(other) + " " + ms(fused_seconds(other));
  if (!refused.empty()) why += "; " + refused;
  SimReport chosen = std::move(*best);
  chosen.exchange_choice = why;
  return chosen;
}

}  // namespace hpmoe::sim
