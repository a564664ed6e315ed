// Discrete-event simulation of compiled programs on a machine model: the
// interleaved schedule. Every queue of every rank walks its tasks in order; a
// task starts when its unit is free and its event has the count it waits for;
// a put occupies its unit for the issue (and, on a CPU, the copy), then its
// bytes cross the links, and the event fires on the receiver when they land.
// The serialized baselines are in baselines.cpp.
#include <algorithm>
#include <queue>

#include "hpmoe/error.hpp"
#include "sim/simulate_parts.hpp"

namespace hpmoe::sim {

using namespace detail;


namespace {

// What the event loop needs of a task, in the order its unit runs them:
// every rank's queues one after another, so a unit walks its tasks
// sequentially (the next is usually in the same cache line, or prefetched
// when the one before starts). Built in one pass whose loads are
// independent of each other, so the processor overlaps their cache
// misses; the event loop's own misses come one after another. At EP 256
// the tasks and their work are hundreds of MB, read in a scattered order.
struct Slot {
  double duration;
  std::int32_t id, wait_event, wait_count, trigger_event, peer;
  TaskKind kind;
  QueueClass queue_class;
};
// A unit's queue, and a copy of its current task's slot (the task running
// or waiting): reading the slot again at the task's end would miss the cache.
struct Queue {
  std::size_t pos = 0, end = 0;  // into slots
  bool busy = false;
  std::int64_t trace_slice = -1;  // of its running task
  Slot task{};
};
// task_done: a unit finished a task (for a put: its issue); wake: a waiter's
// signal arrived; arrive: a put's bytes landed; received: the receiver's
// protocol work on them is done.
enum Type : int { task_done, wake, arrive, received };
struct Ev {
  double time;
  std::uint64_t seq;
  int type, rank, a;
  std::int32_t next_slot = -1;  // task_done: the unit's next slot, relative to its rank's first
  bool operator>(const Ev& o) const { return time != o.time ? time > o.time : seq > o.seq; }
};
// A put past its issue: on the wire, or waiting for a copy engine.
struct Flight {
  int sender, peer, event;
  int worker;  // >= 0: the issuing unit, held until the bytes land (vector engine)
  double bytes, issued;
  std::int64_t trace_slice;
  double on_wire = 0, first_byte = 0;  // when its bytes start out, and reach the receiver
  double receiver_busy = 0;            // the receiving rank's busy clock when they start out
};

class InterleavedSim {
 public:
  InterleavedSim(const MachineModel& m, const std::vector<Program>& programs, const std::vector<std::vector<TaskWork>>& work,
                 DType dtype, bool trace);
  Timeline run();

 private:
  void build_slots(DType dtype);
  void try_start(int r, int w, double t);
  void fire(int r, std::int32_t event, double t);
  void finish_task(int r, int w, double t);
  void start_flight(int id, double t);
  void deliver(int id, double t);
  void bytes_through();
  void arrived(const Ev& e);
  void task_finished(const Ev& e);
  void issue_put(const Ev& e, Queue& q);
  void prefetch_next();
  void check_drained() const;

  const MachineModel& m;
  const std::vector<Program>& programs;
  const std::vector<std::vector<TaskWork>>& work;
  const bool trace;
  const int P, Q;
  HugePageArray<Slot> slots;
  std::vector<std::size_t> slot_base;
  std::vector<Queue> queues;
  std::vector<std::vector<std::int32_t>> count;
  std::vector<std::vector<std::vector<std::int32_t>>> waiters;  // [rank][event] -> queues
  std::vector<Flight> flights;
  const bool held, bounded, receive_work;
  std::vector<int> engines_busy;
  std::vector<std::vector<int>> engine_waiting;  // FIFO of flights, per rank
  std::vector<std::size_t> engine_next;
  std::vector<double> receiver_free, stolen;
  BusyClock busy;  // tasks running per rank, and for how long any was
  // put.stream_per_peer: the flights waiting for each (sender, peer) stream, in issue order.
  const bool streams;
  std::vector<std::vector<int>> stream_waiting;
  std::vector<std::size_t> stream_next;
  std::vector<char> stream_busy;
  std::priority_queue<Ev, std::vector<Ev>, std::greater<>> heap;
  std::uint64_t seq = 0;
  Links links;
  // A vector unit that copies a put itself moves its bytes at most at its own rate.
  const int unit_resources;
  Exposure exposure;
  Timeline out;
  std::vector<int> resources;
};

std::size_t slot_count(const std::vector<Program>& programs) {
  std::size_t n = 0;
  for (const auto& p : programs) n += p.queue_tasks.size();
  return n;
}

InterleavedSim::InterleavedSim(const MachineModel& model, const std::vector<Program>& set,
                               const std::vector<std::vector<TaskWork>>& task_work, DType dtype, bool with_trace)
    : m(model), programs(set), work(task_work), trace(with_trace), P(static_cast<int>(set.size())),
      Q(set[0].machine.workers()), slots(slot_count(set)), slot_base(static_cast<std::size_t>(P) + 1, 0),
      queues(static_cast<std::size_t>(P * Q)), count(static_cast<std::size_t>(P)), waiters(static_cast<std::size_t>(P)),
      held(m.put_engine == PutEngine::vector), bounded(m.put_engine == PutEngine::dma && m.put_in_flight > 0),
      receive_work(m.put_engine == PutEngine::cpu && (m.put_receive_s > 0 || m.put_receive_bytes_per_s > 0)),
      engines_busy(static_cast<std::size_t>(P), 0), engine_waiting(static_cast<std::size_t>(P)),
      engine_next(static_cast<std::size_t>(P), 0), receiver_free(static_cast<std::size_t>(P), 0.0),
      stolen(static_cast<std::size_t>(P), 0.0), busy(P), streams(m.put_engine == PutEngine::cpu && m.put_stream_per_peer),
      stream_waiting(streams ? static_cast<std::size_t>(P) * static_cast<std::size_t>(P) : 0),
      stream_next(stream_waiting.size(), 0), stream_busy(stream_waiting.size(), 0), links(m, P),
      unit_resources(held && m.vector_bytes_per_s > 0 ? links.add_resources(P * Q, m.vector_bytes_per_s) : -1),
      exposure(P) {
  build_slots(dtype);
  for (int r = 0; r < P; ++r) {
    const auto& p = programs[static_cast<std::size_t>(r)];
    if (p.machine.workers() != Q) throw Error("simulate: ranks have different worker counts");
    count[r].assign(p.events.size(), 0);
    waiters[r].resize(p.events.size());
    for (int w = 0; w < Q; ++w) {
      Queue& q = queues[static_cast<std::size_t>(r * Q + w)];
      q.pos = slot_base[static_cast<std::size_t>(r)] + static_cast<std::size_t>(p.queue_begin[w]);
      q.end = slot_base[static_cast<std::size_t>(r)] + static_cast<std::size_t>(p.queue_begin[w + 1]);
    }
  }
}

void InterleavedSim::build_slots(DType dtype) {
  Durations duration(m, dtype, m.task_overhead_s);
  for (int r = 0; r < P; ++r) {
    const auto& p = programs[static_cast<std::size_t>(r)];
    const auto& rank_work = work[static_cast<std::size_t>(r)];
    const std::size_t base = slot_base[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < p.queue_tasks.size(); ++i) {
      const std::int32_t id = p.queue_tasks[i];
      const Task& t = p.tasks[static_cast<std::size_t>(id)];
      slots[base + i] = Slot{duration(p, t, rank_work[static_cast<std::size_t>(id)]),
                             id, t.wait_event, t.wait_count, t.trigger_event, t.peer, t.kind, t.queue};
    }
    slot_base[static_cast<std::size_t>(r) + 1] = base + p.queue_tasks.size();
  }
}

void InterleavedSim::try_start(int r, int w, double t) {
  Queue& q = queues[static_cast<std::size_t>(r * Q + w)];
  if (q.busy || q.pos >= q.end) return;
  q.task = slots[q.pos];
  const Slot& task = q.task;
  if (task.wait_event >= 0 && count[r][static_cast<std::size_t>(task.wait_event)] < task.wait_count) {
    waiters[r][static_cast<std::size_t>(task.wait_event)].push_back(w);
    return;
  }
  const bool more = q.pos + 1 < q.end;
  if (more) __builtin_prefetch(&slots[q.pos + 1]);  // read when this one ends
  const double d = task.duration;
  q.busy = true;
  busy.start(r, t);
  (task.queue_class == QueueClass::matrix ? out.matrix_busy : out.vector_busy) += d;
  exposure.change(r, t, is_put(task.kind) ? 1 : 0, task.queue_class == QueueClass::matrix ? 1 : 0);
  if (trace) {
    q.trace_slice = static_cast<std::int64_t>(out.trace.size());
    out.trace.push_back(slice(r, w, t, t + d, programs[static_cast<std::size_t>(r)].tasks[static_cast<std::size_t>(task.id)]));
  }
  heap.push(Ev{t + d, seq++, task_done, r, w,
               more ? static_cast<std::int32_t>(q.pos + 1 - slot_base[static_cast<std::size_t>(r)]) : -1});
}

void InterleavedSim::fire(int r, std::int32_t event, double t) {
  auto& c = count[r][static_cast<std::size_t>(event)];
  ++c;
  auto& list = waiters[r][static_cast<std::size_t>(event)];
  for (std::size_t i = 0; i < list.size();) {
    const Queue& q = queues[static_cast<std::size_t>(r * Q + list[i])];
    if (c >= q.task.wait_count) {
      heap.push(Ev{t + m.signal_latency_s, seq++, wake, r, list[i]});
      list[i] = list.back();
      list.pop_back();
    } else {
      ++i;
    }
  }
}

// The unit's queue moves past its task and takes the next.
void InterleavedSim::finish_task(int r, int w, double t) {
  Queue& q = queues[static_cast<std::size_t>(r * Q + w)];
  q.busy = false;
  ++q.pos;
  try_start(r, w, t);
}

void InterleavedSim::start_flight(int id, double t) {
  Flight& f = flights[static_cast<std::size_t>(id)];
  const auto [latency, bw] = links.path(f.sender, f.peer, resources);
  if (receive_work) {  // for the receiver's protocol work when it lands
    f.on_wire = t;
    f.first_byte = t + latency;
    f.receiver_busy = busy.at(f.peer, t);
  }
  if (bw > 0) {
    if (bounded) ++engines_busy[static_cast<std::size_t>(f.sender)];
    if (f.worker >= 0 && unit_resources >= 0) resources.push_back(unit_resources + f.sender * Q + f.worker);
    exposure.change(f.sender, t, 1, 0);  // in flight: this rank's communication until its bytes are through
    links.start(t, f.bytes, resources, id);
  } else {
    heap.push(Ev{t + latency, seq++, arrive, f.peer, id});
  }
}

void InterleavedSim::deliver(int id, double t) {
  const Flight& f = flights[static_cast<std::size_t>(id)];
  fire(f.peer, f.event, t);
  if (f.worker >= 0) {  // the vector unit that copied it is free again
    out.vector_busy += t - f.issued;
    if (f.trace_slice >= 0) out.trace[static_cast<std::size_t>(f.trace_slice)].end = t;
    finish_task(f.sender, f.worker, t);
  }
}

// A put's bytes are through the links: they land after the path's latency,
// and its stream or copy engine takes the next waiting put.
void InterleavedSim::bytes_through() {
  const auto [t, tag] = links.pop();
  const Flight& f = flights[static_cast<std::size_t>(tag)];
  const int sender = f.sender, peer = f.peer;
  exposure.change(sender, t, -1, 0);
  heap.push(Ev{t + links.path(sender, peer, resources).first, seq++, arrive, peer, static_cast<int>(tag)});
  if (streams) {  // the stream takes its next put
    const std::size_t pair = static_cast<std::size_t>(sender) * static_cast<std::size_t>(P) + static_cast<std::size_t>(peer);
    auto& waiting = stream_waiting[pair];
    if (stream_next[pair] < waiting.size()) {
      exposure.change(sender, t, -1, 0);  // leaves the wait: start_flight counts it again
      start_flight(waiting[stream_next[pair]++], t);
    } else {
      stream_busy[pair] = 0;
    }
  }
  if (bounded) {  // the engine takes the rank's next waiting put
    --engines_busy[static_cast<std::size_t>(sender)];
    auto& waiting = engine_waiting[static_cast<std::size_t>(sender)];
    auto& next = engine_next[static_cast<std::size_t>(sender)];
    if (next < waiting.size()) {
      exposure.change(sender, t, -1, 0);  // leaves the wait: start_flight counts it again
      start_flight(waiting[next++], t);
    }
  }
}

// A put's bytes landed. With receive work, the receiver's protocol stack,
// one put at a time on its core: it takes the bytes as they come in (from
// the first byte, or when it is done with the put before), so the put is
// whole when the last byte lands or when the stack has caught up, whichever
// is later; then its own work per put. The stack's work is spread over the
// put's flight: the share of the flight during which the core computed is
// the share taken from the task it computed.
void InterleavedSim::arrived(const Ev& e) {
  if (!receive_work) return deliver(e.a, e.time);
  const Flight& f = flights[static_cast<std::size_t>(e.a)];
  const auto r = static_cast<std::size_t>(e.rank);
  const double bytes_s = m.put_receive_bytes_per_s > 0 ? f.bytes / m.put_receive_bytes_per_s : 0.0;
  auto& free_at = receiver_free[r];
  const double begin = std::max(free_at, std::min(f.first_byte, e.time));
  free_at = std::max(begin + bytes_s, e.time) + m.put_receive_s;
  // (A core idle now was waiting: the work it did meanwhile is absorbed.)
  if (busy.running(e.rank)) {
    const double span = e.time - f.on_wire;
    const double computing = span > 0 ? std::clamp((busy.at(e.rank, e.time) - f.receiver_busy) / span, 0.0, 1.0) : 1.0;
    stolen[r] += bytes_s * computing + m.put_receive_s;
  }
  heap.push(Ev{free_at, seq++, received, e.rank, e.a});
}

// A unit finished its task (a put: its issue). A put's flight starts, or
// waits for its copy engine or its stream; a local task fires its event.
void InterleavedSim::task_finished(const Ev& e) {
  const auto r = static_cast<std::size_t>(e.rank);
  if (stolen[r] > 0) {  // the core also ran the receives meanwhile: the task ends that much later
    const double d = stolen[r];
    stolen[r] = 0;
    heap.push(Ev{e.time + d, seq++, task_done, e.rank, e.a, e.next_slot});
    return;
  }
  busy.stop(e.rank, e.time);
  Queue& q = queues[static_cast<std::size_t>(e.rank * Q + e.a)];
  const bool put = is_put(q.task.kind);
  exposure.change(e.rank, e.time, put ? -1 : 0, q.task.queue_class == QueueClass::matrix ? -1 : 0);
  if (put && q.task.trigger_event >= 0 && q.task.peer != e.rank) {
    issue_put(e, q);
    if (held) return;  // its unit stays busy until the bytes land
  } else if (q.task.trigger_event >= 0) {
    fire(q.task.peer, q.task.trigger_event, e.time);
  }
  finish_task(e.rank, e.a, e.time);
}

void InterleavedSim::issue_put(const Ev& e, Queue& q) {
  const auto r = static_cast<std::size_t>(e.rank);
  const int fid = static_cast<int>(flights.size());
  flights.push_back(Flight{e.rank, q.task.peer, q.task.trigger_event, held ? e.a : -1,
                           work[r][static_cast<std::size_t>(q.task.id)].bytes, e.time, held ? q.trace_slice : -1});
  if (held) {
    if (q.trace_slice >= 0) out.trace[static_cast<std::size_t>(q.trace_slice)].name += " (copy until landed)";
    start_flight(fid, e.time);
    return;
  }
  if (bounded && links.path(e.rank, q.task.peer, resources).second > 0 && engines_busy[r] >= m.put_in_flight) {
    exposure.change(e.rank, e.time, 1, 0);  // waiting for an engine counts as communication
    engine_waiting[r].push_back(fid);
  } else if (streams && links.path(e.rank, q.task.peer, resources).second > 0) {
    const std::size_t pair = r * static_cast<std::size_t>(P) + static_cast<std::size_t>(q.task.peer);
    if (stream_busy[pair]) {
      exposure.change(e.rank, e.time, 1, 0);  // queued behind the stream's earlier puts
      stream_waiting[pair].push_back(fid);
    } else {
      stream_busy[pair] = 1;
      start_flight(fid, e.time);
    }
  } else {
    start_flight(fid, e.time);
  }
}

// The next event's unit and its next task: their cache misses overlap this
// event's work instead of following it.
void InterleavedSim::prefetch_next() {
  if (const Ev* next = heap.empty() ? nullptr : &heap.top(); next && (next->type == task_done || next->type == wake)) {
    __builtin_prefetch(&queues[static_cast<std::size_t>(next->rank * Q + next->a)]);
    if (next->next_slot >= 0)
      __builtin_prefetch(&slots[slot_base[static_cast<std::size_t>(next->rank)] + static_cast<std::size_t>(next->next_slot)]);
  }
}

void InterleavedSim::check_drained() const {
  for (int r = 0; r < P; ++r)
    for (int w = 0; w < Q; ++w) {
      const Queue& q = queues[static_cast<std::size_t>(r * Q + w)];
      if (q.pos < q.end) {
        throw Error("simulate: deadlock: rank " + std::to_string(r) + " worker " + std::to_string(w) + " waits on event " +
                    std::to_string(slots[q.pos].wait_event) + " for ever");
      }
    }
}

Timeline InterleavedSim::run() {
  for (int r = 0; r < P; ++r)
    for (int w = 0; w < Q; ++w) try_start(r, w, 0.0);
  for (;;) {
    const double link_t = links.next_time();
    if (heap.empty() && link_t == kInf) break;
    if (link_t < kInf && (heap.empty() || link_t < heap.top().time)) {
      bytes_through();
      continue;
    }
    const Ev e = heap.top();
    heap.pop();
    prefetch_next();
    out.makespan = std::max(out.makespan, e.time);
    switch (e.type) {
      case wake: try_start(e.rank, e.a, e.time); break;
      case arrive: arrived(e); break;
      case received: deliver(e.a, e.time); break;
      default: task_finished(e); break;
    }
  }
  check_drained();
  out.exposed_comm = exposure.share(out.makespan);
  out.busiest_link_s = links.busiest_link_s();
  return std::move(out);
}

}  // namespace

Timeline simulate_interleaved(const MachineModel& m, const std::vector<Program>& programs,
                              const std::vector<std::vector<TaskWork>>& work, DType dtype, bool trace) {
  check_programs(programs, work);
  return InterleavedSim(m, programs, work, dtype, trace).run();
}

}  // namespace hpmoe::sim
