// One rank's program of one pass: the events of its tiles, then its tasks
// in generation order (which is topological): the exchange's first hop, the
// shared experts, each slot's row tiles in the order their rows arrive, the
// returns and the reductions. What differs between the exchanges is asked
// of the scheme the run options choose (SchemeSteps, generate_step.hpp):
// each scheme's own file writes its own kinds.
#include "compiler/generate_step.hpp"
#include "compiler/schedule_queues.hpp"

#include <algorithm>

#include "hpmoe/error.hpp"

namespace hpmoe::taskflow {

StepEmitter::StepEmitter(Program& program, const LayerConfig& layer, const Exchange& exchange, const Machine& machine,
                         Pass p_, std::int64_t r)
    : p(program), c(layer), ex(exchange), m(machine), pass(p_), forward_pass(p_ == Pass::forward), rank(r),
      mine(ex.placement().experts_of(rank)), homes(ex.placement().instances_of(rank)), H(c.hidden), I(c.expert_inter),
      Is(c.shared_inter_total()), L(static_cast<std::int64_t>(mine.size())), T(c.tokens_per_rank), E(c.routed_experts),
      TR(m.tile_rows), TC(m.tile_cols), shared(c.shared_experts > 0), staged(staged_in(c, pass)),
      token_tiles(ceil_div(T, TR)), n_down(ceil_div(H, TC)), ev(event_bases(c, ex, pass, rank)), scheme(scheme_steps(c)),
      b(p, m), emit([this](const TaskSpec& s) { b.task(s); }),
      required([this](std::int64_t event) { return std::int64_t{p.events[static_cast<std::size_t>(event)].required}; }) {}

void SchemeSteps::arrival_event(StepEmitter& s, std::int64_t le, std::int64_t tile, std::int64_t arrived,
                                TaskKind first) const {
  const std::int64_t home = s.home_of(le);
  s.b.event(arrived + s.ex.tile_start(home) + tile, s.ex.arrivals(home, tile), first, s.expert_of(le), tile);
}

const SchemeSteps& scheme_steps(const LayerConfig& c) {
  return c.exchange == ExchangeMode::rank ? rank_steps() : assignment_steps();
}

// Lent weights: their blocks' events, and one more arrival of each lent
// slot's row tiles (after the tiles' own events are set).
void StepEmitter::lend_events() {
  lent_events(c, ex, pass, rank, ev, [&](std::int64_t id, std::int64_t need, std::int64_t e, TaskKind consumer) {
    b.event(id, static_cast<std::int32_t>(need), consumer, e, -1);
  }, [&](std::int64_t id) { ++p.events[static_cast<std::size_t>(id)].required; });
}

// What this rank sends before any expert work: lent weights, then its rows
// to the experts' homes (and a forwarder's forwards).
void StepEmitter::first_hop() {
  lent_weight_puts(c, ex, pass, rank, -1, emit);
  scheme.first_hop(*this);
}

// The rows that come back (and the step's own partial sums: the shared
// experts', the router's), and the split experts' sums of them.
void StepEmitter::combined_events(std::int64_t base_pieces) {
  const std::int64_t combined = forward_pass ? ev.comb_done : ev.dx_ready;
  b.event(combined, static_cast<std::int32_t>(scheme.returned_pieces(*this) + base_pieces), scheme.combined_consumer(*this), -1, -1);
  b.event(ev.reduced, static_cast<std::int32_t>(scheme.split_sums(*this, false)), scheme.final_reduce(*this), -1, -1);
}

// The last reduction: a run of tokens' rows by slot, scattered over every
// expert's returned rows; counts alone do not say which pieces hold them,
// so each task waits for all pieces (and the shared expert, the router),
// and for the split experts' partials to be reduced.
//
// Nothing runs beside them and nothing after them but the step's end, so
// they come in even waves over the workers that take them (the vector
// workers, and where they run vector code the matrix workers:
// reduction_workers): as many waves as token tiles would take, each task
// as many rows as makes them even (rounded up to 8). The H800 model's 132
// SMs reduce 4096 tokens in 128 tasks of 32 rows, one wave (its 24 vector
// units alone took two waves of 88 rows). Each token's sum is the same
// arithmetic in any tiling; the CPU runtime's two workers keep their tiles
// where the token tiles are even (4096 tokens: 16 waves of 128 rows).
static std::int64_t final_reduce_rows(std::int64_t T, std::int64_t TR, std::int64_t workers) {
  const std::int64_t V = std::max<std::int64_t>(1, workers);
  const std::int64_t waves = ceil_div(ceil_div(T, TR), V);
  return std::min(TR, ceil_div(ceil_div(T, waves * V), 8) * 8);
}

void StepEmitter::final_reduces(BufferId out, std::int64_t combined) {
  const std::int64_t wait_event = p.reductions.empty() ? combined : ev.reduced;
  const TaskKind kind = scheme.final_reduce(*this);
  const BufferId source = scheme.final_source(*this);
  const std::int64_t step = final_reduce_rows(T, TR, static_cast<std::int64_t>(reduction_workers(m)));
  for (std::int64_t t = 0; t < T; t += step) {
    const std::int64_t rows = std::min(step, T - t);
    b.task({.kind = kind, .src = source, .dst = out, .row_begin = t, .rows = rows, .col_begin = 0, .cols = H, .src_row = t, .wait_event = wait_event, .wait_count = p.events[static_cast<std::size_t>(wait_event)].required});
  }
}

// A routed slot's row tiles' chain of events: its rows arrived (the
// scheme's: a staged dispatch's pieces land encoded, one decode per tile
// fills the GEMM's rows), its first GEMM's tiles done, its vector step done.
void StepEmitter::tile_events(std::int64_t le, const TileChain& k) {
  const std::int64_t e = expert_of(le), home = home_of(le);
  const std::int64_t tiles = ex.tiles_of(home), tb = ex.tile_start(home);
  for (std::int64_t i = 0; i < tiles; ++i) {
    scheme.arrival_event(*this, le, i, k.arrived, k.first);
    b.event(k.first_done + tb + i, static_cast<std::int32_t>(k.first_tiles), k.step, e, i);
    b.event(k.step_done + tb + i, 1, k.second, e, i);
  }
}

// ---- forward ----

void StepEmitter::forward_events() {
  for (std::int64_t le = 0; le < L; ++le)
    tile_events(le, {ev.recv, ev.h, ev.a, ceil_div(2 * inter_of(le), TC), TaskKind::gemm_gate_up, TaskKind::swiglu,
                     TaskKind::gemm_down});
  lend_events();
  scheme.output_events(*this);
  combined_events(shared ? token_tiles * n_down : 0);
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
  const std::int64_t e = expert_of(le), home = home_of(le);
  const std::int64_t n_e = ex.expert_rows(home), start = ex.expert_start(home), tb = ex.tile_start(home);
  const std::int64_t Ie = inter_of(le), n_gate_up = ceil_div(2 * Ie, TC);
  scheme.before_slot(*this, le);
  lent_relays(c, ex, pass, home, ev, emit);
  for (const std::int64_t i : arrival_tile_order(c, ex, home, rank)) {
    const std::int64_t rows = std::min(TR, n_e - i * TR), row0 = start + i * TR;
    scheme.before_tile(*this, le, i);
    b.gemm_tiles(rows, 2 * Ie, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_gate_up, .src = BufferId::recv, .dst = BufferId::h1, .expert = e, .row_begin = row0, .rows = rows, .col_begin = j, .cols = n, .src_row = row0, .wait_event = ev.recv + tb + i, .wait_count = p.events[ev.recv + tb + i].required, .trigger_event = ev.h + tb + i});
    });
    b.task({.kind = TaskKind::swiglu, .src = BufferId::h1, .dst = BufferId::a, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = Ie, .src_row = row0, .wait_event = ev.h + tb + i, .wait_count = n_gate_up, .trigger_event = ev.a + tb + i});
    const std::int64_t done = scheme.output_event(*this, le, i);
    b.gemm_tiles(rows, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_down, .src = BufferId::a, .dst = BufferId::y, .expert = e, .row_begin = row0, .rows = rows, .col_begin = j, .cols = n, .src_row = row0, .wait_event = ev.a + tb + i, .wait_count = 1, .trigger_event = done});
    });
  }
  scheme.after_slot(*this, le);
}

void StepEmitter::forward() {
  forward_events();
  first_hop();
  if (shared) shared_forward();
  for (std::int64_t le = 0; le < L; ++le) expert_forward(le);
  scheme.returns(*this);
  scheme.split_sums(*this, true);
  final_reduces(BufferId::out, ev.comb_done);
}

// ---- backward ----

void StepEmitter::backward_events() {
  for (std::int64_t le = 0; le < L; ++le) {
    const std::int64_t e = expert_of(le), tiles = ex.tiles_of(home_of(le));
    tile_events(le, {ev.dy, ev.da, ev.dh, ceil_div(inter_of(le), TC), TaskKind::gemm_down_dgrad, TaskKind::swiglu_bwd,
                     TaskKind::gemm_gate_up_dgrad});
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
  scheme.output_events(*this);
  // dx: the returned rows, the router's and the shared experts' data gradients.
  combined_events(token_tiles * n_down + (shared ? token_tiles * n_down : 0));
}

// Router: gate-weight gradients, logits gradients, then its GEMMs. Under
// the per-rank combine the gate gradients come back from the experts'
// ranks (and this rank's own puts of them are generated after the expert
// work): the router follows them.
void StepEmitter::router() {
  for (std::int64_t t = 0; t < token_tiles; ++t) {
    const std::int64_t rows = std::min(TR, T - t * TR);
    scheme.gate_gradients(*this, t, rows);
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
  const std::int64_t e = expert_of(le), home = home_of(le);
  const std::int64_t n_e = ex.expert_rows(home), start = ex.expert_start(home);
  const std::int64_t tb = ex.tile_start(home), tiles = ex.tiles_of(home);
  scheme.before_slot(*this, le);
  lent_relays(c, ex, pass, home, ev, emit);
  const std::int64_t Ie = inter_of(le), n_inter = ceil_div(Ie, TC);
  for (const std::int64_t i : arrival_tile_order(c, ex, home, rank)) {
    const std::int64_t rows = std::min(TR, n_e - i * TR), row0 = start + i * TR;
    scheme.before_tile(*this, le, i);
    const std::int32_t arrivals = p.events[ev.dy + tb + i].required;
    b.gemm_tiles(rows, Ie, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_down_dgrad, .src = BufferId::dy, .dst = BufferId::da, .expert = e, .row_begin = row0, .rows = rows, .col_begin = j, .cols = n, .src_row = row0, .wait_event = ev.dy + tb + i, .wait_count = arrivals, .trigger_event = ev.da + tb + i});
    });
    b.task({.kind = TaskKind::pack_down_grad, .src = BufferId::dy, .dst = BufferId::dyp, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = H, .src_row = row0, .wait_event = ev.dy + tb + i, .wait_count = arrivals, .trigger_event = ev.dy_packed + le});
    b.task({.kind = TaskKind::swiglu_bwd, .src = BufferId::da, .dst = BufferId::dh, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = 2 * Ie, .src_row = row0, .wait_event = ev.da + tb + i, .wait_count = n_inter, .trigger_event = ev.dh + tb + i});
    const std::int64_t done = scheme.output_event(*this, le, i);
    b.gemm_tiles(rows, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_gate_up_dgrad, .src = BufferId::dh, .dst = BufferId::dxe, .expert = e, .row_begin = row0, .rows = rows, .col_begin = j, .cols = n, .src_row = row0, .wait_event = ev.dh + tb + i, .wait_count = 1, .trigger_event = done});
    });
    b.task({.kind = TaskKind::pack_gate_up_grad, .src = BufferId::dh, .dst = BufferId::dhp, .expert = e, .row_begin = row0, .rows = rows, .col_begin = 0, .cols = 2 * Ie, .src_row = row0, .wait_event = ev.dh + tb + i, .wait_count = 1, .trigger_event = ev.dh_packed + le});
  }
  scheme.after_slot(*this, le);
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
  if (scheme.router_first()) router();
  if (shared) shared_backward();
  for (std::int64_t le = 0; le < L; ++le) expert_backward(le);
  scheme.returns(*this);
  scheme.split_sums(*this, true);
  final_reduces(BufferId::dx, ev.dx_ready);
}

void StepEmitter::run() {
  if (forward_pass) forward();
  else backward();
}

void generate(Program& p, const LayerConfig& c, const Exchange& ex, const Machine& m, Pass pass, std::int64_t rank) {
  // Reuse the vectors' storage: a rank recompiles every step.
  p.tasks.clear();
  p.cost.clear();
  p.events.clear();
  program_header(p, c, ex, m, pass, rank);
  StepEmitter step(p, c, ex, m, pass, rank);
  p.events.assign(static_cast<std::size_t>(step.ev.total), Event{0, TaskKind::count, -1, -1});
  step.scheme.events(step);
  step.run();
}

}  // namespace hpmoe::taskflow
