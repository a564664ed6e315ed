// What the compiler's and the runtime's fuzz targets draw from their input:
// a small layer and a placement (fuzz/compile_fuzz.cpp, fuzz/runtime_fuzz.cpp).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"

namespace hpmoe::fuzzing {

// At most `max_ranks` ranks, `max_tokens` tokens a rank and `max_experts` experts.
inline LayerConfig layer_from(FuzzedDataProvider& in, std::int64_t max_ranks = 12, std::int64_t max_tokens = 96,
                              std::int64_t max_experts = 40) {
  LayerConfig c;
  c.ranks = in.ConsumeIntegralInRange<std::int64_t>(1, max_ranks);
  std::vector<std::int64_t> per_node{0};
  for (std::int64_t d = 1; d < c.ranks; ++d)
    if (c.ranks % d == 0) per_node.push_back(d);
  c.ranks_per_node = per_node[in.ConsumeIntegralInRange<std::size_t>(0, per_node.size() - 1)];
  c.tokens_per_rank = in.ConsumeIntegralInRange<std::int64_t>(1, max_tokens);
  c.routed_experts = in.ConsumeIntegralInRange<std::int64_t>(1, max_experts);
  c.top_k = in.ConsumeIntegralInRange<std::int64_t>(1, 8);
  c.hidden = 128 * in.ConsumeIntegralInRange<std::int64_t>(1, 2);
  c.expert_inter = 32 * in.ConsumeIntegralInRange<std::int64_t>(1, 4);
  c.shared_experts = in.ConsumeIntegralInRange<std::int64_t>(0, 1);
  c.dtype = in.ConsumeBool() ? DType::bf16 : DType::fp32;
  c.dispatch_dtype = static_cast<DispatchDType>(in.ConsumeIntegralInRange<int>(0, 3));
  c.grad_dispatch_dtype = static_cast<GradDispatchDType>(in.ConsumeIntegralInRange<int>(0, 2));
  c.exchange = in.ConsumeBool() ? ExchangeMode::rank : ExchangeMode::assignment;
  c.combine_dtype = in.ConsumeBool() ? CombineDType::bf16 : CombineDType::layer;
  c.node_forwarding = in.ConsumeBool();
  const int lend = in.ConsumeIntegralInRange<int>(0, 3);
  c.lend_weights = lend == 0 ? 0 : lend == 1 ? LayerConfig::kLendAuto : in.ConsumeIntegralInRange<std::int64_t>(1, 64);
  if (in.ConsumeBool()) c.capacity_factor = 0.5 + in.ConsumeIntegralInRange<int>(0, 6) * 0.25;
  return c;
}

inline ExpertPlacement placement_from(FuzzedDataProvider& in, const LayerConfig& c) {
  const int kind = in.ConsumeIntegralInRange<int>(0, 2);
  const ExpertPlacement base = kind == 0   ? ExpertPlacement::contiguous(c.routed_experts, c.ranks)
                               : kind == 1 ? ExpertPlacement::round_robin(c.routed_experts, c.ranks)
                                           : ExpertPlacement::random(c.routed_experts, c.ranks, in.ConsumeIntegral<std::uint16_t>());
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(c.ranks));
  for (std::int64_t r = 0; r < c.ranks; ++r)
    for (const auto i : base.instances_of(r)) lists[static_cast<std::size_t>(r)].push_back(base.instance_expert(i));
  if (c.ranks > 1 && in.ConsumeBool()) {  // an expert split over two ranks (a tensor-parallel hybrid)
    const auto e = in.ConsumeIntegralInRange<std::int64_t>(0, c.routed_experts - 1);
    const auto owner = base.owner(e);
    const auto other = (owner + in.ConsumeIntegralInRange<std::int64_t>(1, c.ranks - 1)) % c.ranks;
    auto& list = lists[static_cast<std::size_t>(other)];
    list.insert(list.begin() + static_cast<std::ptrdiff_t>(in.ConsumeIntegralInRange<std::size_t>(0, list.size())), e);
    const std::int64_t cut = in.ConsumeIntegralInRange<std::int64_t>(1, c.expert_inter - 1);
    // Parts go to their homes in rank order: the lower rank takes the first columns.
    return ExpertPlacement::from_rank_lists(
        c.routed_experts, lists,
        ExpertPlacement::Rules{.allow_empty_ranks = true, .splits = {{.expert = e, .columns = {0, cut, c.expert_inter}}}},
        "fuzz");
  }
  const int replicas = in.ConsumeIntegralInRange<int>(0, 4);
  if (replicas == 0) return base;
  for (int k = 0; k < replicas; ++k) {
    const auto e = in.ConsumeIntegralInRange<std::int64_t>(0, c.routed_experts - 1);
    auto& list = lists[static_cast<std::size_t>(in.ConsumeIntegralInRange<std::int64_t>(0, c.ranks - 1))];
    if (std::find(list.begin(), list.end(), e) == list.end()) list.push_back(e);
  }
  const ExpertPlacement replicated = ExpertPlacement::from_rank_lists(
      c.routed_experts, lists, ExpertPlacement::Rules{.allow_empty_ranks = true, .replicas = true}, "fuzz");
  const ExpertPlacement placed = in.ConsumeBool() ? replicated.with_fetched_replicas() : replicated;
  if (!in.ConsumeBool()) return placed;
  std::vector<std::int32_t> owners(static_cast<std::size_t>(c.routed_experts));  // owners that need not be first homes
  for (std::int64_t e = 0; e < c.routed_experts; ++e) {
    const auto home = placed.first_instance(e) + in.ConsumeIntegralInRange<std::int64_t>(0, placed.home_count(e) - 1);
    owners[static_cast<std::size_t>(e)] = placed.instance_rank(home);
  }
  return placed.with_owners(owners);
}

}  // namespace hpmoe::fuzzing
