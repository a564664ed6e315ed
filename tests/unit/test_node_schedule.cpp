// The order in which a forwarder of the per-node exchange returns its node
// sums, where a rank holds one or two expert slots (the sums of a source's
// last combine slot are most of them, and go after the rank's last other
// put on every vector worker: compiler/schedule.cpp place_node_sums).
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "exchange_cases.hpp"

using namespace hpmoe;
using namespace hpmoe::testing;

namespace {

// Rotated by node: a forwarder in node b returns its sums to node b + 1's
// sources first, then b + 2's, and so on, so that every source's link hears
// from about one forwarder at a time (in source order, every node's
// forwarders sent to the first nodes' sources at once: on the H800 model at
// EP 256 that incast took the forward from 28 to 38 ms). Each queue, a
// subsequence of the list order, must see the peers' node distances rise.
TEST(NodeSchedule, LateNodeSumsGoOutRotatedByNode) {
  LayerConfig c = small(16, 64);
  c.routed_experts = 16;  // one expert slot a rank
  c.top_k = 4;
  c.exchange = ExchangeMode::rank;
  c.ranks_per_node = 2;  // 8 nodes
  c.validate();
  const auto placement = contiguous(c);
  const Machine m = parse_machine("accel:4:12:32x64");
  const auto counts = rank_counts(c, placement, "uniform", m.tile_rows);
  const std::int64_t R = c.ranks_per_node, nodes = c.ranks / R;
  for (const Pass pass : {Pass::forward, Pass::backward}) {
    SCOPED_TRACE(pass == Pass::forward ? "forward" : "backward");
    const TaskKind node_sum = pass == Pass::forward ? TaskKind::combine_node_put : TaskKind::grad_combine_node_put;
    const auto programs = compile_checked(c, placement, counts, m, pass, Policy::ratr);
    int sums = 0, queues_with_several_nodes = 0;
    for (const Program& p : programs)
      for (std::size_t w = 0; w + 1 < p.queue_begin.size(); ++w) {
        std::int64_t last = 0;
        std::set<std::int64_t> seen;
        for (auto i = p.queue_begin[w]; i < p.queue_begin[w + 1]; ++i) {
          const Task& t = p.tasks[static_cast<std::size_t>(p.queue_tasks[static_cast<std::size_t>(i)])];
          if (t.kind != node_sum) continue;
          const std::int64_t distance = (t.peer / R - p.rank / R + nodes) % nodes;
          EXPECT_GE(distance, last) << "rank " << p.rank << " queue " << w << ": a sum for node " << t.peer / R
                                    << " after one for a node further on";
          last = distance;
          seen.insert(distance);
          ++sums;
        }
        queues_with_several_nodes += seen.size() > 1;
      }
    EXPECT_GT(sums, 0);
    EXPECT_GT(queues_with_several_nodes, 0) << "no queue returned sums to two nodes: the order is not tested";
  }
}

// Where matrix workers run vector code (a GPU's SMs), the final reductions,
// which wait for every return, are dealt over them too; elsewhere they stay
// on the vector workers. A program that hands a vector task to a matrix
// worker of a machine whose matrix units cannot run it is refused by the
// whole-set and the per-rank proof.
TEST(NodeSchedule, FinalReductionsTakeTheMatrixWorkersWhereTheyRunVectorCode) {
  const LayerConfig c = node_layer(4, 2, 256);
  const auto placement = contiguous(c);
  Machine m = parse_machine("accel:4:12:32x64");
  const auto counts = rank_counts(c, placement, "uniform", m.tile_rows);
  for (const Pass pass : {Pass::forward, Pass::backward}) {
    SCOPED_TRACE(pass == Pass::forward ? "forward" : "backward");
    const TaskKind reduce = pass == Pass::forward ? TaskKind::combine_rank_reduce : TaskKind::grad_rank_reduce;
    const auto on_matrix_workers = [&](const std::vector<Program>& programs) {
      int n = 0, all = 0;
      for (const Program& p : programs)
        for (int w = 0; w < p.machine.workers(); ++w)
          for (auto i = p.queue_begin[static_cast<std::size_t>(w)]; i < p.queue_begin[static_cast<std::size_t>(w) + 1]; ++i) {
            const bool is_reduce = p.tasks[static_cast<std::size_t>(p.queue_tasks[static_cast<std::size_t>(i)])].kind == reduce;
            all += is_reduce;
            n += is_reduce && w < p.machine.matrix_workers;
          }
      return std::pair{n, all};
    };
    m.matrix_runs_vector = false;
    const auto apart = compile_checked(c, placement, counts, m, pass, Policy::ratr);
    EXPECT_EQ(on_matrix_workers(apart).first, 0);
    m.matrix_runs_vector = true;
    auto together = compile_checked(c, placement, counts, m, pass, Policy::ratr);
    const auto [n, all] = on_matrix_workers(together);
    // Sized for one wave over all 16 workers: more tasks than the 12 vector workers.
    EXPECT_GT(all / static_cast<int>(together.size()), 12);
    // The list scheduling hands them to the workers free first: in the
    // forward the matrix workers are idle by then; in the backward their
    // weight gradients may still run.
    if (pass == Pass::backward) continue;
    EXPECT_GT(n, 0) << "no final reduction on a matrix worker";
    Machine cube = m;
    cube.matrix_runs_vector = false;
    for (Program& p : together) p.machine = cube;
    expect_rejected(together, c, placement, counts, cube, "a vector task on a matrix worker that cannot run it");
  }
}

}  // namespace
