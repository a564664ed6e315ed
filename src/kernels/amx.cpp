// bf16 tiles on AMX-BF16 by hpmoe's own kernel (Bf16Engine::amx): C[m, n]
// (=, or +=) A[m, k] B[k, n] with B a VNNI operand (a packed weight panel or
// a pack task's panel), fp32 C.
//
// Why not oneDNN (Debian's 2.6) for these tiles: a step runs thousands of
// small tiles (m <= 256, n = 64, k from 16 to a few thousand), and oneDNN's
// matmul costs 10-20 us a call before it multiplies (memory objects, an
// argument map, its OpenMP setting, a stream wait), and it takes the pack
// tasks' panels through its strided GEMM: the weight gradients (k = an
// expert's rows) ran at 180 GFLOP/s a core in the layer, this kernel's at
// 340 (docs/results/benchmarks.md, "An AMX kernel of our own"). Tiles whose
// K is under one block of 32 are left to libxsmm (gemm.cpp, amx_takes).
//
// The kernel: C in blocks of 32 rows x 32 columns held in four 16 x 16 fp32
// tile registers, A in two 16 x 32 bf16 tiles and B in two 32 x 16 (VNNI)
// ones: four loads per four TDPBF16PS; B's rows two K blocks ahead are
// prefetched (a weight panel comes from memory on its first row block). K runs in blocks of 32 in order; a
// last block shorter than 32 (a pack task's K is only even) is read from
// zero-padded copies, so nothing past an operand is read and its zeros meet
// zeros. Each row of C depends on its own row of A and on B alone, and each
// column on B's column alone: a row's bits do not depend on how many rows
// its tile has, nor on where the tile starts.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "hpmoe/error.hpp"
#include "kernels/kernels.hpp"

namespace hpmoe::kernels {

bool amx_permitted() {
  // Linux hands out the tile registers' state only on request, once per
  // process (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

namespace {

struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// Tile registers: 0-3 C (top-left, top-right, bottom-left, bottom-right),
// 4-5 A (top, bottom), 6-7 B (left, right). `top` and `bottom` rows of the
// block (bottom 0: a block of 16 rows or fewer).
TileConfig config(int top, int bottom) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  c.rows[0] = c.rows[1] = c.rows[4] = static_cast<std::uint8_t>(top);
  c.rows[2] = c.rows[3] = c.rows[5] = static_cast<std::uint8_t>(std::max(bottom, 1));
  c.rows[6] = c.rows[7] = 16;
  return c;
}

constexpr std::int64_t kPanel = kTileCols;  // 64 columns
constexpr std::int64_t kPairStride = 2 * kPanel;  // bf16 elements from one VNNI pair row of a panel to the next

// One block of up to 32 rows x 64 columns of C (ldc floats a row; the
// columns a whole panel: columns past the operand's N are its zeros and the
// caller's scratch). A: `rows` rows, lda; full K blocks from A and B, then
// the tail block from the zero-padded copies a_tail (32 x 32) and b_tail
// (16 pair rows of the panel).
__attribute__((target("amx-tile,amx-bf16"))) void block(const bf16* a, std::int64_t lda, const bf16* b, std::int64_t full_blocks,
                                                         const bf16* a_tail, const bf16* b_tail, float* c, std::int64_t ldc,
                                                         int rows, bool accumulate) {
  const bool two = rows > 16;
  const std::int64_t a_stride = lda * 2, c_stride = ldc * 4;
  for (int half = 0; half < 2; ++half) {  // columns 0-31, then 32-63
    float* c0 = c + half * 32;
    float* c1 = c0 + 16 * ldc;
    if (accumulate) {
      _tile_loadd(0, c0, c_stride);
      _tile_loadd(1, c0 + 16, c_stride);
      if (two) {
        _tile_loadd(2, c1, c_stride);
        _tile_loadd(3, c1 + 16, c_stride);
      }
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    const bf16* bh = b + half * 64;  // 32 columns in: 32 pairs of elements
    for (std::int64_t kb = 0; kb < full_blocks; ++kb) {
      const bf16* ak = a + kb * 32;
      const bf16* bk = bh + kb * 16 * kPairStride;
      if (kb + 2 < full_blocks) {
        const char* next = reinterpret_cast<const char*>(bk + 2 * 16 * kPairStride);
        for (int p = 0; p < 16; ++p) {
          _mm_prefetch(next + p * kPairStride * 2, _MM_HINT_T0);
          _mm_prefetch(next + p * kPairStride * 2 + 64, _MM_HINT_T0);
        }
      }
      _tile_loadd(4, ak, a_stride);
      _tile_loadd(6, bk, kPairStride * 2);
      _tile_loadd(7, bk + 32, kPairStride * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, ak + 16 * lda, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    if (a_tail) {
      const bf16* bk = b_tail + half * 64;
      _tile_loadd(4, a_tail, 64);
      _tile_loadd(6, bk, kPairStride * 2);
      _tile_loadd(7, bk + 32, kPairStride * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, a_tail + 16 * 32, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c0, c_stride);
    _tile_stored(1, c0 + 16, c_stride);
    if (two) {
      _tile_stored(2, c1, c_stride);
      _tile_stored(3, c1 + 16, c_stride);
    }
  }
}

__attribute__((target("amx-tile"))) void load_config(const TileConfig& c) { _tile_loadconfig(&c); }
__attribute__((target("amx-tile"))) void release() { _tile_release(); }

}  // namespace

void amx_bf16_panel(const bf16* a, std::int64_t lda, const bf16* panel, float* c, std::int64_t ldc, std::int64_t m,
                    std::int64_t n, std::int64_t k, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  if (n > kPanel || (k & 1)) throw Error("an AMX tile takes one panel of at most 64 columns and an even K");
  if (!amx_permitted()) throw Error("the AMX-BF16 kernel ran where Linux refused the tile registers");
  const std::int64_t full_blocks = k / 32, tail = k % 32;
  // The tail K block of B (its pair rows past K: zeros), once per call.
  thread_local AlignedVector<bf16> b_tail, a_tail;
  thread_local AlignedVector<float> c_wide;
  if (tail > 0) {
    b_tail.assign(static_cast<std::size_t>(16 * kPairStride), bf16{});
    std::memcpy(b_tail.data(), panel + full_blocks * 16 * kPairStride, static_cast<std::size_t>(tail / 2 * kPairStride) * sizeof(bf16));
    a_tail.resize(32 * 32);
  }
  // C goes through a whole-panel scratch where the tile is narrower than
  // the panel (the kernel writes all 64 columns).
  const bool wide = n < kPanel;
  float* out = c;
  std::int64_t ld_out = ldc;
  if (wide) {
    c_wide.resize(static_cast<std::size_t>(32 * kPanel));
    out = c_wide.data();
    ld_out = kPanel;
  }
  int configured_top = -1, configured_bottom = -1;
  for (std::int64_t i = 0; i < m; i += 32) {
    const int rows = static_cast<int>(std::min<std::int64_t>(32, m - i));
    const int top = std::min(rows, 16), bottom = rows - top;
    if (top != configured_top || bottom != configured_bottom) {
      load_config(config(top, bottom));
      configured_top = top;
      configured_bottom = bottom;
    }
    const bf16* ai = a + i * lda;
    if (tail > 0) {
      std::fill(a_tail.begin(), a_tail.end(), bf16{});
      for (int r = 0; r < rows; ++r)
        std::memcpy(a_tail.data() + r * 32, ai + r * lda + full_blocks * 32, static_cast<std::size_t>(tail) * sizeof(bf16));
    }
    float* ci = wide ? out : c + i * ldc;
    if (wide && accumulate)
      for (int r = 0; r < rows; ++r) {
        std::memcpy(out + r * kPanel, c + (i + r) * ldc, static_cast<std::size_t>(n) * sizeof(float));
        std::fill(out + r * kPanel + n, out + (r + 1) * kPanel, 0.0f);
      }
    block(ai, lda, panel, full_blocks, tail > 0 ? a_tail.data() : nullptr, tail > 0 ? b_tail.data() : nullptr, ci, ld_out, rows,
          accumulate);
    if (wide)
      for (int r = 0; r < rows; ++r) std::memcpy(c + (i + r) * ldc, out + r * kPanel, static_cast<std::size_t>(n) * sizeof(float));
  }
  release();
}

}  // namespace hpmoe::kernels
