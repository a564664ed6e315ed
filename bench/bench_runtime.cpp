// Costs of the runtime's synchronisation, measured on the runtime's own code:
//   - signal-to-wake latency of an event counter between two workers
//     (ping-pong, one way = half a round trip), on two cores and, when both
//     share one core (oversubscribed), through the yield path;
//   - per-task cost of a launch whose tiles do almost nothing (a layer of
//     hidden 2, inter 2), next to the serialized baseline's time for the
//     same layer (its operators and barriers).
//
//   build/bench/bench_runtime --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <pthread.h>

#include <chrono>
#include <thread>

#include "hpmoe/layer.hpp"
#include "runtime/layer_inspect.hpp"
#include "comm/event_wait.hpp"

using namespace hpmoe;
using namespace hpmoe::detail;

namespace {

void pin(unsigned core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core % std::max(1u, std::thread::hardware_concurrency()), &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

void BM_SignalToWake(benchmark::State& state) {
  const bool same_core = state.range(0) != 0;
  EventCounter ping, pong;
  std::atomic<bool> stop{false};
  std::int64_t rounds = 0;
  struct Stopped {};
  std::thread partner([&] {
    pin(same_core ? 0 : 1);
    try {
      for (std::int64_t i = 1;; ++i) {
        wait_until(ping, i, [&] {
          if (stop.load()) throw Stopped{};
        });
        if (stop.load()) return;
        signal(pong);
      }
    } catch (const Stopped&) {
    }
  });
  pin(0);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    ++rounds;
    signal(ping);
    wait_until(pong, rounds, [] {});
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stop.store(true);
  signal(ping);
  partner.join();
  state.counters["one_way_ns"] = total / double(state.iterations()) / 2 * 1e9;
}

void BM_PerTaskCost(benchmark::State& state) {
  const std::int64_t ranks = state.range(0);
  const LayerConfig c = empty_tiles_layer(ranks, 4096 / ranks);
  const auto w = random_weights(c, 1);
  const auto in = random_inputs(c, 1);
  // One layer, both schedules on the same packing (an engine each).
  Layer layer(c, w, Parallel{.workers_per_rank = 1, .backward = false, .pin = true});
  const ForwardOptions serialized{.schedule = Schedule::serialized};
  layer.forward(in.x);
  layer.forward(view(in.x), serialized);
  double launch = 0, d2c = 0;
  std::int64_t tasks = 0;
  for (auto _ : state) {
    const Layer::Step a = layer.forward(in.x);
    const double a_seconds = a.result().dispatch_to_combine_seconds;
    if (tasks == 0)
      for (const auto& p : StepInspector::programs(a)) tasks += static_cast<std::int64_t>(p.tasks.size());
    const Layer::Step b = layer.forward(view(in.x), serialized);
    launch += a_seconds;
    d2c += b.result().dispatch_to_combine_seconds;
    state.SetIterationTime(a_seconds);
  }
  const double n = double(state.iterations());
  state.counters["tasks_per_rank"] = double(tasks) / double(ranks);
  state.counters["ns_per_task"] = launch / n / (double(tasks) / double(ranks)) * 1e9;
  // Serialized: forward operators after routing (plan, permute, a2a, GEMMs, ...).
  state.counters["serialized_us"] = d2c / n * 1e6;
  state.counters["interleaved_us"] = launch / n * 1e6;
}

}  // namespace

BENCHMARK(BM_SignalToWake)->ArgNames({"same_core"})->Arg(0)->Arg(1)->Unit(benchmark::kNanosecond)->MinTime(0.5);
BENCHMARK(BM_PerTaskCost)->ArgNames({"ranks"})->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
