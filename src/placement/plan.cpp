#include "placement/plan.hpp"

#include <algorithm>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <queue>
#include <sstream>

#include "hpmoe/error.hpp"
#include "compiler/taskflow.hpp"

namespace hpmoe {

ExpertCostModel ExpertCostModel::from_machine(const std::string& machine, const LayerConfig& c, bool training,
                                              bool fetched) {
  return cost_model_of(sim::load_machine(machine), c, training, fetched);
}

ExpertCostModel cost_model_of(const sim::MachineModel& m, const LayerConfig& c, bool training, bool fetched) {
  ExpertCostModel cost;
  cost.fetched = fetched;
  cost.tile_rows = m.tile_rows;
  const std::int64_t TR = m.tile_rows, H = c.hidden, I = c.expert_inter;
  const double units = std::max(1, m.accelerator ? m.matrix_units : m.workers);
  // Forward: gate/up [TR, 2I] x H and down [TR, H] x I; the backward's
  // data and weight gradients are twice that again.
  const auto pass = [&](std::int64_t rows, double reuse) {
    return m.gemm_seconds(rows, 2 * I, H, c.dtype, reuse) + m.gemm_seconds(rows, H, I, c.dtype, reuse);
  };
  cost.first_tile_rows_s.assign(static_cast<std::size_t>(TR + 1), 0.0);
  cost.tile_rows_s.assign(static_cast<std::size_t>(TR + 1), 0.0);
  for (std::int64_t r = 1; r <= TR; ++r) {
    cost.first_tile_rows_s[static_cast<std::size_t>(r)] = 3.0 * pass(r, 1.0) / units;
    cost.tile_rows_s[static_cast<std::size_t>(r)] = 3.0 * pass(r, 1e9) / units;
  }
  cost.first_tile_s = cost.first_tile_rows_s.back();
  cost.tile_s = cost.tile_rows_s.back();
  const double weights = 3.0 * double(H) * double(I) * (c.dtype == DType::bf16 ? 2.0 : 4.0);
  if (training || fetched) {
    // Held: the weights refreshed once a step after the update; fetched: the
    // owner puts them for every pass (the backward takes its own layout).
    // In training the fp32 gradient is reduced onto the owner either way.
    const double bytes = (fetched ? (training ? 2.0 : 1.0) : 1.0) * weights + (training ? 3.0 * double(H) * double(I) * 4.0 : 0.0);
    const double link = m.intra_bytes_per_s > 0 ? m.intra_bytes_per_s : m.inter_bytes_per_s;
    cost.replica_s = link > 0 ? bytes / link : 0.0;
  }
  // A further split part receives each row and returns a partial row (and,
  // in training, the same for their gradients): H-wide rows over the link.
  // Without a link (in process) the sender's copy moves them.
  const double link = m.intra_bytes_per_s > 0   ? m.intra_bytes_per_s
                      : m.inter_bytes_per_s > 0 ? m.inter_bytes_per_s
                                                : m.put_copy_bytes_per_s * units;
  const double row_bytes = double(H) * (c.dtype == DType::bf16 ? 2.0 : 4.0) * (training ? 4.0 : 2.0);
  cost.part_row_s = link > 0 ? row_bytes / link : 0.0;
  // A new home of an expert (online placement) receives its weights once;
  // an owner that moves takes its fp32 master weights and Adam's two
  // moments along (12 bytes a parameter) besides the weights themselves.
  cost.weight_bytes = weights;
  cost.owner_bytes = cost.weight_bytes + 3.0 * double(H) * double(I) * 12.0;
  cost.move_s = link > 0 ? cost.weight_bytes / link : 0.0;
  return cost;
}

double ExpertCostModel::instance_seconds(std::int64_t rows) const {
  if (rows <= 0) return 0.0;
  const std::int64_t full = rows / tile_rows, rest = rows % tile_rows;
  // Without per-row tables (a model built by hand), a short tile costs a whole one.
  const auto short_tile = [&](const std::vector<double>& by_rows, double whole) {
    return by_rows.size() == static_cast<std::size_t>(tile_rows + 1) ? by_rows[static_cast<std::size_t>(rest)] : whole;
  };
  if (full == 0) return short_tile(first_tile_rows_s, first_tile_s);
  return first_tile_s + double(full - 1) * tile_s + (rest > 0 ? short_tile(tile_rows_s, tile_s) : 0.0);
}

namespace {
// The intermediate size a split expert's columns tile.
std::int64_t split_inter(const ExpertPlacement& p, std::int64_t e) {
  return p.part_columns(p.first_instance(e) + p.home_count(e) - 1, 0).second;
}
}  // namespace

std::vector<double> rank_seconds(const ExpertPlacement& p, std::span<const std::int64_t> counts, const ExpertCostModel& cost) {
  const std::int64_t P = p.ranks(), N = p.instances();
  std::vector<double> t(static_cast<std::size_t>(P), 0.0);
  const std::vector<std::int64_t> rows = instance_rows(p, counts);
  for (std::int64_t i = 0; i < N; ++i) {
    auto& rank = t[static_cast<std::size_t>(p.instance_rank(i))];
    const std::int64_t e = p.instance_expert(i), n = rows[static_cast<std::size_t>(i)];
    if (p.is_split(e)) {
      const auto [c0, c1] = p.part_columns(i, 0);
      const double share = double(c1 - c0) / double(split_inter(p, e));
      rank += share * cost.instance_seconds(n);
      if (i != p.first_instance(e)) rank += double(n) * cost.part_row_s;
      continue;
    }
    rank += cost.instance_seconds(n);
    if (p.instance_rank(i) != p.owner(e)) rank += cost.replica_s;
  }
  return t;
}

namespace {

struct History {
  std::vector<std::vector<std::int64_t>> counts;  // per step, P x E kept counts
  // Rows per expert, summed over the steps and source ranks.
  std::vector<double> expert_rows(const LayerConfig& c) const {
    std::vector<double> rows(static_cast<std::size_t>(c.routed_experts), 0.0);
    for (const auto& step : counts)
      for (std::int64_t s = 0; s < c.ranks; ++s)
        for (std::int64_t e = 0; e < c.routed_experts; ++e)
          rows[static_cast<std::size_t>(e)] += double(step[static_cast<std::size_t>(s * c.routed_experts + e)]);
    return rows;
  }
};

// The `n` experts with the most rows per home (ties: the lower id).
std::vector<std::int64_t> heaviest_per_home(const ExpertPlacement& p, const std::vector<double>& rows, std::int64_t n) {
  std::vector<std::int64_t> order(rows.size());
  std::iota(order.begin(), order.end(), 0);
  const auto per_home = [&](std::int64_t e) { return rows[static_cast<std::size_t>(e)] / double(p.home_count(e)); };
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return per_home(a) > per_home(b); });
  order.resize(static_cast<std::size_t>(std::min<std::int64_t>(n, static_cast<std::int64_t>(order.size()))));
  return order;
}

double mean_of(const std::vector<double>& v) { return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); }

// Mean over the steps of the slowest rank's time, and of rank max/mean rows.
// A placement over the history: the mean slowest rank's time (the
// objective), the mean rank max/mean rows, and the mean overload (the time
// ranks spend above the mean rank's), which breaks ties of the objective: a
// move that evens out one of several equally slow ranks leaves the slowest
// where it was but is a step towards lowering it.
struct Score {
  double slowest = 0, imbalance = 0, overload = 0;
  bool better_than(const Score& o) const {
    if (slowest < o.slowest * (1 - 1e-6)) return true;
    return slowest <= o.slowest * (1 + 1e-9) && overload < o.overload * (1 - 1e-6);
  }
};

Score evaluate(const ExpertPlacement& p, const History& h, const ExpertCostModel& cost) {
  std::vector<double> slowest, imbalance, overload;
  const std::int64_t P = p.ranks();
  for (const auto& counts : h.counts) {
    const auto t = rank_seconds(p, counts, cost);
    slowest.push_back(*std::max_element(t.begin(), t.end()));
    const double mean = mean_of(t);
    double over = 0;
    for (const double x : t) over += std::max(0.0, x - mean);
    overload.push_back(over);
    // Rows a rank computes; a split part's rows count by its share of the columns.
    std::vector<double> rows(static_cast<std::size_t>(P), 0.0);
    const auto per_instance = instance_rows(p, counts);
    for (std::int64_t i = 0; i < p.instances(); ++i) {
      const std::int64_t e = p.instance_expert(i);
      double share = 1.0;
      if (p.is_split(e)) {
        const auto [c0, c1] = p.part_columns(i, 0);
        share = double(c1 - c0) / double(split_inter(p, e));
      }
      rows[static_cast<std::size_t>(p.instance_rank(i))] += share * double(per_instance[static_cast<std::size_t>(i)]);
    }
    const double total = std::accumulate(rows.begin(), rows.end(), 0.0);
    imbalance.push_back(total > 0 ? *std::max_element(rows.begin(), rows.end()) * double(P) / total : 0.0);
  }
  return {mean_of(slowest), mean_of(imbalance), mean_of(overload)};
}

std::vector<std::vector<std::int64_t>> lists_of(const ExpertPlacement& p) {
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(p.ranks()));
  for (std::int64_t r = 0; r < p.ranks(); ++r)
    for (const auto e : p.experts_of(r)) lists[static_cast<std::size_t>(r)].push_back(e);
  return lists;
}

// Sets expert e's split to `parts` even column parts (on 64-column
// boundaries where the size allows, else on multiples of `min_unit`: 2 in
// bf16); false if the dimension cannot take them.
bool even_split(std::vector<ExpertPlacement::Split>& splits, std::int64_t e, std::int64_t parts, std::int64_t inter,
                std::int64_t min_unit) {
  const std::int64_t unit = inter >= 64 * parts ? 64 : min_unit;
  if (inter % min_unit != 0) return false;
  if (inter < parts * unit) return false;
  ExpertPlacement::Split sp{e, {0}};
  for (std::int64_t j = 1; j < parts; ++j) sp.columns.push_back((inter / unit) * j / parts * unit);
  sp.columns.push_back(inter);
  for (std::size_t j = 1; j < sp.columns.size(); ++j)
    if (sp.columns[j] <= sp.columns[j - 1]) return false;
  std::erase_if(splits, [&](const ExpertPlacement::Split& x) { return x.expert == e; });
  splits.push_back(std::move(sp));
  return true;
}

// The simulator's forward + backward makespans of routing step `step` (by
// default req.steps: a step the plan did not see), serialized and
// interleaved, and the fullest rank's memory. A placement that does not fit
// the machine's memory is simulated all the same (the unbalanced start of a
// plan often does not; the report says so).
struct PlanSimulation {
  double serialized = 0, interleaved = 0;
  sim::MemoryUse memory;
};
sim::SimRequest step_request(const sim::MachineModel& m, const PlanRequest& req, const ExpertPlacement& p,
                             std::int64_t step) {
  sim::SimRequest s;
  s.config = req.config;
  s.routing = req.routing;
  s.routing.step = static_cast<std::uint64_t>(step);
  s.placement = p;
  s.seed = req.seed;
  s.backward = true;
  s.policy = sim::default_policy(m);
  s.refuse_over_memory = false;
  return s;
}

PlanSimulation simulate_step(const sim::MachineModel& m, const PlanRequest& req, const ExpertPlacement& p, std::int64_t step = -1) {
  const auto rep = sim::simulate(m, step_request(m, req, p, step < 0 ? req.steps : step));
  return {rep.forward.serialized_s + rep.backward.serialized_s, rep.forward.interleaved_s + rep.backward.interleaved_s,
          rep.memory};
}

// The greedy search from `start` (see plan_placement): replica moves,
// split moves, or both.
struct Greedy {
  ExpertPlacement placement;
  std::int64_t replicas = 0, split_parts = 0;
};
Greedy greedy(const LayerConfig& c, const ExpertPlacement& start, const History& h, const ExpertCostModel& cost,
              std::int64_t budget, bool replicas, bool splits) {
  Greedy out;
  auto rules = ExpertPlacement::Rules{.allow_empty_ranks = start.allows_empty_ranks(), .replicas = true,
                                      .slots_per_rank = budget, .splits = start.splits()};
  auto lists = lists_of(start);
  ExpertPlacement current = ExpertPlacement::from_rank_lists(c.routed_experts, lists, rules, "plan");
  Score best = evaluate(current, h, cost);
  const std::vector<double> load = h.expert_rows(c);
  for (;;) {
    // Candidates: the 16 experts with the most rows per home now (a hot
    // expert with many replicas already may no longer be the one to help).
    const std::vector<std::int64_t> heavy = heaviest_per_home(current, load, 16);
    // Ranks with a free slot, least loaded first (first step's prediction).
    const auto t = rank_seconds(current, h.counts.front(), cost);
    std::vector<std::int64_t> free;
    for (std::int64_t r = 0; r < c.ranks; ++r)
      if (static_cast<std::int64_t>(lists[static_cast<std::size_t>(r)].size()) < budget) free.push_back(r);
    std::stable_sort(free.begin(), free.end(), [&](auto a, auto b) { return t[static_cast<std::size_t>(a)] < t[static_cast<std::size_t>(b)]; });
    Score candidate = best;
    std::int64_t pick_e = -1;
    std::vector<std::int64_t> pick_ranks;
    bool pick_split = false;
    std::vector<ExpertPlacement::Split> pick_splits;
    const auto consider = [&](std::int64_t e, const std::vector<std::int64_t>& ranks, bool split) {
      auto trial = lists;
      for (const auto r : ranks) trial[static_cast<std::size_t>(r)].push_back(e);
      auto trial_rules = rules;
      if (split && !even_split(trial_rules.splits, e, current.parts(e) + static_cast<std::int64_t>(ranks.size()), c.expert_inter,
                                 c.dtype == DType::bf16 ? 2 : 1))
        return;
      const auto p = ExpertPlacement::from_rank_lists(c.routed_experts, trial, trial_rules, "plan");
      const Score here = evaluate(p, h, cost);
      if (here.better_than(candidate))
        candidate = here, pick_e = e, pick_ranks = ranks, pick_split = split, pick_splits = trial_rules.splits;
    };
    for (const auto e : heavy) {
      std::vector<std::int64_t> open;  // free ranks without e, least loaded first
      for (const auto r : free)
        if (current.instance_on(e, r) < 0) open.push_back(r);
      // A replica on one of the 4 least loaded (unless e is split).
      if (replicas && !current.is_split(e))
        for (std::size_t j = 0; j < std::min<std::size_t>(open.size(), 4); ++j) consider(e, {open[j]}, false);
      // Or its columns in more even parts (unless e is replicated): up to 7
      // new parts at once on the least loaded ranks, since one more part of
      // a hot expert may not pay off where several do.
      if (splits && (current.home_count(e) == 1 || current.is_split(e)))
        for (std::size_t m = 1; m <= std::min<std::size_t>(open.size(), 7); ++m)
          consider(e, std::vector<std::int64_t>(open.begin(), open.begin() + static_cast<std::ptrdiff_t>(m)), true);
    }
    if (pick_e < 0) break;
    for (const auto r : pick_ranks) lists[static_cast<std::size_t>(r)].push_back(pick_e);
    if (pick_split) rules.splits = pick_splits;
    current = ExpertPlacement::from_rank_lists(c.routed_experts, lists, rules, "plan");
    best = candidate;
    (pick_split ? out.split_parts : out.replicas) += static_cast<std::int64_t>(pick_ranks.size());
  }
  out.placement = current;
  return out;
}

// `trial` with `current`'s owners wherever they still hold their expert
// (an online revision moves replicas around owners that stay: a replica may
// land below its owner); an owner whose home went (a relocation) is the
// expert's first home.
ExpertPlacement with_owners_of(const ExpertPlacement& trial, const ExpertPlacement& current) {
  std::vector<std::int32_t> owners(static_cast<std::size_t>(trial.experts()));
  for (std::int64_t e = 0; e < trial.experts(); ++e)
    owners[static_cast<std::size_t>(e)] = trial.instance_on(e, current.owner(e)) >= 0 ? current.owner(e) : trial.owner(e);
  return trial.with_owners(owners);
}

// One change at a time, the best that lowers the objective: a replica of
// one of the experts with the most rows per home added on one of the 4
// least loaded ranks with a free slot; a replica (never an owner: its
// gradient and optimizer state stay put) of one of the 8 experts with the
// fewest rows per home dropped; or such a replica handed over, on the same
// rank, to one of the 8 with the most. A new home costs its weights' bytes
// over the link once, spread over `horizon` steps. With `keep_owners`
// every owner stays where it is (a new home below it is a replica) unless
// the change is a relocation; `relocate` false forbids those.
Revision local_search(const LayerConfig& c, const ExpertPlacement& from, const History& h, const ExpertCostModel& cost,
                      std::int64_t budget, std::int64_t max_changes, double horizon, bool keep_owners,
                      bool relocate = true, const PlanProgress& progress = {}) {
  Revision out{from};
  auto rules = ExpertPlacement::Rules{.allow_empty_ranks = from.allows_empty_ranks(), .replicas = true,
                                      .slots_per_rank = budget, .splits = from.splits()};
  auto lists = lists_of(from);
  const double weight_bytes = cost.weight_bytes, owner_bytes = cost.owner_bytes;
  const double new_home_s = horizon > 0 && !cost.fetched ? cost.move_s / horizon : 0.0;  // fetched: paid every step in replica_s
  const double new_owner_s = horizon > 0 ? cost.move_s * owner_bytes / weight_bytes / horizon : 0.0;
  Score best = evaluate(from, h, cost);
  const std::vector<double> load = h.expert_rows(c);
  for (std::int64_t change = 0; change < max_changes; ++change) {
    if (progress) progress("change " + std::to_string(change + 1) + " of up to " + std::to_string(max_changes) + " (local search)");
    const ExpertPlacement& current = out.placement;
    const auto t = rank_seconds(current, h.counts.back(), cost);
    const std::vector<std::int64_t> heavy = heaviest_per_home(current, load, 8);
    std::vector<std::int64_t> light;
    for (const auto e : heaviest_per_home(current, load, c.routed_experts))
      if (current.home_count(e) > 1 && !current.is_split(e)) light.push_back(e);
    std::reverse(light.begin(), light.end());
    light.resize(std::min<std::size_t>(light.size(), 8));
    Score candidate = best;
    std::vector<std::vector<std::int64_t>> pick;
    int pick_kind = -1;  // 0 add, 1 drop, 2 move (to another expert), 3 relocate (an owner moves)
    // Online (keep_owners) every owner stays where it is unless the change
    // relocates it; a plan from scratch takes first homes as owners.
    const auto placed = [&](const std::vector<std::vector<std::int64_t>>& lists_) {
      ExpertPlacement t = ExpertPlacement::from_rank_lists(c.routed_experts, lists_, rules, "plan");
      return keep_owners ? with_owners_of(t, current) : t;
    };
    const auto consider = [&](std::vector<std::vector<std::int64_t>> trial, int kind) {
      if (kind == 3 && !relocate) return;
      Score here = evaluate(placed(trial), h, cost);
      if (kind == 0 || kind == 2) here.slowest += new_home_s;  // the new home's weights, once
      if (kind == 3) here.slowest += new_owner_s;                 // and an owner's optimizer state
      if (here.better_than(candidate)) candidate = here, pick = std::move(trial), pick_kind = kind;
    };
    std::vector<std::int64_t> open;  // ranks with a free slot, least loaded first
    for (std::int64_t r = 0; r < c.ranks; ++r)
      if (static_cast<std::int64_t>(lists[static_cast<std::size_t>(r)].size()) < budget) open.push_back(r);
    std::stable_sort(open.begin(), open.end(), [&](auto a, auto b) { return t[static_cast<std::size_t>(a)] < t[static_cast<std::size_t>(b)]; });
    for (const auto e : heavy) {
      if (current.is_split(e)) continue;
      int tried = 0;
      for (const auto r : open) {
        if (current.instance_on(e, r) >= 0) continue;
        auto trial = lists;
        trial[static_cast<std::size_t>(r)].push_back(e);
        consider(std::move(trial), 0);
        if (++tried == 4) break;
      }
    }
    for (const auto d : light) {
      // d's replicas (not its owner), least loaded rank first: where a hot expert's new home helps most.
      std::vector<std::int64_t> homes;
      for (std::int64_t j = 0; j < current.home_count(d); ++j)
        if (const auto r = current.instance_rank(current.first_instance(d) + j); r != current.owner(d)) homes.push_back(r);
      std::stable_sort(homes.begin(), homes.end(), [&](auto a, auto b) { return t[static_cast<std::size_t>(a)] < t[static_cast<std::size_t>(b)]; });
      if (homes.size() > 2) homes.erase(homes.begin() + 2, homes.end());
      for (const auto r : homes) {
        auto dropped = lists;
        std::erase(dropped[static_cast<std::size_t>(r)], d);
        for (const auto e : heavy) {
          if (e == d || current.is_split(e) || current.instance_on(e, r) >= 0) continue;
          auto trial = dropped;
          trial[static_cast<std::size_t>(r)].push_back(e);
          consider(std::move(trial), 2);
        }
        if (!dropped[static_cast<std::size_t>(r)].empty() || rules.allow_empty_ranks) consider(std::move(dropped), 1);
      }
    }
    // Or an expert relocated from one of the 2 most loaded ranks to one of
    // the 4 least loaded with a free slot: no replica to pay for, in a
    // static plan (online, an owner's move carries its optimizer state).
    std::vector<std::int64_t> by_load(static_cast<std::size_t>(c.ranks));
    std::iota(by_load.begin(), by_load.end(), 0);
    std::stable_sort(by_load.begin(), by_load.end(), [&](auto a, auto b) { return t[static_cast<std::size_t>(a)] > t[static_cast<std::size_t>(b)]; });
    for (std::size_t x = 0; x < std::min<std::size_t>(2, by_load.size()); ++x) {
      const std::int64_t a = by_load[x];
      if (lists[static_cast<std::size_t>(a)].size() < 2 && !rules.allow_empty_ranks) continue;
      for (const auto e : lists[static_cast<std::size_t>(a)]) {
        if (current.is_split(e)) continue;
        int tried = 0;
        for (const auto b : open) {
          if (current.instance_on(e, b) >= 0) continue;
          auto trial = lists;
          std::erase(trial[static_cast<std::size_t>(a)], e);
          trial[static_cast<std::size_t>(b)].push_back(e);
          consider(std::move(trial), current.owner(e) == a ? 3 : 2);
          if (++tried == 4) break;
        }
      }
    }
    if (pick_kind < 0) break;
    lists = std::move(pick);
    out.placement = placed(lists);
    (pick_kind == 0 ? out.added : pick_kind == 1 ? out.dropped : pick_kind == 2 ? out.moved : out.relocated) += 1;
    if ((pick_kind == 0 || pick_kind == 2) && !cost.fetched) out.bytes_moved += weight_bytes;
    if (pick_kind == 3) out.bytes_moved += owner_bytes;
    // The next change is judged on the placement alone; its own new home pays again.
    best = evaluate(out.placement, h, cost);
  }
  return out;
}

// EPLB's construction from `start`: `extra` new homes handed out one at a
// time to the expert with the most rows per home (split experts keep
// theirs), then placed heaviest home first on the rank with a free slot
// and the fewest expected rows (each home carrying its expert's rows over
// its homes; the per-step quota plan then evens out the real ones).
ExpertPlacement eplb_seed(const LayerConfig& c, const ExpertPlacement& start, const std::vector<double>& rows,
                          std::int64_t budget, std::int64_t extra) {
  const std::int64_t P = c.ranks, E = c.routed_experts;
  auto lists = lists_of(start);
  std::vector<std::int64_t> homes(static_cast<std::size_t>(E)), add(static_cast<std::size_t>(E), 0);
  for (std::int64_t e = 0; e < E; ++e) homes[static_cast<std::size_t>(e)] = start.home_count(e);
  const auto per_home = [&](std::int64_t e) { return rows[static_cast<std::size_t>(e)] / double(homes[static_cast<std::size_t>(e)]); };
  const auto before = [&](std::int64_t a, std::int64_t b) { return per_home(a) != per_home(b) ? per_home(a) < per_home(b) : a > b; };
  std::priority_queue<std::int64_t, std::vector<std::int64_t>, decltype(before)> queue(before);
  for (std::int64_t e = 0; e < E; ++e)
    if (!start.is_split(e)) queue.push(e);
  for (std::int64_t k = 0; k < extra && !queue.empty(); ++k) {
    const std::int64_t e = queue.top();
    queue.pop();
    if (homes[static_cast<std::size_t>(e)] >= P) continue;
    ++homes[static_cast<std::size_t>(e)], ++add[static_cast<std::size_t>(e)];
    queue.push(e);
  }
  std::vector<double> expected(static_cast<std::size_t>(P), 0.0);
  for (std::int64_t r = 0; r < P; ++r)
    for (const auto e : lists[static_cast<std::size_t>(r)]) expected[static_cast<std::size_t>(r)] += per_home(e);
  std::vector<std::int64_t> items;
  for (std::int64_t e = 0; e < E; ++e) items.insert(items.end(), static_cast<std::size_t>(add[static_cast<std::size_t>(e)]), e);
  std::stable_sort(items.begin(), items.end(), [&](auto a, auto b) { return per_home(a) > per_home(b); });
  for (const auto e : items) {
    std::int64_t best = -1;
    for (std::int64_t r = 0; r < P; ++r) {
      const auto& list = lists[static_cast<std::size_t>(r)];
      if (static_cast<std::int64_t>(list.size()) >= budget || std::find(list.begin(), list.end(), e) != list.end()) continue;
      if (best < 0 || expected[static_cast<std::size_t>(r)] < expected[static_cast<std::size_t>(best)]) best = r;
    }
    if (best < 0) continue;
    lists[static_cast<std::size_t>(best)].push_back(e);
    expected[static_cast<std::size_t>(best)] += per_home(e);
  }
  return ExpertPlacement::from_rank_lists(E, lists,
                                          ExpertPlacement::Rules{.allow_empty_ranks = start.allows_empty_ranks(), .replicas = true,
                                                                 .slots_per_rank = budget, .splits = start.splits()},
                                          "plan");
}

// Replicas only: the greedy from the start, and the greedy from EPLB's
// construction with a quarter, half, three quarters or all of the free
// slots filled (the best of those on the cost model); the better on the
// cost model is kept. At large EP the greedy alone adds one replica per
// move from a short candidate list and stops far from balance (33-41% of
// the force-balanced ideal at EP 256); the construction fills many slots at
// once, and the greedy's moves then refine it.
Greedy replica_plan(const LayerConfig& c, const ExpertPlacement& start, const History& h, const ExpertCostModel& cost,
                    std::int64_t budget, const PlanProgress& progress = {}) {
  if (progress) progress("searching: the greedy from the starting placement");
  Greedy from_start = greedy(c, start, h, cost, budget, true, false);
  std::int64_t free = 0;
  for (std::int64_t r = 0; r < c.ranks; ++r) free += budget - static_cast<std::int64_t>(start.experts_of(r).size());
  if (free <= 0) return from_start;
  const std::vector<double> rows = h.expert_rows(c);
  std::optional<ExpertPlacement> seed;
  Score seed_score;
  for (const std::int64_t quarter : {1, 2, 3, 4}) {
    auto trial = eplb_seed(c, start, rows, budget, (free * quarter + 3) / 4);
    const Score here = evaluate(trial, h, cost);
    if (!seed || here.better_than(seed_score)) seed = std::move(trial), seed_score = here;
  }
  if (progress) progress("searching: the greedy from EPLB's construction");
  Greedy from_seed = greedy(c, *seed, h, cost, budget, true, false);
  // Then up to 64 adds, drops or moves (a static plan: no weights move while it runs).
  for (Greedy* g : {&from_start, &from_seed})
    g->placement = local_search(c, g->placement, h, cost, budget, 64, 0, false, true, progress).placement;
  Greedy& kept = evaluate(from_seed.placement, h, cost).better_than(evaluate(from_start.placement, h, cost)) ? from_seed : from_start;
  kept.replicas = kept.placement.instances() - start.instances();
  return kept;
}

}  // namespace

namespace {
History history_of(const LayerConfig& c, std::span<const std::vector<std::int64_t>> steps, const char* what) {
  if (steps.empty()) throw Error(std::string(what) + ": no steps of counts");
  History h;
  for (const auto& counts : steps) {
    if (static_cast<std::int64_t>(counts.size()) != c.ranks * c.routed_experts)
      throw Error(std::string(what) + ": a step has " + std::to_string(counts.size()) + " counts, expected ranks x experts = " +
                  std::to_string(c.ranks * c.routed_experts));
    h.counts.push_back(counts);
  }
  return h;
}
}  // namespace

ExpertPlacement plan_replicas(const LayerConfig& c, const ExpertPlacement& start,
                              std::span<const std::vector<std::int64_t>> history, const ExpertCostModel& cost,
                              std::int64_t slots_per_rank) {
  if (slots_per_rank < start.max_local_count())
    throw Error("plan_replicas: a budget of " + std::to_string(slots_per_rank) + " slots is below the " +
                std::to_string(start.max_local_count()) + " experts the start already puts on one rank");
  return replica_plan(c, start, history_of(c, history, "plan_replicas"), cost, slots_per_rank).placement;
}

Revision revise_placement(const LayerConfig& c, const ExpertPlacement& current,
                          std::span<const std::vector<std::int64_t>> window, const ExpertCostModel& cost,
                          std::int64_t slots_per_rank, std::int64_t max_changes, double horizon, bool relocate) {
  if (slots_per_rank < current.max_local_count())
    throw Error("revise_placement: a budget of " + std::to_string(slots_per_rank) + " slots is below the " +
                std::to_string(current.max_local_count()) + " experts the placement already puts on one rank");
  if (max_changes < 0 || !(horizon >= 0)) throw Error("revise_placement: max_changes and horizon must not be negative");
  const History h = history_of(c, window, "revise_placement");
  // The searches build placements from rank lists; a fetching placement's
  // revision fetches too.
  const auto keep_fetching = [&](Revision r) {
    if (current.fetches_replicas()) r.placement = r.placement.with_fetched_replicas();
    return r;
  };
  Revision local = keep_fetching(local_search(c, current, h, cost, slots_per_rank, max_changes, horizon, true, relocate));
  if (current.has_splits() || max_changes == 0) return local;
  // A whole new plan from the owners alone (after a large drift one change
  // at a time from the old plan stays far off): taken when it is within the
  // change limit and better, net of everything it moves.
  std::vector<std::vector<std::int64_t>> owners(static_cast<std::size_t>(c.ranks));
  for (std::int64_t e = 0; e < c.routed_experts; ++e) owners[static_cast<std::size_t>(current.owner(e))].push_back(e);
  const auto owner_rules = ExpertPlacement::Rules{.allow_empty_ranks = true, .replicas = true, .slots_per_rank = slots_per_rank};
  const ExpertPlacement from_owners = ExpertPlacement::from_rank_lists(c.routed_experts, owners, owner_rules, "revise_placement");
  Revision fresh = keep_fetching(Revision{with_owners_of(replica_plan(c, from_owners, h, cost, slots_per_rank).placement, current)});
  const double weight_bytes = cost.weight_bytes, owner_bytes = cost.owner_bytes;
  for (std::int64_t e = 0; e < c.routed_experts; ++e) {
    for (std::int64_t r = 0; r < c.ranks; ++r) {
      const bool was = current.instance_on(e, r) >= 0, is = fresh.placement.instance_on(e, r) >= 0;
      if (is && !was) ++fresh.added, fresh.bytes_moved += cost.fetched ? 0.0 : weight_bytes;
      if (was && !is) ++fresh.dropped;
    }
    if (fresh.placement.owner(e) != current.owner(e))
      ++fresh.relocated, fresh.bytes_moved += owner_bytes - (cost.fetched ? 0.0 : weight_bytes);
  }
  if (fresh.added + fresh.dropped > max_changes || (fresh.relocated > 0 && !relocate)) return local;
  const double per_byte = weight_bytes > 0 && horizon > 0 ? cost.move_s / weight_bytes / horizon : 0.0;
  Score a = evaluate(local.placement, h, cost), b = evaluate(fresh.placement, h, cost);
  a.slowest += local.bytes_moved * per_byte;
  b.slowest += fresh.bytes_moved * per_byte;
  return b.better_than(a) ? fresh : local;
}

PlanReport plan_placement(const PlanRequest& given, const PlanProgress& progress) {
  PlanRequest req = given;
  req.config.validate();
  std::string exchange_choice;
  if (req.choose_exchange || req.choose_dispatch_dtype) {  // the scheme first, at the start placement; the plan is made under it
    const sim::MachineModel m = sim::load_machine(req.machine);
    sim::SimRequest s = step_request(m, req, placement_or_contiguous(req.start, req.config.routed_experts, req.config.ranks),
                                     req.steps);
    s.choose_scheme = req.choose_exchange;
    s.choose_dispatch_dtype = req.choose_dispatch_dtype;
    const sim::SimReport chosen = sim::simulate_choosing_exchange(m, s);
    req.config.exchange = chosen.config.exchange;
    req.config.dispatch_dtype = chosen.config.dispatch_dtype;
    exchange_choice = chosen.exchange_choice;
  }
  const LayerConfig& c = req.config;
  if (req.steps < 1 || req.steps > 10000) throw Error("--steps must be between 1 and 10000 (got " + std::to_string(req.steps) + ")");
  if (req.slots_per_rank < 0) throw Error("--slots-per-rank must be positive");
  const sim::MachineModel machine = sim::load_machine(req.machine);
  const ExpertCostModel cost = cost_model_of(machine, c, req.training);
  PlanReport rep;
  rep.config = c;
  rep.exchange_choice = exchange_choice;
  rep.routing = req.routing.describe();
  rep.machine = machine.name;
  rep.steps = req.steps;
  rep.before = placement_or_contiguous(req.start, c.routed_experts, c.ranks);
  const std::int64_t budget = req.slots_per_rank > 0 ? req.slots_per_rank : rep.before.max_local_count() + 1;
  if (budget < rep.before.max_local_count())
    throw Error("--slots-per-rank " + std::to_string(budget) + " is below the " + std::to_string(rep.before.max_local_count()) +
                " experts the starting placement already puts on one rank");
  History h;
  for (std::int64_t k = 0; k < req.steps; ++k) {
    if (progress) progress("step " + std::to_string(k + 1) + " of " + std::to_string(req.steps) + " of load history routed");
    RoutingSpec spec = req.routing;  // the same popularity every step, other draws
    spec.step = static_cast<std::uint64_t>(k);
    if (spec.source == RoutingSource::router) {
      h.counts.push_back(taskflow::routing_counts(c, route_step(c, spec, req.seed + static_cast<std::uint64_t>(k))).counts);
    } else {  // the choices alone (no logits to build; capacity dropping does not apply to them)
      h.counts.push_back(taskflow::routing_counts(c, forced_selection(c, spec)).counts);
    }
  }
  const Score start = evaluate(rep.before, h, cost);
  rep.cost_before = start.slowest;
  rep.imbalance_before = start.imbalance;
  if (progress && !(req.replicas && !req.splits)) progress("searching: the greedy");
  Greedy chosen = req.replicas && !req.splits ? replica_plan(c, rep.before, h, cost, budget, progress)
                                              : greedy(c, rep.before, h, cost, budget, req.replicas, req.splits);
  if (req.replicas && req.splits) {
    // The cost model prices a split's rows on its own rank only; every
    // source sends them, and the simulator sees the links they share. So
    // with both kinds of move allowed, the simulator (on the history's last
    // step, which the plan has seen) decides between the hybrid plan and
    // the replicas-only one.
    const Greedy only = replica_plan(c, rep.before, h, cost, budget, progress);
    if (progress) progress("simulating the hybrid and the replicas-only plans");
    rep.sim_hybrid = simulate_step(machine, req, chosen.placement, req.steps - 1).interleaved;
    rep.sim_replicas_only = simulate_step(machine, req, only.placement, req.steps - 1).interleaved;
    if (rep.sim_replicas_only <= rep.sim_hybrid) chosen = only;
  }
  rep.replicas = chosen.replicas;
  rep.split_parts = chosen.split_parts;
  const ExpertPlacement current = chosen.placement;
  rep.after = current;
  const Score after = evaluate(current, h, cost);
  rep.cost_after = after.slowest;
  rep.imbalance_after = after.imbalance;
  if (progress) progress("simulating the step before and after");
  const PlanSimulation before = simulate_step(machine, req, rep.before), after_sim = simulate_step(machine, req, rep.after);
  rep.sim_serialized_before = before.serialized;
  rep.sim_interleaved_before = before.interleaved;
  rep.sim_serialized_after = after_sim.serialized;
  rep.sim_interleaved_after = after_sim.interleaved;
  rep.memory_before = before.memory;
  rep.memory_after = after_sim.memory;
  return rep;
}

std::string format_report(const PlanReport& r) {
  std::ostringstream o;
  o << std::fixed;
  o << "plan     " << r.config.name << " at EP " << r.config.ranks << ", " << r.config.tokens_per_rank
    << " tokens/rank, routing " << r.routing << ", " << r.steps << " steps of history, machine " << r.machine << "\n";
  if (!r.exchange_choice.empty()) o << "exchange auto: " << r.exchange_choice << "\n";
  o << "         " << r.replicas << " replicas added, " << r.split_parts << " split parts added (" << r.after.splits().size()
    << " experts split), at most " << r.after.slots_per_rank() << " experts per rank\n";
  const auto row = [&](const char* what, double before, double after, int digits) {
    o << "  " << std::left << std::setw(44) << what << std::right << std::setprecision(digits) << std::setw(10) << before
      << std::setw(10) << after << "\n";
  };
  o << "  " << std::left << std::setw(44) << "predicted (mean over the history's steps)" << std::right << std::setw(10)
    << "before" << std::setw(10) << "after" << "\n";
  row("rank max/mean rows", r.imbalance_before, r.imbalance_after, 3);
  row("cost model: slowest rank's experts (ms)", r.cost_before * 1e3, r.cost_after * 1e3, 3);
  row("simulated fwd+bwd, serialized (ms)", r.sim_serialized_before * 1e3, r.sim_serialized_after * 1e3, 3);
  row("simulated fwd+bwd, interleaved (ms)", r.sim_interleaved_before * 1e3, r.sim_interleaved_after * 1e3, 3);
  if (r.memory_after.capacity > 0) {
    row("simulated fullest rank's memory (GB)", r.memory_before.total() / 1e9, r.memory_after.total() / 1e9, 1);
    const auto fits = [&](const sim::MemoryUse& m) { return m.total() <= m.capacity ? "fits" : "does NOT fit"; };
    o << "         of " << std::setprecision(1) << r.memory_after.capacity / 1e9 << " GB a rank: before " << fits(r.memory_before)
      << ", after " << fits(r.memory_after) << "\n";
  }
  if (r.sim_hybrid > 0)
    o << "         the simulator chose " << (r.after.has_splits() ? "the hybrid plan" : "replicas only") << " (interleaved, a seen step: hybrid "
      << std::setprecision(3) << r.sim_hybrid * 1e3 << " ms, replicas only " << r.sim_replicas_only * 1e3 << " ms)\n";
  return o.str();
}

nlohmann::json to_json(const PlanReport& r) {
  return {{"layer", r.config.name},
          {"ranks", r.config.ranks},
          {"tokens_per_rank", r.config.tokens_per_rank},
          {"routing", r.routing},
          {"machine", r.machine},
          {"exchange", to_string(r.config.exchange)},
          {"exchange_choice", r.exchange_choice},
          {"steps", r.steps},
          {"replicas_added", r.replicas},
          {"split_parts_added", r.split_parts},
          {"simulated_hybrid_s", r.sim_hybrid},
          {"simulated_replicas_only_s", r.sim_replicas_only},
          {"experts_split", r.after.splits().size()},
          {"placement", to_json(r.after)},
          {"before", {{"rank_max_over_mean", r.imbalance_before}, {"cost_model_s", r.cost_before},
                      {"simulated_serialized_s", r.sim_serialized_before}, {"simulated_interleaved_s", r.sim_interleaved_before},
                      {"memory_bytes", r.memory_before.total()}}},
          {"after", {{"rank_max_over_mean", r.imbalance_after}, {"cost_model_s", r.cost_after},
                     {"simulated_serialized_s", r.sim_serialized_after}, {"simulated_interleaved_s", r.sim_interleaved_after},
                     {"memory_bytes", r.memory_after.total()}}}};
}

}  // namespace hpmoe
