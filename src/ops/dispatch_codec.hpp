#pragma once
// A dispatched row as it travels where the dispatch is narrower than the
// layer's dtype (Dims::dispatch_format): fp8 e4m3 codes with one fp32 scale
// per 128 channels, or bf16. The per-assignment exchange (exchange.cpp) and
// the per-rank one (token_exchange.cpp) encode and decode alike, so that
// their rows agree bit for bit.
#include <cstdint>

#include "common/fp8.hpp"
#include "hpmoe/bf16.hpp"
#include "ir/ir.hpp"
#include "kernels/kernels.hpp"

namespace hpmoe::ops {

inline void encode_row(const taskflow::Dims& d, const float* x, std::uint8_t* out) {
  if (d.dispatch_format == 1) fp8_encode_row(x, d.hidden, out);
  else kernels::store<bf16>(x, reinterpret_cast<bf16*>(out), d.hidden);  // rows of 2 H bytes: bf16-aligned
}
inline void decode_row(const taskflow::Dims& d, const std::uint8_t* in, float* x) {
  if (d.dispatch_format == 1) fp8_decode_row(in, d.hidden, x);
  else kernels::load<bf16>(reinterpret_cast<const bf16*>(in), x, d.hidden);
}

}  // namespace hpmoe::ops
