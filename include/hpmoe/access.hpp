#pragma once
// The per-kind access table: for every task kind, which buffers it reads and
// writes (a row and column rectangle each, as a function of the task's
// fields and the program's layout), on which rank, and how much work it is.
// It is the one description of what a task does to memory: the verifier's
// coverage, race and conflict checks, the CPU executor's operand addresses,
// the simulator's costs and the scheduler's cost model all come from it.
#include <array>
#include <cstdint>

#include "hpmoe/taskflow.hpp"

namespace hpmoe::taskflow {

enum class Use : std::uint8_t { read, write };
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
};

// Layer sizes an operand rule or a GEMM can name.
enum class Extent : std::uint8_t {
  none, one, hidden, inter, inter2, shared_inter, shared_inter2, top_k, experts, tokens, expert_rows,
  expert_kpad,    // the expert's rows, K-padded (bf16: even)
  tokens_padded,  // the rank's tokens, K-padded
  hidden_panels, inter2_panels, shared_inter2_panels,  // widths rounded up to whole kPanelCols panels
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

// An operand of one task: a rectangle of one rank's buffer.
struct Rect {
  BufferId buffer = BufferId::none;
  std::int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
  std::int64_t rows() const { return r1 - r0; }
  std::int64_t cols() const { return c1 - c0; }
  std::int64_t area() const { return rows() * cols(); }
};
struct Operand {
  Rect rect;
  Use use = Use::read;
  std::int32_t rank = 0;          // whose buffer
  bool by_column_tiles = false;   // a read whose columns are the task's: the tiles of a row band read it all
};
struct Operands {
  std::array<Operand, kMaxOperands> list{};
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
};

// Rows of a GEMM's K operand as the kernels need them: even for bf16.
std::int64_t padded_rows(const Program& p, std::int64_t rows);

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
  // The one rectangle of `buffer` a task uses that way (its address in the
  // executor); Error if the table gives it none.
  Rect operand(const Program& p, const Task& t, BufferId buffer, Use use) const;
  TaskWork work(const Program& p, const Task& t) const;
  std::int64_t extent(const Program& p, const Task& t, Extent e) const;

 private:
  std::array<KindAccess, static_cast<std::size_t>(TaskKind::count)> kinds_{};
};

}  // namespace hpmoe::taskflow
