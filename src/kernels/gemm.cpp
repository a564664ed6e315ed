#include <libxsmm.h>

#include <algorithm>
#include <bit>
#include <cpuid.h>
#include <cstdlib>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
#include <unordered_map>
#include <vector>
#ifdef HPMOE_WITH_ONEDNN
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "hpmoe/error.hpp"
#include "common/transpose.hpp"
#include "kernels/kernels.hpp"

namespace hpmoe::kernels {

void init() {
  static std::once_flag once;
  std::call_once(once, [] { libxsmm_init(); });
}

namespace {
// AMX-BF16 and AMX-TILE in CPUID leaf 7 (libgcc 12's __builtin_cpu_supports
// does not know them), and Linux's leave to use the tiles.
bool cpu_runs_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool bf16 = (edx >> 22) & 1u, tile = (edx >> 24) & 1u;
  return bf16 && tile && amx_permitted();
}

bool onednn_has_amx() {
#ifdef HPMOE_WITH_ONEDNN
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & amx) == amx;
#else
  return false;
#endif
}
}  // namespace

Bf16Engine bf16_engine() {
  static const Bf16Engine engine = [] {
    const char* asked = std::getenv("HPMOE_BF16_ENGINE");
    const std::string choice = asked ? asked : "";
    if (choice.empty()) return cpu_runs_amx() ? Bf16Engine::amx : Bf16Engine::libxsmm;
    if (choice == "libxsmm") return Bf16Engine::libxsmm;
    if (choice == "amx") {
      if (!cpu_runs_amx())
        throw Error("HPMOE_BF16_ENGINE=amx: this CPU has no AMX-BF16 tiles (or Linux refused them); unset it or pick libxsmm");
      return Bf16Engine::amx;
    }
    if (choice == "onednn") {
      if (!onednn_has_amx())
        throw Error("HPMOE_BF16_ENGINE=onednn: oneDNN finds no AMX here (or hpmoe was built without oneDNN); unset it or pick libxsmm");
      return Bf16Engine::onednn_amx;
    }
    throw Error("HPMOE_BF16_ENGINE='" + choice + "': expected amx, onednn or libxsmm");
  }();
  return engine;
}

namespace {
bool libxsmm_has_bf16();
}

const char* name(Bf16Engine e) {
  if (e == Bf16Engine::amx) return "hpmoe's AMX-BF16 kernel";
  if (e == Bf16Engine::onednn_amx) return "oneDNN matmul (AMX-BF16)";
  return libxsmm_has_bf16() ? "libxsmm (AVX512-BF16 or emulated)" : "libxsmm fp32 on bf16 widened to fp32 (no AVX-512)";
}

namespace {

#ifdef HPMOE_WITH_ONEDNN
// bf16 tiles by oneDNN: one matmul primitive per process and accumulate
// mode, with every dimension and stride given at run time, so that any tile
// shape runs without a primitive of its own (oneDNN picks its AMX GEMM;
// primitives are safe to execute from many threads at once). Each call runs
// on the calling worker alone: oneDNN's OpenMP parallelism is set to one
// thread for the call and restored after, so a caller's own OpenMP setting
// (PyTorch's, say) is left as it was.
class OnednnBf16 {
 public:
  static const OnednnBf16& get() {
    static const OnednnBf16 instance;
    return instance;
  }
  void run(const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t m,
           std::int64_t n, std::int64_t k, bool accumulate) const {
    using dnnl::memory;
    thread_local dnnl::stream stream(engine_);
    const memory a_mem({{m, k}, memory::data_type::bf16, memory::dims{lda, 1}}, engine_, const_cast<bf16*>(a));
    const memory b_mem({{k, n}, memory::data_type::bf16, memory::dims{ldb, 1}}, engine_, const_cast<bf16*>(b));
    const memory c_mem({{m, n}, memory::data_type::f32, memory::dims{ldc, 1}}, engine_, c);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    (accumulate ? accumulate_ : assign_).execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
    stream.wait();
    omp_set_num_threads(threads);
  }

 private:
  OnednnBf16() : engine_(dnnl::engine::kind::cpu, 0), assign_(make(false)), accumulate_(make(true)) {}
  dnnl::matmul make(bool accumulate) const {
    using dnnl::memory;
    const memory::dim any = DNNL_RUNTIME_DIM_VAL;
    const memory::desc a({any, any}, memory::data_type::bf16, memory::dims{any, 1});
    const memory::desc b({any, any}, memory::data_type::bf16, memory::dims{any, 1});
    const memory::desc c({any, any}, memory::data_type::f32, memory::dims{any, 1});
    dnnl::primitive_attr attr;
    if (accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    return dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, engine_));
  }
  dnnl::engine engine_;
  dnnl::matmul assign_, accumulate_;

 public:
  const dnnl::engine& engine() const { return engine_; }
};

// bf16 tiles whose B is a packed weight panel (VNNI, K padded to 32:
// oneDNN's BA16a64b2a) by oneDNN's AMX brgemm, 2-3x the rate of its strided
// GEMM on the same tiles. It takes dense A and C only: C goes through a
// dense scratch tile, and a strided A is copied first (rare: a split part
// narrower than its buffer). Primitives are made per tile shape (m, n, k) on
// first use and kept per thread, each with its own scratchpad (oneDNN's
// shared library scratchpad is not safe for primitives run concurrently).
class OnednnBrgemm {
 public:
  OnednnBrgemm() : stream_(OnednnBf16::get().engine()) {}
  void run(const bf16* a, std::int64_t lda, const bf16* b, float* c, std::int64_t ldc, std::int64_t m, std::int64_t n,
           std::int64_t k, bool accumulate) {
    using dnnl::memory;
    if (m >= (std::int64_t{1} << 31) || k >= (std::int64_t{1} << 25))
      throw Error("a bf16 tile of " + std::to_string(m) + " x " + std::to_string(k) + " is too large for the AMX path");
    const auto key = (static_cast<std::uint64_t>(m) << 32) | (static_cast<std::uint64_t>(n) << 25) | static_cast<std::uint64_t>(k);
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      if (cache_.size() >= 4096) cache_.clear();
      it = cache_.emplace(key, make(m, n, k)).first;
    }
    const Entry& e = it->second;
    if (lda != k) {  // dense A for the brgemm
      a_.resize(static_cast<std::size_t>(m * k));
      for (std::int64_t i = 0; i < m; ++i) std::memcpy(a_.data() + i * k, a + i * lda, static_cast<std::size_t>(k) * sizeof(bf16));
      a = a_.data();
    }
    c_.resize(static_cast<std::size_t>(m * n));
    scratch_.resize(std::max<std::size_t>(scratch_.size(), e.scratch_bytes));
    const dnnl::engine& eng = OnednnBf16::get().engine();
    const memory a_mem({{m, k}, memory::data_type::bf16, memory::format_tag::ab}, eng, const_cast<bf16*>(a));
    const memory b_mem({{k, n}, memory::data_type::bf16, memory::format_tag::BA16a64b2a}, eng, const_cast<bf16*>(b));
    const memory c_mem({{m, n}, memory::data_type::f32, memory::format_tag::ab}, eng, c_.data());
    const memory pad({{static_cast<memory::dim>(e.scratch_bytes)}, memory::data_type::u8, memory::format_tag::a}, eng,
                     scratch_.data());
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    e.matmul.execute(stream_, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}, {DNNL_ARG_SCRATCHPAD, pad}});
    stream_.wait();
    omp_set_num_threads(threads);
    for (std::int64_t i = 0; i < m; ++i) {
      const float* row = c_.data() + i * n;
      float* out = c + i * ldc;
      if (accumulate)
        for (std::int64_t j = 0; j < n; ++j) out[j] += row[j];
      else
        std::memcpy(out, row, static_cast<std::size_t>(n) * sizeof(float));
    }
  }

 private:
  struct Entry {
    dnnl::matmul matmul;
    std::size_t scratch_bytes = 0;
  };
  static Entry make(std::int64_t m, std::int64_t n, std::int64_t k) {
    using dnnl::memory;
    // One creation at a time: oneDNN's primitive cache, shared by all
    // threads, synchronises in ways ThreadSanitizer cannot see (it reported
    // concurrent creations as races); creations are rare, so this costs
    // nothing measurable.
    static std::mutex creating;
    const std::lock_guard lock(creating);
    const memory::desc a({m, k}, memory::data_type::bf16, memory::format_tag::ab);
    const memory::desc b({k, n}, memory::data_type::bf16, memory::format_tag::BA16a64b2a);
    const memory::desc c({m, n}, memory::data_type::f32, memory::format_tag::ab);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, OnednnBf16::get().engine());
    return {dnnl::matmul(pd), std::max<std::size_t>(pd.scratchpad_desc().get_size(), 1)};
  }
  dnnl::stream stream_;
  std::unordered_map<std::uint64_t, Entry> cache_;
  AlignedVector<bf16> a_;
  AlignedVector<float> c_;
  AlignedVector<std::uint8_t> scratch_;
};
#endif

void widened_batch_reduce(const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float* c,
                          std::int64_t ldc, std::int64_t m, std::int64_t n, std::int64_t kb, std::int64_t blocks,
                          bool accumulate);

// libxsmm is column-major: the row-major product C = A B is the column-major
// product C^T = B^T A^T, so B is libxsmm's "A" and A is its "B".
template <class T>
void batch_reduce(const T* a, std::int64_t lda, const T* b, std::int64_t ldb, float* c, std::int64_t ldc,
                  std::int64_t m, std::int64_t n, std::int64_t kb, std::int64_t blocks, bool accumulate) {
  const libxsmm_blasint xm = n, xn = m, xk = kb, xlda = ldb, xldb = lda, xldc = ldc;
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const libxsmm_blasint stride_rhs = static_cast<libxsmm_blasint>(kb * ldb * std::int64_t(sizeof(T)));
  const libxsmm_blasint stride_lhs = static_cast<libxsmm_blasint>(kb * std::int64_t(sizeof(T)));
  unsigned long long count = static_cast<unsigned long long>(blocks);
  if constexpr (sizeof(T) == 4) {
    const int flags = LIBXSMM_GEMM_FLAG_NONE;
    auto kernel = libxsmm_smmdispatch_reducebatch_strd(xm, xn, xk, stride_rhs, stride_lhs, &xlda, &xldb, &xldc,
                                                       &alpha, &beta, &flags, nullptr);
    if (!kernel) throw Error("libxsmm could not generate an fp32 GEMM kernel for " + std::to_string(m) + "x" +
                             std::to_string(n) + "x" + std::to_string(kb));
    kernel(reinterpret_cast<const float*>(b), reinterpret_cast<const float*>(a), c, &count);
  } else {
    if (!libxsmm_has_bf16()) {
      widened_batch_reduce(a, lda, b, ldb, c, ldc, m, n, kb, blocks, accumulate);
      return;
    }
    const int flags = LIBXSMM_GEMM_FLAG_VNNI_A;
    auto kernel = libxsmm_bsmmdispatch_reducebatch_strd(xm, xn, xk, stride_rhs, stride_lhs, &xlda, &xldb, &xldc,
                                                        &alpha, &beta, &flags, nullptr);
    if (!kernel) throw Error("libxsmm could not generate a bf16 GEMM kernel for " + std::to_string(m) + "x" +
                             std::to_string(n) + "x" + std::to_string(kb));
    kernel(reinterpret_cast<const libxsmm_bfloat16*>(b), reinterpret_cast<const libxsmm_bfloat16*>(a), c, &count);
  }
}

// Whether libxsmm generates bf16 kernels on this CPU: it does from AVX-512
// on (natively with AVX512-BF16, emulated without); on AVX2 CPUs (Zen 3,
// older Xeons) it generates none. Probed once.
bool libxsmm_has_bf16() {
  static const bool has = [] {
    const libxsmm_blasint m = 16, n = 16, k = 16, ld = 16;
    const float alpha = 1.0f, beta = 0.0f;
    const int flags = LIBXSMM_GEMM_FLAG_VNNI_A;
    return libxsmm_bsmmdispatch_reducebatch_strd(m, n, k, k * ld * 2, k * 2, &ld, &ld, &ld, &alpha, &beta, &flags,
                                                 nullptr) != nullptr;
  }();
  return has;
}

// bf16 blocks where libxsmm has no bf16 kernel: each block of A and of the
// VNNI B widened to fp32 (exactly: bf16 is fp32's upper half) and multiplied
// by libxsmm's fp32 kernel. A product of two bf16 values is exact in fp32, so
// this is the same arithmetic as a bf16 dot-product instruction's, with
// fp32 accumulation; every executor takes the same path, so results stay
// bit-identical between them. The widening costs 1/m of the block's work.
void widened_batch_reduce(const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float* c,
                          std::int64_t ldc, std::int64_t m, std::int64_t n, std::int64_t kb, std::int64_t blocks,
                          bool accumulate) {
  thread_local std::vector<float> wa, wb;
  wa.resize(static_cast<std::size_t>(m * kb));
  wb.resize(static_cast<std::size_t>(kb * n));
  for (std::int64_t block = 0; block < blocks; ++block) {
    const bf16* ab = a + block * kb;
    const bf16* bb = b + block * kb * ldb;  // VNNI: kb / 2 rows of pairs, ldb columns each
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t k = 0; k < kb; ++k) wa[static_cast<std::size_t>(i * kb + k)] = ab[i * lda + k].to_float();
    for (std::int64_t k = 0; k < kb; ++k)
      for (std::int64_t j = 0; j < n; ++j)
        wb[static_cast<std::size_t>(k * n + j)] = bb[((k / 2) * ldb + j) * 2 + k % 2].to_float();
    batch_reduce<float>(wa.data(), kb, wb.data(), n, c, ldc, m, n, kb, 1, accumulate || block > 0);
  }
}

}  // namespace

namespace {
// Whether a bf16 tile of this K runs on the AMX kernel. A K shorter than
// one block of 32 (a weight gradient of an expert that got a few rows) is
// half padding for the tiles; libxsmm's AVX512-BF16 kernel, which reads
// the same VNNI panels, runs it instead. The choice follows K alone, as
// every tile of one GEMM shares it.
constexpr std::int64_t kAmxMinK = 32;
bool amx_takes(std::int64_t k) { return bf16_engine() == Bf16Engine::amx && k >= kAmxMinK; }

// A bf16 tile within one panel on the AMX kernel. A VNNI operand that is
// not a whole panel (not panel-blocked: tests, benchmarks) is copied into
// one first, its columns past the tile and K's last pair row zero.
void amx_panel_tile(const bf16* a, std::int64_t lda, RhsView<bf16> b, std::int64_t col0, float* c, std::int64_t ldc,
                    std::int64_t m, std::int64_t n, std::int64_t k, bool accumulate) {
  if (!b.vnni) throw Error("the AMX kernel reads VNNI operands only");
  if (b.panel_stride > 0 && b.ld == kTileCols && col0 % kTileCols == 0) {
    amx_bf16_panel(a, lda, b.data + (col0 / kTileCols) * b.panel_stride, c, ldc, m, n, k, accumulate);
    return;
  }
  if (b.panel_stride > 0) throw Error("an AMX tile on a panel-blocked operand must start at a panel");
  thread_local AlignedVector<bf16> panel;
  panel.assign(static_cast<std::size_t>(k / 2 * 2 * kTileCols), bf16{});
  for (std::int64_t p = 0; p < k / 2; ++p)
    std::memcpy(panel.data() + p * 2 * kTileCols, b.data + (p * b.ld + col0) * 2, static_cast<std::size_t>(2 * n) * sizeof(bf16));
  amx_bf16_panel(a, lda, panel.data(), c, ldc, m, n, k, accumulate);
}

// One tile whose columns lie within one panel of b (or b is not blocked).
template <class T>
void gemm_one_panel(const T* a, std::int64_t lda, RhsView<T> b, std::int64_t col0, float* c, std::int64_t ldc,
                    std::int64_t m, std::int64_t n, std::int64_t k, bool accumulate) {
  const std::int64_t pair = b.vnni ? 2 : 1;  // VNNI keeps K pairs per column
  const T* rhs = b.data + col0 * pair;
  if (b.panel_stride > 0) rhs = b.data + (col0 / kTileCols) * b.panel_stride + (col0 % kTileCols) * pair;
  if constexpr (sizeof(T) == 2) {
    if (amx_takes(k)) {
      amx_panel_tile(a, lda, b, col0, c, ldc, m, n, k, accumulate);
      return;
    }
  }
#ifdef HPMOE_WITH_ONEDNN
  if constexpr (sizeof(T) == 2) {
    if (bf16_engine() == Bf16Engine::onednn_amx) {
      if (!b.vnni) {
        OnednnBf16::get().run(a, lda, rhs, b.ld, c, ldc, m, n, k, accumulate);
        return;
      }
      if (b.panel_stride <= 0 || b.ld != kTileCols || col0 % kTileCols != 0)
        throw Error("a bf16 AMX tile on a VNNI operand needs a whole weight panel (got ld " + std::to_string(b.ld) +
                    ", column " + std::to_string(col0) + ")");
      thread_local OnednnBrgemm brgemm;
      brgemm.run(a, lda, rhs, c, ldc, m, n, k, accumulate);
      return;
    }
  }
#endif
  // A panel's last columns (N not a multiple of 64) run as the whole
  // panel (its columns past N are the packing's zeros) into a scratch
  // tile: libxsmm's kernels for narrow N keep K in several accumulators
  // when M is small, so a row's bits would depend on how many rows its tile
  // has, and the tile's rows depend on the placement (replicas' quotas, lent
  // experts). At the full panel width every tile height gives each row the
  // same bits.
  if (n < kTileCols && b.ld == kTileCols && col0 % kTileCols == 0) {
    thread_local AlignedVector<float> wide;
    wide.resize(static_cast<std::size_t>(m * kTileCols));
    if (accumulate)
      for (std::int64_t i = 0; i < m; ++i) {
        std::memcpy(wide.data() + i * kTileCols, c + i * ldc, static_cast<std::size_t>(n) * sizeof(float));
        std::memset(wide.data() + i * kTileCols + n, 0, static_cast<std::size_t>(kTileCols - n) * sizeof(float));
      }
    gemm_one_panel<T>(a, lda, b, col0, wide.data(), kTileCols, m, kTileCols, k, accumulate);
    for (std::int64_t i = 0; i < m; ++i)
      std::memcpy(c + i * ldc, wide.data() + i * kTileCols, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  const std::int64_t blocks = k / kBlockK, rest = k % kBlockK;
  for (std::int64_t first = 0; first < blocks; first += kChunkBlocks)
    batch_reduce<T>(a + first * kBlockK, lda, rhs + first * kBlockK * b.ld, b.ld, c, ldc, m, n, kBlockK,
                    std::min(kChunkBlocks, blocks - first), accumulate || first > 0);
  if (rest > 0)
    batch_reduce<T>(a + blocks * kBlockK, lda, rhs + blocks * kBlockK * b.ld, b.ld, c, ldc, m, n, rest, 1,
                    accumulate || blocks > 0);
}
// libxsmm generates and keeps a kernel per (m, n, k, lda, ldb, ldc). A
// weight-gradient tile reads k rows' worth of a longer transposed
// activation (lda its whole row count), so under routing that changes
// every step each (k, lda) pair was a new kernel: the code cache grew by
// 70 MB in 1,000 soak steps. Such an A is copied into a tile whose stride
// depends on k alone; the same values in the same FMA order give the same
// bits, and the copy is 1/n of the tile's work.
// (oneDNN takes any stride and keys its kernels otherwise.) hpmoe's AMX
// kernel has no kernels to key, but a strip of weight-gradient tiles reads
// its A once per panel, each row a page apart in the long activation: the
// compact copy, made once for all the panels, keeps those reads in a few
// pages.
template <class T>
void compact_operand(const T*& a, std::int64_t& lda, std::int64_t m, std::int64_t n, std::int64_t k) {
  bool compact_a = true;
  if constexpr (sizeof(T) == 2) compact_a = amx_takes(k) ? n > kTileCols : bf16_engine() != Bf16Engine::onednn_amx;
  const std::int64_t tight = (k + 15) / 16 * 16;
  if (compact_a && lda != k && lda != tight) {
    thread_local std::vector<T> compact;
    compact.resize(static_cast<std::size_t>(m * tight));
    for (std::int64_t i = 0; i < m; ++i)
      std::memcpy(compact.data() + i * tight, a + i * lda, static_cast<std::size_t>(k) * sizeof(T));
    a = compact.data();
    lda = tight;
  }
}

// Rows of a float tile into dst, the whole 64-byte lines of each row with
// non-temporal stores (the line goes to memory without being read first)
// and the partial lines at a row's ends with plain ones. A gradient's rows
// need not start on a line: a std::vector's large blocks start 16 bytes
// past one. The fence orders the stores before the event the task
// releases next (non-temporal stores are weakly ordered).
void stream_rows(const float* src, std::int64_t ld_src, float* dst, std::int64_t ld_dst, std::int64_t m, std::int64_t n) {
#if defined(__AVX512F__) || defined(__AVX__)
#ifdef __AVX512F__
  constexpr std::int64_t kLanes = 16;
#else
  constexpr std::int64_t kLanes = 8;
#endif
  constexpr std::int64_t kLine = 64 / sizeof(float);
  for (std::int64_t i = 0; i < m; ++i) {
    const float* from = src + i * ld_src;
    float* to = dst + i * ld_dst;
    const auto offset = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(to) % 64);
    if (offset % sizeof(float) != 0) {  // not float-aligned: no lines to stream
      std::memcpy(to, from, static_cast<std::size_t>(n) * sizeof(float));
      continue;
    }
    const std::int64_t head = std::min(n, (kLine - offset / std::int64_t{sizeof(float)}) % kLine);
    std::memcpy(to, from, static_cast<std::size_t>(head) * sizeof(float));
    std::int64_t j = head;
    for (; j + kLanes <= n; j += kLanes)
#ifdef __AVX512F__
      _mm512_stream_ps(to + j, _mm512_loadu_ps(from + j));
#else
      _mm256_stream_ps(to + j, _mm256_loadu_ps(from + j));
#endif
    std::memcpy(to + j, from + j, static_cast<std::size_t>(n - j) * sizeof(float));
  }
  _mm_sfence();
#else
  for (std::int64_t i = 0; i < m; ++i)
    std::memcpy(dst + i * ld_dst, src + i * ld_src, static_cast<std::size_t>(n) * sizeof(float));
#endif
}
}  // namespace

template <class T>
void gemm_tile(const T* a, std::int64_t lda, RhsView<T> b, std::int64_t col0, float* c, std::int64_t ldc,
               std::int64_t m, std::int64_t n, std::int64_t k, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    if (!accumulate)
      for (std::int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  if (sizeof(T) == 2 && ((lda | k) & 1))
    throw Error("bf16 tile GEMM needs an even K and an even leading dimension of A (got lda " +
                std::to_string(lda) + ", k " + std::to_string(k) + ")");
  compact_operand(a, lda, m, n, k);
  if (b.panel_stride <= 0) {
    gemm_one_panel<T>(a, lda, b, col0, c, ldc, m, n, k, accumulate);
    return;
  }
  // A panel-blocked operand: panel by panel, along the rows of C (a strip of
  // weight-gradient tiles walks its output rows in order).
  for (std::int64_t col = col0; col < col0 + n;) {
    const std::int64_t width = std::min(col0 + n, (col / kTileCols + 1) * kTileCols) - col;
    gemm_one_panel<T>(a, lda, b, col, c + (col - col0), ldc, m, width, k, accumulate);
    col += width;
  }
}

template <class T>
void gemm_tile_streamed(const T* a, std::int64_t lda, RhsView<T> b, std::int64_t col0, float* c, std::int64_t ldc,
                        std::int64_t m, std::int64_t n, std::int64_t k) {
  if (m <= 0 || n <= 0) return;
  if (m > kMaxTileRows || k <= 0 || b.panel_stride <= 0) {
    gemm_tile<T>(a, lda, b, col0, c, ldc, m, n, k, false);
    return;
  }
  if (sizeof(T) == 2 && ((lda | k) & 1))
    throw Error("bf16 tile GEMM needs an even K and an even leading dimension of A (got lda " +
                std::to_string(lda) + ", k " + std::to_string(k) + ")");
  compact_operand(a, lda, m, n, k);
  alignas(64) float tile[kMaxTileRows * kTileCols];
  for (std::int64_t col = col0; col < col0 + n;) {
    const std::int64_t width = std::min(col0 + n, (col / kTileCols + 1) * kTileCols) - col;
    gemm_one_panel<T>(a, lda, b, col, tile, kTileCols, m, width, k, false);
    stream_rows(tile, kTileCols, c + (col - col0), ldc, m, width);
    col += width;
  }
}

namespace {
template <class T, class S>
T convert(S v) {
  if constexpr (std::is_same_v<T, bf16>) {
    if constexpr (std::is_same_v<S, bf16>) return v;
    else return bf16::from_float(static_cast<float>(v));
  } else {
    if constexpr (std::is_same_v<S, bf16>) return v.to_float();
    else return static_cast<T>(v);
  }
}
}  // namespace

template <class S, class T>
void pack_rhs(const S* src, std::int64_t ld_src, std::int64_t k, std::int64_t n, T* dst, std::int64_t row_begin,
              std::int64_t row_end) {
  const bool vnni = vnni_layout<T>();
  const std::int64_t end = row_end >= k ? padded_k<T>(k) : row_end;
  for (std::int64_t r = row_begin; r < end; ++r) {
    if (!vnni) {
      for (std::int64_t j = 0; j < n; ++j) dst[r * n + j] = r < k ? convert<T>(src[r * ld_src + j]) : T{};
      continue;
    }
    T* out = dst + (r / 2) * n * 2 + (r % 2);
    if (r < k)
      for (std::int64_t j = 0; j < n; ++j) out[j * 2] = convert<T>(src[r * ld_src + j]);
    else
      for (std::int64_t j = 0; j < n; ++j) out[j * 2] = T{};
  }
}

template <class S, class T>
void pack_rhs_transposed(const S* src, std::int64_t ld_src, std::int64_t k, std::int64_t n, T* dst,
                         std::int64_t col_begin, std::int64_t col_end) {
  // Operand element (r, j) = src[j, r].
  const bool vnni = vnni_layout<T>();
  for (std::int64_t j = col_begin; j < col_end; ++j) {
    const S* row = src + j * ld_src;
    for (std::int64_t r = 0; r < padded_k<T>(k); ++r) dst[rhs_index(r, j, n, vnni)] = r < k ? convert<T>(row[r]) : T{};
  }
}

template <class T>
void transpose_rows(const T* src, std::int64_t ld_src, std::int64_t rows, std::int64_t cols, T* dst, std::int64_t ld_dst) {
  transpose_blocked(src, ld_src, rows, cols, dst, ld_dst);
}
template void transpose_rows<float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*, std::int64_t);
template void transpose_rows<bf16>(const bf16*, std::int64_t, std::int64_t, std::int64_t, bf16*, std::int64_t);

template void gemm_tile<float>(const float*, std::int64_t, RhsView<float>, std::int64_t, float*, std::int64_t,
                               std::int64_t, std::int64_t, std::int64_t, bool);
template void gemm_tile_streamed<float>(const float*, std::int64_t, RhsView<float>, std::int64_t, float*,
                                        std::int64_t, std::int64_t, std::int64_t, std::int64_t);
template void gemm_tile_streamed<bf16>(const bf16*, std::int64_t, RhsView<bf16>, std::int64_t, float*,
                                       std::int64_t, std::int64_t, std::int64_t, std::int64_t);
template void gemm_tile<bf16>(const bf16*, std::int64_t, RhsView<bf16>, std::int64_t, float*, std::int64_t,
                              std::int64_t, std::int64_t, std::int64_t, bool);
template void pack_rhs<float, float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*, std::int64_t,
                                     std::int64_t);
template void pack_rhs<float, bf16>(const float*, std::int64_t, std::int64_t, std::int64_t, bf16*, std::int64_t,
                                    std::int64_t);
template void pack_rhs<bf16, bf16>(const bf16*, std::int64_t, std::int64_t, std::int64_t, bf16*, std::int64_t,
                                   std::int64_t);
template void pack_rhs_transposed<float, float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*,
                                                std::int64_t, std::int64_t);
template void pack_rhs_transposed<float, bf16>(const float*, std::int64_t, std::int64_t, std::int64_t, bf16*,
                                               std::int64_t, std::int64_t);

}  // namespace hpmoe::kernels
