// The per-step quota plan against an exact solver on small cases
// (docs/results/placement.md). The plan's objective is the slowest rank's
// load in rows (unreplicated experts fixed, each home of a replicated expert
// paying for the rows it takes; quotas end mid-tile where that helps). The
// exact optimum is the least level W for which the replicated experts' rows
// fit under W on every rank: a flow problem (expert -> its homes' ranks ->
// W minus the rank's fixed rows), whose integral maximum flow gives integer
// quotas, so bisection over W with a max-flow check finds it. Random cases:
// P = 2..6, 4..12 experts, one to four replicated experts with two to four
// homes, Zipf-like counts.
//
//   build/bench/quota_gap [CASES] [SEED]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "hpmoe/placement.hpp"

using namespace hpmoe;

namespace {

struct Case {
  ExpertPlacement placement;
  std::vector<std::int64_t> counts;  // P x E
};

// The slowest rank's rows under the plan's quotas.
std::int64_t planned(const Case& k) {
  const auto& p = k.placement;
  const auto q = plan_quotas(p, k.counts);
  const std::int64_t P = p.ranks(), N = p.instances();
  std::vector<std::int64_t> load(static_cast<std::size_t>(P), 0);
  for (std::int64_t i = 0; i < N; ++i)
    for (std::int64_t s = 0; s < P; ++s) load[static_cast<std::size_t>(p.instance_rank(i))] += q[static_cast<std::size_t>(s * N + i)];
  return *std::max_element(load.begin(), load.end());
}

// Maximum flow (Edmonds-Karp) on a dense capacity matrix: the graphs here
// have at most 2 + 12 + 6 nodes.
std::int64_t max_flow(std::vector<std::vector<std::int64_t>> cap, std::size_t src, std::size_t sink) {
  const std::size_t n = cap.size();
  std::int64_t flow = 0;
  for (;;) {
    std::vector<std::int64_t> parent(n, -1);
    parent[src] = static_cast<std::int64_t>(src);
    std::vector<std::size_t> queue{src};
    for (std::size_t at = 0; at < queue.size() && parent[sink] < 0; ++at)
      for (std::size_t v = 0; v < n; ++v)
        if (parent[v] < 0 && cap[queue[at]][v] > 0) parent[v] = static_cast<std::int64_t>(queue[at]), queue.push_back(v);
    if (parent[sink] < 0) return flow;
    std::int64_t push = std::numeric_limits<std::int64_t>::max();
    for (std::size_t v = sink; v != src; v = static_cast<std::size_t>(parent[v])) push = std::min(push, cap[static_cast<std::size_t>(parent[v])][v]);
    for (std::size_t v = sink; v != src; v = static_cast<std::size_t>(parent[v])) {
      cap[static_cast<std::size_t>(parent[v])][v] -= push;
      cap[v][static_cast<std::size_t>(parent[v])] += push;
    }
    flow += push;
  }
}

// The optimum: the least W at which every replicated row fits.
std::int64_t exact(const Case& k) {
  const auto& p = k.placement;
  const std::int64_t P = p.ranks(), E = p.experts();
  std::vector<std::int64_t> fixed(static_cast<std::size_t>(P), 0), total(static_cast<std::size_t>(E), 0);
  std::int64_t replicated_rows = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    for (std::int64_t s = 0; s < P; ++s) total[static_cast<std::size_t>(e)] += k.counts[static_cast<std::size_t>(s * E + e)];
    if (p.home_count(e) == 1) fixed[static_cast<std::size_t>(p.owner(e))] += total[static_cast<std::size_t>(e)];
    else replicated_rows += total[static_cast<std::size_t>(e)];
  }
  // Nodes: 0 source, 1..E experts, E+1..E+P ranks, E+P+1 sink.
  const auto fits = [&](std::int64_t level) {
    const auto n = static_cast<std::size_t>(E + P + 2), sink = n - 1;
    std::vector<std::vector<std::int64_t>> cap(n, std::vector<std::int64_t>(n, 0));
    for (std::int64_t e = 0; e < E; ++e) {
      if (p.home_count(e) == 1) continue;
      cap[0][static_cast<std::size_t>(1 + e)] = total[static_cast<std::size_t>(e)];
      for (std::int64_t j = 0; j < p.home_count(e); ++j)
        cap[static_cast<std::size_t>(1 + e)][static_cast<std::size_t>(1 + E + p.instance_rank(p.first_instance(e) + j))] = replicated_rows;
    }
    for (std::int64_t r = 0; r < P; ++r) {
      if (fixed[static_cast<std::size_t>(r)] > level) return false;
      cap[static_cast<std::size_t>(1 + E + r)][sink] = level - fixed[static_cast<std::size_t>(r)];
    }
    return max_flow(std::move(cap), 0, sink) == replicated_rows;
  };
  std::int64_t lo = *std::max_element(fixed.begin(), fixed.end()), hi = lo + replicated_rows;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

Case random_case(std::mt19937_64& rng) {
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return lo + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(hi - lo + 1)); };
  const std::int64_t P = pick(2, 6), E = pick(std::max<std::int64_t>(4, P), 12);
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(P));
  for (std::int64_t e = 0; e < E; ++e) lists[static_cast<std::size_t>(e % P)].push_back(e);
  const std::int64_t copies = pick(1, 4);
  for (std::int64_t c = 0; c < copies; ++c) {
    const std::int64_t e = pick(0, E - 1), extra = pick(1, std::min<std::int64_t>(3, P - 1));
    for (std::int64_t k = 1; k <= extra; ++k) {
      auto& l = lists[static_cast<std::size_t>((e % P + k) % P)];
      if (std::find(l.begin(), l.end(), e) == l.end()) l.push_back(e);
    }
  }
  Case k{ExpertPlacement::from_rank_lists(E, lists, ExpertPlacement::Rules{.replicas = true}), {}};
  // Zipf-like: expert e draws about 1 / (rank of e) of a source's rows.
  std::vector<std::int64_t> perm(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e) perm[static_cast<std::size_t>(e)] = e;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t e = 0; e < E; ++e)
      k.counts.push_back(static_cast<std::int64_t>(double(pick(20, 200)) / double(1 + perm[static_cast<std::size_t>(e)])));
  return k;
}

}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 500;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  int optimal = 0;
  double sum_gap = 0, max_gap = 0;
  for (int c = 0; c < cases; ++c) {
    const Case k = random_case(rng);
    const double plan = double(planned(k)), best = double(exact(k));
    const double gap = plan / best - 1;
    optimal += gap < 1e-12;
    sum_gap += gap;
    max_gap = std::max(max_gap, gap);
  }
  std::printf("quota plan vs exact optimum (slowest rank's rows), %d random small cases\n", cases);
  std::printf("optimal in %d (%.1f%%); mean gap %.2f%%, worst gap %.2f%%\n", optimal, 100.0 * optimal / cases,
              100.0 * sum_gap / cases, 100.0 * max_gap);
  return 0;
}
