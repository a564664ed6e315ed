#include <array>
#include <cstdio>
#include <atomic>
#include <csignal>
#include <exception>
#include <map>
#include <mutex>
#include <new>
#include <cstring>
#include <optional>
#include <chrono>
#include <thread>
#include <type_traits>

#include "runtime/executor_parts.hpp"
#include "compiler/layout.hpp"
#include "comm/event_wait.hpp"
#include "compiler/access.hpp"
#include "hpmoe/error.hpp"
#include "runtime/interleaved.hpp"
#include "runtime/worker_pool.hpp"


namespace hpmoe {

using namespace detail;
using taskflow::BufferId;
using taskflow::Task;
using taskflow::TaskKind;
using Clock = std::chrono::steady_clock;

struct InterleavedExecutor::Impl {
  virtual ~Impl() = default;
  virtual void forward(MatrixView x, std::span<const std::int32_t> forced, StepResult&) = 0;
  virtual void backward(MatrixView d_out, StepResult&) = 0;
  virtual void weights_changed(std::shared_ptr<const PackedWeights> packed) = 0;
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
        table_(opt.access_table ? opt.access_table : &taskflow::AccessTable::standard()),
        tr_(opt.transport ? opt.transport : make_inprocess_transport(static_cast<int>(c.ranks))),
        local_(hosted_ranks(*tr_, c.ranks)),
        lc_(hosted_config(c, local_)),
        pool_(static_cast<int>(local_.size()), opt.workers_per_rank, opt.pin, tr_->node_index() * opt.workers_per_rank),
        packed_((kernels::init(), resolve_packing<T>(c, w, opt.packed, opt.backward))) {
    machine_ = taskflow::cpu_machine(opt.workers_per_rank);
    machine_.tile_rows = kernels::token_tile_rows<T>();
    machine_.weight_tile_rows = kernels::weight_tile_rows<T>();
    machine_.weight_tile_cols = kernels::kWeightTileCols;
    machine_.tile_cols = kTileCols;
    programs.resize(static_cast<std::size_t>(c.ranks));
    backward_programs.resize(static_cast<std::size_t>(c.ranks));
    ranks_.resize(static_cast<std::size_t>(c.ranks));
    const auto workers = local_.size() * static_cast<std::size_t>(opt.workers_per_rank);
    waiting_ = std::make_unique<std::atomic<std::int32_t>[]>(workers);
    for (std::size_t i = 0; i < workers; ++i) waiting_[i].store(-1);
    staging_.resize(workers);
    index_of_.assign(static_cast<std::size_t>(c.ranks), -1);
    for (int r = 0; r < c.ranks; ++r) all_ranks_.push_back(r);
    for (std::size_t i = 0; i < local_.size(); ++i) {
      index_of_[static_cast<std::size_t>(local_[i])] = static_cast<int>(i);
      for (const std::int32_t e : placement_.experts_of(local_[i])) {
        if (!packed_->holds(e) && !placement_.is_split(e))  // a split expert's parts are packed below
          throw Error("rank " + std::to_string(local_[i]) + " owns expert " + std::to_string(e) +
                      " but this process holds no weights for it: give every process its own experts' weights");
        if (placement_.owner(e) == local_[i]) owned_.push_back(e);  // replicas: the owner holds the gradient
      }
    }
    if (sharded() && local_.size() != 1)
      throw Error("a transport that spreads ranks over processes must host one rank per process (this one hosts " +
                  std::to_string(local_.size()) + ")");
    placement_.check_fits(c.routed_experts, c.ranks, c.expert_inter);
    if (placement_.has_splits()) pack_split_parts(opt.backward);
    fingerprint_ = layer_fingerprint(c, placement_, w);
    tr_->watch_workers(&activity_);
  }
  ~Interleaved() override { tr_->watch_workers(nullptr); }

  // The batch is a call's, not the layer's: x's rows are the hosted ranks'
  // tokens, T per rank. Everything sized by T (routing, exchange, buffers,
  // programs) is derived per step from c_ and lc_; the fingerprint carries
  // T so that ranks of a sharded run that disagree stop at the count exchange.
  void set_tokens(const MatrixView& x) {
    const auto hosted = static_cast<std::int64_t>(local_.size());
    if (x.rows <= 0 || x.rows % hosted != 0)
      throw Error("input x has " + std::to_string(x.rows) + " rows, which the " + std::to_string(hosted) +
                  " ranks of this process cannot share evenly (give a positive multiple of " + std::to_string(hosted) +
                  " tokens)");
    const std::int64_t tokens = x.rows / hosted;
    if (tokens == c_.tokens_per_rank) return;
    LayerConfig next = c_;
    next.tokens_per_rank = tokens;
    next.validate();
    c_ = next;
    lc_.tokens_per_rank = tokens;
    fingerprint_ = layer_fingerprint(c_, placement_, w_);
  }

 public:
  // The caller changed the weights in place: the packing (shared, updated by
  // the caller) is re-read, a split expert's parts are packed again and the
  // fingerprint covers the new replicated weights.
  void weights_changed(std::shared_ptr<const PackedWeights> packed) override {
    forward_done_ = nullptr;  // a forward before the change has no backward after it
    if (packed) packed_ = resolve_packing<T>(c_, w_, packed, opt_.backward);
    if (placement_.has_splits()) pack_split_parts(opt_.backward);
    fingerprint_ = layer_fingerprint(c_, placement_, w_);
  }

 private:
  // A split expert's part as its own smaller expert: W1's gate and up
  // columns of the part side by side ([H, 2 Ip]) and W2's rows of the part
  // ([Ip, H]), packed for the tile kernels like a whole expert's.
  struct PartWeights {
    Operand<T> w1, w2, w1_t, w2_t;
  };
  void pack_split_parts(bool backward) {
    std::vector<std::int64_t> jobs;
    for (const int r : local_)
      for (const std::int64_t i : placement_.instances_of(r))
        if (placement_.is_split(placement_.instance_expert(i))) jobs.push_back(i);
    part_packed_.assign(static_cast<std::size_t>(placement_.instances()), PartWeights{});
    if (std::all_of(jobs.begin(), jobs.end(), [&](std::int64_t i) { return holds_expert(w_, placement_.instance_expert(i)); })) {
      on_all_cores(jobs.size(), [&](std::size_t j) { pack_part(jobs[j], w_, backward); });
      return;
    }
    // Sharded: each part's expert fetched in turn, packed, and released.
    if (!opt_.expert_source)
      throw Error("this process computes parts of split experts whose weights it was not given: pass their weights or an "
                  "expert source");
    LayerWeights fetched;
    fetched.w1.resize(static_cast<std::size_t>(c_.routed_experts));
    fetched.w2.resize(static_cast<std::size_t>(c_.routed_experts));
    for (const std::int64_t i : jobs) {
      const auto e = static_cast<std::size_t>(placement_.instance_expert(i));
      const bool here = holds_expert(w_, static_cast<std::int64_t>(e));
      if (!here) opt_.expert_source(static_cast<std::int64_t>(e), fetched);
      pack_part(i, here ? w_ : fetched, backward);
      fetched.w1[e] = Matrix();
      fetched.w2[e] = Matrix();
    }
  }
  void pack_part(std::int64_t i, const LayerWeights& w, bool backward) {
    const std::int64_t H = c_.hidden, I = c_.expert_inter, e = placement_.instance_expert(i);
    {
      const auto [c0, c1] = placement_.part_columns(i, I);
      const std::int64_t Ip = c1 - c0;
      const Matrix& w1 = w.w1[static_cast<std::size_t>(e)];
      const Matrix& w2 = w.w2[static_cast<std::size_t>(e)];
      if (w1.rows != H || w1.cols != 2 * I || w2.rows != I || w2.cols != H)
        throw Error("split expert " + std::to_string(e) + "'s weights are not [hidden, 2 expert_inter] and [expert_inter, hidden]");
      Matrix p1(H, 2 * Ip), p2(Ip, H);
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t k = 0; k < Ip; ++k) {
          p1.data[static_cast<std::size_t>(h * 2 * Ip + k)] = w1.data[static_cast<std::size_t>(h * 2 * I + c0 + k)];
          p1.data[static_cast<std::size_t>(h * 2 * Ip + Ip + k)] = w1.data[static_cast<std::size_t>(h * 2 * I + I + c0 + k)];
        }
      std::copy_n(w2.data.begin() + c0 * H, Ip * H, p2.data.begin());
      PartWeights& pw = part_packed_[static_cast<std::size_t>(i)];
      pw.w1 = operand_of<T>(p1);
      pw.w2 = operand_of<T>(p2);
      if (backward) {
        pw.w1_t = transposed_operand_of<T>(p1);
        pw.w2_t = transposed_operand_of<T>(p2);
      }
    }
  }
  // The packed weights rank r computes expert e with: its part's, if split.
  const PartWeights* part_of(int r, std::int32_t e) const {
    if (!placement_.is_split(e)) return nullptr;
    return &part_packed_[static_cast<std::size_t>(placement_.instance_on(e, r))];
  }
  RhsView<T> w1_of(int r, std::int32_t e) const { const auto* pw = part_of(r, e); return (pw ? pw->w1 : packed_->w1[e]).view(); }
  RhsView<T> w2_of(int r, std::int32_t e) const { const auto* pw = part_of(r, e); return (pw ? pw->w2 : packed_->w2[e]).view(); }
  RhsView<T> w1_t_of(int r, std::int32_t e) const { const auto* pw = part_of(r, e); return (pw ? pw->w1_t : packed_->w1_t[e]).view(); }
  RhsView<T> w2_t_of(int r, std::int32_t e) const { const auto* pw = part_of(r, e); return (pw ? pw->w2_t : packed_->w2_t[e]).view(); }
  Interleaved(const Interleaved&) = delete;
  Interleaved& operator=(const Interleaved&) = delete;

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

  // The layer as this process sees it: only its hosted ranks' tokens.
  static LayerConfig hosted_config(const LayerConfig& c, const std::vector<int>& local) {
    LayerConfig lc = c;
    lc.ranks = static_cast<std::int64_t>(local.size());
    return lc;
  }
  // Ranks spread over processes: this one holds only its own rank's tokens,
  // routing and experts.
  bool sharded() const { return local_.size() != static_cast<std::size_t>(c_.ranks); }

  void forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& res) override {
    set_tokens(x);
    check_token_view(lc_, x, "input x");
    x_ = x;
    forward_done_ = nullptr;
    res.forward_ops.clear();
    res.backward_ops.clear();
    res.trace.clear();
    step_start_ = Clock::now();
    check_output_view(res.out_into, "output view");
    if (res.out_into) res.out = Matrix();
    else if (res.out.rows != lc_.total_tokens() || res.out.cols != c_.hidden) res.out = Matrix(lc_.total_tokens(), c_.hidden);
    auto t0 = Clock::now();
    res.routing = run_router(pool_, lc_, packed_->router.view(), x_, w_.expert_bias, forced, logits_);
    auto t1 = Clock::now();
    res.forward_ops.push_back({"router", seconds(t0, t1)});
    res.router_seconds = seconds(t0, t1);
    exchange_counts(res);
    const auto t1x = Clock::now();
    if (sharded()) res.forward_ops.push_back({"count_exchange", seconds(t1, t1x)});
    t1 = t1x;
    ex_.emplace(c_, placement_, counts_, machine_.tile_rows);
    slot_ = taskflow::send_slots(c_, *ex_, res.routing, local_);
    for (const int r : compiled_ranks()) {
      taskflow::generate(programs[r], c_, *ex_, machine_, taskflow::Pass::forward, r);
      taskflow::schedule(programs[r], opt_.policy, schedule_scratch_);
    }
    if (opt_.after_compile) opt_.after_compile(programs);
    auto t2 = Clock::now();
    res.forward_ops.push_back({"compile", seconds(t1, t2)});
    if (opt_.verify_programs) {
      const auto report = verify(programs);
      if (!report.ok) throw Error("the compiled program failed verification: " + report.error);
    }
    auto t3 = Clock::now();
    res.forward_ops.push_back({"verify", seconds(t2, t3)});
    res_ = &res;
    prepare_forward(res);
    res.forward_ops.push_back({"prepare", seconds(t3, Clock::now())});
    res.dispatch_to_combine_seconds = launch(programs, res);
    if (!opt_.phased) res.forward_ops.push_back({"launch", res.dispatch_to_combine_seconds});
    forward_done_ = &res;
  }

  void backward(MatrixView d_out, StepResult& res) override {
    if (!opt_.backward)
      throw Error("backward: this executor was made for forward only; construct it with the backward option");
    if (forward_done_ != &res)
      throw Error("backward: call forward first, with the same result object (it holds the step's routing)");
    check_token_view(lc_, d_out, "output gradient d_out");
    d_out_ = d_out;
    res.backward_ops.clear();
    auto b0 = Clock::now();
    for (const int r : compiled_ranks()) {
      taskflow::generate(backward_programs[r], c_, *ex_, machine_, taskflow::Pass::backward, r);
      taskflow::schedule(backward_programs[r], opt_.policy, schedule_scratch_);
    }
    auto b1 = Clock::now();
    res.backward_ops.push_back({"compile", seconds(b0, b1)});
    if (opt_.verify_programs) {
      const auto report = verify(backward_programs);
      if (!report.ok) throw Error("the compiled backward program failed verification: " + report.error);
    }
    auto b2 = Clock::now();
    res.backward_ops.push_back({"verify", seconds(b1, b2)});
    check_output_view(res.dx_into, "dx view");
    if (!gradients_fit(res.grads)) res.grads = zero_gradients(c_, owned_, lc_.total_tokens());
    if (res.dx_into) res.grads.x = Matrix();
    else if (res.grads.x.rows != lc_.total_tokens()) res.grads.x = Matrix(lc_.total_tokens(), c_.hidden);
    prepare_backward(res);
    res.backward_ops.push_back({"prepare", seconds(b2, Clock::now())});
    res.backward_seconds = launch(backward_programs, res);
    if (!opt_.phased) res.backward_ops.push_back({"launch", res.backward_seconds});
    const auto r0 = Clock::now();
    reduce_replicated(res);
    reduce_replica_gradients(res);
    assemble_split_gradients(res);
    res.backward_ops.push_back({"reduce_replicated_grads", seconds(r0, Clock::now())});
    forward_done_ = nullptr;  // one backward per forward
  }

 private:
  // One launch: all workers of all ranks run their queues of `set` at once.
  double launch(std::vector<taskflow::Program>& set, StepResult& res) {
    current_ = &set;
    // Phased: one barrier counter per operator after the program's events.
    const auto& order = taskflow::operator_order(pass_of(set));
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
      const auto& p = set[r];
      Counter* counters = tr_->counters(r);
      s.base_count.resize(p.events.size() + barriers);
      for (std::size_t e = 0; e < s.base_count.size(); ++e) s.base_count[e] = counters[e].value.load(std::memory_order_relaxed);
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
    activity_.set_workers(static_cast<int>(local_.size()) * opt_.workers_per_rank);
    tr_->launch_begin();  // every process has armed its counters
    if (opt_.fault.kind == RuntimeFault::freeze_process && tr_->hosts(opt_.fault.rank)) std::raise(SIGSTOP);
    if (opt_.phased) phase_end_.assign(busy_.size() * order.size(), 0.0);
    const auto start = launch_start_ = Clock::now();
    pool_.run([&](int index, int w) { run_worker(index, w); });
    if (!failure_) tr_->launch_end();
    if (failure_) std::rethrow_exception(failure_);
    const double elapsed = seconds(start, Clock::now());
    if (opt_.phased) {  // each operator: from the previous barrier to its own, as this process's workers passed them
      auto& ops = pass_of(set) == taskflow::Pass::forward ? res.forward_ops : res.backward_ops;
      // Operators no rank has tasks of (the shared experts' without them) are not listed.
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
    std::vector<float> busy(static_cast<std::size_t>(c_.ranks), 0.0f);
    for (std::size_t i = 0; i < busy_.size(); ++i)
      busy[static_cast<std::size_t>(local_[i / static_cast<std::size_t>(opt_.workers_per_rank)])] += static_cast<float>(busy_[i]);
    for (int q = 0; q < c_.ranks; ++q) tr_->gather(std::span<float>(busy).subspan(static_cast<std::size_t>(q), 1), q);
    double& total = pass_of(set) == taskflow::Pass::forward ? res.forward_busy_seconds : res.backward_busy_seconds;
    total = 0;
    for (float b : busy) total += b;
    if (opt_.trace) {
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
    return elapsed;
  }

  // A caller's output view: the hosted ranks' tokens.
  void check_output_view(const MutableMatrixView& v, const char* what) const {
    if (!v) return;
    check_token_view(lc_, MatrixView{v.data, v.rows, v.cols, v.ld}, what);
  }

  // The ranks whose programs this step compiles: the hosted ones, and all
  // of them where the verifier checks the whole set (it needs every program).
  // The pass of a set of programs, from a hosted rank's (sharded, the other
  // ranks' programs are not compiled here).
  taskflow::Pass pass_of(const std::vector<taskflow::Program>& set) const {
    return set[static_cast<std::size_t>(local_.front())].pass;
  }
  const std::vector<int>& compiled_ranks() const { return !sharded() || whole_set_verified() ? all_ranks_ : local_; }
  bool whole_set_verified() const { return opt_.verify_programs && (!sharded() || opt_.verify_all_ranks); }

  // In process, the whole set at once; sharded, each hosted rank's own
  // program against the interface of the exchanged counts (or, as an audit,
  // every rank's program regenerated here).
  taskflow::VerifyReport verify(const std::vector<taskflow::Program>& set) {
    if (whole_set_verified()) return verifier_.verify(set);
    for (const int r : local_) {
      auto report = verifier_.verify_rank(set[static_cast<std::size_t>(r)], c_, *ex_, machine_);
      if (!report.ok) return report;
    }
    return {};
  }

  // Events of rank r's program for a pass, from the exchange layout alone
  // (a peer's program need not be compiled here).
  std::int64_t event_count(taskflow::Pass pass, std::int64_t r) const {
    return taskflow::EventBases(pass, ex_->row_tiles(r), placement_.local_count(r),
                                (c_.tokens_per_rank + machine_.tile_rows - 1) / machine_.tile_rows)
        .total;
  }

  // Whether res.grads already has this process's shapes (reused across steps).
  bool gradients_fit(const LayerGradients& g) const {
    if (g.w1.size() != static_cast<std::size_t>(c_.routed_experts) || g.w2.size() != g.w1.size()) return false;
    for (const std::int32_t e : owned_)
      if (g.w1[e].rows != c_.hidden || g.w2[e].rows != c_.expert_inter) return false;
    return g.router.rows == c_.hidden && g.router.cols == c_.routed_experts;
  }

  // The P x E counts of the step: this process's rows from its routing, the
  // others' from every process (with the layer's fingerprint, which must
  // match everywhere), and the balancing losses summed over ranks in order.
  void exchange_counts(StepResult& res) {
    const std::int64_t P = c_.ranks, E = c_.routed_experts;
    const auto local = taskflow::routing_counts(lc_, res.routing);  // [hosted ranks, E]
    counts_.ranks = P;
    counts_.experts = E;
    if (!sharded()) {
      counts_.counts = local.counts;
      res.expert_counts = counts_.counts;
      return;
    }
    // One block per rank: fingerprint, aux-loss term, z-loss term, E counts.
    const std::int64_t width = 3 + E;
    const int me = local_.front();
    count_block_.assign(static_cast<std::size_t>(P * width), 0);
    std::uint64_t* mine = count_block_.data() + me * width;
    mine[0] = fingerprint_;
    std::memcpy(&mine[1], &res.routing.aux_loss, sizeof(double));
    std::memcpy(&mine[2], &res.routing.z_loss, sizeof(double));
    for (std::int64_t e = 0; e < E; ++e) mine[3 + e] = static_cast<std::uint64_t>(local.counts[static_cast<std::size_t>(e)]);
    tr_->allgather(std::as_writable_bytes(std::span<std::uint64_t>(count_block_)), static_cast<std::size_t>(width) * 8);
    counts_.counts.assign(static_cast<std::size_t>(P * E), 0);
    double aux = 0, z = 0;
    const std::int64_t limit = c_.tokens_per_rank * c_.top_k;
    for (std::int64_t q = 0; q < P; ++q) {
      const std::uint64_t* block = count_block_.data() + q * width;
      if (block[0] != fingerprint_)
        throw Error("rank " + std::to_string(q) + " runs a different layer, placement or checkpoint than rank " +
                    std::to_string(me) + " (fingerprint " + hex(block[0]) + " vs " + hex(fingerprint_) +
                    "): start every rank with the same configuration, --placement and --load");
      double term = 0;
      std::memcpy(&term, &block[1], sizeof(double));
      aux += term;
      std::memcpy(&term, &block[2], sizeof(double));
      z += term;
      std::int64_t sum = 0;
      for (std::int64_t e = 0; e < E; ++e) {
        const auto n = static_cast<std::int64_t>(block[3 + e]);
        if (n < 0 || n > limit) throw Error("rank " + std::to_string(q) + " reports " + std::to_string(n) + " rows for expert " + std::to_string(e) + ", more than its " + std::to_string(limit) + " assignments");
        sum += n;
        counts_.counts[static_cast<std::size_t>(q * E + e)] = n;
      }
      if (sum > limit) throw Error("rank " + std::to_string(q) + " reports " + std::to_string(sum) + " kept assignments, more than its " + std::to_string(limit));
    }
    res.routing.aux_loss = aux;
    res.routing.z_loss = z;
    res.expert_counts = counts_.counts;
  }

  static std::string hex(std::uint64_t v) {
    char text[19];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
    return text;
  }

  // Sum over ranks, in rank order, of the replicated weights' gradients,
  // on every process. Each rank's part is its backward program's local
  // buffer; over MPI the ranks pass the partial sum along in rank order.
  // A replica's partial gradient of expert e on rank r (W1 or W2 shaped).
  std::vector<float>& replica_partial(int r, std::int32_t e, bool w1) {
    auto& part = (w1 ? replica_w1_ : replica_w2_)[{r, e}];
    part.resize(static_cast<std::size_t>(w1 ? c_.hidden * 2 * c_.expert_inter : c_.expert_inter * c_.hidden));
    return part;
  }

  // Replicated experts: each home computed the gradient of the rows it
  // received; the expert's gradient is their sum in home order (ranks
  // ascending), from +0, on its owner. Over MPI the same sum runs through
  // every rank in rank order (ranks without the expert add zeros, which
  // leaves every partial sum bit for bit as it is).
  void reduce_replica_gradients(StepResult& res) {
    for (std::int64_t e = 0; e < c_.routed_experts; ++e) {
      if (placement_.home_count(e) < 2 || placement_.is_split(e)) continue;
      for (const bool w1 : {true, false}) {
        const auto n = static_cast<std::size_t>(c_.hidden * c_.expert_inter * (w1 ? 2 : 1));
        const int owner = placement_.owner(e);
        const auto contribution = [&](int r) -> const float* {
          if (placement_.instance_on(e, r) < 0) return nullptr;
          if (r == owner) return (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.data();
          return replica_partial(r, static_cast<std::int32_t>(e), w1).data();
        };
        if (sharded()) {
          const int me = local_.front();
          reduce_scratch_.assign(n, 0.0f);
          if (const float* mine = contribution(me)) std::copy_n(mine, n, reduce_scratch_.begin());
          tr_->sum_in_rank_order(std::span<float>(reduce_scratch_));
          if (me == owner) std::copy_n(reduce_scratch_.begin(), n, (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.begin());
          continue;
        }
        float* dst = (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.data();
        for (std::size_t i = 0; i < n; ++i) {
          float sum = 0;
          for (std::int64_t j = 0; j < placement_.home_count(e); ++j)
            sum += contribution(placement_.instance_rank(placement_.first_instance(e) + j))[i];
          dst[i] = sum;
        }
      }
    }
  }

  // Split experts: each part computed the gradient of its own columns
  // (W1's gate and up columns side by side, W2's rows), complete. The
  // expert's gradient, on its owner (part 0's rank), is the sum in rank
  // order from +0 of every rank's columns, zeros elsewhere: over MPI
  // through every rank (sum_in_rank_order), in process the same sum, so the
  // bits agree (each element has one non-zero term; +0 + v is v, but +0 for
  // v = -0).
  void assemble_split_gradients(StepResult& res) {
    const std::int64_t H = c_.hidden, I = c_.expert_inter;
    // Rank r's part of expert e written into a whole [H, 2I] and [I, H] pair.
    const auto scatter = [&](int r, std::int64_t e, float* dw1, float* dw2) {
      const std::int64_t i = placement_.instance_on(e, r);
      if (i < 0) return;
      const auto [c0, c1] = placement_.part_columns(i, I);
      const std::int64_t Ip = c1 - c0;
      const float* p1 = replica_partial(r, static_cast<std::int32_t>(e), true).data();
      const float* p2 = replica_partial(r, static_cast<std::int32_t>(e), false).data();
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t k = 0; k < Ip; ++k) {
          dw1[h * 2 * I + c0 + k] = 0.0f + p1[h * 2 * I + k];
          dw1[h * 2 * I + I + c0 + k] = 0.0f + p1[h * 2 * I + Ip + k];
        }
      for (std::int64_t k = 0; k < Ip * H; ++k) dw2[c0 * H + k] = 0.0f + p2[k];
    };
    for (const auto& sp : placement_.splits()) {
      const auto e = static_cast<std::size_t>(sp.expert);
      if (!sharded()) {
        for (std::int64_t j = 0; j < placement_.home_count(sp.expert); ++j)
          scatter(placement_.instance_rank(placement_.first_instance(sp.expert) + j), sp.expert, res.grads.w1[e].data.data(),
                  res.grads.w2[e].data.data());
        continue;
      }
      const auto n1 = static_cast<std::size_t>(H * 2 * I), n2 = static_cast<std::size_t>(I * H);
      reduce_scratch_.assign(n1 + n2, 0.0f);
      const int me = local_.front();
      scatter(me, sp.expert, reduce_scratch_.data(), reduce_scratch_.data() + n1);
      tr_->sum_in_rank_order(std::span<float>(reduce_scratch_));
      if (me == placement_.owner(sp.expert)) {
        std::copy_n(reduce_scratch_.begin(), n1, res.grads.w1[e].data.begin());
        std::copy_n(reduce_scratch_.begin() + static_cast<std::ptrdiff_t>(n1), n2, res.grads.w2[e].data.begin());
      }
    }
  }

  void reduce_replicated(StepResult& res) {
    auto reduce = [&](std::vector<float>& dst, BufferId part) {
      const auto n = dst.size();
      if (sharded()) {
        std::copy_n(base<float>(local_.front(), part), n, dst.begin());
        tr_->sum_in_rank_order(std::span<float>(dst));
        return;
      }
      for (std::size_t i = 0; i < n; ++i) {
        float sum = 0;
        for (std::int64_t q = 0; q < c_.ranks; ++q) sum += base<float>(q, part)[i];
        dst[i] = sum;
      }
    };
    reduce(res.grads.router.data, BufferId::dwg);
    if (c_.shared_experts > 0) {
      reduce(res.grads.shared_w1.data, BufferId::dws1);
      reduce(res.grads.shared_w2.data, BufferId::dws2);
    }
  }

  // 64-byte aligned bytes that keep their contents when grown.
  struct AlignedBytes {
    struct Free {
      void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
    };
    std::unique_ptr<std::byte[], Free> data;
    std::int64_t size = 0;
    void reserve(std::int64_t n) {
      if (n <= size) return;
      std::unique_ptr<std::byte[], Free> grown(new (std::align_val_t{64}) std::byte[static_cast<std::size_t>(n)]());
      if (size > 0) std::memcpy(grown.get(), data.get(), static_cast<std::size_t>(size));
      data = std::move(grown);
      size = n;
    }
  };

  struct RankState {
    // The rank's symmetric segment (where this process can address it), its
    // local region and its event counters.
    std::byte* segment = nullptr;
    AlignedBytes local;
    Counter* counters = nullptr;
    // Hosted ranks: the first byte of every buffer the current launch's
    // program declares (bound ones point into the caller's tensors), and for
    // the per-slot weight gradients each slot's expert's gradient.
    std::array<std::byte*, static_cast<std::size_t>(BufferId::count)> base{};
    std::array<const taskflow::BufferLayout*, static_cast<std::size_t>(BufferId::count)> layout{};
    std::array<std::int64_t, static_cast<std::size_t>(BufferId::count)> ld{};
    std::vector<std::byte*> dw1_slots, dw2_slots;
    std::vector<std::int64_t> base_count;                // counter values when the launch began (hosted ranks)
    std::vector<std::int32_t> phase_begin, phase_tasks;  // phased: task ids by operator
  };

  // Reserves every rank's symmetric segment (the same on every process) and
  // each hosted rank's local region for this step's programs, forward and,
  // when it runs, backward (whose layout extends the forward's).
  // Every rank's buffers are sized for its own rows (a put addresses the
  // peer's copy by the peer's layout, computed here from the exchange).
  void reserve_memory(StepResult& res) {
    std::vector<std::int64_t> bytes(static_cast<std::size_t>(c_.ranks));
    for (auto* layouts : {&forward_layouts_, &backward_layouts_}) layouts->resize(static_cast<std::size_t>(c_.ranks));
    for (auto* index : {&forward_peer_, &backward_peer_}) index->assign(static_cast<std::size_t>(c_.ranks), {});
    // Each rank's buffers by id, so a put finds its target's layout without a search.
    auto index_of = [](const taskflow::Program& p, PeerBuffers& by_id) {
      for (const auto& b : p.buffers) by_id[static_cast<std::size_t>(b.id)] = &b;
    };
    for (std::int64_t r = 0; r < c_.ranks; ++r) {
      taskflow::Program& forward = forward_layouts_[static_cast<std::size_t>(r)];
      taskflow::declare_buffers(forward, c_, *ex_, taskflow::Pass::forward, r);
      std::int64_t symmetric = forward.region_bytes(taskflow::Region::symmetric);
      std::int64_t local = forward.region_bytes(taskflow::Region::local);
      index_of(forward, forward_peer_[static_cast<std::size_t>(r)]);
      if (opt_.backward) {
        taskflow::Program& backward = backward_layouts_[static_cast<std::size_t>(r)];
        taskflow::declare_buffers(backward, c_, *ex_, taskflow::Pass::backward, r);
        index_of(backward, backward_peer_[static_cast<std::size_t>(r)]);
        symmetric = std::max(symmetric, backward.region_bytes(taskflow::Region::symmetric));
        local = std::max(local, backward.region_bytes(taskflow::Region::local));
      }
      bytes[static_cast<std::size_t>(r)] = symmetric;
      if (tr_->hosts(static_cast<int>(r))) ranks_[r].local.reserve(local);
      if (r == local_.front()) {
        res.segment_bytes = symmetric;
        res.local_bytes = local;
      }
    }
    tr_->reserve_segments(bytes);
    for (std::int64_t r = 0; r < c_.ranks; ++r) ranks_[r].segment = tr_->segment(static_cast<int>(r));
  }

  // Points every buffer of hosted rank r's program at its memory.
  void bind(const taskflow::Program& p, int r, StepResult& res) {
    RankState& s = ranks_[r];
    const std::int64_t T_ = c_.tokens_per_rank;
    s.base.fill(nullptr);
    s.layout.fill(nullptr);
    for (const auto& b : p.buffers) {
      s.layout[static_cast<std::size_t>(b.id)] = &b;
      s.ld[static_cast<std::size_t>(b.id)] = b.cols;
    }
    auto bytes_of = [](const float* f) { return reinterpret_cast<std::byte*>(const_cast<float*>(f)); };
    // Rank r's rows of a caller's tensor of the hosted ranks' tokens, with its row stride.
    const std::int64_t i = index_of_[static_cast<std::size_t>(r)];
    auto rows_of = [&](BufferId id, const float* first_row, std::int64_t ld) {
      s.ld[static_cast<std::size_t>(id)] = ld;
      return bytes_of(first_row + i * T_ * ld);
    };
    for (const auto& b : p.buffers) {
      std::byte*& at = s.base[static_cast<std::size_t>(b.id)];
      switch (b.region) {
        case taskflow::Region::symmetric: at = s.segment + b.offset_bytes; break;
        case taskflow::Region::local: at = s.local.data.get() + b.offset_bytes; break;
        case taskflow::Region::bound:
          switch (b.id) {
            case BufferId::xf: case BufferId::x: at = rows_of(b.id, x_.data, x_.ld); break;
            case BufferId::dout: at = rows_of(b.id, d_out_.data, d_out_.ld); break;
            case BufferId::out:
              at = res.out_into ? rows_of(b.id, res.out_into.data, res.out_into.ld) : rows_of(b.id, res.out.data.data(), c_.hidden);
              break;
            case BufferId::dx:
              at = res.dx_into ? rows_of(b.id, res.dx_into.data, res.dx_into.ld)
                               : rows_of(b.id, res.grads.x.data.data(), c_.hidden);
              break;
            case BufferId::logits: at = rows_of(b.id, logits_.data(), c_.routed_experts); break;
            case BufferId::dw1: case BufferId::dw2: {
              // The owner's instance writes the expert's gradient; a replica
              // its own partial, added to the owner's after the launch; a
              // split expert's part its columns, placed after the launch.
              const bool w1 = b.id == BufferId::dw1;
              auto& slots = w1 ? s.dw1_slots : s.dw2_slots;
              slots.clear();
              for (const std::int32_t e : p.local_experts)
                slots.push_back(placement_.owner(e) == r && !placement_.is_split(e)
                                    ? bytes_of((w1 ? res.grads.w1 : res.grads.w2)[e].data.data())
                                    : bytes_of(replica_partial(r, e, w1).data()));
              break;
            }
            default:
              throw Error(std::string("the runtime cannot bind buffer ") + taskflow::name(b.id) + " to caller memory");
          }
          break;
      }
    }
  }

  // The host's part of a forward launch: routing into the ranks' buffers,
  // and the tokens as T.
  void prepare_forward(StepResult& res) {
    const std::int64_t K = c_.top_k, T_ = c_.tokens_per_rank, H = c_.hidden;
    reserve_memory(res);
    for (const int r : local_) {
      const taskflow::Program& p = programs[r];
      const std::int64_t i = index_of_[static_cast<std::size_t>(r)];
      bind(p, r, res);
      auto* slot = base<std::int64_t>(r, BufferId::slot);
      auto* gate = base<float>(r, BufferId::gate);
      auto* send_token = base<std::int32_t>(r, BufferId::send_token);
      auto* send_assign = base<std::int64_t>(r, BufferId::send_assign);
      for (std::int64_t a = 0; a < T_ * K; ++a) {
        const std::int64_t global = i * T_ * K + a, row = slot_[static_cast<std::size_t>(global)];
        slot[a] = row;
        gate[a] = res.routing.weight[static_cast<std::size_t>(global)];
        if (row >= 0) {
          send_token[row] = static_cast<std::int32_t>(a / K);
          send_assign[row] = a;
          // A split expert's rows go to every part: the same token in each
          // part's block of the source's send order.
          const std::int32_t e = res.routing.expert[static_cast<std::size_t>(global)];
          if (placement_.is_split(e)) {
            const std::int64_t n = ex_->count(r, placement_.first_instance(e));
            for (std::int64_t part = 1; part < placement_.parts(e); ++part) {
              send_token[row + part * n] = static_cast<std::int32_t>(a / K);
              send_assign[row + part * n] = a;
            }
          }
        }
      }
      if constexpr (!std::is_same_v<T, float>)
        for (std::int64_t t = 0; t < T_; ++t) kernels::store<T>(x_.row(i * T_ + t), base<T>(r, BufferId::x) + t * H, H);
    }
  }

  void prepare_backward(StepResult& res) {
    const std::int64_t T_ = c_.tokens_per_rank, H = c_.hidden;
    for (const int r : local_) {
      const std::int64_t i = index_of_[static_cast<std::size_t>(r)];
      bind(backward_programs[r], r, res);
      if (c_.shared_experts > 0)
        for (std::int64_t t = 0; t < T_; ++t)
          kernels::store<T>(d_out_.row(i * T_ + t), base<T>(r, BufferId::sh_dout) + t * H, H);
    }
  }

  // The first element of a hosted rank's buffer.
  template <class U>
  U* base(std::int64_t rank, BufferId id) const {
    return reinterpret_cast<U*>(ranks_[static_cast<std::size_t>(rank)].base[static_cast<std::size_t>(id)]);
  }

  // The operands of one task, from the access table, checked against the
  // program's declared buffers before any kernel touches them.
  struct TaskOperands {
    taskflow::Operands ops;
    const taskflow::Rect& get(BufferId id, taskflow::Use use) const {
      for (const auto& o : ops)
        if (o.rect.buffer == id && (o.use == use || o.use == taskflow::Use::accumulate)) return o.rect;
      throw Error(std::string("the access table gives this task no ") + (use == taskflow::Use::read ? "read of " : "write of ") +
                  taskflow::name(id));
    }
    const taskflow::Rect& in(BufferId id) const { return get(id, taskflow::Use::read); }
    const taskflow::Rect& out(BufferId id) const { return get(id, taskflow::Use::write); }
  };
  TaskOperands operands_of(const taskflow::Program& p, const Task& t) const {
    TaskOperands o{table_->operands(p, t)};
    for (const auto& op : o.ops) {
      const taskflow::BufferLayout* l = op.rank == p.rank
                                            ? ranks_[static_cast<std::size_t>(p.rank)].layout[static_cast<std::size_t>(op.rect.buffer)]
                                            : peer_layout(op.rank, op.rect.buffer);
      const auto& r = op.rect;
      if (!l || r.r0 < 0 || r.c0 < 0 || r.r1 < r.r0 || r.c1 < r.c0 || r.r1 > l->rows || r.c1 > l->cols)
        throw Error("bounds: rank " + std::to_string(p.rank) + " task " + taskflow::name(t.kind) + " rows [" +
                    std::to_string(t.row_begin) + ", " + std::to_string(t.row_begin + t.rows) + ") " +
                    (op.use == taskflow::Use::read ? "reads " : "writes ") + taskflow::name(r.buffer) + " rows [" +
                    std::to_string(r.r0) + ", " + std::to_string(r.r1) + ") cols [" + std::to_string(r.c0) + ", " +
                    std::to_string(r.c1) + ") outside the declared " +
                    (l ? std::to_string(l->rows) + " x " + std::to_string(l->cols) : std::string("(undeclared)")) + " buffer");
    }
    return o;
  }
  // A kernel's extent must lie inside the declared rectangle it was given.
  static void need(const taskflow::Rect& r, std::int64_t rows, std::int64_t cols, const Task& t) {
    if (rows > r.rows() || cols > r.cols())
      throw Error(std::string("bounds: a ") + taskflow::name(t.kind) + " kernel touches " + std::to_string(rows) + " x " +
                  std::to_string(cols) + " of " + taskflow::name(r.buffer) + " but the table declares " +
                  std::to_string(r.rows()) + " x " + std::to_string(r.cols()));
  }

  // The declared layout of a buffer of the program being launched on its
  // (hosted) rank, bound at the launch.
  const taskflow::BufferLayout* layout_of(const taskflow::Program& p, BufferId id) const {
    return ranks_[static_cast<std::size_t>(p.rank)].layout[static_cast<std::size_t>(id)];
  }
  // The layout of rank q's buffer in the pass being launched, from the
  // exchange (q's program need not exist here): where a put to q lands.
  const taskflow::BufferLayout* peer_layout(std::int64_t q, BufferId id) const {
    const auto& index = pass_of(*current_) == taskflow::Pass::forward ? forward_peer_ : backward_peer_;
    return index[static_cast<std::size_t>(q)][static_cast<std::size_t>(id)];
  }

  // Element (r0, c0) of a rectangle of hosted rank r's buffer.
  template <class U>
  U* at(int r, const taskflow::Program& p, const taskflow::Rect& rect) const {
    const taskflow::BufferLayout& l = *layout_of(p, rect.buffer);
    if (rect.buffer == BufferId::dw1 || rect.buffer == BufferId::dw2) {  // per slot: the expert's gradient
      const std::int64_t height = rect.buffer == BufferId::dw1 ? c_.hidden : c_.expert_inter;
      const auto& slots = rect.buffer == BufferId::dw1 ? ranks_[r].dw1_slots : ranks_[r].dw2_slots;
      return reinterpret_cast<U*>(slots[static_cast<std::size_t>(rect.r0 / height)]) + (rect.r0 % height) * l.cols + rect.c0;
    }
    U* b = base<U>(r, rect.buffer);
    if (l.layout == taskflow::Layout::panels)  // rows of a panel are kPanelCols apart (bf16: in pairs)
      return b + (rect.c0 / kTileCols) * l.rows * kTileCols + rect.r0 * kTileCols + (rect.c0 % kTileCols) * pair<U>();
    return b + rect.r0 * ld_of(r, rect.buffer) + rect.c0;
  }
  // Elements between rows of a hosted rank's row-major buffer: its declared
  // width, or a bound view's stride.
  std::int64_t ld_of(int r, BufferId id) const { return ranks_[static_cast<std::size_t>(r)].ld[static_cast<std::size_t>(id)]; }
  template <class U>
  static constexpr std::int64_t pair() {
    return sizeof(U) == 2 ? 2 : 1;
  }
  // A panel-blocked buffer's rows [rect.r0, ...) as a kernel's right-hand operand.
  template <class U>
  RhsView<U> panels_from(int r, const taskflow::Program& p, const taskflow::Rect& rect) const {
    const taskflow::BufferLayout& l = *layout_of(p, rect.buffer);
    return RhsView<U>{base<U>(r, rect.buffer) + rect.r0 * kTileCols, kTileCols, l.rows * kTileCols};
  }

  // Where a put's rows go: straight into the peer's segment when this
  // process can address it, else into the worker's staging buffer, which
  // send_put hands to the transport.
  T* put_target(const Task& t, const taskflow::Rect& rect, std::size_t worker) {
    const taskflow::BufferLayout& l = *peer_layout(t.peer, rect.buffer);
    if (std::byte* peer = ranks_[t.peer].segment)
      return reinterpret_cast<T*>(peer + l.offset_bytes) + rect.r0 * l.cols + rect.c0;
    // Rows for a peer reached by messages are written straight into the
    // message, after the transport's header: no copy before it is sent.
    auto& message = staging_[worker];
    const std::size_t bytes = tr_->put_header_bytes() + static_cast<std::size_t>(rect.area()) * sizeof(T);
    if (message.capacity() < bytes) message = tr_->message_buffer(bytes);
    message.resize(bytes);
    return reinterpret_cast<T*>(message.data() + tr_->put_header_bytes());
  }
  // True if the put went through the transport, which also signals.
  bool send_put(const Task& t, const taskflow::Rect& rect, std::size_t worker) {
    if (ranks_[t.peer].segment) return false;
    const taskflow::BufferLayout& l = *peer_layout(t.peer, rect.buffer);
    const std::int64_t offset = l.offset_bytes + (rect.r0 * l.cols + rect.c0) * std::int64_t{sizeof(T)};
    tr_->send_put(t.peer, offset, std::move(staging_[worker]), t.trigger_event);
    staging_[worker].clear();  // moved from: valid, empty
    return true;
  }

  // Waits until the event reaches base + count: spins, then yields so that
  // an oversubscribed machine still makes progress; a watchdog turns a hang
  // into an error naming what waits for what.
  void wait(int r, std::size_t slot, std::int32_t id, const Task& t) {
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

  std::string peer_report() const {
    const std::string failed = tr_->failed_peers();
    return failed.empty() ? std::string() : "; peers: " + failed;
  }

  // A worker that stops because another failed: not an error of its own.
  struct Aborted {};

  // The first failure of a launch is kept; workers that stop because of it
  // leave quietly, so the error reported is the cause, not a consequence.
  void run_worker(int index, int w) {
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

  // Waits for a task's event, runs it, signals what it triggers.
  void run_task(int r, std::size_t slot, std::int32_t id) {
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
  void run_phased(int r, int w, std::size_t slot) {
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
      wait_all.kind = taskflow::operator_order(p.pass)[k];
      wait_all.wait_event = barrier;
      wait_all.wait_count = static_cast<std::int32_t>(c_.ranks * W);
      wait(r, slot, -2 - static_cast<std::int32_t>(k), wait_all);  // -2 - k: the barrier after operator k
      phase_end_[slot * phases + k] = seconds(launch_start_, Clock::now());
    }
  }

  // A GEMM task's tile: out = A B, A and out the table's rectangles (lda and
  // ldo their buffers' strides), B a packed weight or a buffer operand;
  // stored as T through an fp32 tile, or accumulated-free into fp32.
  template <class U>
  void gemm_tile_task(int r, const taskflow::Program& p, const Task& t, const taskflow::Rect& a, RhsView<U> b,
                      const taskflow::Rect& out, bool store_as_t) const {
    const std::int64_t rows = t.rows, cols = t.cols;
    need(out, rows, cols, t);
    need(a, rows, 0, t);
    const std::int64_t k = a.cols(), lda = ld_of(r, a.buffer), ldo = ld_of(r, out.buffer);
    if constexpr (std::is_same_v<U, T>) {
      if (store_as_t) {
        tile_to<T>(at<T>(r, p, a), lda, b, t.col_begin, at<T>(r, p, out), ldo, rows, cols, k);
        return;
      }
    }
    kernels::gemm_tile<U>(at<U>(r, p, a), lda, b, t.col_begin, at<float>(r, p, out), ldo, rows, cols, k, false);
  }

  // Runs one task; true if the transport already signalled its event. Every
  // address comes from the access table's rectangles of the program's
  // declared buffers; the kernels' extents are checked against them.
  bool execute(int r, std::size_t slot, const Task& t) {
    using taskflow::Rect;
    const taskflow::Program& p = (*current_)[r];
    const TaskOperands o = operands_of(p, t);
    const std::int64_t H = c_.hidden, Is = c_.shared_inter_total(), K = c_.top_k;
    const std::int64_t rows = t.rows;
    // A GEMM tile A[rows, k] B -> out, each from its rectangle.
    auto gemm = [&](const Rect& a, RhsView<T> b, const Rect& out, bool store_as_t) {
      gemm_tile_task(r, p, t, a, b, out, store_as_t);
    };
    switch (t.kind) {
      case TaskKind::dispatch_put: {  // gather rows of x by slot, put them into the owner's receive rows
        const Rect& dst = o.out(BufferId::recv);
        need(dst, rows, H, t);
        T* to = put_target(t, dst, slot);
        const T* x = base<T>(r, BufferId::x);
        const std::int32_t* tokens = at<std::int32_t>(r, p, o.in(BufferId::send_token));
        const std::int64_t ldx = ld_of(r, BufferId::x);
        for (std::int64_t j = 0; j < rows; ++j) copy_elements(to + j * H, x + std::int64_t{tokens[j]} * ldx, H);
        return send_put(t, dst, slot);
      }
      case TaskKind::gemm_gate_up:
        gemm(o.in(BufferId::recv), w1_of(r, t.expert), o.out(BufferId::h1), false);
        break;
      case TaskKind::swiglu: {
        const float* h = at<float>(r, p, o.in(BufferId::h1));
        T* a = at<T>(r, p, o.out(BufferId::a));
        const std::int64_t inter = t.cols, ldh = ld_of(r, BufferId::h1), lda = ld_of(r, BufferId::a);  // a part's width
        need(o.in(BufferId::h1), rows, 2 * inter, t);
        for (std::int64_t row = 0; row < rows; ++row) kernels::swiglu_forward<T>(h + row * ldh, inter, a + row * lda);
        break;
      }
      case TaskKind::gemm_down:
        gemm(o.in(BufferId::a), w2_of(r, t.expert), o.out(BufferId::y), true);
        break;
      case TaskKind::combine_put:
      case TaskKind::grad_combine_put: {
        const bool forward = t.kind == TaskKind::combine_put;
        const Rect& src = o.in(forward ? BufferId::y : BufferId::dxe);
        const Rect& dst = o.out(forward ? BufferId::comb : BufferId::dcomb);
        need(src, rows, H, t);
        need(dst, rows, H, t);
        copy_elements(put_target(t, dst, slot), at<T>(r, p, src), rows * H);
        return send_put(t, dst, slot);
      }
      case TaskKind::combine_reduce: {
        const std::int64_t* slots = at<std::int64_t>(r, p, o.in(BufferId::slot));
        const float* gates = at<float>(r, p, o.in(BufferId::gate));
        const T* comb = at<T>(r, p, o.in(BufferId::comb));
        const float* shared = c_.shared_experts > 0 ? at<float>(r, p, o.in(BufferId::sh_y)) : nullptr;
        float* out = at<float>(r, p, o.out(BufferId::out));
        for (std::int64_t j = 0; j < rows; ++j)
          combine_row<T>(out + j * ld_of(r, BufferId::out), H, K, slots + j * K, gates + j * K, comb,
                         shared ? shared + j * H : nullptr);
        break;
      }
      case TaskKind::part_reduce:
      case TaskKind::grad_part_reduce:
        reduce_parts(r, p, t, t.kind == TaskKind::part_reduce ? BufferId::comb : BufferId::dcomb);
        break;
      case TaskKind::shared_gate_up:
        gemm(o.in(BufferId::x), packed_->sw1.view(), o.out(BufferId::sh_h), false);
        break;
      case TaskKind::shared_swiglu: {
        const float* h = at<float>(r, p, o.in(BufferId::sh_h));
        T* a = at<T>(r, p, o.out(BufferId::sh_a));
        for (std::int64_t row = 0; row < rows; ++row) kernels::swiglu_forward<T>(h + row * 2 * Is, Is, a + row * Is);
        break;
      }
      case TaskKind::shared_down:
        gemm(o.in(BufferId::sh_a), packed_->sw2.view(), o.out(BufferId::sh_y), false);
        break;
      default:
        return execute_backward(r, slot, t, p, o);
    }
    return false;
  }

  // A declared reduction's target rows (part 0's partials) plus parts
  // 1..k-1's rows, in part order, accumulated in fp32 and stored once.
  void reduce_parts(int r, const taskflow::Program& p, const Task& t, BufferId buffer) {
    const taskflow::Reduction* red = p.reduction_at(t.row_begin);  // the access table has checked it
    const std::int64_t H = c_.hidden, ld = ld_of(r, buffer);
    T* rows = base<T>(r, buffer);
    std::vector<float> acc(static_cast<std::size_t>(H));
    for (std::int64_t j = 0; j < t.rows; ++j) {
      T* target = rows + (t.row_begin + j) * ld;
      kernels::load<T>(target, acc.data(), H);
      for (std::int64_t part = 1; part < red->parts; ++part) kernels::axpy<T>(1.0f, target + part * red->rows * ld, acc.data(), H);
      kernels::store<T>(acc.data(), target, H);
    }
  }

  // The backward tasks, each the same arithmetic as the serialized
  // baseline's operator over the same rows (see serialized.cpp).
  bool execute_backward(int r, std::size_t slot, const Task& t, const taskflow::Program& p, const TaskOperands& o) {
    using taskflow::Rect;
    const std::int64_t H = c_.hidden, Is = c_.shared_inter_total(), K = c_.top_k,
                       E = c_.routed_experts, T_ = c_.tokens_per_rank;
    const std::int64_t rows = t.rows;
    // C = A B for a GEMM tile whose A and output are rectangles and whose B
    // is a packed weight, a row-major buffer or a panel-blocked buffer.
    auto gemm = [&](const Rect& a, auto b, const Rect& out, bool store_as_t) {
      gemm_tile_task(r, p, t, a, b, out, store_as_t);
    };
    // A pack task: rows of `src` into a panel-blocked operand, and rows of
    // `tsrc` transposed into a row-major one, each with its K padding.
    auto pack = [&](BufferId src, BufferId panels, BufferId tsrc, BufferId transposed) {
      const Rect& s = o.in(src);
      const Rect& pr = o.out(panels);
      const Rect& ts = o.in(tsrc);
      const Rect& tr = o.out(transposed);
      need(pr, rows, 0, t);
      need(tr, 0, rows, t);
      const auto& pl = *layout_of(p, panels);
      pack_rows_into_panels<T>(at<T>(r, p, s), ld_of(r, src), rows, s.cols(), base<T>(r, panels), pl.rows, pr.r0,
                               pr.rows() - rows);
      const std::int64_t width = ts.cols(), ld = ld_of(r, transposed);
      T* dst = at<T>(r, p, tr);
      kernels::transpose_rows<T>(at<T>(r, p, ts), ld_of(r, tsrc), rows, width, dst, ld);
      for (std::int64_t c = rows; c < tr.cols(); ++c)  // the K padding column
        for (std::int64_t j = 0; j < width; ++j) dst[j * ld + c] = T{};
    };
    switch (t.kind) {
      case TaskKind::gate_grad: {
        const float* dout = at<float>(r, p, o.in(BufferId::dout));
        const std::int64_t* slots = at<std::int64_t>(r, p, o.in(BufferId::slot));
        const T* comb = at<T>(r, p, o.in(BufferId::comb));
        float* gw = at<float>(r, p, o.out(BufferId::gw));
        for (std::int64_t j = 0; j < rows; ++j)
          for (std::int64_t k = 0; k < K; ++k) {
            const std::int64_t row = slots[j * K + k];
            gw[j * K + k] = row >= 0 ? kernels::dot<T>(dout + j * ld_of(r, BufferId::dout), comb + row * H, H) : 0.0f;
          }
        break;
      }
      case TaskKind::router_bwd: {
        const float* logits = at<float>(r, p, o.in(BufferId::logits));
        const float* gw = at<float>(r, p, o.in(BufferId::gw));
        float* dlogits = at<float>(r, p, o.out(BufferId::dlogits));
        for (std::int64_t j = 0; j < rows; ++j)
          router_backward_token<float>(lc_, res_->routing, std::span<const float>(logits + j * E, E),
                                       index_of_[static_cast<std::size_t>(r)] * T_ + t.row_begin + j, std::span<const float>(gw + j * K, K),
                                       std::span<float>(dlogits + j * E, E));
        const Rect& xtf = o.out(BufferId::xtf);
        kernels::transpose_rows<float>(at<float>(r, p, o.in(BufferId::xf)), ld_of(r, BufferId::xf), rows, H, at<float>(r, p, xtf),
                              ld_of(r, BufferId::xtf));
        break;
      }
      case TaskKind::router_dgrad:
        gemm(o.in(BufferId::dlogits), packed_->router_t.view(), o.out(BufferId::rdx), false);
        break;
      case TaskKind::router_wgrad: {
        const Rect& b = o.in(BufferId::dlogits);
        gemm(o.in(BufferId::xtf), RhsView<float>{base<float>(r, BufferId::dlogits) + b.r0 * E, E}, o.out(BufferId::dwg), false);
        break;
      }
      case TaskKind::grad_dispatch_put: {
        const Rect& dst = o.out(BufferId::dy);
        need(dst, rows, H, t);
        T* to = put_target(t, dst, slot);
        const std::int64_t* assign = at<std::int64_t>(r, p, o.in(BufferId::send_assign));
        const float* gates = base<float>(r, BufferId::gate);
        const float* dout = base<float>(r, BufferId::dout);
        const std::int64_t ld_dout = ld_of(r, BufferId::dout);
        for (std::int64_t j = 0; j < rows; ++j)
          kernels::scale_store<T>(gates[assign[j]], dout + (assign[j] / K) * ld_dout, to + j * H, H);
        return send_put(t, dst, slot);
      }
      case TaskKind::gemm_down_dgrad:
        gemm(o.in(BufferId::dy), w2_t_of(r, t.expert), o.out(BufferId::da), false);
        break;
      case TaskKind::pack_down_grad:
        pack(BufferId::dy, BufferId::dyp, BufferId::a, BufferId::at);
        break;
      case TaskKind::gemm_down_wgrad:
        gemm(o.in(BufferId::at), panels_from<T>(r, p, o.in(BufferId::dyp)), o.out(BufferId::dw2), false);
        break;
      case TaskKind::swiglu_bwd: {
        const float* h = at<float>(r, p, o.in(BufferId::h1));
        const float* da = at<float>(r, p, o.in(BufferId::da));
        T* dh = at<T>(r, p, o.out(BufferId::dh));
        const std::int64_t inter = t.cols / 2;  // a part's width
        const std::int64_t ldh = ld_of(r, BufferId::h1), ldda = ld_of(r, BufferId::da), lddh = ld_of(r, BufferId::dh);
        need(o.in(BufferId::da), rows, inter, t);
        for (std::int64_t row = 0; row < rows; ++row)
          kernels::swiglu_backward<T>(h + row * ldh, da + row * ldda, inter, dh + row * lddh);
        break;
      }
      case TaskKind::gemm_gate_up_dgrad:
        gemm(o.in(BufferId::dh), w1_t_of(r, t.expert), o.out(BufferId::dxe), true);
        break;
      case TaskKind::pack_gate_up_grad:
        pack(BufferId::dh, BufferId::dhp, BufferId::recv, BufferId::xt);
        break;
      case TaskKind::gemm_gate_up_wgrad:
        gemm(o.in(BufferId::xt), panels_from<T>(r, p, o.in(BufferId::dhp)), o.out(BufferId::dw1), false);
        break;
      case TaskKind::shared_down_dgrad:
        gemm(o.in(BufferId::sh_dout), packed_->sw2_t.view(), o.out(BufferId::sh_da), false);
        break;
      case TaskKind::pack_shared_down_grad:
        pack(BufferId::sh_dout, BufferId::sh_doutp, BufferId::sh_a, BufferId::sh_at);
        break;
      case TaskKind::shared_down_wgrad:
        gemm(o.in(BufferId::sh_at), panels_from<T>(r, p, o.in(BufferId::sh_doutp)), o.out(BufferId::dws2), false);
        break;
      case TaskKind::shared_swiglu_bwd: {
        const float* h = at<float>(r, p, o.in(BufferId::sh_h));
        const float* da = at<float>(r, p, o.in(BufferId::sh_da));
        T* dh = at<T>(r, p, o.out(BufferId::sh_dh));
        for (std::int64_t row = 0; row < rows; ++row)
          kernels::swiglu_backward<T>(h + row * 2 * Is, da + row * Is, Is, dh + row * 2 * Is);
        break;
      }
      case TaskKind::shared_gate_up_dgrad:
        gemm(o.in(BufferId::sh_dh), packed_->sw1_t.view(), o.out(BufferId::sdx), false);
        break;
      case TaskKind::pack_shared_gate_up_grad:
        pack(BufferId::sh_dh, BufferId::sh_dhp, BufferId::x, BufferId::sh_xt);
        break;
      case TaskKind::shared_gate_up_wgrad:
        gemm(o.in(BufferId::sh_xt), panels_from<T>(r, p, o.in(BufferId::sh_dhp)), o.out(BufferId::dws1), false);
        break;
      case TaskKind::grad_reduce: {
        const std::int64_t* slots = at<std::int64_t>(r, p, o.in(BufferId::slot));
        const T* dcomb = at<T>(r, p, o.in(BufferId::dcomb));
        const float* rdx = at<float>(r, p, o.in(BufferId::rdx));
        const float* sdx = c_.shared_experts > 0 ? at<float>(r, p, o.in(BufferId::sdx)) : nullptr;
        float* dx = at<float>(r, p, o.out(BufferId::dx));
        for (std::int64_t j = 0; j < rows; ++j)
          assemble_dx_row<T>(dx + j * ld_of(r, BufferId::dx), H, K, slots + j * K, dcomb, rdx + j * H,
                             sdx ? sdx + j * H : nullptr);
        break;
      }
      default:
        throw Error(std::string("the interleaved runtime has no implementation of task kind ") + taskflow::name(t.kind));
    }
    return false;
  }

  // `rows` rows of row-major src [., n] into rows [row0, row0 + rows) of a
  // panel-blocked buffer `height` rows high (kernels::pack_rhs_panels writes
  // the same bytes), then `zero_rows` rows of zeros (K padding); columns
  // past n in the last panel are zero.
  template <class U>
  static void pack_rows_into_panels(const U* src, std::int64_t ld_src, std::int64_t rows, std::int64_t n, U* panels_base,
                                    std::int64_t height, std::int64_t row0, std::int64_t zero_rows) {
    const bool vnni = kernels::vnni_layout<U>();
    for (std::int64_t p = 0; p < panels(n); ++p) {
      U* panel = panels_base + p * height * kTileCols;
      for (std::int64_t i = 0; i < rows + zero_rows; ++i) {
        const std::int64_t rr = row0 + i;
        for (std::int64_t j = 0; j < kTileCols; ++j) {
          const std::int64_t col = p * kTileCols + j;
          panel[kernels::rhs_index(rr, j, kTileCols, vnni)] = i < rows && col < n ? src[i * ld_src + col] : U{};
        }
      }
    }
  }

  // A GEMM tile whose result is stored as T (through an fp32 scratch tile).
  template <class U>
  static void tile_to(const U* a, std::int64_t lda, RhsView<U> b, std::int64_t col0, U* out, std::int64_t ldo,
                      std::int64_t m, std::int64_t n, std::int64_t k) {
    float scratch[kernels::kMaxTileRows * kTileCols];
    kernels::gemm_tile<U>(a, lda, b, col0, scratch, kTileCols, m, n, k, false);
    for (std::int64_t row = 0; row < m; ++row) kernels::store<U>(scratch + row * kTileCols, out + row * ldo, n);
  }

  LayerConfig c_;
  const LayerWeights& w_;
  RuntimeOptions opt_;
  ExpertPlacement placement_;
  const taskflow::AccessTable* table_;  // where every task's operands come from
  std::shared_ptr<Transport> tr_;
  WorkerActivity activity_;  // watched by the transport's progress thread
  std::vector<int> local_;  // the ranks this process runs, in order; pool rank i is local_[i]
  LayerConfig lc_;          // the layer with only the hosted ranks (their tokens, in order)
  std::vector<int> index_of_;          // rank -> its index in local_, or -1
  std::vector<std::int32_t> owned_;    // experts the hosted ranks own (hold the gradient of)
  std::map<std::pair<int, std::int32_t>, std::vector<float>> replica_w1_, replica_w2_;  // (rank, expert): a replica's partial
  std::vector<PartWeights> part_packed_;  // [instance]: split experts' parts held here
  std::vector<float> reduce_scratch_;
  std::uint64_t fingerprint_ = 0;      // of layer, placement, format and replicated weights
  taskflow::RoutingCounts counts_;     // this step's P x E counts (every rank's)
  std::vector<std::uint64_t> count_block_;  // the count exchange's blocks
  WorkerPool pool_;
  std::vector<std::vector<std::byte>> staging_;  // per worker: the message of a put to a peer not addressable here
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
  std::vector<double> phase_end_;         // phased: [worker][operator] seconds from the launch's start to its barrier
  Clock::time_point launch_start_;
  Clock::time_point step_start_;
  std::vector<float> logits_;
  std::optional<taskflow::Exchange> ex_;  // this step's exchange layout
  std::vector<std::int64_t> slot_;        // this step's send row of every assignment
  taskflow::ScheduleScratch schedule_scratch_;
  taskflow::Verifier verifier_;
  std::vector<RankState> ranks_;
  const StepResult* res_ = nullptr;
  const StepResult* forward_done_ = nullptr;  // the result of the forward that backward may follow
  MatrixView x_, d_out_;                      // the caller's tokens and output gradient (borrowed)             // the step being run (router backward reads its routing)
  // Every rank's buffers this step, per pass (declared from the exchange).
  std::vector<taskflow::Program> forward_layouts_, backward_layouts_;
  using PeerBuffers = std::array<const taskflow::BufferLayout*, static_cast<std::size_t>(BufferId::count)>;
  std::vector<PeerBuffers> forward_peer_, backward_peer_;  // [rank][buffer id] into the layouts above
  std::vector<std::int64_t> launch_events_;  // events of each rank's program in the launch running
  std::vector<int> all_ranks_;               // 0 .. P-1
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
  check_weight_shapes(c, w);
  backward_ = opt.backward;
  if (c.dtype == DType::fp32) impl_ = std::make_unique<Interleaved<float>>(c, w, opt);
  else impl_ = std::make_unique<Interleaved<bf16>>(c, w, opt);
}

InterleavedExecutor::~InterleavedExecutor() = default;

void InterleavedExecutor::step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& result) {
  impl_->forward(view(in.x), forced, result);
  if (backward_) impl_->backward(view(in.d_out), result);
}

void InterleavedExecutor::forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& result) {
  impl_->forward(x, forced, result);
}

void InterleavedExecutor::backward(MatrixView d_out, StepResult& result) { impl_->backward(d_out, result); }

void InterleavedExecutor::weights_changed(std::shared_ptr<const PackedWeights> packed) {
  impl_->weights_changed(std::move(packed));
}

const std::vector<taskflow::Program>& InterleavedExecutor::programs(taskflow::Pass pass) const {
  return pass == taskflow::Pass::forward ? impl_->programs : impl_->backward_programs;
}

}  // namespace hpmoe
