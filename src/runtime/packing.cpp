// The packing of a layer's weights for the tile kernels (bf16 VNNI, panel
// blocked, the transposes backward needs), shared by every engine of the
// same weights, and its repacking in place when the weights change.
#include <algorithm>
#include <type_traits>

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

namespace {

// An operand packed again in place (its pages kept when the size is
// unchanged) from a stacked source, as repack_operand does from a matrix.
template <class T, class S>
void repack_operand_from(Operand<T>& op, const kernels::StackedRows<S>& src, std::int64_t k, std::int64_t n,
                         bool transposed) {
  const auto size = static_cast<std::size_t>(kernels::panel_blocked_size<T>(k, n));
  if (op.storage.size() != size) op.storage.resize(size);
  kernels::pack_rhs_panels<S, T>(src, k, n, transposed, op.storage.data(), 0, panels(n));
  op.view_ = kernels::panel_view<T>(op.storage.data(), k);
}

// Part `part` of expert e (as pack_expert_part numbers them) from its
// Hugging Face projections: W1 = [gate_proj; up_proj]^T ([H, 2I]) and
// W2 = down_proj^T ([I, H]), so the forward's operands are transposed reads
// of the projections and the backward's (W1^T, W2^T) plain ones.
template <class T, class Mlp>
void pack_expert_part_from_hf(PackedLayer<T>& p, const LayerConfig& c, std::size_t e, const Mlp& m, std::size_t part) {
  using S = std::remove_cv_t<std::remove_pointer_t<decltype(m.gate_proj.data)>>;  // float or bf16
  const std::int64_t H = c.hidden, I = c.expert_inter;
  const kernels::StackedRows<S> gate_up{m.gate_proj.data, m.gate_proj.ld, I, m.up_proj.data, m.up_proj.ld};
  const kernels::StackedRows<S> down{m.down_proj.data, m.down_proj.ld, H, nullptr, 0};
  switch (part) {
    case 0: repack_operand_from<T>(p.w1[e], gate_up, H, 2 * I, true); break;
    case 1: repack_operand_from<T>(p.w2[e], down, I, H, true); break;
    case 2: repack_operand_from<T>(p.w1_t[e], gate_up, 2 * I, H, false); break;
    default: repack_operand_from<T>(p.w2_t[e], down, H, I, false); break;
  }
}

template <class T, class Mlp>
void repack_from_hf(PackedLayer<T>& p, const LayerConfig& c, bool backward, std::span<const std::int32_t> experts,
                    std::span<const Mlp> views) {
  const std::size_t parts = backward ? 4 : 2;
  on_all_cores(experts.size() * parts, [&](std::size_t j) {
    const std::size_t i = j / parts;
    pack_expert_part_from_hf(p, c, static_cast<std::size_t>(experts[i]), views[i], j % parts);
  });
}

template <class T>
void unpack_into(const PackedLayer<T>& p, const LayerConfig& c, std::span<const std::int32_t> experts, LayerWeights& w) {
  const std::int64_t H = c.hidden, I = c.expert_inter;
  on_all_cores(experts.size(), [&](std::size_t i) {
    const auto e = static_cast<std::size_t>(experts[i]);
    Matrix& w1 = w.w1[e];
    Matrix& w2 = w.w2[e];
    if (w1.rows != H || w1.cols != 2 * I) w1 = Matrix(H, 2 * I);
    if (w2.rows != I || w2.cols != H) w2 = Matrix(I, H);
    kernels::unpack_rhs_panels<T>(p.w1[e].storage.data(), H, 2 * I, w1.data.data(), 2 * I);
    kernels::unpack_rhs_panels<T>(p.w2[e].storage.data(), I, H, w2.data.data(), H);
  });
}

}  // namespace

namespace {
template <class Mlp>
void repack_experts_from(const PackedWeights& packed, const LayerConfig& c, std::span<const std::int32_t> experts,
                         std::span<const Mlp> views) {
  if (packed.dtype != c.dtype) throw Error("repack: the packing is " + to_string(packed.dtype) + ", the layer " + to_string(c.dtype));
  if (views.size() != experts.size())
    throw Error("repack_experts_from_hf: " + std::to_string(experts.size()) + " experts but " +
                std::to_string(views.size()) + " sets of projections");
  for (std::size_t i = 0; i < experts.size(); ++i) {
    const std::int32_t e = experts[i];
    if (e < 0 || e >= c.routed_experts || !holds_expert(*packed.weights, e))
      throw Error("expert " + std::to_string(e) + " is not one this layer holds and packs");
    check_hf_expert(c, e, views[i]);
  }
  if constexpr (std::is_same_v<Mlp, HfMlp>)
    if (c.dtype == DType::fp32) return repack_from_hf<float, Mlp>(*packed.fp32, c, packed.backward, experts, views);
  if (c.dtype != DType::bf16)
    throw Error("bfloat16 projections are packed as they are by a bf16 layer; this layer is " + to_string(c.dtype) +
                ": give float projections (HfMlp)");
  repack_from_hf<bf16, Mlp>(*packed.bf16_, c, packed.backward, experts, views);
}
}  // namespace

void repack_experts_from_hf(const PackedWeights& packed, const LayerConfig& c, std::span<const std::int32_t> experts,
                            std::span<const HfMlp> views) {
  repack_experts_from<HfMlp>(packed, c, experts, views);
}
void repack_experts_from_hf(const PackedWeights& packed, const LayerConfig& c, std::span<const std::int32_t> experts,
                            std::span<const HfMlpBf16> views) {
  repack_experts_from<HfMlpBf16>(packed, c, experts, views);
}

void unpack_experts(const PackedWeights& packed, const LayerConfig& c, std::span<const std::int32_t> experts,
                    LayerWeights& w) {
  if (c.dtype == DType::fp32) unpack_into<float>(*packed.fp32, c, experts, w);
  else unpack_into<bf16>(*packed.bf16_, c, experts, w);
}

}  // namespace hpmoe
