// The per-rank exchange (LayerConfig::exchange rank): a token travels once
// to each rank that holds one of its experts, however many of them it chose
// there. The source puts its token block for each destination (encoded where
// the dispatch is) and the routes of its rows: for each row in the
// destination's receive order, the row of its token in the block and its
// gate weight. On the destination, one gather per source piece of a row
// tile fills the GEMM's rows from the block (decoding), exactly the rows the
// per-assignment exchange would have put there. A block is cut into
// sub-blocks by each token's first instance on the destination, so that the
// rows of slot j read sub-blocks 0..j only: a relay per slot passes on that
// sub-blocks up to it arrived, and an expert's gathers need not wait for the
// whole block. The backward sends each token's output gradient once the
// same way; its gather applies the gate.
// With ranks in nodes (LayerConfig::forwards) a token crosses to another
// node once: the source puts its node block to the rank there with its own
// local index, which forwards each rank's block from it (node_exchange).
#include <cstring>
#include <string>
#include <vector>

#include "ops/dispatch_codec.hpp"
#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

// x rows of the rank's token list (kList: per destination rank, or per
// destination node) (encoded where the dispatch is) into the destination's
// token block (or the forwarder's node block).
template <class T, BufferId kList = BufferId::rank_token>
bool token_put(const Tile<T>& tile) {
  const taskflow::Dims& d = tile.dims();
  const std::int64_t H = d.hidden, rows = tile.rows();
  const Rect& dst = tile.write(0);
  const std::int32_t* tokens = tile.template at<std::int32_t>(tile.in(kList));
  const T* x = tile.template base<T>(BufferId::x);
  const std::int64_t ldx = tile.ld(BufferId::x);
  if (d.dispatch_row_bytes > 0) {
    const std::int64_t B = d.dispatch_row_bytes;
    tile.need(dst, rows, B);
    auto* to = reinterpret_cast<std::uint8_t*>(tile.host.put_target(dst));
    thread_local std::vector<float> row;
    row.resize(static_cast<std::size_t>(H));
    for (std::int64_t j = 0; j < rows; ++j) {
      kernels::load<T>(x + std::int64_t{tokens[j]} * ldx, row.data(), H);
      encode_row(d, row.data(), to + j * B);
    }
  } else {
    tile.need(dst, rows, H);
    T* to = tile.host.put_target(dst);
    for (std::int64_t j = 0; j < rows; ++j) copy_elements(to + j * H, x + std::int64_t{tokens[j]} * ldx, H);
  }
  return tile.host.send_put(dst);
}

// Route words as they are: kWords int32 words a row. The per-rank
// exchange's routes of the rows sent to one instance (row in the token
// block, gate: 2 words), the per-node exchange's node-block rows (2 words:
// of the token list's row, of the combine list's).
template <class T, int kWords = 2>
bool route_put(const Tile<T>& tile) {
  const Rect& src = tile.read(0);
  const Rect& dst = tile.write(0);
  tile.need(src, tile.rows(), kWords);
  tile.need(dst, tile.rows(), kWords);
  std::memcpy(static_cast<void*>(tile.host.put_target(dst)), tile.template at<std::byte>(src),
              static_cast<std::size_t>(tile.rows()) * 4 * kWords);
  return tile.host.send_put(dst);
}

// The token block row of route j, checked against the block's rows.
std::int64_t routed_row(const Task& t, const std::int32_t* route, std::int64_t j, std::int64_t block_rows) {
  const std::int64_t at = route[2 * j];
  if (at < 0 || at >= block_rows)
    throw Error(std::string(taskflow::name(t.kind)) + ": the route of receive row " + std::to_string(t.row_begin + j) +
                " names row " + std::to_string(at) + " of a token block of " + std::to_string(block_rows) +
                " rows: the routes do not match the blocks (a corrupt put)");
  return at;
}

// RECV rows of one source's piece, from its token block.
template <class T>
bool gather(const Tile<T>& tile) {
  const taskflow::Dims& d = tile.dims();
  const std::int64_t H = d.hidden, rows = tile.rows();
  const Rect& route_rect = tile.in(BufferId::recv_route);
  const Rect& block = tile.in(BufferId::recv_tok);
  const Rect& dst = tile.out(BufferId::recv);
  tile.need(route_rect, rows, 2);
  tile.need(dst, rows, H);
  const auto* route = tile.template at<std::int32_t>(route_rect);
  T* to = tile.template at<T>(dst);
  const std::int64_t ld = tile.ld(BufferId::recv), ld_block = tile.ld(BufferId::recv_tok);
  if (d.dispatch_row_bytes > 0) {
    const auto* from = tile.template at<std::uint8_t>(block);
    thread_local std::vector<float> row;
    row.resize(static_cast<std::size_t>(H));
    for (std::int64_t j = 0; j < rows; ++j) {
      decode_row(d, from + routed_row(tile.task, route, j, block.rows()) * ld_block, row.data());
      kernels::store<T>(row.data(), to + j * ld, H);
    }
  } else {
    const T* from = tile.template at<T>(block);
    for (std::int64_t j = 0; j < rows; ++j)
      copy_elements(to + j * ld, from + routed_row(tile.task, route, j, block.rows()) * ld_block, H);
  }
  return false;
}

// Whether the backward's token blocks travel in bf16 bytes (an fp32 layer
// whose dy dispatch is bf16): the buffer says.
template <class T>
bool grad_tokens_encoded(const Tile<T>& tile) {
  return tile.host.layout(BufferId::dy_tok).elem_bytes == 1;
}

// DOUT rows of the rank's token list (the layer's dtype, or bf16) into the
// destination's block (or, kList node_token, the forwarder's node block).
template <class T, BufferId kList = BufferId::rank_token>
bool grad_token_put(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, rows = tile.rows();
  const Rect& dst = tile.write(0);
  const std::int32_t* tokens = tile.template at<std::int32_t>(tile.in(kList));
  const float* dout = tile.template base<float>(BufferId::dout);
  const std::int64_t ld = tile.ld(BufferId::dout);
  if (grad_tokens_encoded(tile)) {
    tile.need(dst, rows, 2 * H);
    auto* to = reinterpret_cast<bf16*>(tile.host.put_target(dst));
    for (std::int64_t j = 0; j < rows; ++j) kernels::store<bf16>(dout + std::int64_t{tokens[j]} * ld, to + j * H, H);
  } else {
    tile.need(dst, rows, H);
    T* to = tile.host.put_target(dst);
    for (std::int64_t j = 0; j < rows; ++j) kernels::store<T>(dout + std::int64_t{tokens[j]} * ld, to + j * H, H);
  }
  return tile.host.send_put(dst);
}

// DY rows of one source's piece: gate times the token's output gradient.
template <class T>
bool grad_gather(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, rows = tile.rows();
  const Rect& route_rect = tile.in(BufferId::recv_route);
  const Rect& block = tile.in(BufferId::dy_tok);
  const Rect& dst = tile.out(BufferId::dy);
  tile.need(route_rect, rows, 2);
  tile.need(dst, rows, H);
  const auto* route = tile.template at<std::int32_t>(route_rect);
  T* to = tile.template at<T>(dst);
  const std::int64_t ld = tile.ld(BufferId::dy), ld_block = tile.ld(BufferId::dy_tok);
  thread_local std::vector<float> row;
  row.resize(static_cast<std::size_t>(H));
  const bool encoded = grad_tokens_encoded(tile);
  for (std::int64_t j = 0; j < rows; ++j) {
    const std::int64_t at = routed_row(tile.task, route, j, block.rows());
    float gate = 0;
    std::memcpy(&gate, route + 2 * j + 1, sizeof gate);
    if (encoded)  // rows of 2 H bytes (ld_block counts bytes)
      kernels::load<bf16>(reinterpret_cast<const bf16*>(tile.template at<std::uint8_t>(block) + at * ld_block), row.data(), H);
    else kernels::load<T>(tile.template at<T>(block) + at * ld_block, row.data(), H);
    kernels::scale_store<T>(gate, row.data(), to + j * ld, H);
  }
  return false;
}

// A forwarder's put of one piece of a source's token block for a rank of
// its node: each row from the source's node block (by its route), bytes as
// they arrived (encoded or not), so the rank receives what the source's
// own put would have sent.
template <class T>
bool forward_rows(const Tile<T>& tile) {
  const Rect& routes = tile.read(0);
  const Rect& block = tile.read(1);
  const Rect& dst = tile.write(0);
  const taskflow::BufferLayout& layout = tile.host.layout(block.buffer);
  const std::int64_t rows = tile.rows(), row_bytes = layout.cols * layout.elem_bytes;
  tile.need(routes, rows, 1);
  tile.need(dst, rows, layout.cols);
  const auto* route = tile.template at<std::int32_t>(routes);
  const std::int64_t ld_route = tile.ld(routes.buffer);
  const auto* from = tile.template at<std::byte>(block);
  auto* to = reinterpret_cast<std::byte*>(tile.host.put_target(dst));
  for (std::int64_t j = 0; j < rows; ++j) {
    const std::int64_t at = route[j * ld_route];
    if (at < 0 || at >= block.rows())
      throw Error(std::string(taskflow::name(tile.task.kind)) + ": the route of node row " + std::to_string(tile.task.src_row + j) +
                  " names row " + std::to_string(at) + " of a node block of " + std::to_string(block.rows()) +
                  " rows: the routes do not match the blocks (a corrupt put)");
    std::memcpy(to + j * row_bytes, from + at * row_bytes, static_cast<std::size_t>(row_bytes));
  }
  return tile.host.send_put(dst);
}

constexpr ByteTerm kTokenRow{X::token_row_bytes, 1, 1, X::none};
constexpr ByteTerm kRoute{X::route, 1, 4, X::none};

constexpr OpKind kKinds[] = {
    {TaskKind::dispatch_token_put, "dispatch_token_put", Pass::forward, 3,
     as_put(vector_kind({op(B::rank_token, R, Span::source_rows, X::none, Span::whole, X::one),
                         op(B::x, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::recv_tok, Side::peer)},
                        {kTokenRow}, kPeer)),
     token_put<float>, token_put<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::token_put, .consumer = K::dispatch_gather, .level = 0,
              .permute_first = true}},
    {TaskKind::dispatch_route_put, "dispatch_route_put", Pass::forward, 4,
     as_put(vector_kind({op(B::rank_route, R, Span::source_rows, X::none, Span::whole, X::route),
                         tile(B::recv_route, Side::peer)},
                        {kRoute}, kPeer)),
     route_put<float>, route_put<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::token_put, .consumer = K::dispatch_gather, .level = 0}},
    {TaskKind::dispatch_relay, "dispatch_relay", Pass::forward, 6, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::token_wait, .relay_of = K::dispatch_gather}},
    {TaskKind::dispatch_gather, "dispatch_gather", Pass::forward, 7,
     vector_kind({op(B::recv_route, R, Span::task_rows, X::none, Span::whole, X::route),
                  op(B::recv_tok, R, Span::token_block, X::none, Span::whole, X::token_cols), tile(B::recv)},
                 {kTokenRow, ByteTerm{X::hidden, 1, kElem, X::none}, kRoute}, kOwn),
     gather<float>, gather<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::token_wait}},
    {TaskKind::grad_dispatch_token_put, "grad_dispatch_token_put", Pass::backward, -6,
     as_put(vector_kind({op(B::rank_token, R, Span::source_rows, X::none, Span::whole, X::one),
                         op(B::dout, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::dy_tok, Side::peer)},
                        {kTokenRow}, kPeer)),
     grad_token_put<float>, grad_token_put<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::token_put, .consumer = K::grad_dispatch_gather, .level = 0,
              .permute_first = true}},
    {TaskKind::grad_dispatch_relay, "grad_dispatch_relay", Pass::backward, -5, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::token_wait, .relay_of = K::grad_dispatch_gather}},
    {TaskKind::grad_dispatch_gather, "grad_dispatch_gather", Pass::backward, -4,
     vector_kind({op(B::recv_route, R, Span::task_rows, X::none, Span::whole, X::route),
                  op(B::dy_tok, R, Span::token_block, X::none, Span::whole, X::token_cols), tile(B::dy)},
                 {kTokenRow, ByteTerm{X::hidden, 1, kElem, X::none}, kRoute}, kOwn),
     grad_gather<float>, grad_gather<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::token_wait}},
};
// The per-node exchange: a source's node blocks and their routes to the
// forwarders, the forwarders' puts on to the ranks of their node.
constexpr OpKind kNodeKinds[] = {
    {TaskKind::dispatch_node_put, "dispatch_node_put", Pass::forward, -4,
     as_put(vector_kind({op(B::node_token, R, Span::source_rows, X::none, Span::whole, X::one),
                         op(B::x, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::node_tok, Side::peer)},
                        {kTokenRow})),
     token_put<float, B::node_token>, token_put<bf16, B::node_token>,
     KindRole{.scheme = Scheme::node, .place = Place::token_put, .consumer = K::dispatch_forward, .level = 0,
              .permute_first = true}},
    {TaskKind::dispatch_node_route_put, "dispatch_node_route_put", Pass::forward, -3,
     as_put(vector_kind({op(B::node_index, R, Span::source_rows, X::none, Span::whole, X::route), tile(B::node_route, Side::peer)},
                        {kRoute})),
     route_put<float>, route_put<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::token_put, .consumer = K::dispatch_forward, .level = 0}},
    {TaskKind::dispatch_forward, "dispatch_forward", Pass::forward, -1,
     as_put(vector_kind({op(B::node_route, R, Span::source_rows, X::none, Span::whole, X::one),
                         op(B::node_tok, R, Span::node_prefix, X::none, Span::whole, X::token_cols), tile(B::recv_tok, Side::peer)},
                        {kTokenRow}, kPeer)),
     forward_rows<float>, forward_rows<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::forward, .consumer = K::dispatch_gather, .level = 1}},
    {TaskKind::dispatch_node_relay, "dispatch_node_relay", Pass::forward, -2, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::forward, .relay_of = K::dispatch_forward}},
    {TaskKind::grad_dispatch_node_put, "grad_dispatch_node_put", Pass::backward, -9,
     as_put(vector_kind({op(B::node_token, R, Span::source_rows, X::none, Span::whole, X::one),
                         op(B::dout, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::node_dy, Side::peer)},
                        {kTokenRow})),
     grad_token_put<float, B::node_token>, grad_token_put<bf16, B::node_token>,
     KindRole{.scheme = Scheme::node, .place = Place::token_put, .consumer = K::grad_dispatch_forward, .level = 0,
              .permute_first = true}},
    {TaskKind::grad_dispatch_node_relay, "grad_dispatch_node_relay", Pass::backward, -8, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::forward, .relay_of = K::grad_dispatch_forward}},
    {TaskKind::grad_dispatch_forward, "grad_dispatch_forward", Pass::backward, -7,
     as_put(vector_kind({op(B::node_route, R, Span::source_rows, X::none, Span::whole, X::one),
                         op(B::node_dy, R, Span::node_prefix, X::none, Span::whole, X::token_cols), tile(B::dy_tok, Side::peer)},
                        {kTokenRow}, kPeer)),
     forward_rows<float>, forward_rows<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::forward, .consumer = K::grad_dispatch_gather, .level = 1}},
};
}  // namespace

Family token_exchange_family() { return {"token_exchange", kKinds}; }
Family node_exchange_family() { return {"node_exchange", kNodeKinds}; }

}  // namespace hpmoe::ops
