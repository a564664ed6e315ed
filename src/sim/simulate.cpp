// Discrete-event simulation of compiled programs on a machine model.
//
// Interleaved: every queue of every rank walks its tasks in order; a task
// starts when its unit is free and its event has the count it waits for;
// a put occupies its unit for the issue (and, on a CPU, the copy), then its
// bytes cross the links, and the event fires on the receiver when they land.
// Serialized: the same tiles, one operator at a time: each operator's tasks
// are list-scheduled on the units of each rank, the operator ends when every
// rank's tasks and transfers are done, then the next pays a launch (and, after
// an all-to-all, a collective synchronisation).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <queue>
#include <type_traits>

#if __has_include(<sys/mman.h>)
#include <sys/mman.h>
#endif

#include "hpmoe/error.hpp"
#include "sim/sim.hpp"

namespace hpmoe::sim {

namespace {

using taskflow::Program;
using taskflow::QueueClass;
using taskflow::Task;
using taskflow::TaskKind;
using taskflow::TaskWork;
constexpr double kInf = std::numeric_limits<double>::infinity();

using taskflow::is_put;

// An array of trivially copyable values, uninitialised, backed by huge pages
// where the kernel gives them on request (Linux transparent huge pages in
// "madvise" mode, the default on Debian). The simulator's per-task tables
// are hundreds of MB read in a scattered order: with 4 KiB pages nearly
// every read is a TLB miss, and first touching them page by page costs a
// fault each (several microseconds in a virtual machine).
template <class T>
class HugePageArray {
  static_assert(std::is_trivially_copyable_v<T>);
  static constexpr std::size_t kHuge = std::size_t{2} << 20;

 public:
  explicit HugePageArray(std::size_t n) {
    const std::size_t bytes = std::max<std::size_t>(kHuge, (n * sizeof(T) + kHuge - 1) / kHuge * kHuge);
    data_ = static_cast<T*>(std::aligned_alloc(kHuge, bytes));
    if (!data_) throw Error("simulate: out of memory for " + std::to_string(n) + " task slots (" + std::to_string(bytes >> 20) + " MiB)");
#ifdef MADV_HUGEPAGE
    ::madvise(data_, bytes, MADV_HUGEPAGE);  // a hint: without it the pages are small, and all still works
#endif
  }
  ~HugePageArray() { std::free(data_); }
  HugePageArray(const HugePageArray&) = delete;
  HugePageArray& operator=(const HugePageArray&) = delete;
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }

 private:
  T* data_;
};

// Row tiles in a row that use the same weight panel as this GEMM tile: an
// expert's rows on its rank, or the rank's tokens for the shared experts.
// Other GEMMs (weight gradients, router) reuse their small operand widely.
double weight_reuse(const Program& p, const Task& t) {
  const std::int64_t tile = p.machine.tile_rows;
  switch (t.kind) {
    case TaskKind::gemm_gate_up:
    case TaskKind::gemm_down:
    case TaskKind::gemm_down_dgrad:
    case TaskKind::gemm_gate_up_dgrad: {
      const std::int64_t le = p.slot_of(t.expert);
      if (le < 0 || le + 1 >= static_cast<std::int64_t>(p.expert_begin.size())) return 1;
      const std::int64_t rows = p.expert_begin[static_cast<std::size_t>(le + 1)] - p.expert_begin[static_cast<std::size_t>(le)];
      return double(std::max<std::int64_t>(1, (rows + tile - 1) / tile));
    }
    case TaskKind::shared_gate_up:
    case TaskKind::shared_down:
    case TaskKind::shared_down_dgrad:
    case TaskKind::shared_gate_up_dgrad:
      return double(std::max<std::int64_t>(1, (p.dims.tokens + tile - 1) / tile));
    default:
      return 1e9;
  }
}

// Seconds a task occupies its unit, `overhead` the executor's own per task.
// A layer's GEMM tiles come in a handful of shapes, and the model's time for
// one walks its measured tile table: the times are kept in a small table by
// shape (the same value as computing them again).
class Durations {
 public:
  Durations(const MachineModel& m, DType dtype, double overhead) : m_(m), dtype_(dtype), overhead_(overhead) {}

  double operator()(const Program& p, const Task& t, const TaskWork& work) {
    if (!work.timed) return 0;
    if (t.queue == QueueClass::matrix) return gemm(t.rows, t.cols, std::max<std::int64_t>(1, work.k), weight_reuse(p, t)) + overhead_;
    if (is_put(t.kind))  // the issue (and a core's or vector unit's own copy); the wire comes after
      return m_.put_issue_s + (m_.put_copy_bytes_per_s > 0 ? work.bytes / m_.put_copy_bytes_per_s : 0.0) +
             work.local_bytes / m_.vector_rate(t.kind) + overhead_;
    return work.bytes / m_.vector_rate(t.kind) + overhead_;
  }

 private:
  struct Shape {
    std::int64_t rows = -1, cols = -1, k = -1;
    double reuse = 0, seconds = 0;
  };
  double gemm(std::int64_t rows, std::int64_t cols, std::int64_t k, double reuse) {
    const std::uint64_t h = (std::uint64_t(rows) * 0x9E3779B97F4A7C15ull) ^ (std::uint64_t(cols) * 0xC2B2AE3D27D4EB4Full) ^
                            (std::uint64_t(k) * 0x165667B19E3779F9ull) ^ std::uint64_t(std::int64_t(reuse));
    Shape& s = shapes_[(h ^ (h >> 29)) % shapes_.size()];
    if (s.rows != rows || s.cols != cols || s.k != k || s.reuse != reuse)
      s = Shape{rows, cols, k, reuse, m_.gemm_seconds(rows, cols, k, dtype_, reuse)};
    return s.seconds;
  }

  const MachineModel& m_;
  DType dtype_;
  double overhead_;
  std::array<Shape, 256> shapes_{};
};

// Links as processor-sharing servers: every port (or mesh link) shares its
// capacity equally among the transfers crossing it, and a transfer is through
// when every resource on its path has carried its bytes. Each resource keeps
// a virtual clock (bytes served per active transfer), so a start or a finish
// costs O(log n) however many transfers share the port.
class Links {
 public:
  Links(const MachineModel& m, int ranks) : m_(m), intra_(m.intra_rate(ranks)) {
    if (m.mesh_cols > 0) {
      ports_.resize(static_cast<std::size_t>(ranks) * 4);
      for (auto& p : ports_) p.capacity = m.mesh_link_bytes_per_s;
    } else {
      ports_.resize(static_cast<std::size_t>(ranks) * 4);
      for (int r = 0; r < ranks; ++r) {
        ports_[static_cast<std::size_t>(4 * r)].capacity = ports_[static_cast<std::size_t>(4 * r + 1)].capacity = intra_;
        ports_[static_cast<std::size_t>(4 * r + 2)].capacity = ports_[static_cast<std::size_t>(4 * r + 3)].capacity = m.inter_bytes_per_s;
      }
    }
  }

  // Latency and bandwidth between two ranks (bandwidth 0: no link cost).
  std::pair<double, double> path(int s, int d, std::vector<int>& resources) const {
    resources.clear();
    if (m_.mesh_cols > 0) {
      int x = s % m_.mesh_cols, y = s / m_.mesh_cols;
      const int dx = d % m_.mesh_cols, dy = d / m_.mesh_cols;
      int hops = 0;
      while (x != dx) {  // X first, then Y
        resources.push_back((y * m_.mesh_cols + x) * 4 + (x < dx ? 0 : 1));
        x += x < dx ? 1 : -1;
        ++hops;
      }
      while (y != dy) {
        resources.push_back((y * m_.mesh_cols + x) * 4 + (y < dy ? 2 : 3));
        y += y < dy ? 1 : -1;
        ++hops;
      }
      return {hops * m_.mesh_hop_latency_s, m_.mesh_link_bytes_per_s};
    }
    const bool same_node = s / m_.ranks_per_node == d / m_.ranks_per_node;
    const double bw = same_node ? intra_ : m_.inter_bytes_per_s;
    if (bw > 0) {
      resources.push_back(4 * s + (same_node ? 0 : 2));  // sender's out port
      resources.push_back(4 * d + (same_node ? 1 : 3));  // receiver's in port
    }
    return {same_node ? m_.intra_latency_s : m_.inter_latency_s, bw};
  }

  // `n` more resources of `capacity` (a unit that moves bytes itself); the first one's index.
  int add_resources(int n, double capacity) {
    const int first = static_cast<int>(ports_.size());
    ports_.resize(ports_.size() + static_cast<std::size_t>(n));
    for (auto it = ports_.begin() + first; it != ports_.end(); ++it) it->capacity = capacity;
    return first;
  }

  // Starts a transfer; `tag` comes back from pop() when its bytes are through.
  void start(double t, double bytes, const std::vector<int>& resources, std::int64_t tag) {
    const int id = static_cast<int>(pending_.size());
    pending_.push_back(static_cast<int>(resources.size()));
    tags_.push_back(tag);
    for (int r : resources) {
      Port& p = ports_[static_cast<std::size_t>(r)];
      advance(p, t);
      p.queue.push(Entry{p.virtual_time + bytes, id});
      ++p.active;
      reschedule(r);
    }
  }

  double next_time() const { return order_.empty() ? kInf : ports_[static_cast<std::size_t>(order_.front())].next; }

  // The earliest finished transfer: (time, tag).
  std::pair<double, std::int64_t> pop() {
    for (;;) {
      const int port = order_.front();
      Port& p = ports_[static_cast<std::size_t>(port)];
      const double t = p.next;
      advance(p, t);
      const int id = p.queue.top().id;
      p.queue.pop();
      --p.active;
      reschedule(port);
      if (--pending_[static_cast<std::size_t>(id)] == 0) return {t, tags_[static_cast<std::size_t>(id)]};
    }
  }

 private:
  struct Entry {
    double finish;  // on the port's virtual clock
    int id;
    bool operator>(const Entry& o) const { return finish != o.finish ? finish > o.finish : id > o.id; }
  };
  struct Port {
    double capacity = 0, virtual_time = 0, updated = 0;
    int active = 0;
    int heap_index = -1;  // in order_; -1: no transfers
    double next = kInf;   // when its first transfer is through
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  };
  static void advance(Port& p, double t) {
    if (p.active > 0) p.virtual_time += (t - p.updated) * p.capacity / p.active;
    p.updated = t;
  }
  // Each port with transfers is in the heap of ports once, keyed by the time
  // its first transfer is through (ties: lower port first); a start or a
  // finish moves the port's key in place.
  void reschedule(int r) {
    Port& p = ports_[static_cast<std::size_t>(r)];
    if (p.queue.empty()) {
      if (p.heap_index >= 0) remove(r);
      return;
    }
    p.next = p.updated + (p.queue.top().finish - p.virtual_time) * p.active / p.capacity;
    if (p.heap_index < 0) {
      p.heap_index = static_cast<int>(order_.size());
      order_.push_back(r);
    }
    sift(static_cast<std::size_t>(p.heap_index));
  }
  bool earlier(int a, int b) const {
    const double ta = ports_[static_cast<std::size_t>(a)].next, tb = ports_[static_cast<std::size_t>(b)].next;
    return ta != tb ? ta < tb : a < b;
  }
  void place(std::size_t i, int r) {
    order_[i] = r;
    ports_[static_cast<std::size_t>(r)].heap_index = static_cast<int>(i);
  }
  void sift(std::size_t i) {
    const int r = order_[i];
    while (i > 0 && earlier(r, order_[(i - 1) / 2])) {
      place(i, order_[(i - 1) / 2]);
      i = (i - 1) / 2;
    }
    for (;;) {
      std::size_t c = 2 * i + 1;
      if (c >= order_.size()) break;
      if (c + 1 < order_.size() && earlier(order_[c + 1], order_[c])) ++c;
      if (!earlier(order_[c], r)) break;
      place(i, order_[c]);
      i = c;
    }
    place(i, r);
  }
  void remove(int r) {
    const auto i = static_cast<std::size_t>(ports_[static_cast<std::size_t>(r)].heap_index);
    ports_[static_cast<std::size_t>(r)].heap_index = -1;
    const int last = order_.back();
    order_.pop_back();
    if (i < order_.size()) {
      place(i, last);
      sift(i);
    }
  }

  const MachineModel& m_;
  double intra_;  // at this EP degree
  std::vector<Port> ports_;
  std::vector<int> pending_;  // per transfer: resources still carrying it
  std::vector<std::int64_t> tags_;
  std::vector<int> order_;  // a min-heap of the ports with transfers
};

// Per rank: how many tasks are running, and the time any was (a clock that
// runs only while the rank computes).
class BusyClock {
 public:
  explicit BusyClock(int ranks) : running_(static_cast<std::size_t>(ranks), 0), since_(running_.size()), total_(running_.size()) {}
  void start(int r, double t) {
    const auto i = static_cast<std::size_t>(r);
    if (running_[i]++ == 0) since_[i] = t;
  }
  void stop(int r, double t) {
    const auto i = static_cast<std::size_t>(r);
    if (--running_[i] == 0) total_[i] += t - since_[i];
  }
  bool running(int r) const { return running_[static_cast<std::size_t>(r)] > 0; }
  double at(int r, double t) const {
    const auto i = static_cast<std::size_t>(r);
    return total_[i] + (running_[i] > 0 ? t - since_[i] : 0.0);
  }

 private:
  std::vector<int> running_;
  std::vector<double> since_, total_;
};

// Per rank: time with data in flight from it and no matrix task running.
class Exposure {
 public:
  explicit Exposure(int ranks) : comm_(static_cast<std::size_t>(ranks)), matrix_(comm_.size()), since_(comm_.size()),
                                 exposed_(comm_.size()) {}
  void change(int r, double t, int d_comm, int d_matrix) {
    const auto i = static_cast<std::size_t>(r);
    if (comm_[i] > 0 && matrix_[i] == 0) exposed_[i] += t - since_[i];
    since_[i] = t;
    comm_[i] += d_comm;
    matrix_[i] += d_matrix;
  }
  double share(double makespan) const {
    if (makespan <= 0) return 0;
    double sum = 0;
    for (double e : exposed_) sum += e;
    return sum / (makespan * double(exposed_.size()));
  }

 private:
  std::vector<int> comm_, matrix_;
  std::vector<double> since_, exposed_;
};

TraceSlice slice(int rank, int unit, double start, double end, const Task& t) {
  std::string detail = t.expert >= 0 ? "expert " + std::to_string(t.expert) + " " : std::string();
  detail += "rows " + std::to_string(t.row_begin) + "+" + std::to_string(t.rows);
  if (is_put(t.kind)) detail += " to rank " + std::to_string(t.peer);
  return TraceSlice{rank, unit, start, end, taskflow::name(t.kind), std::move(detail)};
}

void check_programs(const std::vector<Program>& programs, const std::vector<std::vector<TaskWork>>& work) {
  if (programs.empty()) throw Error("simulate: no programs");
  if (work.size() != programs.size()) throw Error("simulate: work given for a different number of ranks");
  for (std::size_t r = 0; r < programs.size(); ++r)
    if (work[r].size() != programs[r].tasks.size()) throw Error("simulate: work and tasks differ on rank " + std::to_string(r));
}

}  // namespace

Timeline simulate_interleaved(const MachineModel& m, const std::vector<Program>& programs,
                              const std::vector<std::vector<TaskWork>>& work, DType dtype, bool trace) {
  check_programs(programs, work);
  const int P = static_cast<int>(programs.size());
  const int Q = programs[0].machine.workers();
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
  std::size_t slots_total = 0;
  for (const auto& p : programs) slots_total += p.queue_tasks.size();
  HugePageArray<Slot> slots(slots_total);
  std::vector<std::size_t> slot_base(static_cast<std::size_t>(P) + 1, 0);
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
  // A unit's queue, and a copy of its current task's slot (the task running
  // or waiting): reading the slot again at the task's end would miss the cache.
  struct Queue {
    std::size_t pos = 0, end = 0;  // into slots
    bool busy = false;
    std::int64_t trace_slice = -1;  // of its running task
    Slot task{};
  };
  std::vector<Queue> queues(static_cast<std::size_t>(P * Q));
  std::vector<std::vector<std::int32_t>> count(static_cast<std::size_t>(P));
  std::vector<std::vector<std::vector<std::int32_t>>> waiters(static_cast<std::size_t>(P));  // [rank][event] -> queues
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
  std::vector<Flight> flights;
  const bool held = m.put_engine == PutEngine::vector;
  const bool bounded = m.put_engine == PutEngine::dma && m.put_in_flight > 0;
  const bool receive_work = m.put_engine == PutEngine::cpu && (m.put_receive_s > 0 || m.put_receive_bytes_per_s > 0);
  std::vector<int> engines_busy(static_cast<std::size_t>(P), 0);
  std::vector<std::vector<int>> engine_waiting(static_cast<std::size_t>(P));  // FIFO of flights, per rank
  std::vector<std::size_t> engine_next(static_cast<std::size_t>(P), 0);
  std::vector<double> receiver_free(static_cast<std::size_t>(P), 0.0), stolen(static_cast<std::size_t>(P), 0.0);
  BusyClock busy(P);  // tasks running per rank, and for how long any was
  // put.stream_per_peer: the flights waiting for each (sender, peer) stream, in issue order.
  const bool streams = m.put_engine == PutEngine::cpu && m.put_stream_per_peer;
  const std::size_t pairs = streams ? static_cast<std::size_t>(P) * static_cast<std::size_t>(P) : 0;
  std::vector<std::vector<int>> stream_waiting(pairs);
  std::vector<std::size_t> stream_next(pairs, 0);
  std::vector<char> stream_busy(pairs, 0);
  std::priority_queue<Ev, std::vector<Ev>, std::greater<>> heap;
  std::uint64_t seq = 0;
  Links links(m, P);
  // A vector unit that copies a put itself moves its bytes at most at its own rate.
  const int unit_resources = held && m.vector_bytes_per_s > 0 ? links.add_resources(P * Q, m.vector_bytes_per_s) : -1;
  Exposure exposure(P);
  Timeline out;
  std::vector<int> resources;

  auto try_start = [&](int r, int w, double t) {
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
    heap.push(Ev{t + d, seq++, task_done, r, w, more ? static_cast<std::int32_t>(q.pos + 1 - slot_base[static_cast<std::size_t>(r)]) : -1});
  };
  auto fire = [&](int r, std::int32_t event, double t) {
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
  };
  // The unit's queue moves past its task and takes the next.
  auto finish_task = [&](int r, int w, double t) {
    Queue& q = queues[static_cast<std::size_t>(r * Q + w)];
    q.busy = false;
    ++q.pos;
    try_start(r, w, t);
  };
  auto start_flight = [&](int id, double t) {
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
  };
  auto deliver = [&](int id, double t) {
    const Flight& f = flights[static_cast<std::size_t>(id)];
    fire(f.peer, f.event, t);
    if (f.worker >= 0) {  // the vector unit that copied it is free again
      out.vector_busy += t - f.issued;
      if (f.trace_slice >= 0) out.trace[static_cast<std::size_t>(f.trace_slice)].end = t;
      finish_task(f.sender, f.worker, t);
    }
  };

  for (int r = 0; r < P; ++r)
    for (int w = 0; w < Q; ++w) try_start(r, w, 0.0);
  for (;;) {
    const double link_t = links.next_time();
    if (heap.empty() && link_t == kInf) break;
    if (link_t < kInf && (heap.empty() || link_t < heap.top().time)) {
      const auto [t, tag] = links.pop();  // bytes through: they land after the path's latency
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
      continue;
    }
    const Ev e = heap.top();
    heap.pop();
    if (const Ev* next = heap.empty() ? nullptr : &heap.top(); next && (next->type == task_done || next->type == wake)) {
      // The next event's unit and its next task: their cache misses overlap
      // this event's work instead of following it.
      __builtin_prefetch(&queues[static_cast<std::size_t>(next->rank * Q + next->a)]);
      if (next->next_slot >= 0)
        __builtin_prefetch(&slots[slot_base[static_cast<std::size_t>(next->rank)] + static_cast<std::size_t>(next->next_slot)]);
    }
    out.makespan = std::max(out.makespan, e.time);
    if (e.type == wake) {
      try_start(e.rank, e.a, e.time);
    } else if (e.type == arrive) {
      if (receive_work) {
        // The receiver's protocol stack, one put at a time on its core: it
        // takes the bytes as they come in (from the first byte, or when it
        // is done with the put before), so the put is whole when the last
        // byte lands or when the stack has caught up, whichever is later;
        // then its own work per put. The stack's work is spread over the
        // put's flight: the share of the flight during which the core
        // computed is the share taken from the task it computed.
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
      } else {
        deliver(e.a, e.time);
      }
    } else if (e.type == received) {
      deliver(e.a, e.time);
    } else {
      const auto r = static_cast<std::size_t>(e.rank);
      if (stolen[r] > 0) {  // the core also ran the receives meanwhile: the task ends that much later
        const double d = stolen[r];
        stolen[r] = 0;
        heap.push(Ev{e.time + d, seq++, task_done, e.rank, e.a, e.next_slot});
        continue;
      }
      busy.stop(e.rank, e.time);
      Queue& q = queues[static_cast<std::size_t>(e.rank * Q + e.a)];
      const bool put = is_put(q.task.kind);
      exposure.change(e.rank, e.time, put ? -1 : 0, q.task.queue_class == QueueClass::matrix ? -1 : 0);
      if (put && q.task.trigger_event >= 0 && q.task.peer != e.rank) {
        const int fid = static_cast<int>(flights.size());
        flights.push_back(Flight{e.rank, q.task.peer, q.task.trigger_event, held ? e.a : -1,
                                 work[r][static_cast<std::size_t>(q.task.id)].bytes, e.time,
                                 held ? q.trace_slice : -1});
        if (held) {  // its unit stays busy until the bytes land
          if (q.trace_slice >= 0) out.trace[static_cast<std::size_t>(q.trace_slice)].name += " (copy until landed)";
          start_flight(fid, e.time);
          continue;
        }
        if (bounded && links.path(e.rank, q.task.peer, resources).second > 0 &&
            engines_busy[r] >= m.put_in_flight) {
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
      } else if (q.task.trigger_event >= 0) {
        fire(q.task.peer, q.task.trigger_event, e.time);
      }
      finish_task(e.rank, e.a, e.time);
    }
  }
  for (int r = 0; r < P; ++r)
    for (int w = 0; w < Q; ++w) {
      const Queue& q = queues[static_cast<std::size_t>(r * Q + w)];
      if (q.pos < q.end) {
        throw Error("simulate: deadlock: rank " + std::to_string(r) + " worker " + std::to_string(w) + " waits on event " +
                    std::to_string(slots[q.pos].wait_event) + " for ever");
      }
    }
  out.exposed_comm = exposure.share(out.makespan);
  return out;
}

namespace {

// The serialized baseline's operators: one task kind each; an exchange is
// preceded by a permute (the gather of the rows into a send buffer).
struct Operator {
  TaskKind kind;
  bool all_to_all = false;
  bool permute_first = false;
};

std::vector<Operator> operators(taskflow::Pass pass) {
  std::vector<Operator> ops;
  for (TaskKind k : taskflow::operator_order(pass)) {
    const bool exchange = is_put(k);
    ops.push_back({k, exchange,
                   exchange && (k == TaskKind::dispatch_put || k == TaskKind::dispatch_cast_put || k == TaskKind::grad_dispatch_put ||
                                k == TaskKind::grad_dispatch_cast_put || k == TaskKind::dispatch_token_put ||
                                k == TaskKind::grad_dispatch_token_put || k == TaskKind::dispatch_node_put ||
                                k == TaskKind::grad_dispatch_node_put)});
  }
  return ops;
}

}  // namespace

namespace {

// Rows of an exchange in the DeepEP scheme, in the direction of `kind`:
// dispatch-like (tokens to experts) or combine-like (back), started at `now`
// on `links`; returns when the last lands.
double run_deepep_exchange(const MachineModel& m, const DeepEpExchange& ex, TaskKind kind, const taskflow::Dims& dims,
                       double now, Links& links, std::vector<int>& resources) {
  const int P = ex.ranks;
  const bool dispatch = kind == TaskKind::dispatch_put || kind == TaskKind::dispatch_cast_put;
  const bool to_experts = dispatch || kind == TaskKind::grad_dispatch_put || kind == TaskKind::grad_dispatch_cast_put;
  // Forward dispatch optionally in fp8 with one fp32 scale per 128 elements; the rest in the layer's dtype.
  const double row_bytes = dispatch && m.deepep.fp8_dispatch
                               ? double(dims.hidden) + 4.0 * double((dims.hidden + 127) / 128)
                               : double(dims.hidden * dims.elem_bytes);
  std::vector<std::pair<int, int>> ends;
  const auto send = [&](int from, int to, double rows) {
    if (rows <= 0 || from == to) return;
    if (!to_experts) std::swap(from, to);
    const auto [latency, bw] = links.path(from, to, resources);
    (void)latency;
    if (bw > 0) links.start(now, rows * row_bytes, resources, (std::int64_t{from} << 32) | to);
    ends.push_back({from, to});
  };
  const int rpn = m.ranks_per_node;
  for (int s = 0; s < P; ++s) {
    for (int d = 0; d < P; ++d) {
      send(s, d, ex.dispatch_rank[static_cast<std::size_t>(s * P + d)]);
      send(s, d, ex.dispatch_forward[static_cast<std::size_t>(s * P + d)]);
    }
    for (int n = 0; n < ex.nodes; ++n)
      send(s, std::min(P - 1, n * rpn + s % rpn), ex.dispatch_node[static_cast<std::size_t>(s * ex.nodes + n)]);
  }
  double end = now;
  for (const auto& [from, to] : ends) end = std::max(end, now + links.path(from, to, resources).first);
  while (links.next_time() < kInf) {
    const auto [t, tag] = links.pop();
    end = std::max(end, t + links.path(static_cast<int>(tag >> 32), static_cast<int>(tag & 0xFFFFFFFF), resources).first);
  }
  return end;
}

// One operator of the MindSpore/MindFormers token dispatcher
// (MoEAlltoAllZeroRedundancyTokenDispatcher), as its code runs it: a vector
// kernel over all vector units, an exchange, or a collective's handshake, and
// where the host waits for the device.
struct FrameworkOp {
  std::vector<double> vector_bytes;           // per rank, read + written (empty: none)
  const std::vector<double>* rows = nullptr;  // exchange rows [s * P + d] (a token once per destination rank)
  bool reverse = false;                       // the rows go d -> s
  double row_bytes = 0;
  double pair_bytes = 0;  // an all-to-all of equal blocks between every pair
  bool collective = false, host_sync = false;
};

// The dispatcher's operators around one exchange of hpmoe's operator order.
// N tokens a rank, E experts, H hidden, `el` bytes a bf16 element, f an fp32
// one; sent / received: a rank's rows in the token all-to-all-v (one per token
// and destination rank); expert: its rows for the grouped GEMM (one per token
// and expert). The backward pass runs the autograd mirror of each forward
// step (gathers become scatter-adds), without the routing map, the list
// all-gathers and the host copy, whose results the forward kept.
std::vector<FrameworkOp> mindspore_ops(TaskKind kind, const std::vector<Program>& programs, const DeepEpExchange& ex) {
  const int P = ex.ranks;
  const taskflow::Dims& d = programs[0].dims;
  const double H = double(d.hidden), N = double(d.tokens), E = double(d.experts), el = double(d.elem_bytes), f = 4;
  std::vector<double> sent(static_cast<std::size_t>(P), 0), received(sent), expert(sent);
  for (int a = 0; a < P; ++a)
    for (int b = 0; b < P; ++b) {
      sent[static_cast<std::size_t>(a)] += ex.dispatch_rank[static_cast<std::size_t>(a * P + b)];
      received[static_cast<std::size_t>(b)] += ex.dispatch_rank[static_cast<std::size_t>(a * P + b)];
    }
  for (int r = 0; r < P; ++r) expert[static_cast<std::size_t>(r)] = double(programs[static_cast<std::size_t>(r)].expert_begin.back());
  const auto per_rank = [&](auto&& bytes) {
    std::vector<double> v(static_cast<std::size_t>(P));
    for (int r = 0; r < P; ++r) v[static_cast<std::size_t>(r)] = bytes(static_cast<std::size_t>(r));
    return v;
  };
  const auto vec = [&](auto&& bytes) { return FrameworkOp{per_rank(bytes)}; };
  const FrameworkOp exchange{{}, &ex.dispatch_rank, false, H * el};
  FrameworkOp exchange_back = exchange;
  exchange_back.reverse = true;
  exchange_back.collective = true;
  FrameworkOp exchange_out = exchange;
  exchange_out.collective = true;
  std::vector<FrameworkOp> ops;
  // Forward combine and its mirror (the backward's gradient dispatch): scale
  // by the gate, sum a token's local experts (zeros, cast to fp32, index_add,
  // cast back), the all-to-all-v, then the same sum over the returned rows.
  const auto combine_like = [&](bool back) {
    ops.push_back(vec([&](std::size_t r) { return 2 * expert[r] * H * el; }));  // * probs
    ops.push_back(vec([&](std::size_t r) { return received[r] * H * f; }));     // zeros
    ops.push_back(vec([&](std::size_t r) { return expert[r] * H * (el + f); }));  // cast to fp32
    ops.push_back(vec([&](std::size_t r) { return expert[r] * H * f + 2 * received[r] * H * f; }));  // index_add
    ops.push_back(vec([&](std::size_t r) { return received[r] * H * (f + el); }));  // cast to bf16
    ops.push_back(back ? exchange_out : exchange_back);
    ops.push_back(vec([&](std::size_t) { return N * H * f; }));  // zeros
    ops.push_back(vec([&](std::size_t r) { return sent[r] * H * (el + f); }));  // cast to fp32
    ops.push_back(vec([&](std::size_t r) { return sent[r] * H * f + 2 * N * H * f; }));  // index_add
    ops.push_back(vec([&](std::size_t) { return N * H * (f + el); }));  // cast to bf16
  };
  switch (kind) {
    case TaskKind::dispatch_put:
    case TaskKind::dispatch_cast_put: {
      ops.push_back(vec([&](std::size_t) { return 3 * N * E * el; }));  // routing map: zeros, scatter, transpose
      FrameworkOp map;
      map.pair_bytes = N * E / P * el;  // the (ep, N, local E) map, all to all
      map.collective = true;
      ops.push_back(map);
      FrameworkOp gather_lists;
      gather_lists.collective = true;
      ops.push_back(gather_lists);  // send list
      ops.push_back(gather_lists);  // receive list
      FrameworkOp to_host;
      to_host.host_sync = true;  // MoveTo(CPU) of both lists: AlltoAllVC needs their counts on the host
      ops.push_back(to_host);
      ops.push_back(vec([&](std::size_t r) { return 2 * sent[r] * H * el; }));  // index_select for the all-to-all-v
      ops.push_back(exchange_out);
      ops.push_back(vec([&](std::size_t r) { return (received[r] + expert[r]) * H * el; }));  // index_select for the GMM
      break;
    }
    case TaskKind::combine_put: combine_like(false); break;
    case TaskKind::grad_dispatch_put:
    case TaskKind::grad_dispatch_cast_put: combine_like(true); break;
    default:  // grad_combine_put: the dispatch's gathers, mirrored
      ops.push_back(vec([&](std::size_t r) { return received[r] * H * el + (received[r] + expert[r]) * H * el; }));  // zeros + scatter-add
      ops.push_back(exchange_back);
      ops.push_back(vec([&](std::size_t) { return N * H * el; }));  // zeros
      ops.push_back(vec([&](std::size_t r) { return sent[r] * H * el + 2 * N * H * el; }));  // scatter-add
      break;
  }
  return ops;
}

// Runs framework operators from `now`; returns when the last one ends.
double run_framework_ops(const MachineModel& m, const std::vector<FrameworkOp>& ops, int P, double now, Links& links,
                         std::vector<int>& resources, double& exposed) {
  const double vector_rate = double(m.accelerator ? m.vector_units : m.workers) * m.vector_bytes_per_s;
  for (const FrameworkOp& op : ops) {
    now += m.operator_launch_s;
    const double start = now;
    double end = now;
    for (double bytes : op.vector_bytes) end = std::max(end, now + bytes / vector_rate + m.task_overhead_s);
    if (op.rows || op.pair_bytes > 0) {
      for (int s = 0; s < P; ++s)
        for (int d = 0; d < P; ++d) {
          if (s == d) continue;
          const double bytes = op.rows ? (*op.rows)[static_cast<std::size_t>(s * P + d)] * op.row_bytes : op.pair_bytes;
          if (bytes <= 0) continue;
          const int from = op.reverse ? d : s, to = op.reverse ? s : d;
          const auto [latency, bw] = links.path(from, to, resources);
          if (bw > 0) links.start(now, bytes, resources, (std::int64_t{from} << 32) | to);
          end = std::max(end, now + latency);
        }
      while (links.next_time() < kInf) {
        const auto [t, tag] = links.pop();
        end = std::max(end, t + links.path(static_cast<int>(tag >> 32), static_cast<int>(tag & 0xFFFFFFFF), resources).first);
      }
    }
    if (op.collective) end += m.collective_sync_s;
    if (op.host_sync) end += m.mindspore.host_sync_s;
    if (op.rows || op.pair_bytes > 0 || op.collective || op.host_sync) exposed += end - start;
    now = end;
  }
  return now;
}

enum class Baseline { framework, deepep, mindspore };

Timeline serialized(const MachineModel& m, const std::vector<Program>& programs,
                    const std::vector<std::vector<TaskWork>>& work, DType dtype, bool trace, Baseline baseline,
                    const DeepEpExchange* deepep) {
  check_programs(programs, work);
  const int P = static_cast<int>(programs.size());
  const taskflow::Machine& machine = programs[0].machine;
  const int Q = machine.workers();
  Timeline out;
  double exposed = 0;
  std::vector<int> resources;
  std::vector<std::pair<double, int>> dealt;  // CPU: each worker's free time, in turn
  const double overhead = m.serialized_task_overhead_s >= 0 ? m.serialized_task_overhead_s : m.task_overhead_s;
  Durations duration(m, dtype, overhead);
  // Task ids of each kind, per rank, in generation order.
  constexpr auto kinds = static_cast<std::size_t>(TaskKind::count);
  std::vector<std::vector<std::int32_t>> by_kind(static_cast<std::size_t>(P) * kinds);
  for (int r = 0; r < P; ++r) {
    const auto& p = programs[static_cast<std::size_t>(r)];
    for (std::size_t id = 0; id < p.tasks.size(); ++id)
      by_kind[static_cast<std::size_t>(r) * kinds + static_cast<std::size_t>(p.tasks[id].kind)].push_back(static_cast<std::int32_t>(id));
  }
  double now = 0;
  bool first = true;
  for (const Operator& op : operators(programs[0].pass)) {
    // DeepEP's dispatch format is its own (baselines.deepep.fp8_dispatch),
    // and its fp8 rows go to the GEMM with their scales: it runs no decode,
    // whatever format hpmoe's programs dispatch in.
    if (baseline == Baseline::deepep && (op.kind == TaskKind::dispatch_decode || op.kind == TaskKind::grad_dispatch_decode))
      continue;
    bool any = false;
    for (int r = 0; r < P && !any; ++r)
      for (const std::int32_t id : by_kind[static_cast<std::size_t>(r) * kinds + static_cast<std::size_t>(op.kind)])
        if (work[static_cast<std::size_t>(r)][static_cast<std::size_t>(id)].timed) {
          any = true;
          break;
        }
    if (!any) continue;  // nothing of it in scope: no operator
    // 0: the permute before an exchange, a framework's own operator (the CPU
    // baseline's dispatch gathers its rows itself, as the runtime's does).
    const bool permute = op.permute_first && baseline != Baseline::mindspore && m.accelerator;
    for (int pass = permute ? 0 : 1; pass < 2; ++pass) {
      if (!first) now += m.operator_launch_s;
      first = false;
      Links links(m, P);
      double end = now;
      if (baseline == Baseline::mindspore && op.all_to_all) {  // the dispatcher's own operators, permutes included
        now = run_framework_ops(m, mindspore_ops(op.kind, programs, *deepep), P, now - m.operator_launch_s, links, resources, exposed);
        continue;
      }
      if (baseline == Baseline::deepep && pass == 1 && op.all_to_all) {  // DeepEP's kernel moves the rows its own way
        const double op_end = run_deepep_exchange(m, *deepep, op.kind, programs[0].dims, now, links, resources) + m.deepep.kernel_launch_s;
        exposed += op_end - now;
        now = op_end;
        continue;
      }
      for (int r = 0; r < P; ++r) {
        const auto& p = programs[static_cast<std::size_t>(r)];
        // The units of the operator's class. An accelerator's framework
        // hands each tile to the earliest free unit (ties: lowest unit); the
        // CPU baseline deals an operator's tiles out in turn, tile i to
        // worker i mod W, as serialized.cpp does.
        std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>, std::greater<>> units;
        dealt.clear();
        if (taskflow::queue_class(op.kind) == QueueClass::matrix && m.serialized_matrix_units > 0)
          for (int w = 0; w < m.serialized_matrix_units; ++w) units.push({now, w});  // every SM on the framework's GEMMs
        else
          for (int w = 0; w < Q; ++w)
            if (machine.takes(w, taskflow::queue_class(op.kind))) {
              units.push({now, w});
              dealt.push_back({now, w});
            }
        const bool in_turn = !m.accelerator && !dealt.empty();
        std::size_t turn = 0;
        for (const std::int32_t task_id : by_kind[static_cast<std::size_t>(r) * kinds + static_cast<std::size_t>(op.kind)]) {
          const auto id = static_cast<std::size_t>(task_id);
          const Task& t = p.tasks[id];
          std::pair<double, int>* next_unit = in_turn ? &dealt[turn++ % dealt.size()] : nullptr;
          const auto [start, unit] = in_turn ? *next_unit : units.top();
          if (!in_turn) units.pop();
          const TaskWork& w = work[static_cast<std::size_t>(r)][id];
          const double bytes = w.bytes;
          const double d = !w.timed ? 0.0 : pass == 0 ? bytes / m.vector_bytes_per_s + overhead : duration(p, t, w);
          if (in_turn) next_unit->first = start + d;
          else units.push({start + d, unit});
          (t.queue == QueueClass::matrix ? out.matrix_busy : out.vector_busy) += d;
          const bool exchange = pass == 1 && is_put(t.kind);
          if (trace) {
            out.trace.push_back(slice(r, unit, start, start + d, t));
            if (pass == 0) out.trace.back().name = "permute";
          }
          end = std::max(end, start + d);
          if (exchange && t.peer != r) {
            const auto [latency, bw] = links.path(r, t.peer, resources);
            if (bw > 0) links.start(start + d, bytes, resources, (std::int64_t{r} << 32) | t.peer);
            else end = std::max(end, start + d + latency);
          }
        }
      }
      while (links.next_time() < kInf) {
        const auto [t, tag] = links.pop();
        end = std::max(end, t + links.path(static_cast<int>(tag >> 32), static_cast<int>(tag & 0xFFFFFFFF), resources).first);
      }
      const double op_end = end + (pass == 1 && op.all_to_all ? m.collective_sync_s : 0.0);
      // Nothing overlaps an exchange in a serialized step: all of it is exposed.
      if (pass == 1 && op.all_to_all) exposed += op_end - now;
      now = op_end;
    }
  }
  out.makespan = now;
  out.exposed_comm = now > 0 ? exposed / now : 0;
  return out;
}

}  // namespace

Timeline simulate_serialized(const MachineModel& m, const std::vector<Program>& programs,
                             const std::vector<std::vector<TaskWork>>& work, DType dtype, bool trace) {
  return serialized(m, programs, work, dtype, trace, Baseline::framework, nullptr);
}

Timeline simulate_deepep(const MachineModel& m, const std::vector<Program>& programs,
                         const std::vector<std::vector<TaskWork>>& work, DType dtype, const DeepEpExchange& ex) {
  if (ex.ranks != static_cast<int>(programs.size())) throw Error("simulate: the DeepEP exchange is for another number of ranks");
  return serialized(m, programs, work, dtype, false, Baseline::deepep, &ex);
}

Timeline simulate_mindspore(const MachineModel& m, const std::vector<Program>& programs,
                            const std::vector<std::vector<TaskWork>>& work, DType dtype, const DeepEpExchange& ex) {
  if (ex.ranks != static_cast<int>(programs.size())) throw Error("simulate: the exchange is for another number of ranks");
  return serialized(m, programs, work, dtype, false, Baseline::mindspore, &ex);
}

std::vector<std::vector<TaskWork>> task_work(const std::vector<Program>& programs) {
  const auto& table = taskflow::AccessTable::standard();
  std::vector<std::vector<TaskWork>> work(programs.size());
  for (std::size_t r = 0; r < programs.size(); ++r) {
    work[r].reserve(programs[r].tasks.size());
    for (const Task& t : programs[r].tasks) work[r].push_back(table.work(programs[r], t));
  }
  return work;
}

}  // namespace hpmoe::sim
