// The weight packers: a row-major (or transposed) source into the
// panel-blocked operand the tile GEMMs read (kernels.hpp: RhsView,
// panel_view), and back. A training step repacks every weight it changed,
// so the hot cases (float to float, float to bf16 VNNI, either way round)
// run along the source's rows and through blocked transposes.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "common/transpose.hpp"
#include "kernels/kernels.hpp"

namespace hpmoe::kernels {

namespace {

template <class T, class S>
T convert(S v) {
  if constexpr (std::is_same_v<T, S>) return v;
  else if constexpr (std::is_same_v<T, bf16>) return bf16::from_float(static_cast<float>(v));
  else if constexpr (std::is_same_v<S, bf16>) return static_cast<T>(v.to_float());
  else return static_cast<T>(v);
}

// bf16::from_float without its branch, so that a row's loop vectorizes:
// round to nearest, ties to even; a NaN stays a (quiet) NaN.
inline std::uint32_t bf16_bits(float value) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

// Rows r and r + 1 of a float source into a bf16 VNNI panel line: element
// (r, j) in the low half of 32-bit word j, (r + 1, j) in the high half (the
// second row absent past K: zero), the same bits as rhs_index's element by
// element stores of bf16::from_float, written a word at a time.
void pack_vnni_row_pair(const float* a, const float* b, std::int64_t width, bf16* line) {
  for (std::int64_t j = 0; j < width; ++j) {
    const std::uint32_t word = bf16_bits(a[j]) | (b ? bf16_bits(b[j]) << 16 : 0u);
    std::memcpy(static_cast<void*>(line + 2 * j), &word, sizeof word);  // (r, j) then (r + 1, j): little-endian halves
  }
}

// src's rows [c0, c0 + width), columns [r0, r0 + run), transposed into
// out (leading dimension ld_out): out[i ld_out + j] = src.row(c0 + j)[r0 + i],
// one blocked transpose per run of rows within one of src's blocks.
template <class S>
void turn(const StackedRows<S>& src, std::int64_t c0, std::int64_t width, std::int64_t r0, std::int64_t run, S* out,
          std::int64_t ld_out) {
  for (std::int64_t j = 0; j < width;) {
    const std::int64_t m = src.run_from(c0 + j, width - j);
    transpose_blocked(src.row(c0 + j) + r0, src.ld(c0 + j), m, run, out + j, ld_out);
    j += m;
  }
}

// Rows r and r + 1 of a bf16 source into a VNNI panel line, as they are
// (a bf16 model's weights: nothing to round).
void pack_vnni_row_pair(const bf16* a, const bf16* b, std::int64_t width, bf16* line) {
  std::int64_t j = 0;
#ifdef __AVX2__
  // 16 of each row interleaved in registers (16-bit unpacks work within
  // 128-bit lanes, so the halves are put back in order): GCC did not
  // vectorize the word loop below.
  if (b)
    for (; j + 16 <= width; j += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j));
      const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(line + 2 * j), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(line + 2 * j + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
#endif
  for (; j < width; ++j) {
    const std::uint32_t word = std::uint32_t(a[j].bits) | (b ? std::uint32_t(b[j].bits) << 16 : 0u);
    std::memcpy(static_cast<void*>(line + 2 * j), &word, sizeof word);
  }
}

}  // namespace

template <class S, class T>
void pack_rhs_panels(const StackedRows<S>& src, std::int64_t k, std::int64_t n, bool transposed, T* dst,
                     std::int64_t panel_begin, std::int64_t panel_end) {
  static_assert(std::is_same_v<T, bf16> || std::is_same_v<S, float>, "float panels are packed from float sources");
  const std::int64_t kp = weight_padded_k<T>(k);
  // Reads run along src's rows: a training step repacks every weight, and
  // reading a transposed source down its columns took most of a small
  // layer's step (16 experts of 256 x 256: 21% of a bf16 forward's time).
  // Transposed sources go through blocked transposes, so the panel lines a
  // block writes stay in L1 while each column's run of K is read.
  for (std::int64_t p = panel_begin; p < panel_end; ++p) {
    T* panel = dst + p * kp * kTileCols;
    const std::int64_t c0 = p * kTileCols, width = std::clamp<std::int64_t>(n - c0, 0, kTileCols);
    if constexpr (std::is_same_v<S, float> && std::is_same_v<T, float>) {
      // Rows of 64 floats: copied, or a blocked transpose; only the padding
      // zeroed (the whole panel cleared first took as long as the packing).
      std::fill(panel + k * kTileCols, panel + kp * kTileCols, 0.0f);
      if (width < kTileCols)
        for (std::int64_t r = 0; r < k; ++r) std::fill(panel + r * kTileCols + width, panel + (r + 1) * kTileCols, 0.0f);
      if (transposed) {
        turn(src, c0, width, 0, k, panel, kTileCols);
      } else {
        for (std::int64_t r = 0; r < k; ++r)
          std::memcpy(panel + r * kTileCols, src.row(r) + c0, static_cast<std::size_t>(width) * sizeof(float));
      }
      continue;
    }
    std::fill(panel, panel + kp * kTileCols, T{});  // padding rows and columns past N stay zero
    if constexpr (std::is_same_v<T, bf16>) {  // from float (rounded) or bf16 (as it is)
      if (!transposed) {  // a training step repacks every weight: two rows at a time, vectorized
        for (std::int64_t r = 0; r < k; r += 2)
          pack_vnni_row_pair(src.row(r) + c0, r + 1 < k ? src.row(r + 1) + c0 : nullptr, width,
                             panel + rhs_index(r, 0, kTileCols, true));
        continue;
      }
      // Transposed (the data gradients' W^T panels, repacked with every
      // weight): a block of 64 of K's rows turned by the blocked transpose
      // into a tile of the source's type in L1, then packed two rows at a
      // time as above
      // (a run of src's row converted and stored a word each, 128 elements
      // apart, was ~8% slower on the module's bf16 repack at hidden 256).
      constexpr std::int64_t kRun = 64;
      alignas(64) S turned[kRun * kTileCols];
      for (std::int64_t r0 = 0; r0 < k; r0 += kRun) {
        const std::int64_t run = std::min(kRun, k - r0);
        turn(src, c0, width, r0, run, turned, kTileCols);
        for (std::int64_t r = 0; r < run; r += 2)  // K odd: its last pair's second row is padding
          pack_vnni_row_pair(turned + r * kTileCols, r + 1 < run ? turned + (r + 1) * kTileCols : nullptr, width,
                             panel + rhs_index(r0 + r, 0, kTileCols, true));
      }
      continue;
    }
  }
}

template <class S, class T>
void pack_rhs_panels(const S* src, std::int64_t ld_src, std::int64_t k, std::int64_t n, bool transposed, T* dst,
                     std::int64_t panel_begin, std::int64_t panel_end) {
  const StackedRows<S> one{src, ld_src, std::numeric_limits<std::int64_t>::max(), nullptr, 0};
  pack_rhs_panels<S, T>(one, k, n, transposed, dst, panel_begin, panel_end);
}

template <class T>
void pack_rows_into_panels(const T* src, std::int64_t ld_src, std::int64_t rows, std::int64_t n, T* panels,
                           std::int64_t height, std::int64_t row0, std::int64_t zero_rows) {
  const bool vnni = vnni_layout<T>();
  const std::int64_t total = rows + zero_rows;
  const auto row = [&](std::int64_t i, std::int64_t c0) -> const T* { return i < rows ? src + i * ld_src + c0 : nullptr; };
  for (std::int64_t p = 0; p < (n + kTileCols - 1) / kTileCols; ++p) {
    T* panel = panels + p * height * kTileCols;
    const std::int64_t c0 = p * kTileCols, width = std::min(kTileCols, n - c0);
    // One row on its own, element by element: a row whose VNNI partner
    // belongs to the neighbouring task's tile keeps that half untouched.
    const auto single = [&](std::int64_t i) {
      const T* from = row(i, c0);
      for (std::int64_t j = 0; j < kTileCols; ++j)
        panel[rhs_index(row0 + i, j, kTileCols, vnni)] = from && j < width ? from[j] : T{};
    };
    if (!vnni) {
      for (std::int64_t i = 0; i < total; ++i) {
        T* line = panel + (row0 + i) * kTileCols;
        const T* from = row(i, c0);
        if (from) std::memcpy(static_cast<void*>(line), from, static_cast<std::size_t>(width) * sizeof(T));
        std::fill(line + (from ? width : 0), line + kTileCols, T{});
      }
      continue;
    }
    if constexpr (std::is_same_v<T, bf16>) {
      std::int64_t i = 0;
      if ((row0 & 1) != 0 && total > 0) single(i++);
      for (; i + 1 < total; i += 2) {
        bf16* line = panel + rhs_index(row0 + i, 0, kTileCols, true);
        const bf16* first = row(i, c0);
        if (first) pack_vnni_row_pair(first, row(i + 1, c0), width, line);
        std::fill(line + (first ? 2 * width : 0), line + 2 * kTileCols, bf16{});
      }
      if (i < total) single(i);
    }
  }
}

template <class T>
void unpack_rhs_panels(const T* panels, std::int64_t k, std::int64_t n, float* dst, std::int64_t ld_dst) {
  const std::int64_t kp = weight_padded_k<T>(k);
  const bool vnni = sizeof(T) == 2;
  for (std::int64_t c0 = 0; c0 < n; c0 += kTileCols) {
    const T* panel = panels + (c0 / kTileCols) * kp * kTileCols;
    const std::int64_t width = std::min(kTileCols, n - c0);
    for (std::int64_t r = 0; r < k; ++r)
      for (std::int64_t j = 0; j < width; ++j)
        dst[r * ld_dst + c0 + j] = convert<float>(panel[rhs_index(r, j, kTileCols, vnni)]);
  }
}

template void pack_rhs_panels<float, float>(const float*, std::int64_t, std::int64_t, std::int64_t, bool, float*,
                                            std::int64_t, std::int64_t);
template void pack_rhs_panels<float, bf16>(const float*, std::int64_t, std::int64_t, std::int64_t, bool, bf16*,
                                           std::int64_t, std::int64_t);
template void pack_rhs_panels<bf16, bf16>(const bf16*, std::int64_t, std::int64_t, std::int64_t, bool, bf16*,
                                          std::int64_t, std::int64_t);
template void pack_rhs_panels<float, float>(const StackedRows<float>&, std::int64_t, std::int64_t, bool, float*,
                                            std::int64_t, std::int64_t);
template void pack_rhs_panels<float, bf16>(const StackedRows<float>&, std::int64_t, std::int64_t, bool, bf16*,
                                           std::int64_t, std::int64_t);
template void pack_rhs_panels<bf16, bf16>(const StackedRows<bf16>&, std::int64_t, std::int64_t, bool, bf16*,
                                          std::int64_t, std::int64_t);
template void pack_rows_into_panels<float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*, std::int64_t,
                                           std::int64_t, std::int64_t);
template void pack_rows_into_panels<bf16>(const bf16*, std::int64_t, std::int64_t, std::int64_t, bf16*, std::int64_t,
                                          std::int64_t, std::int64_t);
template void unpack_rhs_panels<float>(const float*, std::int64_t, std::int64_t, float*, std::int64_t);
template void unpack_rhs_panels<bf16>(const bf16*, std::int64_t, std::int64_t, float*, std::int64_t);

}  // namespace hpmoe::kernels
