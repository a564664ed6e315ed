// `hpmoe plan` (src/placement/plan.cpp): the greedy search for replicas and
// tensor-parallel splits on a machine model's expert costs.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "source_dir.hpp"
#include "hpmoe/planning.hpp"
#include "placement/plan.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/routing.hpp"

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
  const auto cost = cost_model_of(sim::load_machine(req.machine), req.config, true);
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
  const auto cost = cost_model_of(sim::load_machine(req.machine), req.config, true);
  EXPECT_GT(cost.part_row_s, 0.0);
}

namespace {
// A step's counts (P x E) of a routing.
std::vector<std::int64_t> counts_of(const LayerConfig& c, const std::string& routing, std::uint64_t seed, std::uint64_t step = 0) {
  RoutingSpec spec = parse_routing_spec(routing, seed);
  spec.step = step;
  const auto ids = forced_selection(c, spec);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(c.ranks * c.routed_experts), 0);
  for (std::int64_t t = 0; t < c.total_tokens(); ++t)
    for (std::int64_t j = 0; j < c.top_k; ++j) ++counts[static_cast<std::size_t>((t / c.tokens_per_rank) * c.routed_experts + ids[static_cast<std::size_t>(t * c.top_k + j)])];
  return counts;
}
// A tiny layer with `experts` experts top-4 on `ranks` ranks, and the H800 model's expert costs.
LayerConfig tiny_layer(std::int64_t ranks, std::int64_t experts, std::int64_t tokens_per_rank) {
  LayerConfig c = preset("tiny");
  c.ranks = ranks;
  c.routed_experts = experts;
  c.top_k = 4;
  c.tokens_per_rank = tokens_per_rank;
  return c;
}
ExpertCostModel h800_cost(const LayerConfig& c, bool training) {
  return cost_model_of(sim::load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json"), c, training);
}
double rank_max_over_mean_rows(const ExpertPlacement& p, const std::vector<std::int64_t>& counts) {
  const auto rows = instance_rows(p, counts);
  std::vector<double> rank(static_cast<std::size_t>(p.ranks()), 0.0);
  double total = 0;
  for (std::int64_t i = 0; i < p.instances(); ++i) rank[static_cast<std::size_t>(p.instance_rank(i))] += double(rows[static_cast<std::size_t>(i)]), total += double(rows[static_cast<std::size_t>(i)]);
  return *std::max_element(rank.begin(), rank.end()) * double(p.ranks()) / total;
}
}  // namespace

// Many experts on many ranks under Zipf (the EP 256 shape, small): the
// search fills many slots at once (EPLB's construction) and refines them,
// where one replica per move from a short candidate list stopped far from
// balance. One spare slot per rank evens the rows out to within 10%.
TEST(Plan, BalancesZipfAtLargeEpWithOneSpareSlot) {
  const LayerConfig c = tiny_layer(32, 64, 512);
  const auto cost = h800_cost(c, false);
  std::vector<std::vector<std::int64_t>> history;
  for (std::uint64_t k = 0; k < 4; ++k) history.push_back(counts_of(c, "zipf:1.2", 5, k));
  const auto start = ExpertPlacement::contiguous(c.routed_experts, c.ranks);
  const auto plan = plan_replicas(c, start, history, cost, start.max_local_count() + 1);
  EXPECT_LE(plan.max_local_count(), start.max_local_count() + 1);
  const auto held_out = counts_of(c, "zipf:1.2", 5, 9);
  EXPECT_GT(rank_max_over_mean_rows(start, held_out), 2.0);
  EXPECT_LT(rank_max_over_mean_rows(plan, held_out), 1.10);
  EXPECT_EQ(plan, plan_replicas(c, start, history, cost, start.max_local_count() + 1));  // a pure function
  EXPECT_THROW(plan_replicas(c, start, history, cost, start.max_local_count() - 1), Error);  // below what the start holds
}

// Online placement: after the routing drifts (another popularity), a
// revision from a window of the new steps gives the new hot experts homes,
// within the budget and the change limit, with their weights' bytes
// counted, and without moving an owner unless it says so; every rank gets
// the same revision from the same counts.
TEST(Plan, RevisesThePlacementAfterTheRoutingDrifts) {
  const LayerConfig c = tiny_layer(8, 32, 1024);
  const auto cost = h800_cost(c, true);
  const auto start = ExpertPlacement::contiguous(c.routed_experts, c.ranks);
  const std::int64_t budget = start.max_local_count() + 1;
  std::vector<std::vector<std::int64_t>> before, after;
  for (std::uint64_t k = 0; k < 4; ++k) before.push_back(counts_of(c, "zipf:1.3", 1, k));
  for (std::uint64_t k = 0; k < 4; ++k) after.push_back(counts_of(c, "zipf:1.3", 2, k));  // other hot experts
  const auto fixed = plan_replicas(c, start, before, cost, budget);
  const Revision r = revise_placement(c, fixed, after, cost, budget, 8, 10);
  EXPECT_GT(r.added + r.moved + r.relocated, 0);
  EXPECT_LE(r.added + r.dropped + r.moved + r.relocated, 8);
  EXPECT_LE(r.placement.max_local_count(), budget);
  EXPECT_GT(r.bytes_moved, 0.0);
  if (r.relocated == 0) {
    for (std::int64_t e = 0; e < c.routed_experts; ++e) {
      EXPECT_EQ(r.placement.owner(e), fixed.owner(e)) << "expert " << e;
    }
  }
  double fixed_rows = 0, revised_rows = 0;
  for (const auto& counts : after) fixed_rows += rank_max_over_mean_rows(fixed, counts), revised_rows += rank_max_over_mean_rows(r.placement, counts);
  EXPECT_LT(revised_rows, fixed_rows);
  EXPECT_EQ(r.placement, revise_placement(c, fixed, after, cost, budget, 8, 10).placement);
  EXPECT_EQ(revise_placement(c, fixed, after, cost, budget, 0, 10).placement, fixed);  // no change allowed
  // Bad input: a budget the placement already exceeds, an empty window,
  // counts of the wrong shape, a negative horizon.
  EXPECT_THROW(revise_placement(c, fixed, after, cost, budget - 1, 8, 10), Error);
  EXPECT_THROW(revise_placement(c, fixed, {}, cost, budget, 8, 10), Error);
  EXPECT_THROW(revise_placement(c, fixed, std::vector<std::vector<std::int64_t>>{{1, 2, 3}}, cost, budget, 8, 10), Error);
  EXPECT_THROW(revise_placement(c, fixed, after, cost, budget, 8, -1), Error);
}

// Replicas that fetch their weights (fetch_replicas): the cost model charges
// every pass's weights each step and nothing at the revision; without
// relocation no owner moves (the PyTorch module's policy: parameters and
// their optimizer state stay), a fetching placement's revision fetches, and
// the revision still follows the drift.
TEST(Plan, FetchedReplicasAreChargedEveryStepAndOwnersCanStay) {
  const LayerConfig c = tiny_layer(8, 32, 1024);
  const auto m = sim::load_machine(std::string(HPMOE_SOURCE_DIR) + "/machines/h800.json");
  const auto held = cost_model_of(m, c, true), fetched = cost_model_of(m, c, true, true);
  const auto held_inf = cost_model_of(m, c, false), fetched_inf = cost_model_of(m, c, false, true);
  const double w = held.weight_bytes, link = w / held.move_s;  // the link the weights take
  EXPECT_DOUBLE_EQ(held_inf.replica_s, 0.0);
  EXPECT_NEAR(fetched_inf.replica_s, w / link, 1e-12 * w / link);
  EXPECT_NEAR(fetched.replica_s - held.replica_s, w / link, 1e-9 * held.replica_s);  // the backward's own layout too
  const auto start = ExpertPlacement::contiguous(c.routed_experts, c.ranks);
  const std::int64_t budget = start.max_local_count() + 1;
  std::vector<std::vector<std::int64_t>> before, after;
  for (std::uint64_t k = 0; k < 4; ++k) before.push_back(counts_of(c, "zipf:1.3", 1, k));
  for (std::uint64_t k = 0; k < 4; ++k) after.push_back(counts_of(c, "zipf:1.3", 2, k));
  nlohmann::json j = to_json(plan_replicas(c, start, before, fetched, budget));
  j["replicas"] = j["fetch_replicas"] = true;
  const ExpertPlacement fixed = placement_from_json(j, c.routed_experts, c.ranks, "test");
  const Revision r = revise_placement(c, fixed, after, fetched, budget, 64, 10, /*relocate=*/false);
  EXPECT_EQ(r.relocated, 0);
  EXPECT_GT(r.added + r.moved, 0);
  EXPECT_DOUBLE_EQ(r.bytes_moved, 0.0);  // fetched replicas pay every step instead
  EXPECT_TRUE(r.placement.fetches_replicas());
  for (std::int64_t e = 0; e < c.routed_experts; ++e) EXPECT_EQ(r.placement.owner(e), fixed.owner(e)) << "expert " << e;
  // Owners that stay do not pin replicas above them: a new home below its owner.
  bool below = false;
  for (std::int64_t i = 0; i < r.placement.instances(); ++i)
    below = below || r.placement.instance_rank(i) < r.placement.owner(r.placement.instance_expert(i));
  EXPECT_TRUE(below);
  EXPECT_TRUE(r.placement.has_moved_owners());
  EXPECT_EQ(placement_from_json(to_json(r.placement), c.routed_experts, c.ranks, "round trip"), r.placement);
  // The cost model's objective: the window's mean slowest rank, lower.
  const auto mean_slowest = [&](const ExpertPlacement& p) {
    double sum = 0;
    for (const auto& counts : after) {
      const auto t = rank_seconds(p, counts, fetched);
      sum += *std::max_element(t.begin(), t.end());
    }
    return sum / double(after.size());
  };
  EXPECT_LT(mean_slowest(r.placement), mean_slowest(fixed));
  // The policy with relocation off never moves an owner either.
  OnlinePlacement policy(c, fixed, fetched, {.window = 2, .every = 2, .max_changes = 64, .drift = 0, .relocate = false});
  for (const auto& counts : after)
    if (const auto rev = policy.observe(counts)) {
      EXPECT_EQ(rev->relocated, 0);
    }
  for (std::int64_t e = 0; e < c.routed_experts; ++e) EXPECT_EQ(policy.placement().owner(e), fixed.owner(e));
}

// The online policy (hpmoe/planning.hpp): revisions on its schedule and, after a
// step that took far longer than the placement was expected to, at once and
// from that step alone; two policies fed the same counts make the same
// revisions (what every rank relies on).
TEST(Plan, OnlinePolicyRevisesOnScheduleAndAfterADrift) {
  const LayerConfig c = tiny_layer(8, 32, 1024);
  const auto cost = h800_cost(c, true);
  std::vector<std::vector<std::int64_t>> steps;
  for (std::uint64_t k = 0; k < 12; ++k) steps.push_back(counts_of(c, "zipf:1.3", 1, k));
  for (std::uint64_t k = 0; k < 12; ++k) steps.push_back(counts_of(c, "zipf:1.3", 2, k));  // other hot experts
  const auto contiguous = ExpertPlacement::contiguous(c.routed_experts, c.ranks);
  const auto start = plan_replicas(c, contiguous, std::span(steps).subspan(0, 4), cost, contiguous.max_local_count() + 1);
  const OnlinePlacement::Options options{.window = 4, .every = 10, .max_changes = 64, .drift = 0.25, .slots_per_rank = 0};
  OnlinePlacement a(c, start, cost, options), b(c, start, cost, options);
  std::vector<std::int64_t> revised_at;
  double after_drift = 0, at_drift = 0;
  for (std::size_t t = 0; t < steps.size(); ++t) {
    const auto ra = a.observe(steps[t]);
    const auto rb = b.observe(steps[t]);
    ASSERT_EQ(ra.has_value(), rb.has_value());
    if (ra) {
      EXPECT_EQ(ra->placement, rb->placement);
      EXPECT_LE(ra->placement.max_local_count(), start.max_local_count());
      revised_at.push_back(static_cast<std::int64_t>(t + 1));
    }
    if (t == 12) at_drift = a.last_step_s();
    if (t == 13) after_drift = a.last_step_s();
  }
  // Scheduled at steps 10 and 20, and once after the popularity changed at step 13.
  EXPECT_EQ(a.drifts(), 1);
  EXPECT_EQ(revised_at, (std::vector<std::int64_t>{10, 13, 20}));
  EXPECT_LT(after_drift, at_drift);  // the step after the revision runs on a placement for the new routing
  // Bad input: a window of no steps, counts of the wrong shape.
  EXPECT_THROW(OnlinePlacement(c, start, cost, {.window = 0}), Error);
  EXPECT_THROW(a.observe(std::vector<std::int64_t>{1, 2, 3}), Error);
}
