// The compiler: task generation for every pass, policy and layout, the schedule
// policies, the access table, program dumps, edge cases.
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


class CompileAll : public ::testing::TestWithParam<std::tuple<Pass, Policy, int, std::string>> {};

TEST_P(CompileAll, VerifiesForEveryPolicyPassAndLayout) {
  const auto [pass, policy, ranks, machine] = GetParam();
  for (const char* routing : {"uniform", "zipf:2.5"}) {
    const LayerConfig c = small(ranks, 150);
    const auto programs = compile_checked(c, contiguous(c), counts_for(c, routing), parse_machine(machine), pass, policy);
    ASSERT_EQ(programs.size(), static_cast<std::size_t>(ranks));
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, CompileAll,
    ::testing::Combine(::testing::Values(Pass::forward, Pass::backward),
                       ::testing::Values(Policy::fill, Policy::rank_rotated, Policy::critical_path, Policy::interleave_wgrad, Policy::ratr),
                       ::testing::Values(1, 2, 4), ::testing::Values("cpu:1", "cpu:2", "accel:2:3")),
    [](const auto& info) {
      std::string m = std::get<3>(info.param);
      for (auto& ch : m)
        if (ch == ':') ch = '_';
      std::string p = name(std::get<1>(info.param));
      for (auto& ch : p)
        if (ch == '-') ch = '_';
      return std::string(std::get<0>(info.param) == Pass::forward ? "fwd" : "bwd") + "_" + p + "_P" +
             std::to_string(std::get<2>(info.param)) + "_" + m;
    });


// Where the order matters, a policy beats filling queues in generation order
// under the cost model: on separate matrix and vector units, fill leaves the
// puts that feed the other ranks (and their GEMMs) behind local work.
TEST(Schedule, CriticalPathBeatsFillWhereOrderMatters) {
  LayerConfig c = small(4, 150);
  c.routed_experts = 16;
  const auto counts = counts_for(c, "zipf:1.2");
  const auto fill = compile(c, contiguous(c), counts, parse_machine("accel:1:1"), Pass::forward, Policy::fill);
  const auto best = compile(c, contiguous(c), counts, parse_machine("accel:1:1"), Pass::forward, Policy::critical_path);
  expect_ok(fill);
  expect_ok(best);
  double fill_makespan = 0, best_makespan = 0;
  for (std::int64_t r = 0; r < c.ranks; ++r) {
    fill_makespan = std::max(fill_makespan, stats(fill, r).makespan_s);
    best_makespan = std::max(best_makespan, stats(best, r).makespan_s);
  }
  EXPECT_LT(best_makespan, 0.97 * fill_makespan);
}

// The table's work is what the cost model and simulator see.
TEST(AccessTable, WorkAndOperandsOfAGemmTile) {
  const auto programs = tiny_programs(Pass::forward);
  const Program& p = programs[0];
  const Task& t = p.tasks[static_cast<std::size_t>(first_task(p, TaskKind::gemm_gate_up))];
  const auto& table = AccessTable::standard();
  const TaskWork w = table.work(p, t);
  EXPECT_EQ(w.k, p.dims.hidden);
  EXPECT_DOUBLE_EQ(w.flops, 2.0 * t.rows * t.cols * p.dims.hidden);
  const Rect a = table.operand(p, t, BufferId::recv, Use::read);
  EXPECT_EQ(a.r0, t.row_begin);
  EXPECT_EQ(a.rows(), t.rows);
  EXPECT_EQ(a.cols(), p.dims.hidden);
  const Rect out = table.operand(p, t, BufferId::h1, Use::write);
  EXPECT_EQ(out.c0, t.col_begin);
  EXPECT_EQ(out.cols(), t.cols);
  EXPECT_THROW(table.operand(p, t, BufferId::y, Use::write), Error);
  for (std::size_t k = 0; k < static_cast<std::size_t>(TaskKind::count); ++k) {
    const auto kind = static_cast<TaskKind>(k);
    // Every kind reads and writes, but the per-rank and per-node exchanges' relays, which
    // only pass on that an event completed.
    if (kind == TaskKind::dispatch_relay || kind == TaskKind::grad_dispatch_relay || kind == TaskKind::combine_relay ||
        kind == TaskKind::grad_combine_relay || kind == TaskKind::dispatch_node_relay || kind == TaskKind::grad_dispatch_node_relay ||
        kind == TaskKind::weight_relay || kind == TaskKind::grad_weight_relay || kind == TaskKind::combine_node_relay ||
        kind == TaskKind::grad_combine_node_relay)
      EXPECT_EQ(table[kind].operand_count, 0);
    // A weight put reads the owner's packed weights, which no launch writes
    // (they change between steps only): it declares its write alone.
    else if (kind == TaskKind::weight_put || kind == TaskKind::grad_weight_put) EXPECT_EQ(table[kind].operand_count, 1);
    else EXPECT_GT(table[kind].operand_count, 1) << name(kind);
    EXPECT_EQ(table[kind].queue == QueueClass::matrix, table[kind].gemm_k != Extent::none) << name(kind);
  }
}

// Programs compiled for an uneven and a permuted placement verify.
TEST(Taskflow, UnevenAndPermutedPlacementsVerify) {
  LayerConfig c = small(3, 97);
  c.routed_experts = 8;
  for (const auto& placement : {ExpertPlacement::contiguous(8, 3), ExpertPlacement::round_robin(8, 3),
                                ExpertPlacement::random(8, 3, 9)})
    for (auto pass : {Pass::forward, Pass::backward}) {
      const auto programs = compile_checked(c, placement, counts_for(c, "zipf:1.3"), parse_machine("cpu:2"), pass,
                                            Policy::critical_path);
      for (std::int64_t r = 0; r < 3; ++r)
        EXPECT_EQ(static_cast<std::int64_t>(programs[static_cast<std::size_t>(r)].local_experts.size()),
                  placement.local_count(r));
    }
}

TEST(Taskflow, EdgeCases) {
  // P = 1 (puts stay local), no shared experts, empty experts, single-token tiles.
  for (auto pass : {Pass::forward, Pass::backward}) {
    LayerConfig c = small(1, 37);
    c.shared_experts = 0;
    compile_checked(c, contiguous(c), counts_for(c, "zipf:4"), parse_machine("cpu:2"), pass, Policy::critical_path);
    c = small(4, 1);  // one token per rank
    const auto counts = counts_for(c, "uniform");
    std::int64_t empty = 0;
    for (auto n : counts.counts) empty += n == 0;
    EXPECT_GT(empty, 0);
    compile_checked(c, contiguous(c), counts, parse_machine("cpu:2:1x64"), pass, Policy::critical_path);
    c = small(2, 130);
    compile_checked(c, contiguous(c), counts_for(c, "hot:0.45"), parse_machine("cpu:2:1x64"), pass, Policy::interleave_wgrad);
  }
}

TEST(Taskflow, LargeLayerCountsAndDependencies) {
  LayerConfig c = preset("deepseek-v2-lite");
  c.ranks = 4;
  c.tokens_per_rank = 1024;
  const auto counts = counts_for(c, "zipf:1.2");
  const auto programs = compile_checked(c, contiguous(c), counts, parse_machine("cpu:2"), Pass::forward, Policy::critical_path);
  const auto s = stats(programs, 1);
  // Every gate/up tile of rank 1: ceil(rows / 64) row tiles x 2816 / 64 column tiles per expert.
  std::int64_t expected = 0;
  const ExpertPlacement placement = contiguous(c);
  for (const std::int64_t e : placement.experts_of(1)) {
    std::int64_t rows = 0;
    for (std::int64_t src = 0; src < c.ranks; ++src) rows += counts.at(src, e);
    expected += (rows + 63) / 64 * (2 * c.expert_inter / 64);
  }
  EXPECT_EQ(s.tasks_by_kind[static_cast<std::size_t>(TaskKind::gemm_gate_up)], expected);
  EXPECT_GT(s.critical_path_s, 0);
  EXPECT_GE(s.makespan_s, s.critical_path_s);
  double load = 0;
  for (double l : s.worker_load_s) load += l;
  EXPECT_GE(s.makespan_s * 2 * 1.0001, load);  // two workers cannot beat their total load
  compile_checked(c, contiguous(c), counts, parse_machine("cpu:2"), Pass::backward, Policy::interleave_wgrad);
}

TEST(Taskflow, RankRotatedPutsStartWithTheNextRank) {
  const LayerConfig c = small(4, 150);
  const auto programs = compile(c, contiguous(c), counts_for(c, "uniform"), parse_machine("cpu:1"), Pass::forward, Policy::rank_rotated);
  const auto& p = programs[2];
  EXPECT_EQ(p.tasks[p.queue_tasks[0]].kind, TaskKind::dispatch_put);
  EXPECT_EQ(p.tasks[p.queue_tasks[0]].peer, 2);  // (0 + r) mod P: itself first
  std::int32_t last = 0;
  for (auto id : p.queue_tasks) {
    if (p.tasks[id].kind != TaskKind::dispatch_put) break;
    const std::int32_t key = (p.tasks[id].peer - 2 + 4) % 4;
    EXPECT_GE(key, last);
    last = key;
  }
}

// The router's data gradient feeds only the final reductions: under RATR
// it is queued after every data-gradient task of the routed experts on each
// worker (queued first, it held the matrix units behind the router's
// backward while the experts' dy had landed), and before the reductions.
TEST(Taskflow, RatrQueuesTheRoutersDataGradientAfterTheExpertChains) {
  const LayerConfig c = small(4, 300);
  const Machine m = parse_machine("accel:4:12:32x64");
  const auto programs = compile_checked(c, contiguous(c), counts_for(c, "uniform"), m, Pass::backward, Policy::ratr);
  for (const Program& p : programs) {
    std::int64_t router = 0;
    for (int w = 0; w < m.workers(); ++w) {
      bool seen_router = false;
      for (std::int32_t q = p.queue_begin[static_cast<std::size_t>(w)]; q < p.queue_begin[static_cast<std::size_t>(w) + 1]; ++q) {
        const Task& t = p.tasks[static_cast<std::size_t>(p.queue_tasks[static_cast<std::size_t>(q)])];
        if (t.kind == TaskKind::router_dgrad) seen_router = true, ++router;
        const TileStep step = role(t.kind).step;
        const bool chain = t.expert >= 0 && step != TileStep::none && step != TileStep::weight_gradient;
        EXPECT_FALSE(seen_router && chain) << "rank " << p.rank << " worker " << w << ": " << name(t.kind) << " after router_dgrad";
      }
    }
    EXPECT_GT(router, 0);
  }
}

// On a machine with matrix units of their own and at least 8 local
// experts, RATR queues an expert's weight gradients between a later
// expert's row tiles (spread_weight_gradients), so that they fill matrix
// units waiting for dy; with fewer experts, or on a CPU, after every chain.
TEST(Taskflow, RatrSpreadsWeightGradientsBetweenLaterExpertsRowTilesOnAccelerators) {
  LayerConfig c = small(2, 512);
  c.routed_experts = 16;  // 8 a rank
  c.top_k = 2;
  const auto spread_on = [&](const Machine& m, const LayerConfig& layer) {
    const auto programs = compile_checked(layer, contiguous(layer), counts_for(layer, "uniform"), m, Pass::backward, Policy::ratr);
    std::int64_t early = 0;  // weight-gradient tasks queued before some chain task
    for (const Program& p : programs)
      for (int w = 0; w < m.workers(); ++w) {
        std::int64_t wgrads = 0;
        for (std::int32_t q = p.queue_begin[static_cast<std::size_t>(w)]; q < p.queue_begin[static_cast<std::size_t>(w) + 1]; ++q) {
          const Task& t = p.tasks[static_cast<std::size_t>(p.queue_tasks[static_cast<std::size_t>(q)])];
          const TileStep step = role(t.kind).step;
          if (t.expert >= 0 && step == TileStep::weight_gradient) ++wgrads;
          else if (t.expert >= 0 && step != TileStep::none) early += wgrads, wgrads = 0;
        }
      }
    return early;
  };
  EXPECT_GT(spread_on(parse_machine("accel:4:4:32x64"), c), 0);
  EXPECT_EQ(spread_on(parse_machine("cpu:2"), c), 0);
  LayerConfig few = c;
  few.routed_experts = 8;  // 4 a rank
  EXPECT_EQ(spread_on(parse_machine("accel:4:4:32x64"), few), 0);
}

// The final reductions wait for everything and nothing runs beside them:
// they come in even waves over the vector workers (as many waves as token
// tiles would take), every token reduced once.
TEST(Taskflow, FinalReductionsComeInEvenWavesOverTheVectorWorkers) {
  for (const std::int64_t T : {420, 1000, 64}) {
    const LayerConfig c = small(4, T);
    const Machine m = parse_machine("accel:4:12:32x64");
    for (const Pass pass : {Pass::forward, Pass::backward}) {
      SCOPED_TRACE(std::to_string(T) + (pass == Pass::forward ? " forward" : " backward"));
      const auto programs = compile_checked(c, contiguous(c), counts_for(c, "uniform"), m, pass, Policy::ratr);
      const std::int64_t tiles = (T + m.tile_rows - 1) / m.tile_rows, waves = (tiles + 11) / 12;
      for (const Program& p : programs) {
        std::vector<int> covered(static_cast<std::size_t>(T), 0);
        std::int64_t tasks = 0, widest = 0;
        for (const Task& t : p.tasks)
          if (role(t.kind).place == Place::reduction) {
            ++tasks, widest = std::max<std::int64_t>(widest, t.rows);
            for (std::int64_t r = t.row_begin; r < t.row_begin + t.rows; ++r) ++covered[static_cast<std::size_t>(r)];
          }
        EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](int n) { return n == 1; }));
        EXPECT_LE(tasks, waves * 12);
        EXPECT_LE(widest, m.tile_rows);
        EXPECT_LE((T + widest - 1) / widest, waves * 12);
        if (T == 420) {
          EXPECT_EQ(widest, 24);  // 14 tiles of 32 are two waves: 18 tasks of 24 rows, not 14 of 32
        }
      }
    }
  }
}

TEST(Taskflow, JsonRoundTripAndMalformedDumps) {
  const auto programs = tiny_programs(Pass::backward);
  std::vector<Program> back;
  for (const auto& p : programs) back.push_back(program_from_json(nlohmann::json::parse(to_json(p).dump())));
  expect_ok(back);
  EXPECT_EQ(to_json(back[1]), to_json(programs[1]));
  EXPECT_FALSE(listing(programs[0]).empty());
  auto j = to_json(programs[0]);
  EXPECT_THROW(program_from_json(nlohmann::json::parse("[1, 2]")), Error);
  auto bad = j;
  bad["version"] = 99;
  EXPECT_THROW(program_from_json(bad), Error);
  bad = j;
  bad["tasks"][0][0] = "teleport";
  EXPECT_THROW(program_from_json(bad), Error);
  bad = j;
  bad["tasks"][3] = {1, 2};
  EXPECT_THROW(program_from_json(bad), Error);
  bad = j;
  bad["queues"][0][0] = 999999;
  EXPECT_THROW(program_from_json(bad), Error);
  bad = j;
  bad.erase("events");
  EXPECT_THROW(program_from_json(bad), Error);
  bad = j;
  bad["rank"] = "zero";
  EXPECT_THROW(program_from_json(bad), Error);
  bad = j;
  bad["machine"]["weight_tile_cols"] = bad["machine"]["tile_cols"].get<std::int64_t>() + 1;  // strips of whole tiles only
  EXPECT_THROW(program_from_json(bad), Error);
  bad = j;
  bad["machine"]["matrix_runs_vector"] = 1;
  EXPECT_THROW(program_from_json(bad), Error);
  // Written only where set, and read back.
  EXPECT_FALSE(j["machine"].contains("matrix_runs_vector"));
  Program gpu = programs[0];
  gpu.machine.matrix_runs_vector = true;
  EXPECT_TRUE(program_from_json(nlohmann::json::parse(to_json(gpu).dump())).machine.matrix_runs_vector);
}

TEST(Taskflow, RejectsImpossibleInputs) {
  const LayerConfig c = small(2, 150);
  auto counts = counts_for(c, "uniform");
  counts.counts[3] = 10000;  // more rows than the rank has tokens
  EXPECT_THROW(compile(c, contiguous(c), counts, parse_machine("cpu:1"), Pass::forward, Policy::fill), Error);
  counts.counts.pop_back();
  EXPECT_THROW(compile(c, contiguous(c), counts, parse_machine("cpu:1"), Pass::forward, Policy::fill), Error);
  EXPECT_THROW(parse_machine("gpu:4"), Error);
  EXPECT_THROW(parse_machine("cpu:0"), Error);
  EXPECT_THROW(parse_machine("cpu:2:64"), Error);
  EXPECT_THROW(parse_machine("accel:1"), Error);
  EXPECT_THROW(parse_policy("random"), Error);
}

TEST(Taskflow, RanksWithoutRoutedRowsStillVerify) {
  // Steep Zipf: some ranks' experts receive nothing. Their own dispatch puts
  // must still precede their combine, under every policy.
  for (auto pass : {Pass::forward, Pass::backward})
    for (auto policy : {Policy::fill, Policy::rank_rotated, Policy::critical_path, Policy::interleave_wgrad, Policy::ratr})
      for (std::uint64_t seed = 1; seed <= 12; ++seed) {
        LayerConfig c = preset("tiny");
        c.ranks = 4;
        c.tokens_per_rank = 9;
        c.shared_experts = 0;
        const auto counts = counts_for(c, "zipf:4", seed);
        compile_checked(c, contiguous(c), counts, parse_machine("cpu:1"), pass, policy);
      }
}

