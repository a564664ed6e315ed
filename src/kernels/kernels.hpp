#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <new>
#include <vector>

#include "hpmoe/bf16.hpp"

// Tile kernels shared by every executor, so that comparisons between
// executors measure scheduling, not kernels.
namespace hpmoe::kernels {

// Tile sizes of the expert GEMMs: output tiles of kTileRows x kTileCols,
// with K consumed in blocks of kBlockK by libxsmm's batch-reduce kernel
// (libxsmm does not block over K itself).
inline constexpr std::int64_t kTileRows = 128;       // token rows of a tile
inline constexpr std::int64_t kWeightTileRows = 64;  // rows of a weight-gradient tile (K: a step's rows)
// Columns of a weight-gradient task: whole rows of the gradient up to 16 KiB
// of fp32. Its tiles have a short K and are bound by writing their output;
// two cores writing neighbouring 64-column tiles of the same rows take 8.0
// us a tile against 3.5 for strips of whole rows (a Xeon, 2 cores, K 16:
// build/bench/wgrad_layout; docs/results/benchmarks.md, "Weight-gradient strips").
inline constexpr std::int64_t kWeightTileCols = 4096;
inline constexpr std::int64_t kTileCols = 64;
inline constexpr std::int64_t kBlockK = 128;
// A tile's K is reduced in chunks of at most kChunkBlocks blocks, each one
// batch-reduce call accumulating into C: a chunk of A's row tile and of B's
// panel (64 x 2048 fp32: 512 KiB each) stays in L2 while the kernel sweeps
// it, where a whole K of 7168 (1.8 MiB each) does not. libxsmm's fp32 tile
// is a sequential FMA sum in K order and C is exact between chunks, so the
// result is bit for bit the one-call result (TileGemm.Fp32IsASequentialFmaSum).
inline constexpr std::int64_t kChunkBlocks = 16;

// An allocator of 64-byte aligned storage: tile operands whose rows start
// on a cache line. oneDNN's AMX kernels run at half their rate or less on
// operands 16 bytes off a line (docs/results/benchmarks.md, "bf16 on AMX").
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  friend bool operator==(const CacheLineAllocator&, const CacheLineAllocator&) { return true; }
};
template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// Initialises libxsmm once per process; cheap to call again.
void init();

// The engine that runs bf16 tiles, chosen once per process from the CPU:
// on a CPU with AMX-BF16 (and Linux's leave to use its tiles), hpmoe's own
// AMX kernel (amx.cpp), which runs the layer 1.5-1.6x faster than oneDNN
// 2.6's matmul (its tiles 1.1-2.3x); elsewhere libxsmm, whose AVX512-BF16 kernels
// match oneDNN's without AMX (docs/results/benchmarks.md, "bf16 on AMX").
// fp32 tiles always run libxsmm (a sequential FMA sum in K; see
// kChunkBlocks). HPMOE_BF16_ENGINE=amx|onednn|libxsmm in the environment
// picks one (onednn: oneDNN's matmul, AMX where it finds it; kept to
// measure against); a choice the build or the CPU cannot run is an error.
enum class Bf16Engine { libxsmm, onednn_amx, amx };
Bf16Engine bf16_engine();
const char* name(Bf16Engine);
// Whether the engine multiplies on AMX tiles (the tile and padding rules below).
inline bool amx_engine() { return bf16_engine() != Bf16Engine::libxsmm; }
// Whether bf16 operands are in VNNI pairs (libxsmm, the AMX kernel) or plain rows (oneDNN).
inline bool bf16_vnni() { return bf16_engine() != Bf16Engine::onednn_amx; }
// Whether Linux lets this process use the AMX tile registers (asked once).
bool amx_permitted();
// The AMX kernel: C[m, n] (=, or += when accumulate) A[m, k] times one
// VNNI panel of 64 columns (pair rows 128 elements apart; n <= 64, its
// columns past n zero), fp32 C; k even.
void amx_bf16_panel(const bf16* a, std::int64_t lda, const bf16* panel, float* c, std::int64_t ldc, std::int64_t m,
                    std::int64_t n, std::int64_t k, bool accumulate);
// Rows of a token tile for T's engine: kTileRows, and twice as many for bf16
// on AMX, where a tile of 128 rows spends more time bringing in its weight
// panel than multiplying it (each panel is read once per row tile).
inline constexpr std::int64_t kMaxTileRows = 256;
template <class T>
std::int64_t token_tile_rows() {
  if constexpr (sizeof(T) == 2) return amx_engine() ? kMaxTileRows : kTileRows;
  else return kTileRows;
}
// Rows of a weight-gradient tile for T's engine. Their K is an expert's rows
// of a step (a few hundred), so a tile is short work; oneDNN's AMX GEMM
// needs taller tiles to run near its rate (m x 64 x 384: 575 GFLOP/s at 64
// rows, 881 at 256; docs/results/benchmarks.md, "bf16 on AMX").
template <class T>
std::int64_t weight_tile_rows() {
  if constexpr (sizeof(T) == 2) return amx_engine() ? 256 : kWeightTileRows;
  else return kWeightTileRows;
}

// Index of operand element (k, n) in a (panel of a) RhsView operand with
// leading dimension ld; vnni: bf16_vnni() for bf16, false for float.
inline std::int64_t rhs_index(std::int64_t k, std::int64_t n, std::int64_t ld, bool vnni) {
  return vnni ? ((k / 2) * ld + n) * 2 + k % 2 : k * ld + n;
}
template <class T>
bool vnni_layout() {
  if constexpr (sizeof(T) == 2) return bf16_vnni();
  else return false;
}

// The right-hand operand of a tile GEMM, laid out as the kernel reads it:
//   float: row-major [K, N], leading dimension ld;
//   bf16:  VNNI pairs when `vnni`: element (k, n) at
//          ((k / 2) * ld + n) * 2 + k % 2; otherwise as float.
// libxsmm reads VNNI only. oneDNN on AMX reads packed weights (panel_view)
// as VNNI panels with K padded to 32, its AMX brgemm's own blocked layout
// (BA16a64b2a), and every other bf16 operand (the pack tasks' panels of
// activations and gradients) as plain rows, which its AMX GEMM takes with
// any strides. The packers below and every executor's pack task write the
// layout of the engine in use.
// When panel_stride > 0 the operand is panel-blocked: columns come in panels
// of kTileCols, each panel a contiguous [K, kTileCols] operand of the layout
// above (ld = kTileCols), panel p starting at data + p * panel_stride. A tile
// then reads one contiguous block instead of K rows a whole row apart, which
// keeps the TLB and the prefetchers happy for long K. A tile across panels
// runs panel by panel.
template <class T>
struct RhsView {
  const T* data = nullptr;
  std::int64_t ld = 0;
  std::int64_t panel_stride = 0;
  bool vnni = vnni_layout<T>();
};

// C[m, n] (=, or += when accumulate) A[m, k] * B[k, col0 : col0 + n].
// A is row-major with leading dimension lda; C is fp32 row-major. For bf16, k
// must be even (operands are zero-padded to an even K).
template <class T>
void gemm_tile(const T* a, std::int64_t lda, RhsView<T> b, std::int64_t col0, float* c, std::int64_t ldc,
               std::int64_t m, std::int64_t n, std::int64_t k, bool accumulate);

// gemm_tile (=, not accumulating) for an output written once and read
// much later (a weight gradient): each panel's tile computed into an L1
// scratch tile and stored to c with non-temporal stores, which send its
// lines to memory without reading them first. The same bits as gemm_tile.
template <class T>
void gemm_tile_streamed(const T* a, std::int64_t lda, RhsView<T> b, std::int64_t col0, float* c, std::int64_t ldc,
                        std::int64_t m, std::int64_t n, std::int64_t k);

// K rounded up to what the layout of T needs (even for bf16).
template <class T>
constexpr std::int64_t padded_k(std::int64_t k) {
  if constexpr (sizeof(T) == 2) return (k + 1) & ~std::int64_t{1};
  return k;
}

// Packs rows [row_begin, row_end) of row-major src [K, N] (leading dimension
// ld_src) into the RhsView layout with ld = n. Rows past K up to padded_k are
// zero when row_end reaches K.
template <class S, class T>
void pack_rhs(const S* src, std::int64_t ld_src, std::int64_t k, std::int64_t n, T* dst, std::int64_t row_begin,
              std::int64_t row_end);

// K of a packed weight's panels: padded_k, and a multiple of 32 for bf16 on
// AMX (oneDNN's brgemm layout blocks K by 32; the padding rows are zero).
template <class T>
std::int64_t weight_padded_k(std::int64_t k) {
  if constexpr (sizeof(T) == 2)
    if (amx_engine()) return (k + 31) & ~std::int64_t{31};
  return padded_k<T>(k);
}

// Elements of a panel-blocked weight operand of [K, N].
template <class T>
std::int64_t panel_blocked_size(std::int64_t k, std::int64_t n) {
  return weight_padded_k<T>(k) * ((n + kTileCols - 1) / kTileCols) * kTileCols;
}

// Packs row-major src [K, N] (or, when transposed, src [N, K] read as its
// transpose) into the panel-blocked weight layout (bf16: VNNI, K padded to
// weight_padded_k), panels [panel_begin, panel_end). Columns past N in the
// last panel and rows past K are zero.
template <class S, class T>
void pack_rhs_panels(const S* src, std::int64_t ld_src, std::int64_t k, std::int64_t n, bool transposed, T* dst,
                     std::int64_t panel_begin, std::int64_t panel_end);

// A row-major source made of two blocks of rows, each with its own leading
// dimension: rows [0, top_rows) of `top`, then `bottom`'s. A Hugging Face
// expert's gate_proj and up_proj ([I, H] each) are one [2 I, H] source this
// way, which the packers read without copying them together.
template <class S>
struct StackedRows {
  const S* top = nullptr;
  std::int64_t ld_top = 0, top_rows = 0;
  const S* bottom = nullptr;
  std::int64_t ld_bottom = 0;
  const S* row(std::int64_t r) const { return r < top_rows ? top + r * ld_top : bottom + (r - top_rows) * ld_bottom; }
  std::int64_t ld(std::int64_t r) const { return r < top_rows ? ld_top : ld_bottom; }
  // Rows from r on that lie in r's block (a run one pointer and ld reach).
  std::int64_t run_from(std::int64_t r, std::int64_t want) const {
    return r < top_rows ? std::min(want, top_rows - r) : want;
  }
};
// pack_rhs_panels from a stacked source: the operand is [K, N] read from
// src's rows (or, transposed, src [N, K] read as its transpose, each of N's
// columns one of src's rows). The same bits as packing the two blocks
// copied into one matrix.
template <class S, class T>
void pack_rhs_panels(const StackedRows<S>& src, std::int64_t k, std::int64_t n, bool transposed, T* dst,
                     std::int64_t panel_begin, std::int64_t panel_end);
// Rows [row0, row0 + rows) of a panel-blocked [height, n] operand (T's
// layout, ld = kTileCols, panels height * kTileCols apart) from row-major
// src (leading dimension ld_src), then zero_rows zero rows (a K padding
// row): the weight-gradient packs' token tiles of an output gradient.
// Columns past n in the last panel are zero. Writes only its own rows'
// elements, so tiles of one operand may be packed concurrently.
template <class T>
void pack_rows_into_panels(const T* src, std::int64_t ld_src, std::int64_t rows, std::int64_t n, T* panels,
                           std::int64_t height, std::int64_t row0, std::int64_t zero_rows);
// The inverse of pack_rhs_panels (not transposed): a panel-blocked [K, N]
// operand back into row-major float dst (leading dimension ld_dst), bf16
// values widened (exactly).
template <class T>
void unpack_rhs_panels(const T* panels, std::int64_t k, std::int64_t n, float* dst, std::int64_t ld_dst);
template <class T>
RhsView<T> panel_view(const T* data, std::int64_t k) {
  return {data, kTileCols, weight_padded_k<T>(k) * kTileCols, sizeof(T) == 2};
}

// Packs the transpose of row-major src [N, K] (so the operand is src^T) into
// the RhsView layout with ld = n, for output columns [col_begin, col_end).
template <class S, class T>
void pack_rhs_transposed(const S* src, std::int64_t ld_src, std::int64_t k, std::int64_t n, T* dst,
                         std::int64_t col_begin, std::int64_t col_end);

// dst[j, i] = src[i, j] for i in [0, rows), j in [0, cols): a block of
// token rows into the columns of a transposed buffer (the weight-gradient
// packs, the router's x^T, a dW tile into a framework's [out, in] gradient),
// 16 rows at a time (common/transpose.hpp). libxsmm_otrans was no better
// than the plain blocked loop: 5.9 GB/s, 3.0 at 74 rows, and in the runtime
// some calls took 4 ms.
template <class T>
void transpose_rows(const T* src, std::int64_t ld_src, std::int64_t rows, std::int64_t cols, T* dst, std::int64_t ld_dst);

// Vector kernels (fp32 arithmetic, T storage).
template <class T>
void store(const float* src, T* dst, std::int64_t n);
template <class T>
void load(const T* src, float* dst, std::int64_t n);
template <class T>
void scale_store(float w, const float* src, T* dst, std::int64_t n);  // dst = w * src
template <class T>
void axpy(float w, const T* x, float* acc, std::int64_t n);           // acc += w * x
template <class T>
float dot(const float* a, const T* b, std::int64_t n);

// a = silu(h[:, :I]) * h[:, I:], one row.
template <class T>
void swiglu_forward(const float* h, std::int64_t inter, T* a);
// dh from da and the saved h, one row.
template <class T>
void swiglu_backward(const float* h, const float* da, std::int64_t inter, T* dh);

// memcpy of n elements that is defined for n == 0 (empty buffers have no data).
template <class T>
void copy_elements(T* dst, const T* src, std::int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(T));
}

// One token's combine: its K returned rows (rows[slots[k]], H wide) weighted
// in k order, then `extra` rows added with weight 1 (the shared experts', the
// router's; null ones skipped). slots[k] < 0: dropped. weights null: 1.
template <class T>
void combine_row(float* out, std::int64_t H, std::int64_t K, const std::int64_t* slots, const float* weights, const T* rows,
                 std::initializer_list<const float*> extra) {
  std::fill(out, out + H, 0.0f);
  for (std::int64_t k = 0; k < K; ++k)
    if (slots[k] >= 0) axpy<T>(weights ? weights[k] : 1.0f, rows + slots[k] * H, out, H);
  for (const float* e : extra)
    if (e) axpy<float>(1.0f, e, out, H);
}

}  // namespace hpmoe::kernels
