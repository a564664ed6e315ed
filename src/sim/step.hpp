#pragma once
// A whole training step of a model on a machine model: N transformer layers,
// each an attention block and either a dense FFN or the MoE layer, forward
// and backward, on one rank (data-parallel attention, expert-parallel MoE).
// The MoE layer is simulated tile by tile (sim::simulate, once per token
// count: layers that are alike share one simulation); attention and dense
// FFNs are costed from their FLOPs and bytes on the machine's rates. Five
// ways to run the MoE layers are compared: the framework's serialized
// operators (with the machine's own exchange baseline, DeepEP-style or
// MindSpore-style, where it has one), the same with two micro-batches
// overlapping one's exchange with the other's compute (DeepSeek-V3's
// scheme), and hpmoe's fused taskflow, alone and with micro-batch overlap.
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "sim/sim.hpp"

namespace hpmoe::sim {

struct StepRequest {
  SimRequest moe;                    // the MoE layer, its routing and placement (the backward is always simulated)
  std::int64_t layers = 0;           // transformer layers on the rank
  std::int64_t dense_layers = 0;     // of them, the first ones, with a dense FFN instead of the MoE layer
  std::int64_t dense_inter = 0;      // the dense FFN's intermediate width (0: 4 x hidden)
  std::int64_t seq_len = 4096;       // tokens of one sequence (the attention scores' context)
  double attention_params = 0;       // weights of one attention block (0: 4 hidden^2, Q K V O)
  std::int64_t attention_width = 0;  // heads x head dim of the scores (0: hidden)
  // Forward times of one attention block / dense FFN the user measured
  // (seconds at the layer's tokens per rank; the backward is 2x); < 0: from
  // FLOPs and bytes.
  double attention_s = -1, dense_s = -1;
  // Share of the compute units the exchange of one micro-batch takes while
  // it overlaps the other's compute (DeepSeek-V3: 20 of 132 SMs).
  double comm_share = 20.0 / 132.0;
  // Time of the rest of the step that no way changes (optimizer, data-
  // parallel gradient reduction, embedding and loss), seconds.
  double other_s = 0;
  // --exchange auto: the MoE layer's exchange scheme chosen by the simulator
  // at the full token count (simulate_choosing_exchange), then kept for the
  // micro-batches.
  bool choose_exchange = false;
};

// One way to run the step's MoE layers.
struct StepWay {
  std::string name;
  bool micro_batches = false;              // two micro-batches, exchange under compute
  double forward_s = 0, backward_s = 0;    // the whole step's passes
  double moe_forward_s = 0, moe_backward_s = 0;  // one MoE layer's passes (both micro-batches), as the way runs it
  double step_s() const { return forward_s + backward_s; }
};

// Attention block or dense FFN of one layer: forward seconds at a token count.
struct BlockCost {
  double gemm_s = 0, vector_s = 0;
  double total() const { return gemm_s + vector_s; }
};

struct StepReport {
  StepRequest request;
  SimReport layer, half;  // the MoE layer at T tokens per rank, and at T / 2 (one micro-batch)
  BlockCost attention, attention_half, dense, dense_half;
  std::vector<StepWay> ways;
  std::string baseline;       // the way speedups are against: the machine's framework exchange
  // The whole stack's parameters on the fullest rank: every MoE layer's
  // share (as the layer's memory check counts it), every attention block
  // and dense FFN (replicated: data-parallel attention); weights in the
  // layer's dtype, fp32 gradients, Adam's state where asked. A lower bound
  // of what the step needs: activations are not counted.
  double stack_parameter_bytes = 0;
  double simulate_seconds = 0;
};

StepReport simulate_step(const MachineModel&, const StepRequest&);
// What simulate_step refuses (layers, shares, times; at least 2 tokens a
// rank for two micro-batches): Error naming the option.
// The tokens of each of a step's two micro-batches: the larger half of T.
std::int64_t micro_batch_tokens(std::int64_t tokens_per_rank);
// One layer of two micro-batches, each `compute` seconds on the units
// and `exchange` seconds of exposed exchange: one's exchange runs under the
// other's compute, which loses `share` of the units while they overlap.
// `link_busy`: one micro-batch's busiest link time, where its exchange is
// longer than its exposed part (the fused run hides the rest under
// compute, not off the links): the two take at least twice that.
double micro_batched_layer_s(double compute, double exchange, double share, double link_busy = 0);
void check_step_request(const StepRequest&);
std::string format_step_report(const StepReport&);
nlohmann::json to_json(const StepReport&);
// The ways' steps as an SVG bar chart (forward, backward, the rest), to scale.
std::string step_chart_svg(const StepReport&);

// Forward cost of one attention block and one dense FFN at `tokens` per rank
// (the GEMMs at the machine's tile rates on every matrix unit a framework
// uses, the norms, residuals and activations at its vector rate).
BlockCost attention_cost(const MachineModel&, const StepRequest&, std::int64_t tokens);
BlockCost dense_cost(const MachineModel&, const StepRequest&, std::int64_t tokens);

}  // namespace hpmoe::sim
