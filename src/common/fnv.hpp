#pragma once
// FNV-1a over a string's bytes: the same text gives the same value in every
// process and on every run (options compared across MPI processes, stable
// colours per name).
#include <cstdint>
#include <string_view>

namespace hpmoe {

inline std::uint64_t fnv1a(std::string_view text) {
  std::uint64_t h = 1469598103934665603ull;
  for (const unsigned char ch : text) h = (h ^ ch) * 1099511628211ull;
  return h;
}

}  // namespace hpmoe
