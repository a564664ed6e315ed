// MPI transport: one rank per process.
//
// Shared path: each process's segment and counters live in MPI-3
// shared-memory windows (one passive-target lock_all epoch for their whole
// life), so workers store rows straight into a peer's segment and add to its
// counters with release atomics, exactly as in-process ranks do.
//
// Network path: a put with signal is one message (offset, event, rows). The
// receiving process's progress thread copies the rows into its segment and
// then adds to the counter (release), so a worker that sees the count sees
// the rows. This is MPI_Put + flush + MPI_Accumulate folded into one message;
// it works over plain TCP, where Open MPI's osc/rdma cannot create a window.
// (osc/pt2pt does work at MPI_THREAD_SERIALIZED, but it is itself built on
// messages and needs the target to progress, so it would add a layer, not
// remove the progress thread.)
//
// Both paths: a progress thread per process makes every MPI call (MPI is
// initialised MPI_THREAD_SERIALIZED), so workers never enter MPI; collectives
// are nonblocking and polled, so a process waiting in one neither burns a core
// another process needs nor stops applying incoming puts; heartbeats to every
// peer let a waiting rank name a peer that died or became unreachable.
#include "hpmoe/transport.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "hpmoe/error.hpp"

#ifdef HPMOE_HAVE_MPI
#include <mpi.h>
#endif

namespace hpmoe {

#ifndef HPMOE_HAVE_MPI

struct MpiSession::StartupGuard {};
MpiSession::MpiSession(int*, char***, double) {
  throw Error("this hpmoe was built without MPI; install libopenmpi-dev and rebuild, or use --transport inprocess");
}
MpiSession::~MpiSession() = default;
void MpiSession::started() {}
bool MpiSession::available() { return false; }
std::shared_ptr<Transport> make_mpi_transport(const MpiSession&, int, const MpiOptions&) {
  throw Error("this hpmoe was built without MPI");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw Error(std::string("MPI ") + what + " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

// kPut carries a put's header, kRows its rows (a second message from the
// same buffer, received straight into the segment).
enum Tag : int { kPut = 101, kBeat = 102, kGather = 103, kSum = 104, kRows = 105, kCount = 106 };

// Rows up to this size travel in the header's message (one message, one
// small copy out of it); larger ones in their own message, received in place.
constexpr std::int64_t kInlineRows = 8192;

// The progress thread's longest nap while the doorbell stays silent: with
// sends or receives of its own in flight (their sockets move bytes only when
// polled), and with none (heartbeats every 100 ms; peers time out after
// seconds).
constexpr auto kNapInFlight = std::chrono::milliseconds(1);
constexpr auto kNapQuiet = std::chrono::milliseconds(10);

// Completed puts' buffers kept for reuse, at most (message_buffer searches them).
constexpr std::size_t kMaxSpareBuffers = 256;

struct PutHeader {
  std::int64_t offset;  // into the target's segment
  std::int64_t bytes;   // of rows following in a kRows message (0: none)
  std::int32_t event;
  std::int32_t pad;
};

class Mpi final : public Transport {
 public:
  Mpi(int ranks, const MpiOptions& options)
      : peer_timeout_(options.peer_timeout_seconds), outbox_limit_(options.outbox_bytes) {
    const auto exchange = options.count_exchange;
    const MpiPath path = options.path;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    if (ranks != size_)
      throw Error("--transport mpi runs one rank per process: the layer has " + std::to_string(ranks) +
                  " ranks but there are " + std::to_string(size_) + " MPI processes (launch with mpirun -np " +
                  std::to_string(ranks) + ")");
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_), "Comm_split_type");
    int node_size = 0;
    MPI_Comm_rank(node_, &node_index_);
    MPI_Comm_size(node_, &node_size);
    const bool one_node = node_size == size_;
    if (path == MpiPath::shared && !one_node)
      throw Error("--mpi-path shared needs every process on one machine; these " + std::to_string(size_) +
                  " processes span several (use --mpi-path network, hybrid or auto)");
    int largest_machine = 0;
    MPI_Allreduce(&node_size, &largest_machine, 1, MPI_INT, MPI_MAX, comm_);
    shared_ = path == MpiPath::shared || (path == MpiPath::automatic && one_node);
    hybrid_ = path == MpiPath::hybrid || (path == MpiPath::automatic && !one_node && largest_machine > 1);
    share_ = node_;  // the ranks whose segments and counters this process maps
    if (hybrid_) join_node(options.ranks_per_node);
    {
      int n = 0;
      MPI_Comm_size(share_, &n);
      MPI_Group shared_group, world_group;
      MPI_Comm_group(share_, &shared_group);
      MPI_Comm_group(comm_, &world_group);
      std::vector<int> mine(static_cast<std::size_t>(n)), world(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i) mine[static_cast<std::size_t>(i)] = i;
      MPI_Group_translate_ranks(shared_group, n, mine.data(), world_group, world.data());
      MPI_Group_free(&shared_group);
      MPI_Group_free(&world_group);
      share_members_ = world;
    }
    one_sided_exchange_ = exchange == MpiOptions::CountExchange::one_sided ||
                          (exchange == MpiOptions::CountExchange::automatic && shared_);
    segments_.assign(static_cast<std::size_t>(size_), nullptr);
    counters_.assign(static_cast<std::size_t>(size_), nullptr);
    control_.assign(static_cast<std::size_t>(size_), nullptr);
    seg_bytes_.assign(static_cast<std::size_t>(size_), 0);
    event_capacity_.assign(static_cast<std::size_t>(size_), 0);
    last_heard_.assign(static_cast<std::size_t>(size_), Clock::now());
    progress_ = std::thread([this] { progress_loop(); });
  }

  ~Mpi() override {
    try {
      if (!failed_) run([this](bool first) { return barrier_step(first); });
    } catch (...) {
    }
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    doorbell_.ring();
    progress_.join();
    for (OutNode* n = outbox_.exchange(nullptr); n;) delete std::exchange(n, n->next);
    // Only this thread is left to call MPI. Heartbeats still in flight to a
    // peer are given a moment, then let go.
    const auto give_up = Clock::now() + std::chrono::seconds(1);
    for (auto& s : sends_) {
      int done = 0;
      while (!done && Clock::now() < give_up && MPI_Test(&s.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS) {
      }
      if (!done) MPI_Request_free(&s.request);
    }
    free_windows();
    if (share_ != node_) MPI_Comm_free(&share_);
    MPI_Comm_free(&node_);
    MPI_Comm_free(&comm_);
  }

  std::string describe() const override {
    return std::string("mpi ") +
           (shared_   ? "shared-memory windows"
            : hybrid_ ? "hybrid: shared-memory windows inside nodes of " + std::to_string(share_members_.size()) +
                            ", network messages across"
                      : "network messages") +
           ", " + std::to_string(size_) + " processes";
  }
  int ranks() const override { return size_; }
  bool hosts(int rank) const override { return rank == rank_; }
  int node_index() const override { return node_index_; }
  bool is_root() const override { return rank_ == 0; }

  void reserve_segments(std::span<const std::int64_t> bytes) override {
    check_size(bytes.size());
    // Grow with headroom when a rank needs more; give memory back when a
    // rank holds more than four times what it needs (after a spike). Every
    // process sees the same sizes, so all reach the same decision and
    // reallocate together (no message needed to agree).
    bool change = false;
    for (int r = 0; r < size_; ++r)
      change = change || seg_bytes_[r] < bytes[r] || seg_bytes_[r] > 4 * round64(bytes[r] + bytes[r] / 2) + kKeepBytes;
    if (!change) return;
    for (int r = 0; r < size_; ++r) seg_bytes_[r] = round64(bytes[r] + bytes[r] / 2);
    if (shared_) {
      run_collective(share_, [this] { allocate_shared(data_win_, seg_bytes_, segments_); });
    } else if (hybrid_) {  // the node's segments mapped, rows from other nodes received into this one
      run_collective(share_, [this] {
        std::lock_guard lock(apply_mutex_);
        if (pending_arrivals_.load(std::memory_order_relaxed) > 0)
          throw Error("internal: the segment is being resized while rows from a peer are still arriving");
        allocate_shared(data_win_, seg_bytes_, segments_);
        local_bytes_ = seg_bytes_[rank_];
      });
    } else {
      std::lock_guard lock(apply_mutex_);
      if (pending_arrivals_.load(std::memory_order_relaxed) > 0)
        throw Error("internal: the segment is being resized while rows from a peer are still arriving");
      std::vector<Line>(static_cast<std::size_t>(seg_bytes_[rank_] / 64)).swap(local_);  // frees a larger one
      segments_[rank_] = reinterpret_cast<std::byte*>(local_.data());
      local_bytes_ = seg_bytes_[rank_];
    }
  }

  void reserve_events(std::span<const std::int64_t> events) override {
    check_size(events.size());
    bool grow = false;
    for (int r = 0; r < size_; ++r) grow = grow || event_capacity_[r] < events[r];
    if (!grow) return;
    for (int r = 0; r < size_; ++r) event_capacity_[r] = std::max(event_capacity_[r], events[r] * 2);
    if (shared_ || hybrid_) {
      std::vector<std::int64_t> bytes(event_capacity_.size());
      for (std::size_t r = 0; r < bytes.size(); ++r) bytes[r] = event_capacity_[r] * std::int64_t{sizeof(EventCounter)};
      std::vector<std::byte*> bases(bytes.size(), nullptr);
      run_collective(share_, [&] {
        std::lock_guard lock(apply_mutex_);  // hybrid: puts from other nodes count into these
        allocate_shared(event_win_, bytes, bases);
        for (std::size_t r = 0; r < bases.size(); ++r) counters_[r] = reinterpret_cast<EventCounter*>(bases[r]);
        local_events_ = event_capacity_[rank_];
      });
    } else {
      // A fresh array while the progress thread may touch the old one: swap under the lock.
      auto fresh = std::make_unique<EventCounter[]>(static_cast<std::size_t>(event_capacity_[rank_]));
      std::lock_guard lock(apply_mutex_);
      local_counters_ = std::move(fresh);
      counters_[rank_] = local_counters_.get();
      local_events_ = event_capacity_[rank_];
    }
    run([this](bool first) { return barrier_step(first); });  // nobody signals into a counter not yet there
  }

  std::byte* segment(int rank) override { return segments_.at(static_cast<std::size_t>(rank)); }
  EventCounter* counters(int rank) override { return counters_.at(static_cast<std::size_t>(rank)); }

  void put_signal(int to, std::int64_t offset, std::span<const std::byte> data, std::int32_t event) override {
    std::vector<std::byte> message = message_buffer(sizeof(PutHeader) + data.size());
    if (!data.empty()) std::memcpy(message.data() + sizeof(PutHeader), data.data(), data.size());
    send_put(to, offset, std::move(message), event);
  }

  std::size_t put_header_bytes() const override { return sizeof(PutHeader); }

  // The smallest kept buffer that holds `bytes`, else a fresh one.
  std::vector<std::byte> message_buffer(std::size_t bytes) override {
    std::vector<std::byte> buffer;
    {
      std::lock_guard lock(spare_mutex_);
      std::size_t best = spare_.size();
      for (std::size_t i = 0; i < spare_.size(); ++i)
        if (spare_[i].capacity() >= bytes && (best == spare_.size() || spare_[i].capacity() < spare_[best].capacity()))
          best = i;
      if (best < spare_.size()) {
        spare_bytes_ -= static_cast<std::int64_t>(spare_[best].capacity());
        buffer = std::move(spare_[best]);
        spare_[best] = std::move(spare_.back());
        spare_.pop_back();
      }
    }
    buffer.clear();
    buffer.resize(bytes);  // zeroed, as a fresh one
    return buffer;
  }

  // The header goes in front of rows the worker already wrote in place;
  // the progress thread sends header and rows from this one buffer, and the
  // receiver's progress thread takes the rows straight into its segment,
  // then adds to the counter (release), so the order of rows and signal
  // needs no lock. The hand-off to the progress thread is a lock-free push.
  void send_put(int to, std::int64_t offset, std::vector<std::byte>&& message, std::int32_t event) override {
    if (message.size() < sizeof(PutHeader)) throw Error("send_put: the message has no room for its header");
    const PutHeader h{offset, static_cast<std::int64_t>(message.size() - sizeof(PutHeader)), event, 0};
    std::memcpy(message.data(), &h, sizeof h);
    const auto bytes = static_cast<std::int64_t>(message.size());
    wait_for_outbox_room(bytes);
    if (failed_.load(std::memory_order_acquire)) {
      std::lock_guard lock(mutex_);
      std::rethrow_exception(failure_);
    }
    pending_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    auto* node = new OutNode{nullptr, to, std::move(message)};
    node->next = outbox_.load(std::memory_order_relaxed);
    while (!outbox_.compare_exchange_weak(node->next, node, std::memory_order_seq_cst, std::memory_order_relaxed)) {
    }
    if (!launch_active_.load(std::memory_order_relaxed)) launch_active_.store(true, std::memory_order_relaxed);
    doorbell_.ring();
  }

  void launch_begin() override {
    run([this](bool first) { return barrier_step(first); });
    launch_active_.store(true, std::memory_order_relaxed);
  }

  void launch_end() override {
    // Sends drain before the barrier completes: a peer still waiting for
    // our rows keeps its progress thread receiving them meanwhile.
    bool barrier_started = false;
    run([&](bool) {
      if (!barrier_started) {
        if (outbox_.load(std::memory_order_acquire) || has_pending_puts()) return false;
        barrier_started = true;
        return barrier_step(true);
      }
      return barrier_step(false);
    });
    launch_active_.store(false, std::memory_order_relaxed);
  }

  void gather(std::span<float> data, int owner) override {
    if (owner == 0 || (rank_ != 0 && rank_ != owner)) return;
    if (data.size() > static_cast<std::size_t>(INT32_MAX)) throw Error("gather: more than 2^31 values in one piece");
    MPI_Request req = MPI_REQUEST_NULL;
    run([&](bool first) {
      if (first) {
        if (rank_ == 0)
          check_mpi(MPI_Irecv(data.data(), static_cast<int>(data.size()), MPI_FLOAT, owner, kGather, comm_, &req), "Irecv");
        else
          check_mpi(MPI_Isend(data.data(), static_cast<int>(data.size()), MPI_FLOAT, 0, kGather, comm_, &req), "Isend");
      }
      int done = 0;
      check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "Test");
      return done != 0;
    });
  }

  void allgather(std::span<std::byte> all, std::size_t block) override {
    if (all.size() != block * static_cast<std::size_t>(size_)) throw Error("allgather: wrong buffer size");
    if (block > static_cast<std::size_t>(INT32_MAX)) throw Error("allgather: a block of more than 2^31 bytes");
    if (one_sided_exchange_ && shared_) {
      one_sided_allgather(all, block);
      return;
    }
    if (one_sided_exchange_) {
      direct_allgather(all, block);
      return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    run([&](bool first) {
      if (first)
        check_mpi(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, all.data(), static_cast<int>(block), MPI_BYTE, comm_, &req),
                  "Iallgather");
      int done = 0;
      check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "Test");
      return done != 0;
    });
  }

  void sum_in_rank_order(std::span<float> data) override { chain_sum(data, MPI_FLOAT); }
  void sum_in_rank_order(std::span<double> data) override { chain_sum(data, MPI_DOUBLE); }

  std::string failed_peers() const override {
    std::lock_guard lock(mutex_);
    std::string text;
    const auto now = Clock::now();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const double silent = std::chrono::duration<double>(now - last_heard_[r]).count();
      if (silent > peer_timeout_)
        text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " has not been heard from for " +
                std::to_string(silent).substr(0, 4) + " s (dead, or its link is down)";
    }
    if (failed_ && text.empty()) text = "this process's MPI progress thread failed";
    return text;
  }

 public:
  void watch_workers(WorkerActivity* activity) override {
    if (WorkerActivity* old = activity_.exchange(activity, std::memory_order_acq_rel)) old->ring_on_wait(nullptr);
    if (activity) activity->ring_on_wait(&doorbell_);
  }

 private:
  std::atomic<WorkerActivity*> activity_{nullptr};
  // Wakes the progress thread from a nap: a worker begins to wait, a put or
  // a collective is handed to it, or the transport stops.
  WorkerActivity::Doorbell doorbell_;
  struct alignas(64) Line {
    std::byte bytes[64];
  };
  // A put handed to the progress thread: a node of a lock-free stack.
  struct OutNode {
    OutNode* next;
    int to;
    std::vector<std::byte> bytes;
  };
  // A send in flight; a put is two sends (header, rows) of one buffer.
  struct InFlight {
    MPI_Request request, rows = MPI_REQUEST_NULL;
    int tag;
    std::vector<std::byte> bytes;
  };
  // Rows of a put being received into the segment, and the counter they signal.
  struct Arriving {
    MPI_Request request;
    std::int32_t event;
  };

  static std::int64_t round64(std::int64_t n) { return (n + 63) / 64 * 64; }
  static constexpr std::int64_t kKeepBytes = 1 << 20;  // 1 MiB is never worth giving back
  void check_size(std::size_t n) const {
    if (n != static_cast<std::size_t>(size_)) throw Error("transport: sizes given for " + std::to_string(n) + " ranks");
  }

  // Runs `step(first)` on the progress thread until it returns true; the
  // thread keeps applying puts and heartbeats in between.
  void run(std::function<bool(bool)> step) {
    std::unique_lock lock(mutex_);
    if (failed_) std::rethrow_exception(failure_);
    job_ = std::move(step);
    job_first_ = true;
    job_done_ = false;
    lock.unlock();
    doorbell_.ring();  // the job is visible under mutex_, which the nap's check takes
    lock.lock();
    // A peer that died or went silent never joins the collective: give up
    // with its name instead of waiting forever.
    while (!job_cv_.wait_for(lock, std::chrono::milliseconds(50), [this] { return job_done_ || failed_; })) {
      lock.unlock();
      const std::string failed = failed_peers();
      lock.lock();
      if (!failed.empty()) {
        failed_ = true;  // the collective can no longer complete
        failure_ = std::make_exception_ptr(Error("a peer failed while this rank waited in a collective: " + failed));
      }
    }
    job_ = nullptr;
    if (failed_) std::rethrow_exception(failure_);
  }
  // A blocking collective over `comm` (a window's allocation) on the
  // progress thread, entered only once every member has reached it: a
  // non-blocking barrier is polled first, with heartbeats applied in
  // between, so a peer that froze or died before it is named by its
  // silence instead of holding this thread inside MPI for good.
  void run_collective(MPI_Comm comm, const std::function<void()>& fn) {
    MPI_Request arrived = MPI_REQUEST_NULL;
    run([&](bool first) {
      if (first) check_mpi(MPI_Ibarrier(comm, &arrived), "Ibarrier (before a collective)");
      int done = 0;
      check_mpi(MPI_Test(&arrived, &done, MPI_STATUS_IGNORE), "Test (before a collective)");
      if (!done) return false;
      fn();
      return true;
    });
  }

  // The ordered sum as a chain: rank q receives the sum of ranks < q, adds
  // its part and passes it on; the last rank's total is broadcast.
  template <class V>
  void chain_sum(std::span<V> data, MPI_Datatype type) {
    if (data.size() > static_cast<std::size_t>(INT32_MAX)) throw Error("sum_in_rank_order: more than 2^31 values");
    const int n = static_cast<int>(data.size());
    std::vector<V> partial(rank_ > 0 ? data.size() : 0);
    enum { receive, add, send, broadcast, done } stage = rank_ > 0 ? receive : add;
    MPI_Request req = MPI_REQUEST_NULL;
    bool posted = false;
    auto finished = [&] {
      int flag = 0;
      check_mpi(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "Test");
      if (flag) posted = false;
      return flag != 0;
    };
    run([&](bool) {
      for (;;) {
        switch (stage) {
          case receive:
            if (!posted) {
              check_mpi(MPI_Irecv(partial.data(), n, type, rank_ - 1, kSum, comm_, &req), "Irecv");
              posted = true;
            }
            if (!finished()) return false;
            stage = add;
            break;
          case add:
            for (std::size_t i = 0; i < data.size(); ++i) data[i] = (rank_ > 0 ? partial[i] : V(0)) + data[i];
            stage = rank_ + 1 < size_ ? send : broadcast;
            break;
          case send:
            if (!posted) {
              check_mpi(MPI_Isend(data.data(), n, type, rank_ + 1, kSum, comm_, &req), "Isend");
              posted = true;
            }
            if (!finished()) return false;
            stage = broadcast;
            break;
          case broadcast:
            if (!posted) {
              check_mpi(MPI_Ibcast(data.data(), n, type, size_ - 1, comm_, &req), "Ibcast");
              posted = true;
            }
            if (!finished()) return false;
            stage = done;
            break;
          case done:
            return true;
        }
      }
    });
  }

  // Backpressure: a put that would take the bytes queued or in flight past
  // the limit waits until sends complete (a single larger put still goes
  // alone). Receivers' progress threads always receive, so room comes,
  // unless a peer failed, which is then the error.
  void wait_for_outbox_room(std::int64_t bytes) {
    auto since = Clock::now();
    struct Waiter {  // keeps the progress thread from napping while a worker waits for its sends
      Mpi& m;
      bool on = false;
      ~Waiter() {
        if (on) m.outbox_waiters_.fetch_sub(1, std::memory_order_relaxed);
      }
    } waiter{*this};
    for (int spins = 0;; ++spins) {
      const std::int64_t pending = pending_bytes_.load(std::memory_order_acquire);
      if (pending == 0 || pending + bytes <= outbox_limit_) return;
      if (!waiter.on) {
        waiter.on = true;
        outbox_waiters_.fetch_add(1, std::memory_order_seq_cst);
        doorbell_.ring();
      }
      if (spins % 256 == 255 && Clock::now() - since > std::chrono::duration<double>(peer_timeout_)) {
        const std::string failed = failed_peers();
        if (!failed.empty()) throw Error("a put waits for room in the outbox and a peer failed: " + failed);
        since = Clock::now();
      }
      std::this_thread::yield();
    }
  }

  // The one-sided allgather on shared memory: each rank stores its block
  // into every peer's control area and adds to the peer's arrival counter
  // (release); it then waits for P - 1 arrivals of its own (acquire). Two
  // areas used by turns: a rank can be at most one call ahead of a peer
  // (finishing a call needs every peer's block of it), so a block never
  // lands in an area its owner is still reading.
  void one_sided_allgather(std::span<std::byte> all, std::size_t block) {
    const auto P = static_cast<std::size_t>(size_);
    const std::size_t area = ((block * P + 63) / 64) * 64;
    if (area > control_area_) {  // collective: every rank asks with the same block
      control_area_ = area;
      std::vector<std::int64_t> bytes(P, static_cast<std::int64_t>(64 + 2 * area));
      run_collective(share_, [&] { allocate_shared(control_win_, bytes, control_); });
      control_calls_ = 0;
    }
    // Two areas of the window's size, whatever this call's block: a peer one
    // call ahead writes the other one, even when its call's block differs.
    const std::size_t turn = static_cast<std::size_t>(control_calls_ % 2), stride = control_area_;
    ++control_calls_;
    const std::byte* mine = all.data() + static_cast<std::size_t>(rank_) * block;
    for (std::size_t q = 0; q < P; ++q) {
      if (static_cast<int>(q) == rank_) continue;
      std::memcpy(control_[q] + 64 + turn * stride + static_cast<std::size_t>(rank_) * block, mine, block);
      reinterpret_cast<std::atomic<std::int64_t>*>(control_[q])->fetch_add(1, std::memory_order_release);
    }
    auto& arrived = *reinterpret_cast<std::atomic<std::int64_t>*>(control_[static_cast<std::size_t>(rank_)]);
    const std::int64_t expected = control_calls_ * static_cast<std::int64_t>(P - 1);
    const auto start = Clock::now();
    for (int spins = 0; arrived.load(std::memory_order_acquire) < expected; ++spins) {
      if (spins % 1024 == 1023 && Clock::now() - start > std::chrono::duration<double>(peer_timeout_)) {
        const std::string failed = failed_peers();
        if (!failed.empty()) throw Error("a peer failed during the count exchange: " + failed);
      }
      std::this_thread::yield();
    }
    for (std::size_t q = 0; q < P; ++q)
      if (static_cast<int>(q) != rank_)
        std::memcpy(all.data() + q * block, control_[static_cast<std::size_t>(rank_)] + 64 + turn * stride + q * block, block);
  }

  // The network path's form of the one-sided exchange: there is no remote
  // memory access there, so a put is a message; each rank sends its block
  // straight to every peer (one round, P - 1 messages, like its puts) and
  // receives each peer's into place. A peer one call ahead cannot confuse
  // it: messages of one tag from one sender arrive in order.
  void direct_allgather(std::span<std::byte> all, std::size_t block) {
    std::vector<MPI_Request> requests;
    requests.reserve(2 * static_cast<std::size_t>(size_));
    const std::byte* mine = all.data() + static_cast<std::size_t>(rank_) * block;
    run([&](bool first) {
      if (first) {
        for (int q = 0; q < size_; ++q) {
          if (q == rank_) continue;
          requests.emplace_back(MPI_REQUEST_NULL);
          check_mpi(MPI_Irecv(all.data() + static_cast<std::size_t>(q) * block, static_cast<int>(block), MPI_BYTE, q, kCount,
                              comm_, &requests.back()),
                    "Irecv (counts)");
        }
        for (int q = 0; q < size_; ++q) {
          if (q == rank_) continue;
          requests.emplace_back(MPI_REQUEST_NULL);
          check_mpi(MPI_Isend(mine, static_cast<int>(block), MPI_BYTE, q, kCount, comm_, &requests.back()), "Isend (counts)");
        }
      }
      int done = 0;
      check_mpi(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE), "Testall");
      return done != 0;
    });
  }

  bool has_pending_puts() const {
    for (const auto& s : sends_)
      if (s.tag == kPut) return true;
    return false;
  }

  bool barrier_step(bool first) {
    if (first) check_mpi(MPI_Ibarrier(comm_, &barrier_), "Ibarrier");
    int done = 0;
    check_mpi(MPI_Test(&barrier_, &done, MPI_STATUS_IGNORE), "Test");
    return done != 0;
  }

  // The hybrid path's node: consecutive ranks_per_node ranks (0: this
  // machine's processes), which must share a machine.
  void join_node(int ranks_per_node) {
    if (ranks_per_node <= 0) return;  // the machine's processes (node_)
    if (size_ % ranks_per_node != 0)
      throw Error("--mpi-path hybrid: ranks_per_node " + std::to_string(ranks_per_node) + " does not divide the " +
                  std::to_string(size_) + " processes");
    check_mpi(MPI_Comm_split(comm_, rank_ / ranks_per_node, rank_, &share_), "Comm_split");
    MPI_Comm same_machine = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(share_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &same_machine), "Comm_split_type");
    int together = 0, local_ok = 0, all_ok = 0;
    MPI_Comm_size(same_machine, &together);
    MPI_Comm_free(&same_machine);
    local_ok = together == ranks_per_node ? 1 : 0;
    MPI_Allreduce(&local_ok, &all_ok, 1, MPI_INT, MPI_MIN, comm_);
    if (!all_ok)
      throw Error("--mpi-path hybrid: the layer's ranks_per_node " + std::to_string(ranks_per_node) +
                  " groups ranks that are not on one machine (launch ranks_per_node consecutive ranks per host, e.g. "
                  "mpirun --map-by ppr:" + std::to_string(ranks_per_node) + ":node)");
  }

  // Progress thread, collective over the ranks this process maps (the
  // machine's on the shared path, the node's on the hybrid path): a fresh
  // shared window whose rank r part holds bytes[r]; bases[r] is where this
  // process sees it (untouched for ranks outside).
  void allocate_shared(MPI_Win& win, std::span<const std::int64_t> bytes, std::span<std::byte*> bases) {
    if (win != MPI_WIN_NULL) {
      MPI_Win_unlock_all(win);
      MPI_Win_free(&win);
    }
    MPI_Info info;
    MPI_Info_create(&info);
    MPI_Info_set(info, "alloc_shared_noncontig", "true");
    void* mine = nullptr;
    // 64 bytes spare: each part is aligned up to a cache line (a part's
    // offset within its page is the same in every process's mapping).
    check_mpi(MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes[rank_] + 64), 1, info, share_, &mine, &win),
              "Win_allocate_shared (is /dev/shm large enough?)");
    MPI_Info_free(&info);
    check_mpi(MPI_Win_lock_all(MPI_MODE_NOCHECK, win), "Win_lock_all");
    std::memset(mine, 0, static_cast<std::size_t>(bytes[rank_] + 64));
    for (std::size_t i = 0; i < share_members_.size(); ++i) {
      MPI_Aint size = 0;
      int unit = 0;
      void* base = nullptr;
      check_mpi(MPI_Win_shared_query(win, static_cast<int>(i), &size, &unit, &base), "Win_shared_query");
      const auto address = reinterpret_cast<std::uintptr_t>(base);
      bases[static_cast<std::size_t>(share_members_[i])] = static_cast<std::byte*>(base) + ((64 - address % 64) % 64);
    }
    MPI_Barrier(share_);  // every part zeroed before anyone signals into it
  }

  void free_windows() {
    for (MPI_Win* w : {&data_win_, &event_win_, &control_win_})
      if (*w != MPI_WIN_NULL) {
        MPI_Win_unlock_all(*w);
        MPI_Win_free(w);
      }
  }

  void progress_loop() {
    std::vector<std::byte> scratch;  // headers, heartbeats and small puts
    auto last_beat = Clock::now() - std::chrono::seconds(1), last_busy = Clock::now();
    int idle = 0;
    for (;;) {
      bool busy = false;
      try {
        std::unique_lock lock(mutex_);
        if (stop_) return;
        if (job_ && !job_done_) {
          const bool first = job_first_;
          job_first_ = false;
          if (job_(first)) {
            job_done_ = true;
            job_cv_.notify_all();
          }
          busy = true;
        }
        lock.unlock();
        // Take every put the workers pushed; the stack holds them newest
        // first, so reverse to send each worker's puts in its order.
        OutNode* taken = outbox_.exchange(nullptr, std::memory_order_acquire);
        OutNode* in_order = nullptr;
        while (taken) {
          OutNode* next = taken->next;
          taken->next = in_order;
          in_order = taken;
          taken = next;
        }
        while (in_order) {
          std::unique_ptr<OutNode> m(std::exchange(in_order, in_order->next));
          start_send(m->to, kPut, std::move(m->bytes));
          busy = true;
        }
        const bool active = launch_active_.load(std::memory_order_relaxed);

        for (std::size_t i = 0; i < sends_.size();) {
          int done = 0;
          check_mpi(MPI_Test(&sends_[i].request, &done, MPI_STATUS_IGNORE), "Test (a send to a peer)");
          if (done && sends_[i].rows != MPI_REQUEST_NULL)
            check_mpi(MPI_Test(&sends_[i].rows, &done, MPI_STATUS_IGNORE), "Test (rows sent to a peer)");
          if (done) {
            if (sends_[i].tag == kPut) {
              pending_bytes_.fetch_sub(static_cast<std::int64_t>(sends_[i].bytes.size()), std::memory_order_release);
              keep_for_reuse(std::move(sends_[i].bytes));
            }
            sends_[i] = std::move(sends_.back());
            sends_.pop_back();
          } else {
            ++i;
          }
        }
        busy = receive(scratch) || busy;
        pending_arrivals_.store(static_cast<std::int64_t>(arriving_.size()), std::memory_order_relaxed);
        const auto now = Clock::now();
        if (now - last_beat > std::chrono::milliseconds(100)) {
          last_beat = now;
          for (int r = 0; r < size_; ++r)
            if (r != rank_) start_send(r, kBeat, {});
        }
        // Back off when quiet: a busy poll collapses when ranks outnumber
        // cores, and on a core shared with a worker every wake costs that
        // worker far more than the loop's own work (naps of 200 us took 20%
        // of a one-core host's GEMM time). So while a worker waits (for an
        // event, or for room in the outbox) the thread yields: a message
        // may be what it waits for. Otherwise, after 50 us of quiet, it
        // naps until the doorbell rings (a worker begins to wait, a put or
        // a collective is handed over, stop), for at most kNapInFlight
        // while sends or receives of its own are in flight (their sockets
        // move bytes only when polled) and kNapQuiet when none are.
        if (busy) {
          idle = 0;
          last_busy = now;
        } else if (++idle > 64) {
          const WorkerActivity* workers = activity_.load(std::memory_order_acquire);
          auto someone_waits = [&] {
            return (active && workers && workers->any_waiting()) || outbox_waiters_.load(std::memory_order_seq_cst) > 0;
          };
          if (someone_waits() || (active && !workers) || now - last_busy < std::chrono::microseconds(50)) {
            std::this_thread::yield();
          } else {
            const bool in_flight = !sends_.empty() || !arriving_.empty();
            doorbell_.nap(in_flight ? kNapInFlight : kNapQuiet, [&] {
              if (someone_waits() || outbox_.load(std::memory_order_seq_cst)) return false;
              std::lock_guard job_lock(mutex_);
              return !stop_ && !(job_ && !job_done_);
            });
          }
        }
      } catch (...) {
        std::lock_guard lock(mutex_);
        failed_ = true;
        failure_ = std::current_exception();
        job_cv_.notify_all();
        return;
      }
    }
  }

  // A completed put's buffer, kept for message_buffer while the kept ones
  // hold less than the outbox limit (and are few enough to search).
  void keep_for_reuse(std::vector<std::byte>&& buffer) {
    const auto bytes = static_cast<std::int64_t>(buffer.capacity());
    std::lock_guard lock(spare_mutex_);
    if (spare_.size() >= kMaxSpareBuffers || spare_bytes_ + bytes > outbox_limit_) return;
    spare_bytes_ += bytes;
    spare_.push_back(std::move(buffer));
  }

  void start_send(int to, int tag, std::vector<std::byte> bytes) {
    if (bytes.size() > static_cast<std::size_t>(INT32_MAX)) throw Error("a put of more than 2 GiB");
    InFlight f{MPI_REQUEST_NULL, MPI_REQUEST_NULL, tag, std::move(bytes)};
    const bool split = tag == kPut && static_cast<std::int64_t>(f.bytes.size() - sizeof(PutHeader)) > kInlineRows;
    const std::size_t head = split ? sizeof(PutHeader) : f.bytes.size();
    int code = MPI_Isend(f.bytes.data(), static_cast<int>(head), MPI_BYTE, to, tag, comm_, &f.request);
    if (code == MPI_SUCCESS && head < f.bytes.size())
      code = MPI_Isend(f.bytes.data() + head, static_cast<int>(f.bytes.size() - head), MPI_BYTE, to, kRows, comm_, &f.rows);
    if (code != MPI_SUCCESS) check_mpi(code, ("Isend to rank " + std::to_string(to)).c_str());
    sends_.push_back(std::move(f));
  }

  // Takes every header that has arrived and starts receiving its rows
  // straight into the segment; signals the puts whose rows have landed.
  // True if anything happened.
  bool receive(std::vector<std::byte>& scratch) {
    bool any = false;
    for (std::size_t i = 0; i < arriving_.size();) {
      int done = 0;
      check_mpi(MPI_Test(&arriving_[i].request, &done, MPI_STATUS_IGNORE), "Test (rows from a peer)");
      if (!done) {
        ++i;
        continue;
      }
      counters_[rank_][arriving_[i].event].value.fetch_add(1, std::memory_order_release);
      arriving_[i] = arriving_.back();
      arriving_.pop_back();
      any = true;
    }
    for (;;) {
      int flag = 0;
      MPI_Status st;
      check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, kPut, comm_, &flag, &st), "Iprobe");
      if (!flag) check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, kBeat, comm_, &flag, &st), "Iprobe");
      if (!flag) return any;
      any = true;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      PutHeader h{};
      scratch.resize(static_cast<std::size_t>(std::max(count, 1)));
      check_mpi(MPI_Recv(scratch.data(), count, MPI_BYTE, st.MPI_SOURCE, st.MPI_TAG, comm_, MPI_STATUS_IGNORE), "Recv");
      const std::int64_t inline_rows = count - static_cast<std::int64_t>(sizeof h);
      if (st.MPI_TAG == kPut) {
        if (inline_rows < 0) throw Error("a malformed put header from rank " + std::to_string(st.MPI_SOURCE));
        std::memcpy(&h, scratch.data(), sizeof h);
        if (inline_rows != 0 && inline_rows != h.bytes)
          throw Error("a malformed put from rank " + std::to_string(st.MPI_SOURCE) + ": its header and rows disagree");
      }
      {
        std::lock_guard lock(mutex_);
        last_heard_[st.MPI_SOURCE] = Clock::now();
      }
      if (st.MPI_TAG == kBeat) continue;
      // The segment and counters are swapped only between launches, when no
      // put is on its way (every counter of the launch completed).
      std::lock_guard lock(apply_mutex_);
      if (h.offset < 0 || h.bytes < 0 || h.bytes > local_bytes_ || h.offset > local_bytes_ - h.bytes || h.event < 0 ||
          h.event >= local_events_)
        throw Error("a put from rank " + std::to_string(st.MPI_SOURCE) + " outside this rank's segment or events");
      if (h.bytes == 0 || inline_rows > 0) {
        if (inline_rows > 0)
          std::memcpy(segments_[rank_] + h.offset, scratch.data() + sizeof h, static_cast<std::size_t>(inline_rows));
        counters_[rank_][h.event].value.fetch_add(1, std::memory_order_release);
        continue;
      }
      // Rows from one source arrive in the order of its headers (MPI does not
      // let messages of one tag from one sender overtake each other).
      Arriving a{MPI_REQUEST_NULL, h.event};
      check_mpi(MPI_Irecv(segments_[rank_] + h.offset, static_cast<int>(h.bytes), MPI_BYTE, st.MPI_SOURCE, kRows, comm_,
                          &a.request),
                "Irecv (rows)");
      arriving_.push_back(a);
      pending_arrivals_.store(static_cast<std::int64_t>(arriving_.size()), std::memory_order_relaxed);
    }
  }

  int rank_ = 0, size_ = 1, node_index_ = 0;
  bool shared_ = true;
  bool hybrid_ = false;  // shared windows inside the node (share_), messages across
  MPI_Comm share_ = MPI_COMM_NULL;  // the ranks whose windows this process maps (node_, or the layer's node)
  std::vector<int> share_members_;  // their world ranks, in share_'s order
  double peer_timeout_;
  std::int64_t outbox_limit_;
  std::atomic<std::int64_t> pending_bytes_{0};  // puts queued or in flight
  MPI_Comm comm_ = MPI_COMM_NULL, node_ = MPI_COMM_NULL;
  MPI_Win data_win_ = MPI_WIN_NULL, event_win_ = MPI_WIN_NULL, control_win_ = MPI_WIN_NULL;
  bool one_sided_exchange_ = false;  // MpiOptions::count_exchange, resolved for the path
  std::vector<std::byte*> control_;  // one-sided allgather: each rank's arrival counter, then two areas
  std::size_t control_area_ = 0;
  std::int64_t control_calls_ = 0;
  MPI_Request barrier_ = MPI_REQUEST_NULL;
  std::vector<std::byte*> segments_;
  std::vector<EventCounter*> counters_;
  std::vector<std::int64_t> seg_bytes_, event_capacity_;
  std::mutex spare_mutex_;  // completed puts' buffers, for message_buffer
  std::vector<std::vector<std::byte>> spare_;
  std::int64_t spare_bytes_ = 0;
  std::vector<Line> local_;  // network path: this rank's segment (hybrid: in the node's window)
  std::unique_ptr<EventCounter[]> local_counters_;
  std::int64_t local_bytes_ = 0, local_events_ = 0;
  std::mutex apply_mutex_;  // network path: counters swapped while puts are applied

  std::thread progress_;
  mutable std::mutex mutex_;
  std::condition_variable job_cv_;
  std::function<bool(bool)> job_;
  bool job_first_ = false, job_done_ = false, stop_ = false;
  std::atomic<bool> launch_active_{false};
  std::atomic<bool> failed_{false};
  std::exception_ptr failure_;            // set under mutex_ before failed_
  std::atomic<OutNode*> outbox_{nullptr};  // puts from workers (lock-free stack)
  std::vector<InFlight> sends_;           // progress thread only
  std::vector<Arriving> arriving_;        // progress thread only
  std::atomic<std::int64_t> pending_arrivals_{0};
  std::atomic<int> outbox_waiters_{0};  // workers waiting in wait_for_outbox_room
  std::vector<Clock::time_point> last_heard_;
};

}  // namespace

// A thread that waits for started() and, past the limit, says which phase
// did not finish and ends the process: nothing else can, since the main
// thread is inside a blocking MPI call that only the missing peer releases.
struct MpiSession::StartupGuard {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::atomic<bool> initialised{false};
  std::thread thread;

  explicit StartupGuard(double limit_s) {
    thread = std::thread([this, limit_s] {
      std::unique_lock lock(mutex);
      if (cv.wait_for(lock, std::chrono::duration<double>(limit_s), [this] { return done; })) return;
      std::fprintf(stderr,
                   "error: MPI start-up did not finish within %.0f s (%s): a peer process did not start, or froze while "
                   "starting; check every host of the job (the limit is 10 x --peer-timeout)\n",
                   limit_s, initialised.load() ? "building the transport" : "in MPI_Init");
      std::fflush(stderr);
      std::_Exit(2);
    });
  }
  void stand_down() {
    {
      std::lock_guard lock(mutex);
      done = true;
    }
    cv.notify_all();
    if (thread.joinable()) thread.join();
  }
  ~StartupGuard() { stand_down(); }
};

void MpiSession::started() {
  if (guard_) guard_->stand_down();
}

MpiSession::MpiSession(int* argc, char*** argv, double startup_limit_s) {
  if (startup_limit_s > 0) guard_ = std::make_unique<StartupGuard>(startup_limit_s);
  int provided = 0;
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "Init_thread");
  if (provided < MPI_THREAD_SERIALIZED) {
    MPI_Finalize();
    throw Error("this MPI library does not provide MPI_THREAD_SERIALIZED, which the progress thread needs");
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  if (guard_) guard_->initialised = true;
}

MpiSession::~MpiSession() {
  guard_.reset();
  MPI_Finalize();
}

bool MpiSession::available() { return true; }

std::shared_ptr<Transport> make_mpi_transport(const MpiSession&, int ranks, const MpiOptions& options) {
  if (!(options.peer_timeout_seconds > 0)) throw Error("the peer timeout must be positive");
  if (options.outbox_bytes < 1) throw Error("the MPI outbox limit must be at least one byte");
  return std::make_shared<Mpi>(ranks, options);
}

#endif

}  // namespace hpmoe
