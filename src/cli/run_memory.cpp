// The memory a run of `hpmoe run` takes, estimated from the layer before
// anything is allocated, and refused with one line where it cannot fit.
// The terms are the big buffers: weights as drawn or read (fp32) and packed
// for the tile kernels, the tokens and their results, each executor's
// activations (rows of every assignment through the experts' GEMMs and
// SwiGLU, and in backward their gradients and packed transposes), and the
// weight gradients of each executor's kept result. Measured peaks
// (docs/reliability.md) sit at 0.6-1.0x of it.
#include <algorithm>
#include <string>

#include "cli/run.hpp"
#include "common/memory.hpp"

namespace hpmoe {

void check_run_memory(const RunRequest& req, bool sharded) {
  const LayerConfig& c = req.config;
  const double P = double(c.ranks), N = double(c.total_tokens()), H = double(c.hidden), I = double(c.expert_inter),
               K = double(c.top_k), E = double(c.routed_experts), Is = double(c.shared_inter_total());
  const double elem = c.dtype == DType::fp32 ? 4.0 : 2.0;
  const bool bwd = req.backward;
  // Over MPI a process holds its rank's share: its experts and tokens (the
  // replicated router and shared experts whole), its received rows at the
  // balanced average.
  const double share = sharded ? 1.0 / P : 1.0;
  const double expert_weights = 4.0 * E * 3.0 * H * I * share, replicated = 4.0 * (E * H + 3.0 * H * Is);
  const double raw = expert_weights + replicated;
  const double packed = raw * elem / 4.0 * (bwd ? 2.0 : 1.0);
  const double tokens = 4.0 * N * share * H * (bwd ? 6.0 : 3.0);
  const double rows = N * K * share;
  // Bytes per routed row, fitted to measured peaks (docs/reliability.md):
  // the forward's buffers come to about 6 H + 3 I floats a row, forward and
  // backward's to about 18 H + 19 I (activations kept for the backward,
  // their gradients, packed transposes, staging and the combine's rows).
  // bf16 layers keep some of them in fp32: counted as fp32 (the estimate
  // leans high there rather than low).
  const double per_executor = 4.0 * rows * (bwd ? 18.0 * H + 19.0 * I : 6.0 * H + 3.0 * I) +
                              4.0 * N * share * (bwd ? 6.0 * Is + 3.0 * H : 3.0 * Is + H);
  const int executors = req.mode == RunMode::serialized || req.mode == RunMode::interleaved ? 1 : 2;
  const double grads = bwd ? raw * executors : 0.0;
  // Copies of experts beyond their one home, per executor (they were not
  // counted: a run under --lend 1 took 6x the estimate, one with every
  // expert replicated 2.5x). A replica's partial weight gradient (fp32) in
  // backward, and its weights where it fetches them (received every step,
  // packed, and transposed for the backward); a lent copy the same as a
  // fetched replica. Lent pairs are bounded by the (expert, other rank)
  // pairs and by the rows that can reach the threshold.
  const double expert_bytes = 3.0 * H * I;  // elements of one expert's W1 and W2
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  double replicas = 0;  // homes past the first of whole experts (a split expert's parts are its one copy)
  for (std::int64_t e = 0; e < c.routed_experts; ++e)
    if (!placement.is_split(e)) replicas += double(placement.home_count(e) - 1);
  const double copy_bytes = expert_bytes * (elem * (bwd ? 2.0 : 1.0) + (bwd ? 4.0 : 0.0));
  double lent_pairs = 0;
  if (c.lend_weights != 0) {
    const double threshold = std::max<double>(1.0, double(c.lend_threshold()));
    lent_pairs = std::min(E * std::max(P - 1.0, 0.0), N * K / threshold);
  }
  const double copies = share * (replicas * ((placement.fetches_replicas() ? elem * (bwd ? 2.0 : 1.0) : 0.0) * expert_bytes +
                                             (bwd ? 4.0 * expert_bytes : 0.0)) +
                                 lent_pairs * copy_bytes);
  // The fp64 oracle holds the experts of a batch of checked tokens, at most about 1 GiB of them.
  const double oracle = req.verify == VerifyMode::off ? 0.0 : std::min(2.0 * raw, double(std::int64_t{1} << 30));
  const double total = raw + packed + tokens + executors * (per_executor + copies) + grads + oracle;
  require_memory(total, sharded ? "this rank of the run" : "this run",
                 "weights " + gib_text(raw) + ", packed " + gib_text(packed) + ", tokens " + gib_text(tokens) + ", " +
                     std::to_string(executors) + " x activations " + gib_text(per_executor) +
                     (bwd ? ", gradients " + gib_text(grads) : std::string()) +
                     (copies > 0 ? ", " + std::to_string(executors) + " x replicas and lent weights " + gib_text(copies)
                                 : std::string()) +
                     (oracle > 0 ? ", fp64 oracle " + gib_text(oracle) : std::string()),
                 "use fewer tokens (-T), ranks or experts, one executor (--mode interleaved), or a smaller layer");
}

}  // namespace hpmoe
