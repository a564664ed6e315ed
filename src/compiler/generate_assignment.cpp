// The per-assignment exchange (LayerConfig::exchange assignment): a row per
// (token, expert) to the expert's home, split at the home's row tiles so
// that each piece signals exactly the tile it fills, and the expert's
// output rows back the same way. generate.cpp calls these for a rank's
// program and for the interface between two ranks' programs.
#include <algorithm>
#include <utility>
#include <vector>

#include "compiler/generate_step.hpp"

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

namespace {

// The per-assignment exchange's part of a rank's program: staged tiles and
// their decodes, each row tile's return once its outputs are written, the
// combine of the returned rows in fixed order (a split expert's parts
// summed first), and the gate gradients computed where the rows come back.
class AssignmentSteps final : public SchemeSteps {
 public:
  void arrival_event(StepEmitter& s, std::int64_t le, std::int64_t tile, std::int64_t arrived, TaskKind first) const override {
    if (!s.staged) return SchemeSteps::arrival_event(s, le, tile, arrived, first);
    const std::int64_t home = s.home_of(le), at = s.ex.tile_start(home) + tile;
    s.b.event(s.ev.staged + at, s.ex.arrivals(home, tile), s.forward_pass ? TaskKind::dispatch_decode : TaskKind::grad_dispatch_decode,
              s.expert_of(le), tile);
    s.b.event(arrived + at, 1, first, s.expert_of(le), tile);
  }
  // Each row tile's outputs (forward Y, backward DXE) written: what its return puts wait for.
  void output_events(StepEmitter& s) const override {
    for (std::int64_t le = 0; le < s.L; ++le) {
      const std::int64_t home = s.home_of(le), tb = s.ex.tile_start(home);
      for (std::int64_t i = 0; i < s.ex.tiles_of(home); ++i)
        s.b.event(output_base(s) + tb + i, static_cast<std::int32_t>(s.n_down),
                  s.forward_pass ? TaskKind::combine_put : TaskKind::grad_combine_put, s.expert_of(le), i);
    }
  }
  std::int64_t output_event(const StepEmitter& s, std::int64_t le, std::int64_t tile) const override {
    return output_base(s) + s.ex.tile_start(s.home_of(le)) + tile;
  }
  std::int64_t returned_pieces(const StepEmitter& s) const override { return s.ex.pieces_into(s.rank); }
  TaskKind combined_consumer(const StepEmitter& s) const override {
    if (!s.p.reductions.empty()) return s.forward_pass ? TaskKind::part_reduce : TaskKind::grad_part_reduce;
    return final_reduce(s);
  }
  TaskKind final_reduce(const StepEmitter& s) const override {
    return s.forward_pass ? TaskKind::combine_reduce : TaskKind::grad_reduce;
  }
  BufferId final_source(const StepEmitter& s) const override { return s.forward_pass ? BufferId::comb : BufferId::dcomb; }
  // Split experts' partial rows, reduced in place once every piece is back:
  // one task per row tile of each declared reduction's target block.
  std::int64_t split_sums(StepEmitter& s, bool emit) const override {
    const TaskKind kind = s.forward_pass ? TaskKind::part_reduce : TaskKind::grad_part_reduce;
    const BufferId buffer = final_source(s);
    const std::int64_t wait_event = s.forward_pass ? s.ev.comb_done : s.ev.dx_ready;
    std::int64_t n = 0;
    for (const Reduction& red : s.p.reductions)
      for (std::int64_t r = 0; r < red.rows; r += s.TR, ++n)
        if (emit)
          s.b.task({.kind = kind, .src = buffer, .dst = buffer, .row_begin = red.row_begin + r, .rows = std::min(s.TR, red.rows - r),
                    .col_begin = 0, .cols = s.H, .src_row = red.row_begin + red.rows + r, .wait_event = wait_event,
                    .wait_count = s.required(wait_event), .trigger_event = s.ev.reduced});
    return n;
  }
  void first_hop(StepEmitter& s) const override {
    assignment_puts_to_experts(s.c, s.ex, s.TR, s.pass, s.rank, -1, s.emit);
  }
  // A staged tile's decode, once its pieces have all arrived.
  void before_tile(StepEmitter& s, std::int64_t le, std::int64_t tile) const override {
    if (!s.staged) return;
    const std::int64_t home = s.home_of(le), tb = s.ex.tile_start(home);
    const std::int64_t rows = std::min(s.TR, s.ex.expert_rows(home) - tile * s.TR), row0 = s.ex.expert_start(home) + tile * s.TR;
    const std::int64_t staged = s.ev.staged + tb + tile;
    s.b.task({.kind = s.forward_pass ? TaskKind::dispatch_decode : TaskKind::grad_dispatch_decode,
              .src = s.forward_pass ? BufferId::recv_staged : BufferId::dy_staged, .dst = s.forward_pass ? BufferId::recv : BufferId::dy,
              .expert = s.expert_of(le), .row_begin = row0, .rows = rows, .col_begin = 0, .cols = s.H, .src_row = row0,
              .wait_event = staged, .wait_count = s.required(staged), .trigger_event = (s.forward_pass ? s.ev.recv : s.ev.dy) + tb + tile});
  }
  void gate_gradients(StepEmitter& s, std::int64_t t, std::int64_t rows) const override {
    s.b.task({.kind = TaskKind::gate_grad, .src = BufferId::comb, .dst = BufferId::gw, .row_begin = t * s.TR, .rows = rows,
              .col_begin = 0, .cols = s.c.top_k, .src_row = t * s.TR, .trigger_event = s.ev.gw + t});
  }
  bool router_first() const override { return true; }
  void returns(StepEmitter& s) const override {
    assignment_puts_to_sources(s.c, s.ex, s.TR, s.pass, s.rank, -1, output_base(s), s.n_down, s.emit);
  }
  // The rows that come back (COMB, DCOMB) and the staged tiles.
  void forward_return_buffers(const BufferDecl& d) const override {
    d.add(BufferId::comb, d.send, d.H, d.elem, Region::symmetric);
  }
  void forward_exchange_buffers(const BufferDecl& d) const override {
    if (staged_in(d.c, Pass::forward)) d.add(BufferId::recv_staged, d.recv, d.c.dispatch_row_bytes(), 1, Region::symmetric);
  }
  void backward_buffers(const BufferDecl& d) const override {
    d.add(BufferId::dcomb, d.send, d.H, d.elem, Region::symmetric);
    if (staged_in(d.c, Pass::backward)) d.add(BufferId::dy_staged, d.recv, 2 * d.H, 1, Region::symmetric);
  }
  void interface(const LayerConfig& c, const Exchange& ex, std::int64_t tile_rows, Pass pass, std::int64_t from, std::int64_t to,
                 const Emit& emit) const override {
    assignment_puts_to_experts(c, ex, tile_rows, pass, from, to, emit);
    assignment_puts_to_sources(c, ex, tile_rows, pass, from, to, -1, 0, emit);
  }

 private:
  static std::int64_t output_base(const StepEmitter& s) { return s.forward_pass ? s.ev.y : s.ev.dxe; }
};

}  // namespace

const SchemeSteps& assignment_steps() {
  static const AssignmentSteps steps;
  return steps;
}

}  // namespace hpmoe::taskflow
