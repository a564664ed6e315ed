#include <array>
#include <atomic>
#include <csignal>
#include <exception>
#include <mutex>
#include <optional>
#include <chrono>
#include <thread>
#include <type_traits>

#include "common/executor_parts.hpp"
#include "taskflow/layout.hpp"
#include "runtime/event_wait.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/runtime.hpp"
#include "hpmoe/worker_pool.hpp"


namespace hpmoe {

using namespace detail;
using taskflow::BufferId;
using taskflow::Task;
using taskflow::TaskKind;
using Clock = std::chrono::steady_clock;

struct InterleavedExecutor::Impl {
  virtual ~Impl() = default;
  virtual void step(const LayerInputs&, std::span<const std::int32_t>, StepResult&) = 0;
  std::vector<taskflow::Program> programs, backward_programs;
};

namespace {

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Counters only grow: a launch waits for base + count, base being the value
// when the launch began (re-armed by an offset, never reset).
using Counter = EventCounter;

template <class T>
class Interleaved final : public InterleavedExecutor::Impl {
 public:
  Interleaved(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt)
      : c_(c),
        w_(w),
        opt_(opt),
        placement_(placement_or_contiguous(opt.placement, c.routed_experts, c.ranks)),
        tr_(opt.transport ? opt.transport : make_inprocess_transport(static_cast<int>(c.ranks))),
        local_(hosted_ranks(*tr_, c.ranks)),
        pool_(static_cast<int>(local_.size()), opt.workers_per_rank, opt.pin, tr_->node_index() * opt.workers_per_rank),
        packed_((kernels::init(), resolve_packing<T>(c, w, opt.packed, opt.backward))) {
    machine_ = taskflow::cpu_machine(opt.workers_per_rank);
    machine_.tile_rows = kTileRows;
    machine_.tile_cols = kTileCols;
    programs.resize(static_cast<std::size_t>(c.ranks));
    backward_programs.resize(static_cast<std::size_t>(c.ranks));
    ranks_.resize(static_cast<std::size_t>(c.ranks));
    const auto workers = local_.size() * static_cast<std::size_t>(opt.workers_per_rank);
    waiting_ = std::make_unique<std::atomic<std::int32_t>[]>(workers);
    for (std::size_t i = 0; i < workers; ++i) waiting_[i].store(-1);
    staging_.resize(workers);
  }

  static std::vector<int> hosted_ranks(const Transport& tr, std::int64_t ranks) {
    if (tr.ranks() != ranks)
      throw Error("the transport connects " + std::to_string(tr.ranks()) + " ranks but the layer has " +
                  std::to_string(ranks));
    std::vector<int> out;
    for (int r = 0; r < ranks; ++r)
      if (tr.hosts(r)) out.push_back(r);
    if (out.empty()) throw Error("the transport hosts no rank in this process");
    return out;
  }

  void step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& res) override {
    check_shapes(c_, w_, in);
    res.forward_ops.clear();
    res.backward_ops.clear();
    res.trace.clear();
    step_start_ = Clock::now();
    if (res.out.rows != c_.total_tokens() || res.out.cols != c_.hidden) res.out = Matrix(c_.total_tokens(), c_.hidden);
    auto t0 = Clock::now();
    res.routing = run_router(pool_, c_, packed_->router.view(), in, w_.expert_bias, forced, logits_);
    auto t1 = Clock::now();
    res.forward_ops.push_back({"router", seconds(t0, t1)});
    res.router_seconds = seconds(t0, t1);
    const auto counts = taskflow::routing_counts(c_, res.routing);
    ex_.emplace(c_, placement_, counts, machine_.tile_rows);
    slot_ = taskflow::send_slots(c_, *ex_, res.routing);
    for (std::int64_t r = 0; r < c_.ranks; ++r) {
      taskflow::generate(programs[r], c_, *ex_, machine_, taskflow::Pass::forward, r);
      taskflow::schedule(programs[r], opt_.policy, schedule_scratch_);
    }
    if (opt_.after_compile) opt_.after_compile(programs);
    auto t2 = Clock::now();
    res.forward_ops.push_back({"compile", seconds(t1, t2)});
    if (opt_.verify_programs) {
      const auto report = verifier_.verify(programs);
      if (!report.ok) throw Error("the compiled program failed verification: " + report.error);
    }
    auto t3 = Clock::now();
    res.forward_ops.push_back({"verify", seconds(t2, t3)});
    prepare_buffers(in);
    res.forward_ops.push_back({"prepare", seconds(t3, Clock::now())});
    res.dispatch_to_combine_seconds = launch(programs, in, res);
    res.forward_ops.push_back({"launch", res.dispatch_to_combine_seconds});
    gather_rows(res.out);
    if (!opt_.backward) return;

    auto b0 = Clock::now();
    for (std::int64_t r = 0; r < c_.ranks; ++r) {
      taskflow::generate(backward_programs[r], c_, *ex_, machine_, taskflow::Pass::backward, r);
      taskflow::schedule(backward_programs[r], opt_.policy, schedule_scratch_);
    }
    auto b1 = Clock::now();
    res.backward_ops.push_back({"compile", seconds(b0, b1)});
    if (opt_.verify_programs) {
      const auto report = verifier_.verify(backward_programs);
      if (!report.ok) throw Error("the compiled backward program failed verification: " + report.error);
    }
    auto b2 = Clock::now();
    res.backward_ops.push_back({"verify", seconds(b1, b2)});
    if (res.grads.w1.size() != static_cast<std::size_t>(c_.routed_experts)) res.grads = zero_gradients(c_);
    prepare_backward(in);
    res.backward_ops.push_back({"prepare", seconds(b2, Clock::now())});
    res.backward_seconds = launch(backward_programs, in, res);
    res.backward_ops.push_back({"launch", res.backward_seconds});
    const auto r0 = Clock::now();
    gather_rows(res.grads.x);
    for (std::int64_t e = 0; e < c_.routed_experts; ++e) {
      tr_->gather(res.grads.w1[e].data, placement_.owner(e));
      tr_->gather(res.grads.w2[e].data, placement_.owner(e));
    }
    reduce_replicated(res);
    res.backward_ops.push_back({"reduce_replicated_grads", seconds(r0, Clock::now())});
  }

 private:
  // One launch: all workers of all ranks run their queues of `set` at once.
  double launch(std::vector<taskflow::Program>& set, const LayerInputs& in, StepResult& res) {
    current_ = &set;
    // Phased: one barrier counter per operator after the program's events.
    const auto& order = taskflow::operator_order(set[0].pass);
    const std::size_t barriers = opt_.phased ? order.size() : 0;
    std::vector<std::int64_t> events(static_cast<std::size_t>(c_.ranks));
    for (std::int64_t r = 0; r < c_.ranks; ++r) events[r] = static_cast<std::int64_t>(set[r].events.size() + barriers);
    tr_->reserve_events(events);
    for (int r : local_) {
      RankState& s = ranks_[r];
      const auto& p = set[r];
      Counter* counters = tr_->counters(r);
      s.base.resize(p.events.size() + barriers);
      for (std::size_t e = 0; e < s.base.size(); ++e) s.base[e] = counters[e].value.load(std::memory_order_relaxed);
      if (opt_.phased) {  // the rank's tasks by operator, in generation order
        // One counting pass: operator of each kind, tasks per operator, then placement.
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
    }
    for (std::int64_t r = 0; r < c_.ranks; ++r) ranks_[r].counters = tr_->counters(static_cast<int>(r));
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
    tr_->set_launch_workers(static_cast<int>(local_.size()) * opt_.workers_per_rank);
    tr_->launch_begin();  // every process has armed its counters
    if (opt_.fault.kind == RuntimeFault::freeze_process && tr_->hosts(opt_.fault.rank)) std::raise(SIGSTOP);
    const auto start = Clock::now();
    pool_.run([&](int index, int w) { run_worker(in, res, index, w); });
    if (!failure_) tr_->launch_end();
    if (failure_) std::rethrow_exception(failure_);
    const double elapsed = seconds(start, Clock::now());
    // Busy worker-seconds of every rank, summed on the root.
    std::vector<float> busy(static_cast<std::size_t>(c_.ranks), 0.0f);
    for (std::size_t i = 0; i < busy_.size(); ++i)
      busy[static_cast<std::size_t>(local_[i / static_cast<std::size_t>(opt_.workers_per_rank)])] += static_cast<float>(busy_[i]);
    for (int q = 0; q < c_.ranks; ++q) tr_->gather(std::span<float>(busy).subspan(static_cast<std::size_t>(q), 1), q);
    double& total = set[0].pass == taskflow::Pass::forward ? res.forward_busy_seconds : res.backward_busy_seconds;
    total = 0;
    for (float b : busy) total += b;
    if (opt_.trace) {
      const char* pass = set[0].pass == taskflow::Pass::forward ? "forward" : "backward";
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
    return elapsed;
  }

  // Every rank's token rows of m onto the root process.
  void gather_rows(Matrix& m) {
    const std::int64_t n = c_.tokens_per_rank * m.cols;
    for (int q = 0; q < c_.ranks; ++q)
      tr_->gather(std::span<float>(m.data).subspan(static_cast<std::size_t>(q * n), static_cast<std::size_t>(n)), q);
  }

  // Sum over ranks, in rank order, of the replicated weights' gradients (on
  // the root process, which gathers the other ranks' parts).
  void reduce_replicated(StepResult& res) {
    auto reduce = [&](std::vector<float>& dst, std::vector<float> RankState::*part) {
      std::vector<std::vector<float>> received(static_cast<std::size_t>(c_.ranks));
      std::vector<const float*> parts(static_cast<std::size_t>(c_.ranks));
      for (int q = 0; q < c_.ranks; ++q) {
        if (tr_->hosts(q)) {
          parts[q] = (ranks_[q].*part).data();
          if (tr_->is_root()) continue;
        } else if (tr_->is_root()) {
          received[q].resize(dst.size());
          parts[q] = received[q].data();
        }
        tr_->gather(tr_->hosts(q) ? std::span<float>(ranks_[q].*part) : std::span<float>(received[q]), q);
      }
      if (!tr_->is_root()) return;
      for (std::size_t i = 0; i < dst.size(); ++i) {
        float sum = 0;
        for (std::int64_t q = 0; q < c_.ranks; ++q) sum += parts[q][i];
        dst[i] = sum;
      }
    };
    reduce(res.grads.router.data, &RankState::d_router);
    if (c_.shared_experts > 0) {
      reduce(res.grads.shared_w1.data, &RankState::d_shared_w1);
      reduce(res.grads.shared_w2.data, &RankState::d_shared_w2);
    }
  }

  struct RankState {
    // The rank's symmetric segment: the forward program's buffers, then the
    // backward's put targets dy and dcomb. Offsets are known for every rank;
    // `segment` and `counters` only where this process can address them.
    std::array<std::int64_t, static_cast<std::size_t>(BufferId::count)> offset{};
    std::byte* segment = nullptr;
    Counter* counters = nullptr;
    std::vector<std::int64_t> base;              // counter values when the launch began (hosted ranks)
    std::vector<std::int32_t> phase_begin, phase_tasks;  // phased: task ids by operator
    std::vector<std::int32_t> send_token;        // send row -> local token
    std::vector<std::int64_t> send_assign;       // send row -> assignment t * K + k (global)
    // Backward, laid out as the serialized baseline lays them out (padded K,
    // panel-packed operands) so that the arithmetic is the same.
    std::vector<float> d_weight, d_logits, x_t_float, d_router, rdx, sdx, da, shared_da, d_shared_w1, d_shared_w2;
    std::vector<T> dh, dx_expert, a_t, x_t, dy_packed, dh_packed;
    std::vector<T> shared_dy, shared_dy_packed, shared_dh, shared_dh_packed, shared_a_t, shared_x_t;
  };

  void prepare_backward(const LayerInputs& in) {
    const std::int64_t H = c_.hidden, I = c_.expert_inter, K = c_.top_k, E = c_.routed_experts,
                       T_ = c_.tokens_per_rank, Is = c_.shared_inter_total(), tpad = padded_k<T>(T_);
    for (const int r : local_) {
      RankState& b = ranks_[r];
      const std::int64_t rows = ex_->recv_rows(r), kpad = ex_->kpad_rows(r);
      auto size = [](auto& v, std::int64_t n) { v.resize(static_cast<std::size_t>(n)); };
      size(b.d_weight, T_ * K);
      size(b.d_logits, T_ * E);
      size(b.x_t_float, H * T_);
      size(b.d_router, H * E);
      size(b.rdx, T_ * H);
      size(b.da, rows * I);
      size(b.dh, rows * 2 * I);
      size(b.dx_expert, rows * H);
      size(b.a_t, I * kpad);
      size(b.x_t, H * kpad);
      size(b.dy_packed, kpad * round_up(H));
      size(b.dh_packed, kpad * round_up(2 * I));
      if (c_.shared_experts > 0) {
        size(b.sdx, T_ * H);
        size(b.shared_da, T_ * Is);
        size(b.shared_dy, T_ * H);
        size(b.shared_dy_packed, tpad * round_up(H));
        size(b.shared_dh, T_ * 2 * Is);
        size(b.shared_dh_packed, tpad * round_up(2 * Is));
        size(b.shared_a_t, Is * tpad);
        size(b.shared_x_t, H * tpad);
        size(b.d_shared_w1, H * 2 * Is);
        size(b.d_shared_w2, Is * H);
        for (std::int64_t t = 0; t < T_; ++t) kernels::store<T>(in.d_out.row(r * T_ + t), b.shared_dy.data() + t * H, H);
      }
    }
  }

  // Lays out every rank's segment (the same on every process), reserves
  // them, and fills the hosted ranks' send maps.
  void prepare_buffers(const LayerInputs& in) {
    const std::int64_t K = c_.top_k, T_ = c_.tokens_per_rank, H = c_.hidden;
    std::vector<std::int64_t> bytes(static_cast<std::size_t>(c_.ranks));
    auto align = [](std::int64_t n) { return (n + 63) / 64 * 64; };
    for (std::int64_t r = 0; r < c_.ranks; ++r) {
      RankState& s = ranks_[r];
      s.offset.fill(-1);
      std::int64_t end = 0;
      for (const auto& b : programs[r].buffers) {
        s.offset[static_cast<std::size_t>(b.id)] = b.offset_bytes;
        end = std::max(end, b.offset_bytes + b.rows * b.cols * b.elem_bytes);
      }
      if (opt_.backward) {  // the backward's put targets, in rows of T
        s.offset[static_cast<std::size_t>(BufferId::dy)] = end = align(end);
        end += ex_->recv_rows(r) * H * std::int64_t{sizeof(T)};
        s.offset[static_cast<std::size_t>(BufferId::dcomb)] = end = align(end);
        end += ex_->send_rows(r) * H * std::int64_t{sizeof(T)};
      }
      bytes[r] = end;
    }
    tr_->reserve_segments(bytes);
    for (std::int64_t r = 0; r < c_.ranks; ++r) ranks_[r].segment = tr_->segment(static_cast<int>(r));
    for (const int r : local_) {
      RankState& s = ranks_[r];
      s.send_token.assign(static_cast<std::size_t>(ex_->send_rows(r)), -1);
      s.send_assign.assign(static_cast<std::size_t>(ex_->send_rows(r)), -1);
      for (std::int64_t a = r * T_ * K; a < (r + 1) * T_ * K; ++a)
        if (slot_[a] >= 0) {
          s.send_token[static_cast<std::size_t>(slot_[a])] = static_cast<std::int32_t>(a / K - r * T_);
          s.send_assign[static_cast<std::size_t>(slot_[a])] = a;
        }
      if constexpr (!std::is_same_v<T, float>)
        for (std::int64_t t = 0; t < T_; ++t) kernels::store<T>(in.x.row(r * T_ + t), buf<T>(r, BufferId::x) + t * c_.hidden, c_.hidden);
    }
  }

  // Rank r's tokens as T: the input itself in fp32; in bf16 the x buffer,
  // filled once per step (the inputs are bf16 values, so this is exact).
  const T* tokens_of(const LayerInputs& in, std::int64_t r) const {
    if constexpr (std::is_same_v<T, float>) return in.x.row(r * c_.tokens_per_rank);
    else return buf<T>(r, BufferId::x);
  }

  template <class U>
  U* buf(std::int64_t rank, BufferId id) const {
    return reinterpret_cast<U*>(ranks_[rank].segment + ranks_[rank].offset[static_cast<std::size_t>(id)]);
  }

  // Where a put of `elems` values at row offset `at` of the peer's buffer
  // `id` is written: straight into the peer's segment when this process can
  // address it, else into the worker's staging buffer, which send_put hands
  // to the transport.
  T* put_target(const Task& t, BufferId id, std::int64_t at, std::int64_t elems, std::size_t worker) {
    if (ranks_[t.peer].segment) return buf<T>(t.peer, id) + at;
    auto& stage = staging_[worker];
    stage.resize(static_cast<std::size_t>(elems));
    return stage.data();
  }
  // True if the put went through the transport, which also signals.
  bool send_put(const Task& t, BufferId id, std::int64_t at, std::int64_t elems, std::size_t worker) {
    if (ranks_[t.peer].segment) return false;
    const std::int64_t offset = ranks_[t.peer].offset[static_cast<std::size_t>(id)] + at * std::int64_t{sizeof(T)};
    tr_->put_signal(t.peer, offset,
                    std::as_bytes(std::span<const T>(staging_[worker].data(), static_cast<std::size_t>(elems))),
                    t.trigger_event);
    return true;
  }

  // Waits until the event reaches base + count: spins, then yields so that
  // an oversubscribed machine still makes progress; a watchdog turns a hang
  // into an error naming what waits for what.
  void wait(int r, std::size_t slot, std::int32_t id, const Task& t) {
    const RankState& s = ranks_[r];
    const std::int64_t target = s.base[t.wait_event] + t.wait_count;
    const std::atomic<std::int64_t>& counter = s.counters[t.wait_event].value;
    if (counter.load(std::memory_order_acquire) >= target) return;
    const auto start = Clock::now();
    std::atomic<std::int32_t>& status = waiting_[slot];
    status.store(id, std::memory_order_relaxed);
    struct Clear {
      std::atomic<std::int32_t>& s;
      ~Clear() { s.store(-1, std::memory_order_relaxed); }
    } clear{status};
    wait_until(s.counters[t.wait_event], target, [&] {
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

  // Every worker that is waiting now, with what it waits for.
  std::string describe_waiters() const {
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
                  " at the barrier after operator " + taskflow::name(taskflow::operator_order(p.pass)[k]) + " at " +
                  std::to_string(ranks_[r].counters[e].value.load() - ranks_[r].base[e]) + " of " +
                  std::to_string(c_.ranks * opt_.workers_per_rank);
          continue;
        }
        const Task& t = (*current_)[r].tasks[id];
        const auto& ev = (*current_)[r].events[t.wait_event];
        const std::int64_t reached = ranks_[r].counters[t.wait_event].value.load() - ranks_[r].base[t.wait_event];
        text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " worker " + std::to_string(w) +
                " task #" + std::to_string(id) + " (" + taskflow::name(t.kind) + ") on event " +
                std::to_string(t.wait_event) + " (for " + taskflow::name(ev.consumer) +
                (ev.expert >= 0 ? ", expert " + std::to_string(ev.expert) : "") + ") at " + std::to_string(reached) +
                " of " + std::to_string(t.wait_count);
      }
    return text;
  }

  std::string peer_report() const {
    const std::string failed = tr_->failed_peers();
    return failed.empty() ? std::string() : "; peers: " + failed;
  }

  // A worker that stops because another failed: not an error of its own.
  struct Aborted {};

  // The first failure of a launch is kept; workers that stop because of it
  // leave quietly, so the error reported is the cause, not a consequence.
  void run_worker(const LayerInputs& in, StepResult& res, int index, int w) {
    const int r = local_[static_cast<std::size_t>(index)];
    const std::size_t slot = static_cast<std::size_t>(index * opt_.workers_per_rank + w);
    const auto& p = (*current_)[r];
    try {
      if (opt_.fault.kind == RuntimeFault::stall && opt_.fault.rank == r && w == 0)
        while (!abort_.load(std::memory_order_relaxed)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (opt_.phased) {
        run_phased(in, res, r, w, slot);
        return;
      }
      for (auto q = p.queue_begin[w]; q < p.queue_begin[w + 1]; ++q) run_task(in, res, r, slot, p.queue_tasks[q]);
    } catch (const Aborted&) {
      return;
    } catch (...) {
      if (!abort_.exchange(true)) {
        std::lock_guard lock(failure_mutex_);
        failure_ = std::current_exception();
      }
    }
  }

  // Waits for a task's event, runs it, signals what it triggers.
  void run_task(const LayerInputs& in, StepResult& res, int r, std::size_t slot, std::int32_t id) {
    const Task& t = (*current_)[r].tasks[id];
    if (t.wait_event >= 0) wait(r, slot, id, t);
    const auto begin = Clock::now();
    tr_->workers_in_tasks().fetch_add(1, std::memory_order_relaxed);
    struct Leave {
      std::atomic<int>& n;
      ~Leave() { n.fetch_sub(1, std::memory_order_relaxed); }
    } leave{tr_->workers_in_tasks()};
    const bool signalled = execute(in, res, r, slot, t);
    const auto end = Clock::now();
    busy_[slot] += seconds(begin, end);
    if (opt_.trace) spans_[slot].push_back(Span{id, seconds(step_start_, begin), seconds(step_start_, end)});
    if (t.trigger_event >= 0 && !signalled) signal_rank(t.peer, t.trigger_event, id);
  }

  // Adds one to a counter of any rank: a store when its memory is
  // addressable here, an empty put with signal otherwise.
  void signal_rank(int rank, std::int32_t event, std::int32_t task) {
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

  // The serialized operator sequence: a worker runs every W-th task of the
  // operator on its rank, then all workers of all ranks meet at the
  // operator's barrier counter before the next operator starts.
  void run_phased(const LayerInputs& in, StepResult& res, int r, int w, std::size_t slot) {
    const auto& p = (*current_)[r];
    const RankState& s = ranks_[r];
    const std::int64_t W = opt_.workers_per_rank;
    const std::size_t phases = s.phase_begin.size() - 1;
    for (std::size_t k = 0; k < phases; ++k) {
      for (std::int64_t i = s.phase_begin[k] + w; i < s.phase_begin[k + 1]; i += W) run_task(in, res, r, slot, s.phase_tasks[i]);
      // Rank q's barrier counters follow its own program's events.
      for (int q = 0; q < c_.ranks; ++q) signal_rank(q, static_cast<std::int32_t>((*current_)[q].events.size() + k), -1);
      const auto barrier = static_cast<std::int32_t>(p.events.size() + k);
      Task wait_all{};
      wait_all.kind = taskflow::operator_order(p.pass)[k];
      wait_all.wait_event = barrier;
      wait_all.wait_count = static_cast<std::int32_t>(c_.ranks * W);
      wait(r, slot, -2 - static_cast<std::int32_t>(k), wait_all);  // -2 - k: the barrier after operator k
    }
  }

  // Runs one task; true if the transport already signalled its event.
  bool execute(const LayerInputs& in, StepResult& res, int r, std::size_t slot, const Task& t) {
    const std::int64_t H = c_.hidden, I = c_.expert_inter, Is = c_.shared_inter_total(), K = c_.top_k,
                       T_ = c_.tokens_per_rank;
    const std::int64_t r0 = t.row_begin, rows = t.rows;
    switch (t.kind) {
      case TaskKind::dispatch_put: {  // gather by slot, put into the owner's receive rows
        T* dst = put_target(t, BufferId::recv, r0 * H, rows * H, slot);
        const T* x = tokens_of(in, r);
        const auto& tokens = ranks_[r].send_token;
        for (std::int64_t j = 0; j < rows; ++j)
          copy_elements(dst + j * H, x + std::int64_t{tokens[static_cast<std::size_t>(t.src_row + j)]} * H, H);
        return send_put(t, BufferId::recv, r0 * H, rows * H, slot);
      }
      case TaskKind::gemm_gate_up:
        kernels::gemm_tile<T>(buf<T>(r, BufferId::recv) + r0 * H, H, packed_->w1[t.expert].view(), t.col_begin,
                              buf<float>(r, BufferId::h1) + r0 * 2 * I + t.col_begin, 2 * I, rows, t.cols, H, false);
        break;
      case TaskKind::swiglu:
        for (std::int64_t row = r0; row < r0 + rows; ++row)
          kernels::swiglu_forward<T>(buf<float>(r, BufferId::h1) + row * 2 * I, I, buf<T>(r, BufferId::a) + row * I);
        break;
      case TaskKind::gemm_down:
        tile_to<T>(buf<T>(r, BufferId::a) + r0 * I, I, packed_->w2[t.expert].view(), t.col_begin,
                   buf<T>(r, BufferId::y) + r0 * H + t.col_begin, H, rows, t.cols, I);
        break;
      case TaskKind::combine_put:
        copy_elements(put_target(t, BufferId::comb, r0 * H, rows * H, slot), buf<T>(r, BufferId::y) + t.src_row * H,
                      rows * H);
        return send_put(t, BufferId::comb, r0 * H, rows * H, slot);
      case TaskKind::combine_reduce:
        for (std::int64_t tok = r0; tok < r0 + rows; ++tok) {
          const std::int64_t a = (r * T_ + tok) * K;
          combine_row<T>(res.out.row(r * T_ + tok), H, K, slot_.data() + a, res.routing.weight.data() + a,
                         buf<T>(r, BufferId::comb),
                         c_.shared_experts > 0 ? buf<float>(r, BufferId::sh_y) + tok * H : nullptr);
        }
        break;
      case TaskKind::shared_gate_up:
        kernels::gemm_tile<T>(tokens_of(in, r) + r0 * H, H, packed_->sw1.view(), t.col_begin,
                              buf<float>(r, BufferId::sh_h) + r0 * 2 * Is + t.col_begin, 2 * Is, rows, t.cols, H, false);
        break;
      case TaskKind::shared_swiglu:
        for (std::int64_t row = r0; row < r0 + rows; ++row)
          kernels::swiglu_forward<T>(buf<float>(r, BufferId::sh_h) + row * 2 * Is, Is, buf<T>(r, BufferId::sh_a) + row * Is);
        break;
      case TaskKind::shared_down:
        kernels::gemm_tile<T>(buf<T>(r, BufferId::sh_a) + r0 * Is, Is, packed_->sw2.view(), t.col_begin,
                              buf<float>(r, BufferId::sh_y) + r0 * H + t.col_begin, H, rows, t.cols, Is, false);
        break;
      default:
        return execute_backward(in, res, r, slot, t);
    }
    return false;
  }

  // The backward tasks, each the same arithmetic as the serialized
  // baseline's operator over the same rows (see serialized.cpp).
  bool execute_backward(const LayerInputs& in, StepResult& res, int r, std::size_t slot, const Task& t) {
    const std::int64_t H = c_.hidden, I = c_.expert_inter, Is = c_.shared_inter_total(), K = c_.top_k,
                       E = c_.routed_experts, T_ = c_.tokens_per_rank, tpad = padded_k<T>(T_);
    const std::int64_t r0 = t.row_begin, rows = t.rows;
    RankState& b = ranks_[r];
    // Expert-relative layout of task t's expert on this rank.
    const std::int64_t e = std::max<std::int64_t>(t.expert, 0), le = (*current_)[r].slot_of(e);
    const std::int64_t start = ex_->expert_start(e), n_e = ex_->expert_rows(e);
    const std::int64_t kp0 = ex_->kpad_start(e), ld = padded_k<T>(n_e);
    switch (t.kind) {
      case TaskKind::gate_grad:
        for (std::int64_t tok = r0; tok < r0 + rows; ++tok) {
          const float* dout = in.d_out.row(r * T_ + tok);
          for (std::int64_t k = 0; k < K; ++k) {
            const std::int64_t slot = slot_[(r * T_ + tok) * K + k];
            b.d_weight[tok * K + k] = slot >= 0 ? kernels::dot<T>(dout, buf<T>(r, BufferId::comb) + slot * H, H) : 0.0f;
          }
        }
        break;
      case TaskKind::router_bwd:
        for (std::int64_t tok = r0; tok < r0 + rows; ++tok) {
          const std::int64_t g = r * T_ + tok;
          router_backward_token<float>(c_, res.routing, std::span<const float>(logits_.data() + g * E, E), g,
                                       std::span<const float>(b.d_weight.data() + tok * K, K),
                                       std::span<float>(b.d_logits.data() + tok * E, E));
        }
        transpose_rows<float>(in.x.row(r * T_ + r0), H, rows, H, b.x_t_float.data() + r0, T_);
        break;
      case TaskKind::router_dgrad:
        kernels::gemm_tile<float>(b.d_logits.data() + r0 * E, E, packed_->router_t.view(), t.col_begin,
                                  b.rdx.data() + r0 * H + t.col_begin, H, rows, t.cols, E, false);
        break;
      case TaskKind::router_wgrad:
        kernels::gemm_tile<float>(b.x_t_float.data() + r0 * T_, T_, RhsView<float>{b.d_logits.data(), E}, t.col_begin,
                                  b.d_router.data() + r0 * E + t.col_begin, E, rows, t.cols, T_, false);
        break;
      case TaskKind::grad_dispatch_put: {
        T* dst = put_target(t, BufferId::dy, r0 * H, rows * H, slot);
        for (std::int64_t j = 0; j < rows; ++j) {
          const std::int64_t a = b.send_assign[static_cast<std::size_t>(t.src_row + j)];
          kernels::scale_store<T>(res.routing.weight[a], in.d_out.row(a / K), dst + j * H, H);
        }
        return send_put(t, BufferId::dy, r0 * H, rows * H, slot);
      }
      case TaskKind::gemm_down_dgrad:
        kernels::gemm_tile<T>(buf<T>(r, BufferId::dy) + r0 * H, H, packed_->w2_t[t.expert].view(), t.col_begin,
                              b.da.data() + r0 * I + t.col_begin, I, rows, t.cols, H, false);
        break;
      case TaskKind::pack_down_grad: {
        const std::int64_t rel = r0 - start;
        transpose_rows<T>(buf<T>(r, BufferId::a) + r0 * I, I, rows, I, b.a_t.data() + kp0 * I + rel, ld);
        pack_panel_rows<T>(buf<T>(r, BufferId::dy) + start * H, H, n_e, H, b.dy_packed.data() + kp0 * round_up(H), rel, rel + rows);
        if (rel + rows == n_e && ld > n_e)  // the K padding column of the bf16 pairs
          for (std::int64_t j = 0; j < I; ++j) b.a_t[static_cast<std::size_t>(kp0 * I + j * ld + n_e)] = T{};
        break;
      }
      case TaskKind::gemm_down_wgrad:
        kernels::gemm_tile<T>(b.a_t.data() + kp0 * I + (r0 - le * I) * ld, ld,
                              kernels::panel_view<T>(b.dy_packed.data() + kp0 * round_up(H), n_e), t.col_begin,
                              res.grads.w2[t.expert].row(r0 - le * I) + t.col_begin, H, rows, t.cols, ld, false);
        break;
      case TaskKind::swiglu_bwd:
        for (std::int64_t row = r0; row < r0 + rows; ++row)
          kernels::swiglu_backward<T>(buf<float>(r, BufferId::h1) + row * 2 * I, b.da.data() + row * I, I,
                                      b.dh.data() + row * 2 * I);
        break;
      case TaskKind::gemm_gate_up_dgrad:
        tile_to<T>(b.dh.data() + r0 * 2 * I, 2 * I, packed_->w1_t[t.expert].view(), t.col_begin,
                   b.dx_expert.data() + r0 * H + t.col_begin, H, rows, t.cols, 2 * I);
        break;
      case TaskKind::pack_gate_up_grad: {
        const std::int64_t rel = r0 - start;
        transpose_rows<T>(buf<T>(r, BufferId::recv) + r0 * H, H, rows, H, b.x_t.data() + kp0 * H + rel, ld);
        pack_panel_rows<T>(b.dh.data() + start * 2 * I, 2 * I, n_e, 2 * I, b.dh_packed.data() + kp0 * round_up(2 * I),
                           rel, rel + rows);
        if (rel + rows == n_e && ld > n_e)
          for (std::int64_t j = 0; j < H; ++j) b.x_t[static_cast<std::size_t>(kp0 * H + j * ld + n_e)] = T{};
        break;
      }
      case TaskKind::gemm_gate_up_wgrad:
        kernels::gemm_tile<T>(b.x_t.data() + kp0 * H + (r0 - le * H) * ld, ld,
                              kernels::panel_view<T>(b.dh_packed.data() + kp0 * round_up(2 * I), n_e), t.col_begin,
                              res.grads.w1[t.expert].row(r0 - le * H) + t.col_begin, 2 * I, rows, t.cols, ld, false);
        break;
      case TaskKind::grad_combine_put:
        copy_elements(put_target(t, BufferId::dcomb, r0 * H, rows * H, slot), b.dx_expert.data() + t.src_row * H,
                      rows * H);
        return send_put(t, BufferId::dcomb, r0 * H, rows * H, slot);
      case TaskKind::shared_down_dgrad:
        kernels::gemm_tile<T>(b.shared_dy.data() + r0 * H, H, packed_->sw2_t.view(), t.col_begin,
                              b.shared_da.data() + r0 * Is + t.col_begin, Is, rows, t.cols, H, false);
        break;
      case TaskKind::pack_shared_down_grad:
        pack_panel_rows<T>(b.shared_dy.data(), H, T_, H, b.shared_dy_packed.data(), r0, r0 + rows);
        transpose_rows<T>(buf<T>(r, BufferId::sh_a) + r0 * Is, Is, rows, Is, b.shared_a_t.data() + r0, tpad);
        if (r0 + rows == T_ && tpad > T_)
          for (std::int64_t j = 0; j < Is; ++j) b.shared_a_t[static_cast<std::size_t>(j * tpad + T_)] = T{};
        break;
      case TaskKind::shared_down_wgrad:
        kernels::gemm_tile<T>(b.shared_a_t.data() + r0 * tpad, tpad, kernels::panel_view<T>(b.shared_dy_packed.data(), T_),
                              t.col_begin, b.d_shared_w2.data() + r0 * H + t.col_begin, H, rows, t.cols, tpad, false);
        break;
      case TaskKind::shared_swiglu_bwd:
        for (std::int64_t row = r0; row < r0 + rows; ++row)
          kernels::swiglu_backward<T>(buf<float>(r, BufferId::sh_h) + row * 2 * Is, b.shared_da.data() + row * Is, Is,
                                      b.shared_dh.data() + row * 2 * Is);
        break;
      case TaskKind::shared_gate_up_dgrad:
        kernels::gemm_tile<T>(b.shared_dh.data() + r0 * 2 * Is, 2 * Is, packed_->sw1_t.view(), t.col_begin,
                              b.sdx.data() + r0 * H + t.col_begin, H, rows, t.cols, 2 * Is, false);
        break;
      case TaskKind::pack_shared_gate_up_grad:
        pack_panel_rows<T>(b.shared_dh.data(), 2 * Is, T_, 2 * Is, b.shared_dh_packed.data(), r0, r0 + rows);
        transpose_rows<T>(tokens_of(in, r) + r0 * H, H, rows, H, b.shared_x_t.data() + r0, tpad);
        if (r0 + rows == T_ && tpad > T_)
          for (std::int64_t j = 0; j < H; ++j) b.shared_x_t[static_cast<std::size_t>(j * tpad + T_)] = T{};
        break;
      case TaskKind::shared_gate_up_wgrad:
        kernels::gemm_tile<T>(b.shared_x_t.data() + r0 * tpad, tpad, kernels::panel_view<T>(b.shared_dh_packed.data(), T_),
                              t.col_begin, b.d_shared_w1.data() + r0 * 2 * Is + t.col_begin, 2 * Is, rows, t.cols, tpad,
                              false);
        break;
      case TaskKind::grad_reduce:
        for (std::int64_t tok = r0; tok < r0 + rows; ++tok)
          assemble_dx_row<T>(res.grads.x.row(r * T_ + tok), H, K, slot_.data() + (r * T_ + tok) * K,
                             buf<T>(r, BufferId::dcomb), b.rdx.data() + tok * H,
                             c_.shared_experts > 0 ? b.sdx.data() + tok * H : nullptr);
        break;
      default:
        throw Error(std::string("the interleaved runtime has no implementation of task kind ") + taskflow::name(t.kind));
    }
    return false;
  }

  // dst[j * ld_dst + i] = src[i * ld_src + j] for rows i < rows, columns j < cols.
  template <class U>
  static void transpose_rows(const U* src, std::int64_t ld_src, std::int64_t rows, std::int64_t cols, U* dst,
                             std::int64_t ld_dst) {
    for (std::int64_t j = 0; j < cols; ++j)
      for (std::int64_t i = 0; i < rows; ++i) dst[j * ld_dst + i] = src[i * ld_src + j];
  }

  // Rows [row_begin, row_end) of row-major src [k, n] into the panel-blocked
  // operand layout (kernels::pack_rhs_panels writes the same bytes, panel by
  // panel); the last rows also write the zero padding.
  template <class U>
  static void pack_panel_rows(const U* src, std::int64_t ld_src, std::int64_t k, std::int64_t n, U* dst,
                              std::int64_t row_begin, std::int64_t row_end) {
    const std::int64_t kp = padded_k<U>(k), end = row_end >= k ? kp : row_end;
    for (std::int64_t p = 0; p < panels(n); ++p) {
      U* panel = dst + p * kp * kTileCols;
      for (std::int64_t rr = row_begin; rr < end; ++rr)
        for (std::int64_t j = 0; j < kTileCols; ++j) {
          const std::int64_t col = p * kTileCols + j;
          const U v = rr < k && col < n ? src[rr * ld_src + col] : U{};
          if constexpr (sizeof(U) == 2) panel[(rr / 2) * kTileCols * 2 + j * 2 + (rr % 2)] = v;
          else panel[rr * kTileCols + j] = v;
        }
    }
  }

  // A GEMM tile whose result is stored as T (through an fp32 scratch tile).
  template <class U>
  static void tile_to(const U* a, std::int64_t lda, RhsView<U> b, std::int64_t col0, U* out, std::int64_t ldo,
                      std::int64_t m, std::int64_t n, std::int64_t k) {
    float scratch[kTileRows * kTileCols];
    kernels::gemm_tile<U>(a, lda, b, col0, scratch, kTileCols, m, n, k, false);
    for (std::int64_t row = 0; row < m; ++row) kernels::store<U>(scratch + row * kTileCols, out + row * ldo, n);
  }

  LayerConfig c_;
  const LayerWeights& w_;
  RuntimeOptions opt_;
  ExpertPlacement placement_;
  std::shared_ptr<Transport> tr_;
  std::vector<int> local_;  // the ranks this process runs, in order; pool rank i is local_[i]
  WorkerPool pool_;
  std::vector<std::vector<T>> staging_;  // per worker: rows of a put to a peer not addressable here
  taskflow::Machine machine_;
  std::shared_ptr<const PackedLayer<T>> packed_;
  std::vector<taskflow::Program>* current_ = nullptr;  // the program set being launched
  struct Span {
    std::int32_t task;
    double start, end;
  };
  std::vector<std::vector<Span>> spans_;  // per worker, when tracing
  std::vector<double> busy_;              // per worker: seconds in tasks this launch
  std::vector<std::int32_t> phase_fill_;  // phased: scratch of the per-operator placement
  Clock::time_point step_start_;
  std::vector<float> logits_;
  std::optional<taskflow::Exchange> ex_;  // this step's exchange layout
  std::vector<std::int64_t> slot_;        // this step's send row of every assignment
  taskflow::ScheduleScratch schedule_scratch_;
  taskflow::Verifier verifier_;
  std::vector<RankState> ranks_;
  std::atomic<bool> abort_{false};
  std::mutex failure_mutex_;
  std::exception_ptr failure_;
  std::unique_ptr<std::atomic<std::int32_t>[]> waiting_;  // per worker: the task it waits in, -1 if none
};

}  // namespace

InterleavedExecutor::InterleavedExecutor(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt) {
  c.validate();
  if (opt.workers_per_rank < 1 || opt.workers_per_rank > 256)
    throw Error("workers per rank must be between 1 and 256 (got " + std::to_string(opt.workers_per_rank) + ")");
  if (!(opt.watchdog_seconds > 0)) throw Error("the watchdog time must be positive");
  if (c.dtype == DType::fp32) impl_ = std::make_unique<Interleaved<float>>(c, w, opt);
  else impl_ = std::make_unique<Interleaved<bf16>>(c, w, opt);
}

InterleavedExecutor::~InterleavedExecutor() = default;

void InterleavedExecutor::step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& result) {
  impl_->step(in, forced, result);
}

const std::vector<taskflow::Program>& InterleavedExecutor::programs(taskflow::Pass pass) const {
  return pass == taskflow::Pass::forward ? impl_->programs : impl_->backward_programs;
}

}  // namespace hpmoe
