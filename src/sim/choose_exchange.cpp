// --exchange auto: the exchange scheme a layer runs with, chosen by the
// simulator for the machine, EP, model and routing. Each scheme the layer
// allows is simulated as asked (forward, and backward where asked) and the
// fastest fused step wins; the report says which ran and what the others
// would have taken. The wire dtypes stay as given unless the caller leaves
// the dispatch's to the choice too (--dispatch-dtype auto: the user accepts
// a narrower wire, bf16 or fp8, where it is faster); otherwise auto never
// changes the layer's math, only how its rows travel.
#include <algorithm>
#include <cstdio>

#include "hpmoe/error.hpp"
#include "sim/sim.hpp"

namespace hpmoe::sim {

namespace {

double fused_seconds(const SimReport& r) {
  return r.forward.interleaved_s + (r.has_backward ? r.backward.interleaved_s : 0.0);
}

std::string scheme_name(const SimReport& r, bool with_dispatch) {
  std::string name = r.config.exchange == ExchangeMode::assignment ? "per assignment" : r.config.forwards() ? "per node" : "per rank";
  if (with_dispatch) name += std::string(" with ") + to_string(r.config.dispatch_dtype) + " dispatch";
  return name;
}

std::string ms(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f ms", seconds * 1e3);
  return text;
}

}  // namespace

SimReport simulate_choosing_exchange(const MachineModel& m, const SimRequest& req) {
  std::vector<ExchangeMode> schemes{req.config.exchange};
  if (req.choose_scheme) schemes = {ExchangeMode::assignment, ExchangeMode::rank};
  std::vector<DispatchDType> dispatch{req.config.dispatch_dtype};
  if (req.choose_dispatch_dtype) {
    dispatch = {DispatchDType::layer};
    if (req.config.dtype == DType::fp32) dispatch.push_back(DispatchDType::bf16);
    dispatch.push_back(DispatchDType::fp8);
  }
  std::vector<SimReport> runs;
  std::string refused;
  for (const ExchangeMode mode : schemes)
    for (const DispatchDType wire : dispatch) {
      SimRequest candidate = req;
      candidate.config.exchange = mode;
      candidate.config.dispatch_dtype = wire;
      try {
        candidate.config.validate();
        runs.push_back(simulate(m, candidate));
      } catch (const Error& e) {  // a scheme or wire this layer cannot take, or that does not fit
        std::string name = mode == ExchangeMode::assignment ? "per assignment" : "per rank";
        if (req.choose_dispatch_dtype) name += std::string(" with ") + to_string(wire) + " dispatch";
        refused += std::string(refused.empty() ? "" : "; ") + name + " not possible: " + e.what();
      }
    }
  const char* what = req.choose_scheme && req.choose_dispatch_dtype ? "--exchange auto --dispatch-dtype auto"
                     : req.choose_scheme                            ? "--exchange auto"
                                                                    : "--dispatch-dtype auto";
  if (runs.empty()) throw Error(std::string(what) + ": no exchange fits this layer and machine: " + refused);
  const auto best = std::min_element(runs.begin(), runs.end(),
                                     [](const SimReport& a, const SimReport& b) { return fused_seconds(a) < fused_seconds(b); });
  const bool wire = req.choose_dispatch_dtype;
  std::string why = scheme_name(*best, wire) + ", the fastest fused step predicted (" + ms(fused_seconds(*best)) +
                    (req.backward ? ", forward + backward" : ", forward") + ")";
  for (const SimReport& other : runs)
    if (&other != &*best) why += "; " + scheme_name(other, wire) + " " + ms(fused_seconds(other));
  if (!refused.empty()) why += "; " + refused;
  SimReport chosen = std::move(*best);
  chosen.exchange_choice = why;
  return chosen;
}

}  // namespace hpmoe::sim
