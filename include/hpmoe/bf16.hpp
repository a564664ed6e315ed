#pragma once
#include <bit>
#include <cstdint>

namespace hpmoe {

// bfloat16 storage type: the upper 16 bits of an IEEE float. Arithmetic is
// always done in fp32; this type only exists in buffers.
struct bf16 {
  std::uint16_t bits = 0;

  static bf16 from_float(float value) {
    std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return bf16{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return bf16{static_cast<std::uint16_t>(u >> 16)};
  }
  float to_float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
};

inline float round_to_bf16(float value) { return bf16::from_float(value).to_float(); }

}  // namespace hpmoe
