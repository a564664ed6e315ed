#pragma once
// Internal to the runtime: the engine behind InterleavedExecutor (and so
// behind hpmoe::Layer). One class template per dtype; its members live by
// job in the engine_*.cpp files (a step: routing, the count exchanges, the
// plan (step_plan.hpp); the launch: workers, waits, signals, watchdog;
// memory: buffers bound to the plan's programs; a tile: the op table's
// body through its TileHost). The gradients are made whole by the
// GradientReducer (gradient_reducer.hpp), the per-rank exchange's host
// tables filled by host_tables.hpp. Each file instantiates its own members
// for fp32 and bf16.
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
#include "runtime/gradient_reducer.hpp"
#include "runtime/step_plan.hpp"
#include "compiler/layout.hpp"
#include "comm/event_wait.hpp"
#include "ops/access.hpp"
#include "hpmoe/error.hpp"
#include "runtime/interleaved.hpp"
#include "runtime/worker_pool.hpp"

namespace hpmoe {

struct InterleavedExecutor::Impl {
  virtual ~Impl() = default;
  virtual void forward(MatrixView x, std::span<const std::int32_t> forced, StepResult&) = 0;
  virtual void backward(MatrixView d_out, StepResult&) = 0;
  virtual void weights_changed(std::shared_ptr<const PackedWeights> packed) = 0;
  detail::StepPlan plan;  // the step being run: planned once, then launched
};

namespace detail {

using namespace detail;
using taskflow::BufferId;
using taskflow::Task;
using taskflow::TaskKind;
using Clock = std::chrono::steady_clock;

inline double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Counters only grow: a launch waits for base + count, base being the value
// when the launch began (re-armed by an offset, never reset).
using Counter = EventCounter;

template <class T>
class Interleaved final : public InterleavedExecutor::Impl {
 public:
  Interleaved(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt);
  ~Interleaved() override { tr_->watch_workers(nullptr); }

  // The caller changed the weights in place: the packing (shared, updated by
  // the caller) is re-read, a split expert's parts are packed again and the
  // fingerprint covers the new replicated weights.
  void weights_changed(std::shared_ptr<const PackedWeights> packed) override;

 private:
  // The batch is a call's, not the layer's: x's rows are the hosted ranks'
  // tokens, T per rank. Everything sized by T (routing, exchange, buffers,
  // programs) is derived per step from c_ and lc_; the fingerprint carries
  // T so that ranks of a sharded run that disagree stop at the count exchange.
  void set_tokens(const MatrixView& x);

  // A split expert's part as its own smaller expert: W1's gate and up
  // columns of the part side by side ([H, 2 Ip]) and W2's rows of the part
  // ([Ip, H]), packed for the tile kernels like a whole expert's.
  struct PartWeights {
    Operand<T> w1, w2, w1_t, w2_t;
  };
  void pack_split_parts(bool backward);
  void pack_part(std::int64_t i, const LayerWeights& w, bool backward);
  // The packed weights rank r computes expert e with: its part's, if split.
  const PartWeights* part_of(int r, std::int32_t e) const {
    if (!layer_placement_.is_split(e)) return nullptr;
    return &part_packed_[static_cast<std::size_t>(layer_placement_.instance_on(e, r))];
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
    lc.ranks_per_node = 0;  // the hosted ranks alone are no whole nodes; the exchange keeps the layer's
    return lc;
  }
  // Ranks spread over processes: this one holds only its own rank's tokens,
  // routing and experts.
  bool sharded() const { return local_.size() != static_cast<std::size_t>(c_.ranks); }

  void forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& res) override;

  void backward(MatrixView d_out, StepResult& res) override;

 private:
  // One launch: all workers of all ranks run their queues of `set` at once.
  double launch(std::vector<taskflow::Program>& set, StepResult& res);
  void arm_counters(const std::vector<taskflow::Program>& set, std::span<const TaskKind> order);
  void group_by_operator(int r, const taskflow::Program& p, std::span<const TaskKind> order);
  void record_operators(const std::vector<taskflow::Program>& set, std::span<const TaskKind> order,
                        std::vector<OperatorTime>& ops) const;
  void record_busy(const std::vector<taskflow::Program>& set, StepResult& res);
  void record_trace(const std::vector<taskflow::Program>& set, StepResult& res) const;

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

  // Events of rank r's program for a pass, from the exchange layout alone
  // (a peer's program need not be compiled here).
  std::int64_t event_count(taskflow::Pass pass, std::int64_t r) const {
    return taskflow::event_bases(c_, plan.ex(), pass, r).total;
  }

  // Whether res.grads already has this process's shapes (reused across steps).
  bool gradients_fit(const LayerGradients& g) const;

  // The P x E counts of the step: this process's rows from its routing, the
  // others' from every process (with the layer's fingerprint, which must
  // match everywhere), and the balancing losses summed over ranks in order.
  void exchange_counts(StepResult& res);
  // The per-rank exchange: each hosted rank's token lists and routes, and
  // every rank's token counts per destination (gathered when sharded).
  void exchange_rank_tokens(const StepResult& res);

  static std::string hex(std::uint64_t v) {
    char text[19];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
    return text;
  }


  // 64-byte aligned bytes that keep their contents when grown.
  struct AlignedBytes {
    struct Free {
      void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
    };
    std::unique_ptr<std::byte[], Free> data;
    std::int64_t size = 0;
    // Grows with headroom, as the transports' segments do: the need follows
    // the routing, and growing to the exact need made a training loop whose
    // routing changes every step reallocate, zero and copy the region at
    // every other forward (62 ms of a 80 ms forward, hidden 256, 16 experts).
    void reserve(std::int64_t n) {
      if (n <= size) return;
      const std::int64_t grown_size = n + n / 2;
      std::unique_ptr<std::byte[], Free> grown(new (std::align_val_t{64}) std::byte[static_cast<std::size_t>(grown_size)]());
      if (size > 0) std::memcpy(grown.get(), data.get(), static_cast<std::size_t>(size));
      data = std::move(grown);
      size = grown_size;
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
    // Per slot: whether (ld > 0) and how the slot's dW tiles store into a
    // caller's gradient in Hugging Face's layout, transposed.
    std::vector<taskflow::TransposedStore> dw1_transposed, dw2_transposed;
    std::vector<std::int64_t> base_count;                // counter values when the launch began (hosted ranks)
    std::vector<std::int32_t> phase_begin, phase_tasks;  // phased: task ids by operator
  };

  // Reserves every rank's symmetric segment (the same on every process) and
  // each hosted rank's local region for this step's programs, forward and,
  // when it runs, backward (whose layout extends the forward's).
  // Every rank's buffers are sized for its own rows (a put addresses the
  // peer's copy by the peer's layout, computed here from the exchange).
  void reserve_memory(StepResult& res);

  // Points every buffer of hosted rank r's program at its memory.
  void bind(const taskflow::Program& p, int r, StepResult& res);

  // The host's part of a forward launch: routing into the ranks' buffers,
  // and the tokens as T.
  void prepare_forward(StepResult& res);

  void prepare_backward(StepResult& res);

  // The first element of a hosted rank's buffer.
  template <class U>
  U* base(std::int64_t rank, BufferId id) const {
    return reinterpret_cast<U*>(ranks_[static_cast<std::size_t>(rank)].base[static_cast<std::size_t>(id)]);
  }

  // The operands of one task, from the access table, checked against the
  // program's declared buffers before any kernel touches them.
  taskflow::Operands operands_of(const taskflow::Program& p, const Task& t) const;

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
      const auto slot = static_cast<std::size_t>(rect.r0 / height);
      const auto& slots = rect.buffer == BufferId::dw1 ? ranks_[r].dw1_slots : ranks_[r].dw2_slots;
      if (const taskflow::TransposedStore t = transposed(r, rect); t.ld) {
        const std::int64_t offset = rect.c0 * t.ld + rect.r0 % height;
        return t.bf16 ? reinterpret_cast<U*>(reinterpret_cast<bf16*>(slots[slot]) + offset)
                      : reinterpret_cast<U*>(reinterpret_cast<float*>(slots[slot]) + offset);
      }
      return reinterpret_cast<U*>(slots[slot]) + (rect.r0 % height) * l.cols + rect.c0;
    }
    U* b = base<U>(r, rect.buffer);
    if (l.layout == taskflow::Layout::panels)  // rows of a panel are kPanelCols apart (bf16: in pairs)
      return b + (rect.c0 / kTileCols) * l.rows * kTileCols + rect.r0 * kTileCols + (rect.c0 % kTileCols) * pair<U>();
    return b + rect.r0 * ld_of(r, rect.buffer) + rect.c0;
  }
  // Whether expert e's weight gradients go straight into the caller's
  // transposed views (StepResult::expert_grads_into): asked for, and the
  // expert computed whole by one instance, its owner's, this step.
  bool gradient_stored_transposed(const StepResult& res, std::int32_t e) const {
    return static_cast<std::size_t>(e) < res.expert_grads_into.size() && res.expert_grads_into[static_cast<std::size_t>(e)] &&
           plan.placement().home_count(e) == 1 && !layer_placement_.is_split(e);
  }
  // The caller's transposed views checked (shapes, strides, experts owned
  // here), and filled after the launch for the experts not stored by their tiles.
  void check_gradient_views(const StepResult& res) const;
  void transpose_remaining_gradients(StepResult& res) const;
  // Whether the rectangle (of DW1 or DW2) lands in a caller's transposed
  // gradient: element (h, c) at c ld + h, in float32 or bfloat16.
  taskflow::TransposedStore transposed(int r, const taskflow::Rect& rect) const {
    if (rect.buffer != BufferId::dw1 && rect.buffer != BufferId::dw2) return {};
    const bool w1 = rect.buffer == BufferId::dw1;
    const auto& slots = w1 ? ranks_[r].dw1_transposed : ranks_[r].dw2_transposed;
    return slots[static_cast<std::size_t>(rect.r0 / (w1 ? c_.hidden : c_.expert_inter))];
  }
  // Elements between rows of a hosted rank's row-major buffer: its declared
  // width, or a bound view's stride.
  std::int64_t ld_of(int r, BufferId id) const { return ranks_[static_cast<std::size_t>(r)].ld[static_cast<std::size_t>(id)]; }
  template <class U>
  static constexpr std::int64_t pair() {
    return sizeof(U) == 2 ? 2 : 1;
  }

  // Where a put's rows go: straight into the peer's segment when this
  // process can address it, else into the worker's staging buffer, which
  // send_put hands to the transport.
  T* put_target(const Task& t, const taskflow::Rect& rect, std::size_t worker);
  // True if the put went through the transport, which also signals.
  bool send_put(const Task& t, const taskflow::Rect& rect, std::size_t worker);

  // Waits until the event reaches base + count: spins, then yields so that
  // an oversubscribed machine still makes progress; a watchdog turns a hang
  // into an error naming what waits for what.
  void wait(int r, std::size_t slot, std::int32_t id, const Task& t);

  // Every worker that is waiting now, with what it waits for.
  std::string describe_waiters() const;

  std::string peer_report() const;

  // A worker that stops because another failed: not an error of its own.
  struct Aborted {};

  // The first failure of a launch is kept; workers that stop because of it
  // leave quietly, so the error reported is the cause, not a consequence.
  void run_worker(int index, int w);

  // Waits for a task's event, runs it, signals what it triggers.
  void run_task(int r, std::size_t slot, std::int32_t id);

  // Adds one to a counter of any rank: a store when its memory is
  // addressable here, an empty put with signal otherwise.
  void signal_rank(int rank, std::int32_t event, std::int32_t task);

  // The serialized operator sequence: a worker runs every W-th task of the
  // operator on its rank, then all workers of all ranks meet at the
  // operator's barrier counter before the next operator starts.
  void run_phased(int r, int w, std::size_t slot);

  // Runs one task through the op table (ops/op.hpp); true if the transport
  // already signalled its event. Every address comes from the access
  // table's rectangles of the program's declared buffers.
  bool execute(int r, std::size_t slot, const Task& t);
  class TileHost;  // what a task's body may ask of the engine (engine_tile.cpp)

  LayerConfig c_;
  const LayerWeights& w_;
  RuntimeOptions opt_;
  // The layer's placement: what is packed, split and reduced here (its
  // instance ids index part_packed_). A step's placement adds the homes it
  // lends (plan.placement(), whose instance ids index the exchange): the two
  // are never mixed for one index.
  ExpertPlacement layer_placement_;
  const taskflow::AccessTable* table_;  // where every task's operands come from
  std::shared_ptr<Transport> tr_;
  WorkerActivity activity_;  // watched by the transport's progress thread
  std::vector<int> local_;  // the ranks this process runs, in order; pool rank i is local_[i]
  LayerConfig lc_;          // the layer with only the hosted ranks (their tokens, in order)
  std::vector<int> index_of_;          // rank -> its index in local_, or -1
  std::vector<std::int32_t> owned_;    // experts the hosted ranks own (hold the gradient of)
  std::vector<PartWeights> part_packed_;  // [instance]: split experts' parts held here
  std::uint64_t fingerprint_ = 0;      // of layer, placement, format and replicated weights
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
  // phased: the operators of the layer, forward and backward (a barrier after each)
  std::array<std::vector<TaskKind>, 2> phases_;
  std::vector<double> phase_end_;         // phased: [worker][operator] seconds from the launch's start to its barrier
  Clock::time_point launch_start_;
  Clock::time_point step_start_;
  std::vector<float> logits_;
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
  // Plans each step (in process, the whole set proved at once; sharded,
  // each hosted rank's own program against the interface of the exchanged
  // counts, or, as an audit, every rank's program regenerated here).
  // Makes the step's gradients whole after the backward launch; holds the
  // replicas' and split parts' partials the dW tiles write.
  GradientReducer reducer_{c_, layer_placement_};
  StepPlanner planner_{StepPlanner::Options{opt_.policy, opt_.verify_programs, whole_set_verified(), opt_.after_compile}};
};

}  // namespace detail
}  // namespace hpmoe
