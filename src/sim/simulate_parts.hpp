// The simulator's parts shared by its two schedules (internal to the sim
// target): task durations on the machine model, the links a put crosses,
// unit and exposure clocks. simulate.cpp runs the interleaved schedule,
// baselines.cpp the serialized ones.
#pragma once

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

namespace hpmoe::sim::detail {


using taskflow::Program;
using taskflow::QueueClass;
using taskflow::Task;
using taskflow::TaskKind;
using taskflow::TaskWork;
inline constexpr double kInf = std::numeric_limits<double>::infinity();

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
inline double weight_reuse(const Program& p, const Task& t) {
  const std::int64_t tile = p.machine.tile_rows;
  const taskflow::KindRole& role = taskflow::role(t.kind);
  if (role.step != taskflow::TileStep::first_gemm && role.step != taskflow::TileStep::second_gemm) return 1e9;
  switch (role.scheme) {
    case taskflow::Scheme::layer: {
      const std::int64_t le = p.slot_of(t.expert);
      if (le < 0 || le + 1 >= static_cast<std::int64_t>(p.expert_begin.size())) return 1;
      const std::int64_t rows = p.expert_begin[static_cast<std::size_t>(le + 1)] - p.expert_begin[static_cast<std::size_t>(le)];
      return double(std::max<std::int64_t>(1, (rows + tile - 1) / tile));
    }
    case taskflow::Scheme::shared:
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
    if (t.queue == QueueClass::matrix) return gemm(t.rows, t.cols, std::max<std::int64_t>(1, work.k), weight_reuse(p,
        t)) + overhead_;
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
    link_ports_ = ports_.size();
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

  // The longest any link port (a rank's NVLink or NIC, out or in; a mesh
  // link) spent carrying bytes: a lower bound on any run that moves the
  // same bytes again, e.g. a second micro-batch.
  double busiest_link_s() const {
    double most = 0;
    for (std::size_t r = 0; r < link_ports_ && r < ports_.size(); ++r)
      if (ports_[r].capacity > 0) most = std::max(most, ports_[r].carried / ports_[r].capacity);
    return most;
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
      p.carried += bytes;
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
    double capacity = 0, virtual_time = 0, updated = 0, carried = 0;
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
  std::size_t link_ports_ = 0;  // the first ports are links; the rest, units that move bytes (add_resources)
  std::vector<int> pending_;  // per transfer: resources still carrying it
  std::vector<std::int64_t> tags_;
  std::vector<int> order_;  // a min-heap of the ports with transfers
};

// Per rank: how many tasks are running, and the time any was (a clock that
// runs only while the rank computes).
class BusyClock {
 public:
  explicit BusyClock(int ranks) : running_(static_cast<std::size_t>(ranks), 0), since_(running_.size()),
                     total_(running_.size()) {}
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

inline TraceSlice slice(int rank, int unit, double start, double end, const Task& t) {
  std::string detail = t.expert >= 0 ? "expert " + std::to_string(t.expert) + " " : std::string();
  detail += "rows " + std::to_string(t.row_begin) + "+" + std::to_string(t.rows);
  if (is_put(t.kind)) detail += " to rank " + std::to_string(t.peer);
  return TraceSlice{rank, unit, start, end, taskflow::name(t.kind), std::move(detail)};
}

inline void check_programs(const std::vector<Program>& programs, const std::vector<std::vector<TaskWork>>& work) {
  if (programs.empty()) throw Error("simulate: no programs");
  if (work.size() != programs.size()) throw Error("simulate: work given for a different number of ranks");
  for (std::size_t r = 0; r < programs.size(); ++r)
    if (work[r].size() != programs[r].tasks.size()) throw Error("simulate: work and tasks differ on rank " + std::to_string(r));
}

}  // namespace hpmoe::sim::detail
