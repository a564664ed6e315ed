// The forward task bodies: what each task kind of the forward program does
// on a CPU worker, with its operands from the access table.
#include "runtime/engine.hpp"

namespace hpmoe::detail {

template <class T>
bool Interleaved<T>::execute(int r, std::size_t slot, const Task& t) {
  using taskflow::Rect;
  const taskflow::Program& p = (*current_)[r];
  const TaskOperands o = operands_of(p, t);
  const std::int64_t H = c_.hidden, Is = c_.shared_inter_total(), K = c_.top_k;
  const std::int64_t rows = t.rows;
  // A GEMM tile A[rows, k] B -> out, each from its rectangle.
  auto gemm = [&](const Rect& a, RhsView<T> b, const Rect& out, bool store_as_t) {
    gemm_tile_task(r, p, t, a, b, out, store_as_t);
  };
  switch (t.kind) {
    case TaskKind::dispatch_put: {  // gather rows of x by slot, put them into the owner's receive rows
      const Rect& dst = o.out(BufferId::recv);
      need(dst, rows, H, t);
      T* to = put_target(t, dst, slot);
      const T* x = base<T>(r, BufferId::x);
      const std::int32_t* tokens = at<std::int32_t>(r, p, o.in(BufferId::send_token));
      const std::int64_t ldx = ld_of(r, BufferId::x);
      for (std::int64_t j = 0; j < rows; ++j) copy_elements(to + j * H, x + std::int64_t{tokens[j]} * ldx, H);
      return send_put(t, dst, slot);
    }
    case TaskKind::gemm_gate_up:
      gemm(o.in(BufferId::recv), w1_of(r, t.expert), o.out(BufferId::h1), false);
      break;
    case TaskKind::swiglu: {
      const float* h = at<float>(r, p, o.in(BufferId::h1));
      T* a = at<T>(r, p, o.out(BufferId::a));
      const std::int64_t inter = t.cols, ldh = ld_of(r, BufferId::h1), lda = ld_of(r, BufferId::a);  // a part's width
      need(o.in(BufferId::h1), rows, 2 * inter, t);
      for (std::int64_t row = 0; row < rows; ++row) kernels::swiglu_forward<T>(h + row * ldh, inter, a + row * lda);
      break;
    }
    case TaskKind::gemm_down:
      gemm(o.in(BufferId::a), w2_of(r, t.expert), o.out(BufferId::y), true);
      break;
    case TaskKind::combine_put:
    case TaskKind::grad_combine_put: {
      const bool forward = t.kind == TaskKind::combine_put;
      const Rect& src = o.in(forward ? BufferId::y : BufferId::dxe);
      const Rect& dst = o.out(forward ? BufferId::comb : BufferId::dcomb);
      need(src, rows, H, t);
      need(dst, rows, H, t);
      copy_elements(put_target(t, dst, slot), at<T>(r, p, src), rows * H);
      return send_put(t, dst, slot);
    }
    case TaskKind::combine_reduce: {
      const std::int64_t* slots = at<std::int64_t>(r, p, o.in(BufferId::slot));
      const float* gates = at<float>(r, p, o.in(BufferId::gate));
      const T* comb = at<T>(r, p, o.in(BufferId::comb));
      const float* shared = c_.shared_experts > 0 ? at<float>(r, p, o.in(BufferId::sh_y)) : nullptr;
      float* out = at<float>(r, p, o.out(BufferId::out));
      for (std::int64_t j = 0; j < rows; ++j)
        combine_row<T>(out + j * ld_of(r, BufferId::out), H, K, slots + j * K, gates + j * K, comb,
                       shared ? shared + j * H : nullptr);
      break;
    }
    case TaskKind::part_reduce:
    case TaskKind::grad_part_reduce:
      reduce_parts(r, p, t, t.kind == TaskKind::part_reduce ? BufferId::comb : BufferId::dcomb);
      break;
    case TaskKind::shared_gate_up:
      gemm(o.in(BufferId::x), packed_->sw1.view(), o.out(BufferId::sh_h), false);
      break;
    case TaskKind::shared_swiglu: {
      const float* h = at<float>(r, p, o.in(BufferId::sh_h));
      T* a = at<T>(r, p, o.out(BufferId::sh_a));
      for (std::int64_t row = 0; row < rows; ++row) kernels::swiglu_forward<T>(h + row * 2 * Is, Is, a + row * Is);
      break;
    }
    case TaskKind::shared_down:
      gemm(o.in(BufferId::sh_a), packed_->sw2.view(), o.out(BufferId::sh_y), false);
      break;
    default:
      return execute_backward(r, slot, t, p, o);
  }
  return false;
}

// Instantiations of the members above.
template bool Interleaved<float>::execute(int r, std::size_t slot, const Task& t);
template bool Interleaved<bf16>::execute(int r, std::size_t slot, const Task& t);

}  // namespace hpmoe::detail
