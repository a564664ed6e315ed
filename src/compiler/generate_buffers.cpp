// The buffers a rank's program declares for a pass (compiler/layout.hpp's
// declare_buffers): each sized for this rank's own rows, put targets in the
// symmetric region at offsets every rank derives from the exchange.
#include <algorithm>

#include "compiler/generate_parts.hpp"
#include "compiler/layout.hpp"
#include "ops/combine_list.hpp"

namespace hpmoe::taskflow {

namespace {

// Appends a buffer after the last one of its region (cache-line aligned).
void add_buffer(Program& p, BufferId id, std::int64_t rows, std::int64_t cols, std::int64_t elem, Region region,
                Layout layout = Layout::row_major) {
  std::int64_t offset = 0;
  if (region != Region::bound)
    for (const auto& b : p.buffers)
      if (b.region == region) offset = std::max(offset, b.offset_bytes + (b.bytes() + 63) / 64 * 64);
  p.buffers.push_back(BufferLayout{id, rows, cols, elem, offset, region, layout});
}

std::int64_t panel_width(std::int64_t n) { return (n + kPanelCols - 1) / kPanelCols * kPanelCols; }

}  // namespace

void declare_buffers(Program& p, const LayerConfig& c, const Exchange& ex, Pass pass, std::int64_t rank) {
  const std::int64_t H = c.hidden, I = c.expert_inter, Is = c.shared_inter_total(), T = c.tokens_per_rank,
                     E = c.routed_experts, K = c.top_k, L = ex.placement().local_count(rank);
  const std::int64_t elem = c.dtype == DType::bf16 ? 2 : 4;
  const std::int64_t comb_elem = c.narrow_combine() ? 2 : elem;  // the per-rank combine's sums as they travel
  const bool shared = c.shared_experts > 0;
  // Every buffer is sized for this rank's own rows; put targets are in the
  // symmetric region (the segment peers write into), and a put addresses the
  // peer's copy by the peer's layout, which every rank derives from the
  // exchange.
  const std::int64_t recv = ex.recv_rows(rank), send = ex.send_rows(rank);
  const std::int64_t kpad = ex.kpad_rows(rank), tpad = ex.padded(T);
  constexpr Region sym = Region::symmetric, local = Region::local, bound = Region::bound;
  p.buffers.clear();
  // The forward's buffers and the step's routing. The backward program
  // declares them too, at the same offsets, and reads them as saved.
  add_buffer(p, BufferId::xf, T, H, 4, bound);
  add_buffer(p, BufferId::x, T, H, elem, elem == 4 ? bound : local);  // fp32: the caller's tokens themselves
  add_buffer(p, BufferId::slot, T, K, 8, local);
  add_buffer(p, BufferId::gate, T, K, 4, local);
  add_buffer(p, BufferId::send_token, send, 1, 4, local);
  add_buffer(p, BufferId::send_assign, send, 1, 8, local);
  add_buffer(p, BufferId::recv, recv, H, elem, sym);
  // Lent weights: a row per lent slot for each pass (forward rows first), so
  // that neither pass's puts land where the other reads; on every rank
  // once any lends (a put target is declared alike everywhere, rows apart).
  if (ex.placement().has_borrowed())
    add_buffer(p, BufferId::lent_w, 2 * ex.placement().lent_count(rank), lent_block_width(c), 1, sym);
  add_buffer(p, BufferId::h1, recv, 2 * I, 4, local);
  add_buffer(p, BufferId::a, recv, I, elem, local);
  add_buffer(p, BufferId::y, recv, H, elem, local);
  const bool by_rank = c.exchange == ExchangeMode::rank;
  if (!by_rank) add_buffer(p, BufferId::comb, send, H, elem, sym);
  add_buffer(p, BufferId::out, T, H, 4, bound);
  if (staged_in(c, Pass::forward)) add_buffer(p, BufferId::recv_staged, recv, c.dispatch_row_bytes(), 1, sym);
  const std::int64_t list = by_rank && ex.has_rank_tokens() ? ex.token_send_offset(rank, ex.ranks()) : 0;
  // The rows its sums come back to (Exchange::sum_rows).
  const std::int64_t sums = by_rank && ex.has_rank_tokens() ? ex.sum_rows(rank) : 0;
  if (by_rank) {
    if (!ex.has_rank_tokens())
      throw Error("the per-rank exchange needs each source's token count per destination rank (rank_token_counts); "
                  "this exchange was built from expert counts alone");
    const std::int64_t blocks = ex.token_recv_rows(rank);
    add_buffer(p, BufferId::rank_token, list, 1, 4, local);
    add_buffer(p, BufferId::rank_route, send, 2, 4, local);
    if (c.staged_dispatch()) add_buffer(p, BufferId::recv_tok, blocks, c.dispatch_row_bytes(), 1, sym);
    else add_buffer(p, BufferId::recv_tok, blocks, H, elem, sym);
    add_buffer(p, BufferId::recv_route, recv, 2, 4, sym);
    add_buffer(p, BufferId::rank_comb, list, ops::CombineList::words(K), 4, local);
    add_buffer(p, BufferId::recv_comb, blocks, ops::CombineList::words(K), 4, sym);
    add_buffer(p, BufferId::comb_rank, sums, H, comb_elem, sym);
    add_buffer(p, BufferId::rank_slot, T, 2 * c.ranks + ex.nodes(), 8, local);
    if (ex.forwards()) {  // the per-node exchange: lists of the source, blocks, routes and sums of the forwarder
      add_buffer(p, BufferId::node_token, ex.node_send_offset(rank, ex.nodes()), 1, 4, local);
      add_buffer(p, BufferId::node_index, list, 2, 4, local);
      if (c.staged_dispatch()) add_buffer(p, BufferId::node_tok, ex.node_recv_rows(rank), c.dispatch_row_bytes(), 1, sym);
      else add_buffer(p, BufferId::node_tok, ex.node_recv_rows(rank), H, elem, sym);
      add_buffer(p, BufferId::node_route, ex.node_route_recv_rows(rank), 2, 4, sym);
      add_buffer(p, BufferId::node_comb, ex.node_route_recv_rows(rank), H, comb_elem, sym);
    }
  }
  if (shared) {
    add_buffer(p, BufferId::sh_h, T, 2 * Is, 4, local);
    add_buffer(p, BufferId::sh_a, T, Is, elem, local);
    add_buffer(p, BufferId::sh_y, T, H, 4, local);
  }
  if (pass == Pass::forward) return;
  add_buffer(p, BufferId::logits, T, E, 4, bound);
  add_buffer(p, BufferId::dout, T, H, 4, bound);
  add_buffer(p, BufferId::gw, T, K, 4, local);
  add_buffer(p, BufferId::dlogits, T, E, 4, local);
  add_buffer(p, BufferId::xtf, H, T, 4, local);
  add_buffer(p, BufferId::rdx, T, H, 4, local);
  add_buffer(p, BufferId::dwg, H, E, 4, local);
  add_buffer(p, BufferId::dy, recv, H, elem, sym);
  add_buffer(p, BufferId::da, recv, I, 4, local);
  add_buffer(p, BufferId::dyp, kpad, panel_width(H), elem, local, Layout::panels);
  add_buffer(p, BufferId::at, I, kpad, elem, local);
  add_buffer(p, BufferId::dw2, L * I, H, 4, bound);  // per slot: the expert's gradient, in the caller's result
  add_buffer(p, BufferId::dh, recv, 2 * I, elem, local);
  add_buffer(p, BufferId::dxe, recv, H, elem, local);
  add_buffer(p, BufferId::dhp, kpad, panel_width(2 * I), elem, local, Layout::panels);
  add_buffer(p, BufferId::xt, H, kpad, elem, local);
  add_buffer(p, BufferId::dw1, L * H, 2 * I, 4, bound);
  if (by_rank) {
    add_buffer(p, BufferId::gw_rank, list, K, 4, sym);
    add_buffer(p, BufferId::dcomb_rank, sums, H, comb_elem, sym);
  } else {
    add_buffer(p, BufferId::dcomb, send, H, elem, sym);
  }
  if (staged_in(c, Pass::backward)) add_buffer(p, BufferId::dy_staged, recv, 2 * H, 1, sym);
  if (by_rank) {
    if (c.staged_grad_dispatch()) add_buffer(p, BufferId::dy_tok, ex.token_recv_rows(rank), 2 * H, 1, sym);
    else add_buffer(p, BufferId::dy_tok, ex.token_recv_rows(rank), H, elem, sym);
    if (ex.forwards()) {
      if (c.staged_grad_dispatch()) add_buffer(p, BufferId::node_dy, ex.node_recv_rows(rank), 2 * H, 1, sym);
      else add_buffer(p, BufferId::node_dy, ex.node_recv_rows(rank), H, elem, sym);
      add_buffer(p, BufferId::node_dcomb, ex.node_route_recv_rows(rank), H, comb_elem, sym);
    }
  }
  if (shared) {
    add_buffer(p, BufferId::sh_dout, T, H, elem, local);
    add_buffer(p, BufferId::sh_da, T, Is, 4, local);
    add_buffer(p, BufferId::sh_doutp, tpad, panel_width(H), elem, local, Layout::panels);
    add_buffer(p, BufferId::sh_at, Is, tpad, elem, local);
    add_buffer(p, BufferId::sh_xt, H, tpad, elem, local);
    add_buffer(p, BufferId::dws2, Is, H, 4, local);
    add_buffer(p, BufferId::sh_dh, T, 2 * Is, elem, local);
    add_buffer(p, BufferId::sdx, T, H, 4, local);
    add_buffer(p, BufferId::sh_dhp, tpad, panel_width(2 * Is), elem, local, Layout::panels);
    add_buffer(p, BufferId::dws1, H, 2 * Is, 4, local);
  }
  add_buffer(p, BufferId::dx, T, H, 4, bound);
}

}  // namespace hpmoe::taskflow
