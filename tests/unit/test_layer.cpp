// hpmoe::Layer, the face a framework keeps across calls: every step it runs
// is bit-identical to a fresh engine built for that step's tokens and
// weights, whatever the calls before it (other token counts, weight
// updates, steps in flight), for both schedules and both dtypes.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "bit_identity.hpp"
#include "fresh_engine.hpp"

#include "hpmoe/error.hpp"
#include "hpmoe/hpmoe.hpp"
#include "runtime/interleaved.hpp"

using namespace hpmoe;
using hpmoe::testing::bit_identical;

namespace {

LayerConfig small_layer(DType dtype) {
  LayerConfig c = preset("tiny");
  c.hidden = 160;  // ragged column tiles
  c.expert_inter = 96;
  c.dtype = dtype;
  c.ranks = 2;
  c.tokens_per_rank = 8;  // the spec's T is only a default: every call brings its own
  return c;
}

Parallel parallel_of(Schedule schedule, ExpertPlacement placement = {}) {
  Parallel p;
  p.workers_per_rank = 2;
  p.schedule = schedule;
  p.pin = false;
  p.placement = std::move(placement);
  return p;
}

// What a fresh engine computes for T tokens per rank: forward and backward.
struct Fresh {
  StepResult r;
  Fresh(const LayerConfig& c, const LayerWeights& w, std::int64_t, const LayerInputs& in, const Parallel& p)
      : r(hpmoe::testing::fresh_step(c, w, p, in)) {}
};

LayerInputs inputs(LayerConfig c, std::int64_t T, std::uint64_t seed) {
  c.tokens_per_rank = T;
  return random_inputs(c, seed);
}

// Every expert's weights scaled, and the router nudged: a training step's update.
void update(LayerWeights& w, float scale) {
  for (auto& m : w.w1)
    for (auto& v : m.data) v = v * scale;
  for (auto& v : w.router.data) v = v + 0.01f;
  for (auto& v : w.shared_w2.data) v = v * scale;
}

// Expert e of w as Hugging Face stores it ([out, in]), each projection with
// a row stride of its own whose padding holds NaN (a packer reading past a
// row would show), and views of it.
struct HfExpert {
  std::vector<float> gate, up, down;
  HfMlp views;
  HfExpert(const LayerConfig& c, const LayerWeights& w, std::size_t e) {
    const std::int64_t H = c.hidden, I = c.expert_inter, ld_in = H + 5, ld_down = I + 3;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    gate.assign(static_cast<std::size_t>(I * ld_in), nan);
    up.assign(gate.size(), nan);
    down.assign(static_cast<std::size_t>(H * ld_down), nan);
    const Matrix& w1 = w.w1[e];
    const Matrix& w2 = w.w2[e];
    for (std::int64_t i = 0; i < I; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        gate[static_cast<std::size_t>(i * ld_in + h)] = w1.data[static_cast<std::size_t>(h * 2 * I + i)];
        up[static_cast<std::size_t>(i * ld_in + h)] = w1.data[static_cast<std::size_t>(h * 2 * I + I + i)];
        down[static_cast<std::size_t>(h * ld_down + i)] = w2.data[static_cast<std::size_t>(i * H + h)];
      }
    views = {{gate.data(), I, H, ld_in}, {up.data(), I, H, ld_in}, {down.data(), H, I, ld_down}};
  }
};

// The same as a bfloat16 model holds them (w's values rounded first, in
// place, so that w is what the layer computes with).
struct HfExpertBf16 {
  std::vector<bf16> gate, up, down;
  HfMlpBf16 views;
  HfExpertBf16(const LayerConfig& c, LayerWeights& w, std::size_t e) {
    for (auto& v : w.w1[e].data) v = round_to_bf16(v);
    for (auto& v : w.w2[e].data) v = round_to_bf16(v);
    const HfExpert f(c, w, e);
    const auto narrow = [](const std::vector<float>& from, std::vector<bf16>& to) {
      to.resize(from.size());
      for (std::size_t i = 0; i < from.size(); ++i) to[i] = bf16::from_float(from[i]);
    };
    narrow(f.gate, gate);
    narrow(f.up, up);
    narrow(f.down, down);
    const auto as = [](const MatrixView& v, const std::vector<bf16>& data) { return Bf16View{data.data(), v.rows, v.cols, v.ld}; };
    views = {as(f.views.gate_proj, gate), as(f.views.up_proj, up), as(f.views.down_proj, down)};
  }
};

void update_from_hf_bits(Layer& layer, const LayerConfig& c, LayerWeights& w, const std::vector<std::int32_t>& experts) {
  std::vector<HfExpertBf16> hf;
  hf.reserve(experts.size());
  std::vector<HfMlpBf16> views;
  for (const std::int32_t e : experts) views.push_back(hf.emplace_back(c, w, static_cast<std::size_t>(e)).views);
  layer.update_experts(experts, views);
}

// `experts` of w handed to layer.update_experts as Hugging Face projections.
void update_from_hf(Layer& layer, const LayerConfig& c, const LayerWeights& w, const std::vector<std::int32_t>& experts) {
  std::vector<HfExpert> hf;
  hf.reserve(experts.size());
  std::vector<HfMlp> views;
  for (const std::int32_t e : experts) views.push_back(hf.emplace_back(c, w, static_cast<std::size_t>(e)).views);
  layer.update_experts(experts, views);
}

void scale_experts(LayerWeights& w, const std::vector<std::int32_t>& experts, float s1, float s2) {
  for (const std::int32_t e : experts) {
    for (auto& v : w.w1[static_cast<std::size_t>(e)].data) v = v * s1;
    for (auto& v : w.w2[static_cast<std::size_t>(e)].data) v = v * s2;
  }
}

// The layer's next step on `in`, forward and backward, bit for bit a fresh
// engine's on weights w.
void expect_fresh_step(Layer& layer, const LayerConfig& c, const LayerWeights& w, const LayerInputs& in,
                       const std::string& what) {
  const StepResult fresh = hpmoe::testing::fresh_step(c, w, layer.parallel(), in);
  auto s = layer.forward(in.x);
  EXPECT_TRUE(bit_identical(s.out(), fresh.out)) << what;
  s.backward(view(in.d_out));
  EXPECT_TRUE(bit_identical(s.gradients(), fresh.grads)) << what;
}

std::vector<std::int32_t> all_experts(const LayerConfig& c) {
  std::vector<std::int32_t> e(static_cast<std::size_t>(c.routed_experts));
  for (std::size_t i = 0; i < e.size(); ++i) e[i] = static_cast<std::int32_t>(i);
  return e;
}

}  // namespace

class LayerKept : public ::testing::TestWithParam<std::tuple<DType, Schedule>> {};

TEST_P(LayerKept, AnyTokenCountPerCallIsBitIdenticalToAFreshEngine) {
  const auto [dtype, schedule] = GetParam();
  const LayerConfig c = small_layer(dtype);
  const auto w = random_weights(c, 5);
  Layer layer(c, w, parallel_of(schedule));
  for (const std::int64_t T : {24, 61, 1, 24}) {
    const auto in = inputs(c, T, 100 + static_cast<std::uint64_t>(T));
    Fresh fresh(c, w, T, in, layer.parallel());
    auto step = layer.forward(in.x);
    EXPECT_TRUE(bit_identical(step.out(), fresh.r.out)) << "T " << T;
    step.backward(view(in.d_out));
    EXPECT_TRUE(bit_identical(step.gradients(), fresh.r.grads)) << "T " << T;
    EXPECT_EQ(step.result().expert_counts, fresh.r.expert_counts);
  }
  EXPECT_EQ(layer.engines(), 1u);  // one step at a time: one engine, reused
}

TEST_P(LayerKept, WeightsUpdatedInPlaceMatchAFreshEngineOnTheNewWeights) {
  const auto [dtype, schedule] = GetParam();
  const LayerConfig c = small_layer(dtype);
  auto w = random_weights(c, 6);
  Layer layer(c, w, parallel_of(schedule));
  const auto in = inputs(c, 40, 7);
  layer.forward(in.x).backward(view(in.d_out));  // packed and run once before the change
  update(layer.weights(WeightChange{}), 0.75f);
  update(w, 0.75f);
  Fresh fresh(c, w, 40, in, layer.parallel());
  auto step = layer.forward(in.x);
  EXPECT_TRUE(bit_identical(step.out(), fresh.r.out));
  step.backward(view(in.d_out));
  EXPECT_TRUE(bit_identical(step.gradients(), fresh.r.grads));

  // Only two experts changed, and said so: the rest of the packing is kept.
  for (const int e : {1, 3}) {
    for (auto& v : layer.weights(WeightChange::only_experts({e})).w2[static_cast<std::size_t>(e)].data) v = -v;
    for (auto& v : w.w2[static_cast<std::size_t>(e)].data) v = -v;
  }
  Fresh fresh2(c, w, 40, in, layer.parallel());
  auto step2 = layer.forward(in.x);
  EXPECT_TRUE(bit_identical(step2.out(), fresh2.r.out));
  step2.backward(view(in.d_out));
  EXPECT_TRUE(bit_identical(step2.gradients(), fresh2.r.grads));
}

TEST_P(LayerKept, StepsInFlightEachKeepTheirOwnForwardAndWeights) {
  const auto [dtype, schedule] = GetParam();
  const LayerConfig c = small_layer(dtype);
  auto w = random_weights(c, 8);
  Layer layer(c, w, parallel_of(schedule));
  const auto a_in = inputs(c, 24, 9), b_in = inputs(c, 33, 10);
  Fresh a_fresh(c, w, 24, a_in, layer.parallel());
  auto a = layer.forward(a_in.x);
  // The weights change while a is in flight: b runs on the new ones (a new
  // packing, copied on write), a's backward on the ones its forward used.
  update(layer.weights(WeightChange{}), 1.25f);
  update(w, 1.25f);
  Fresh b_fresh(c, w, 33, b_in, layer.parallel());
  auto b = layer.forward(b_in.x);
  EXPECT_EQ(layer.engines(), 2u);
  b.backward(view(b_in.d_out));
  a.backward(view(a_in.d_out));
  EXPECT_TRUE(bit_identical(a.out(), a_fresh.r.out));
  EXPECT_TRUE(bit_identical(a.gradients(), a_fresh.r.grads));
  EXPECT_TRUE(bit_identical(b.out(), b_fresh.r.out));
  EXPECT_TRUE(bit_identical(b.gradients(), b_fresh.r.grads));
  // Both engines are free again and read the new packing.
  auto c1 = layer.forward(a_in.x);
  Fresh c_fresh(c, w, 24, a_in, layer.parallel());
  EXPECT_TRUE(bit_identical(c1.out(), c_fresh.r.out));
  EXPECT_EQ(layer.engines(), 2u);
}

// A framework's training loop: after each optimizer step the moved experts
// are packed straight from their Hugging Face tensors (no math-layout copy),
// over steps whose tokens, token counts, moved experts and router change;
// every step is bit for bit a fresh engine's on the new weights, and the
// math layout, read afterwards, is what expert_from_hf makes of them.
TEST_P(LayerKept, ExpertsPackedStraightFromHfProjectionsMatchAFreshEngine) {
  const auto [dtype, schedule] = GetParam();
  const LayerConfig c = small_layer(dtype);
  auto w = random_weights(c, 21);
  Layer layer(c, w, parallel_of(schedule));
  for (int step = 0; step < 4; ++step) {
    const auto in = inputs(c, 24 + 9 * step, 30 + static_cast<std::uint64_t>(step));
    // Steps 0 and 2 move every expert, step 1 two of them (given out of
    // order), step 3 none but the router.
    std::vector<std::int32_t> moved = step % 2 == 0 ? all_experts(c) : std::vector<std::int32_t>{};
    if (step == 1) moved = {3, 1};
    scale_experts(w, moved, 0.9f - 0.1f * float(step), -1.1f);
    // A bf16 layer takes bfloat16 projections too (steps 1 and 2).
    if (dtype == DType::bf16 && (step == 1 || step == 2)) update_from_hf_bits(layer, c, w, moved);
    else if (!moved.empty()) update_from_hf(layer, c, w, moved);
    if (step == 3) {
      for (auto& v : w.router.data) v = v - 0.02f;
      layer.update_replicated(w);
    }
    expect_fresh_step(layer, c, w, in, "step " + std::to_string(step));
  }
  LayerWeights expect = w;
  for (const std::int32_t e : all_experts(c)) expert_from_hf(c, e, HfExpert(c, w, static_cast<std::size_t>(e)).views, expect);
  for (std::size_t e = 0; e < expect.w1.size(); ++e) {
    EXPECT_TRUE(bit_identical(layer.weights().w1[e], expect.w1[e])) << "expert " << e;
    EXPECT_TRUE(bit_identical(layer.weights().w2[e], expect.w2[e])) << "expert " << e;
  }
  EXPECT_EQ(layer.engines(), 1u);
}

// An update while a step is in flight: that step keeps the weights it ran
// with, the next one runs on the new ones; then a straight update again.
TEST_P(LayerKept, ExpertsFromHfWhileAStepIsInFlight) {
  const auto [dtype, schedule] = GetParam();
  const LayerConfig c = small_layer(dtype);
  auto w = random_weights(c, 22);
  Layer layer(c, w, parallel_of(schedule));
  const auto a_in = inputs(c, 24, 23), b_in = inputs(c, 17, 24);
  Fresh a_fresh(c, w, 0, a_in, layer.parallel());
  auto a = layer.forward(a_in.x);
  scale_experts(w, all_experts(c), 1.25f, 0.5f);
  if (dtype == DType::bf16) update_from_hf_bits(layer, c, w, all_experts(c));  // widened through the math layout
  else update_from_hf(layer, c, w, all_experts(c));
  Fresh b_fresh(c, w, 0, b_in, layer.parallel());
  auto b = layer.forward(b_in.x);
  b.backward(view(b_in.d_out));
  a.backward(view(a_in.d_out));
  EXPECT_TRUE(bit_identical(a.out(), a_fresh.r.out));
  EXPECT_TRUE(bit_identical(a.gradients(), a_fresh.r.grads));
  EXPECT_TRUE(bit_identical(b.out(), b_fresh.r.out));
  EXPECT_TRUE(bit_identical(b.gradients(), b_fresh.r.grads));
  scale_experts(w, {0, 2}, -0.5f, 2.0f);
  if (dtype == DType::bf16) update_from_hf_bits(layer, c, w, {0, 2});
  else update_from_hf(layer, c, w, {0, 2});
  expect_fresh_step(layer, c, w, a_in, "after the steps in flight");
}

INSTANTIATE_TEST_SUITE_P(DtypesAndSchedules, LayerKept,
                         ::testing::Combine(::testing::Values(DType::fp32, DType::bf16),
                                            ::testing::Values(Schedule::interleaved, Schedule::serialized)),
                         [](const auto& info) {
                           return to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == Schedule::interleaved ? "_interleaved" : "_serialized");
                         });

// The layer and how it runs, given apart, are the same layer as one config.
TEST(LayerFace, TakesTheLayerAndHowItRunsApart) {
  LayerConfig c = small_layer(DType::fp32);
  c.ranks = 2;
  c.exchange = ExchangeMode::rank;
  const auto w = random_weights(c, 5);
  const auto in = inputs(c, 24, 6);
  Layer whole(c, w, parallel_of(Schedule::interleaved));
  Layer apart(c.spec(), c.run(), w, parallel_of(Schedule::interleaved));
  auto a = whole.forward(in.x), b = apart.forward(in.x);
  a.backward(view(in.d_out));
  b.backward(view(in.d_out));
  EXPECT_TRUE(bit_identical(a.out(), b.out()));
  EXPECT_TRUE(bit_identical(a.gradients(), b.gradients()));
}

// A placement with a split expert and a replica: the parts are packed from
// the raw weights again when they change.
TEST(LayerFace, SplitExpertsFollowAWeightUpdate) {
  LayerConfig c = small_layer(DType::fp32);
  c.ranks = 3;
  c.routed_experts = 8;
  ExpertPlacement::Rules rules{.replicas = true, .slots_per_rank = 4};
  rules.splits = {{0, {0, 32, 64, 96}}, {5, {0, 40, 96}}};
  const auto placement = ExpertPlacement::from_rank_lists(8, {{0, 1, 2, 3}, {0, 3, 4, 5}, {0, 5, 6, 7}}, rules);
  auto w = random_weights(c, 11);
  Layer layer(c, w, parallel_of(Schedule::interleaved, placement));
  const auto in = inputs(c, 30, 12);
  layer.forward(in.x).backward(view(in.d_out));
  update(layer.weights(WeightChange{}), 0.5f);
  update(w, 0.5f);
  Fresh fresh(c, w, 30, in, layer.parallel());
  auto step = layer.forward(in.x);
  step.backward(view(in.d_out));
  EXPECT_TRUE(bit_identical(step.out(), fresh.r.out));
  EXPECT_TRUE(bit_identical(step.gradients(), fresh.r.grads));
  // Packed straight from Hugging Face projections: the split experts' parts
  // are cut from the math layout, which follows the packing first.
  scale_experts(w, all_experts(c), -0.75f, 1.5f);
  update_from_hf(layer, c, w, all_experts(c));
  expect_fresh_step(layer, c, w, in, "split experts after update_experts");
}

// An online revision between steps: the kept layer takes a new placement
// (new replicas fetch their weights from their owners, so nothing is loaded),
// rebuilds its idle engine on it, and its next step is bit for bit a fresh
// layer's on that placement, after a weight update too.
TEST(LayerFace, TakesANewPlacementBetweenSteps) {
  LayerConfig c = small_layer(DType::fp32);
  c.ranks = 3;
  c.routed_experts = 8;
  const ExpertPlacement::Rules fetched{.replicas = true, .fetch_replicas = true};
  const auto first = ExpertPlacement::from_rank_lists(8, {{0, 1, 2, 5}, {3, 4, 5, 0}, {6, 7, 1}}, fetched);
  const auto revised = ExpertPlacement::from_rank_lists(8, {{0, 1, 2, 7}, {3, 4, 5, 6}, {6, 7, 0, 3}}, fetched);
  auto w = random_weights(c, 17);
  Layer layer(c, w, parallel_of(Schedule::interleaved, first));
  const auto in = inputs(c, 30, 18);
  layer.forward(in.x).backward(view(in.d_out));
  update(layer.weights(WeightChange{}), 0.5f);
  update(w, 0.5f);
  layer.set_placement(revised);
  EXPECT_EQ(layer.parallel().placement, revised);
  Fresh fresh(c, w, 30, in, layer.parallel());
  auto step = layer.forward(in.x);
  step.backward(view(in.d_out));
  EXPECT_TRUE(bit_identical(step.out(), fresh.r.out));
  EXPECT_TRUE(bit_identical(step.gradients(), fresh.r.grads));
  EXPECT_EQ(layer.engines(), 1u) << "the idle engine was rebuilt, not added";
  // The step ran on the revised placement: its exchange is that one's, not the first's.
  Parallel before = layer.parallel();
  before.placement = first;
  const Fresh old(c, w, 30, in, before);
  EXPECT_NE(old.r.forward_put_bytes, fresh.r.forward_put_bytes);
  EXPECT_EQ(step.result().forward_put_bytes, fresh.r.forward_put_bytes);
  // One that does not fit the layer is refused, and nothing changes.
  EXPECT_THROW(layer.set_placement(ExpertPlacement::contiguous(8, 2)), Error);
  EXPECT_EQ(layer.parallel().placement, revised);
}

TEST(LayerFace, WritesIntoTheCallersMemoryAndReusesDroppedResults) {
  const LayerConfig c = small_layer(DType::fp32);
  const auto w = random_weights(c, 13);
  Layer layer(c, w, parallel_of(Schedule::interleaved));
  const auto in = inputs(c, 16, 14);
  Matrix out(in.x.rows, c.hidden), dx(in.x.rows, c.hidden);
  Fresh fresh(c, w, 16, in, layer.parallel());
  {
    auto step = layer.forward(view(in.x), {}, MutableMatrixView{out.data.data(), out.rows, out.cols, out.cols});
    EXPECT_EQ(step.out().rows, 0);  // written into `out` instead
    step.backward(view(in.d_out), MutableMatrixView{dx.data.data(), dx.rows, dx.cols, dx.cols});
    EXPECT_TRUE(bit_identical(out, fresh.r.out));
    EXPECT_TRUE(bit_identical(dx, fresh.r.grads.x));
  }
  // The dropped step's gradient buffers serve the next step.
  auto next = layer.forward(in.x);
  next.backward(view(in.d_out));
  EXPECT_TRUE(bit_identical(next.gradients(), fresh.r.grads));
}

// Tracing plugs in as an observer: told of every forward and backward, with
// a slice per task when it asks for them, and the results do not change.
TEST(LayerFace, ObserversSeeEveryStepAndItsTrace) {
  struct Counter : StepObserver {
    bool wants_trace() const override { return true; }
    void on_forward(const StepResult& r) override {
      ++forwards;
      slices += r.trace.size();
      kept = r.expert_counts;
    }
    void on_backward(const StepResult& r) override {
      ++backwards;
      slices += r.trace.size();
    }
    int forwards = 0, backwards = 0;
    std::size_t slices = 0;
    std::vector<std::int64_t> kept;
  };
  const LayerConfig c = small_layer(DType::fp32);
  const auto w = random_weights(c, 17);
  auto counter = std::make_shared<Counter>();
  Parallel p = parallel_of(Schedule::interleaved);
  p.observers.push_back(counter);
  Layer layer(c, w, p);
  const auto in = inputs(c, 20, 18);
  Fresh fresh(c, w, 20, in, parallel_of(Schedule::interleaved));
  auto step = layer.forward(in.x);
  EXPECT_EQ(counter->forwards, 1);
  EXPECT_EQ(counter->backwards, 0);
  const std::size_t forward_slices = counter->slices;
  EXPECT_GT(forward_slices, 0u);
  EXPECT_EQ(counter->kept, fresh.r.expert_counts);
  step.backward(view(in.d_out));
  EXPECT_EQ(counter->backwards, 1);
  EXPECT_GT(counter->slices, forward_slices);
  EXPECT_TRUE(bit_identical(step.out(), fresh.r.out));
  EXPECT_TRUE(bit_identical(step.gradients(), fresh.r.grads));
}

// One layer running both schedules, step by step (hpmoe run --mode both):
// each step of either is bit-identical to the other's and to a fresh
// engine, over steps whose tokens, routing and weights change, and the
// layer keeps one engine per schedule.
TEST(LayerFace, BothSchedulesOnOneLayerAgreeStepByStep) {
  for (const DType dtype : {DType::fp32, DType::bf16}) {
    const LayerConfig c = small_layer(dtype);
    auto w = random_weights(c, 21);
    Layer layer(c, w, parallel_of(Schedule::interleaved));
    const ForwardOptions serialized{.schedule = Schedule::serialized};
    for (int step = 0; step < 4; ++step) {
      const std::int64_t T = step == 2 ? 5 : 24 + 8 * step;
      const auto in = inputs(c, T, 300 + static_cast<std::uint64_t>(step));
      auto a = layer.forward(in.x);
      a.backward(view(in.d_out));
      auto b = layer.forward(view(in.x), serialized);
      b.backward(view(in.d_out));
      EXPECT_TRUE(bit_identical(a.out(), b.out())) << "step " << step;
      EXPECT_TRUE(bit_identical(a.gradients(), b.gradients())) << "step " << step;
      const Fresh fresh(c, w, T, in, parallel_of(Schedule::serialized));
      EXPECT_TRUE(bit_identical(b.out(), fresh.r.out)) << "step " << step;
      EXPECT_TRUE(bit_identical(b.gradients(), fresh.r.grads)) << "step " << step;
      update(layer.weights(WeightChange{}), 0.9f);  // an optimizer step between steps
      update(w, 0.9f);
    }
    EXPECT_EQ(layer.engines(), 2u);  // one per schedule, reused
  }
}

TEST(LayerFace, BadCallsSayWhatIsWrong) {
  const LayerConfig c = small_layer(DType::fp32);
  Layer layer(c, random_weights(c, 15), parallel_of(Schedule::interleaved));
  const auto in = inputs(c, 8, 16);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  Matrix odd(3, c.hidden);  // 3 tokens cannot be shared by 2 ranks
  EXPECT_NE(message([&] { layer.forward(odd); }).find("cannot share evenly"), std::string::npos);
  Matrix narrow(4, c.hidden - 1);
  EXPECT_NE(message([&] { layer.forward(narrow); }).find("input x has shape"), std::string::npos);
  auto step = layer.forward(in.x);
  step.backward(view(in.d_out));
  EXPECT_NE(message([&] { step.backward(view(in.d_out)); }).find("already run"), std::string::npos);
  // Expert gradient views: one per expert, each of the transposed shape.
  Matrix big(2 * c.expert_inter, c.hidden), small(c.hidden, c.expert_inter);
  BackwardOptions views;
  views.experts.resize(1);
  EXPECT_NE(message([&] { layer.forward(in.x).backward(view(in.d_out), views); }).find("1 given, the layer has"),
            std::string::npos);
  views.experts.assign(static_cast<std::size_t>(c.routed_experts), {});
  views.experts[2].w1_t = MutableMatrixView{big.data.data(), big.rows, big.cols, big.cols};
  views.experts[2].w2_t = MutableMatrixView{small.data.data(), small.rows - 1, small.cols, small.cols};
  EXPECT_NE(message([&] { layer.forward(in.x).backward(view(in.d_out), views); }).find("expert 2's gradient view w2_t must be"),
            std::string::npos);
  EXPECT_NE(message([&] { layer.weights(WeightChange::only_experts({99})); }).find("expert 99"), std::string::npos);
  // Hugging Face projections: one set per expert, of the layer's shapes.
  const LayerWeights kept = layer.weights();
  HfExpert hf(c, kept, 2);
  HfMlp narrow_up = hf.views;
  narrow_up.up_proj.cols -= 1;
  EXPECT_NE(message([&] { layer.update_experts(std::vector<std::int32_t>{2}, std::vector<HfMlp>{narrow_up}); })
                .find("mlp.experts.2.up_proj.weight has shape"),
            std::string::npos);
  EXPECT_NE(message([&] { layer.update_experts(std::vector<std::int32_t>{2, 3}, std::vector<HfMlp>{hf.views}); })
                .find("2 experts but 1 sets"),
            std::string::npos);
  EXPECT_NE(message([&] { layer.update_experts(std::vector<std::int32_t>{99}, std::vector<HfMlp>{hf.views}); })
                .find("expert 99 is not one this layer holds"),
            std::string::npos);
  LayerWeights bits_of = kept;
  HfExpertBf16 hf_bits(c, bits_of, 2);
  EXPECT_NE(message([&] { layer.update_experts(std::vector<std::int32_t>{2}, std::vector<HfMlpBf16>{hf_bits.views}); })
                .find("packed as they are by a bf16 layer; this layer is fp32"),
            std::string::npos);
  LayerWeights wrong_router = kept;
  wrong_router.router = Matrix(c.hidden + 1, c.routed_experts);
  EXPECT_NE(message([&] { layer.update_replicated(wrong_router); }).find("router weight has shape"), std::string::npos);
  Parallel bad;
  bad.workers_per_rank = 0;
  EXPECT_NE(message([&] { Layer(c, random_weights(c, 1), bad); }).find("workers_per_rank"), std::string::npos);
  Parallel fetching = parallel_of(Schedule::interleaved);
  fetching.expert_source = [](std::int64_t, LayerWeights&) {};
  EXPECT_NE(message([&] { Layer(c, random_weights(c, 1), fetching); }).find("give it with a transport"), std::string::npos);
  // A failed forward leaves the layer usable.
  auto again = layer.forward(in.x);
  again.backward(view(in.d_out));
  EXPECT_EQ(again.gradients().x.rows, in.x.rows);
}
