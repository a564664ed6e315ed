// The per-assignment exchange (LayerConfig::exchange assignment): a row per
// (token, expert) to the expert's home, split at the home's row tiles so
// that each piece signals exactly the tile it fills, and the expert's
// output rows back the same way. generate.cpp calls these for a rank's
// program and for the interface between two ranks' programs.
#include <algorithm>
#include <utility>
#include <vector>

#include "compiler/generate_parts.hpp"

namespace hpmoe::taskflow {

// Puts of `rank`'s tokens (forward) or output gradients (backward) to every
// expert's owner (only `only_peer`'s when it is >= 0), split at the owner's
// row tiles so that each piece signals exactly the tile it fills.
void assignment_puts_to_experts(const LayerConfig& c, const Exchange& ex, std::int64_t tile_rows, Pass pass,
                                std::int64_t rank, std::int64_t only_peer, const Emit& emit) {
  const bool forward = pass == Pass::forward;
  const std::int64_t TR = tile_rows;
  const bool staged = staged_in(c, pass);
  const TaskKind kind = forward ? (staged ? TaskKind::dispatch_cast_put : TaskKind::dispatch_put)
                                : (staged ? TaskKind::grad_dispatch_cast_put : TaskKind::grad_dispatch_put);
  const BufferId target = forward ? (staged ? BufferId::recv_staged : BufferId::recv) : (staged ? BufferId::dy_staged : BufferId::dy);
  const std::int64_t cols = !staged ? c.hidden : forward ? c.dispatch_row_bytes() : 2 * c.hidden;
  // The pieces go in the order their destinations compute them: a piece's
  // key is where its tile stands in its destination's queue (its slot's
  // rows before it, then the tile's place in arrival order), as a share of
  // the destination's rows; ties by rotated destination. Every destination
  // then receives its rows spread over the whole dispatch, in the order it
  // uses them. Grouping by expert ordinal instead (each destination's first
  // expert to all, then the second) makes, where a rank's slots differ in
  // size (a hot expert's replica beside a cold owner, EP 256 under Zipf),
  // each phase pour into the ranks with the large slots while the others
  // wait: the fused step then overlapped little (docs/results/placement.md).
  // Where the pieces are equal the two orders coincide.
  std::vector<std::pair<std::pair<double, std::int64_t>, TaskSpec>> pieces;
  std::vector<double> dest_rows(static_cast<std::size_t>(c.ranks), -1.0);
  std::vector<std::int64_t> keys;
  for (std::int64_t i = 0; i < ex.instances(); ++i) {  // each expert's homes, in send order
    const std::int64_t e = ex.placement().instance_expert(i), d = ex.placement().instance_rank(i), n = ex.count(rank, i);
    if (n == 0 || (only_peer >= 0 && d != only_peer)) continue;
    const EventBases owner_events = event_bases(c, ex, pass, d);
    const std::int64_t base = staged ? owner_events.staged : forward ? owner_events.recv : owner_events.dy;
    const std::int64_t first = ex.source_offset(rank, i);
    auto& total = dest_rows[static_cast<std::size_t>(d)];
    if (total < 0) {
      total = 0;
      for (const auto h : ex.placement().instances_of(d)) total += double(ex.expert_rows(h));
    }
    // A tile's place in the destination's order (arrival_tile_order's:
    // by latest source in rotated order, ties by index), counted for the
    // few tiles this rank's block touches instead of sorting them all.
    arrival_keys(c, ex, i, d, keys);
    const auto position = [&](std::int64_t t) {
      const std::int64_t k = keys[static_cast<std::size_t>(t)];
      std::int64_t before = 0;
      for (std::int64_t u = 0; u < static_cast<std::int64_t>(keys.size()); ++u)
        before += keys[static_cast<std::size_t>(u)] < k || (keys[static_cast<std::size_t>(u)] == k && u < t);
      return before;
    };
    for (std::int64_t r = first; r < first + n;) {
      const std::int64_t tile = r / TR, end = std::min(first + n, (tile + 1) * TR);
      TaskSpec t{.kind = kind, .src = forward ? BufferId::x : BufferId::dout, .dst = target,
                 .expert = e, .peer = d, .row_begin = ex.expert_start(i) + r, .rows = end - r, .col_begin = 0,
                 .cols = cols, .src_row = ex.send_offset(rank, i) + (r - first),
                 .trigger_event = base + ex.tile_start(i) + tile};
      const double at = double(ex.expert_start(i) + position(tile) * TR) /
                        std::max(1.0, dest_rows[static_cast<std::size_t>(d)]);
      pieces.push_back({{at, (d - rank + c.ranks) % c.ranks}, t});
      r = end;
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [key, t] : pieces) emit(t);
}

// Puts of `rank`'s expert outputs (forward) or their input gradients
// (backward) back to each source (only `only_source` when it is >= 0), split
// at this rank's row tiles; each piece waits for the one tile it reads
// (wait_base: the first of those events, -1 for pieces that wait for nothing;
// the per-rank combine's pieces wait for events whose counts
// wait_count_of(event) gives).
void assignment_puts_to_sources(const LayerConfig& c, const Exchange& ex, std::int64_t tile_rows, Pass pass,
                                std::int64_t rank, std::int64_t only_source, std::int64_t wait_base,
                                std::int64_t wait_count, const Emit& emit) {
  const bool forward = pass == Pass::forward;
  const std::int64_t TR = tile_rows;
  for (const std::int64_t i : ex.placement().instances_of(rank)) {
    const std::int64_t e = ex.placement().instance_expert(i);
    for (std::int64_t s = 0; s < ex.ranks(); ++s) {
      const std::int64_t n = ex.count(s, i), first = ex.source_offset(s, i);
      if (n == 0 || (only_source >= 0 && s != only_source)) continue;
      const EventBases source_events = event_bases(c, ex, pass, s);
      const std::int64_t target = forward ? source_events.comb_done : source_events.dx_ready;
      for (std::int64_t r = first; r < first + n;) {
        const std::int64_t tile = r / TR, end = std::min(first + n, (tile + 1) * TR);
        emit(TaskSpec{.kind = forward ? TaskKind::combine_put : TaskKind::grad_combine_put,
                      .src = forward ? BufferId::y : BufferId::dxe, .dst = forward ? BufferId::comb : BufferId::dcomb,
                      .expert = e, .peer = s, .row_begin = ex.send_offset(s, i) + (r - first), .rows = end - r,
                      .col_begin = 0, .cols = c.hidden, .src_row = ex.expert_start(i) + r,
                      .wait_event = wait_base < 0 ? -1 : wait_base + ex.tile_start(i) + tile,
                      .wait_count = wait_base < 0 ? 0 : wait_count, .trigger_event = target});
        r = end;
      }
    }
  }
}

}  // namespace hpmoe::taskflow
