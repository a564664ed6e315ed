// The buffers a rank's program declares for a pass (compiler/layout.hpp's
// declare_buffers): each sized for this rank's own rows, put targets in the
// symmetric region at offsets every rank derives from the exchange.
#include <algorithm>

#include "compiler/generate_step.hpp"
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

void BufferDecl::add(BufferId id, std::int64_t rows, std::int64_t cols, std::int64_t elem_bytes, Region region,
                     Layout layout) const {
  add_buffer(p, id, rows, cols, elem_bytes, region, layout);
}

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
  const SchemeSteps& scheme = scheme_steps(c);
  const BufferDecl decl{p, c, ex, pass, rank, H, K, T, elem, comb_elem, recv, send};
  scheme.forward_return_buffers(decl);
  add_buffer(p, BufferId::out, T, H, 4, bound);
  scheme.forward_exchange_buffers(decl);
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
  scheme.backward_buffers(decl);
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
