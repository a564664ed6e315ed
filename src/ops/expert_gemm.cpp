// The experts' GEMM tiles against packed weights: gate/up and down, forward
// and their data gradients, for the routed experts (rows in the receive
// order, the slot's weights) and the shared experts (the rank's token rows,
// the shared weights). One body: out = rows x weight, the weight a template
// argument of the kind.
#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

// The weight a routed expert's GEMM reads: the packed weights the rank
// holds, or, for an expert lent to it this step, their copy in its LENT_W
// block (which the kind's access rule declares, so the task waits for the
// weight puts that fill it).
template <class T, Weight w>
RhsView<T> routed_weight(const Tile<T>& tile) {
  if (tile.program.lent_block_of(tile.task.expert) < 0) return tile.host.weight(w, tile.task.expert);
  const taskflow::Dims& d = tile.dims();
  const bool second = w == Weight::w2 || w == Weight::w1_t;  // the block's second region
  const std::int64_t k = w == Weight::w1 ? d.hidden : w == Weight::w2 ? d.inter : w == Weight::w2_t ? d.hidden : 2 * d.inter;
  const Rect& block = tile.in(BufferId::lent_w);
  const std::byte* at = tile.template at<std::byte>(block) + (second ? taskflow::lent_second_region(d, tile.program.pass) : 0);
  return kernels::panel_view<T>(reinterpret_cast<const T*>(at), k);
}

// out[rows, cols] = A[rows] weight; stored in the layer's dtype when the
// next operand reads it so (the down projection's Y, the gate/up's DXE).
template <class T, Weight w, bool store_in_dtype>
bool weight_gemm(const Tile<T>& tile) {
  constexpr bool routed = w == Weight::w1 || w == Weight::w2 || w == Weight::w1_t || w == Weight::w2_t;
  if constexpr (routed) tile.gemm(tile.read(0), routed_weight<T, w>(tile), tile.write(0), store_in_dtype);
  else tile.gemm(tile.read(0), tile.host.weight(w, tile.task.expert), tile.write(0), store_in_dtype);
  return false;
}

constexpr OpKind kKinds[] = {
    // forward
    {TaskKind::gemm_gate_up, "gemm_gate_up", Pass::forward, 10,
     gemm_kind({band(B::recv, X::hidden), tile(B::h1), lent_weights()}, X::hidden, kOwn),
     weight_gemm<float, Weight::w1, false>, weight_gemm<bf16, Weight::w1, false>,
     KindRole{.step = TileStep::first_gemm}},
    {TaskKind::gemm_down, "gemm_down", Pass::forward, 30,
     gemm_kind({band(B::a, X::expert_inter), tile(B::y), lent_weights()}, X::expert_inter, kOwn),
     weight_gemm<float, Weight::w2, true>, weight_gemm<bf16, Weight::w2, true>,
     KindRole{.step = TileStep::second_gemm}},
    {TaskKind::shared_gate_up, "shared_gate_up", Pass::forward, 40,
     gemm_kind({band(B::x, X::hidden), tile(B::sh_h)}, X::hidden),
     weight_gemm<float, Weight::shared_w1, false>, weight_gemm<bf16, Weight::shared_w1, false>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::first_gemm}},
    {TaskKind::shared_down, "shared_down", Pass::forward, 60,
     gemm_kind({band(B::sh_a, X::shared_inter), tile(B::sh_y)}, X::shared_inter),
     weight_gemm<float, Weight::shared_w2, false>, weight_gemm<bf16, Weight::shared_w2, false>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::second_gemm}},
    // backward: data gradients against the transposed weights
    {TaskKind::gemm_down_dgrad, "gemm_down_dgrad", Pass::backward, 50,
     gemm_kind({band(B::dy, X::hidden), tile(B::da), lent_weights()}, X::hidden, kOwn),
     weight_gemm<float, Weight::w2_t, false>, weight_gemm<bf16, Weight::w2_t, false>,
     KindRole{.step = TileStep::first_gemm}},
    {TaskKind::gemm_gate_up_dgrad, "gemm_gate_up_dgrad", Pass::backward, 90,
     gemm_kind({band(B::dh, X::expert_inter2), tile(B::dxe), lent_weights()}, X::expert_inter2, kOwn),
     weight_gemm<float, Weight::w1_t, true>, weight_gemm<bf16, Weight::w1_t, true>,
     KindRole{.step = TileStep::second_gemm}},
    {TaskKind::shared_down_dgrad, "shared_down_dgrad", Pass::backward, 120,
     gemm_kind({band(B::sh_dout, X::hidden), tile(B::sh_da)}, X::hidden),
     weight_gemm<float, Weight::shared_w2_t, false>, weight_gemm<bf16, Weight::shared_w2_t, false>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::first_gemm}},
    {TaskKind::shared_gate_up_dgrad, "shared_gate_up_dgrad", Pass::backward, 160,
     gemm_kind({band(B::sh_dh, X::shared_inter2), tile(B::sdx)}, X::shared_inter2),
     weight_gemm<float, Weight::shared_w1_t, false>, weight_gemm<bf16, Weight::shared_w1_t, false>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::second_gemm}},
};
}  // namespace

Family expert_gemm_family() { return {"expert_gemm", kKinds}; }

}  // namespace hpmoe::ops
