// The router's backward: the gate gradients (each kept (token, k) pair's
// returned row against DOUT), the logits' gradient through the router's
// softmax or sigmoid, top-k, groups and losses (one token at a time, the
// model's own rule), and the two GEMMs that follow: dx's router part
// (DLOGITS Wg^T) and the router weight's gradient (x^T DLOGITS).
#include <span>

#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

template <class T>
bool gate_grad(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, K = tile.dims().top_k;
  const float* dout = tile.template at<float>(tile.in(BufferId::dout));
  const std::int64_t ld_dout = tile.ld(BufferId::dout);
  const std::int64_t* slots = tile.template at<std::int64_t>(tile.in(BufferId::slot));
  const T* comb = tile.template at<T>(tile.in(BufferId::comb));
  float* gw = tile.template at<float>(tile.out(BufferId::gw));
  for (std::int64_t j = 0; j < tile.rows(); ++j)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t row = slots[j * K + k];
      gw[j * K + k] = row >= 0 ? kernels::dot<T>(dout + j * ld_dout, comb + row * H, H) : 0.0f;
    }
  return false;
}

// DLOGITS rows from GW; the same rows of x, transposed, for the weight gradient.
template <class T>
bool router_backward(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, K = tile.dims().top_k, E = tile.dims().experts;
  const float* logits = tile.template at<float>(tile.in(BufferId::logits));
  const float* gw = tile.template at<float>(tile.in(BufferId::gw));
  float* dlogits = tile.template at<float>(tile.out(BufferId::dlogits));
  const std::int64_t first = tile.host.first_token() + tile.task.row_begin;
  for (std::int64_t j = 0; j < tile.rows(); ++j)
    router_backward_token<float>(tile.host.hosted_layer(), tile.host.routing(), std::span<const float>(logits + j * E, E),
                                 first + j, std::span<const float>(gw + j * K, K), std::span<float>(dlogits + j * E, E));
  const Rect& xtf = tile.out(BufferId::xtf);
  kernels::transpose_rows<float>(tile.template at<float>(tile.in(BufferId::xf)), tile.ld(BufferId::xf), tile.rows(), H,
                                 tile.template at<float>(xtf), tile.ld(BufferId::xtf));
  return false;
}

template <class T>
bool router_dgrad(const Tile<T>& tile) {
  tile.gemm(tile.in(BufferId::dlogits), tile.host.router_transposed(), tile.out(BufferId::rdx), false);
  return false;
}

template <class T>
bool router_wgrad(const Tile<T>& tile) {
  const std::int64_t E = tile.dims().experts;
  const Rect& b = tile.in(BufferId::dlogits);
  tile.gemm(tile.in(BufferId::xtf), RhsView<float>{tile.template base<float>(BufferId::dlogits) + b.r0 * E, E},
            tile.out(BufferId::dwg), false);
  return false;
}

constexpr OpKind kKinds[] = {
    {TaskKind::gate_grad, "gate_grad", Pass::backward, 0,
     vector_kind({op(B::comb, R, Span::sent_rows, X::none, Span::whole, X::hidden), band(B::dout, X::hidden),
                  band(B::slot, X::top_k), tile(B::gw)},
                 {{X::hidden, 1, kElem, X::top_k}, {X::hidden, 1, 4, X::top_k}}),
     gate_grad<float>, gate_grad<bf16>,
     KindRole{.scheme = Scheme::assignment, .kernel_scope = KernelScope::outside}},
    {TaskKind::router_bwd, "router_bwd", Pass::backward, 10,
     vector_kind({band(B::gw, X::top_k), band(B::logits, X::experts), band(B::xf, X::hidden), tile(B::dlogits),
                  transposed(B::xtf, X::hidden)},
                 {{X::experts, 1, 8, X::none}, {X::hidden, 1, 8, X::none}}),
     router_backward<float>, router_backward<bf16>,
     KindRole{.kernel_scope = KernelScope::outside}},
    {TaskKind::router_dgrad, "router_dgrad", Pass::backward, 20,
     gemm_kind({band(B::dlogits, X::experts), tile(B::rdx)}, X::experts), router_dgrad<float>, router_dgrad<bf16>,
     KindRole{.place = Place::side_gradient, .kernel_scope = KernelScope::outside}},
    {TaskKind::router_wgrad, "router_wgrad", Pass::backward, 30,
     gemm_kind({band(B::xtf, X::tokens), op(B::dlogits, R, Span::whole, X::tokens, Span::task_cols, X::none), tile(B::dwg)},
               X::tokens),
     router_wgrad<float>, router_wgrad<bf16>,
     KindRole{.step = TileStep::weight_gradient, .kernel_scope = KernelScope::outside}},
};
}  // namespace

Family router_family() { return {"router", kKinds}; }

}  // namespace hpmoe::ops
