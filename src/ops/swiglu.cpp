// SwiGLU between the two GEMMs: A = silu(gate) * up from H1 = [gate | up]
// (fp32), and its backward DH = [dgate | dup] from H1 and DA. Routed
// experts' rows and the shared experts' token rows alike: the width is the
// task's (a split expert's part computes its own columns), the strides the
// buffers'.
#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

template <class T>
bool swiglu(const Tile<T>& tile) {
  const Rect& h_rect = tile.read(0);
  const Rect& a_rect = tile.write(0);
  const std::int64_t inter = tile.task.cols, ldh = tile.ld(h_rect.buffer), lda = tile.ld(a_rect.buffer);
  tile.need(h_rect, tile.rows(), 2 * inter);
  const float* h = tile.template at<float>(h_rect);
  T* a = tile.template at<T>(a_rect);
  for (std::int64_t row = 0; row < tile.rows(); ++row) kernels::swiglu_forward<T>(h + row * ldh, inter, a + row * lda);
  return false;
}

template <class T>
bool swiglu_backward(const Tile<T>& tile) {
  const Rect& da_rect = tile.read(0);
  const Rect& h_rect = tile.read(1);
  const Rect& dh_rect = tile.write(0);
  const std::int64_t inter = tile.task.cols / 2;
  const std::int64_t ldh = tile.ld(h_rect.buffer), ldda = tile.ld(da_rect.buffer), lddh = tile.ld(dh_rect.buffer);
  tile.need(da_rect, tile.rows(), inter);
  const float* h = tile.template at<float>(h_rect);
  const float* da = tile.template at<float>(da_rect);
  T* dh = tile.template at<T>(dh_rect);
  for (std::int64_t row = 0; row < tile.rows(); ++row)
    kernels::swiglu_backward<T>(h + row * ldh, da + row * ldda, inter, dh + row * lddh);
  return false;
}

constexpr OpKind kKinds[] = {
    {TaskKind::swiglu, "swiglu", Pass::forward, 20,
     vector_kind({band(B::h1, X::expert_inter2), tile(B::a)},
                 {{X::expert_inter2, 1, 4, X::none}, {X::expert_inter, 1, kElem, X::none}}, kOwn),
     swiglu<float>, swiglu<bf16>,
     KindRole{.step = TileStep::vector_step}},
    {TaskKind::shared_swiglu, "shared_swiglu", Pass::forward, 50,
     vector_kind({band(B::sh_h, X::shared_inter2), tile(B::sh_a)}, {{X::shared_inter, 3, 4, X::none}}),
     swiglu<float>, swiglu<bf16>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::vector_step}},
    {TaskKind::swiglu_bwd, "swiglu_bwd", Pass::backward, 80,
     vector_kind({band(B::da, X::expert_inter), band(B::h1, X::expert_inter2), tile(B::dh)},
                 {{X::expert_inter, 1, 16, X::none}}, kOwn),
     swiglu_backward<float>, swiglu_backward<bf16>,
     KindRole{.step = TileStep::vector_step}},
    {TaskKind::shared_swiglu_bwd, "shared_swiglu_bwd", Pass::backward, 150,
     vector_kind({band(B::sh_da, X::shared_inter), band(B::sh_h, X::shared_inter2), tile(B::sh_dh)},
                 {{X::shared_inter, 1, 16, X::none}}),
     swiglu_backward<float>, swiglu_backward<bf16>,
     KindRole{.scheme = Scheme::shared, .step = TileStep::vector_step}},
};
}  // namespace

Family swiglu_family() { return {"swiglu", kKinds}; }

}  // namespace hpmoe::ops
