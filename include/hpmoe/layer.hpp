#pragma once
// hpmoe::Layer: one expert-parallel MoE layer that a framework builds once
// and calls every step. It owns the weights and their packing for the tile
// kernels, the worker pool, the buffers and the compile scratch, and keeps
// them across calls: a forward takes any number of tokens, and a weight
// update repacks only what changed, in the same memory.
//
//   hpmoe::Layer layer(spec, std::move(weights), {.workers_per_rank = 2});
//   auto step = layer.forward(x);         // x: [tokens, hidden]
//   use(step.out());
//   step.backward(dy);                    // later: the same forward's backward
//   use(step.gradients());                // dx and every weight's gradient
//
// Every program a step runs was accepted by the verifier first.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "hpmoe/step.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/schedule.hpp"
#include "hpmoe/tensors.hpp"
#include "hpmoe/transport.hpp"

namespace hpmoe {

// How a step's tasks are ordered in time. Both run the same verified
// program, tile for tile, and give bit-identical results.
enum class Schedule {
  interleaved,  // one launch: every worker walks its queue, waiting only on the events it needs
  serialized,   // one operator at a time, a barrier across all workers after each (the framework way)
};

// Which threads run the layer's workers.
enum class WorkerThreads {
  own,     // threads of the layer's own, started once (pinned where Parallel::pin)
  // The OpenMP runtime's threads, the calling thread's team: in a process
  // whose framework computes on OpenMP (PyTorch on Linux), the threads its
  // operators use, so that none of them spins idle beside the layer's
  // workers (libgomp's idle threads spin for milliseconds after each
  // parallel operator). Where the team cannot have a thread per worker
  // (the call is inside a parallel region, a thread limit, a build
  // without OpenMP), the layer's own threads run the step instead.
  openmp,
};

// Watches a layer's steps, as Taskflow's observers watch its executor:
// called after every forward and every backward with the step's result
// (routing, expert load, per-operator times; a slice per task when
// wants_trace()). Runs on the caller's thread, after the launch; it must
// not call the layer it watches.
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  virtual bool wants_trace() const { return false; }
  virtual void on_forward(const StepResult&) {}
  virtual void on_backward(const StepResult&) {}
};

// Where a sharded process's experts come from when its weights do not hold
// them (a run over MPI draws or reads each one): called with an expert id
// and weights to fill that expert of; the layer packs it and releases the
// raw copy, so that the raw and packed copies of all experts never coexist.
using ExpertSource = std::function<void(std::int64_t expert, LayerWeights&)>;

// Faults injected on purpose, for tests and tools of the watchdog and of
// peer failure (hpmoe run --fault); none in training.
struct RuntimeFault {
  enum Kind { none, exit_process, freeze_process, stall } kind = none;
  // exit_process: the process hosting this rank dies at its first launch;
  // freeze_process: it stops (SIGSTOP: alive but silent, like a host whose
  // link went down); stall: this rank's worker 0 waits before its first task
  int rank = 0;
};

// Where and how the layer runs: the ranks are the spec's (LayerConfig::ranks).
struct Parallel {
  int workers_per_rank = 1;
  Schedule schedule = Schedule::interleaved;
  // The interleaved schedule's task order per worker (hpmoe run --policy).
  taskflow::Policy policy = taskflow::Policy::critical_path;
  ExpertPlacement placement{};           // where the experts live; empty: contiguous
  std::shared_ptr<Transport> transport{};  // null: all ranks in this process
  bool backward = true;                  // steps may run backward (packs the transposes it needs)
  bool pin = true;                       // pin workers to cores (off inside a framework's process)
  WorkerThreads threads = WorkerThreads::own;  // whose threads run the workers
  double watchdog_seconds = 10.0;        // a wait longer than this fails the step, naming task and event
  bool trace = false;                    // record a slice per task in StepResult::trace
  std::vector<std::shared_ptr<StepObserver>> observers{};  // told of every forward and backward
  // Over a transport each process proves its own rank's program against the
  // interface the exchanged counts predict. This audit instead compiles
  // every rank's program in every process and proves the whole set (P
  // times the compile cost).
  bool verify_all_ranks = false;
  // Over a transport: the weights given hold the replicated parameters only,
  // and each expert this process holds comes from here, once (whole experts
  // when the layer is built, a tensor-parallel split's parts when a step
  // first computes them). Empty: the weights given hold this process's experts.
  ExpertSource expert_source{};
  RuntimeFault fault{};  // injected into the engines of `schedule` (tests)
};

// One forward's choices beyond its tokens.
struct ForwardOptions {
  std::span<const std::int32_t> forced{};  // replaces the router's choice (synthetic or recorded routing)
  MutableMatrixView out{};                 // when given, receives the output
  // This step's schedule; unset: Parallel::schedule. A layer keeps an
  // engine per schedule it has run, on the one packing of its weights, so
  // that a tool can run the same steps both ways and compare them bit for bit.
  std::optional<Schedule> schedule{};
};

// One backward's destinations beyond gradients(): dx into the caller's
// view, and routed experts' weight gradients into the caller's memory in
// Hugging Face's layout (StepResult::expert_grads_into: a framework's
// gradient tensors, filled with no copy after the launch).
struct BackwardOptions {
  MutableMatrixView dx{};
  std::vector<ExpertGradientsInto> experts{};
};

// What a caller changed in the weights it edits through Layer::weights().
struct WeightChange {
  bool replicated = true;             // router, expert bias, shared experts
  bool all_experts = true;            // every routed expert held here ...
  std::vector<std::int32_t> experts;  // ... or only these
  static WeightChange none() { return {false, false, {}}; }
  static WeightChange only_experts(std::vector<std::int32_t> e) { return {false, false, std::move(e)}; }
};

class Layer {
  struct Shared;

 public:
  // weights: the layer's parameters in the math layout (a sharded process
  // holds only its own experts). Packs them once.
  Layer(const LayerConfig& spec, LayerWeights weights, Parallel parallel = {});
  // The same from the layer and how it runs, apart (config.hpp).
  Layer(const LayerSpec& layer, const RunOptions& run, LayerWeights weights, Parallel parallel = {})
      : Layer(LayerConfig(layer, run), std::move(weights), std::move(parallel)) {}
  ~Layer();
  Layer(Layer&&) noexcept;
  Layer& operator=(Layer&&) noexcept;

  // One forward, and later its backward. A step holds what its backward
  // needs; several may be in flight (micro-batches), each on its own engine
  // (in process; a transport across processes allows one at a time). A step
  // keeps its layer's state alive.
  class Step {
   public:
    Step(Step&&) noexcept;
    Step& operator=(Step&&) noexcept;
    ~Step();
    const Matrix& out() const;  // [tokens, hidden], unless the forward wrote into the caller's view
    // The backward of this step's forward, once. dx goes into `dx` when
    // given (a view of the caller's memory), else into gradients().x.
    void backward(MatrixView dy, MutableMatrixView dx = {}) { backward(dy, BackwardOptions{dx, {}}); }
    void backward(MatrixView dy, const BackwardOptions& options);
    const LayerGradients& gradients() const;
    // Routing, expert load, losses, memory, per-operator and launch times.
    const StepResult& result() const;

   private:
    friend class Layer;
    friend struct StepInspector;  // runtime/layer_inspect.hpp: the tools' view of a step's programs
    struct State;
    explicit Step(std::unique_ptr<State>);
    std::unique_ptr<State> s_;
  };

  // x: this process's tokens ([hosted ranks x T, hidden], any row stride),
  // any T >= 1; read in place, and it must stay alive and unchanged until
  // the step's backward has run. `forced` replaces the router's choice
  // (synthetic or recorded routing); `out`, when given, receives the output.
  Step forward(MatrixView x, std::span<const std::int32_t> forced = {}, MutableMatrixView out = {}) {
    return forward(x, ForwardOptions{forced, out, std::nullopt});
  }
  Step forward(MatrixView x, const ForwardOptions& options);
  Step forward(const Matrix& x) { return forward(view(x)); }

  const LayerConfig& spec() const;
  const Parallel& parallel() const;
  const LayerWeights& weights() const;
  // The weights, to change in place; then say what changed. The packing of
  // what changed is redone in place before the next forward; steps already
  // in flight keep the weights they ran with.
  LayerWeights& weights(const WeightChange& change);
  // Say after the fact that weights changed (through a pointer kept from
  // weights(WeightChange::none())).
  void weights_changed(const WeightChange& change = {});
  // Routed experts' new weights straight from Hugging Face projections
  // (`views[i]` for `experts[i]`; [out, in], any row stride), packed for the
  // kernels at once, without the math-layout copy that weights() and
  // expert_from_hf make: a framework's per-step update. The bits are those
  // of that copy and its repack. The math layout of these experts follows
  // only when something reads it (weights(), a split expert's parts, a new
  // engine); a reference kept from weights() sees it after weights() is
  // called again. With a step in flight the weights go through the math
  // layout and the next forward packs them (steps in flight keep theirs).
  void update_experts(std::span<const std::int32_t> experts, std::span<const HfMlp> views);
  // The same from a bfloat16 model's projections, for a bf16 layer: their
  // bits packed as they are (no widening, no rounding).
  void update_experts(std::span<const std::int32_t> experts, std::span<const HfMlpBf16> views);
  // The replicated parameters (router, expert bias, shared experts) replaced
  // by `replicated`'s (its routed experts are ignored), packed at the next
  // forward; the routed experts are not touched (nor brought up, as
  // weights() would).
  void update_replicated(LayerWeights replicated);

  // A new expert placement from the next forward on: an online revision
  // between steps (OnlinePlacement's, say). Steps in flight finish on the
  // placement they started with; an idle engine is rebuilt on the new one
  // when a forward takes it (the packing is kept). Over a transport every
  // process must make the same change before the same step (a revision
  // computed from the exchanged counts is), and a replica whose weights
  // this process does not hold must fetch them ("fetch_replicas"). Throws
  // Error, changing nothing, where it does not fit the layer.
  void set_placement(const ExpertPlacement& placement);

  // Engines made so far (one per step in flight at once): a measure of reuse.
  std::size_t engines() const;

 private:
  std::shared_ptr<Shared> s_;
};

}  // namespace hpmoe
