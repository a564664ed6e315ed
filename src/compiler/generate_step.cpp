// One rank's program of one pass: the events of its tiles, then its tasks
// in generation order (which is topological): the exchange's first hop, the
// shared experts, each slot's row tiles in the order their rows arrive, the
// returns and the reductions. What differs between the exchanges is asked
// of their emitters (generate_parts.hpp): each scheme's own file.
#include <algorithm>

#include "compiler/generate_parts.hpp"
#include "compiler/layout.hpp"
#include "hpmoe/error.hpp"
#include "ops/access.hpp"

namespace hpmoe::taskflow {

namespace {

class Builder {
 public:
  Builder(Program& p, const Machine& m) : p_(p), m_(m), table_(AccessTable::standard()) {}

  std::int32_t event(std::int64_t id, std::int32_t required, TaskKind consumer, std::int64_t expert, std::int64_t tile) {
    p_.events[static_cast<std::size_t>(id)] = Event{required, consumer, static_cast<std::int32_t>(expert),
                                                    static_cast<std::int32_t>(tile)};
    return static_cast<std::int32_t>(id);
  }

  // Appends a task; its cost comes from the access table's work and the
  // machine's rates (the scheduler's cost model).
  void task(const TaskSpec& s) {
    auto i32 = [](std::int64_t v) { return static_cast<std::int32_t>(v); };
    const KindAccess& access = table_[s.kind];
    p_.tasks.push_back(Task{s.kind, access.queue, s.src, s.dst, i32(s.expert), i32(s.peer < 0 ? p_.rank : s.peer),
                            i32(s.row_begin), i32(s.rows), i32(s.col_begin), i32(s.cols), i32(s.src_row),
                            i32(s.wait_event), i32(s.wait_count), i32(s.trigger_event)});
    const TaskWork w = table_.work(p_, p_.tasks.back());
    const double seconds = access.queue == QueueClass::matrix ? w.flops / m_.matrix_flops
                           : access.put ? w.bytes / m_.put_bytes_per_s + w.local_bytes / m_.vector_bytes_per_s
                                        : w.bytes / m_.vector_bytes_per_s;
    p_.cost.push_back(static_cast<float>(seconds + m_.task_overhead_s));
  }

  // GEMM output tiles of [M, N]: add(row, rows, col, cols).
  template <class Fn>
  void gemm_tiles(std::int64_t M, std::int64_t N, Fn&& add) {
    gemm_tiles(M, N, m_.tile_rows, m_.tile_cols, add);
  }
  // Weight-gradient tiles: Machine::weight_rows x Machine::weight_cols.
  template <class Fn>
  void weight_tiles(std::int64_t M, std::int64_t N, Fn&& add) {
    gemm_tiles(M, N, m_.weight_rows(), m_.weight_cols(), add);
  }
  template <class Fn>
  void gemm_tiles(std::int64_t M, std::int64_t N, std::int64_t rows, std::int64_t cols, Fn&& add) {
    for (std::int64_t i = 0; i < M; i += rows)
      for (std::int64_t j = 0; j < N; j += cols) add(i, std::min(rows, M - i), j, std::min(cols, N - j));
  }

 private:
  Program& p_;
  const Machine& m_;
  const AccessTable& table_;
};


// The state of one rank's generation: its layer, exchange and machine, its
// slots, the bases of its events, and the builder that appends to it.
struct StepEmitter {
  StepEmitter(Program& program, const LayerConfig& layer, const Exchange& exchange, const Machine& machine, Pass p_,
              std::int64_t r)
      : p(program), c(layer), ex(exchange), m(machine), pass(p_), rank(r), mine(ex.placement().experts_of(rank)),
        homes(ex.placement().instances_of(rank)), H(c.hidden), I(c.expert_inter), Is(c.shared_inter_total()),
        L(static_cast<std::int64_t>(mine.size())), T(c.tokens_per_rank), E(c.routed_experts), TR(m.tile_rows),
        TC(m.tile_cols), shared(c.shared_experts > 0), by_rank(c.exchange == ExchangeMode::rank),
        staged(staged_in(c, pass)), token_tiles(ceil_div(T, TR)), n_down(ceil_div(H, TC)),
        ev(event_bases(c, ex, pass, rank)), b(p, m), emit([this](const TaskSpec& s) { b.task(s); }),
        required([this](std::int64_t event) { return std::int64_t{p.events[static_cast<std::size_t>(event)].required}; }) {}

  Program& p;
  const LayerConfig& c;
  const Exchange& ex;
  const Machine& m;
  const Pass pass;
  const std::int64_t rank;
  const std::span<const std::int32_t> mine;   // this rank's experts, in slot order
  const std::vector<std::int64_t> homes;  // and their instances (the exchange's indexes)
  const std::int64_t H, I, Is, L, T, E, TR, TC;
  const bool shared, by_rank, staged;
  const std::int64_t token_tiles, n_down;
  const EventBases ev;
  Builder b;
  const Emit emit;
  const RequiredOf required;

  // A slot's intermediate width: the whole expert's, or its split part's.
  std::int64_t inter_of(std::int64_t le) const { return p.slot_parts[static_cast<std::size_t>(le)].inter; }

  void exchange_events();
  // A routed row tile's events, by their bases, and the kinds that wait on them.
  struct TileChain {
    std::int64_t arrived, first_done, step_done, out_done, first_tiles;
    TaskKind decode, first, step, second, give_back;
  };
  void tile_events(std::int64_t le, const TileChain&);
  void lend_events();
  void slot_done_events(TaskKind consumer);
  void relays_into(std::int64_t j);
  void slot_relay(std::int64_t j);
  std::int64_t gate_grad_pieces_into() const;
  std::int64_t part_reduces(TaskKind kind, BufferId buffer, std::int64_t wait_event, bool emit_tasks);
  void first_hop();
  void final_reduces(TaskKind kind, BufferId source, BufferId out, std::int64_t wait_event);

  void forward();
  void forward_events();
  void shared_forward();
  void expert_forward(std::int64_t le);

  void backward();
  void backward_events();
  void router();
  void shared_backward();
  void expert_backward(std::int64_t le);
};

// The per-rank and per-node exchanges' events of this rank.
void StepEmitter::exchange_events() {
  if (by_rank) {
    // Source s's `tok` event of slot j: its sub-block j (and forward, the
    // routes of its rows for slot j), and the relay from slot j - 1, so that
    // it completes once sub-blocks 0..j have all arrived.
    const TaskKind relay = pass == Pass::forward ? TaskKind::dispatch_relay : TaskKind::grad_dispatch_relay;
    for (std::int64_t s = 0; s < c.ranks; ++s) {
      if (ex.rank_tokens(s, rank) == 0) continue;
      for (std::int64_t j = 0; j < L; ++j) {
        const std::int64_t i = homes[static_cast<std::size_t>(j)];
        const std::int64_t pieces = ceil_div(ex.first_tokens(s, i), TR), routes = pass == Pass::forward && ex.count(s, i) > 0;
        const std::int64_t list = pass == Pass::forward && j == 0;  // the block's combine list
        b.event(ev.tok + s * L + j, static_cast<std::int32_t>(pieces + routes + list + (j > 0)),
                j + 1 < L ? relay : pass == Pass::forward ? TaskKind::dispatch_gather : TaskKind::grad_dispatch_gather,
                mine[static_cast<std::size_t>(j)], -1);
      }
    }
  }
  node_events(c, ex, TR, pass, rank, [&](std::int64_t id, std::int64_t need) {
    b.event(id, static_cast<std::int32_t>(need), pass == Pass::forward ? TaskKind::dispatch_forward : TaskKind::grad_dispatch_forward, -1, -1);
  });
  node_sum_events(c, ex, TR, pass, rank, ev, [&](std::int64_t id, std::int64_t need) {
    b.event(id, static_cast<std::int32_t>(need), pass == Pass::forward ? TaskKind::combine_node_put : TaskKind::grad_combine_node_put, -1, -1);
  });
}

// Lent weights: their blocks' events, and one more arrival of each lent
// slot's row tiles (after the tiles' own events are set).
void StepEmitter::lend_events() {
  lent_events(c, ex, pass, rank, ev, [&](std::int64_t id, std::int64_t need, std::int64_t e) {
    b.event(id, static_cast<std::int32_t>(need), pass == Pass::forward ? TaskKind::weight_relay : TaskKind::grad_weight_relay, e, -1);
  }, [&](std::int64_t id) { ++p.events[static_cast<std::size_t>(id)].required; });
}

// The per-rank combine: slot j's outputs written, and through a relay slot
// j - 1's: what the sums of the tokens whose last instance here is j wait for.
void StepEmitter::slot_done_events(TaskKind consumer) {
  for (std::int64_t j = 0; j < L; ++j)
    b.event(ev.slot_done + j, static_cast<std::int32_t>(ex.tiles_of(homes[static_cast<std::size_t>(j)]) * n_down + (j > 0)),
            consumer, mine[static_cast<std::size_t>(j)], -1);
}

// The relays into slot j, emitted just before slot j's gathers: in
// generation order (which is topological) after the puts and relays that
// feed them, and in a worker's queue no earlier than the work they release.
void StepEmitter::relays_into(std::int64_t j) {
  if (!by_rank || j == 0) return;
  const TaskKind relay = pass == Pass::forward ? TaskKind::dispatch_relay : TaskKind::grad_dispatch_relay;
  for (std::int64_t s = 0; s < c.ranks; ++s) {
    if (ex.rank_tokens(s, rank) == 0) continue;
    const std::int32_t need = p.events[static_cast<std::size_t>(ev.tok + s * L + j - 1)].required;
    b.task({.kind = relay, .peer = -1, .src_row = s, .wait_event = need > 0 ? ev.tok + s * L + j - 1 : -1, .wait_count = need,
            .trigger_event = ev.tok + s * L + j});
  }
}

// The relay into slot j + 1, after slot j's tasks in generation order.
void StepEmitter::slot_relay(std::int64_t j) {
  if (!by_rank || j + 1 >= L) return;
  const std::int64_t need = required(ev.slot_done + j);
  b.task({.kind = pass == Pass::forward ? TaskKind::combine_relay : TaskKind::grad_combine_relay, .peer = -1,
          .wait_event = need > 0 ? ev.slot_done + j : -1, .wait_count = need, .trigger_event = ev.slot_done + j + 1});
}

// The per-rank combine's gate gradients: pieces of whole lists, one per tile
// of rows of each block this rank sent.
std::int64_t StepEmitter::gate_grad_pieces_into() const {
  std::int64_t n = 0;
  for (std::int64_t d = 0; d < c.ranks; ++d) n += ceil_div(ex.rank_tokens(rank, d), TR);
  return n;
}

// Split experts' partial rows, reduced in place once every piece is back:
// one task per row tile of each declared reduction's target block.
std::int64_t StepEmitter::part_reduces(TaskKind kind, BufferId buffer, std::int64_t wait_event, bool emit_tasks) {
  std::int64_t n = 0;
  for (const Reduction& red : p.reductions)
    for (std::int64_t r = 0; r < red.rows; r += TR, ++n)
      if (emit_tasks)
        b.task({.kind = kind, .src = buffer, .dst = buffer, .row_begin = red.row_begin + r, .rows = std::min(TR, red.rows - r), .col_begin = 0, .cols = H, .src_row = red.row_begin + red.rows + r, .wait_event = wait_event, .wait_count = p.events[static_cast<std::size_t>(wait_event)].required, .trigger_event = ev.reduced});
  return n;
}

// What this rank sends before any expert work: lent weights, its rows to
// the experts' homes, and (a forwarder) its node's forwards.
void StepEmitter::first_hop() {
  lent_weight_puts(c, ex, pass, rank, -1, emit);
  puts_to_experts(c, ex, TR, pass, rank, -1, emit);
  node_forwards(c, ex, TR, pass, rank, -1, true, required, emit);
}

// The last reduction: a token tile's rows by slot, scattered over every
// expert's returned rows; counts alone do not say which pieces hold them,
// so each tile waits for all pieces (and the shared expert, the router),
// and for the split experts' partials to be reduced.
void StepEmitter::final_reduces(TaskKind kind, BufferId source, BufferId out, std::int64_t wait_event) {
  for (std::int64_t t = 0; t < token_tiles; ++t) {
    const std::int64_t rows = std::min(TR, T - t * TR);
    b.task({.kind = kind, .src = source, .dst = out, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = H, .src_row = t * TR, .wait_event = wait_event, .wait_count = p.events[static_cast<std::size_t>(wait_event)].required});
  }
}

// A routed slot's row tiles' chain of events: its rows arrived (through a
// decode where the dispatch is staged: the pieces land encoded, one decode
// per tile fills the GEMM's rows), its first GEMM's tiles done, its vector
// step done, its second GEMM's tiles done (what the per-assignment return
// waits for).
void StepEmitter::tile_events(std::int64_t le, const TileChain& k) {
  const std::int64_t e = mine[static_cast<std::size_t>(le)], home = homes[static_cast<std::size_t>(le)];
  const std::int64_t tiles = ex.tiles_of(home), tb = ex.tile_start(home);
  for (std::int64_t i = 0; i < tiles; ++i) {
    if (staged) {
      b.event(ev.staged + tb + i, ex.arrivals(home, i), k.decode, e, i);
      b.event(k.arrived + tb + i, 1, k.first, e, i);
    } else {
      b.event(k.arrived + tb + i, ex.arrivals(home, i), k.first, e, i);
    }
    b.event(k.first_done + tb + i, static_cast<std::int32_t>(k.first_tiles), k.step, e, i);
    b.event(k.step_done + tb + i, 1, k.second, e, i);
    if (!by_rank) b.event(k.out_done + tb + i, static_cast<std::int32_t>(n_down), k.give_back, e, i);
  }
}

// ---- forward ----

void StepEmitter::forward_events() {
  for (std::int64_t le = 0; le < L; ++le)
    tile_events(le, {ev.recv, ev.h, ev.a, ev.y, ceil_div(2 * inter_of(le), TC), TaskKind::dispatch_decode, TaskKind::gemm_gate_up,
                     TaskKind::swiglu, TaskKind::gemm_down, TaskKind::combine_put});
  lend_events();
  if (by_rank) slot_done_events(TaskKind::combine_rank_put);
  b.event(ev.comb_done,
          static_cast<std::int32_t>((by_rank ? sum_pieces_into(ex, TR, rank) : ex.pieces_into(rank)) + (shared ? token_tiles * n_down : 0)),
          by_rank ? TaskKind::combine_rank_reduce : p.reductions.empty() ? TaskKind::combine_reduce : TaskKind::part_reduce, -1, -1);
  b.event(ev.reduced, static_cast<std::int32_t>(part_reduces(TaskKind::part_reduce, BufferId::comb, ev.comb_done, false)),
          TaskKind::combine_reduce, -1, -1);
  if (shared)
    for (std::int64_t t = 0; t < token_tiles; ++t) {
      b.event(ev.sh_h + t, static_cast<std::int32_t>(ceil_div(2 * Is, TC)), TaskKind::shared_swiglu, -1, t);
      b.event(ev.sh_a + t, 1, TaskKind::shared_down, -1, t);
    }
}

void StepEmitter::shared_forward() {
  for (std::int64_t t = 0; t < token_tiles; ++t) {
    const std::int64_t rows = std::min(TR, T - t * TR);
    b.gemm_tiles(rows, 2 * Is, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::shared_gate_up, .src = BufferId::x, .dst = BufferId::sh_h, .row_begin = t * TR, .rows = rows, .col_begin = j, .cols = n, .src_row = t * TR, .trigger_event = ev.sh_h + t});
    });
    b.task({.kind = TaskKind::shared_swiglu, .src = BufferId::sh_h, .dst = BufferId::sh_a, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = Is, .src_row = t * TR, .wait_event = ev.sh_h + t, .wait_count = ceil_div(2 * Is, TC), .trigger_event = ev.sh_a + t});
    b.gemm_tiles(rows, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::shared_down, .src = BufferId::sh_a, .dst = BufferId::sh_y, .row_begin = t * TR, .rows = rows, .col_begin = j, .cols = n, .src_row = t * TR, .wait_event = ev.sh_a + t, .wait_count = 1, .trigger_event = ev.comb_done});
    });
  }
}

// Slot le's row tiles in the order their rows arrive, not in row order. An
// instance's rows are its sources' blocks in rank order, and source s puts
// to its destinations in rotated order, reaching this rank after
// (rank - s) mod P of its other puts (this rank's own rows first). In row
// order every destination would compute source 0's rows first and return
// them first: at large EP every rank's returns converge on one source at
// a time, and each first tile waits for the put that arrives last. A tile
// is keyed by its latest source; ties keep row order. Tiles are
// independent (each writes its own rows; the weight gradients sum in row
// order whatever the queue order), so the bits do not change.
void StepEmitter::expert_forward(std::int64_t le) {
  const std::int64_t e = mine[static_cast<std::size_t>(le)], home = homes[static_cast<std::size_t>(le)];
  const std::int64_t n_e = ex.expert_rows(home), start = ex.expert_start(home), tb = ex.tile_start(home);
  const std::int64_t Ie = inter_of(le), n_gate_up = ceil_div(2 * Ie, TC);
  relays_into(le);
  lent_relays(c, ex, pass, home, ev, emit);
  for (const std::int64_t i : arrival_tile_order(c, ex, home, rank)) {
    const std::int64_t rows = std::min(TR, n_e - i * TR), row0 = start + i * TR;
    if (by_rank) rank_gathers_of_tile(c, ex, p, pass, rank, home, i, ev, emit);
    if (staged)
      b.task({.kind = TaskKind::dispatch_decode, .src = BufferId::recv_staged, .dst = BufferId::recv, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = H, .src_row = row0, .wait_event = ev.staged + tb + i, .wait_count = p.events[static_cast<std::size_t>(ev.staged + tb + i)].required, .trigger_event = ev.recv + tb + i});
    b.gemm_tiles(rows, 2 * Ie, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_gate_up, .src = BufferId::recv, .dst = BufferId::h1, .expert = e, .row_begin = row0, .rows = rows, .col_begin = j, .cols = n, .src_row = row0, .wait_event = ev.recv + tb + i, .wait_count = p.events[ev.recv + tb + i].required, .trigger_event = ev.h + tb + i});
    });
    b.task({.kind = TaskKind::swiglu, .src = BufferId::h1, .dst = BufferId::a, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = Ie, .src_row = row0, .wait_event = ev.h + tb + i, .wait_count = n_gate_up, .trigger_event = ev.a + tb + i});
    b.gemm_tiles(rows, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_down, .src = BufferId::a, .dst = BufferId::y, .expert = e, .row_begin = row0, .rows = rows, .col_begin = j, .cols = n, .src_row = row0, .wait_event = ev.a + tb + i, .wait_count = 1, .trigger_event = by_rank ? ev.slot_done + le : ev.y + tb + i});
    });
  }
  slot_relay(le);
}

void StepEmitter::forward() {
  forward_events();
  first_hop();
  if (shared) shared_forward();
  for (std::int64_t le = 0; le < L; ++le) expert_forward(le);
  puts_to_sources(c, ex, TR, pass, rank, -1, ev.y, n_down, required, emit);
  node_combines(c, ex, TR, pass, rank, -1, true, required, emit);
  part_reduces(TaskKind::part_reduce, BufferId::comb, ev.comb_done, true);
  final_reduces(by_rank ? TaskKind::combine_rank_reduce : TaskKind::combine_reduce, by_rank ? BufferId::comb_rank : BufferId::comb,
                BufferId::out, p.reductions.empty() ? ev.comb_done : ev.reduced);
}

// ---- backward ----

void StepEmitter::backward_events() {
  const std::int64_t n_router_dgrad = token_tiles * n_down;
  const std::int64_t n_shared_dgrad = shared ? token_tiles * n_down : 0;
  for (std::int64_t le = 0; le < L; ++le) {
    const std::int64_t e = mine[static_cast<std::size_t>(le)], home = homes[static_cast<std::size_t>(le)];
    const std::int64_t tiles = ex.tiles_of(home);
    tile_events(le, {ev.dy, ev.da, ev.dh, ev.dxe, ceil_div(inter_of(le), TC), TaskKind::grad_dispatch_decode,
                     TaskKind::gemm_down_dgrad, TaskKind::swiglu_bwd, TaskKind::gemm_gate_up_dgrad, TaskKind::grad_combine_put});
    b.event(ev.dy_packed + le, static_cast<std::int32_t>(tiles), TaskKind::gemm_down_wgrad, e, -1);
    b.event(ev.dh_packed + le, static_cast<std::int32_t>(tiles), TaskKind::gemm_gate_up_wgrad, e, -1);
  }
  lend_events();
  for (std::int64_t t = 0; t < token_tiles; ++t) b.event(ev.gw + t, 1, TaskKind::router_bwd, -1, t);
  b.event(ev.dl_all, static_cast<std::int32_t>(token_tiles), TaskKind::router_dgrad, -1, -1);
  if (shared) {
    for (std::int64_t t = 0; t < token_tiles; ++t) {
      b.event(ev.sh_da + t, static_cast<std::int32_t>(ceil_div(Is, TC)), TaskKind::shared_swiglu_bwd, -1, t);
      b.event(ev.sh_dh + t, 1, TaskKind::shared_gate_up_dgrad, -1, t);
    }
    b.event(ev.sh_dout_packed, static_cast<std::int32_t>(token_tiles), TaskKind::shared_down_wgrad, -1, -1);
    b.event(ev.sh_dh_packed, static_cast<std::int32_t>(token_tiles), TaskKind::shared_gate_up_wgrad, -1, -1);
  }
  if (by_rank) {
    slot_done_events(TaskKind::grad_combine_rank_put);
    b.event(ev.gw_done, static_cast<std::int32_t>(gate_grad_pieces_into()), TaskKind::gate_grad_gather, -1, -1);
  }
  b.event(ev.dx_ready, static_cast<std::int32_t>((by_rank ? sum_pieces_into(ex, TR, rank) : ex.pieces_into(rank)) + n_router_dgrad + n_shared_dgrad),
          by_rank ? TaskKind::grad_rank_reduce : p.reductions.empty() ? TaskKind::grad_reduce : TaskKind::grad_part_reduce, -1, -1);
  b.event(ev.reduced, static_cast<std::int32_t>(part_reduces(TaskKind::grad_part_reduce, BufferId::dcomb, ev.dx_ready, false)),
          TaskKind::grad_reduce, -1, -1);
}

// Router: gate-weight gradients, logits gradients, then its GEMMs. Under
// the per-rank combine the gate gradients come back from the experts'
// ranks (and this rank's own puts of them are generated after the expert
// work): the router follows them.
void StepEmitter::router() {
  for (std::int64_t t = 0; t < token_tiles; ++t) {
    const std::int64_t rows = std::min(TR, T - t * TR);
    if (by_rank)  // the gate gradients come back from the experts' ranks
      b.task({.kind = TaskKind::gate_grad_gather, .src = BufferId::gw_rank, .dst = BufferId::gw, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = c.top_k, .src_row = t * TR, .wait_event = ev.gw_done, .wait_count = required(ev.gw_done), .trigger_event = ev.gw + t});
    else
      b.task({.kind = TaskKind::gate_grad, .src = BufferId::comb, .dst = BufferId::gw, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = c.top_k, .src_row = t * TR, .trigger_event = ev.gw + t});
    b.task({.kind = TaskKind::router_bwd, .src = BufferId::gw, .dst = BufferId::dlogits, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = E, .src_row = t * TR, .wait_event = ev.gw + t, .wait_count = 1, .trigger_event = ev.dl_all});
  }
  b.gemm_tiles(T, H, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n) {
    b.task({.kind = TaskKind::router_dgrad, .src = BufferId::dlogits, .dst = BufferId::rdx, .row_begin = i, .rows = rows, .col_begin = j, .cols = n, .src_row = i, .wait_event = ev.dl_all, .wait_count = token_tiles, .trigger_event = ev.dx_ready});
  });
  b.weight_tiles(H, E, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n) {
    b.task({.kind = TaskKind::router_wgrad, .src = BufferId::xtf, .dst = BufferId::dwg, .row_begin = i, .rows = rows, .col_begin = j, .cols = n, .src_row = 0, .wait_event = ev.dl_all, .wait_count = token_tiles});
  });
}

void StepEmitter::shared_backward() {
  for (std::int64_t t = 0; t < token_tiles; ++t) {
    const std::int64_t rows = std::min(TR, T - t * TR);
    b.gemm_tiles(rows, Is, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::shared_down_dgrad, .src = BufferId::dout, .dst = BufferId::sh_da, .row_begin = t * TR, .rows = rows, .col_begin = j, .cols = n, .src_row = t * TR, .trigger_event = ev.sh_da + t});
    });
    b.task({.kind = TaskKind::pack_shared_down_grad, .src = BufferId::dout, .dst = BufferId::sh_doutp, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = H, .src_row = t * TR, .trigger_event = ev.sh_dout_packed});
    b.task({.kind = TaskKind::shared_swiglu_bwd, .src = BufferId::sh_da, .dst = BufferId::sh_dh, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = 2 * Is, .src_row = t * TR, .wait_event = ev.sh_da + t, .wait_count = ceil_div(Is, TC), .trigger_event = ev.sh_dh + t});
    b.gemm_tiles(rows, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::shared_gate_up_dgrad, .src = BufferId::sh_dh, .dst = BufferId::sdx, .row_begin = t * TR, .rows = rows, .col_begin = j, .cols = n, .src_row = t * TR, .wait_event = ev.sh_dh + t, .wait_count = 1, .trigger_event = ev.dx_ready});
    });
    b.task({.kind = TaskKind::pack_shared_gate_up_grad, .src = BufferId::sh_dh, .dst = BufferId::sh_dhp, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = 2 * Is, .src_row = t * TR, .wait_event = ev.sh_dh + t, .wait_count = 1, .trigger_event = ev.sh_dh_packed});
  }
  b.weight_tiles(Is, H, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n) {
    b.task({.kind = TaskKind::shared_down_wgrad, .src = BufferId::sh_at, .dst = BufferId::dws2, .row_begin = i, .rows = rows, .col_begin = j, .cols = n, .src_row = 0, .wait_event = ev.sh_dout_packed, .wait_count = token_tiles});
  });
  b.weight_tiles(H, 2 * Is, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n) {
    b.task({.kind = TaskKind::shared_gate_up_wgrad, .src = BufferId::sh_xt, .dst = BufferId::dws1, .row_begin = i, .rows = rows, .col_begin = j, .cols = n, .src_row = 0, .wait_event = ev.sh_dh_packed, .wait_count = token_tiles});
  });
}

// Slot le's data-gradient chain per row tile (in arrival order, as the
// forward's), then its weight gradients: one task per output tile, K = all
// its rows.
void StepEmitter::expert_backward(std::int64_t le) {
  const std::int64_t e = mine[static_cast<std::size_t>(le)], home = homes[static_cast<std::size_t>(le)];
  const std::int64_t n_e = ex.expert_rows(home), start = ex.expert_start(home);
  const std::int64_t tb = ex.tile_start(home), tiles = ex.tiles_of(home);
  relays_into(le);
  lent_relays(c, ex, pass, home, ev, emit);
  const std::int64_t Ie = inter_of(le), n_inter = ceil_div(Ie, TC);
  for (const std::int64_t i : arrival_tile_order(c, ex, home, rank)) {
    const std::int64_t rows = std::min(TR, n_e - i * TR), row0 = start + i * TR;
    if (by_rank) rank_gathers_of_tile(c, ex, p, pass, rank, home, i, ev, emit);
    if (staged)
      b.task({.kind = TaskKind::grad_dispatch_decode, .src = BufferId::dy_staged, .dst = BufferId::dy, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = H, .src_row = row0, .wait_event = ev.staged + tb + i, .wait_count = p.events[static_cast<std::size_t>(ev.staged + tb + i)].required, .trigger_event = ev.dy + tb + i});
    const std::int32_t arrivals = p.events[ev.dy + tb + i].required;
    b.gemm_tiles(rows, Ie, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_down_dgrad, .src = BufferId::dy, .dst = BufferId::da, .expert = e, .row_begin = row0, .rows = rows, .col_begin = j, .cols = n, .src_row = row0, .wait_event = ev.dy + tb + i, .wait_count = arrivals, .trigger_event = ev.da + tb + i});
    });
    b.task({.kind = TaskKind::pack_down_grad, .src = BufferId::dy, .dst = BufferId::dyp, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = H, .src_row = row0, .wait_event = ev.dy + tb + i, .wait_count = arrivals, .trigger_event = ev.dy_packed + le});
    b.task({.kind = TaskKind::swiglu_bwd, .src = BufferId::da, .dst = BufferId::dh, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = 2 * Ie, .src_row = row0, .wait_event = ev.da + tb + i, .wait_count = n_inter, .trigger_event = ev.dh + tb + i});
    b.gemm_tiles(rows, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_gate_up_dgrad, .src = BufferId::dh, .dst = BufferId::dxe, .expert = e, .row_begin = row0, .rows = rows, .col_begin = j, .cols = n, .src_row = row0, .wait_event = ev.dh + tb + i, .wait_count = 1, .trigger_event = by_rank ? ev.slot_done + le : ev.dxe + tb + i});
    });
    b.task({.kind = TaskKind::pack_gate_up_grad, .src = BufferId::dh, .dst = BufferId::dhp, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = 2 * Ie, .src_row = row0, .wait_event = ev.dh + tb + i, .wait_count = 1, .trigger_event = ev.dh_packed + le});
  }
  slot_relay(le);
  b.weight_tiles(Ie, H, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n) {
    b.task({.kind = TaskKind::gemm_down_wgrad, .src = BufferId::at, .dst = BufferId::dw2, .expert = e, .row_begin = le * I + i, .rows = rows, .col_begin = j, .cols = n, .src_row = start, .wait_event = ev.dy_packed + le, .wait_count = tiles});
  });
  b.weight_tiles(H, 2 * Ie, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n) {
    b.task({.kind = TaskKind::gemm_gate_up_wgrad, .src = BufferId::xt, .dst = BufferId::dw1, .expert = e, .row_begin = le * H + i, .rows = rows, .col_begin = j, .cols = n, .src_row = start, .wait_event = ev.dh_packed + le, .wait_count = tiles});
  });
}

void StepEmitter::backward() {
  backward_events();
  first_hop();
  if (!by_rank) router();
  if (shared) shared_backward();
  for (std::int64_t le = 0; le < L; ++le) expert_backward(le);
  if (by_rank) {
    puts_to_sources(c, ex, TR, pass, rank, -1, ev.dxe, n_down, required, emit, ReturnPuts::gate_grads);
    router();
    puts_to_sources(c, ex, TR, pass, rank, -1, ev.dxe, n_down, required, emit, ReturnPuts::sums);
    node_combines(c, ex, TR, pass, rank, -1, true, required, emit);
  } else {
    puts_to_sources(c, ex, TR, pass, rank, -1, ev.dxe, n_down, required, emit);
  }
  part_reduces(TaskKind::grad_part_reduce, BufferId::dcomb, ev.dx_ready, true);
  final_reduces(by_rank ? TaskKind::grad_rank_reduce : TaskKind::grad_reduce, by_rank ? BufferId::dcomb_rank : BufferId::dcomb,
                BufferId::dx, p.reductions.empty() ? ev.dx_ready : ev.reduced);
}

}  // namespace

void generate(Program& p, const LayerConfig& c, const Exchange& ex, const Machine& m, Pass pass, std::int64_t rank) {
  // Reuse the vectors' storage: a rank recompiles every step.
  p.tasks.clear();
  p.cost.clear();
  p.events.clear();
  program_header(p, c, ex, m, pass, rank);
  StepEmitter step(p, c, ex, m, pass, rank);
  p.events.assign(static_cast<std::size_t>(step.ev.total), Event{0, TaskKind::count, -1, -1});
  step.exchange_events();
  if (pass == Pass::forward) step.forward();
  else step.backward();
}

}  // namespace hpmoe::taskflow
