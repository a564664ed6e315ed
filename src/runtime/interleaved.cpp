#include <atomic>
#include <exception>
#include <mutex>
#include <chrono>
#include <thread>
#include <type_traits>

#include "common/executor_parts.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/runtime.hpp"
#include "hpmoe/worker_pool.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hpmoe {

using namespace detail;
using taskflow::BufferId;
using taskflow::Task;
using taskflow::TaskKind;
using Clock = std::chrono::steady_clock;

struct InterleavedExecutor::Impl {
  virtual ~Impl() = default;
  virtual void step(const LayerInputs&, std::span<const std::int32_t>, StepResult&) = 0;
  std::vector<taskflow::Program> programs;
};

namespace {

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// One event counter per cache line. Counters only grow: a step waits for
// base + count, base being the value when the step began (re-armed by an
// offset, never reset).
struct alignas(64) Counter {
  std::atomic<std::int64_t> value{0};
};

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

template <class T>
class Interleaved final : public InterleavedExecutor::Impl {
 public:
  Interleaved(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt)
      : c_(c), w_(w), opt_(opt), pool_(static_cast<int>(c.ranks), opt.workers_per_rank, opt.pin) {
    kernels::init();
    machine_ = taskflow::parse_machine("cpu:" + std::to_string(opt.workers_per_rank));
    machine_.tile_rows = kTileRows;
    machine_.tile_cols = kTileCols;
    for (std::int64_t e = 0; e < c.routed_experts; ++e) {
      w1_.push_back(operand_of<T>(w.w1[e]));
      w2_.push_back(operand_of<T>(w.w2[e]));
    }
    router_ = operand_of<float>(w.router);
    if (c.shared_experts > 0) {
      sw1_ = operand_of<T>(w.shared_w1);
      sw2_ = operand_of<T>(w.shared_w2);
    }
    programs.resize(static_cast<std::size_t>(c.ranks));
    ranks_.resize(static_cast<std::size_t>(c.ranks));
    const auto workers = static_cast<std::size_t>(c.ranks * opt.workers_per_rank);
    waiting_ = std::make_unique<std::atomic<std::int32_t>[]>(workers);
    for (std::size_t i = 0; i < workers; ++i) waiting_[i].store(-1);
  }

  void step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& res) override {
    check_shapes(c_, w_, in);
    res.forward_ops.clear();
    res.backward_ops.clear();
    if (res.out.rows != c_.total_tokens() || res.out.cols != c_.hidden) res.out = Matrix(c_.total_tokens(), c_.hidden);
    auto t0 = Clock::now();
    res.routing = run_router(pool_, c_, router_.view(), in, w_.expert_bias, forced, logits_);
    auto t1 = Clock::now();
    res.forward_ops.push_back({"router", seconds(t0, t1)});
    res.router_seconds = seconds(t0, t1);
    plan_ = make_plan<T>(c_, res.routing);
    const auto counts = taskflow::routing_counts(c_, res.routing);
    for (std::int64_t r = 0; r < c_.ranks; ++r) {
      taskflow::generate_into(programs[r], c_, counts, machine_, taskflow::Pass::forward, r);
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

    const auto launch = Clock::now();
    abort_.store(false, std::memory_order_relaxed);
    failure_ = nullptr;
    pool_.run([&](int r, int w) { run_worker(in, res, r, w); });
    if (failure_) std::rethrow_exception(failure_);
    const double d2c = seconds(launch, Clock::now());
    res.forward_ops.push_back({"launch", d2c});
    res.dispatch_to_combine_seconds = d2c;
  }

 private:
  struct RankState {
    std::vector<std::uint64_t> region;           // the symmetric buffers, 8-byte aligned
    std::array<std::byte*, static_cast<std::size_t>(BufferId::count)> buffer{};
    std::unique_ptr<Counter[]> counters;
    std::size_t capacity = 0;
    std::vector<std::int64_t> base;              // counter values when the step began
    std::vector<std::int32_t> send_token;        // send row -> local token
  };

  void prepare_buffers(const LayerInputs& in) {
    const std::int64_t K = c_.top_k, T_ = c_.tokens_per_rank;
    for (std::int64_t r = 0; r < c_.ranks; ++r) {
      RankState& s = ranks_[r];
      const auto& p = programs[r];
      std::int64_t bytes = 0;
      for (const auto& b : p.buffers) bytes = std::max(bytes, b.offset_bytes + b.rows * b.cols * b.elem_bytes);
      s.region.resize(static_cast<std::size_t>((bytes + 7) / 8));
      s.buffer.fill(nullptr);
      for (const auto& b : p.buffers)
        s.buffer[static_cast<std::size_t>(b.id)] = reinterpret_cast<std::byte*>(s.region.data()) + b.offset_bytes;
      if (s.capacity < p.events.size()) {  // quiescent between launches: a fresh array is safe
        s.capacity = p.events.size() * 2;
        s.counters = std::make_unique<Counter[]>(s.capacity);
      }
      s.base.resize(p.events.size());
      for (std::size_t e = 0; e < p.events.size(); ++e) s.base[e] = s.counters[e].value.load(std::memory_order_relaxed);
      s.send_token.assign(static_cast<std::size_t>(plan_.send_rows(r)), -1);
      for (std::int64_t a = r * T_ * K; a < (r + 1) * T_ * K; ++a)
        if (plan_.slot[a] >= 0) s.send_token[static_cast<std::size_t>(plan_.slot[a])] = static_cast<std::int32_t>(a / K - r * T_);
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
    return reinterpret_cast<U*>(ranks_[rank].buffer[static_cast<std::size_t>(id)]);
  }

  // Waits until the event reaches base + count: spins, then yields so that
  // an oversubscribed machine still makes progress; a watchdog turns a hang
  // into an error naming what waits for what.
  void wait(int r, int w, std::int32_t id, const Task& t) {
    const RankState& s = ranks_[r];
    const std::int64_t target = s.base[t.wait_event] + t.wait_count;
    const std::atomic<std::int64_t>& counter = s.counters[t.wait_event].value;
    if (counter.load(std::memory_order_acquire) >= target) return;
    const auto start = Clock::now();
    std::atomic<std::int32_t>& status = waiting_[static_cast<std::size_t>(r * opt_.workers_per_rank + w)];
    status.store(id, std::memory_order_relaxed);
    struct Clear {
      std::atomic<std::int32_t>& s;
      ~Clear() { s.store(-1, std::memory_order_relaxed); }
    } clear{status};
    for (std::uint64_t spins = 0;; ++spins) {
      if (counter.load(std::memory_order_acquire) >= target) return;
      if (spins < 256) {
        cpu_relax();
        continue;
      }
      std::this_thread::yield();
      if ((spins & 255) == 0) {
        if (abort_.load(std::memory_order_relaxed)) throw Aborted{};
        const double waited = seconds(start, Clock::now());
        if (waited > opt_.watchdog_seconds) {
          throw Error("watchdog: no progress for " + std::to_string(waited).substr(0, 5) + " s; waiting: " +
                      describe_waiters());
        }
      }
    }
  }

  // Every worker that is waiting now, with what it waits for.
  std::string describe_waiters() const {
    std::string text;
    for (std::int64_t r = 0; r < c_.ranks; ++r)
      for (int w = 0; w < opt_.workers_per_rank; ++w) {
        const std::int32_t id = waiting_[static_cast<std::size_t>(r * opt_.workers_per_rank + w)].load();
        if (id < 0) continue;
        const Task& t = programs[r].tasks[id];
        const auto& ev = programs[r].events[t.wait_event];
        const std::int64_t reached = ranks_[r].counters[t.wait_event].value.load() - ranks_[r].base[t.wait_event];
        text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " worker " + std::to_string(w) +
                " task #" + std::to_string(id) + " (" + taskflow::name(t.kind) + ") on event " +
                std::to_string(t.wait_event) + " (for " + taskflow::name(ev.consumer) +
                (ev.expert >= 0 ? ", expert " + std::to_string(ev.expert) : "") + ") at " + std::to_string(reached) +
                " of " + std::to_string(t.wait_count);
      }
    return text;
  }

  // A worker that stops because another failed: not an error of its own.
  struct Aborted {};

  // The first failure of a launch is kept; workers that stop because of it
  // leave quietly, so the error reported is the cause, not a consequence.
  void run_worker(const LayerInputs& in, StepResult& res, int r, int w) {
    const auto& p = programs[r];
    try {
      for (auto q = p.queue_begin[w]; q < p.queue_begin[w + 1]; ++q) {
        const std::int32_t id = p.queue_tasks[q];
        const Task& t = p.tasks[id];
        if (t.wait_event >= 0) wait(r, w, id, t);
        execute(in, res, r, t);
        if (t.trigger_event >= 0) ranks_[t.peer].counters[t.trigger_event].value.fetch_add(1, std::memory_order_release);
      }
    } catch (const Aborted&) {
      return;
    } catch (...) {
      if (!abort_.exchange(true)) {
        std::lock_guard lock(failure_mutex_);
        failure_ = std::current_exception();
      }
    }
  }

  void execute(const LayerInputs& in, StepResult& res, int r, const Task& t) {
    const std::int64_t H = c_.hidden, I = c_.expert_inter, Is = c_.shared_inter_total(), K = c_.top_k,
                       T_ = c_.tokens_per_rank;
    const std::int64_t r0 = t.row_begin, rows = t.rows;
    switch (t.kind) {
      case TaskKind::dispatch_put: {  // gather by slot, put into the owner's receive rows
        T* dst = buf<T>(t.peer, BufferId::recv) + r0 * H;
        const T* x = tokens_of(in, r);
        const auto& tokens = ranks_[r].send_token;
        for (std::int64_t j = 0; j < rows; ++j)
          copy_elements(dst + j * H, x + std::int64_t{tokens[static_cast<std::size_t>(t.src_row + j)]} * H, H);
        break;
      }
      case TaskKind::gemm_gate_up:
        kernels::gemm_tile<T>(buf<T>(r, BufferId::recv) + r0 * H, H, w1_[t.expert].view(), t.col_begin,
                              buf<float>(r, BufferId::h1) + r0 * 2 * I + t.col_begin, 2 * I, rows, t.cols, H, false);
        break;
      case TaskKind::swiglu:
        for (std::int64_t row = r0; row < r0 + rows; ++row)
          kernels::swiglu_forward<T>(buf<float>(r, BufferId::h1) + row * 2 * I, I, buf<T>(r, BufferId::a) + row * I);
        break;
      case TaskKind::gemm_down:
        tile_to<T>(buf<T>(r, BufferId::a) + r0 * I, I, w2_[t.expert].view(), t.col_begin,
                   buf<T>(r, BufferId::y) + r0 * H + t.col_begin, H, rows, t.cols, I);
        break;
      case TaskKind::combine_put:
        copy_elements(buf<T>(t.peer, BufferId::comb) + r0 * H, buf<T>(r, BufferId::y) + t.src_row * H, rows * H);
        break;
      case TaskKind::combine_reduce: {
        const T* comb = buf<T>(r, BufferId::comb);
        for (std::int64_t tok = r0; tok < r0 + rows; ++tok) {
          float* out = res.out.row(r * T_ + tok);
          std::fill(out, out + H, 0.0f);
          for (std::int64_t k = 0; k < K; ++k) {
            const std::int64_t a = (r * T_ + tok) * K + k, slot = plan_.slot[a];
            if (slot >= 0) kernels::axpy<T>(res.routing.weight[a], comb + slot * H, out, H);
          }
          if (c_.shared_experts > 0) kernels::axpy<float>(1.0f, buf<float>(r, BufferId::sh_y) + tok * H, out, H);
        }
        break;
      }
      case TaskKind::shared_gate_up:
        kernels::gemm_tile<T>(tokens_of(in, r) + r0 * H, H, sw1_.view(), t.col_begin,
                              buf<float>(r, BufferId::sh_h) + r0 * 2 * Is + t.col_begin, 2 * Is, rows, t.cols, H, false);
        break;
      case TaskKind::shared_swiglu:
        for (std::int64_t row = r0; row < r0 + rows; ++row)
          kernels::swiglu_forward<T>(buf<float>(r, BufferId::sh_h) + row * 2 * Is, Is, buf<T>(r, BufferId::sh_a) + row * Is);
        break;
      case TaskKind::shared_down:
        kernels::gemm_tile<T>(buf<T>(r, BufferId::sh_a) + r0 * Is, Is, sw2_.view(), t.col_begin,
                              buf<float>(r, BufferId::sh_y) + r0 * H + t.col_begin, H, rows, t.cols, Is, false);
        break;
      default:
        throw Error(std::string("the interleaved runtime cannot run a ") + taskflow::name(t.kind) +
                    " task: it runs forward programs only so far");
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
  WorkerPool pool_;
  taskflow::Machine machine_;
  std::vector<Operand<T>> w1_, w2_;
  Operand<float> router_;
  Operand<T> sw1_, sw2_;
  std::vector<float> logits_;
  Plan plan_;
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

const std::vector<taskflow::Program>& InterleavedExecutor::programs() const { return impl_->programs; }

}  // namespace hpmoe
