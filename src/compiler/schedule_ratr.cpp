// The RATR policy's order (schedule.cpp runs it, then the passes common to
// every policy and the worker assignment).
#include <algorithm>
#include <cmath>
#include <tuple>

#include "compiler/schedule_roles.hpp"

namespace hpmoe::taskflow {

namespace {

using namespace schedule_roles;

// RATR (the hyper-parallel code's dispatch order): the first puts carry
// every destination's first expert, destinations rotated by rank
// ((i + rank) % P), so the first experts' rows land first everywhere and
// their GEMMs start while the rest is on the wire. (The per-assignment
// dispatch refines that: each piece goes when its destination will compute
// it, see puts_to_experts; where the pieces are equal it is this order.) Then the expert work row
// tile by row tile, in generation order, except that a row tile's second
// GEMM (down-projection; in the backward pass the gate/up data gradient) is
// released `lookahead` row tiles later, once its vector step has had time to
// run, instead of after every expert's first GEMM; and each row tile's
// return puts right after the tasks that fill them (sources rotated), so
// combines start early. Weight gradients, which nothing waits for, go after
// the data-gradient chains and overlap the last return puts (on machines
// with matrix units of their own and many local experts, between later
// experts' row tiles: spread_weight_gradients); the router's data
// gradient, which only the final reductions read, just before them.
// Topological: moved tasks only move later and their consumers follow them,
// but for the spread weight gradients, which may move earlier and stay
// after every task of their expert's row tiles (the verifier proves each
// order); dispatch puts wait for nothing.
bool is_weight_gradient(TaskKind k) { return step(k) == TileStep::weight_gradient; }
bool second_gemm(TaskKind k) { return step(k) == TileStep::second_gemm; }
bool first_gemm(TaskKind k) { return step(k) == TileStep::first_gemm; }

// Where RATR queues each routed expert's weight gradients on a machine with
// matrix units of their own and at least kSpreadExperts local experts: from
// `gap` row tiles after the expert's last one (its second GEMMs are keyed up
// to `lookahead` tiles later; the rest gives its last packs, vector work,
// time to run: at 1 lookahead the gain was half), spread over as many row
// tiles as the expert has, instead of all after the last chain. There the
// later experts' dy is still landing while their chains run, and the
// weight gradients fill matrix units that waited for it (H800 model,
// DeepSeek-V3, EP 16: the per-node backward 15.87 -> 14.90 ms). With fewer,
// larger experts (EP 64: 4 a rank) the later chains are bound by the
// matrix units, and the spread slowed them (EP 64: 20.0 -> 21.4 ms); on a
// CPU every worker takes both queues, and the order is left as it was.
// Keys: -1 where a task stays where RATR put it.
constexpr std::size_t kSpreadExperts = 8;
std::vector<double> spread_weight_gradients(const Program& p, const std::vector<std::int64_t>& tile_start, std::int64_t lookahead) {
  std::vector<double> key(p.tasks.size(), -1.0);
  const std::size_t L = p.local_experts.size();
  if (L < kSpreadExperts || p.machine.matrix_workers == 0 || tile_start.empty()) return key;
  std::vector<std::int64_t> first(L, -1), last(L, -1), total(L, 0), seen(L, 0);
  // A routed expert's slot here, or L (none: the shared experts' tiles).
  const auto slot = [&](const Task& t) {
    const std::int64_t s = p.slot_of(t.expert);
    return s >= 0 && static_cast<std::size_t>(s) < L ? static_cast<std::size_t>(s) : L;
  };
  for (std::size_t j = 0; j < tile_start.size(); ++j) {
    const std::size_t le = slot(p.tasks[static_cast<std::size_t>(tile_start[j])]);
    if (le == L) continue;
    if (first[le] < 0) first[le] = static_cast<std::int64_t>(j);
    last[le] = static_cast<std::int64_t>(j);
  }
  for (const Task& t : p.tasks)
    if (is_wgrad(t.kind) && slot(t) < L) ++total[slot(t)];
  const std::int64_t gap = (5 * lookahead + 1) / 2, tiles = static_cast<std::int64_t>(tile_start.size());
  for (std::size_t i = 0; i < p.tasks.size(); ++i) {
    const Task& t = p.tasks[i];
    const std::size_t le = is_wgrad(t.kind) ? slot(t) : L;
    if (le == L) continue;
    const std::int64_t from = last[le] + gap;
    if (last[le] < 0 || from >= tiles) continue;  // the last experts' stay after the chains
    const std::int64_t span = std::min(tiles - from, last[le] - first[le] + 1);
    const std::int64_t j = from + seen[le]++ * span / total[le];
    // After the second GEMMs keyed at that tile (- 0.5), before its first GEMM.
    key[i] = double(tile_start[static_cast<std::size_t>(j)]) - 0.375;
  }
  return key;
}

}  // namespace

std::vector<std::int32_t> ratr_order(const Program& p) {
  const auto rotated = [&](std::int32_t peer) { return (peer - p.rank + p.ranks) % p.ranks; };
  std::vector<std::tuple<std::int32_t, std::int32_t, std::int32_t>> first;  // (expert ordinal at the destination, rotated destination, task)
  std::vector<std::int32_t> experts_seen(static_cast<std::size_t>(p.ranks), 0), last_expert(static_cast<std::size_t>(p.ranks), -1);
  std::vector<std::int32_t> node_event(static_cast<std::size_t>(p.ranks), -1);
  // Row tiles in generation order: where each starts, and its cost shape.
  std::vector<std::int64_t> tile_start;
  double first_gemm_s = 0, vector_step_s = 0;
  std::int64_t tile_expert = -2, tile_row = -1;
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(p.tasks.size()); ++i) {
    const Task& t = p.tasks[static_cast<std::size_t>(i)];
    if (first_gemm(t.kind) && (t.expert != tile_expert || t.row_begin != tile_row)) {
      tile_start.push_back(i);
      tile_expert = t.expert, tile_row = t.row_begin;
    }
    if (tile_start.size() == 1) {  // the first row tile's costs stand for all
      if (first_gemm(t.kind)) first_gemm_s += p.cost[static_cast<std::size_t>(i)];
      if (step(t.kind) == TileStep::vector_step) vector_step_s = p.cost[static_cast<std::size_t>(i)];
    }
  }
  int units = 0;
  for (int w = 0; w < p.machine.workers(); ++w) units += p.machine.takes(w, QueueClass::matrix) ? 1 : 0;
  const double wave_s = first_gemm_s / std::max(1, units);
  // At most 16 row tiles: 8 (until 2026-12-07) held the matrix units back
  // behind the backward's vector steps on the H800 model (DeepSeek-V3 at
  // EP 16 asks for 25, the forward for 9); 16 and 24 are within 0.5% of
  // each other there, and the A3 model asks for fewer.
  const std::int64_t lookahead =
      wave_s > 0 ? std::clamp<std::int64_t>(1 + static_cast<std::int64_t>(std::ceil(vector_step_s / wave_s)), 1, 16) : 1;
  // Where the final reductions begin (they wait for every return put).
  std::int64_t tail = static_cast<std::int64_t>(p.tasks.size());
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(p.tasks.size()); ++i) {
    if (place(p.tasks[static_cast<std::size_t>(i)].kind) == Place::reduction) {
      tail = i;
      break;
    }
  }
  // The end of the expert work: the first return put or shared/token task after the last row tile.
  std::int64_t expert_work_end = tile_start.empty() ? 0 : tile_start.back();
  while (expert_work_end < static_cast<std::int64_t>(p.tasks.size()) &&
         !is_put(p.tasks[static_cast<std::size_t>(expert_work_end)].kind) &&
         p.tasks[static_cast<std::size_t>(expert_work_end)].expert >= 0)
    ++expert_work_end;
  // Keys: generation position; a second GEMM of row tile j just before row
  // tile j + lookahead (past the last one: at the end of the expert work);
  // weight gradients before the final reductions.
  const std::vector<double> spread = spread_weight_gradients(p, tile_start, lookahead);
  std::vector<double> filled(p.events.size(), -1.0);  // latest key of a local task filling the event
  std::vector<std::tuple<double, std::int32_t, std::int32_t>> rest;  // (key, rotated peer, task)
  std::size_t tile = 0;
  std::vector<std::int32_t> returns;
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(p.tasks.size()); ++i) {
    const Task& t = p.tasks[static_cast<std::size_t>(i)];
    while (tile + 1 < tile_start.size() && tile_start[tile + 1] <= i) ++tile;
    if (is_put(t.kind) && t.wait_event < 0) {
      const auto d = static_cast<std::size_t>(t.peer);
      // A node block's sub-block j carries the tokens whose lowest slot on
      // the node is j: it goes with the destinations' slot j (ordinal j +
      // 1), not all first, which held the copy engines on the slow link
      // while the node's own ranks waited for their first slot. Its puts
      // count towards the forwarder's `node` events of this source, one per
      // sub-block in order (the routes' with sub-block 0's).
      if (role(t.kind).scheme == Scheme::node && place(t.kind) == Place::token_put) {
        if (node_event[d] < 0) node_event[d] = t.trigger_event;
        first.emplace_back(1 + t.trigger_event - node_event[d], rotated(t.peer), i);
        continue;
      }
      if (t.expert != last_expert[d]) ++experts_seen[d], last_expert[d] = t.expert;
      first.emplace_back(experts_seen[d], rotated(t.peer), i);
      continue;
    }
    if (is_put(t.kind)) {
      returns.push_back(i);
      continue;
    }
    double k = i;
    if (is_weight_gradient(t.kind)) k = double(tail) - 0.5;  // nothing waits on them: after the data-gradient chains
    if (spread[static_cast<std::size_t>(i)] >= 0) k = spread[static_cast<std::size_t>(i)];
    // Only the final reductions read it: queued in generation order (first),
    // the router's data gradient held every matrix unit behind the gate
    // gradients and the router's backward (vector work) while the experts'
    // dy had landed (3.8 of 10.6 ms at EP 64, 2048 tokens a rank).
    if (place(t.kind) == Place::side_gradient) k = double(tail) - 0.75;
    if (second_gemm(t.kind) && !tile_start.empty()) {
      const std::size_t later = tile + static_cast<std::size_t>(lookahead);
      if (later < tile_start.size()) k = double(tile_start[later]) - 0.5;
      else if (t.expert >= 0) k = std::max(double(i), double(expert_work_end) - 0.5);
    }
    // A relay of the per-rank combine follows the (moved) GEMMs it counts.
    if (place(t.kind) == Place::rank_relay && t.wait_event >= 0)
      k = std::max(k, filled[static_cast<std::size_t>(t.wait_event)] + 0.125);
    if (t.trigger_event >= 0 && t.peer == p.rank)
      filled[static_cast<std::size_t>(t.trigger_event)] = std::max(filled[static_cast<std::size_t>(t.trigger_event)], k);
    rest.emplace_back(k, 0, i);
  }
  for (const std::int32_t i : returns) {  // right after the tasks that fill the tile it reads
    const Task& t = p.tasks[static_cast<std::size_t>(i)];
    rest.emplace_back(filled[static_cast<std::size_t>(t.wait_event)] + 0.25, 1 + rotated(t.peer), i);
  }
  // The per-assignment dispatch puts keep the generator's order (each
  // destination's pieces in the order it computes them, spread over the
  // dispatch: generate.cpp puts_to_experts); the rest (lent weights, the
  // per-rank and per-node exchanges' puts) first, by expert ordinal at the
  // destination and rotated destination.
  std::vector<std::tuple<std::int32_t, std::int32_t, std::int32_t>> keyed;
  std::erase_if(first, [&](const auto& f) {
    const bool dispatch = place(p.tasks[static_cast<std::size_t>(std::get<2>(f))].kind) == Place::expert_put;
    if (dispatch) keyed.push_back(f);
    return dispatch;
  });
  std::sort(first.begin(), first.end());
  first.insert(first.end(), keyed.begin(), keyed.end());
  std::stable_sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) {
    return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) < std::get<0>(b) : std::get<1>(a) < std::get<1>(b);
  });
  std::vector<std::int32_t> order;
  order.reserve(p.tasks.size());
  for (const auto& f : first) order.push_back(std::get<2>(f));
  for (const auto& r : rest) order.push_back(std::get<2>(r));
  return order;
}

}  // namespace hpmoe::taskflow
