// The MPI transport's progress thread and the puts it carries (design: mpi.cpp).
#include <algorithm>

#include "comm/mpi_transport.hpp"

#ifdef HPMOE_HAVE_MPI

namespace hpmoe::mpi_detail {

void Mpi::put_signal(int to, std::int64_t offset, std::span<const std::byte> data, std::int32_t event) {
  std::vector<std::byte> message = message_buffer(sizeof(PutHeader) + data.size());
  if (!data.empty()) std::memcpy(message.data() + sizeof(PutHeader), data.data(), data.size());
  send_put(to, offset, std::move(message), event);
}

std::vector<std::byte> Mpi::message_buffer(std::size_t bytes) {
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

void Mpi::send_put(int to, std::int64_t offset, std::vector<std::byte>&& message, std::int32_t event) {
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

void Mpi::launch_begin() {
  run([this](bool first) { return barrier_step(first); });
  launch_active_.store(true, std::memory_order_relaxed);
}

void Mpi::launch_end() {
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

void Mpi::wait_for_outbox_room(std::int64_t bytes) {
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

bool Mpi::has_pending_puts() const {
  for (const auto& s : sends_)
    if (s.tag == kPut) return true;
  return false;
}

void Mpi::run(std::function<bool(bool)> step) {
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

void Mpi::run_collective(MPI_Comm comm, const std::function<void()>& fn) {
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

void Mpi::progress_loop() {
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
      if (say_goodbye_.exchange(false, std::memory_order_acq_rel)) {
        for (int r = 0; r < size_; ++r)
          if (r != rank_) start_send(r, kBye, {});
        busy = true;
      }
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

void Mpi::keep_for_reuse(std::vector<std::byte>&& buffer) {
  const auto bytes = static_cast<std::int64_t>(buffer.capacity());
  std::lock_guard lock(spare_mutex_);
  if (spare_.size() >= kMaxSpareBuffers || spare_bytes_ + bytes > outbox_limit_) return;
  spare_bytes_ += bytes;
  spare_.push_back(std::move(buffer));
}

void Mpi::start_send(int to, int tag, std::vector<std::byte> bytes) {
  if (bytes.size() > static_cast<std::size_t>(INT32_MAX)) throw Error("a put of more than 2 GiB");
  InFlight f{MPI_REQUEST_NULL, MPI_REQUEST_NULL, tag, std::move(bytes)};
  const bool split = tag == kPut && static_cast<std::int64_t>(f.bytes.size() - sizeof(PutHeader)) > kInlineRows;
  const std::size_t head = split ? sizeof(PutHeader) : f.bytes.size();
  int code = MPI_Isend(f.bytes.data(), static_cast<int>(head), MPI_BYTE, to, tag, comm_, &f.request);
  if (code == MPI_SUCCESS && head < f.bytes.size())
    code = MPI_Isend(f.bytes.data() + head, static_cast<int>(f.bytes.size() - head), MPI_BYTE, to, kRows, comm_,
                     &f.rows);
  if (code != MPI_SUCCESS) check_mpi(code, ("Isend to rank " + std::to_string(to)).c_str());
  sends_.push_back(std::move(f));
}

bool Mpi::receive(std::vector<std::byte>& scratch) {
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
    if (!flag) check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, kBye, comm_, &flag, &st), "Iprobe");
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
      if (st.MPI_TAG == kBye) left_at_[static_cast<std::size_t>(st.MPI_SOURCE)] = Clock::now();
    }
    if (st.MPI_TAG == kBeat || st.MPI_TAG == kBye) continue;
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

}  // namespace hpmoe::mpi_detail

#endif  // HPMOE_HAVE_MPI
