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
#include "comm/mpi_transport.hpp"

#include <cstdio>
#include <cstdlib>

namespace hpmoe {

#ifndef HPMOE_HAVE_MPI

struct MpiSession::StartupGuard {};
MpiSession::MpiSession(int*, char***, double) {
  throw Error("this hpmoe was built without MPI; install libopenmpi-dev and rebuild, or use --transport inprocess");
}
MpiSession::~MpiSession() = default;
void MpiSession::started() {}
void MpiSession::abort(const std::string& message, int code) const {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  std::_Exit(code);
}
bool MpiSession::available() { return false; }
std::shared_ptr<Transport> make_mpi_transport(const MpiSession&, int, const MpiOptions&) {
  throw Error("this hpmoe was built without MPI");
}

#else

namespace mpi_detail {

Mpi::Mpi(int ranks, const MpiOptions& options)
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
  agree_on_options(options);
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
  left_at_.assign(static_cast<std::size_t>(size_), std::nullopt);
  progress_ = std::thread([this] { progress_loop(); });
}

Mpi::~Mpi() { close(); }

void Mpi::close() {
  if (closed_) return;
  closed_ = true;
  closing_.store(true, std::memory_order_release);
  try {
    // Goodbye first: a peer that still waits for this process (in a
    // collective, or for a put in a launch) fails at once naming it.
    say_goodbye_.store(true, std::memory_order_release);
    doorbell_.ring();
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

std::string Mpi::describe() const {
  return std::string("mpi ") +
         (shared_   ? "shared-memory windows"
          : hybrid_ ? "hybrid: shared-memory windows inside nodes of " + std::to_string(share_members_.size()) +
                          ", network messages across"
                    : "network messages") +
         ", " + std::to_string(size_) + " processes";
}

void Mpi::reserve_segments(std::span<const std::int64_t> bytes) {
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

void Mpi::reserve_events(std::span<const std::int64_t> events) {
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

namespace {
const char* path_name(MpiPath p) {
  switch (p) {
    case MpiPath::shared: return "shared";
    case MpiPath::network: return "network";
    case MpiPath::hybrid: return "hybrid";
    case MpiPath::automatic: break;
  }
  return "auto";
}
const char* count_exchange_name(MpiOptions::CountExchange e) {
  switch (e) {
    case MpiOptions::CountExchange::one_sided: return "one-sided";
    case MpiOptions::CountExchange::collective: return "collective";
    case MpiOptions::CountExchange::automatic: break;
  }
  return "auto";
}
}  // namespace

void Mpi::agree_on_options(const MpiOptions& options) {
  // Each option as its text's FNV-1a hash and the text's first bytes (to
  // name both values), gathered with a blocking MPI_Allgather on the world
  // communicator: it needs nothing that the options choose.
  std::vector<std::pair<std::string, std::string>> all = {
      {"--mpi-path (module: mpi_path)", path_name(options.path)},
      {"--count-exchange", count_exchange_name(options.count_exchange)},
      {"ranks_per_node", std::to_string(options.ranks_per_node)},
  };
  all.insert(all.end(), options.agree.begin(), options.agree.end());
  constexpr std::size_t kText = 56;
  struct Entry {
    std::uint64_t hash;
    char text[kText];
  };
  const std::size_t n = all.size();
  std::vector<Entry> mine(n), every(n * static_cast<std::size_t>(size_));
  for (std::size_t i = 0; i < n; ++i) {
    mine[i].hash = fnv1a(all[i].second);
    std::memset(mine[i].text, 0, kText);
    std::memcpy(mine[i].text, all[i].second.data(), std::min(all[i].second.size(), kText - 1));
  }
  // The count first: processes whose lists differ in length must not read past each other's.
  const int count = static_cast<int>(n);
  std::vector<int> counts(static_cast<std::size_t>(size_));
  check_mpi(MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, comm_), "Allgather");
  for (int q = 0; q < size_; ++q)
    if (counts[static_cast<std::size_t>(q)] != count)
      throw Error("rank " + std::to_string(q) + " checks " + std::to_string(counts[static_cast<std::size_t>(q)]) +
                  " options and rank " + std::to_string(rank_) + " " + std::to_string(count) +
                  ": start every process of the job with the same program and hpmoe");
  check_mpi(MPI_Allgather(mine.data(), static_cast<int>(n * sizeof(Entry)), MPI_BYTE, every.data(),
                          static_cast<int>(n * sizeof(Entry)), MPI_BYTE, comm_),
            "Allgather");
  for (int q = 1; q < size_; ++q)
    for (std::size_t i = 0; i < n; ++i) {
      const Entry& a = every[i];
      const Entry& b = every[static_cast<std::size_t>(q) * n + i];
      if (a.hash == b.hash) continue;
      const auto shown = [](const Entry& e) {
        const std::string t(e.text, strnlen(e.text, kText));
        return t.size() + 1 >= kText ? t + "..." : t;
      };
      throw Error("rank " + std::to_string(q) + " was started with another " + all[i].first + " than rank 0 (" +
                  shown(b) + " against " + shown(a) + "): start every process with the same options");
    }
}

std::string Mpi::failed_peers() const {
  std::lock_guard lock(mutex_);
  std::string text;
  const auto now = Clock::now();
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto& left = left_at_[static_cast<std::size_t>(r)];
    if (left && !closing_.load(std::memory_order_acquire) && now - *left > kLeaveGrace) {
      text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) +
              " has left the job (its process closed its transport: it failed or exited; its own output says why)";
      continue;
    }
    const double silent = std::chrono::duration<double>(now - last_heard_[r]).count();
    if (silent > peer_timeout_)
      text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " has not been heard from for " +
              std::to_string(silent).substr(0, 4) + " s (dead, or its link is down)";
  }
  if (failed_ && text.empty()) text = "this process's MPI progress thread failed";
  return text;
}

void Mpi::watch_workers(WorkerActivity* activity) {
  if (WorkerActivity* old = activity_.exchange(activity, std::memory_order_acq_rel)) old->ring_on_wait(nullptr);
  if (activity) activity->ring_on_wait(&doorbell_);
}

void Mpi::check_size(std::size_t n) const {
  if (n != static_cast<std::size_t>(size_)) throw Error("transport: sizes given for " + std::to_string(n) + " ranks");
}

void Mpi::join_node(int ranks_per_node) {
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

void Mpi::allocate_shared(MPI_Win& win, std::span<const std::int64_t> bytes, std::span<std::byte*> bases) {
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

void Mpi::free_windows() {
  for (MPI_Win* w : {&data_win_, &event_win_, &control_win_})
    if (*w != MPI_WIN_NULL) {
      MPI_Win_unlock_all(*w);
      MPI_Win_free(w);
    }
}

}  // namespace mpi_detail

using mpi_detail::Mpi;
using mpi_detail::check_mpi;

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
  // Transports still alive (held by objects that outlive the session, such
  // as Python's at exit) stop before MPI does: a progress thread that
  // probes after MPI_Finalize crashes the process.
  std::vector<std::shared_ptr<Transport>> alive;
  {
    std::lock_guard lock(open_mutex_);
    for (auto& w : open_)
      if (auto t = w.lock()) alive.push_back(std::move(t));
    open_.clear();
  }
  for (auto& t : alive) t->close();
  MPI_Finalize();
}

void MpiSession::abort(const std::string& message, int code) const {
  std::fprintf(stderr, "error: rank %d: %s\n", rank_, message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; should it, the process still ends
}

bool MpiSession::available() { return true; }

std::shared_ptr<Transport> make_mpi_transport(const MpiSession& session, int ranks, const MpiOptions& options) {
  if (!(options.peer_timeout_seconds > 0)) throw Error("the peer timeout must be positive");
  if (options.outbox_bytes < 1) throw Error("the MPI outbox limit must be at least one byte");
  auto transport = std::make_shared<Mpi>(ranks, options);
  std::lock_guard lock(session.open_mutex_);
  std::erase_if(session.open_, [](const std::weak_ptr<Transport>& w) { return w.expired(); });
  session.open_.push_back(transport);
  return transport;
}

#endif

}  // namespace hpmoe
