// The FMA peak of this core, measured with compiler intrinsics (no
// assembly): each ISA's loop is compiled for that ISA alone and run only
// where the CPU reports it.
#include "kernels/peak.hpp"

#include "kernels/kernels.hpp"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
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

// AMX-BF16: four 16 x 16 fp32 accumulator tiles, each updated by a 16 x 32
// bf16 tile times a 32 x 16 (VNNI) one per step: 4 x 16 x 16 x 32 multiply-
// adds. Linux hands out the tile registers only on request
// (kernels::amx_permitted).

struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) float dot_amx_bf16(long iters) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  alignas(64) std::uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = 0x3a83;  // ~1e-3 in bf16
    b[i] = 0x3a03;
  }
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  for (long n = 0; n < iters; ++n) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float sum = 0;
  _tile_stored(0, c, 64);
  for (float v : c) sum += v;
  _tile_stored(3, c, 64);
  for (float v : c) sum += v;
  _tile_release();
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

// Whether /proc/cpuinfo lists `flag` (the kernel lists only what it enables).
bool cpu_flag(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) return (line + " ").find(" " + flag + " ") != std::string::npos;
  return false;
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
  if (cpu_flag("amx_bf16")) {  // libgcc 12's __builtin_cpu_supports does not report AMX
    if (kernels::amx_permitted()) p.amx_bf16_flops_per_core = best_rate(dot_amx_bf16, 4.0 * 16 * 16 * 32 * 2, seconds, rounds);
    else p.not_measured = "AMX-BF16 tiles (the kernel refused their permission)";
  }
  return p;
}

double FmaPeak::bf16_tile_peak_per_core() const {
  return kernels::amx_engine() && amx_bf16_flops_per_core > 0 ? amx_bf16_flops_per_core
                                                                                                 : bf16_flops_per_core;
}

std::string FmaPeak::bf16_tile_isa() const {
  return kernels::amx_engine() && amx_bf16_flops_per_core > 0 ? "amx-bf16" : bf16_isa;
}

}  // namespace hpmoe
