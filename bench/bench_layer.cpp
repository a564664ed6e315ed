// The whole serialized baseline layer, forward and forward+backward, against
// the machine's GEMM roofline: cores x the single-thread tile GEMM rate
// (64 x 64 x H tile, same dtype) measured in the same process.
//
//   build/bench/bench_layer --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
//
// The layer is deepseek-v2-lite's expert shape (H 2048, I 1408, top-6, two
// shared experts) with 16 routed experts and 1024 tokens per rank, EP 2 x 1
// worker: one worker per core on a 2-core machine.
#include <benchmark/benchmark.h>

#include <chrono>
#include <thread>

#include "hpmoe/layer.hpp"
#include "kernels/kernels.hpp"

using namespace hpmoe;
using namespace hpmoe::kernels;

namespace {

template <class T>
double tile_gflops(std::int64_t k) {
  init();
  std::vector<T> a(static_cast<std::size_t>(64 * k)), b(static_cast<std::size_t>(k * 64));
  for (std::size_t i = 0; i < a.size(); ++i) {
    if constexpr (sizeof(T) == 2) a[i] = b[i] = bf16::from_float(0.5f);
    else a[i] = b[i] = 0.5f;
  }
  std::vector<float> c(64 * 64);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const int calls = 200;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) gemm_tile<T>(a.data(), k, RhsView<T>{b.data(), 64}, 0, c.data(), 64, 64, 64, k, false);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * 64 * 64 * double(k) * calls / sec / 1e9);
  }
  return best;
}

LayerConfig bench_layer_config(DType dtype) {
  LayerConfig c = preset("deepseek-v2-lite");
  c.routed_experts = 16;
  c.tokens_per_rank = 1024;
  c.ranks = 2;
  c.dtype = dtype;
  c.validate();
  return c;
}

void BM_SerializedLayer(benchmark::State& state) {
  const DType dtype = state.range(0) ? DType::bf16 : DType::fp32;
  const bool backward = state.range(1) != 0;
  const LayerConfig c = bench_layer_config(dtype);
  const double tile = dtype == DType::fp32 ? tile_gflops<float>(c.hidden) : tile_gflops<bf16>(c.hidden);
  const double roofline = double(std::max(1u, std::thread::hardware_concurrency())) * tile;
  const auto w = random_weights(c, 1);
  const auto in = random_inputs(c, 1);
  Layer layer(c, w, Parallel{.workers_per_rank = 1, .schedule = Schedule::serialized, .backward = backward, .pin = true});
  auto step = [&] {
    Layer::Step s = layer.forward(in.x);
    if (backward) s.backward(view(in.d_out));
    return s;
  };
  step();  // warm
  double flops = 0, total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const Layer::Step done = step();
    const StepResult& r = done.result();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(sec);
    total += sec;
    std::int64_t kept = 0;
    for (auto k : r.routing.kept) kept += k;
    const double n = double(c.total_tokens());
    const double fwd = double(kept) * 6.0 * double(c.hidden) * double(c.expert_inter) +
                       n * 6.0 * double(c.hidden) * double(c.shared_inter_total()) +
                       n * 2.0 * double(c.hidden) * double(c.routed_experts);
    flops += backward ? 3.0 * fwd : fwd;
  }
  const double gflops = flops / total / 1e9;
  state.counters["GFLOP/s"] = gflops;
  state.counters["roofline_GFLOP/s"] = roofline;
  state.counters["pct_of_roofline"] = 100.0 * gflops / roofline;
}

}  // namespace

BENCHMARK(BM_SerializedLayer)
    ->ArgNames({"bf16", "backward"})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime()
    ->MinTime(2.0);

BENCHMARK_MAIN();
