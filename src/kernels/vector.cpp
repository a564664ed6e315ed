#include <cstring>
#include <cmath>
#include <cstdint>

#include "kernels/kernels.hpp"

// Plain loops written so that GCC vectorises them (-O3 -march=native; the
// SwiGLU's exp is a polynomial of our own, below); the reduction order of
// dot() is fixed by the compiled code, so results repeat run to run.
namespace hpmoe::kernels {

namespace {
inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return v.to_float(); }
template <class T>
inline T from_f(float v) {
  if constexpr (sizeof(T) == 2) return bf16::from_float(v);
  else return v;
}
}  // namespace

template <class T>
void store(const float* src, T* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = from_f<T>(src[i]);
}

template <class T>
void load(const T* src, float* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

template <class T>
void scale_store(float w, const float* src, T* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = from_f<T>(w * src[i]);
}

template <class T>
void axpy(float w, const T* x, float* acc, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] += w * to_f(x[i]);
}

template <class T>
float dot(const float* a, const T* b, std::int64_t n) {
  // Sixteen partial sums in a fixed order: vectorisable and deterministic.
  float part[16] = {};
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += a[i + l] * to_f(b[i + l]);
  float total = 0;
  for (int l = 0; l < 16; ++l) total += part[l];
  for (; i < n; ++i) total += a[i] * to_f(b[i]);
  return total;
}

namespace {
// exp(x) in plain arithmetic that GCC vectorises (glibc's expf is a call per
// element unless -ffast-math, which hpmoe does not use): x = n ln2 + r with
// |r| <= ln2 / 2 (Cody-Waite, two constants), e^r by a degree-6 Taylor
// polynomial (relative error ~2e-7, about 2 ulp), 2^n through the exponent
// bits. Arguments are clamped to [-87.3, 88.7], where e^x is a normal
// float; the sigmoid below saturates correctly at both ends. Deterministic:
// the same operations in the same order on every call.
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  // Round to nearest by the 1.5 * 2^23 trick (floorf does not vectorise
  // without -ffast-math; |x log2 e| < 2^22 here).
  constexpr float kRound = 12582912.0f;
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
}  // namespace

template <class T>
void swiglu_forward(const float* h, std::int64_t inter, T* a) {
  for (std::int64_t j = 0; j < inter; ++j) {
    const float g = h[j];
    a[j] = from_f<T>(g / (1.0f + exp_approx(-g)) * h[inter + j]);
  }
}

template <class T>
void swiglu_backward(const float* h, const float* da, std::int64_t inter, T* dh) {
  for (std::int64_t j = 0; j < inter; ++j) {
    const float g = h[j], u = h[inter + j];
    const float s = 1.0f / (1.0f + exp_approx(-g));
    dh[j] = from_f<T>(da[j] * u * s * (1.0f + g * (1.0f - s)));
    dh[inter + j] = from_f<T>(da[j] * g * s);
  }
}

#define HPMOE_VECTOR_KERNELS(T)                                                 \
  template void store<T>(const float*, T*, std::int64_t);                       \
  template void load<T>(const T*, float*, std::int64_t);                        \
  template void scale_store<T>(float, const float*, T*, std::int64_t);          \
  template void axpy<T>(float, const T*, float*, std::int64_t);                 \
  template float dot<T>(const float*, const T*, std::int64_t);                  \
  template void swiglu_forward<T>(const float*, std::int64_t, T*);              \
  template void swiglu_backward<T>(const float*, const float*, std::int64_t, T*);
HPMOE_VECTOR_KERNELS(float)
HPMOE_VECTOR_KERNELS(bf16)
#undef HPMOE_VECTOR_KERNELS

}  // namespace hpmoe::kernels
