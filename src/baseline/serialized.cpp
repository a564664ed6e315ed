#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <type_traits>

#include "hpmoe/baseline.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/kernels.hpp"
#include "hpmoe/worker_pool.hpp"
#include "common/executor_parts.hpp"
#include "taskflow/layout.hpp"

namespace hpmoe {

struct SerializedExecutor::Impl {
  virtual ~Impl() = default;
  virtual void step(const LayerInputs&, std::span<const std::int32_t> forced, StepResult& result) = 0;
};

namespace {

using namespace detail;
using kernels::kTileCols;
using kernels::kTileRows;
using kernels::padded_k;
using kernels::RhsView;
using Clock = std::chrono::steady_clock;

template <class T>
struct RankBuffers {
  // forward
  std::vector<T> x;                // [T, H] tokens as T (bf16 only; fp32 reads the input)
  std::vector<T> send, comb;       // [send_rows, H]
  std::vector<T> recv, y;          // [recv_rows, H]
  std::vector<float> h;            // [recv_rows, 2I]
  std::vector<T> a;                // [recv_rows, I]
  std::vector<float> shared_h;     // [T, 2Is]
  std::vector<T> shared_a;         // [T, Is]
  std::vector<float> shared_y;     // [T, H]
  // backward
  std::vector<T> gsend, grecv, dx_expert, dcomb;
  std::vector<float> da;           // [recv_rows, I]
  std::vector<T> dh;               // [recv_rows, 2I]
  std::vector<T> a_t, x_t;         // per expert [I | H, padded rows]
  std::vector<T> dy_packed, dh_packed;  // dY and dH per expert, panel-blocked (weight-gradient operands)
  std::vector<float> d_weight;     // [T, K]
  std::vector<float> d_logits;     // [T, E]
  std::vector<float> x_t_float;    // [H, T] for the router weight gradient
  std::vector<float> d_router;     // [H, E] this rank's share
  std::vector<float> rdx, sdx;     // [T, H] the router's and shared experts' parts of dx
  std::vector<T> shared_dy, shared_dy_packed, shared_dh, shared_dh_packed, shared_a_t, shared_x_t;
  std::vector<float> shared_da;
  std::vector<float> d_shared_w1, d_shared_w2;  // this rank's share
};

template <class T>
void resize(std::vector<T>& v, std::int64_t n) {
  v.resize(static_cast<std::size_t>(n));
}

template <class T>
class Serialized final : public SerializedExecutor::Impl {
 public:
  Serialized(const LayerConfig& c, const LayerWeights& w, ExecutorOptions opt)
      : c_(c),
        w_(w),
        opt_(opt),
        placement_(placement_or_contiguous(opt.placement, c.routed_experts, c.ranks)),
        pool_(static_cast<int>(c.ranks), opt.workers_per_rank, opt.pin),
        packed_((kernels::init(), resolve_packing<T>(c, w, opt.packed, opt.backward))) {
    ranks_.resize(static_cast<std::size_t>(c.ranks));
  }

  void step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& res) override {
    check_shapes(c_, w_, in);
    res.forward_ops.clear();
    res.backward_ops.clear();
    res.trace.clear();
    step_start_ = Clock::now();
    trace_ = &res.trace;
    trace_result_ = &res;
    res.forward_busy_seconds = res.backward_busy_seconds = 0;
    if (res.out.rows != c_.total_tokens() || res.out.cols != c_.hidden) res.out = Matrix(c_.total_tokens(), c_.hidden);
    if (opt_.backward && res.grads.w1.size() != static_cast<std::size_t>(c_.routed_experts))
      res.grads = zero_gradients(c_);
    const auto t0 = Clock::now();
    route_tokens(in, forced, res);
    const auto t1 = Clock::now();
    res.router_seconds = seconds(t0, t1);
    forward(in, res);
    res.dispatch_to_combine_seconds = seconds(t1, Clock::now());
    if (opt_.backward) {
      const auto t2 = Clock::now();
      backward(in, res);
      res.backward_seconds = seconds(t2, Clock::now());
    }
  }

 private:
  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  int W() const { return opt_.workers_per_rank; }
  std::int64_t tokens() const { return c_.tokens_per_rank; }

  template <class Fn>
  void timed(const char* name, std::vector<OperatorTime>& times, Fn&& fn) {
    const auto start = Clock::now();
    // Each worker's own span within the operator: the rest until the
    // barrier is idle time (busy share; in a trace, the gaps).
    spans_.resize(static_cast<std::size_t>(c_.ranks * W()));
    pool_.run([&](int r, int w) {
      const double t0 = seconds(step_start_, Clock::now());
      fn(r, w);
      spans_[static_cast<std::size_t>(r * W() + w)] = {t0, seconds(step_start_, Clock::now())};
    });
    const bool backward = &times == &trace_result_->backward_ops;
    for (const auto& [t0, t1] : spans_) (backward ? trace_result_->backward_busy_seconds : trace_result_->forward_busy_seconds) += t1 - t0;
    if (opt_.trace) {
      const auto& spans = spans_;
      for (std::size_t i = 0; i < spans.size(); ++i)
        trace_->push_back(TraceSlice{static_cast<std::int32_t>(i / static_cast<std::size_t>(W())),
                                     static_cast<std::int32_t>(i % static_cast<std::size_t>(W())), spans[i].first,
                                     spans[i].second, name, backward ? "backward" : "forward"});
    }
    times.push_back({name, seconds(start, Clock::now())});
  }

  // Adds the tiles of C[M, N] = A[M, K] B[K, N] to a rank's list.
  static void add_gemm(std::vector<GemmTile<T>>& tiles, const T* a, std::int64_t lda, RhsView<T> b, float* c,
                       T* out, std::int64_t ldc, std::int64_t M, std::int64_t N, std::int64_t K, bool accumulate) {
    for (std::int64_t i = 0; i < M; i += kTileRows)
      for (std::int64_t j = 0; j < N; j += kTileCols)
        tiles.push_back({a + i * lda, lda, b, j, c ? c + i * ldc + j : nullptr, out ? out + i * ldc + j : nullptr, ldc,
                         std::min(kTileRows, M - i), std::min(kTileCols, N - j), K, accumulate});
  }

  template <class U>
  void gemm_op(const char* name, std::vector<OperatorTime>& times, std::vector<std::vector<GemmTile<U>>>& tiles) {
    timed(name, times, [&](int r, int w) { run_tiles<U>(tiles[r], w, W()); });
  }

  template <class U = T>
  std::vector<std::vector<GemmTile<U>>> tile_lists() const {
    return std::vector<std::vector<GemmTile<U>>>(static_cast<std::size_t>(c_.ranks));
  }

  // The tokens of rank r as the GEMMs read them.
  const T* x_of(const LayerInputs& in, std::int64_t r) const {
    if constexpr (std::is_same_v<T, float>) return in.x.row(r * tokens());
    else return ranks_[r].x.data();
  }

  void route_tokens(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& res) {
    const auto start = Clock::now();
    res.routing = run_router(pool_, c_, packed_->router.view(), in, w_.expert_bias, forced, logits_);
    res.forward_ops.push_back({"router", seconds(start, Clock::now())});
    const auto plan_start = Clock::now();
    ex_.emplace(c_, placement_, taskflow::routing_counts(c_, res.routing), kTileRows);
    slot_ = taskflow::send_slots(c_, *ex_, res.routing);
    res.forward_ops.push_back({"plan", seconds(plan_start, Clock::now())});
  }

  void forward(const LayerInputs& in, StepResult& res) {
    const std::int64_t H = c_.hidden, I = c_.expert_inter, P = c_.ranks, K = c_.top_k,
                       T_ = tokens(), Is = c_.shared_inter_total();
    auto& ops = res.forward_ops;
    for (std::int64_t r = 0; r < P; ++r) {
      auto& b = ranks_[r];
      if constexpr (!std::is_same_v<T, float>) resize(b.x, T_ * H);
      resize(b.send, ex_->send_rows(r) * H);
      resize(b.comb, ex_->send_rows(r) * H);
      resize(b.recv, ex_->recv_rows(r) * H);
      resize(b.y, ex_->recv_rows(r) * H);
      resize(b.h, ex_->recv_rows(r) * 2 * I);
      resize(b.a, ex_->recv_rows(r) * I);
      if (c_.shared_experts > 0) {
        resize(b.shared_h, T_ * 2 * Is);
        resize(b.shared_a, T_ * Is);
        resize(b.shared_y, T_ * H);
      }
    }

    timed("permute", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(T_, w, W());
      for (std::int64_t t = begin; t < end; ++t) {
        const float* x = in.x.row(r * T_ + t);
        const T* xt = x_of(in, r) + t * H;
        if constexpr (!std::is_same_v<T, float>) {
          kernels::store<T>(x, b.x.data() + t * H, H);
        }
        for (std::int64_t k = 0; k < K; ++k) {
          const std::int64_t slot = slot_[(r * T_ + t) * K + k];
          if (slot >= 0) copy_elements(b.send.data() + slot * H, xt, H);
        }
      }
    });

    all_to_all("dispatch_a2a", ops, &RankBuffers<T>::send, &RankBuffers<T>::recv, true);

    auto tiles = tile_lists();
    for (std::int64_t d = 0; d < P; ++d)
      for (const std::int64_t e : ex_->placement().experts_of(d)) {
        const std::int64_t row0 = ex_->expert_start(e), n = ex_->expert_rows(e);
        add_gemm(tiles[d], ranks_[d].recv.data() + row0 * H, H, packed_->w1[e].view(),
                 ranks_[d].h.data() + row0 * 2 * I, nullptr, 2 * I, n, 2 * I, H, false);
      }
    gemm_op<T>("gemm1_gate_up", ops, tiles);

    timed("swiglu", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(ex_->recv_rows(r), w, W());
      for (std::int64_t row = begin; row < end; ++row)
        kernels::swiglu_forward<T>(b.h.data() + row * 2 * I, I, b.a.data() + row * I);
    });

    tiles = tile_lists();
    for (std::int64_t d = 0; d < P; ++d)
      for (const std::int64_t e : ex_->placement().experts_of(d)) {
        const std::int64_t row0 = ex_->expert_start(e), n = ex_->expert_rows(e);
        add_gemm(tiles[d], ranks_[d].a.data() + row0 * I, I, packed_->w2[e].view(), nullptr,
                 ranks_[d].y.data() + row0 * H, H, n, H, I, false);
      }
    gemm_op<T>("gemm2_down", ops, tiles);

    if (c_.shared_experts > 0) {
      tiles = tile_lists();
      for (std::int64_t r = 0; r < P; ++r)
        add_gemm(tiles[r], x_of(in, r), H, packed_->sw1.view(), ranks_[r].shared_h.data(), nullptr, 2 * Is, T_, 2 * Is, H, false);
      gemm_op<T>("shared_gemm1", ops, tiles);
      timed("shared_swiglu", ops, [&](int r, int w) {
        auto& b = ranks_[r];
        auto [begin, end] = share(T_, w, W());
        for (std::int64_t t = begin; t < end; ++t)
          kernels::swiglu_forward<T>(b.shared_h.data() + t * 2 * Is, Is, b.shared_a.data() + t * Is);
      });
      tiles = tile_lists();
      for (std::int64_t r = 0; r < P; ++r)
        add_gemm(tiles[r], ranks_[r].shared_a.data(), Is, packed_->sw2.view(), ranks_[r].shared_y.data(), nullptr, H, T_, H, Is,
                 false);
      gemm_op<T>("shared_gemm2", ops, tiles);
    }

    all_to_all("combine_a2a", ops, &RankBuffers<T>::y, &RankBuffers<T>::comb, false);

    timed("unpermute_combine", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(T_, w, W());
      for (std::int64_t t = begin; t < end; ++t) {
        const std::int64_t a = (r * T_ + t) * K;
        combine_row<T>(res.out.row(r * T_ + t), H, K, slot_.data() + a, res.routing.weight.data() + a, b.comb.data(),
                       c_.shared_experts > 0 ? b.shared_y.data() + t * H : nullptr);
      }
    });
  }

  // dispatch: each destination pulls its rows from every source's `from`
  // (send layout) into its `to` (receive layout); combine: the reverse.
  void all_to_all(const char* name, std::vector<OperatorTime>& ops, std::vector<T> RankBuffers<T>::*send_side,
                  std::vector<T> RankBuffers<T>::*recv_side, bool dispatch) {
    const std::int64_t H = c_.hidden, P = c_.ranks, E = c_.routed_experts;
    const ExpertPlacement& placement = ex_->placement();
    timed(name, ops, [&](int r, int w) {
      // Rank r moves the chunks that land in its own buffer.
      if (dispatch) {  // r is the destination: (its expert, source) pairs
        const auto mine = placement.experts_of(r);
        for (std::int64_t item = w; item < static_cast<std::int64_t>(mine.size()) * P; item += W()) {
          const std::int64_t source = item % P, e = mine[static_cast<std::size_t>(item / P)];
          const T* src = (ranks_[source].*send_side).data() + ex_->send_offset(source, e) * H;
          T* dst = (ranks_[r].*recv_side).data() + ex_->recv_offset(source, e) * H;
          copy_elements(dst, src, ex_->count(source, e) * H);
        }
      } else {  // r is the source that gets its rows back from every expert's owner
        for (std::int64_t e = w; e < E; e += W()) {
          const T* src = (ranks_[placement.owner(e)].*send_side).data() + ex_->recv_offset(r, e) * H;
          T* dst = (ranks_[r].*recv_side).data() + ex_->send_offset(r, e) * H;
          copy_elements(dst, src, ex_->count(r, e) * H);
        }
      }
    });
  }

  void backward(const LayerInputs& in, StepResult& res) {
    const std::int64_t H = c_.hidden, I = c_.expert_inter, P = c_.ranks, K = c_.top_k,
                       T_ = tokens(), Is = c_.shared_inter_total(), E = c_.routed_experts;
    auto& ops = res.backward_ops;
    for (std::int64_t r = 0; r < P; ++r) {
      auto& b = ranks_[r];
      const std::int64_t rows = ex_->recv_rows(r), kpad = ex_->kpad_rows(r);
      resize(b.gsend, ex_->send_rows(r) * H);
      resize(b.dcomb, ex_->send_rows(r) * H);
      resize(b.grecv, rows * H);
      resize(b.dx_expert, rows * H);
      resize(b.da, rows * I);
      resize(b.dh, rows * 2 * I);
      resize(b.a_t, I * kpad);
      resize(b.x_t, H * kpad);
      resize(b.dy_packed, kpad * round_up(H));
      resize(b.dh_packed, kpad * round_up(2 * I));
      resize(b.d_weight, T_ * K);
      resize(b.d_logits, T_ * E);
      resize(b.x_t_float, H * T_);
      resize(b.d_router, H * E);
      resize(b.rdx, T_ * H);
      if (c_.shared_experts > 0) resize(b.sdx, T_ * H);
      if (c_.shared_experts > 0) {
        const std::int64_t tpad = padded_k<T>(T_);
        resize(b.shared_dy, T_ * H);
        resize(b.shared_da, T_ * Is);
        resize(b.shared_dh, T_ * 2 * Is);
        resize(b.shared_a_t, Is * tpad);
        resize(b.shared_x_t, H * tpad);
        resize(b.shared_dy_packed, tpad * round_up(H));
        resize(b.shared_dh_packed, tpad * round_up(2 * Is));
        resize(b.d_shared_w1, H * 2 * Is);
        resize(b.d_shared_w2, Is * H);
      }
    }

    timed("grad_permute", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(T_, w, W());
      for (std::int64_t t = begin; t < end; ++t) {
        const float* dout = in.d_out.row(r * T_ + t);
        for (std::int64_t k = 0; k < K; ++k) {
          const std::int64_t a = (r * T_ + t) * K + k, slot = slot_[a];
          float dw = 0;
          if (slot >= 0) {
            dw = kernels::dot<T>(dout, b.comb.data() + slot * H, H);
            kernels::scale_store<T>(res.routing.weight[a], dout, b.gsend.data() + slot * H, H);
          }
          b.d_weight[t * K + k] = dw;
        }
      }
    });

    all_to_all("grad_dispatch_a2a", ops, &RankBuffers<T>::gsend, &RankBuffers<T>::grecv, true);

    // Operands of the weight-gradient GEMMs: A^T and X^T per expert (and, in
    // bf16, dY in the kernel's pair layout).
    timed("pack_down_grad", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      for (const std::int64_t e : ex_->placement().experts_of(r)) {
        const std::int64_t row0 = ex_->expert_start(e), n = ex_->expert_rows(e);
        const std::int64_t kp0 = ex_->kpad_start(e), ld = padded_k<T>(n);
        auto [c0, c1] = share(I, w, W());
        kernels::transpose<T>(b.a.data() + row0 * I, I, n, b.a_t.data() + kp0 * I, ld, c0, c1);
        auto [x0, x1] = share(H, w, W());
        kernels::transpose<T>(b.recv.data() + row0 * H, H, n, b.x_t.data() + kp0 * H, ld, x0, x1);
        auto [p0, p1] = share(panels(H), w, W());
        kernels::pack_rhs_panels<T, T>(b.grecv.data() + row0 * H, H, n, H, false, b.dy_packed.data() + kp0 * round_up(H),
                                       p0, p1);
      }
    });

    auto dy_view = [&](std::int64_t e) {
      return kernels::panel_view<T>(ranks_[ex_->placement().owner(e)].dy_packed.data() + ex_->kpad_start(e) * round_up(H),
                                    ex_->expert_rows(e));
    };
    auto dh_view = [&](std::int64_t e) {
      return kernels::panel_view<T>(ranks_[ex_->placement().owner(e)].dh_packed.data() + ex_->kpad_start(e) * round_up(2 * I),
                                    ex_->expert_rows(e));
    };

    auto tiles = tile_lists();
    for (std::int64_t d = 0; d < P; ++d)
      for (const std::int64_t e : ex_->placement().experts_of(d)) {
        const std::int64_t row0 = ex_->expert_start(e), n = ex_->expert_rows(e);
        add_gemm(tiles[d], ranks_[d].grecv.data() + row0 * H, H, packed_->w2_t[e].view(), ranks_[d].da.data() + row0 * I,
                 nullptr, I, n, I, H, false);
      }
    gemm_op<T>("gemm2_dgrad", ops, tiles);

    tiles = tile_lists();
    for (std::int64_t d = 0; d < P; ++d)
      for (const std::int64_t e : ex_->placement().experts_of(d)) {
        const std::int64_t kp0 = ex_->kpad_start(e), ld = padded_k<T>(ex_->expert_rows(e));
        add_gemm(tiles[d], ranks_[d].a_t.data() + kp0 * I, ld, dy_view(e), res.grads.w2[e].data.data(),
                 nullptr, H, I, H, ld, false);
      }
    gemm_op<T>("gemm2_wgrad", ops, tiles);

    timed("swiglu_bwd", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(ex_->recv_rows(r), w, W());
      for (std::int64_t row = begin; row < end; ++row)
        kernels::swiglu_backward<T>(b.h.data() + row * 2 * I, b.da.data() + row * I, I, b.dh.data() + row * 2 * I);
    });

    timed("pack_gate_up_grad", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      for (const std::int64_t e : ex_->placement().experts_of(r)) {
        const std::int64_t row0 = ex_->expert_start(e), n = ex_->expert_rows(e);
        const std::int64_t kp0 = ex_->kpad_start(e);
        auto [p0, p1] = share(panels(2 * I), w, W());
        kernels::pack_rhs_panels<T, T>(b.dh.data() + row0 * 2 * I, 2 * I, n, 2 * I, false,
                                       b.dh_packed.data() + kp0 * round_up(2 * I), p0, p1);
      }
    });

    tiles = tile_lists();
    for (std::int64_t d = 0; d < P; ++d)
      for (const std::int64_t e : ex_->placement().experts_of(d)) {
        const std::int64_t row0 = ex_->expert_start(e), n = ex_->expert_rows(e);
        add_gemm(tiles[d], ranks_[d].dh.data() + row0 * 2 * I, 2 * I, packed_->w1_t[e].view(), nullptr,
                 ranks_[d].dx_expert.data() + row0 * H, H, n, H, 2 * I, false);
      }
    gemm_op<T>("gemm1_dgrad", ops, tiles);

    tiles = tile_lists();
    for (std::int64_t d = 0; d < P; ++d)
      for (const std::int64_t e : ex_->placement().experts_of(d)) {
        const std::int64_t kp0 = ex_->kpad_start(e), ld = padded_k<T>(ex_->expert_rows(e));
        add_gemm(tiles[d], ranks_[d].x_t.data() + kp0 * H, ld, dh_view(e), res.grads.w1[e].data.data(),
                 nullptr, 2 * I, H, 2 * I, ld, false);
      }
    gemm_op<T>("gemm1_wgrad", ops, tiles);

    all_to_all("grad_combine_a2a", ops, &RankBuffers<T>::dx_expert, &RankBuffers<T>::dcomb, false);

    // Router: d logits per token, then its dx part (RDX = dlogits Wg^T) and dWg = x^T dlogits.
    timed("router_bwd", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(T_, w, W());
      for (std::int64_t t = begin; t < end; ++t) {
        const std::int64_t g = r * T_ + t;
        router_backward_token<float>(c_, res.routing, std::span<const float>(logits_.data() + g * E, E), g,
                                     std::span<const float>(b.d_weight.data() + t * K, K),
                                     std::span<float>(b.d_logits.data() + t * E, E));
      }
      auto [h0, h1] = share(H, w, W());
      kernels::transpose<float>(in.x.row(r * T_), H, T_, b.x_t_float.data(), T_, h0, h1);
    });
    auto ftiles = tile_lists<float>();
    for (std::int64_t r = 0; r < P; ++r) {
      auto& b = ranks_[r];
      for (std::int64_t i = 0; i < T_; i += kTileRows)
        for (std::int64_t j = 0; j < H; j += kTileCols)
          ftiles[r].push_back({b.d_logits.data() + i * E, E, packed_->router_t.view(), j, b.rdx.data() + i * H + j, nullptr, H,
                               std::min(kTileRows, T_ - i), std::min(kTileCols, H - j), E, false});
      for (std::int64_t i = 0; i < H; i += kTileRows)
        for (std::int64_t j = 0; j < E; j += kTileCols)
          ftiles[r].push_back({b.x_t_float.data() + i * T_, T_, RhsView<float>{b.d_logits.data(), E}, j,
                               b.d_router.data() + i * E + j, nullptr, E, std::min(kTileRows, H - i),
                               std::min(kTileCols, E - j), T_, false});
    }
    gemm_op<float>("router_grad_gemm", ops, ftiles);

    if (c_.shared_experts > 0) shared_backward(in, res);

    // dx in a fixed order: routed rows over k, then the router's part, then
    // the shared experts' (the interleaved runtime's grad_reduce does the same).
    timed("grad_reduce", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(T_, w, W());
      for (std::int64_t t = begin; t < end; ++t)
        assemble_dx_row<T>(res.grads.x.row(r * T_ + t), H, K, slot_.data() + (r * T_ + t) * K, b.dcomb.data(),
                           b.rdx.data() + t * H, c_.shared_experts > 0 ? b.sdx.data() + t * H : nullptr);
    });

    // Data-parallel reduction of the replicated weights' gradients, in rank order.
    timed("reduce_replicated_grads", ops, [&](int r, int w) {
      const int workers = static_cast<int>(P) * W(), me = static_cast<int>(r) * W() + w;
      auto reduce = [&](std::vector<float>& dst, std::vector<float> RankBuffers<T>::*part) {
        auto [begin, end] = share(static_cast<std::int64_t>(dst.size()), me, workers);
        for (std::int64_t i = begin; i < end; ++i) {
          float sum = 0;
          for (std::int64_t q = 0; q < P; ++q) sum += (ranks_[q].*part)[i];
          dst[i] = sum;
        }
      };
      reduce(res.grads.router.data, &RankBuffers<T>::d_router);
      if (c_.shared_experts > 0) {
        reduce(res.grads.shared_w1.data, &RankBuffers<T>::d_shared_w1);
        reduce(res.grads.shared_w2.data, &RankBuffers<T>::d_shared_w2);
      }
    });
  }

  void shared_backward(const LayerInputs& in, StepResult& res) {
    const std::int64_t H = c_.hidden, P = c_.ranks, T_ = tokens(), Is = c_.shared_inter_total();
    const std::int64_t tpad = padded_k<T>(T_);
    auto& ops = res.backward_ops;
    timed("shared_grad_prepare", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(T_, w, W());
      for (std::int64_t t = begin; t < end; ++t) kernels::store<T>(in.d_out.row(r * T_ + t), b.shared_dy.data() + t * H, H);
      auto [c0, c1] = share(Is, w, W());
      kernels::transpose<T>(b.shared_a.data(), Is, T_, b.shared_a_t.data(), tpad, c0, c1);
      auto [x0, x1] = share(H, w, W());
      kernels::transpose<T>(x_of(in, r), H, T_, b.shared_x_t.data(), tpad, x0, x1);
    });
    auto shared_dy_view = [&](std::int64_t r) { return kernels::panel_view<T>(ranks_[r].shared_dy_packed.data(), T_); };
    auto shared_dh_view = [&](std::int64_t r) { return kernels::panel_view<T>(ranks_[r].shared_dh_packed.data(), T_); };
    timed("shared_pack_dy", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [p0, p1] = share(panels(H), w, W());
      kernels::pack_rhs_panels<T, T>(b.shared_dy.data(), H, T_, H, false, b.shared_dy_packed.data(), p0, p1);
    });
    auto tiles = tile_lists();
    for (std::int64_t r = 0; r < P; ++r) {
      add_gemm(tiles[r], ranks_[r].shared_dy.data(), H, packed_->sw2_t.view(), ranks_[r].shared_da.data(), nullptr, Is, T_, Is,
               H, false);
      add_gemm(tiles[r], ranks_[r].shared_a_t.data(), tpad, shared_dy_view(r), ranks_[r].d_shared_w2.data(), nullptr, H,
               Is, H, tpad, false);
    }
    gemm_op<T>("shared_gemm2_grads", ops, tiles);
    timed("shared_swiglu_bwd", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [begin, end] = share(T_, w, W());
      for (std::int64_t t = begin; t < end; ++t)
        kernels::swiglu_backward<T>(b.shared_h.data() + t * 2 * Is, b.shared_da.data() + t * Is, Is,
                                    b.shared_dh.data() + t * 2 * Is);
    });
    timed("shared_pack_dh", ops, [&](int r, int w) {
      auto& b = ranks_[r];
      auto [p0, p1] = share(panels(2 * Is), w, W());
      kernels::pack_rhs_panels<T, T>(b.shared_dh.data(), 2 * Is, T_, 2 * Is, false, b.shared_dh_packed.data(), p0, p1);
    });
    tiles = tile_lists();
    for (std::int64_t r = 0; r < P; ++r) {
      add_gemm(tiles[r], ranks_[r].shared_dh.data(), 2 * Is, packed_->sw1_t.view(), ranks_[r].sdx.data(), nullptr, H, T_, H,
               2 * Is, false);
      add_gemm(tiles[r], ranks_[r].shared_x_t.data(), tpad, shared_dh_view(r), ranks_[r].d_shared_w1.data(), nullptr,
               2 * Is, H, 2 * Is, tpad, false);
    }
    gemm_op<T>("shared_gemm1_grads", ops, tiles);
  }

  LayerConfig c_;
  const LayerWeights& w_;
  ExecutorOptions opt_;
  ExpertPlacement placement_;
  WorkerPool pool_;
  std::shared_ptr<const PackedLayer<T>> packed_;
  std::vector<RankBuffers<T>> ranks_;
  std::vector<float> logits_;
  Clock::time_point step_start_;
  std::vector<TraceSlice>* trace_ = nullptr;
  StepResult* trace_result_ = nullptr;
  std::vector<std::pair<double, double>> spans_;  // per worker, the last operator
  std::optional<taskflow::Exchange> ex_;  // this step's exchange layout
  std::vector<std::int64_t> slot_;        // this step's send row of every assignment
};

}  // namespace

std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig& c, const LayerWeights& w, bool backward) {
  c.validate();
  check_shapes(c, w, LayerInputs{Matrix(c.total_tokens(), c.hidden), Matrix(c.total_tokens(), c.hidden)});
  kernels::init();
  auto p = std::make_shared<PackedWeights>();
  p->weights = &w;
  p->dtype = c.dtype;
  p->backward = backward;
  if (c.dtype == DType::fp32) p->fp32 = pack_layer<float>(c, w, backward);
  else p->bf16_ = pack_layer<bf16>(c, w, backward);
  return p;
}

SerializedExecutor::SerializedExecutor(const LayerConfig& c, const LayerWeights& w, ExecutorOptions opt) {
  c.validate();
  if (opt.workers_per_rank < 1 || opt.workers_per_rank > 256)
    throw Error("workers per rank must be between 1 and 256 (got " + std::to_string(opt.workers_per_rank) + ")");
  if (c.dtype == DType::fp32) impl_ = std::make_unique<Serialized<float>>(c, w, opt);
  else impl_ = std::make_unique<Serialized<bf16>>(c, w, opt);
}

SerializedExecutor::~SerializedExecutor() = default;

StepResult SerializedExecutor::step(const LayerInputs& in, std::span<const std::int32_t> forced) {
  StepResult result;
  impl_->step(in, forced, result);
  return result;
}

void SerializedExecutor::step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& result) {
  impl_->step(in, forced, result);
}

}  // namespace hpmoe
