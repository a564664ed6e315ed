// The per-rank combine (LayerConfig::exchange rank): one row per (token,
// rank) travels back instead of one per (token, expert). With its tokens
// each source sends a destination the token's combine list: for each of its
// K choices, the row the choice fills on the destination (-1 where the
// choice lives elsewhere or was dropped), then the K gates. Once its
// experts are done, the destination sums, per token of a source's list,
// the gate-weighted expert rows in k order and puts one row into the
// source's COMB_RANK; the source adds its ranks' rows in rank order (and
// the shared experts' row). The backward mirrors it: the destination sums a
// token's dx rows in k order, and computes the gate gradients (the token's
// output gradient, which arrived once, against each expert row), because
// the source no longer holds the expert rows to do it; the source adds both
// over ranks in rank order.
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "ops/combine_list.hpp"
#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

// The source's combine list for one destination, into its RECV_COMB.
template <class T>
bool list_put(const Tile<T>& tile) {
  const Rect& src = tile.read(0);
  const Rect& dst = tile.write(0);
  const std::int64_t words = CombineList::words(tile.dims().top_k);
  tile.need(src, tile.rows(), words);
  tile.need(dst, tile.rows(), words);
  std::memcpy(static_cast<void*>(tile.host.put_target(dst)), tile.template at<std::byte>(src),
              static_cast<std::size_t>(tile.rows() * words) * 4);
  return tile.host.send_put(dst);
}

// Whether a buffer of sums holds bf16 under an fp32 layer
// (LayerConfig::narrow_combine: the sums travel in bf16); U below is the
// type of its rows.
template <class T>
bool narrow_sums(const Tile<T>& tile, BufferId sums) {
  if constexpr (std::is_same_v<T, float>) return tile.host.layout(sums).elem_bytes == 2;
  else return (void)tile, (void)sums, false;
}

// One row per token of a source's block: sum over k of weight_k ROWS[row k]
// (weights: the gates, or 1), in the dtype the sums travel in (U), put into `dst`.
template <class T, class U>
bool sum_put_as(const Tile<T>& tile, BufferId rows_buffer, bool gated) {
  const std::int64_t H = tile.dims().hidden, K = tile.dims().top_k, rows = tile.rows();
  const Rect& list = tile.in(BufferId::recv_comb);
  const Rect& from = tile.in(rows_buffer);
  const Rect& dst = tile.write(0);
  tile.need(list, rows, CombineList::words(K));
  tile.need(dst, rows, H);
  const auto* words = tile.template at<std::int32_t>(list);
  const T* y = tile.template at<T>(from);
  const std::int64_t ld_list = tile.ld(BufferId::recv_comb), ld = tile.ld(rows_buffer);
  U* to = reinterpret_cast<U*>(tile.host.put_target(dst));
  thread_local std::vector<float> acc;
  acc.resize(static_cast<std::size_t>(H));
  for (std::int64_t j = 0; j < rows; ++j) {
    const CombineList::Row entry{words + j * ld_list, K};
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t k = 0; k < K; ++k)
      if (const std::int64_t r = entry.row(taskflow::name(tile.task.kind), k, from.rows()); r >= 0)
        kernels::axpy<T>(gated ? entry.gate(k) : 1.0f, y + r * ld, acc.data(), H);
    kernels::store<U>(acc.data(), to + j * H, H);
  }
  return tile.host.send_put(dst);
}

template <class T>
bool sum_put(const Tile<T>& tile, BufferId rows_buffer, bool gated) {
  return narrow_sums(tile, tile.write(0).buffer) ? sum_put_as<T, bf16>(tile, rows_buffer, gated) : sum_put_as<T, T>(tile, rows_buffer, gated);
}

template <class T>
bool combine_put(const Tile<T>& tile) {
  return sum_put(tile, BufferId::y, true);
}
template <class T>
bool dx_put(const Tile<T>& tile) {
  return sum_put(tile, BufferId::dxe, false);
}

// The gate gradients of a source's tokens on this rank: <dout, Y[row k]>
// for each choice that lives here, 0 for the others.
template <class T>
bool gate_grad_put(const Tile<T>& tile) {
  const std::int64_t H = tile.dims().hidden, K = tile.dims().top_k, rows = tile.rows();
  const Rect& list = tile.in(BufferId::recv_comb);
  const Rect& block = tile.in(BufferId::dy_tok);
  const Rect& from = tile.in(BufferId::y);
  const Rect& dst = tile.write(0);
  tile.need(list, rows, CombineList::words(K));
  tile.need(dst, rows, K);
  const auto* words = tile.template at<std::int32_t>(list);
  const T* y = tile.template at<T>(from);
  const std::int64_t ld_list = tile.ld(BufferId::recv_comb), ld = tile.ld(BufferId::y), ld_block = tile.ld(BufferId::dy_tok);
  const bool encoded = tile.host.layout(BufferId::dy_tok).elem_bytes == 1;  // bf16 bytes under an fp32 layer
  auto* to = reinterpret_cast<float*>(static_cast<void*>(tile.host.put_target(dst)));
  thread_local std::vector<float> dout;
  dout.resize(static_cast<std::size_t>(H));
  for (std::int64_t j = 0; j < rows; ++j) {
    const CombineList::Row entry{words + j * ld_list, K};
    const std::int64_t at = entry.block_row(taskflow::name(tile.task.kind), block.rows());
    if (encoded)
      kernels::load<bf16>(reinterpret_cast<const bf16*>(tile.template at<std::uint8_t>(block) + at * ld_block), dout.data(), H);
    else kernels::load<T>(tile.template at<T>(block) + at * ld_block, dout.data(), H);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t r = entry.row(taskflow::name(tile.task.kind), k, from.rows());
      to[j * K + k] = r >= 0 ? kernels::dot<T>(dout.data(), y + r * ld, H) : 0.0f;
    }
  }
  return tile.host.send_put(dst);
}

// The source's side: each token's rows from its ranks, node by node. Its
// own node's ranks' rows are added one by one, in rank order; another
// node's come as one row, the sum over that node's ranks in rank order,
// rounded to the dtype the sums travel in: its forwarder's (the per-node combine), or
// summed here the same way when the rows came straight. Either way the
// additions are the same, so forwarding the combine changes no bit; with
// one node (or one rank a node) it is the plain rank order.
// `slots`: the token's sum rows, P by rank then B by node (RANK_SLOT's
// columns after the list rows).
template <class T>
void sum_by_node(float* out, std::int64_t H, const Program& p, std::int64_t nodes, const std::int64_t* all_slots, const T* rows,
                 std::initializer_list<const float*> extra) {
  const std::int64_t P = p.ranks, R = P / nodes, own = p.rank / R;
  const std::int64_t* slots = all_slots + P;
  thread_local std::vector<float> partial;
  thread_local std::vector<T> rounded;
  std::fill(out, out + H, 0.0f);
  for (std::int64_t b = 0; b < nodes; ++b) {
    if (b == own) {
      for (std::int64_t d = b * R; d < (b + 1) * R; ++d)
        if (slots[d] >= 0) kernels::axpy<T>(1.0f, rows + slots[d] * H, out, H);
    } else if (slots[P + b] >= 0) {
      kernels::axpy<T>(1.0f, rows + slots[P + b] * H, out, H);
    } else {
      partial.assign(static_cast<std::size_t>(H), 0.0f);
      bool any = false;
      for (std::int64_t d = b * R; d < (b + 1) * R; ++d)
        if (slots[d] >= 0) kernels::axpy<T>(1.0f, rows + slots[d] * H, partial.data(), H), any = true;
      if (!any) continue;
      rounded.resize(static_cast<std::size_t>(H));
      kernels::store<T>(partial.data(), rounded.data(), H);
      kernels::axpy<T>(1.0f, rounded.data(), out, H);
    }
  }
  for (const float* e : extra)
    if (e) kernels::axpy<float>(1.0f, e, out, H);
}

std::int64_t slot_nodes(const Program& p, const Rect& slots) {
  const std::int64_t nodes = slots.cols() - 2 * p.ranks;
  if (nodes < 1 || p.ranks % nodes != 0)
    throw Error("rank_slot has " + std::to_string(slots.cols()) + " columns for " + std::to_string(p.ranks) +
                " ranks: it needs two per rank and one per node, and the nodes must divide the ranks");
  return nodes;
}

// Each token's rows back (COMB_RANK or DCOMB_RANK, rows of U), node by
// node, plus up to two fp32 rows of the task's tokens (`first`, `second`:
// the shared experts', the router's dx; null: none).
template <class T, class U>
void reduce_rows(const Tile<T>& tile, BufferId sums, BufferId out_buffer, const float* first, const float* second) {
  const std::int64_t H = tile.dims().hidden;
  const Rect& slot_rect = tile.in(BufferId::rank_slot);
  const std::int64_t nodes = slot_nodes(tile.program, slot_rect), ld_slot = tile.ld(BufferId::rank_slot);
  const std::int64_t* slots = tile.template at<std::int64_t>(slot_rect);
  const U* rows = tile.template at<U>(tile.in(sums));
  float* out = tile.template at<float>(tile.out(out_buffer));
  const std::int64_t ld = tile.ld(out_buffer);
  for (std::int64_t j = 0; j < tile.rows(); ++j)
    sum_by_node<U>(out + j * ld, H, tile.program, nodes, slots + j * ld_slot, rows,
                   {first ? first + j * H : nullptr, second ? second + j * H : nullptr});
}

template <class T>
bool rank_reduce(const Tile<T>& tile) {
  const float* shared = tile.dims().shared_inter > 0 ? tile.template at<float>(tile.in(BufferId::sh_y)) : nullptr;
  if (narrow_sums(tile, BufferId::comb_rank)) reduce_rows<T, bf16>(tile, BufferId::comb_rank, BufferId::out, shared, nullptr);
  else reduce_rows<T, T>(tile, BufferId::comb_rank, BufferId::out, shared, nullptr);
  return false;
}

template <class T>
bool grad_rank_reduce(const Tile<T>& tile) {
  const float* rdx = tile.template at<float>(tile.in(BufferId::rdx));
  const float* sdx = tile.dims().shared_inter > 0 ? tile.template at<float>(tile.in(BufferId::sdx)) : nullptr;
  if (narrow_sums(tile, BufferId::dcomb_rank)) reduce_rows<T, bf16>(tile, BufferId::dcomb_rank, BufferId::dx, rdx, sdx);
  else reduce_rows<T, T>(tile, BufferId::dcomb_rank, BufferId::dx, rdx, sdx);
  return false;
}

template <class T>
bool gate_grad_gather(const Tile<T>& tile) {
  const std::int64_t K = tile.dims().top_k, P = tile.program.ranks, ld_slot = tile.ld(BufferId::rank_slot);
  const std::int64_t* slots = tile.template at<std::int64_t>(tile.in(BufferId::rank_slot));
  const float* parts = tile.template at<float>(tile.in(BufferId::gw_rank));
  float* gw = tile.template at<float>(tile.out(BufferId::gw));
  const std::int64_t ld = tile.ld(BufferId::gw);
  for (std::int64_t j = 0; j < tile.rows(); ++j) {
    float* g = gw + j * ld;
    std::fill(g, g + K, 0.0f);
    for (std::int64_t d = 0; d < P; ++d)
      if (const std::int64_t at = slots[j * ld_slot + d]; at >= 0)
        for (std::int64_t k = 0; k < K; ++k) g[k] += parts[at * K + k];
  }
  return false;
}

// The per-node combine on a forwarder: one row per token of a piece of
// source s's node sums (rows [src_row, src_row + rows) of them, all of one
// combine slot c), the sum of the rows its node's ranks put for it, in
// rank order, rounded to the layer's dtype and put into the source's rows
// after its lists. NODE_COMB holds s's rows slot-major (Program::
// node_comb_begin: slot, then node rank), the routes' second column naming
// each row's token among the node sums; the task reads slots 0..c of every
// rank (the node_comb_prefix span) and adds rank by rank, so that a token's
// sum is the same additions in the same order as without forwarding.
template <class T, class U>
bool node_sum_put_as(const Tile<T>& tile, BufferId parts_buffer) {
  const std::int64_t H = tile.dims().hidden, first = tile.task.src_row, rows = tile.rows();
  const Rect& routes = tile.in(BufferId::node_route);
  const Rect& parts = tile.in(parts_buffer);
  const Rect& dst = tile.write(0);
  tile.need(dst, rows, H);
  const std::int64_t ld_route = tile.ld(BufferId::node_route), ld = tile.ld(parts_buffer);
  const auto* route = tile.template at<std::int32_t>(routes);
  const U* from = tile.template at<U>(parts);
  const Program& p = tile.program;
  const std::int64_t P = p.ranks, S = static_cast<std::int64_t>(p.node_sum_begin.size() - 1) / P, s = tile.task.peer;
  const std::int64_t R = static_cast<std::int64_t>(p.node_comb_begin.size() - 1) / (P * S);
  const std::int64_t block = p.node_sum_begin[static_cast<std::size_t>((s + 1) * S)] - p.node_sum_begin[static_cast<std::size_t>(s * S)];
  // The slots the span covers: those whose segments end within it.
  std::int64_t slots = 0;
  while (slots < S && p.node_comb_begin[static_cast<std::size_t>((s * S + slots + 1) * R)] <= routes.r1) ++slots;
  thread_local std::vector<float> acc;
  acc.assign(static_cast<std::size_t>(rows * H), 0.0f);
  for (std::int64_t d = 0; d < R; ++d)
    for (std::int64_t j = 0; j < slots; ++j) {
      const auto seg = static_cast<std::size_t>((s * S + j) * R + d);
      for (std::int64_t r = p.node_comb_begin[seg] - routes.r0; r < p.node_comb_begin[seg + 1] - routes.r0; ++r) {
        const std::int64_t at = route[r * ld_route + 1];
        if (at < 0 || at >= block)
          throw Error(std::string(taskflow::name(tile.task.kind)) + ": node row " + std::to_string(routes.r0 + r) + " names row " +
                      std::to_string(at) + " of " + std::to_string(block) +
                      " node sums: the routes do not match the blocks (a corrupt put)");
        if (at >= first && at < first + rows) kernels::axpy<U>(1.0f, from + r * ld, acc.data() + (at - first) * H, H);
      }
    }
  U* to = reinterpret_cast<U*>(tile.host.put_target(dst));
  for (std::int64_t j = 0; j < rows; ++j) kernels::store<U>(acc.data() + j * H, to + j * H, H);
  return tile.host.send_put(dst);
}

template <class T>
bool node_sum_put(const Tile<T>& tile, BufferId parts_buffer) {
  return narrow_sums(tile, parts_buffer) ? node_sum_put_as<T, bf16>(tile, parts_buffer) : node_sum_put_as<T, T>(tile, parts_buffer);
}

template <class T>
bool combine_node_put(const Tile<T>& tile) {
  return node_sum_put(tile, BufferId::node_comb);
}
template <class T>
bool grad_combine_node_put(const Tile<T>& tile) {
  return node_sum_put(tile, BufferId::node_dcomb);
}

// A put's bytes are what it carries (the step's put bytes and the
// simulator's wire count them); the sums' reads of the expert rows, and of
// the list, are the sending unit's vector work (local). A token has 1 to K
// rows on a rank, which the task's fields do not say: one row per token is
// charged, exact where a token has one expert on the rank (the common case
// at EP 16 and beyond for DeepSeek-V3: 1.25 on average), an under-estimate
// where it has more (3 on average at 2 ranks of top-6 of 16).
constexpr ByteTerm kList{X::comb_words, 1, 4, X::none};
// A sum as it travels: the layer's dtype, or bf16 (LayerConfig::narrow_combine).
constexpr ByteTerm kRow{X::comb_row_bytes, 1, 1, X::none};
constexpr ByteTerm kRowsRead{X::hidden, 1, kElem, X::none, true};
constexpr ByteTerm kListRead{X::comb_words, 1, 4, X::none, true};
// The source reads a token's row from each rank it went to: at most K of them.
constexpr ByteTerm kRowsOfRanks{X::comb_row_bytes, 1, 1, X::top_k};
constexpr ByteTerm kSlots{X::slot_cols, 1, 8, X::none};
constexpr auto kListRows = Span::source_rows;

constexpr OpKind kKinds[] = {
    {TaskKind::combine_route_put, "combine_route_put", Pass::forward, 5,
     as_put(vector_kind({op(B::rank_comb, R, Span::source_rows, X::none, Span::whole, X::comb_words), tile(B::recv_comb, Side::peer)},
                        {kList})),
     list_put<float>, list_put<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::token_put, .consumer = K::dispatch_gather, .level = 0,
              .feeds = K::combine_rank_put}},
    {TaskKind::combine_relay, "combine_relay", Pass::forward, 72, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::rank_relay}},
    {TaskKind::combine_rank_put, "combine_rank_put", Pass::forward, 75,
     as_put(vector_kind({op(B::recv_comb, R, kListRows, X::none, Span::whole, X::comb_words),
                         op(B::y, R, Span::expert_prefix, X::none, Span::whole, X::hidden), tile(B::comb_rank, Side::peer)},
                        {kRow, kRowsRead, kListRead}, kOwn)),
     combine_put<float>, combine_put<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::sum_return, .consumer = K::combine_rank_reduce, .level = 2}},
    {TaskKind::combine_rank_reduce, "combine_rank_reduce", Pass::forward, 95,
     vector_kind({op(B::comb_rank, R, Span::whole, X::comb_rows, Span::whole, X::hidden), band(B::rank_slot, X::slot_cols),
                  op(B::sh_y, R, Span::task_rows, X::none, Span::whole, X::hidden, Side::own, true), tile(B::out)},
                 {kRowsOfRanks, kSlots, {X::hidden, 1, 4, X::none}}),
     rank_reduce<float>, rank_reduce<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::reduction}},
    {TaskKind::gate_grad_put, "gate_grad_put", Pass::backward, -3,
     as_put(vector_kind({op(B::recv_comb, R, kListRows, X::none, Span::whole, X::comb_words),
                         op(B::dy_tok, R, Span::peer_block, X::none, Span::whole, X::token_cols),
                         op(B::y, R, Span::whole, X::recv_rows, Span::whole, X::hidden), tile(B::gw_rank, Side::peer)},
                        {{X::top_k, 1, 4, X::none}, kRowsRead, kListRead, {X::token_row_bytes, 1, 1, X::none, true}})),
     gate_grad_put<float>, gate_grad_put<bf16>,
     KindRole{.scheme = Scheme::rank, .consumer = K::gate_grad_gather, .level = 2,
              .kernel_scope = KernelScope::put_only}},
    {TaskKind::gate_grad_gather, "gate_grad_gather", Pass::backward, -2,
     vector_kind({op(B::gw_rank, R, Span::whole, X::token_list, Span::whole, X::top_k), band(B::rank_slot, X::slot_cols),
                  tile(B::gw)},
                 {{X::top_k, 1, 4, X::top_k}, kSlots}),
     gate_grad_gather<float>, gate_grad_gather<bf16>,
     KindRole{.scheme = Scheme::rank}},
    {TaskKind::grad_combine_relay, "grad_combine_relay", Pass::backward, 192, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::rank_relay}},
    {TaskKind::grad_combine_rank_put, "grad_combine_rank_put", Pass::backward, 195,
     as_put(vector_kind({op(B::recv_comb, R, kListRows, X::none, Span::whole, X::comb_words),
                         op(B::dxe, R, Span::expert_prefix, X::none, Span::whole, X::hidden), tile(B::dcomb_rank, Side::peer)},
                        {kRow, kRowsRead, kListRead}, kOwn)),
     dx_put<float>, dx_put<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::sum_return, .consumer = K::grad_rank_reduce, .level = 3}},
    {TaskKind::grad_rank_reduce, "grad_rank_reduce", Pass::backward, 215,
     vector_kind({op(B::dcomb_rank, R, Span::whole, X::comb_rows, Span::whole, X::hidden), band(B::rank_slot, X::slot_cols),
                  band(B::rdx, X::hidden), op(B::sdx, R, Span::task_rows, X::none, Span::whole, X::hidden, Side::own, true),
                  tile(B::dx)},
                 {kRowsOfRanks, kSlots, {X::hidden, 3, 4, X::none}}),
     grad_rank_reduce<float>, grad_rank_reduce<bf16>,
     KindRole{.scheme = Scheme::rank, .place = Place::reduction}},
};
// The per-node combine: a node's ranks put their sums of another node's
// source's tokens on the source's forwarder there (as the per-rank
// combine's, into NODE_COMB), which sums them per token and puts one row
// per (token, node) back. The forwarder reads, per token, the rows of the
// node's ranks that hold it: one row per row charged, as above.
constexpr ByteTerm kNodeRoutesRead{X::route, 1, 4, X::none, true};
constexpr ByteTerm kSumsRead{X::comb_row_bytes, 1, 1, X::none, true};
constexpr OpKind kNodeKinds[] = {
    {TaskKind::combine_node_part_put, "combine_node_part_put", Pass::forward, 76,
     as_put(vector_kind({op(B::recv_comb, R, kListRows, X::none, Span::whole, X::comb_words),
                         op(B::y, R, Span::expert_prefix, X::none, Span::whole, X::hidden), tile(B::node_comb, Side::peer)},
                        {kRow, kRowsRead, kListRead}, kOwn)),
     combine_put<float>, combine_put<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::sum_return, .consumer = K::combine_node_put, .level = 2}},
    {TaskKind::combine_node_put, "combine_node_put", Pass::forward, 78,
     as_put(vector_kind({op(B::node_route, R, Span::node_comb_prefix, X::none, Span::whole, X::route),
                         op(B::node_comb, R, Span::node_comb_prefix, X::none, Span::whole, X::hidden), tile(B::comb_rank, Side::peer)},
                        {kRow, kSumsRead, kNodeRoutesRead})),
     combine_node_put<float>, combine_node_put<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::node_sum, .consumer = K::combine_rank_reduce, .level = 3}},
    {TaskKind::grad_combine_node_part_put, "grad_combine_node_part_put", Pass::backward, 196,
     as_put(vector_kind({op(B::recv_comb, R, kListRows, X::none, Span::whole, X::comb_words),
                         op(B::dxe, R, Span::expert_prefix, X::none, Span::whole, X::hidden), tile(B::node_dcomb, Side::peer)},
                        {kRow, kRowsRead, kListRead}, kOwn)),
     dx_put<float>, dx_put<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::sum_return, .consumer = K::grad_combine_node_put, .level = 3}},
    {TaskKind::grad_combine_node_put, "grad_combine_node_put", Pass::backward, 198,
     as_put(vector_kind({op(B::node_route, R, Span::node_comb_prefix, X::none, Span::whole, X::route),
                         op(B::node_dcomb, R, Span::node_comb_prefix, X::none, Span::whole, X::hidden), tile(B::dcomb_rank, Side::peer)},
                        {kRow, kSumsRead, kNodeRoutesRead})),
     grad_combine_node_put<float>, grad_combine_node_put<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::node_sum, .consumer = K::grad_rank_reduce, .level = 4}},
    {TaskKind::combine_node_relay, "combine_node_relay", Pass::forward, 77, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::node_sum, .relay_of = K::combine_node_put}},
    {TaskKind::grad_combine_node_relay, "grad_combine_node_relay", Pass::backward, 197, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::node, .place = Place::node_sum, .relay_of = K::grad_combine_node_put}},
};
}  // namespace

Family rank_combine_family() { return {"rank_combine", kKinds}; }
Family node_combine_family() { return {"node_combine", kNodeKinds}; }

}  // namespace hpmoe::ops
