// The weight gradients: dW tiles = (the pass's activations, transposed by a
// pack task) x (the output gradients, packed into panels), reduced over every
// row of the step: over an expert's received rows for a routed expert, over
// the rank's tokens (K-padded) for the shared experts.
#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

template <class T>
bool weight_grad(const Tile<T>& tile) {
  // dW is written once and read after the pass (the optimizer, the
  // framework's gradients): at deepseek-v2-lite's sizes 1.1 GB of fp32 a
  // rank, which cached stores read from memory before writing. Streamed,
  // bench/wgrad_layout's strips ran 3-6% faster (AMD Zen 4, bf16, K 384);
  // the whole layer's weight gradients moved less than the spread.
  tile.gemm(tile.read(0), tile.template panels<T>(tile.read(1)), tile.write(0), false, /*streamed=*/true);
  return false;
}

constexpr OpKind kKinds[] = {
    {TaskKind::gemm_down_wgrad, "gemm_down_wgrad", Pass::backward, 70,
     gemm_kind({op(B::at, R, Span::expert_block, X::inter, Span::expert_kpad, X::none),
                op(B::dyp, R, Span::expert_kpad, X::none, Span::task_cols, X::none), tile(B::dw2)},
               X::expert_kpad, kOwn),
     weight_grad<float>, weight_grad<bf16>,
     KindRole{.step = TileStep::weight_gradient}},
    {TaskKind::gemm_gate_up_wgrad, "gemm_gate_up_wgrad", Pass::backward, 110,
     gemm_kind({op(B::xt, R, Span::expert_block, X::hidden, Span::expert_kpad, X::none),
                op(B::dhp, R, Span::expert_kpad, X::none, Span::task_cols, X::none), tile(B::dw1)},
               X::expert_kpad, kOwn),
     weight_grad<float>, weight_grad<bf16>,
     KindRole{.step = TileStep::weight_gradient}},
    {TaskKind::shared_down_wgrad, "shared_down_wgrad", Pass::backward, 140,
     gemm_kind({op(B::sh_at, R, Span::task_rows, X::none, Span::whole, X::tokens_padded),
                op(B::sh_doutp, R, Span::whole, X::tokens_padded, Span::task_cols, X::none), tile(B::dws2)},
               X::tokens_padded),
     weight_grad<float>, weight_grad<bf16>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::weight_gradient}},
    {TaskKind::shared_gate_up_wgrad, "shared_gate_up_wgrad", Pass::backward, 180,
     gemm_kind({op(B::sh_xt, R, Span::task_rows, X::none, Span::whole, X::tokens_padded),
                op(B::sh_dhp, R, Span::whole, X::tokens_padded, Span::task_cols, X::none), tile(B::dws1)},
               X::tokens_padded),
     weight_grad<float>, weight_grad<bf16>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::weight_gradient}},
};
}  // namespace

Family weight_grad_family() { return {"weight_grad", kKinds}; }

}  // namespace hpmoe::ops
