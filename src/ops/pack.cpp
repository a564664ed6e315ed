// Packs for the weight gradients: a row tile of an output gradient into
// column panels (the GEMM's right operand) and the matching rows of the
// pass's activation transposed into columns (its left operand), each with
// the K padding row bf16 needs. Routed experts' rows go to the expert's
// block; the shared experts' token rows to the token-wide operands.
#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

// Rule order: the gradient rows, the activation rows; the panels, the
// transposed activation.
template <class T>
bool pack(const Tile<T>& tile) {
  const std::int64_t rows = tile.rows();
  const Rect& s = tile.read(0);
  const Rect& ts = tile.read(1);
  const Rect& pr = tile.write(0);
  const Rect& tr = tile.write(1);
  tile.need(pr, rows, 0);
  tile.need(tr, 0, rows);
  kernels::pack_rows_into_panels<T>(tile.template at<T>(s), tile.ld(s.buffer), rows, s.cols(), tile.template base<T>(pr.buffer),
                           tile.host.layout(pr.buffer).rows, pr.r0, pr.rows() - rows);
  const std::int64_t width = ts.cols(), ld = tile.ld(tr.buffer);
  T* dst = tile.template at<T>(tr);
  kernels::transpose_rows<T>(tile.template at<T>(ts), tile.ld(ts.buffer), rows, width, dst, ld);
  for (std::int64_t c = rows; c < tr.cols(); ++c)  // the K padding column
    for (std::int64_t j = 0; j < width; ++j) dst[j * ld + c] = T{};
  return false;
}

constexpr OpKind kKinds[] = {
    {TaskKind::pack_down_grad, "pack_down_grad", Pass::backward, 60,
     vector_kind({band(B::dy, X::hidden), band(B::a, X::expert_inter),
                  op(B::dyp, W, Span::kpad_task_rows, X::none, Span::whole, X::hidden_panels),
                  op(B::at, W, Span::whole, X::expert_inter, Span::kpad_task_rows, X::none)},
                 {{X::hidden, 2, kElem, X::none}, {X::expert_inter, 2, kElem, X::none}}, kOwn),
     pack<float>, pack<bf16>,
     KindRole{.step = TileStep::pack, .kernel_scope = KernelScope::outside}},
    {TaskKind::pack_gate_up_grad, "pack_gate_up_grad", Pass::backward, 100,
     vector_kind({band(B::dh, X::expert_inter2), band(B::recv, X::hidden),
                  op(B::dhp, W, Span::kpad_task_rows, X::none, Span::whole, X::expert_inter2_panels),
                  op(B::xt, W, Span::whole, X::hidden, Span::kpad_task_rows, X::none)},
                 {{X::expert_inter2, 2, kElem, X::none}, {X::hidden, 2, kElem, X::none}}, kOwn),
     pack<float>, pack<bf16>,
     KindRole{.step = TileStep::pack, .kernel_scope = KernelScope::outside}},
    {TaskKind::pack_shared_down_grad, "pack_shared_down_grad", Pass::backward, 130,
     vector_kind({band(B::sh_dout, X::hidden), band(B::sh_a, X::shared_inter),
                  op(B::sh_doutp, W, Span::task_rows_padded, X::none, Span::whole, X::hidden_panels),
                  op(B::sh_at, W, Span::whole, X::shared_inter, Span::task_rows_padded, X::none)},
                 {{X::hidden, 4, kElem, X::none}, {X::shared_inter, 2, kElem, X::none}}),
     pack<float>, pack<bf16>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::pack, .kernel_scope = KernelScope::outside}},
    {TaskKind::pack_shared_gate_up_grad, "pack_shared_gate_up_grad", Pass::backward, 170,
     vector_kind({band(B::sh_dh, X::shared_inter2), band(B::x, X::hidden),
                  op(B::sh_dhp, W, Span::task_rows_padded, X::none, Span::whole, X::shared_inter2_panels),
                  op(B::sh_xt, W, Span::whole, X::hidden, Span::task_rows_padded, X::none)},
                 {{X::shared_inter2, 2, kElem, X::none}}),
     pack<float>, pack<bf16>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::pack, .kernel_scope = KernelScope::outside}},
};
}  // namespace

Family pack_family() { return {"pack", kKinds}; }

}  // namespace hpmoe::ops
