// The exchange: one-sided puts of rows between ranks, each signalling an
// event on the peer. Dispatch gathers a row tile of x by the send order into
// the expert owner's receive rows; combine returns expert outputs into the
// source's combine rows; the backward does the same with gate-weighted
// output gradients and the experts' data gradients.
#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

// x rows, gathered by token, into the owner's RECV rows.
template <class T>
bool dispatch(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, rows = tile.rows();
  const Rect& dst = tile.write(0);
  tile.need(dst, rows, H);
  T* to = tile.host.put_target(dst);
  const T* x = tile.template base<T>(BufferId::x);
  const std::int32_t* tokens = tile.template at<std::int32_t>(tile.in(BufferId::send_token));
  const std::int64_t ldx = tile.ld(BufferId::x);
  for (std::int64_t j = 0; j < rows; ++j) copy_elements(to + j * H, x + std::int64_t{tokens[j]} * ldx, H);
  return tile.host.send_put(dst);
}

// Gate-weighted DOUT rows, by assignment t K + k, into the owner's DY rows.
template <class T>
bool grad_dispatch(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, K = tile.dims().top_k, rows = tile.rows();
  const Rect& dst = tile.write(0);
  tile.need(dst, rows, H);
  T* to = tile.host.put_target(dst);
  const std::int64_t* assign = tile.template at<std::int64_t>(tile.in(BufferId::send_assign));
  const float* gates = tile.template base<float>(BufferId::gate);
  const float* dout = tile.template base<float>(BufferId::dout);
  const std::int64_t ld_dout = tile.ld(BufferId::dout);
  for (std::int64_t j = 0; j < rows; ++j)
    kernels::scale_store<T>(gates[assign[j]], dout + (assign[j] / K) * ld_dout, to + j * H, H);
  return tile.host.send_put(dst);
}

// An expert's rows (outputs, or data gradients) back into the source's rows.
template <class T>
bool give_back(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, rows = tile.rows();
  const Rect& src = tile.read(0);
  const Rect& dst = tile.write(0);
  tile.need(src, rows, H);
  tile.need(dst, rows, H);
  copy_elements(tile.host.put_target(dst), tile.template at<T>(src), rows * H);
  return tile.host.send_put(dst);
}

constexpr OpKind kKinds[] = {
    {TaskKind::dispatch_put, "dispatch_put", Pass::forward, 0,
     put_kind({op(B::send_token, R, Span::source_rows, X::none, Span::whole, X::one),
               op(B::x, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::recv, Side::peer)},
              kPeer),
     dispatch<float>, dispatch<bf16>},
    {TaskKind::combine_put, "combine_put", Pass::forward, 70,
     put_kind({op(B::y, R, Span::source_rows, X::none, Span::whole, X::hidden), tile(B::comb, Side::peer)}, kOwn),
     give_back<float>, give_back<bf16>},
    {TaskKind::grad_dispatch_put, "grad_dispatch_put", Pass::backward, 40,
     put_kind({op(B::send_assign, R, Span::source_rows, X::none, Span::whole, X::one),
               op(B::gate, R, Span::whole, X::tokens, Span::whole, X::top_k),
               op(B::dout, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::dy, Side::peer)},
              kPeer),
     grad_dispatch<float>, grad_dispatch<bf16>},
    {TaskKind::grad_combine_put, "grad_combine_put", Pass::backward, 190,
     put_kind({op(B::dxe, R, Span::source_rows, X::none, Span::whole, X::hidden), tile(B::dcomb, Side::peer)}, kOwn),
     give_back<float>, give_back<bf16>},
};
}  // namespace

Family exchange_family() { return {"exchange", kKinds}; }

}  // namespace hpmoe::ops
