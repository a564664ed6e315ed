// The per-node exchange's direct tokens (compiler/layout.hpp, Exchange::
// direct_first): a token that only one rank of another node takes crosses
// straight to that rank and its sum comes straight back, with no hop
// through the node's forwarder and no node sum; a token two or more ranks
// of the node take still crosses once, to the forwarder. The mutation
// corpus of the new route, and the runtime over steps whose routing,
// tokens and weights change: bit for bit the per-rank exchange sent
// straight, serialized = interleaved.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>

#include "bit_identity.hpp"
#include "compiler/layout.hpp"
#include "hpmoe/error.hpp"
#include "runtime/interleaved.hpp"
#include "exchange_cases.hpp"

using namespace hpmoe;
using namespace hpmoe::testing;
using hpmoe::testing::bit_identical;

namespace {

TEST(NodeDirect, MutationsOfTheDirectRouteAreRejected) {
  const MutationBase base(node_layer(4, 2, 100));
  const auto& [c, m, placement, counts, forward, backward] = base;
  const auto rejected = [&](const std::vector<Program>& programs, const char* what) { base.rejected(programs, what); };
  // The direct tokens (only one rank of the other node takes them): their
  // pieces go straight across, and their sums come straight back.
  const auto across = [](Program& p, TaskKind kind) -> Task& {  // p's first put of `kind` into another node (2 ranks a node)
    const auto it = std::find_if(p.tasks.begin(), p.tasks.end(), [&](const Task& t) { return t.kind == kind && t.peer >= 0 && t.peer / 2 != p.rank / 2; });
    EXPECT_NE(it, p.tasks.end()) << name(kind) << " across nodes on rank " << p.rank;
    return *it;
  };
  using Change = void (*)(Task&, const Program&);
  for (const auto& [pass, kind, change, what] :
       {std::tuple{Pass::forward, TaskKind::dispatch_token_put, Change{shorter}, "a direct piece one row short: a row the gathers read never lands"},
        std::tuple{Pass::forward, TaskKind::dispatch_token_put, Change{next_event}, "a direct piece counted for the next slot: a gather may read it before it lands"},
        std::tuple{Pass::backward, TaskKind::grad_dispatch_token_put, Change{shifted}, "the backward's direct dy piece one row down"},
        std::tuple{Pass::forward, TaskKind::combine_rank_put, Change{unwaited}, "a direct sum that does not wait for its rank's experts"},
        std::tuple{Pass::forward, TaskKind::combine_rank_put, Change{shorter}, "a direct sum one row short: the source adds a row that never came"},
        std::tuple{Pass::backward, TaskKind::grad_combine_rank_put, Change{shifted}, "the backward's direct dx sum one row down"}}) {
    for (const int r : {0, 3}) {
      auto programs = pass == Pass::forward ? forward : backward;
      change(across(programs[static_cast<std::size_t>(r)], kind), programs[static_cast<std::size_t>(r)]);
      rejected(programs, what);
    }
  }
  {
    // A forwarder that also forwards a direct token: a forwarded piece
    // that runs one row into the sub-block's direct rows, which the source
    // puts itself.
    auto programs = forward;
    bool found = false;
    for (auto& p : programs)
      for (auto& f : p.tasks) {
        if (found || f.kind != TaskKind::dispatch_forward) continue;
        for (const auto& q : programs)
          for (const auto& t : q.tasks)
            if (t.kind == TaskKind::dispatch_token_put && t.peer == f.peer && q.rank / 2 != f.peer / 2 &&
                t.row_begin == f.row_begin + f.rows && !found)
              f.rows += 1, found = true;
      }
    ASSERT_TRUE(found) << "no forwarded piece followed by a direct one";
    rejected(programs, "a direct token forwarded too: its row written twice");
  }
}

// A hot rank (over 1.25 times its node's mean rows from other nodes) takes
// its tokens through the forwarders, which spread them over the node's
// links; the others take their direct tokens straight. Counts that claim
// direct tokens for a hot rank are refused.
TEST(NodeDirect, AHotRankTakesItsTokensThroughTheForwarders) {
  const LayerConfig c = node_layer(4, 2, 100);
  const auto placement = contiguous(c);  // rank r holds experts 4r..4r+3
  const auto r = routing_of(c, "hot:0.25");  // one expert's rows: a quarter of all
  const auto counts = routing_counts(c, r);
  taskflow::Exchange ex(c, placement, counts, 32);
  const auto tokens = rank_token_counts(c, placement, counts, r, 32);
  ex.set_rank_tokens(tokens, c.tokens_per_rank);
  // Each rank's rows from the other node, and which are hot.
  std::int64_t load[4] = {};
  for (std::int64_t s = 0; s < 4; ++s)
    for (std::int64_t e = 0; e < c.routed_experts; ++e)
      if (s / 2 != e / 8) load[e / 4] += counts.at(s, e);
  int hot = -1;
  for (int d = 0; d < 4; ++d) {
    const std::int64_t node_sum = load[d / 2 * 2] + load[d / 2 * 2 + 1];
    const bool is_hot = 2.0 * static_cast<double>(load[d]) > 1.25 * static_cast<double>(node_sum);
    EXPECT_EQ(ex.takes_direct(d), !is_hot) << "rank " << d << ": " << load[d] << " of its node's " << node_sum << " rows";
    if (is_hot) hot = d;
  }
  ASSERT_GE(hot, 0) << "no hot rank: the case tests nothing";
  std::int64_t straight = 0;  // direct tokens of the ranks that take them
  for (std::int64_t s = 0; s < 4; ++s)
    for (std::int64_t i = 0; i < ex.instances(); ++i) {
      const std::int64_t d = ex.placement().instance_rank(i);
      if (d == hot) EXPECT_EQ(ex.direct_first(s, i), 0) << "source " << s;
      else straight += ex.direct_first(s, i);
    }
  EXPECT_GT(straight, 0) << "the ranks that are not hot take their direct tokens straight";
  auto wrong = tokens;
  const auto N = static_cast<std::size_t>(ex.instances());
  const std::size_t first_direct = tokens.size() - 2 * static_cast<std::size_t>(c.ranks) * N;
  const std::size_t s_on_hot = static_cast<std::size_t>((hot < 2 ? 2 : 0)) * N + static_cast<std::size_t>(ex.placement().instances_of(hot)[0]);
  wrong[first_direct + s_on_hot] += 1;
  wrong[first_direct + static_cast<std::size_t>(c.ranks) * N + s_on_hot] += 1;
  EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error) << "a direct token claimed for the hot rank";
}

// The tokens a step sends straight across nodes (the direct tokens), over
// all sources.
std::int64_t direct_tokens(const LayerConfig& c, const ExpertPlacement& placement, const std::string& routing, std::uint64_t seed) {
  const auto r = routing_of(c, routing, seed);
  const auto counts = routing_counts(c, r);
  taskflow::Exchange ex(c, placement, counts, 32);
  ex.set_rank_tokens(rank_token_counts(c, placement, counts, r, 32), c.tokens_per_rank);
  std::int64_t n = 0;
  for (std::int64_t s = 0; s < c.ranks; ++s)
    for (std::int64_t i = 0; i < ex.instances(); ++i) n += ex.direct_first(s, i);
  return n;
}

// Three ranks a node, so that a token the forwarder sums may be none of its
// own, and a direct token may go to a rank that is not the forwarder.
class NodeDirectSteps : public ::testing::TestWithParam<DType> {};

TEST_P(NodeDirectSteps, EveryStepIsTheStraightExchangeBitForBit) {
  LayerConfig c = node_layer(6, 3, 29);
  c.dtype = GetParam();
  c.validate();
  LayerConfig straight_config = c;
  straight_config.node_forwarding = false;
  auto w = random_weights(c, 41);
  const auto placement = contiguous(c);
  const RuntimeOptions serial_opt = serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = true, .pin = false, .placement = placement});
  const RuntimeOptions inter_opt{.workers_per_rank = 1, .backward = true, .policy = taskflow::Policy::ratr, .pin = false, .placement = placement};
  InterleavedExecutor serial(c, w, serial_opt), inter(c, w, inter_opt), straight(straight_config, w, inter_opt);
  int step = 0;
  for (const auto& [routing, seed] : {std::tuple{"uniform", 3}, std::tuple{"zipf:1.2", 4}, std::tuple{"hot:0.2", 5}, std::tuple{"uniform", 6}}) {
    SCOPED_TRACE(std::string("step ") + std::to_string(step) + ", " + routing);
    ASSERT_GT(direct_tokens(c, placement, routing, seed), 0) << "a step without direct tokens tests nothing new";
    const auto in = random_inputs(c, 100 + static_cast<std::uint64_t>(seed));
    const auto forced = forced_selection(c, parse_routing_spec(routing, static_cast<std::uint64_t>(seed)));
    StepResult a, b, d;
    serial.step(in, forced, a);
    inter.step(in, forced, b);
    straight.step(in, forced, d);
    EXPECT_TRUE(bit_identical(a.out, b.out)) << "serialized = interleaved";
    EXPECT_TRUE(bit_identical(a.grads, b.grads)) << "serialized = interleaved";
    EXPECT_TRUE(bit_identical(d.out, b.out)) << "forwarded and direct = sent straight";
    EXPECT_TRUE(bit_identical(d.grads, b.grads)) << "forwarded and direct = sent straight";
    EXPECT_LT(b.forward_cross_node_bytes, d.forward_cross_node_bytes);
    // The weights change between steps (an optimizer's update, in place).
    for (auto& e : w.w2)
      for (auto& v : e.data) v *= 0.875f;
    for (auto* x : {&serial, &inter, &straight}) x->weights_changed();
    ++step;
  }
}

INSTANTIATE_TEST_SUITE_P(All, NodeDirectSteps, ::testing::Values(DType::fp32, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& info) { return to_string(info.param); });

}  // namespace
