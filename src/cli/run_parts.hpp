// The pieces of `hpmoe run` shared by its in-process path (run.cpp), its
// steps and their samples (run_steps.cpp) and its MPI path, one rank per
// process (run_sharded.cpp). Internal to the CLI.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cli/run.hpp"
#include "hpmoe/reference.hpp"
#include "hpmoe/layer.hpp"

namespace hpmoe::run_detail {

// Samples of one executor's steps, summarised into the report.
struct ExecutorSamples {
  double workers = 1;
  std::int64_t forward_put_bytes = 0, backward_put_bytes = 0;  // of the last step
  std::int64_t forward_cross_node_bytes = 0, backward_cross_node_bytes = 0;
  std::int64_t lent_experts = 0, forward_lent_bytes = 0, backward_lent_bytes = 0;
  std::vector<double> router, forward, backward, forward_busy, backward_busy, host;
  std::vector<std::vector<double>> forward_ops, backward_ops;
  std::vector<std::string> forward_names, backward_names;
  // A long run (a soak) keeps an even subsample: past kMaxSamples steps
  // every other kept sample is dropped and only every 2nd (4th, ...) step
  // is kept from then on, so the statistics stay a fixed size while the
  // medians still see the whole run (and ranks keep the same steps).
  static constexpr std::size_t kMaxSamples = 2048;
  std::int64_t seen = 0, stride = 1;

  double share(double busy_seconds,
               double seconds) const { return seconds > 0 ? busy_seconds / (workers * seconds) : 0.0; }

  // `host_seconds` < 0: none (the serialized executor).
  void add(const StepResult& r, double host_seconds = -1) {
    if (seen == 0)
      for (auto* v : {&router, &forward, &backward, &forward_busy, &backward_busy, &host}) allocate(*v);
    if (seen++ % stride != 0) return;
    if (forward.size() == kMaxSamples) {
      for (auto* v : {&router, &forward, &backward, &forward_busy, &backward_busy, &host}) halve(*v);
      for (auto& v : forward_ops) halve(v);
      for (auto& v : backward_ops) halve(v);
      stride *= 2;
      if ((seen - 1) % stride != 0) return;
    }
    if (host_seconds >= 0) host.push_back(host_seconds);
    forward_put_bytes = r.forward_put_bytes;
    backward_put_bytes = r.backward_put_bytes;
    forward_cross_node_bytes = r.forward_cross_node_bytes;
    backward_cross_node_bytes = r.backward_cross_node_bytes;
    lent_experts = r.lent_experts;
    forward_lent_bytes = r.forward_lent_bytes;
    backward_lent_bytes = r.backward_lent_bytes;
    router.push_back(r.router_seconds);
    forward.push_back(r.dispatch_to_combine_seconds);
    backward.push_back(r.backward_seconds);
    forward_busy.push_back(share(r.forward_busy_seconds, r.dispatch_to_combine_seconds));
    backward_busy.push_back(share(r.backward_busy_seconds, r.backward_seconds));
    auto record = [](const std::vector<OperatorTime>& ops, std::vector<std::string>& names,
                     std::vector<std::vector<double>>& samples) {
      if (samples.empty()) {
        for (const auto& op : ops) names.push_back(op.name);
        samples.resize(ops.size());
        for (auto& v : samples) allocate(v);
      }
      for (std::size_t i = 0; i < ops.size() && i < samples.size(); ++i) samples[i].push_back(ops[i].seconds);
    };
    record(r.forward_ops, forward_names, forward_ops);
    record(r.backward_ops, backward_names, backward_ops);
  }

  // The whole capacity up front, written once: a soak's memory is then flat
  // from the first step (it used to grow as the vectors doubled).
  static void allocate(std::vector<double>& v) {
    v.assign(kMaxSamples, 0.0);
    v.clear();
  }

  static void halve(std::vector<double>& v) {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < v.size(); i += 2) v[kept++] = v[i];
    v.resize(kept);
  }

  static std::vector<std::pair<std::string, Summary>> table(const std::vector<std::string>& names,
                                                            const std::vector<std::vector<double>>& samples) {
    std::vector<std::pair<std::string, Summary>> out;
    for (std::size_t i = 0; i < samples.size(); ++i) out.push_back({names[i], summarize(samples[i])});
    return out;
  }
};

// The layer a run measures, and which schedules it runs: the serialized
// baseline and the interleaved runtime, alternating on one layer (one
// packing of its weights, an engine per schedule). In process and over MPI
// (sharded: the baseline then runs on the same transport and links).
struct Executors {
  std::unique_ptr<Layer> layer;
  bool use_serialized = false, use_interleaved = false, trace = false;
};

// The measured steps of a run. Side by side: the schedules alternate on
// the same inputs; each one's last step is kept for the report.
struct Steps {
  ExecutorSamples serialized, interleaved;
  std::optional<Layer::Step> serial_step, inter_step;
  // The step the report describes and verifies: the serialized one's when
  // the run has it, else the interleaved one's.
  const StepResult& last() const { return (serial_step ? *serial_step : *inter_step).result(); }
  const StepResult& inter_last() const { return inter_step->result(); }
};

// The expert choices of every step: the same each step, or for a routing
// that changes every step (mixed) that step's draw; `rank` >= 0 keeps only
// that rank's tokens (a sharded process).
class StepChoices {
 public:
  StepChoices(const LayerConfig& c, const RoutingSpec& spec, int rank) : config_(c), spec_(spec), rank_(rank) {
    ids_ = draw(spec_);
  }
  // The routing of step `it` (its spec, for whoever recomputes it).
  RoutingSpec spec_of(int it) const {
    RoutingSpec s = spec_;
    if (s.changes_every_step()) s.step = static_cast<std::uint64_t>(it);
    return s;
  }
  std::span<const std::int32_t> at(int it) {
    if (spec_.changes_every_step()) ids_ = draw(spec_of(it));
    return ids_;
  }

 private:
  std::vector<std::int32_t> draw(const RoutingSpec& s) const {
    std::vector<std::int32_t> ids = forced_selection(config_, s);
    if (ids.empty() || rank_ < 0) return ids;
    const auto per_rank = static_cast<std::ptrdiff_t>(config_.tokens_per_rank * config_.top_k);
    return std::vector<std::int32_t>(ids.begin() + rank_ * per_rank, ids.begin() + (rank_ + 1) * per_rank);
  }
  const LayerConfig& config_;
  RoutingSpec spec_;
  int rank_;
  std::vector<std::int32_t> ids_;
};

std::vector<float> concat(const std::vector<Matrix>& ms);

std::vector<double> concat(const std::vector<std::vector<double>>& vs);

std::vector<float> rows_of(const Matrix& m, const std::vector<std::int64_t>& rows);

// The oracle's options for checking `res` of layer c: the executor's
// routing forced, all tokens where the oracle costs at most `full_flops`
// (or --verify full), else a sample spread over them (`salt` varies it by
// rank); false when verification is off.
bool plan_oracle(const RunRequest& req, const LayerConfig& c, const StepResult& res, double full_flops,
                 std::int64_t salt, Verification& v, OracleOptions& opt);

// The per-token checks: gate weights, out and (backward) dx of the
// oracle's tokens.
void check_tokens(Verification& v, const OracleResult& ref, const StepResult& res, DType dtype, bool backward);

// The layer of a run on `w` (moved in; read back through
// x.layer->weights()); over MPI with `expert_source`, which draws or reads
// each expert this process holds.
Executors make_executors(const RunRequest& req, LayerWeights w, const ExpertPlacement& placement,
                         ExpertSource expert_source = {});

// A whole step of `schedule` on the layer: the forward and, with backward,
// its backward on in.d_out.
Layer::Step one_step(Layer& layer, const LayerInputs& in, std::span<const std::int32_t> forced, Schedule schedule,
                     bool backward);

// A whole step of one executor bit for bit against another's: outputs and,
// with backward, every gradient.
Comparison bit_identity(const std::string& name, const StepResult& a, const StepResult& b, const LayerConfig& c,
                        bool backward);

// Routing statistics (from the exchanged counts), FLOPs and the balancing
// terms of the step reported.
void describe_step(RunReport& rep, const LayerConfig& c, const LayerWeights& w, const ExpertPlacement& placement,
                   const StepResult& last);

double current_rss_bytes();

// Open file descriptors of this process now.
std::int64_t open_files();

void run_steps(const RunRequest& req, Executors& x, const LayerInputs& in, StepChoices& choices, Steps& steps,
               SoakReport& soak, const std::function<void(const std::string&)>& say);

// What the report says of the run before any step.
RunReport report_header(const RunRequest& req, const ExpertPlacement& placement, const Executors& x);

// The executors' samples summarised into the report.
void summarize_into(RunReport& rep, const ExecutorSamples& serialized, const ExecutorSamples& interleaved);

double peak_rss_bytes();

// The soak's spot checks as one line of the verification.
Comparison soak_check(const SoakReport& soak);

// Over MPI, one rank per process: the process holds its rank's tokens,
// the replicated parameters and its own experts (raw weights released once
// packed), routes its own tokens, exchanges counts, compiles and launches
// its own program. The root prints the table.
RunReport run_sharded(const RunRequest& req, const std::function<void(const std::string&)>& say);

}  // namespace hpmoe::run_detail
