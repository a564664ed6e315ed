#include "hpmoe/run.hpp"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hpmoe/error.hpp"
#include "hpmoe/reference.hpp"
#include "hpmoe/runtime.hpp"
#include "hpmoe/trace.hpp"
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
  std::sort(v.begin(), v.end());
  s.min = v.front();
  s.max = v.back();
  const std::size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
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

Verification verify(const RunRequest& req, const LayerWeights& w, const LayerInputs& in, const StepResult& res) {
  const LayerConfig& c = req.config;
  Verification v;
  VerifyMode mode = req.verify;
  if (mode == VerifyMode::off) {
    v.mode = "off";
    return v;
  }
  const double oracle_flops = c.forward_flops() * (req.backward ? 3.0 : 1.0);
  if (mode == VerifyMode::automatic) mode = oracle_flops <= 4e9 ? VerifyMode::full : VerifyMode::sample;
  OracleOptions opt;
  opt.forced_ids = res.routing.expert;
  opt.forced_kept = res.routing.kept;
  opt.backward = req.backward;
  // Would the oracle's own fp64 router have chosen the same experts?
  opt.count_own_choice_differences = req.routing.source == RoutingSource::router;
  if (mode == VerifyMode::sample) {
    const std::int64_t n = c.total_tokens(), s = std::min<std::int64_t>(std::max(req.sample_tokens, 1), n);
    for (std::int64_t i = 0; i < s; ++i) opt.tokens.push_back((i * n) / s + ((i * 7919) % std::max<std::int64_t>(n / s, 1)));
  }
  v.mode = mode == VerifyMode::full ? "full" : "sample";
  const OracleResult ref = reference_layer(c, w, in, opt);
  v.sample_tokens = static_cast<std::int64_t>(ref.tokens.size());

  v.selection_mismatches = ref.own_choice_differences;

  std::vector<double> weights(ref.routing.weight.begin(), ref.routing.weight.end());
  v.checks.push_back(compare("gate_weights", res.routing.weight, weights, DType::fp32));
  v.checks.push_back(compare("out", rows_of(res.out, ref.tokens), ref.out, c.dtype));
  if (req.backward) {
    v.checks.push_back(compare("grad.x", rows_of(res.grads.x, ref.tokens), ref.dx, c.dtype));
    if (mode == VerifyMode::full) {
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
  std::vector<double> router, forward, backward, forward_busy, backward_busy;
  std::vector<std::vector<double>> forward_ops, backward_ops;
  std::vector<std::string> forward_names, backward_names;

  double share(double busy_seconds, double seconds) const { return seconds > 0 ? busy_seconds / (workers * seconds) : 0.0; }

  void add(const StepResult& r) {
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
      }
      for (std::size_t i = 0; i < ops.size() && i < samples.size(); ++i) samples[i].push_back(ops[i].seconds);
    };
    record(r.forward_ops, forward_names, forward_ops);
    record(r.backward_ops, backward_names, backward_ops);
  }

  static std::vector<std::pair<std::string, Summary>> table(const std::vector<std::string>& names,
                                                            const std::vector<std::vector<double>>& samples) {
    std::vector<std::pair<std::string, Summary>> out;
    for (std::size_t i = 0; i < samples.size(); ++i) out.push_back({names[i], summarize(samples[i])});
    return out;
  }
};

// The executors of a run: the serialized baseline (in process; over MPI the
// runtime's phased mode on the same transport, with the in-process one on
// the root as the bit-for-bit reference) and the interleaved runtime.
struct Executors {
  std::unique_ptr<SerializedExecutor> serial;
  std::unique_ptr<InterleavedExecutor> inter, phased;
  bool use_serialized = false, use_interleaved = false, distributed = false, root = true, trace = false;
};

Executors make_executors(const RunRequest& req, const LayerWeights& w, const ExpertPlacement& placement,
                         const std::function<void(const std::string&)>& say) {
  const LayerConfig& c = req.config;
  Executors x;
  const RunMode mode = req.mode == RunMode::automatic ? RunMode::both : req.mode;
  x.root = !req.transport || req.transport->is_root();
  if (req.transport)
    for (int r = 0; r < c.ranks; ++r) x.distributed = x.distributed || !req.transport->hosts(r);
  x.use_serialized = mode != RunMode::interleaved;
  x.use_interleaved = mode != RunMode::serialized;
  x.trace = !req.trace_file.empty() || !req.timeline_file.empty();
  say("packing weights for the tile kernels");
  const auto packed = pack_weights(c, w, req.backward);  // one packing for every executor
  ExecutorOptions opt;
  opt.workers_per_rank = req.workers_per_rank;
  opt.backward = req.backward;
  opt.pin = req.pin;
  opt.packed = packed;
  opt.trace = x.trace;
  opt.placement = placement;
  if ((x.use_serialized && !x.distributed) || (x.distributed && x.root && req.verify != VerifyMode::off))
    x.serial = std::make_unique<SerializedExecutor>(c, w, opt);
  RuntimeOptions ropt;
  ropt.workers_per_rank = req.workers_per_rank;
  ropt.policy = req.policy;
  ropt.backward = req.backward;
  ropt.packed = packed;
  ropt.trace = x.trace;
  ropt.transport = req.transport;
  ropt.watchdog_seconds = req.watchdog_seconds;
  ropt.fault = req.fault;
  ropt.placement = placement;
  ropt.pin = !x.use_serialized || x.distributed ? req.pin : false;  // else the serialized executor's pool holds the pinned cores
  if (x.use_interleaved) x.inter = std::make_unique<InterleavedExecutor>(c, w, ropt);
  if (x.use_serialized && x.distributed) {
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

// Routing statistics, FLOPs and the balancing terms of the step reported.
void describe_step(RunReport& rep, const LayerConfig& c, const LayerWeights& w, const ExpertPlacement& placement,
                   const StepResult& last) {
  rep.stats = routing_stats(c, placement, last.routing);
  rep.aux_loss = last.routing.aux_loss;
  rep.z_loss = last.routing.z_loss;
  const double kept = double(rep.stats.assignments - rep.stats.dropped);
  const double n = double(c.total_tokens());
  rep.forward_flops = kept * 6.0 * double(c.hidden) * double(c.expert_inter) +
                      n * 6.0 * double(c.hidden) * double(c.shared_inter_total());
  rep.backward_flops = 2.0 * rep.forward_flops + 4.0 * n * double(c.hidden) * double(c.routed_experts);
  if (c.expert_bias) {
    std::vector<float> bias = w.expert_bias;
    update_expert_bias(bias, rep.stats.tokens_per_expert, c.bias_update_rate);
    for (std::size_t i = 0; i < bias.size(); ++i)
      rep.bias_update_max = std::max(rep.bias_update_max, double(std::abs(bias[i] - w.expert_bias[i])));
  }
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

  say(req.load_dir.empty() ? "generating weights and inputs" : "loading weights and inputs from " + req.load_dir);
  LayerWeights w = req.load_dir.empty() ? random_weights(c, req.seed) : load_weights(req.load_dir, c);
  LayerInputs in = req.load_dir.empty() ? random_inputs(c, req.seed) : load_inputs(req.load_dir, c);
  check_shapes(c, w, in);
  const auto forced = forced_selection(c, req.routing);
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  Executors x = make_executors(req, w, placement, say);

  RunReport rep;
  rep.serialized = x.use_serialized;
  rep.interleaved = x.use_interleaved;
  if (req.transport) rep.transport = req.transport->describe();
  if (x.distributed) rep.serialized_over = rep.transport;
  rep.policy = taskflow::name(req.policy);
  rep.config = c;
  rep.routing = req.routing.describe();
  rep.placement = describe(placement);
  rep.workers_per_rank = req.workers_per_rank;
  rep.iterations = req.iterations;
  rep.backward = req.backward;

  // Side by side: the executors alternate on the same inputs.
  ExecutorSamples serialized, interleaved;
  serialized.workers = interleaved.workers = double(c.ranks * req.workers_per_rank);
  StepResult last, inter_last;
  const int total = req.warmup + req.iterations;
  for (int it = 0; it < total; ++it) {
    say("step " + std::to_string(it + 1) + "/" + std::to_string(total) + (it < req.warmup ? " (warm-up)" : ""));
    if (x.inter) {
      x.inter->step(in, forced, inter_last);
      if (it >= req.warmup) interleaved.add(inter_last);
    }
    if (!x.use_serialized) continue;
    if (x.phased) x.phased->step(in, forced, last);
    else x.serial->step(in, forced, last);
    if (it >= req.warmup) serialized.add(last);
  }
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
  if (!x.use_serialized) last = std::move(inter_last);  // interleaved only: verify and report its step
  describe_step(rep, c, w, placement, last);

  if (!x.root) return rep;  // the root process verifies and reports
  if (req.verify != VerifyMode::off) say("verifying against the fp64 oracle");
  rep.verification = verify(req, w, in, last);
  auto record = [&](const Comparison& ch) {
    rep.verification.checks.push_back(ch);
    rep.verification.pass = rep.verification.pass && ch.pass;
  };
  if (x.distributed && x.serial) {  // every executor over MPI reproduces the in-process serialized step
    say("running the serialized executor in process as the reference");
    StepResult reference;
    x.serial->step(in, forced, reference);
    if (x.use_serialized) record(bit_identity("phased (mpi) = in-process serialized", last, reference, c, req.backward));
    if (x.use_interleaved)
      record(bit_identity("interleaved (mpi) = in-process serialized", x.use_serialized ? inter_last : last, reference, c,
                          req.backward));
  }
  if (x.use_serialized && x.inter) record(bit_identity("interleaved = serialized", last, inter_last, c, req.backward));
  if (x.trace) {
    std::vector<TracedRun> runs;
    if (x.use_serialized) runs.push_back({x.distributed ? "serialized (phased, rank 0's workers)" : "serialized", &last});
    if (x.inter)
      runs.push_back({"interleaved (" + std::string(taskflow::name(req.policy)) + ")" + (x.distributed ? ", rank 0's workers" : ""),
                      x.use_serialized ? &inter_last : &last});
    if (!req.trace_file.empty()) write_chrome_trace(req.trace_file, runs);
    if (!req.timeline_file.empty()) write_timeline_svg(req.timeline_file, runs);
  }
  if (!req.save_dir.empty()) {
    say("saving tensors to " + req.save_dir);
    save_weights(req.save_dir, c, w);
    save_inputs(req.save_dir, in);
    save_routing(req.save_dir, c, last.routing);
    save_outputs(req.save_dir, c, last.out, req.backward ? &last.grads : nullptr);
  }
  return rep;
}

namespace {
nlohmann::json summary_json(const Summary& s) { return {{"median_s", s.median}, {"min_s", s.min}, {"max_s", s.max}}; }
}  // namespace

nlohmann::json to_json(const RunReport& r) {
  nlohmann::json j;
  j["layer"] = to_json(r.config);
  j["placement"] = r.placement;
  j["routing"] = {{"source", r.routing},
                  {"tokens_per_expert", r.stats.tokens_per_expert},
                  {"tokens_per_rank", r.stats.tokens_per_rank},
                  {"expert_max_over_mean", r.stats.expert_max_over_mean},
                  {"rank_max_over_mean", r.stats.rank_max_over_mean},
                  {"expert_gini", r.stats.expert_gini},
                  {"dropped", r.stats.dropped},
                  {"assignments", r.stats.assignments},
                  {"aux_loss", r.aux_loss},
                  {"z_loss", r.z_loss},
                  {"bias_update_max", r.bias_update_max}};
  j["workers_per_rank"] = r.workers_per_rank;
  j["transport"] = r.transport;
  j["iterations"] = r.iterations;
  j["backward"] = r.backward;
  nlohmann::json ops = nlohmann::json::array();
  for (const auto& [name, s] : r.forward_ops) ops.push_back({{"name", name}, {"pass", "forward"}, {"time", summary_json(s)}});
  for (const auto& [name, s] : r.backward_ops) ops.push_back({{"name", name}, {"pass", "backward"}, {"time", summary_json(s)}});
  j["operators"] = ops;
  if (r.interleaved) {
    nlohmann::json host = nlohmann::json::object();
    for (const auto& [name, s] : r.interleaved_ops) host[name] = summary_json(s);
    j["interleaved"] = {{"schedule", r.policy},
                        {"dispatch_to_combine", summary_json(r.interleaved_d2c)},
                        {"forward_gflops", r.forward_flops / r.interleaved_d2c.median / 1e9},
                        {"busy_share", r.interleaved_busy.median},
                        {"steps", host}};
    if (r.serialized) j["interleaved"]["speedup"] = r.dispatch_to_combine.median / r.interleaved_d2c.median;
    if (r.backward) {
      j["interleaved"]["backward"] = summary_json(r.interleaved_backward);
      j["interleaved"]["backward_gflops"] = r.backward_flops / r.interleaved_backward.median / 1e9;
      j["interleaved"]["backward_busy_share"] = r.interleaved_backward_busy.median;
      if (r.serialized) j["interleaved"]["backward_speedup"] = r.backward_time.median / r.interleaved_backward.median;
    }
  }
  if (r.serialized) j["serialized"] = {{"router", summary_json(r.router)},
                     {"dispatch_to_combine", summary_json(r.dispatch_to_combine)},
                     {"forward_gflops", r.forward_flops / r.dispatch_to_combine.median / 1e9},
                     {"busy_share", r.serialized_busy.median}};
  if (r.serialized && r.backward) {
    j["serialized"]["backward"] = summary_json(r.backward_time);
    j["serialized"]["backward_gflops"] = r.backward_flops / r.backward_time.median / 1e9;
    j["serialized"]["backward_busy_share"] = r.serialized_backward_busy.median;
  }
  nlohmann::json checks = nlohmann::json::array();
  for (const auto& c : r.verification.checks)
    checks.push_back(c.bitwise ? nlohmann::json{{"tensor", c.tensor}, {"bit_identical", c.pass}, {"tensors", c.tensors},
                                                {"differing", c.differing}, {"pass", c.pass}}
                               : nlohmann::json{{"tensor", c.tensor}, {"rel_l2", c.rel_l2}, {"max_abs", c.max_abs},
                                                {"ref_max", c.ref_max}, {"pass", c.pass}});
  j["verification"] = {{"mode", r.verification.mode},
                       {"sample_tokens", r.verification.sample_tokens},
                       {"selection_mismatches", r.verification.selection_mismatches},
                       {"checks", checks},
                       {"pass", r.verification.pass}};
  return j;
}

namespace {
// ", workers busy 88% / idle 12%"
std::string busy_idle(const Summary& s) {
  const int busy = static_cast<int>(std::lround(s.median * 100));
  return ", workers busy " + std::to_string(busy) + "% / idle " + std::to_string(100 - busy) + "%";
}

std::string ms(double s) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(3) << s * 1e3;
  return o.str();
}
}  // namespace

std::string format_report(const RunReport& r) {
  const auto& c = r.config;
  std::ostringstream o;
  o << std::setprecision(4);
  o << "layer    " << c.name << ": hidden " << c.hidden << ", expert inter " << c.expert_inter << ", experts "
    << c.routed_experts << " routed / " << c.shared_experts << " shared, top-" << c.top_k << ", "
    << to_string(c.scoring);
  if (c.groups > 1) o << ", groups " << c.groups << " keep " << c.groups_kept;
  if (c.normalize_topk) o << ", normalised";
  if (c.route_scale != 1.0) o << ", scale " << c.route_scale;
  if (c.capacity_factor > 0) o << ", capacity " << c.capacity_factor << " (drop by " << to_string(c.drop_policy) << ")";
  o << "\n";
  o << "run      EP " << c.ranks << " x " << r.workers_per_rank << " workers, " << c.tokens_per_rank
    << " tokens/rank, " << to_string(c.dtype) << ", " << (r.backward ? "forward+backward" : "forward") << ", "
    << r.iterations << " iterations";
  if (r.interleaved) o << ", interleaved over " << r.transport;
  if (!r.serialized_over.empty()) o << "; serialized operator by operator over the same";
  o << "\n";
  const auto& st = r.stats;
  if (r.placement != "contiguous") o << "experts  " << r.placement << "\n";
  o << "routing  " << r.routing << ": expert max/mean " << st.expert_max_over_mean << ", rank max/mean "
    << st.rank_max_over_mean << ", Gini " << st.expert_gini << ", dropped " << st.dropped << "/" << st.assignments;
  if (c.aux_loss_coef > 0) o << ", aux loss " << r.aux_loss;
  if (c.z_loss_coef > 0) o << ", z-loss " << r.z_loss;
  if (c.expert_bias) o << ", bias update max " << r.bias_update_max;
  o << "\n         tokens per rank:";
  for (auto v : st.tokens_per_rank) o << " " << v;
  o << "\n         tokens per expert:";
  const std::size_t shown = std::min<std::size_t>(st.tokens_per_expert.size(), 32);
  for (std::size_t i = 0; i < shown; ++i) o << " " << st.tokens_per_expert[i];
  if (shown < st.tokens_per_expert.size()) o << " ... (" << st.tokens_per_expert.size() << " experts; --json has all)";
  o << "\noperators (median ms over iterations)\n";
  auto table = [&](const char* pass, const auto& ops) {
    for (const auto& [name, s] : ops)
      o << "  " << std::left << std::setw(9) << pass << std::setw(26) << name << std::right << std::setw(11) << ms(s.median)
        << "\n";
  };
  table("forward", r.forward_ops);
  table("backward", r.backward_ops);
  o << std::setprecision(1) << std::fixed;
  if (r.serialized)
    o << "serialized router " << ms(r.router.median) << " ms; dispatch-to-combine " << ms(r.dispatch_to_combine.median)
      << " ms (min " << ms(r.dispatch_to_combine.min) << ", max " << ms(r.dispatch_to_combine.max) << "), "
      << r.forward_flops / r.dispatch_to_combine.median / 1e9 << " GFLOP/s" << busy_idle(r.serialized_busy) << "\n";
  if (r.interleaved) {
    o << "interleaved (" << r.policy << ") dispatch-to-combine " << ms(r.interleaved_d2c.median) << " ms (min "
      << ms(r.interleaved_d2c.min) << ", max " << ms(r.interleaved_d2c.max) << "), "
      << r.forward_flops / r.interleaved_d2c.median / 1e9 << " GFLOP/s" << busy_idle(r.interleaved_busy);
    if (r.serialized) o << "; speedup " << std::setprecision(3) << r.dispatch_to_combine.median / r.interleaved_d2c.median << "x" << std::setprecision(1);
    if (r.backward) {
      o << "\ninterleaved backward " << ms(r.interleaved_backward.median) << " ms (min " << ms(r.interleaved_backward.min)
        << ", max " << ms(r.interleaved_backward.max) << "), " << r.backward_flops / r.interleaved_backward.median / 1e9
        << " GFLOP/s" << busy_idle(r.interleaved_backward_busy);
      if (r.serialized)
        o << "; speedup " << std::setprecision(3) << r.backward_time.median / r.interleaved_backward.median << "x"
          << std::setprecision(1);
    }
    o << "\n  host side per step:";
    for (const auto& [name, s] : r.interleaved_ops)
      if (name != "launch") o << " " << name << " " << ms(s.median) << " ms";
    o << "\n";
  }
  if (r.serialized && r.backward)
    o << "serialized backward " << ms(r.backward_time.median) << " ms (min " << ms(r.backward_time.min) << ", max "
      << ms(r.backward_time.max) << "), " << r.backward_flops / r.backward_time.median / 1e9 << " GFLOP/s"
      << busy_idle(r.serialized_backward_busy) << "\n";
  const auto& v = r.verification;
  o << std::scientific << std::setprecision(2);
  if (v.mode == "off") {
    o << "verify   off\n";
  } else {
    o << "verify   " << (v.pass ? "PASS" : "FAIL") << " against the fp64 oracle ("
      << (v.mode == "full" ? std::string("all tokens") : std::to_string(v.sample_tokens) + " sampled tokens")
      << ", router selection mismatches " << v.selection_mismatches << ")\n";
    for (const auto& ch : v.checks) {
      if (ch.bitwise) {
        o << "         " << ch.tensor << ": "
          << (ch.pass ? "bit-identical, all " + std::to_string(ch.tensors) + " tensors"
                      : "NOT bit-identical (" + ch.differing + " differs)  FAIL")
          << "\n";
        continue;
      }
      o << "         " << std::left << std::setw(16) << ch.tensor << std::right << " rel L2 " << ch.rel_l2
        << "  max abs " << ch.max_abs << " (ref max " << ch.ref_max << ")" << (ch.pass ? "" : "  FAIL") << "\n";
    }
  }
  return o.str();
}

}  // namespace hpmoe
