#include <algorithm>
#include <limits>
#include <bit>
#include <numeric>
#include <queue>

#include "hpmoe/error.hpp"
#include "hpmoe/taskflow.hpp"
#include "taskflow/layout.hpp"

namespace hpmoe::taskflow {

namespace {

bool is_wgrad(TaskKind k) { return k == TaskKind::gemm_down_wgrad || k == TaskKind::gemm_gate_up_wgrad; }

bool is_expert_chain(TaskKind k) {
  return k == TaskKind::gemm_down_dgrad || k == TaskKind::pack_down_grad || k == TaskKind::swiglu_bwd ||
         k == TaskKind::gemm_gate_up_dgrad || k == TaskKind::pack_gate_up_grad;
}

// What waits on the event a put signals at its peer: returned rows feed
// the combine, or first a split expert's reduction.
std::pair<TaskKind, TaskKind> remote_consumers(TaskKind put) {
  switch (put) {
    case TaskKind::dispatch_put: return {TaskKind::gemm_gate_up, TaskKind::gemm_gate_up};
    case TaskKind::combine_put: return {TaskKind::combine_reduce, TaskKind::part_reduce};
    case TaskKind::grad_dispatch_put: return {TaskKind::gemm_down_dgrad, TaskKind::gemm_down_dgrad};
    default: return {TaskKind::grad_reduce, TaskKind::grad_part_reduce};
  }
}

// Puts go to peers in rotated order: rank r serves (i + r) mod P first, so
// that all ranks do not hit one target at once.
void rotate_puts(const Program& p, std::vector<std::int32_t>& order) {
  for (std::size_t i = 0; i < order.size();) {
    const TaskKind k = p.tasks[order[i]].kind;
    std::size_t j = i;
    while (j < order.size() && p.tasks[order[j]].kind == k) ++j;
    if (is_put(k))
      std::stable_sort(order.begin() + static_cast<std::ptrdiff_t>(i), order.begin() + static_cast<std::ptrdiff_t>(j),
                       [&](std::int32_t a, std::int32_t b) {
                         return (p.tasks[a].peer - p.rank + p.ranks) % p.ranks < (p.tasks[b].peer - p.rank + p.ranks) % p.ranks;
                       });
    i = j;
  }
}

// A bottom level above any real one (the keys are floats of levels).
constexpr double kFirst = std::numeric_limits<float>::max();

// Longest cost path from each task to the end of the step (bottom level).
// Generation order is topological, so one backward pass suffices; a put's
// remote consumers are estimated by the longest local task of their kind.
std::vector<double> bottom_levels(const Program& p) {
  std::vector<double> bl(p.tasks.size(), 0.0), event_bl(p.events.size(), 0.0);
  std::vector<double> kind_bl(static_cast<std::size_t>(TaskKind::count), 0.0);
  for (std::size_t i = p.tasks.size(); i-- > 0;) {
    const Task& t = p.tasks[i];
    double below = 0;
    if (t.trigger_event >= 0) {
      if (t.peer == p.rank) below = event_bl[static_cast<std::size_t>(t.trigger_event)];
      else {
        const auto [first, second] = remote_consumers(t.kind);
        below = std::max(kind_bl[static_cast<std::size_t>(first)], kind_bl[static_cast<std::size_t>(second)]);
      }
    }
    bl[i] = double(p.cost[i]) + below;
    // Puts that wait for nothing start every other rank's pipeline, and this
    // rank's own tail depends on them through those ranks: they go first.
    // (Estimating them from local tasks of the consumer's kind fails when this
    // rank has no such tasks, e.g. no rows routed to its experts.)
    if (is_put(t.kind) && t.wait_event < 0) bl[i] = kFirst;
    if (t.wait_event >= 0) event_bl[static_cast<std::size_t>(t.wait_event)] = std::max(event_bl[t.wait_event], bl[i]);
    kind_bl[static_cast<std::size_t>(t.kind)] = std::max(kind_bl[static_cast<std::size_t>(t.kind)], bl[i]);
  }
  return bl;
}

// Backward: each expert's data-gradient chain, then its dX puts at once;
// its weight-gradient tiles are spread between the next expert's chain tasks.
std::vector<std::int32_t> interleave_weight_gradients(const Program& p) {
  const auto L = static_cast<std::int64_t>(p.local_experts.size());
  std::vector<std::vector<std::int32_t>> chain(static_cast<std::size_t>(L)), wgrad(static_cast<std::size_t>(L)),
      puts(static_cast<std::size_t>(L));
  std::vector<std::int32_t> head, tail;
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(p.tasks.size()); ++i) {
    const Task& t = p.tasks[i];
    const std::int64_t le = p.slot_of(t.expert);
    if (is_expert_chain(t.kind)) chain[le].push_back(i);
    else if (is_wgrad(t.kind)) wgrad[le].push_back(i);
    else if (t.kind == TaskKind::grad_combine_put) puts[le].push_back(i);
    else if (t.kind == TaskKind::grad_reduce || t.kind == TaskKind::grad_part_reduce) tail.push_back(i);
    else head.push_back(i);
  }
  std::vector<std::int32_t> order = head;
  std::vector<std::int32_t> pending;  // previous expert's weight-gradient tiles
  for (std::int64_t le = 0; le < L; ++le) {
    std::size_t next = 0;
    const std::size_t per_task = chain[le].empty() ? 0 : (pending.size() + chain[le].size() - 1) / chain[le].size();
    for (auto task : chain[le]) {
      order.push_back(task);
      for (std::size_t k = 0; k < per_task && next < pending.size(); ++k) order.push_back(pending[next++]);
    }
    order.insert(order.end(), pending.begin() + static_cast<std::ptrdiff_t>(next), pending.end());
    order.insert(order.end(), puts[le].begin(), puts[le].end());
    pending = wgrad[le];
  }
  order.insert(order.end(), pending.begin(), pending.end());
  order.insert(order.end(), tail.begin(), tail.end());
  return order;
}

// LSD radix sort of 64-bit keys, 16 bits a pass (stable, linear time).
void radix_sort(std::vector<std::uint64_t>& keys, std::vector<std::uint64_t>& tmp) {
  tmp.resize(keys.size());
  std::vector<std::uint32_t> count(1u << 16);
  for (int shift = 0; shift < 64; shift += 16) {
    std::fill(count.begin(), count.end(), 0u);
    for (auto k : keys) ++count[(k >> shift) & 0xffffu];
    std::uint32_t sum = 0;
    for (auto& c : count) {
      const std::uint32_t n = c;
      c = sum;
      sum += n;
    }
    for (auto k : keys) tmp[count[(k >> shift) & 0xffffu]++] = k;
    keys.swap(tmp);
  }
}

}  // namespace

void schedule(Program& p, Policy policy) {
  ScheduleScratch scratch;
  schedule(p, policy, scratch);
}

void schedule(Program& p, Policy policy, ScheduleScratch& scratch) {
  const int W = p.machine.workers();
  if (W < 1) throw Error("a machine needs at least one worker");
  if (p.cost.size() != p.tasks.size()) throw Error("program has no cost for some tasks");
  auto& order = scratch.order;
  order.resize(p.tasks.size());
  std::iota(order.begin(), order.end(), 0);
  if (policy == Policy::rank_rotated || policy == Policy::critical_path) rotate_puts(p, order);
  if (policy == Policy::critical_path) {
    // Descending bottom level, ties in the current order: sort packed keys
    // (inverted float bits of the level, position) with a radix sort.
    const auto bl = bottom_levels(p);
    auto& keys = scratch.keys;
    keys.resize(order.size());
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto bits = std::bit_cast<std::uint32_t>(static_cast<float>(bl[order[i]]));  // levels are >= 0
      keys[i] = (std::uint64_t{~bits} << 32) | static_cast<std::uint32_t>(order[i]);
    }
    radix_sort(keys, scratch.keys_tmp);
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int32_t>(keys[i] & 0xffffffffu);
  }
  if (policy == Policy::interleave_wgrad) {
    if (p.pass == Pass::backward) order = interleave_weight_gradients(p);
    rotate_puts(p, order);
  }

  // Placement. Fill: round-robin over the workers that take the class.
  // Otherwise list scheduling on the cost model: each task, in order, goes to
  // the worker of its class that is free first. Queues keep the global order,
  // which is topological, so the schedule cannot deadlock.
  std::vector<int> classes[2];
  for (int w = 0; w < W; ++w) {
    if (p.machine.takes(w, QueueClass::matrix)) classes[0].push_back(w);
    if (p.machine.takes(w, QueueClass::vector)) classes[1].push_back(w);
  }
  for (auto& c : classes)
    if (c.empty()) throw Error("machine '" + p.machine.name + "' has no worker for a class of tasks");
  auto& worker_of = scratch.worker_of;  // per position in `order`
  worker_of.resize(order.size());
  if (policy == Policy::fill) {
    std::size_t next[2] = {0, 0};
    for (std::size_t i = 0; i < order.size(); ++i) {
      const int c = p.tasks[order[i]].queue == QueueClass::matrix ? 0 : 1;
      worker_of[i] = classes[c][next[c]];
      if (++next[c] == classes[c].size()) next[c] = 0;
    }
  } else {
    auto& free_at = scratch.free_at;
    auto& event_done = scratch.event_done;
    free_at.assign(static_cast<std::size_t>(W), 0.0);
    event_done.assign(p.events.size(), 0.0);
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto id = order[i];
      const Task& t = p.tasks[id];
      const int c = t.queue == QueueClass::matrix ? 0 : 1;
      int best = classes[c][0];
      for (int w : classes[c])
        if (free_at[w] < free_at[best]) best = w;
      const double ready = t.wait_event >= 0 ? event_done[t.wait_event] : 0.0;
      free_at[best] = std::max(free_at[best], ready) + double(p.cost[id]);
      if (t.trigger_event >= 0 && t.peer == p.rank)
        event_done[t.trigger_event] = std::max(event_done[t.trigger_event], free_at[best]);
      worker_of[i] = best;
    }
  }
  // Counting placement straight into the per-worker CSR queues.
  p.queue_begin.assign(static_cast<std::size_t>(W) + 1, 0);
  for (auto w : worker_of) ++p.queue_begin[static_cast<std::size_t>(w) + 1];
  for (int w = 0; w < W; ++w) p.queue_begin[w + 1] += p.queue_begin[w];
  auto& fill = scratch.fill;
  fill.assign(p.queue_begin.begin(), p.queue_begin.end() - 1);
  p.queue_tasks.resize(order.size());
  for (std::size_t i = 0; i < order.size(); ++i) p.queue_tasks[static_cast<std::size_t>(fill[worker_of[i]]++)] = order[i];
}

std::vector<Program> compile(const LayerConfig& c, const ExpertPlacement& placement, const RoutingCounts& counts,
                             const Machine& m, Pass pass, Policy policy) {
  c.validate();
  const Exchange ex(c, placement, counts, m.tile_rows);
  std::vector<Program> programs(static_cast<std::size_t>(c.ranks));
  ScheduleScratch scratch;
  for (std::int64_t r = 0; r < c.ranks; ++r) {
    generate(programs[static_cast<std::size_t>(r)], c, ex, m, pass, r);
    schedule(programs[static_cast<std::size_t>(r)], policy, scratch);
  }
  return programs;
}

}  // namespace hpmoe::taskflow
