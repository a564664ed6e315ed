// hpmoe::Layer: the engine (InterleavedExecutor) kept across calls. The layer
// owns the weights and one packing of them; engines are made on demand, one
// per step in flight, and go back to a free list when their step's backward
// has run or the step is dropped. Results' buffers (outputs, gradients) are
// recycled the same way, so a steady training loop allocates nothing large.
#include "hpmoe/layer.hpp"

#include <algorithm>
#include <chrono>
#include <type_traits>
#include <utility>

#include "hpmoe/error.hpp"
#include "runtime/interleaved.hpp"
#include "runtime/layer_inspect.hpp"

namespace hpmoe {

struct Layer::Shared {
  LayerConfig spec;
  Parallel parallel;
  LayerWeights weights;
  std::shared_ptr<const PackedWeights> packed;

  struct Engine {
    std::unique_ptr<InterleavedExecutor> executor;
    Schedule schedule = Schedule::interleaved;
    bool busy = false;
    const PackedWeights* packing = nullptr;  // the packing it reads (stale after a copy-on-write)
    std::uint64_t placement_epoch = 0;       // the placement it was built on (set_placement counts them)
  };
  std::uint64_t placement_epoch = 0;
  std::vector<Engine> engines;
  std::vector<StepResult> spare_results;  // dropped steps' buffers, reused by the next ones

  // Weights changed since the last repack, not yet packed.
  bool dirty = false;
  WeightChange pending = WeightChange::none();
  // Experts packed straight from a caller's projections (Layer::update_experts)
  // whose math-layout copy in `weights` lags the packing, until something
  // reads it (math_current).
  std::vector<std::int32_t> stale;

  Shared(const LayerConfig& c, LayerWeights w, Parallel p) : spec(c), parallel(std::move(p)), weights(std::move(w)) {
    spec.validate();
    if (parallel.workers_per_rank < 1 || parallel.workers_per_rank > 256)
      throw Error("Parallel::workers_per_rank must be between 1 and 256 (got " +
                  std::to_string(parallel.workers_per_rank) + ")");
    check_weight_shapes(spec, weights);
    if (parallel.expert_source && !parallel.transport)
      throw Error("Parallel::expert_source fetches a sharded process's experts: give it with a transport (in process "
                  "the weights hold every expert)");
    packed = parallel.expert_source ? pack_fetched() : pack_weights(spec, weights, parallel.backward);
  }

  // A sharded process's whole experts, each fetched into the weights,
  // packed and released in turn; the engine packs its parts of split ones.
  std::shared_ptr<const PackedWeights> pack_fetched() {
    const ExpertPlacement p = placement_or_contiguous(parallel.placement, spec.routed_experts, spec.ranks);
    std::vector<std::int32_t> whole;
    for (int r = 0; r < spec.ranks; ++r)
      if (parallel.transport->hosts(r))
        for (const std::int32_t e : p.experts_of(r))
          if (!p.is_split(e)) whole.push_back(e);
    std::sort(whole.begin(), whole.end());
    whole.erase(std::unique(whole.begin(), whole.end()), whole.end());
    return pack_weights(spec, weights, parallel.backward, whole, parallel.expert_source);
  }

  RuntimeOptions options(Schedule schedule) const {
    RuntimeOptions o;
    o.workers_per_rank = parallel.workers_per_rank;
    o.backward = parallel.backward;
    o.pin = parallel.pin;
    o.threads = parallel.threads;
    o.verify_programs = true;  // no program runs unless the verifier accepted it
    o.watchdog_seconds = parallel.watchdog_seconds;
    o.packed = packed;
    o.trace = parallel.trace || std::any_of(parallel.observers.begin(), parallel.observers.end(),
                                            [](const auto& w) { return w && w->wants_trace(); });
    o.transport = parallel.transport;
    o.placement = parallel.placement;
    o.policy = parallel.policy;
    o.verify_all_ranks = parallel.verify_all_ranks;
    o.expert_source = parallel.expert_source;
    if (schedule == parallel.schedule) o.fault = parallel.fault;
    return schedule == Schedule::serialized ? serialized_schedule(o) : o;
  }

  // The math layout brought up to the packing where update_experts left it
  // behind: before anything reads `weights` (a caller, a split expert's
  // parts, a whole new packing, a new engine).
  void math_current() {
    if (stale.empty()) return;
    unpack_experts(*packed, spec, stale, weights);
    stale.clear();
  }

  // Layer::update_experts, for float or bfloat16 projections.
  template <class Mlp>
  void update_experts(std::span<const std::int32_t> experts, std::span<const Mlp> views);

  bool in_flight() const {
    return std::any_of(engines.begin(), engines.end(), [](const Engine& e) { return e.busy; });
  }

  void note(const WeightChange& change) {
    for (const std::int32_t e : change.experts)
      if (e < 0 || e >= spec.routed_experts)
        throw Error("WeightChange names expert " + std::to_string(e) + ", outside the layer's " +
                    std::to_string(spec.routed_experts) + " experts");
    dirty = true;
    pending.replicated = pending.replicated || change.replicated;
    pending.all_experts = pending.all_experts || change.all_experts;
    if (!pending.all_experts) pending.experts.insert(pending.experts.end(), change.experts.begin(), change.experts.end());
  }

  // Before a forward: the changed weights packed again. In place when no
  // step in flight reads the packing; else into a new packing (copy on
  // write), which the busy engines take when their steps end.
  // Whether anything was packed.
  bool repack() {
    if (!dirty) return false;
    check_weight_shapes(spec, weights);
    if (in_flight()) {
      math_current();  // a new packing of every weight reads them all
      packed = pack_weights(spec, weights, parallel.backward);
    } else {
      std::sort(pending.experts.begin(), pending.experts.end());
      pending.experts.erase(std::unique(pending.experts.begin(), pending.experts.end()), pending.experts.end());
      repack_weights(*packed, spec, pending.experts, pending.all_experts, pending.replicated);
    }
    for (Engine& e : engines)
      if (!e.busy) refresh(e);
    dirty = false;
    pending = WeightChange::none();
    return true;
  }

  void refresh(Engine& e) {
    if (placement_or_contiguous(parallel.placement, spec.routed_experts, spec.ranks).has_splits())
      math_current();  // the engine packs its split experts' parts from the math layout
    e.executor->weights_changed(e.packing == packed.get() ? nullptr : packed);
    e.packing = packed.get();
  }

  std::size_t acquire(Schedule schedule) {
    if (parallel.transport && std::any_of(engines.begin(), engines.end(), [](const Engine& e) { return e.busy; }))
      throw Error("a layer on a transport runs one step at a time: run the backward of the step in flight (or drop "
                  "it) before the next forward");
    for (std::size_t i = 0; i < engines.size(); ++i)
      if (!engines[i].busy && engines[i].schedule == schedule) {
        Engine& e = engines[i];
        if (e.placement_epoch != placement_epoch) {  // built on an older placement: rebuilt on the new one
          math_current();
          e.executor.reset();  // first: over a transport the old engine lets go of it
          e.executor = std::make_unique<InterleavedExecutor>(spec, weights, options(schedule));
          e.packing = packed.get();
          e.placement_epoch = placement_epoch;
        }
        e.busy = true;
        return i;
      }
    math_current();
    engines.push_back(Engine{std::make_unique<InterleavedExecutor>(spec, weights, options(schedule)), schedule, true,
                             packed.get(), placement_epoch});
    return engines.size() - 1;
  }

  void release(std::size_t i) {
    Engine& e = engines[i];
    e.busy = false;
    if (e.packing != packed.get()) refresh(e);  // weights repacked (copied) while its step was in flight
  }
};

struct Layer::Step::State {
  std::shared_ptr<Layer::Shared> layer;
  std::size_t engine = 0;
  bool holds_engine = false;
  bool backward_done = false;
  StepResult result;

  ~State() {
    if (holds_engine) layer->release(engine);
    if (layer) {
      result.out_into = {};
      result.dx_into = {};
      layer->spare_results.push_back(std::move(result));
    }
  }
};

Layer::Layer(const LayerConfig& spec, LayerWeights weights, Parallel parallel)
    : s_(std::make_shared<Shared>(spec, std::move(weights), std::move(parallel))) {}
Layer::~Layer() = default;
Layer::Layer(Layer&&) noexcept = default;
Layer& Layer::operator=(Layer&&) noexcept = default;

Layer::Step Layer::forward(MatrixView x, const ForwardOptions& options) {
  if (!s_) throw Error("this Layer was moved from");
  const auto repack_start = std::chrono::steady_clock::now();
  const bool repacked = s_->repack();
  const double repack_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - repack_start).count();
  auto state = std::make_unique<Step::State>();
  if (!s_->spare_results.empty()) {
    state->result = std::move(s_->spare_results.back());
    s_->spare_results.pop_back();
  }
  state->engine = s_->acquire(options.schedule.value_or(s_->parallel.schedule));
  state->holds_engine = true;
  state->layer = s_;
  state->result.out_into = options.out;
  state->result.dx_into = {};
  s_->engines[state->engine].executor->forward(x, options.forced, state->result);
  if (repacked) state->result.forward_ops.insert(state->result.forward_ops.begin(), OperatorTime{"repack", repack_seconds});
  for (const auto& w : s_->parallel.observers)
    if (w) w->on_forward(state->result);
  if (!s_->parallel.backward) {  // nothing to keep for a backward
    s_->release(state->engine);
    state->holds_engine = false;
  }
  return Step(std::move(state));
}

const LayerConfig& Layer::spec() const { return s_->spec; }
const Parallel& Layer::parallel() const { return s_->parallel; }
const LayerWeights& Layer::weights() const {
  s_->math_current();
  return s_->weights;
}
LayerWeights& Layer::weights(const WeightChange& change) {
  s_->math_current();
  s_->note(change);
  return s_->weights;
}

namespace {
// A bfloat16 model's projections widened (exactly) into float copies, for
// the rare path through the math layout (a step in flight).
struct WidenedMlp {
  std::vector<float> gate, up, down;
  HfMlp views;
  explicit WidenedMlp(const HfMlpBf16& m) {
    views = {widen(m.gate_proj, gate), widen(m.up_proj, up), widen(m.down_proj, down)};
  }
  static MatrixView widen(const Bf16View& v, std::vector<float>& into) {
    into.resize(static_cast<std::size_t>(v.rows * v.cols));
    for (std::int64_t r = 0; r < v.rows; ++r)
      for (std::int64_t j = 0; j < v.cols; ++j) into[static_cast<std::size_t>(r * v.cols + j)] = v.data[r * v.ld + j].to_float();
    return {into.data(), v.rows, v.cols, v.cols};
  }
};
}  // namespace

template <class Mlp>
void Layer::Shared::update_experts(std::span<const std::int32_t> experts, std::span<const Mlp> views) {
  if (views.size() != experts.size())
    throw Error("Layer::update_experts: " + std::to_string(experts.size()) + " experts but " +
                std::to_string(views.size()) + " sets of projections");
  for (std::size_t i = 0; i < experts.size(); ++i) {
    const std::int32_t e = experts[i];
    if (e < 0 || e >= spec.routed_experts || !holds_expert(weights, e))
      throw Error("Layer::update_experts: expert " + std::to_string(e) + " is not one this layer holds (of " +
                  std::to_string(spec.routed_experts) + " experts; a sharded process holds its own)");
    check_hf_expert(spec, e, views[i]);
  }
  if constexpr (std::is_same_v<Mlp, HfMlpBf16>)
    if (spec.dtype != DType::bf16)
      throw Error("Layer::update_experts: bfloat16 projections are packed as they are by a bf16 layer; this layer is " +
                  to_string(spec.dtype) + ": give float projections (HfMlp)");
  if (in_flight()) {
    // Steps in flight keep the packing they run on: the new weights go
    // through the math layout, and the next forward packs a new copy.
    math_current();
    for (std::size_t i = 0; i < experts.size(); ++i) {
      if constexpr (std::is_same_v<Mlp, HfMlpBf16>) expert_from_hf(spec, experts[i], WidenedMlp(views[i]).views, weights);
      else expert_from_hf(spec, experts[i], views[i], weights);
    }
    note(WeightChange::only_experts({experts.begin(), experts.end()}));
    return;
  }
  repack();  // what a caller changed before, packed first: the math layout of those experts is current
  repack_experts_from_hf(*packed, spec, experts, views);
  stale.insert(stale.end(), experts.begin(), experts.end());
  std::sort(stale.begin(), stale.end());
  stale.erase(std::unique(stale.begin(), stale.end()), stale.end());
  for (Engine& e : engines) refresh(e);  // none is busy
}

void Layer::update_experts(std::span<const std::int32_t> experts, std::span<const HfMlp> views) {
  if (!s_) throw Error("this Layer was moved from");
  s_->update_experts(experts, views);
}
void Layer::update_experts(std::span<const std::int32_t> experts, std::span<const HfMlpBf16> views) {
  if (!s_) throw Error("this Layer was moved from");
  s_->update_experts(experts, views);
}

void Layer::weights_changed(const WeightChange& change) {
  // A change said after update_experts: what it left stale is brought up
  // first, so that a repack of every expert reads the new weights.
  s_->math_current();
  s_->note(change);
}

void Layer::update_replicated(LayerWeights replicated) {
  if (!s_) throw Error("this Layer was moved from");
  Shared& s = *s_;
  const auto E = static_cast<std::size_t>(s.spec.routed_experts);
  replicated.w1.assign(E, Matrix());  // checked as if every expert were held elsewhere
  replicated.w2.assign(E, Matrix());
  check_weight_shapes(s.spec, replicated);
  s.weights.router = std::move(replicated.router);
  s.weights.expert_bias = std::move(replicated.expert_bias);
  s.weights.shared_w1 = std::move(replicated.shared_w1);
  s.weights.shared_w2 = std::move(replicated.shared_w2);
  s.note(WeightChange{true, false, {}});
}
std::size_t Layer::engines() const { return s_->engines.size(); }

void Layer::set_placement(const ExpertPlacement& placement) {
  if (!s_) throw Error("this Layer was moved from");
  const LayerConfig& c = s_->spec;
  const ExpertPlacement p = placement_or_contiguous(placement, c.routed_experts, c.ranks);
  p.check_fits(c.routed_experts, c.ranks, c.expert_inter, c.dtype == DType::bf16 ? 2 : 1);
  if (p == placement_or_contiguous(s_->parallel.placement, c.routed_experts, c.ranks)) return;
  s_->parallel.placement = p;
  ++s_->placement_epoch;
}

Layer::Step::Step(std::unique_ptr<State> s) : s_(std::move(s)) {}
Layer::Step::Step(Step&&) noexcept = default;
Layer::Step& Layer::Step::operator=(Step&&) noexcept = default;
Layer::Step::~Step() = default;

const Matrix& Layer::Step::out() const { return s_->result.out; }
const LayerGradients& Layer::Step::gradients() const { return s_->result.grads; }
const StepResult& Layer::Step::result() const { return s_->result; }

const std::vector<taskflow::Program>& StepInspector::programs(const Layer::Step& step, taskflow::Pass pass) {
  if (!step.s_) throw Error("this Step was moved from");
  const auto& engine = step.s_->layer->engines[step.s_->engine];
  return engine.executor->programs(pass);
}

void Layer::Step::backward(MatrixView dy, const BackwardOptions& options) {
  if (!s_) throw Error("this Step was moved from");
  if (s_->backward_done) throw Error("this step's backward has already run (one backward per forward)");
  if (!s_->holds_engine) throw Error("backward: the layer was built with Parallel::backward = false");
  s_->result.dx_into = options.dx;
  s_->result.expert_grads_into = options.experts;
  s_->layer->engines[s_->engine].executor->backward(dy, s_->result);
  s_->backward_done = true;
  s_->layer->release(s_->engine);
  s_->holds_engine = false;
  for (const auto& w : s_->layer->parallel.observers)
    if (w) w->on_backward(s_->result);
}

}  // namespace hpmoe
