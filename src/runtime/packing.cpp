// The packing of a layer's weights for the tile kernels (bf16 VNNI, panel
// blocked, the transposes backward needs), shared by every engine of the
// same weights, and its repacking in place when the weights change.
#include <algorithm>

#include "runtime/executor_parts.hpp"
#include "hpmoe/error.hpp"
#include "kernels/kernels.hpp"
#include "runtime/interleaved.hpp"

namespace hpmoe {

using namespace detail;

std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig& c, const LayerWeights& w, bool backward) {
  c.validate();
  check_weight_shapes(c, w);
  kernels::init();
  auto p = std::make_shared<PackedWeights>();
  p->weights = &w;
  p->dtype = c.dtype;
  p->backward = backward;
  if (c.dtype == DType::fp32) p->fp32 = pack_layer<float>(c, w, backward);
  else p->bf16_ = pack_layer<bf16>(c, w, backward);
  return p;
}

std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig& c, LayerWeights& w, bool backward,
                                                  std::span<const std::int32_t> experts, const ExpertSource& fetch) {
  c.validate();
  check_weight_shapes(c, w);
  if (!fetch) throw Error("pack_weights: no source of the experts' weights");
  kernels::init();
  auto p = std::make_shared<PackedWeights>();
  p->weights = &w;
  p->dtype = c.dtype;
  p->backward = backward;
  if (c.dtype == DType::fp32) p->fp32 = pack_layer<float>(c, w, backward, experts, fetch);
  else p->bf16_ = pack_layer<bf16>(c, w, backward, experts, fetch);
  return p;
}

void repack_weights(const PackedWeights& packed, const LayerConfig& c, std::span<const std::int32_t> experts,
                    bool all_experts, bool replicated) {
  if (packed.dtype != c.dtype) throw Error("repack: the packing is " + to_string(packed.dtype) + ", the layer " + to_string(c.dtype));
  check_weight_shapes(c, *packed.weights);
  if (c.dtype == DType::fp32) repack_layer<float>(*packed.fp32, c, *packed.weights, packed.backward, experts, all_experts, replicated);
  else repack_layer<bf16>(*packed.bf16_, c, *packed.weights, packed.backward, experts, all_experts, replicated);
}

}  // namespace hpmoe
