#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace hpmoe {

// An event counter of the runtime: one per cache line. Counters only grow;
// a launch waits for (value at launch start) + count.
struct alignas(64) EventCounter {
  std::atomic<std::int64_t> value{0};
};

// Where the P ranks of a layer live and how rows reach a peer. Every rank
// owns a symmetric segment (the buffers peers put rows into) and an array of
// event counters. A process hosts some ranks; it can address the segments of
// some others directly (same process, or a shared-memory window), and reaches
// the rest with put_signal.
//
// Collective calls (reserve*, launch_begin/end, gather) must be made by every
// process in the same order with the same arguments; the runtime derives them
// from the routing, which every process computes identically.
class Transport {
 public:
  virtual ~Transport() = default;
  // Ends this process's part in the transport: peers are told it left (a
  // peer that still waits for it then fails at once, naming it, instead of
  // waiting for ever), the last barrier is met, and whatever runs in the
  // background stops. Idempotent; the destructor does the same.
  virtual void close() {}
  virtual std::string describe() const = 0;
  virtual int ranks() const = 0;
  virtual bool hosts(int rank) const = 0;
  // Index of this process among those on its machine: where its workers are pinned.
  virtual int node_index() const { return 0; }
  // Root process: the one that receives gather().
  virtual bool is_root() const { return true; }

  // Collective: rank r's segment holds at least bytes[r] bytes (64-byte
  // aligned) and its counter array at least events[r] counters. Growing
  // may move memory and lose contents; counters restart from zero.
  virtual void reserve_segments(std::span<const std::int64_t> bytes) = 0;
  virtual void reserve_events(std::span<const std::int64_t> events) = 0;
  // nullptr where rank's memory is not addressable from this process.
  virtual std::byte* segment(int rank) = 0;
  virtual EventCounter* counters(int rank) = 0;

  // For a rank whose memory is not addressable: copies `data` into its
  // segment at `offset`, then adds one to its counter `event`, in that order
  // as seen by the receiving rank's workers. Thread-safe; returns at once
  // (or, when too many bytes are in flight, once there is room again).
  virtual void put_signal(int to, std::int64_t offset, std::span<const std::byte> data, std::int32_t event) = 0;
  // The same for rows written in place: `message` holds put_header_bytes()
  // bytes for the transport, then the rows, and is sent without a copy.
  virtual std::size_t put_header_bytes() const { return 0; }
  virtual void send_put(int to, std::int64_t offset, std::vector<std::byte>&& message, std::int32_t event) {
    put_signal(to, offset, std::span<const std::byte>(message).subspan(put_header_bytes()), event);
  }
  // A zeroed message of `bytes` bytes for send_put. Where puts travel as
  // messages, the transport keeps the buffers of sends that completed and
  // hands them out again: a fresh allocation for every put costs page faults
  // (glibc maps large blocks and gives them back when freed).
  virtual std::vector<std::byte> message_buffer(std::size_t bytes) { return std::vector<std::byte>(bytes); }

  // Collective: every process has armed its counters before any signals a
  // peer (begin); every put has been delivered and every process is done (end).
  virtual void launch_begin() {}
  virtual void launch_end() {}
  // Collective: `owner`'s `data` is copied into the root's `data`.
  virtual void gather(std::span<float> data, int owner) { (void)data, (void)owner; }
  // Collective, for transports that host one rank per process: `all` holds
  // one block of `block` bytes per rank in rank order, and each process has
  // written its own rank's block; on return every process holds every block.
  virtual void allgather(std::span<std::byte> all, std::size_t block);
  // Collective, one rank per process: on entry `data` is this rank's part;
  // on return, on every process, the elementwise sum over ranks in rank
  // order, (((0 + part 0) + part 1) + ...), the order an in-process sum
  // takes, so the result is bit-identical to it (no MPI_Allreduce, whose
  // order is unspecified).
  virtual void sum_in_rank_order(std::span<float> data);
  virtual void sum_in_rank_order(std::span<double> data);
  // A description of peers that stopped responding (empty if none): the
  // watchdog adds it to its error, and a waiting worker gives up early.
  virtual std::string failed_peers() const { return {}; }

  // The runtime's count of its workers in tasks, for a transport whose
  // progress thread shares their cores (null: stop watching). It must
  // outlive the watching.
  virtual void watch_workers(class WorkerActivity* activity) { (void)activity; }
};

// How many of a process's launch workers are inside a task, and how many
// wait for an event they could not reach by spinning: while none waits, no
// worker needs a message now, so a progress thread on their cores can nap and
// leave them the CPU; a worker that starts to wait rings the doorbell.
class WorkerActivity {
 public:
  void set_workers(int workers) { workers_.store(workers, std::memory_order_relaxed); }
  void enter() { in_tasks_.fetch_add(1, std::memory_order_relaxed); }
  void leave() { in_tasks_.fetch_sub(1, std::memory_order_relaxed); }
  bool all_busy() const {
    const int w = workers_.load(std::memory_order_relaxed);
    return w > 0 && in_tasks_.load(std::memory_order_relaxed) >= w;
  }
  // A worker's event is not reached after its spin: it may wait for a
  // message. seq_cst against Doorbell::nap's check of any_waiting().
  void begin_wait() {
    waiting_.fetch_add(1, std::memory_order_seq_cst);
    if (Doorbell* d = doorbell_.load(std::memory_order_acquire)) d->ring();
  }
  void end_wait() { waiting_.fetch_sub(1, std::memory_order_relaxed); }
  bool any_waiting() const { return waiting_.load(std::memory_order_seq_cst) > 0; }

  // Wakes a thread that naps until it is needed. Ringing costs one load
  // while nobody naps, so it can sit on a worker's path.
  class Doorbell {
   public:
    void ring() {
      if (!napping_.load(std::memory_order_seq_cst)) return;
      {
        std::lock_guard lock(mutex_);
        rung_ = true;
      }
      cv_.notify_one();
    }
    // Sleeps for at most `longest` unless rung. `still_quiet` is checked
    // after the napper is visible to ring(), so a change made before a ring
    // is either seen here or wakes the nap: none is lost.
    template <class Rep, class Period, class Quiet>
    void nap(std::chrono::duration<Rep, Period> longest, Quiet&& still_quiet) {
      std::unique_lock lock(mutex_);
      rung_ = false;
      napping_.store(true, std::memory_order_seq_cst);
      if (still_quiet()) cv_.wait_for(lock, longest, [this] { return rung_; });
      napping_.store(false, std::memory_order_relaxed);
    }

   private:
    std::atomic<bool> napping_{false};
    std::mutex mutex_;
    std::condition_variable cv_;
    bool rung_ = false;
  };
  // The doorbell begin_wait() rings (null: none); it must outlive the activity's use.
  void ring_on_wait(Doorbell* d) { doorbell_.store(d, std::memory_order_release); }

 private:
  std::atomic<int> workers_{0}, in_tasks_{0}, waiting_{0};
  std::atomic<Doorbell*> doorbell_{nullptr};
};

// All ranks in this process (the default): segments are plain memory.
std::shared_ptr<Transport> make_inprocess_transport(int ranks);

// MPI: one rank per process. `path` is how rows reach a peer:
//   auto    shared memory if all processes are on one machine, else hybrid
//           where a machine holds several, else network
//   shared  MPI-3 shared-memory windows: workers store into the peer's
//           segment and add to its counters directly
//   network put+signal as one message, sent and applied by a progress
//           thread per process that makes all MPI calls (works over TCP)
//   hybrid  shared-memory windows among the ranks of a node (the layer's
//           ranks_per_node consecutive ranks, or the processes of a machine
//           when it has none), network messages between nodes
enum class MpiPath { automatic, shared, network, hybrid };
MpiPath parse_mpi_path(const std::string&);

struct MpiOptions;

// MPI_Init_thread / MPI_Finalize for the process's lifetime.
//
// Start-up (MPI_Init and the transport's first collectives) makes blocking
// calls that a frozen or missing peer never lets return, before any
// heartbeat runs. With `startup_limit_s` > 0 a guard ends the process with
// one error line and exit code 2 unless started() is called within that
// many seconds.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv, double startup_limit_s = 0);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }
  static bool available();  // built with MPI
  // Start-up is over (the transport is built): the guard stands down.
  void started();
  // Ends the whole job now: `message` (one line, this process's rank in
  // front) on stderr, then MPI_Abort with `code`, which makes mpirun stop
  // every process. For an error on one process that the others would wait
  // for (they are in a collective or a launch with it).
  [[noreturn]] void abort(const std::string& message, int code = 2) const;

 private:
  friend std::shared_ptr<Transport> make_mpi_transport(const MpiSession&, int, const MpiOptions&);
  struct StartupGuard;
  std::unique_ptr<StartupGuard> guard_;
  int rank_ = 0, size_ = 1;
  // The transports made on this session that may still be alive: each is
  // closed (its progress thread stopped, its windows freed) before
  // MPI_Finalize, whatever still holds it (a Python object alive at exit).
  mutable std::mutex open_mutex_;
  mutable std::vector<std::weak_ptr<Transport>> open_;
};

struct MpiOptions {
  MpiPath path = MpiPath::automatic;
  double peer_timeout_seconds = 5.0;  // a peer silent this long (no heartbeat) is reported by failed_peers()
  // Network path: bytes of puts queued or in flight from this process at
  // most; a worker whose put would exceed it waits for room (backpressure).
  std::int64_t outbox_bytes = std::int64_t{64} << 20;
  // How allgather (the per-step count exchange) runs. One-sided: on the
  // shared-memory path stores into every peer's control area with an
  // arrival counter; on the network path (no remote memory access there, a
  // put is a message) the block sent straight to every peer, as puts are.
  // Collective: MPI_Iallgather. Automatic: whichever measured faster on the
  // path (docs/results/benchmarks.md): one-sided on shared memory, the collective on
  // the network path.
  enum class CountExchange { automatic, one_sided, collective };
  CountExchange count_exchange = CountExchange::automatic;
  // Hybrid path: ranks a node (consecutive ranks; they must share a
  // machine); 0: the processes of each machine.
  int ranks_per_node = 0;
  // Options every process must have been started with alike, beside the
  // transport's own (path, count exchange, ranks per node): (the name the
  // user typed, its value as text). The transport compares them across
  // processes before it builds anything that depends on them, with plain
  // blocking MPI on the world communicator, so a difference is one error
  // naming the option on every process, never a hang in the path in dispute.
  std::vector<std::pair<std::string, std::string>> agree{};
};
std::shared_ptr<Transport> make_mpi_transport(const MpiSession&, int ranks, const MpiOptions& = {});

}  // namespace hpmoe
