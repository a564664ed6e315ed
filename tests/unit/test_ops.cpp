// The op table: every task kind is one entry of one family, with a name, a
// place in the serialized operator order and a body per dtype; and a body
// runs on nothing but its Tile (a host over plain memory here, no engine).
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "compiler/taskflow.hpp"
#include "ops/op.hpp"

namespace hpmoe {
namespace {

using taskflow::BufferId;
using taskflow::TaskKind;

TEST(OpTable, EveryKindIsOneEntryOfOneFamilyWithABodyPerDtype) {
  std::set<TaskKind> seen;
  std::set<std::string> names;
  for (const auto& family : ops::families())
    for (const auto& k : family.kinds) {
      EXPECT_TRUE(seen.insert(k.kind).second) << k.name << " is listed twice";
      EXPECT_TRUE(names.insert(k.name).second) << k.name;
      EXPECT_EQ(&ops::op(k.kind), &k);
      EXPECT_STREQ(taskflow::name(k.kind), k.name);
      EXPECT_NE(k.body_f32, nullptr);
      EXPECT_NE(k.body_bf16, nullptr);
      EXPECT_EQ(taskflow::AccessTable::standard()[k.kind].operand_count, k.access.operand_count);
    }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(TaskKind::count));
}

// The serialized baseline runs operators in the order a framework does; the
// families' order numbers must give exactly that sequence.
TEST(OpTable, SerializedOperatorOrderIsTheFrameworkOrder) {
  auto spelled = [](taskflow::Pass pass) {
    std::vector<std::string> out;
    for (const auto k : taskflow::operator_order(pass)) out.push_back(taskflow::name(k));
    return out;
  };
  EXPECT_EQ(spelled(taskflow::Pass::forward),
            (std::vector<std::string>{"weight_put", "dispatch_node_put", "dispatch_node_route_put", "dispatch_node_relay", "dispatch_forward", "dispatch_put", "dispatch_cast_put", "dispatch_decode", "dispatch_token_put", "dispatch_route_put", "combine_route_put", "dispatch_relay", "dispatch_gather", "weight_relay", "gemm_gate_up", "swiglu", "gemm_down", "shared_gate_up",
                                      "shared_swiglu", "shared_down", "combine_put", "combine_relay", "combine_rank_put", "combine_node_part_put", "combine_node_relay", "combine_node_put", "part_reduce", "combine_reduce", "combine_rank_reduce"}));
  EXPECT_EQ(spelled(taskflow::Pass::backward),
            (std::vector<std::string>{"grad_weight_put", "grad_dispatch_node_put", "grad_dispatch_node_relay", "grad_dispatch_forward", "grad_dispatch_token_put", "grad_dispatch_relay", "grad_dispatch_gather", "gate_grad_put", "gate_grad_gather", "gate_grad", "router_bwd", "router_dgrad", "router_wgrad", "grad_dispatch_put", "grad_dispatch_cast_put", "grad_dispatch_decode",
                                      "grad_weight_relay", "gemm_down_dgrad", "pack_down_grad", "gemm_down_wgrad", "swiglu_bwd",
                                      "gemm_gate_up_dgrad", "pack_gate_up_grad", "gemm_gate_up_wgrad", "shared_down_dgrad",
                                      "pack_shared_down_grad", "shared_down_wgrad", "shared_swiglu_bwd",
                                      "shared_gate_up_dgrad", "pack_shared_gate_up_grad", "shared_gate_up_wgrad",
                                      "grad_combine_put", "grad_combine_relay", "grad_combine_rank_put", "grad_combine_node_part_put", "grad_combine_node_relay", "grad_combine_node_put", "grad_part_reduce", "grad_reduce", "grad_rank_reduce"}));
}

// A host over plain row-major fp32 buffers: what a body needs, and nothing
// of the engine.
class PlainHost final : public ops::TileHost<float> {
 public:
  PlainHost(const taskflow::Program& p, std::vector<std::vector<float>>& memory) : p_(p), memory_(memory) {}
  std::byte* address(const taskflow::Rect& r) const override {
    return reinterpret_cast<std::byte*>(data(r.buffer) + r.r0 * ld(r.buffer) + r.c0);
  }
  std::byte* base(BufferId b) const override { return reinterpret_cast<std::byte*>(data(b)); }
  std::int64_t ld(BufferId b) const override { return layout(b).cols; }
  taskflow::TransposedStore transposed(const taskflow::Rect&) const override { return {}; }
  const taskflow::BufferLayout& layout(BufferId b) const override { return *p_.buffer(b); }
  float* put_target(const taskflow::Rect&) override { throw Error("no peers here"); }
  bool send_put(const taskflow::Rect&) override { throw Error("no peers here"); }
  kernels::RhsView<float> weight(ops::Weight, std::int32_t) const override { throw Error("no weights here"); }
  std::span<const std::byte> packed_weight(ops::Weight, std::int32_t) const override { throw Error("no weights here"); }
  kernels::RhsView<float> router_transposed() const override { throw Error("no router here"); }
  const LayerConfig& hosted_layer() const override { throw Error("no layer here"); }
  const RouterOutput<float>& routing() const override { throw Error("no routing here"); }
  std::int64_t first_token() const override { return 0; }

 private:
  float* data(BufferId b) const {
    for (std::size_t i = 0; i < p_.buffers.size(); ++i)
      if (p_.buffers[i].id == b) return memory_[i].data();
    throw Error(std::string("undeclared buffer ") + taskflow::name(b));
  }
  const taskflow::Program& p_;
  std::vector<std::vector<float>>& memory_;
};

// The shared experts' SwiGLU through the one SwiGLU body: rows of SH_H
// [tokens, 2 Is] into SH_A [tokens, Is], strides from the declared buffers.
TEST(OpBodies, SharedSwigluRunsOnItsTileAlone) {
  const std::int64_t tokens = 5, Is = 7;
  taskflow::Program p;
  p.dims = taskflow::Dims{16, 8, Is, 4, 2, tokens, 4};
  p.buffers = {{BufferId::sh_h, tokens, 2 * Is, 4, 0}, {BufferId::sh_a, tokens, Is, 4, 0}};
  std::vector<std::vector<float>> memory{std::vector<float>(tokens * 2 * Is), std::vector<float>(tokens * Is, -1.0f)};
  for (std::size_t i = 0; i < memory[0].size(); ++i) memory[0][i] = std::sin(0.37f * float(i));
  taskflow::Task t{};
  t.kind = TaskKind::shared_swiglu;
  t.expert = -1;
  t.row_begin = 1;
  t.rows = 3;
  t.cols = static_cast<std::int32_t>(Is);
  const taskflow::Operands operands = taskflow::AccessTable::standard().operands(p, t);
  PlainHost host(p, memory);
  EXPECT_FALSE(ops::op(t.kind).body<float>()(ops::Tile<float>{t, p, operands, host}));
  for (std::int64_t row = 0; row < tokens; ++row) {
    std::vector<float> want(Is, -1.0f);
    if (row >= 1 && row < 4) kernels::swiglu_forward<float>(memory[0].data() + row * 2 * Is, Is, want.data());
    for (std::int64_t c = 0; c < Is; ++c) EXPECT_EQ(memory[1][row * Is + c], want[c]) << row << ", " << c;
  }
}

}  // namespace
}  // namespace hpmoe
