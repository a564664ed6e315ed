#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace hpmoe {

enum class Scoring { softmax, sigmoid };
enum class DType { fp32, bf16 };           // bf16: bf16 storage, fp32 accumulation
enum class DropPolicy { probs, position };  // which tokens a full expert drops (Megatron-Core)
// The format the dispatch sends tokens to their experts in: the layer's dtype,
// or narrower (bf16 under an fp32 layer; fp8 e4m3 with one fp32 scale per 128
// channels, as DeepSeek-V3). The experts compute on the tokens as decoded.
enum class DispatchDType { layer, fp32, bf16, fp8 };
// The backward's dispatch of the output gradients (dy): auto sends bf16
// under an fp32 layer whose forward dispatch is encoded, the layer's dtype
// otherwise.
enum class GradDispatchDType { automatic, layer, bf16 };
// What the per-rank combine's sums (and the backward's dx sums) travel in:
// the layer's dtype, or bf16 under an fp32 layer.
enum class CombineDType { layer, bf16 };
// How tokens travel to their experts: one row per (token, expert) pair, or
// each token once per destination rank, the rank's experts gathering their
// rows from the one copy (the backward sends dy the same way).
enum class ExchangeMode { assignment, rank };

std::string to_string(Scoring);
std::string to_string(DType);
std::string to_string(DropPolicy);
std::string to_string(DispatchDType);
std::string to_string(GradDispatchDType);
std::string to_string(CombineDType);
std::string to_string(ExchangeMode);

// What an expert-parallel MoE FFN layer is: its sizes, its router and
// balancing terms, and the dtype its weights and activations are stored in.
// The same layer runs under any RunOptions (its checkpoints, its oracle and
// its gradients do not depend on them).
struct LayerSpec {
  std::string name = "custom";

  // Sizes.
  std::int64_t hidden = 0;              // H
  std::int64_t expert_inter = 0;        // I, per routed expert
  std::int64_t routed_experts = 0;      // E
  std::int64_t shared_experts = 0;      // fused into one MLP of shared_experts * shared_inter
  std::int64_t shared_inter = 0;        // per shared expert; 0 means expert_inter
  std::int64_t top_k = 0;               // K

  // Router.
  Scoring scoring = Scoring::softmax;
  std::int64_t groups = 1;              // group-limited routing: expert groups ...
  std::int64_t groups_kept = 1;         // ... and how many a token may use
  bool normalize_topk = false;          // divide the K weights by their sum
  double route_scale = 1.0;             // multiply the K weights

  // Capacity: 0 means dropless. Otherwise each expert takes at most
  // ceil(factor * T * K / E) of a rank's assignments, dropping the rest.
  double capacity_factor = 0.0;
  DropPolicy drop_policy = DropPolicy::probs;

  // Training-time balancing.
  double aux_loss_coef = 0.0;           // Switch/GShard load-balancing loss
  double z_loss_coef = 0.0;             // router z-loss
  bool expert_bias = false;             // DeepSeek-V3 aux-loss-free bias (selection only)
  double bias_update_rate = 0.001;      // bias += rate * sign(mean load - load)

  DType dtype = DType::fp32;            // storage of weights and activations (fp32 accumulation)

  std::int64_t shared_inter_total() const {
    return shared_experts * (shared_inter > 0 ? shared_inter : expert_inter);
  }
};

// How a step of a layer runs: the expert-parallel degree and each rank's
// tokens, how tokens travel to their experts and back (the exchange scheme
// and the dtypes on its wire), the ranks of a node, and whether weights
// travel instead of rows. Where the experts live and how tasks are ordered
// are the layer's `Parallel` (layer.hpp).
struct RunOptions {
  std::int64_t tokens_per_rank = 0;     // T
  std::int64_t ranks = 1;               // P (expert-parallel degree)
  DispatchDType dispatch_dtype = DispatchDType::layer;
  GradDispatchDType grad_dispatch_dtype = GradDispatchDType::automatic;
  ExchangeMode exchange = ExchangeMode::assignment;
  CombineDType combine_dtype = CombineDType::layer;
  // Ranks per node (0: all ranks in one node). With the per-rank exchange
  // and 1 < ranks_per_node < ranks, a token crosses to another node once,
  // to the rank there with its own local index, which forwards it to the
  // ranks of its node that need it (forwards()).
  std::int64_t ranks_per_node = 0;
  // Whether the per-rank exchange forwards inside nodes (false: every token
  // goes straight to each rank, across nodes too; to compare the two).
  bool node_forwarding = true;
  // Weights instead of tokens (MoE-Prefill): each step, where a rank's own
  // rows for a remote expert reach a threshold, the expert's owner puts its
  // weights to that rank and the rows stay home (ExpertPlacement::Lend).
  // 0: never; kLendAuto: where the rows would move more bytes than the
  // weights on every link direction (lend_threshold()); N >= 1: where a
  // rank has N rows or more.
  static constexpr std::int64_t kLendAuto = -1;
  std::int64_t lend_weights = 0;

  std::int64_t total_tokens() const { return tokens_per_rank * ranks; }
  // Ranks per node as used (ranks when unset) and the nodes.
  std::int64_t node_ranks() const { return ranks_per_node > 0 ? ranks_per_node : ranks; }
  std::int64_t nodes() const { return ranks / node_ranks(); }
  // Whether the dispatch forwards tokens inside destination nodes.
  bool forwards() const { return exchange == ExchangeMode::rank && node_forwarding && node_ranks() > 1 && node_ranks() < ranks; }
};

// One step's whole description: the layer and how it runs. What the
// compiler, the engines and the simulator take; a config file or preset
// gives both parts (`hpmoe config` prints them as "layer" and "run").
struct LayerConfig : LayerSpec, RunOptions {
  LayerConfig() = default;
  LayerConfig(const LayerSpec& layer, const RunOptions& run) : LayerSpec(layer), RunOptions(run) {}

  const LayerSpec& spec() const { return *this; }
  LayerSpec& spec() { return *this; }
  const RunOptions& run() const { return *this; }
  RunOptions& run() { return *this; }

  // Rows of one (rank, expert) from which its weights are lent (0: never).
  // Auto: where the rows' narrower leg (dispatch or return, in the bytes
  // they travel in) outweighs the expert's packed weights, so that no link
  // direction at either end carries more than the rows would have.
  std::int64_t lend_threshold() const;

  // Whether the dispatch sends tokens narrower than the layer's dtype (a
  // quantize on the source, a decode on arrival), and the bytes of one
  // dispatched row then.
  bool staged_dispatch() const;
  std::int64_t dispatch_row_bytes() const;
  // Whether the backward sends dy in bf16 under an fp32 layer.
  bool staged_grad_dispatch() const;
  // Whether the per-rank combine's sums travel in bf16 under an fp32 layer
  // (the forward's sums and the backward's dx sums; gate gradients stay fp32).
  bool narrow_combine() const { return combine_dtype == CombineDType::bf16 && dtype == DType::fp32; }
  // Capacity per (rank, expert); -1 when dropless.
  std::int64_t expert_capacity() const;

  // Throws Error naming the first field that makes the layer impossible.
  void validate() const;

  // Sets one field from text, as `--set field=value` does. Throws Error on an
  // unknown field or a value that does not parse.
  void set(std::string_view field, std::string_view value);

  // FLOPs of one forward pass of routed + shared experts and router, whole layer.
  double forward_flops() const;
};

// Bytes of a weight [k, n] packed for the tile kernels, in any of their
// layouts: columns in whole panels of 64, and in bf16 K padded to 32 (the
// most any engine pads: oneDNN's AMX layout). What a lent weight travels as.
inline std::int64_t packed_weight_bytes(std::int64_t k, std::int64_t n, DType dtype) {
  const std::int64_t padded_k = dtype == DType::bf16 ? (k + 31) / 32 * 32 : k;
  return padded_k * ((n + 63) / 64 * 64) * (dtype == DType::bf16 ? 2 : 4);
}

// Every field name set() understands, for help texts; and which part each
// belongs to (the layer's, or how it runs).
std::vector<std::string> config_fields();
std::vector<std::string> layer_fields();
std::vector<std::string> run_fields();

// hpmoe's own format: one object of every field (to_json), or the two parts
// under "layer" and "run" (to_sections_json, what `hpmoe config` prints).
// config_from_json reads both; unknown keys, and a field in the other
// part's section, are errors.
nlohmann::json to_json(const LayerConfig&);
nlohmann::json to_sections_json(const LayerConfig&);
LayerConfig config_from_json(const nlohmann::json&);

std::vector<std::string> preset_names();
LayerConfig preset(std::string_view name);  // Error lists the presets
// A layer whose tiles do next to nothing (hidden 2, inter 2, 8 experts,
// top-2): what a step of it costs is the runtime's overhead.
LayerConfig empty_tiles_layer(std::int64_t ranks, std::int64_t tokens_per_rank);

// Reads a layer description from a file: hpmoe's own JSON, a Hugging Face
// style config.json (hidden_size, moe_intermediate_size, ...), or a DeepSeek
// inference config (dim, moe_inter_dim, ...). The format is detected from the
// keys. tokens_per_rank and ranks keep the defaults of `base`.
LayerConfig load_config_file(const std::string& path, const LayerConfig& base);
LayerConfig config_from_model_json(const nlohmann::json&, const LayerConfig& base,
                                   const std::string& source);

}  // namespace hpmoe
