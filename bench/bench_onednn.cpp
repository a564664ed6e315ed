// oneDNN's matmul primitive measured as an alternative engine for hpmoe's
// tile GEMMs (issue 13, item 2): the same tile shapes, one thread, weights
// reordered once into the layout oneDNN picks (as hpmoe packs its panels),
// next to hpmoe's libxsmm tile in the same process, both as a share of this
// core's measured FMA peak (fp32 FMAs; for bf16 the AVX512-BF16 dot peak,
// which AMX, where oneDNN uses it, is not bound by). Built when Debian's
// libdnnl-dev is present; set OMP_NUM_THREADS=1 (oneDNN's runtime is OpenMP),
// and ONEDNN_VERBOSE=1 to see which implementation (avx512, amx) ran.
//
//   OMP_NUM_THREADS=1 build/bench/bench_onednn [REPS]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "kernels/kernels.hpp"
#include "kernels/peak.hpp"
#include "hpmoe/tensors.hpp"

using namespace hpmoe;
using namespace hpmoe::kernels;

namespace {

template <class Fn>
double best_seconds(int reps, Fn&& fn) {
  fn();  // warm: JIT, caches
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// C[m, n] = A[m, k] B[k, n] by oneDNN, `iters` times per call; dt: f32 or bf16 inputs, f32 output.
double onednn_seconds(dnnl::engine& eng, dnnl::stream& s, std::int64_t m, std::int64_t n, std::int64_t k,
                      dnnl::memory::data_type dt, int reps, int iters, std::string& impl) {
  using dnnl::memory;
  const memory::desc a_md({m, k}, dt, memory::format_tag::ab);
  const memory::desc b_any({k, n}, dt, memory::format_tag::any);
  const memory::desc c_md({m, n}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_any, c_md), eng);  // oneDNN 2.x API
  impl = pd.impl_info_str();
  memory a(a_md, eng), b_plain({{k, n}, dt, memory::format_tag::ab}, eng), b(pd.weights_desc(), eng), c(c_md, eng);
  // Inputs: small integers, exact in bf16.
  const auto fill = [&](memory& mem, std::int64_t count) {
    if (dt == memory::data_type::f32) {
      auto* p = static_cast<float*>(mem.get_data_handle());
      for (std::int64_t i = 0; i < count; ++i) p[i] = float(i % 7) - 3;
    } else {
      auto* p = static_cast<std::uint16_t*>(mem.get_data_handle());
      for (std::int64_t i = 0; i < count; ++i) p[i] = bf16::from_float(float(i % 7) - 3).bits;
    }
  };
  fill(a, m * k);
  fill(b_plain, k * n);
  dnnl::reorder(b_plain, b).execute(s, b_plain, b);  // once, like hpmoe's packing
  s.wait();
  const dnnl::matmul mm(pd);
  return best_seconds(reps, [&] {
           for (int i = 0; i < iters; ++i) mm.execute(s, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
           s.wait();
         }) /
         iters;
}

template <class T>
double hpmoe_seconds(std::int64_t m, std::int64_t n, std::int64_t k, int reps, int iters) {
  std::vector<T> a(static_cast<std::size_t>(m * k));
  std::vector<float> raw(static_cast<std::size_t>(k * n)), c(static_cast<std::size_t>(m * n));
  for (std::size_t i = 0; i < a.size(); ++i) {
    if constexpr (sizeof(T) == 2) a[i] = bf16::from_float(float(i % 7) - 3);
    else a[i] = float(i % 7) - 3;
  }
  for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = float(i % 5) - 2;
  std::vector<T> b(static_cast<std::size_t>(panel_blocked_size<T>(k, n)));
  pack_rhs_panels<float, T>(raw.data(), n, k, n, false, b.data(), 0, (n + kTileCols - 1) / kTileCols);
  return best_seconds(reps, [&] {
           for (int i = 0; i < iters; ++i)
             for (std::int64_t j = 0; j < n; j += kTileCols)
               gemm_tile<T>(a.data(), k, panel_view<T>(b.data(), k), j, c.data() + j, n, m, std::min(kTileCols, n - j), k, false);
         }) /
         iters;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  init();
  const FmaPeak peak = measure_fma_peak(0.05, 7);
  std::printf("CPU: %s; FMA peak per core: fp32 %.1f GFLOP/s (%s), bf16 dot %.1f GFLOP/s (%s)\n", peak.cpu.c_str(),
              peak.fp32_flops_per_core / 1e9, peak.isa.c_str(), peak.bf16_flops_per_core / 1e9, peak.bf16_isa.c_str());
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  std::printf("| shape m x n x k | dtype | hpmoe libxsmm GFLOP/s (%% of peak) | oneDNN GFLOP/s (%% of peak) | oneDNN implementation |\n");
  std::printf("|---|---|---|---|---|\n");
  struct Shape {
    std::int64_t m, n, k;
  };
  for (const Shape sh : {Shape{128, 64, 2048}, Shape{128, 64, 7168}, Shape{128, 2816, 2048}, Shape{64, 2048, 1408},
                         Shape{64, 64, 72}}) {
    for (const bool bf : {false, true}) {
      const double flops = 2.0 * double(sh.m) * double(sh.n) * double(sh.k);
      const int iters = std::max<int>(1, int(2e8 / flops));
      std::string impl;
      const double ours = bf ? hpmoe_seconds<bf16>(sh.m, sh.n, sh.k, reps, iters) : hpmoe_seconds<float>(sh.m, sh.n, sh.k, reps, iters);
      const double theirs = onednn_seconds(eng, s, sh.m, sh.n, sh.k, bf ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32,
                                           reps, iters, impl);
      const double pk = bf && peak.bf16_tile_peak_per_core() > 0 ? peak.bf16_tile_peak_per_core() : peak.fp32_flops_per_core;
      std::printf("| %lld x %lld x %lld | %s | %.1f (%.0f%%) | %.1f (%.0f%%) | %s |\n", (long long)sh.m, (long long)sh.n,
                  (long long)sh.k, bf ? "bf16" : "fp32", flops / ours / 1e9, 100 * flops / ours / pk, flops / theirs / 1e9,
                  100 * flops / theirs / pk, impl.c_str());
    }
  }
  return 0;
}
