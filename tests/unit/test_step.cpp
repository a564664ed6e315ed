// The training-step model (sim/step.hpp): the ways it compares add up from
// the simulated MoE layer and the costed blocks, and it refuses what it
// cannot model.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "hpmoe/error.hpp"
#include "sim/step.hpp"

using namespace hpmoe;
using namespace hpmoe::sim;

namespace {

StepRequest small_step(std::int64_t layers, std::int64_t dense) {
  StepRequest req;
  req.moe.config = preset("tiny");
  req.moe.config.set("ranks", "2");
  req.moe.config.set("tokens_per_rank", "64");
  req.moe.config.validate();
  req.moe.routing = parse_routing_spec("uniform", 1);
  req.layers = layers;
  req.dense_layers = dense;
  req.seq_len = 256;
  return req;
}

const StepWay& way(const StepReport& r, const std::string& name) {
  for (const auto& w : r.ways)
    if (w.name == name) return w;
  throw Error("no way " + name);
}

}  // namespace

TEST(StepModel, UnoverlappedWaysAreTheBlocksPlusTheSimulatedLayer) {
  const MachineModel m = load_machine("ascend-a3");
  StepRequest req = small_step(6, 2);
  req.other_s = 1e-3;
  const StepReport r = simulate_step(m, req);
  // serialized, MindSpore-style and fused, each alone and with micro-batches
  ASSERT_EQ(r.ways.size(), 6u);
  EXPECT_EQ(r.baseline, "MindSpore-style");
  const double blocks_fwd = 6 * r.attention.total() + 2 * r.dense.total();
  const auto& ser = way(r, "serialized");
  EXPECT_NEAR(ser.forward_s, blocks_fwd + 4 * r.layer.forward.serialized_s, 1e-12);
  EXPECT_NEAR(ser.backward_s, 2 * blocks_fwd + 4 * r.layer.backward.serialized_s + 1e-3, 1e-12);
  const auto& fused = way(r, "fused (hpmoe)");
  EXPECT_NEAR(fused.forward_s, blocks_fwd + 4 * r.layer.forward.interleaved_s, 1e-12);
  EXPECT_NEAR(way(r, "MindSpore-style").moe_forward_s, r.layer.forward.mindspore_s, 1e-15);
  for (const auto& w : r.ways) EXPECT_NEAR(w.step_s(), w.forward_s + w.backward_s, 1e-15);
}

TEST(StepModel, MicroBatchesHideTheExchangeUnderTheOtherMicroBatchsCompute) {
  const MachineModel m = load_machine("ascend-a3");
  StepRequest req = small_step(1, 0);
  req.comm_share = 0;
  const StepReport r = simulate_step(m, req);
  const PassResult& half = r.half.forward;
  const double attention = r.attention_half.total();
  const double exchange = half.serialized_exposed_comm * half.serialized_s;
  const double compute = attention + half.serialized_s - exchange;
  ASSERT_GT(exchange, 0);
  // Two phases of max(compute, exchange): the exchange is hidden unless it is longer.
  EXPECT_NEAR(way(r, "serialized + 2 micro-batches").forward_s, 2 * std::max(compute, exchange), 1e-12);
  // The share of units the exchange takes slows the overlapped compute.
  req.comm_share = 0.5;
  const StepReport slowed = simulate_step(m, req);
  EXPECT_NEAR(way(slowed, "serialized + 2 micro-batches").forward_s,
              2 * std::max(compute + 0.5 * std::min(exchange, compute), exchange), 1e-12);
}

// The fused run hides its exchange under compute, not off the links: two
// micro-batches carry twice the bytes over the same links, so the fused way
// with micro-batches takes at least twice one micro-batch's busiest link
// (at EP 64 on the H800 model it was credited with less before 2026-12-07).
TEST(StepModel, TwoFusedMicroBatchesTakeAtLeastTwiceTheirBusiestLink) {
  const MachineModel m = load_machine("ascend-a3");
  StepRequest req = small_step(1, 0);
  const StepReport r = simulate_step(m, req);
  for (const PassResult* half : {&r.half.forward, &r.half.backward}) {
    EXPECT_GT(half->interleaved_link_busy_s, 0);
    // A link carries its bytes within the run that sends them.
    EXPECT_LE(half->interleaved_link_busy_s, half->interleaved_s);
  }
  const StepWay& fused = way(r, "fused (hpmoe) + 2 micro-batches");
  EXPECT_GE(fused.moe_forward_s, 2 * r.half.forward.interleaved_link_busy_s);
  EXPECT_GE(fused.moe_backward_s, 2 * r.half.backward.interleaved_link_busy_s);
  // Exactly the phases or the links, whichever is longer.
  const PassResult& half = r.half.forward;
  const double exchange = half.interleaved_exposed_comm * half.interleaved_s;
  EXPECT_NEAR(fused.moe_forward_s,
              micro_batched_layer_s(half.interleaved_s - exchange, exchange, req.comm_share, half.interleaved_link_busy_s), 1e-15);
  // Where the links bind (the H800 model at EP 64: 7.37 ms a micro-batch,
  // 40% exposed, its busiest NIC 6.87 ms), they are the layer's time.
  EXPECT_NEAR(micro_batched_layer_s(7.37 - 2.95, 2.95, 20.0 / 132.0, 6.87), 13.74, 1e-12);
  EXPECT_NEAR(micro_batched_layer_s(7.37 - 2.95, 2.95, 20.0 / 132.0), 2 * (4.42 + 2.95 * 20.0 / 132.0), 1e-12);
  EXPECT_NEAR(micro_batched_layer_s(3.0, 0, 0.5, 1.0), 6.0, 1e-12);
}

TEST(StepModel, LayersThatAreAlikeShareOneSimulation) {
  const MachineModel m = load_machine("h800");
  const StepReport one = simulate_step(m, small_step(1, 0));
  const StepReport many = simulate_step(m, small_step(64, 0));
  for (std::size_t i = 0; i < one.ways.size(); ++i) EXPECT_NEAR(many.ways[i].step_s(), 64 * one.ways[i].step_s(), 1e-9);
  EXPECT_EQ(many.baseline, "DeepEP-style");
  const auto j = to_json(many);
  EXPECT_EQ(j["ways"].size(), many.ways.size());
  EXPECT_EQ(j["layers"], 64);
}

TEST(StepModel, MeasuredBlockTimesReplaceTheEstimate) {
  const MachineModel m = load_machine("cpu-local");
  StepRequest req = small_step(2, 1);
  req.attention_s = 4e-3;
  req.dense_s = 2e-3;
  EXPECT_DOUBLE_EQ(attention_cost(m, req, 64).total(), 4e-3);
  EXPECT_DOUBLE_EQ(attention_cost(m, req, 32).total(), 2e-3);  // in proportion to the tokens
  EXPECT_DOUBLE_EQ(dense_cost(m, req, 64).total(), 2e-3);
  req.attention_s = -1;
  const double small = attention_cost(m, req, 64).total();
  req.attention_params = 64.0 * 4 * req.moe.config.hidden * req.moe.config.hidden;
  EXPECT_GT(attention_cost(m, req, 64).total(), small);
}

TEST(StepModel, RefusesWhatItCannotModel) {
  const MachineModel m = load_machine("cpu-local");
  auto expect_error = [&](StepRequest req, const char* needle) {
    try {
      simulate_step(m, req);
      ADD_FAILURE() << "accepted, expected an error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(small_step(0, 0), "--layers");
  expect_error(small_step(2, 3), "--dense-layers");
  StepRequest one_token = small_step(2, 0);
  one_token.moe.config.tokens_per_rank = 1;
  expect_error(one_token, "2 tokens");
  StepRequest share = small_step(2, 0);
  share.comm_share = 1;
  expect_error(share, "--comm-share");
}

TEST(StepModel, TheStacksParametersAreCountedAgainstTheRanksMemory) {
  const MachineModel m = load_machine("h800");
  StepRequest req = small_step(4, 1);
  const StepReport r = simulate_step(m, req);
  const auto& moe = r.layer.memory;
  const double h = double(req.moe.config.hidden);
  // bf16? tiny is fp32: 4 bytes a weight and 4 a gradient, attention 4 h^2, dense 3 h 4h.
  const double per = 4.0 + 4.0;
  const double expected = 3 * (moe.weights + moe.gradients + moe.optimizer) + (4 * 4 * h * h + 1 * 3 * h * 4 * h) * per;
  EXPECT_NEAR(r.stack_parameter_bytes, expected, 1e-6 * expected);
  req.moe.optimizer_state = true;
  EXPECT_GT(simulate_step(m, req).stack_parameter_bytes, r.stack_parameter_bytes);
  EXPECT_NE(format_step_report(r).find("activations not counted"), std::string::npos);
}

// Issue 58, class 8: an odd T splits into micro-batches of (T + 1) / 2 and
// T / 2, modelled at the larger (T = 3 was modelled as micro-batches of 1
// token); the table keeps a space between columns however large the times;
// the chart says where the blocks' times came from.
TEST(StepModel, OddTokensLargeTimesAndGivenTimesAreReportedAsTheyAre) {
  const MachineModel m = load_machine("ascend-a3");
  StepRequest req = small_step(4, 1);
  req.moe.config.tokens_per_rank = 3;
  EXPECT_EQ(micro_batch_tokens(3), 2);
  EXPECT_EQ(micro_batch_tokens(64), 32);
  const StepReport odd = simulate_step(m, req);
  EXPECT_EQ(odd.half.config.tokens_per_rank, 2);
  EXPECT_NE(format_step_report(odd).find("micro-batches of 2 and 1, both modelled at the larger"), std::string::npos);
  EXPECT_NE(step_chart_svg(odd).find("blocks from FLOPs"), std::string::npos);

  req.moe.config.tokens_per_rank = 64;
  req.attention_s = 5e3;  // 5,000 s a layer: every time in the table is wider than its column
  req.dense_s = 5e3;
  const StepReport slow = simulate_step(m, req);
  const std::string table = format_step_report(slow);
  for (const auto& w : slow.ways) {
    const auto at = table.find("  " + w.name + " ");
    ASSERT_NE(at, std::string::npos) << w.name;
    const std::string line = table.substr(at, table.find('\n', at) - at);
    // Between the numbers there is always a space: no two of them run together.
    std::istringstream fields(line.substr(2 + 34));
    int numbers = 0;
    for (std::string f; fields >> f;)
      if (f != "/") ++numbers;
    EXPECT_EQ(numbers, 6) << line;
  }
  EXPECT_NE(step_chart_svg(slow).find("blocks as given"), std::string::npos);
}
