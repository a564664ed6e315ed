// libFuzzer target: recorded routing traces (--routing trace:FILE[:LAYER]).
// Any input either gives, for every token, top_k distinct expert ids inside
// the layer, or is rejected with an hpmoe::Error; nothing else may happen.
// The first two bytes choose the layer: 1..64 experts, top_k 1..8.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "hpmoe/error.hpp"
#include "hpmoe/routing.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::int64_t experts = 1 + data[0] % 64, top_k = 1 + data[1] % 8;
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);
  try {
    std::int64_t tokens = 0;
    const auto ids = hpmoe::parse_trace(text, "fuzz", "0", top_k, experts, &tokens);
    if (tokens <= 0 || static_cast<std::int64_t>(ids.size()) != tokens * top_k) std::abort();
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t k = 0; k < top_k; ++k) {
        const auto id = ids[static_cast<std::size_t>(t * top_k + k)];
        if (id < 0 || id >= experts) std::abort();
        if (std::count(ids.begin() + t * top_k, ids.begin() + (t + 1) * top_k, id) != 1) std::abort();
      }
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
