// The engine's launch: every worker of every hosted rank walks its queue
// (or, phased, one operator at a time between barriers), waiting on event
// counters and moving rows with put + signal; the watchdog names the task
// and event a stuck wait is for.
#include "runtime/engine.hpp"

namespace hpmoe::detail {

// Each hosted rank's counters read before the launch (the step's counts
// are relative to them), and, phased, its tasks grouped by operator.
template <class T>
void Interleaved<T>::arm_counters(const std::vector<taskflow::Program>& set, std::span<const TaskKind> order) {
  const std::size_t barriers = opt_.phased ? order.size() : 0;
  std::vector<std::int64_t> events(static_cast<std::size_t>(c_.ranks));
  launch_events_.resize(static_cast<std::size_t>(c_.ranks));
  for (std::int64_t r = 0; r < c_.ranks; ++r) {
    launch_events_[static_cast<std::size_t>(r)] = event_count(pass_of(set), r);
    events[static_cast<std::size_t>(r)] = launch_events_[static_cast<std::size_t>(r)] + static_cast<std::int64_t>(barriers);
  }
  tr_->reserve_events(events);
  for (int r : local_) {
    RankState& s = ranks_[r];
    Counter* counters = tr_->counters(r);
    s.base_count.resize(set[r].events.size() + barriers);
    for (std::size_t e = 0; e < s.base_count.size(); ++e) s.base_count[e] = counters[e].value.load(std::memory_order_relaxed);
    if (opt_.phased) group_by_operator(r, set[r], order);
  }
  for (std::int64_t r = 0; r < c_.ranks; ++r) ranks_[r].counters = tr_->counters(static_cast<int>(r));
}

// Phased: the rank's tasks by operator, in generation order. One counting
// pass: operator of each kind, tasks per operator, then placement.
template <class T>
void Interleaved<T>::group_by_operator(int r, const taskflow::Program& p, std::span<const TaskKind> order) {
  RankState& s = ranks_[r];
  std::array<int, static_cast<std::size_t>(taskflow::TaskKind::count)> phase_of;
  phase_of.fill(-1);
  for (std::size_t k = 0; k < order.size(); ++k) phase_of[static_cast<std::size_t>(order[k])] = static_cast<int>(k);
  s.phase_begin.assign(order.size() + 1, 0);
  for (const Task& t : p.tasks) {
    const int k = phase_of[static_cast<std::size_t>(t.kind)];
    if (k < 0)
      throw Error("phased execution: rank " + std::to_string(r) + " has a " + taskflow::name(t.kind) +
                  " task, outside the operator order");
    ++s.phase_begin[static_cast<std::size_t>(k) + 1];
  }
  for (std::size_t k = 0; k < order.size(); ++k) s.phase_begin[k + 1] += s.phase_begin[k];
  s.phase_tasks.resize(p.tasks.size());
  std::vector<std::int32_t>& fill = phase_fill_;
  fill.assign(s.phase_begin.begin(), s.phase_begin.end() - 1);
  for (std::size_t id = 0; id < p.tasks.size(); ++id)
    s.phase_tasks[static_cast<std::size_t>(fill[static_cast<std::size_t>(phase_of[static_cast<std::size_t>(p.tasks[id].kind)])]++)] =
        static_cast<std::int32_t>(id);
}

template <class T>
double Interleaved<T>::launch(std::vector<taskflow::Program>& set, StepResult& res) {
  current_ = &set;
  // Phased: one barrier counter per operator after the program's events.
  const auto& order = pass_of(set) == taskflow::Pass::forward ? phases_[0] : phases_[1];
  arm_counters(set, order);
  if (opt_.trace) {  // storage before the launch: recording allocates nothing
    spans_.resize(local_.size() * static_cast<std::size_t>(opt_.workers_per_rank));
    for (std::size_t i = 0; i < local_.size(); ++i)
      for (int w = 0; w < opt_.workers_per_rank; ++w) {
        auto& v = spans_[i * static_cast<std::size_t>(opt_.workers_per_rank) + static_cast<std::size_t>(w)];
        v.clear();
        v.reserve(static_cast<std::size_t>(set[local_[i]].queue_begin[w + 1] - set[local_[i]].queue_begin[w]));
      }
  }
  abort_.store(false, std::memory_order_relaxed);
  failure_ = nullptr;
  busy_.assign(local_.size() * static_cast<std::size_t>(opt_.workers_per_rank), 0.0);
  if (opt_.fault.kind == RuntimeFault::exit_process && tr_->hosts(opt_.fault.rank)) std::_Exit(9);
  activity_.set_workers(static_cast<int>(local_.size()) * opt_.workers_per_rank);
  tr_->launch_begin();  // every process has armed its counters
  if (opt_.fault.kind == RuntimeFault::freeze_process && tr_->hosts(opt_.fault.rank)) std::raise(SIGSTOP);
  if (opt_.phased) phase_end_.assign(busy_.size() * order.size(), 0.0);
  const auto start = launch_start_ = Clock::now();
  pool_.run([&](int index, int w) { run_worker(index, w); });
  if (!failure_) tr_->launch_end();
  if (failure_) std::rethrow_exception(failure_);
  const double elapsed = seconds(start, Clock::now());
  if (opt_.phased) record_operators(set, order, pass_of(set) == taskflow::Pass::forward ? res.forward_ops : res.backward_ops);
  record_busy(set, res);
  if (opt_.trace) record_trace(set, res);
  return elapsed;
}

// Phased: each operator from the previous barrier to its own, as this
// process's workers passed them. Operators no rank has tasks of (the shared
// experts' without them) are not listed.
template <class T>
void Interleaved<T>::record_operators(const std::vector<taskflow::Program>& set, std::span<const TaskKind> order,
                                      std::vector<OperatorTime>& ops) const {
  std::array<bool, static_cast<std::size_t>(TaskKind::count)> present{};
  for (const int r : local_)
    for (const Task& t : set[r].tasks) present[static_cast<std::size_t>(t.kind)] = true;
  double previous = 0;
  for (std::size_t k = 0; k < order.size(); ++k) {
    double end = 0;
    for (std::size_t w = 0; w < busy_.size(); ++w) end = std::max(end, phase_end_[w * order.size() + k]);
    if (present[static_cast<std::size_t>(order[k])]) ops.push_back({taskflow::name(order[k]), end - previous});
    previous = end;
  }
}

// Busy worker-seconds of every rank, summed on the root.
template <class T>
void Interleaved<T>::record_busy(const std::vector<taskflow::Program>& set, StepResult& res) {
  std::vector<float> busy(static_cast<std::size_t>(c_.ranks), 0.0f);
  for (std::size_t i = 0; i < busy_.size(); ++i)
    busy[static_cast<std::size_t>(local_[i / static_cast<std::size_t>(opt_.workers_per_rank)])] += static_cast<float>(busy_[i]);
  for (int q = 0; q < c_.ranks; ++q) tr_->gather(std::span<float>(busy).subspan(static_cast<std::size_t>(q), 1), q);
  double& total = pass_of(set) == taskflow::Pass::forward ? res.forward_busy_seconds : res.backward_busy_seconds;
  total = 0;
  for (float b : busy) total += b;
}

// The launch's spans as trace slices, named by kind and described by tile.
template <class T>
void Interleaved<T>::record_trace(const std::vector<taskflow::Program>& set, StepResult& res) const {
  const char* pass = pass_of(set) == taskflow::Pass::forward ? "forward" : "backward";
  for (std::size_t i = 0; i < local_.size(); ++i)
    for (int w = 0; w < opt_.workers_per_rank; ++w)
      for (const auto& span : spans_[i * static_cast<std::size_t>(opt_.workers_per_rank) + static_cast<std::size_t>(w)]) {
        const int r = local_[i];
        const Task& t = set[r].tasks[span.task];
        std::string detail = std::string(pass) + (t.expert >= 0 ? " expert " + std::to_string(t.expert) : "") +
                             " rows [" + std::to_string(t.row_begin) + ", " + std::to_string(t.row_begin + t.rows) +
                             ") cols [" + std::to_string(t.col_begin) + ", " + std::to_string(t.col_begin + t.cols) +
                             ")" + (t.peer != r ? " to rank " + std::to_string(t.peer) : "");
        res.trace.push_back(TraceSlice{static_cast<std::int32_t>(r), w, span.start, span.end, taskflow::name(t.kind),
                                       std::move(detail)});
      }
}

template <class T>
T* Interleaved<T>::put_target(const Task& t, const taskflow::Rect& rect, std::size_t worker) {
  const taskflow::BufferLayout& l = *peer_layout(t.peer, rect.buffer);
  // Offsets in the buffer's own elements (a staged dispatch's are bytes).
  if (std::byte* peer = ranks_[t.peer].segment)
    return reinterpret_cast<T*>(peer + l.offset_bytes + (rect.r0 * l.cols + rect.c0) * l.elem_bytes);
  // Rows for a peer reached by messages are written straight into the
  // message, after the transport's header: no copy before it is sent.
  auto& message = staging_[worker];
  const std::size_t bytes = tr_->put_header_bytes() + static_cast<std::size_t>(rect.area() * l.elem_bytes);
  if (message.capacity() < bytes) message = tr_->message_buffer(bytes);
  message.resize(bytes);
  return reinterpret_cast<T*>(message.data() + tr_->put_header_bytes());
}

template <class T>
bool Interleaved<T>::send_put(const Task& t, const taskflow::Rect& rect, std::size_t worker) {
  if (ranks_[t.peer].segment) return false;
  const taskflow::BufferLayout& l = *peer_layout(t.peer, rect.buffer);
  const std::int64_t offset = l.offset_bytes + (rect.r0 * l.cols + rect.c0) * l.elem_bytes;
  tr_->send_put(t.peer, offset, std::move(staging_[worker]), t.trigger_event);
  staging_[worker].clear();  // moved from: valid, empty
  return true;
}

template <class T>
void Interleaved<T>::wait(int r, std::size_t slot, std::int32_t id, const Task& t) {
  const RankState& s = ranks_[r];
  const std::int64_t target = s.base_count[t.wait_event] + t.wait_count;
  const std::atomic<std::int64_t>& counter = s.counters[t.wait_event].value;
  if (counter.load(std::memory_order_acquire) >= target) return;
  const auto start = Clock::now();
  std::atomic<std::int32_t>& status = waiting_[slot];
  status.store(id, std::memory_order_relaxed);
  struct Clear {
    std::atomic<std::int32_t>& s;
    ~Clear() { s.store(-1, std::memory_order_relaxed); }
  } clear{status};
  struct Blocked {  // the transport's progress thread is told while this worker waits
    WorkerActivity& a;
    bool on = false;
    ~Blocked() {
      if (on) a.end_wait();
    }
  } blocked{activity_};
  wait_until(
      s.counters[t.wait_event], target,
      [&] {
        blocked.on = true;
        activity_.begin_wait();
      },
      [&] {
    if (abort_.load(std::memory_order_relaxed)) throw Aborted{};
    const double waited = seconds(start, Clock::now());
    if (waited > opt_.watchdog_seconds)
      throw Error("watchdog: no progress for " + std::to_string(waited).substr(0, 5) + " s; waiting: " +
                  describe_waiters() + peer_report());
    if (waited > 0.5 && local_.size() < static_cast<std::size_t>(c_.ranks)) {
      const std::string failed = tr_->failed_peers();
      if (!failed.empty()) throw Error("a peer failed: " + failed + "; waiting: " + describe_waiters());
    }
  });
}

template <class T>
std::string Interleaved<T>::describe_waiters() const {
  std::string text;
  for (std::size_t i = 0; i < local_.size(); ++i)
    for (int w = 0; w < opt_.workers_per_rank; ++w) {
      const int r = local_[i];
      const std::int32_t id = waiting_[i * static_cast<std::size_t>(opt_.workers_per_rank) + static_cast<std::size_t>(w)].load();
      if (id == -1) continue;
      if (id <= -2) {  // phased: an operator's barrier
        const auto& p = (*current_)[r];
        const std::size_t k = static_cast<std::size_t>(-2 - id), e = p.events.size() + k;
        text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " worker " + std::to_string(w) +
                " at the barrier after operator " + taskflow::name(phases_[p.pass == taskflow::Pass::forward ? 0 : 1][k]) + " at " +
                std::to_string(ranks_[r].counters[e].value.load() - ranks_[r].base_count[e]) + " of " +
                std::to_string(c_.ranks * opt_.workers_per_rank);
        continue;
      }
      const Task& t = (*current_)[r].tasks[id];
      const auto& ev = (*current_)[r].events[t.wait_event];
      const std::int64_t reached = ranks_[r].counters[t.wait_event].value.load() - ranks_[r].base_count[t.wait_event];
      text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " worker " + std::to_string(w) +
              " task #" + std::to_string(id) + " (" + taskflow::name(t.kind) + ") on event " +
              std::to_string(t.wait_event) + " (for " + taskflow::name(ev.consumer) +
              (ev.expert >= 0 ? ", expert " + std::to_string(ev.expert) : "") + ") at " + std::to_string(reached) +
              " of " + std::to_string(t.wait_count);
    }
  return text;
}

template <class T>
std::string Interleaved<T>::peer_report() const {
  const std::string failed = tr_->failed_peers();
  return failed.empty() ? std::string() : "; peers: " + failed;
}

template <class T>
void Interleaved<T>::run_worker(int index, int w) {
  const int r = local_[static_cast<std::size_t>(index)];
  const std::size_t slot = static_cast<std::size_t>(index * opt_.workers_per_rank + w);
  const auto& p = (*current_)[r];
  try {
    if (opt_.fault.kind == RuntimeFault::stall && opt_.fault.rank == r && w == 0)
      while (!abort_.load(std::memory_order_relaxed)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (opt_.phased) {
      run_phased(r, w, slot);
      return;
    }
    for (auto q = p.queue_begin[w]; q < p.queue_begin[w + 1]; ++q) run_task(r, slot, p.queue_tasks[q]);
  } catch (const Aborted&) {
    return;
  } catch (...) {
    if (!abort_.exchange(true)) {
      std::lock_guard lock(failure_mutex_);
      failure_ = std::current_exception();
    }
  }
}

template <class T>
void Interleaved<T>::run_task(int r, std::size_t slot, std::int32_t id) {
  const Task& t = (*current_)[r].tasks[id];
  if (t.wait_event >= 0) wait(r, slot, id, t);
  const auto begin = Clock::now();
  activity_.enter();
  struct Leave {
    WorkerActivity& a;
    ~Leave() { a.leave(); }
  } leave{activity_};
  const bool signalled = execute(r, slot, t);
  const auto end = Clock::now();
  busy_[slot] += seconds(begin, end);
  if (opt_.trace) spans_[slot].push_back(Span{id, seconds(step_start_, begin), seconds(step_start_, end)});
  if (t.trigger_event >= 0 && !signalled) signal_rank(t.peer, t.trigger_event, id);
}

template <class T>
void Interleaved<T>::signal_rank(int rank, std::int32_t event, std::int32_t task) {
  if (Counter* c = ranks_[rank].counters) {
    signal(c[event]);
  } else if (task < 0) {
    tr_->put_signal(rank, 0, {}, event);
  } else {
    const Task& t = (*current_)[local_.front()].tasks[task];
    throw Error("task #" + std::to_string(task) + " (" + taskflow::name(t.kind) + ") signals rank " +
                std::to_string(rank) + ", which this process cannot address, without a put");
  }
}

template <class T>
void Interleaved<T>::run_phased(int r, int w, std::size_t slot) {
  const auto& p = (*current_)[r];
  const RankState& s = ranks_[r];
  const std::int64_t W = opt_.workers_per_rank;
  const std::size_t phases = s.phase_begin.size() - 1;
  for (std::size_t k = 0; k < phases; ++k) {
    for (std::int64_t i = s.phase_begin[k] + w; i < s.phase_begin[k + 1]; i += W) run_task(r, slot, s.phase_tasks[i]);
    // Rank q's barrier counters follow its own program's events.
    for (int q = 0; q < c_.ranks; ++q)
      signal_rank(q, static_cast<std::int32_t>(launch_events_[static_cast<std::size_t>(q)] + static_cast<std::int64_t>(k)), -1);
    const auto barrier = static_cast<std::int32_t>(p.events.size() + k);
    Task wait_all{};
    wait_all.kind = phases_[p.pass == taskflow::Pass::forward ? 0 : 1][k];
    wait_all.wait_event = barrier;
    wait_all.wait_count = static_cast<std::int32_t>(c_.ranks * W);
    wait(r, slot, -2 - static_cast<std::int32_t>(k), wait_all);  // -2 - k: the barrier after operator k
    phase_end_[slot * phases + k] = seconds(launch_start_, Clock::now());
  }
}

// Instantiations of the members above.
template double Interleaved<float>::launch(std::vector<taskflow::Program>& set, StepResult& res);
template double Interleaved<bf16>::launch(std::vector<taskflow::Program>& set, StepResult& res);
template float* Interleaved<float>::put_target(const Task& t, const taskflow::Rect& rect, std::size_t worker);
template bf16* Interleaved<bf16>::put_target(const Task& t, const taskflow::Rect& rect, std::size_t worker);
template bool Interleaved<float>::send_put(const Task& t, const taskflow::Rect& rect, std::size_t worker);
template bool Interleaved<bf16>::send_put(const Task& t, const taskflow::Rect& rect, std::size_t worker);
template void Interleaved<float>::wait(int r, std::size_t slot, std::int32_t id, const Task& t);
template void Interleaved<bf16>::wait(int r, std::size_t slot, std::int32_t id, const Task& t);
template std::string Interleaved<float>::describe_waiters() const;
template std::string Interleaved<bf16>::describe_waiters() const;
template std::string Interleaved<float>::peer_report() const;
template std::string Interleaved<bf16>::peer_report() const;
template void Interleaved<float>::run_worker(int index, int w);
template void Interleaved<bf16>::run_worker(int index, int w);
template void Interleaved<float>::run_task(int r, std::size_t slot, std::int32_t id);
template void Interleaved<bf16>::run_task(int r, std::size_t slot, std::int32_t id);
template void Interleaved<float>::signal_rank(int rank, std::int32_t event, std::int32_t task);
template void Interleaved<bf16>::signal_rank(int rank, std::int32_t event, std::int32_t task);
template void Interleaved<float>::run_phased(int r, int w, std::size_t slot);
template void Interleaved<bf16>::run_phased(int r, int w, std::size_t slot);

}  // namespace hpmoe::detail
