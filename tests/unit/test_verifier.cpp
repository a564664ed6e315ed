// The verifier and its mutation corpus: corrupted programs are rejected by
// the whole-set check and by the per-rank check; replicas and tensor-parallel
// splits go through the same proof.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <numeric>

#include "ops/access.hpp"
#include "hpmoe/error.hpp"
#include "compiler/taskflow.hpp"
#include "taskflow_cases.hpp"

using namespace hpmoe;
using namespace hpmoe::taskflow;
using namespace hpmoe::testing;


TEST(Verifier, RejectsARemovedTrigger) {
  for (auto pass : {Pass::forward, Pass::backward}) {
    auto programs = tiny_programs(pass);
    auto& t = programs[1].tasks[first_task(programs[1], pass == Pass::forward ? TaskKind::swiglu : TaskKind::swiglu_bwd)];
    const auto ev = t.trigger_event;
    t.trigger_event = -1;
    const auto error = verify_error(programs);
    EXPECT_TRUE(contains(error, "event " + std::to_string(ev) + " on rank 1")) << error;
    EXPECT_TRUE(contains(error, "triggered by 0 tasks")) << error;
  }
}

TEST(Verifier, RejectsACountOffByOne) {
  auto programs = tiny_programs(Pass::forward);
  const auto id = first_task(programs[0], TaskKind::combine_reduce);
  programs[0].tasks[id].wait_count += 1;
  auto error = verify_error(programs);
  EXPECT_TRUE(contains(error, "combine_reduce")) << error;
  EXPECT_TRUE(contains(error, "to reach")) << error;
  // The event's own count off by one: its waiters and triggers disagree with it.
  programs = tiny_programs(Pass::forward);
  const auto ev = programs[0].tasks[id].wait_event;
  programs[0].events[ev].required -= 1;
  error = verify_error(programs);
  EXPECT_TRUE(contains(error, "but it completes at " + std::to_string(programs[0].events[ev].required))) << error;
  // An event nobody waits on, triggered once too often.
  programs = tiny_programs(Pass::backward);
  const auto wg = first_task(programs[0], TaskKind::router_wgrad);
  programs[0].tasks[wg].trigger_event = programs[0].tasks[wg].wait_event;
  error = verify_error(programs);
  EXPECT_TRUE(contains(error, "but is triggered by")) << error;
}

TEST(Verifier, FindsACycleAcrossRanks) {
  // Each rank reduces its combine before it dispatches its own tokens: the
  // reduce waits for the peer's expert outputs, which wait for this rank's
  // dispatch, which sits behind the reduce. Only abstract execution sees it.
  auto programs = tiny_programs(Pass::forward, 2, "cpu:1");
  for (auto& p : programs) {
    auto& q = p.queue_tasks;
    const auto reduce = std::find_if(q.begin(), q.end(), [&](std::int32_t id) { return p.tasks[id].kind == TaskKind::combine_reduce; });
    std::rotate(q.begin(), reduce, reduce + 1);  // move the first reduce to the front
  }
  const auto error = verify_error(programs);
  EXPECT_TRUE(contains(error, "deadlock: rank 0")) << error;
  EXPECT_TRUE(contains(error, "combine_reduce")) << error;
  EXPECT_TRUE(contains(error, "which reached 0 of")) << error;
}

TEST(Verifier, RejectsAShrunkTile) {
  auto programs = tiny_programs(Pass::forward);
  auto& t = programs[0].tasks[first_task(programs[0], TaskKind::gemm_gate_up)];
  t.rows -= 1;
  auto error = verify_error(programs);
  EXPECT_TRUE(contains(error, "coverage")) << error;
  EXPECT_TRUE(contains(error, "swiglu")) << error;
  EXPECT_TRUE(contains(error, "h1")) << error;
  // Results no task reads: a weight-gradient tile and an output row cut short.
  programs = tiny_programs(Pass::backward);
  programs[1].tasks[first_task(programs[1], TaskKind::gemm_down_wgrad)].cols -= 1;
  error = verify_error(programs);
  EXPECT_TRUE(contains(error, "outputs: rank 1 writes")) << error;
  EXPECT_TRUE(contains(error, "dw2")) << error;
  programs = tiny_programs(Pass::forward);
  programs[0].tasks[first_task(programs[0], TaskKind::combine_reduce)].rows -= 1;
  error = verify_error(programs);
  EXPECT_TRUE(contains(error, "outputs: rank 0 writes")) << error;
  EXPECT_TRUE(contains(error, "out rows")) << error;
}

TEST(Verifier, RejectsRacesConflictsAndBadQueues) {
  auto programs = tiny_programs(Pass::forward);
  // A GEMM2 tile that no longer waits for its SwiGLU row: a race.
  auto& down = programs[0].tasks[first_task(programs[0], TaskKind::gemm_down)];
  down.wait_event = -1;
  down.wait_count = 0;
  EXPECT_TRUE(contains(verify_error(programs), "race")) << verify(programs).error;
  // Two tiles writing the same elements.
  programs = tiny_programs(Pass::forward);
  const auto g = first_task(programs[0], TaskKind::gemm_gate_up);
  programs[0].tasks[g + 1].col_begin = programs[0].tasks[g].col_begin;
  EXPECT_TRUE(contains(verify_error(programs), "write conflict")) << verify(programs).error;
  // A matrix task queued on a vector worker, and a task on no queue.
  programs = compile(small(2, 150), contiguous(small(2, 150)), counts_for(small(2, 150), "uniform"), parse_machine("accel:1:1"), Pass::forward,
                     Policy::fill);
  std::swap(programs[0].queue_tasks.front(), programs[0].queue_tasks.back());
  EXPECT_TRUE(contains(verify_error(programs), "does not take that class")) << verify(programs).error;
  programs = tiny_programs(Pass::forward);
  programs[0].queue_tasks.pop_back();
  programs[0].queue_begin.back() -= 1;
  EXPECT_TRUE(contains(verify_error(programs), "is on no worker's queue")) << verify(programs).error;
}

// Weight-gradient strips (Machine::weight_tile_cols, as the CPU runtime runs
// them): a strip of two tiles and a ragged one per row; the verifier accepts
// the set, and rejects a strip cut short (a result's columns left unwritten,
// which no task reads) and one grown over its neighbour (a write conflict).
TEST(Verifier, ChecksWeightGradientStrips) {
  const LayerConfig c = small(2, 150);
  Machine m = parse_machine("cpu:2");
  m.weight_tile_cols = 2 * m.tile_cols;
  const auto strips = [&] { return compile(c, contiguous(c), counts_for(c, "uniform"), m, Pass::backward, Policy::critical_path); };
  auto programs = strips();
  expect_ok(programs);
  const auto w = first_task(programs[0], TaskKind::gemm_gate_up_wgrad);
  ASSERT_EQ(programs[0].tasks[w].cols, 2 * m.tile_cols);  // 2 x inter = 192: a strip of 128, then 64
  ASSERT_EQ(programs[0].tasks[w + 1].cols, 64);
  programs[0].tasks[w].cols -= 1;
  auto error = verify_error(programs);
  EXPECT_TRUE(contains(error, "outputs: rank 0 writes")) << error;
  EXPECT_TRUE(contains(error, "dw1")) << error;
  programs = strips();
  programs[0].tasks[w + 1].col_begin -= 64;
  programs[0].tasks[w + 1].cols += 64;
  error = verify_error(programs);
  EXPECT_TRUE(contains(error, "write conflict")) << error;
}

// Buffers are sized for each rank's own rows: a put is checked against the
// target rank's buffer, so a receiver that declares one row too few rejects
// the sender's put, and put targets must agree in width across ranks.
TEST(Verifier, ChecksPutsAgainstTheTargetRanksOwnBuffer) {
  auto programs = tiny_programs(Pass::forward);
  const auto put = first_task(programs[0], TaskKind::dispatch_put);
  const auto peer = programs[0].tasks[put].peer;
  auto* recv = const_cast<BufferLayout*>(programs[static_cast<std::size_t>(peer)].buffer(BufferId::recv));
  ASSERT_NE(recv, nullptr);
  recv->rows -= 1;
  auto error = verify_error(programs);
  EXPECT_TRUE(contains(error, "recv")) << error;
  // Ranks may size put targets differently, never lay them out with another width.
  programs = tiny_programs(Pass::forward);
  auto* comb = const_cast<BufferLayout*>(programs[1].buffer(BufferId::comb));
  comb->cols += 1;
  error = verify_error(programs);
  EXPECT_TRUE(contains(error, "declares put target comb unlike rank 0")) << error;
}

// Placement mutations: tasks naming experts that are not where they need
// them, slot tables that disagree, expert ids out of range.
TEST(Verifier, RejectsExpertsAwayFromTheirHome) {
  for (auto pass : {Pass::forward, Pass::backward}) {
    auto programs = tiny_programs(pass);
    // An expert task on rank 0 naming rank 1's expert.
    auto& gemm = programs[0].tasks[first_task(programs[0], pass == Pass::forward ? TaskKind::gemm_gate_up
                                                                                    : TaskKind::gemm_down_wgrad)];
    gemm.expert = programs[1].local_experts.front();
    auto error = verify_error(programs);
    EXPECT_TRUE(contains(error, "which does not hold it")) << error;
    // A dispatch put to a rank that does not own the expert.
    programs = tiny_programs(pass);
    auto& put = programs[0].tasks[first_task(programs[0], pass == Pass::forward ? TaskKind::dispatch_put
                                                                                   : TaskKind::grad_dispatch_put)];
    put.expert = programs[put.peer == 0 ? 1 : 0].local_experts.front();
    error = verify_error(programs);
    EXPECT_TRUE(contains(error, "which does not hold it")) << error;
    // An expert id past the layer's (issue 15's crash in verify).
    programs = tiny_programs(pass);
    programs[1].tasks[first_task(programs[1], pass == Pass::forward ? TaskKind::swiglu : TaskKind::gemm_gate_up_wgrad)]
        .expert = 5000;
    error = verify_error(programs);
    EXPECT_TRUE(contains(error, "names expert 5000, which does not exist")) << error;
    // A slot table that disagrees with the expert list.
    programs = tiny_programs(pass);
    std::swap(programs[0].expert_slot[static_cast<std::size_t>(programs[0].local_experts[0])],
              programs[0].expert_slot[static_cast<std::size_t>(programs[0].local_experts[1])]);
    error = verify_error(programs);
    EXPECT_TRUE(contains(error, "slot table disagrees")) << error;
    // An expert on a task kind that has none.
    programs = tiny_programs(pass);
    programs[0].tasks[first_task(programs[0], pass == Pass::forward ? TaskKind::combine_reduce : TaskKind::grad_reduce)]
        .expert = 0;
    error = verify_error(programs);
    EXPECT_TRUE(contains(error, "names an expert")) << error;
  }
}

// The table is what the verifier checks: widen one kind's write rectangle in
// a copy of it and programs that the standard table accepts are rejected.
TEST(Verifier, FollowsThePerturbedAccessTable) {
  for (auto [pass, kind, buffer] : {std::tuple{Pass::forward, TaskKind::gemm_gate_up, BufferId::h1},
                                    std::tuple{Pass::forward, TaskKind::swiglu, BufferId::a},
                                    std::tuple{Pass::backward, TaskKind::pack_down_grad, BufferId::dyp},
                                    std::tuple{Pass::backward, TaskKind::gemm_gate_up_wgrad, BufferId::dw1}}) {
    const auto programs = tiny_programs(pass);
    EXPECT_TRUE(verify(programs).ok);
    AccessTable widened = AccessTable::standard();
    bool found = false;
    for (auto& rule : widened.edit(kind).operands)
      if (rule.buffer == buffer && rule.use == Use::write) {
        rule.grow_rows = 1;
        found = true;
      }
    ASSERT_TRUE(found) << name(kind);
    Verifier verifier(widened);
    const auto report = verifier.verify(programs);
    EXPECT_FALSE(report.ok) << name(kind) << " widened by a row was accepted";
    EXPECT_TRUE(contains(report.error, "write conflict") || contains(report.error, "outside the buffer")) << report.error;
    EXPECT_TRUE(contains(report.error, name(kind))) << report.error;
  }
}


// The per-rank proof (docs/proofs.md): each rank checks its own
// program against the interface the counts predict, without its peers'.
namespace {
Pass flip(Pass p) { return p == Pass::forward ? Pass::backward : Pass::forward; }

// Deletes a task from a program, renumbering the queues.
void remove_task(Program& p, std::int32_t id) {
  p.tasks.erase(p.tasks.begin() + id);
  p.cost.erase(p.cost.begin() + id);
  const auto at = std::find(p.queue_tasks.begin(), p.queue_tasks.end(), id) - p.queue_tasks.begin();
  p.queue_tasks.erase(p.queue_tasks.begin() + at);
  for (auto& q : p.queue_tasks)
    if (q > id) --q;
  for (auto& b : p.queue_begin)
    if (b > at) --b;
}
}  // namespace

TEST(PerRankVerifier, RejectsAPutQueuedBehindWhatPeersSend) {
  for (auto pass : {Pass::forward, Pass::backward}) {
    // Rank 0's last put to rank 1 moved behind its reduce, which waits for
    // rank 1's returns, which wait for that put: a cycle across ranks that
    // rank 0 alone sees as a level-0 put depending on a level-1 event.
    auto programs = tiny_programs(pass, 2, "cpu:1");
    auto& p = programs[0];
    const TaskKind put = pass == Pass::forward ? TaskKind::dispatch_put : TaskKind::grad_dispatch_put;
    auto& q = p.queue_tasks;
    auto last_put = std::find_if(q.rbegin(), q.rend(), [&](std::int32_t id) { return p.tasks[id].kind == put && p.tasks[id].peer == 1; });
    ASSERT_NE(last_put, q.rend());
    const auto id = *last_put;
    q.erase(std::next(last_put).base());
    q.push_back(id);
    EXPECT_TRUE(contains(verify_error(programs), "deadlock")) << verify(programs).error;
    const auto error = per_rank_error(programs);
    EXPECT_TRUE(contains(error, "level: rank 0 task #" + std::to_string(id))) << error;
    EXPECT_TRUE(contains(error, "feeds a level-0 event of rank 1")) << error;
    EXPECT_TRUE(contains(error, "level-1 puts feed")) << error;
  }
}

// The per-rank condition is sufficient, not necessary: a put queued behind an
// expert tile that peers feed cannot deadlock here (the peers' pieces for
// that tile do not depend on it), so the whole set is accepted, but a rank
// alone cannot know that and refuses. The scheduler never emits this order.
TEST(PerRankVerifier, IsStricterThanTheWholeSetWhereItMustBe) {
  auto programs = tiny_programs(Pass::forward, 2, "cpu:1");
  auto& p = programs[0];
  auto& q = p.queue_tasks;
  const auto put = std::find_if(q.begin(), q.end(), [&](std::int32_t id) {
    return p.tasks[id].kind == TaskKind::dispatch_put && p.tasks[id].peer == 1;
  });
  const auto gemm = std::find_if(q.begin(), q.end(), [&](std::int32_t id) { return p.tasks[id].kind == TaskKind::gemm_gate_up; });
  ASSERT_TRUE(put != q.end() && gemm != q.end());
  ASSERT_LT(put, gemm);
  std::rotate(put, put + 1, gemm + 1);  // the put now runs right after the first gate/up tile
  expect_ok(programs);
  EXPECT_TRUE(contains(per_rank_error(programs), "level: rank 0")) << per_rank_error(programs);
}

TEST(PerRankVerifier, NamesPutsTheCountsDoNotPredict) {
  for (auto pass : {Pass::forward, Pass::backward}) {
    // A piece shifted by a row in the peer's buffer.
    auto programs = tiny_programs(pass);
    const TaskKind kind = pass == Pass::forward ? TaskKind::dispatch_put : TaskKind::grad_dispatch_put;
    auto& p = programs[1];
    std::int32_t id = -1;
    for (std::size_t i = 0; i < p.tasks.size() && id < 0; ++i)
      if (p.tasks[i].kind == kind && p.tasks[i].peer == 0) id = static_cast<std::int32_t>(i);
    ASSERT_GE(id, 0);
    p.tasks[id].row_begin += 1;
    verify_error(programs);
    auto error = per_rank_error(programs);
    EXPECT_TRUE(contains(error, "interface: rank 1 makes a put the routing counts do not predict")) << error;
    // A piece dropped: the sender lacks it (and rank 0's event misses a trigger).
    programs = tiny_programs(pass);
    remove_task(programs[1], id);
    error = per_rank_error(programs);
    EXPECT_TRUE(contains(error, "rank 1 lacks a put that the routing counts predict")) << error;
    // A program of the other pass, or of another rank count, is refused.
    const auto other = tiny_programs(flip(pass));
    const LayerConfig c = small(2, 150);
    Verifier verifier;
    EXPECT_FALSE(verifier.verify_rank(other[0], small(3, 150), contiguous(small(3, 150)), counts_for(small(3, 150), "uniform"),
                                      other[0].machine).ok);
    EXPECT_TRUE(verifier.verify_rank(other[0], c, contiguous(c), counts_for(c, "uniform"), other[0].machine).ok);
  }
}

// Another rank's counts (a peer that routed differently) change the
// interface; the rank's program then disagrees with what it must send.
TEST(PerRankVerifier, RejectsAProgramCompiledForOtherCounts) {
  const LayerConfig c = small(2, 150);
  const auto programs = compile(c, contiguous(c), counts_for(c, "uniform", 1), parse_machine("cpu:1"), Pass::forward, Policy::fill);
  const auto report = verify_rank(programs[0], c, contiguous(c), counts_for(c, "uniform", 2), parse_machine("cpu:1"));
  EXPECT_FALSE(report.ok);
  EXPECT_TRUE(contains(report.error, "interface") || contains(report.error, "required") || contains(report.error, "requires"))
      << report.error;
}

// Replicated experts: the quota plan divides each expert's rows among its
// homes; programs of every pass and policy verify both ways.
TEST(ReplicaPrograms, QuotasCoverEveryRowEvenOutRanksAndAreDeterministic) {
  LayerConfig c = small(4, 150);
  c.routed_experts = 8;
  const auto counts = counts_for(c, "hot:0.45", 3);
  // Expert 0 (hot) on all four ranks, expert 1 on two.
  const auto pl = ExpertPlacement::from_rank_lists(8, {{0, 1, 2}, {0, 3, 1}, {0, 4, 5}, {0, 6, 7}},
                                                   ExpertPlacement::Rules{.replicas = true});
  ASSERT_EQ(pl.instances(), 8 + 3 + 1);
  // Rows are the unit, independent of the compute tile.
  const auto q = plan_quotas(pl, counts.counts);
  EXPECT_EQ(q, plan_quotas(pl, counts.counts));  // the same on every rank
  const std::int64_t N = pl.instances();
  std::vector<std::int64_t> load(4, 0), plain(4, 0);
  for (std::int64_t s = 0; s < 4; ++s)
    for (std::int64_t e = 0; e < 8; ++e) {
      std::int64_t sum = 0;
      for (std::int64_t j = 0; j < pl.home_count(e); ++j) sum += q[static_cast<std::size_t>(s * N + pl.first_instance(e) + j)];
      EXPECT_EQ(sum, counts.at(s, e)) << "source " << s << " expert " << e;  // every row goes somewhere, once
    }
  for (std::int64_t i = 0; i < N; ++i)
    for (std::int64_t s = 0; s < 4; ++s) load[static_cast<std::size_t>(pl.instance_rank(i))] += q[static_cast<std::size_t>(s * N + i)];
  const auto contiguous_pl = ExpertPlacement::contiguous(8, 4);
  for (std::int64_t s = 0; s < 4; ++s)
    for (std::int64_t e = 0; e < 8; ++e) plain[static_cast<std::size_t>(contiguous_pl.owner(e))] += counts.at(s, e);
  const auto ratio = [](const std::vector<std::int64_t>& v) {
    return double(*std::max_element(v.begin(), v.end())) * double(v.size()) / double(std::accumulate(v.begin(), v.end(), std::int64_t{0}));
  };
  EXPECT_GT(ratio(plain), 2.0);  // the hot expert's rank carries most rows
  EXPECT_LT(ratio(load), 1.05) << "rank max/mean after the quota plan";
  // A source's rows go to its own rank's home first.
  for (std::int64_t s = 0; s < 4; ++s) EXPECT_GT(q[static_cast<std::size_t>(s * N + pl.instance_on(0, s))], 0);
  for (auto pass : {Pass::forward, Pass::backward})
    for (auto policy : {Policy::fill, Policy::critical_path, Policy::interleave_wgrad, Policy::ratr})
      for (const char* machine : {"cpu:2", "accel:2:3"})
        compile_checked(c, pl, counts, parse_machine(machine), pass, policy);
}

// Row-granular quotas: a home's share ends mid-tile where that evens the
// ranks out, to the row. Rank 0 holds expert 0 (300 rows) and expert 1
// (a replica with rank 1); rank 1 holds expert 2 (100 rows) and expert 1's
// other home. Expert 1's 301 rows bring the two ranks to 701 rows: level
// 350 and one row over, which goes to the earliest home (rank 0): rank 0
// takes 51 rows, rank 1 takes 250.
TEST(ReplicaPrograms, QuotasSplitRowsMidTileToTheRow) {
  const auto pl = ExpertPlacement::from_rank_lists(3, {{0, 1}, {2, 1}}, ExpertPlacement::Rules{.replicas = true});
  // counts[s E + e]: source 0 sends 300 rows to expert 0 and 301 to expert 1; source 1 sends 100 to expert 2.
  const std::vector<std::int64_t> counts = {300, 301, 0, 0, 0, 100};
  const auto q = plan_quotas(pl, counts);
  const std::int64_t N = pl.instances();
  const auto rows_of = [&](std::int64_t i) { return q[static_cast<std::size_t>(i)] + q[static_cast<std::size_t>(N + i)]; };
  const std::int64_t on0 = rows_of(pl.instance_on(1, 0)), on1 = rows_of(pl.instance_on(1, 1));
  EXPECT_EQ(on0 + on1, 301);
  // Loads 300 + on0 and 100 + on1 differ by at most one row: 701 rows over two ranks.
  EXPECT_EQ(300 + on0, 351);
  EXPECT_EQ(100 + on1, 350);
  EXPECT_NE(on1 % 64, 0);  // not a whole number of any usual tile
  // A rank already above the level takes nothing.
  const std::vector<std::int64_t> light = {300, 20, 0, 0, 0, 100};
  const auto q2 = plan_quotas(pl, light);
  EXPECT_EQ(q2[static_cast<std::size_t>(pl.instance_on(1, 0))] + q2[static_cast<std::size_t>(N + pl.instance_on(1, 0))], 0);
}

// A placement feature goes through the proof: a dispatch put sent to another
// home of a replicated expert than the quota plan chose is rejected by the
// whole-set check and by the sending rank's own check.
TEST(ReplicaPrograms, PutToTheWrongHomeIsRejected) {
  LayerConfig c = small(4, 150);
  c.routed_experts = 8;
  const auto counts = counts_for(c, "hot:0.45", 3);
  const auto pl = ExpertPlacement::from_rank_lists(8, {{0, 1, 2}, {0, 3, 1}, {0, 4, 5}, {0, 6, 7}},
                                                   ExpertPlacement::Rules{.replicas = true});
  const Machine m = parse_machine("cpu:1");
  auto programs = compile(c, pl, counts, m, Pass::forward, Policy::fill);
  bool mutated = false;
  for (auto& p : programs) {
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::dispatch_put && t.expert == 0 && t.peer != p.rank) {
        t.peer = (t.peer + 1) % 4 == p.rank ? (t.peer + 2) % 4 : (t.peer + 1) % 4;  // another home of expert 0
        mutated = true;
        break;
      }
    if (mutated) {
      EXPECT_FALSE(verify(programs).ok);
      EXPECT_FALSE(verify_rank(p, c, pl, counts, m).ok);
      break;
    }
  }
  EXPECT_TRUE(mutated);
}

// ---- Tensor-parallel split experts: a declared reduction in the proof.

namespace {
// Expert 0 (hot) split into three parts, expert 5 into two uneven ones,
// expert 3 replicated; every rank holds a part of expert 0.
struct SplitCase {
  LayerConfig c;
  ExpertPlacement placement;
  RoutingCounts counts;
};
SplitCase split_case(std::int64_t ranks, const char* routing) {
  SplitCase k{small(ranks, 150), {}, {}};
  k.c.routed_experts = 8;
  ExpertPlacement::Rules rules{.replicas = true};
  std::vector<std::vector<std::int64_t>> lists;
  if (ranks == 2) {
    lists = {{0, 1, 2, 3, 5}, {0, 3, 4, 5, 6, 7}};
    rules.splits = {{0, {0, 64, 96}}, {5, {0, 40, 96}}};
  } else {
    lists = {{0, 1, 2, 3}, {0, 3, 4, 5}, {0, 5, 6}, {0, 7}};
    rules.splits = {{0, {0, 32, 48, 64, 96}}, {5, {0, 40, 96}}};
  }
  k.placement = ExpertPlacement::from_rank_lists(8, lists, rules);
  k.counts = counts_for(k.c, routing, 5);
  return k;
}
// A corrupted split set must fail the whole-set check and some rank's own.
std::string split_error(const SplitCase& k, const std::vector<Program>& programs) {
  const auto whole = verify(programs);
  EXPECT_FALSE(whole.ok) << "the corrupted program was accepted";
  Verifier verifier;
  std::string own;
  for (const auto& p : programs) {
    const auto report = verifier.verify_rank(p, k.c, k.placement, k.counts, programs[0].machine);
    if (!report.ok) {
      own = report.error;
      break;
    }
  }
  EXPECT_NE(own, "") << "every rank alone accepted the corrupted set (full check: " << whole.error << ")";
  return whole.error;
}
}  // namespace

TEST(SplitPrograms, CompileAndVerifyForEveryPolicyPassAndMachine) {
  for (const std::int64_t ranks : {2, 4})
    for (const char* routing : {"uniform", "hot:0.45"}) {
      const SplitCase k = split_case(ranks, routing);
      for (const auto pass : {Pass::forward, Pass::backward})
        for (const auto policy : {Policy::fill, Policy::rank_rotated, Policy::critical_path, Policy::interleave_wgrad, Policy::ratr})
          for (const char* machine : {"cpu:1", "cpu:2", "accel:2:3"}) {
            const auto programs = compile_checked(k.c, k.placement, k.counts, parse_machine(machine), pass, policy);
            // Each part computes its own columns; every source that chose a
            // split expert declares its reduction.
            for (const auto& p : programs) {
              const auto slot = p.slot_of(0);
              ASSERT_GE(slot, 0);
              EXPECT_EQ(p.slot_parts[static_cast<std::size_t>(slot)].parts, ranks == 2 ? 2 : 4);
              EXPECT_FALSE(p.reductions.empty());
            }
          }
    }
}

TEST(SplitPrograms, ExchangeGivesEveryPartAllRowsAndDeclaresReductions) {
  const SplitCase k = split_case(4, "hot:0.45");
  const auto programs = compile(k.c, k.placement, k.counts, parse_machine("cpu:1"), Pass::forward, Policy::fill);
  std::int64_t rows_of_0 = 0;
  for (std::int64_t s = 0; s < 4; ++s) rows_of_0 += k.counts.at(s, 0);
  for (const auto& p : programs) {
    const auto slot = static_cast<std::size_t>(p.slot_of(0));
    EXPECT_EQ(p.expert_begin[slot + 1] - p.expert_begin[slot], rows_of_0) << "rank " << p.rank;
    const auto& red = p.reductions.front();
    EXPECT_EQ(red.expert, 0);
    EXPECT_EQ(red.parts, 4);
    EXPECT_EQ(red.rows, k.counts.at(p.rank, 0));
  }
  EXPECT_EQ(programs[2].slot_parts[static_cast<std::size_t>(programs[2].slot_of(0))], (SlotPart{48, 16, 2, 4}));
  // Round trip through a dump keeps the parts and reductions.
  const Program back = program_from_json(to_json(programs[1]));
  EXPECT_EQ(back.slot_parts, programs[1].slot_parts);
  EXPECT_EQ(back.reductions, programs[1].reductions);
}

TEST(SplitPrograms, MutationsOfTheReductionAreRejected) {
  const SplitCase k = split_case(2, "hot:0.45");
  for (const auto pass : {Pass::forward, Pass::backward}) {
    const TaskKind reduce = pass == Pass::forward ? TaskKind::part_reduce : TaskKind::grad_part_reduce;
    const TaskKind combine = pass == Pass::forward ? TaskKind::combine_reduce : TaskKind::grad_reduce;
    const TaskKind put = pass == Pass::forward ? TaskKind::combine_put : TaskKind::grad_combine_put;
    const auto base = compile(k.c, k.placement, k.counts, parse_machine("cpu:2"), pass, Policy::critical_path);
    {  // the reduction reads the partials without waiting for them
      auto programs = base;
      auto& t = programs[0].tasks[first_task(programs[0], reduce)];
      t.wait_event = -1;
      t.wait_count = 0;
      EXPECT_TRUE(contains(split_error(k, programs), "does not wait")) << split_error(k, programs);
    }
    {  // the combine skips the reduction (waits for the returned pieces only)
      auto programs = base;
      auto& p = programs[1];
      const Task r = p.tasks[first_task(p, reduce)];
      for (auto& t : p.tasks)
        if (t.kind == combine) {
          t.wait_event = r.wait_event;
          t.wait_count = r.wait_count;
        }
      const auto ev = r.trigger_event;
      p.events[static_cast<std::size_t>(ev)].consumer = reduce;  // nothing waits on it now
      EXPECT_TRUE(contains(split_error(k, programs), "does not wait")) << split_error(k, programs);
    }
    {  // a reduction tile one row short: a partial row is never summed
      auto programs = base;
      auto& t = programs[0].tasks[first_task(programs[0], reduce)];
      t.rows -= 1;
      EXPECT_TRUE(contains(split_error(k, programs), "every partial row must be summed exactly once"))
          << split_error(k, programs);
    }
    {  // two reductions of the same rows
      auto programs = base;
      auto& p = programs[0];
      std::vector<std::int32_t> ids;
      for (std::size_t i = 0; i < p.tasks.size(); ++i)
        if (p.tasks[i].kind == reduce) ids.push_back(static_cast<std::int32_t>(i));
      if (ids.size() >= 2) {
        p.tasks[ids[1]].row_begin = p.tasks[ids[0]].row_begin;
        p.tasks[ids[1]].rows = p.tasks[ids[0]].rows;
        p.tasks[ids[1]].src_row = p.tasks[ids[0]].src_row;
        const auto error = split_error(k, programs);
        EXPECT_TRUE(contains(error, "conflict") || contains(error, "exactly once")) << error;
      }
    }
    {  // the source forgets its declared reduction
      auto programs = base;
      programs[1].reductions.clear();
      const auto error = split_error(k, programs);
      EXPECT_TRUE(contains(error, "reduction")) << error;
    }
    {  // a part returns its partials into another part's block
      auto programs = base;
      bool moved = false;
      for (auto& p : programs)
        for (auto& t : p.tasks)
          if (!moved && t.kind == put && t.expert == 0 && p.slot_parts[static_cast<std::size_t>(p.slot_of(0))].part == 1) {
            const Reduction* red = programs[static_cast<std::size_t>(t.peer)].reduction_at(t.row_begin - k.counts.at(t.peer, 0));
            ASSERT_NE(red, nullptr);
            t.row_begin -= static_cast<std::int32_t>(red->rows);  // onto part 0's rows
            moved = true;
          }
      ASSERT_TRUE(moved);
      const auto error = split_error(k, programs);
      EXPECT_TRUE(contains(error, "outside that part's block") || contains(error, "conflict")) << error;
    }
    {  // a part computes columns past the intermediate dimension
      auto programs = base;
      auto& sp = programs[0].slot_parts[static_cast<std::size_t>(programs[0].slot_of(5))];
      sp.inter += 8;  // overlaps the next part's columns
      EXPECT_TRUE(contains(split_error(k, programs), "do not tile")) << split_error(k, programs);
      sp.inter_begin = 60;
      EXPECT_TRUE(contains(split_error(k, programs), "impossible part")) << split_error(k, programs);
    }
  }
}

