#pragma once
// A matrix transposed, dst[j, i] = src[i, j], in blocks of 16 rows: the one
// transpose of the layouts' conversions (Hugging Face's [out, in] weights
// into the math layout, weight gradients back, the packs' token rows into
// a transposed buffer). Header-only, below every room that transposes.
// A column of a whole block read at once is one line per row, a row stride
// apart: past about 40 rows those lines no longer stay in L1, and at 64 rows
// of 2048 fp32 the plain loop moved 4.0 GB/s against 8.4 in blocks of 16
// (AMD EPYC, bench_kernels' BM_TransposeRows). Where the build has AVX-512,
// whole 16 x 16 blocks of 32-bit words go through registers; with AVX only
// (AMD Zen 3, say), 8 x 8 blocks. 16-bit elements (bf16) go in 16 x 16
// blocks through AVX2 registers.
#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace hpmoe {

#ifdef __AVX512F__
// dst[j, i] = src[i, j] for a 16 x 16 block of 32-bit words, in registers:
// 32-bit, then 64-bit interleaves within 128-bit lanes, then two rounds of
// lane shuffles. The scalar loop took ~1 ns an element, which made storing
// weight-gradient tiles transposed (a framework's [out, in] layout) cost as
// much as computing them at small K. (GCC 12's AVX-512 intrinsics give
// their unused merge source as an undefined value, which -Wuninitialized
// reports: a false positive.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
template <class T>
inline void transpose16x16(const T* src, std::int64_t ld_src, T* dst, std::int64_t ld_dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(src + i * ld_src));
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  const auto lo = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  const auto hi = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  for (int i = 0; i < 16; i += 4) {
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(dst + i * ld_dst), r[i]);
}
#pragma GCC diagnostic pop
#elif defined(__AVX__)
// dst[j, i] = src[i, j] for an 8 x 8 block of 32-bit words, in registers:
// 32-bit interleaves, 64-bit shuffles, then the 128-bit halves exchanged.
// A packed weight's transposed panels and the weight gradients stored in a
// framework's layout go through it (on Zen 3 the scalar blocks were the
// largest part of the module's repack after an optimizer step).
template <class T>
inline void transpose8x8(const T* src, std::int64_t ld_src, T* dst, std::int64_t ld_dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i * ld_src));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm256_permute2f128_ps(r[k], r[k + 4], 0x20);
    t[k + 4] = _mm256_permute2f128_ps(r[k], r[k + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(reinterpret_cast<float*>(dst + i * ld_dst), t[i]);
}
#endif

#ifdef __AVX2__
// dst[j, i] = src[i, j] for a 16 x 16 block of 16-bit elements, in
// registers: 16-, 32- and 64-bit interleaves within 128-bit lanes (after
// them, lane L of d[j] holds column j + 8 L of rows 0-7, and of e[j] of
// rows 8-15), then the lanes recombined. The scalar loop (1.4 GB/s against
// 5.3) was most of the bf16 weight-gradient packs, a token tile's rows into
// x^T's columns (AMD Zen 4).
template <class T>
inline void transpose16x16_16bit(const T* src, std::int64_t ld_src, T* dst, std::int64_t ld_dst) {
  static_assert(sizeof(T) == 2);
  __m256i a[16], b[16], c[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * ld_src));
  for (int k = 0; k < 8; ++k) {
    b[2 * k] = _mm256_unpacklo_epi16(a[2 * k], a[2 * k + 1]);      // columns 0-3 of rows 2k, 2k+1
    b[2 * k + 1] = _mm256_unpackhi_epi16(a[2 * k], a[2 * k + 1]);  // columns 4-7
  }
  for (int g = 0; g < 4; ++g) {  // rows 4g .. 4g + 3
    const __m256i* q = b + 4 * g;
    c[4 * g + 0] = _mm256_unpacklo_epi32(q[0], q[2]);  // columns 0, 1
    c[4 * g + 1] = _mm256_unpackhi_epi32(q[0], q[2]);  // columns 2, 3
    c[4 * g + 2] = _mm256_unpacklo_epi32(q[1], q[3]);  // columns 4, 5
    c[4 * g + 3] = _mm256_unpackhi_epi32(q[1], q[3]);  // columns 6, 7
  }
  for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7: column j from c[8h + j / 2] and c[8h + 4 + j / 2]
    const __m256i* lo = c + 8 * h;
    const __m256i* hi = c + 8 * h + 4;
    for (int m = 0; m < 4; ++m) {
      b[8 * h + 2 * m] = _mm256_unpacklo_epi64(lo[m], hi[m]);
      b[8 * h + 2 * m + 1] = _mm256_unpackhi_epi64(lo[m], hi[m]);
    }
  }
  for (int j = 0; j < 8; ++j) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * ld_dst), _mm256_permute2x128_si256(b[j], b[8 + j], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (j + 8) * ld_dst),
                        _mm256_permute2x128_si256(b[j], b[8 + j], 0x31));
  }
}
#endif

// dst[j, i] = src[i, j] for i in [0, rows), j in [0, cols).
template <class T>
void transpose_blocked(const T* src, std::int64_t ld_src, std::int64_t rows, std::int64_t cols, T* dst, std::int64_t ld_dst) {
  // 16-bit elements in blocks of 32 rows: a column of the block is then one
  // whole 64-byte line of dst, where 16 rows wrote half lines whose other
  // halves came a block later (5.0 against 5.3-5.4 GB/s at hidden 2048,
  // bench_kernels' BM_TransposeRows_bf16, AMD Zen 4).
  constexpr std::int64_t kBlock = sizeof(T) == 2 ? 32 : 16;
  for (std::int64_t i0 = 0; i0 < rows; i0 += kBlock) {
    const std::int64_t i1 = std::min(rows, i0 + kBlock);
    std::int64_t j = 0;
#ifdef __AVX512F__
    if constexpr (sizeof(T) == 4)
      if (i1 - i0 == kBlock)
        for (; j + kBlock <= cols; j += kBlock) transpose16x16(src + i0 * ld_src + j, ld_src, dst + j * ld_dst + i0, ld_dst);
#elif defined(__AVX__)
    if constexpr (sizeof(T) == 4)
      if (i1 - i0 == kBlock)
        for (; j + 8 <= cols; j += 8) {
          transpose8x8(src + i0 * ld_src + j, ld_src, dst + j * ld_dst + i0, ld_dst);
          transpose8x8(src + (i0 + 8) * ld_src + j, ld_src, dst + j * ld_dst + i0 + 8, ld_dst);
        }
#endif
#ifdef __AVX2__
    if constexpr (sizeof(T) == 2) {
      const std::int64_t whole = (i1 - i0) / 16 * 16;  // rows in whole 16 x 16 blocks
      if (whole > 0) {
        for (; j + 16 <= cols; j += 16)
          for (std::int64_t s = 0; s < whole; s += 16)
            transpose16x16_16bit(src + (i0 + s) * ld_src + j, ld_src, dst + j * ld_dst + i0 + s, ld_dst);
        for (std::int64_t jj = 0; jj < j; ++jj)  // the block's last rows, in those columns
          for (std::int64_t i = i0 + whole; i < i1; ++i) dst[jj * ld_dst + i] = src[i * ld_src + jj];
      }
    }
#endif
    for (; j < cols; ++j)
      for (std::int64_t i = i0; i < i1; ++i) dst[j * ld_dst + i] = src[i * ld_src + j];
  }
}

}  // namespace hpmoe
