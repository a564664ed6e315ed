#include <gtest/gtest.h>

#include <bit>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "hpmoe/error.hpp"
#include "kernels/kernels.hpp"
#include "hpmoe/tensors.hpp"

using namespace hpmoe;
using namespace hpmoe::kernels;

namespace {

template <class T>
T to(float v) {
  if constexpr (sizeof(T) == 2) return bf16::from_float(v);
  else return v;
}
template <class T>
double from(T v) {
  if constexpr (sizeof(T) == 2) return v.to_float();
  else return v;
}

// C = A B (+ C) for a tile inside larger matrices, against a double loop.
template <class T>
void check_gemm(std::int64_t m, std::int64_t n, std::int64_t k, bool accumulate) {
  init();
  const std::int64_t lda = padded_k<T>(k) + 4, ldb_cols = n + 5, ldc = n + 2, col0 = 2;
  Rng rng(m * 1000 + n * 10 + k);
  std::vector<T> a(static_cast<std::size_t>(m * lda));
  for (auto& v : a) v = to<T>(float(rng.normal()));
  std::vector<float> b(static_cast<std::size_t>(k * ldb_cols));
  for (auto& v : b) v = sizeof(T) == 2 ? round_to_bf16(float(rng.normal())) : float(rng.normal());
  std::vector<T> packed(static_cast<std::size_t>(padded_k<T>(k) * ldb_cols));
  pack_rhs<float, T>(b.data(), ldb_cols, k, ldb_cols, packed.data(), 0, k);
  std::vector<float> c(static_cast<std::size_t>(m * ldc), 0.5f);
  gemm_tile<T>(a.data(), lda, RhsView<T>{packed.data(), ldb_cols}, col0, c.data(), ldc, m, n, padded_k<T>(k), accumulate);
  // fp32 accumulation error grows like sqrt(k) * eps * sum |a b|.
  double worst = 0;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double ref = accumulate ? 0.5 : 0.0, magnitude = 1.0;
      for (std::int64_t p = 0; p < k; ++p) {
        ref += from(a[i * lda + p]) * double(b[p * ldb_cols + col0 + j]);
        magnitude += std::abs(from(a[i * lda + p]) * double(b[p * ldb_cols + col0 + j]));
      }
      worst = std::max(worst, std::abs(ref - double(c[i * ldc + j])) / (magnitude * std::sqrt(double(k))));
    }
  EXPECT_LT(worst, 4 * 6e-8) << m << "x" << n << "x" << k;
  // Untouched outside the tile.
  if (ldc > n) {
    EXPECT_EQ(c[n], 0.5f);
  }
}

}  // namespace

TEST(TileGemm, Fp32MatchesDoubleLoops) {
  for (auto [m, n, k] : std::vector<std::tuple<int, int, int>>{{1, 1, 1}, {64, 64, 128}, {37, 50, 300}, {64, 17, 1024}, {5, 64, 129}})
    for (bool acc : {false, true}) check_gemm<float>(m, n, k, acc);
}

// The fp32 tile is a sequential FMA sum over K in order, whatever K (blocks,
// chunks of blocks, a ragged rest): what makes chunking K, and any split of
// the work into tiles, free of numerical change.
TEST(TileGemm, Fp32IsASequentialFmaSum) {
  init();
  for (const std::int64_t k : {std::int64_t{1}, std::int64_t{300}, kBlockK * kChunkBlocks, kBlockK * kChunkBlocks * 2 + 77, std::int64_t{7168}}) {
    const std::int64_t m = 17, n = 64;
    Rng rng(static_cast<std::uint64_t>(k));
    std::vector<float> a(static_cast<std::size_t>(m * k)), raw(static_cast<std::size_t>(k * n));
    for (auto& v : a) v = float(rng.normal());
    for (auto& v : raw) v = float(rng.normal());
    std::vector<float> b(static_cast<std::size_t>(panel_blocked_size<float>(k, n))), c(static_cast<std::size_t>(m * n));
    pack_rhs_panels<float, float>(raw.data(), n, k, n, false, b.data(), 0, 1);
    gemm_tile<float>(a.data(), k, panel_view<float>(b.data(), k), 0, c.data(), n, m, n, k, false);
    std::int64_t differ = 0;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        float s = 0;
        for (std::int64_t q = 0; q < k; ++q) s = std::fma(a[static_cast<std::size_t>(i * k + q)], raw[static_cast<std::size_t>(q * n + j)], s);
        differ += s != c[static_cast<std::size_t>(i * n + j)];
      }
    EXPECT_EQ(differ, 0) << "K " << k;
  }
}

TEST(TileGemm, Bf16MatchesDoubleLoops) {
  // For bf16 the inputs are exact bf16 values and accumulation is fp32, so
  // the same tolerance holds; odd K exercises the zero pair padding.
  for (auto [m, n, k] : std::vector<std::tuple<int, int, int>>{{1, 1, 2}, {64, 64, 128}, {37, 50, 301}, {64, 17, 1024}, {3, 64, 7}})
    for (bool acc : {false, true}) check_gemm<bf16>(m, n, k, acc);
}

// A whole GEMM through row tiles over a panel-blocked operand with a
// ragged last panel, against double loops; A's rows `spare` elements wider
// than K (a strided A), C accumulated into when `accumulate`.
template <class T>
void check_panel_gemm(std::int64_t m, std::int64_t n, std::int64_t k, bool transposed, std::int64_t spare = 0,
                      bool accumulate = false) {
  init();
  Rng rng(7);
  const std::int64_t kp = padded_k<T>(k), lda = kp + spare;
  std::vector<T> a(static_cast<std::size_t>(m * lda));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t p = 0; p < lda; ++p) a[i * lda + p] = to<T>(p < k ? float(rng.normal()) : p < kp ? 0.0f : 1e30f);
  std::vector<float> b(static_cast<std::size_t>(k * n));  // operand [k, n], stored as b or (transposed) [n, k]
  for (auto& v : b) v = round_to_bf16(float(rng.normal()));
  auto operand = [&](std::int64_t r, std::int64_t col) { return transposed ? b[col * k + r] : b[r * n + col]; };
  std::vector<T> packed(static_cast<std::size_t>(panel_blocked_size<T>(k, n)));
  pack_rhs_panels<float, T>(b.data(), transposed ? k : n, k, n, transposed, packed.data(), 0, (n + kTileCols - 1) / kTileCols);
  const float before = accumulate ? 0.5f : 0.0f;
  std::vector<float> c(static_cast<std::size_t>(m * n), before);
  for (std::int64_t i = 0; i < m; i += kTileRows)
    for (std::int64_t j = 0; j < n; j += kTileCols)
      gemm_tile<T>(a.data() + i * lda, lda, panel_view<T>(packed.data(), k), j, c.data() + i * n + j, n,
                   std::min(kTileRows, m - i), std::min(kTileCols, n - j), kp, accumulate);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double ref = before, magnitude = 1;
      for (std::int64_t p = 0; p < k; ++p) {
        ref += from(a[i * lda + p]) * double(operand(p, j));
        magnitude += std::abs(from(a[i * lda + p]) * double(operand(p, j)));
      }
      ASSERT_LT(std::abs(ref - c[i * n + j]), 4 * 6e-8 * std::sqrt(double(k)) * magnitude) << i << "," << j;
    }
}

TEST(TileGemm, Bf16PanelsFromRowsAreTheBitsOfElementwiseRounding) {
  // Both vectorised packings (a training step repacks every weight: rows
  // in pairs, and transposed sources a column run at a time) against
  // element-by-element bf16::from_float into rhs_index's places, on
  // values that round every way: ties to even both ways, a carry into the
  // exponent, subnormals, signed zero, the largest finite float, infinities
  // and NaN; odd K (the last pair half zero) and a ragged last panel.
  const std::vector<std::uint32_t> specials = {0x3f808000u, 0x3f818000u, 0x3f7fffffu, 0x00000001u, 0x80000000u,
                                               0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00001u, 0x7f800001u};
  for (auto [k, n] : std::vector<std::pair<std::int64_t, std::int64_t>>{{7, 70}, {256, 64}, {1, 5}, {129, 130}}) {
    Rng rng(static_cast<std::uint64_t>(k * 1000 + n));
    std::vector<float> rows(static_cast<std::size_t>(k * n)), cols(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i)
      rows[i] = i % 7 == 3 ? std::bit_cast<float>(specials[i % specials.size()]) : float(rng.normal());
    for (std::int64_t r = 0; r < k; ++r)
      for (std::int64_t j = 0; j < n; ++j) cols[static_cast<std::size_t>(j * k + r)] = rows[static_cast<std::size_t>(r * n + j)];
    const std::int64_t panels = (n + kTileCols - 1) / kTileCols;
    std::vector<bf16> fast(static_cast<std::size_t>(panel_blocked_size<bf16>(k, n))), slow(fast.size());
    pack_rhs_panels<float, bf16>(rows.data(), n, k, n, false, fast.data(), 0, panels);
    pack_rhs_panels<float, bf16>(cols.data(), k, k, n, true, slow.data(), 0, panels);
    std::vector<bf16> reference(fast.size());  // zeros: padding rows and columns
    const std::int64_t kp = weight_padded_k<bf16>(k);
    for (std::int64_t r = 0; r < k; ++r)
      for (std::int64_t j = 0; j < n; ++j)
        reference[static_cast<std::size_t>((j / kTileCols) * kp * kTileCols + rhs_index(r, j % kTileCols, kTileCols, true))] =
            bf16::from_float(rows[static_cast<std::size_t>(r * n + j)]);
    std::size_t differ_rows = 0, differ_cols = 0;
    for (std::size_t i = 0; i < fast.size(); ++i) {
      differ_rows += fast[i].bits != reference[i].bits;
      differ_cols += slow[i].bits != reference[i].bits;
    }
    EXPECT_EQ(differ_rows, 0u) << "from rows: K " << k << ", N " << n;
    EXPECT_EQ(differ_cols, 0u) << "transposed: K " << k << ", N " << n;
  }
}

// Two blocks of rows with their own strides (gate_proj over up_proj) pack
// to the bits of the same rows copied into one matrix, either way round,
// with the boundary inside a panel and on one; unpacking the forward
// operand gives the (rounded) matrix back.
template <class X>
X value_as(float v) {
  if constexpr (std::is_same_v<X, bf16>) return bf16::from_float(v);
  else return v;
}
template <class X>
float float_of(X v) {
  if constexpr (std::is_same_v<X, bf16>) return v.to_float();
  else return v;
}

template <class S, class T>
void check_stacked_pack(std::int64_t top_rows, std::int64_t rows, std::int64_t cols) {
  Rng rng(static_cast<std::uint64_t>(top_rows * 7 + rows * 31 + cols));
  const std::int64_t ld_top = cols + 3, ld_bottom = cols + 17;  // strides of their own, wider than the rows
  std::vector<S> top(static_cast<std::size_t>(top_rows * ld_top)), bottom(static_cast<std::size_t>((rows - top_rows) * ld_bottom));
  std::vector<S> whole(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) {
      const S v = value_as<S>(float(rng.normal()));
      (r < top_rows ? top[static_cast<std::size_t>(r * ld_top + j)]
                    : bottom[static_cast<std::size_t>((r - top_rows) * ld_bottom + j)]) = v;
      whole[static_cast<std::size_t>(r * cols + j)] = v;
    }
  const StackedRows<S> stacked{top.data(), ld_top, top_rows, bottom.data(), ld_bottom};
  for (const bool transposed : {false, true}) {
    // Not transposed: the operand is [rows, cols]; transposed: [cols, rows].
    const std::int64_t k = transposed ? cols : rows, n = transposed ? rows : cols;
    const std::int64_t panels = (n + kTileCols - 1) / kTileCols;
    std::vector<T> one(static_cast<std::size_t>(panel_blocked_size<T>(k, n)), value_as<T>(7.0f)), two(one.size(), value_as<T>(-3.0f));
    pack_rhs_panels<S, T>(whole.data(), cols, k, n, transposed, one.data(), 0, panels);
    pack_rhs_panels<S, T>(stacked, k, n, transposed, two.data(), 0, panels);
    EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(T)), 0)
        << "top " << top_rows << " of " << rows << " rows, " << cols << " columns, transposed " << transposed;
    std::vector<float> back(static_cast<std::size_t>(k * n), -1.0f);
    unpack_rhs_panels<T>(one.data(), k, n, back.data(), n);
    std::size_t wrong = 0;
    for (std::int64_t r = 0; r < k; ++r)
      for (std::int64_t j = 0; j < n; ++j) {
        const S v = transposed ? whole[static_cast<std::size_t>(j * cols + r)] : whole[static_cast<std::size_t>(r * cols + j)];
        const float expect = float_of(value_as<T>(float_of(v)));  // as packed: rounded to T
        wrong += std::bit_cast<std::uint32_t>(back[static_cast<std::size_t>(r * n + j)]) != std::bit_cast<std::uint32_t>(expect);
      }
    EXPECT_EQ(wrong, 0u) << "unpacked: top " << top_rows << " of " << rows << ", transposed " << transposed;
  }
}

TEST(TileGemm, StackedSourcesPackAsOneMatrixAndUnpackBack) {
  for (auto [top, rows, cols] : std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>>{
           {96, 192, 160}, {64, 128, 70}, {37, 75, 33}, {1, 2, 129}}) {
    check_stacked_pack<float, float>(top, rows, cols);
    check_stacked_pack<float, bf16>(top, rows, cols);
    check_stacked_pack<bf16, bf16>(top, rows, cols);
  }
}

TEST(TileGemm, PanelBlockedOperands) {
  for (bool transposed : {false, true}) {
    check_panel_gemm<float>(70, 150, 300, transposed);
    check_panel_gemm<bf16>(70, 150, 301, transposed);
  }
}

// Weight panels with a strided A (a split part narrower than its buffer)
// and accumulation: on AMX the brgemm path copies A and adds its dense tile.
TEST(TileGemm, PanelBlockedOperandsWithStridedAAndAccumulation) {
  for (bool accumulate : {false, true}) {
    check_panel_gemm<float>(150, 70, 96, false, 6, accumulate);
    check_panel_gemm<bf16>(150, 70, 97, false, 6, accumulate);
  }
}

// A tile across several panels (a weight-gradient strip) is its per-panel
// tiles, bit for bit: from a panel's middle to another's, a strided A (as the
// transposed activations give it), with and without accumulation. (bf16
// from a panel's start: AMX tiles on VNNI weights take whole panels.)
template <class T>
void check_strip_equals_tiles(bool accumulate) {
  init();
  Rng rng(11);
  const std::int64_t m = 64, n = 5 * kTileCols - 20, k = 22, lda = 300, col0 = sizeof(T) == 2 ? kTileCols : 32, width = n - col0;
  std::vector<T> a(static_cast<std::size_t>(m * lda));
  for (auto& v : a) v = to<T>(float(rng.normal()));
  std::vector<float> b(static_cast<std::size_t>(k * n));
  for (auto& v : b) v = round_to_bf16(float(rng.normal()));
  std::vector<T> packed(static_cast<std::size_t>(panel_blocked_size<T>(k, n)));
  pack_rhs_panels<float, T>(b.data(), n, k, n, false, packed.data(), 0, (n + kTileCols - 1) / kTileCols);
  const auto view = panel_view<T>(packed.data(), k);
  std::vector<float> strip(static_cast<std::size_t>(m * n), 0.25f), tiles(strip);
  gemm_tile<T>(a.data(), lda, view, col0, strip.data() + col0, n, m, width, padded_k<T>(k), accumulate);
  for (std::int64_t j = col0; j < col0 + width;) {
    const std::int64_t w = std::min(col0 + width, (j / kTileCols + 1) * kTileCols) - j;
    gemm_tile<T>(a.data(), lda, view, j, tiles.data() + j, n, m, w, padded_k<T>(k), accumulate);
    j += w;
  }
  for (std::size_t i = 0; i < strip.size(); ++i) ASSERT_EQ(strip[i], tiles[i]) << "element " << i;
}

TEST(TileGemm, StripAcrossPanelsIsItsTilesBitForBit) {
  for (bool accumulate : {false, true}) {
    check_strip_equals_tiles<float>(accumulate);
    check_strip_equals_tiles<bf16>(accumulate);
  }
}

// The streamed store of a weight-gradient strip is gemm_tile's result bit
// for bit, whether c's rows are aligned for non-temporal stores or not,
// for a strip that ends inside a panel; nothing outside it is written.
template <class T>
void check_streamed_equals_plain(std::int64_t m, std::int64_t c_offset) {
  init();
  Rng rng(12);
  const std::int64_t n = 3 * kTileCols - 24, k = 38, lda = 301 + (sizeof(T) == 2), ldc = 4 * kTileCols;
  std::vector<T> a(static_cast<std::size_t>(m * lda));
  for (auto& v : a) v = to<T>(float(rng.normal()));
  std::vector<float> b(static_cast<std::size_t>(k * n));
  for (auto& v : b) v = round_to_bf16(float(rng.normal()));
  AlignedVector<T> packed(static_cast<std::size_t>(panel_blocked_size<T>(k, n)));
  pack_rhs_panels<float, T>(b.data(), n, k, n, false, packed.data(), 0, (n + kTileCols - 1) / kTileCols);
  const auto view = panel_view<T>(packed.data(), k);
  AlignedVector<float> plain(static_cast<std::size_t>(m * ldc + c_offset), -3.0f), streamed(plain);
  gemm_tile<T>(a.data(), lda, view, 0, plain.data() + c_offset, ldc, m, n, padded_k<T>(k), false);
  gemm_tile_streamed<T>(a.data(), lda, view, 0, streamed.data() + c_offset, ldc, m, n, padded_k<T>(k));
  for (std::size_t i = 0; i < plain.size(); ++i) ASSERT_EQ(streamed[i], plain[i]) << m << " rows, element " << i;
}

TEST(TileGemm, StreamedStoresAreThePlainTileBitForBit) {
  for (const std::int64_t m : {1, 64, 100}) {
    for (const std::int64_t offset : {0, 3}) {  // aligned rows (non-temporal stores), then not
      check_streamed_equals_plain<float>(m, offset);
      check_streamed_equals_plain<bf16>(m, offset);
    }
  }
}

// A gradient's token tiles packed into the dW GEMM's panels: every element
// where rhs_index puts it, the K padding row zero, columns past n zero, and
// a tile that starts on an odd row (its first row shares VNNI words with
// the tile before) leaves the other tile's halves alone.
template <class T>
void check_rows_into_panels() {
  init();
  const std::int64_t n = 2 * kTileCols + 21, ld = n + 5, height = 42, panels = (n + kTileCols - 1) / kTileCols;
  const bool vnni = vnni_layout<T>();
  const T sentinel = to<T>(-7.0f);
  for (const auto& [row0, rows, zero_rows] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 16, 0},
                                              {3, 17, 1}, {8, 11, 1}, {5, 1, 0}, {40, 1, 1}}) {
    std::vector<T> src(static_cast<std::size_t>(rows * ld));
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = to<T>(float(i % 977) + 1.0f);
    AlignedVector<T> out(static_cast<std::size_t>(height * kTileCols * panels), sentinel);
    pack_rows_into_panels<T>(src.data(), ld, rows, n, out.data(), height, row0, zero_rows);
    for (std::int64_t p = 0; p < panels; ++p)
      for (std::int64_t r = 0; r < height; ++r)
        for (std::int64_t j = 0; j < kTileCols; ++j) {
          const std::int64_t i = r - row0, col = p * kTileCols + j;
          T want = sentinel;
          if (i >= 0 && i < rows) want = col < n ? src[static_cast<std::size_t>(i * ld + col)] : T{};
          else if (i >= rows && i < rows + zero_rows) want = T{};
          const T got = out[static_cast<std::size_t>(p * height * kTileCols + rhs_index(r, j, kTileCols, vnni))];
          ASSERT_EQ(from(got), from(want)) << "tile at row " << row0 << ", panel " << p << ", row " << r << ", column " << j;
        }
  }
}
TEST(Pack, GradientRowsIntoPanels) {
  check_rows_into_panels<float>();
  check_rows_into_panels<bf16>();
}

// A row's bits depend on its row of A and on B alone, not on the height of
// the tile it is computed in nor on where the tile starts (the layer relies
// on it: tile heights follow the placement, replicas' quotas, lent experts).
// On AMX the kernel's blocks of 32 and 16 rows and its tail configurations
// all meet here; k 90 has a short last K block.
TEST(TileGemm, Bf16RowBitsDoNotDependOnTheTile) {
  init();
  if (bf16_engine() == Bf16Engine::onednn_amx)
    GTEST_SKIP() << "oneDNN's matmul does not keep this (a 1-row tile's bits differ): kept only to measure against";
  for (const std::int64_t k : {90, 18}) {  // a short last K block; a K the AMX engine leaves to libxsmm
    Rng rng(29);
    const std::int64_t m = 75, n = 2 * kTileCols - 6, lda = 96;
    std::vector<bf16> a(static_cast<std::size_t>(m * lda));
    for (auto& v : a) v = bf16::from_float(float(rng.normal()));
    std::vector<float> b(static_cast<std::size_t>(k * n));
    for (auto& v : b) v = round_to_bf16(float(rng.normal()));
    std::vector<bf16> packed(static_cast<std::size_t>(panel_blocked_size<bf16>(k, n)));
    pack_rhs_panels<float, bf16>(b.data(), n, k, n, false, packed.data(), 0, (n + kTileCols - 1) / kTileCols);
    const auto view = panel_view<bf16>(packed.data(), k);
    for (const bool accumulate : {false, true}) {
      std::vector<float> whole(static_cast<std::size_t>(m * n), 0.75f), pieces(whole);
      for (std::int64_t j = 0; j < n; j += kTileCols)
        gemm_tile<bf16>(a.data(), lda, view, j, whole.data() + j, n, m, std::min(kTileCols, n - j), k, accumulate);
      for (std::int64_t i = 0, step = 1; i < m; i += step, step = step == 1 ? 17 : step == 17 ? 33 : 1) {
        const std::int64_t rows = std::min(step, m - i);
        for (std::int64_t j = 0; j < n; j += kTileCols)
          gemm_tile<bf16>(a.data() + i * lda, lda, view, j, pieces.data() + i * n + j, n, rows, std::min(kTileCols, n - j), k,
                          accumulate);
      }
      for (std::size_t i = 0; i < whole.size(); ++i)
        ASSERT_EQ(whole[i], pieces[i]) << "element " << i << ", k " << k << ", accumulate " << accumulate;
    }
  }
}

// A pack task's panels have K padded to even only: a tile with a short last
// K block must not read the next panel's rows (here NaN), nor A past K.
TEST(TileGemm, Bf16TileReadsNothingPastItsPanelsK) {
  init();
  if (!bf16_vnni()) GTEST_SKIP() << "the engine reads plain bf16 rows";
  const std::int64_t m = 20, k = 18, panel = padded_k<bf16>(k) * kTileCols;
  std::vector<bf16> a(static_cast<std::size_t>(m * 40), bf16::from_float(std::nanf("")));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t p = 0; p < k; ++p) a[static_cast<std::size_t>(i * 40 + p)] = bf16::from_float(1.0f);
  std::vector<bf16> panels(static_cast<std::size_t>(3 * panel), bf16::from_float(std::nanf("")));
  std::vector<float> ones(static_cast<std::size_t>(k * kTileCols), 0.5f);
  pack_rhs<float, bf16>(ones.data(), kTileCols, k, kTileCols, panels.data() + panel, 0, k);
  std::vector<float> c(static_cast<std::size_t>(m * kTileCols), -1.0f);
  gemm_tile<bf16>(a.data(), 40, RhsView<bf16>{panels.data() + panel, kTileCols, panel}, 0, c.data(), kTileCols, m, kTileCols, k,
                  false);
  for (const float v : c) ASSERT_EQ(v, 0.5f * float(k));
}

TEST(TileGemm, Bf16RejectsOddLeadingDimension) {
  std::vector<bf16> a(64), b(64);
  std::vector<float> c(16);
  EXPECT_THROW(gemm_tile<bf16>(a.data(), 3, RhsView<bf16>{b.data(), 4}, 0, c.data(), 4, 2, 4, 2, false), Error);
}

TEST(TileGemm, ZeroKClearsOrKeeps) {
  std::vector<float> c(4, 3.0f), b(4, 1.0f), a(4, 1.0f);
  gemm_tile<float>(a.data(), 2, RhsView<float>{b.data(), 2}, 0, c.data(), 2, 2, 2, 0, true);
  EXPECT_EQ(c[0], 3.0f);
  gemm_tile<float>(a.data(), 2, RhsView<float>{b.data(), 2}, 0, c.data(), 2, 2, 2, 0, false);
  EXPECT_EQ(c[3], 0.0f);
}

TEST(Pack, TransposedPackingEqualsPackingTheTranspose) {
  const std::int64_t rows = 5, cols = 7;  // src [rows, cols]; operand src^T [cols, rows]
  std::vector<float> src(rows * cols), srcT(cols * rows);
  for (std::int64_t i = 0; i < rows * cols; ++i) src[i] = round_to_bf16(float(i) * 0.25f);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) srcT[j * rows + i] = src[i * cols + j];
  std::vector<bf16> a(padded_k<bf16>(cols) * rows), b(padded_k<bf16>(cols) * rows);
  pack_rhs_transposed<float, bf16>(src.data(), cols, cols, rows, a.data(), 0, rows);
  pack_rhs<float, bf16>(srcT.data(), rows, cols, rows, b.data(), 0, cols);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].bits, b[i].bits) << i;
}

// Whole and partial blocks of 16 rows, odd widths and strides, fp32 and
// bf16: every element lands where the plain loop puts it, and nothing
// outside the block is written.
template <class T>
void check_transpose_rows() {
  auto bits = [](const T& v) {
    std::uint32_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
  };
  auto with_bits = [](std::uint32_t b) {
    T v;
    std::memcpy(static_cast<void*>(&v), &b, sizeof(T));  // the low bytes: x86 is little-endian
    return v;
  };
  for (const std::int64_t rows : {1, 7, 16, 31, 47, 48, 64, 97}) {
    const std::int64_t cols = 133, ld_src = 150, ld_dst = 211;
    const std::uint32_t untouched = 0x3c00;
    std::vector<T> src(static_cast<std::size_t>(rows * ld_src)), dst(static_cast<std::size_t>(cols * ld_dst), with_bits(untouched));
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = with_bits(static_cast<std::uint32_t>(i % 30000 + 1));
    kernels::transpose_rows<T>(src.data(), ld_src, rows, cols, dst.data(), ld_dst);
    for (std::int64_t j = 0; j < cols; ++j)
      for (std::int64_t i = 0; i < ld_dst; ++i) {
        const std::uint32_t want = i < rows ? bits(src[static_cast<std::size_t>(i * ld_src + j)]) : untouched;
        ASSERT_EQ(bits(dst[static_cast<std::size_t>(j * ld_dst + i)]), want) << rows << " rows, element " << j << ", " << i;
      }
  }
}
TEST(Pack, TransposeRowsInBlocksIsThePlainTranspose) {
  kernels::init();
  check_transpose_rows<float>();
  check_transpose_rows<bf16>();
}

TEST(Bf16, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(bf16::from_float(1.0f).bits, 0x3f80);
  EXPECT_EQ(bf16::from_float(1.0f + 1.0f / 256).bits, 0x3f80);      // tie -> even
  EXPECT_EQ(bf16::from_float(1.0f + 3.0f / 256).bits, 0x3f82);      // tie -> even (up)
  EXPECT_TRUE(std::isnan(bf16::from_float(std::numeric_limits<float>::quiet_NaN()).to_float()));
  EXPECT_TRUE(std::isinf(bf16::from_float(std::numeric_limits<float>::infinity()).to_float()));
}

TEST(VectorKernels, SwigluForwardAndBackward) {
  const std::int64_t inter = 37;
  std::vector<float> h(2 * inter), da(inter);
  for (std::int64_t j = 0; j < 2 * inter; ++j) h[j] = float(std::sin(0.7 * j) * 3);
  for (std::int64_t j = 0; j < inter; ++j) da[j] = float(std::cos(0.3 * j));
  std::vector<float> a(inter), dh(2 * inter);
  swiglu_forward<float>(h.data(), inter, a.data());
  swiglu_backward<float>(h.data(), da.data(), inter, dh.data());
  for (std::int64_t j = 0; j < inter; ++j) {
    const double g = h[j], u = h[inter + j], s = 1 / (1 + std::exp(-g));
    EXPECT_NEAR(a[j], g * s * u, 1e-5 * (1 + std::abs(g * s * u)));
    EXPECT_NEAR(dh[j], da[j] * u * s * (1 + g * (1 - s)), 1e-5 * (1 + std::abs(dh[j])));
    EXPECT_NEAR(dh[inter + j], da[j] * g * s, 1e-5 * (1 + std::abs(dh[inter + j])));
  }
  // The SwiGLU's own exp over the whole range, the saturated ends included.
  const std::vector<float> gates = {-200.f, -100.f, -88.f, -87.f, -30.f, -5.5f, -1.f, -1e-3f, 0.f, 1e-3f, 0.37f, 1.f, 7.9f, 30.f, 88.f, 89.f, 200.f};
  const auto n = static_cast<std::int64_t>(gates.size());
  std::vector<float> hx(static_cast<std::size_t>(2 * n), 1.5f), ax(static_cast<std::size_t>(n)), dax(static_cast<std::size_t>(n), 1.f),
      dhx(static_cast<std::size_t>(2 * n));
  std::copy(gates.begin(), gates.end(), hx.begin());
  swiglu_forward<float>(hx.data(), n, ax.data());
  swiglu_backward<float>(hx.data(), dax.data(), n, dhx.data());
  for (std::int64_t j = 0; j < n; ++j) {
    const double g = gates[static_cast<std::size_t>(j)], s = 1 / (1 + std::exp(-g)), want = g * s * 1.5;
    ASSERT_TRUE(std::isfinite(ax[static_cast<std::size_t>(j)])) << "g " << g;
    EXPECT_NEAR(ax[static_cast<std::size_t>(j)], want, 1e-6 * std::abs(want) + 1e-30) << "g " << g;
    const double dgate = 1.5 * s * (1 + g * (1 - s));
    EXPECT_NEAR(dhx[static_cast<std::size_t>(j)], dgate, 2e-6 * (1 + std::abs(dgate))) << "g " << g;
  }
  std::vector<float> x(100);
  for (int i = 0; i < 100; ++i) x[i] = float(i % 7) - 3;
  double ref = 0;
  for (int i = 0; i < 100; ++i) ref += double(x[i]) * x[i];
  EXPECT_FLOAT_EQ(dot<float>(x.data(), x.data(), 100), float(ref));
}

// A's stride does not change a bit of the result: a strided A (a weight
// gradient's transposed activation) is compacted before libxsmm sees it, so
// its kernels depend on the tile's shape alone (a code cache that stays put
// under routing that changes every step).
TEST(TileGemm, StridedAGivesTheSameBitsAsADenseOne) {
  init();
  for (const std::int64_t k : {1, 7, 33, 130}) {
    const std::int64_t m = 16, n = 32;
    Rng rng(static_cast<std::uint64_t>(k));
    std::vector<float> dense(static_cast<std::size_t>(m * k)), strided(static_cast<std::size_t>(m * (k + 37)), -1.0f);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t p = 0; p < k; ++p)
        dense[static_cast<std::size_t>(i * k + p)] = strided[static_cast<std::size_t>(i * (k + 37) + p)] = float(rng.normal());
    std::vector<float> b(static_cast<std::size_t>(k * n));
    for (auto& v : b) v = float(rng.normal());
    std::vector<float> packed(static_cast<std::size_t>(padded_k<float>(k) * n));
    pack_rhs<float, float>(b.data(), n, k, n, packed.data(), 0, k);
    std::vector<float> c1(static_cast<std::size_t>(m * n)), c2(c1.size());
    gemm_tile<float>(dense.data(), k, RhsView<float>{packed.data(), n}, 0, c1.data(), n, m, n, k, false);
    gemm_tile<float>(strided.data(), k + 37, RhsView<float>{packed.data(), n}, 0, c2.data(), n, m, n, k, false);
    EXPECT_EQ(0, std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float))) << "k " << k;
  }
}
