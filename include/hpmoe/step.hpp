#pragma once
// What a layer's step returns: the output and gradients (or the caller's
// views they were written into), the routing, and where the time went.
#include <cstdint>
#include <string>
#include <vector>

#include "hpmoe/routing.hpp"
#include "hpmoe/tensors.hpp"

namespace hpmoe {

// What one worker did over one span of a step, for timelines: seconds from
// the step's start.
struct TraceSlice {
  std::int32_t rank = 0, worker = 0;
  double start = 0, end = 0;
  std::string name;    // operator or task kind
  std::string detail;  // expert and tile, when a task
};

// Wall time of one bulk-synchronous operator (all ranks, all workers).
struct OperatorTime {
  std::string name;
  double seconds = 0;
};

// Where a routed expert's weight gradients go in Hugging Face's layout
// ([out, in], the transpose of the math layout's): w1_t is [2I, H], the
// gate_proj gradient's I rows then up_proj's (one block, or two views of
// it), w2_t is down_proj's [H, I]; any row stride >= the row's length. In
// float32, or in bfloat16 (for bfloat16 parameters: each element rounded
// once from its float32 sum); one pair or the other.
struct ExpertGradientsInto {
  MutableMatrixView w1_t, w2_t;
  MutableBf16View w1_t_bf16, w2_t_bf16;
  bool in_bf16() const { return w1_t_bf16 && w2_t_bf16; }
  explicit operator bool() const { return (w1_t && w2_t) || in_bf16(); }
};

struct StepResult {
  // Optional, set by the caller before forward / backward: write the output
  // (and dx) into these views of the caller's memory ([hosted ranks x T, H],
  // any row stride) instead of `out` (and grads.x), which then stay empty.
  MutableMatrixView out_into, dx_into;
  // Optional, before backward: empty, or one entry per routed expert; an
  // expert whose entry is set (it must be one this process owns) gets its
  // gradients written there, and its grads.w1 / w2 are left as they were.
  // An expert computed whole by its owner's tiles has them stored there
  // transposed by the tiles themselves (no copy after the launch); a
  // replicated, lent or split one is summed as usual, then transposed in.
  std::vector<ExpertGradientsInto> expert_grads_into;
  Matrix out;                      // [hosted ranks x T, H]: this process's tokens
  LayerGradients grads;            // filled when backward
  RouterOutput<float> routing;     // what the fast path routed: the hosted ranks' tokens
                                   // (aux_loss and z_loss: summed over all ranks)
  std::vector<std::int64_t> expert_counts;  // [P, E] kept rows from each rank to each expert, all ranks
  // The first hosted rank's memory this step needs: its symmetric segment
  // (put targets, laid out alike on every rank) and its local region.
  std::int64_t segment_bytes = 0, local_bytes = 0;
  std::vector<OperatorTime> forward_ops;
  std::vector<OperatorTime> backward_ops;
  double router_seconds = 0;       // router GEMM and top-k: before dispatch
  double dispatch_to_combine_seconds = 0;  // forward, dispatch through combine
  double backward_seconds = 0;
  // Worker-seconds spent running tasks or operator work (not waiting at an
  // event or a barrier) in the forward dispatch-to-combine and the backward:
  // divided by workers x time, the workers' busy share.
  double forward_busy_seconds = 0, backward_busy_seconds = 0;
  // Bytes the step's puts carried to other ranks, forward and backward: the
  // exchange's payload as the hosted ranks' programs declare it (rows x row
  // bytes; over MPI this process's ranks only).
  std::int64_t forward_put_bytes = 0, backward_put_bytes = 0;
  // Of those, the bytes to ranks of other nodes (LayerConfig::ranks_per_node;
  // all of them when the ranks are one node: none).
  std::int64_t forward_cross_node_bytes = 0, backward_cross_node_bytes = 0;
  // Weights instead of tokens (LayerConfig::lend_weights): the (expert,
  // rank) pairs this step lent (every rank's), and of the put bytes above
  // those that carried lent weights.
  std::int64_t lent_experts = 0;
  std::int64_t forward_lent_bytes = 0, backward_lent_bytes = 0;
  std::vector<TraceSlice> trace;   // when tracing
};

}  // namespace hpmoe
