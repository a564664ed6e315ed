#include "hpmoe/placement.hpp"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"

namespace hpmoe {

namespace {

std::string text(std::int64_t v) { return std::to_string(v); }

void check_sizes(std::int64_t experts, std::int64_t ranks, const std::string& source) {
  if (experts < 1) throw Error(source + ": a placement needs at least one expert (got " + text(experts) + ")");
  if (ranks < 1) throw Error(source + ": a placement needs at least one rank (got " + text(ranks) + ")");
}

// The built-in placements give every rank an expert; fewer experts than
// ranks must be asked for with a placement file.
void check_every_rank_has_one(std::int64_t experts, std::int64_t ranks, const std::string& source) {
  check_sizes(experts, ranks, source);
  if (experts < ranks)
    throw Error(source + " of " + text(experts) + " experts on " + text(ranks) +
                " ranks leaves ranks without experts; use at most " + text(experts) +
                " ranks, or a --placement file that sets \"allow_empty_ranks\": true");
}

}  // namespace

ExpertPlacement ExpertPlacement::build(std::int64_t experts, const std::vector<std::vector<std::int64_t>>& lists,
                                       const Rules& rules, const std::string& source) {
  const bool allow_empty_ranks = rules.allow_empty_ranks, allow_replicas = rules.replicas;
  const std::int64_t slots_per_rank = rules.slots_per_rank;
  const auto ranks = static_cast<std::int64_t>(lists.size());
  check_sizes(experts, ranks, source);
  if (slots_per_rank < 0) throw Error(source + ": \"slots_per_rank\" must be positive (got " + text(slots_per_rank) + ")");
  ExpertPlacement p;
  p.ranks_ = ranks;
  p.slots_per_rank_ = slots_per_rank;
  p.allow_empty_ranks_ = allow_empty_ranks;
  p.owner_.assign(static_cast<std::size_t>(experts), -1);
  p.local_begin_.assign(static_cast<std::size_t>(ranks + 1), 0);
  // Splits first: a split expert may be listed on as many ranks as it has parts.
  p.split_of_.assign(static_cast<std::size_t>(experts), -1);
  p.splits_ = rules.splits;
  std::sort(p.splits_.begin(), p.splits_.end(), [](const Split& a, const Split& b) { return a.expert < b.expert; });
  for (std::size_t i = 0; i < p.splits_.size(); ++i) {
    const Split& sp = p.splits_[i];
    const std::string where = source + ": split of expert " + text(sp.expert);
    if (sp.expert < 0 || sp.expert >= experts)
      throw Error(source + ": a split names expert " + text(sp.expert) + ", which does not exist (the layer has " +
                  text(experts) + " experts, 0.." + text(experts - 1) + ")");
    if (p.split_of_[static_cast<std::size_t>(sp.expert)] >= 0)
      throw Error(where + " is given twice; give each split expert one list of columns");
    if (sp.columns.size() < 3)
      throw Error(where + ": \"columns\" needs at least three boundaries (0, a cut, the intermediate size) for two parts");
    if (sp.columns.front() != 0)
      throw Error(where + ": its parts do not tile the intermediate dimension: \"columns\" must start at 0 (got " +
                  text(sp.columns.front()) + ")");
    for (std::size_t j = 1; j < sp.columns.size(); ++j)
      if (sp.columns[j] <= sp.columns[j - 1])
        throw Error(where + ": its parts do not tile the intermediate dimension: \"columns\" must increase (" +
                    text(sp.columns[j - 1]) + " then " + text(sp.columns[j]) + ")");
    p.split_of_[static_cast<std::size_t>(sp.expert)] = static_cast<std::int32_t>(i);
  }
  std::vector<std::vector<std::int32_t>> homes(static_cast<std::size_t>(experts));
  for (std::int64_t r = 0; r < ranks; ++r) {
    const auto& list = lists[static_cast<std::size_t>(r)];
    if (list.empty() && !allow_empty_ranks)
      throw Error(source + ": rank " + text(r) + " has no experts; give it one, or set \"allow_empty_ranks\": true " +
                  "if a rank without experts is what you want");
    if (slots_per_rank > 0 && static_cast<std::int64_t>(list.size()) > slots_per_rank) {
      std::string beyond;  // the experts past the budget, in slot order: what a revision would have to drop
      for (std::size_t i = static_cast<std::size_t>(slots_per_rank); i < list.size(); ++i)
        beyond += (beyond.empty() ? "" : ", ") + text(list[i]);
      throw Error(source + ": rank " + text(r) + " holds " + text(static_cast<std::int64_t>(list.size())) +
                  " experts, more than its budget of " + text(slots_per_rank) + " slots (\"slots_per_rank\"): expert" +
                  (list.size() - static_cast<std::size_t>(slots_per_rank) > 1 ? "s " : " ") + beyond +
                  " past it; move or drop replicas, or raise the budget");
    }
    for (const std::int64_t e : list) {
      if (e < 0 || e >= experts)
        throw Error(source + ": rank " + text(r) + " lists expert " + text(e) + ", which does not exist (the layer has " +
                    text(experts) + " experts, 0.." + text(experts - 1) + ")");
      auto& h = homes[static_cast<std::size_t>(e)];
      if (!h.empty() && h.back() == r)
        throw Error(source + ": rank " + text(r) + " lists expert " + text(e) + " twice; a rank holds an expert once");
      if (!h.empty() && !allow_replicas && p.split_of_[static_cast<std::size_t>(e)] < 0)
        throw Error(source + ": expert " + text(e) + " is placed twice (on rank " + text(h.front()) + " and on rank " +
                    text(r) + "); set \"replicas\": true if the second is a replica, or split it (\"splits\")");
      h.push_back(static_cast<std::int32_t>(r));
      p.local_.push_back(static_cast<std::int32_t>(e));
    }
    p.local_begin_[static_cast<std::size_t>(r + 1)] = static_cast<std::int64_t>(p.local_.size());
  }
  p.home_begin_.assign(1, 0);
  for (std::int64_t e = 0; e < experts; ++e) {
    const auto& h = homes[static_cast<std::size_t>(e)];
    if (h.empty()) throw Error(source + ": expert " + text(e) + " is placed on no rank; every expert needs a home");
    if (const auto sp = p.split_of_[static_cast<std::size_t>(e)]; sp >= 0) {
      const auto parts = static_cast<std::int64_t>(p.splits_[static_cast<std::size_t>(sp)].columns.size()) - 1;
      if (static_cast<std::int64_t>(h.size()) != parts)
        throw Error(source + ": expert " + text(e) + " is split into " + text(parts) + " parts but placed on " +
                    text(static_cast<std::int64_t>(h.size())) + " ranks; list it on one rank per part (a split expert has no replicas)");
      for (const auto b : p.splits_[static_cast<std::size_t>(sp)].columns) p.split_columns_.push_back(b);
      p.split_columns_.push_back(-1);  // separator
    } else if (h.size() > 1) {
      ++p.replicated_experts_;
    }
    p.owner_[static_cast<std::size_t>(e)] = h.front();
    for (const std::int32_t r : h) {
      p.instance_rank_.push_back(r);
      p.instance_expert_.push_back(static_cast<std::int32_t>(e));
    }
    p.home_begin_.push_back(static_cast<std::int64_t>(p.instance_rank_.size()));
  }
  if (rules.fetch_replicas && !allow_replicas)
    throw Error(source + ": \"fetch_replicas\" is about replicas: set \"replicas\": true and list them");
  p.fetch_replicas_ = rules.fetch_replicas;
  p.number_borrowed();
  return p;
}

void ExpertPlacement::number_borrowed() {
  lent_block_.clear();
  lent_count_.clear();
  const auto borrowed = [&](std::int64_t i) {
    const std::int64_t e = instance_expert(i);
    return is_lent(i) || (fetch_replicas_ && !is_split(e) && instance_rank(i) != owner(e));
  };
  bool any = false;
  for (std::int64_t i = 0; i < instances() && !any; ++i) any = borrowed(i);
  if (!any) return;
  lent_block_.assign(static_cast<std::size_t>(instances()), -1);
  lent_count_.assign(static_cast<std::size_t>(ranks_), 0);
  for (std::int64_t r = 0; r < ranks_; ++r)
    for (const std::int64_t i : instances_of(r))
      if (borrowed(i)) lent_block_[static_cast<std::size_t>(i)] = lent_count_[static_cast<std::size_t>(r)]++;
}

ExpertPlacement ExpertPlacement::from_rank_lists(std::int64_t experts, const std::vector<std::vector<std::int64_t>>& lists,
                                                 const Rules& rules, const std::string& source) {
  return build(experts, lists, rules, source);
}

std::int64_t ExpertPlacement::instance_on(std::int64_t expert, std::int64_t rank) const {
  for (std::int64_t i = first_instance(expert); i < first_instance(expert) + home_count(expert); ++i)
    if (instance_rank(i) == rank) return i;
  return -1;
}

std::vector<std::int64_t> ExpertPlacement::instances_of(std::int64_t rank) const {
  std::vector<std::int64_t> out;
  for (const std::int32_t e : experts_of(rank)) out.push_back(instance_on(e, rank));
  return out;
}

ExpertPlacement ExpertPlacement::with_lent(std::span<const Lend> lends) const {
  if (lends.empty()) return *this;
  if (has_lent()) throw Error("lend: this placement already has lent homes; lend from the placement without them");
  const std::int64_t E = experts();
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(ranks_));
  for (std::int64_t r = 0; r < ranks_; ++r)
    for (const std::int32_t e : experts_of(r)) lists[static_cast<std::size_t>(r)].push_back(e);
  for (const Lend& l : lends) {
    if (l.expert < 0 || l.expert >= E || l.rank < 0 || l.rank >= ranks_)
      throw Error("lend: expert " + text(l.expert) + " to rank " + text(l.rank) + " is outside the layer's " + text(E) +
                  " experts and " + text(ranks_) + " ranks");
    if (is_split(l.expert))
      throw Error("lend: expert " + text(l.expert) + " is split (tensor-parallel); a split expert is not lent");
    auto& list = lists[static_cast<std::size_t>(l.rank)];
    if (std::find(list.begin(), list.end(), l.expert) != list.end())
      throw Error("lend: expert " + text(l.expert) + " is already on rank " + text(l.rank) +
                  " (a home, or lent there twice); a rank holds an expert once");
    list.push_back(l.expert);
  }
  Rules rules{allow_empty_ranks_, true, 0, splits_, fetch_replicas_};
  ExpertPlacement p = build(E, lists, rules, "lent placement");
  p.slots_per_rank_ = slots_per_rank_;  // lent homes are outside the budget
  p.replicated_experts_ = replicated_experts_;
  p.owner_ = owner_;  // the owner keeps the gradient, whatever rank the lent home is on
  p.lends_.assign(lends.begin(), lends.end());
  p.lent_.assign(static_cast<std::size_t>(p.instances()), 0);
  for (const Lend& l : lends) p.lent_[static_cast<std::size_t>(p.instance_on(l.expert, l.rank))] = 1;
  p.number_borrowed();  // with the owners restored: a lent home below its owner is no fetched replica
  return p;
}

std::int64_t ExpertPlacement::lent_count(std::int64_t rank) const {
  return lent_count_.empty() ? 0 : lent_count_[static_cast<std::size_t>(rank)];
}

std::int64_t ExpertPlacement::lent_block(std::int64_t instance) const {
  return lent_block_.empty() ? -1 : lent_block_[static_cast<std::size_t>(instance)];
}

ExpertPlacement ExpertPlacement::without_lent() const {
  if (!has_lent()) return *this;
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(ranks_));
  for (std::int64_t r = 0; r < ranks_; ++r)
    for (const std::int64_t i : instances_of(r))
      if (!is_lent(i)) lists[static_cast<std::size_t>(r)].push_back(instance_expert(i));
  ExpertPlacement p = build(experts(), lists, Rules{allow_empty_ranks_, true, slots_per_rank_, splits_, fetch_replicas_}, "placement");
  p.replicated_experts_ = replicated_experts_;
  p.owner_ = owner_;  // a lent home is never an owner: every owner is still a home
  p.number_borrowed();
  return p;
}

ExpertPlacement ExpertPlacement::with_owners(std::span<const std::int32_t> owners) const {
  if (static_cast<std::int64_t>(owners.size()) != experts())
    throw Error("owners: " + text(static_cast<std::int64_t>(owners.size())) + " given for " + text(experts()) +
                " experts; give one rank per expert");
  ExpertPlacement p = *this;
  for (std::int64_t e = 0; e < experts(); ++e) {
    const std::int32_t r = owners[static_cast<std::size_t>(e)];
    const std::int64_t i = r >= 0 && r < ranks_ ? instance_on(e, r) : -1;
    if (i < 0 || is_lent(i))
      throw Error("owners: expert " + text(e) + "'s owner is given as rank " + text(r) + ", which is not one of its homes" +
                  (i >= 0 ? " (it is lent there for the step)" : "") + "; an owner must hold the expert");
    if (is_split(e) && r != owner_[static_cast<std::size_t>(e)])
      throw Error("owners: expert " + text(e) + " is split; its owner is its first part's rank " +
                  text(owner_[static_cast<std::size_t>(e)]));
    p.owner_[static_cast<std::size_t>(e)] = r;
  }
  p.number_borrowed();
  return p;
}

ExpertPlacement ExpertPlacement::with_fetched_replicas() const {
  ExpertPlacement p = *this;
  p.fetch_replicas_ = true;
  p.number_borrowed();
  return p;
}

bool ExpertPlacement::has_moved_owners() const {
  for (std::int64_t e = 0; e < experts(); ++e)
    if (owner(e) != instance_rank(first_instance(e))) return true;
  return false;
}

ExpertPlacement ExpertPlacement::contiguous(std::int64_t experts, std::int64_t ranks) {
  check_every_rank_has_one(experts, ranks, "contiguous placement");
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(ranks));
  for (std::int64_t r = 0; r < ranks; ++r)
    for (std::int64_t e = r * experts / ranks; e < (r + 1) * experts / ranks; ++e) lists[static_cast<std::size_t>(r)].push_back(e);
  return build(experts, lists, Rules{}, "contiguous placement");
}

ExpertPlacement ExpertPlacement::round_robin(std::int64_t experts, std::int64_t ranks) {
  check_every_rank_has_one(experts, ranks, "round-robin placement");
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(ranks));
  for (std::int64_t e = 0; e < experts; ++e) lists[static_cast<std::size_t>(e % ranks)].push_back(e);
  return build(experts, lists, Rules{}, "round-robin placement");
}

ExpertPlacement ExpertPlacement::random(std::int64_t experts, std::int64_t ranks, std::uint64_t seed) {
  check_every_rank_has_one(experts, ranks, "random placement");
  std::vector<std::int64_t> perm(static_cast<std::size_t>(experts));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(seed);
  for (std::size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[static_cast<std::size_t>(rng() % i)]);
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(ranks));
  for (std::int64_t r = 0; r < ranks; ++r)
    for (std::int64_t i = r * experts / ranks; i < (r + 1) * experts / ranks; ++i)
      lists[static_cast<std::size_t>(r)].push_back(perm[static_cast<std::size_t>(i)]);
  return build(experts, lists, Rules{}, "random placement");
}

ExpertPlacement ExpertPlacement::from_owners(std::int64_t ranks, std::span<const std::int64_t> owner,
                                             bool allow_empty_ranks, const std::string& source) {
  check_sizes(static_cast<std::int64_t>(owner.size()), ranks, source);
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(ranks));
  for (std::size_t e = 0; e < owner.size(); ++e) {
    if (owner[e] < 0 || owner[e] >= ranks)
      throw Error(source + ": expert " + text(static_cast<std::int64_t>(e)) + " is placed on rank " + text(owner[e]) +
                  ", which does not exist (the layer has " + text(ranks) + " ranks, 0.." + text(ranks - 1) + ")");
    lists[static_cast<std::size_t>(owner[e])].push_back(static_cast<std::int64_t>(e));
  }
  return build(static_cast<std::int64_t>(owner.size()), lists, Rules{.allow_empty_ranks = allow_empty_ranks}, source);
}

ExpertPlacement ExpertPlacement::from_rank_lists(std::int64_t experts, const std::vector<std::vector<std::int64_t>>& lists,
                                                 bool allow_empty_ranks, const std::string& source) {
  return build(experts, lists, Rules{.allow_empty_ranks = allow_empty_ranks}, source);
}

std::int64_t ExpertPlacement::max_local_count() const {
  std::int64_t most = 0;
  for (std::int64_t r = 0; r < ranks_; ++r) most = std::max(most, local_count(r));
  return most;
}

void ExpertPlacement::check_fits(std::int64_t experts, std::int64_t ranks, std::int64_t inter, std::int64_t column_unit) const {
  if (this->experts() != experts || ranks_ != ranks)
    throw Error("the expert placement is for " + text(this->experts()) + " experts on " + text(ranks_) +
                " ranks, the layer has " + text(experts) + " experts on " + text(ranks) + " ranks");
  if (inter > 0)
    for (const Split& sp : splits_)
      if (sp.columns.back() != inter)
        throw Error("the split of expert " + text(sp.expert) + " does not tile the intermediate dimension: its columns end at " +
                    text(sp.columns.back()) + ", the layer's expert_inter is " + text(inter));
  if (column_unit > 1)
    for (const Split& sp : splits_)
      for (const auto b : sp.columns)
        if (b % column_unit != 0)
          throw Error("the split of expert " + text(sp.expert) + " cuts at column " + text(b) + ": a bf16 layer's split " +
                      "boundaries must be multiples of " + text(column_unit) + " (its kernels take the intermediate "
                      "dimension in pairs); plan with --dtype bf16, or move the cut");
}

std::pair<std::int64_t, std::int64_t> ExpertPlacement::part_columns(std::int64_t instance, std::int64_t inter) const {
  const std::int64_t e = instance_expert(instance);
  const auto sp = split_of_[static_cast<std::size_t>(e)];
  if (sp < 0) return {0, inter};
  const auto& cols = splits_[static_cast<std::size_t>(sp)].columns;
  const auto j = static_cast<std::size_t>(part_of(instance));
  return {cols[j], cols[j + 1]};
}

ExpertPlacement placement_or_contiguous(const ExpertPlacement& p, std::int64_t experts, std::int64_t ranks) {
  if (p.empty()) return ExpertPlacement::contiguous(experts, ranks);
  p.check_fits(experts, ranks);
  return p;
}

std::string describe(const ExpertPlacement& p) {
  if (p == ExpertPlacement::contiguous(p.experts(), p.ranks())) return "contiguous";
  std::string text;
  for (std::int64_t r = 0; r < p.ranks(); ++r) {
    text += r ? "; rank " : "rank ";
    text += std::to_string(r);
    text += ':';
    for (const auto e : p.experts_of(r)) {
      text += ' ';
      text += std::to_string(e);
    }
  }
  for (const auto& sp : p.splits()) {
    text += "; expert " + std::to_string(sp.expert) + " split at columns";
    for (const auto c : sp.columns) text += ' ' + std::to_string(c);
  }
  return text;
}

nlohmann::json to_json(const ExpertPlacement& p) {
  nlohmann::json lists = nlohmann::json::array();
  for (std::int64_t r = 0; r < p.ranks(); ++r) {
    const auto experts = p.experts_of(r);
    lists.push_back(std::vector<std::int32_t>(experts.begin(), experts.end()));
  }
  nlohmann::json j{{"experts_of_rank", lists}};
  if (p.allows_empty_ranks()) j["allow_empty_ranks"] = true;
  if (p.has_replicas() || p.fetches_replicas()) j["replicas"] = true;  // a fetching placement may have none yet
  if (p.fetches_replicas()) j["fetch_replicas"] = true;
  if (p.slots_per_rank() > 0) j["slots_per_rank"] = p.slots_per_rank();
  if (p.has_moved_owners()) {  // an owner that is not its expert's first home
    std::vector<std::int32_t> owners;
    for (std::int64_t e = 0; e < p.experts(); ++e) owners.push_back(p.owner(e));
    j["owners"] = owners;
  }
  if (p.has_splits()) {
    nlohmann::json splits = nlohmann::json::array();
    for (const auto& sp : p.splits()) splits.push_back({{"expert", sp.expert}, {"columns", sp.columns}});
    j["splits"] = splits;
  }
  return j;
}

ExpertPlacement placement_from_json(const nlohmann::json& j, std::int64_t experts, std::int64_t ranks,
                                    const std::string& source) {
  if (!j.is_object()) throw Error(source + ": a placement must be a JSON object with \"experts_of_rank\" or \"owner\"");
  for (const auto& [key, value] : j.items())
    if (key != "experts_of_rank" && key != "owner" && key != "allow_empty_ranks" && key != "replicas" &&
        key != "slots_per_rank" && key != "splits" && key != "fetch_replicas" && key != "owners")
      throw Error(source + ": unknown key '" + key +
                  "' (expected experts_of_rank, owner, owners, allow_empty_ranks, replicas, fetch_replicas, slots_per_rank, splits)");
  if (j.contains("experts_of_rank") == j.contains("owner"))
    throw Error(source + ": give exactly one of \"experts_of_rank\" (a list per rank) and \"owner\" (a rank per expert)");
  bool allow_empty = false;
  if (j.contains("allow_empty_ranks")) {
    if (!j["allow_empty_ranks"].is_boolean()) throw Error(source + ": \"allow_empty_ranks\" must be true or false");
    allow_empty = j["allow_empty_ranks"].get<bool>();
  }
  bool replicas = false;
  if (j.contains("replicas")) {
    if (!j["replicas"].is_boolean()) throw Error(source + ": \"replicas\" must be true or false");
    replicas = j["replicas"].get<bool>();
    if (replicas && j.contains("owner"))
      throw Error(source + ": \"owner\" gives each expert one home; list replicas in \"experts_of_rank\"");
  }
  bool fetch = false;
  if (j.contains("fetch_replicas")) {
    if (!j["fetch_replicas"].is_boolean()) throw Error(source + ": \"fetch_replicas\" must be true or false");
    fetch = j["fetch_replicas"].get<bool>();
  }
  std::int64_t slots = 0;
  if (j.contains("slots_per_rank")) {
    if (!j["slots_per_rank"].is_number_integer() ||
        (j["slots_per_rank"].is_number_unsigned() && j["slots_per_rank"].get<std::uint64_t>() > (std::uint64_t{1} << 20)) ||
        j["slots_per_rank"].get<std::int64_t>() < 1 ||
        j["slots_per_rank"].get<std::int64_t>() > (std::int64_t{1} << 20))
      throw Error(source + ": \"slots_per_rank\" must be a positive integer (the experts a rank may hold)");
    slots = j["slots_per_rank"].get<std::int64_t>();
  }
  auto integer = [&](const nlohmann::json& v, const std::string& where) {
    if (!v.is_number_integer()) throw Error(source + ": " + where + " must be an integer");
    // An unsigned value past int64 (a u64 id) would wrap to a negative one
    // and be reported as -1: name it as written.
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
      throw Error(source + ": " + where + " = " + v.dump() + " is out of range (an expert id, rank or column of this layer)");
    return v.get<std::int64_t>();
  };
  std::vector<ExpertPlacement::Split> splits;
  if (j.contains("splits")) {
    const auto& list = j["splits"];
    if (!list.is_array()) throw Error(source + ": \"splits\" must be a list of {\"expert\": E, \"columns\": [0, ..., I]}");
    if (j.contains("owner")) throw Error(source + ": \"owner\" gives each expert one home; list split experts' parts in \"experts_of_rank\"");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string where = "splits[" + text(static_cast<std::int64_t>(i)) + "]";
      const auto& item = list[i];
      if (!item.is_object() || !item.contains("expert") || !item.contains("columns") || item.size() != 2)
        throw Error(source + ": " + where + " must be {\"expert\": E, \"columns\": [0, ..., I]} and nothing else");
      ExpertPlacement::Split sp;
      sp.expert = integer(item["expert"], where + ".expert");
      if (!item["columns"].is_array() || item["columns"].size() > 4096)
        throw Error(source + ": " + where + ".columns must be a list of column boundaries");
      for (std::size_t c = 0; c < item["columns"].size(); ++c) {
        const std::int64_t b = integer(item["columns"][c], where + ".columns[" + text(static_cast<std::int64_t>(c)) + "]");
        if (b < 0 || b > (std::int64_t{1} << 30))
          throw Error(source + ": " + where + ".columns[" + text(static_cast<std::int64_t>(c)) + "] = " + text(b) +
                      " is not a column of an intermediate dimension");
        sp.columns.push_back(b);
      }
      splits.push_back(std::move(sp));
    }
  }
  ExpertPlacement p;
  if (j.contains("owner")) {
    const auto& list = j["owner"];
    if (!list.is_array()) throw Error(source + ": \"owner\" must be a list with one rank per expert");
    if (static_cast<std::int64_t>(list.size()) != experts)
      throw Error(source + ": \"owner\" lists " + text(static_cast<std::int64_t>(list.size())) +
                  " experts, the layer has " + text(experts));
    if (fetch) throw Error(source + ": \"fetch_replicas\" is about replicas: list them in \"experts_of_rank\"");
    std::vector<std::int64_t> owner;
    for (std::size_t e = 0; e < list.size(); ++e) owner.push_back(integer(list[e], "owner[" + text(static_cast<std::int64_t>(e)) + "]"));
    p = ExpertPlacement::from_owners(ranks, owner, allow_empty, source);
    if (slots > 0) {
      std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(ranks));
      for (std::int64_t r = 0; r < ranks; ++r)
        for (const auto e : p.experts_of(r)) lists[static_cast<std::size_t>(r)].push_back(e);
      p = ExpertPlacement::from_rank_lists(experts, lists, ExpertPlacement::Rules{allow_empty, false, slots, {}}, source);
    }
  } else {
    const auto& lists = j["experts_of_rank"];
    if (!lists.is_array()) throw Error(source + ": \"experts_of_rank\" must be a list of lists of expert ids");
    if (static_cast<std::int64_t>(lists.size()) != ranks)
      throw Error(source + ": \"experts_of_rank\" has " + text(static_cast<std::int64_t>(lists.size())) +
                  " lists, but the layer has " + text(ranks) + " ranks" +
                  (static_cast<std::int64_t>(lists.size()) > ranks ? " (it places experts on ranks that do not exist)" : ""));
    std::vector<std::vector<std::int64_t>> parsed(lists.size());
    for (std::size_t r = 0; r < lists.size(); ++r) {
      const std::string where = "experts_of_rank[" + text(static_cast<std::int64_t>(r)) + "]";
      if (!lists[r].is_array()) throw Error(source + ": " + where + " must be a list of expert ids");
      for (std::size_t i = 0; i < lists[r].size(); ++i)
        parsed[r].push_back(integer(lists[r][i], where + "[" + text(static_cast<std::int64_t>(i)) + "]"));
    }
    p = ExpertPlacement::from_rank_lists(experts, parsed,
                                         ExpertPlacement::Rules{allow_empty, replicas, slots, std::move(splits), fetch}, source);
  }
  if (j.contains("owners")) {
    const auto& list = j["owners"];
    if (j.contains("owner")) throw Error(source + ": \"owners\" names replicated experts' owners; with \"owner\" every expert has one home");
    if (!list.is_array() || static_cast<std::int64_t>(list.size()) != experts)
      throw Error(source + ": \"owners\" must be a list with one rank per expert (" + text(experts) + "), each one of its homes");
    std::vector<std::int32_t> owners;
    for (std::size_t e = 0; e < list.size(); ++e) {
      const std::int64_t r = integer(list[e], "owners[" + text(static_cast<std::int64_t>(e)) + "]");
      owners.push_back(static_cast<std::int32_t>(std::clamp<std::int64_t>(r, -1, ranks)));
    }
    try {
      p = p.with_owners(owners);
    } catch (const Error& e) {
      throw Error(source + ": " + e.what());
    }
  }
  return p;
}

ExpertPlacement parse_placement(const std::string& spec, std::int64_t experts, std::int64_t ranks) {
  if (spec == "contiguous") return ExpertPlacement::contiguous(experts, ranks);
  if (spec == "round-robin") return ExpertPlacement::round_robin(experts, ranks);
  if (spec == "random" || spec.rfind("random:", 0) == 0) {
    std::uint64_t seed = 1;
    if (spec.size() > 7) {
      const std::string digits = spec.substr(7);
      if (digits.empty() || digits.size() > 19 || digits.find_first_not_of("0123456789") != std::string::npos)
        throw Error("--placement random:SEED needs a non-negative integer seed (got '" + digits + "')");
      seed = std::stoull(digits);
    }
    return ExpertPlacement::random(experts, ranks, seed);
  }
  const nlohmann::json j = parse_json_file(
      spec, "placement file '" + spec + "'",
      "--placement '" + spec + "' is neither contiguous, round-robin, random[:SEED] nor a readable JSON file");
  return placement_from_json(j, experts, ranks, "placement file '" + spec + "'");
}

}  // namespace hpmoe
