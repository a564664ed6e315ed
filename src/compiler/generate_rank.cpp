// The generator's per-rank and per-node exchanges (generate_parts.hpp): a
// token once per destination rank, once per destination node through a
// forwarder there, and the per-rank combine's return puts.
#include <algorithm>
#include <utility>
#include <vector>

#include "ops/access.hpp"
#include "compiler/taskflow.hpp"
#include "compiler/generate_step.hpp"

namespace hpmoe::taskflow {

namespace {

// Columns of a token row as it travels in a pass (RECV_TOK / DY_TOK, and
// the node blocks, alike).
std::int64_t token_cols(const LayerConfig& c, Pass pass) {
  return pass == Pass::forward ? (c.staged_dispatch() ? c.dispatch_row_bytes() : c.hidden)
                               : (c.staged_grad_dispatch() ? 2 * c.hidden : c.hidden);
}

}  // namespace

void rank_puts_to_experts(const LayerConfig& c, const Exchange& ex, std::int64_t TR, Pass pass, std::int64_t rank,
                          std::int64_t only_peer, const Emit& emit) {
  // Each token once per destination rank: its block's pieces (through the
  // destination node's forwarder when it is another node's, but for the
  // tokens only that rank of the node takes: Exchange::direct_first), then
  // (forward) the routes of the rows for each instance; both complete the
  // source's `tok` event of the instance's slot on the destination.
  const bool forward = pass == Pass::forward;
  const std::int64_t cols = token_cols(c, pass);
  for (std::int64_t d = 0; d < ex.ranks(); ++d) {
    if (ex.rank_tokens(rank, d) == 0 || (only_peer >= 0 && d != only_peer)) continue;
    const std::int64_t L = ex.placement().local_count(d), tok = event_bases(c, ex, pass, d).tok + rank * L;
    // The combine list of the block first (it is small, and counted with
    // the first sub-block: sent after the block, it would hold slot 0's
    // gathers back until the whole block had arrived).
    if (forward)
      emit(TaskSpec{.kind = TaskKind::combine_route_put, .src = BufferId::rank_comb, .dst = BufferId::recv_comb, .peer = d,
                    .row_begin = ex.token_start(rank, d), .rows = ex.rank_tokens(rank, d), .col_begin = 0,
                    .cols = ops::CombineList::words(c.top_k), .src_row = ex.token_send_offset(rank, d), .trigger_event = tok});
    for (const std::int64_t i : ex.placement().instances_of(d)) {
      // Through a forwarder, only the sub-block's direct tokens (its last rows).
      const std::int64_t n = ex.first_tokens(rank, i), within = ex.sub_block_offset(rank, i);
      const std::int64_t slot_event = tok + ex.instance_slot(i);
      for (std::int64_t r = ex.forwarded(rank, d) ? ex.relayed_first(rank, i) : 0; r < n; r += TR)
        emit(TaskSpec{.kind = forward ? TaskKind::dispatch_token_put : TaskKind::grad_dispatch_token_put,
                      .src = forward ? BufferId::x : BufferId::dout, .dst = forward ? BufferId::recv_tok : BufferId::dy_tok,
                      .expert = ex.placement().instance_expert(i), .peer = d, .row_begin = ex.token_start(rank, d) + within + r,
                      .rows = std::min(TR, n - r), .col_begin = 0, .cols = cols,
                      .src_row = ex.token_send_offset(rank, d) + within + r, .trigger_event = slot_event});
      if (forward && ex.count(rank, i) > 0)  // the backward reads the forward's routes
        emit(TaskSpec{.kind = TaskKind::dispatch_route_put, .src = BufferId::rank_route, .dst = BufferId::recv_route,
                      .expert = ex.placement().instance_expert(i), .peer = d,
                      .row_begin = ex.expert_start(i) + ex.source_offset(rank, i), .rows = ex.count(rank, i),
                      .col_begin = 0, .cols = 2, .src_row = ex.send_offset(rank, i), .trigger_event = slot_event});
    }
  }
  if (!ex.forwards()) return;
  // Each other node's block once, to its forwarder, sub-block by sub-block
  // in pieces of a tile's rows (each counting towards the forwarder's
  // `node` event of this source and sub-block); forward also its routes,
  // counted with sub-block 0.
  const std::int64_t S = ex.node_slots();
  for (std::int64_t b = 0; b < ex.nodes(); ++b) {
    const std::int64_t f = ex.forwarder(rank, b);
    if (ex.node_tokens(rank, b) == 0 || (only_peer >= 0 && f != only_peer)) continue;
    const std::int64_t node_event = event_bases(c, ex, pass, f).node + rank * S;
    if (forward)
      emit(TaskSpec{.kind = TaskKind::dispatch_node_route_put, .src = BufferId::node_index, .dst = BufferId::node_route,
                    .peer = f, .row_begin = ex.node_route_start(rank, b), .rows = ex.node_route_rows(rank, b), .col_begin = 0,
                    .cols = 2, .src_row = ex.token_send_offset(rank, b * (ex.ranks() / ex.nodes())),
                    .trigger_event = node_event});
    for (std::int64_t j = 0; j < S; ++j) {
      const std::int64_t n = ex.node_first(rank, b, j), within = ex.node_sub_offset(rank, b, j);
      for (std::int64_t r = 0; r < n; r += TR)
        emit(TaskSpec{.kind = forward ? TaskKind::dispatch_node_put : TaskKind::grad_dispatch_node_put,
                      .src = forward ? BufferId::x : BufferId::dout, .dst = forward ? BufferId::node_tok : BufferId::node_dy,
                      .peer = f, .row_begin = ex.node_start(rank, b) + within + r, .rows = std::min(TR, n - r), .col_begin = 0,
                      .cols = cols, .src_row = ex.node_send_offset(rank, b) + within + r, .trigger_event = node_event + j});
    }
  }
}

void node_events(const LayerConfig& c, const Exchange& ex, std::int64_t TR, Pass pass, std::int64_t rank,
                 const std::function<void(std::int64_t, std::int64_t)>& event) {
  // Source s's sub-block j, (forward) with sub-block 0 its routes, and
  // from j > 0 the relay from j - 1: complete once sub-blocks 0..j are in.
  const EventBases ev = event_bases(c, ex, pass, rank);
  const std::int64_t b = ex.node_of(rank), S = ex.node_slots();
  for (std::int64_t s = 0; s < ex.ranks(); ++s)
    if (ex.forwards_through(s, rank) && ex.node_tokens(s, b) > 0)
      for (std::int64_t j = 0; j < S; ++j)
        event(ev.node + s * S + j, ceil_div(ex.node_first(s, b, j), TR) + (pass == Pass::forward && j == 0) + (j > 0));
}

void node_forwards(const LayerConfig& c, const Exchange& ex, std::int64_t TR, Pass pass, std::int64_t rank, std::int64_t only_peer,
                   bool with_waits, const RequiredOf& required, const Emit& emit) {
  // Each source's rows for each rank of this node, piece by piece as its
  // own put would have sent them: a rank's sub-block j once the source's
  // node sub-blocks 0..j have arrived (relays chain them; a token's node
  // slot is at most its slot on any rank of the node).
  if (!ex.forwards()) return;
  const bool forward = pass == Pass::forward;
  const std::int64_t b = ex.node_of(rank), R = ex.ranks() / ex.nodes(), S = ex.node_slots(), cols = token_cols(c, pass);
  const EventBases own = event_bases(c, ex, pass, rank);
  std::vector<std::int64_t> tok_base(static_cast<std::size_t>(R));  // the node's ranks' first `tok` events
  for (std::int64_t d = b * R; d < (b + 1) * R; ++d) tok_base[static_cast<std::size_t>(d - b * R)] = event_bases(c, ex, pass, d).tok;
  for (std::int64_t s = 0; s < ex.ranks(); ++s) {
    if (!ex.forwards_through(s, rank) || ex.node_tokens(s, b) == 0) continue;
    const std::int64_t node_event = own.node + s * S;
    // The forwarder's sums of s's tokens read s's routes (NODE_ROUTE): its
    // node_comb event counts their arrival too, through a relay, and does
    // not rely on its own part sums (a forwarder may hold none of s's
    // tokens, and the node's other ranks' sums say nothing a rank's own
    // proof can see of when the routes landed).
    if (forward && only_peer < 0)
      emit(TaskSpec{.kind = TaskKind::dispatch_node_relay, .src_row = s, .wait_event = with_waits ? node_event : -1,
                    .wait_count = with_waits ? required(node_event) : 0, .trigger_event = own.node_comb + s * S});
    for (std::int64_t j = 0; j < S; ++j) {
      if (j > 0 && only_peer < 0)
        emit(TaskSpec{.kind = forward ? TaskKind::dispatch_node_relay : TaskKind::grad_dispatch_node_relay, .src_row = s,
                      .wait_event = with_waits ? node_event + j - 1 : -1,
                      .wait_count = with_waits ? required(node_event + j - 1) : 0, .trigger_event = node_event + j});
      for (std::int64_t d = b * R; d < (b + 1) * R; ++d) {
        if (ex.rank_tokens(s, d) == 0 || (only_peer >= 0 && d != only_peer)) continue;
        const auto homes = ex.placement().instances_of(d);
        if (j >= static_cast<std::int64_t>(homes.size())) continue;
        const std::int64_t i = homes[static_cast<std::size_t>(j)], n = ex.relayed_first(s, i), within = ex.sub_block_offset(s, i);
        // d's rows in s's routes for this node, which follow s's token list.
        const std::int64_t routes = ex.node_route_start(s, b) + ex.token_send_offset(s, d) - ex.token_send_offset(s, b * R);
        const std::int64_t tok = tok_base[static_cast<std::size_t>(d - b * R)] + s * static_cast<std::int64_t>(homes.size()) + j;
        for (std::int64_t r = 0; r < n; r += TR)
          emit(TaskSpec{.kind = forward ? TaskKind::dispatch_forward : TaskKind::grad_dispatch_forward,
                        .src = forward ? BufferId::node_tok : BufferId::node_dy, .dst = forward ? BufferId::recv_tok : BufferId::dy_tok,
                        .expert = ex.placement().instance_expert(i), .peer = d, .row_begin = ex.token_start(s, d) + within + r,
                        .rows = std::min(TR, n - r), .col_begin = 0, .cols = cols, .src_row = routes + within + r,
                        .wait_event = with_waits ? node_event + j : -1, .wait_count = with_waits ? required(node_event + j) : 0,
                        .trigger_event = tok});
      }
    }
  }
}

// The per-rank exchange on the destination: one gather per source piece of
// row tile `tile` of instance `home` (the pieces the per-assignment
// exchange puts), each once its source's sub-blocks up to the instance's
// slot have arrived.
void rank_gathers_of_tile(const LayerConfig& c, const Exchange& ex, const Program& p, Pass pass, std::int64_t rank,
                     std::int64_t home, std::int64_t tile, const EventBases& ev, const Emit& emit) {
  const bool forward = pass == Pass::forward;
  const std::int64_t TR = ex.tile_rows(), lo = tile * TR, hi = lo + TR;
  const std::int64_t e = ex.placement().instance_expert(home);
  for (std::int64_t s = 0; s < ex.ranks(); ++s) {
    const std::int64_t first = ex.source_offset(s, home), n = ex.count(s, home);
    const std::int64_t r0 = std::max(first, lo), r1 = std::min(first + n, hi);
    if (r0 >= r1) continue;
    const std::int64_t tok = ev.tok + s * ex.placement().local_count(rank) + ex.instance_slot(home);
    emit(TaskSpec{.kind = forward ? TaskKind::dispatch_gather : TaskKind::grad_dispatch_gather,
                  .src = forward ? BufferId::recv_tok : BufferId::dy_tok, .dst = forward ? BufferId::recv : BufferId::dy,
                  .expert = e, .row_begin = ex.expert_start(home) + r0, .rows = r1 - r0, .col_begin = 0, .cols = c.hidden,
                  .src_row = s, .wait_event = tok,
                  .wait_count = p.events[static_cast<std::size_t>(tok)].required,
                  .trigger_event = (forward ? ev.recv : ev.dy) + ex.tile_start(home) + tile});
  }
}

std::int64_t sum_pieces_into(const Exchange& ex, std::int64_t TR, std::int64_t rank) {
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < ex.instances(); ++i)
    n += ceil_div(ex.forwarded(rank, ex.placement().instance_rank(i)) ? ex.direct_last(rank, i) : ex.last_tokens(rank, i), TR);
  for (std::int64_t b = 0; b < ex.nodes() && ex.forwards(); ++b)
    for (std::int64_t c = 0; c < ex.node_slots() && b != ex.node_of(rank); ++c) n += ceil_div(ex.node_last(rank, b, c), TR);
  return n;
}

// The sums a node's ranks put on forwarder f for source s's slot j: every
// piece of their sub-lists j of s's tokens.
std::int64_t node_sum_pieces(const Exchange& ex, std::int64_t TR, std::int64_t s, std::int64_t f, std::int64_t j) {
  const std::int64_t b = ex.node_of(f), R = ex.ranks() / ex.nodes();
  std::int64_t n = 0;
  for (std::int64_t d = b * R; d < (b + 1) * R; ++d)
    if (const auto homes = ex.placement().instances_of(d); j < static_cast<std::int64_t>(homes.size()))
      n += ceil_div(ex.relayed_last(s, homes[static_cast<std::size_t>(j)]), TR);
  return n;
}

void node_sum_events(const LayerConfig&, const Exchange& ex, std::int64_t TR, Pass pass, std::int64_t rank, const EventBases& ev,
                     const std::function<void(std::int64_t, std::int64_t)>& event) {
  if (!ex.forwards()) return;
  // Source s's combine slot c: the node's sums of slot c, and from c > 0
  // the relay from c - 1, so that it completes once slots 0..c are in;
  // forward, slot 0 also counts the relay that passes on that the source's
  // routes are here (node_forwards).
  const std::int64_t S = ex.node_slots();
  for (std::int64_t s = 0; s < ex.ranks(); ++s)
    if (ex.forwards_through(s, rank) && ex.node_tokens(s, ex.node_of(rank)) > 0)
      for (std::int64_t c = 0; c < S; ++c)
        event(ev.node_comb + s * S + c, node_sum_pieces(ex, TR, s, rank, c) + (c > 0 || pass == Pass::forward ? 1 : 0));
}

void node_combines(const LayerConfig& c, const Exchange& ex, std::int64_t TR, Pass pass, std::int64_t rank, std::int64_t only_peer,
                   bool with_waits, const RequiredOf& required, const Emit& emit) {
  // Each source's node sums by combine slot, in pieces of a tile's rows:
  // slot c once every rank of the node has put its sums of the source's
  // tokens whose last instance there is in slots 0..c (a relay chains the
  // slots), each row the sum of the token's rows over the node's ranks, in
  // rank order, into the source's node sum rows (Exchange::node_sum_start,
  // node_sum_offset). Slot by slot across the sources: a queue holds them
  // in the order their rows complete.
  if (!ex.forwards()) return;
  const bool forward = pass == Pass::forward;
  const std::int64_t b = ex.node_of(rank), S = ex.node_slots();
  const EventBases own = event_bases(c, ex, pass, rank);
  for (std::int64_t slot = 0; slot < S; ++slot)
    for (std::int64_t s = 0; s < ex.ranks(); ++s) {
      if (!ex.forwards_through(s, rank) || ex.node_tokens(s, b) == 0 || (only_peer >= 0 && s != only_peer)) continue;
      const std::int64_t wait = own.node_comb + s * S + slot;
      if (slot > 0 && only_peer < 0) {  // (an event nothing counts towards needs no wait)
        const std::int64_t need = with_waits ? required(wait - 1) : 0;
        emit(TaskSpec{.kind = forward ? TaskKind::combine_node_relay : TaskKind::grad_combine_node_relay, .src_row = s,
                      .wait_event = need > 0 ? wait - 1 : -1, .wait_count = need, .trigger_event = wait});
      }
      const EventBases source_events = event_bases(c, ex, pass, s);
      const std::int64_t n = ex.node_last(s, b, slot), first = ex.node_sum_offset(s, b, slot), at = ex.node_sum_start(s, b) + first;
      for (std::int64_t r = 0; r < n; r += TR)
        emit(TaskSpec{.kind = forward ? TaskKind::combine_node_put : TaskKind::grad_combine_node_put,
                      .src = forward ? BufferId::node_comb : BufferId::node_dcomb, .dst = forward ? BufferId::comb_rank : BufferId::dcomb_rank,
                      .peer = s, .row_begin = at + r, .rows = std::min(TR, n - r), .col_begin = 0, .cols = c.hidden, .src_row = first + r,
                      .wait_event = with_waits ? wait : -1, .wait_count = with_waits ? required(wait) : 0,
                      .trigger_event = forward ? source_events.comb_done : source_events.dx_ready});
    }
}

void rank_puts_to_sources(const LayerConfig& c, const Exchange& ex, std::int64_t TR, Pass pass, std::int64_t rank,
                          std::int64_t only_peer, bool with_waits, const RequiredOf& required, const Emit& emit, ReturnPuts which) {
  const bool forward = pass == Pass::forward;
  // One row per (token, rank): each source's list in pieces of a tile's
  // rows, each sub-list (the tokens whose last instance here is slot j)
  // once the instances up to j are done; in the backward first the gate
  // gradients of the whole list, once its dy block has all arrived. A
  // source of another node gets its sums through its forwarder here (the
  // per-node combine), which adds the node's ranks' rows first, but for
  // its direct tokens' (no other rank of the node takes them), which go
  // straight.
  const EventBases own = event_bases(c, ex, pass, rank);
  const std::int64_t L = ex.placement().local_count(rank), b = ex.node_of(rank);
  const auto waits = [&](std::int64_t event) { return !with_waits ? std::pair<std::int64_t, std::int64_t>{-1, 0} : std::pair{event, required(event)}; };
  for (std::int64_t s = 0; s < ex.ranks(); ++s) {
    const std::int64_t n = ex.rank_tokens(s, rank);
    const bool through = ex.forwarded(s, rank);
    const std::int64_t f = through ? ex.forwarder(s, b) : s;
    if (n == 0 || (only_peer >= 0 && s != only_peer && f != only_peer)) continue;
    const EventBases source_events = event_bases(c, ex, pass, s);
    const std::int64_t list = ex.token_send_offset(s, rank), block = ex.token_start(s, rank);
    // Where the relayed sums go: the forwarder's node rows (slot-major:
    // this rank's sub-list j in slot j's segment) and its event of slot j.
    const std::int64_t sums_event = through ? event_bases(c, ex, pass, f).node_comb + s * ex.node_slots() : -1;
    if (!forward && which != ReturnPuts::sums && (only_peer < 0 || s == only_peer))
      for (std::int64_t r = 0; r < n; r += TR) {
        const auto [event, count] = waits(own.tok + s * L + L - 1);
        emit(TaskSpec{.kind = TaskKind::gate_grad_put, .src = BufferId::dy_tok, .dst = BufferId::gw_rank, .peer = s,
                      .row_begin = list + r, .rows = std::min(TR, n - r), .col_begin = 0, .cols = c.top_k, .src_row = block + r,
                      .wait_event = event, .wait_count = count, .trigger_event = source_events.gw_done});
      }
    if (which == ReturnPuts::gate_grads) continue;
    const TaskKind straight = forward ? TaskKind::combine_rank_put : TaskKind::grad_combine_rank_put;
    const BufferId sums = forward ? BufferId::comb_rank : BufferId::dcomb_rank;
    const std::int64_t straight_event = forward ? source_events.comb_done : source_events.dx_ready;
    for (const std::int64_t i : ex.placement().instances_of(rank)) {
      const std::int64_t m = ex.last_tokens(s, i), within = ex.sub_list_offset(s, i), j = ex.instance_slot(i);
      const auto [event, count] = waits(own.slot_done + j);
      // Through the forwarder the sub-list's relayed rows, into its node
      // rows; straight back the rest (all of it, or the direct tokens').
      const std::int64_t relayed = through ? ex.relayed_last(s, i) : 0;
      for (std::int64_t r = 0; r < relayed && (only_peer < 0 || f == only_peer); r += TR)
        emit(TaskSpec{.kind = forward ? TaskKind::combine_node_part_put : TaskKind::grad_combine_node_part_put,
                      .src = forward ? BufferId::y : BufferId::dxe, .dst = forward ? BufferId::node_comb : BufferId::node_dcomb,
                      .expert = ex.placement().instance_expert(i), .peer = f,
                      .row_begin = ex.node_route_start(s, b) + ex.node_part_start(s, j, rank) + r, .rows = std::min(TR, relayed - r),
                      .col_begin = 0, .cols = c.hidden, .src_row = block + within + r, .wait_event = event, .wait_count = count,
                      .trigger_event = sums_event + j});
      const std::int64_t at = through ? ex.direct_sum_start(s, rank) + ex.direct_list_offset(s, i) - relayed : ex.sum_start(s, rank) + within;
      for (std::int64_t r = relayed; r < m && (only_peer < 0 || s == only_peer); r += TR)
        emit(TaskSpec{.kind = straight, .src = forward ? BufferId::y : BufferId::dxe, .dst = sums,
                      .expert = ex.placement().instance_expert(i), .peer = s, .row_begin = at + r, .rows = std::min(TR, m - r),
                      .col_begin = 0, .cols = c.hidden, .src_row = block + within + r, .wait_event = event, .wait_count = count,
                      .trigger_event = straight_event});
    }
  }
}

namespace {

// The per-rank (and per-node) exchange's part of a rank's program: each
// source's token chains into the slots (and a forwarder's node blocks and
// sums), the gathers of each row tile's rows from the token blocks, the
// slots' outputs counted in slot order for the sums per (token, rank), the
// gate gradients computed on the experts' ranks and gathered back, and the
// returns in rank order.
class RankSteps final : public SchemeSteps {
 public:
  void events(StepEmitter& s) const override {
    // Source q's `tok` event of slot j: its sub-block j (and forward, the
    // routes of its rows for slot j), and the relay from slot j - 1, so that
    // it completes once sub-blocks 0..j have all arrived.
    const TaskKind relay = s.forward_pass ? TaskKind::dispatch_relay : TaskKind::grad_dispatch_relay;
    const TaskKind gather = s.forward_pass ? TaskKind::dispatch_gather : TaskKind::grad_dispatch_gather;
    for (std::int64_t q = 0; q < s.c.ranks; ++q) {
      if (s.ex.rank_tokens(q, s.rank) == 0) continue;
      for (std::int64_t j = 0; j < s.L; ++j) {
        const std::int64_t i = s.home_of(j);
        // Through a forwarder, its pieces and q's own of the direct tokens.
        const std::int64_t pieces = ceil_div(s.ex.relayed_first(q, i), s.TR) + ceil_div(s.ex.direct_first(q, i), s.TR);
        const std::int64_t routes = s.forward_pass && s.ex.count(q, i) > 0;
        const std::int64_t list = s.forward_pass && j == 0;  // the block's combine list
        s.b.event(s.ev.tok + q * s.L + j, static_cast<std::int32_t>(pieces + routes + list + (j > 0)), j + 1 < s.L ? relay : gather,
                  s.expert_of(j), -1);
      }
    }
    node_events(s.c, s.ex, s.TR, s.pass, s.rank, [&](std::int64_t id, std::int64_t need) {
      s.b.event(id, static_cast<std::int32_t>(need), s.forward_pass ? TaskKind::dispatch_forward : TaskKind::grad_dispatch_forward, -1, -1);
    });
    node_sum_events(s.c, s.ex, s.TR, s.pass, s.rank, s.ev, [&](std::int64_t id, std::int64_t need) {
      s.b.event(id, static_cast<std::int32_t>(need), s.forward_pass ? TaskKind::combine_node_put : TaskKind::grad_combine_node_put, -1, -1);
    });
  }
  // Slot j's outputs written, and through a relay slot j - 1's: what the
  // sums of the tokens whose last instance here is j wait for; backward,
  // every rank's gate gradients of this rank's tokens (pieces of whole
  // lists, one per tile of rows of each block this rank sent).
  void output_events(StepEmitter& s) const override {
    for (std::int64_t j = 0; j < s.L; ++j)
      s.b.event(s.ev.slot_done + j, static_cast<std::int32_t>(s.ex.tiles_of(s.home_of(j)) * s.n_down + (j > 0)),
                s.forward_pass ? TaskKind::combine_rank_put : TaskKind::grad_combine_rank_put, s.expert_of(j), -1);
    if (s.forward_pass) return;
    std::int64_t lists = 0;
    for (std::int64_t d = 0; d < s.c.ranks; ++d) lists += ceil_div(s.ex.rank_tokens(s.rank, d), s.TR);
    s.b.event(s.ev.gw_done, static_cast<std::int32_t>(lists), TaskKind::gate_grad_gather, -1, -1);
  }
  std::int64_t output_event(const StepEmitter& s, std::int64_t le, std::int64_t) const override { return s.ev.slot_done + le; }
  std::int64_t returned_pieces(const StepEmitter& s) const override { return sum_pieces_into(s.ex, s.TR, s.rank); }
  TaskKind combined_consumer(const StepEmitter& s) const override { return final_reduce(s); }
  TaskKind final_reduce(const StepEmitter& s) const override {
    return s.forward_pass ? TaskKind::combine_rank_reduce : TaskKind::grad_rank_reduce;
  }
  BufferId final_source(const StepEmitter& s) const override {
    return s.forward_pass ? BufferId::comb_rank : BufferId::dcomb_rank;
  }
  void first_hop(StepEmitter& s) const override {
    rank_puts_to_experts(s.c, s.ex, s.TR, s.pass, s.rank, -1, s.emit);
    node_forwards(s.c, s.ex, s.TR, s.pass, s.rank, -1, true, s.required, s.emit);
  }
  // The relays into slot j, emitted just before slot j's gathers: in
  // generation order (which is topological) after the puts and relays that
  // feed them, and in a worker's queue no earlier than the work they release.
  void before_slot(StepEmitter& s, std::int64_t j) const override {
    if (j == 0) return;
    const TaskKind relay = s.forward_pass ? TaskKind::dispatch_relay : TaskKind::grad_dispatch_relay;
    for (std::int64_t q = 0; q < s.c.ranks; ++q) {
      if (s.ex.rank_tokens(q, s.rank) == 0) continue;
      const std::int64_t before = s.ev.tok + q * s.L + j - 1, need = s.required(before);
      s.b.task({.kind = relay, .peer = -1, .src_row = q, .wait_event = need > 0 ? before : -1, .wait_count = need,
                .trigger_event = s.ev.tok + q * s.L + j});
    }
  }
  void before_tile(StepEmitter& s, std::int64_t le, std::int64_t tile) const override {
    rank_gathers_of_tile(s.c, s.ex, s.p, s.pass, s.rank, s.home_of(le), tile, s.ev, s.emit);
  }
  // The relay into slot j + 1, after slot j's tasks in generation order.
  void after_slot(StepEmitter& s, std::int64_t j) const override {
    if (j + 1 >= s.L) return;
    const std::int64_t need = s.required(s.ev.slot_done + j);
    s.b.task({.kind = s.forward_pass ? TaskKind::combine_relay : TaskKind::grad_combine_relay, .peer = -1,
              .wait_event = need > 0 ? s.ev.slot_done + j : -1, .wait_count = need, .trigger_event = s.ev.slot_done + j + 1});
  }
  // The gate gradients come back from the experts' ranks.
  void gate_gradients(StepEmitter& s, std::int64_t t, std::int64_t rows) const override {
    s.b.task({.kind = TaskKind::gate_grad_gather, .src = BufferId::gw_rank, .dst = BufferId::gw, .row_begin = t * s.TR, .rows = rows,
              .col_begin = 0, .cols = s.c.top_k, .src_row = t * s.TR, .wait_event = s.ev.gw_done,
              .wait_count = s.required(s.ev.gw_done), .trigger_event = s.ev.gw + t});
  }
  bool router_first() const override { return false; }
  // The rows of the source's token list (every destination's block).
  static std::int64_t token_list(const BufferDecl& d) { return d.ex.token_send_offset(d.rank, d.ex.ranks()); }
  // Forward: the sums. Backward: the gate gradients, then the router (which
  // waits for every rank's), then the dx sums; then a forwarder's node sums.
  void returns(StepEmitter& s) const override {
    if (s.forward_pass) {
      rank_puts_to_sources(s.c, s.ex, s.TR, s.pass, s.rank, -1, true, s.required, s.emit, ReturnPuts::all);
    } else {
      rank_puts_to_sources(s.c, s.ex, s.TR, s.pass, s.rank, -1, true, s.required, s.emit, ReturnPuts::gate_grads);
      s.router();
      rank_puts_to_sources(s.c, s.ex, s.TR, s.pass, s.rank, -1, true, s.required, s.emit, ReturnPuts::sums);
    }
    node_combines(s.c, s.ex, s.TR, s.pass, s.rank, -1, true, s.required, s.emit);
  }
  // The source's token list, routes and combine lists; the blocks, routes
  // and lists it receives; the sums that come back; a forwarder's node
  // blocks, routes and sums.
  void forward_exchange_buffers(const BufferDecl& d) const override {
    const LayerConfig& c = d.c;
    const Exchange& ex = d.ex;
    if (!ex.has_rank_tokens())
      throw Error("the per-rank exchange needs each source's token count per destination rank (rank_token_counts); "
                  "this exchange was built from expert counts alone");
    constexpr Region sym = Region::symmetric, local = Region::local;
    const std::int64_t list = token_list(d), blocks = ex.token_recv_rows(d.rank), row_bytes = c.dispatch_row_bytes();
    d.add(BufferId::rank_token, list, 1, 4, local);
    d.add(BufferId::rank_route, d.send, 2, 4, local);
    if (c.staged_dispatch()) d.add(BufferId::recv_tok, blocks, row_bytes, 1, sym);
    else d.add(BufferId::recv_tok, blocks, d.H, d.elem, sym);
    d.add(BufferId::recv_route, d.recv, 2, 4, sym);
    d.add(BufferId::rank_comb, list, ops::CombineList::words(d.K), 4, local);
    d.add(BufferId::recv_comb, blocks, ops::CombineList::words(d.K), 4, sym);
    d.add(BufferId::comb_rank, ex.sum_rows(d.rank), d.H, d.comb_elem, sym);  // the rows its sums come back to
    d.add(BufferId::rank_slot, d.T, 2 * c.ranks + ex.nodes(), 8, local);
    if (!ex.forwards()) return;
    d.add(BufferId::node_token, ex.node_send_offset(d.rank, ex.nodes()), 1, 4, local);
    d.add(BufferId::node_index, list, 2, 4, local);
    if (c.staged_dispatch()) d.add(BufferId::node_tok, ex.node_recv_rows(d.rank), row_bytes, 1, sym);
    else d.add(BufferId::node_tok, ex.node_recv_rows(d.rank), d.H, d.elem, sym);
    d.add(BufferId::node_route, ex.node_route_recv_rows(d.rank), 2, 4, sym);
    d.add(BufferId::node_comb, ex.node_route_recv_rows(d.rank), d.H, d.comb_elem, sym);
  }
  void backward_buffers(const BufferDecl& d) const override {
    const Exchange& ex = d.ex;
    constexpr Region sym = Region::symmetric;
    d.add(BufferId::gw_rank, token_list(d), d.K, 4, sym);
    d.add(BufferId::dcomb_rank, ex.sum_rows(d.rank), d.H, d.comb_elem, sym);
    if (d.c.staged_grad_dispatch()) d.add(BufferId::dy_tok, ex.token_recv_rows(d.rank), 2 * d.H, 1, sym);
    else d.add(BufferId::dy_tok, ex.token_recv_rows(d.rank), d.H, d.elem, sym);
    if (!ex.forwards()) return;
    if (d.c.staged_grad_dispatch()) d.add(BufferId::node_dy, ex.node_recv_rows(d.rank), 2 * d.H, 1, sym);
    else d.add(BufferId::node_dy, ex.node_recv_rows(d.rank), d.H, d.elem, sym);
    d.add(BufferId::node_dcomb, ex.node_route_recv_rows(d.rank), d.H, d.comb_elem, sym);
  }
  void interface(const LayerConfig& c, const Exchange& ex, std::int64_t tile_rows, Pass pass, std::int64_t from, std::int64_t to,
                 const Emit& emit) const override {
    const RequiredOf none = [](std::int64_t) { return std::int64_t{0}; };
    rank_puts_to_experts(c, ex, tile_rows, pass, from, to, emit);
    rank_puts_to_sources(c, ex, tile_rows, pass, from, to, false, none, emit, ReturnPuts::all);
    node_forwards(c, ex, tile_rows, pass, from, to, false, none, emit);
    node_combines(c, ex, tile_rows, pass, from, to, false, none, emit);
  }
};

}  // namespace

const SchemeSteps& rank_steps() {
  static const RankSteps steps;
  return steps;
}

}  // namespace hpmoe::taskflow
