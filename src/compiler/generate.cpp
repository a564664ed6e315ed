#include <algorithm>
#include <numeric>

#include "ops/access.hpp"
#include "hpmoe/error.hpp"
#include "compiler/taskflow.hpp"
#include "compiler/layout.hpp"
#include "compiler/generate_parts.hpp"

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

}  // namespace

Program generate(const LayerConfig& c, const ExpertPlacement& placement, const RoutingCounts& counts, const Machine& m,
                 Pass pass, std::int64_t rank) {
  Program p;
  generate_into(p, c, placement, counts, m, pass, rank);
  return p;
}

void generate_into(Program& p, const LayerConfig& c, const ExpertPlacement& placement, const RoutingCounts& counts,
                   const Machine& m, Pass pass, std::int64_t rank) {
  c.validate();
  if (rank < 0 || rank >= c.ranks) throw Error("rank " + std::to_string(rank) + " is outside 0.." + std::to_string(c.ranks - 1));
  generate(p, c, Exchange(c, placement, counts, m.tile_rows), m, pass, rank);
}

bool staged_in(const LayerConfig& c, Pass pass) {
  // The per-rank exchange decodes in its gather: no staged tiles.
  if (c.exchange == ExchangeMode::rank) return false;
  return pass == Pass::forward ? c.staged_dispatch() : c.staged_grad_dispatch();
}

EventBases event_bases(const LayerConfig& c, const Exchange& ex, Pass pass, std::int64_t rank) {
  EventBases b(pass, ex.row_tiles(rank), ex.placement().local_count(rank), ceil_div(c.tokens_per_rank, ex.tile_rows()),
               staged_in(c, pass), c.exchange == ExchangeMode::rank ? c.ranks * ex.placement().local_count(rank) : 0,
               c.exchange == ExchangeMode::rank, ex.forwards() ? c.ranks * ex.node_slots() : 0, ex.forwards() ? c.ranks : 0);
  b.lent = b.total;  // the lent blocks' events last, one per block
  b.total += ex.placement().lent_count(rank);
  return b;
}

void arrival_keys(const LayerConfig& c, const Exchange& ex, std::int64_t home, std::int64_t rank, std::vector<std::int64_t>& key) {
  const std::int64_t TR = ex.tile_rows(), P = c.ranks, rows = ex.expert_rows(home);
  key.assign(static_cast<std::size_t>(ex.tiles_of(home)), 0);
  // The source whose block holds row x of the home (blocks in rank order).
  const auto source_of = [&](std::int64_t x) {
    std::int64_t lo = 0, hi = P - 1;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (ex.source_offset(mid, home) <= x) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  };
  // A tile's sources with rows are a run of ranks; (rank - s) mod P falls
  // along it except past `rank`, where it jumps to P - 1 and falls again:
  // its latest is the run's first source's, or the first after `rank`'s.
  const std::int64_t after_rank = rank + 1 < P ? ex.source_offset(rank + 1, home) : rows;
  for (std::int64_t t = 0; t < static_cast<std::int64_t>(key.size()); ++t) {
    const std::int64_t a = t * TR, b = std::min(rows, a + TR);
    const std::int64_t first = source_of(a);
    std::int64_t k = (rank - first + P) % P;
    if (first <= rank && after_rank < b) k = std::max(k, (rank - source_of(after_rank) + P) % P);
    key[static_cast<std::size_t>(t)] = k;
  }
}

std::vector<std::int64_t> arrival_tile_order(const LayerConfig& c, const Exchange& ex, std::int64_t home, std::int64_t rank) {
  std::vector<std::int64_t> key, order(static_cast<std::size_t>(ex.tiles_of(home)));
  arrival_keys(c, ex, home, rank, key);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return key[static_cast<std::size_t>(a)] < key[static_cast<std::size_t>(b)]; });
  return order;
}

namespace {

// Puts of `rank`'s tokens (forward) or output gradients (backward) to every
// expert's owner (only `only_peer`'s when it is >= 0), split at the owner's
// row tiles so that each piece signals exactly the tile it fills.
template <class EmitFn>
void puts_to_experts(const LayerConfig& c, const Exchange& ex, std::int64_t tile_rows, Pass pass, std::int64_t rank,
                     std::int64_t only_peer, EmitFn&& emit) {
  const bool forward = pass == Pass::forward;
  const std::int64_t TR = tile_rows;
  if (c.exchange == ExchangeMode::rank) return rank_puts_to_experts(c, ex, tile_rows, pass, rank, only_peer, emit);
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
template <class EmitFn, class Required>
void puts_to_sources(const LayerConfig& c, const Exchange& ex, std::int64_t tile_rows, Pass pass, std::int64_t rank,
                     std::int64_t only_source, std::int64_t wait_base, std::int64_t wait_count, Required&& wait_count_of,
                     EmitFn&& emit, ReturnPuts which = ReturnPuts::all) {
  const bool forward = pass == Pass::forward;
  const std::int64_t TR = tile_rows;
  if (c.exchange == ExchangeMode::rank)
    return rank_puts_to_sources(c, ex, tile_rows, pass, rank, only_source, wait_base >= 0, wait_count_of, emit, which);
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

}  // namespace

void program_header(Program& p, const LayerConfig& c, const Exchange& ex, const Machine& m, Pass pass, std::int64_t rank) {
  const auto mine = ex.placement().experts_of(rank);
  const std::int64_t E = c.routed_experts;
  p.version = kFormatVersion;
  p.local_experts.assign(mine.begin(), mine.end());
  p.expert_slot.assign(static_cast<std::size_t>(E), -1);
  for (std::size_t le = 0; le < mine.size(); ++le) p.expert_slot[static_cast<std::size_t>(mine[le])] = static_cast<std::int32_t>(le);
  p.pass = pass;
  p.rank = static_cast<std::int32_t>(rank);
  p.ranks = static_cast<std::int32_t>(c.ranks);
  p.machine = m;
  p.dims = Dims{c.hidden, c.expert_inter, c.shared_inter_total(), E, c.top_k, c.tokens_per_rank, c.dtype == DType::bf16 ? 2 : 4};
  if (c.staged_dispatch()) {
    p.dims.dispatch_row_bytes = c.dispatch_row_bytes();
    p.dims.dispatch_format = c.dispatch_dtype == DispatchDType::fp8 ? 1 : 2;
  }
  p.expert_begin.clear();
  p.kpad_begin.clear();
  p.slot_parts.clear();
  const ExpertPlacement& placement = ex.placement();
  for (const std::int64_t i : placement.instances_of(rank)) {
    p.expert_begin.push_back(ex.expert_start(i));
    p.kpad_begin.push_back(ex.kpad_start(i));
    const auto [c0, c1] = placement.part_columns(i, c.expert_inter);
    const std::int64_t e = placement.instance_expert(i);
    p.slot_parts.push_back(SlotPart{c0, c1 - c0, static_cast<std::int32_t>(placement.is_split(e) ? placement.part_of(i) : 0),
                                    static_cast<std::int32_t>(placement.parts(e))});
  }
  // Split experts' partial rows returning to this rank: one declared
  // reduction per split expert this rank's tokens chose.
  p.reductions.clear();
  for (const auto& sp : placement.splits()) {
    if (c.exchange == ExchangeMode::rank) break;  // the per-rank combine sums the parts on their ranks
    const std::int64_t first = placement.first_instance(sp.expert), n = ex.count(rank, first);
    if (n > 0)
      p.reductions.push_back(Reduction{static_cast<std::int32_t>(sp.expert), static_cast<std::int32_t>(placement.parts(sp.expert)),
                                       ex.send_offset(rank, first), n});
  }
  std::sort(p.reductions.begin(), p.reductions.end(),
            [](const Reduction& a, const Reduction& b) { return a.row_begin < b.row_begin; });
  p.lent_block.clear();
  if (placement.lent_count(rank) > 0)
    for (const std::int64_t i : placement.instances_of(rank)) p.lent_block.push_back(static_cast<std::int32_t>(lent_row(ex, pass, i)));
  p.expert_begin.push_back(ex.recv_rows(rank));
  p.kpad_begin.push_back(ex.kpad_rows(rank));
  p.send_rows = ex.send_rows(rank);
  p.token_begin.clear();
  if (c.exchange == ExchangeMode::rank && ex.has_rank_tokens()) {  // every (source, slot) sub-block, then the end
    for (std::int64_t s = 0; s < c.ranks; ++s)
      for (const std::int64_t i : placement.instances_of(rank)) p.token_begin.push_back(ex.token_start(s, rank) + ex.sub_block_offset(s, i));
    p.token_begin.push_back(ex.token_recv_rows(rank));
  }
  p.node_begin.clear();
  p.node_route_begin.clear();
  if (ex.forwards() && ex.has_rank_tokens()) {  // the node blocks of the sources forwarding through this rank
    const std::int64_t b = ex.node_of(rank), S = ex.node_slots(), R = c.ranks / ex.nodes();
    std::int64_t rows = 0, routes = 0;
    for (std::int64_t s = 0; s < c.ranks; ++s) {
      const bool through = ex.forwards_through(s, rank);
      for (std::int64_t j = 0; j < S; ++j) {
        p.node_begin.push_back(rows);
        if (through) rows += ex.node_first(s, b, j);
      }
      for (std::int64_t d = b * R; d < (b + 1) * R; ++d) {
        const auto homes = placement.instances_of(d);
        for (std::int64_t j = 0; j < S; ++j) {
          p.node_route_begin.push_back(routes);
          if (through && j < static_cast<std::int64_t>(homes.size())) routes += ex.first_tokens(s, homes[static_cast<std::size_t>(j)]);
        }
      }
    }
    p.node_begin.push_back(rows);
    p.node_route_begin.push_back(routes);
  }
  declare_buffers(p, c, ex, pass, rank);
}

void interface_puts(const LayerConfig& c, const Exchange& ex, std::int64_t tile_rows, Pass pass, std::int64_t from,
                    std::int64_t to, std::vector<Task>& out) {
  const auto add = [&](const TaskSpec& s) {
    auto i32 = [](std::int64_t v) { return static_cast<std::int32_t>(v); };
    out.push_back(Task{s.kind, queue_class(s.kind), s.src, s.dst, i32(s.expert), i32(s.peer), i32(s.row_begin),
                       i32(s.rows), i32(s.col_begin), i32(s.cols), i32(s.src_row), -1, 0, i32(s.trigger_event)});
  };
  lent_weight_puts(c, ex, pass, from, to, add);
  puts_to_experts(c, ex, tile_rows, pass, from, to, add);
  puts_to_sources(c, ex, tile_rows, pass, from, to, -1, 0, [](std::int64_t) { return std::int64_t{0}; }, add);
  node_forwards(c, ex, tile_rows, pass, from, to, false, [](std::int64_t) { return std::int64_t{0}; }, add);
  node_combines(c, ex, tile_rows, pass, from, to, false, [](std::int64_t) { return std::int64_t{0}; }, add);
}

void generate(Program& p, const LayerConfig& c, const Exchange& ex, const Machine& m, Pass pass, std::int64_t rank) {
  const ExpertPlacement& placement = ex.placement();
  const auto mine = placement.experts_of(rank);  // this rank's experts, in slot order
  const auto homes = placement.instances_of(rank);  // and their instances (the exchange's indexes)
  const std::int64_t H = c.hidden, I = c.expert_inter, Is = c.shared_inter_total(),
                     L = static_cast<std::int64_t>(mine.size()), T = c.tokens_per_rank,
                     E = c.routed_experts, TR = m.tile_rows, TC = m.tile_cols;
  const bool shared = c.shared_experts > 0;
  // Reuse the vectors' storage: a rank recompiles every step.
  p.tasks.clear();
  p.cost.clear();
  p.events.clear();
  program_header(p, c, ex, m, pass, rank);

  const std::int64_t token_tiles = ceil_div(T, TR);
  const bool staged = staged_in(c, pass);
  const EventBases ev = event_bases(c, ex, pass, rank);
  p.events.assign(static_cast<std::size_t>(ev.total), Event{0, TaskKind::count, -1, -1});
  Builder b(p, m);
  const std::int64_t n_down = ceil_div(H, TC);
  // A slot's intermediate width: the whole expert's, or its split part's.
  const auto inter_of = [&](std::int64_t le) { return p.slot_parts[static_cast<std::size_t>(le)].inter; };
  const auto emit = [&](const TaskSpec& s) { b.task(s); };
  const bool by_rank = c.exchange == ExchangeMode::rank;
  // Lent weights: their blocks' events, and one more arrival of each lent
  // slot's row tiles (after the tiles' own events are set).
  const auto lend_events = [&] {
    lent_events(c, ex, pass, rank, ev, [&](std::int64_t id, std::int64_t need, std::int64_t e) {
      b.event(id, static_cast<std::int32_t>(need), pass == Pass::forward ? TaskKind::weight_relay : TaskKind::grad_weight_relay, e, -1);
    }, [&](std::int64_t id) { ++p.events[static_cast<std::size_t>(id)].required; });
  };
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
  // The relays into slot j, emitted just before slot j's gathers: in
  // generation order (which is topological) after the puts and relays that
  // feed them, and in a worker's queue no earlier than the work they release.
  const auto relays_into = [&](std::int64_t j) {
    if (!by_rank || j == 0) return;
    const TaskKind relay = pass == Pass::forward ? TaskKind::dispatch_relay : TaskKind::grad_dispatch_relay;
    for (std::int64_t s = 0; s < c.ranks; ++s) {
      if (ex.rank_tokens(s, rank) == 0) continue;
      const std::int32_t need = p.events[static_cast<std::size_t>(ev.tok + s * L + j - 1)].required;
      b.task({.kind = relay, .peer = -1, .src_row = s, .wait_event = need > 0 ? ev.tok + s * L + j - 1 : -1, .wait_count = need,
              .trigger_event = ev.tok + s * L + j});
    }
  };

  // The per-rank combine: the pieces every rank returns to this one (one
  // per tile of rows of each block this rank sent), and the count an event
  // completes at.
  // pieces of whole lists (the gate gradients) or of each sub-list (the sums).
  const auto gate_grad_pieces_into = [&] {
    std::int64_t n = 0;
    for (std::int64_t d = 0; d < c.ranks; ++d) n += ceil_div(ex.rank_tokens(rank, d), TR);
    return n;
  };
  const auto required = [&](std::int64_t event) { return std::int64_t{p.events[static_cast<std::size_t>(event)].required}; };
  // Slot j's outputs written, and through a relay slot j - 1's: what the
  // sums of the tokens whose last instance here is j wait for.
  const auto slot_done_events = [&](TaskKind consumer) {
    for (std::int64_t j = 0; j < L; ++j)
      b.event(ev.slot_done + j, static_cast<std::int32_t>(ex.tiles_of(homes[static_cast<std::size_t>(j)]) * n_down + (j > 0)),
              consumer, mine[static_cast<std::size_t>(j)], -1);
  };
  // The relay into slot j + 1, after slot j's tasks in generation order.
  const auto slot_relay = [&](std::int64_t j) {
    if (!by_rank || j + 1 >= L) return;
    const std::int64_t need = required(ev.slot_done + j);
    b.task({.kind = pass == Pass::forward ? TaskKind::combine_relay : TaskKind::grad_combine_relay, .peer = -1,
            .wait_event = need > 0 ? ev.slot_done + j : -1, .wait_count = need, .trigger_event = ev.slot_done + j + 1});
  };
  // Row tiles in the order their rows arrive, not in row order. An
  // instance's rows are its sources' blocks in rank order, and source s puts
  // to its destinations in rotated order, reaching this rank after
  // (rank - s) mod P of its other puts (this rank's own rows first). In row
  // order every destination would compute source 0's rows first and return
  // them first: at large EP every rank's returns converge on one source at
  // a time, and each first tile waits for the put that arrives last. A tile
  // is keyed by its latest source; ties keep row order. Tiles are
  // independent (each writes its own rows; the weight gradients sum in row
  // order whatever the queue order), so the bits do not change.
  const auto tile_order = [&](std::int64_t home) { return arrival_tile_order(c, ex, home, rank); };
  const auto gathers = [&](std::int64_t home, std::int64_t tile) {
    if (by_rank) rank_gathers_of_tile(c, ex, p, pass, rank, home, tile, ev, emit);
  };
  // Split experts' partial rows, reduced in place once every piece is back:
  // one task per row tile of each declared reduction's target block.
  const auto part_reduces = [&](TaskKind kind, BufferId buffer, std::int64_t wait_event, bool emit_tasks) {
    std::int64_t n = 0;
    for (const Reduction& red : p.reductions)
      for (std::int64_t r = 0; r < red.rows; r += TR, ++n)
        if (emit_tasks)
          b.task({.kind = kind, .src = buffer, .dst = buffer, .row_begin = red.row_begin + r, .rows = std::min(TR, red.rows - r), .col_begin = 0, .cols = H, .src_row = red.row_begin + red.rows + r, .wait_event = wait_event, .wait_count = p.events[static_cast<std::size_t>(wait_event)].required, .trigger_event = ev.reduced});
    return n;
  };

  if (pass == Pass::forward) {
    // Events of this rank.
    for (std::int64_t le = 0; le < L; ++le) {
      const std::int64_t e = mine[static_cast<std::size_t>(le)], home = homes[static_cast<std::size_t>(le)];
      const std::int64_t tiles = ex.tiles_of(home), tb = ex.tile_start(home), n_gate_up = ceil_div(2 * inter_of(le), TC);
      for (std::int64_t i = 0; i < tiles; ++i) {
        if (staged) {  // the pieces land encoded; one decode per tile fills the GEMM's rows
          b.event(ev.staged + tb + i, ex.arrivals(home, i), TaskKind::dispatch_decode, e, i);
          b.event(ev.recv + tb + i, 1, TaskKind::gemm_gate_up, e, i);
        } else {
          b.event(ev.recv + tb + i, ex.arrivals(home, i), TaskKind::gemm_gate_up, e, i);
        }
        b.event(ev.h + tb + i, static_cast<std::int32_t>(n_gate_up), TaskKind::swiglu, e, i);
        b.event(ev.a + tb + i, 1, TaskKind::gemm_down, e, i);
        if (!by_rank) b.event(ev.y + tb + i, static_cast<std::int32_t>(n_down), TaskKind::combine_put, e, i);
      }
    }
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

    lent_weight_puts(c, ex, pass, rank, -1, emit);
    puts_to_experts(c, ex, TR, pass, rank, -1, emit);
    node_forwards(c, ex, TR, pass, rank, -1, true, required, emit);
    if (shared) {
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
    for (std::int64_t le = 0; le < L; ++le) {
      const std::int64_t e = mine[static_cast<std::size_t>(le)], home = homes[static_cast<std::size_t>(le)];
      const std::int64_t n_e = ex.expert_rows(home), start = ex.expert_start(home), tb = ex.tile_start(home);
      const std::int64_t Ie = inter_of(le), n_gate_up = ceil_div(2 * Ie, TC);
      relays_into(le);
      lent_relays(c, ex, pass, home, ev, emit);
      for (const std::int64_t i : tile_order(home)) {
        const std::int64_t rows = std::min(TR, n_e - i * TR), row0 = start + i * TR;
        gathers(home, i);
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
    puts_to_sources(c, ex, TR, pass, rank, -1, ev.y, n_down, required, emit);
    node_combines(c, ex, TR, pass, rank, -1, true, required, emit);
    part_reduces(TaskKind::part_reduce, BufferId::comb, ev.comb_done, true);
    // A reduce tile reads its tokens' rows by slot, scattered over every
    // expert's returned rows; counts alone do not say which pieces hold them,
    // so each reduce tile waits for all pieces (and the shared expert), and
    // for the split experts' partials to be reduced.
    const std::int64_t combined = p.reductions.empty() ? ev.comb_done : ev.reduced;
    for (std::int64_t t = 0; t < token_tiles; ++t) {
      const std::int64_t rows = std::min(TR, T - t * TR);
      b.task({.kind = by_rank ? TaskKind::combine_rank_reduce : TaskKind::combine_reduce, .src = by_rank ? BufferId::comb_rank : BufferId::comb, .dst = BufferId::out, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = H, .src_row = t * TR, .wait_event = combined, .wait_count = p.events[static_cast<std::size_t>(combined)].required});
    }
    return;
  }

  // ---- backward ----

  const std::int64_t n_router_dgrad = token_tiles * n_down;
  const std::int64_t n_shared_dgrad = shared ? token_tiles * n_down : 0;
  for (std::int64_t le = 0; le < L; ++le) {
    const std::int64_t e = mine[static_cast<std::size_t>(le)], home = homes[static_cast<std::size_t>(le)];
    const std::int64_t tiles = ex.tiles_of(home), tb = ex.tile_start(home), n_inter = ceil_div(inter_of(le), TC);
    for (std::int64_t i = 0; i < tiles; ++i) {
      if (staged) {  // the pieces land in bf16; one decode per tile fills dy
        b.event(ev.staged + tb + i, ex.arrivals(home, i), TaskKind::grad_dispatch_decode, e, i);
        b.event(ev.dy + tb + i, 1, TaskKind::gemm_down_dgrad, e, i);
      } else {
        b.event(ev.dy + tb + i, ex.arrivals(home, i), TaskKind::gemm_down_dgrad, e, i);
      }
      b.event(ev.da + tb + i, static_cast<std::int32_t>(n_inter), TaskKind::swiglu_bwd, e, i);
      b.event(ev.dh + tb + i, 1, TaskKind::gemm_gate_up_dgrad, e, i);
      if (!by_rank) b.event(ev.dxe + tb + i, static_cast<std::int32_t>(n_down), TaskKind::grad_combine_put, e, i);
    }
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

  lent_weight_puts(c, ex, pass, rank, -1, emit);
  puts_to_experts(c, ex, TR, pass, rank, -1, emit);
  node_forwards(c, ex, TR, pass, rank, -1, true, required, emit);
  // Router: gate-weight gradients, logits gradients, then its GEMMs. Under
  // the per-rank combine the gate gradients come back from the experts'
  // ranks (and this rank's own puts of them are generated after the expert
  // work): the router follows them.
  const auto router = [&] {
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
  };
  if (!by_rank) router();
  if (shared) {
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
  for (std::int64_t le = 0; le < L; ++le) {
    const std::int64_t e = mine[static_cast<std::size_t>(le)], home = homes[static_cast<std::size_t>(le)];
    const std::int64_t n_e = ex.expert_rows(home), start = ex.expert_start(home);
    const std::int64_t tb = ex.tile_start(home), tiles = ex.tiles_of(home);
    relays_into(le);
    lent_relays(c, ex, pass, home, ev, emit);
    const std::int64_t Ie = inter_of(le), n_inter = ceil_div(Ie, TC);
    for (const std::int64_t i : tile_order(home)) {
      const std::int64_t rows = std::min(TR, n_e - i * TR), row0 = start + i * TR;
      gathers(home, i);
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
    // Weight gradients of expert e: one task per output tile, K = all its rows.
    b.weight_tiles(Ie, H, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_down_wgrad, .src = BufferId::at, .dst = BufferId::dw2, .expert = e, .row_begin = le * I + i, .rows = rows, .col_begin = j, .cols = n, .src_row = start, .wait_event = ev.dy_packed + le, .wait_count = tiles});
    });
    b.weight_tiles(H, 2 * Ie, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n) {
      b.task({.kind = TaskKind::gemm_gate_up_wgrad, .src = BufferId::xt, .dst = BufferId::dw1, .expert = e, .row_begin = le * H + i, .rows = rows, .col_begin = j, .cols = n, .src_row = start, .wait_event = ev.dh_packed + le, .wait_count = tiles});
    });
  }
  if (by_rank) {
    puts_to_sources(c, ex, TR, pass, rank, -1, ev.dxe, n_down, required, emit, ReturnPuts::gate_grads);
    router();
    puts_to_sources(c, ex, TR, pass, rank, -1, ev.dxe, n_down, required, emit, ReturnPuts::sums);
    node_combines(c, ex, TR, pass, rank, -1, true, required, emit);
  } else {
    puts_to_sources(c, ex, TR, pass, rank, -1, ev.dxe, n_down, required, emit);
  }
  part_reduces(TaskKind::grad_part_reduce, BufferId::dcomb, ev.dx_ready, true);
  const std::int64_t assembled = p.reductions.empty() ? ev.dx_ready : ev.reduced;
  for (std::int64_t t = 0; t < token_tiles; ++t) {
    const std::int64_t rows = std::min(TR, T - t * TR);
    b.task({.kind = by_rank ? TaskKind::grad_rank_reduce : TaskKind::grad_reduce, .src = by_rank ? BufferId::dcomb_rank : BufferId::dcomb, .dst = BufferId::dx, .row_begin = t * TR, .rows = rows, .col_begin = 0, .cols = H, .src_row = t * TR, .wait_event = assembled, .wait_count = p.events[static_cast<std::size_t>(assembled)].required});
  }
}

}  // namespace hpmoe::taskflow
