// The per-node exchange (LayerConfig::ranks_per_node under exchange rank):
// a token crosses to another node once, to the rank there with its own
// local index, which forwards each rank's block from that one copy. The
// layout (node blocks and routes), the config field, the programs (proved
// whole and per rank, fewer bytes across nodes), the mutation corpus of the
// new kinds, and the runtime: bit for bit the per-rank exchange's results
// (the same bytes land in the same places), serialized = interleaved, and
// the fp64 oracle's checks.
#include <gtest/gtest.h>

#include <limits>

#include <algorithm>
#include <initializer_list>
#include <map>
#include <set>
#include <tuple>

#include "bit_identity.hpp"
#include "oracle_checks.hpp"
#include "compiler/layout.hpp"
#include "compiler/generate_parts.hpp"
#include <nlohmann/json.hpp>
#include "hpmoe/error.hpp"
#include "hpmoe/reference.hpp"
#include "runtime/interleaved.hpp"
#include "exchange_cases.hpp"

using namespace hpmoe;
using namespace hpmoe::testing;
using hpmoe::testing::bit_identical;

namespace {

// Four ranks: expert 0 split over ranks 0 and 2 (two nodes), expert 5
// replicated on ranks 1 and 3.
ExpertPlacement split_and_replicated(const LayerConfig& c) {
  const nlohmann::json j{{"experts_of_rank", {{0, 1, 2, 3, 4}, {5, 6, 7, 8}, {0, 9, 10, 11}, {5, 12, 13, 14, 15}}},
                         {"replicas", true},
                         {"splits", {{{"expert", 0}, {"columns", {0, 48, 96}}}}}};
  return placement_from_json(j, c.routed_experts, c.ranks, "test placement");
}

bool carries_tokens(TaskKind k) {
  return k == TaskKind::dispatch_token_put || k == TaskKind::dispatch_node_put || k == TaskKind::dispatch_forward ||
         k == TaskKind::grad_dispatch_token_put || k == TaskKind::grad_dispatch_node_put || k == TaskKind::grad_dispatch_forward;
}

// The combine's sums: one row per (token, rank), or per (token, node).
bool carries_sums(TaskKind k) {
  return k == TaskKind::combine_rank_put || k == TaskKind::combine_node_part_put || k == TaskKind::combine_node_put ||
         k == TaskKind::grad_combine_rank_put || k == TaskKind::grad_combine_node_part_put || k == TaskKind::grad_combine_node_put;
}

// Bytes of token rows (or of sums) the programs put to ranks of other nodes.
double cross_node_bytes(const std::vector<Program>& set, std::int64_t per_node, bool (*carries)(TaskKind)) {
  double bytes = 0;
  for (const auto& p : set)
    for (const auto& t : p.tasks)
      if (carries(t.kind) && t.peer / per_node != p.rank / per_node) bytes += AccessTable::standard().work(p, t).bytes;
  return bytes;
}
double cross_node_token_bytes(const std::vector<Program>& set, std::int64_t per_node) {
  return cross_node_bytes(set, per_node, carries_tokens);
}

}  // namespace

TEST(NodeExchange, ConfigFieldMustDivideTheRanks) {
  LayerConfig c = preset("tiny");
  c.ranks = 4;
  c.exchange = ExchangeMode::rank;
  c.set("ranks_per_node", "2");
  EXPECT_TRUE(c.forwards());
  EXPECT_EQ(c.nodes(), 2);
  EXPECT_EQ(to_json(c).at("ranks_per_node"), 2);
  EXPECT_EQ(config_from_json(to_json(c)).ranks_per_node, 2);
  for (const char* bad : {"3", "5", "-1"}) {
    c.set("ranks_per_node", bad);
    try {
      c.validate();
      FAIL() << "accepted ranks_per_node=" << bad << " for 4 ranks";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ranks_per_node"), std::string::npos) << e.what();
    }
  }
  c.set("ranks_per_node", "4");  // one node: nothing to forward
  EXPECT_FALSE(c.forwards());
  c.set("ranks_per_node", "2");
  c.set("node_forwarding", "false");
  EXPECT_FALSE(c.forwards()) << "asked not to";
  c.set("node_forwarding", "true");
  c.exchange = ExchangeMode::assignment;
  EXPECT_FALSE(c.forwards()) << "the per-assignment exchange sends rows, not tokens";
}

TEST(NodeExchange, EachTokenCrossesOnceToEachNodeAndItsRoutesPointAtIt) {
  const LayerConfig c = node_layer(4, 2, 90);
  for (const auto& placement : {contiguous(c), split_and_replicated(c)}) {
    const auto r = routing_of(c, "zipf:1.2");
    const auto counts = routing_counts(c, r);
    taskflow::Exchange ex(c, placement, counts, 32);
    const auto tokens = rank_token_counts(c, placement, counts, r, 32);
    ex.set_rank_tokens(tokens, c.tokens_per_rank);
    const std::vector<int> all{0, 1, 2, 3};
    const auto slot = send_slots(c, ex, r, all);
    const std::int64_t n = c.tokens_per_rank * c.top_k;
    for (std::int64_t s = 0; s < c.ranks; ++s) {
      const auto routes = taskflow::rank_routes(c, ex, s, std::span(slot).subspan(static_cast<std::size_t>(s * n), static_cast<std::size_t>(n)),
                                                std::span(r.expert).subspan(static_cast<std::size_t>(s * n), static_cast<std::size_t>(n)));
      for (std::int64_t b = 0; b < ex.nodes(); ++b) {
        const std::int64_t begin = ex.node_send_offset(s, b), rows = ex.node_tokens(s, b);
        if (b == ex.node_of(s)) {
          EXPECT_EQ(rows, 0) << "a source's own node takes its tokens straight";
          continue;
        }
        const std::set<std::int32_t> block(routes.node_tokens.begin() + begin, routes.node_tokens.begin() + begin + rows);
        EXPECT_EQ(static_cast<std::int64_t>(block.size()), rows) << "a token twice in one node block";
        std::map<std::int32_t, int> takers;  // how many of the node's ranks take each token
        for (std::int64_t d = b * 2; d < b * 2 + 2; ++d)
          for (std::int64_t row = ex.token_send_offset(s, d); row < ex.token_send_offset(s, d + 1); ++row)
            ++takers[routes.tokens[static_cast<std::size_t>(row)]];
        std::set<std::int32_t> needed;
        std::int64_t direct_seen = 0;
        for (std::int64_t d = b * 2; d < b * 2 + 2; ++d)
          for (std::int64_t row = ex.token_send_offset(s, d); row < ex.token_send_offset(s, d + 1); ++row) {
            const std::int32_t at = routes.node_index[static_cast<std::size_t>(2 * row)];
            // Rank d's sub-block j needs node sub-blocks 0..j only.
            std::int64_t j = 0;
            while (ex.sub_block_offset(s, placement.instances_of(d)[static_cast<std::size_t>(j)]) +
                       ex.first_tokens(s, placement.instances_of(d)[static_cast<std::size_t>(j)]) <=
                   row - ex.token_send_offset(s, d))
              ++j;
            // Its last rows are the direct tokens: only d of the node takes
            // them, and they go to it straight, outside the node block.
            const std::int64_t i = placement.instances_of(d)[static_cast<std::size_t>(j)];
            const std::int32_t token = routes.tokens[static_cast<std::size_t>(row)];
            const bool direct = row - ex.token_send_offset(s, d) - ex.sub_block_offset(s, i) >= ex.relayed_first(s, i);
            EXPECT_EQ(direct, takers[token] == 1 && ex.takes_direct(d)) << "token " << token << " of rank " << d << "'s sub-block " << j;
            if (direct) {
              EXPECT_EQ(at, -1) << "a direct token forwarded";
              ++direct_seen;
              continue;
            }
            ASSERT_GE(at, 0);
            ASSERT_LT(at, rows);
            EXPECT_LT(at, ex.node_sub_offset(s, b, j + 1)) << "rank " << d << "'s sub-block " << j << " reads a later node sub-block";
            EXPECT_EQ(routes.node_tokens[static_cast<std::size_t>(begin + at)], routes.tokens[static_cast<std::size_t>(row)])
                << "rank " << d << "'s row " << row << " forwarded from another token's node row";
            needed.insert(routes.tokens[static_cast<std::size_t>(row)]);
          }
        EXPECT_EQ(block, needed) << "node " << b << "'s block holds exactly the tokens two or more of its ranks need";
        EXPECT_GT(direct_seen, 0) << "no token that only one rank of node " << b << " takes";
        // The second column, slot-major as the forwarder's NODE_COMB: each
        // row of rank d's combine sub-list j names its token's node sum
        // row, which lies in the token's combine slot (its highest last
        // slot over the node's ranks, hence at least j), each slot in token
        // order; the token's own table points at that row too.
        const std::int64_t routes_at = ex.token_send_offset(s, b * 2), cols = 2 * c.ranks + ex.nodes();
        std::map<std::int32_t, std::int64_t> sum_row;
        for (std::int64_t d = b * 2; d < b * 2 + 2; ++d)
          for (std::size_t j = 0; j < placement.instances_of(d).size(); ++j) {
            const std::int64_t i = placement.instances_of(d)[j], list = ex.token_send_offset(s, d) + ex.sub_list_offset(s, i);
            for (std::int64_t k = 0; k < ex.last_tokens(s, i); ++k) {
              const std::int32_t token = routes.tokens[static_cast<std::size_t>(ex.token_send_offset(s, d) +
                                                                                routes.list_block[static_cast<std::size_t>(list + k)])];
              if (k >= ex.relayed_last(s, i)) {  // a direct token's sum: straight back, to its row after the node sums
                EXPECT_EQ(takers[token], 1);
                EXPECT_EQ(routes.list_slot[static_cast<std::size_t>(token * cols + c.ranks + d)],
                          ex.direct_sum_start(s, d) + ex.direct_list_offset(s, i) + k - ex.relayed_last(s, i));
                EXPECT_EQ(routes.list_slot[static_cast<std::size_t>(token * cols + 2 * c.ranks + b)], -1);
                continue;
              }
              const std::int32_t at = routes.node_index[static_cast<std::size_t>(2 * (routes_at + ex.node_part_start(s, static_cast<std::int64_t>(j), d) + k) + 1)];
              ASSERT_GE(at, 0);
              ASSERT_LT(at, rows);
              const auto [it, fresh] = sum_row.emplace(token, at);
              EXPECT_EQ(it->second, at) << "token " << token << " sums into two node rows";
              std::int64_t slot = 0;
              while (ex.node_sum_offset(s, b, slot + 1) <= at) ++slot;
              EXPECT_GE(slot, static_cast<std::int64_t>(j)) << "a node sum made before rank " << d << "'s slot " << j << " is in";
              EXPECT_EQ(routes.list_slot[static_cast<std::size_t>(token * cols + 2 * c.ranks + b)], ex.node_sum_start(s, b) + at);
            }
          }
        EXPECT_EQ(static_cast<std::int64_t>(sum_row.size()), rows) << "every token of the node block has one node sum";
        std::int32_t previous = -1;
        for (std::int64_t slot = 0; slot < ex.node_slots(); ++slot, previous = -1)
          for (const auto& [token, at] : sum_row)
            if (at >= ex.node_sum_offset(s, b, slot) && at < ex.node_sum_offset(s, b, slot + 1)) {
              EXPECT_GT(token, previous) << "a combine slot's sums out of token order";
              previous = token;
            }
      }
    }
    // Forwarders' blocks do not overlap and cover what their sources send.
    for (std::int64_t f = 0; f < c.ranks; ++f) {
      std::int64_t rows = 0;
      for (std::int64_t s = 0; s < c.ranks; ++s)
        if (ex.forwards_through(s, f)) {
          EXPECT_EQ(ex.node_start(s, ex.node_of(f)), rows);
          rows += ex.node_tokens(s, ex.node_of(f));
        }
      EXPECT_EQ(ex.node_recv_rows(f), rows);
    }
    auto wrong = tokens;
    const std::size_t S = static_cast<std::size_t>(ex.node_slots()), N = static_cast<std::size_t>(ex.instances()),
                      first_node_count = 2 * static_cast<std::size_t>(c.ranks) * N,
                      first_direct = first_node_count + static_cast<std::size_t>(2 * c.ranks * ex.nodes()) * S;
    ASSERT_EQ(tokens.size(), first_direct + 2 * static_cast<std::size_t>(c.ranks) * N);
    wrong[first_node_count + S] += c.tokens_per_rank;  // rank 0 claims more tokens for node 1 than it has
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
    wrong = tokens;
    wrong[first_node_count] = 1;  // rank 0 claims tokens for its own node (node 0, sub-block 0)
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
    wrong = tokens;
    wrong[first_node_count + static_cast<std::size_t>(ex.nodes()) * S + S] += 1;  // node 1's combine slots: one token more than its block
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
    wrong = tokens;
    wrong[first_direct] += 1;  // rank 0 claims a direct token for instance 0, on its own node's rank 0
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
    wrong = tokens;
    const std::size_t far = N - 1;  // an instance of rank 3, in node 1
    wrong[first_direct + far] = tokens[far] + 1;  // more direct tokens than the sub-block holds
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
    wrong = tokens;
    wrong[first_direct + far] += 1;  // by first, not matched by last
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
    wrong.resize(first_direct);  // without the direct counts
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
    wrong.resize(first_node_count);  // without the node counts
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
  }
}

TEST(NodeExchange, ProgramsAreProvedWholeAndPerRankAndCrossNodesLess) {
  const LayerConfig c = node_layer(4, 2, 90);
  LayerConfig by_rank = c;
  by_rank.node_forwarding = false;
  const Machine m = parse_machine("cpu:2:32x64");
  for (const auto& placement : {contiguous(c), split_and_replicated(c)}) {
    const auto counts = rank_counts(c, placement, "uniform", m.tile_rows);
    const auto direct_counts = rank_counts(by_rank, placement, "uniform", m.tile_rows);
    for (const Pass pass : {Pass::forward, Pass::backward}) {
      const auto programs = compile_checked(c, placement, counts, m, pass, Policy::critical_path);
      for (const auto& p : programs) {  // the node tables survive a dump
        const Program back = program_from_json(to_json(p));
        EXPECT_EQ(back.node_begin, p.node_begin);
        EXPECT_EQ(back.node_route_begin, p.node_route_begin);
        EXPECT_EQ(back.node_comb_begin, p.node_comb_begin);
        EXPECT_EQ(back.node_sum_begin, p.node_sum_begin);
        EXPECT_FALSE(p.node_begin.empty());
        auto j = to_json(p);  // a dump of the pipelined combine without its tables, or with them out of step
        j.erase("node_comb_begin");
        EXPECT_THROW(program_from_json(j), Error);
        j = to_json(p);
        j["node_sum_begin"].back() = j["node_sum_begin"].back().get<std::int64_t>() + 1;
        EXPECT_THROW(program_from_json(j), Error);
      }
      const auto direct = compile(by_rank, placement, direct_counts, m, pass, Policy::critical_path);
      // Top-4 of 16 on 4 ranks of 4 experts, 2 per node: a token reaches
      // each rank of the other node with probability 1 - C(12,4)/C(16,4)
      // = 0.73 (1.46 rows), that node with 1 - C(8,4)/C(16,4) = 0.96: about
      // 0.66 of the bytes cross.
      const double ratio = cross_node_token_bytes(programs, 2) / cross_node_token_bytes(direct, 2);
      EXPECT_LT(ratio, 0.75) << (pass == Pass::forward ? "forward" : "backward");
      EXPECT_GT(ratio, 0.55) << (pass == Pass::forward ? "forward" : "backward");
      // The sums come back the same way: one row per (token, node).
      const double sums = cross_node_bytes(programs, 2, carries_sums) / cross_node_bytes(direct, 2, carries_sums);
      EXPECT_LT(sums, 0.75) << (pass == Pass::forward ? "forward" : "backward") << " sums";
      EXPECT_GT(sums, 0.55) << (pass == Pass::forward ? "forward" : "backward") << " sums";
    }
  }
}

// Every policy queues a forwarder's forwards before the gathers and relays
// that may wait for other forwarders' (found over MPI: the tiny preset's
// cheap tiles let the critical-path order put a relay first, a level
// violation the per-rank check rejected), and its node sums after its
// other puts; and (one node too) the backward's combine relays after the
// chains whose dx rows they wait for (interleave-wgrad had queued them
// first: a deadlock).
// On a machine with vector workers to spare, the gathers and a forwarder's
// node sums get queues of their own (compiler/schedule.cpp, queues_apart):
// a queue that holds a gather or a node sum holds nothing else (so a node
// sum of an early combine slot is not queued behind the rank's later part
// puts) but, after them, the final reductions, which every vector worker
// takes; and where a last combine slot holds most sums, those sums in any
// queue, after its last other put. Returns how many queues mixed them so.
int expect_queues_apart(const std::vector<Program>& programs, bool node_sums) {
  int sum_queues = 0, gather_queues = 0, late_sum_queues = 0;
  for (const Program& p : programs)
    for (std::size_t w = 0; w + 1 < p.queue_begin.size(); ++w) {
      std::set<Place> places;
      bool reducing = false, put_after_sum = false, sum_seen = false;
      for (auto i = p.queue_begin[w]; i < p.queue_begin[w + 1]; ++i) {
        const Task& t = p.tasks[static_cast<std::size_t>(p.queue_tasks[static_cast<std::size_t>(i)])];
        const Place at = role(t.kind).place;
        if (at == Place::reduction) reducing = true;
        else places.insert(at);
        sum_seen |= at == Place::node_sum;
        put_after_sum |= sum_seen && at != Place::node_sum && is_put(t.kind) && t.peer != p.rank;
        EXPECT_TRUE(!reducing || at == Place::reduction) << "queue " << w << " of rank " << p.rank << " has work after a final reduction";
      }
      if (places.count(Place::token_wait)) {
        EXPECT_EQ(places.size(), 1u) << "queue " << w << " of rank " << p.rank << " mixes the gathers with others";
        ++gather_queues;
      }
      if (places.count(Place::node_sum)) {
        if (places.size() == 1) ++sum_queues;
        else ++late_sum_queues;
        EXPECT_FALSE(put_after_sum) << "queue " << w << " of rank " << p.rank << " has a put after a node sum";
      }
    }
  EXPECT_EQ(sum_queues > 0, node_sums);
  EXPECT_GT(gather_queues, 0);
  return late_sum_queues;
}

TEST(NodeExchange, EveryPolicyQueuesTheForwarderLevelsInOrder) {
  LayerConfig c = preset("tiny");
  c.ranks = 4;
  c.tokens_per_rank = 48;
  c.top_k = 4;
  c.routed_experts = 16;
  c.exchange = ExchangeMode::rank;
  int late_sums = 0;
  for (const std::int64_t per_node : {2, 0})
  for (const char* machine : {"cpu:1", "cpu:2", "accel:4:12:32x64"}) {
    c.ranks_per_node = per_node;
    c.validate();
    const auto placement = contiguous(c);
    const Machine m = parse_machine(machine);
    const auto counts = rank_counts(c, placement, "zipf:1.2", m.tile_rows);
    for (const Policy policy : {Policy::fill, Policy::rank_rotated, Policy::critical_path, Policy::interleave_wgrad, Policy::ratr})
      for (const Pass pass : {Pass::forward, Pass::backward}) {
        SCOPED_TRACE(std::to_string(per_node) + " a node, " + machine + " " + name(policy) + (pass == Pass::forward ? " forward" : " backward"));
        const auto programs = compile_checked(c, placement, counts, m, pass, policy);
        if (m.vector_workers >= 8) late_sums += expect_queues_apart(programs, per_node > 0);
      }
  }
  EXPECT_GT(late_sums, 0) << "no last combine slot's sums left the queues apart: the case is not covered";
}

// A rank computes an expert's row tiles in the order their rows arrive:
// across nodes they come through a forwarder, after the node's own ranks',
// so every tile of the node's own rows goes before any that waits for a
// forwarded one.
TEST(NodeExchange, RowTilesOfTheNodesOwnRowsGoFirst) {
  const LayerConfig c = node_layer(8, 2, 200);
  const auto placement = contiguous(c);
  const auto r = routing_of(c, "uniform");
  const auto counts = routing_counts(c, r);
  taskflow::Exchange ex(c, placement, counts, 16);
  ex.set_rank_tokens(rank_token_counts(c, placement, counts, r, 16), c.tokens_per_rank);
  for (std::int64_t d = 0; d < c.ranks; ++d)
    for (const std::int64_t home : placement.instances_of(d)) {
      bool forwarded_seen = false;
      for (const std::int64_t t : taskflow::arrival_tile_order(c, ex, home, d)) {
        bool forwarded = false;
        for (std::int64_t s = 0; s < c.ranks; ++s)
          forwarded |= ex.forwarded(s, d) && ex.count(s, home) > 0 && ex.source_offset(s, home) < (t + 1) * 16 &&
                       ex.source_offset(s, home) + ex.count(s, home) > t * 16;
        EXPECT_FALSE(forwarded_seen && !forwarded) << "rank " << d << " expert instance " << home << " tile " << t;
        forwarded_seen |= forwarded;
      }
      EXPECT_TRUE(forwarded_seen || ex.expert_rows(home) == 0);
    }
}

// RATR sends a source's node sub-blocks with the destinations' slots they
// carry: sub-block j goes with the token puts of slot j (not every
// sub-block first, which kept the copy engines on the slow link while the
// node's own ranks waited for their first slot), each queue in sub-block
// order.
TEST(NodeExchange, RatrSendsNodeSubBlocksWithTheirSlots) {
  const LayerConfig c = node_layer(8, 4, 256);
  const auto placement = contiguous(c);
  const Machine m = parse_machine("accel:4:12:32x64");
  const auto counts = rank_counts(c, placement, "uniform", m.tile_rows);
  for (const Pass pass : {Pass::forward, Pass::backward}) {
    SCOPED_TRACE(pass == Pass::forward ? "forward" : "backward");
    const auto programs = compile_checked(c, placement, counts, m, pass, Policy::ratr);
    const TaskKind node_put = pass == Pass::forward ? TaskKind::dispatch_node_put : TaskKind::grad_dispatch_node_put;
    const TaskKind token_put = pass == Pass::forward ? TaskKind::dispatch_token_put : TaskKind::grad_dispatch_token_put;
    for (const Program& p : programs) {
      std::int32_t first_event = std::numeric_limits<std::int32_t>::max();
      for (const Task& t : p.tasks)
        if (t.kind == node_put) first_event = std::min(first_event, t.trigger_event);
      bool token_before_later_sub_block = false;
      for (std::size_t w = 0; w + 1 < p.queue_begin.size(); ++w) {
        std::int32_t last = -1;
        bool token_seen = false;
        for (auto i = p.queue_begin[w]; i < p.queue_begin[w + 1]; ++i) {
          const Task& t = p.tasks[static_cast<std::size_t>(p.queue_tasks[static_cast<std::size_t>(i)])];
          if (t.kind == token_put) token_seen = true;
          if (t.kind != node_put) continue;
          EXPECT_GE(t.trigger_event, last) << "rank " << p.rank << " queue " << w << " sends a node sub-block before an earlier one";
          last = t.trigger_event;
          token_before_later_sub_block |= token_seen && t.trigger_event > first_event;
        }
      }
      EXPECT_TRUE(token_before_later_sub_block) << "rank " << p.rank << " queues every node sub-block before its token puts";
    }
  }
}

// The backward's gate-gradient puts wait on `tok` events too, and RATR
// queues them with the puts: the forwards used to go after them (before
// the first gather only), so a forwarder could wait on another's forwards
// behind its own. Found at EP 256 on the H800 model, where the simulator
// deadlocked; eight nodes of two ranks on an accelerator machine show it.
TEST(NodeExchange, ForwardsGoBeforeEveryTaskThatWaitsOnTokens) {
  for (const char* routing : {"uniform", "zipf:1.2"}) {
    const LayerConfig c = node_layer(16, 2, 64);
    const auto placement = contiguous(c);
    const Machine m = parse_machine("accel:2:3");
    const auto counts = rank_counts(c, placement, routing, m.tile_rows);
    for (const Policy policy : {Policy::ratr, Policy::critical_path, Policy::fill}) {
      SCOPED_TRACE(std::string(routing) + " " + name(policy));
      compile_checked(c, placement, counts, m, Pass::backward, policy);
    }
  }
}

// Cases the compiler's fuzz target (fuzz/compile_fuzz.cpp) found: sets the
// generator and scheduler made that the per-rank check rejected. Each is
// the fuzzer's layer, placement, machine and routing.
struct FoundCase {
  const char* layer;
  const char* placement;
  const char* machine;
  int put_workers;
  const char* routing;
  std::uint64_t seed;
  Pass pass;
  Policy policy;
};

TEST(NodeExchange, CasesTheCompilerFuzzerFoundAreProved) {
  const FoundCase cases[] = {
      // A node's part sums queued behind a forwarder's node sums (fill), lent weights and fetched replicas beside.
      {R"({"capacity_factor":1.75,"combine_dtype":"bf16","dispatch_dtype":"fp32","dtype":"fp32","exchange":"rank",
           "expert_inter":32,"grad_dispatch_dtype":"bf16","hidden":128,"lend_weights":"auto","ranks":12,"ranks_per_node":2,
           "routed_experts":28,"shared_experts":1,"tokens_per_rank":42,"top_k":1})",
       R"({"allow_empty_ranks":true,"experts_of_rank":[[0,1,4],[2,3],[4,5,6],[7,8],[9,10,0],[11,12,13],[14,15],[16,17],
           [18,19,20],[21,22],[23,24],[25,26,27,18]],"fetch_replicas":true,"replicas":true})",
       "accel:1:4:64x128", 0, "uniform", 0, Pass::forward, Policy::fill},
      // A forwarder's node sums behind a rank reduce under RATR with put workers, a split expert and lent weights beside.
      {R"({"capacity_factor":1.25,"combine_dtype":"bf16","dispatch_dtype":"fp8","dtype":"bf16","exchange":"rank",
           "expert_inter":64,"hidden":256,"lend_weights":64,"ranks":12,"ranks_per_node":4,"routed_experts":26,
           "shared_experts":0,"tokens_per_rank":1,"top_k":2})",
       R"({"allow_empty_ranks":true,"experts_of_rank":[[0,12,24],[1,13,25],[2,14],[3,15],[4,16,12],[5,17],[6,18],[7,19],
           [8,20],[9,21],[10,22],[11,23]],"splits":[{"columns":[0,6,64],"expert":12}]})",
       "accel:3:3:64x128", 2, "hot:0.5", 194, Pass::forward, Policy::ratr},
  };
  for (const auto& k : cases) {
    const LayerConfig c = config_from_json(nlohmann::json::parse(k.layer));
    c.validate();
    const auto placement = placement_from_json(nlohmann::json::parse(k.placement), c.routed_experts, c.ranks, "case");
    Machine m = parse_machine(k.machine);
    m.put_workers = k.put_workers;
    const auto ids = forced_selection(c, parse_routing_spec(k.routing, k.seed));
    std::vector<float> logits(static_cast<std::size_t>(c.total_tokens() * c.routed_experts), 0.0f);
    const auto routed = route<float>(c, logits, std::vector<float>(static_cast<std::size_t>(c.routed_experts), 0.0f), ids);
    RoutingCounts counts = routing_counts(c, routed);
    counts.token_counts = rank_token_counts(c, placement, counts, routed, m.tile_rows);
    compile_checked(c, placement, counts, m, k.pass, k.policy);
  }
}

TEST(NodeExchange, MutationsOfTheForwardingAreRejected) {
  const MutationBase base(node_layer(4, 2, 100));
  const auto& [c, m, placement, counts, forward, backward] = base;
  const auto rejected = [&](const std::vector<Program>& programs, const char* what) { base.rejected(programs, what); };
  const auto remote = remote_task;
  const PutMutation put_mutations[] = {
      {Pass::forward, 0, TaskKind::dispatch_forward, shifted, "a forwarded piece one row down: a row sent twice, another not at all"},
      {Pass::forward, 1, TaskKind::dispatch_forward, shorter, "a forwarded piece one row short: a block row the gathers read is never written"},
      {Pass::forward, 2, TaskKind::dispatch_forward, unwaited, "a forward that does not wait: it reads the node block before it lands"},
      {Pass::forward, 1, TaskKind::dispatch_node_put, shorter, "a node piece one row short: the forwarder sends a row that never came"},
      {Pass::forward, 3, TaskKind::dispatch_node_route_put, shifted, "node routes one row down: a row is forwarded through an unwritten route"},
      {Pass::forward, 0, TaskKind::dispatch_node_put, next_event, "a node piece that counts towards another source's node block"},
      {Pass::backward, 1, TaskKind::grad_dispatch_forward, shifted, "the backward's forwarded dy piece one row down"},
      {Pass::backward, 0, TaskKind::grad_dispatch_node_put, shorter, "the backward's node piece one row short"},
      // The per-node combine: a node rank's sums on the forwarder, the
      // forwarder's sums back to the source.
      {Pass::forward, 0, TaskKind::combine_node_part_put, shorter, "a node rank's sums one row short: the forwarder adds a row that never came"},
      {Pass::forward, 1, TaskKind::combine_node_part_put, next_event, "a node rank's sums counted for the next combine slot: the forwarder's sum may miss a rank"},
      {Pass::forward, 2, TaskKind::combine_node_part_put, unwaited, "a node rank's sums that do not wait for its experts"},
      {Pass::forward, 0, TaskKind::combine_node_put, unwaited, "a forwarder's sum that does not wait for its node's ranks: a reduction that misses a rank"},
      {Pass::forward, 3, TaskKind::combine_node_put, shorter, "a forwarder's sums one row short: the source adds a node row that never came"},
      {Pass::forward, 1, TaskKind::combine_node_put, shifted, "a forwarder's sums one row down: a node row written twice, another never"},
      {Pass::backward, 2, TaskKind::grad_combine_node_part_put, shorter, "the backward's node rank dx sums one row short"},
      {Pass::backward, 0, TaskKind::grad_combine_node_put, unwaited, "the backward's forwarder dx sum that does not wait for its node's ranks"},
  };
  expect_put_mutations_rejected(put_mutations, forward, backward, rejected);
  {
    auto programs = forward;
    auto& p = programs[0];
    const auto i = static_cast<std::size_t>(first_task(p, TaskKind::dispatch_forward));
    p.tasks.push_back(p.tasks[i]);  // the same piece forwarded twice
    p.cost.push_back(p.cost[i]);
    p.queue_tasks.push_back(static_cast<std::int32_t>(p.tasks.size() - 1));
    p.queue_begin.back() += 1;
    rejected(programs, "a forwarded piece sent twice");
  }
  {
    // A forward of a later sub-block that waits only for the node
    // sub-blocks before its own: it may read rows still on the wire.
    auto programs = forward;
    auto& p = programs[2];
    bool changed = false;
    std::set<std::int32_t> relayed;  // node events a relay feeds: sub-blocks after the first
    for (const auto& t : p.tasks)
      if (t.kind == TaskKind::dispatch_node_relay) relayed.insert(t.trigger_event);
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::dispatch_forward && t.peer != p.rank && relayed.count(t.wait_event) > 0) {
        t.wait_event -= 1;
        t.wait_count = p.events[static_cast<std::size_t>(t.wait_event)].required;
        changed = true;
        break;
      }
    EXPECT_TRUE(changed) << "no forward of a later node sub-block";
    rejected(programs, "a forward that waits for an earlier node sub-block than the ones it reads");
  }
  {
    auto programs = forward;
    auto& p = programs[1];
    auto it = std::find_if(p.tasks.begin(), p.tasks.end(), [&](const Task& t) {  // a relay of the sub-block chain
      return t.kind == TaskKind::dispatch_node_relay && t.wait_event >= 0 &&
             p.events[static_cast<std::size_t>(t.trigger_event)].consumer == TaskKind::dispatch_forward;
    });
    ASSERT_NE(it, p.tasks.end());
    it->wait_event = -1, it->wait_count = 0;
    rejected(programs, "a node relay that does not wait: the next sub-block's forwards may read rows before they land");
  }
  {
    auto programs = forward;
    auto& p = programs[3];
    p.tasks[static_cast<std::size_t>(first_task(p, TaskKind::dispatch_node_relay))].trigger_event += 1;
    rejected(programs, "a node relay that passes its sub-block on to the one after the next");
  }
  // The per-node combine, streamed: a forwarder's sums of combine slot c
  // wait for the node's parts of slots 0..c (a relay per slot).
  const auto relayed_sum = [](Program& p, TaskKind sum, TaskKind relay) -> Task* {  // a sum of a slot after the first
    std::set<std::int32_t> relayed;
    for (const auto& t : p.tasks)
      if (t.kind == relay) relayed.insert(t.trigger_event);
    for (auto& t : p.tasks)
      if (t.kind == sum && relayed.count(t.wait_event) > 0) return &t;
    return nullptr;
  };
  for (const auto& [pass, sum, relay] : {std::tuple{Pass::forward, TaskKind::combine_node_put, TaskKind::combine_node_relay},
                                         std::tuple{Pass::backward, TaskKind::grad_combine_node_put, TaskKind::grad_combine_node_relay}}) {
    const auto& base = pass == Pass::forward ? forward : backward;
    int found = 0;
    for (std::size_t r = 0; r < base.size(); ++r) {
      {
        auto programs = base;
        Task* t = relayed_sum(programs[r], sum, relay);
        if (!t) continue;
        ++found;
        t->wait_event -= 1;
        t->wait_count = programs[r].events[static_cast<std::size_t>(t->wait_event)].required;
        rejected(programs, "a node sum released one slot early: it adds parts of its slot that may not have landed");
      }
      {
        auto programs = base;
        auto& p = programs[r];
        auto it = std::find_if(p.tasks.begin(), p.tasks.end(), [&](const Task& t) { return t.kind == relay && t.wait_event >= 0; });
        it->wait_event = -1, it->wait_count = 0;
        rejected(programs, "a node combine relay that does not wait: the next slot's sums may add parts before they land");
      }
      {
        auto programs = base;
        auto& p = programs[r];
        p.tasks[static_cast<std::size_t>(first_task(p, relay))].trigger_event += 1;
        rejected(programs, "a node combine relay that passes its slot on to the one after the next");
      }
    }
    EXPECT_GT(found, 0) << "no node sum of a later combine slot in " << name(sum);
  }
  {
    // Rank 0 forwards rank 2's tokens; its own node put waits for them: a
    // level-0 put after a remote-fed level-0 event (and, with rank 2 doing
    // the same, a cycle).
    auto programs = forward;
    for (const int r : {0, 2}) {
      auto& p = programs[static_cast<std::size_t>(r)];
      const Task fwd = p.tasks[static_cast<std::size_t>(first_task(p, TaskKind::dispatch_forward))];
      auto& t = remote(p, TaskKind::dispatch_node_put);
      t.wait_event = fwd.wait_event;
      t.wait_count = fwd.wait_count;
    }
    rejected(programs, "a node put that waits for the node blocks it forwards: a level violation through the forwarder");
  }
  {
    // A forwarder's sum that waits for one piece fewer than its node's
    // ranks put: it may add before the last rank's rows land.
    auto programs = forward;
    auto& t = remote(programs[2], TaskKind::combine_node_put);
    t.wait_count -= 1;
    rejected(programs, "a forwarder's sum that waits for one piece fewer than its node's ranks send");
  }
  {
    // A forwarder's sum queued before one of its rank's own return puts on
    // the same worker: the sum waits for what the node's ranks return at
    // that level, so the ranks could wait on each other (a level violation
    // through the forwarder's combine).
    auto programs = forward;
    bool moved = false;
    for (auto& p : programs) {
      for (std::size_t w = 0; w + 1 < p.queue_begin.size() && !moved; ++w) {
        const auto first = p.queue_tasks.begin() + p.queue_begin[w], last = p.queue_tasks.begin() + p.queue_begin[w + 1];
        const auto is = [&](std::int32_t id, std::initializer_list<TaskKind> kinds) {
          const Task& t = p.tasks[static_cast<std::size_t>(id)];
          return t.peer != p.rank && std::find(kinds.begin(), kinds.end(), t.kind) != kinds.end();
        };
        const auto put = std::find_if(first, last, [&](std::int32_t id) { return is(id, {TaskKind::combine_rank_put, TaskKind::combine_node_part_put}); });
        const auto sum = std::find_if(first, last, [&](std::int32_t id) { return is(id, {TaskKind::combine_node_put}); });
        if (put == last || sum == last || sum < put) continue;
        std::rotate(put, sum, sum + 1);  // the sum now runs just before the put
        moved = true;
      }
      if (moved) break;
    }
    ASSERT_TRUE(moved) << "no worker queues a forwarder's sum after a return put";
    rejected(programs, "forwarder sums queued before the rank's own returns: a level violation through the forwarder's combine");
  }
}

// The per-rank exchange's results bit for bit: the forwarder copies the
// bytes the source would have sent into the same rows, and the events
// count as many pieces.
// narrow: the sums travel in bf16 (combine_dtype bf16 under an fp32 layer),
// held to bf16's tolerance against the oracle, which does not round them.
class NodeExchangeExecution : public ::testing::TestWithParam<std::tuple<DType, DispatchDType, std::string, bool, bool>> {};

TEST_P(NodeExchangeExecution, IsTheRankExchangeBitForBitAndMatchesTheOracle) {
  const auto [dtype, dispatch, routing, placed, narrow] = GetParam();
  LayerConfig c = node_layer(4, 2, 37);
  c.dtype = dtype;
  c.dispatch_dtype = dispatch;
  if (narrow) c.combine_dtype = CombineDType::bf16;
  c.validate();
  LayerConfig by_rank = c;
  by_rank.node_forwarding = false;
  const auto w = random_weights(c, 71);
  const auto in = random_inputs(c, 71);
  const auto forced = forced_selection(c, parse_routing_spec(routing, 5));
  const ExpertPlacement placement = placed ? split_and_replicated(c) : contiguous(c);
  const RuntimeOptions serial_opt = serialized_schedule(RuntimeOptions{.workers_per_rank = 2, .backward = true, .pin = false, .placement = placement});
  const RuntimeOptions inter_opt{.workers_per_rank = 2, .backward = true, .policy = taskflow::Policy::ratr, .pin = false, .placement = placement};
  InterleavedExecutor serial(c, w, serial_opt), inter(c, w, inter_opt), direct(by_rank, w, inter_opt);
  StepResult a, b, d;
  serial.step(in, forced, a);
  inter.step(in, forced, b);
  direct.step(in, forced, d);
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  EXPECT_TRUE(bit_identical(d.out, b.out)) << "forwarded = sent straight";
  EXPECT_TRUE(bit_identical(d.grads, b.grads)) << "forwarded = sent straight";
  const auto ref = reference_layer(c, w, in, oracle_options_of(b));
  for (const auto& cmp : checks_against(ref, b, narrow ? DType::bf16 : dtype, 4)) EXPECT_TRUE(cmp.pass) << cmp.tensor << ": rel L2 " << cmp.rel_l2;
  if (narrow) {  // half the sums' bytes, and a result that is not the fp32 combine's
    LayerConfig wide = c;
    wide.combine_dtype = CombineDType::layer;
    InterleavedExecutor fp32_sums(wide, w, inter_opt);
    StepResult f;
    fp32_sums.step(in, forced, f);
    EXPECT_FALSE(bit_identical(f.out, b.out)) << "the bf16 sums are rounded";
    EXPECT_LT(b.forward_cross_node_bytes, f.forward_cross_node_bytes);
    EXPECT_LT(b.backward_cross_node_bytes, f.backward_cross_node_bytes);
  }
  EXPECT_GT(b.forward_cross_node_bytes, 0);
  EXPECT_LT(b.forward_cross_node_bytes, d.forward_cross_node_bytes);
  EXPECT_LT(b.backward_cross_node_bytes, d.backward_cross_node_bytes);
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out)) << "second step";
  EXPECT_TRUE(bit_identical(a.grads, b.grads)) << "second step";
}

std::string node_case_name(const ::testing::TestParamInfo<NodeExchangeExecution::ParamType>& info) {
  const auto& [dtype, dispatch, routing, placed, narrow] = info.param;
  return to_string(dtype) + "_" + to_string(dispatch) + "_" + routing.substr(0, routing.find(':')) + (placed ? "_split_replicated" : "") +
         (narrow ? "_bf16_sums" : "");
}

INSTANTIATE_TEST_SUITE_P(All, NodeExchangeExecution,
                         ::testing::Values(std::tuple{DType::fp32, DispatchDType::layer, std::string("zipf:1.2"), false, false},
                                           std::tuple{DType::fp32, DispatchDType::fp8, std::string("uniform"), true, false},
                                           std::tuple{DType::bf16, DispatchDType::layer, std::string("hot:0.2"), true, false},
                                           std::tuple{DType::bf16, DispatchDType::fp8, std::string("zipf:1.2"), false, false},
                                           std::tuple{DType::fp32, DispatchDType::fp8, std::string("zipf:1.2"), true, true},
                                           std::tuple{DType::fp32, DispatchDType::layer, std::string("uniform"), false, true}),
                         node_case_name);
