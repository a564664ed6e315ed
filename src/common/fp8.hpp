#pragma once
// FP8 E4M3 (the "fn" variant: no infinities, one NaN code per sign, largest
// finite 448) with one fp32 scale per block of 128 channels, as DeepSeek-V3
// and DeepEP dispatch activations. A row of H channels travels as H code
// bytes followed by H / 128 fp32 scales. Encoding rounds to nearest, ties to
// even, after dividing by the block's scale (its absolute maximum / 448), so
// the block's largest element encodes exactly as +-448 times the scale.
//
// Header-only: the layer config (model) sizes rows with it, the fp64 oracle
// (model) applies the same encode-decode, and the exchange's tasks (ops)
// encode on the source and decode on arrival.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace hpmoe {

inline constexpr std::int64_t kFp8BlockChannels = 128;
inline constexpr float kFp8Max = 448.0f;

inline constexpr std::int64_t fp8_row_bytes(std::int64_t hidden) {
  return hidden + 4 * ((hidden + kFp8BlockChannels - 1) / kFp8BlockChannels);
}

// The value of an E4M3 code.
inline float fp8_e4m3_value(std::uint8_t code) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      const int exponent = (c >> 3) & 0xF, mantissa = c & 7;
      float v;
      if (exponent == 0xF && mantissa == 7) v = std::nanf("");
      else if (exponent == 0) v = std::ldexp(float(mantissa) / 8.0f, -6);
      else v = std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
      t[static_cast<std::size_t>(c)] = (c & 0x80) ? -v : v;
    }
    return t;
  }();
  return table[code];
}

// The nearest E4M3 code (ties to even), saturating at +-448; NaN encodes as NaN.
// E4M3 by its definition, with frexp, ldexp and the library's rounding:
// the specification fp8_e4m3_code is tested against (all 2^32 floats agree),
// and the slow path the benchmarks compare it with.
inline std::uint8_t fp8_e4m3_code_by_definition(float v) {
  if (std::isnan(v)) return 0x7F;
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const float a = std::fabs(v);
  if (a >= kFp8Max) return sign | 0x7E;
  int e = 0;
  std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): the leading bit's exponent is e - 1
  if (a == 0.0f || e - 1 < -6)  // subnormal (or zero): steps of 2^-9; 8 steps is the smallest normal, code 0x08
    return static_cast<std::uint8_t>(sign | static_cast<int>(std::nearbyint(std::ldexp(a, 9))));
  auto m = static_cast<int>(std::nearbyint((std::ldexp(a, -(e - 1)) - 1.0f) * 8.0f));
  int exponent = e - 1 + 7;
  if (m == 8) m = 0, ++exponent;
  if (exponent > 15 || (exponent == 15 && m == 7)) return sign | 0x7E;  // rounds past 448: saturate
  return static_cast<std::uint8_t>(sign | (exponent << 3) | m);
}

inline std::uint8_t fp8_e4m3_code(float v) {
  // On the float's bits, every path computed and one selected (no branch,
  // no frexp, ldexp or rounding call), so that an encode loop vectorises.
  // Normal: round the 23-bit mantissa to 3 bits, to nearest, ties to even;
  // a carry moves into the exponent by itself. Below 2^-6: steps of 2^-9,
  // rounded by the FPU's round-to-nearest-even (v 2^9 + 2^23 is exact in
  // its integer part; no -ffast-math here). The result equals the
  // definition's for every float (the unit test checks all 2^32).
  std::uint32_t a;
  std::memcpy(&a, &v, 4);
  const std::uint32_t sign = (a >> 24) & 0x80u;
  a &= 0x7FFFFFFFu;
  const std::uint32_t rounded = a + 0x7FFFFu + ((a >> 20) & 1u);
  const std::uint32_t normal = ((((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 7u)) & 0xFFu;
  float magnitude;
  std::memcpy(&magnitude, &a, 4);
  const float shifted = magnitude * 512.0f + 8388608.0f;
  std::uint32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, 4);
  const std::uint32_t subnormal = shifted_bits - 0x4B000000u;
  std::uint32_t code = a < 0x3C800000u ? subnormal : normal;
  code = a >= 0x43E00000u || (a >= 0x3C800000u && normal == 0x7Fu) ? 0x7Eu : code;  // |v| >= 448, or rounds to it: saturate
  return static_cast<std::uint8_t>(a > 0x7F800000u ? 0x7Fu : (sign | code));
}

// One row: per block of 128 channels, scale = amax / 448 and the codes of
// x / scale. Code: fp8_e4m3_code, or for the benchmarks' comparison the
// definition's.
template <std::uint8_t (*Code)(float) = fp8_e4m3_code>
inline void fp8_encode_row(const float* x, std::int64_t hidden, std::uint8_t* out) {
  std::uint8_t* scales = out + hidden;
  for (std::int64_t b = 0; b * kFp8BlockChannels < hidden; ++b) {
    const std::int64_t c0 = b * kFp8BlockChannels, c1 = std::min(hidden, c0 + kFp8BlockChannels);
    float amax = 0.0f;
    for (std::int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[c]));
    const float scale = amax > 0.0f && std::isfinite(amax) ? amax / kFp8Max : 1.0f;
    for (std::int64_t c = c0; c < c1; ++c) out[c] = Code(x[c] / scale);
    std::memcpy(scales + 4 * b, &scale, 4);
  }
}

// A row encoded by fp8_encode_row, decoded: code value times its block's scale.
inline void fp8_decode_row(const std::uint8_t* in, std::int64_t hidden, float* x) {
  const std::uint8_t* scales = in + hidden;
  for (std::int64_t b = 0; b * kFp8BlockChannels < hidden; ++b) {
    float scale;
    std::memcpy(&scale, scales + 4 * b, 4);
    const std::int64_t c0 = b * kFp8BlockChannels, c1 = std::min(hidden, c0 + kFp8BlockChannels);
    for (std::int64_t c = c0; c < c1; ++c) x[c] = fp8_e4m3_value(in[c]) * scale;
  }
}

}  // namespace hpmoe
