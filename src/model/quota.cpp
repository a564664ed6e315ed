// The per-step quota plan for replicated experts (placement.hpp).
#include <algorithm>
#include <numeric>

#include "hpmoe/error.hpp"
#include "hpmoe/placement.hpp"

namespace hpmoe {

namespace {
std::int64_t first_instance_end(const ExpertPlacement& p, std::int64_t e) { return p.first_instance(e) + p.home_count(e); }
}  // namespace

std::vector<std::int64_t> plan_quotas(const ExpertPlacement& placement, std::span<const std::int64_t> counts,
                                      std::int64_t tile_rows) {
  const std::int64_t P = placement.ranks(), E = placement.experts(), N = placement.instances();
  if (static_cast<std::int64_t>(counts.size()) != P * E)
    throw Error("plan_quotas: " + std::to_string(counts.size()) + " counts for " + std::to_string(P) + " ranks x " +
                std::to_string(E) + " experts");
  if (tile_rows < 1) throw Error("plan_quotas: the tile height must be positive");
  const auto padded = [&](std::int64_t rows) { return (rows + tile_rows - 1) / tile_rows * tile_rows; };
  std::vector<std::int64_t> quota(static_cast<std::size_t>(P * N), 0), total(static_cast<std::size_t>(E), 0);
  std::vector<std::int64_t> load(static_cast<std::size_t>(P), 0);
  std::vector<std::int32_t> replicated;
  for (std::int64_t e = 0; e < E; ++e) {
    for (std::int64_t s = 0; s < P; ++s) total[static_cast<std::size_t>(e)] += counts[static_cast<std::size_t>(s * E + e)];
    if (placement.is_split(e)) {
      // Every part of a split expert takes all of its rows: its load is its
      // share of the intermediate columns.
      for (std::int64_t j = 0; j < placement.home_count(e); ++j) {
        const std::int64_t i = placement.first_instance(e) + j;
        for (std::int64_t s = 0; s < P; ++s)
          quota[static_cast<std::size_t>(s * N + i)] = counts[static_cast<std::size_t>(s * E + e)];
        const auto [c0, c1] = placement.part_columns(i, 0);
        const std::int64_t inter = placement.part_columns(first_instance_end(placement, e) - 1, 0).second;
        load[static_cast<std::size_t>(placement.instance_rank(i))] += padded(total[static_cast<std::size_t>(e)]) * (c1 - c0) / inter;
      }
      continue;
    }
    if (placement.home_count(e) > 1) {
      replicated.push_back(static_cast<std::int32_t>(e));
      continue;
    }
    const std::int64_t i = placement.first_instance(e);
    for (std::int64_t s = 0; s < P; ++s)
      quota[static_cast<std::size_t>(s * N + i)] = counts[static_cast<std::size_t>(s * E + e)];
    load[static_cast<std::size_t>(placement.instance_rank(i))] += padded(total[static_cast<std::size_t>(e)]);
  }
  // The most constrained replicated experts first (fewest homes), then the
  // heaviest; ties by id. Experts with many homes fill what is left evenly.
  std::sort(replicated.begin(), replicated.end(), [&](std::int32_t a, std::int32_t b) {
    const auto ha = placement.home_count(a), hb = placement.home_count(b);
    if (ha != hb) return ha < hb;
    return total[static_cast<std::size_t>(a)] != total[static_cast<std::size_t>(b)]
               ? total[static_cast<std::size_t>(a)] > total[static_cast<std::size_t>(b)]
               : a < b;
  });
  std::vector<std::int64_t> give, left(static_cast<std::size_t>(P));
  for (const std::int32_t e : replicated) {
    const std::int64_t first = placement.first_instance(e), h = placement.home_count(e);
    const std::int64_t rows = total[static_cast<std::size_t>(e)];
    give.assign(static_cast<std::size_t>(h), 0);
    // Water-filling in whole tiles: each chunk to the home whose rank would
    // then carry the least (ties: the earlier home); chunks of at least a
    // tile, and at most ~16 per home.
    const std::int64_t chunk = tile_rows * std::max<std::int64_t>(1, rows / (tile_rows * 16 * h));
    for (std::int64_t done = 0; done < rows;) {
      const std::int64_t n = std::min(chunk, rows - done);
      std::int64_t best = 0, best_load = 0;
      for (std::int64_t j = 0; j < h; ++j) {
        const auto r = static_cast<std::size_t>(placement.instance_rank(first + j));
        const std::int64_t after = load[r] + padded(give[static_cast<std::size_t>(j)] + n);
        if (j == 0 || after < best_load) best = j, best_load = after;
      }
      give[static_cast<std::size_t>(best)] += n;
      done += n;
    }
    for (std::int64_t j = 0; j < h; ++j)
      load[static_cast<std::size_t>(placement.instance_rank(first + j))] += padded(give[static_cast<std::size_t>(j)]);
    // Sources: rows first to a home on the source's own rank, then to the
    // homes in order.
    for (std::int64_t s = 0; s < P; ++s) left[static_cast<std::size_t>(s)] = counts[static_cast<std::size_t>(s * E + e)];
    const auto take = [&](std::int64_t s, std::int64_t j) {
      const std::int64_t n = std::min(left[static_cast<std::size_t>(s)], give[static_cast<std::size_t>(j)]);
      quota[static_cast<std::size_t>(s * N + first + j)] += n;
      left[static_cast<std::size_t>(s)] -= n;
      give[static_cast<std::size_t>(j)] -= n;
    };
    for (std::int64_t j = 0; j < h; ++j) take(placement.instance_rank(first + j), j);
    for (std::int64_t s = 0; s < P; ++s)
      for (std::int64_t j = 0; j < h && left[static_cast<std::size_t>(s)] > 0; ++j) take(s, j);
  }
  return quota;
}

std::vector<std::int64_t> instance_rows(const ExpertPlacement& p, std::span<const std::int64_t> counts,
                                        std::int64_t tile_rows) {
  const std::int64_t P = p.ranks(), E = p.experts(), N = p.instances();
  if (counts.size() != static_cast<std::size_t>(P * E))
    throw Error("routing counts: " + std::to_string(counts.size()) + " values, expected ranks x experts = " +
                std::to_string(P * E));
  std::vector<std::int64_t> rows(static_cast<std::size_t>(N), 0);
  if (N > E) {
    const auto quota = plan_quotas(p, counts, tile_rows);
    for (std::int64_t s = 0; s < P; ++s)
      for (std::int64_t i = 0; i < N; ++i) rows[static_cast<std::size_t>(i)] += quota[static_cast<std::size_t>(s * N + i)];
  } else {
    for (std::int64_t s = 0; s < P; ++s)
      for (std::int64_t e = 0; e < E; ++e) rows[static_cast<std::size_t>(e)] += counts[static_cast<std::size_t>(s * E + e)];
  }
  return rows;
}

}  // namespace hpmoe
