#pragma once
// The op ABI, after Mirage's runtime_header.h: what one task kind is, and
// what its CPU tile body may ask of the engine that runs it.
//
// A kind is one `OpKind` entry: its name, the pass and place in the
// serialized operator order, its access rule and cost (`KindAccess`: the
// rectangles it reads and writes, the FLOPs or bytes it moves), its body
// for each dtype, and its role (`KindRole`: the scheme that emits it, what a
// put feeds at its peer and at which proof level, its place in the
// schedule, the framework operator it stands for). Kinds come in families,
// one source file each in this folder (exchange, token_exchange,
// rank_combine, lend, expert_gemm, weight_grad, swiglu, pack, combine,
// router, reduction); `table.cpp` lists the families and builds the one op
// table that the verifier, generator, engine, scheduler and simulator read:
// none of them names a kind to decide what to do with it.
//
// A body sees one `Tile`: its task, its program, the operands the access
// rule resolved (in the rule's order), and the engine behind `TileHost`:
// addresses, leading dimensions, the layer's packed weights, puts to peers.
// Bodies take every extent from the program's dims, never from a config.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>

#include "hpmoe/bf16.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/routing.hpp"
#include "kernels/kernels.hpp"
#include "ops/access.hpp"
#include "ops/kind_role.hpp"

namespace hpmoe::ops {

using kernels::copy_elements;
using kernels::RhsView;
using taskflow::BufferId;
using taskflow::KindAccess;
using taskflow::Pass;
using taskflow::Program;
using taskflow::Rect;
using taskflow::Task;
using taskflow::TaskKind;

// The packed weights a GEMM tile's right-hand operand can be: a routed
// expert's (its slot's part for a split expert), transposed for the
// backward's data gradients, or the shared experts'.
enum class Weight : std::uint8_t { w1, w2, w1_t, w2_t, shared_w1, shared_w2, shared_w1_t, shared_w2_t };

// What the engine running a task offers its body. One per (rank, worker,
// task); addresses are the running rank's.
template <class T>
class TileHost {
 public:
  // Element (r0, c0) of a rectangle of the rank's own buffer.
  virtual std::byte* address(const Rect&) const = 0;
  virtual std::byte* base(BufferId) const = 0;
  virtual std::int64_t ld(BufferId) const = 0;
  // Whether the rectangle lands in a caller's memory transposed (a
  // framework's weight gradient), and how (ops/access.hpp).
  virtual taskflow::TransposedStore transposed(const Rect&) const = 0;
  virtual const taskflow::BufferLayout& layout(BufferId) const = 0;
  // Where a put writes the rows of `peer_rect` (the peer's memory, or a
  // message to it), and the put itself: true when the transport signals
  // the task's trigger event with the data.
  virtual T* put_target(const Rect& peer_rect) = 0;
  virtual bool send_put(const Rect& peer_rect) = 0;
  virtual RhsView<T> weight(Weight, std::int32_t expert) const = 0;
  // The packed storage behind weight(w, expert) on the expert's owner: what
  // a weight put lends (elements of T, as bytes).
  virtual std::span<const std::byte> packed_weight(Weight, std::int32_t expert) const = 0;
  virtual RhsView<float> router_transposed() const = 0;
  // The router's backward reads the step's routing: the layer as hosted
  // here, the routing of the hosted tokens, and this rank's first token in it.
  virtual const LayerConfig& hosted_layer() const = 0;
  virtual const RouterOutput<float>& routing() const = 0;
  virtual std::int64_t first_token() const = 0;

 protected:
  ~TileHost() = default;
};

// One task as its body sees it.
template <class T>
struct Tile {
  const Task& task;
  const Program& program;
  const taskflow::Operands& operands;
  TileHost<T>& host;

  // The i-th read (write) of the kind's access rule, in the rule's order;
  // an accumulating operand counts as both.
  const Rect& read(int i) const { return nth(taskflow::Use::read, i); }
  const Rect& write(int i) const { return nth(taskflow::Use::write, i); }
  // The operand of that buffer.
  const Rect& in(BufferId b) const { return find(b, taskflow::Use::read); }
  const Rect& out(BufferId b) const { return find(b, taskflow::Use::write); }

  template <class U>
  U* at(const Rect& r) const {
    return reinterpret_cast<U*>(host.address(r));
  }
  template <class U>
  U* base(BufferId b) const {
    return reinterpret_cast<U*>(host.base(b));
  }
  std::int64_t ld(BufferId b) const { return host.ld(b); }
  std::int64_t rows() const { return task.rows; }
  const taskflow::Dims& dims() const { return program.dims; }

  // A body's check that the rule declares what its kernel touches.
  void need(const Rect& r, std::int64_t rows, std::int64_t cols) const {
    if (rows > r.rows() || cols > r.cols())
      throw Error(std::string("bounds: a ") + taskflow::name(task.kind) + " kernel touches " + std::to_string(rows) + " x " +
                  std::to_string(cols) + " of " + taskflow::name(r.buffer) + " but the table declares " +
                  std::to_string(r.rows()) + " x " + std::to_string(r.cols()));
  }

  // out = a b for the task's rows and columns: a is a rectangle, b a packed
  // weight or a buffer. The output is fp32, or the layer's dtype when
  // store_in_dtype (through an fp32 tile). `streamed`: an fp32 output that
  // nothing reads soon (a weight gradient) goes to memory with
  // non-temporal stores (kernels::gemm_tile_streamed).
  template <class U>
  void gemm(const Rect& a, RhsView<U> b, const Rect& out, bool store_in_dtype, bool streamed = false) const {
    const std::int64_t m = task.rows, n = task.cols;
    need(out, m, n);
    need(a, m, 0);
    const std::int64_t k = a.cols(), lda = ld(a.buffer), ldo = ld(out.buffer);
    if (const taskflow::TransposedStore t = host.transposed(out); t.ld) {  // a panel at a time through fp32 tiles
      float tile[kernels::kMaxTileRows * kernels::kTileCols], turned[kernels::kTileCols * kernels::kMaxTileRows];
      for (std::int64_t j = 0; j < n; j += kernels::kTileCols) {
        const std::int64_t w = std::min(kernels::kTileCols, n - j);
        kernels::gemm_tile<U>(at<U>(a), lda, b, task.col_begin + j, tile, kernels::kTileCols, m, w, k, false);
        if (!t.bf16) {
          kernels::transpose_rows(tile, kernels::kTileCols, m, w, at<float>(out) + j * t.ld, t.ld);
          continue;
        }
        kernels::transpose_rows(tile, kernels::kTileCols, m, w, turned, m);
        bf16* dst = reinterpret_cast<bf16*>(host.address(out)) + j * t.ld;
        for (std::int64_t col = 0; col < w; ++col) kernels::store<bf16>(turned + col * m, dst + col * t.ld, m);
      }
      return;
    }
    if constexpr (std::is_same_v<U, T>) {
      if (store_in_dtype) {
        float scratch[kernels::kMaxTileRows * kernels::kTileCols];
        kernels::gemm_tile<T>(at<T>(a), lda, b, task.col_begin, scratch, kernels::kTileCols, m, n, k, false);
        T* dst = at<T>(out);
        for (std::int64_t row = 0; row < m; ++row) kernels::store<T>(scratch + row * kernels::kTileCols, dst + row * ldo, n);
        return;
      }
    }
    if (streamed) kernels::gemm_tile_streamed<U>(at<U>(a), lda, b, task.col_begin, at<float>(out), ldo, m, n, k);
    else kernels::gemm_tile<U>(at<U>(a), lda, b, task.col_begin, at<float>(out), ldo, m, n, k, false);
  }
  // A panel-blocked buffer's rows from r.r0 on, as a GEMM's right operand.
  template <class U>
  RhsView<U> panels(const Rect& r) const {
    return RhsView<U>{base<U>(r.buffer) + r.r0 * kernels::kTileCols, kernels::kTileCols,
                      host.layout(r.buffer).rows * kernels::kTileCols};
  }

 private:
  const Rect& nth(taskflow::Use use, int i) const {
    for (const auto& o : operands)
      if ((o.use == use || o.use == taskflow::Use::accumulate) && i-- == 0) return o.rect;
    throw Error(std::string("the access table gives a ") + taskflow::name(task.kind) + " task fewer " +
                (use == taskflow::Use::read ? "reads" : "writes") + " than its body takes");
  }
  const Rect& find(BufferId b, taskflow::Use use) const {
    for (const auto& o : operands)
      if (o.rect.buffer == b && (o.use == use || o.use == taskflow::Use::accumulate)) return o.rect;
    throw Error(std::string("the access table gives a ") + taskflow::name(task.kind) + " task no " +
                (use == taskflow::Use::read ? "read of " : "write of ") + taskflow::name(b));
  }
};

// A body: runs the tile; true when a put it sent carries the trigger event
// (the engine then does not signal it).
template <class T>
using Body = bool (*)(const Tile<T>&);

struct OpKind {
  TaskKind kind = TaskKind::count;
  const char* name = "";
  Pass pass = Pass::forward;
  // Place in the serialized schedule's operator sequence of its pass (the
  // order a framework runs the operators in); unique within a pass.
  int order = 0;
  KindAccess access;
  Body<float> body_f32 = nullptr;
  Body<bf16> body_bf16 = nullptr;
  // Its part in the step: scheme, what a put feeds and at which level, its
  // place in the schedule, its framework operator (ops/kind_role.hpp).
  taskflow::KindRole role{};

  template <class T>
  Body<T> body() const {
    if constexpr (std::is_same_v<T, float>) return body_f32;
    else return body_bf16;
  }
};

// The op table: every kind's entry, by kind. Its first use checks that
// every kind has exactly one entry, with a body for each dtype.
const OpKind& op(TaskKind);
// The families, in table order, for listings and tests.
struct Family {
  const char* name;
  std::span<const OpKind> kinds;
};
std::span<const Family> families();

// How the families spell their access rules.
namespace rules {
using B = BufferId;
using X = taskflow::Extent;
using taskflow::ByteTerm;
using taskflow::ExpertHome;
using taskflow::OperandRule;
using taskflow::QueueClass;
using taskflow::Side;
using taskflow::Span;
using taskflow::Use;
using taskflow::Collective;
using taskflow::KernelScope;
using taskflow::KindRole;
using taskflow::Place;
using taskflow::Scheme;
using taskflow::TileStep;
using K = taskflow::TaskKind;
inline constexpr Use R = Use::read, W = Use::write, Acc = Use::accumulate;
inline constexpr ExpertHome kOwn = ExpertHome::own_rank, kPeer = ExpertHome::peer;
inline constexpr std::uint8_t kElem = 0;  // bytes of the layer's dtype

// Rules read as: buffer, use, side, rows (span, extent), columns (span, extent).
constexpr OperandRule op(B b, Use u, Span rows, X row_extent, Span cols, X col_extent, Side side = Side::own,
                         bool only_with_shared = false) {
  return OperandRule{b, u, side, rows, row_extent, cols, col_extent, only_with_shared, false, 0};
}
// A GEMM's read of its expert's lent weights: the whole block of the slot,
// for a slot lent to the task's rank only.
constexpr OperandRule lent_weights() {
  OperandRule r = op(B::lent_w, R, Span::lent_block, X::none, Span::whole, X::lent_block_bytes);
  r.only_for_lent_slot = true;
  return r;
}
// The common cases: a task's row band of a buffer, all its columns; the
// task's own output rectangle.
constexpr OperandRule band(B b, X width, Use u = R) { return op(b, u, Span::task_rows, X::none, Span::whole, width); }
constexpr OperandRule tile(B b, Side side = Side::own) {
  return op(b, W, Span::task_rows, X::none, Span::task_cols, X::none, side);
}
// A transposed operand filled by a pack task: all of `height` rows, the task's rows as columns.
constexpr OperandRule transposed(B b, X height) { return op(b, W, Span::whole, height, Span::task_rows, X::none); }

constexpr KindAccess vector_kind(std::initializer_list<OperandRule> ops, std::initializer_list<ByteTerm> traffic,
                                 ExpertHome home = ExpertHome::none) {
  KindAccess a;
  a.queue = QueueClass::vector;
  a.expert_home = home;
  for (const auto& o : ops) a.operands[a.operand_count++] = o;
  for (const auto& t : traffic) a.traffic[a.traffic_terms++] = t;
  return a;
}
// The same access with its task a put (its bytes then count as sent).
constexpr KindAccess as_put(KindAccess a) {
  a.put = true;
  return a;
}
// A relay's body moves nothing: its trigger says that the event it waited
// for completed (the per-rank exchange's chains of slots).
template <class T>
bool relay(const Tile<T>&) {
  return false;
}
// A put moves its rows of the hidden width.
constexpr KindAccess put_kind(std::initializer_list<OperandRule> ops, ExpertHome home) {
  KindAccess a = vector_kind(ops, {ByteTerm{X::hidden, 1, 0, X::none}}, home);
  a.put = true;
  return a;
}
// A GEMM tile costs 2 rows cols k FLOPs.
constexpr KindAccess gemm_kind(std::initializer_list<OperandRule> ops, X k, ExpertHome home = ExpertHome::none) {
  KindAccess a = vector_kind(ops, {}, home);
  a.queue = QueueClass::matrix;
  a.gemm_k = k;
  return a;
}
}  // namespace rules

}  // namespace hpmoe::ops
