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

namespace {

// One plan_quotas call: the placement, the counts (each lent home's own rows
// taken out), each rank's load in rows, and each expert's homes that share
// its rows. A row costs the same wherever it runs, and a short last tile
// costs its rows (the GEMM kernels run it short), so the unit of balance is
// the row, not the compute tile.
class QuotaPlan {
 public:
  QuotaPlan(const ExpertPlacement& placement, std::span<const std::int64_t> counts_in)
      : placement_(placement), P(placement.ranks()), E(placement.experts()), N(placement.instances()),
        quota_(static_cast<std::size_t>(P * N), 0), total_(static_cast<std::size_t>(E), 0), load_(static_cast<std::size_t>(P), 0),
        home_begin_(static_cast<std::size_t>(E + 1), 0) {
    if (placement.has_lent()) lent_rows_.assign(counts_in.begin(), counts_in.end());
    counts_ = lent_rows_.empty() ? counts_in : std::span<const std::int64_t>(lent_rows_);
  }

  std::vector<std::int64_t> plan() {
    take_lent_homes();
    place_single_and_split();
    balance_replicated();
    for (std::size_t x = 0; x < replicated_.size(); ++x) assign_sources(x);
    return std::move(quota_);
  }

 private:
  std::int64_t count(std::int64_t s, std::int64_t e) const { return counts_[static_cast<std::size_t>(s * E + e)]; }
  std::int64_t& quota(std::int64_t s, std::int64_t i) { return quota_[static_cast<std::size_t>(s * N + i)]; }
  std::int64_t home_count(std::int64_t e) const {
    return home_begin_[static_cast<std::size_t>(e + 1)] - home_begin_[static_cast<std::size_t>(e)];
  }
  std::int64_t home(std::int64_t e, std::int64_t j) const {
    return home_list_[static_cast<std::size_t>(home_begin_[static_cast<std::size_t>(e)] + j)];
  }
  std::int64_t& rank_load(std::int64_t instance) { return load_[static_cast<std::size_t>(placement_.instance_rank(instance))]; }

  // A lent home takes exactly its own rank's rows of its expert (they stay
  // home: that is what its weights travelled for); the expert's other homes
  // share the rest. Instances are numbered expert by expert: each expert's
  // homes are a run of them, its lent ones left out of the list.
  void take_lent_homes() {
    home_list_.reserve(static_cast<std::size_t>(N));
    for (std::int64_t e = 0; e < E; ++e) {
      for (std::int64_t i = placement_.first_instance(e); i < placement_.first_instance(e) + placement_.home_count(e); ++i) {
        if (!placement_.is_lent(i)) {
          home_list_.push_back(i);
          continue;
        }
        const std::int64_t r = placement_.instance_rank(i);
        auto& own = lent_rows_[static_cast<std::size_t>(r * E + e)];
        quota(r, i) = own;
        load_[static_cast<std::size_t>(r)] += own;
        own = 0;
      }
      home_begin_[static_cast<std::size_t>(e + 1)] = static_cast<std::int64_t>(home_list_.size());
    }
  }

  // An expert with one home takes all its rows there; every part of a split
  // expert takes all of them, its load its share of the intermediate
  // columns. The replicated experts are left for the balance.
  void place_single_and_split() {
    for (std::int64_t e = 0; e < E; ++e) {
      for (std::int64_t s = 0; s < P; ++s) total_[static_cast<std::size_t>(e)] += count(s, e);
      if (placement_.is_split(e)) {
        const std::int64_t inter = placement_.part_columns(first_instance_end(placement_, e) - 1, 0).second;
        for (std::int64_t j = 0; j < placement_.home_count(e); ++j) {
          const std::int64_t i = placement_.first_instance(e) + j;
          for (std::int64_t s = 0; s < P; ++s) quota(s, i) = count(s, e);
          const auto [c0, c1] = placement_.part_columns(i, 0);
          rank_load(i) += total_[static_cast<std::size_t>(e)] * (c1 - c0) / inter;
        }
        continue;
      }
      if (home_count(e) > 1) {
        replicated_.push_back(static_cast<std::int32_t>(e));
        continue;
      }
      const std::int64_t i = home(e, 0);
      for (std::int64_t s = 0; s < P; ++s) quota(s, i) = count(s, e);
      rank_load(i) += total_[static_cast<std::size_t>(e)];
    }
  }

  // The most constrained replicated experts first (fewest homes), then the
  // heaviest; ties by id. Experts with many homes fill what is left evenly.
  // Each replicated expert water-filled over its homes' ranks in turn; then
  // a few more rounds in the same order, each expert's rows taken back and
  // water-filled again against everyone else's current shares, which lets
  // an early expert make room where a later one had no home (the first round
  // alone is exact in ~97% of small cases, 26% off in the worst; eight
  // rounds in 99.9%, 0.5% off: bench/quota_gap.cpp). Rounds stop early when
  // one changes nothing; a fixed bound keeps it a pure function.
  void balance_replicated() {
    std::sort(replicated_.begin(), replicated_.end(), [&](std::int32_t a, std::int32_t b) {
      const auto ha = home_count(a), hb = home_count(b);
      if (ha != hb) return ha < hb;
      return total_[static_cast<std::size_t>(a)] != total_[static_cast<std::size_t>(b)]
                 ? total_[static_cast<std::size_t>(a)] > total_[static_cast<std::size_t>(b)]
                 : a < b;
    });
    give_.resize(replicated_.size());
    std::vector<std::int64_t> home_load, before, order;
    constexpr int kRounds = 8;
    for (int round = 0, changed = 1; round < kRounds && changed; ++round) {
      changed = 0;
      for (std::size_t x = 0; x < replicated_.size(); ++x) {
        const std::int32_t e = replicated_[x];
        const std::int64_t h = home_count(e);
        auto& g = give_[x];
        if (g.empty()) g.assign(static_cast<std::size_t>(h), 0);
        home_load.assign(static_cast<std::size_t>(h), 0);
        for (std::int64_t j = 0; j < h; ++j) {
          auto& load = rank_load(home(e, j));
          load -= g[static_cast<std::size_t>(j)];
          home_load[static_cast<std::size_t>(j)] = load;
        }
        before = g;
        water_fill(home_load, total_[static_cast<std::size_t>(e)], g, order);
        changed |= static_cast<int>(before != g);
        for (std::int64_t j = 0; j < h; ++j) rank_load(home(e, j)) += g[static_cast<std::size_t>(j)];
      }
    }
  }

  // Replicated expert x's sources: rows first to a home on the source's own
  // rank, then the rest of each source's rows spread over the homes in
  // proportion to what each can still take (largest remainders, ties to the
  // earlier home), so that every home's rows come from many sources in small
  // blocks rather than from one or two sources' large ones, which the
  // rotated put order may deliver last.
  void assign_sources(std::size_t x) {
    const std::int32_t e = replicated_[x];
    const std::int64_t h = home_count(e);
    auto& g = give_[x];
    left_.resize(static_cast<std::size_t>(P));
    for (std::int64_t s = 0; s < P; ++s) left_[static_cast<std::size_t>(s)] = count(s, e);
    for (std::int64_t j = 0; j < h; ++j) {
      const std::int64_t s = placement_.instance_rank(home(e, j));
      const std::int64_t n = std::min(left_[static_cast<std::size_t>(s)], g[static_cast<std::size_t>(j)]);
      quota(s, home(e, j)) += n;
      left_[static_cast<std::size_t>(s)] -= n;
      g[static_cast<std::size_t>(j)] -= n;
    }
    std::int64_t remaining = 0;
    for (std::int64_t j = 0; j < h; ++j) remaining += g[static_cast<std::size_t>(j)];
    share_.resize(static_cast<std::size_t>(h));
    rest_.resize(static_cast<std::size_t>(h));
    for (std::int64_t s = 0; s < P && remaining > 0; ++s) {
      const std::int64_t n = left_[static_cast<std::size_t>(s)];
      if (n == 0) continue;
      std::int64_t given = 0;
      const Divider by(remaining);
      for (std::int64_t j = 0; j < h; ++j) {
        std::int64_t r = 0;
        share_[static_cast<std::size_t>(j)] = by.quotient(n * g[static_cast<std::size_t>(j)], r);
        rest_[static_cast<std::size_t>(j)] = {r, j};
        given += share_[static_cast<std::size_t>(j)];
      }
      // Largest remainders first, ties in home order: a stable insertion sort (a few homes).
      for (std::int64_t i = 1; i < h; ++i)
        for (std::int64_t j = i; j > 0 && rest_[static_cast<std::size_t>(j)].first > rest_[static_cast<std::size_t>(j - 1)].first; --j)
          std::swap(rest_[static_cast<std::size_t>(j)], rest_[static_cast<std::size_t>(j - 1)]);
      for (std::int64_t k = 0; given < n; ++k, ++given) ++share_[static_cast<std::size_t>(rest_[static_cast<std::size_t>(k)].second)];
      for (std::int64_t j = 0; j < h; ++j) {
        const std::int64_t q = share_[static_cast<std::size_t>(j)];
        quota(s, home(e, j)) += q;
        g[static_cast<std::size_t>(j)] -= q;
      }
      left_[static_cast<std::size_t>(s)] = 0;
      remaining -= n;
    }
  }

  const ExpertPlacement& placement_;
  const std::int64_t P, E, N;
  std::vector<std::int64_t> lent_rows_;  // the counts with each lent home's own rows taken out, where any
  std::span<const std::int64_t> counts_;
  std::vector<std::int64_t> quota_, total_, load_;
  std::vector<std::int64_t> home_list_, home_begin_;
  std::vector<std::int32_t> replicated_;
  std::vector<std::vector<std::int64_t>> give_;  // each replicated expert's rows per home
  std::vector<std::int64_t> left_, share_;
  std::vector<std::pair<std::int64_t, std::int64_t>> rest_;  // (remainder, home)
};

}  // namespace

std::vector<std::int64_t> plan_quotas(const ExpertPlacement& placement, std::span<const std::int64_t> counts) {
  if (static_cast<std::int64_t>(counts.size()) != placement.ranks() * placement.experts())
    throw Error("plan_quotas: " + std::to_string(counts.size()) + " counts for " + std::to_string(placement.ranks()) +
                " ranks x " + std::to_string(placement.experts()) + " experts");
  return QuotaPlan(placement, counts).plan();
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
