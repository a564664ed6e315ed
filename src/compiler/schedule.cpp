#include <algorithm>
#include <limits>
#include <bit>
#include <cmath>
#include <numeric>
#include <queue>
#include <tuple>

#include "hpmoe/error.hpp"
#include "compiler/taskflow.hpp"
#include "compiler/layout.hpp"
#include "compiler/levels.hpp"
#include "compiler/schedule_queues.hpp"
#include "compiler/schedule_roles.hpp"

namespace hpmoe::taskflow {

namespace {

using namespace schedule_roles;

// What waits on the event a put signals at its peer: returned rows feed
// the combine, or first a split expert's reduction.
std::pair<TaskKind, TaskKind> remote_consumers(TaskKind put) {
  const KindRole& r = role(put);
  return {fed_kind(r), fed_split_kind(r)};
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
    else if (place(t.kind) == Place::expert_return) puts[le].push_back(i);
    // The reductions, and the per-rank and per-node combines' sums and the
    // relays that wait for the slots' dx rows: after the chains.
    else if (const Place at = place(t.kind);
             at == Place::reduction || at == Place::sum_return || at == Place::node_sum || at == Place::rank_relay)
      tail.push_back(i);
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

// The ranks of a node on a forwarder of the per-node exchange (0 elsewhere).
std::int64_t node_ranks(const Program& p) {
  if (p.node_begin.size() < 2) return 0;
  return static_cast<std::int64_t>(p.node_route_begin.size() - 1) / static_cast<std::int64_t>(p.node_begin.size() - 1);
}

// Puts (of one level, nothing among them waiting on another) reordered by
// their peer's node, starting with the next node after this rank's: where
// every forwarder sent its node sums in source order, the sources of the
// first nodes each received from every node at once (an incast on their
// links) while the others' links idled; rotated, each node's sources hear
// from about one forwarder at a time. Stable: a peer's own order stays.
void rotate_puts_by_node(const Program& p, std::vector<std::int32_t>& puts) {
  const std::int64_t R = node_ranks(p);
  if (R <= 0) return;
  const std::int64_t nodes = p.ranks / R, mine = p.rank / R;  // R divides the ranks (LayerConfig::validate)
  std::stable_sort(puts.begin(), puts.end(), [&](std::int32_t a, std::int32_t b) {
    const auto distance = [&](std::int32_t i) { return (p.tasks[static_cast<std::size_t>(i)].peer / R - mine + nodes) % nodes; };
    return distance(a) < distance(b);
  });
}

// Moves the tasks `moved` picks, in their order (or, for puts of one
// level, rotated by node), to just after the last other put and the last
// local producer of an event they wait on.
template <class Pick>
void sink_after_puts(const Program& p, std::vector<std::int32_t>& order, Pick&& moved, bool rotate_by_node = false) {
  std::vector<std::int32_t> picked, rest;
  // The events the moved tasks wait on: their local producers (a node
  // relay's count) must stay before them, or the order stops being topological.
  std::vector<std::uint8_t> awaited(p.events.size(), 0);
  for (const std::int32_t i : order)
    if (moved(i) && p.tasks[static_cast<std::size_t>(i)].wait_event >= 0)
      awaited[static_cast<std::size_t>(p.tasks[static_cast<std::size_t>(i)].wait_event)] = 1;
  std::size_t after = 0;  // in `rest`: one past the last other put, and the moved tasks' last producer
  for (const std::int32_t i : order) {
    if (moved(i)) picked.push_back(i);
    else {
      rest.push_back(i);
      const Task& t = p.tasks[static_cast<std::size_t>(i)];
      if (is_put(t.kind) || (t.trigger_event >= 0 && t.peer == p.rank && awaited[static_cast<std::size_t>(t.trigger_event)]))
        after = rest.size();
    }
  }
  if (picked.empty()) return;
  if (rotate_by_node) rotate_puts_by_node(p, picked);
  rest.insert(rest.begin() + static_cast<std::ptrdiff_t>(after), picked.begin(), picked.end());
  order.swap(rest);
}

// A forwarder's node sums (the per-node combine) wait for what its node's
// ranks put at the level of their own return puts: queued before any of
// this rank's returns, they would make the ranks wait on each other. Under
// every policy they go right after the last other put and the last local
// task that counts towards them (a node relay: the fuzz target found the
// sums queued before one, an order no longer topological; nothing local
// waits on them, and the reductions that wait for what they feed come later).
void sink_node_sums(const Program& p, std::vector<std::int32_t>& order) {
  sink_after_puts(p, order, [&](std::int32_t i) { return place(p.tasks[static_cast<std::size_t>(i)].kind) == Place::node_sum; });
}

// With queues of their own, each node sum and relay goes right after the
// last local task counting towards the event it waits for (the rank's own
// part put to itself, a relay), in generation order: the order stays
// topological and its queues hold nothing else.
void place_node_sums(const Program& p, std::vector<std::int32_t>& order) {
  const auto node_sums = [&](std::int32_t i) { return place(p.tasks[static_cast<std::size_t>(i)].kind) == Place::node_sum; };
  std::vector<std::int32_t> sums, rest;
  std::vector<std::int64_t> produced_at(p.events.size(), 0);  // in `rest`: one past the event's last local producer
  for (const std::int32_t i : order) {
    if (node_sums(i)) {
      sums.push_back(i);
      continue;
    }
    rest.push_back(i);
    const Task& t = p.tasks[static_cast<std::size_t>(i)];
    if (t.trigger_event >= 0 && t.peer == p.rank) produced_at[static_cast<std::size_t>(t.trigger_event)] = static_cast<std::int64_t>(rest.size());
  }
  if (sums.empty()) return;
  order.clear();
  std::size_t next = 0;
  std::int64_t at = 0;
  for (const std::int32_t i : sums) {
    const Task& t = p.tasks[static_cast<std::size_t>(i)];
    if (t.wait_event >= 0) at = std::max(at, produced_at[static_cast<std::size_t>(t.wait_event)]);
    for (; static_cast<std::int64_t>(next) < at; ++next) order.push_back(rest[next]);
    order.push_back(i);
  }
  for (; next < rest.size(); ++next) order.push_back(rest[next]);
  // Where a source's last combine slot holds at least half the rank's node
  // sums (a rank of one or two expert slots: EP 128 and 256 on the H800
  // model), the queues apart (a twelfth of the vector workers) would carry
  // them alone after the experts are done while the rest idle: those sums
  // go after the rank's last other put instead, where every vector worker
  // may take them (assign_workers) and the per-rank proof's level rule
  // holds as for sunk sums.
  std::vector<std::int32_t> last_event(static_cast<std::size_t>(p.ranks), -1);
  for (const std::int32_t i : sums) {
    const Task& t = p.tasks[static_cast<std::size_t>(i)];
    if (is_put(t.kind)) last_event[static_cast<std::size_t>(t.peer)] = std::max(last_event[static_cast<std::size_t>(t.peer)], t.wait_event);
  }
  const auto late = [&](std::int32_t i) {
    const Task& t = p.tasks[static_cast<std::size_t>(i)];
    return place(t.kind) == Place::node_sum && is_put(t.kind) && t.wait_event == last_event[static_cast<std::size_t>(t.peer)];
  };
  std::size_t late_sums = 0, all_sums = 0;
  for (const std::int32_t i : sums) {
    all_sums += is_put(p.tasks[static_cast<std::size_t>(i)].kind);
    late_sums += late(i);
  }
  if (2 * late_sums < all_sums) return;
  sink_after_puts(p, order, late, true);
}

// A forwarder's forwards (the per-node exchange's second hop, level 1)
// wait only for node blocks other ranks put; the gathers and relays that
// wait on `tok` events, and any other task that waits on one (the
// backward's gate-gradient puts, which RATR queues with the puts), may wait
// for other forwarders' forwards (level 1 too): queued before this rank's
// own forwards, the forwarders could wait on each other. Under every policy
// the forwards and node relays go, in their order, after the rank's own
// dispatch puts and before the first task that waits on a `tok` event.
void hoist_forwards(const Program& p, std::vector<std::int32_t>& order) {
  const auto kind = [&](std::int32_t i) { return p.tasks[static_cast<std::size_t>(i)].kind; };
  const auto forwarding = [](TaskKind k) { return place(k) == Place::forward; };
  const auto dispatch_put = [](TaskKind k) { return place(k) == Place::token_put; };
  const auto token_consumer = [](TaskKind k) { return place(k) == Place::token_wait; };
  std::vector<std::int32_t> forwards, rest;
  std::size_t after_puts = 0, first_consumer = std::numeric_limits<std::size_t>::max();
  for (const std::int32_t i : order) {
    const TaskKind k = kind(i);
    if (forwarding(k)) {
      forwards.push_back(i);
      continue;
    }
    rest.push_back(i);
    if (dispatch_put(k)) after_puts = rest.size();
    const std::int32_t wait = p.tasks[static_cast<std::size_t>(i)].wait_event;
    const bool waits_on_tokens = token_consumer(k) || (wait >= 0 && token_consumer(p.events[static_cast<std::size_t>(wait)].consumer));
    if (waits_on_tokens && first_consumer == std::numeric_limits<std::size_t>::max()) first_consumer = rest.size() - 1;
  }
  if (forwards.empty()) return;
  const std::size_t at = std::max(after_puts, std::min(first_consumer, rest.size()));
  rest.insert(rest.begin() + static_cast<std::ptrdiff_t>(at), forwards.begin(), forwards.end());
  order.swap(rest);
}

// The levels of this rank's events that peers' puts feed (-1: only its
// own triggers), by the kind of task that waits on them: from the kinds of
// put this rank sends where they feed that kind (its peers' exchange
// programs are made by the same rules: a forwarder's forwards exist only
// where nodes forward), else from every kind that may feed it (lent and
// fetched weights go one way only). Where several kinds feed one consumer,
// the highest level stands for all.
std::vector<std::int8_t> remote_levels(const Program& p) {
  const std::size_t E = p.events.size(), K = static_cast<std::size_t>(TaskKind::count);
  constexpr std::int8_t kUnknownLevel = 7;  // a remote-fed event whose feeders are unknown: assume the worst
  std::vector<std::uint8_t> sends(K, 0);
  for (const Task& t : p.tasks)
    if (is_put(t.kind) && t.peer != p.rank) sends[static_cast<std::size_t>(t.kind)] = 1;
  std::vector<std::int8_t> by_sent(K, -1), by_any(K, -1);
  for (std::size_t k = 0; k < K; ++k) {
    const auto put = static_cast<TaskKind>(k);
    if (!is_put(put)) continue;
    const auto [first, second] = remote_consumers(put);
    for (const TaskKind c : {remote_consumer(put), first, second}) {
      const auto i = static_cast<std::size_t>(c);
      by_any[i] = std::max(by_any[i], put_level(put));
      if (sends[k]) by_sent[i] = std::max(by_sent[i], put_level(put));
    }
  }
  std::vector<std::int8_t> consumer_level(K);
  for (std::size_t i = 0; i < K; ++i) consumer_level[i] = by_sent[i] >= 0 ? by_sent[i] : by_any[i];
  // A relay's event counts the same puts as the gather (or forward) it chains.
  for (std::size_t relay = 0; relay < K; ++relay)
    if (const TaskKind of = role(static_cast<TaskKind>(relay)).relay_of; of != TaskKind::count)
      consumer_level[relay] = std::max(consumer_level[relay], consumer_level[static_cast<std::size_t>(of)]);
  std::vector<std::int32_t> local(E, 0);
  for (const Task& t : p.tasks)
    if (t.trigger_event >= 0 && t.peer == p.rank) ++local[static_cast<std::size_t>(t.trigger_event)];
  std::vector<std::int8_t> level(E, -1);
  for (std::size_t e = 0; e < E; ++e)
    if (p.events[e].required > local[e]) {
      const std::int8_t l = consumer_level[static_cast<std::size_t>(p.events[e].consumer)];
      level[e] = l >= 0 ? l : kUnknownLevel;
    }
  return level;
}

// Whether some put runs, in its queue, after a task that depends (through
// the tasks before it in its queue, or the events it waits on) on peers'
// puts of its level or above: the per-rank proof's check, on this rank's
// estimate of its events' levels (`worker_of`: each position's worker).
bool queues_break_levels(const Program& p, const std::vector<std::int32_t>& order, const std::vector<int>& worker_of,
                         std::vector<std::int8_t> event_dep) {
  std::vector<std::int8_t> queue_dep(static_cast<std::size_t>(p.machine.workers()), -1);
  for (std::size_t i = 0; i < order.size(); ++i) {  // queues keep the order, and producers come first
    const Task& t = p.tasks[static_cast<std::size_t>(order[i])];
    auto& d = queue_dep[static_cast<std::size_t>(worker_of[i])];
    if (t.wait_event >= 0) d = std::max(d, event_dep[static_cast<std::size_t>(t.wait_event)]);
    if (is_put(t.kind) && t.peer != p.rank && d >= put_level(t.kind)) return true;
    if (t.trigger_event >= 0 && t.peer == p.rank) {
      auto& e = event_dep[static_cast<std::size_t>(t.trigger_event)];
      e = std::max(e, d);
    }
  }
  return false;
}

// The per-rank proof's rule (compiler/levels.hpp): a put into a peer's
// level-l event may not run after anything that waits, through its worker's
// queue or the events it waits on, for what peers put at level l or above;
// else two ranks could each hold back what the other waits for. The
// policies and the passes above order the known cases (forwards, node
// sums); this pass keeps the rule wherever an order still breaks it (the
// compiler's fuzz target found a node's part sums queued behind a rank
// reduce under critical-path). Each task's dependence is the highest level
// of remote-fed event it waits on, directly or through local producers.
// For each level l in turn, the puts of level l that lie after the first
// task of dependence >= l move there, with the local tasks they wait on
// from that point, in their order. Every put then precedes, in the order
// and so in every queue, each task that depends on its level or above.
// Nothing moves where the order keeps the rule, and a task moves with its
// producers, so the order stays topological.
void keep_levels(const Program& p, std::vector<std::int32_t>& order, std::vector<std::int8_t> event_dep) {
  const std::size_t n = p.tasks.size(), E = p.events.size();
  std::vector<std::int32_t> local(E + 1, 0);  // each event's local producers, as CSR offsets
  for (const Task& t : p.tasks)
    if (t.trigger_event >= 0 && t.peer == p.rank) ++local[static_cast<std::size_t>(t.trigger_event) + 1];
  // Dependence in order (topological: an event's producers come first).
  std::vector<std::int8_t> dep(n, -1);
  std::int8_t top = -1;
  for (const std::int32_t id : order) {
    const Task& t = p.tasks[static_cast<std::size_t>(id)];
    const std::int8_t d = t.wait_event >= 0 ? event_dep[static_cast<std::size_t>(t.wait_event)] : std::int8_t{-1};
    dep[static_cast<std::size_t>(id)] = d;
    top = std::max(top, d);
    if (t.trigger_event >= 0 && t.peer == p.rank) {
      auto& e = event_dep[static_cast<std::size_t>(t.trigger_event)];
      e = std::max(e, d);
    }
  }
  if (top < 0) return;  // nothing waits on peers
  // Each event's local producers (CSR), and each task's place in the order.
  for (std::size_t e = 0; e < E; ++e) local[e + 1] += local[e];
  std::vector<std::int32_t> producers(static_cast<std::size_t>(local[E])), fill(local.begin(), local.end() - 1);
  for (std::size_t i = 0; i < n; ++i) {
    const Task& t = p.tasks[i];
    if (t.trigger_event >= 0 && t.peer == p.rank)
      producers[static_cast<std::size_t>(fill[static_cast<std::size_t>(t.trigger_event)]++)] = static_cast<std::int32_t>(i);
  }
  std::vector<std::size_t> pos(n);
  std::vector<std::uint8_t> moving(n, 0);
  std::vector<std::int32_t> stack, moved, stay;
  for (std::int8_t level = 0; level <= top; ++level) {
    for (std::size_t i = 0; i < n; ++i) pos[static_cast<std::size_t>(order[i])] = i;
    std::size_t first = n;
    for (std::size_t i = 0; i < n && first == n; ++i)
      if (dep[static_cast<std::size_t>(order[i])] >= level) first = i;
    for (std::size_t i = first; i < n; ++i) {
      const Task& t = p.tasks[static_cast<std::size_t>(order[i])];
      if (is_put(t.kind) && t.peer != p.rank && put_level(t.kind) == level) stack.push_back(order[i]);
    }
    if (stack.empty()) continue;
    for (const auto id : stack) moving[static_cast<std::size_t>(id)] = 1;
    while (!stack.empty()) {  // and what they wait on, from `first` on
      const Task& t = p.tasks[static_cast<std::size_t>(stack.back())];
      stack.pop_back();
      if (t.wait_event < 0) continue;
      const auto e = static_cast<std::size_t>(t.wait_event);
      for (auto k = local[e]; k < local[e + 1]; ++k) {
        const auto u = static_cast<std::size_t>(producers[static_cast<std::size_t>(k)]);
        if (pos[u] >= first && !moving[u]) {
          moving[u] = 1;
          stack.push_back(static_cast<std::int32_t>(u));
        }
      }
    }
    moved.clear();
    stay.clear();
    for (std::size_t i = first; i < n; ++i) (moving[static_cast<std::size_t>(order[i])] ? moved : stay).push_back(order[i]);
    std::copy(moved.begin(), moved.end(), order.begin() + static_cast<std::ptrdiff_t>(first));
    std::copy(stay.begin(), stay.end(), order.begin() + static_cast<std::ptrdiff_t>(first + moved.size()));
    std::fill(moving.begin(), moving.end(), 0);
  }
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
  if (policy == Policy::ratr) order = ratr_order(p);
  hoist_forwards(p, order);
  if (has_place(p, Place::node_sum) && queues_apart(vector_workers_outside_puts(p.machine)).node_sums > 0) place_node_sums(p, order);
  else sink_node_sums(p, order);

  assign_workers(p, policy, order, scratch);
  // Where the order still lets a put wait behind what depends on its level
  // (the passes above cover the cases known), the level pass, then again.
  if (const auto levels = remote_levels(p); queues_break_levels(p, order, scratch.worker_of, levels)) {
    keep_levels(p, order, levels);
    assign_workers(p, policy, order, scratch);
  }
  const auto& worker_of = scratch.worker_of;
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

std::vector<TaskKind> layer_operators(const LayerConfig& c, bool has_splits, Pass pass, bool fetched_replicas) {
  const bool by_rank = c.exchange == ExchangeMode::rank, shared = c.shared_experts > 0;
  const bool staged = !by_rank && (pass == Pass::forward ? c.staged_dispatch() : c.staged_grad_dispatch());
  // The one place the run options choose the schemes a step's kinds come from.
  const auto may_emit = [&](TaskKind k) {
    switch (role(k).scheme) {
      case Scheme::layer: return true;
      case Scheme::shared: return shared;
      case Scheme::assignment: return !by_rank;
      case Scheme::assignment_direct: return !by_rank && !staged;
      case Scheme::assignment_staged: return staged;
      case Scheme::assignment_splits: return !by_rank && has_splits;
      case Scheme::rank: return by_rank;
      case Scheme::node: return c.forwards();
      case Scheme::lend: return c.lend_weights != 0 || fetched_replicas;
    }
    return true;
  };
  std::vector<TaskKind> kinds;
  for (const TaskKind k : operator_order(pass))
    if (may_emit(k)) kinds.push_back(k);
  return kinds;
}

}  // namespace hpmoe::taskflow
