// What a rank holds, for the simulator's capacity check (issue 42, item 3):
// weights, gradients and optimizer state from the layer and the placement,
// buffers from the programs the compiler declares for a routing.
#include <algorithm>
#include <numeric>

#include "sim/sim.hpp"

namespace hpmoe::sim {

double declared_bytes(const taskflow::Program& p) {
  double bytes = 0;
  for (const auto& b : p.buffers)
    if (b.region != taskflow::Region::bound) bytes += double(b.bytes());  // bound: the caller's tensors (x, out, ...)
  return bytes;
}

MemoryUse parameter_bytes(const LayerConfig& c, const ExpertPlacement& placement, std::int64_t r, bool backward,
                          bool optimizer_state) {
  const double H = double(c.hidden);
  double params = double(c.routed_experts) * H + 3.0 * H * double(c.shared_inter_total());  // router, shared experts
  for (const auto i : placement.instances_of(r)) {
    const auto [c0, c1] = placement.part_columns(i, c.expert_inter);
    params += 3.0 * H * double(c1 - c0);  // a split part holds its columns' share; a whole expert all of I
  }
  MemoryUse m;
  m.rank = r;
  m.weights = params * (c.dtype == DType::fp32 ? 4.0 : 2.0);
  m.gradients = backward ? params * 4.0 : 0.0;
  m.optimizer = optimizer_state ? params * 12.0 : 0.0;
  return m;
}

std::vector<std::int32_t> worst_routing_for(const LayerConfig& c, const ExpertPlacement& placement, std::int64_t r) {
  const auto held = placement.experts_of(r);
  std::vector<std::int64_t> mine(held.begin(), held.end());
  // Experts r alone holds take all their rows; a replica's are shared by its homes.
  std::stable_sort(mine.begin(), mine.end(),
                   [&](std::int64_t a, std::int64_t b) { return placement.home_count(a) < placement.home_count(b); });
  std::vector<std::int32_t> choice;
  for (const auto e : mine)
    if (static_cast<std::int64_t>(choice.size()) < c.top_k) choice.push_back(static_cast<std::int32_t>(e));
  for (std::int64_t e = 0; static_cast<std::int64_t>(choice.size()) < c.top_k && e < c.routed_experts; ++e)
    if (std::find(choice.begin(), choice.end(), e) == choice.end()) choice.push_back(static_cast<std::int32_t>(e));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(c.total_tokens() * c.top_k));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = choice[i % choice.size()];
  return ids;
}

}  // namespace hpmoe::sim
