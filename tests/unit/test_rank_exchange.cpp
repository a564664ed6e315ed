// The per-rank exchange (LayerConfig::exchange rank): each token travels
// once to every rank that holds one of its experts, with the routes of its
// rows, and the experts' rows are gathered from that one copy. The layout
// (token blocks, routes), the config field, the programs (proved whole and
// per rank), the verifier's mutation corpus for the new kinds, and the
// runtime: serialized = interleaved bit for bit, the fp64 oracle's checks,
// and bit-identity with the per-assignment exchange where both round alike.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "bit_identity.hpp"
#include "oracle_checks.hpp"
#include "compiler/layout.hpp"
#include <nlohmann/json.hpp>
#include "hpmoe/error.hpp"
#include "hpmoe/reference.hpp"
#include "runtime/interleaved.hpp"
#include "exchange_cases.hpp"

using namespace hpmoe;
using namespace hpmoe::testing;
using hpmoe::testing::bit_identical;

namespace {

LayerConfig rank_layer(std::int64_t ranks, std::int64_t tokens, std::int64_t experts = 16, std::int64_t top_k = 4) {
  LayerConfig c = small(ranks, tokens);
  c.hidden = 256;  // two fp8 scale blocks
  c.routed_experts = experts;
  c.top_k = top_k;
  c.exchange = ExchangeMode::rank;
  c.validate();
  return c;
}

ExpertPlacement replicated_and_split(const LayerConfig& c) {
  const nlohmann::json j{{"experts_of_rank", {{0, 1, 2, 3, 4, 5}, {0, 5, 6, 7, 8, 9, 10}, {0, 11, 12, 13, 14, 15}}},
                         {"replicas", true},
                         {"splits", {{{"expert", 0}, {"columns", {0, 32, 64, 96}}}}}};
  return placement_from_json(j, c.routed_experts, c.ranks, "test placement");
}

}  // namespace

TEST(RankExchange, ConfigFieldParsesAndNamesItsValues) {
  LayerConfig c = preset("tiny");
  EXPECT_EQ(c.exchange, ExchangeMode::assignment);
  c.set("exchange", "rank");
  EXPECT_EQ(c.exchange, ExchangeMode::rank);
  EXPECT_EQ(to_json(c).at("exchange"), "rank");
  try {
    c.set("exchange", "node");
    FAIL() << "accepted exchange=node";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'exchange'"), std::string::npos) << e.what();
  }
}

TEST(RankExchange, EachTokenTravelsOnceToEachRankAndItsRoutesPointAtIt) {
  const LayerConfig c = rank_layer(3, 90);
  for (const auto& placement : {contiguous(c), replicated_and_split(c)}) {
    const auto r = routing_of(c, "zipf:1.2");
    const auto counts = routing_counts(c, r);
    taskflow::Exchange ex(c, placement, counts, 32);
    ex.set_rank_tokens(rank_token_counts(c, placement, counts, r, 32), c.tokens_per_rank);
    const std::vector<int> all{0, 1, 2};
    const auto slot = send_slots(c, ex, r, all);
    const std::int64_t n = c.tokens_per_rank * c.top_k;
    for (std::int64_t s = 0; s < c.ranks; ++s) {
      const auto routes = taskflow::rank_routes(c, ex, s, std::span(slot).subspan(static_cast<std::size_t>(s * n), static_cast<std::size_t>(n)),
                                                std::span(r.expert).subspan(static_cast<std::size_t>(s * n), static_cast<std::size_t>(n)));
      for (std::int64_t d = 0; d < c.ranks; ++d) {
        const std::int64_t u = ex.rank_tokens(s, d), block = ex.token_send_offset(s, d);
        std::set<std::int32_t> sent(routes.tokens.begin() + block, routes.tokens.begin() + block + u);
        EXPECT_EQ(static_cast<std::int64_t>(sent.size()), u) << "a token twice in one block";
        // Every row s sends to d's instances names its own token in d's
        // block, within the sub-blocks up to the instance's slot.
        std::set<std::int32_t> needed;
        for (const std::int64_t i : placement.instances_of(d)) {
          const std::int64_t prefix = ex.sub_block_offset(s, i) + ex.first_tokens(s, i);
          for (std::int64_t row = ex.send_offset(s, i); row < ex.send_offset(s, i) + ex.count(s, i); ++row) {
            const auto at = routes.position[static_cast<std::size_t>(row)];
            ASSERT_GE(at, 0);
            ASSERT_LT(at, prefix) << "a row of instance " << i << " reads past its slot's sub-blocks";
            EXPECT_EQ(routes.tokens[static_cast<std::size_t>(block + at)], routes.row_token[static_cast<std::size_t>(row)]);
            needed.insert(routes.row_token[static_cast<std::size_t>(row)]);
          }
        }
        EXPECT_EQ(sent, needed) << "the block holds exactly the tokens with a row on rank " << d;
        // The combine list: the block's tokens again, by last instance; a
        // sub-list's sums read only the rows of the instances up to its own.
        std::set<std::int32_t> listed;
        for (const std::int64_t i : placement.instances_of(d))
          for (std::int64_t j = ex.sub_list_offset(s, i); j < ex.sub_list_offset(s, i) + ex.last_tokens(s, i); ++j) {
            const auto row = static_cast<std::size_t>(block + j);
            listed.insert(routes.tokens[static_cast<std::size_t>(block) + static_cast<std::size_t>(routes.list_block[row])]);
            EXPECT_EQ(routes.list_slot[static_cast<std::size_t>(routes.tokens[static_cast<std::size_t>(block + routes.list_block[row])] * (2 * c.ranks + c.nodes()) + d)],
                      block + j);
            for (std::int64_t k = 0; k < c.top_k; ++k)
              EXPECT_LT(routes.comb_row[row * static_cast<std::size_t>(c.top_k) + static_cast<std::size_t>(k)],
                        ex.expert_start(i) + ex.expert_rows(i))
                  << "a sum of the sub-list of instance " << i << " reads a later instance's row";
          }
        EXPECT_EQ(listed, sent);
      }
    }
    for (std::int64_t d = 0; d < c.ranks; ++d) EXPECT_LE(ex.token_recv_rows(d), ex.recv_rows(d));
    auto wrong = rank_token_counts(c, placement, counts, r, 32);
    wrong[0] = c.tokens_per_rank + 1;
    EXPECT_THROW(ex.set_rank_tokens(wrong, c.tokens_per_rank), Error);
    EXPECT_THROW(ex.set_rank_tokens(std::vector<std::int64_t>(3, 0), c.tokens_per_rank), Error);
  }
}

TEST(RankExchange, ProgramsAreProvedWholeAndPerRankAndSendFewerBytes) {
  const LayerConfig c = rank_layer(3, 90);
  const Machine m = parse_machine("cpu:2:32x64");
  for (const auto& placement : {contiguous(c), replicated_and_split(c)}) {
    const auto counts = rank_counts(c, placement, "uniform", m.tile_rows);
    for (const Pass pass : {Pass::forward, Pass::backward}) {
      const auto programs = compile_checked(c, placement, counts, m, pass, Policy::critical_path);
      LayerConfig per_assignment = c;
      per_assignment.exchange = ExchangeMode::assignment;
      const auto old = compile(per_assignment, placement, counts, m, pass, Policy::critical_path);
      // Bytes of the dispatch to other ranks: a token once per rank (and 8
      // bytes a row of routes) against a row per (token, expert).
      const auto dispatched = [&](const std::vector<Program>& set) {
        double bytes = 0;
        for (const auto& p : set)
          for (std::size_t i = 0; i < p.tasks.size(); ++i) {
            const Task& t = p.tasks[i];
            const bool dispatch = t.kind == TaskKind::dispatch_put || t.kind == TaskKind::grad_dispatch_put ||
                                  t.kind == TaskKind::dispatch_token_put || t.kind == TaskKind::dispatch_route_put ||
                                  t.kind == TaskKind::grad_dispatch_token_put;
            if (dispatch && t.peer != p.rank) bytes += AccessTable::standard().work(p, t).bytes;
          }
        return bytes;
      };
      // Top-4 of 16 experts on 3 ranks: a token has 4/3 rows on a rank on
      // average but reaches it with probability 1 - C(11,4)/C(16,4) = 0.82,
      // so the per-rank dispatch moves about 0.62 of the bytes.
      EXPECT_LT(dispatched(programs), 0.7 * dispatched(old));
      EXPECT_GT(dispatched(programs), 0.5 * dispatched(old));
    }
  }
}

TEST(RankExchange, MutationsOfThePerRankExchangeAreRejected) {
  const MutationBase base(rank_layer(2, 100));
  const auto& [c, m, placement, counts, forward, backward] = base;
  const auto rejected = [&](const std::vector<Program>& programs, const char* what) { base.rejected(programs, what); };
  const auto remote = remote_task;
  {
    auto programs = forward;
    programs[1].tasks[first_task(programs[1], TaskKind::dispatch_gather)].wait_count -= 1;
    rejected(programs, "a gather that starts before its source's block and routes have all arrived");
  }
  {
    auto programs = forward;
    remote(programs[0], TaskKind::dispatch_token_put).rows -= 1;
    rejected(programs, "a token piece one row short: a block row is read but never written");
  }
  {
    auto programs = forward;
    remote(programs[0], TaskKind::dispatch_token_put).row_begin += 1;
    rejected(programs, "a token piece written one row down, over the next piece");
  }
  {
    auto programs = forward;
    remote(programs[1], TaskKind::dispatch_route_put).trigger_event += 1;
    rejected(programs, "routes that signal another source's block");
  }
  {
    auto programs = forward;
    remote(programs[1], TaskKind::dispatch_route_put).rows -= 1;
    rejected(programs, "a route missing: its row is gathered through an unwritten route");
  }
  {
    auto programs = forward;
    auto& p = programs[0];
    const Task gather = p.tasks[first_task(p, TaskKind::dispatch_gather)];
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::gemm_gate_up && t.wait_event == gather.trigger_event) {
        t.wait_event = gather.wait_event;
        t.wait_count = gather.wait_count;
      }
    rejected(programs, "the GEMM reads its rows when the block arrives, not when they are gathered");
  }
  {
    auto programs = forward;
    auto& p = programs[0];
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::dispatch_gather && t.src_row > 0) {
        t.src_row = 0;  // source 0's sub-blocks, while it waits for source 1's
        break;
      }
    rejected(programs, "a gather reading another source's block than the one it waits for");
  }
  {
    auto programs = forward;
    auto& p = programs[1];
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::dispatch_relay && t.wait_event >= 0) {
        t.wait_event = -1;
        t.wait_count = 0;
        break;
      }
    rejected(programs, "a relay that does not wait: the next slot's gathers may read a sub-block before it lands");
  }
  {
    auto programs = forward;
    auto& p = programs[0];
    p.tasks[first_task(p, TaskKind::dispatch_relay)].trigger_event += 1;
    rejected(programs, "a relay that passes its slot on to the slot after the next");
  }
  {
    auto programs = backward;
    programs[0].tasks[first_task(programs[0], TaskKind::grad_dispatch_gather)].wait_count -= 1;
    rejected(programs, "the backward's gather before its source's dy block arrived");
  }
  {
    auto programs = backward;
    remote(programs[1], TaskKind::grad_dispatch_token_put).rows -= 1;
    rejected(programs, "a dy piece one row short");
  }
  // The per-rank combine: a remote put of one rank's program, changed.
  const auto first_sub_block = [](Task& t, const Program& p) {  // the block's first sub-block only
    t.wait_event -= static_cast<std::int32_t>(p.local_experts.size()) - 1;
    t.wait_count = p.events[static_cast<std::size_t>(t.wait_event)].required;
  };
  const PutMutation put_mutations[] = {
      {Pass::forward, 0, TaskKind::combine_route_put, shorter, "a combine list one token short: a sum reads a list row nothing wrote"},
      {Pass::forward, 1, TaskKind::combine_rank_put, shorter, "a return piece one row short: the source adds a rank's row that never came"},
      {Pass::forward, 1, TaskKind::combine_rank_put, unwaited, "a sum that does not wait for the experts: it reads Y rows still being written"},
      {Pass::backward, 1, TaskKind::gate_grad_put, first_sub_block, "gate gradients taken before the token's whole dy block arrived"},
      {Pass::backward, 0, TaskKind::gate_grad_put, shorter, "a gate-gradient piece one row short: the router reads gradients that never came"},
      {Pass::backward, 0, TaskKind::grad_combine_rank_put, unwaited, "a dx sum that does not wait for the experts' dx rows"},
  };
  expect_put_mutations_rejected(put_mutations, forward, backward, rejected);
  {
    auto programs = forward;
    auto& p = programs[0];
    const std::int32_t ev = p.tasks[first_task(p, TaskKind::combine_rank_reduce)].wait_event;
    p.events[static_cast<std::size_t>(ev)].required -= 1;
    for (auto& t : p.tasks)
      if (t.wait_event == ev) t.wait_count -= 1;
    rejected(programs, "a reduction that misses a rank: the combine starts one return piece early");
  }
}

static double relative_l2(const Matrix& ref, const Matrix& got) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.data.size(); ++i) {
    const double d = double(got.data[i]) - double(ref.data[i]);
    num += d * d;
    den += double(ref.data[i]) * double(ref.data[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Serialized and interleaved bit for bit, the oracle's checks, and the
// per-assignment exchange's results up to the order of the combine's sums.
class RankExchangeExecution
    : public ::testing::TestWithParam<std::tuple<DType, DispatchDType, int, std::string, bool>> {};

TEST_P(RankExchangeExecution, IsBitIdenticalAcrossSchedulesAndMatchesTheOracle) {
  const auto [dtype, dispatch, ranks, routing, placed] = GetParam();
  LayerConfig c = rank_layer(ranks, 120 / ranks + 3);
  c.dtype = dtype;
  c.dispatch_dtype = dispatch;
  c.validate();
  const auto w = random_weights(c, 61);
  const auto in = random_inputs(c, 61);
  const auto forced = forced_selection(c, parse_routing_spec(routing, 5));
  const ExpertPlacement placement = placed ? replicated_and_split(c) : contiguous(c);
  const RuntimeOptions serial_opt = serialized_schedule(RuntimeOptions{.workers_per_rank = 2, .backward = true, .pin = false, .placement = placement});
  const RuntimeOptions inter_opt{.workers_per_rank = 2, .backward = true, .policy = taskflow::Policy::ratr, .pin = false, .placement = placement};
  InterleavedExecutor serial(c, w, serial_opt), inter(c, w, inter_opt);
  StepResult a, b;
  serial.step(in, forced, a);
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  const OracleOptions oo = oracle_options_of(b);
  const auto ref = reference_layer(c, w, in, oo);
  const auto checks = checks_against(ref, b, dtype, 4);
  for (const auto& cmp : checks) EXPECT_TRUE(cmp.pass) << cmp.tensor << ": rel L2 " << cmp.rel_l2;
  LayerConfig old = c;
  old.exchange = ExchangeMode::assignment;
  InterleavedExecutor per_assignment(old, w, inter_opt);
  StepResult o;
  per_assignment.step(in, forced, o);
  // The per-rank combine adds the same products in another order (a
  // token's choices on each rank, then the ranks in order) and, in bf16,
  // rounds each rank's sum once more: with one rank in fp32 that is the
  // same sum bit for bit; otherwise it differs by rounding alone.
  const double tolerance = dtype == DType::fp32 ? 1e-6 : 1e-2;
  EXPECT_LE(relative_l2(o.out, b.out), tolerance);
  if (ranks == 1 && dtype == DType::fp32) {
    EXPECT_TRUE(bit_identical(o.out, b.out)) << "one rank: the same sums";
  }
  if (dtype == DType::fp32 && !c.staged_grad_dispatch()) {
    EXPECT_LE(relative_l2(o.grads.x, b.grads.x), tolerance);
    EXPECT_LE(relative_l2(o.grads.router, b.grads.router), tolerance);
  }
  if (ranks > 1) {  // one row per (token, rank) each way instead of one per (token, expert)
    EXPECT_LT(b.forward_put_bytes, o.forward_put_bytes);
    EXPECT_LT(b.backward_put_bytes, o.backward_put_bytes);
    EXPECT_GT(b.forward_put_bytes, 0);
  } else {
    EXPECT_EQ(b.forward_put_bytes + b.backward_put_bytes, 0) << "one rank puts nothing to others";
  }
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out)) << "second step";
  EXPECT_TRUE(bit_identical(a.grads, b.grads)) << "second step";
}

std::string rank_case_name(const ::testing::TestParamInfo<RankExchangeExecution::ParamType>& info) {
  const auto& [dtype, dispatch, ranks, routing, placed] = info.param;
  const std::string r = routing.substr(0, routing.find(':'));
  return to_string(dtype) + "_" + to_string(dispatch) + "_P" + std::to_string(ranks) + "_" + r + (placed ? "_replicas_splits" : "");
}

INSTANTIATE_TEST_SUITE_P(
    All, RankExchangeExecution,
    ::testing::Values(std::tuple{DType::fp32, DispatchDType::layer, 1, std::string("uniform"), false},
                      std::tuple{DType::fp32, DispatchDType::layer, 2, std::string("zipf:1.2"), false},
                      std::tuple{DType::fp32, DispatchDType::layer, 3, std::string("hot:0.2"), true},
                      std::tuple{DType::fp32, DispatchDType::fp8, 3, std::string("zipf:1.2"), false},
                      std::tuple{DType::fp32, DispatchDType::bf16, 2, std::string("uniform"), false},
                      std::tuple{DType::bf16, DispatchDType::layer, 3, std::string("uniform"), true},
                      std::tuple{DType::bf16, DispatchDType::fp8, 2, std::string("zipf:1.2"), false}),
    rank_case_name);
