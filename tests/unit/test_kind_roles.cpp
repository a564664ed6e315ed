// A kind's role in the op table (ops/kind_role.hpp) is what the verifier,
// the scheduler and the simulator decide by; here it is held against the
// programs the generator emits: every put signals, at its peer, an event
// whose waiting kind is the consumer its role names; every kind a step
// emits belongs to a scheme its run options choose; each scheme's kinds are
// what its exchange emits and nothing else; and over these configurations
// every kind of the table is emitted, so no role goes untested.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "exchange_cases.hpp"
#include "ops/op.hpp"
#include "source_dir.hpp"

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
  EXPECT_EQ(relays, 6);
}

}  // namespace

namespace {

const char* scheme_name(Scheme s) {
  switch (s) {
    case Scheme::layer: return "layer";
    case Scheme::shared: return "shared experts";
    case Scheme::assignment: return "per assignment";
    case Scheme::assignment_direct: return "per assignment, direct";
    case Scheme::assignment_staged: return "per assignment, staged";
    case Scheme::assignment_splits: return "per assignment, splits";
    case Scheme::rank: return "per rank";
    case Scheme::node: return "per node";
    case Scheme::lend: return "lending";
  }
  return "?";
}

const char* place_name(Place p) {
  switch (p) {
    case Place::none: return "";
    case Place::expert_put: return "dispatch in destination order";
    case Place::token_put: return "first hop";
    case Place::forward: return "hoisted forward";
    case Place::token_wait: return "waits on tokens";
    case Place::expert_return: return "return";
    case Place::rank_relay: return "after the GEMMs it counts";
    case Place::sum_return: return "sums back";
    case Place::node_sum: return "sunk node sums";
    case Place::side_gradient: return "after the expert chains";
    case Place::reduction: return "final reduction";
  }
  return "?";
}

const char* step_name(TileStep s) {
  switch (s) {
    case TileStep::none: return "";
    case TileStep::first_gemm: return "first GEMM";
    case TileStep::vector_step: return "vector step";
    case TileStep::pack: return "pack";
    case TileStep::second_gemm: return "second GEMM";
    case TileStep::weight_gradient: return "weight gradient";
  }
  return "?";
}

// One row of the kind table: what the op table says of a kind, in words.
std::string kind_row(const ops::OpKind& k, const char* family) {
  std::string reads, writes;
  for (int i = 0; i < k.access.operand_count; ++i) {
    const auto& o = k.access.operands[static_cast<std::size_t>(i)];
    std::string b = std::string(name(o.buffer)) + (o.side == Side::peer ? " (peer)" : "");
    if (o.use == Use::accumulate) b += " +=";
    std::string& list = o.use == Use::read ? reads : writes;
    list += (list.empty() ? "" : ", ") + b;
  }
  const KindRole& r = k.role;
  std::string role;
  if (k.access.put) role = std::string("feeds ") + name(r.consumer) + " (level " + std::to_string(r.level) + ")";
  if (r.relay_of != TaskKind::count) role = std::string("relay of ") + name(r.relay_of) + "'s event";
  for (const char* part : {place_name(r.place), step_name(r.step)})
    if (*part) role += (role.empty() ? "" : "; ") + std::string(part);
  return std::string("| ") + k.name + " | " + family + " | " + (k.pass == Pass::forward ? "fwd" : "bwd") + " | " +
         scheme_name(r.scheme) + " | " + name(k.access.queue) + " | " + reads + " | " + writes + " | " + role + " |";
}

std::string kind_table() {
  std::string out = "| kind | family | pass | scheme | queue | reads | writes | role |\n|---|---|---|---|---|---|---|---|\n";
  for (const auto& f : ops::families())
    for (const auto& k : f.kinds) out += kind_row(k, f.name) + "\n";
  return out;
}

// docs/architecture.md lists every kind as the op table has it: the table
// between its two markers is this test's kind_table(), row for row. On a
// change to the op table, paste the table this test prints.
TEST(KindRoles, TheArchitectureDocListsEveryKindAsTheOpTableHasIt) {
  const std::string path = std::string(HPMOE_SOURCE_DIR) + "/docs/architecture.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string begin = "<!-- kind table: generated from the op table (tests/unit/test_kind_roles.cpp) -->\n";
  const std::string end = "<!-- end of the kind table -->";
  const auto b = doc.find(begin), e = doc.find(end);
  ASSERT_NE(b, std::string::npos) << "docs/architecture.md has no kind table marker";
  ASSERT_NE(e, std::string::npos);
  const std::string listed = doc.substr(b + begin.size(), e - b - begin.size());
  EXPECT_EQ(listed, kind_table()) << "docs/architecture.md's kind table differs from the op table; the table as it is:\n"
                                  << kind_table();
  EXPECT_EQ(std::count(listed.begin(), listed.end(), '\n'), static_cast<long>(TaskKind::count) + 2);
}

}  // namespace
