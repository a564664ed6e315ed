// The backward task bodies: what each task kind of the backward program
// does on a CPU worker, with its operands from the access table.
#include "runtime/engine.hpp"

namespace hpmoe::detail {

template <class T>
bool Interleaved<T>::execute_backward(int r, std::size_t slot, const Task& t, const taskflow::Program& p, const TaskOperands& o) {
  using taskflow::Rect;
  const std::int64_t H = c_.hidden, Is = c_.shared_inter_total(), K = c_.top_k,
                     E = c_.routed_experts, T_ = c_.tokens_per_rank;
  const std::int64_t rows = t.rows;
  // C = A B for a GEMM tile whose A and output are rectangles and whose B
  // is a packed weight, a row-major buffer or a panel-blocked buffer.
  auto gemm = [&](const Rect& a, auto b, const Rect& out, bool store_as_t) {
    gemm_tile_task(r, p, t, a, b, out, store_as_t);
  };
  // A pack task: rows of `src` into a panel-blocked operand, and rows of
  // `tsrc` transposed into a row-major one, each with its K padding.
  auto pack = [&](BufferId src, BufferId panels, BufferId tsrc, BufferId transposed) {
    const Rect& s = o.in(src);
    const Rect& pr = o.out(panels);
    const Rect& ts = o.in(tsrc);
    const Rect& tr = o.out(transposed);
    need(pr, rows, 0, t);
    need(tr, 0, rows, t);
    const auto& pl = *layout_of(p, panels);
    pack_rows_into_panels<T>(at<T>(r, p, s), ld_of(r, src), rows, s.cols(), base<T>(r, panels), pl.rows, pr.r0,
                             pr.rows() - rows);
    const std::int64_t width = ts.cols(), ld = ld_of(r, transposed);
    T* dst = at<T>(r, p, tr);
    kernels::transpose_rows<T>(at<T>(r, p, ts), ld_of(r, tsrc), rows, width, dst, ld);
    for (std::int64_t c = rows; c < tr.cols(); ++c)  // the K padding column
      for (std::int64_t j = 0; j < width; ++j) dst[j * ld + c] = T{};
  };
  switch (t.kind) {
    case TaskKind::gate_grad: {
      const float* dout = at<float>(r, p, o.in(BufferId::dout));
      const std::int64_t* slots = at<std::int64_t>(r, p, o.in(BufferId::slot));
      const T* comb = at<T>(r, p, o.in(BufferId::comb));
      float* gw = at<float>(r, p, o.out(BufferId::gw));
      for (std::int64_t j = 0; j < rows; ++j)
        for (std::int64_t k = 0; k < K; ++k) {
          const std::int64_t row = slots[j * K + k];
          gw[j * K + k] = row >= 0 ? kernels::dot<T>(dout + j * ld_of(r, BufferId::dout), comb + row * H, H) : 0.0f;
        }
      break;
    }
    case TaskKind::router_bwd: {
      const float* logits = at<float>(r, p, o.in(BufferId::logits));
      const float* gw = at<float>(r, p, o.in(BufferId::gw));
      float* dlogits = at<float>(r, p, o.out(BufferId::dlogits));
      for (std::int64_t j = 0; j < rows; ++j)
        router_backward_token<float>(lc_, res_->routing, std::span<const float>(logits + j * E, E),
                                     index_of_[static_cast<std::size_t>(r)] * T_ + t.row_begin + j, std::span<const float>(gw + j * K, K),
                                     std::span<float>(dlogits + j * E, E));
      const Rect& xtf = o.out(BufferId::xtf);
      kernels::transpose_rows<float>(at<float>(r, p, o.in(BufferId::xf)), ld_of(r, BufferId::xf), rows, H, at<float>(r, p, xtf),
                            ld_of(r, BufferId::xtf));
      break;
    }
    case TaskKind::router_dgrad:
      gemm(o.in(BufferId::dlogits), packed_->router_t.view(), o.out(BufferId::rdx), false);
      break;
    case TaskKind::router_wgrad: {
      const Rect& b = o.in(BufferId::dlogits);
      gemm(o.in(BufferId::xtf), RhsView<float>{base<float>(r, BufferId::dlogits) + b.r0 * E, E}, o.out(BufferId::dwg), false);
      break;
    }
    case TaskKind::grad_dispatch_put: {
      const Rect& dst = o.out(BufferId::dy);
      need(dst, rows, H, t);
      T* to = put_target(t, dst, slot);
      const std::int64_t* assign = at<std::int64_t>(r, p, o.in(BufferId::send_assign));
      const float* gates = base<float>(r, BufferId::gate);
      const float* dout = base<float>(r, BufferId::dout);
      const std::int64_t ld_dout = ld_of(r, BufferId::dout);
      for (std::int64_t j = 0; j < rows; ++j)
        kernels::scale_store<T>(gates[assign[j]], dout + (assign[j] / K) * ld_dout, to + j * H, H);
      return send_put(t, dst, slot);
    }
    case TaskKind::gemm_down_dgrad:
      gemm(o.in(BufferId::dy), w2_t_of(r, t.expert), o.out(BufferId::da), false);
      break;
    case TaskKind::pack_down_grad:
      pack(BufferId::dy, BufferId::dyp, BufferId::a, BufferId::at);
      break;
    case TaskKind::gemm_down_wgrad:
      gemm(o.in(BufferId::at), panels_from<T>(r, p, o.in(BufferId::dyp)), o.out(BufferId::dw2), false);
      break;
    case TaskKind::swiglu_bwd: {
      const float* h = at<float>(r, p, o.in(BufferId::h1));
      const float* da = at<float>(r, p, o.in(BufferId::da));
      T* dh = at<T>(r, p, o.out(BufferId::dh));
      const std::int64_t inter = t.cols / 2;  // a part's width
      const std::int64_t ldh = ld_of(r, BufferId::h1), ldda = ld_of(r, BufferId::da), lddh = ld_of(r, BufferId::dh);
      need(o.in(BufferId::da), rows, inter, t);
      for (std::int64_t row = 0; row < rows; ++row)
        kernels::swiglu_backward<T>(h + row * ldh, da + row * ldda, inter, dh + row * lddh);
      break;
    }
    case TaskKind::gemm_gate_up_dgrad:
      gemm(o.in(BufferId::dh), w1_t_of(r, t.expert), o.out(BufferId::dxe), true);
      break;
    case TaskKind::pack_gate_up_grad:
      pack(BufferId::dh, BufferId::dhp, BufferId::recv, BufferId::xt);
      break;
    case TaskKind::gemm_gate_up_wgrad:
      gemm(o.in(BufferId::xt), panels_from<T>(r, p, o.in(BufferId::dhp)), o.out(BufferId::dw1), false);
      break;
    case TaskKind::shared_down_dgrad:
      gemm(o.in(BufferId::sh_dout), packed_->sw2_t.view(), o.out(BufferId::sh_da), false);
      break;
    case TaskKind::pack_shared_down_grad:
      pack(BufferId::sh_dout, BufferId::sh_doutp, BufferId::sh_a, BufferId::sh_at);
      break;
    case TaskKind::shared_down_wgrad:
      gemm(o.in(BufferId::sh_at), panels_from<T>(r, p, o.in(BufferId::sh_doutp)), o.out(BufferId::dws2), false);
      break;
    case TaskKind::shared_swiglu_bwd: {
      const float* h = at<float>(r, p, o.in(BufferId::sh_h));
      const float* da = at<float>(r, p, o.in(BufferId::sh_da));
      T* dh = at<T>(r, p, o.out(BufferId::sh_dh));
      for (std::int64_t row = 0; row < rows; ++row)
        kernels::swiglu_backward<T>(h + row * 2 * Is, da + row * Is, Is, dh + row * 2 * Is);
      break;
    }
    case TaskKind::shared_gate_up_dgrad:
      gemm(o.in(BufferId::sh_dh), packed_->sw1_t.view(), o.out(BufferId::sdx), false);
      break;
    case TaskKind::pack_shared_gate_up_grad:
      pack(BufferId::sh_dh, BufferId::sh_dhp, BufferId::x, BufferId::sh_xt);
      break;
    case TaskKind::shared_gate_up_wgrad:
      gemm(o.in(BufferId::sh_xt), panels_from<T>(r, p, o.in(BufferId::sh_dhp)), o.out(BufferId::dws1), false);
      break;
    case TaskKind::grad_reduce: {
      const std::int64_t* slots = at<std::int64_t>(r, p, o.in(BufferId::slot));
      const T* dcomb = at<T>(r, p, o.in(BufferId::dcomb));
      const float* rdx = at<float>(r, p, o.in(BufferId::rdx));
      const float* sdx = c_.shared_experts > 0 ? at<float>(r, p, o.in(BufferId::sdx)) : nullptr;
      float* dx = at<float>(r, p, o.out(BufferId::dx));
      for (std::int64_t j = 0; j < rows; ++j)
        assemble_dx_row<T>(dx + j * ld_of(r, BufferId::dx), H, K, slots + j * K, dcomb, rdx + j * H,
                           sdx ? sdx + j * H : nullptr);
      break;
    }
    default:
      throw Error(std::string("the interleaved runtime has no implementation of task kind ") + taskflow::name(t.kind));
  }
  return false;
}

// Instantiations of the members above.
template bool Interleaved<float>::execute_backward(int r, std::size_t slot, const Task& t, const taskflow::Program& p, const TaskOperands& o);
template bool Interleaved<bf16>::execute_backward(int r, std::size_t slot, const Task& t, const taskflow::Program& p, const TaskOperands& o);

}  // namespace hpmoe::detail
