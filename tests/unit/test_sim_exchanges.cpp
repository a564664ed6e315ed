// The rows a DeepEP-style exchange moves (a token once per node across
// nodes), and --exchange / --dispatch-dtype auto, which choose among
// simulated exchanges.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "source_dir.hpp"
#include "hpmoe/error.hpp"
#include "sim/sim.hpp"
#include <nlohmann/json.hpp>

using namespace hpmoe;
using namespace hpmoe::sim;

TEST(DeepEp, NodeDeduplicatedExchangeAndItsBytes) {
  // 4 ranks, 2 per node, 1 expert per rank. Token 0 of rank 0 picks experts
  // 1, 2 and 3: rank 1 is in its node (direct), ranks 2 and 3 in the other
  // node: one RDMA row to rank 2 (the same-index rank there), forwarded to 3.
  LayerConfig c = preset("tiny");
  c.ranks = 4;
  c.routed_experts = 4;
  c.top_k = 3;
  c.tokens_per_rank = 1;
  RouterOutput<float> r;
  r.tokens = 4;
  r.experts = 4;
  r.top_k = 3;
  r.expert = {1, 2, 3, /* rank 1 */ 0, 1, 2, /* rank 2 */ 3, 0, 1, /* rank 3 */ 2, 3, 0};
  r.kept.assign(12, 1);
  r.kept[11] = 0;  // rank 3's choice of expert 0 dropped
  const auto placement = placement_or_contiguous(ExpertPlacement{}, 4, 4);
  const auto ex = deepep_exchange(c, placement, r, 2);
  EXPECT_EQ(ex.nodes, 2);
  EXPECT_EQ(ex.dispatch_rank[0 * 4 + 1], 1);     // 0 -> 1 in its node
  EXPECT_EQ(ex.dispatch_node[0 * 2 + 1], 1);     // 0 -> node 1 once, not twice
  EXPECT_EQ(ex.dispatch_forward[2 * 4 + 3], 1);  // rank 2 forwards it to 3
  EXPECT_EQ(ex.dispatch_node[1 * 2 + 1], 1);     // rank 1's token to expert 2: RDMA to rank 3, the same index
  EXPECT_EQ(ex.dispatch_forward[3 * 4 + 2], 1);  // which forwards it to rank 2
  EXPECT_EQ(ex.dispatch_node[3 * 2 + 0], 0);     // rank 3's only cross-node choice was dropped
  EXPECT_EQ(ex.dispatch_node[2 * 2 + 0], 1);     // rank 2's token to experts 0 and 1: once to rank 0 ...
  EXPECT_EQ(ex.dispatch_forward[0 * 4 + 1], 1);  // ... which forwards it to rank 1
  EXPECT_EQ(ex.cross_node_rows(), 3);            // one row each from ranks 0, 1 and 2
  // DeepEP's benchmark counts: the rows each rank receives (own rank's
  // included), each rank's tokens times the nodes they reach (own node included).
  EXPECT_EQ(ex.received, (std::vector<double>{2, 3, 3, 3}));
  EXPECT_EQ(ex.node_tokens, (std::vector<double>{2, 2, 2, 1}));
}

namespace {
// Two H800 nodes, a small layer (16 ranks, 32 experts, 64 tokens a rank),
// forward + backward under RATR: what the exchange chooser is tried on.
SimRequest two_h800_nodes() {
  SimRequest req;
  req.config = preset("tiny");
  req.config.ranks = 16;
  req.config.routed_experts = 32;
  req.config.tokens_per_rank = 64;
  req.routing = parse_routing_spec("uniform", 3);
  req.backward = true;
  req.policy = taskflow::Policy::ratr;
  return req;
}
double fused_seconds(const SimReport& r) { return r.forward.interleaved_s + r.backward.interleaved_s; }
}  // namespace

TEST(ChooseExchange, AutoRunsTheFasterSchemeAndSaysWhatTheOtherTook) {
  // Each scheme simulated alone, and auto returns exactly the faster one's
  // report, naming the other's time.
  const MachineModel m = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json");
  SimRequest req = two_h800_nodes();
  req.config.dtype = DType::bf16;
  const auto fused = fused_seconds;
  SimRequest assignment = req, rank = req;
  rank.config.exchange = ExchangeMode::rank;
  const double a = fused(simulate(m, assignment)), r = fused(simulate(m, rank));
  const SimReport chosen = simulate_choosing_exchange(m, req);
  EXPECT_DOUBLE_EQ(fused(chosen), std::min(a, r));
  EXPECT_EQ(chosen.config.exchange, a <= r ? ExchangeMode::assignment : ExchangeMode::rank);
  EXPECT_NE(chosen.exchange_choice.find(a <= r ? "per node" : "per assignment"), std::string::npos) << chosen.exchange_choice;
  EXPECT_NE(format_report(chosen).find("exchange auto: "), std::string::npos);
  // A layer only one scheme can take: the other is named as impossible.
  req.config.combine_dtype = CombineDType::bf16;  // the per-rank combine's sums in bf16: needs the per-rank exchange
  req.config.dtype = DType::fp32;
  const SimReport only_rank = simulate_choosing_exchange(m, req);
  EXPECT_EQ(only_rank.config.exchange, ExchangeMode::rank);
  EXPECT_NE(only_rank.exchange_choice.find("per assignment not possible"), std::string::npos) << only_rank.exchange_choice;
}

TEST(ChooseExchange, DispatchDtypeAutoRunsTheFastestWireAndKeepsAGivenScheme) {
  // An fp32 layer on two H800 nodes: its own fp32 wire, bf16 and fp8 each
  // simulated alone; with the scheme given, auto chooses among the wires
  // only and returns exactly the fastest one's report.
  const MachineModel m = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json");
  SimRequest req = two_h800_nodes();
  req.config.hidden = 256;
  req.config.exchange = ExchangeMode::rank;
  const auto fused = fused_seconds;
  double best = 1e30;
  DispatchDType fastest = DispatchDType::layer;
  for (const DispatchDType wire : {DispatchDType::layer, DispatchDType::bf16, DispatchDType::fp8}) {
    SimRequest one = req;
    one.config.dispatch_dtype = wire;
    if (const double t = fused(simulate(m, one)); t < best) {
      best = t;
      fastest = wire;
    }
  }
  req.choose_scheme = false;
  req.choose_dispatch_dtype = true;
  const SimReport chosen = simulate_choosing_exchange(m, req);
  EXPECT_EQ(chosen.config.exchange, ExchangeMode::rank);
  EXPECT_EQ(chosen.config.dispatch_dtype, fastest);
  EXPECT_DOUBLE_EQ(fused(chosen), best);
  for (const char* wire : {"with layer dispatch", "with bf16 dispatch", "with fp8 dispatch"})
    EXPECT_NE(chosen.exchange_choice.find(wire), std::string::npos) << chosen.exchange_choice;
  // A wire the layer cannot take is named, not chosen: fp8 needs hidden a multiple of 128.
  req.config.hidden = 192;
  const SimReport no_fp8 = simulate_choosing_exchange(m, req);
  EXPECT_NE(no_fp8.config.dispatch_dtype, DispatchDType::fp8);
  EXPECT_NE(no_fp8.exchange_choice.find("with fp8 dispatch not possible"), std::string::npos) << no_fp8.exchange_choice;
}

// The per-node exchange's report says how its tokens crossed: most straight
// where a rank holds few experts (uniform routing, 16 ranks of 2 experts, 8
// a node), none through a hot rank; a hot expert's rank takes its tokens
// through the forwarders.
TEST(NodeRoute, TheReportSaysHowTheTokensCrossed) {
  const MachineModel m = load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json");
  SimRequest req = two_h800_nodes();
  req.backward = false;
  req.config.exchange = ExchangeMode::rank;
  req.config.ranks_per_node = 8;
  const SimReport uniform = simulate(m, req);
  const auto& n = uniform.node_route;
  EXPECT_GT(n.crossings, 0);
  EXPECT_GT(n.direct, n.crossings / 2) << n.direct << " of " << n.crossings;
  EXPECT_EQ(n.hot_ranks, 0);
  EXPECT_NE(format_report(uniform).find("of the token crossings into other nodes straight"), std::string::npos);
  EXPECT_EQ(to_json(uniform)["node_route"]["direct"].get<std::int64_t>(), n.direct);
  req.routing = parse_routing_spec("hot:0.25", 3);
  EXPECT_GE(simulate(m, req).node_route.hot_ranks, 1);
  req.config.node_forwarding = false;  // straight: no node route to report
  EXPECT_EQ(simulate(m, req).node_route.crossings, 0);
  EXPECT_EQ(format_report(simulate(m, req)).find("token crossings"), std::string::npos);
}
