#include "cli/run.hpp"
#include "cli/run_agree.hpp"
#include "common/stats.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <cmath>
#include <limits>
#include <fstream>
#include <optional>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "hpmoe/error.hpp"
#include "kernels/kernels.hpp"
#include "hpmoe/reference.hpp"
#include "runtime/interleaved.hpp"
#include "cli/trace.hpp"
#include "hpmoe/safetensors.hpp"

namespace hpmoe {

VerifyMode parse_verify_mode(const std::string& s) {
  if (s == "auto") return VerifyMode::automatic;
  if (s == "full") return VerifyMode::full;
  if (s == "sample") return VerifyMode::sample;
  if (s == "off") return VerifyMode::off;
  throw Error("unknown verification mode '" + s + "' (use auto, full, sample or off)");
}

RunMode parse_run_mode(const std::string& s) {
  if (s == "auto") return RunMode::automatic;
  if (s == "serialized") return RunMode::serialized;
  if (s == "interleaved") return RunMode::interleaved;
  if (s == "both") return RunMode::both;
  throw Error("unknown mode '" + s + "' (use auto, serialized, interleaved or both)");
}

Summary summarize(std::vector<double> v) {
  Summary s;
  if (v.empty()) return s;
  s.samples = v;
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  s.median = median(std::move(v));
  return s;
}

Comparison compare(const std::string& tensor, std::span<const float> fast, std::span<const double> ref, DType dtype) {
  if (fast.size() != ref.size()) throw Error("cannot compare " + tensor + ": sizes differ");
  Comparison c;
  c.tensor = tensor;
  double diff2 = 0, ref2 = 0;
  bool finite = true;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double d = double(fast[i]) - ref[i];
    finite = finite && std::isfinite(fast[i]);
    diff2 += d * d;
    ref2 += ref[i] * ref[i];
    c.max_abs = std::max(c.max_abs, std::abs(d));
    c.ref_max = std::max(c.ref_max, std::abs(ref[i]));
  }
  c.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  if (!finite) {  // std::max drops a NaN difference: say infinite, not 0 (and the report prints "inf", not "-nan")
    c.max_abs = std::numeric_limits<double>::infinity();
    c.rel_l2 = std::numeric_limits<double>::infinity();
  }
  if (dtype == DType::fp32) c.pass = finite && c.rel_l2 <= 1e-5;
  else c.pass = finite && c.rel_l2 <= 1e-2 && c.max_abs <= 0.02 * c.ref_max + 1e-30;
  return c;
}

namespace {

std::vector<float> concat(const std::vector<Matrix>& ms) {
  std::vector<float> out;
  for (const auto& m : ms) out.insert(out.end(), m.data.begin(), m.data.end());
  return out;
}
std::vector<double> concat(const std::vector<std::vector<double>>& vs) {
  std::vector<double> out;
  for (const auto& v : vs) out.insert(out.end(), v.begin(), v.end());
  return out;
}

std::vector<float> rows_of(const Matrix& m, const std::vector<std::int64_t>& rows) {
  std::vector<float> out;
  for (auto r : rows) out.insert(out.end(), m.row(r), m.row(r) + m.cols);
  return out;
}

// The oracle's options for checking `res` of layer c: the executor's
// routing forced, all tokens where the oracle costs at most `full_flops`
// (or --verify full), else a sample spread over them (`salt` varies it by
// rank); false when verification is off.
bool plan_oracle(const RunRequest& req, const LayerConfig& c, const StepResult& res, double full_flops, std::int64_t salt,
                 Verification& v, OracleOptions& opt) {
  VerifyMode mode = req.verify;
  if (mode == VerifyMode::off) {
    v.mode = "off";
    return false;
  }
  const double oracle_flops = c.forward_flops() * (req.backward ? 3.0 : 1.0);
  if (mode == VerifyMode::automatic) mode = oracle_flops <= full_flops ? VerifyMode::full : VerifyMode::sample;
  opt.forced_ids = res.routing.expert;
  opt.forced_kept = res.routing.kept;
  opt.dispatched_gates = res.routing.weight;
  opt.backward = req.backward;
  // Would the oracle's own fp64 router have chosen the same experts?
  opt.count_own_choice_differences = req.routing.source == RoutingSource::router;
  if (mode == VerifyMode::sample) {
    const std::int64_t n = c.total_tokens(), s = std::min<std::int64_t>(std::max(req.sample_tokens, 1), n);
    for (std::int64_t i = 0; i < s; ++i)
      opt.tokens.push_back((i * n) / s + (((i + salt) * 7919) % std::max<std::int64_t>(n / s, 1)));
  }
  v.mode = mode == VerifyMode::full ? "full" : "sample";
  return true;
}

// The per-token checks: gate weights, out and (backward) dx of the
// oracle's tokens.
void check_tokens(Verification& v, const OracleResult& ref, const StepResult& res, DType dtype, bool backward) {
  v.sample_tokens = static_cast<std::int64_t>(ref.tokens.size());
  v.selection_mismatches = ref.own_choice_differences;
  std::vector<double> weights(ref.routing.weight.begin(), ref.routing.weight.end());
  v.checks.push_back(compare("gate_weights", res.routing.weight, weights, DType::fp32));
  v.checks.push_back(compare("out", rows_of(res.out, ref.tokens), ref.out, dtype));
  if (backward) v.checks.push_back(compare("grad.x", rows_of(res.grads.x, ref.tokens), ref.dx, dtype));
}

Verification verify(const RunRequest& req, const LayerWeights& w, const LayerInputs& in, const StepResult& res) {
  const LayerConfig& c = req.config;
  Verification v;
  OracleOptions opt;
  if (!plan_oracle(req, c, res, 4e9, 0, v, opt)) return v;
  const OracleResult ref = reference_layer(c, w, in, opt);
  // A bf16 combine rounds each rank's (and node's) sums, which the oracle
  // does not: out and dx are held to bf16's tolerance then.
  check_tokens(v, ref, res, c.narrow_combine() ? DType::bf16 : c.dtype, req.backward);
  if (req.backward) {
    if (v.mode == "full") {
      v.checks.push_back(compare("grad.router", res.grads.router.data, ref.d_router, c.dtype));
      v.checks.push_back(compare("grad.w1", concat(res.grads.w1), concat(ref.d_w1), c.dtype));
      v.checks.push_back(compare("grad.w2", concat(res.grads.w2), concat(ref.d_w2), c.dtype));
      if (c.shared_experts > 0) {
        v.checks.push_back(compare("grad.shared_w1", res.grads.shared_w1.data, ref.d_shared_w1, c.dtype));
        v.checks.push_back(compare("grad.shared_w2", res.grads.shared_w2.data, ref.d_shared_w2, c.dtype));
      }
    }
  }
  for (const auto& ch : v.checks) v.pass = v.pass && ch.pass;
  return v;
}

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

  double share(double busy_seconds, double seconds) const { return seconds > 0 ? busy_seconds / (workers * seconds) : 0.0; }

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

// The executors of a run: the serialized baseline and the interleaved
// runtime. In process the baseline is its own executor; over MPI (sharded)
// it is the runtime's phased mode on the same transport.
struct Executors {
  std::unique_ptr<InterleavedExecutor> serial;
  std::unique_ptr<InterleavedExecutor> inter, phased;
  bool use_serialized = false, use_interleaved = false, trace = false;
};

Executors make_executors(const RunRequest& req, const LayerWeights& w, const ExpertPlacement& placement,
                         std::shared_ptr<const PackedWeights> packed, bool sharded, ExpertSource expert_source = {}) {
  const LayerConfig& c = req.config;
  Executors x;
  const RunMode mode = req.mode == RunMode::automatic ? RunMode::both : req.mode;
  x.use_serialized = mode != RunMode::interleaved;
  x.use_interleaved = mode != RunMode::serialized;
  x.trace = !req.trace_file.empty() || !req.timeline_file.empty();
  RuntimeOptions opt;
  opt.workers_per_rank = req.workers_per_rank;
  opt.backward = req.backward;
  opt.pin = req.pin;
  opt.packed = packed;
  opt.trace = x.trace;
  opt.placement = placement;
  if (x.use_serialized && !sharded) x.serial = std::make_unique<InterleavedExecutor>(c, w, serialized_schedule(opt));
  RuntimeOptions ropt;
  ropt.workers_per_rank = req.workers_per_rank;
  ropt.policy = req.policy;
  ropt.backward = req.backward;
  ropt.packed = packed;
  ropt.trace = x.trace;
  ropt.transport = req.transport;
  ropt.watchdog_seconds = req.watchdog_seconds;
  ropt.verify_all_ranks = req.verify_all_ranks;
  ropt.fault = req.fault;
  ropt.placement = placement;
  ropt.expert_source = std::move(expert_source);
  ropt.pin = !x.use_serialized || sharded ? req.pin : false;  // else the serialized executor's pool holds the pinned cores
  if (x.use_interleaved) x.inter = std::make_unique<InterleavedExecutor>(c, w, ropt);
  if (x.use_serialized && sharded) {
    ropt.phased = true;
    ropt.fault = {};
    x.phased = std::make_unique<InterleavedExecutor>(c, w, ropt);
  }
  return x;
}

// A whole step of one executor bit for bit against another's: outputs and,
// with backward, every gradient.
Comparison bit_identity(const std::string& name, const StepResult& a, const StepResult& b, const LayerConfig& c,
                        bool backward) {
  Comparison ch;
  ch.tensor = name;
  ch.bitwise = true;
  auto same = [&](const std::string& tensor, const Matrix& x, const Matrix& y) {
    ++ch.tensors;
    const bool equal = x.data.size() == y.data.size() &&
                       (x.data.empty() || std::memcmp(x.data.data(), y.data.data(), x.data.size() * sizeof(float)) == 0);
    if (!equal && ch.differing.empty()) ch.differing = tensor;
  };
  same("out", a.out, b.out);
  if (backward) {
    same("dx", a.grads.x, b.grads.x);
    same("router", a.grads.router, b.grads.router);
    if (c.shared_experts > 0) {
      same("shared w1", a.grads.shared_w1, b.grads.shared_w1);
      same("shared w2", a.grads.shared_w2, b.grads.shared_w2);
    }
    for (std::size_t e = 0; e < a.grads.w1.size() && e < b.grads.w1.size(); ++e) {
      same("w1 of expert " + std::to_string(e), a.grads.w1[e], b.grads.w1[e]);
      same("w2 of expert " + std::to_string(e), a.grads.w2[e], b.grads.w2[e]);
    }
  }
  ch.pass = ch.differing.empty();
  return ch;
}

// Routing statistics (from the exchanged counts), FLOPs and the balancing
// terms of the step reported.
void describe_step(RunReport& rep, const LayerConfig& c, const LayerWeights& w, const ExpertPlacement& placement,
                   const StepResult& last) {
  std::int64_t kept_rows = 0;
  for (const auto n : last.expert_counts) kept_rows += n;
  rep.stats = routing_stats(c, placement, last.expert_counts, c.total_tokens() * c.top_k - kept_rows);
  rep.aux_loss = last.routing.aux_loss;
  rep.z_loss = last.routing.z_loss;
  const double kept = double(rep.stats.assignments - rep.stats.dropped);
  const double n = double(c.total_tokens());
  rep.forward_flops = kept * 6.0 * double(c.hidden) * double(c.expert_inter) +
                      n * 6.0 * double(c.hidden) * double(c.shared_inter_total());
  rep.backward_flops = 2.0 * rep.forward_flops + 4.0 * n * double(c.hidden) * double(c.routed_experts);
  // Each operator's product: rows x 2 x (its K x N). The expert GEMMs run on
  // the kept assignments, the shared experts on every token. The router's
  // are left out: they run in fp32 whatever the layer's dtype, inside
  // operators that also do its softmax and top-k.
  const double H = double(c.hidden), I = double(c.expert_inter), Is = double(c.shared_inter_total());
  rep.operator_flops.clear();
  for (const char* op : {"gemm_gate_up", "gemm_gate_up_dgrad", "gemm_gate_up_wgrad"}) rep.operator_flops[op] = kept * 4.0 * H * I;
  for (const char* op : {"gemm_down", "gemm_down_dgrad", "gemm_down_wgrad"}) rep.operator_flops[op] = kept * 2.0 * H * I;
  if (Is > 0) {
    for (const char* op : {"shared_gate_up", "shared_gate_up_dgrad", "shared_gate_up_wgrad"}) rep.operator_flops[op] = n * 4.0 * H * Is;
    for (const char* op : {"shared_down", "shared_down_dgrad", "shared_down_wgrad"}) rep.operator_flops[op] = n * 2.0 * H * Is;
  }
  if (c.expert_bias) {
    std::vector<float> bias = w.expert_bias;
    update_expert_bias(bias, rep.stats.tokens_per_expert, c.bias_update_rate);
    for (std::size_t i = 0; i < bias.size(); ++i)
      rep.bias_update_max = std::max(rep.bias_update_max, double(std::abs(bias[i] - w.expert_bias[i])));
  }
}


// The measured steps of a run. Side by side: the executors alternate on
// the same inputs.
struct Steps {
  ExecutorSamples serialized, interleaved;
  StepResult last, inter_last;
};

// A memory figure of this process from /proc/self/status ("VmRSS:" now,
// "VmHWM:" its peak), in bytes; 0 where unknown.
double status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size())) * 1024.0;
  return 0;
}
double current_rss_bytes() { return status_bytes("VmRSS:"); }
// Open file descriptors of this process now.
std::int64_t open_files() {
  std::error_code ec;
  std::int64_t n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec))
    ++n;
  return n;
}

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

void run_steps(const RunRequest& req, Executors& x, const LayerInputs& in, StepChoices& choices, Steps& steps,
               SoakReport& soak, const std::function<void(const std::string&)>& say) {
  steps.serialized.workers = steps.interleaved.workers = double(req.config.ranks * req.workers_per_rank);
  const int total = req.warmup + req.iterations;
  for (int it = 0; it < total; ++it) {
    say("step " + std::to_string(it + 1) + "/" + std::to_string(total) + (it < req.warmup ? " (warm-up)" : ""));
    const bool measured = it >= req.warmup;
    const std::span<const std::int32_t> forced = choices.at(it);
    if (x.inter) {
      x.inter->step(in, forced, steps.inter_last);
      if (measured) {
        double h = 0;
        for (const auto& op : steps.inter_last.forward_ops)
          if (op.name != "launch") h += op.seconds;
        steps.interleaved.add(steps.inter_last, h);
      }
    }
    if (x.use_serialized) {
      if (x.phased) x.phased->step(in, forced, steps.last);
      else x.serial->step(in, forced, steps.last);
      if (measured) steps.serialized.add(steps.last);
    }
    if (req.check_every > 0 && ((it + 1) % req.check_every == 0 || it + 1 == total)) {
      if (x.inter && x.use_serialized) {
        const Comparison ch = bit_identity("interleaved = serialized", steps.last, steps.inter_last, req.config, req.backward);
        ++soak.checks;
        if (!ch.pass) {
          ++soak.mismatches;
          if (soak.first_mismatch.empty()) soak.first_mismatch = "step " + std::to_string(it + 1) + ": " + ch.differing;
        }
      }
      soak.samples.push_back({it + 1, current_rss_bytes(), open_files()});
    }
  }
}

// What the report says of the run before any step.
RunReport report_header(const RunRequest& req, const ExpertPlacement& placement, const Executors& x) {
  RunReport rep;
  rep.peak = measure_fma_peak();
  const auto cores = static_cast<std::int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  rep.peak_cores = static_cast<int>(std::min<std::int64_t>(cores, req.config.ranks * req.workers_per_rank));
  rep.serialized = x.use_serialized;
  rep.interleaved = x.use_interleaved;
  if (req.transport) rep.transport = req.transport->describe();
  rep.policy = taskflow::name(req.policy);
  rep.config = req.config;
  rep.routing = req.routing.describe();
  rep.placement = describe(placement);
  rep.workers_per_rank = req.workers_per_rank;
  rep.iterations = req.iterations;
  rep.backward = req.backward;
  return rep;
}

// The executors' samples summarised into the report.
void summarize_into(RunReport& rep, const ExecutorSamples& serialized, const ExecutorSamples& interleaved) {
  rep.forward_ops = ExecutorSamples::table(serialized.forward_names, serialized.forward_ops);
  rep.backward_ops = ExecutorSamples::table(serialized.backward_names, serialized.backward_ops);
  rep.interleaved_ops = ExecutorSamples::table(interleaved.forward_names, interleaved.forward_ops);
  rep.interleaved_d2c = summarize(interleaved.forward);
  rep.interleaved_backward = summarize(interleaved.backward);
  rep.interleaved_busy = summarize(interleaved.forward_busy);
  rep.interleaved_backward_busy = summarize(interleaved.backward_busy);
  rep.router = summarize(serialized.router);
  rep.dispatch_to_combine = summarize(serialized.forward);
  rep.backward_time = summarize(serialized.backward);
  rep.serialized_busy = summarize(serialized.forward_busy);
  rep.serialized_backward_busy = summarize(serialized.backward_busy);
  const ExecutorSamples& any = interleaved.forward.empty() ? serialized : interleaved;
  rep.forward_put_bytes = any.forward_put_bytes;
  rep.backward_put_bytes = any.backward_put_bytes;
  rep.forward_cross_node_bytes = any.forward_cross_node_bytes;
  rep.backward_cross_node_bytes = any.backward_cross_node_bytes;
  rep.lent_experts = any.lent_experts;
  rep.forward_lent_bytes = any.forward_lent_bytes;
  rep.backward_lent_bytes = any.backward_lent_bytes;
}

double peak_rss_bytes() { return status_bytes("VmHWM:"); }

// Every rank's `mine` (the same length on every rank), in rank order.
std::vector<std::vector<double>> allgather_doubles(Transport& tr, int me, const std::vector<double>& mine) {
  const std::size_t n = mine.size();
  std::vector<double> all(n * static_cast<std::size_t>(tr.ranks()), 0.0);
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(me)));
  tr.allgather(std::as_writable_bytes(std::span<double>(all)), n * sizeof(double));
  std::vector<std::vector<double>> out(static_cast<std::size_t>(tr.ranks()));
  for (std::size_t q = 0; q < out.size(); ++q)
    out[q].assign(all.begin() + static_cast<std::ptrdiff_t>(q * n), all.begin() + static_cast<std::ptrdiff_t>((q + 1) * n));
  return out;
}

// The soak's spot checks as one line of the verification.
Comparison soak_check(const SoakReport& soak) {
  Comparison ch;
  ch.tensor = "soak: interleaved = serialized, spot checks (a tensor = a step checked whole)";
  ch.bitwise = true;
  ch.tensors = soak.checks;
  ch.pass = soak.mismatches == 0;
  if (soak.mismatches > 0) ch.differing = std::to_string(soak.mismatches) + " steps, first at " + soak.first_mismatch;
  return ch;
}

// A sharded soak's figures: mismatches summed over ranks, and every rank's
// memory and open files at the first and last samples.
void gather_soak(Transport& tr, int me, int warmup, SoakReport& soak) {
  if (soak.samples.empty()) return;
  const auto after_warmup = std::find_if(soak.samples.begin(), soak.samples.end(),
                                         [&](const SoakSample& x) { return x.step > warmup; });
  const SoakSample& first = after_warmup != soak.samples.end() ? *after_warmup : soak.samples.back();
  const SoakSample& final_sample = soak.samples.back();
  const auto all = allgather_doubles(tr, me, {first.rss_bytes, final_sample.rss_bytes, double(first.open_files),
                                              double(final_sample.open_files), double(soak.mismatches)});
  soak.mismatches = 0;
  for (const auto& r : all) {
    soak.ranks.push_back({r[0], r[1], r[2], r[3]});
    soak.mismatches += static_cast<std::int64_t>(r[4]);
  }
}

// Each step's time as the slowest rank's: the step ends when every rank has.
void slowest_rank(Transport& tr, int me, std::vector<double>& samples) {
  const auto all = allgather_doubles(tr, me, samples);
  for (const auto& rank : all)
    for (std::size_t i = 0; i < samples.size(); ++i) samples[i] = std::max(samples[i], rank[i]);
}

// The experts a rank holds weights of (its own and its replicas).
std::vector<std::int32_t> experts_of(const ExpertPlacement& placement, int rank) {
  const auto span = placement.experts_of(rank);
  return {span.begin(), span.end()};
}

// The experts a rank owns: it holds their gradients and saves them.
std::vector<std::int32_t> owned_by(const ExpertPlacement& placement, int rank) {
  std::vector<std::int32_t> out;
  for (const std::int32_t e : placement.experts_of(rank))
    if (placement.owner(e) == rank) out.push_back(e);
  return out;
}

// Rows a rank computes in a step: its experts' rows, a replicated expert's
// as the quota plan divides them.
std::int64_t rows_into(const ExpertPlacement& placement, std::span<const std::int64_t> counts, int rank) {
  const auto per_instance = instance_rows(placement, counts);
  std::int64_t rows = 0;
  for (std::int64_t i = 0; i < placement.instances(); ++i)
    if (placement.instance_rank(i) == rank) rows += per_instance[static_cast<std::size_t>(i)];
  return rows;
}

// Rank `me`'s tokens checked against the fp64 oracle on this process alone:
// the oracle runs the layer as if it had one rank (routing, capacity and the
// balancing terms are per rank, so every per-token value is the same), with
// the experts the sampled tokens chose drawn again from their seeds (or
// read from the checkpoint) where another rank owns them.
Verification verify_own_tokens(const RunRequest& req, const LayerWeights& held, const LayerInputs& in,
                               const StepResult& res, int me, const Checkpoint* checkpoint) {
  LayerConfig lc = req.config;
  lc.ranks = 1;
  lc.ranks_per_node = 0;
  Verification v;
  OracleOptions opt;
  if (!plan_oracle(req, lc, res, 1e9, me, v, opt)) return v;
  const std::int64_t K = lc.top_k;
  if (opt.tokens.empty())  // every own token; weight gradients need every rank's tokens
    for (std::int64_t t = 0; t < lc.tokens_per_rank; ++t) opt.tokens.push_back(t);
  // The experts the checked tokens use: the replicated parameters are here,
  // the experts drawn (or read) one by one. Tokens go to the oracle in
  // batches whose experts fit in about 1 GB, so checking a large layer
  // never holds more than that of remote experts at once.
  LayerWeights w;
  w.router = held.router;
  w.expert_bias = held.expert_bias;
  w.shared_w1 = held.shared_w1;
  w.shared_w2 = held.shared_w2;
  w.w1.resize(static_cast<std::size_t>(lc.routed_experts));
  w.w2.resize(static_cast<std::size_t>(lc.routed_experts));
  const double expert_bytes = 12.0 * double(lc.hidden) * double(lc.expert_inter);
  const auto budget = static_cast<std::size_t>(std::max<double>(double(K), 1e9 / expert_bytes));
  std::vector<std::int32_t> present;
  std::vector<std::int64_t> batch;
  OracleResult ref;
  bool first = true;
  auto flush = [&] {
    if (batch.empty()) return;
    OracleOptions part = opt;
    part.tokens = batch;
    OracleResult r = reference_layer(lc, w, in, part);
    if (first) {
      ref.routing = std::move(r.routing);
      ref.own_choice_differences = r.own_choice_differences;
      first = false;
    }
    ref.tokens.insert(ref.tokens.end(), r.tokens.begin(), r.tokens.end());
    ref.out.insert(ref.out.end(), r.out.begin(), r.out.end());
    ref.dx.insert(ref.dx.end(), r.dx.begin(), r.dx.end());
    for (const auto e : present) w.w1[e] = Matrix(), w.w2[e] = Matrix();
    present.clear();
    batch.clear();
  };
  for (const auto t : opt.tokens) {
    std::vector<std::int32_t> fresh;
    for (std::int64_t k = 0; k < K; ++k) {
      const auto a = static_cast<std::size_t>(t * K + k);
      const std::int32_t e = res.routing.expert[a];
      if (res.routing.kept[a] && !holds_expert(w, e) && std::find(fresh.begin(), fresh.end(), e) == fresh.end())
        fresh.push_back(e);
    }
    if (present.size() + fresh.size() > budget) {
      flush();
      fresh.clear();
      for (std::int64_t k = 0; k < K; ++k) {
        const auto a = static_cast<std::size_t>(t * K + k);
        const std::int32_t e = res.routing.expert[a];
        if (res.routing.kept[a] && std::find(fresh.begin(), fresh.end(), e) == fresh.end()) fresh.push_back(e);
      }
    }
    for (const auto e : fresh) {
      if (checkpoint) load_expert(*checkpoint, req.config, e, w);
      else random_expert(req.config, req.seed, e, w);
      present.push_back(e);
    }
    batch.push_back(t);
  }
  flush();
  check_tokens(v, ref, res, lc.narrow_combine() ? DType::bf16 : lc.dtype, req.backward);
  for (const auto& ch : v.checks) v.pass = v.pass && ch.pass;
  return v;
}

// Every rank's verification, summarised on every process: each tensor's
// worst rank (largest relative L2), passing only if every rank passed.
Verification merge_verifications(Transport& tr, int me, const Verification& mine) {
  std::vector<double> block{double(mine.sample_tokens), double(mine.selection_mismatches), mine.pass ? 1.0 : 0.0};
  for (const auto& ch : mine.checks) block.insert(block.end(), {ch.rel_l2, ch.max_abs, ch.ref_max, ch.pass ? 1.0 : 0.0});
  const auto all = allgather_doubles(tr, me, block);
  Verification v = mine;
  v.sample_tokens = 0;
  v.selection_mismatches = 0;
  v.pass = true;
  for (std::size_t q = 0; q < all.size(); ++q) {
    v.sample_tokens += static_cast<std::int64_t>(all[q][0]);
    v.selection_mismatches += static_cast<std::int64_t>(all[q][1]);
    v.pass = v.pass && all[q][2] != 0;
  }
  for (std::size_t i = 0; i < v.checks.size(); ++i) {
    Comparison& ch = v.checks[i];
    std::size_t worst = 0;
    for (std::size_t q = 0; q < all.size(); ++q) {
      const double* f = all[q].data() + 3 + 4 * i;
      if (q == 0 || f[0] > all[worst][3 + 4 * i]) worst = q;
      ch.pass = (q == 0 ? true : ch.pass) && f[3] != 0;
    }
    const double* f = all[worst].data() + 3 + 4 * i;
    ch.rel_l2 = f[0];
    ch.max_abs = f[1];
    ch.ref_max = f[2];
    ch.tensor += " (worst: rank " + std::to_string(worst) + ")";
  }
  return v;
}

// One sharded step gathered onto the root: every rank's token rows and its
// experts' gradients (the replicated gradients are already on every rank).
StepResult gather_step(Transport& tr, int me, const LayerConfig& c, const ExpertPlacement& placement,
                       const StepResult& mine, bool backward) {
  const bool root = tr.is_root();
  const std::int64_t T = c.tokens_per_rank, H = c.hidden;
  StepResult all;
  if (root) {
    all.out = Matrix(c.total_tokens(), H);
    if (backward) {
      all.grads = zero_gradients(c);
      all.grads.router = mine.grads.router;
      all.grads.shared_w1 = mine.grads.shared_w1;
      all.grads.shared_w2 = mine.grads.shared_w2;
    }
  }
  auto rows = [&](const Matrix& local, Matrix& whole) {
    for (int q = 0; q < tr.ranks(); ++q) {
      if (q == me && root) {
        std::copy(local.data.begin(), local.data.end(), whole.data.begin() + static_cast<std::ptrdiff_t>(q * T * H));
        continue;
      }
      std::vector<float> piece = q == me ? local.data : std::vector<float>(root ? static_cast<std::size_t>(T * H) : 0);
      tr.gather(piece, q);
      if (root) std::copy(piece.begin(), piece.end(), whole.data.begin() + static_cast<std::ptrdiff_t>(q * T * H));
    }
  };
  rows(mine.out, all.out);
  if (!backward) return all;
  rows(mine.grads.x, all.grads.x);
  for (int q = 0; q < tr.ranks(); ++q) {
    const auto experts = owned_by(placement, q);
    const std::size_t each = static_cast<std::size_t>(H * 2 * c.expert_inter + c.expert_inter * H);
    std::vector<float> packed(q == me || root ? experts.size() * each : 0);
    if (q == me)
      for (std::size_t i = 0; i < experts.size(); ++i) {
        const auto& g1 = mine.grads.w1[experts[i]].data;
        const auto& g2 = mine.grads.w2[experts[i]].data;
        std::copy(g1.begin(), g1.end(), packed.begin() + static_cast<std::ptrdiff_t>(i * each));
        std::copy(g2.begin(), g2.end(), packed.begin() + static_cast<std::ptrdiff_t>(i * each + g1.size()));
      }
    if (!(q == me && root)) tr.gather(packed, q);
    if (!root) continue;
    for (std::size_t i = 0; i < experts.size(); ++i) {
      auto& g1 = all.grads.w1[experts[i]].data;
      auto& g2 = all.grads.w2[experts[i]].data;
      std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(i * each), g1.size(), g1.begin());
      std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(i * each + g1.size()), g2.size(), g2.begin());
    }
  }
  return all;
}

// A sharded save in two phases: every rank stages its files, the ranks
// agree that all succeeded, and only then is anything put in place (rank 0
// writing the index last). A rank that could not write (a full disk, a
// file-size limit) leaves the folder's earlier checkpoint whole on all.
void save_sharded(Transport& tr, int me, const std::string& dir, const RankTensors& t, const ExpertPlacement& placement) {
  std::optional<SaveSet> staged;
  std::string failure;
  try {
    staged.emplace(stage_rank(dir, t));
  } catch (const std::exception& e) {
    failure = e.what();
  }
  const auto staged_everywhere = allgather_doubles(tr, me, {failure.empty() ? 1.0 : 0.0});
  const std::string unchanged = ": nothing of this save was put in place, and the checkpoint there before is unchanged";
  if (!failure.empty()) throw Error(failure + unchanged);
  for (std::size_t q = 0; q < staged_everywhere.size(); ++q)
    if (staged_everywhere[q][0] == 0)
      throw Error("rank " + std::to_string(q) + " could not write its part of the save to '" + dir + "' (its error says why)" +
                  unchanged);
  staged->commit();
  allgather_doubles(tr, me, {1.0});  // every rank's files in place before rank 0 writes the index
  if (me == 0) finish_sharded_save(dir, t.config, placement);
}

// Over MPI, one rank per process: the process holds its rank's tokens,
// the replicated parameters and its own experts (raw weights released once
// packed), routes its own tokens, exchanges counts, compiles and launches
// its own program. The root prints the table.
RunReport run_sharded(const RunRequest& req, const std::function<void(const std::string&)>& say) {
  const LayerConfig& c = req.config;
  Transport& tr = *req.transport;
  int me = 0;
  while (!tr.hosts(me)) ++me;
  agree_on_request(tr, me, req);
  check_run_memory(req, true);
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  const auto held = experts_of(placement, me), owned = owned_by(placement, me);
  const std::vector<int> mine{me};
  say(req.load_dir.empty() ? "generating this rank's experts and tokens" : "loading this rank's experts and tokens from " + req.load_dir);
  // The replicated parameters now; each own expert generated (or read) and
  // packed in turn below.
  std::optional<Checkpoint> checkpoint;  // opened once: each expert is read from it by seeking
  if (!req.load_dir.empty()) checkpoint.emplace(req.load_dir);
  LayerWeights w = req.load_dir.empty() ? random_weights(c, req.seed, {}) : load_weights(req.load_dir, c, {});
  LayerInputs in = req.load_dir.empty() ? random_inputs(c, req.seed, mine) : load_inputs(req.load_dir, c, me, req.backward ? DOut::required : DOut::optional);
  StepChoices choices(c, req.routing, me);
  const RoutingSpec last_routing = choices.spec_of(req.warmup + req.iterations - 1);
  say("generating and packing this rank's experts for the tile kernels");
  const ExpertSource fetch = [&](std::int64_t e, LayerWeights& into) {
    if (checkpoint) load_expert(*checkpoint, c, e, into);
    else random_expert(c, req.seed, e, into);
  };
  // Whole experts packed here; the executor packs only its parts of split ones.
  std::vector<std::int32_t> whole;
  for (const std::int32_t e : held)
    if (!placement.is_split(e)) whole.push_back(e);
  const auto packed = pack_weights(c, w, req.backward, whole, fetch);
  Executors x = make_executors(req, w, placement, packed, true, fetch);

  RunReport rep = report_header(req, placement, x);
  rep.sharded = true;
  rep.verified_per_rank = !req.verify_all_ranks;
  rep.serialized_over = rep.transport;

  Steps steps;
  run_steps(req, x, in, choices, steps, rep.soak, say);
  gather_soak(tr, me, req.warmup, rep.soak);
  auto& [serialized, interleaved, last, inter_last] = steps;
  // The table's row of this rank, and every step's time as the slowest rank's.
  const StepResult& shown = x.inter ? inter_last : last;
  const std::int64_t received = rows_into(placement, shown.expert_counts, me);
  const double elem = c.dtype == DType::fp32 ? 4.0 : 2.0;
  const std::vector<double> row{double(me), double(held.size()), double(received),
                                summarize(interleaved.forward).median, summarize(interleaved.backward).median,
                                summarize(serialized.forward).median, summarize(serialized.backward).median,
                                summarize(interleaved.host).median, peak_rss_bytes(),
                                double(held.size()) * double(3 * c.hidden * c.expert_inter) * elem * (req.backward ? 2.0 : 1.0),
                                double(shown.segment_bytes), double(shown.local_bytes)};
  for (const auto& r : allgather_doubles(tr, me, row))
    rep.ranks.push_back(RankSummary{static_cast<int>(r[0]), static_cast<std::int64_t>(r[1]), static_cast<std::int64_t>(r[2]),
                                    r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11]});
  for (auto* v : {&interleaved.forward, &interleaved.backward, &serialized.forward, &serialized.backward})
    slowest_rank(tr, me, *v);
  summarize_into(rep, serialized, interleaved);
  describe_step(rep, c, w, placement, shown);

  if (req.verify != VerifyMode::off) say("verifying this rank's tokens against the fp64 oracle");
  rep.verification = merge_verifications(tr, me, verify_own_tokens(req, w, in, shown, me, checkpoint ? &*checkpoint : nullptr));
  auto record = [&](const Comparison& ch) {
    rep.verification.checks.push_back(ch);
    rep.verification.pass = rep.verification.pass && ch.pass;
  };
  if (x.inter && x.phased) {  // on every rank, then whether all ranks agree
    const Comparison local = bit_identity("interleaved = serialized", last, inter_last, c, req.backward);
    Comparison ch = local;
    for (const auto& r : allgather_doubles(tr, me, {local.pass ? 1.0 : 0.0, double(local.tensors)})) {
      ch.pass = ch.pass && r[0] != 0;
      if (r[0] == 0 && ch.differing.empty()) ch.differing = "on some rank";
    }
    ch.tensor = "interleaved = serialized (every rank, its own tensors)";
    record(ch);
  }
  if (rep.soak.checks > 0) record(soak_check(rep.soak));
  if (req.check_inprocess) {
    // The whole layer once more on the root, in process, from the same seeds
    // (or checkpoint), as the bit-for-bit reference of every MPI executor.
    std::unique_ptr<InterleavedExecutor> serial;
    LayerWeights whole;
    LayerInputs whole_in;
    StepResult reference;
    if (tr.is_root()) {
      say("running the whole layer in process on the root as the reference");
      whole = req.load_dir.empty() ? random_weights(c, req.seed) : load_weights(req.load_dir, c);
      whole_in = req.load_dir.empty() ? random_inputs(c, req.seed) : load_inputs(req.load_dir, c, req.backward ? DOut::required : DOut::optional);
      RuntimeOptions opt;
      opt.workers_per_rank = req.workers_per_rank;
      opt.backward = req.backward;
      opt.pin = false;
      opt.placement = placement;
      serial = std::make_unique<InterleavedExecutor>(c, whole, serialized_schedule(opt));
      serial->step(whole_in, forced_selection(c, last_routing), reference);
    }
    for (const auto& [name, result] : {std::pair<std::string, const StepResult*>{"phased (mpi)", x.phased ? &last : nullptr},
                                       {"interleaved (mpi)", x.inter ? &inter_last : nullptr}}) {
      if (!result) continue;
      const StepResult gathered = gather_step(tr, me, c, placement, *result, req.backward);
      if (tr.is_root()) record(bit_identity(name + " = in-process serialized", gathered, reference, c, req.backward));
    }
  }
  if (!req.save_dir.empty()) {
    say("saving this rank's tensors to " + req.save_dir);
    RankTensors t;
    t.config = c;
    t.placement = &placement;
    t.rank = me;
    t.experts = owned;
    t.expert = [&](std::int64_t e, LayerWeights& into) {  // released after packing: drawn or read again
      if (checkpoint) load_expert(*checkpoint, c, e, into);
      else random_expert(c, req.seed, e, into);
    };
    t.weights = &w;
    t.inputs = &in;
    t.routing = &shown.routing;
    t.out = &shown.out;
    t.grads = req.backward ? &shown.grads : nullptr;
    save_sharded(tr, me, req.save_dir, t, placement);
  }
  if (x.trace && tr.is_root()) {
    std::vector<TracedRun> runs;
    if (x.phased) runs.push_back({"serialized (phased, rank 0's workers)", &last});
    if (x.inter) runs.push_back({"interleaved (" + std::string(taskflow::name(req.policy)) + "), rank 0's workers", &inter_last});
    if (!req.trace_file.empty()) write_chrome_trace(req.trace_file, runs);
    if (!req.timeline_file.empty()) write_timeline_svg(req.timeline_file, runs);
  }
  return rep;
}

}  // namespace

RunReport run_layer(const RunRequest& req, const std::function<void(const std::string&)>& progress) {
  auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  const LayerConfig& c = req.config;
  c.validate();
  if (req.iterations < 1 || req.iterations > 100000) throw Error("iterations must be between 1 and 100000");
  if (req.warmup < 0 || req.warmup > 100000) throw Error("warm-up iterations must be between 0 and 100000");

  if (req.transport) return run_sharded(req, say);  // MPI, one rank per process (P = 1 too)
  if (req.check_inprocess) throw Error("--check-inprocess compares an MPI run with the in-process one; use it with --transport mpi");
  if (req.verify_all_ranks)
    throw Error("--verify-all-ranks audits the per-rank proof of an MPI run (in process the whole set is always verified); "
                "use it with --transport mpi");

  check_run_memory(req, false);
  say(req.load_dir.empty() ? "generating weights and inputs" : "loading weights and inputs from " + req.load_dir);
  LayerWeights w = req.load_dir.empty() ? random_weights(c, req.seed) : load_weights(req.load_dir, c);
  LayerInputs in = req.load_dir.empty() ? random_inputs(c, req.seed) : load_inputs(req.load_dir, c, req.backward ? DOut::required : DOut::optional);
  check_shapes(c, w, in);
  StepChoices choices(c, req.routing, -1);
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  say("packing weights for the tile kernels");
  Executors x = make_executors(req, w, placement, pack_weights(c, w, req.backward), false);

  RunReport rep = report_header(req, placement, x);

  Steps steps;
  run_steps(req, x, in, choices, steps, rep.soak, say);
  auto& [serialized, interleaved, last, inter_last] = steps;
  summarize_into(rep, serialized, interleaved);
  if (!x.use_serialized) last = std::move(inter_last);  // interleaved only: verify and report its step
  describe_step(rep, c, w, placement, last);

  if (req.verify != VerifyMode::off) say("verifying against the fp64 oracle");
  rep.verification = verify(req, w, in, last);
  auto record = [&](const Comparison& ch) {
    rep.verification.checks.push_back(ch);
    rep.verification.pass = rep.verification.pass && ch.pass;
  };
  if (x.use_serialized && x.inter) record(bit_identity("interleaved = serialized", last, inter_last, c, req.backward));
  if (rep.soak.checks > 0) record(soak_check(rep.soak));
  if (x.trace) {
    std::vector<TracedRun> runs;
    if (x.use_serialized) runs.push_back({"serialized", &last});
    if (x.inter)
      runs.push_back({"interleaved (" + std::string(taskflow::name(req.policy)) + ")", x.use_serialized ? &inter_last : &last});
    if (!req.trace_file.empty()) write_chrome_trace(req.trace_file, runs);
    if (!req.timeline_file.empty()) write_timeline_svg(req.timeline_file, runs);
  }
  if (!req.save_dir.empty()) {
    say("saving tensors to " + req.save_dir);
    save_layer(req.save_dir, c, w, in, last.routing, last.out, req.backward ? &last.grads : nullptr);
  }
  return rep;
}

}  // namespace hpmoe
