// hpmoe sweep (cli/sweep.hpp): the grid, the varied machine fields, the
// parallel run, and the rows of points that cannot run.
#include <gtest/gtest.h>

#include <sstream>

#include "cli/sweep.hpp"
#include "hpmoe/error.hpp"

using namespace hpmoe;

namespace {

SweepRequest small_grid() {
  SweepRequest req;
  req.machines = {"ascend-a3", "h800"};
  req.models = {"tiny"};
  req.ranks = {2, 4};
  req.tokens = {64};
  req.routings = {"uniform", "zipf:1.2"};
  req.backward = true;
  return req;
}

// The CSV without its last column (the host's simulation time).
std::string without_timing(const std::string& csv) {
  std::istringstream in(csv);
  std::string out;
  for (std::string line; std::getline(in, line);) out += line.substr(0, line.rfind(',')) + "\n";
  return out;
}

std::string error_of(const SweepRequest& req) {
  try {
    (void)sweep_points(req);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Sweep, TheGridIsEveryCombination) {
  SweepRequest req = small_grid();
  req.schedules = {"ratr", "critical-path"};
  req.vary = {{"put.in_flight", {"4", "16", "x2"}}};
  const auto points = sweep_points(req);
  ASSERT_EQ(points.size(), 2u * 2 * 2 * 2 * 3);
  EXPECT_EQ(points.front().machine, "ascend-a3");
  EXPECT_EQ(points.front().vary_values, std::vector<std::string>{"4"});
  EXPECT_EQ(points.front().config.ranks, 2);
  // Without --schedule each machine runs its default policy.
  const auto defaults = sweep_points(small_grid());
  EXPECT_EQ(defaults.size(), 8u);
  EXPECT_EQ(defaults.front().schedule, "ratr");
}

TEST(Sweep, VariedFieldsSetOrScaleTheModelsValue) {
  SweepRequest req = small_grid();
  req.vary = {{"put.in_flight", {"5"}}, {"matrix.tile_rates.*.efficiency", {"x0.5"}}};
  const auto points = sweep_points(req);
  const sim::MachineModel base = sim::load_machine(points.front().machine);
  const sim::MachineModel varied = sweep_machine(req, points.front());
  EXPECT_EQ(varied.put_in_flight, 5);
  ASSERT_EQ(varied.tile_rates.size(), base.tile_rates.size());
  for (std::size_t i = 0; i < base.tile_rates.size(); ++i) {
    EXPECT_DOUBLE_EQ(varied.tile_rates[i].efficiency, 0.5 * base.tile_rates[i].efficiency);
    EXPECT_DOUBLE_EQ(varied.tile_rates[i].bf16_flops, 0.5 * base.tile_rates[i].bf16_flops);
    EXPECT_DOUBLE_EQ(varied.tile_rates[i].fp32_flops, 0.5 * base.tile_rates[i].fp32_flops);
  }
}

TEST(Sweep, FieldsJoinedByPlusVaryTogether) {
  SweepRequest req = small_grid();
  req.machines = {"ascend-a3"};
  req.vary = {{"links.intra.bytes_per_s+links.intra.by_ep.*.bytes_per_s", {"x2"}}};
  const auto points = sweep_points(req);
  const sim::MachineModel base = sim::load_machine("ascend-a3");
  const sim::MachineModel varied = sweep_machine(req, points.front());
  EXPECT_DOUBLE_EQ(varied.intra_bytes_per_s, 2 * base.intra_bytes_per_s);
  ASSERT_FALSE(base.intra_by_ep.empty());
  EXPECT_DOUBLE_EQ(varied.intra_by_ep.back().bytes_per_s, 2 * base.intra_by_ep.back().bytes_per_s);
  req.vary = {{"put.in_flight+", {"2"}}};
  EXPECT_NE(error_of(req).find("empty field path"), std::string::npos);
}

TEST(Sweep, BadGridsAreRefusedNamingWhatIsWrong) {
  SweepRequest req = small_grid();
  req.vary = {{"put.nope", {"1"}}};
  EXPECT_NE(error_of(req).find("no field 'nope'"), std::string::npos);
  req.vary = {{"put", {"1"}}};
  EXPECT_NE(error_of(req).find("not a number"), std::string::npos);
  req.vary = {{"put.in_flight", {"-2"}}};
  EXPECT_NE(error_of(req).find("put.in_flight"), std::string::npos);
  req.vary = {{"put.in_flight", {"x"}}};
  EXPECT_NE(error_of(req).find("xF"), std::string::npos);
  req = small_grid();
  req.models = {"no-such-model"};
  EXPECT_NE(error_of(req).find("neither a preset"), std::string::npos);
  req = small_grid();
  req.ranks = {16};  // tiny has 8 experts
  EXPECT_NE(error_of(req).find("-P 16"), std::string::npos);
  req = small_grid();
  req.routings.clear();
  EXPECT_NE(error_of(req).find("--routing"), std::string::npos);
}

TEST(Sweep, InParallelItGivesTheSameRowsAsOneAtATime) {
  SweepRequest req = small_grid();
  const auto points = sweep_points(req);
  req.jobs = 1;
  const auto one = run_sweep(req, points);
  req.jobs = 3;
  std::size_t calls = 0;
  const auto three = run_sweep(req, points, [&](std::size_t k, std::size_t n) {
    ++calls;
    EXPECT_LE(k, n);
  });
  EXPECT_EQ(calls, points.size());
  EXPECT_EQ(without_timing(sweep_csv(req, one)), without_timing(sweep_csv(req, three)));
  for (const auto& row : one) {
    EXPECT_TRUE(row.error.empty()) << row.error;
    EXPECT_GT(row.layer.forward.interleaved_s, 0);
    EXPECT_GT(row.layer.backward.serialized_s, 0);
  }
}

TEST(Sweep, APointThatCannotRunIsARowWithItsReason) {
  SweepRequest req = small_grid();
  req.machines = {"h800"};
  req.models = {"deepseek-v3"};
  req.ranks = {8};
  req.tokens = {32768};  // forward and backward do not fit 80 GB a rank
  req.routings = {"uniform"};
  const auto rows = run_sweep(req, sweep_points(req));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_NE(rows[0].error.find("GB short"), std::string::npos) << rows[0].error;
  const std::string csv = sweep_csv(req, rows);
  EXPECT_NE(csv.find("GB short"), std::string::npos);
}

TEST(Sweep, WithLayersEveryPointIsAWholeStep) {
  SweepRequest req = small_grid();
  req.machines = {"h800"};
  req.ranks = {2};
  req.routings = {"uniform"};
  sim::StepRequest step;
  step.layers = 4;
  step.dense_layers = 1;
  req.step = step;
  const auto rows = run_sweep(req, sweep_points(req));
  ASSERT_EQ(rows.size(), 1u);
  ASSERT_TRUE(rows[0].step.has_value()) << rows[0].error;
  EXPECT_EQ(rows[0].step->request.layers, 4);
  const std::string csv = sweep_csv(req, rows);
  EXPECT_NE(csv.find("step_fused_micro_ms"), std::string::npos);
  EXPECT_NE(csv.find("DeepEP-style"), std::string::npos);
}
