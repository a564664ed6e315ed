#pragma once
// `hpmoe sweep`: the simulator over a grid of machines, models, EP degrees,
// tokens per rank, routings, schedules and machine-model parameters (a
// plausible range of an estimate), run in parallel over the cores, written
// as CSV, JSON and a markdown report (bench/sweep_plot.py draws them).
// Each point is one MoE layer (`hpmoe simulate`) or, with a step, a whole
// training step (`hpmoe step`).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "sim/step.hpp"

namespace hpmoe {

struct SweepRequest {
  std::vector<std::string> machines;   // names in machines/ or files
  std::vector<std::string> models;     // presets or layer config files
  std::vector<std::int64_t> ranks, tokens;
  std::vector<std::string> routings;
  std::vector<std::string> schedules;  // empty: each machine's default
  std::vector<std::string> lends;      // weights instead of tokens: off | auto | ROWS each (empty: the layer's own)
  // Machine-model fields varied, each over its values: a dotted path into
  // the model file ("put.in_flight"; "*" stands for every element of an
  // array: "matrix.tile_rates.*.efficiency"; "A+B": both fields together), a
  // value either a number or "xF", the file's value times F.
  std::vector<std::pair<std::string, std::vector<std::string>>> vary;
  // Applied to every model: --set fields, then these where given.
  std::vector<std::string> sets;
  std::optional<std::string> dtype, dispatch_dtype, exchange, combine_dtype;
  std::string placement = "contiguous";
  std::uint64_t seed = 1;
  bool backward = false, kernel_scope = false, optimizer_state = false;
  bool fp8_gemms = false;  // --gemm-dtype fp8
  // With a step (layers > 0): every point a whole training step of the
  // model, the step's MoE layer the point's (its `moe` is filled per point).
  std::optional<sim::StepRequest> step;
  int jobs = 0;  // points simulated at once (0: the machine's hardware threads)
};

struct SweepPoint {
  std::string machine, model, routing, schedule;  // schedule: as given, or the machine's default
  std::string lend;                               // as given ("" where the grid has no --lend)
  std::int64_t ranks = 0, tokens = 0;
  std::vector<std::string> vary_values;  // one per SweepRequest::vary
  LayerConfig config;                    // resolved
};

struct SweepRow {
  SweepPoint point;
  std::string error;  // what stopped this point (a layer that does not fit the machine's memory); empty: it ran
  sim::SimReport layer;
  std::optional<sim::StepReport> step;
};

// Every point of the grid, each layer resolved and checked: Error naming the
// point where one cannot be (experts that do not divide over the ranks, ...).
std::vector<SweepPoint> sweep_points(const SweepRequest&);
// The machine model of a point: the file with the point's varied fields set.
sim::MachineModel sweep_machine(const SweepRequest&, const SweepPoint&);
// --vary's pieces (sweep_vary.cpp): "PATH=V1,V2,..." split; a model file's
// JSON with each varied field set to its value (Error naming a path that
// leads to no number, or a value that is neither a number nor xF); the
// machine model so varied.
std::pair<std::string, std::vector<std::string>> parse_vary(const std::string& spec);
// The fields of one --vary's PATH: "A+B" varies A and B together.
std::vector<std::string> vary_fields(const std::string& paths);
nlohmann::json vary_machine_json(nlohmann::json model, const std::vector<std::pair<std::string, std::vector<std::string>>>& vary,
                                 const std::vector<std::string>& values);
sim::MachineModel varied_machine(const std::string& machine, const std::vector<std::pair<std::string, std::vector<std::string>>>& vary,
                                 const std::vector<std::string>& values);
// Points simulated at once (SweepRequest::jobs, at most the points).
std::size_t sweep_jobs(const SweepRequest&, const std::vector<SweepPoint>&);
// The host memory one point's simulation takes, estimated from its layer and
// machine model; check_sweep_memory refuses (one line) a sweep whose `jobs`
// largest points at once would not fit this machine.
double sweep_point_bytes(const sim::MachineModel&, const SweepPoint&, bool backward);
void check_sweep_memory(const SweepRequest&, const std::vector<SweepPoint>&);

// Simulates every point, `jobs` at once; `done(k, n)` after each.
std::vector<SweepRow> run_sweep(const SweepRequest&, const std::vector<SweepPoint>&,
                                const std::function<void(std::size_t, std::size_t)>& done = {});
// DIR/sweep.csv, DIR/sweep.json and DIR/report.md (`command`: how it was asked for).
void write_sweep(const std::string& dir, const SweepRequest&, const std::vector<SweepRow>&, const std::string& command);
std::string sweep_csv(const SweepRequest&, const std::vector<SweepRow>&);

}  // namespace hpmoe
