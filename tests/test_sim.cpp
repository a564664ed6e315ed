#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "hpmoe/error.hpp"
#include "hpmoe/peak.hpp"
#include "hpmoe/sim.hpp"

using namespace hpmoe;
using namespace hpmoe::sim;
using taskflow::Program;
using taskflow::QueueClass;
using taskflow::Task;
using taskflow::TaskKind;

namespace {

// A machine with round figures: 1 TFLOP/s matrix units, 1 GB/s vector
// units, 1 GB/s links with 1 us latency, 0.5 us put issue, 0.25 us signal.
MachineModel round_machine(int matrix = 1, int vector = 2) {
  MachineModel m;
  m.name = "round";
  m.accelerator = true;
  m.matrix_units = matrix;
  m.vector_units = vector;
  m.workers = 0;
  m.tile_rates = {TileRate{64, 1024, 1e12, 2e12}};
  m.vector_bytes_per_s = 1e9;
  m.signal_latency_s = 0.25e-6;
  m.put_issue_s = 0.5e-6;
  m.ranks_per_node = 64;
  m.intra_bytes_per_s = 1e9;
  m.intra_latency_s = 1e-6;
  m.operator_launch_s = 10e-6;
  m.collective_sync_s = 20e-6;
  return m;
}

// A program skeleton for `ranks` ranks of the round machine: tasks are
// added to queues by hand.
struct Builder {
  std::vector<Program> programs;
  std::vector<std::vector<taskflow::TaskWork>> work;
  std::vector<std::vector<std::vector<std::int32_t>>> queues;  // [rank][worker] -> task ids

  Builder(int ranks, const MachineModel& m) : programs(static_cast<std::size_t>(ranks)), work(programs.size()), queues(programs.size()) {
    for (int r = 0; r < ranks; ++r) {
      programs[r].rank = r;
      programs[r].ranks = ranks;
      programs[r].machine = m.compiler_machine();
      queues[r].resize(static_cast<std::size_t>(programs[r].machine.workers()));
    }
  }
  // Adds a task to rank r's worker w; returns its id.
  std::int32_t add(int r, int w, TaskKind kind, double units, std::int32_t rows = 64, std::int32_t cols = 64,
                   std::int32_t wait = -1, std::int32_t count = 0, std::int32_t trigger = -1, std::int32_t peer = -1) {
    Task t{};
    t.kind = kind;
    t.queue = taskflow::queue_class(kind);
    t.expert = -1;
    t.peer = peer < 0 ? r : peer;
    t.rows = rows;
    t.cols = cols;
    t.wait_event = wait;
    t.wait_count = count;
    t.trigger_event = trigger;
    auto& p = programs[r];
    p.tasks.push_back(t);
    p.cost.push_back(0);
    // `units`: FLOPs of a GEMM tile, bytes otherwise.
    work[r].push_back(t.queue == taskflow::QueueClass::matrix
                          ? taskflow::TaskWork{units, 0, std::llround(units / (2.0 * rows * cols))}
                          : taskflow::TaskWork{0, units, 0});
    const auto id = static_cast<std::int32_t>(p.tasks.size() - 1);
    queues[r][static_cast<std::size_t>(w)].push_back(id);
    return id;
  }
  void event(int r, std::int32_t required) { programs[r].events.push_back(taskflow::Event{required, TaskKind::swiglu, -1, -1}); }
  const std::vector<Program>& done() {
    for (std::size_t r = 0; r < programs.size(); ++r) {
      auto& p = programs[r];
      p.queue_begin = {0};
      for (const auto& q : queues[r]) {
        p.queue_tasks.insert(p.queue_tasks.end(), q.begin(), q.end());
        p.queue_begin.push_back(static_cast<std::int32_t>(p.queue_tasks.size()));
      }
    }
    return programs;
  }
};

}  // namespace

TEST(Simulator, OneGemmTile) {
  const MachineModel m = round_machine();
  Builder b(1, m);
  b.add(0, 0, TaskKind::gemm_gate_up, 2.0 * 64 * 64 * 1024);  // 8.4 MFLOP at 1 TFLOP/s
  const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, false);
  EXPECT_DOUBLE_EQ(t.makespan, 2.0 * 64 * 64 * 1024 / 1e12);
  EXPECT_DOUBLE_EQ(simulate_interleaved(m, b.programs, b.work, DType::bf16, false).makespan, 2.0 * 64 * 64 * 1024 / 2e12);
}

TEST(Simulator, OnePutOverOneLink) {
  // Rank 0 puts 1000 bytes into rank 1, whose vector task waits for them.
  const MachineModel m = round_machine();
  Builder b(2, m);
  b.event(1, 1);
  b.add(0, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
  b.add(1, 1, TaskKind::swiglu, 500, 1, 64, 0, 1);
  const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, false);
  // issue 0.5 us, 1000 B at 1 GB/s = 1 us, latency 1 us, signal 0.25 us, 500 B at 1 GB/s = 0.5 us.
  EXPECT_NEAR(t.makespan, 0.5e-6 + 1e-6 + 1e-6 + 0.25e-6 + 0.5e-6, 1e-15);
}

TEST(Simulator, TwoPutsShareALink) {
  // Two vector units of rank 0 put 1000 bytes each into rank 1 at once: the
  // receiver's port is shared, so both finish after 2000 bytes' time.
  const MachineModel m = round_machine();
  Builder b(2, m);
  b.event(1, 2);
  b.add(0, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
  b.add(0, 2, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
  b.add(1, 1, TaskKind::swiglu, 0, 1, 64, 0, 2);
  const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, false);
  EXPECT_NEAR(t.makespan, 0.5e-6 + 2e-6 + 1e-6 + 0.25e-6, 1e-15);
  // From two senders into one receiver: the receiver's port is the shared one.
  Builder c(3, m);
  c.event(2, 2);
  c.add(0, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 2);
  c.add(1, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 2);
  c.add(2, 1, TaskKind::swiglu, 0, 1, 64, 0, 2);
  EXPECT_NEAR(simulate_interleaved(m, c.done(), c.work, DType::fp32, false).makespan, 0.5e-6 + 2e-6 + 1e-6 + 0.25e-6, 1e-15);
}

TEST(Simulator, ChainAcrossUnits) {
  // GEMM (matrix unit) -> SwiGLU (vector unit) -> GEMM: durations plus two signals.
  const MachineModel m = round_machine();
  Builder b(1, m);
  b.event(0, 1);
  b.event(0, 1);
  const double flops = 2.0 * 64 * 64 * 1024;
  b.add(0, 0, TaskKind::gemm_gate_up, flops, 64, 64, -1, 0, 0);
  b.add(0, 1, TaskKind::swiglu, 2000, 64, 64, 0, 1, 1);
  b.add(0, 0, TaskKind::gemm_down, flops, 64, 64, 1, 1);
  const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, false);
  EXPECT_NEAR(t.makespan, flops / 1e12 + 0.25e-6 + 2e-6 + 0.25e-6 + flops / 1e12, 1e-15);
  EXPECT_NEAR(t.matrix_busy, 2 * flops / 1e12, 1e-15);
  EXPECT_NEAR(t.vector_busy, 2e-6, 1e-15);
}

TEST(Simulator, SerializedPaysOperatorsAndSync) {
  // One rank: dispatch (permute + all-to-all), a GEMM, nothing else.
  const MachineModel m = round_machine();
  Builder b(1, m);
  b.add(0, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, -1, 0);
  const double flops = 2.0 * 64 * 64 * 1024;
  b.add(0, 0, TaskKind::gemm_gate_up, flops);
  const auto t = simulate_serialized(m, b.done(), b.work, DType::fp32, false);
  // permute 1 us | launch 10 | put issue 0.5 + copy 0 (own rank: no link) | sync 20 | launch 10 | GEMM
  EXPECT_NEAR(t.makespan, 1e-6 + 10e-6 + 0.5e-6 + 20e-6 + 10e-6 + flops / 1e12, 1e-15);
}

TEST(Simulator, MeshRoutesXYAndSharesLinks) {
  MachineModel m = round_machine();
  m.mesh_cols = 2;  // ranks 0 1 / 2 3
  m.mesh_link_bytes_per_s = 1e9;
  m.mesh_hop_latency_s = 1e-6;
  // 0 -> 3 takes 2 hops (east, then south); 1 -> 3 one hop (south) sharing the 1->3 link.
  Builder b(4, m);
  b.event(3, 2);
  b.add(0, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 3);
  b.add(1, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 3);
  b.add(3, 1, TaskKind::swiglu, 0, 1, 64, 0, 2);
  const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, false);
  // Both share link 1->3: 2 us of bytes; the 2-hop one lands last (2 us latency).
  EXPECT_NEAR(t.makespan, 0.5e-6 + 2e-6 + 2e-6 + 0.25e-6, 1e-15);
}

TEST(Simulator, CompiledLayerIsDeterministicAndInterleavingHelpsWhenCommunicationBound) {
  const MachineModel m = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json");
  SimRequest req;
  req.config = preset("deepseek-v3");
  req.config.ranks = 8;
  req.config.tokens_per_rank = 256;
  req.config.dtype = DType::bf16;
  req.routing = parse_routing_spec("uniform", 1);
  req.backward = true;
  const SimReport a = simulate(m, req), b = simulate(m, req);
  EXPECT_EQ(a.forward.interleaved_s, b.forward.interleaved_s);
  EXPECT_EQ(a.backward.serialized_s, b.backward.serialized_s);
  EXPECT_GT(a.forward.serialized_s / a.forward.interleaved_s, 1.0);
  EXPECT_GT(a.forward.serialized_exposed_comm, a.forward.interleaved_exposed_comm);
  EXPECT_GT(a.forward.tasks, 0);
}

TEST(Simulator, RejectsBadModels) {
  const auto good = nlohmann::json::parse(std::ifstream(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json"));
  EXPECT_NO_THROW(machine_from_json(good));
  auto expect_error = [&](nlohmann::json j, const std::string& says) {
    try {
      machine_from_json(j);
      ADD_FAILURE() << "accepted a bad model; expected an error saying " << says;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
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
