#pragma once
// What this CPU can do at most, measured: the FMA peak of one core and the
// machine's name, so that every GEMM figure can be stated as a share of the
// hardware's peak and not only of hpmoe's own tile rate.
#include <string>

namespace hpmoe {

struct FmaPeak {
  std::string cpu;                  // the model name /proc/cpuinfo gives
  std::string isa;                  // "avx512f", "avx2+fma" or "scalar"
  double fp32_flops_per_core = 0;   // fused multiply-adds, 2 flops each
  std::string bf16_isa;             // "avx512bf16", or "" where the CPU has no bf16 dot products
  double bf16_flops_per_core = 0;   // bf16 dot products (2 flops a pair), 0 without them
  double amx_bf16_flops_per_core = 0;  // AMX-BF16 tile dot products, 0 without them
  std::string not_measured;         // what the CPU has that could not be measured
  // The bf16 peak of the instructions hpmoe's bf16 tiles run on: AMX where
  // the oneDNN engine runs them (kernels::bf16_engine()), else AVX512-BF16.
  double bf16_tile_peak_per_core() const;
  std::string bf16_tile_isa() const;
};

// One core (the calling thread) running independent FMAs on the widest
// vectors the CPU offers, 12 accumulators deep so that latency never
// limits, and bf16 dot products where it has AVX512-BF16: the best of
// several rounds of `seconds` each; AMX-BF16 tile products where the CPU has
// them and the kernel grants them.
FmaPeak measure_fma_peak(double seconds = 0.02, int rounds = 5);
// The CPU's model name ("unknown CPU" if it cannot be read).
std::string cpu_model_name();

}  // namespace hpmoe
