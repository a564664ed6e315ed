// The MPI transport's class (internal to the comm target; see mpi.cpp for
// its design): mpi.cpp sets it up and tears it down, mpi_progress.cpp holds
// the progress thread and the puts it carries, mpi_collectives.cpp the
// gathers, ordered sums and barriers.
#pragma once

#include "common/fnv.hpp"
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
#include <optional>
#include <thread>
#include <vector>

#include "hpmoe/error.hpp"

#ifdef HPMOE_HAVE_MPI
#include <mpi.h>

namespace hpmoe::mpi_detail {

using Clock = std::chrono::steady_clock;

inline void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw Error(std::string("MPI ") + what + " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

// kPut carries a put's header, kRows its rows (a second message from the
// same buffer, received straight into the segment).
// kBye: the sender closed its transport (it finished, or failed).
enum Tag : int { kPut = 101, kBeat = 102, kGather = 103, kSum = 104, kRows = 105, kCount = 106, kBye = 107 };

// Rows up to this size travel in the header's message (one message, one
// small copy out of it); larger ones in their own message, received in place.
inline constexpr std::int64_t kInlineRows = 8192;

// The progress thread's longest nap while the doorbell stays silent: with
// sends or receives of its own in flight (their sockets move bytes only when
// polled), and with none (heartbeats every 100 ms; peers time out after
// seconds).
inline constexpr auto kNapInFlight = std::chrono::milliseconds(1);
inline constexpr auto kNapQuiet = std::chrono::milliseconds(10);

// Completed puts' buffers kept for reuse, at most (message_buffer searches them).
inline constexpr std::size_t kMaxSpareBuffers = 256;

// How long after a peer's goodbye a wait for it fails (see Mpi::left_).
inline constexpr auto kLeaveGrace = std::chrono::seconds(1);

struct PutHeader {
  std::int64_t offset;  // into the target's segment
  std::int64_t bytes;   // of rows following in a kRows message (0: none)
  std::int32_t event;
  std::int32_t pad;
};

class Mpi final : public Transport {
 public:
  Mpi(int ranks, const MpiOptions& options);

  ~Mpi() override;
  void close() override;

  std::string describe() const override;
  int ranks() const override { return size_; }
  bool hosts(int rank) const override { return rank == rank_; }
  int node_index() const override { return node_index_; }
  bool is_root() const override { return rank_ == 0; }

  void reserve_segments(std::span<const std::int64_t> bytes) override;

  void reserve_events(std::span<const std::int64_t> events) override;

  std::byte* segment(int rank) override { return segments_.at(static_cast<std::size_t>(rank)); }
  EventCounter* counters(int rank) override { return counters_.at(static_cast<std::size_t>(rank)); }

  void put_signal(int to, std::int64_t offset, std::span<const std::byte> data, std::int32_t event) override;

  std::size_t put_header_bytes() const override { return sizeof(PutHeader); }

  // The smallest kept buffer that holds `bytes`, else a fresh one.
  std::vector<std::byte> message_buffer(std::size_t bytes) override;

  // The header goes in front of rows the worker already wrote in place;
  // the progress thread sends header and rows from this one buffer, and the
  // receiver's progress thread takes the rows straight into its segment,
  // then adds to the counter (release), so the order of rows and signal
  // needs no lock. The hand-off to the progress thread is a lock-free push.
  void send_put(int to, std::int64_t offset, std::vector<std::byte>&& message, std::int32_t event) override;

  void launch_begin() override;

  void launch_end() override;

  void gather(std::span<float> data, int owner) override;

  void allgather(std::span<std::byte> all, std::size_t block) override;

  void sum_in_rank_order(std::span<float> data) override { chain_sum(data, MPI_FLOAT); }
  void sum_in_rank_order(std::span<double> data) override { chain_sum(data, MPI_DOUBLE); }

  std::string failed_peers() const override;

 public:
  void watch_workers(WorkerActivity* activity) override;

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
  void check_size(std::size_t n) const;

  // Runs `step(first)` on the progress thread until it returns true; the
  // thread keeps applying puts and heartbeats in between.
  void run(std::function<bool(bool)> step);
  // A blocking collective over `comm` (a window's allocation) on the
  // progress thread, entered only once every member has reached it: a
  // non-blocking barrier is polled first, with heartbeats applied in
  // between, so a peer that froze or died before it is named by its
  // silence instead of holding this thread inside MPI for good.
  void run_collective(MPI_Comm comm, const std::function<void()>& fn);

  // The ordered sum as a chain: rank q receives the sum of ranks < q, adds
  // its part and passes it on; the last rank's total is broadcast.
  template <class V>
  void chain_sum(std::span<V> data, MPI_Datatype type);

  // Backpressure: a put that would take the bytes queued or in flight past
  // the limit waits until sends complete (a single larger put still goes
  // alone). Receivers' progress threads always receive, so room comes,
  // unless a peer failed, which is then the error.
  void wait_for_outbox_room(std::int64_t bytes);

  // The one-sided allgather on shared memory: each rank stores its block
  // into every peer's control area and adds to the peer's arrival counter
  // (release); it then waits for P - 1 arrivals of its own (acquire). Two
  // areas used by turns: a rank can be at most one call ahead of a peer
  // (finishing a call needs every peer's block of it), so a block never
  // lands in an area its owner is still reading.
  void one_sided_allgather(std::span<std::byte> all, std::size_t block);

  // The network path's form of the one-sided exchange: there is no remote
  // memory access there, so a put is a message; each rank sends its block
  // straight to every peer (one round, P - 1 messages, like its puts) and
  // receives each peer's into place. A peer one call ahead cannot confuse
  // it: messages of one tag from one sender arrive in order.
  void direct_allgather(std::span<std::byte> all, std::size_t block);

  bool has_pending_puts() const;

  // Every process's transport options (and MpiOptions::agree) compared before
  // anything is built from them; a difference is an Error naming the option.
  void agree_on_options(const MpiOptions& options);

  bool barrier_step(bool first);

  // The hybrid path's node: consecutive ranks_per_node ranks (0: this
  // machine's processes), which must share a machine.
  void join_node(int ranks_per_node);

  // Progress thread, collective over the ranks this process maps (the
  // machine's on the shared path, the node's on the hybrid path): a fresh
  // shared window whose rank r part holds bytes[r]; bases[r] is where this
  // process sees it (untouched for ranks outside).
  void allocate_shared(MPI_Win& win, std::span<const std::int64_t> bytes, std::span<std::byte*> bases);

  void free_windows();

  void progress_loop();

  // A completed put's buffer, kept for message_buffer while the kept ones
  // hold less than the outbox limit (and are few enough to search).
  void keep_for_reuse(std::vector<std::byte>&& buffer);

  void start_send(int to, int tag, std::vector<std::byte> bytes);

  // Takes every header that has arrived and starts receiving its rows
  // straight into the segment; signals the puts whose rows have landed.
  // True if anything happened.
  bool receive(std::vector<std::byte>& scratch);

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
  // [rank]: when its goodbye arrived, if it did (under mutex_). A peer that left
  // counts as failed a grace period later: one that finished a collective
  // and closed may say goodbye before this process has seen the same
  // collective complete.
  std::vector<std::optional<Clock::time_point>> left_at_;
  bool closed_ = false;                      // close() ran (main thread only)
  std::atomic<bool> closing_{false};         // in close(): peers' goodbyes are expected, not failures
  std::atomic<bool> say_goodbye_{false};     // the progress thread sends kBye to every peer, once
};

}  // namespace hpmoe::mpi_detail

#endif  // HPMOE_HAVE_MPI
