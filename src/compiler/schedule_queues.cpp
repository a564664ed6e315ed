// The scheduler's worker assignment (compiler/schedule_queues.hpp): which
// worker's queue each task of the scheduler's order goes to, and the
// queues some kinds get apart on wide machines. The orders themselves are
// schedule.cpp's.
#include <algorithm>

#include "hpmoe/error.hpp"
#include "compiler/schedule_queues.hpp"

namespace hpmoe::taskflow {

namespace {
Place place(TaskKind k) { return role(k).place; }
}  // namespace

// Queues apart. A worker runs its queue in order, and the list scheduling
// below does not know when peers' rows land: a task that waits for rows
// still on the wire holds back every task behind it. On a machine with
// vector workers to spare (kQueuesApart or more outside the put workers),
// two kinds of waiting get queues of their own, which take nothing else:
// - the per-rank exchange's gathers (and their relays), which wait for
//   tokens as they arrive: a fifth of those workers (5 of the H800 model's
//   24: on its DeepSeek-V3 layer at EP 16-64, 3 or fewer starve the
//   gathers, 8 or more the other vector work; 4-6 within 3% of each other);
// - a forwarder's node sums and their relays, which wait for the node's
//   sums of a combine slot: a twelfth (2 of 24). There a sum waits only
//   for its slot (the rank's part puts of later slots, level 2, are in
//   other queues, so the per-rank proof's level rule holds), and the sums
//   of early slots cross while the experts still compute.
// Small machines (the CPU runtime's two workers) keep one set of queues,
// the node sums sunk behind the rank's other puts.
constexpr std::size_t kQueuesApart = 8;
QueuesApart queues_apart(std::size_t vector_workers) {
  if (vector_workers < kQueuesApart) return {};
  return {(vector_workers + 2) / 5, vector_workers / 12};
}

bool has_place(const Program& p, Place at) {
  return std::any_of(p.tasks.begin(), p.tasks.end(), [&](const Task& t) { return place(t.kind) == at; });
}
// The vector workers that do not carry puts (all of them where put_workers is 0).
std::size_t vector_workers_outside_puts(const Machine& m) {
  std::size_t n = 0;
  for (int w = 0; w < m.workers(); ++w) n += m.takes(w, QueueClass::vector);
  return m.put_workers > 0 && static_cast<std::size_t>(m.put_workers) < n ? n - static_cast<std::size_t>(m.put_workers) : n;
}
std::size_t reduction_workers(const Machine& m) {
  return vector_workers_outside_puts(m) + (m.matrix_runs_vector ? static_cast<std::size_t>(m.matrix_workers) : 0);
}

// Each position of `order` its worker (scratch.worker_of). Fill:
// round-robin over the workers that take the class. Otherwise list
// scheduling on the cost model: each task, in order, goes to the worker of
// its class that is free first. Queues keep the global order, which is
// topological, so the schedule cannot deadlock.
void assign_workers(const Program& p, Policy policy, const std::vector<std::int32_t>& order, ScheduleScratch& scratch) {
  const int W = p.machine.workers();
  std::vector<int> classes[3];  // matrix, vector, and the vector workers that carry puts
  for (int w = 0; w < W; ++w) {
    if (p.machine.takes(w, QueueClass::matrix)) classes[0].push_back(w);
    if (p.machine.takes(w, QueueClass::vector)) classes[1].push_back(w);
  }
  for (int c = 0; c < 2; ++c)
    if (classes[c].empty()) throw Error("machine '" + p.machine.name + "' has no worker for a class of tasks");
  classes[2] = classes[1];
  if (p.machine.put_workers > 0 && static_cast<std::size_t>(p.machine.put_workers) < classes[1].size()) {
    classes[2].resize(static_cast<std::size_t>(p.machine.put_workers));
    classes[1].erase(classes[1].begin(), classes[1].begin() + p.machine.put_workers);
  }
  // A forwarder's node sums on queues of their own.
  const QueuesApart apart = queues_apart(classes[1].size());
  std::vector<int> sum_workers;
  if (const std::size_t k = apart.node_sums; k > 0 && has_place(p, Place::node_sum)) {
    sum_workers.assign(classes[1].end() - static_cast<std::ptrdiff_t>(k), classes[1].end());
    classes[1].resize(classes[1].size() - k);
    if (p.machine.put_workers == 0) classes[2] = classes[1];
  }
  // The per-rank exchange's gathers (and their relays) on queues of their
  // own (gather_workers).
  std::vector<int> gather_workers;
  if (const std::size_t k = apart.gathers; k > 0 && has_place(p, Place::token_wait)) {
    gather_workers.assign(classes[1].end() - static_cast<std::ptrdiff_t>(k), classes[1].end());
    classes[1].resize(classes[1].size() - k);
    if (p.machine.put_workers == 0) classes[2] = classes[1];
  }
  // The final reductions come last and wait for everything else: every
  // vector worker outside the puts takes them, those apart included, and
  // where matrix workers run vector code (a GPU's SMs), those too.
  std::vector<int> reduce_workers = classes[1];
  if (p.machine.matrix_runs_vector) reduce_workers.insert(reduce_workers.end(), classes[0].begin(), classes[0].end());
  reduce_workers.insert(reduce_workers.end(), gather_workers.begin(), gather_workers.end());
  reduce_workers.insert(reduce_workers.end(), sum_workers.begin(), sum_workers.end());
  const auto class_of = [&](const Task& t, bool puts_apart) {
    if (t.queue == QueueClass::matrix) return 0;
    if (place(t.kind) == Place::reduction) return 5;
    if (!sum_workers.empty() && place(t.kind) == Place::node_sum) return 3;
    if (!gather_workers.empty() && place(t.kind) == Place::token_wait) return 4;
    return puts_apart && is_put(t.kind) ? 2 : 1;
  };
  // The node sums queued after the rank's last other put (a last combine
  // slot's, where it holds most of them: schedule.cpp place_node_sums) may
  // take any vector worker outside the puts, as on a small machine.
  std::vector<int> late_sum_workers = sum_workers;
  late_sum_workers.insert(late_sum_workers.end(), classes[1].begin(), classes[1].end());
  std::size_t last_other_put = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const Task& t = p.tasks[static_cast<std::size_t>(order[i])];
    if (is_put(t.kind) && t.peer != p.rank && place(t.kind) != Place::node_sum) last_other_put = i;
  }
  const auto workers_of = [&](int c) -> const std::vector<int>& {
    return c == 3 ? sum_workers : c == 4 ? gather_workers : c == 5 ? reduce_workers : c == 6 ? late_sum_workers : classes[c];
  };
  auto& worker_of = scratch.worker_of;  // per position in `order`
  worker_of.resize(order.size());
  if (policy == Policy::fill) {
    std::size_t next[6] = {0, 0, 0, 0, 0, 0};
    for (std::size_t i = 0; i < order.size(); ++i) {
      const int c = class_of(p.tasks[order[i]], false);
      worker_of[i] = workers_of(c)[next[c]];
      if (++next[c] == workers_of(c).size()) next[c] = 0;
    }
  } else {
    auto& free_at = scratch.free_at;
    auto& event_done = scratch.event_done;
    free_at.assign(static_cast<std::size_t>(W), 0.0);
    event_done.assign(p.events.size(), 0.0);
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto id = order[i];
      const Task& t = p.tasks[id];
      const int c = class_of(t, true) == 3 && i > last_other_put ? 6 : class_of(t, true);
      int best = workers_of(c)[0];
      for (int w : workers_of(c))
        if (free_at[w] < free_at[best]) best = w;
      const double ready = t.wait_event >= 0 ? event_done[t.wait_event] : 0.0;
      free_at[best] = std::max(free_at[best], ready) + double(p.cost[id]);
      if (t.trigger_event >= 0 && t.peer == p.rank)
        event_done[t.trigger_event] = std::max(event_done[t.trigger_event], free_at[best]);
      worker_of[i] = best;
    }
  }
}

}  // namespace hpmoe::taskflow
