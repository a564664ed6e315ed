#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "hpmoe/config.hpp"
#include "model/format.hpp"

// The taskflow IR: tasks (44-byte tiles of work), event counters, declared
// buffers, machines and per-rank programs. A task waits for one event
// counter to reach a count, runs, and adds one to one counter (on a peer
// rank for a put); nothing else orders tasks. What each task kind reads,
// writes and costs is the op table's (ops/access.hpp); the compiler
// (compiler/taskflow.hpp) generates, schedules and verifies programs.
namespace hpmoe::taskflow {


enum class QueueClass : std::uint8_t { matrix, vector };

enum class TaskKind : std::uint8_t {
  // forward
  dispatch_put,      // gather row tile of x by slot, put into the owner's RECV, signal
  gemm_gate_up,      // H1[rows, cols] = RECV[rows] W1_e
  swiglu,            // A[rows] = swiglu(H1[rows])
  gemm_down,         // Y[rows, cols] = A[rows] W2_e
  combine_put,       // put Y rows back into the source's COMB, signal
  combine_reduce,    // OUT[tokens] = sum_k w COMB[slot] (+ SH_Y), fixed k order
  shared_gate_up,    // SH_H[tokens, cols] = X W1s
  shared_swiglu,     // SH_A[tokens] = swiglu(SH_H[tokens])
  shared_down,       // SH_Y[tokens, cols] = SH_A Ws2
  // backward
  gate_grad,            // GW[tokens] = <DOUT, COMB[slot]> per (t, k)
  router_bwd,           // DLOGITS[tokens] from GW (+ aux, z-loss); XTF columns = x^T
  router_dgrad,         // RDX[tokens, cols] = DLOGITS Wg^T
  router_wgrad,         // DWG tile = XTF DLOGITS over the rank's tokens
  grad_dispatch_put,    // put w * DOUT rows into the owner's DY, signal
  gemm_down_dgrad,      // DA[rows, cols] = DY[rows] W2_e^T
  pack_down_grad,       // DY row tile -> DYP panels, A row tile -> AT columns
  gemm_down_wgrad,      // DW2_e tile = AT_e DYP_e over all rows of e
  swiglu_bwd,           // DH[rows] from H1, DA
  gemm_gate_up_dgrad,   // DXE[rows, cols] = DH[rows] W1_e^T
  pack_gate_up_grad,    // DH row tile -> DHP panels, RECV row tile -> XT columns
  gemm_gate_up_wgrad,   // DW1_e tile = XT_e DHP_e over all rows of e
  grad_combine_put,     // put DXE rows back into the source's DCOMB, signal
  shared_down_dgrad,    // SH_DA[tokens, cols] = DOUT Ws2^T
  pack_shared_down_grad,// DOUT -> SH_DOUTP panels, SH_A -> SH_AT
  shared_down_wgrad,    // DWS2 tile = SH_AT SH_DOUTP
  shared_swiglu_bwd,    // SH_DH[tokens] from SH_H, SH_DA
  shared_gate_up_dgrad, // SDX[tokens, cols] = SH_DH Ws1^T
  pack_shared_gate_up_grad, // SH_DH -> SH_DHP panels, x -> SH_XT
  shared_gate_up_wgrad, // DWS1 tile = SH_XT SH_DHP
  grad_reduce,          // DX[tokens] = sum_k DCOMB[slot] + RDX + SDX, fixed order
  // tensor-parallel split experts (a declared reduction, Program::reductions)
  part_reduce,          // COMB[part 0 rows] += COMB[part p rows], p = 1, 2, ... in order
  grad_part_reduce,     // DCOMB[part 0 rows] += DCOMB[part p rows], the same
  // dispatch narrower than the layer's dtype (LayerConfig::staged_dispatch)
  dispatch_cast_put,    // gather row tile of x by slot, encode (fp8 + scales, or bf16), put into the owner's RECV_STAGED, signal
  dispatch_decode,      // RECV[rows] = decode(RECV_STAGED[rows]) once a row tile's pieces have all arrived
  // the backward's dispatch in bf16 under an fp32 layer (LayerConfig::staged_grad_dispatch)
  grad_dispatch_cast_put,  // put bf16(w * DOUT) rows into the owner's DY_STAGED, signal
  grad_dispatch_decode,    // DY[rows] = DY_STAGED[rows] in fp32 once a row tile's pieces have all arrived
  // the per-rank exchange (LayerConfig::exchange rank): a token travels once to each destination rank
  dispatch_token_put,   // x rows by the rank's token list (encoded where the dispatch is) into the peer's RECV_TOK, signal
  dispatch_route_put,   // the send rows' (row in the token block, gate) into the owner's RECV_ROUTE, signal
  dispatch_relay,       // a source's sub-blocks up to slot j arrived: count it towards slot j + 1 (no data)
  dispatch_gather,      // RECV[rows] = RECV_TOK[block + route row] (decoded where encoded): one source's piece of a tile
  grad_dispatch_token_put,  // DOUT rows by the token list (layer dtype, or bf16) into the peer's DY_TOK, signal
  grad_dispatch_relay,      // the same relay for the backward's sub-blocks
  grad_dispatch_gather,     // DY[rows] = gate * DY_TOK[block + route row]: one source's piece of a tile
  // the per-rank combine: one row per (token, rank) back, summed on the expert side
  combine_route_put,    // the source's combine list for a destination (recv rows and gates per token) into its RECV_COMB, signal
  combine_relay,        // the instances up to slot j are done: count it towards slot j + 1 (no data)
  combine_rank_put,     // sum_k gate Y[recv row k] per token of a source's sub-list, put into the source's COMB_RANK, signal
  combine_rank_reduce,  // OUT[tokens] = sum_d COMB_RANK[rank slot d] (+ SH_Y), fixed rank order
  gate_grad_put,        // <DY_TOK[token], Y[recv row k]> per token of a source's block, put into the source's GW_RANK, signal
  grad_combine_relay,   // the same relay for the backward's dx rows
  grad_combine_rank_put,  // sum_k DXE[recv row k] per token of a source's sub-list, put into the source's DCOMB_RANK, signal
  gate_grad_gather,     // GW[tokens] = sum_d GW_RANK[rank slot d], fixed rank order
  grad_rank_reduce,     // DX[tokens] = sum_d DCOMB_RANK[rank slot d] + RDX + SDX, fixed order
  // the per-node exchange (LayerConfig::forwards): a token crosses to another node once, to the rank there with
  // its own local index, which forwards it to the ranks of its node
  dispatch_node_put,        // x rows by the rank's node list (encoded where the dispatch is) into the forwarder's NODE_TOK, signal
  dispatch_node_route_put,  // the node-block row of each row of the node's ranks' blocks into the forwarder's NODE_ROUTE, signal
  dispatch_forward,         // NODE_TOK[route] rows as they are into a node rank's RECV_TOK, signal (as the source's token put would)
  grad_dispatch_node_put,   // DOUT rows by the node list (layer dtype, or bf16) into the forwarder's NODE_DY, signal
  grad_dispatch_forward,    // NODE_DY[route] rows into a node rank's DY_TOK, signal
  dispatch_node_relay,      // a source's node sub-blocks up to j arrived: count it towards j + 1 (no data)
  grad_dispatch_node_relay, // the same for the backward's node blocks
  // the per-node combine: a node's ranks sum a source's tokens on the source's forwarder there, which returns
  // one row per (token, node)
  combine_node_part_put,       // as combine_rank_put, into the forwarder's NODE_COMB (laid out as NODE_ROUTE), signal
  combine_node_put,            // sum over the node's ranks, in rank order, of NODE_COMB rows per token of a combine slot, into the source's COMB_RANK, signal
  grad_combine_node_part_put,  // as grad_combine_rank_put, into the forwarder's NODE_DCOMB, signal
  grad_combine_node_put,       // the same sum of NODE_DCOMB rows into the source's DCOMB_RANK, signal
  combine_node_relay,          // the node's ranks' sums of a source up to slot c arrived: count it towards c + 1 (no data)
  grad_combine_node_relay,     // the same for the backward's dx sums
  // weights instead of tokens (LayerConfig::lend_weights): an expert lent to a rank for one step
  weight_put,          // on the owner: a piece of the expert's packed W1 | W2 into the lent rank's LENT_W block, signal
  weight_relay,        // the lent weights arrived: count it towards a row tile's event, as one more arrival (no data)
  grad_weight_put,     // the same with the transposed W2^T | W1^T the backward's data gradients read
  grad_weight_relay,   // the same relay for the backward's row tiles
  count
};

// Every buffer a task touches. A program declares each one it uses (see
// BufferLayout); the access table says which rectangle of which a task reads
// and writes.
enum class BufferId : std::uint8_t {
  none,
  // forward (the backward pass reads them as saved activations)
  x, recv, h1, a, y, comb, out, sh_h, sh_a, sh_y,
  // backward
  dout, gw, dlogits, xtf, rdx, dwg, dy, da, dyp, at, dw2, dh, dxe, dhp, xt, dw1, dcomb,
  sh_da, sh_doutp, sh_at, sh_xt, dws2, sh_dh, sdx, sh_dhp, dws1, dx,
  // the caller's fp32 tokens; the step's routing, written by the host before
  // a launch: the send row of each (token, k) or -1 (int64), its gate
  // weight, the token of each send row (int32) and its assignment t K + k
  // (int64); the router's logits
  xf, slot, gate, send_token, send_assign, logits,
  // dout in the layer's dtype (the shared experts' GEMM operand)
  sh_dout,
  // the dispatched rows as they travel, encoded (bytes; Dims::dispatch_row_bytes each)
  recv_staged,
  // the backward's dispatched rows as they travel (bf16 bytes, 2 H each)
  dy_staged,
  // the per-rank exchange: the source's token of each row it sends to each
  // destination rank (int32, by destination), the (row in the destination's
  // token block, gate) of each send row (int32 + fp32); the token blocks a
  // rank receives (by source; encoded bytes where the dispatch is), the
  // routes of its received rows; the backward's token blocks of DOUT
  rank_token, rank_route, recv_tok, recv_route, dy_tok,
  // the per-rank combine: the source's combine lists (per token of each
  // destination's list: its row in its block, the recv row there of each
  // of the token's K choices or -1, then their gates; int32 words), the
  // lists as received;
  // the source's rows back, one per (token, rank) of its list, then (the
  // per-node combine) one per (token, node) of its node list; each token's
  // row there for each rank, then for each node (int64, -1: none; P + B
  // columns); the backward's gate gradients (K per list row, fp32) and dx
  // partials back, laid out as the forward's rows
  rank_comb, recv_comb, comb_rank, rank_slot, gw_rank, dcomb_rank,
  // the per-node exchange: the source's token list per destination node
  // (int32) and, per row of its token list, that token's row in its node
  // block, then the same for the token of that row of its combine list
  // (int32 x 2, rows for its own node unused); the node blocks a forwarder
  // receives (by source; as RECV_TOK rows), their routes (int32 x 2), the
  // backward's node blocks of DOUT (as DY_TOK rows); on a forwarder, the
  // sums its node's ranks return for each source, one row per (token,
  // rank), laid out as NODE_ROUTE (forward, backward)
  node_token, node_index, node_tok, node_route, node_dy, node_comb, node_dcomb,
  // weights instead of tokens: the packed weights of the experts lent to
  // this rank for the step, one row of bytes per lent slot (forward W1 then
  // W2, backward W2^T then W1^T, each in a region of lent_region_bytes)
  lent_w,
  count
};

const char* name(BufferId);
const char* name(QueueClass);
// Where the expert a task names must live: nowhere (the task has none), on
// the task's rank (expert compute, puts of expert outputs), or on the peer
// it puts to (dispatch).
enum class ExpertHome : std::uint8_t { none, own_rank, peer };

// One tile of work: 44 bytes, no pointers, no allocation.
struct Task {
  TaskKind kind;
  QueueClass queue;
  BufferId src;           // main operand read
  BufferId dst;           // written
  std::int32_t expert;    // global expert id, -1 if none
  std::int32_t peer;      // rank whose dst buffer (and trigger event) a put targets; own rank otherwise
  std::int32_t row_begin; // output rows [row_begin, row_begin + rows) in dst (for puts: in the peer's buffer)
  std::int32_t rows;
  std::int32_t col_begin; // output columns
  std::int32_t cols;
  std::int32_t src_row;   // first row read in src (puts, gathers)
  std::int32_t wait_event;     // -1: none
  std::int32_t wait_count;     // counter value the wait needs
  std::int32_t trigger_event;  // on rank `peer` for puts, own rank otherwise; -1: none
};
static_assert(sizeof(Task) <= 48 && std::is_trivially_copyable_v<Task>, "Task must stay a small POD");

// What an event counts, for messages that name it.
struct Event {
  std::int32_t required;  // triggers that complete it
  TaskKind consumer;      // the kind of task that waits on it
  std::int32_t expert;    // -1 if none
  std::int32_t tile;      // row tile (or -1)
};

// Where a buffer lives. Symmetric: in the rank's segment, at the same
// offset on every rank, so a put can address a peer's copy. Local: in memory
// only the rank itself touches. Bound: memory the caller owns (inputs,
// outputs, gradients), which the executor binds at launch.
enum class Region : std::uint8_t { symmetric, local, bound };
// Row-major with a leading dimension of `cols`; or panel-blocked, the
// kernels' right-hand-operand layout: column panels of kPanelCols, each
// rows x kPanelCols (bf16 in row pairs), panel p at p x rows x kPanelCols.
enum class Layout : std::uint8_t { row_major, panels };
inline constexpr std::int64_t kPanelCols = 64;

// What one of a rank's expert slots computes: the whole expert, or part
// `part` of `parts` of a tensor-parallel split, the intermediate columns
// [inter_begin, inter_begin + inter). Its buffers keep the layer's full
// widths; a part uses the first `inter` (gate/up: 2 inter) columns.
struct SlotPart {
  std::int64_t inter_begin = 0, inter = 0;
  std::int32_t part = 0, parts = 1;
  friend bool operator==(const SlotPart&, const SlotPart&) = default;
};

// A declared reduction in a source rank's COMB (forward) or DCOMB
// (backward): a split expert's k parts each return their partial rows into
// their own block, [row_begin + p rows, + rows) for part p; part_reduce
// tasks add parts 1..k-1 in order into part 0's block, which the combine
// then reads. The verifier knows that these accumulating writes follow the
// parts' puts, and that each target element is reduced exactly once.
struct Reduction {
  std::int32_t expert = -1, parts = 0;
  std::int64_t row_begin = 0, rows = 0;
  friend bool operator==(const Reduction&, const Reduction&) = default;
};

struct BufferLayout {
  BufferId id;
  std::int64_t rows, cols, elem_bytes;
  std::int64_t offset_bytes;  // in its region (none for bound buffers)
  Region region = Region::symmetric;
  Layout layout = Layout::row_major;
  std::int64_t bytes() const { return rows * cols * elem_bytes; }
};
const char* name(Region);
const char* name(Layout);

// Workers of one rank: matrix-only, vector-only and unified (take both).
struct Machine {
  std::string name = "cpu";
  int matrix_workers = 0;
  int vector_workers = 0;
  int unified_workers = 1;
  std::int64_t tile_rows = 64, tile_cols = 64;
  // Rows of a weight-gradient output tile (tiles of [H, 2I], [I, H], ...,
  // whose K is the rows of a step); 0: tile_rows. Token row tiles and weight
  // tiles need not be alike: tall token tiles reuse each weight panel over
  // more rows, while weight tiles with a short K prefer to stay small.
  std::int64_t weight_tile_rows = 0;
  std::int64_t weight_rows() const { return weight_tile_rows > 0 ? weight_tile_rows : tile_rows; }
  // Columns of a weight-gradient task (a multiple of tile_cols; 0:
  // tile_cols). With a short K such a task is bound by writing its output,
  // and on a CPU the output tile next to another core's in the same rows
  // costs twice as much (the line prefetcher pulls the neighbour's lines):
  // a worker takes a strip of whole rows and walks along it.
  std::int64_t weight_tile_cols = 0;
  std::int64_t weight_cols() const { return weight_tile_cols > 0 ? weight_tile_cols : tile_cols; }
  // Cost model: seconds = flops / matrix_flops (GEMM) or bytes / vector_bytes_per_s, + overhead.
  double matrix_flops = 100e9, vector_bytes_per_s = 20e9, put_bytes_per_s = 20e9, task_overhead_s = 0.2e-6;
  // Vector-class workers that carry puts, the first ones of the class (0:
  // all): where the issuing unit moves the bytes itself, a few units fill the
  // link and the others stay free for vector work. The list-scheduling
  // policies keep puts on these and other vector tasks off them.
  int put_workers = 0;
  // Whether a matrix worker can also run a vector task the schedule hands
  // it. A GPU's SMs run whatever code they are given: the matrix/vector
  // split is the fused schedule's choice, and once the matrix work is done
  // the final reductions take every SM. Ascend's cube cores cannot run
  // vector code (false).
  bool matrix_runs_vector = false;

  int workers() const { return matrix_workers + vector_workers + unified_workers; }
  bool takes(int worker, QueueClass c) const;  // the worker's own class: matrix..., vector..., unified (both)...
  // What the worker may be handed: its own class, and on a machine whose
  // matrix workers run vector code, a vector task too.
  bool runs(int worker, QueueClass c) const;
};
// W unified workers per rank; M matrix + V vector workers per rank.
Machine cpu_machine(int workers);
Machine accel_machine(int matrix_workers, int vector_workers);
// "cpu:W[:RxC]" or "accel:M:V[:RxC]" (the CLI's --machine).
Machine parse_machine(const std::string& spec);

enum class Pass { forward, backward };

// Layer sizes a program's tasks refer to.
struct Dims {
  std::int64_t hidden = 0, inter = 0, shared_inter = 0, experts = 0, top_k = 0, tokens = 0;
  std::int64_t elem_bytes = 4;  // of the layer's dtype (activations, weights)
  // Bytes of one dispatched row where the dispatch is narrower than the
  // layer's dtype (fp8 codes and scales, or bf16); 0: rows travel as they are.
  std::int64_t dispatch_row_bytes = 0;
  // Its format: 1 fp8 e4m3 with per-128 scales, 2 bf16 (0: none).
  std::int64_t dispatch_format = 0;
};

// Bytes of the region of one packed weight [k, n] in a lent slot's block:
// what any kernel layout's packing takes (hpmoe::packed_weight_bytes).
inline std::int64_t lent_region_bytes(std::int64_t k, std::int64_t n, std::int64_t elem_bytes) {
  return packed_weight_bytes(k, n, elem_bytes == 2 ? DType::bf16 : DType::fp32);
}
// A lent block: the pass's two weights (forward [H, 2I] then [I, H];
// backward W2^T [H, I] then W1^T [2I, H]) and where the second starts.
inline std::int64_t lent_second_region(const Dims& d, Pass pass) {
  return pass == Pass::forward ? lent_region_bytes(d.hidden, 2 * d.inter, d.elem_bytes)
                               : lent_region_bytes(d.hidden, d.inter, d.elem_bytes);
}
inline std::int64_t lent_block_bytes(const Dims& d, Pass pass) {
  return pass == Pass::forward ? lent_second_region(d, pass) + lent_region_bytes(d.inter, d.hidden, d.elem_bytes)
                               : lent_second_region(d, pass) + lent_region_bytes(2 * d.inter, d.hidden, d.elem_bytes);
}

// A rank's program for one pass of one step.
struct Program {
  int version = kFormatVersion;
  Pass pass = Pass::forward;
  std::int32_t rank = 0, ranks = 1;
  Machine machine;
  Dims dims;
  std::vector<std::int32_t> local_experts;  // [L] this rank's experts (global ids) in slot order
  std::vector<std::int32_t> expert_slot;    // [E] slot of each expert on this rank, -1 if it lives elsewhere
  std::vector<std::int64_t> expert_begin;   // [L + 1] rows of each local slot in RECV
  std::vector<std::int64_t> kpad_begin;     // [L + 1] the same in the weight-gradient operands (bf16: even counts)
  std::vector<SlotPart> slot_parts;         // [L] what each local slot computes
  // [L] each slot's block in LENT_W for an expert lent to this rank for the
  // step (its weights arrive by weight_put tasks), -1 for the rank's own
  // experts; empty when nothing is lent here.
  std::vector<std::int32_t> lent_block;
  std::int64_t send_rows = 0;               // rows this rank's tokens send (COMB rows)
  // The per-rank exchange: [P + 1] rows of each source's token block in
  // RECV_TOK (and DY_TOK); empty under the per-assignment exchange.
  std::vector<std::int64_t> token_begin;
  // The per-node exchange, on a forwarder (S node slots, R ranks a node):
  // [P S + 1] rows of each source's node sub-blocks in NODE_TOK (and
  // NODE_DY), and [P R S + 1] rows in NODE_ROUTE of the routes of each
  // source's sub-block j for each rank of the node (empty for ranks that
  // do not forward through it); empty without. The per-node combine,
  // streamed: [P S R + 1] rows in NODE_COMB (and NODE_DCOMB) of each
  // source's segment of slot j from each rank of the node (slot-major, so
  // that slots 0..c of a source are one prefix), and [P S + 1] rows among
  // the node sums of each source's combine slot c (a token's highest
  // last-instance slot over the node's ranks).
  std::vector<std::int64_t> node_begin, node_route_begin, node_comb_begin, node_sum_begin;
  std::vector<Reduction> reductions;        // split experts' partial rows in COMB / DCOMB, by row_begin
  std::vector<Task> tasks;
  std::vector<float> cost;                // seconds per task (cost model)
  std::vector<std::int32_t> queue_begin;  // [workers + 1] into queue_tasks
  std::vector<std::int32_t> queue_tasks;  // task ids, per worker in execution order
  std::vector<Event> events;
  std::vector<BufferLayout> buffers;

  // The declared buffer `id`, or null.
  const BufferLayout* buffer(BufferId id) const {
    for (const auto& b : buffers)
      if (b.id == id) return &b;
    return nullptr;
  }
  // Bytes of a region this program's buffers span.
  std::int64_t region_bytes(Region) const;

  // The declared reduction whose target block (part 0) holds `row`, or null.
  const Reduction* reduction_at(std::int64_t row) const {
    auto it = std::upper_bound(reductions.begin(), reductions.end(), row,
                               [](std::int64_t r, const Reduction& x) { return r < x.row_begin; });
    if (it == reductions.begin()) return nullptr;
    --it;
    return row < it->row_begin + it->rows ? &*it : nullptr;
  }
  // The LENT_W block of `expert`'s slot here, -1 unless it is lent to this rank.
  std::int64_t lent_block_of(std::int64_t expert) const {
    const std::int64_t slot = slot_of(expert);
    return slot < 0 || lent_block.empty() ? -1 : lent_block[static_cast<std::size_t>(slot)];
  }
  // Slot of `expert` on this rank; -1 if it is not here (or not an expert).
  std::int64_t slot_of(std::int64_t expert) const {
    return expert >= 0 && expert < static_cast<std::int64_t>(expert_slot.size()) ? expert_slot[static_cast<std::size_t>(expert)]
                                                                                  : -1;
  }
};

}  // namespace hpmoe::taskflow
