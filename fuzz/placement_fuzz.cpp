// libFuzzer target: expert placement files (--placement FILE.json). Any
// input either parses into a placement that gives every expert one or more
// homes on existing ranks (at most one per rank, within the slot budget), or
// is rejected with an hpmoe::Error; nothing else may happen (no crash, no
// other exception, no hang). A parsed placement's quota plan must hand every
// row of every (source, expert) count to exactly one of the expert's homes,
// or, for a tensor-parallel split expert, every row to every part, whose
// columns tile the intermediate dimension in part order.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <vector>

#include "hpmoe/error.hpp"
#include "hpmoe/placement.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  // The layer's sizes from the first two bytes: 1..64 experts on 1..16 ranks.
  const std::int64_t experts = 1 + data[0] % 64, ranks = 1 + data[1] % 16;
  const auto j = nlohmann::json::parse(data + 2, data + size, nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    const auto p = hpmoe::placement_from_json(j, experts, ranks, "fuzz");
    std::int64_t placed = 0;
    for (std::int64_t r = 0; r < p.ranks(); ++r) {
      if (p.slots_per_rank() > 0 && p.local_count(r) > p.slots_per_rank()) std::abort();
      for (const auto e : p.experts_of(r)) {
        if (e < 0 || e >= experts || p.instance_on(e, r) < 0 || p.instance_rank(p.instance_on(e, r)) != r) std::abort();
        ++placed;
      }
    }
    for (std::int64_t e = 0; e < experts; ++e) {
      // The owner is one of the expert's homes: its first unless "owners" says otherwise.
      if (p.home_count(e) < 1 || p.instance_on(e, p.owner(e)) < 0) std::abort();
      if (!j.contains("owners") && p.owner(e) != p.instance_rank(p.first_instance(e))) std::abort();
      for (std::int64_t i = p.first_instance(e) + 1; i < p.first_instance(e) + p.home_count(e); ++i)
        if (p.instance_rank(i) <= p.instance_rank(i - 1) || p.instance_expert(i) != e) std::abort();
    }
    if (placed != p.instances() || p.ranks() != ranks) std::abort();
    for (const auto& sp : p.splits()) {
      if (p.parts(sp.expert) != static_cast<std::int64_t>(sp.columns.size()) - 1) std::abort();
      std::int64_t next = 0;
      for (std::int64_t j = 0; j < p.parts(sp.expert); ++j) {
        const auto [c0, c1] = p.part_columns(p.first_instance(sp.expert) + j, sp.columns.back());
        if (c0 != next || c1 <= c0) std::abort();
        next = c1;
      }
      if (next != sp.columns.back() || (p.home_count(sp.expert) > 1 && !p.is_split(sp.expert))) std::abort();
    }
    if (!(hpmoe::placement_from_json(hpmoe::to_json(p), experts, ranks, "round trip") == p)) std::abort();
    // Counts from the input's bytes; every row goes to exactly one home.
    std::vector<std::int64_t> counts(static_cast<std::size_t>(ranks * experts));
    for (std::size_t i = 0; i < counts.size(); ++i) counts[i] = data[i % size] % 97;
    const auto quota = hpmoe::plan_quotas(p, counts);
    const std::int64_t N = p.instances();
    for (std::int64_t s = 0; s < ranks; ++s)
      for (std::int64_t e = 0; e < experts; ++e) {
        std::int64_t sum = 0;
        const std::int64_t n = counts[static_cast<std::size_t>(s * experts + e)];
        for (std::int64_t i = p.first_instance(e); i < p.first_instance(e) + p.home_count(e); ++i) {
          const std::int64_t q = quota[static_cast<std::size_t>(s * N + i)];
          if (q < 0 || (p.is_split(e) && q != n)) std::abort();
          sum += q;
        }
        if (!p.is_split(e) && sum != n) std::abort();
      }
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
