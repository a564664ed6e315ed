#pragma once
// `hpmoe calibrate`: the simulator's CPU model measured on this machine, by
// running the kernels and the runtime itself (so it sits above both).
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hpmoe/config.hpp"

namespace hpmoe::sim {

// Microbenchmarks of this machine -> the cpu-local model.
struct CalibrateOptions {
  int workers = 2;
  bool quick = false;  // fewer repetitions (tests)
};
// A tile shape's calibrated rate from its rounds' rates (FLOP/s): the
// second-fastest (the only one for a single round). Interference on a
// shared machine only slows a round: on the VM of 2026-12-02, 81 of 1560
// rounds ran under 0.6x their shape's fastest, and a median of 5 would
// have set 10 of the 312 rates more than 20% low (it is misled by 3 slow
// rounds, the second-fastest by 4); one lucky round alone does not set it
// (bench/calibration_rounds.py).
double undisturbed_rate(std::vector<double> rounds);
// Each vector kind's rate in the runtime itself ("vector.by_kind"): layer c
// (one rank, Zipf-routed: experts of few rows and of many), forward and
// backward through the interleaved executor with its task trace on, as a
// layer runs them: rows written by one task and read by the next, GEMM
// tiles of the other workers beside them. Per step, a kind's counted bytes
// (the access table's traffic terms) over its tasks' summed run time; the
// median of `steps` steps after a warm-up.
nlohmann::json vector_kind_rates(const LayerConfig& c, int workers, int steps);
nlohmann::json calibrate(const CalibrateOptions&, const std::function<void(const std::string&)>& progress = {});

}  // namespace hpmoe::sim
