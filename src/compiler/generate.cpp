#include <algorithm>
#include <numeric>

#include "ops/access.hpp"
#include "hpmoe/error.hpp"
#include "compiler/taskflow.hpp"
#include "compiler/layout.hpp"
#include "compiler/generate_step.hpp"

namespace hpmoe::taskflow {

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
               c.exchange == ExchangeMode::rank, ex.forwards() ? c.ranks * ex.node_slots() : 0,
               ex.forwards() ? c.ranks * ex.node_slots() : 0);
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
    if (ex.forwards()) {
      // Across nodes the rows come through a forwarder, after the node's
      // own ranks' (each in the rotated order): a tile waits for its latest.
      std::int64_t k = 0;
      for (std::int64_t s = first; s < P && ex.source_offset(s, home) < b; ++s)
        if (ex.count(s, home) > 0) k = std::max(k, (ex.forwarded(s, rank) ? P : 0) + (rank - s + P) % P);
      key[static_cast<std::size_t>(t)] = k;
      continue;
    }
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
    // The per-node combine streamed: each source's NODE_COMB segments
    // (slot-major: slot, then node rank) and its node sums by combine slot.
    p.node_comb_begin.clear();
    p.node_sum_begin.clear();
    std::int64_t sums = 0, parts = 0;  // the rows so far
    for (std::int64_t s = 0; s < c.ranks; ++s) {
      const bool through = ex.forwards_through(s, rank);
      for (std::int64_t j = 0; j < S; ++j) {
        for (std::int64_t d = b * R; d < (b + 1) * R; ++d)
          p.node_comb_begin.push_back(through ? ex.node_route_start(s, b) + ex.node_part_start(s, j, d) : parts);
        p.node_sum_begin.push_back(sums);
        if (through) sums += ex.node_last(s, b, j);
      }
      if (through) parts = ex.node_route_start(s, b) + ex.node_part_start(s, S, b * R);
    }
    p.node_comb_begin.push_back(parts);  // (the direct tokens' rows of the last source's routes take no part)
    p.node_sum_begin.push_back(sums);
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
  scheme_steps(c).interface(c, ex, tile_rows, pass, from, to, add);
}

}  // namespace hpmoe::taskflow
