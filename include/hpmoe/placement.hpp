#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace hpmoe {

// Where each routed expert lives: the rank that owns it and its slot among
// that rank's experts. The compiler, both executors, the verifier and the
// simulator take the placement as data; nothing assumes that expert e lives
// on rank e / L. A rank's experts are laid out in its receive buffer in slot
// order, and the experts' arithmetic does not depend on where they live, so
// any placement gives bit-identical results.
//
// An expert may have several homes (replicas, EPLB's redundant experts): at
// most one per rank, the first (lowest rank) its owner, which holds its
// gradient; the others hold copies of its weights. Each home is an
// *instance*, numbered expert by expert, home by home (without replicas
// instance e is expert e). Every step a quota plan (plan_quotas) divides
// each (source rank, expert) count among the expert's instances, the same
// on every rank. A per-rank slot budget bounds the experts a rank holds.
//
// An expert may instead be split (tensor-parallel, HDA-MoE's hybrid): its
// intermediate dimension cut into k column parts [b_j, b_{j+1}) on its k
// homes in rank order. Every part receives all of the expert's rows and
// computes its slice of gate/up and SwiGLU and a partial down projection;
// the partials are summed on the source in part order by a declared
// reduction (TaskKind::part_reduce). A split expert has no replicas.
class ExpertPlacement {
 public:
  ExpertPlacement() = default;

  // Rank r owns [r E / P, (r + 1) E / P): e / (E / P) when P divides E,
  // otherwise the first ranks get one expert fewer.
  static ExpertPlacement contiguous(std::int64_t experts, std::int64_t ranks);
  // Expert e on rank e mod P.
  static ExpertPlacement round_robin(std::int64_t experts, std::int64_t ranks);
  // A random permutation of the contiguous placement (same count per rank).
  static ExpertPlacement random(std::int64_t experts, std::int64_t ranks, std::uint64_t seed);
  // owner[e] is expert e's rank; a rank's slots are in increasing expert id.
  // `source` starts error messages (a file name, a flag).
  static ExpertPlacement from_owners(std::int64_t ranks, std::span<const std::int64_t> owner,
                                     bool allow_empty_ranks = false, const std::string& source = "placement");
  // experts_of_rank[r] lists rank r's experts in slot order. Every expert of
  // 0..E-1 must appear exactly once.
  static ExpertPlacement from_rank_lists(std::int64_t experts, const std::vector<std::vector<std::int64_t>>& experts_of_rank,
                                         bool allow_empty_ranks = false, const std::string& source = "placement");
  // What a placement may do beyond one home per expert.
  // A split expert: its homes, in rank order, take the column parts
  // [columns[j], columns[j + 1]) of its intermediate dimension.
  struct Split {
    std::int64_t expert = 0;
    std::vector<std::int64_t> columns;  // 0 = b_0 < b_1 < ... < b_k = the layer's expert_inter
  };
  struct Rules {
    bool allow_empty_ranks = false;
    bool replicas = false;            // an expert on several ranks (at most once per rank)
    std::int64_t slots_per_rank = 0;  // experts a rank may hold (0: no budget)
    std::vector<Split> splits = {};   // tensor-parallel experts (each listed on as many ranks as it has parts)
    // Replicas whose weights their owner puts to them every step (as a lent
    // home's: weight_put tasks the verifier proves) instead of being held:
    // always the owner's current weights, nothing to load where a replica
    // moves. Their quotas are a replica's.
    bool fetch_replicas = false;
  };
  static ExpertPlacement from_rank_lists(std::int64_t experts, const std::vector<std::vector<std::int64_t>>& experts_of_rank,
                                         const Rules&, const std::string& source = "placement");

  std::int64_t ranks() const { return ranks_; }
  std::int64_t experts() const { return static_cast<std::int64_t>(owner_.size()); }
  bool empty() const { return owner_.empty(); }
  // The expert's first home: the rank that holds its gradient.
  std::int32_t owner(std::int64_t expert) const { return owner_[static_cast<std::size_t>(expert)]; }
  // Instances (homes) of every expert: expert e has home_count(e) of them,
  // numbered from first_instance(e), on increasing ranks.
  std::int64_t instances() const { return static_cast<std::int64_t>(instance_rank_.size()); }
  std::int64_t first_instance(std::int64_t expert) const { return home_begin_[static_cast<std::size_t>(expert)]; }
  std::int64_t home_count(std::int64_t expert) const {
    return home_begin_[static_cast<std::size_t>(expert) + 1] - home_begin_[static_cast<std::size_t>(expert)];
  }
  std::int32_t instance_rank(std::int64_t instance) const { return instance_rank_[static_cast<std::size_t>(instance)]; }
  std::int32_t instance_expert(std::int64_t instance) const { return instance_expert_[static_cast<std::size_t>(instance)]; }
  // Expert e's instance on `rank`, or -1 if it has none there.
  std::int64_t instance_on(std::int64_t expert, std::int64_t rank) const;
  bool has_replicas() const { return replicated_experts_ > 0; }
  // Tensor-parallel splits: whether expert e is split, and the columns of
  // the intermediate dimension an instance computes ([0, inter) for an
  // instance of an unsplit expert).
  bool has_splits() const { return !splits_.empty(); }
  bool is_split(std::int64_t expert) const { return split_of_[static_cast<std::size_t>(expert)] >= 0; }
  std::int64_t parts(std::int64_t expert) const { return is_split(expert) ? home_count(expert) : 1; }
  std::int64_t part_of(std::int64_t instance) const { return instance - first_instance(instance_expert(instance)); }
  std::pair<std::int64_t, std::int64_t> part_columns(std::int64_t instance, std::int64_t inter) const;
  const std::vector<Split>& splits() const { return splits_; }
  std::int64_t slots_per_rank() const { return slots_per_rank_; }
  std::int64_t local_count(std::int64_t rank) const {
    return local_begin_[static_cast<std::size_t>(rank + 1)] - local_begin_[static_cast<std::size_t>(rank)];
  }
  // Rank r's experts in slot order.
  std::span<const std::int32_t> experts_of(std::int64_t rank) const {
    return std::span<const std::int32_t>(local_).subspan(static_cast<std::size_t>(local_begin_[static_cast<std::size_t>(rank)]),
                                                        static_cast<std::size_t>(local_count(rank)));
  }
  std::int64_t max_local_count() const;
  bool allows_empty_ranks() const { return allow_empty_ranks_; }
  // Rank r's instances in slot order (their experts are experts_of(r)).
  std::vector<std::int64_t> instances_of(std::int64_t rank) const;

  // Weights instead of tokens (MoE-Prefill): a *lent* home holds its
  // expert for one step only. The expert's owner puts the packed weights
  // to it as declared tasks, and it computes exactly its own rank's rows of
  // the expert (the quota plan gives it nothing else), so those rows never
  // leave their rank. A lent home is the last slot(s) of its rank, after
  // the rank's own experts, in the order given; it does not move the owner
  // (who keeps the gradient: a lent home's weight gradient is a replica's
  // partial) and does not count against the slot budget.
  struct Lend {
    std::int64_t expert = 0, rank = 0;
    friend bool operator==(const Lend&, const Lend&) = default;
  };
  // This placement with `lends` added. Throws Error naming the expert when
  // it is split, already on that rank, lent there twice, or not in range.
  ExpertPlacement with_lent(std::span<const Lend> lends) const;
  bool is_lent(std::int64_t instance) const {
    return !lent_.empty() && lent_[static_cast<std::size_t>(instance)] != 0;
  }
  bool has_lent() const { return !lends_.empty(); }
  const std::vector<Lend>& lends() const { return lends_; }
  // Whether replicas fetch their weights (Rules::fetch_replicas), and the
  // instances whose weights arrive by puts each step: lent homes and
  // fetched replicas (borrowed, for short).
  bool fetches_replicas() const { return fetch_replicas_; }
  bool borrows(std::int64_t instance) const { return lent_block(instance) >= 0; }
  bool has_borrowed() const { return !lent_block_.empty(); }
  // Borrowed homes on `rank`, and the index of a borrowed instance among
  // them in slot order (its block in the rank's lent weights); -1 if not.
  std::int64_t lent_count(std::int64_t rank) const;
  std::int64_t lent_block(std::int64_t instance) const;
  // The placement without its lent homes.
  ExpertPlacement without_lent() const;

  // An expert's owner is its first (lowest-ranked) home unless given: this
  // placement with `owners[e]` as expert e's owner, which must be one of
  // its homes (not a lent one; a split expert's stays its first part's).
  // The owner holds the expert's weights and sums its gradient; its other
  // homes are replicas wherever they are, so a replica may sit below its
  // owner (an online revision that keeps every owner where its parameters
  // and optimizer state are). Throws Error naming the expert.
  ExpertPlacement with_owners(std::span<const std::int32_t> owners) const;
  // Whether some owner is not its expert's first home.
  bool has_moved_owners() const;
  // This placement with replicas that fetch their weights (Rules::
  // fetch_replicas), owners and slots as they are: where replicas will be
  // added later (an online start) too. Split experts' parts are never
  // fetched.
  ExpertPlacement with_fetched_replicas() const;

  // Throws Error unless this placement fits a layer of `experts` experts on
  // `ranks` ranks (and, given the expert's intermediate size, unless every
  // split's parts tile [0, inter)). `column_unit`: every split boundary a
  // multiple of it (2 for a bf16 layer, whose kernels take K in pairs).
  void check_fits(std::int64_t experts, std::int64_t ranks, std::int64_t inter = 0, std::int64_t column_unit = 1) const;

  friend bool operator==(const ExpertPlacement& a, const ExpertPlacement& b) {
    return a.ranks_ == b.ranks_ && a.local_begin_ == b.local_begin_ && a.local_ == b.local_ &&
           a.slots_per_rank_ == b.slots_per_rank_ && a.split_columns_ == b.split_columns_ && a.lends_ == b.lends_ &&
           a.fetch_replicas_ == b.fetch_replicas_ && a.owner_ == b.owner_;
  }

 private:
  static ExpertPlacement build(std::int64_t experts, const std::vector<std::vector<std::int64_t>>& experts_of_rank,
                               const Rules&, const std::string& source);
  std::int64_t ranks_ = 0, slots_per_rank_ = 0, replicated_experts_ = 0;
  std::vector<Split> splits_;                 // sorted by expert
  std::vector<std::int32_t> split_of_;        // [E] index into splits_, -1 if whole
  std::vector<std::int64_t> split_columns_;   // [E + 1 per part...]: flat boundaries, for equality
  bool allow_empty_ranks_ = false;
  std::vector<std::int32_t> owner_;                            // [E]
  std::vector<std::int64_t> home_begin_;                       // [E + 1] into the instances
  std::vector<std::int32_t> instance_rank_, instance_expert_;  // [instances]
  std::vector<std::int64_t> local_begin_;   // [P + 1] into local_
  std::vector<std::int32_t> local_;         // [E] experts by rank, slot order
  std::vector<Lend> lends_;                 // the lent homes, as given to with_lent
  std::vector<std::uint8_t> lent_;          // [instances]: 1 for a lent home (empty without)
  bool fetch_replicas_ = false;
  std::vector<std::int64_t> lent_block_;    // [instances]: a borrowed home's block on its rank, -1 otherwise (empty: none)
  std::vector<std::int64_t> lent_count_;    // [P]: borrowed homes per rank (empty: none)
  // The blocks of the borrowed homes (lent ones, and fetched replicas).
  void number_borrowed();
};

// `p` checked against the layer's sizes, or the contiguous placement when p
// is empty (what an option left unset means).
ExpertPlacement placement_or_contiguous(const ExpertPlacement& p, std::int64_t experts, std::int64_t ranks);

// "contiguous", or each rank's experts ("rank 0: 7 0 3; rank 1: 5 1").
std::string describe(const ExpertPlacement&);

// {"experts_of_rank": [[0, 3], [1, 2]]} or {"owner": [0, 1, 1, 0]}, with an
// optional "allow_empty_ranks": true; with "replicas": true an expert may be
// listed on several ranks, and "slots_per_rank": N bounds every rank's list;
// "splits": [{"expert": 3, "columns": [0, 704, 1408]}] splits an expert
// listed on two ranks into two column parts (docs/placement.schema.json).
// Errors name the field and the expert.
nlohmann::json to_json(const ExpertPlacement&);
ExpertPlacement placement_from_json(const nlohmann::json&, std::int64_t experts, std::int64_t ranks,
                                    const std::string& source);
// "contiguous", "round-robin", "random[:SEED]", or a JSON file as above.
ExpertPlacement parse_placement(const std::string& spec, std::int64_t experts, std::int64_t ranks);

// The per-step quota plan: rows of each (source rank, expert) count
// (counts[s E + e]) given to each of the expert's instances, [s N + i].
// Each expert's rows go to its homes so as to even out the ranks' loads in
// rows: the unreplicated experts' loads fixed first, then replicated experts
// with the fewest homes, the heaviest first among equals, each water-filled
// row by row over its homes (a home's share may end mid-tile: the executors
// run the last tile short, and a short tile costs its rows). A source's rows
// go first to a home on its own rank; the rest spread over the homes in
// proportion to what each can still take (largest remainders). A
// pure function of its arguments in integers, independent of the compute
// tile: every rank computes the same plan with no communication (TopoEP's
// property).
std::vector<std::int64_t> plan_quotas(const ExpertPlacement&, std::span<const std::int64_t> counts);
// Rows each instance runs in a step ([instances]): the quota plan's, summed
// over sources (without replicas or splits, instance e is expert e and runs
// all its rows; a split expert's every part runs every row). The one place
// the routing statistics, the planner and the run report take loads from.
std::vector<std::int64_t> instance_rows(const ExpertPlacement&, std::span<const std::int64_t> counts);

}  // namespace hpmoe
