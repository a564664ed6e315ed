// A kept layer over several steps whose routing, token count and weights
// change, for every exchange and placement feature: each step is bit for bit
// what a fresh engine built for that step computes (forward and every
// gradient). The first version of the per-rank exchange failed here at its
// second step: the engine carried the last step's token counts into the
// next step's exchange (issue 58, class 1). Tests that run one step per
// layer cannot see such state.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "bit_identity.hpp"
#include "fresh_engine.hpp"

#include "hpmoe/hpmoe.hpp"
#include "runtime/interleaved.hpp"

using namespace hpmoe;
using hpmoe::testing::bit_identical;
using hpmoe::testing::fresh_step;

namespace {

// One step of the sequence: its tokens per rank, how it is routed (the
// router, or a forced routing that moves the load), and whether the
// placement changes before it (an online revision).
struct StepPlan {
  std::int64_t tokens;
  const char* routing;
  bool revise = false;
};

constexpr StepPlan kSteps[] = {
    {24, "router"}, {61, "zipf:1.5"}, {9, "hot:0.45", true}, {40, "router"}, {17, "uniform", true}, {33, "zipf:0.8"},
};

struct Case {
  std::string name;
  LayerConfig layer;
  ExpertPlacement first, revised;  // empty: contiguous, and no revision
  Schedule schedule = Schedule::interleaved;
  WorkerThreads threads = WorkerThreads::own;  // the kept layer's (the fresh engines run on their own)
};
void PrintTo(const Case& k, std::ostream* os) { *os << k.name; }

LayerConfig base_layer(std::int64_t ranks, DType dtype) {
  LayerConfig c = preset("tiny");
  c.hidden = 96;
  c.expert_inter = 48;
  c.routed_experts = 8;
  c.dtype = dtype;
  c.ranks = ranks;
  c.tokens_per_rank = 8;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const auto add = [&](std::string name, LayerConfig c, ExpertPlacement first = {}, ExpertPlacement revised = {},
                       Schedule schedule = Schedule::interleaved, WorkerThreads threads = WorkerThreads::own) {
    c.validate();
    out.push_back({std::move(name), c, std::move(first), std::move(revised), schedule, threads});
  };
  const auto rank = [](LayerConfig c, std::int64_t per_node = 0) {
    c.exchange = ExchangeMode::rank;
    c.ranks_per_node = per_node;
    return c;
  };
  add("assignment", base_layer(2, DType::fp32));
  add("assignment_serialized", base_layer(2, DType::fp32), {}, {}, Schedule::serialized);
  add("rank", rank(base_layer(2, DType::fp32)));
  add("rank_bf16", rank(base_layer(2, DType::bf16)));
  add("rank_serialized", rank(base_layer(2, DType::fp32)), {}, {}, Schedule::serialized);
  add("node", rank(base_layer(4, DType::fp32), 2));
  // The workers on the OpenMP runtime's threads (the Python module's):
  // bit for bit what the engines on their own threads compute.
  add("rank_bf16_openmp", rank(base_layer(2, DType::bf16)), {}, {}, Schedule::interleaved, WorkerThreads::openmp);
  add("node_openmp", rank(base_layer(4, DType::fp32), 2), {}, {}, Schedule::interleaved, WorkerThreads::openmp);
  add("assignment_serialized_openmp", base_layer(2, DType::fp32), {}, {}, Schedule::serialized, WorkerThreads::openmp);
  {
    LayerConfig c = rank(base_layer(4, DType::fp32), 2);
    c.hidden = 128;  // fp8: one scale per 128 channels
    c.dispatch_dtype = DispatchDType::fp8;
    c.combine_dtype = CombineDType::bf16;
    add("node_fp8_bf16_sums", c);
  }
  {
    LayerConfig c = rank(base_layer(4, DType::fp32), 2);
    c.node_forwarding = false;
    add("rank_4_no_forwarding", c);
  }
  {
    LayerConfig c = base_layer(2, DType::fp32);
    c.lend_weights = 1;  // every pair lends: the lent pairs follow each step's counts
    add("lend", c);
    add("lend_rank", rank(c));
  }
  const ExpertPlacement::Rules held{.replicas = true};
  const ExpertPlacement::Rules fetched{.replicas = true, .fetch_replicas = true};
  const auto a_held = ExpertPlacement::from_rank_lists(8, {{0, 1, 2, 5}, {3, 4, 5, 0}, {6, 7, 1}}, held);
  const auto b_held = ExpertPlacement::from_rank_lists(8, {{0, 1, 2, 7}, {3, 4, 5, 6}, {6, 7, 0, 3}}, held);
  add("replicas", base_layer(3, DType::fp32), a_held);
  add("replicas_rank", rank(base_layer(3, DType::fp32)), a_held);
  const auto a_fetched = ExpertPlacement::from_rank_lists(8, {{0, 1, 2, 5}, {3, 4, 5, 0}, {6, 7, 1}}, fetched);
  const auto b_fetched = ExpertPlacement::from_rank_lists(8, {{0, 1, 2, 7}, {3, 4, 5, 6}, {6, 7, 0, 3}}, fetched);
  add("online_held", base_layer(3, DType::fp32), a_held, b_held);
  add("online_fetched_rank", rank(base_layer(3, DType::fp32)), a_fetched, b_fetched);
  add("online_fetched_bf16", base_layer(3, DType::bf16), a_fetched, b_fetched);
  const nlohmann::json split{{"experts_of_rank", {{0, 1, 2}, {0, 3, 4}, {5, 6, 7}}},
                             {"splits", {{{"expert", 0}, {"columns", {0, 16, 48}}}}}};
  add("split", base_layer(3, DType::fp32), placement_from_json(split, 8, 3, "test"));
  add("split_rank", rank(base_layer(3, DType::fp32)), placement_from_json(split, 8, 3, "test"));
  return out;
}

Parallel parallel_of(const Case& k, const ExpertPlacement& placement) {
  Parallel p;
  p.workers_per_rank = 2;
  p.schedule = k.schedule;
  p.pin = false;
  p.placement = placement;
  return p;
}

// A training step's update: every weight moves, and the router's columns
// are shuffled, so the next step routes differently even for the same tokens.
void update(LayerWeights& w, std::int64_t experts, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> jitter(0.9f, 1.1f);
  for (auto* group : {&w.w1, &w.w2})
    for (auto& m : *group)
      for (auto& v : m.data) v *= jitter(rng);
  for (auto& v : w.shared_w1.data) v *= jitter(rng);
  std::vector<std::int64_t> order(static_cast<std::size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const Matrix before = w.router;
  for (std::int64_t h = 0; h < before.rows; ++h)
    for (std::int64_t e = 0; e < experts; ++e) w.router.at(h, e) = before.at(h, order[static_cast<std::size_t>(e)]);
}

// Every other step's backward writes the experts' weight gradients into the
// caller's memory in Hugging Face's layout (what the PyTorch module hands
// to autograd), in float32 or in bfloat16, filled with NaN before: each
// must be the fresh engine's gradient transposed (and rounded), bit for
// bit, whether its tiles stored it there (an expert computed whole) or it
// was summed first (replicas, lent homes, split parts), idle experts' zeros included.
void backward_into_views(Layer::Step& step, const LayerConfig& c, const LayerInputs& in, const LayerGradients& fresh,
                         bool in_bf16) {
  const std::int64_t E = c.routed_experts, H = c.hidden, I = c.expert_inter, pad = 3;  // a row stride past the row
  const auto n1 = static_cast<std::size_t>(2 * I * (H + pad)), n2 = static_cast<std::size_t>(H * I);
  std::vector<std::vector<float>> w1_t(static_cast<std::size_t>(E)), w2_t(static_cast<std::size_t>(E));
  std::vector<std::vector<bf16>> b1_t(static_cast<std::size_t>(E)), b2_t(static_cast<std::size_t>(E));
  BackwardOptions options;
  options.experts.resize(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    ExpertGradientsInto& into = options.experts[static_cast<std::size_t>(e)];
    if (in_bf16) {
      b1_t[e].assign(n1, bf16::from_float(nan));
      b2_t[e].assign(n2, bf16::from_float(nan));
      into.w1_t_bf16 = {b1_t[e].data(), 2 * I, H, H + pad};
      into.w2_t_bf16 = {b2_t[e].data(), H, I, I};
    } else {
      w1_t[e].assign(n1, nan);
      w2_t[e].assign(n2, nan);
      into.w1_t = {w1_t[e].data(), 2 * I, H, H + pad};
      into.w2_t = {w2_t[e].data(), H, I, I};
    }
  }
  step.backward(view(in.d_out), options);
  const LayerGradients& g = step.gradients();
  EXPECT_TRUE(bit_identical(g.x, fresh.x) && bit_identical(g.router, fresh.router) &&
              bit_identical(g.shared_w1, fresh.shared_w1) && bit_identical(g.shared_w2, fresh.shared_w2));
  const auto value = [&](const std::vector<float>& f, const std::vector<bf16>& b, std::int64_t i) {
    return in_bf16 ? b[static_cast<std::size_t>(i)].to_float() : f[static_cast<std::size_t>(i)];
  };
  for (std::int64_t e = 0; e < E; ++e) {
    Matrix t1(H, 2 * I), t2(I, H), want1 = fresh.w1[e], want2 = fresh.w2[e];  // the views read back in the math layout
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < 2 * I; ++j) t1.at(h, j) = value(w1_t[e], b1_t[e], j * (H + pad) + h);
    for (std::int64_t i = 0; i < I; ++i)
      for (std::int64_t h = 0; h < H; ++h) t2.at(i, h) = value(w2_t[e], b2_t[e], h * I + i);
    if (in_bf16)
      for (auto* m : {&want1, &want2})
        for (float& v : m->data) v = round_to_bf16(v);
    EXPECT_TRUE(bit_identical(t1, want1) && bit_identical(t2, want2)) << "expert " << e;
  }
}

}  // namespace

class LayerAcrossSteps : public ::testing::TestWithParam<Case> {};

TEST_P(LayerAcrossSteps, EveryStepIsBitIdenticalToAFreshEngine) {
  const Case& k = GetParam();
  const LayerConfig& c = k.layer;
  auto w = random_weights(c, 31);
  const bool online = k.revised.ranks() > 0;
  ExpertPlacement current = k.first;
  Parallel kept = parallel_of(k, current);
  kept.threads = k.threads;
  Layer layer(c, w, kept);
  std::uint64_t step_index = 0;
  for (const StepPlan& s : kSteps) {
    ++step_index;
    SCOPED_TRACE("step " + std::to_string(step_index) + ": " + std::to_string(s.tokens) + " tokens per rank, routing " +
                 s.routing);
    if (online && s.revise) {
      current = current == k.first ? k.revised : k.first;
      layer.set_placement(current);
    }
    LayerConfig at = c;
    at.tokens_per_rank = s.tokens;
    const LayerInputs in = random_inputs(at, 200 + step_index);
    const std::string spec = s.routing;
    const auto forced = spec == "router" ? std::vector<std::int32_t>{}
                                         : forced_selection(at, parse_routing_spec(spec, 300 + step_index));
    const StepResult fresh = fresh_step(c, w, parallel_of(k, current), in, forced);
    auto step = layer.forward(view(in.x), forced);
    EXPECT_TRUE(bit_identical(step.out(), fresh.out));
    EXPECT_EQ(step.result().expert_counts, fresh.expert_counts);
    if (step_index % 2 == 1) {
      step.backward(view(in.d_out));
      EXPECT_TRUE(bit_identical(step.gradients(), fresh.grads));
    } else {
      backward_into_views(step, c, in, fresh.grads, step_index % 4 == 0);
    }
    // The update after the step: the kept layer's weights and the fresh
    // engines' copy move together.
    update(layer.weights(WeightChange{}), c.routed_experts, 400 + step_index);
    update(w, c.routed_experts, 400 + step_index);
  }
  EXPECT_EQ(layer.engines(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Exchanges, LayerAcrossSteps, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });
