#pragma once
// Internal: pieces both executors share, so that the serialized baseline and
// the interleaved runtime compute with the same operands, the same exchange
// layout and the same router, and their results can be bit-identical.
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "runtime/interleaved.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "kernels/kernels.hpp"
#include "hpmoe/routing.hpp"
#include <atomic>
#include <mutex>
#include <thread>
#include <exception>
#include "hpmoe/tensors.hpp"
#include "runtime/worker_pool.hpp"

namespace hpmoe::detail {

using kernels::kTileCols;
using kernels::kTileRows;
using kernels::padded_k;
using kernels::RhsView;

// A weight as the right-hand GEMM operand, packed once into the kernel's
// panel-blocked layout (so the per-step cost is zero).
template <class T>
struct Operand {
  kernels::AlignedVector<T> storage;
  RhsView<T> view_;
  RhsView<T> view() const { return view_; }
};

// The operand is m itself ([rows, cols]) or, when transposed, m^T.
template <class T>
Operand<T> packed_operand(const Matrix& m, bool transposed) {
  const std::int64_t k = transposed ? m.cols : m.rows, n = transposed ? m.rows : m.cols;
  Operand<T> op;
  op.storage.resize(static_cast<std::size_t>(kernels::panel_blocked_size<T>(k, n)));
  kernels::pack_rhs_panels<float, T>(m.data.data(), m.cols, k, n, transposed, op.storage.data(), 0,
                                     (n + kTileCols - 1) / kTileCols);
  op.view_ = kernels::panel_view<T>(op.storage.data(), k);
  return op;
}
// m packed again into op's storage, which keeps its pages when the size is
// unchanged (a training step's weight update repacks without new memory).
template <class T>
void repack_operand(Operand<T>& op, const Matrix& m, bool transposed) {
  const std::int64_t k = transposed ? m.cols : m.rows, n = transposed ? m.rows : m.cols;
  if (op.storage.size() != static_cast<std::size_t>(kernels::panel_blocked_size<T>(k, n))) {
    op = packed_operand<T>(m, transposed);
    return;
  }
  kernels::pack_rhs_panels<float, T>(m.data.data(), m.cols, k, n, transposed, op.storage.data(), 0,
                                     (n + kTileCols - 1) / kTileCols);
  op.view_ = kernels::panel_view<T>(op.storage.data(), k);
}
template <class T>
Operand<T> operand_of(const Matrix& m) {
  return packed_operand<T>(m, false);
}
template <class T>
Operand<T> transposed_operand_of(const Matrix& m) {
  return packed_operand<T>(m, true);
}

// Every weight of the layer packed for the tile kernels (transposes too,
// for backward).
template <class T>
struct PackedLayer {
  std::vector<Operand<T>> w1, w2, w1_t, w2_t;  // [E]; empty for experts not held
  bool holds(std::int64_t e) const { return !w1[static_cast<std::size_t>(e)].storage.empty(); }
  Operand<float> router, router_t;
  Operand<T> sw1, sw2, sw1_t, sw2_t;
};

// Runs job(0..n-1) on up to one thread per core (packing is pure per job,
// so the result does not depend on the thread count).
template <class Job>
void on_all_cores(std::size_t n, Job&& job) {
  const std::size_t threads = std::min<std::size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (std::size_t i = 0; i < n; ++i) job(i);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  std::vector<std::thread> pool;
  for (std::size_t t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (std::size_t i; (i = next.fetch_add(1)) < n;) try {
          job(i);
        } catch (...) {
          std::lock_guard lock(failure_mutex);
          if (!failure) failure = std::current_exception();
        }
    });
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
}

// One operand of expert e: W1, W2 and, for backward, their transposes (parts 0-3).
template <class T>
void pack_expert_part(PackedLayer<T>& p, const LayerWeights& w, std::size_t e, std::size_t part) {
  switch (part) {
    case 0: p.w1[e] = operand_of<T>(w.w1[e]); break;
    case 1: p.w2[e] = operand_of<T>(w.w2[e]); break;
    case 2: p.w1_t[e] = transposed_operand_of<T>(w.w1[e]); break;
    default: p.w2_t[e] = transposed_operand_of<T>(w.w2[e]); break;
  }
}

// Expert e packed into p (and, for backward, its transposes): the two or
// four operands on all cores.
template <class T>
void pack_expert(PackedLayer<T>& p, const LayerWeights& w, std::size_t e, bool backward) {
  on_all_cores(backward ? 4 : 2, [&](std::size_t part) { pack_expert_part(p, w, e, part); });
}

// The replicated parameters, and the experts `w` holds (`fetch`, when
// given, first brings each of `experts` into w, and the raw copy is
// released once packed: only one expert's raw weights exist at a time).
template <class T>
std::shared_ptr<PackedLayer<T>> pack_layer(const LayerConfig& c, LayerWeights& w, bool backward,
                                                 std::span<const std::int32_t> experts,
                                                 const std::function<void(std::int64_t, LayerWeights&)>& fetch) {
  auto p = std::make_shared<PackedLayer<T>>();
  const auto E = static_cast<std::size_t>(c.routed_experts);
  p->w1.resize(E);
  p->w2.resize(E);
  if (backward) {
    p->w1_t.resize(E);
    p->w2_t.resize(E);
  }
  if (fetch) {
    w.w1.resize(E);
    w.w2.resize(E);
    for (const std::int32_t e : experts) {
      fetch(e, w);
      check_weight_shapes(c, w);
      pack_expert(*p, w, static_cast<std::size_t>(e), backward);
      w.w1[e] = Matrix();
      w.w2[e] = Matrix();
    }
  } else {
    // Every operand of every held expert is one job (an expert not held
    // here lives in another process).
    std::vector<std::pair<std::size_t, std::size_t>> jobs;
    for (std::size_t e = 0; e < E; ++e)
      if (holds_expert(w, static_cast<std::int64_t>(e)))
        for (std::size_t part = 0; part < (backward ? 4u : 2u); ++part) jobs.emplace_back(e, part);
    on_all_cores(jobs.size(), [&](std::size_t j) { pack_expert_part(*p, w, jobs[j].first, jobs[j].second); });
  }
  p->router = operand_of<float>(w.router);
  if (backward) p->router_t = transposed_operand_of<float>(w.router);
  if (c.shared_experts > 0) {
    p->sw1 = operand_of<T>(w.shared_w1);
    p->sw2 = operand_of<T>(w.shared_w2);
    if (backward) {
      p->sw1_t = transposed_operand_of<T>(w.shared_w1);
      p->sw2_t = transposed_operand_of<T>(w.shared_w2);
    }
  }
  return p;
}
template <class T>
std::shared_ptr<PackedLayer<T>> pack_layer(const LayerConfig& c, const LayerWeights& w, bool backward) {
  return pack_layer<T>(c, const_cast<LayerWeights&>(w), backward, {}, {});  // without fetch, w is only read
}

// The operands of `experts` (every held one when `all_experts`) and, when
// `replicated`, the router's and the shared experts', packed again in place
// from w: the weights a caller changed, and nothing else.
template <class T>
void repack_layer(PackedLayer<T>& p, const LayerConfig& c, const LayerWeights& w, bool backward,
                  std::span<const std::int32_t> experts, bool all_experts, bool replicated) {
  std::vector<std::pair<std::size_t, std::size_t>> jobs;  // (expert, part) as pack_expert_part numbers them
  auto add = [&](std::size_t e) {
    if (e >= p.w1.size()) throw Error("repack: expert " + std::to_string(e) + " is not in the layer");
    if (!holds_expert(w, static_cast<std::int64_t>(e))) return;  // held elsewhere
    for (std::size_t part = 0; part < (backward ? 4u : 2u); ++part) jobs.emplace_back(e, part);
  };
  if (all_experts)
    for (std::size_t e = 0; e < p.w1.size(); ++e) add(e);
  else
    for (const std::int32_t e : experts) add(static_cast<std::size_t>(e));
  on_all_cores(jobs.size(), [&](std::size_t j) {
    const auto [e, part] = jobs[j];
    switch (part) {
      case 0: repack_operand<T>(p.w1[e], w.w1[e], false); break;
      case 1: repack_operand<T>(p.w2[e], w.w2[e], false); break;
      case 2: repack_operand<T>(p.w1_t[e], w.w1[e], true); break;
      default: repack_operand<T>(p.w2_t[e], w.w2[e], true); break;
    }
  });
  if (!replicated) return;
  repack_operand<float>(p.router, w.router, false);
  if (backward) repack_operand<float>(p.router_t, w.router, true);
  if (c.shared_experts > 0) {
    repack_operand<T>(p.sw1, w.shared_w1, false);
    repack_operand<T>(p.sw2, w.shared_w2, false);
    if (backward) {
      repack_operand<T>(p.sw1_t, w.shared_w1, true);
      repack_operand<T>(p.sw2_t, w.shared_w2, true);
    }
  }
}

}  // namespace hpmoe::detail

namespace hpmoe {
struct PackedWeights {
  const LayerWeights* weights = nullptr;  // what was packed (identity, not ownership)
  DType dtype = DType::fp32;
  bool backward = false;
  // Mutable behind the shared const face: the owner of the weights (a
  // Layer) repacks in place what it changed (repack_weights).
  std::shared_ptr<detail::PackedLayer<float>> fp32;
  std::shared_ptr<detail::PackedLayer<bf16>> bf16_;
};
}  // namespace hpmoe

namespace hpmoe::detail {

// The packing an executor uses: the shared one when given (it must be of
// these weights, this dtype, and have the transposes if backward needs them),
// else its own.
template <class T>
std::shared_ptr<const PackedLayer<T>> resolve_packing(const LayerConfig& c, const LayerWeights& w,
                                                      const std::shared_ptr<const PackedWeights>& shared, bool backward) {
  if (!shared) return pack_layer<T>(c, w, backward);
  if (shared->weights != &w) throw Error("the shared packed weights were packed from other weights");
  if (shared->dtype != c.dtype) throw Error("the shared packed weights are " + to_string(shared->dtype) + ", the layer is " + to_string(c.dtype));
  if (backward && !shared->backward) throw Error("the shared packed weights lack the transposes backward needs");
  if constexpr (std::is_same_v<T, float>) return shared->fp32;
  else return shared->bf16_;
}

// One output tile of one GEMM. The result goes to `c` (fp32) or, when `out`
// is set, is rounded to T into `out`.
template <class T>
struct GemmTile {
  const T* a;
  std::int64_t lda;
  RhsView<T> b;
  std::int64_t col0;
  float* c;
  T* out;
  std::int64_t ldc;
  std::int64_t m, n, k;
  bool accumulate;
};

// Column panels of an operand n wide, and n rounded up to whole panels.
inline std::int64_t panels(std::int64_t n) { return (n + kTileCols - 1) / kTileCols; }
inline std::int64_t round_up(std::int64_t n) { return panels(n) * kTileCols; }

// Rows [begin, end) of n split evenly over W workers.
inline std::pair<std::int64_t, std::int64_t> share(std::int64_t n, int worker, int workers) {
  return {n * worker / workers, n * (worker + 1) / workers};
}

// Runs a rank's tile list on worker w of W (tile i goes to worker i mod W).
template <class U>
void run_tiles(const std::vector<GemmTile<U>>& list, int w, int W) {
  float scratch[kTileRows * kTileCols];
  for (std::size_t i = static_cast<std::size_t>(w); i < list.size(); i += static_cast<std::size_t>(W)) {
    const auto& t = list[i];
    if (t.out == nullptr) {
      kernels::gemm_tile<U>(t.a, t.lda, t.b, t.col0, t.c, t.ldc, t.m, t.n, t.k, t.accumulate);
    } else {
      kernels::gemm_tile<U>(t.a, t.lda, t.b, t.col0, scratch, kTileCols, t.m, t.n, t.k, false);
      for (std::int64_t row = 0; row < t.m; ++row) kernels::store<U>(scratch + row * kTileCols, t.out + row * t.ldc, t.n);
    }
  }
}

// The router before dispatch: fp32 logits by tile GEMM on the pool's workers
// (rank r's tokens on rank r's workers), then top-k for all tokens.
inline RouterOutput<float> run_router(WorkerPool& pool, const LayerConfig& c, RhsView<float> router,
                                      MatrixView x, std::span<const float> bias,
                                      std::span<const std::int32_t> forced, std::vector<float>& logits) {
  const std::int64_t E = c.routed_experts, H = c.hidden, T = c.tokens_per_rank;
  logits.assign(static_cast<std::size_t>(c.total_tokens() * E), 0.0f);
  std::vector<std::vector<GemmTile<float>>> tiles(static_cast<std::size_t>(c.ranks));
  for (std::int64_t r = 0; r < c.ranks; ++r)
    for (std::int64_t i = 0; i < T; i += kTileRows)
      for (std::int64_t j = 0; j < E; j += kTileCols)
        tiles[r].push_back({x.row(r * T + i), x.ld, router, j, logits.data() + (r * T + i) * E + j, nullptr, E,
                            std::min(kTileRows, T - i), std::min(kTileCols, E - j), H, false});
  // A pool that runs fewer ranks than the layer has (one MPI process per
  // rank) routes every rank's tokens with what it has: every process needs
  // the whole routing to lay out the exchange.
  pool.run([&](int pr, int w) {
    for (std::int64_t r = pr; r < c.ranks; r += pool.ranks()) run_tiles<float>(tiles[r], w, pool.workers_per_rank());
  });
  return route<float>(c, logits, bias, forced);
}

}  // namespace hpmoe::detail
