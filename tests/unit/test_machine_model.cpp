// Machine models as files: what the loader refuses (each field named),
// what calibration measures into a model, and the peak a model carries.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "source_dir.hpp"
#include "hpmoe/error.hpp"
#include "kernels/peak.hpp"
#include "cli/calibrate.hpp"
#include "sim/sim.hpp"

using namespace hpmoe;
using namespace hpmoe::sim;
using taskflow::TaskKind;

// Calibration of the vector kinds: every vector kind of a layer's forward
// and backward gets a positive rate, and the rates read back as a model's.
// A shape's rate is its second-fastest round: slow rounds (interference)
// and one lucky round do not set it.
TEST(Calibrate, TileRateIsTheSecondFastestRound) {
  EXPECT_EQ(undisturbed_rate({166e9, 174e9, 89e9, 70e9, 170e9}), 170e9);  // two rounds at half speed
  EXPECT_EQ(undisturbed_rate({60e9, 65e9, 150e9, 70e9, 55e9}), 70e9);     // one fast round alone is not taken
  EXPECT_EQ(undisturbed_rate({120e9}), 120e9);
  EXPECT_THROW(undisturbed_rate({}), Error);
}

TEST(Calibrate, EveryVectorKindOfALayerGetsItsRate) {
  LayerConfig c = preset("tiny");
  c.tokens_per_rank = 64;
  const nlohmann::json by_kind = vector_kind_rates(c, 2, 1);
  for (const char* kind : {"swiglu", "combine_reduce", "shared_swiglu", "gate_grad", "router_bwd", "pack_down_grad",
                           "swiglu_bwd", "pack_gate_up_grad", "grad_reduce"}) {
    ASSERT_TRUE(by_kind.contains(kind)) << kind;
    EXPECT_GT(by_kind[kind].get<double>(), 0.0) << kind;
  }
  for (const auto& [kind, rate] : by_kind.items()) EXPECT_FALSE(kind.find("put") != std::string::npos) << kind;
  auto model = nlohmann::json::parse(std::ifstream(std::string(HPMOE_SOURCE_DIR) + "/machines/cpu-local.json"));
  model["vector"]["by_kind"] = by_kind;
  const MachineModel m = machine_from_json(model);
  EXPECT_EQ(m.vector_rate(TaskKind::gate_grad), by_kind["gate_grad"].get<double>());
}

namespace {
// The loader refuses `j` with an error that says `says`.
void expect_error(const nlohmann::json& j, const std::string& says) {
  try {
    machine_from_json(j);
    ADD_FAILURE() << "accepted a bad model; expected an error saying " << says;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(Simulator, RejectsBadModels) {
  const auto good = nlohmann::json::parse(std::ifstream(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json"));
  EXPECT_NO_THROW(machine_from_json(good));
  auto j = good;
  j.erase("vector");
  expect_error(j, "vector.bytes_per_s");
  j = good;
  j["units"]["matrix"] = 0;
  expect_error(j, "units.matrix");
  j = good;
  j["kind"] = "quantum";
  expect_error(j, "kind");
  j = good;
  j["links"]["intra"]["bytes_per_s"] = "fast";
  expect_error(j, "links.intra.bytes_per_s");
  j = good;
  j["matrix"]["tile_rates"] = nlohmann::json::array();
  expect_error(j, "tile_rates");
  j = good;
  j.erase("sources");
  expect_error(j, "sources");
  j = good;
  j["sources"]["links"] = 42;
  expect_error(j, "sources.links");
  j = good;
  j["put"]["engine"] = "pigeon";
  expect_error(j, "put.engine");
  j = good;
  j["put"]["in_flight"] = 1000;
  j["put"]["engine"] = "vector";
  expect_error(j, "put.in_flight");
  j = good;
  j["put"].erase("in_flight");  // an accelerator must bound its puts
  expect_error(j, "put.in_flight");
  j = good;
  j["put"]["receive"] = {{"per_put_s", 1e-6}, {"bytes_per_s", 1e9}};
  expect_error(j, "put.receive");
  j = good;
  j["put"]["stream_per_peer"] = true;  // an accelerator's DMA puts
  expect_error(j, "put.stream_per_peer");
  j = good;
  j["put"]["engine"] = "cpu";
  j["put"].erase("in_flight");
  j["put"]["stream_per_peer"] = 1;
  expect_error(j, "put.stream_per_peer");
  j = good;
  j["units"]["matrix_runs_vector"] = "yes";
  expect_error(j, "units.matrix_runs_vector");
  j = nlohmann::json::parse(std::ifstream(std::string(HPMOE_SOURCE_DIR) + "/machines/cpu-local.json"));
  j["units"]["matrix_runs_vector"] = true;  // a CPU's workers take both classes already
  expect_error(j, "units.matrix_runs_vector");
  j = good;
  j["links"]["intra"]["by_ep"] = {{{"ranks", 16}, {"bytes_per_s", 1e11}}, {{"ranks", 8}, {"bytes_per_s", 1e11}}};
  expect_error(j, "by_ep.1.ranks");
  j = good;
  j["vector"]["by_kind"] = {{"gemm_down", 1e10}};  // a matrix kind
  expect_error(j, "vector.by_kind.gemm_down");
  j["vector"]["by_kind"] = {{"dispatch_put", 1e10}};  // a put: its copy has its own rate
  expect_error(j, "vector.by_kind.dispatch_put");
  j["vector"]["by_kind"] = {{"swiglu", -1}};
  expect_error(j, "vector.by_kind.swiglu");
  j["vector"]["by_kind"] = 7;
  expect_error(j, "vector.by_kind");
  j = good;
  j["baselines"]["deepep"]["fp8_dispatch"] = "yes";
  expect_error(j, "fp8_dispatch");
  j = good;
  j["baselines"]["mindspore"] = {{"host_sync_s", -1}};
  expect_error(j, "baselines.mindspore.host_sync_s");
  // Written back, a model reads the same (engine, bounds, rates by EP, baselines).
  const MachineModel a3 = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/ascend-a3.json");
  EXPECT_EQ(a3.put_engine, PutEngine::vector);
  EXPECT_GT(a3.put_in_flight, 0);
  auto back = to_json(a3);
  back["sources"] = {{"all", "test"}};
  const MachineModel again = machine_from_json(back);
  EXPECT_EQ(again.put_engine, a3.put_engine);
  EXPECT_EQ(again.put_in_flight, a3.put_in_flight);
  EXPECT_EQ(again.intra_rate(32), a3.intra_rate(32));
  const MachineModel h800 = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json");
  EXPECT_TRUE(h800.deepep.enabled);
  // Every accelerator bounds its puts, and runs ratr by default; CPUs run critical-path.
  for (const char* name : {"ascend-a3", "h800", "h200", "nmp-mesh"}) {
    const MachineModel m = load_machine(name);
    EXPECT_GT(m.put_in_flight, 0) << name;
    EXPECT_EQ(default_policy(m), taskflow::Policy::ratr) << name;
  }
  EXPECT_EQ(default_policy(load_machine("cpu-local")), taskflow::Policy::critical_path);
  const MachineModel h800_again = machine_from_json([&] { auto h = to_json(h800); h["sources"] = {{"all", "test"}}; return h; }());
  EXPECT_EQ(h800_again.serialized_matrix_units, 132);
  // A GPU's SMs run vector code; Ascend's cube cores do not.
  EXPECT_TRUE(h800.matrix_runs_vector && h800_again.matrix_runs_vector && h800.compiler_machine().matrix_runs_vector);
  EXPECT_FALSE(a3.matrix_runs_vector || again.matrix_runs_vector || a3.compiler_machine().matrix_runs_vector);
  MachineModel cpu = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/cpu-local.json");
  cpu.put_stream_per_peer = true;
  EXPECT_TRUE(machine_from_json([&] { auto c = to_json(cpu); c["sources"] = {{"all", "test"}}; return c; }()).put_stream_per_peer);
  cpu.vector_kind_bytes_per_s[static_cast<std::size_t>(TaskKind::router_bwd)] = 3e9;
  const MachineModel cpu_again = machine_from_json([&] { auto c = to_json(cpu); c["sources"] = {{"all", "test"}}; return c; }());
  EXPECT_EQ(cpu_again.vector_rate(TaskKind::router_bwd), 3e9);
  EXPECT_EQ(cpu_again.vector_rate(TaskKind::swiglu), cpu.vector_bytes_per_s);
  EXPECT_THROW(load_machine("/nonexistent/model.json"), Error);
}

// The FMA peak: measured on this core, named by ISA and CPU, and carried by
// CPU machine models (hpmoe calibrate writes it; older models have none).
TEST(Peak, MeasuredAndCarriedByTheMachineModel) {
  const auto p = measure_fma_peak(0.005, 2);
  EXPECT_GT(p.fp32_flops_per_core, 1e8);
  EXPECT_FALSE(p.isa.empty());
  EXPECT_FALSE(p.cpu.empty());
  EXPECT_EQ(p.bf16_flops_per_core > 0, !p.bf16_isa.empty());
  // AMX tiles, where measured, do 16 x 16 x 32 products an instruction: far
  // above the AVX512-BF16 dot products of the same CPU.
  if (p.amx_bf16_flops_per_core > 0) {
    EXPECT_GT(p.amx_bf16_flops_per_core, 2 * p.bf16_flops_per_core);
  }
  EXPECT_GE(p.bf16_tile_peak_per_core(), p.bf16_flops_per_core);
  auto model = sim::load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/cpu-local.json");
  model.fma_peak_fp32_per_core = p.fp32_flops_per_core;
  model.cpu = p.cpu;
  auto j = sim::to_json(model);
  j["sources"] = {{"peak", "test"}};
  const auto back = sim::machine_from_json(j);
  EXPECT_DOUBLE_EQ(back.fma_peak_fp32_per_core, p.fp32_flops_per_core);
  EXPECT_EQ(back.cpu, p.cpu);
  j["peak"]["fp32_fma_flops_per_core"] = -1;
  EXPECT_THROW(sim::machine_from_json(j), Error);
}

// GEMM efficiency as an explicit field (issue 42, item 1): a tile class's
// rate is its share of the unit's peak, for every precision the peak gives;
// fp8 rates where the peak has one (item 4).
TEST(MachineModel, TileRatesAsAShareOfThePeak) {
  const MachineModel h800 = load_machine("h800");
  ASSERT_GT(h800.peak_bf16_flops, 0);
  for (const auto& r : h800.tile_rates) {
    EXPECT_GT(r.efficiency, 0.1);
    EXPECT_LT(r.efficiency, 0.8);
    EXPECT_DOUBLE_EQ(r.bf16_flops, r.efficiency * h800.peak_bf16_flops);
    EXPECT_DOUBLE_EQ(r.fp32_flops, r.efficiency * h800.peak_fp32_flops);
    EXPECT_DOUBLE_EQ(r.fp8_flops, r.efficiency * h800.peak_fp8_flops);
  }
  EXPECT_TRUE(h800.has_fp8());
  const MachineModel fp8 = h800.with_fp8_gemms();
  EXPECT_NEAR(fp8.gemm_seconds(128, 256, 7168, DType::bf16),
              h800.gemm_seconds(128, 256, 7168, DType::bf16) * h800.peak_bf16_flops / h800.peak_fp8_flops, 1e-15);
  // The A3 die's cubes have no fp8 format: asked for, it is an error naming the field.
  const MachineModel a3 = load_machine("ascend-a3");
  EXPECT_FALSE(a3.has_fp8());
  try {
    (void)a3.with_fp8_gemms();
    ADD_FAILURE() << "the A3 model gave fp8 rates";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("matrix.peak.fp8_flops"), std::string::npos) << e.what();
  }
  // The model written back as JSON reads back the same.
  const MachineModel again = machine_from_json(to_json(h800));
  ASSERT_EQ(again.tile_rates.size(), h800.tile_rates.size());
  EXPECT_DOUBLE_EQ(again.tile_rates[0].bf16_flops, h800.tile_rates[0].bf16_flops);
  EXPECT_DOUBLE_EQ(again.tile_rates[0].fp8_flops, h800.tile_rates[0].fp8_flops);
}

TEST(MachineModel, EfficiencyFieldsAreChecked) {
  const auto good = nlohmann::json::parse(std::ifstream(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json"));
  auto j = good;
  j["matrix"]["tile_rates"][0]["efficiency"] = 1.5;  // above the peak
  expect_error(j, "matrix.tile_rates.0.efficiency");
  j = good;
  j["matrix"]["tile_rates"][0]["efficiency"] = 0;
  expect_error(j, "matrix.tile_rates.0.efficiency");
  j = good;
  j["matrix"]["tile_rates"][0]["bf16_flops"] = 1e12;  // both forms at once
  expect_error(j, "gives both");
  j = good;
  j["matrix"].erase("peak");
  expect_error(j, "matrix.peak");
  j = good;
  j["matrix"]["peak"]["bf16_flops"] = -1;
  expect_error(j, "matrix.peak.bf16_flops");
  j = good;
  j["matrix"]["peak"]["fp4_flops"] = 1e15;  // a typo or an unknown precision
  expect_error(j, "matrix.peak.fp4_flops");
}

TEST(Simulator, Fp8GemmsNeedABf16LayerAndAMachineThatHasThem) {
  SimRequest req;
  req.config = preset("tiny");
  req.config.set("ranks", "2");
  req.config.set("tokens_per_rank", "128");
  req.config.set("dtype", "bf16");
  req.fp8_gemms = true;
  const MachineModel h800 = load_machine("h800");
  const SimReport fp8 = simulate(h800, req);
  req.fp8_gemms = false;
  const SimReport bf16 = simulate(h800, req);
  EXPECT_LE(fp8.forward.serialized_s, bf16.forward.serialized_s);
  EXPECT_TRUE(fp8.fp8_gemms);
  req.fp8_gemms = true;
  EXPECT_THROW(simulate(load_machine("ascend-a3"), req), Error);
  req.config.set("dtype", "fp32");
  EXPECT_THROW(simulate(h800, req), Error);
}
