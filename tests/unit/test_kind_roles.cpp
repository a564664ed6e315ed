// A kind's role in the op table (ops/kind_role.hpp) is what the verifier,
// the scheduler and the simulator decide by; here it is held against the
// programs the generator emits: every put signals, at its peer, an event
// whose waiting kind is the consumer its role names; every kind a step
// emits belongs to a scheme its run options choose; each scheme's kinds are
// what its exchange emits and nothing else; and over these configurations
// every kind of the table is emitted, so no role goes untested.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "exchange_cases.hpp"
#include "ops/op.hpp"

using namespace hpmoe;
using namespace hpmoe::testing;

namespace {

struct Case {
  const char* what;
  LayerConfig layer;
  ExpertPlacement placement;
  std::string routing;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  LayerConfig c = small(4, 96);
  c.hidden = 256;  // fp8 scale blocks
  c.routed_experts = 16;
  c.top_k = 4;
  c.validate();
  const auto add = [&](const char* what, LayerConfig l, std::optional<ExpertPlacement> placement = {},
                       std::string routing = "zipf:1.2") {
    l.validate();
    out.push_back({what, l, placement ? *placement : contiguous(l), routing});
  };
  add("per assignment", c);
  LayerConfig staged = c;
  staged.dtype = DType::bf16;
  staged.dispatch_dtype = DispatchDType::fp8;
  add("per assignment, fp8 dispatch", staged);
  LayerConfig grad_staged = c;
  grad_staged.grad_dispatch_dtype = GradDispatchDType::bf16;
  add("per assignment, bf16 gradient dispatch", grad_staged);
  const nlohmann::json split{{"experts_of_rank", {{0, 1, 2, 3, 4}, {0, 5, 6, 7, 8}, {9, 10, 11, 12}, {13, 14, 15}}},
                             {"splits", {{{"expert", 0}, {"columns", {0, 48, 96}}}}}};
  add("per assignment, a split expert", c, placement_from_json(split, c.routed_experts, c.ranks, "split"));
  LayerConfig by_rank = c;
  by_rank.exchange = ExchangeMode::rank;
  add("per rank", by_rank);
  LayerConfig by_node = by_rank;
  by_node.ranks_per_node = 2;
  add("per node", by_node);
  LayerConfig lent = c;
  lent.lend_weights = 20;
  add("lending", lent);
  return out;
}

std::vector<Program> programs_of(const Case& k, Pass pass) {
  const Machine m = parse_machine("cpu:2");
  const RoutingCounts counts = rank_counts(k.layer, k.placement, k.routing, m.tile_rows);
  return compile(k.layer, k.placement, counts, m, pass, Policy::critical_path);
}

// What may wait on a put's event at its peer: the consumer its role names,
// a split expert's reduction first (feeds_split), or a relay that chains
// the consumer's events (relay_of).
bool waits_on(const KindRole& put, TaskKind waiting) {
  if (waiting == put.consumer || (put.feeds_split != TaskKind::count && waiting == put.feeds_split)) return true;
  return role(waiting).relay_of == put.consumer;
}

TEST(KindRoles, EveryPutFeedsTheKindItsRoleNames) {
  for (const Case& k : cases())
    for (const Pass pass : {Pass::forward, Pass::backward}) {
      const auto programs = programs_of(k, pass);
      int puts = 0;
      for (const auto& p : programs)
        for (const auto& t : p.tasks) {
          if (!is_put(t.kind)) continue;
          ++puts;
          const Event& e = programs[static_cast<std::size_t>(t.peer)].events[static_cast<std::size_t>(t.trigger_event)];
          EXPECT_TRUE(waits_on(role(t.kind), e.consumer))
              << k.what << ": a " << name(t.kind) << " from rank " << p.rank << " to rank " << t.peer << " feeds a "
              << name(e.consumer) << ", its role names " << name(role(t.kind).consumer);
        }
      EXPECT_GT(puts, 0) << k.what;
    }
}

TEST(KindRoles, AStepEmitsOnlyTheKindsOfTheSchemesItsOptionsChoose) {
  std::set<TaskKind> emitted;
  std::map<Scheme, std::set<std::string>> configs_of_scheme;
  for (const Case& k : cases())
    for (const Pass pass : {Pass::forward, Pass::backward}) {
      const auto allowed = layer_operators(k.layer, k.placement.has_splits(), pass, k.placement.fetches_replicas());
      const std::set<TaskKind> may(allowed.begin(), allowed.end());
      for (const auto& p : compile(k.layer, k.placement,
                                   rank_counts(k.layer, k.placement, k.routing, parse_machine("cpu:2").tile_rows),
                                   parse_machine("cpu:2"), pass, Policy::fill))
        for (const auto& t : p.tasks) {
          EXPECT_TRUE(may.count(t.kind)) << k.what << ": " << name(t.kind) << " is not of a scheme its options choose";
          emitted.insert(t.kind);
          configs_of_scheme[role(t.kind).scheme].insert(k.what);
        }
    }
  for (std::size_t i = 0; i < static_cast<std::size_t>(TaskKind::count); ++i)
    EXPECT_TRUE(emitted.count(static_cast<TaskKind>(i))) << name(static_cast<TaskKind>(i)) << " was never emitted";
  // An exchange's kinds come from that exchange only.
  EXPECT_EQ(configs_of_scheme[Scheme::rank], (std::set<std::string>{"per rank", "per node"}));
  EXPECT_EQ(configs_of_scheme[Scheme::node], (std::set<std::string>{"per node"}));
  EXPECT_EQ(configs_of_scheme[Scheme::lend], (std::set<std::string>{"lending"}));
  EXPECT_EQ(configs_of_scheme[Scheme::assignment_splits], (std::set<std::string>{"per assignment, a split expert"}));
  EXPECT_EQ(configs_of_scheme[Scheme::assignment_staged],
            (std::set<std::string>{"per assignment, fp8 dispatch", "per assignment, bf16 gradient dispatch"}));
  EXPECT_EQ(configs_of_scheme[Scheme::assignment].count("per rank"), 0u);
}

// The relays chain events that peers' puts feed: a relay's chained kind is
// fed by puts of its own scheme, and a put's level is at least that of
// every remote-fed event its own task waits on (the proof's rule, per kind).
TEST(KindRoles, RelaysChainPutFedKindsOfTheirScheme) {
  std::set<TaskKind> fed;
  for (std::size_t i = 0; i < static_cast<std::size_t>(TaskKind::count); ++i)
    if (is_put(static_cast<TaskKind>(i))) fed.insert(role(static_cast<TaskKind>(i)).consumer);
  int relays = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(TaskKind::count); ++i) {
    const auto k = static_cast<TaskKind>(i);
    const TaskKind of = role(k).relay_of;
    if (of == TaskKind::count) continue;
    ++relays;
    EXPECT_TRUE(fed.count(of)) << name(k) << " chains " << name(of) << ", which no put feeds";
    EXPECT_EQ(role(of).scheme, role(k).scheme) << name(k);
    EXPECT_EQ(ops::op(of).pass, ops::op(k).pass) << name(k);
  }
  EXPECT_EQ(relays, 4);
}

}  // namespace
