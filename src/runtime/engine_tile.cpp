// The engine's side of the op ABI (ops/op.hpp): one task's body runs through
// the op table, and asks the engine for addresses, strides, packed weights
// and puts through this host.
#include "ops/op.hpp"
#include "runtime/engine.hpp"

namespace hpmoe::detail {

template <class T>
class Interleaved<T>::TileHost final : public ops::TileHost<T> {
 public:
  TileHost(Interleaved& e, int r, const taskflow::Program& p, const Task& t, std::size_t slot)
      : e_(e), r_(r), p_(p), t_(t), slot_(slot) {}

  std::byte* address(const taskflow::Rect& rect) const override {
    switch (e_.layout_of(p_, rect.buffer)->elem_bytes) {  // the element size steps the offsets
      case 1: return e_.template at<std::byte>(r_, p_, rect);
      case 2: return reinterpret_cast<std::byte*>(e_.template at<bf16>(r_, p_, rect));
      case 8: return reinterpret_cast<std::byte*>(e_.template at<std::int64_t>(r_, p_, rect));
      default: return reinterpret_cast<std::byte*>(e_.template at<float>(r_, p_, rect));
    }
  }
  std::byte* base(BufferId id) const override { return e_.template base<std::byte>(r_, id); }
  std::int64_t ld(BufferId id) const override { return e_.ld_of(r_, id); }
  taskflow::TransposedStore transposed(const taskflow::Rect& rect) const override { return e_.transposed(r_, rect); }
  const taskflow::BufferLayout& layout(BufferId id) const override { return *e_.layout_of(p_, id); }
  T* put_target(const taskflow::Rect& rect) override { return e_.put_target(t_, rect, slot_); }
  bool send_put(const taskflow::Rect& rect) override { return e_.send_put(t_, rect, slot_); }
  RhsView<T> weight(ops::Weight w, std::int32_t expert) const override {
    switch (w) {
      case ops::Weight::w1: return e_.w1_of(r_, expert);
      case ops::Weight::w2: return e_.w2_of(r_, expert);
      case ops::Weight::w1_t: return e_.w1_t_of(r_, expert);
      case ops::Weight::w2_t: return e_.w2_t_of(r_, expert);
      case ops::Weight::shared_w1: return e_.packed_->sw1.view();
      case ops::Weight::shared_w2: return e_.packed_->sw2.view();
      case ops::Weight::shared_w1_t: return e_.packed_->sw1_t.view();
      case ops::Weight::shared_w2_t: return e_.packed_->sw2_t.view();
    }
    throw Error("a task asks for a weight the layer does not pack");
  }
  std::span<const std::byte> packed_weight(ops::Weight w, std::int32_t expert) const override {
    const PackedLayer<T>& pk = *e_.packed_;
    const std::vector<Operand<T>>* of = w == ops::Weight::w1 ? &pk.w1 : w == ops::Weight::w2 ? &pk.w2
                                        : w == ops::Weight::w1_t ? &pk.w1_t : w == ops::Weight::w2_t ? &pk.w2_t : nullptr;
    if (!of || expert < 0 || static_cast<std::size_t>(expert) >= of->size() || (*of)[static_cast<std::size_t>(expert)].storage.empty())
      throw Error("rank " + std::to_string(r_) + " lends expert " + std::to_string(expert) +
                  "'s weights, which this process does not hold packed (its owner lends them)");
    const auto& storage = (*of)[static_cast<std::size_t>(expert)].storage;
    return std::as_bytes(std::span<const T>(storage.data(), storage.size()));
  }
  RhsView<float> router_transposed() const override { return e_.packed_->router_t.view(); }
  const LayerConfig& hosted_layer() const override { return e_.lc_; }
  const RouterOutput<float>& routing() const override { return e_.res_->routing; }
  std::int64_t first_token() const override {
    return std::int64_t{e_.index_of_[static_cast<std::size_t>(r_)]} * p_.dims.tokens;
  }

 private:
  Interleaved& e_;
  int r_;
  const taskflow::Program& p_;
  const Task& t_;
  std::size_t slot_;
};

template <class T>
bool Interleaved<T>::execute(int r, std::size_t slot, const Task& t) {
  const taskflow::Program& p = (*current_)[r];
  const taskflow::Operands o = operands_of(p, t);
  TileHost host(*this, r, p, t, slot);
  return ops::op(t.kind).template body<T>()(ops::Tile<T>{t, p, o, host});
}

template bool Interleaved<float>::execute(int r, std::size_t slot, const Task& t);
template bool Interleaved<bf16>::execute(int r, std::size_t slot, const Task& t);

}  // namespace hpmoe::detail
