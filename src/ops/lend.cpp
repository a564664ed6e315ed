// Weights instead of tokens (LayerConfig::lend_weights, seed 003's
// MoE-Prefill): where a rank's own rows for a remote expert outweigh the
// expert's weights, the owner lends the weights for the step. Its weight
// puts copy the packed weights, piece by piece, into the lent rank's LENT_W
// block and count towards the block's event; there a relay per row tile
// counts the completed block as one more arrival of the tile, so the
// expert's first GEMM of each tile waits for its rows and its weights alike.
// The forward lends W1 and W2, the backward their transposes (the data
// gradients' operands): each pass's program declares the puts it needs.
#include <algorithm>

#include "ops/op.hpp"

namespace hpmoe::ops {
namespace {
using namespace rules;

// One piece of the block [col_begin, col_begin + cols): the part of each of
// the pass's two weights it covers, copied from the owner's packing; the
// rest of a region (the layout's padding) is zero.
template <class T>
bool lend(const Tile<T>& tile) {
  const taskflow::Dims& d = tile.dims();
  const Pass pass = tile.program.pass;
  const Rect& dst = tile.write(0);
  const std::int64_t split = taskflow::lent_second_region(d, pass), end = taskflow::lent_block_bytes(d, pass);
  const std::int64_t c0 = tile.task.col_begin, c1 = c0 + tile.task.cols;
  if (c0 < 0 || c1 > end || tile.task.rows != 1)
    throw Error(std::string("bounds: a ") + taskflow::name(tile.task.kind) + " task puts bytes [" + std::to_string(c0) + ", " +
                std::to_string(c1) + ") of a lent block of " + std::to_string(end) + " bytes (one row)");
  tile.need(dst, 1, c1 - c0);
  auto* to = reinterpret_cast<std::byte*>(tile.host.put_target(dst));
  const Weight first = pass == Pass::forward ? Weight::w1 : Weight::w2_t;
  const Weight second = pass == Pass::forward ? Weight::w2 : Weight::w1_t;
  for (const auto& [w, begin, stop] : {std::tuple{first, std::int64_t{0}, split}, std::tuple{second, split, end}}) {
    const std::int64_t a = std::max(c0, begin), b = std::min(c1, stop);
    if (a >= b) continue;
    const std::span<const std::byte> packed = tile.host.packed_weight(w, tile.task.expert);
    if (static_cast<std::int64_t>(packed.size()) > stop - begin)
      throw Error("a lent block's region of " + std::to_string(stop - begin) + " bytes cannot hold expert " +
                  std::to_string(tile.task.expert) + "'s packed weight of " + std::to_string(packed.size()) + " bytes");
    const std::int64_t from = a - begin, have = std::clamp<std::int64_t>(static_cast<std::int64_t>(packed.size()) - from, 0, b - a);
    if (have > 0) std::memcpy(to + (a - c0), packed.data() + from, static_cast<std::size_t>(have));
    if (have < b - a) std::memset(to + (a - c0) + have, 0, static_cast<std::size_t>(b - a - have));
  }
  return tile.host.send_put(dst);
}

constexpr KindAccess weight_put_kind() {
  return as_put(vector_kind({tile(B::lent_w, Side::peer)}, {ByteTerm{X::task_cols, 1, 1, X::none}}, kOwn));
}

constexpr OpKind kKinds[] = {
    // The weights go first: they are the largest puts of the step, and the
    // lent tiles' GEMMs wait for them.
    {TaskKind::weight_put, "weight_put", Pass::forward, -10, weight_put_kind(), lend<float>, lend<bf16>,
     KindRole{.scheme = Scheme::lend, .consumer = K::weight_relay, .level = 0}},
    {TaskKind::weight_relay, "weight_relay", Pass::forward, 8, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::lend}},
    {TaskKind::grad_weight_put, "grad_weight_put", Pass::backward, -12, weight_put_kind(), lend<float>, lend<bf16>,
     KindRole{.scheme = Scheme::lend, .consumer = K::grad_weight_relay, .level = 0}},
    {TaskKind::grad_weight_relay, "grad_weight_relay", Pass::backward, 45, vector_kind({}, {}), relay<float>, relay<bf16>,
     KindRole{.scheme = Scheme::lend}},
};
}  // namespace

Family lend_family() { return {"lend", kKinds}; }

}  // namespace hpmoe::ops
