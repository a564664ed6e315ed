#pragma once
// The median of measured samples, the one definition every report, the
// calibration and the benchmarks use (an even count takes the mean of the
// two middle samples).
#include <algorithm>
#include <vector>

#include "hpmoe/error.hpp"

namespace hpmoe {

inline double median(std::vector<double> v) {
  if (v.empty()) throw Error("the median of no samples");
  const std::size_t n = v.size();
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n / 2), v.end());
  const double upper = v[n / 2];
  if (n % 2) return upper;
  return 0.5 * (*std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n / 2)) + upper);
}

}  // namespace hpmoe
