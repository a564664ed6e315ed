// `hpmoe calibrate`: microbenchmarks of this machine, run the way the
// runtime runs (W pinned workers at once, the runtime's own kernels and
// event code), written as the cpu-local machine model.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "hpmoe/bf16.hpp"
#include "common/memory.hpp"
#include "common/stats.hpp"
#include "kernels/kernels.hpp"
#include "hpmoe/layer.hpp"
#include "runtime/layer_inspect.hpp"
#include "kernels/peak.hpp"
#include "cli/calibrate.hpp"

#include "common/memory.hpp"
#include "sim/sim.hpp"
#include "runtime/worker_pool.hpp"
#include "comm/event_wait.hpp"

namespace hpmoe::sim {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

void pin(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<unsigned>(core) % std::max(1u, std::thread::hardware_concurrency()), &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Runs body(worker, rounds) on `workers` pinned threads at once, `reps`
// times; returns the median seconds per round of the slowest worker.
double concurrent(int workers, int reps, int rounds, const std::function<void(int, int)>& body) {
  std::vector<double> samples;
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<double> seconds(static_cast<std::size_t>(workers));
    std::barrier sync(workers);
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w)
      threads.emplace_back([&, w] {
        pin(w);
        body(w, 1);  // warm
        sync.arrive_and_wait();
        const auto t0 = Clock::now();
        body(w, rounds);
        seconds[static_cast<std::size_t>(w)] = std::chrono::duration<double>(Clock::now() - t0).count();
      });
    for (auto& t : threads) t.join();
    samples.push_back(*std::max_element(seconds.begin(), seconds.end()) / rounds);
  }
  return median(samples);
}

// Bytes no cache of this machine holds: twice the last-level cache, at
// least 96 MiB. (Some server parts have hundreds of MiB of L3: a fixed
// buffer of 64 or 96 MiB would be measured from cache there, while a
// layer's weights and weight gradients of gigabytes come from memory.)
std::int64_t beyond_cache_bytes() {
  std::int64_t llc = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
  llc = std::max<long>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
#endif
  if (llc == 0)
    for (const char* path : {"/sys/devices/system/cpu/cpu0/cache/index3/size", "/sys/devices/system/cpu/cpu0/cache/index2/size"}) {
      std::ifstream in(path);
      std::int64_t kib = 0;
      char unit = 0;
      if (in >> kib >> unit) {
        llc = kib * (unit == 'M' ? 1 << 20 : 1 << 10);
        break;
      }
    }
  return std::max<std::int64_t>(std::int64_t{96} << 20, 2 * llc);
}

// Each worker's memory for the tile measurements, allocated once: a region
// of weight panels and a region of output rows, both beyond the caches.
// Cursors walk both across measurements, so a streamed panel or an output
// tile is cold when it is touched, as in a layer. (Storage of unsigned char:
// C++20 creates the float or bf16 objects the kernels read implicitly.)
struct TileMemory {
  std::int64_t bytes = 0;
  std::unique_ptr<unsigned char[]> panels, out;
  std::int64_t panel_cursor = 0, out_cursor = 0;
  static constexpr std::int64_t ldc = 2048;  // floats a row of the output matrix

  explicit TileMemory(std::int64_t bytes) : bytes(bytes), panels(new unsigned char[bytes]), out(new unsigned char[bytes]) {
    // 0.5f everywhere: as bf16 pairs that reads 0 and 0.5, no denormals either way.
    std::fill_n(reinterpret_cast<float*>(panels.get()), bytes / 4, 0.5f);
    std::fill_n(reinterpret_cast<float*>(out.get()), bytes / 4, 0.0f);
  }
  template <class T>
  const T* panel(std::int64_t elements) {  // the next panel of the walk
    const std::int64_t size = elements * std::int64_t{sizeof(T)};
    if (panel_cursor + size > bytes) panel_cursor = 0;
    const T* p = reinterpret_cast<const T*>(panels.get() + panel_cursor);
    panel_cursor += size;
    return p;
  }
  float* output(std::int64_t m) {  // the next m x 64 output tile of the walk, a row of ldc apart
    const std::int64_t rows = bytes / (ldc * 4), tiles_per_row = ldc / 64;
    const std::int64_t row = (out_cursor / tiles_per_row * m) % (rows - m), col = (out_cursor % tiles_per_row) * 64;
    ++out_cursor;
    return reinterpret_cast<float*>(out.get()) + row * ldc + col;
  }
};

// FLOP/s of one unit for an m x 64 x k tile as a layer runs it: every
// worker multiplies by its own weight panels and writes its output tiles a
// row apart into a matrix beyond the caches (as activations and weight
// gradients are written). `streamed`: every tile reads a panel from memory,
// as an expert's weights are at their first row tile (for few rows per tile
// this bounds the rate); otherwise 32 panels in turn, as the next row tiles
// of the same expert find them.
template <class T>
double tile_rate(std::vector<TileMemory>& memory, std::int64_t m, std::int64_t k, int reps, bool streamed) {
  const int workers = static_cast<int>(memory.size());
  const std::int64_t kp = kernels::padded_k<T>(k);
  const std::int64_t panel = kernels::weight_padded_k<T>(k) * kernels::kTileCols;  // elements of one K x 64 weight panel
  // As many tiles as 96 MiB of panels: long enough to time, short enough for every shape.
  const int rounds = static_cast<int>(std::max<std::int64_t>(8 * 32, (std::int64_t{96} << 20) / (panel * std::int64_t{sizeof(T)})));
  std::vector<std::vector<T>> a(static_cast<std::size_t>(workers), std::vector<T>(static_cast<std::size_t>(m * kp), T(0.25f)));
  std::vector<const T*> hot(static_cast<std::size_t>(workers));
  for (int w = 0; w < workers; ++w) hot[static_cast<std::size_t>(w)] = memory[static_cast<std::size_t>(w)].template panel<T>(32 * panel);
  const double s = concurrent(workers, reps, rounds, [&](int w, int rounds) {
    auto& mem = memory[static_cast<std::size_t>(w)];
    for (int i = 0; i < rounds; ++i) {
      const T* weights = streamed ? mem.template panel<T>(panel) : hot[static_cast<std::size_t>(w)] + (i % 32) * panel;
      const auto view = kernels::panel_view<T>(weights, k);
      kernels::gemm_tile<T>(a[static_cast<std::size_t>(w)].data(), kp, view, 0, mem.output(m), TileMemory::ldc, m,
                            kernels::kTileCols, kp, false);
    }
  });
  return 2.0 * double(m) * double(kernels::kTileCols) * double(k) / s;
}

}  // namespace

double undisturbed_rate(std::vector<double> rounds) {
  if (rounds.empty()) throw Error("undisturbed_rate: no rounds measured");
  std::sort(rounds.begin(), rounds.end(), std::greater<>());
  return rounds[std::min<std::size_t>(1, rounds.size() - 1)];
}

json vector_kind_rates(const LayerConfig& c, int workers, int steps) {
  const auto w = random_weights(c, 7);
  const auto in = random_inputs(c, 7);
  Layer layer(c, w, Parallel{.workers_per_rank = workers, .trace = true});
  // Zipf routing: the experts get from a few rows to many, as a routed
  // layer's do (a pack's rate per byte depends on its rows).
  const std::vector<std::int32_t> forced = forced_selection(c, parse_routing_spec("zipf:1.2", 7));
  const auto& table = taskflow::AccessTable::standard();
  constexpr auto kinds = static_cast<std::size_t>(taskflow::TaskKind::count);
  std::vector<std::vector<double>> rates(kinds);
  for (int step = 0; step <= steps; ++step) {  // step 0 warms
    Layer::Step done = layer.forward(view(in.x), forced);
    done.backward(view(in.d_out));
    if (step == 0) continue;
    const StepResult& res = done.result();
    std::array<double, kinds> bytes{}, seconds{};
    std::unordered_map<std::string_view, std::size_t> vector_kind;  // a slice's name -> its kind
    for (const auto pass : {taskflow::Pass::forward, taskflow::Pass::backward})
      for (const auto& program : StepInspector::programs(done, pass))
        for (const auto& t : program.tasks)
          if (table[t.kind].queue == taskflow::QueueClass::vector && !taskflow::is_put(t.kind)) {
            bytes[static_cast<std::size_t>(t.kind)] += table.work(program, t).bytes;
            vector_kind.emplace(taskflow::name(t.kind), static_cast<std::size_t>(t.kind));
          }
    for (const auto& slice : res.trace)
      if (const auto k = vector_kind.find(slice.name); k != vector_kind.end()) seconds[k->second] += slice.end - slice.start;
    for (std::size_t k = 0; k < kinds; ++k)
      if (bytes[k] > 0 && seconds[k] > 0) rates[k].push_back(bytes[k] / seconds[k]);
  }
  json by_kind = json::object();
  for (std::size_t k = 0; k < kinds; ++k)
    if (!rates[k].empty()) by_kind[taskflow::name(static_cast<taskflow::TaskKind>(k))] = median(rates[k]);
  return by_kind;
}

namespace {

// Each tile shape's GEMM rates (fp32, bf16; cycling through reused and
// streamed weight panels), all workers at once, in rounds.
json measure_tile_rates(int W, int reps, std::int64_t cold_bytes, const std::function<void(const std::string&)>& say) {
  json rates = json::array();
  std::vector<TileMemory> memory;
  for (int w = 0; w < W; ++w) memory.emplace_back(cold_bytes);
  // Shapes the layers' tiles have: full and partial row tiles; K from the
  // weight gradients' few rows per expert (a cold expert's 2) to hidden and
  // 2 x inter.
  struct Shape {
    std::int64_t m, k;
    std::array<std::vector<double>, 4> rates;  // fp32, bf16, fp32 streamed, bf16 streamed: one per round
  };
  std::vector<Shape> shapes;
  for (std::int64_t m : {kernels::kTileRows, std::int64_t{64}, std::int64_t{48}, std::int64_t{32}, std::int64_t{16}, std::int64_t{8}})
    for (std::int64_t k : {2, 4, 8, 16, 32, 64, 128, 256, 768, 1408, 2048, 2816, 4096}) shapes.push_back({m, k, {}});
  // Every shape once a round, and each shape's undisturbed_rate over the
  // rounds. A phase of a shared machine (steps 1.6x slower for a minute at
  // a time on the VM of 2026-12-02) then slows one round of every shape,
  // not all the repetitions of the few shapes measured during it: measured
  // back to back, neighbouring shapes came out up to 2x apart (48 x 1408 at
  // 89 GFLOP/s between 159 and 176; docs/results/simulation.md, "Calibrating in
  // rounds").
  for (int round = 0; round < reps; ++round) {
    if (reps > 1) say("tile GEMM rates, round " + std::to_string(round + 1) + " of " + std::to_string(reps));
    for (auto& shape : shapes) {
      shape.rates[0].push_back(tile_rate<float>(memory, shape.m, shape.k, 1, false));
      shape.rates[1].push_back(tile_rate<bf16>(memory, shape.m, shape.k, 1, false));
      shape.rates[2].push_back(tile_rate<float>(memory, shape.m, shape.k, 1, true));
      shape.rates[3].push_back(tile_rate<bf16>(memory, shape.m, shape.k, 1, true));
    }
  }
  for (const auto& shape : shapes)
    rates.push_back({{"m", shape.m}, {"k", shape.k}, {"fp32_flops", undisturbed_rate(shape.rates[0])},
                     {"bf16_flops", undisturbed_rate(shape.rates[1])}, {"fp32_streamed_flops", undisturbed_rate(shape.rates[2])},
                     {"bf16_streamed_flops", undisturbed_rate(shape.rates[3])},
                     {"rounds", {{"fp32_flops", shape.rates[0]}, {"bf16_flops", shape.rates[1]},
                                 {"fp32_streamed_flops", shape.rates[2]}, {"bf16_streamed_flops", shape.rates[3]}}}});
  return rates;
}

struct Bandwidths {
  double vector_bytes_per_s, copy_bytes_per_s;
};

// The vector units' bandwidth on a layer's access pattern, and a put's copy.
Bandwidths measure_bandwidths(int W, int reps, std::int64_t cold_bytes) {
  // A layer's vector tasks (SwiGLU, packs, reduces) read rows other tasks
  // wrote long before and write rows read long after: 64-row blocks walking
  // a region beyond the caches, as the tiles do. (In cache, one block over
  // and over, the rate here was 2-5x what the layer's vector tasks reach.)
  const std::int64_t rows = 64, inter = 1408, hidden = 2048;
  const std::int64_t region_rows = std::max<std::int64_t>(rows, cold_bytes / (3 * inter * 4) / rows * rows);
  std::vector<std::vector<float>> h(static_cast<std::size_t>(W), std::vector<float>(static_cast<std::size_t>(region_rows * 2 * inter), 0.5f));
  std::vector<std::vector<float>> a(static_cast<std::size_t>(W), std::vector<float>(static_cast<std::size_t>(region_rows * inter), 0.0f));
  // -1: not walked yet. The first walk over memory, by the worker's thread,
  // is not timed: on a virtual machine it ran at a twentieth of the later
  // ones (the runtime's buffers are walked every step).
  std::vector<std::int64_t> next_row(static_cast<std::size_t>(W), -1);
  const double swiglu_s = concurrent(W, reps, 64, [&](int w, int rounds) {
    auto& at = next_row[static_cast<std::size_t>(w)];
    if (at < 0) {
      at = 0;
      for (std::int64_t r = 0; r < region_rows; ++r)
        kernels::swiglu_forward<float>(h[w].data() + r * 2 * inter, inter, a[w].data() + r * inter);
    }
    for (int i = 0; i < rounds; ++i, at = (at + rows) % region_rows)
      for (std::int64_t r = at; r < at + rows; ++r)
        kernels::swiglu_forward<float>(h[w].data() + r * 2 * inter, inter, a[w].data() + r * inter);
  });
  h.clear();
  a.clear();
  const double vector_bytes = double(rows) * inter * (2 * 4 + 4);
  // A put's copy: rows of a token matrix into a peer's buffer (larger than cache, as in a layer).
  const std::int64_t copy_rows = 4096;
  std::vector<std::vector<float>> src(static_cast<std::size_t>(W), std::vector<float>(static_cast<std::size_t>(copy_rows * hidden), 1.0f));
  std::vector<std::vector<float>> dst(src);
  const double copy_s = concurrent(W, reps, 1, [&](int w, int rounds) {
    for (int i = 0; i < rounds; ++i)
      for (std::int64_t r = 0; r < copy_rows; r += 64)
        std::copy_n(src[w].data() + r * hidden, 64 * hidden, dst[w].data() + ((r * 7) % copy_rows) * hidden);
  });
  const double copy_bytes = double(copy_rows) * hidden * 4;
  return {vector_bytes / swiglu_s, copy_bytes / copy_s};
}

// An event's signal-to-wake latency: a ping-pong between two pinned threads (one way).
double measure_wake(bool quick) {
  detail::EventCounter ping, pong;
  const int rounds = quick ? 2000 : 20000;
  std::thread partner([&] {
    pin(1);
    for (int i = 1; i <= rounds; ++i) {
      detail::wait_until(ping, i, [] {});
      detail::signal(pong);
    }
  });
  pin(0);
  const auto t0 = Clock::now();
  for (int i = 1; i <= rounds; ++i) {
    detail::signal(ping);
    detail::wait_until(pong, i, [] {});
  }
  const double wake = std::chrono::duration<double>(Clock::now() - t0).count() / rounds / 2;
  partner.join();
  return wake;
}

// An empty bulk-synchronous step of the worker pool (the serialized baseline's barrier per operator).
double measure_barrier(int W, bool quick) {
  WorkerPool pool(1, W, true);
  std::vector<double> v;
  for (int i = 0; i < (quick ? 50 : 500); ++i) {
    const auto t0 = Clock::now();
    pool.run([](int, int) {});
    v.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(v);
}

struct TaskOverheads {
  double interleaved, serialized;
};

// The runtime's own cost per task: a layer whose tiles do next to nothing,
// interleaved and through the serialized baseline (less its barriers).
TaskOverheads measure_task_overheads(int W, bool quick, double barrier) {
  const LayerConfig c = empty_tiles_layer(1, 4096);
  const auto w = random_weights(c, 1);
  const auto in = random_inputs(c, 1);
  Layer layer(c, w, Parallel{.workers_per_rank = W, .backward = false});
  std::vector<double> v;
  std::size_t tasks = 0;
  std::vector<bool> kinds(static_cast<std::size_t>(taskflow::TaskKind::count), false);
  for (int i = 0; i < (quick ? 3 : 15); ++i) {
    const Layer::Step done = layer.forward(in.x);
    v.push_back(done.result().dispatch_to_combine_seconds);
    const auto& program = StepInspector::programs(done)[0];
    tasks = program.tasks.size();
    for (const auto& t : program.tasks) kinds[static_cast<std::size_t>(t.kind)] = true;
  }
  const double per_task = median(v) * W / double(tasks);
  // The serialized baseline over the same tasks: dealt out in turn, a
  // barrier after each operator. Less the barriers the simulator charges
  // (one between operators), what is left is its cost per task.
  v.clear();
  for (int i = 0; i < (quick ? 3 : 15); ++i)
    v.push_back(layer.forward(view(in.x), ForwardOptions{.schedule = Schedule::serialized}).result().dispatch_to_combine_seconds);
  const auto operators = std::count(kinds.begin(), kinds.end(), true);
  const double serialized_per_task = std::max(0.0, median(v) - double(operators - 1) * barrier) * W / double(tasks);
  return {per_task, serialized_per_task};
}

}  // namespace

json calibrate(const CalibrateOptions& opt, const std::function<void(const std::string&)>& progress) {
  auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  kernels::init();
  const int W = opt.workers, reps = opt.quick ? 1 : 5;
  const std::int64_t cold_bytes = opt.quick ? std::int64_t{96} << 20 : beyond_cache_bytes();
  // One worker per core is what the model describes and what can be
  // measured; each takes two regions beyond the caches.
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores > 0 && W > static_cast<int>(cores))
    throw Error("calibrate -W " + std::to_string(W) + ": this machine runs " + std::to_string(cores) +
                " threads at once, and calibration measures one worker per core (use -W " + std::to_string(cores) + " or fewer)");
  require_memory(double(W) * 2.0 * double(cold_bytes), "calibrate -W " + std::to_string(W),
                 std::to_string(W) + " workers x 2 x " + gib_text(double(cold_bytes)) + " beyond the caches",
                 "use fewer workers (-W) or --quick");
  say("tile GEMM rates");
  const json rates = measure_tile_rates(W, reps, cold_bytes, say);
  say("vector and copy bandwidth");
  const Bandwidths bandwidth = measure_bandwidths(W, reps, cold_bytes);
  say("event signal-to-wake latency");
  const double wake = measure_wake(opt.quick);
  say("operator barrier and per-task overhead");
  const double barrier = measure_barrier(W, opt.quick);
  const TaskOverheads per_task = measure_task_overheads(W, opt.quick, barrier);

  say("vector task kinds in a layer");
  // A layer of mid-size shapes (hidden 2048, experts of 1408, 256 tokens:
  // the sizes of the layers the model is checked on, but none of them),
  // Zipf-routed.
  LayerConfig vector_layer = empty_tiles_layer(1, 256);  // 8 experts, top 2; sizes below
  vector_layer.name = "vector-calibration";
  vector_layer.hidden = 2048;
  vector_layer.expert_inter = vector_layer.shared_inter = 1408;
  vector_layer.shared_experts = 1;
  vector_layer.validate();
  const json by_kind = vector_kind_rates(vector_layer, W, opt.quick ? 2 : 7);

  say("FMA peak of one core");
  const FmaPeak peak = measure_fma_peak(0.05, 7);
  const std::string when = std::to_string(std::chrono::system_clock::to_time_t(std::chrono::system_clock::now()));
  json model = {
      {"name", "cpu-local"},
      {"description", "this machine, " + std::to_string(W) + " workers per rank, in-process ranks (hpmoe calibrate)"},
      {"kind", "cpu"},
      {"units", {{"workers", W}}},
      {"tile", {{"rows", kernels::kTileRows}, {"cols", kernels::kTileCols}, {"weight_rows", kernels::kWeightTileRows}, {"weight_cols", kernels::kWeightTileCols}}},
      {"matrix", {{"tile_rates", rates}}},
      {"vector", {{"bytes_per_s", bandwidth.vector_bytes_per_s}, {"by_kind", by_kind}}},
      {"task_overhead_s", per_task.interleaved},
      {"signal_latency_s", wake},
      {"put", {{"issue_s", 0.0}, {"copy_bytes_per_s", bandwidth.copy_bytes_per_s}}},
      {"links", {{"ranks_per_node", 1000000}, {"intra", {{"bytes_per_s", 0.0}, {"latency_s", wake}}},
                 {"inter", {{"bytes_per_s", 0.0}, {"latency_s", wake}}}}},
      {"serialized", {{"operator_launch_s", barrier}, {"collective_sync_s", 0.0}, {"task_overhead_s", per_task.serialized}}},
      {"peak", {{"cpu", peak.cpu}, {"isa", peak.isa}, {"fp32_fma_flops_per_core", peak.fp32_flops_per_core},
                {"bf16_isa", peak.bf16_isa}, {"bf16_dot_flops_per_core", peak.bf16_flops_per_core},
                {"amx_bf16_flops_per_core", peak.amx_bf16_flops_per_core},
                {"bf16_engine", kernels::name(kernels::bf16_engine())},
                {"copy_bytes_per_s", bandwidth.copy_bytes_per_s}, {"not_measured", peak.not_measured}}},
      {"sources",
       {{"matrix.tile_rates", "m x 64 x k tile GEMMs (the runtime's kernel: libxsmm for fp32; for bf16 peak.bf16_engine), all workers at once, output tiles written a row apart into a matrix of " +
                                  std::to_string(cold_bytes >> 20) + " MiB per worker (twice the last-level cache, at least 96 MiB: from memory); *_flops: cycling through 32 weight panels (reused, as by an expert's next row tiles), *_streamed_flops: a fresh panel per tile walking " +
                                  std::to_string(cold_bytes >> 20) + " MiB (from memory, as at an expert's first row tile); each shape's second-fastest of " + std::to_string(reps) + " rounds through all the shapes (every round's rate under 'rounds')"},
        {"vector.bytes_per_s", "swiglu_forward over 64-row blocks of 1408 walking " + std::to_string(cold_bytes >> 20) +
                                   " MiB per worker (bytes read + written; from memory, as a layer's vector tasks), all workers at once"},
        {"vector.by_kind", "each vector kind in the runtime: a layer of hidden 2048, 8 experts of 1408 (top 2) and a shared one, 256 tokens, Zipf-routed (1.2), 1 rank of " +
                               std::to_string(W) + " workers, forward and backward through the interleaved executor, traced; per step, the bytes its tasks' access-table traffic terms count over their summed run time; the median of 7 steps after a warm-up"},
        {"put.copy_bytes_per_s", "64-row copies of hidden 2048 fp32 rows out of a 32 MiB matrix, all workers at once; in process a put is the worker's copy"},
        {"signal_latency_s", "event counter ping-pong between two pinned threads (one way)"},
        {"task_overhead_s", "a launch of a layer with hidden 2 (tiles that do next to nothing): launch time x workers / tasks"},
        {"serialized.operator_launch_s", "an empty bulk-synchronous step of the worker pool (the baseline's barrier per operator)"},
        {"serialized.task_overhead_s", "the same layer through the serialized baseline (the runtime's phased mode: tiles dealt out in turn, a barrier per operator): launch time less a barrier between operators, x workers / tasks"},
        {"links", "in process there is no link: the sender's copy moves the bytes; latency is the signal's"},
        {"peak", "one core: 12 independent FMA chains on the widest vectors the CPU has (fp32), and AVX512-BF16 dot products where present, compiler intrinsics, best of 7 runs of 50 ms; copy bandwidth as put.copy_bytes_per_s; AMX tiles are not measured"},
        {"calibrated_at_unix", when}}}};
  return model;
}

}  // namespace hpmoe::sim
