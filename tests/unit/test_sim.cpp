#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "source_dir.hpp"
#include "hpmoe/error.hpp"
#include "sim/sim.hpp"

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

// The round machine as a CPU: `workers` cores per rank, each copying its own
// puts at `copy_bytes_per_s` (0: no copy cost).
MachineModel round_cpu(int workers, double copy_bytes_per_s) {
  MachineModel m = round_machine();
  m.accelerator = false;
  m.workers = workers;
  m.put_engine = PutEngine::cpu;
  m.put_copy_bytes_per_s = copy_bytes_per_s;
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

// A tile's time between the measured shapes is linear in its rows and in
// its K; outside them the nearest shape's rate holds; `reuse` moves it
// from the streamed time toward the reused one.
TEST(Simulator, TileTimeIsInterpolatedBetweenMeasuredShapes) {
  MachineModel m = round_machine();
  // 32 rows at 80 GFLOP/s (40 streamed), 64 rows at 200 (100 streamed), K 1024; 64 rows also at K 2048.
  m.tile_rates = {TileRate{32, 1024, 80e9, 80e9, 40e9, 40e9}, TileRate{64, 1024, 200e9, 200e9, 100e9, 100e9},
                  TileRate{64, 2048, 100e9, 100e9, 50e9, 50e9}};
  const double flop32 = 2.0 * 32 * 64 * 1024, flop64 = 2.0 * 64 * 64 * 1024;
  const double t32 = flop32 / 80e9, t64 = flop64 / 200e9;  // 52.4 and 41.9 us
  // The default reuse (1e9) leaves a billionth of the streamed time: compare to 1e-6.
  const auto near = [](double got, double want) { EXPECT_NEAR(got, want, 1e-6 * want); };
  // Measured shapes: their own time.
  near(m.gemm_seconds(32, 64, 1024, DType::fp32), t32);
  near(m.gemm_seconds(64, 64, 1024, DType::fp32), t64);
  // 40 rows: a quarter of the way from 32 rows' time to 64 rows' (the nearest shape's rate gave 65.5 us).
  near(m.gemm_seconds(40, 64, 1024, DType::fp32), t32 + 0.25 * (t64 - t32));
  // Outside the measured rows: the nearest row count's rate.
  near(m.gemm_seconds(128, 64, 1024, DType::fp32), 2.0 * 128 * 64 * 1024 / 200e9);
  near(m.gemm_seconds(16, 64, 1024, DType::fp32), 2.0 * 16 * 64 * 1024 / 80e9);
  // 48 rows at K 1536: 64 rows interpolate in K (t64 at 1024, twice the FLOPs at half the rate at
  // 2048: 4 t64; 2.5 t64 halfway), 32 rows have no K above 1024 and keep its rate (1.5 t32); then
  // halfway in rows.
  near(m.gemm_seconds(48, 64, 1536, DType::fp32), 0.5 * (1.5 * t32 + 2.5 * t64));
  // A panel read once takes the streamed rates (half the reused ones here), twice: halfway.
  const double hot48 = 0.5 * (t32 + t64);
  near(m.gemm_seconds(48, 64, 1024, DType::fp32, 1.0), 2 * hot48);
  near(m.gemm_seconds(48, 64, 1024, DType::fp32, 2.0), 1.5 * hot48);
}

// A vector kind with its own measured rate takes its bytes at that rate;
// the others keep the model's one vector rate.
TEST(Simulator, VectorKindsTakeTheirOwnRateWhereMeasured) {
  MachineModel m = round_machine(1, 1);
  m.vector_kind_bytes_per_s[static_cast<std::size_t>(TaskKind::gate_grad)] = 4e9;
  Builder b(1, m);
  b.add(0, 1, TaskKind::gate_grad, 1000);  // 1000 B at 4 GB/s: 0.25 us
  b.add(0, 1, TaskKind::swiglu, 1000);     // 1000 B at 1 GB/s: 1 us
  const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, true);
  ASSERT_EQ(t.trace.size(), 2u);
  EXPECT_DOUBLE_EQ(t.trace[0].end - t.trace[0].start, 0.25e-6);
  EXPECT_DOUBLE_EQ(t.trace[1].end - t.trace[1].start, 1e-6);
  EXPECT_DOUBLE_EQ(t.makespan, 1.25e-6);
  EXPECT_DOUBLE_EQ(m.vector_rate(TaskKind::router_bwd), 1e9);
}

namespace {
// Rank 0 puts `bytes` into rank 1, whose vector task of `then` bytes waits for them.
Builder one_put(const MachineModel& m, double bytes, double then) {
  Builder b(2, m);
  b.event(1, 1);
  b.add(0, 1, TaskKind::dispatch_put, bytes, 1, 64, -1, 0, 0, 1);
  b.add(1, 1, TaskKind::swiglu, then, 1, 64, 0, 1);
  b.done();
  return b;
}
}  // namespace

TEST(Simulator, OnePutOverOneLink) {
  const MachineModel m = round_machine();
  const Builder b = one_put(m, 1000, 500);
  const auto t = simulate_interleaved(m, b.programs, b.work, DType::fp32, false);
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

// An operator of tiles of 4, 1, 1 and 1 units of work on two workers. A CPU
// baseline deals them out in turn (tiles 0 and 2 to worker 0: 5 units); an
// accelerator's framework gives each to the earliest free unit (4 units).
TEST(Simulator, CpuBaselineDealsTilesInTurn) {
  MachineModel cpu = round_machine();
  cpu.accelerator = false;
  cpu.matrix_units = cpu.vector_units = 0;
  cpu.workers = 2;
  const double unit = 2.0 * 64 * 64 * 1024;  // 8.4 us at 1 TFLOP/s
  const auto tiles = [&](const MachineModel& m) {
    Builder b(1, m);
    for (double units : {4.0, 1.0, 1.0, 1.0}) b.add(0, 0, TaskKind::gemm_gate_up, units * unit, 64, 64);
    return simulate_serialized(m, b.done(), b.work, DType::fp32, false).makespan;
  };
  EXPECT_NEAR(tiles(cpu), 5 * unit / 1e12, 1e-15);
  MachineModel accel = round_machine(2, 1);
  EXPECT_NEAR(tiles(accel), 4 * unit / 1e12, 1e-15);
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

namespace {
// Start of the first traced slice named `name` on rank r.
double start_of(const Timeline& t, int rank, const std::string& name) {
  for (const auto& s : t.trace)
    if (s.rank == rank && s.name.rfind(name, 0) == 0) return s.start;
  ADD_FAILURE() << "no slice " << name << " on rank " << rank;
  return -1;
}
double end_of(const Timeline& t, int rank, const std::string& name) {
  for (const auto& s : t.trace)
    if (s.rank == rank && s.name.rfind(name, 0) == 0) return s.end;
  ADD_FAILURE() << "no slice " << name << " on rank " << rank;
  return -1;
}
}  // namespace

namespace {
// Rank 0's units `first` and `second` each issue a 1000-byte put into rank 1
// at once; rank 1's unit `waiter` waits for the first one only.
Timeline two_puts_into_rank_1(const MachineModel& m, int first, int second, int waiter) {
  Builder b(2, m);
  b.event(1, 1);
  b.event(1, 1);
  b.add(0, first, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
  b.add(0, second, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 1, 1);
  b.add(1, waiter, TaskKind::swiglu, 500, 1, 64, 0, 1);
  return simulate_interleaved(m, b.done(), b.work, DType::fp32, true);
}
}  // namespace

TEST(PutEngines, DmaEnginesBoundThePutsInFlight) {
  // Two vector units put; rank 1's vector unit waits.
  MachineModel m = round_machine();
  auto run = [&] { return two_puts_into_rank_1(m, 1, 2, 1); };
  // No bound: both share the ports, the first is through after 2000 bytes'
  // time: issue 0.5 + 2 us, latency 1, signal 0.25.
  EXPECT_NEAR(start_of(run(), 1, "swiglu"), 0.5e-6 + 2e-6 + 1e-6 + 0.25e-6, 1e-15);
  // One engine: the first goes alone (1 us), the second waits for the engine.
  m.put_in_flight = 1;
  const Timeline one = run();
  EXPECT_NEAR(start_of(one, 1, "swiglu"), 0.5e-6 + 1e-6 + 1e-6 + 0.25e-6, 1e-15);
  EXPECT_NEAR(one.makespan, 0.5e-6 + 1e-6 + 1e-6 + 1e-6, 1e-15);  // the second is on the wire from 1.5 to 2.5 us
  // The issuing units were free after the issue either way.
  EXPECT_NEAR(end_of(one, 0, "dispatch_put"), 0.5e-6, 1e-15);
}

TEST(PutEngines, VectorPutsHoldTheirUnitUntilTheBytesLand) {
  // Rank 0's vector unit puts 1000 bytes into rank 1, then runs a SwiGLU.
  MachineModel m = round_machine();
  m.put_engine = PutEngine::vector;
  auto run = [&] {
    Builder b(2, m);
    b.event(1, 1);
    b.add(0, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
    b.add(0, 1, TaskKind::swiglu, 500, 1, 64);
    b.add(1, 1, TaskKind::swiglu, 0, 1, 64, 0, 1);
    return simulate_interleaved(m, b.done(), b.work, DType::fp32, true);
  };
  // issue 0.5 us, 1000 B at 1 GB/s (link and unit alike) 1 us, latency 1 us: the unit is free at 2.5 us.
  Timeline t = run();
  EXPECT_NEAR(end_of(t, 0, "dispatch_put"), 2.5e-6, 1e-15);
  EXPECT_NEAR(start_of(t, 0, "swiglu"), 2.5e-6, 1e-15);
  EXPECT_NEAR(t.makespan, 2.5e-6 + 0.5e-6, 1e-15);
  EXPECT_NEAR(t.vector_busy, 2.5e-6 + 0.5e-6 + 0.0, 1e-15);
  // The unit copies at its own rate: at 0.5 GB/s the bytes take 2 us (the link could do 1).
  m.vector_bytes_per_s = 0.5e9;
  t = run();
  EXPECT_NEAR(end_of(t, 0, "dispatch_put"), 0.5e-6 + 2e-6 + 1e-6, 1e-15);
  // A DMA engine would have freed the unit after the issue.
  m.put_engine = PutEngine::dma;
  EXPECT_NEAR(start_of(run(), 0, "swiglu"), 0.5e-6, 1e-15);
}

TEST(PutEngines, CpuReceiversPayProtocolWork) {
  // One worker per rank. Rank 0 copies 1000 bytes (1 GB/s) into rank 1 over
  // a 1 GB/s link: on the wire from 1.5 us, first byte at 2.5 (latency 1),
  // last byte at 3.5. The receiver's stack takes the bytes as they come, at
  // 2 GB/s (0.5 us of work), then 0.2 us for the put.
  MachineModel m = round_cpu(1, 1e9);
  m.put_receive_s = 0.2e-6;
  m.put_receive_bytes_per_s = 2e9;
  const auto idle_receiver = [&] {
    Builder b(2, m);
    b.event(1, 1);
    b.add(0, 0, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
    b.add(1, 0, TaskKind::swiglu, 0, 1, 64, 0, 1);
    return start_of(simulate_interleaved(m, b.done(), b.work, DType::fp32, true), 1, "swiglu");
  };
  // Rank 1 idle, waiting: the stack keeps up with the wire, so the put is
  // whole when its last byte lands (3.5), then 0.2 for the put, 0.25 signal.
  EXPECT_NEAR(idle_receiver(), 3.5e-6 + 0.2e-6 + 0.25e-6, 1e-15);
  // A stack slower than the wire (0.5 GB/s: 2 us of work from the first
  // byte at 2.5) is done after the last byte: 4.5, + 0.2, + 0.25.
  m.put_receive_bytes_per_s = 0.5e9;
  EXPECT_NEAR(idle_receiver(), 4.5e-6 + 0.2e-6 + 0.25e-6, 1e-15);
  m.put_receive_bytes_per_s = 2e9;
  {  // rank 1 computes a 8.4 us GEMM through the whole transfer: the GEMM ends 0.5 + 0.2 us later
    Builder b(2, m);
    b.event(1, 1);
    b.add(0, 0, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
    const double flops = 2.0 * 64 * 64 * 1024;
    b.add(1, 0, TaskKind::gemm_gate_up, flops);
    const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, true);
    EXPECT_NEAR(t.makespan, flops / 1e12 + 0.7e-6, 1e-15);
  }
  {  // rank 1 computes for part of the put's flight (1.5 to 3.5 us) only: a
     // GEMM to g = 2.4576 us (k 300); then a SwiGLU waits for rank 0, which
     // signals it after its put and 1.5 us of its own SwiGLU (at 3.0; the
     // wake at 3.25): idle from g to 3.25. The SwiGLU (0.5 us) runs when the
     // bytes land, and the share of the flight the core computed, (2 - (3.25
     // - g)) / 2, of the stack's 0.5 us is taken from it, with the 0.2 for the
     // put; then a GEMM of 8.4 us.
    Builder b(2, m);
    b.event(1, 1);
    b.event(1, 1);
    b.add(0, 0, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
    b.add(0, 0, TaskKind::swiglu, 1500, 1, 64, -1, 0, 1, 1);
    const double g = 2.0 * 64 * 64 * 300 / 1e12, flops = 2.0 * 64 * 64 * 1024;
    b.add(1, 0, TaskKind::gemm_gate_up, 2.0 * 64 * 64 * 300);
    b.add(1, 0, TaskKind::swiglu, 500, 1, 64, 1, 1);
    b.add(1, 0, TaskKind::gemm_down, flops);
    const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, true);
    EXPECT_NEAR(start_of(t, 1, "swiglu"), 3.25e-6, 1e-15);
    const double share = (2e-6 - (3.25e-6 - g)) / 2e-6;
    EXPECT_NEAR(t.makespan, 3.25e-6 + 0.5e-6 + share * 0.5e-6 + 0.2e-6 + flops / 1e12, 1e-15);
  }
  {  // rank 1 computes until 2.4576 us, then waits for the put: the stack's
     // work is absorbed in the wait, and the next task starts as if idle.
    Builder b(2, m);
    b.event(1, 1);
    b.add(0, 0, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
    b.add(1, 0, TaskKind::gemm_gate_up, 2.0 * 64 * 64 * 300);
    b.add(1, 0, TaskKind::swiglu, 0, 1, 64, 0, 1);
    EXPECT_NEAR(start_of(simulate_interleaved(m, b.done(), b.work, DType::fp32, true), 1, "swiglu"),
                3.5e-6 + 0.2e-6 + 0.25e-6, 1e-15);
  }
}

TEST(PutEngines, CpuStreamsCarryAPeersPutsOneAtATime) {
  // Rank 0's two workers each put 1000 bytes into rank 1 at once (no copy
  // cost: both are on the wire after the 0.5 us issue); rank 1 waits for the
  // first one only.
  MachineModel m = round_cpu(2, 0);
  auto run = [&] { return two_puts_into_rank_1(m, 0, 1, 0); };
  // Shared: both are through after 2000 bytes' time (2 us), then latency 1, signal 0.25.
  EXPECT_NEAR(start_of(run(), 1, "swiglu"), 0.5e-6 + 2e-6 + 1e-6 + 0.25e-6, 1e-15);
  // One stream: the first goes alone (1 us), the second follows it on the
  // wire from 1.5 to 2.5 us and lands at 3.5.
  m.put_stream_per_peer = true;
  const Timeline one = run();
  EXPECT_NEAR(start_of(one, 1, "swiglu"), 0.5e-6 + 1e-6 + 1e-6 + 0.25e-6, 1e-15);
  EXPECT_NEAR(one.makespan, 0.5e-6 + 2e-6 + 1e-6, 1e-15);
  // Streams to different peers do not wait for each other: rank 0 puts into
  // ranks 1 and 2 at once, each through its own receiver's port in 1 us.
  Builder c(3, m);
  c.event(1, 1);
  c.event(2, 1);
  c.add(0, 0, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 1);
  c.add(0, 1, TaskKind::dispatch_put, 1000, 1, 64, -1, 0, 0, 2);
  c.add(1, 0, TaskKind::swiglu, 0, 1, 64, 0, 1);
  c.add(2, 0, TaskKind::swiglu, 0, 1, 64, 0, 1);
  const Timeline two = simulate_interleaved(m, c.done(), c.work, DType::fp32, true);
  // The sender's port is shared by both: 2000 bytes' time, as without streams.
  EXPECT_NEAR(start_of(two, 2, "swiglu"), 0.5e-6 + 2e-6 + 1e-6 + 0.25e-6, 1e-15);
  m.put_stream_per_peer = false;
  EXPECT_NEAR(start_of(simulate_interleaved(m, c.programs, c.work, DType::fp32, true), 2, "swiglu"),
              0.5e-6 + 2e-6 + 1e-6 + 0.25e-6, 1e-15);
}

TEST(Links, RateFollowsTheEpDegreeWhereTheModelGivesOne) {
  MachineModel m = round_machine();
  m.intra_by_ep = {{8, 125e9}, {16, 103e9}, {128, 81e9}};
  EXPECT_DOUBLE_EQ(m.intra_rate(4), 125e9);   // below the first point: its rate
  EXPECT_DOUBLE_EQ(m.intra_rate(8), 125e9);
  EXPECT_DOUBLE_EQ(m.intra_rate(16), 103e9);
  EXPECT_DOUBLE_EQ(m.intra_rate(32), 103e9 + (81e9 - 103e9) / 3);  // a third of the way in log2(EP) from 16 to 128
  EXPECT_DOUBLE_EQ(m.intra_rate(256), 81e9);
  // Simulated at EP 2, the first point's 0.5 GB/s: 1000 bytes take 2 us on the wire.
  m.intra_by_ep = {{2, 0.5e9}, {8, 2e9}};
  const Builder b = one_put(m, 1000, 0);
  EXPECT_NEAR(simulate_interleaved(m, b.programs, b.work, DType::fp32, false).makespan, 0.5e-6 + 2e-6 + 1e-6 + 0.25e-6, 1e-15);
}

TEST(Scope, TasksOutsideTheScopeTakeNoTimeButKeepTheirDependencies) {
  const MachineModel m = round_machine();
  Builder b(1, m);
  b.event(0, 1);
  const double flops = 2.0 * 64 * 64 * 1024;
  b.add(0, 0, TaskKind::router_dgrad, flops, 64, 64, -1, 0, 0);
  b.add(0, 1, TaskKind::swiglu, 2000, 64, 64, 0, 1);
  b.work[0][0].timed = false;
  const auto t = simulate_interleaved(m, b.done(), b.work, DType::fp32, false);
  EXPECT_NEAR(t.makespan, 0.25e-6 + 2e-6, 1e-15);
  // Serialized: an operator with nothing in scope is not launched at all
  // (the SwiGLU is then the first operator: no launch before it).
  EXPECT_NEAR(simulate_serialized(m, b.programs, b.work, DType::fp32, false).makespan, 2e-6, 1e-15);
}

TEST(DeepEp, ExchangeAloneTimesEachKernelOnIdleLinksAndCountsAsDeepEpDoes) {
  // 2 ranks in one node, each token to the other rank's one expert: the
  // dispatch is 8 rows a way on 1 GB/s links, the combine the same rows back.
  LayerConfig c = preset("tiny");
  c.ranks = 2;
  c.routed_experts = 2;
  c.top_k = 1;
  c.tokens_per_rank = 8;
  c.hidden = 256;
  c.dtype = DType::bf16;
  RouterOutput<float> r;
  r.tokens = 16;
  r.experts = 2;
  r.top_k = 1;
  for (int t = 0; t < 16; ++t) r.expert.push_back(t < 8 ? 1 : 0);
  r.kept.assign(16, 1);
  MachineModel m = round_machine();
  m.intra_latency_s = 0;
  m.deepep.enabled = true;
  m.deepep.fp8_dispatch = true;
  const auto ex = deepep_exchange(c, placement_or_contiguous(ExpertPlacement{}, 2, 2), r, 8);
  taskflow::Dims dims;
  dims.hidden = c.hidden;
  dims.elem_bytes = 2;
  const DeepEpExchangeAlone x = simulate_deepep_exchange(m, ex, dims);
  EXPECT_DOUBLE_EQ(x.dispatch_row_bytes, 256 + 4 * 2);  // fp8 codes and one fp32 scale per 128
  EXPECT_DOUBLE_EQ(x.combine_row_bytes, 256 * 2);       // bf16
  EXPECT_NEAR(x.dispatch_s, 8 * 264 / 1e9, 1e-12);       // no kernel launch: the kernel alone
  EXPECT_NEAR(x.combine_s, 8 * 512 / 1e9, 1e-12);
  EXPECT_EQ(x.nodes, 1);
  EXPECT_EQ(x.received_rows, 8);
  EXPECT_NEAR(x.nvl_gbps(true), 1.0, 1e-9);  // 8 rows in the time of 8 rows: the link's rate
}

namespace {
// A bf16 step of a preset, uniform routing, forward and backward.
SimRequest bf16_step(const std::string& name, std::int64_t ranks, std::int64_t tokens) {
  SimRequest req;
  req.config = preset(name);
  req.config.ranks = ranks;
  req.config.tokens_per_rank = tokens;
  req.config.dtype = DType::bf16;
  req.routing = parse_routing_spec("uniform", 1);
  req.backward = true;
  return req;
}
}  // namespace

TEST(Baselines, GpuFrameworksGiveTheirGemmsEverySm) {
  // One rank, 4 equal GEMM tiles; the fused schedule has 1 matrix unit, the
  // framework's serialized GEMMs run on 4.
  MachineModel m = round_machine();
  Builder b(1, m);
  const double flops = 2.0 * 64 * 64 * 1024;
  for (int i = 0; i < 4; ++i) b.add(0, 0, TaskKind::gemm_gate_up, flops);
  EXPECT_NEAR(simulate_serialized(m, b.done(), b.work, DType::fp32, false).makespan, 4 * flops / 1e12, 1e-15);
  m.serialized_matrix_units = 4;
  EXPECT_NEAR(simulate_serialized(m, b.programs, b.work, DType::fp32, false).makespan, flops / 1e12, 1e-15);
}

TEST(Baselines, GpuFrameworksGiveTheirVectorOperatorsEverySmToo) {
  // One rank, 6 equal SwiGLU tiles: 2 vector units take them in 3 waves;
  // where the matrix unit runs vector code (a GPU's SM), a framework's
  // operator takes all 3 units, 2 waves.
  MachineModel m = round_machine(1, 2);
  const double bytes = 1e6;
  Builder b(1, m);
  for (int i = 0; i < 6; ++i) b.add(0, 1 + i % 2, TaskKind::swiglu, bytes);
  EXPECT_NEAR(simulate_serialized(m, b.done(), b.work, DType::fp32, false).makespan, 3 * bytes / 1e9, 1e-12);
  m.matrix_runs_vector = true;
  for (Program& p : b.programs) p.machine = m.compiler_machine();
  EXPECT_NEAR(simulate_serialized(m, b.programs, b.work, DType::fp32, false).makespan, 2 * bytes / 1e9, 1e-12);
}

TEST(Baselines, MindSporeDispatcherPaysItsCollectivesHostCopyAndPermutes) {
  // A compiled 2-rank step on A3: the MindSpore-style baseline does what the
  // serialized one does plus the dispatcher's extra operators, so it is
  // slower by at least its fixed costs: per forward pass, the map all-to-all
  // and two all-gathers (3 collective handshakes) and the host copy.
  const MachineModel m = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/ascend-a3.json");
  ASSERT_TRUE(m.mindspore.enabled);
  const SimRequest req = bf16_step("deepseek-v2-lite", 2, 256);
  const SimReport r = simulate(m, req);
  EXPECT_GT(r.forward.mindspore_s, r.forward.serialized_s + 3 * m.collective_sync_s + m.mindspore.host_sync_s -
                                       2 * m.operator_launch_s);
  EXPECT_GT(r.backward.mindspore_s, 0);
  EXPECT_EQ(r.forward.deepep_s, 0);  // A3 has no DeepEP-style baseline
  // Without the host copy and with free handshakes and launches it can only be faster.
  MachineModel cheap = m;
  cheap.mindspore.host_sync_s = 0;
  cheap.collective_sync_s = 0;
  EXPECT_LT(simulate(cheap, req).forward.mindspore_s, r.forward.mindspore_s);
}

TEST(Simulator, CompiledLayerIsDeterministicAndInterleavingHelpsWhenCommunicationBound) {
  const MachineModel m = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json");
  const SimRequest req = bf16_step("deepseek-v3", 8, 256);
  const SimReport a = simulate(m, req), b = simulate(m, req);
  EXPECT_EQ(a.forward.interleaved_s, b.forward.interleaved_s);
  EXPECT_EQ(a.backward.serialized_s, b.backward.serialized_s);
  EXPECT_GT(a.forward.serialized_s / a.forward.interleaved_s, 1.0);
  EXPECT_GT(a.forward.serialized_exposed_comm, a.forward.interleaved_exposed_comm);
  EXPECT_GT(a.forward.tasks, 0);
  // The programs were proved before they were simulated (SimRequest::verify).
  EXPECT_TRUE(a.verified);
  EXPECT_GT(a.verify_seconds, 0.0);
  EXPECT_NE(format_report(a).find("proved (whole set"), std::string::npos);
  SimRequest unproved = req;
  unproved.verify = false;
  const SimReport c = simulate(m, unproved);
  EXPECT_FALSE(c.verified);
  EXPECT_EQ(c.forward.interleaved_s, a.forward.interleaved_s) << "the proof changes no prediction";
}

// A model written out and read back simulates the same, with its sources:
// every field the loader takes, to_json writes (calibrate and the cluster
// scripts build models from it).
TEST(Simulator, EveryCommittedModelSurvivesARoundTrip) {
  for (const char* name : {"cpu-local", "cpu-amd-epyc", "cpu-amd-epyc-zen4", "ascend-a3", "h800", "h200", "nmp-mesh"}) {
    SCOPED_TRACE(name);
    const MachineModel m = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/" + name + ".json");
    const MachineModel back = machine_from_json(to_json(m));
    EXPECT_EQ(back.sources, m.sources);
    EXPECT_FALSE(back.sources.empty());
    const SimRequest req = bf16_step("deepseek-v2-lite", 4, 256);
    const SimReport a = simulate(m, req), b = simulate(back, req);
    for (const auto& [x, y] : {std::pair{a.forward, b.forward}, std::pair{a.backward, b.backward}}) {
      EXPECT_EQ(x.serialized_s, y.serialized_s);
      EXPECT_EQ(x.interleaved_s, y.interleaved_s);
      EXPECT_EQ(x.deepep_s, y.deepep_s);
      EXPECT_EQ(x.mindspore_s, y.mindspore_s);
    }
  }
}

TEST(Memory, TheRankThatHoldsTheMostIsCheckedAgainstTheMachine) {
  // deepseek-v2-lite (64 experts, H 2048, I 1408, 2 shared experts) on 2 ranks in bf16:
  // each rank holds 32 experts; the router and shared experts are on both.
  MachineModel m = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json");
  ASSERT_EQ(m.memory_bytes_per_rank, 80e9);
  SimRequest req = bf16_step("deepseek-v2-lite", 2, 256);
  const LayerConfig& c = req.config;
  const double params = 32.0 * 3 * 2048 * 1408 + 64.0 * 2048 + 3.0 * 2048 * double(c.shared_inter_total());
  const SimReport r = simulate(m, req);
  EXPECT_DOUBLE_EQ(r.memory.weights, 2 * params);  // bf16
  EXPECT_DOUBLE_EQ(r.memory.gradients, 4 * params);  // fp32, a backward
  EXPECT_EQ(r.memory.optimizer, 0);
  EXPECT_GT(r.memory.buffers, 0);
  // The worst routing sends every token's choices to one rank (twice its average rows here; the
  // token-sized buffers stay as they are).
  EXPECT_GT(r.memory.worst_buffers, 1.2 * r.memory.buffers);
  EXPECT_EQ(r.memory.capacity, 80e9);
  req.optimizer_state = true;
  EXPECT_DOUBLE_EQ(simulate(m, req).memory.optimizer, 12 * params);
  // A machine too small for the layer: one error naming the shortfall.
  m.memory_bytes_per_rank = r.memory.total() * 0.9;
  req.optimizer_state = false;
  try {
    simulate(m, req);
    FAIL() << "a layer that does not fit was simulated";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("short"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("per rank"), std::string::npos) << e.what();
  }
  // Without a capacity, no check (CPU models).
  m.memory_bytes_per_rank = 0;
  EXPECT_NO_THROW(simulate(m, req));
}
