// The combine: each token's output is its K returned expert rows weighted by
// their gates in k order, plus the shared experts' row; in the backward, dx
// is its K returned rows in k order, plus the router's and the shared
// experts' parts. A fixed order, so every schedule adds the same way.
#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

template <class T>
bool combine(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, K = tile.dims().top_k;
  const std::int64_t* slots = tile.template at<std::int64_t>(tile.in(BufferId::slot));
  const float* gates = tile.template at<float>(tile.in(BufferId::gate));
  const T* comb = tile.template at<T>(tile.in(BufferId::comb));
  const float* shared = tile.dims().shared_inter > 0 ? tile.template at<float>(tile.in(BufferId::sh_y)) : nullptr;
  float* out = tile.template at<float>(tile.out(BufferId::out));
  const std::int64_t ld = tile.ld(BufferId::out);
  for (std::int64_t j = 0; j < tile.rows(); ++j)
    kernels::combine_row<T>(out + j * ld, H, K, slots + j * K, gates + j * K, comb, {shared ? shared + j * H : nullptr});
  return false;
}

template <class T>
bool assemble_dx(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, K = tile.dims().top_k;
  const std::int64_t* slots = tile.template at<std::int64_t>(tile.in(BufferId::slot));
  const T* dcomb = tile.template at<T>(tile.in(BufferId::dcomb));
  const float* rdx = tile.template at<float>(tile.in(BufferId::rdx));
  const float* sdx = tile.dims().shared_inter > 0 ? tile.template at<float>(tile.in(BufferId::sdx)) : nullptr;
  float* dx = tile.template at<float>(tile.out(BufferId::dx));
  const std::int64_t ld = tile.ld(BufferId::dx);
  for (std::int64_t j = 0; j < tile.rows(); ++j)
    kernels::combine_row<T>(dx + j * ld, H, K, slots + j * K, nullptr, dcomb, {rdx + j * H, sdx ? sdx + j * H : nullptr});
  return false;
}

constexpr OpKind kKinds[] = {
    {TaskKind::combine_reduce, "combine_reduce", Pass::forward, 90,
     vector_kind({op(B::comb, R, Span::sent_rows, X::none, Span::whole, X::hidden), band(B::slot, X::top_k),
                  band(B::gate, X::top_k), op(B::sh_y, R, Span::task_rows, X::none, Span::whole, X::hidden, Side::own, true),
                  tile(B::out)},
                 {{X::hidden, 1, kElem, X::top_k}, {X::hidden, 1, 4, X::none}}),
     combine<float>, combine<bf16>,
     KindRole{.scheme = Scheme::assignment, .place = Place::reduction}},
    {TaskKind::grad_reduce, "grad_reduce", Pass::backward, 210,
     vector_kind({op(B::dcomb, R, Span::sent_rows, X::none, Span::whole, X::hidden), band(B::slot, X::top_k),
                  band(B::rdx, X::hidden), op(B::sdx, R, Span::task_rows, X::none, Span::whole, X::hidden, Side::own, true),
                  tile(B::dx)},
                 {{X::hidden, 1, kElem, X::top_k}, {X::hidden, 3, 4, X::none}}),
     assemble_dx<float>, assemble_dx<bf16>,
     KindRole{.scheme = Scheme::assignment, .place = Place::reduction}},
};
}  // namespace

Family combine_family() { return {"combine", kKinds}; }

}  // namespace hpmoe::ops
