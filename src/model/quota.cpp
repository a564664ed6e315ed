// The per-step quota plan for replicated experts (placement.hpp).
#include <algorithm>
#include <numeric>

#include "hpmoe/error.hpp"
#include "hpmoe/placement.hpp"

namespace hpmoe {

namespace {
std::int64_t first_instance_end(const ExpertPlacement& p, std::int64_t e) { return p.first_instance(e) + p.home_count(e); }
}  // namespace

namespace {
// Integer water-filling: `rows` rows among homes whose ranks already carry
// `load[j]`, so that the most loaded of them carries as little as possible.
// The homes below the water level W take W - load[j] (W the floor of the
// level, the remainder one row each to the earliest of them), the others
// none: a home's share may end anywhere, mid-tile included. `order`:
// scratch, kept by the caller (the plan fills hundreds of experts a step).
void water_fill(std::span<const std::int64_t> load, std::int64_t rows, std::span<std::int64_t> give,
                std::vector<std::int64_t>& order) {
  const auto h = static_cast<std::int64_t>(load.size());
  order.resize(static_cast<std::size_t>(h));
  std::iota(order.begin(), order.end(), 0);
  // A stable insertion sort by load: an expert has a few homes.
  for (std::int64_t i = 1; i < h; ++i)
    for (std::int64_t j = i; j > 0 && load[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])] <
                                          load[static_cast<std::size_t>(order[static_cast<std::size_t>(j - 1)])];
         --j)
      std::swap(order[static_cast<std::size_t>(j)], order[static_cast<std::size_t>(j - 1)]);
  std::int64_t k = 1, below = load[static_cast<std::size_t>(order[0])];  // the k lowest, and their summed load
  while (k < h) {
    const std::int64_t next = load[static_cast<std::size_t>(order[static_cast<std::size_t>(k)])];
    if ((rows + below) <= next * k) break;  // the level with k homes does not reach the next home
    below += next;
    ++k;
  }
  const std::int64_t level = (rows + below) / k;
  std::int64_t remainder = (rows + below) - level * k;
  // The k lowest homes are filled, in home order (the remainder to the earliest).
  std::fill(give.begin(), give.end(), -1);
  for (std::int64_t x = 0; x < k; ++x) give[static_cast<std::size_t>(order[static_cast<std::size_t>(x)])] = 0;
  for (std::int64_t j = 0; j < h; ++j) {
    auto& g = give[static_cast<std::size_t>(j)];
    if (g < 0) {
      g = 0;
      continue;
    }
    g = level - load[static_cast<std::size_t>(j)] + (remainder > 0 ? 1 : 0);
    if (remainder > 0) --remainder;
  }
}

// floor(a / b) and a mod b for 0 <= a < 2^52, 0 < b, exact: a double
// reciprocal's estimate, corrected in integers (two 64-bit divisions per
// (source, home) were most of the plan's time at EP 64).
struct Divider {
  std::int64_t b;
  double inverse;
  explicit Divider(std::int64_t divisor) : b(divisor), inverse(1.0 / static_cast<double>(divisor)) {}
  std::int64_t quotient(std::int64_t a, std::int64_t& rest) const {
    std::int64_t q = static_cast<std::int64_t>(static_cast<double>(a) * inverse);
    std::int64_t r = a - q * b;
    while (r < 0) --q, r += b;
    while (r >= b) ++q, r -= b;
    rest = r;
    return q;
  }
};
}  // namespace

std::vector<std::int64_t> plan_quotas(const ExpertPlacement& placement, std::span<const std::int64_t> counts_in) {
  const std::int64_t P = placement.ranks(), E = placement.experts(), N = placement.instances();
  if (static_cast<std::int64_t>(counts_in.size()) != P * E)
    throw Error("plan_quotas: " + std::to_string(counts_in.size()) + " counts for " + std::to_string(P) + " ranks x " +
                std::to_string(E) + " experts");
  std::vector<std::int64_t> quota(static_cast<std::size_t>(P * N), 0), total(static_cast<std::size_t>(E), 0);
  // Each rank's load in rows: a row costs the same wherever it runs, and a
  // short last tile costs its rows (the GEMM kernels run it short), so the
  // unit of balance is the row, not the compute tile.
  std::vector<std::int64_t> load(static_cast<std::size_t>(P), 0);
  // A lent home takes exactly its own rank's rows of its expert (they stay
  // home: that is what its weights travelled for); the expert's other
  // homes share the rest.
  // Instances are numbered expert by expert: each expert's homes are a run
  // of them, its lent ones left out.
  std::vector<std::int64_t> lent_rows;  // the counts with each lent home's own rows taken out, where any
  if (placement.has_lent()) lent_rows.assign(counts_in.begin(), counts_in.end());
  const std::span<const std::int64_t> counts = lent_rows.empty() ? counts_in : std::span<const std::int64_t>(lent_rows);
  std::vector<std::int64_t> home_list;
  home_list.reserve(static_cast<std::size_t>(N));
  std::vector<std::int64_t> home_begin(static_cast<std::size_t>(E + 1), 0);
  for (std::int64_t e = 0; e < E; ++e) {
    for (std::int64_t i = placement.first_instance(e); i < placement.first_instance(e) + placement.home_count(e); ++i) {
      if (!placement.is_lent(i)) {
        home_list.push_back(i);
        continue;
      }
      const std::int64_t r = placement.instance_rank(i);
      auto& own = lent_rows[static_cast<std::size_t>(r * E + e)];
      quota[static_cast<std::size_t>(r * N + i)] = own;
      load[static_cast<std::size_t>(r)] += own;
      own = 0;
    }
    home_begin[static_cast<std::size_t>(e + 1)] = static_cast<std::int64_t>(home_list.size());
  }
  std::vector<std::int32_t> replicated;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t homes_of_e = home_begin[static_cast<std::size_t>(e + 1)] - home_begin[static_cast<std::size_t>(e)];
    for (std::int64_t s = 0; s < P; ++s) total[static_cast<std::size_t>(e)] += counts[static_cast<std::size_t>(s * E + e)];
    if (placement.is_split(e)) {
      // Every part of a split expert takes all of its rows: its load is its
      // share of the intermediate columns.
      const std::int64_t inter = placement.part_columns(first_instance_end(placement, e) - 1, 0).second;
      for (std::int64_t j = 0; j < placement.home_count(e); ++j) {
        const std::int64_t i = placement.first_instance(e) + j;
        for (std::int64_t s = 0; s < P; ++s)
          quota[static_cast<std::size_t>(s * N + i)] = counts[static_cast<std::size_t>(s * E + e)];
        const auto [c0, c1] = placement.part_columns(i, 0);
        load[static_cast<std::size_t>(placement.instance_rank(i))] += total[static_cast<std::size_t>(e)] * (c1 - c0) / inter;
      }
      continue;
    }
    if (homes_of_e > 1) {
      replicated.push_back(static_cast<std::int32_t>(e));
      continue;
    }
    const std::int64_t i = home_list[static_cast<std::size_t>(home_begin[static_cast<std::size_t>(e)])];
    for (std::int64_t s = 0; s < P; ++s)
      quota[static_cast<std::size_t>(s * N + i)] = counts[static_cast<std::size_t>(s * E + e)];
    load[static_cast<std::size_t>(placement.instance_rank(i))] += total[static_cast<std::size_t>(e)];
  }
  const auto home_count = [&](std::int64_t e) {
    return home_begin[static_cast<std::size_t>(e + 1)] - home_begin[static_cast<std::size_t>(e)];
  };
  const auto home = [&](std::int64_t e, std::int64_t j) {
    return home_list[static_cast<std::size_t>(home_begin[static_cast<std::size_t>(e)] + j)];
  };
  // The most constrained replicated experts first (fewest homes), then the
  // heaviest; ties by id. Experts with many homes fill what is left evenly.
  std::sort(replicated.begin(), replicated.end(), [&](std::int32_t a, std::int32_t b) {
    const auto ha = home_count(a), hb = home_count(b);
    if (ha != hb) return ha < hb;
    return total[static_cast<std::size_t>(a)] != total[static_cast<std::size_t>(b)]
               ? total[static_cast<std::size_t>(a)] > total[static_cast<std::size_t>(b)]
               : a < b;
  });
  // Each replicated expert water-filled over its homes' ranks in turn; then
  // a few more rounds in the same order, each expert's rows taken back and
  // water-filled again against everyone else's current shares, which lets
  // an early expert make room where a later one had no home (the first round
  // alone is exact in ~97% of small cases, 26% off in the worst; eight
  // rounds in 99.9%, 0.5% off: bench/quota_gap.cpp). Rounds stop early when
  // one changes nothing; a fixed bound keeps it a pure function.
  std::vector<std::vector<std::int64_t>> give(replicated.size());
  std::vector<std::int64_t> home_load;
  std::vector<std::int64_t> before, order;
  constexpr int kRounds = 8;
  for (int round = 0, changed = 1; round < kRounds && changed; ++round) {
    changed = 0;
    for (std::size_t x = 0; x < replicated.size(); ++x) {
      const std::int32_t e = replicated[x];
      const std::int64_t h = home_count(e);
      auto& g = give[x];
      if (g.empty()) g.assign(static_cast<std::size_t>(h), 0);
      home_load.assign(static_cast<std::size_t>(h), 0);
      for (std::int64_t j = 0; j < h; ++j) {
        auto& rank_load = load[static_cast<std::size_t>(placement.instance_rank(home(e, j)))];
        rank_load -= g[static_cast<std::size_t>(j)];
        home_load[static_cast<std::size_t>(j)] = rank_load;
      }
      before = g;
      water_fill(home_load, total[static_cast<std::size_t>(e)], g, order);
      changed |= static_cast<int>(before != g);
      for (std::int64_t j = 0; j < h; ++j) load[static_cast<std::size_t>(placement.instance_rank(home(e, j)))] += g[static_cast<std::size_t>(j)];
    }
  }
  // Sources: rows first to a home on the source's own rank, then to the
  // homes in order.
  std::vector<std::int64_t> left(static_cast<std::size_t>(P)), share;
  std::vector<std::pair<std::int64_t, std::int64_t>> rest;  // (remainder, home)
  for (std::size_t x = 0; x < replicated.size(); ++x) {
    const std::int32_t e = replicated[x];
    const std::int64_t h = home_count(e);
    auto& g = give[x];
    for (std::int64_t s = 0; s < P; ++s) left[static_cast<std::size_t>(s)] = counts[static_cast<std::size_t>(s * E + e)];
    const auto take = [&](std::int64_t s, std::int64_t j) {
      const std::int64_t n = std::min(left[static_cast<std::size_t>(s)], g[static_cast<std::size_t>(j)]);
      quota[static_cast<std::size_t>(s * N + home(e, j))] += n;
      left[static_cast<std::size_t>(s)] -= n;
      g[static_cast<std::size_t>(j)] -= n;
    };
    for (std::int64_t j = 0; j < h; ++j) take(placement.instance_rank(home(e, j)), j);
    // The rest of each source's rows spread over the homes in proportion to
    // what each can still take (largest remainders, ties to the earlier
    // home), so that every home's rows come from many sources in small
    // blocks rather than from one or two sources' large ones, which the
    // rotated put order may deliver last.
    std::int64_t remaining = 0;
    for (std::int64_t j = 0; j < h; ++j) remaining += g[static_cast<std::size_t>(j)];
    share.resize(static_cast<std::size_t>(h));
    rest.resize(static_cast<std::size_t>(h));
    for (std::int64_t s = 0; s < P && remaining > 0; ++s) {
      const std::int64_t n = left[static_cast<std::size_t>(s)];
      if (n == 0) continue;
      std::int64_t given = 0;
      const Divider by(remaining);
      for (std::int64_t j = 0; j < h; ++j) {
        std::int64_t r = 0;
        share[static_cast<std::size_t>(j)] = by.quotient(n * g[static_cast<std::size_t>(j)], r);
        rest[static_cast<std::size_t>(j)] = {r, j};
        given += share[static_cast<std::size_t>(j)];
      }
      // Largest remainders first, ties in home order: a stable insertion sort (a few homes).
      for (std::int64_t i = 1; i < h; ++i)
        for (std::int64_t j = i; j > 0 && rest[static_cast<std::size_t>(j)].first > rest[static_cast<std::size_t>(j - 1)].first; --j)
          std::swap(rest[static_cast<std::size_t>(j)], rest[static_cast<std::size_t>(j - 1)]);
      for (std::int64_t k = 0; given < n; ++k, ++given) ++share[static_cast<std::size_t>(rest[static_cast<std::size_t>(k)].second)];
      for (std::int64_t j = 0; j < h; ++j) {
        const std::int64_t q = share[static_cast<std::size_t>(j)];
        quota[static_cast<std::size_t>(s * N + home(e, j))] += q;
        g[static_cast<std::size_t>(j)] -= q;
      }
      left[static_cast<std::size_t>(s)] = 0;
      remaining -= n;
    }
  }
  return quota;
}

std::vector<std::int64_t> instance_rows(const ExpertPlacement& p, std::span<const std::int64_t> counts) {
  const std::int64_t P = p.ranks(), E = p.experts(), N = p.instances();
  if (counts.size() != static_cast<std::size_t>(P * E))
    throw Error("routing counts: " + std::to_string(counts.size()) + " values, expected ranks x experts = " +
                std::to_string(P * E));
  std::vector<std::int64_t> rows(static_cast<std::size_t>(N), 0);
  if (N > E) {
    const auto quota = plan_quotas(p, counts);
    for (std::int64_t s = 0; s < P; ++s)
      for (std::int64_t i = 0; i < N; ++i) rows[static_cast<std::size_t>(i)] += quota[static_cast<std::size_t>(s * N + i)];
  } else {
    for (std::int64_t s = 0; s < P; ++s)
      for (std::int64_t e = 0; e < E; ++e) rows[static_cast<std::size_t>(e)] += counts[static_cast<std::size_t>(s * E + e)];
  }
  return rows;
}

}  // namespace hpmoe
