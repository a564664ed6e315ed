#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <map>
#include <string>
#include <vector>

#include "runtime/interleaved.hpp"
#include "hpmoe/config.hpp"
#include "kernels/peak.hpp"
#include "hpmoe/routing.hpp"
#include "runtime/interleaved.hpp"
#include "compiler/taskflow.hpp"

namespace hpmoe {

enum class VerifyMode { automatic, full, sample, off };
VerifyMode parse_verify_mode(const std::string&);

// Which executors a run uses (auto = both).
enum class RunMode { automatic, serialized, interleaved, both };
RunMode parse_run_mode(const std::string&);

struct RunRequest {
  LayerConfig config;
  std::string exchange_choice;  // --exchange auto: the scheme chosen and why (choose_run_exchange)
  RoutingSpec routing;
  ExpertPlacement placement;  // where the experts live; empty: contiguous
  int workers_per_rank = 1;
  bool backward = false;
  int iterations = 3;
  int warmup = 1;
  VerifyMode verify = VerifyMode::automatic;
  int sample_tokens = 16;
  std::uint64_t seed = 1;
  std::string load_dir;  // weights.safetensors + inputs.safetensors instead of random ones
  std::string save_dir;  // write the run's tensors here
  bool pin = true;
  RunMode mode = RunMode::automatic;
  std::string trace_file;     // Chrome/Perfetto trace of the last step of each executor
  std::string timeline_file;  // the same as an SVG Gantt chart
  taskflow::Policy policy = taskflow::Policy::critical_path;
  // The interleaved runtime's transport (null: in-process). With MPI, every
  // process calls run_layer; the root also runs the serialized baseline (in
  // process, as the reference) and verifies; only its report is complete.
  std::shared_ptr<Transport> transport;
  double watchdog_seconds = 10.0;
  RuntimeFault fault;
  // Over MPI (one rank per process, each holding only its own tokens and
  // experts): also run the whole layer in process on the root, gather every
  // rank's outputs and gradients there, and compare bit for bit. Small
  // layers only: the root then holds the whole layer once more.
  bool check_inprocess = false;
  // Over MPI: every process regenerates all ranks' programs and verifies the
  // whole set (an audit of the per-rank proof; P times the compile cost).
  bool verify_all_ranks = false;
  // A soak's spot checks: every `check_every` steps (and at the last), the
  // two executors' results of that step compared bit for bit, and this
  // process's resident memory and open files sampled. 0: off.
  int check_every = 0;
};

// What a run with check_every found, step by step.
struct SoakSample {
  std::int64_t step = 0;
  double rss_bytes = 0;  // VmRSS of the process at that step
  std::int64_t open_files = 0;
};
struct SoakReport {
  std::int64_t checks = 0, mismatches = 0;  // bit-identity spot checks (over MPI: summed over ranks)
  std::string first_mismatch;
  std::vector<SoakSample> samples;  // this process's (the root's over MPI)
  // Over MPI: every rank's resident memory at the first sample after the
  // warm-up and at the last, and its open files then.
  std::vector<std::array<double, 4>> ranks;  // rss first, rss last, files first, files last
};

// One rank's share of a sharded (MPI) run, as the root reports it.
struct RankSummary {
  int rank = 0;
  std::int64_t experts = 0, received_rows = 0;   // experts held; rows received in the last step
  double interleaved_forward = 0, interleaved_backward = 0;  // median seconds of this rank's launches
  double serialized_forward = 0, serialized_backward = 0;
  double host = 0;                               // median seconds of route + count exchange + compile + verify + prepare
  double peak_rss_bytes = 0;                     // VmHWM of the process
  double expert_weight_bytes = 0;                // packed expert weights held
  double segment_bytes = 0, local_bytes = 0;     // the last step's symmetric segment and local region
};

// One tensor of a fast path compared against the oracle.
// One tensor of a fast path compared against the oracle, or (bitwise) a
// whole step of one executor compared bit for bit against another's.
// The absolute floors of the oracle checks (per-element RMS): a check whose
// reference's RMS is below its floor passes when the difference's RMS is
// too, whatever their ratio.
inline constexpr double kFp32AbsFloor = 1e-7, kBf16AbsFloor = 1e-4;

struct Comparison {
  std::string tensor;
  double rel_l2 = 0, max_abs = 0, ref_max = 0;
  double abs_floor = 0;  // see kFp32AbsFloor
  bool pass = false;
  bool bitwise = false;          // a bit-identity check of `tensors` tensors
  std::int64_t tensors = 0;
  std::string differing;         // bitwise: the first tensor that differs
};

struct Verification {
  std::string mode;  // full, sample or off
  std::int64_t sample_tokens = 0;
  std::int64_t selection_mismatches = 0;  // tokens the oracle's own router would route differently
  std::vector<Comparison> checks;
  bool pass = true;
};

struct Summary {
  double median = 0, min = 0, max = 0;
  // Every measured step, in step order: the executors alternate step by
  // step, so sample i of one executor and sample i of the other are a pair
  // taken seconds apart (a speedup per pair cancels slow drifts of a
  // shared machine).
  std::vector<double> samples;
};
Summary summarize(std::vector<double> samples);

// Refuses (Error naming the parts and what to change) a run whose estimated
// memory exceeds what this machine has available, before anything is
// allocated. `sharded`: one MPI process's share.
void check_run_memory(const RunRequest& req, bool sharded);

struct RunReport {
  LayerConfig config;
  std::string exchange_choice;  // --exchange auto: the scheme chosen and why
  // Bytes the last step's puts carried to other ranks (StepResult).
  std::int64_t forward_put_bytes = 0, backward_put_bytes = 0;
  std::int64_t lent_experts = 0, forward_lent_bytes = 0, backward_lent_bytes = 0;  // weights instead of tokens, last step
  std::int64_t forward_cross_node_bytes = 0, backward_cross_node_bytes = 0;  // of those, to other nodes' ranks
  // The CPU and its FMA peak, measured at the start of the run: every GFLOP/s
  // figure is also given as a share of peak_cores x the peak per core.
  FmaPeak peak;
  int peak_cores = 1;
  std::string routing;
  std::string placement;  // describe(ExpertPlacement)
  int workers_per_rank = 1;
  int iterations = 0;
  bool backward = false;
  RoutingStats stats;
  double aux_loss = 0, z_loss = 0;
  std::vector<std::pair<std::string, Summary>> forward_ops, backward_ops;  // per operator, over iterations
  Summary router, dispatch_to_combine, backward_time;
  bool serialized = true, interleaved = false;  // which executors ran
  std::string transport = "in-process";
  std::string serialized_over;  // over MPI: the serialized baseline runs phased on this transport
  std::string policy;
  std::vector<std::pair<std::string, Summary>> interleaved_ops;
  Summary interleaved_d2c, interleaved_backward;
  // Workers' busy share (time in tasks or operator work over workers x time);
  // the rest is waiting at events or barriers.
  Summary serialized_busy, serialized_backward_busy, interleaved_busy, interleaved_backward_busy;
  double forward_flops = 0, backward_flops = 0;  // expert + shared (+ router in backward), this routing
  // FLOPs per step of each matrix operator (the phased executor's operator
  // names: gemm_gate_up, router_wgrad, ...), all ranks, this routing: the
  // operator table gives each its rate and share of the peak.
  std::map<std::string, double> operator_flops;
  double bias_update_max = 0;                    // largest |delta| of the aux-loss-free bias update
  Verification verification;
  // Over MPI: each process held only its rank; times are the maximum over
  // ranks of each step, and `ranks` has one row per rank.
  bool sharded = false;
  bool verified_per_rank = false;  // sharded: each rank proved only its own program
  std::vector<RankSummary> ranks;
  SoakReport soak;
};

// --exchange auto: req.config.exchange set to the scheme the simulator
// predicts fastest for this run on `machine` (a file or a name in
// machines/), and req.exchange_choice to why (run_exchange.cpp).
void choose_run_exchange(RunRequest& req, const std::string& machine);

// Compares a fast result with the oracle under the tolerances for the dtype
// (fp32: rel L2 <= 1e-5; bf16: rel L2 <= 1e-2 and max-abs <= 2% of max |ref|).
Comparison compare(const std::string& tensor, std::span<const float> fast, std::span<const double> ref, DType);

// Runs the serialized baseline, verifies it and measures it. `progress`
// receives short status lines.
RunReport run_layer(const RunRequest&, const std::function<void(const std::string&)>& progress = {});

nlohmann::json to_json(const RunReport&);
std::string format_report(const RunReport&);

}  // namespace hpmoe
