// libFuzzer target: expert placement files (--placement FILE.json). Any
// input either parses into a placement that puts every expert on exactly one
// existing rank, or is rejected with an hpmoe::Error; nothing else may
// happen (no crash, no other exception, no hang).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>

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
    for (std::int64_t r = 0; r < p.ranks(); ++r)
      for (const auto e : p.experts_of(r)) {
        if (e < 0 || e >= experts || p.owner(e) != r) std::abort();
        ++placed;
      }
    if (placed != experts || p.ranks() != ranks) std::abort();
    if (!(hpmoe::placement_from_json(hpmoe::to_json(p), experts, ranks, "round trip") == p)) std::abort();
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
