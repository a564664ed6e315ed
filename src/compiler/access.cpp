#include "compiler/access.hpp"

#include <string>

#include "hpmoe/error.hpp"

namespace hpmoe::taskflow {

namespace {

using B = BufferId;
using K = TaskKind;
using X = Extent;
constexpr Use R = Use::read, W = Use::write, Acc = Use::accumulate;

// Rules read as: buffer, use, side, rows (span, extent), columns (span, extent).
constexpr OperandRule op(B b, Use u, Span rows, X row_extent, Span cols, X col_extent, Side side = Side::own,
                         bool only_with_shared = false) {
  return OperandRule{b, u, side, rows, row_extent, cols, col_extent, only_with_shared, 0};
}
// The common cases: a task's row band of a buffer, all its columns; the
// task's own output rectangle.
constexpr OperandRule band(B b, X width, Use u = R) { return op(b, u, Span::task_rows, X::none, Span::whole, width); }
constexpr OperandRule tile(B b, Side side = Side::own) {
  return op(b, W, Span::task_rows, X::none, Span::task_cols, X::none, side);
}
// A transposed operand filled by a pack task: all of `height` rows, the task's rows as columns.
constexpr OperandRule transposed(B b, X height) { return op(b, W, Span::whole, height, Span::task_rows, X::none); }

struct Entry {
  TaskKind kind;
  KindAccess access;
};

constexpr KindAccess vector_kind(std::initializer_list<OperandRule> ops, std::initializer_list<ByteTerm> traffic,
                                 ExpertHome home = ExpertHome::none) {
  KindAccess a;
  a.queue = QueueClass::vector;
  a.expert_home = home;
  for (const auto& o : ops) a.operands[a.operand_count++] = o;
  for (const auto& t : traffic) a.traffic[a.traffic_terms++] = t;
  return a;
}
constexpr KindAccess put_kind(std::initializer_list<OperandRule> ops, ExpertHome home) {
  KindAccess a = vector_kind(ops, {ByteTerm{X::hidden, 1, 0, X::none}}, home);
  a.put = true;
  return a;
}
constexpr KindAccess gemm_kind(std::initializer_list<OperandRule> ops, X k, ExpertHome home = ExpertHome::none) {
  KindAccess a = vector_kind(ops, {}, home);
  a.queue = QueueClass::matrix;
  a.gemm_k = k;
  return a;
}

constexpr ExpertHome kOwn = ExpertHome::own_rank, kPeer = ExpertHome::peer;
constexpr std::uint8_t kElem = 0;  // the layer's dtype

// What every task kind does. Reads of a pass's inputs (x; in the backward,
// the forward's saved activations and dout) are listed too: the verifier
// checks their bounds and the executor takes their addresses from here.
constexpr Entry kEntries[] = {
    // ---- forward
    {K::dispatch_put,
     put_kind({op(B::send_token, R, Span::source_rows, X::none, Span::whole, X::one),
               op(B::x, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::recv, Side::peer)},
              kPeer)},
    {K::gemm_gate_up, gemm_kind({band(B::recv, X::hidden), tile(B::h1)}, X::hidden, kOwn)},
    {K::swiglu, vector_kind({band(B::h1, X::expert_inter2), tile(B::a)}, {{X::expert_inter2, 1, 4, X::none}, {X::expert_inter, 1, kElem, X::none}}, kOwn)},
    {K::gemm_down, gemm_kind({band(B::a, X::expert_inter), tile(B::y)}, X::expert_inter, kOwn)},
    {K::combine_put,
     put_kind({op(B::y, R, Span::source_rows, X::none, Span::whole, X::hidden), tile(B::comb, Side::peer)}, kOwn)},
    {K::combine_reduce,
     vector_kind({op(B::comb, R, Span::sent_rows, X::none, Span::whole, X::hidden), band(B::slot, X::top_k),
                  band(B::gate, X::top_k), op(B::sh_y, R, Span::task_rows, X::none, Span::whole, X::hidden, Side::own, true),
                  tile(B::out)},
                 {{X::hidden, 1, kElem, X::top_k}, {X::hidden, 1, 4, X::none}})},
    {K::shared_gate_up, gemm_kind({band(B::x, X::hidden), tile(B::sh_h)}, X::hidden)},
    {K::shared_swiglu, vector_kind({band(B::sh_h, X::shared_inter2), tile(B::sh_a)}, {{X::shared_inter, 3, 4, X::none}})},
    {K::shared_down, gemm_kind({band(B::sh_a, X::shared_inter), tile(B::sh_y)}, X::shared_inter)},
    // ---- backward
    {K::gate_grad,
     vector_kind({op(B::comb, R, Span::sent_rows, X::none, Span::whole, X::hidden), band(B::dout, X::hidden),
                  band(B::slot, X::top_k), tile(B::gw)},
                 {{X::hidden, 1, kElem, X::top_k}, {X::hidden, 1, 4, X::top_k}})},
    {K::router_bwd,
     vector_kind({band(B::gw, X::top_k), band(B::logits, X::experts), band(B::xf, X::hidden), tile(B::dlogits),
                  transposed(B::xtf, X::hidden)},
                 {{X::experts, 1, 8, X::none}, {X::hidden, 1, 8, X::none}})},
    {K::router_dgrad, gemm_kind({band(B::dlogits, X::experts), tile(B::rdx)}, X::experts)},
    {K::router_wgrad,
     gemm_kind({band(B::xtf, X::tokens), op(B::dlogits, R, Span::whole, X::tokens, Span::task_cols, X::none), tile(B::dwg)},
               X::tokens)},
    {K::grad_dispatch_put,
     put_kind({op(B::send_assign, R, Span::source_rows, X::none, Span::whole, X::one),
               op(B::gate, R, Span::whole, X::tokens, Span::whole, X::top_k),
               op(B::dout, R, Span::whole, X::tokens, Span::whole, X::hidden), tile(B::dy, Side::peer)},
              kPeer)},
    {K::gemm_down_dgrad, gemm_kind({band(B::dy, X::hidden), tile(B::da)}, X::hidden, kOwn)},
    {K::pack_down_grad,
     vector_kind({band(B::dy, X::hidden), band(B::a, X::expert_inter),
                  op(B::dyp, W, Span::kpad_task_rows, X::none, Span::whole, X::hidden_panels),
                  op(B::at, W, Span::whole, X::expert_inter, Span::kpad_task_rows, X::none)},
                 {{X::hidden, 2, kElem, X::none}, {X::expert_inter, 2, kElem, X::none}}, kOwn)},
    {K::gemm_down_wgrad,
     gemm_kind({op(B::at, R, Span::expert_block, X::inter, Span::expert_kpad, X::none),
                op(B::dyp, R, Span::expert_kpad, X::none, Span::task_cols, X::none), tile(B::dw2)},
               X::expert_kpad, kOwn)},
    {K::swiglu_bwd, vector_kind({band(B::da, X::expert_inter), band(B::h1, X::expert_inter2), tile(B::dh)}, {{X::expert_inter, 1, 16, X::none}}, kOwn)},
    {K::gemm_gate_up_dgrad, gemm_kind({band(B::dh, X::expert_inter2), tile(B::dxe)}, X::expert_inter2, kOwn)},
    {K::pack_gate_up_grad,
     vector_kind({band(B::dh, X::expert_inter2), band(B::recv, X::hidden),
                  op(B::dhp, W, Span::kpad_task_rows, X::none, Span::whole, X::expert_inter2_panels),
                  op(B::xt, W, Span::whole, X::hidden, Span::kpad_task_rows, X::none)},
                 {{X::expert_inter2, 2, kElem, X::none}, {X::hidden, 2, kElem, X::none}}, kOwn)},
    {K::gemm_gate_up_wgrad,
     gemm_kind({op(B::xt, R, Span::expert_block, X::hidden, Span::expert_kpad, X::none),
                op(B::dhp, R, Span::expert_kpad, X::none, Span::task_cols, X::none), tile(B::dw1)},
               X::expert_kpad, kOwn)},
    {K::grad_combine_put,
     put_kind({op(B::dxe, R, Span::source_rows, X::none, Span::whole, X::hidden), tile(B::dcomb, Side::peer)}, kOwn)},
    {K::shared_down_dgrad, gemm_kind({band(B::sh_dout, X::hidden), tile(B::sh_da)}, X::hidden)},
    {K::pack_shared_down_grad,
     vector_kind({band(B::sh_dout, X::hidden), band(B::sh_a, X::shared_inter),
                  op(B::sh_doutp, W, Span::task_rows_padded, X::none, Span::whole, X::hidden_panels),
                  op(B::sh_at, W, Span::whole, X::shared_inter, Span::task_rows_padded, X::none)},
                 {{X::hidden, 4, kElem, X::none}, {X::shared_inter, 2, kElem, X::none}})},
    {K::shared_down_wgrad,
     gemm_kind({op(B::sh_at, R, Span::task_rows, X::none, Span::whole, X::tokens_padded),
                op(B::sh_doutp, R, Span::whole, X::tokens_padded, Span::task_cols, X::none), tile(B::dws2)},
               X::tokens_padded)},
    {K::shared_swiglu_bwd,
     vector_kind({band(B::sh_da, X::shared_inter), band(B::sh_h, X::shared_inter2), tile(B::sh_dh)},
                 {{X::shared_inter, 1, 16, X::none}})},
    {K::shared_gate_up_dgrad, gemm_kind({band(B::sh_dh, X::shared_inter2), tile(B::sdx)}, X::shared_inter2)},
    {K::pack_shared_gate_up_grad,
     vector_kind({band(B::sh_dh, X::shared_inter2), band(B::x, X::hidden),
                  op(B::sh_dhp, W, Span::task_rows_padded, X::none, Span::whole, X::shared_inter2_panels),
                  op(B::sh_xt, W, Span::whole, X::hidden, Span::task_rows_padded, X::none)},
                 {{X::shared_inter2, 2, kElem, X::none}})},
    {K::shared_gate_up_wgrad,
     gemm_kind({op(B::sh_xt, R, Span::task_rows, X::none, Span::whole, X::tokens_padded),
                op(B::sh_dhp, R, Span::whole, X::tokens_padded, Span::task_cols, X::none), tile(B::dws1)},
               X::tokens_padded)},
    {K::grad_reduce,
     vector_kind({op(B::dcomb, R, Span::sent_rows, X::none, Span::whole, X::hidden), band(B::slot, X::top_k),
                  band(B::rdx, X::hidden), op(B::sdx, R, Span::task_rows, X::none, Span::whole, X::hidden, Side::own, true),
                  tile(B::dx)},
                 {{X::hidden, 1, kElem, X::top_k}, {X::hidden, 3, 4, X::none}})},
    // ---- tensor-parallel splits: part 0's rows += the other parts' rows, in part order
    {K::part_reduce,
     vector_kind({op(B::comb, R, Span::reduction_parts, X::none, Span::whole, X::hidden),
                  op(B::comb, Acc, Span::task_rows, X::none, Span::whole, X::hidden)},
                 {{X::hidden, 3, kElem, X::none}})},
    {K::grad_part_reduce,
     vector_kind({op(B::dcomb, R, Span::reduction_parts, X::none, Span::whole, X::hidden),
                  op(B::dcomb, Acc, Span::task_rows, X::none, Span::whole, X::hidden)},
                 {{X::hidden, 3, kElem, X::none}})},
};
static_assert(std::size(kEntries) == static_cast<std::size_t>(TaskKind::count), "every task kind needs an entry");

AccessTable make_standard() {
  AccessTable t;
  for (const auto& e : kEntries) t.edit(e.kind) = e.access;
  return t;
}

}  // namespace


const AccessTable& AccessTable::standard() {
  static const AccessTable table = make_standard();
  return table;
}

Rect AccessTable::operand(const Program& p, const Task& t, BufferId buffer, Use use) const {
  for (const Operand& o : operands(p, t))
    if (o.rect.buffer == buffer && (o.use == use || o.use == Use::accumulate)) return o.rect;
  throw Error(std::string("the access table gives a ") + name(t.kind) + " task no " +
              (use == Use::read ? "read of " : "write of ") + name(buffer));
}


}  // namespace hpmoe::taskflow
