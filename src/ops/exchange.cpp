// The exchange: one-sided puts of rows between ranks, each signalling an
// event on the peer. Dispatch gathers a row tile of x by the send order into
// the expert owner's receive rows; combine returns expert outputs into the
// source's combine rows; the backward does the same with gate-weighted
// output gradients and the experts' data gradients. A dispatch narrower than
// the layer's dtype encodes on the source (fp8 codes and scales, or bf16)
// into the owner's staged rows, and a decode per row tile fills the GEMM's.
#include "ops/dispatch_codec.hpp"
#include "ops/op.hpp"

#include <vector>

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

// x rows, gathered by token and encoded, into the owner's staged rows.
template <class T>
bool dispatch_encoded(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, B = tile.dims().dispatch_row_bytes, rows = tile.rows();
  const Rect& dst = tile.write(0);
  tile.need(dst, rows, B);
  auto* to = reinterpret_cast<std::uint8_t*>(tile.host.put_target(dst));
  const T* x = tile.template base<T>(BufferId::x);
  const std::int32_t* tokens = tile.template at<std::int32_t>(tile.in(BufferId::send_token));
  const std::int64_t ldx = tile.ld(BufferId::x);
  thread_local std::vector<float> row;  // one row in fp32, kept per worker
  row.resize(static_cast<std::size_t>(H));
  for (std::int64_t j = 0; j < rows; ++j) {
    kernels::load<T>(x + std::int64_t{tokens[j]} * ldx, row.data(), H);
    encode_row(tile.dims(), row.data(), to + j * B);
  }
  return tile.host.send_put(dst);
}

// Staged rows decoded into the GEMM's operand rows.
template <class T>
bool decode(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, B = tile.dims().dispatch_row_bytes, rows = tile.rows();
  const Rect& src = tile.read(0);
  const Rect& dst = tile.write(0);
  tile.need(src, rows, B);
  tile.need(dst, rows, H);
  const auto* from = tile.template at<std::uint8_t>(src);
  T* to = tile.template at<T>(dst);
  const std::int64_t ld = tile.ld(BufferId::recv);
  thread_local std::vector<float> row;
  row.resize(static_cast<std::size_t>(H));
  for (std::int64_t j = 0; j < rows; ++j) {
    decode_row(tile.dims(), from + j * B, row.data());
    kernels::store<T>(row.data(), to + j * ld, H);
  }
  return false;
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

// The same in bf16 bytes, into the owner's staged rows (an fp32 layer whose
// backward dispatch is encoded).
template <class T>
bool grad_dispatch_encoded(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, K = tile.dims().top_k, rows = tile.rows();
  const Rect& dst = tile.write(0);
  tile.need(dst, rows, 2 * H);
  auto* to = reinterpret_cast<bf16*>(tile.host.put_target(dst));
  const std::int64_t* assign = tile.template at<std::int64_t>(tile.in(BufferId::send_assign));
  const float* gates = tile.template base<float>(BufferId::gate);
  const float* dout = tile.template base<float>(BufferId::dout);
  const std::int64_t ld_dout = tile.ld(BufferId::dout);
  for (std::int64_t j = 0; j < rows; ++j)
    kernels::scale_store<bf16>(gates[assign[j]], dout + (assign[j] / K) * ld_dout, to + j * H, H);
  return tile.host.send_put(dst);
}

template <class T>
bool grad_decode(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, rows = tile.rows();
  const Rect& src = tile.read(0);
  const Rect& dst = tile.write(0);
  tile.need(src, rows, 2 * H);
  tile.need(dst, rows, H);
  const auto* from = tile.template at<bf16>(src);
  T* to = tile.template at<T>(dst);
  const std::int64_t ld = tile.ld(BufferId::dy);
  thread_local std::vector<float> row;
  row.resize(static_cast<std::size_t>(H));
  for (std::int64_t j = 0; j < rows; ++j) {
    kernels::load<bf16>(from + j * H, row.data(), H);
    kernels::store<T>(row.data(), to + j * ld, H);
  }
  return false;
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
     dispatch<float>, dispatch<bf16>,
     KindRole{.scheme = Scheme::assignment_direct, .place = Place::expert_put, .consumer = K::gemm_gate_up,
              .level = 0, .collective = Collective::dispatch, .permute_first = true}},
    {TaskKind::dispatch_cast_put, "dispatch_cast_put", Pass::forward, 1,
     [] {
       KindAccess a = vector_kind({op(B::send_token, R, Span::source_rows, X::none, Span::whole, X::one),
                                   op(B::x, R, Span::whole, X::tokens, Span::whole, X::hidden),
                                   tile(B::recv_staged, Side::peer)},
                                  {ByteTerm{X::dispatch_row_bytes, 1, 1, X::none}}, kPeer);
       a.put = true;
       return a;
     }(),
     dispatch_encoded<float>, dispatch_encoded<bf16>,
     KindRole{.scheme = Scheme::assignment_staged, .place = Place::expert_put, .consumer = K::dispatch_decode,
              .level = 0, .collective = Collective::dispatch, .permute_first = true}},
    {TaskKind::dispatch_decode, "dispatch_decode", Pass::forward, 2,
     vector_kind({op(B::recv_staged, R, Span::task_rows, X::none, Span::whole, X::dispatch_row_bytes), tile(B::recv)},
                 {ByteTerm{X::dispatch_row_bytes, 1, 1, X::none}, ByteTerm{X::hidden, 1, kElem, X::none}}, kOwn),
     decode<float>, decode<bf16>,
     KindRole{.scheme = Scheme::assignment_staged}},
    {TaskKind::combine_put, "combine_put", Pass::forward, 70,
     put_kind({op(B::y, R, Span::source_rows, X::none, Span::whole, X::hidden), tile(B::comb, Side::peer)}, kOwn),
     give_back<float>, give_back<bf16>,
     KindRole{.scheme = Scheme::assignment, .place = Place::expert_return, .consumer = K::combine_reduce,
              .feeds_split = K::part_reduce, .collective = Collective::combine}},
    {TaskKind::grad_dispatch_put, "grad_dispatch_put", Pass::backward, 40,
     put_kind({op(B::send_assign, R, Span::source_rows, X::none, Span::whole, X::one),
               op(B::gate, R, Span::whole, X::tokens, Span::whole, X::top_k),
               op(B::dout, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::dy, Side::peer)},
              kPeer),
     grad_dispatch<float>, grad_dispatch<bf16>,
     KindRole{.scheme = Scheme::assignment_direct, .place = Place::expert_put, .consumer = K::gemm_down_dgrad,
              .level = 0, .collective = Collective::grad_dispatch, .permute_first = true}},
    {TaskKind::grad_dispatch_cast_put, "grad_dispatch_cast_put", Pass::backward, 41,
     [] {
       KindAccess a = vector_kind({op(B::send_assign, R, Span::source_rows, X::none, Span::whole, X::one),
                                   op(B::gate, R, Span::whole, X::tokens, Span::whole, X::top_k),
                                   op(B::dout, R, Span::whole, X::tokens, Span::whole, X::hidden),
                                   tile(B::dy_staged, Side::peer)},
                                  {ByteTerm{X::grad_dispatch_row_bytes, 1, 1, X::none}}, kPeer);
       a.put = true;
       return a;
     }(),
     grad_dispatch_encoded<float>, grad_dispatch_encoded<bf16>,
     KindRole{.scheme = Scheme::assignment_staged, .place = Place::expert_put, .consumer = K::grad_dispatch_decode,
              .level = 0, .collective = Collective::grad_dispatch, .permute_first = true}},
    {TaskKind::grad_dispatch_decode, "grad_dispatch_decode", Pass::backward, 42,
     vector_kind({op(B::dy_staged, R, Span::task_rows, X::none, Span::whole, X::grad_dispatch_row_bytes), tile(B::dy)},
                 {ByteTerm{X::grad_dispatch_row_bytes, 1, 1, X::none}, ByteTerm{X::hidden, 1, kElem, X::none}}, kOwn),
     grad_decode<float>, grad_decode<bf16>,
     KindRole{.scheme = Scheme::assignment_staged}},
    {TaskKind::grad_combine_put, "grad_combine_put", Pass::backward, 190,
     put_kind({op(B::dxe, R, Span::source_rows, X::none, Span::whole, X::hidden), tile(B::dcomb, Side::peer)}, kOwn),
     give_back<float>, give_back<bf16>,
     KindRole{.scheme = Scheme::assignment, .place = Place::expert_return, .consumer = K::grad_reduce,
              .feeds_split = K::grad_part_reduce, .collective = Collective::grad_combine}},
};
}  // namespace

Family exchange_family() { return {"exchange", kKinds}; }

}  // namespace hpmoe::ops
