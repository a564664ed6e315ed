#pragma once
// Test helpers: whole tensors and gradient sets compared bit for bit.
#include <cstring>

#include "hpmoe/tensors.hpp"

namespace hpmoe::testing {

inline bool bit_identical(const Matrix& a, const Matrix& b) {
  // Empty tensors (a layer without shared experts) have no storage: memcmp's
  // pointers must not be null, even for zero bytes.
  return a.data.size() == b.data.size() &&
         (a.data.empty() || std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0);
}

inline bool bit_identical(const LayerGradients& a, const LayerGradients& b) {
  bool same = a.w1.size() == b.w1.size() && bit_identical(a.x, b.x) && bit_identical(a.router, b.router) &&
              bit_identical(a.shared_w1, b.shared_w1) && bit_identical(a.shared_w2, b.shared_w2);
  for (std::size_t e = 0; same && e < a.w1.size(); ++e)
    same = bit_identical(a.w1[e], b.w1[e]) && bit_identical(a.w2[e], b.w2[e]);
  return same;
}

}  // namespace hpmoe::testing
