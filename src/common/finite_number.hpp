#pragma once
// Internal: the whole of a text as a finite number, or nothing. Callers
// name the field or flag in their own error (a config field, a routing
// spec, a benchmark's flag).
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace hpmoe::detail {

inline std::optional<double> finite_number(std::string_view text) {
  const std::string s(text);
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {  // not a number, or out of double's range
    return std::nullopt;
  }
  if (s.empty() || used != s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace hpmoe::detail
