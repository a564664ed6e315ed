// Declared reductions of tensor-parallel split experts (Program::reductions):
// part 0's rows of COMB (DCOMB) += parts 1, 2, ... in part order, so the
// combine reads one row per (token, k) and the sum has one order.
#include <vector>

#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

template <class T>
bool reduce_parts(const Tile<T>& tile) {
  const Rect& target_rect = tile.write(0);
  const taskflow::Reduction* red = tile.program.reduction_at(tile.task.row_begin);  // the access rule has checked it
  const std::int64_t H = tile.dims().hidden, ld = tile.ld(target_rect.buffer);
  T* rows = tile.template base<T>(target_rect.buffer);
  std::vector<float> acc(static_cast<std::size_t>(H));
  for (std::int64_t j = 0; j < tile.rows(); ++j) {
    T* target = rows + (tile.task.row_begin + j) * ld;
    kernels::load<T>(target, acc.data(), H);
    for (std::int64_t part = 1; part < red->parts; ++part) kernels::axpy<T>(1.0f, target + part * red->rows * ld, acc.data(), H);
    kernels::store<T>(acc.data(), target, H);
  }
  return false;
}

constexpr KindAccess parts_of(B buffer) {
  return vector_kind({op(buffer, R, Span::reduction_parts, X::none, Span::whole, X::hidden),
                      op(buffer, Acc, Span::task_rows, X::none, Span::whole, X::hidden)},
                     {{X::hidden, 3, kElem, X::none}});
}

constexpr OpKind kKinds[] = {
    {TaskKind::part_reduce, "part_reduce", Pass::forward, 80, parts_of(B::comb), reduce_parts<float>, reduce_parts<bf16>,
     KindRole{.scheme = Scheme::assignment_splits, .place = Place::reduction}},
    {TaskKind::grad_part_reduce, "grad_part_reduce", Pass::backward, 200, parts_of(B::dcomb), reduce_parts<float>,
     reduce_parts<bf16>,
     KindRole{.scheme = Scheme::assignment_splits, .place = Place::reduction}},
};
}  // namespace

Family reduction_family() { return {"reduction", kKinds}; }

}  // namespace hpmoe::ops
