// `hpmoe plan` (src/cli/plan.cpp): the greedy search for replicas and
// tensor-parallel splits on a machine model's expert costs.
#include <gtest/gtest.h>

#include "source_dir.hpp"
#include "cli/plan.hpp"
#include "hpmoe/error.hpp"

using namespace hpmoe;

namespace {
// 16 experts on 4 ranks with a hot expert (0) taking 30% of the rows.
PlanRequest hot_expert_request() {
  PlanRequest req;
  req.config = preset("tiny");
  req.config.ranks = 4;
  req.config.routed_experts = 16;
  req.config.tokens_per_rank = 1024;  // the hot expert: ~20 row tiles, the others ~3
  req.routing = parse_routing_spec("hot:0.3", 3);
  req.machine = std::string(HPMOE_SOURCE_DIR) + "/machines/cpu-local.json";
  req.steps = 4;
  return req;
}
}  // namespace

// `hpmoe plan`: replicas chosen on the machine's cost model lower the
// predicted slowest rank and the rank imbalance, within the slot budget, and
// the same request gives the same placement.
TEST(Plan, ReplicatesTheHotExpertWithinTheBudgetAndDeterministically) {
  PlanRequest req = hot_expert_request();
  const auto a = plan_placement(req);
  EXPECT_GT(a.replicas, 0);
  EXPECT_LT(a.imbalance_after, a.imbalance_before);
  EXPECT_LT(a.cost_after, a.cost_before);
  EXPECT_LE(a.after.max_local_count(), a.before.max_local_count() + 1);  // default budget: one more slot
  EXPECT_GT(a.after.home_count(0), 1) << "the hot expert (0) was not replicated";
  EXPECT_EQ(a.after, plan_placement(req).after);
  req.slots_per_rank = 3;  // below the 4 experts a rank already holds
  EXPECT_THROW(plan_placement(req), Error);
  // The cost model: weight streaming dominates one tile, tiles dominate many.
  const auto cost = ExpertCostModel::from(sim::load_machine(req.machine), req.config, true);
  EXPECT_GT(cost.first_tile_s, cost.tile_s);
  EXPECT_EQ(cost.instance_seconds(0), 0.0);
  EXPECT_DOUBLE_EQ(cost.instance_seconds(cost.tile_rows), cost.first_tile_s);
  EXPECT_DOUBLE_EQ(cost.instance_seconds(2 * cost.tile_rows), cost.first_tile_s + cost.tile_s);
  // A short tile costs its true rows: less than a whole tile, more than
  // nothing, and more rows cost more (row-granular quotas end mid-tile).
  EXPECT_LT(cost.instance_seconds(1), cost.first_tile_s);
  EXPECT_GT(cost.instance_seconds(1), 0.0);
  EXPECT_LT(cost.instance_seconds(cost.tile_rows + 1), cost.first_tile_s + cost.tile_s);
  EXPECT_GT(cost.instance_seconds(cost.tile_rows + 1), cost.first_tile_s);
  EXPECT_LT(cost.instance_seconds(cost.tile_rows + 10), cost.instance_seconds(cost.tile_rows + 11));
}

// `hpmoe plan --splits --no-replicas`: a static hybrid TP/EP mapping. The hot
// rank's experts are split into column parts that tile their intermediate dimension,
// the predicted slowest rank and imbalance fall, and the placement is valid.
TEST(Plan, SplitsTheHotExpertIntoColumnParts) {
  PlanRequest req = hot_expert_request();
  req.splits = true;
  req.replicas = false;
  const auto a = plan_placement(req);
  EXPECT_EQ(a.replicas, 0);
  EXPECT_GT(a.split_parts, 0);
  ASSERT_TRUE(a.after.has_splits());
  // The hottest rank's experts are split first (rank 0: the hot expert and
  // its neighbours). A later split may relieve the rank that a part moved
  // to, which the greedy planner may then find the slowest.
  bool hot_rank_split = false;
  for (const auto& sp : a.after.splits()) hot_rank_split = hot_rank_split || a.before.owner(sp.expert) == 0;
  EXPECT_TRUE(hot_rank_split) << "no expert of the hot rank was split";
  EXPECT_FALSE(a.after.has_replicas());
  EXPECT_LT(a.imbalance_after, a.imbalance_before);
  EXPECT_LT(a.cost_after, a.cost_before);
  EXPECT_NO_THROW(a.after.check_fits(16, 4, req.config.expert_inter));
  EXPECT_EQ(a.after, plan_placement(req).after);
  // The split's cost: a part's share of the columns, plus its rows' link time.
  const auto cost = ExpertCostModel::from(sim::load_machine(req.machine), req.config, true);
  EXPECT_GT(cost.part_row_s, 0.0);
}
