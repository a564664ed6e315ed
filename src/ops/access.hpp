#pragma once
// The per-kind access table: for every task kind, which buffers it reads and
// writes (a row and column rectangle each, as a function of the task's
// fields and the program's layout), on which rank, and how much work it is.
// Its entries are the op families' (ops/*.cpp, listed by ops/table.cpp).
// It is the one description of what a task does to memory: the verifier's
// coverage, race and conflict checks, the CPU executor's operand addresses,
// the simulator's costs and the scheduler's cost model all come from it.
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hpmoe/error.hpp"

#include "ir/ir.hpp"
#include "ops/combine_list.hpp"
#include "ops/kind_role.hpp"

namespace hpmoe::taskflow {

// What the op table (ops/table.cpp) says of each kind.
const char* name(TaskKind);
inline QueueClass queue_class(TaskKind k) { return facts(k).queue; }
// A put to a peer (dispatch, combine and their gradients): an all-to-all in
// the serialized operator sequence.
inline bool is_put(TaskKind k) { return facts(k).put; }
inline ExpertHome expert_home(TaskKind k) { return facts(k).expert_home; }
// The serialized baseline's operator sequence over the same tiles: one task
// kind per operator, in the order a framework runs them.
const std::vector<TaskKind>& operator_order(Pass);

// accumulate: a declared reduction's target, read and then written
// (dst += ...); visited as both a read and a write.
enum class Use : std::uint8_t { read, write, accumulate };
// Whose copy of a symmetric buffer an operand is: the rank running the task,
// or the peer a put targets (Task::peer).
enum class Side : std::uint8_t { own, peer };

// How an operand's rows or columns follow from the task and the program.
enum class Span : std::uint8_t {
  task_rows,     // [row_begin, row_begin + rows)
  task_cols,     // [col_begin, col_begin + cols)
  source_rows,   // [src_row, src_row + rows)
  whole,         // [0, extent)
  expert_rows,   // the task's expert's rows in the receive order: [expert_begin[slot], expert_begin[slot + 1])
  expert_block,  // task rows within the expert's block of a per-slot stack: [row_begin - slot extent, ... + rows)
  sent_rows,     // [0, send_rows): every row this rank's tokens sent
  expert_kpad,   // the task's expert's rows in the weight-gradient operands: [kpad_begin[slot], kpad_begin[slot + 1])
  kpad_task_rows,     // the task's rows there; the expert's last tile also covers its K padding row
  task_rows_padded,   // the task's token rows; the last tile also covers the tokens' K padding row
  reduction_parts,    // the task's rows in parts 1..k-1 of the declared reduction holding them (one band over all)
  token_block,        // the per-rank exchange: source s = src_row's sub-blocks 0..slot of the task's expert: [token_begin[s L], token_begin[s L + slot + 1])
  peer_block,         // the per-rank combine: the whole token block of the put's target: [token_begin[peer L], token_begin[peer L + L])
  expert_prefix,      // the rows of the rank's slots up to the task's expert's: [0, expert_begin[slot + 1])
  node_prefix,        // the per-node exchange on a forwarder: source s's node sub-blocks 0..j, where rows [src_row, src_row + rows) of the routes are of s's sub-block j for a rank of the node
  node_comb_prefix,   // the per-node combine on a forwarder: the route rows (and NODE_COMB rows) of source s = peer's slots 0..c for all the node's ranks, where node sums [src_row, src_row + rows) of s are of combine slot c
  lent_block,         // weights instead of tokens: the LENT_W row of the task's expert's slot, lent to this rank
};

// Layer sizes an operand rule or a GEMM can name.
enum class Extent : std::uint8_t {
  none, one, hidden, inter, inter2, shared_inter, shared_inter2, top_k, experts, tokens, expert_rows,
  expert_kpad,    // the expert's rows, K-padded (bf16: even)
  tokens_padded,  // the rank's tokens, K-padded
  hidden_panels, inter2_panels, shared_inter2_panels,  // widths rounded up to whole kPanelCols panels
  // the intermediate width the task's expert slot computes: the layer's
  // for a whole expert, its part's for a tensor-parallel split (SlotPart)
  expert_inter, expert_inter2, expert_inter2_panels,
  dispatch_row_bytes,  // one dispatched row as it travels (Dims::dispatch_row_bytes)
  grad_dispatch_row_bytes,  // one row of the backward's bf16 dispatch: 2 hidden
  route,            // a route of the per-rank exchange: (row in the token block, gate), 2 x 4 bytes
  // a token row of the per-rank exchange as it travels (the pass's token
  // buffer: RECV_TOK forward, DY_TOK backward): its columns, its bytes
  token_cols, token_row_bytes,
  // the per-rank combine: the ranks; all rows a rank receives; the rows of
  // the rank's own token list (its COMB_RANK rows); a combine-list row (2 K + 1 words)
  ranks, recv_rows, token_list, comb_words,
  // the rows a source's sums come back to (COMB_RANK: its token list, then
  // its node list), and the columns of its slots (RANK_SLOT: P + B)
  comb_rows, slot_cols,
  // bytes of one sum as it travels (COMB_RANK's row: the layer's dtype, or bf16)
  comb_row_bytes,
  // weights instead of tokens: one lent slot's block of packed weights (this
  // pass's); a task's own columns (a weight put's bytes)
  lent_block_bytes, task_cols,
};

struct OperandRule {
  BufferId buffer = BufferId::none;
  Use use = Use::read;
  Side side = Side::own;
  Span rows = Span::task_rows;
  Extent row_extent = Extent::none;
  Span cols = Span::task_cols;
  Extent col_extent = Extent::none;
  bool only_with_shared_experts = false;
  // Only for a task whose expert is lent to its rank this step (its GEMMs
  // then read the lent weights, which they must wait for).
  bool only_for_lent_slot = false;
  // Rows added at the rectangle's end: zero in the standard table; the
  // perturbation tests widen a rule with it.
  std::int32_t grow_rows = 0;
};

// Bytes a vector task or a put moves, besides what its rectangles say:
// a sum of rows x extent x element-size terms.
struct ByteTerm {
  Extent extent = Extent::none;
  std::uint8_t per_row_multiple = 1;  // e.g. K rows read per token
  std::uint8_t bytes = 0;             // element size; 0: the layer's dtype
  Extent times = Extent::none;        // a second extent factor (none: 1)
  // A put's bytes are what it carries; a term marked local is what its
  // issuing unit reads besides (the per-rank combine's sums): vector work,
  // not wire bytes (TaskWork::local_bytes).
  bool local = false;
};

inline constexpr int kMaxOperands = 5;
inline constexpr int kMaxByteTerms = 4;

struct KindAccess {
  QueueClass queue = QueueClass::vector;
  ExpertHome expert_home = ExpertHome::none;
  bool put = false;
  std::array<OperandRule, kMaxOperands> operands{};
  std::uint8_t operand_count = 0;
  Extent gemm_k = Extent::none;  // matrix tasks: the reduction length
  std::array<ByteTerm, kMaxByteTerms> traffic{};  // vector tasks and puts: bytes per task row
  std::uint8_t traffic_terms = 0;
};

// An operand of one task: a rectangle of one rank's buffer. (Plain
// aggregates without member initializers: the verifier builds millions.)
struct Rect {
  BufferId buffer;
  std::int64_t r0, r1, c0, c1;
  std::int64_t rows() const { return r1 - r0; }
  std::int64_t cols() const { return c1 - c0; }
  std::int64_t area() const { return rows() * cols(); }
};
struct Operand {
  Rect rect;
  Use use;
  std::int32_t rank;      // whose buffer
  bool by_column_tiles;   // a read whose columns are the task's: the tiles of a row band read it all
};
struct Operands {
  std::array<Operand, kMaxOperands> list;
  int count = 0;
  const Operand* begin() const { return list.data(); }
  const Operand* end() const { return list.data() + count; }
};

// What a task costs: FLOPs of a GEMM tile (and its reduction length), or the
// bytes a vector task or a put moves.
struct TaskWork {
  double flops = 0;
  double bytes = 0;
  std::int64_t k = 0;
  bool timed = true;  // false: outside a simulation's scope (takes no time; its events still fire)
  double local_bytes = 0;  // a put's reads besides what it carries (vector work on the sender)
};

// Rows of a GEMM's K operand as the kernels need them: even for bf16.
inline std::int64_t padded_rows(const Program& p, std::int64_t rows) {
  return p.dims.elem_bytes == 2 ? (rows + 1) & ~std::int64_t{1} : rows;
}

class AccessTable {
 public:
  // hpmoe's task kinds as the compiler, runtime and simulator implement them.
  static const AccessTable& standard();

  const KindAccess& operator[](TaskKind k) const { return kinds_[static_cast<std::size_t>(k)]; }
  // For perturbation tests: a copy whose entries can be changed.
  KindAccess& edit(TaskKind k) { return kinds_[static_cast<std::size_t>(k)]; }

  // The rectangles a task of program p touches. Throws Error if the task
  // names an expert its rank does not hold where a rule needs one.
  Operands operands(const Program& p, const Task& t) const;
  // Only its reads, or only its writes.
  Operands operands(const Program& p, const Task& t, Use only) const;
  // The same, each handed to fn(const Operand&) as it is computed.
  template <class Fn>
  void for_each(const Program& p, const Task& t, Use only, Fn&& fn) const {
    visit(p, t, true, only, fn);
  }
  // The one rectangle of `buffer` a task uses that way (its address in the
  // executor); Error if the table gives it none.
  Rect operand(const Program& p, const Task& t, BufferId buffer, Use use) const;
  TaskWork work(const Program& p, const Task& t) const;
  std::int64_t extent(const Program& p, const Task& t, Extent e) const;

 private:
  Operands collect(const Program& p, const Task& t, bool filter, Use only) const;
  template <class Fn>
  void visit(const Program& p, const Task& t, bool filter, Use only, Fn&& fn) const;
  static std::pair<std::int64_t, std::int64_t> span_of(const AccessTable& table, const Program& p, const Task& t, Span s,
                                                       Extent e, bool rows);
  std::array<KindAccess, static_cast<std::size_t>(TaskKind::count)> kinds_{};
};

// The hot paths (the verifier asks for every task's operands), inline.

inline std::int64_t AccessTable::extent(const Program& p, const Task& t, Extent e) const {
  const Dims& d = p.dims;
  auto panels = [](std::int64_t n) { return (n + kPanelCols - 1) / kPanelCols * kPanelCols; };
  switch (e) {
    case Extent::none: return 1;
    case Extent::one: return 1;
    case Extent::tokens_padded: return padded_rows(p, d.tokens);
    case Extent::hidden_panels: return panels(d.hidden);
    case Extent::inter2_panels: return panels(2 * d.inter);
    case Extent::shared_inter2_panels: return panels(2 * d.shared_inter);
    case Extent::expert_kpad: {
      const std::int64_t slot = p.slot_of(t.expert);
      if (slot < 0) return 0;
      return p.kpad_begin[static_cast<std::size_t>(slot + 1)] - p.kpad_begin[static_cast<std::size_t>(slot)];
    }
    case Extent::hidden: return d.hidden;
    case Extent::lent_block_bytes: return lent_block_bytes(d, p.pass);
    case Extent::task_cols: return t.cols;
    case Extent::dispatch_row_bytes: return d.dispatch_row_bytes;
    case Extent::grad_dispatch_row_bytes: return 2 * d.hidden;
    case Extent::route: return 2;
    case Extent::token_cols:
    case Extent::token_row_bytes: {
      const BufferLayout* b = p.buffer(p.pass == Pass::forward ? BufferId::recv_tok : BufferId::dy_tok);
      if (!b) return 0;
      return e == Extent::token_cols ? b->cols : b->cols * b->elem_bytes;
    }
    case Extent::ranks: return p.ranks;
    case Extent::recv_rows: return p.expert_begin.empty() ? 0 : p.expert_begin.back();
    case Extent::token_list: {
      const BufferLayout* b = p.buffer(BufferId::rank_token);
      return b ? b->rows : 0;
    }
    case Extent::comb_words: return ops::CombineList::words(d.top_k);
    case Extent::comb_row_bytes: {
      const BufferLayout* b = p.buffer(BufferId::comb_rank);
      return b ? b->cols * b->elem_bytes : d.hidden * d.elem_bytes;
    }
    case Extent::comb_rows:
    case Extent::slot_cols: {
      const BufferLayout* b = p.buffer(e == Extent::comb_rows ? BufferId::comb_rank : BufferId::rank_slot);
      return !b ? 0 : e == Extent::comb_rows ? b->rows : b->cols;
    }
    case Extent::inter: return d.inter;
    case Extent::inter2: return 2 * d.inter;
    case Extent::shared_inter: return d.shared_inter;
    case Extent::shared_inter2: return 2 * d.shared_inter;
    case Extent::top_k: return d.top_k;
    case Extent::experts: return d.experts;
    case Extent::tokens: return d.tokens;
    case Extent::expert_rows: {
      const std::int64_t slot = p.slot_of(t.expert);
      if (slot < 0) return 0;
      return p.expert_begin[static_cast<std::size_t>(slot + 1)] - p.expert_begin[static_cast<std::size_t>(slot)];
    }
    case Extent::expert_inter:
    case Extent::expert_inter2:
    case Extent::expert_inter2_panels: {
      const std::int64_t slot = p.slot_of(t.expert);
      const std::int64_t w = slot < 0 || static_cast<std::size_t>(slot) >= p.slot_parts.size()
                                 ? 0
                                 : p.slot_parts[static_cast<std::size_t>(slot)].inter;
      return e == Extent::expert_inter ? w : e == Extent::expert_inter2 ? 2 * w : panels(2 * w);
    }
  }
  return 0;
}


// [begin, end) of one side of an operand's rectangle.
inline std::pair<std::int64_t, std::int64_t> AccessTable::span_of(const AccessTable& table, const Program& p, const Task& t, Span s, Extent e,
                                              bool rows) {
  switch (s) {  // the common spans first
    case Span::task_rows: return {t.row_begin, std::int64_t{t.row_begin} + t.rows};
    case Span::task_cols: return {t.col_begin, std::int64_t{t.col_begin} + t.cols};
    case Span::source_rows: return {t.src_row, std::int64_t{t.src_row} + t.rows};
    case Span::whole: return {0, table.extent(p, t, e)};
    case Span::sent_rows: return {0, p.send_rows};
    case Span::task_rows_padded: {
      const std::int64_t end = std::int64_t{t.row_begin} + t.rows;
      return {t.row_begin, end == p.dims.tokens ? padded_rows(p, end) : end};
    }
    case Span::reduction_parts: {
      const Reduction* red = p.reduction_at(t.row_begin);
      if (!red || std::int64_t{t.row_begin} + t.rows > red->row_begin + red->rows)
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " reduces rows [" +
                    std::to_string(t.row_begin) + ", " + std::to_string(std::int64_t{t.row_begin} + t.rows) +
                    "), which no declared reduction's target block holds");
      return {std::int64_t{t.row_begin} + red->rows, std::int64_t{t.row_begin} + (red->parts - 1) * red->rows + t.rows};
    }
    case Span::token_block: {  // source src_row's sub-blocks 0..slot of the task's expert
      const std::int64_t L = static_cast<std::int64_t>(p.local_experts.size()), src = t.src_row, slot = p.slot_of(t.expert);
      if (slot < 0 || src < 0 || src >= p.ranks || static_cast<std::int64_t>(p.token_begin.size()) != p.ranks * L + 1)
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " reads source " + std::to_string(t.src_row) +
                    "'s token block for expert " + std::to_string(t.expert) + ", which this program's token blocks do not hold");
      const auto at = [&](std::int64_t k) { return p.token_begin[static_cast<std::size_t>(k)]; };
      return {at(src * L), at(src * L + slot + 1)};
    }
    case Span::peer_block: {
      const std::int64_t L = static_cast<std::int64_t>(p.local_experts.size()), peer = t.peer;
      if (L == 0 || peer < 0 || peer >= p.ranks || static_cast<std::int64_t>(p.token_begin.size()) != p.ranks * L + 1)
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " reads rank " + std::to_string(t.peer) +
                    "'s token block, which this program's token blocks do not hold");
      return {p.token_begin[static_cast<std::size_t>(peer * L)], p.token_begin[static_cast<std::size_t>(peer * L + L)]};
    }
    case Span::node_prefix: {
      // The routes [src_row, src_row + rows) lie in one (source s, node
      // rank, sub-block j) segment; a token of rank's sub-block j has its
      // node slot at most j, so they read s's node sub-blocks 0..j.
      const auto& routes = p.node_route_begin;
      const std::int64_t P = p.ranks, first = t.src_row, end = first + t.rows;
      const std::int64_t S = p.node_begin.empty() ? 0 : static_cast<std::int64_t>(p.node_begin.size() - 1) / P;
      const std::int64_t RS = routes.empty() ? 0 : static_cast<std::int64_t>(routes.size() - 1) / P;
      if (S < 1 || RS < S || RS % S != 0 || static_cast<std::int64_t>(p.node_begin.size()) != P * S + 1 ||
          static_cast<std::int64_t>(routes.size()) != P * RS + 1 || first < 0 || end > routes.back() || t.rows < 1)
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " forwards node routes [" + std::to_string(first) +
                    ", " + std::to_string(end) + "), which this program's node blocks do not hold");
      const auto k = static_cast<std::int64_t>(std::upper_bound(routes.begin(), routes.end(), first) - routes.begin() - 1);
      if (end > routes[static_cast<std::size_t>(k + 1)])
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " forwards node routes [" + std::to_string(first) +
                    ", " + std::to_string(end) + "), which span two sub-blocks' routes");
      const std::int64_t s = k / RS, j = k % S;
      return {p.node_begin[static_cast<std::size_t>(s * S)], p.node_begin[static_cast<std::size_t>(s * S + j + 1)]};
    }
    case Span::node_comb_prefix: {
      // The node sums [src_row, src_row + rows) of s lie in one combine
      // slot c; a token of slot c has its last instance on each rank of
      // the node in a slot up to c, so they read s's segments 0..c.
      const auto& sums = p.node_sum_begin;
      const auto& parts = p.node_comb_begin;
      const std::int64_t P = p.ranks, peer = t.peer;
      const std::int64_t S = sums.empty() ? 0 : static_cast<std::int64_t>(sums.size() - 1) / P;
      const std::int64_t SR = parts.empty() ? 0 : static_cast<std::int64_t>(parts.size() - 1) / P;
      if (S < 1 || SR < S || SR % S != 0 || static_cast<std::int64_t>(sums.size()) != P * S + 1 ||
          static_cast<std::int64_t>(parts.size()) != P * SR + 1 || peer < 0 || peer >= P || t.rows < 1)
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " sums rank " + std::to_string(t.peer) +
                    "'s node rows, which this program's node blocks do not hold");
      const std::int64_t R = SR / S, base = sums[static_cast<std::size_t>(peer * S)];
      const std::int64_t first = base + t.src_row, end = first + t.rows;
      const auto slice = sums.begin() + peer * S;
      const auto k = static_cast<std::int64_t>(std::upper_bound(slice, slice + S + 1, first) - slice - 1);
      if (t.src_row < 0 || k < 0 || k >= S || end > sums[static_cast<std::size_t>(peer * S + k + 1)])
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " sums rank " + std::to_string(t.peer) +
                    "'s node rows [" + std::to_string(t.src_row) + ", " + std::to_string(t.src_row + t.rows) +
                    "), which are not within one of its combine slots");
      return {parts[static_cast<std::size_t>(peer * SR)], parts[static_cast<std::size_t>(peer * SR + (k + 1) * R)]};
    }
    case Span::lent_block: {
      const std::int64_t block = p.lent_block_of(t.expert);
      if (block < 0)
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " reads the lent weights of expert " +
                    std::to_string(t.expert) + ", which is not lent to this rank");
      return {block, block + 1};
    }
    case Span::expert_prefix: {
      const std::int64_t slot = p.slot_of(t.expert);
      if (slot < 0)
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " names expert " +
                    std::to_string(t.expert) + ", which this rank does not hold");
      return {0, p.expert_begin[static_cast<std::size_t>(slot + 1)]};
    }
    case Span::expert_kpad:
    case Span::kpad_task_rows:
    case Span::expert_rows:
    case Span::expert_block: {
      const std::int64_t slot = p.slot_of(t.expert);
      if (slot < 0)
        throw Error("rank " + std::to_string(p.rank) + " task " + name(t.kind) + " names expert " +
                    std::to_string(t.expert) + ", which this rank does not hold");
      const auto at = [](const std::vector<std::int64_t>& v, std::int64_t i) { return v[static_cast<std::size_t>(i)]; };
      if (s == Span::expert_rows) return {at(p.expert_begin, slot), at(p.expert_begin, slot + 1)};
      if (s == Span::expert_kpad) return {at(p.kpad_begin, slot), at(p.kpad_begin, slot + 1)};
      if (s == Span::kpad_task_rows) {
        const std::int64_t first = std::int64_t{t.row_begin} - at(p.expert_begin, slot) + at(p.kpad_begin, slot);
        const bool last = std::int64_t{t.row_begin} + t.rows == at(p.expert_begin, slot + 1);
        return {first, last ? at(p.kpad_begin, slot + 1) : first + t.rows};
      }
      const std::int64_t first = std::int64_t{t.row_begin} - slot * table.extent(p, t, e);
      return {first, first + (rows ? t.rows : t.cols)};
    }
  }
  return {0, 0};
}


inline Operands AccessTable::operands(const Program& p, const Task& t) const { return collect(p, t, false, Use::read); }
inline Operands AccessTable::operands(const Program& p, const Task& t, Use only) const { return collect(p, t, true, only); }

template <class Fn>
inline void AccessTable::visit(const Program& p, const Task& t, bool filter, Use only, Fn&& fn) const {
  const KindAccess& a = (*this)[t.kind];
  for (int i = 0; i < a.operand_count; ++i) {
    const OperandRule& rule = a.operands[static_cast<std::size_t>(i)];
    if ((filter && rule.use != only && rule.use != Use::accumulate) || (rule.only_with_shared_experts && p.dims.shared_inter == 0))
      continue;
    if (rule.only_for_lent_slot && (p.lent_block.empty() || p.lent_block_of(t.expert) < 0)) continue;
    // The task's own tile, most operands' span, without the general switch.
    const auto [r0, r1] = rule.rows == Span::task_rows ? std::pair<std::int64_t, std::int64_t>{t.row_begin, std::int64_t{t.row_begin} + t.rows}
                                                       : span_of(*this, p, t, rule.rows, rule.row_extent, true);
    const auto [c0, c1] = rule.cols == Span::task_cols ? std::pair<std::int64_t, std::int64_t>{t.col_begin, std::int64_t{t.col_begin} + t.cols}
                                                       : span_of(*this, p, t, rule.cols, rule.col_extent, false);
    fn(Operand{Rect{rule.buffer, r0, r1 + rule.grow_rows, c0, c1}, rule.use, rule.side == Side::peer ? t.peer : p.rank,
               rule.use == Use::read && rule.cols == Span::task_cols});
  }
}

inline TaskWork AccessTable::work(const Program& p, const Task& t) const {
  const KindAccess& a = (*this)[t.kind];
  TaskWork w;
  if (a.queue == QueueClass::matrix) {
    w.k = extent(p, t, a.gemm_k);
    w.flops = 2.0 * double(t.rows) * double(t.cols) * double(w.k);
    return w;
  }
  for (int i = 0; i < a.traffic_terms; ++i) {
    const ByteTerm& term = a.traffic[static_cast<std::size_t>(i)];
    const double element = term.bytes == 0 ? double(p.dims.elem_bytes) : double(term.bytes);
    (term.local ? w.local_bytes : w.bytes) +=
        double(t.rows) * term.per_row_multiple * double(extent(p, t, term.extent)) * double(extent(p, t, term.times)) * element;
  }
  return w;
}

inline Operands AccessTable::collect(const Program& p, const Task& t, bool filter, Use only) const {
  Operands out;
  visit(p, t, filter, only, [&](const Operand& o) { out.list[static_cast<std::size_t>(out.count++)] = o; });
  return out;
}


// Where a rectangle lands in a caller's memory transposed (a framework's
// weight gradient in its [out, in] layout): element (i, j) of the rectangle
// at j ld + i from its address, in float32 or bfloat16. ld 0: not transposed.
struct TransposedStore {
  std::int64_t ld = 0;
  bool bf16 = false;
};

}  // namespace hpmoe::taskflow
