// Tile GEMM throughput over the tile shapes the MoE layer uses, next to a
// large single-thread GEMM measured in the same process.
//
//   build/bench/bench_kernels --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// Counters: GFLOP/s of the benchmark, and pct_of_large: its GFLOP/s as a
// percentage of the large 2048^3 single-thread GEMM of the same dtype driven
// through the same libxsmm kernels (measured once, first thing). For fp32 the
// large GEMM of OpenBLAS (one thread) is reported too, as an outside check.
// pct_of_fma_peak: the same GFLOP/s as a percentage of this core's measured
// FMA peak (fp32 FMAs for fp32, AVX512-BF16 dot products for bf16 where the
// CPU has them, else the fp32 peak), measured first; the CPU model and both
// peaks are in the benchmark's context lines.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <type_traits>
#include <vector>

#include "common/fp8.hpp"
#include "runtime/executor_parts.hpp"
#include "kernels/kernels.hpp"
#include "kernels/peak.hpp"
#include "hpmoe/tensors.hpp"

#ifdef HPMOE_HAVE_CBLAS
#include <cblas.h>
extern "C" void openblas_set_num_threads(int);
#endif

using namespace hpmoe;
using namespace hpmoe::kernels;

namespace {

template <class T>
struct Operands {
  AlignedVector<T> a;     // [m, k] row-major
  AlignedVector<T> b;     // [k, n] in the kernel's panel-blocked layout
  AlignedVector<float> c; // [m, n]
  Operands(std::int64_t m, std::int64_t n, std::int64_t k) {
    Rng rng(42);
    a.resize(static_cast<std::size_t>(m * k));
    for (auto& v : a) v = from_float(float(rng.normal()));
    std::vector<float> raw(static_cast<std::size_t>(k * n));
    for (auto& v : raw) v = float(rng.normal());
    b.resize(static_cast<std::size_t>(panel_blocked_size<T>(k, n)));
    pack_rhs_panels<float, T>(raw.data(), n, k, n, false, b.data(), 0, (n + kTileCols - 1) / kTileCols);
    c.resize(static_cast<std::size_t>(m * n));
  }
  static T from_float(float v) {
    if constexpr (sizeof(T) == 2) return bf16::from_float(v);
    else return v;
  }
};

// C[m, n] = A B as the executors do it: every 64 x 64 output tile with the
// whole K in one batch-reduce call.
template <class T>
void tiled_gemm(Operands<T>& o, std::int64_t m, std::int64_t n, std::int64_t k) {
  for (std::int64_t i = 0; i < m; i += kTileRows)
    for (std::int64_t j = 0; j < n; j += kTileCols)
      gemm_tile<T>(o.a.data() + i * k, k, panel_view<T>(o.b.data(), k), j, o.c.data() + i * n + j, n,
                   std::min(kTileRows, m - i), std::min(kTileCols, n - j), k, false);
}

template <class T>
double large_gemm_gflops() {
  static const double value = [] {
    init();
    const std::int64_t s = 2048;
    Operands<T> o(s, s, s);
    tiled_gemm<T>(o, s, s, s);  // warm
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      tiled_gemm<T>(o, s, s, s);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * s * s * s / sec / 1e9);
    }
    return best;
  }();
  return value;
}

const FmaPeak& peak() {
  static const FmaPeak p = measure_fma_peak(0.05, 7);
  return p;
}

// Runs the benchmark's iterations, timing each by hand (manual time);
// returns the seconds they took in all.
template <class Fn>
double timed_iterations(benchmark::State& state, Fn&& body) {
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(sec);
    total += sec;
  }
  return total;
}

// Times each iteration by hand so the ratio to the large GEMM can be reported
// as a counter of its own.
template <class Fn>
void measure(benchmark::State& state, double flops_per_iter, double large, Fn&& body, bool bf16 = false) {
  const double total = timed_iterations(state, body);
  const double gflops = flops_per_iter * double(state.iterations()) / total / 1e9;
  state.counters["GFLOP/s"] = gflops;
  state.counters["large_GFLOP/s"] = large;
  state.counters["pct_of_large"] = 100.0 * gflops / large;
  const double fma = (bf16 && peak().bf16_tile_peak_per_core() > 0 ? peak().bf16_tile_peak_per_core() : peak().fp32_flops_per_core) / 1e9;
  state.counters["pct_of_fma_peak"] = 100.0 * gflops / fma;
}

// One output tile of the layer, hot in cache: the kernel itself.
template <class T>
void BM_Tile(benchmark::State& state) {
  init();
  const std::int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const double large = large_gemm_gflops<T>();
  Operands<T> o(m, n, k);
  measure(state, 2.0 * m * n * k, large, [&] {
    gemm_tile<T>(o.a.data(), k, panel_view<T>(o.b.data(), k), 0, o.c.data(), n, m, n, k, false);
    benchmark::DoNotOptimize(o.c.data());
  }, std::is_same_v<T, bf16>);
}

// One expert's GEMM as the baseline runs it (all its tiles, real sizes).
template <class T>
void BM_ExpertGemm(benchmark::State& state) {
  init();
  const std::int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const double large = large_gemm_gflops<T>();
  Operands<T> o(m, n, k);
  measure(state, 2.0 * m * n * k, large, [&] {
    tiled_gemm<T>(o, m, n, k);
    benchmark::DoNotOptimize(o.c.data());
  }, std::is_same_v<T, bf16>);
}

template <class T>
void BM_LargeGemm(benchmark::State& state) {
  const std::int64_t s = 2048;
  Operands<T> o(s, s, s);
  init();
  measure(state, 2.0 * s * s * s, large_gemm_gflops<T>(), [&] {
    tiled_gemm<T>(o, s, s, s);
    benchmark::DoNotOptimize(o.c.data());
  }, std::is_same_v<T, bf16>);
}

#ifdef HPMOE_HAVE_CBLAS
void BM_LargeGemm_OpenBLAS_fp32(benchmark::State& state) {
  openblas_set_num_threads(1);
  const int s = 2048;
  Operands<float> o(s, s, s);
  std::vector<float> b(static_cast<std::size_t>(s) * s, 0.5f);  // OpenBLAS takes plain row-major B
  measure(state, 2.0 * s * s * s, large_gemm_gflops<float>(), [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s, s, s, 1.0f, o.a.data(), s, b.data(), s, 0.0f,
                o.c.data(), s);
    benchmark::DoNotOptimize(o.c.data());
  });
}
BENCHMARK(BM_LargeGemm_OpenBLAS_fp32)->Unit(benchmark::kMillisecond)->UseManualTime();
#endif

// ---- Vector work against the measured copy bandwidth (issue 13, item 4).
// Operands larger than the caches (as a layer's are); bytes counted once per
// element read or written. pct_of_copy: the kernel's bytes/s as a share of
// a plain memcpy's (read + written) over buffers of the same size, measured
// once in this process.
constexpr std::size_t kStreamBytes = std::size_t{64} << 20;

double copy_bytes_per_s() {
  static const double value = [] {
    std::vector<char> a(kStreamBytes, 1), b(kStreamBytes, 0);
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) std::memcpy(b.data(), a.data(), kStreamBytes);  // warm: pages, clocks
    for (int rep = 0; rep < 30; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      std::memcpy(b.data(), a.data(), kStreamBytes);
      benchmark::DoNotOptimize(b.data());
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * double(kStreamBytes) / sec);
    }
    return best;
  }();
  return value;
}

template <class Fn>
void measure_bytes(benchmark::State& state, double bytes_per_iter, Fn&& body) {
  const double total = timed_iterations(state, body);
  const double rate = bytes_per_iter * double(state.iterations()) / total;
  state.counters["GB/s"] = rate / 1e9;
  state.counters["copy_GB/s"] = copy_bytes_per_s() / 1e9;
  state.counters["pct_of_copy"] = 100.0 * rate / copy_bytes_per_s();
}

void BM_Copy(benchmark::State& state) {
  std::vector<char> a(kStreamBytes, 1), b(kStreamBytes, 0);
  measure_bytes(state, 2.0 * double(kStreamBytes), [&] {
    std::memcpy(b.data(), a.data(), kStreamBytes);
    benchmark::DoNotOptimize(b.data());
  });
}

// SwiGLU over rows of deepseek-v2-lite's experts (inter 1408): h fp32 [rows, 2I] -> a [rows, I].
template <class T>
void BM_Swiglu(benchmark::State& state) {
  const std::int64_t inter = 1408, rows = std::int64_t(kStreamBytes / (2 * inter * 4));
  std::vector<float> h(static_cast<std::size_t>(rows * 2 * inter), 0.5f);
  std::vector<T> a(static_cast<std::size_t>(rows * inter));
  measure_bytes(state, double(rows) * double(inter) * (2.0 * 4 + sizeof(T)), [&] {
    for (std::int64_t r = 0; r < rows; ++r) swiglu_forward<T>(h.data() + r * 2 * inter, inter, a.data() + r * inter);
    benchmark::DoNotOptimize(a.data());
  });
}

// The weight-gradient packs' transpose: blocks of `rows` token rows of
// hidden 2048 into the columns of x^T (an expert's rows among 4096), as
// kernels::transpose_rows (arg 1 = 1, blocks of 16 rows) and as the plain
// loop it replaced (arg 1 = 0).
template <class T>
void BM_TransposeRows(benchmark::State& state) {
  const std::int64_t H = 2048, rows = state.range(0), ld_dst = 4096, blocks = std::int64_t(kStreamBytes / (rows * H * sizeof(T)));
  const bool plain = state.range(1) == 0;
  std::vector<T> src(static_cast<std::size_t>(blocks * rows * H), T(1.0f)), dst(static_cast<std::size_t>(H * ld_dst));
  measure_bytes(state, 2.0 * double(blocks * rows * H) * sizeof(T), [&] {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const T* from = src.data() + b * rows * H;
      T* to = dst.data() + (b * rows) % (ld_dst - rows);
      if (plain) {
        for (std::int64_t j = 0; j < H; ++j)
          for (std::int64_t i = 0; i < rows; ++i) to[j * ld_dst + i] = from[i * H + j];
      } else {
        transpose_rows<T>(from, H, rows, H, to, ld_dst);
      }
    }
    benchmark::DoNotOptimize(dst.data());
  });
}

// The weight-gradient packs' panels: an output gradient's token tiles
// (hidden 2048, `rows` rows each) into the panel-blocked right operand of
// the dW GEMM (bf16: VNNI pairs along the tokens), as
// kernels::pack_rows_into_panels.
template <class T>
void BM_PackGradRows(benchmark::State& state) {
  const std::int64_t H = 2048, rows = state.range(0), blocks = std::int64_t(kStreamBytes / (rows * H * sizeof(T)));
  const std::int64_t height = padded_k<T>(blocks * rows);
  std::vector<T> src(static_cast<std::size_t>(blocks * rows * H), T(1.0f));
  AlignedVector<T> panels(static_cast<std::size_t>(height * ((H + kTileCols - 1) / kTileCols) * kTileCols));
  measure_bytes(state, 2.0 * double(blocks * rows * H) * sizeof(T), [&] {
    for (std::int64_t b = 0; b < blocks; ++b)
      pack_rows_into_panels<T>(src.data() + b * rows * H, H, rows, H, panels.data(), height, b * rows, 0);
    benchmark::DoNotOptimize(panels.data());
  });
}

// Dispatch's permute: rows of x gathered by token index into the send order (hidden 2048).
template <class T>
void BM_Permute(benchmark::State& state) {
  const std::int64_t H = 2048, rows = std::int64_t(kStreamBytes / (H * sizeof(T)));
  std::vector<T> x(static_cast<std::size_t>(rows * H)), out(static_cast<std::size_t>(rows * H));
  std::vector<std::int32_t> token(static_cast<std::size_t>(rows));
  Rng rng(3);
  for (auto& t : token) t = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(rows));
  measure_bytes(state, 2.0 * double(rows) * double(H) * sizeof(T), [&] {
    for (std::int64_t r = 0; r < rows; ++r)
      kernels::copy_elements(out.data() + r * H, x.data() + std::int64_t{token[static_cast<std::size_t>(r)]} * H, H);
    benchmark::DoNotOptimize(out.data());
  });
}

// The combine: each token's K returned rows weighted in k order into its fp32 output (hidden 2048, top-6).
template <class T>
void BM_Combine(benchmark::State& state) {
  const std::int64_t H = 2048, K = 6, tokens = std::int64_t(kStreamBytes / (H * K * sizeof(T)));
  std::vector<T> comb(static_cast<std::size_t>(tokens * K * H));
  std::vector<float> out(static_cast<std::size_t>(tokens * H)), weights(static_cast<std::size_t>(tokens * K), 0.25f);
  std::vector<std::int64_t> slots(static_cast<std::size_t>(tokens * K));
  Rng rng(5);
  for (auto& s : slots) s = static_cast<std::int64_t>(rng.next() % static_cast<std::uint64_t>(tokens * K));
  measure_bytes(state, double(tokens) * double(H) * (double(K) * sizeof(T) + 4.0), [&] {
    for (std::int64_t t = 0; t < tokens; ++t)
      kernels::combine_row<T>(out.data() + t * H, H, K, slots.data() + t * K, weights.data() + t * K, comb.data(), {});
    benchmark::DoNotOptimize(out.data());
  });
}

// Tile shapes: full 64 x 64 tiles with K = deepseek-v2-lite's H (gate/up),
// I (down), 2I (gate/up data gradient), deepseek-v3's H, and a ragged
// 17-row tile (the tail of an expert's rows).
void tile_shapes(benchmark::internal::Benchmark* b) {
  for (std::int64_t k : {1408, 2048, 2816, 7168}) b->Args({64, 64, k});
  b->Args({17, 64, 2048});
  for (std::int64_t k : {2048, 7168}) b->Args({128, 64, k});  // the runtime's token row tiles
  // weight-gradient tiles: K is an expert's rows of a step (64 rows; 256 for bf16 on AMX)
  b->Args({64, 64, 384});
  b->Args({128, 64, 384});
  b->Args({256, 64, 384});
}
// deepseek-v2-lite expert GEMMs with 384 rows (its mean load at EP2, 2048 tokens/rank).
void expert_shapes(benchmark::internal::Benchmark* b) {
  b->Args({384, 2816, 2048});  // gate+up
  b->Args({384, 2048, 1408});  // down
}

}  // namespace

// The fp8 dispatch's codec on one DeepSeek-V3 row (7168 channels, 56
// scale blocks): bytes of fp32 per second in and out. Arg 1: the encode on
// the float's bits (the library's); arg 0: by the definition (frexp,
// ldexp, nearbyint per element), the codec before it.
static void BM_Fp8EncodeRow(benchmark::State& state) {
  std::vector<float> x(7168);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 3.0f * std::sin(0.37f * float(i));
  std::vector<std::uint8_t> row(static_cast<std::size_t>(hpmoe::fp8_row_bytes(7168)));
  const bool bits = state.range(0) == 1;
  for (auto _ : state) {
    if (bits) hpmoe::fp8_encode_row(x.data(), 7168, row.data());
    else hpmoe::fp8_encode_row<hpmoe::fp8_e4m3_code_by_definition>(x.data(), 7168, row.data());
    benchmark::DoNotOptimize(row.data());
  }
  state.SetBytesProcessed(state.iterations() * 7168 * 4);
}
static void BM_Fp8DecodeRow(benchmark::State& state) {
  std::vector<float> x(7168);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 3.0f * std::sin(0.37f * float(i));
  std::vector<std::uint8_t> row(static_cast<std::size_t>(hpmoe::fp8_row_bytes(7168)));
  hpmoe::fp8_encode_row(x.data(), 7168, row.data());
  for (auto _ : state) {
    hpmoe::fp8_decode_row(row.data(), 7168, x.data());
    benchmark::DoNotOptimize(x.data());
  }
  state.SetBytesProcessed(state.iterations() * 7168 * 4);
}
BENCHMARK(BM_Fp8EncodeRow)->ArgNames({"bits"})->Arg(0)->Arg(1);
BENCHMARK(BM_Fp8DecodeRow);
BENCHMARK(BM_LargeGemm<float>)->Name("BM_LargeGemm_fp32")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_LargeGemm<bf16>)->Name("BM_LargeGemm_bf16")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_Copy)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_Swiglu<float>)->Name("BM_Swiglu_fp32")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_Swiglu<bf16>)->Name("BM_Swiglu_bf16")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_TransposeRows<float>)->Name("BM_TransposeRows_fp32")->ArgsProduct({{16, 32, 64, 128}, {0, 1}})->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_TransposeRows<bf16>)->Name("BM_TransposeRows_bf16")->ArgsProduct({{16, 64, 128}, {0, 1}})->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_PackGradRows<float>)->Name("BM_PackGradRows_fp32")->Arg(128)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_PackGradRows<bf16>)->Name("BM_PackGradRows_bf16")->Arg(128)->Arg(256)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_Permute<float>)->Name("BM_Permute_fp32")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_Permute<bf16>)->Name("BM_Permute_bf16")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_Combine<float>)->Name("BM_Combine_fp32")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_Combine<bf16>)->Name("BM_Combine_bf16")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_Tile<float>)->Name("BM_Tile_fp32")->Apply(tile_shapes)->UseManualTime();
BENCHMARK(BM_Tile<bf16>)->Name("BM_Tile_bf16")->Apply(tile_shapes)->UseManualTime();
BENCHMARK(BM_ExpertGemm<float>)->Name("BM_ExpertGemm_fp32")->Apply(expert_shapes)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_ExpertGemm<bf16>)->Name("BM_ExpertGemm_bf16")->Apply(expert_shapes)->Unit(benchmark::kMillisecond)->UseManualTime();

int main(int argc, char** argv) {
  const FmaPeak& p = peak();
  benchmark::AddCustomContext("cpu", p.cpu);
  benchmark::AddCustomContext("fma_peak_fp32_GFLOP/s_per_core", std::to_string(p.fp32_flops_per_core / 1e9) + " (" + p.isa + ")");
  benchmark::AddCustomContext("fma_peak_bf16_GFLOP/s_per_core",
                              p.bf16_flops_per_core > 0 ? std::to_string(p.bf16_flops_per_core / 1e9) + " (" + p.bf16_isa + ")"
                                                        : "none (no bf16 dot products; bf16 figures are against the fp32 peak)");
  if (p.amx_bf16_flops_per_core > 0)
    benchmark::AddCustomContext("amx_peak_bf16_GFLOP/s_per_core", std::to_string(p.amx_bf16_flops_per_core / 1e9));
  benchmark::AddCustomContext("bf16_engine", std::string(name(bf16_engine())) + "; bf16 pct_of_fma_peak is of the " +
                                                 (p.bf16_tile_isa().empty() ? "fp32" : p.bf16_tile_isa()) + " peak");
  if (!p.not_measured.empty()) benchmark::AddCustomContext("not_measured", p.not_measured);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
