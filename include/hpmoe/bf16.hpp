#pragma once
#include <bit>
#include <cstdint>

namespace hpmoe {

// bfloat16 storage type: the upper 16 bits of an IEEE float. Arithmetic is
// always done in fp32; this type only exists in buffers.
struct bf16 {
  std::uint16_t bits = 0;

  // Round to nearest, ties to even; a NaN stays a NaN (quiet, its sign and
  // top payload kept). Without a branch, so that loops over it vectorise.
  static bf16 from_float(float value) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet_nan = (u >> 16) | 0x0040u;
    return bf16{static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
  }
  float to_float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
};

inline float round_to_bf16(float value) { return bf16::from_float(value).to_float(); }

}  // namespace hpmoe
