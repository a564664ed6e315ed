// The per-step quota plan against an exact solver on small cases
// (docs/results/placement.md). The plan's objective is the slowest rank's load in
// rows rounded up to whole tiles (unreplicated experts fixed, each home of a
// replicated expert paying for the tiles of the rows it takes). Only each
// home's tile count matters, so the exact optimum enumerates every way to
// split each replicated expert's tiles among its homes. Random cases:
// P = 2..4, 4..8 experts, one to three replicated experts with two or three
// homes, Zipf-like counts, 16- or 64-row tiles.
//
//   build/bench/quota_gap [CASES] [SEED]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "hpmoe/placement.hpp"

using namespace hpmoe;

namespace {

struct Case {
  ExpertPlacement placement;
  std::vector<std::int64_t> counts;  // P x E
  std::int64_t tile_rows;
};

std::int64_t tiles(std::int64_t rows, std::int64_t tr) { return (rows + tr - 1) / tr; }

// The slowest rank's padded rows under the plan's quotas.
std::int64_t planned(const Case& k) {
  const auto& p = k.placement;
  const auto q = plan_quotas(p, k.counts, k.tile_rows);
  const std::int64_t P = p.ranks(), N = p.instances();
  std::vector<std::int64_t> load(static_cast<std::size_t>(P), 0);
  for (std::int64_t i = 0; i < N; ++i) {
    std::int64_t rows = 0;
    for (std::int64_t s = 0; s < P; ++s) rows += q[static_cast<std::size_t>(s * N + i)];
    load[static_cast<std::size_t>(p.instance_rank(i))] += tiles(rows, k.tile_rows) * k.tile_rows;
  }
  return *std::max_element(load.begin(), load.end());
}

// The optimum: every split of each replicated expert's tiles among its homes.
std::int64_t exact(const Case& k) {
  const auto& p = k.placement;
  const std::int64_t P = p.ranks(), E = p.experts();
  std::vector<std::int64_t> fixed(static_cast<std::size_t>(P), 0), need;
  std::vector<std::int32_t> replicated;
  for (std::int64_t e = 0; e < E; ++e) {
    std::int64_t rows = 0;
    for (std::int64_t s = 0; s < P; ++s) rows += k.counts[static_cast<std::size_t>(s * E + e)];
    if (p.home_count(e) == 1) {
      fixed[static_cast<std::size_t>(p.owner(e))] += tiles(rows, k.tile_rows);
    } else {
      replicated.push_back(static_cast<std::int32_t>(e));
      need.push_back(tiles(rows, k.tile_rows));
    }
  }
  std::int64_t best = -1;
  std::vector<std::int64_t> load = fixed;
  std::function<void(std::size_t)> expert = [&](std::size_t x) {
    if (x == replicated.size()) {
      const std::int64_t worst = *std::max_element(load.begin(), load.end());
      if (best < 0 || worst < best) best = worst;
      return;
    }
    const std::int32_t e = replicated[x];
    const std::int64_t h = p.home_count(e), first = p.first_instance(e);
    std::function<void(std::int64_t, std::int64_t)> home = [&](std::int64_t j, std::int64_t left) {
      const auto r = static_cast<std::size_t>(p.instance_rank(first + j));
      if (j == h - 1) {
        load[r] += left;
        expert(x + 1);
        load[r] -= left;
        return;
      }
      for (std::int64_t t = 0; t <= left; ++t) {
        load[r] += t;
        home(j + 1, left - t);
        load[r] -= t;
      }
    };
    home(0, need[x]);
  };
  expert(0);
  return best * k.tile_rows;
}

Case random_case(std::mt19937_64& rng) {
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return lo + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(hi - lo + 1)); };
  const std::int64_t P = pick(2, 4), E = pick(4, 8);
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(P));
  for (std::int64_t e = 0; e < E; ++e) lists[static_cast<std::size_t>(e % P)].push_back(e);
  const std::int64_t copies = pick(1, 3);
  for (std::int64_t c = 0; c < copies; ++c) {
    const std::int64_t e = pick(0, E - 1), extra = pick(1, std::min<std::int64_t>(2, P - 1));
    for (std::int64_t k = 1; k <= extra; ++k) {
      auto& l = lists[static_cast<std::size_t>((e % P + k) % P)];
      if (std::find(l.begin(), l.end(), e) == l.end()) l.push_back(e);
    }
  }
  Case k{ExpertPlacement::from_rank_lists(E, lists, ExpertPlacement::Rules{.replicas = true}), {}, pick(0, 1) ? 64 : 16};
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
  std::printf("quota plan vs exact optimum (slowest rank's padded rows), %d random small cases\n", cases);
  std::printf("optimal in %d (%.1f%%); mean gap %.2f%%, worst gap %.2f%%\n", optimal, 100.0 * optimal / cases,
              100.0 * sum_gap / cases, 100.0 * max_gap);
  return 0;
}
