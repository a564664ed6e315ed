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
#include <limits>
#include <queue>

#include "hpmoe/error.hpp"
#include "hpmoe/sim.hpp"

namespace hpmoe::sim {

namespace {

using taskflow::Program;
using taskflow::QueueClass;
using taskflow::Task;
using taskflow::TaskKind;
using taskflow::TaskWork;
constexpr double kInf = std::numeric_limits<double>::infinity();

using taskflow::is_put;

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

// Seconds a task occupies its unit.
double duration(const MachineModel& m, const Program& p, const Task& t, const TaskWork& work, DType dtype) {
  if (t.queue == QueueClass::matrix)
    return m.gemm_seconds(t.rows, t.cols, std::max<std::int64_t>(1, work.k), dtype, weight_reuse(p, t)) + m.task_overhead_s;
  if (is_put(t.kind))
    return m.put_issue_s + (m.put_copy_bytes_per_s > 0 ? work.bytes / m.put_copy_bytes_per_s : 0.0) + m.task_overhead_s;
  return work.bytes / m.vector_bytes_per_s + m.task_overhead_s;
}

// Links as processor-sharing servers: every port (or mesh link) shares its
// capacity equally among the transfers crossing it, and a transfer is through
// when every resource on its path has carried its bytes. Each resource keeps
// a virtual clock (bytes served per active transfer), so a start or a finish
// costs O(log n) however many transfers share the port.
class Links {
 public:
  Links(const MachineModel& m, int ranks) : m_(m) {
    if (m.mesh_cols > 0) {
      ports_.resize(static_cast<std::size_t>(ranks) * 4);
      for (auto& p : ports_) p.capacity = m.mesh_link_bytes_per_s;
    } else {
      ports_.resize(static_cast<std::size_t>(ranks) * 4);
      for (int r = 0; r < ranks; ++r) {
        ports_[static_cast<std::size_t>(4 * r)].capacity = ports_[static_cast<std::size_t>(4 * r + 1)].capacity = m.intra_bytes_per_s;
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
    const double bw = same_node ? m_.intra_bytes_per_s : m_.inter_bytes_per_s;
    if (bw > 0) {
      resources.push_back(4 * s + (same_node ? 0 : 2));  // sender's out port
      resources.push_back(4 * d + (same_node ? 1 : 3));  // receiver's in port
    }
    return {same_node ? m_.intra_latency_s : m_.inter_latency_s, bw};
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

  double next_time() {
    drop_stale();
    return events_.empty() ? kInf : events_.top().time;
  }

  // The earliest finished transfer: (time, tag).
  std::pair<double, std::int64_t> pop() {
    for (;;) {
      drop_stale();
      const Next e = events_.top();
      events_.pop();
      Port& p = ports_[static_cast<std::size_t>(e.port)];
      advance(p, e.time);
      const int id = p.queue.top().id;
      p.queue.pop();
      --p.active;
      reschedule(e.port);
      if (--pending_[static_cast<std::size_t>(id)] == 0) return {e.time, tags_[static_cast<std::size_t>(id)]};
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
    std::uint64_t version = 0;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  };
  struct Next {
    double time;
    int port;
    std::uint64_t version;
    bool operator>(const Next& o) const { return time != o.time ? time > o.time : port > o.port; }
  };

  static void advance(Port& p, double t) {
    if (p.active > 0) p.virtual_time += (t - p.updated) * p.capacity / p.active;
    p.updated = t;
  }
  void reschedule(int r) {
    Port& p = ports_[static_cast<std::size_t>(r)];
    ++p.version;
    if (p.queue.empty()) return;
    events_.push(Next{p.updated + (p.queue.top().finish - p.virtual_time) * p.active / p.capacity, r, p.version});
  }
  void drop_stale() {
    while (!events_.empty() && events_.top().version != ports_[static_cast<std::size_t>(events_.top().port)].version) events_.pop();
  }

  const MachineModel& m_;
  std::vector<Port> ports_;
  std::vector<int> pending_;  // per transfer: resources still carrying it
  std::vector<std::int64_t> tags_;
  std::priority_queue<Next, std::vector<Next>, std::greater<>> events_;
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
  struct Queue {
    std::int32_t pos = 0, end = 0;
    bool busy = false;
  };
  std::vector<Queue> queues(static_cast<std::size_t>(P * Q));
  std::vector<std::vector<std::int32_t>> count(static_cast<std::size_t>(P));
  std::vector<std::vector<std::vector<std::int32_t>>> waiters(static_cast<std::size_t>(P));  // [rank][event] -> queues
  for (int r = 0; r < P; ++r) {
    const auto& p = programs[static_cast<std::size_t>(r)];
    if (p.machine.workers() != Q) throw Error("simulate: ranks have different worker counts");
    count[r].assign(p.events.size(), 0);
    waiters[r].resize(p.events.size());
    for (int w = 0; w < Q; ++w) queues[static_cast<std::size_t>(r * Q + w)] = Queue{p.queue_begin[w], p.queue_begin[w + 1], false};
  }
  enum Type : int { task_done, wake, arrive };
  struct Ev {
    double time;
    std::uint64_t seq;
    int type, rank, a;
    bool operator>(const Ev& o) const { return time != o.time ? time > o.time : seq > o.seq; }
  };
  std::priority_queue<Ev, std::vector<Ev>, std::greater<>> heap;
  std::uint64_t seq = 0;
  Links links(m, P);
  Exposure exposure(P);
  Timeline out;
  std::vector<int> resources;

  auto try_start = [&](int r, int w, double t) {
    Queue& q = queues[static_cast<std::size_t>(r * Q + w)];
    if (q.busy || q.pos >= q.end) return;
    const auto& p = programs[static_cast<std::size_t>(r)];
    const std::int32_t id = p.queue_tasks[static_cast<std::size_t>(q.pos)];
    const Task& task = p.tasks[static_cast<std::size_t>(id)];
    if (task.wait_event >= 0 && count[r][static_cast<std::size_t>(task.wait_event)] < task.wait_count) {
      waiters[r][static_cast<std::size_t>(task.wait_event)].push_back(w);
      return;
    }
    const double d = duration(m, p, task, work[static_cast<std::size_t>(r)][static_cast<std::size_t>(id)], dtype);
    q.busy = true;
    (task.queue == QueueClass::matrix ? out.matrix_busy : out.vector_busy) += d;
    exposure.change(r, t, is_put(task.kind) ? 1 : 0, task.queue == QueueClass::matrix ? 1 : 0);
    if (trace) out.trace.push_back(slice(r, w, t, t + d, task));
    heap.push(Ev{t + d, seq++, task_done, r, w});
  };
  auto fire = [&](int r, std::int32_t event, double t) {
    auto& c = count[r][static_cast<std::size_t>(event)];
    ++c;
    auto& list = waiters[r][static_cast<std::size_t>(event)];
    const auto& p = programs[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < list.size();) {
      const Queue& q = queues[static_cast<std::size_t>(r * Q + list[i])];
      const Task& task = p.tasks[static_cast<std::size_t>(p.queue_tasks[static_cast<std::size_t>(q.pos)])];
      if (c >= task.wait_count) {
        heap.push(Ev{t + m.signal_latency_s, seq++, wake, r, list[i]});
        list[i] = list.back();
        list.pop_back();
      } else {
        ++i;
      }
    }
  };

  for (int r = 0; r < P; ++r)
    for (int w = 0; w < Q; ++w) try_start(r, w, 0.0);
  for (;;) {
    const double link_t = links.next_time();
    if (heap.empty() && link_t == kInf) break;
    if (link_t < kInf && (heap.empty() || link_t < heap.top().time)) {
      const auto [t, tag] = links.pop();  // bytes through: they land after the path's latency
      const int sender = static_cast<int>(tag >> 40), peer = static_cast<int>((tag >> 20) & 0xFFFFF);
      const auto latency = links.path(sender, peer, resources).first;
      exposure.change(sender, t, -1, 0);
      heap.push(Ev{t + latency, seq++, arrive, peer, static_cast<int>(tag & 0xFFFFF)});
      continue;
    }
    const Ev e = heap.top();
    heap.pop();
    out.makespan = std::max(out.makespan, e.time);
    if (e.type == wake) {
      try_start(e.rank, e.a, e.time);
    } else if (e.type == arrive) {
      fire(e.rank, e.a, e.time);
    } else {
      Queue& q = queues[static_cast<std::size_t>(e.rank * Q + e.a)];
      const auto& p = programs[static_cast<std::size_t>(e.rank)];
      const std::int32_t id = p.queue_tasks[static_cast<std::size_t>(q.pos)];
      const Task& task = p.tasks[static_cast<std::size_t>(id)];
      q.busy = false;
      ++q.pos;
      exposure.change(e.rank, e.time, 0, task.queue == QueueClass::matrix ? -1 : 0);
      if (task.trigger_event >= 0) {
        if (task.trigger_event >= (1 << 20) || task.peer >= (1 << 20))
          throw Error("simulate: more than 2^20 events or ranks");
        if (is_put(task.kind) && task.peer != e.rank) {
          const auto [latency, bw] = links.path(e.rank, task.peer, resources);
          const double bytes = work[static_cast<std::size_t>(e.rank)][static_cast<std::size_t>(id)].bytes;
          if (bw > 0) {  // still in flight: counts as this rank's communication until it lands
            exposure.change(e.rank, e.time, 1, 0);
            links.start(e.time, bytes, resources,
                        (std::int64_t{e.rank} << 40) | (std::int64_t{task.peer} << 20) | task.trigger_event);
          } else {
            heap.push(Ev{e.time + latency, seq++, arrive, task.peer, task.trigger_event});
          }
          exposure.change(e.rank, e.time, -1, 0);
        } else {
          if (is_put(task.kind)) exposure.change(e.rank, e.time, -1, 0);
          fire(task.peer, task.trigger_event, e.time);
        }
      } else if (is_put(task.kind)) {
        exposure.change(e.rank, e.time, -1, 0);
      }
      try_start(e.rank, e.a, e.time);
    }
  }
  for (int r = 0; r < P; ++r)
    for (int w = 0; w < Q; ++w) {
      const Queue& q = queues[static_cast<std::size_t>(r * Q + w)];
      if (q.pos < q.end) {
        const auto& p = programs[static_cast<std::size_t>(r)];
        const Task& t = p.tasks[static_cast<std::size_t>(p.queue_tasks[static_cast<std::size_t>(q.pos)])];
        throw Error("simulate: deadlock: rank " + std::to_string(r) + " worker " + std::to_string(w) + " waits on event " +
                    std::to_string(t.wait_event) + " for ever");
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
    ops.push_back({k, exchange, exchange && (k == TaskKind::dispatch_put || k == TaskKind::grad_dispatch_put)});
  }
  return ops;
}

}  // namespace

Timeline simulate_serialized(const MachineModel& m, const std::vector<Program>& programs,
                             const std::vector<std::vector<TaskWork>>& work, DType dtype, bool trace) {
  check_programs(programs, work);
  const int P = static_cast<int>(programs.size());
  const taskflow::Machine& machine = programs[0].machine;
  const int Q = machine.workers();
  Timeline out;
  double exposed = 0;
  std::vector<int> resources;
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
    bool any = false;
    for (int r = 0; r < P; ++r) any = any || !by_kind[static_cast<std::size_t>(r) * kinds + static_cast<std::size_t>(op.kind)].empty();
    if (!any) continue;
    for (int pass = op.permute_first ? 0 : 1; pass < 2; ++pass) {  // 0: the permute before an exchange
      if (!first) now += m.operator_launch_s;
      first = false;
      Links links(m, P);
      double end = now;
      for (int r = 0; r < P; ++r) {
        const auto& p = programs[static_cast<std::size_t>(r)];
        // The units of the operator's class, earliest free first (ties: lowest unit).
        std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>, std::greater<>> units;
        for (int w = 0; w < Q; ++w)
          if (machine.takes(w, taskflow::queue_class(op.kind))) units.push({now, w});
        for (const std::int32_t task_id : by_kind[static_cast<std::size_t>(r) * kinds + static_cast<std::size_t>(op.kind)]) {
          const auto id = static_cast<std::size_t>(task_id);
          const Task& t = p.tasks[id];
          const auto [start, unit] = units.top();
          units.pop();
          const TaskWork& w = work[static_cast<std::size_t>(r)][id];
          const double bytes = w.bytes;
          const double d = pass == 0 ? bytes / m.vector_bytes_per_s + m.task_overhead_s : duration(m, p, t, w, dtype);
          units.push({start + d, unit});
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
