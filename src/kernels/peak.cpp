// The FMA peak of this core, measured with compiler intrinsics (no
// assembly): each ISA's loop is compiled for that ISA alone and run only
// where the CPU reports it.
#include "hpmoe/peak.hpp"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>

namespace hpmoe {

namespace {

using Clock = std::chrono::steady_clock;

// Each loop runs `iters` iterations of 12 independent FMAs and returns a
// value derived from the accumulators, so that nothing is optimised away.
// One definition per ISA, each compiled for that ISA alone.
#define HPMOE_FMA_LOOP(NAME, TARGET, VEC, LANES, SET1, FMA, STORE)                     \
  __attribute__((target(TARGET))) float NAME(long iters) {                             \
    VEC a[12];                                                                         \
    for (int i = 0; i < 12; ++i) a[i] = SET1(0.001f * float(i));                       \
    const VEC x = SET1(0.999999f), y = SET1(1e-7f);                                    \
    for (long n = 0; n < iters; ++n)                                                   \
      for (int i = 0; i < 12; ++i) a[i] = FMA(a[i], x, y);                             \
    float out[LANES], sum = 0;                                                         \
    for (int i = 0; i < 12; ++i) {                                                     \
      STORE(out, a[i]);                                                                \
      for (float v : out) sum += v;                                                    \
    }                                                                                  \
    return sum;                                                                        \
  }

HPMOE_FMA_LOOP(fma_avx512, "avx512f", __m512, 16, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps)
HPMOE_FMA_LOOP(fma_avx2, "avx2,fma", __m256, 8, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps)
#undef HPMOE_FMA_LOOP

__attribute__((target("avx512f,avx512bf16"))) float dot_avx512bf16(long iters) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * float(i));
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
  const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(2e-3f));
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  float out[16];
  _mm512_storeu_ps(out, s);
  float sum = 0;
  for (float v : out) sum += v;
  return sum;
}

float scalar_fma(long iters) {
  float a[12];
  for (int i = 0; i < 12; ++i) a[i] = 0.001f * float(i);
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < 12; ++i) a[i] = a[i] * 0.999999f + 1e-7f;
  float s = 0;
  for (float v : a) s += v;
  return s;
}

volatile float sink = 0;

// Best flops per second over `rounds` timed runs of about `seconds` each.
template <class Loop>
double best_rate(Loop loop, double flops_per_iteration, double seconds, int rounds) {
  long iters = 1000;
  for (;;) {  // size the run to about `seconds`
    const auto t0 = Clock::now();
    sink = sink + loop(iters);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s > seconds / 4 || iters > (1L << 40)) {
      iters = std::max(1000L, static_cast<long>(double(iters) * seconds / std::max(s, 1e-9)));
      break;
    }
    iters *= 4;
  }
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = Clock::now();
    sink = sink + loop(iters);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, double(iters) * flops_per_iteration / s);
  }
  return best;
}

}  // namespace

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto name = line.substr(colon + 1);
        name.erase(0, name.find_first_not_of(" \t"));
        return name;
      }
    }
  return "unknown CPU";
}

FmaPeak measure_fma_peak(double seconds, int rounds) {
  FmaPeak p;
  p.cpu = cpu_model_name();
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    p.isa = "avx512f";
    p.fp32_flops_per_core = best_rate(fma_avx512, 12.0 * 16 * 2, seconds, rounds);
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    p.isa = "avx2+fma";
    p.fp32_flops_per_core = best_rate(fma_avx2, 12.0 * 8 * 2, seconds, rounds);
  } else {
    p.isa = "scalar";
    p.fp32_flops_per_core = best_rate(scalar_fma, 12.0 * 2, seconds, rounds);
  }
  if (__builtin_cpu_supports("avx512bf16")) {
    p.bf16_isa = "avx512bf16";
    p.bf16_flops_per_core = best_rate(dot_avx512bf16, 12.0 * 32 * 2, seconds, rounds);
  }
  // AMX tiles need the OS's permission and a tile configuration; not measured.
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      if (line.find(" amx_bf16") != std::string::npos) p.not_measured = "AMX-BF16 tiles";
      break;
    }
  return p;
}

}  // namespace hpmoe
