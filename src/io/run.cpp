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

  const RunMode mode = req.mode == RunMode::automatic ? RunMode::both : req.mode;
  const bool root = !req.transport || req.transport->is_root();
  bool distributed = false;
  if (req.transport)
    for (int r = 0; r < c.ranks; ++r) distributed = distributed || !req.transport->hosts(r);
  // Over MPI the serialized baseline is the runtime's phased mode (operator
  // by operator on the same transport); the root also runs the in-process
  // serialized executor once, as the bit-for-bit reference.
  const bool use_serialized = mode != RunMode::interleaved, use_interleaved = mode != RunMode::serialized;

  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  say("packing weights for the tile kernels");
  const auto packed = pack_weights(c, w, req.backward);  // one packing for both executors
  ExecutorOptions opt;
  opt.workers_per_rank = req.workers_per_rank;
  opt.backward = req.backward;
  opt.pin = req.pin;
  opt.packed = packed;
  opt.trace = !req.trace_file.empty() || !req.timeline_file.empty();
  opt.placement = placement;
  std::unique_ptr<SerializedExecutor> serial;
  std::unique_ptr<InterleavedExecutor> inter, phased;
  if ((use_serialized && !distributed) || (distributed && root && req.verify != VerifyMode::off))
    serial = std::make_unique<SerializedExecutor>(c, w, opt);
  auto runtime_options = [&] {
    RuntimeOptions ropt;
    ropt.workers_per_rank = req.workers_per_rank;
    ropt.policy = req.policy;
    ropt.backward = req.backward;
    ropt.packed = packed;
    ropt.trace = opt.trace;
    ropt.transport = req.transport;
    ropt.watchdog_seconds = req.watchdog_seconds;
    ropt.fault = req.fault;
    ropt.placement = placement;
    ropt.pin = false;  // the serialized executor's pool holds the pinned cores
    if (!use_serialized || distributed) ropt.pin = req.pin;
    return ropt;
  };
  if (use_interleaved) inter = std::make_unique<InterleavedExecutor>(c, w, runtime_options());
  if (use_serialized && distributed) {
    RuntimeOptions ropt = runtime_options();
    ropt.phased = true;
    ropt.fault = {};
    phased = std::make_unique<InterleavedExecutor>(c, w, ropt);
  }

  RunReport rep;
  rep.serialized = use_serialized;
  rep.interleaved = use_interleaved;
  if (req.transport) rep.transport = req.transport->describe();
  if (distributed) rep.serialized_over = rep.transport;
  rep.policy = taskflow::name(req.policy);
  rep.config = c;
  rep.routing = req.routing.describe();
  rep.placement = describe(placement);
  rep.workers_per_rank = req.workers_per_rank;
  rep.iterations = req.iterations;
  rep.backward = req.backward;
  std::vector<double> router, d2c, bwd, inter_d2c, inter_bwd, busy, bwd_busy, inter_busy, inter_bwd_busy;
  const double workers = double(c.ranks * req.workers_per_rank);
  auto share = [&](double busy_seconds, double seconds) { return seconds > 0 ? busy_seconds / (workers * seconds) : 0.0; };
  std::vector<std::vector<double>> fwd_ops, bwd_ops, inter_ops;
  StepResult last, inter_last;
  const int total = req.warmup + req.iterations;
  for (int it = 0; it < total; ++it) {
    say("step " + std::to_string(it + 1) + "/" + std::to_string(total) + (it < req.warmup ? " (warm-up)" : ""));
    // Side by side: the two executors alternate on the same inputs.
    if (inter) {
      inter->step(in, forced, inter_last);
      if (it >= req.warmup) {
        inter_d2c.push_back(inter_last.dispatch_to_combine_seconds);
        inter_bwd.push_back(inter_last.backward_seconds);
        inter_busy.push_back(share(inter_last.forward_busy_seconds, inter_last.dispatch_to_combine_seconds));
        inter_bwd_busy.push_back(share(inter_last.backward_busy_seconds, inter_last.backward_seconds));
        if (inter_ops.empty()) {
          for (const auto& op : inter_last.forward_ops) rep.interleaved_ops.push_back({op.name, {}});
          inter_ops.resize(inter_last.forward_ops.size());
        }
        for (std::size_t i = 0; i < inter_last.forward_ops.size(); ++i) inter_ops[i].push_back(inter_last.forward_ops[i].seconds);
      }
    }
    if (!use_serialized) continue;
    if (phased) phased->step(in, forced, last);
    else serial->step(in, forced, last);
    const StepResult& res = last;
    if (it >= req.warmup) {
      router.push_back(res.router_seconds);
      d2c.push_back(res.dispatch_to_combine_seconds);
      bwd.push_back(res.backward_seconds);
      busy.push_back(share(res.forward_busy_seconds, res.dispatch_to_combine_seconds));
      bwd_busy.push_back(share(res.backward_busy_seconds, res.backward_seconds));
      if (fwd_ops.empty()) {
        for (const auto& op : res.forward_ops) rep.forward_ops.push_back({op.name, {}});
        for (const auto& op : res.backward_ops) rep.backward_ops.push_back({op.name, {}});
        fwd_ops.resize(res.forward_ops.size());
        bwd_ops.resize(res.backward_ops.size());
      }
      for (std::size_t i = 0; i < res.forward_ops.size(); ++i) fwd_ops[i].push_back(res.forward_ops[i].seconds);
      for (std::size_t i = 0; i < res.backward_ops.size(); ++i) bwd_ops[i].push_back(res.backward_ops[i].seconds);
    }
  }
  for (std::size_t i = 0; i < fwd_ops.size(); ++i) rep.forward_ops[i].second = summarize(fwd_ops[i]);
  for (std::size_t i = 0; i < bwd_ops.size(); ++i) rep.backward_ops[i].second = summarize(bwd_ops[i]);
  for (std::size_t i = 0; i < inter_ops.size(); ++i) rep.interleaved_ops[i].second = summarize(inter_ops[i]);
  rep.interleaved_d2c = summarize(inter_d2c);
  rep.interleaved_backward = summarize(inter_bwd);
  rep.serialized_busy = summarize(busy);
  rep.serialized_backward_busy = summarize(bwd_busy);
  rep.interleaved_busy = summarize(inter_busy);
  rep.interleaved_backward_busy = summarize(inter_bwd_busy);
  if (!use_serialized) last = std::move(inter_last);  // interleaved only: verify and report its step
  rep.router = summarize(router);
  rep.dispatch_to_combine = summarize(d2c);
  rep.backward_time = summarize(bwd);
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

  if (!root) return rep;  // the root process verifies and reports
  StepResult reference;  // over MPI: the in-process serialized executor's step
  if (distributed && serial) {
    say("running the serialized executor in process as the reference");
    serial->step(in, forced, reference);
  }
  if (req.verify != VerifyMode::off) say("verifying against the fp64 oracle");
  rep.verification = verify(req, w, in, last);
  // Bit identity of whole steps: outputs and, with backward, every gradient.
  auto bit_identity = [&](const std::string& name, const StepResult& a, const StepResult& b) {
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
    if (req.backward) {
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
    rep.verification.checks.push_back(ch);
    rep.verification.pass = rep.verification.pass && ch.pass;
  };
  if (distributed && serial) {  // every executor over MPI reproduces the in-process serialized step
    if (use_serialized) bit_identity("phased (mpi) = in-process serialized", last, reference);
    if (use_interleaved) bit_identity("interleaved (mpi) = in-process serialized", use_serialized ? inter_last : last, reference);
  }
  if (use_serialized && inter) bit_identity("interleaved = serialized", last, inter_last);
  if (opt.trace) {
    std::vector<TracedRun> runs;
    if (use_serialized) runs.push_back({distributed ? "serialized (phased, rank 0's workers)" : "serialized", &last});
    if (inter)
      runs.push_back({"interleaved (" + std::string(taskflow::name(req.policy)) + ")" + (distributed ? ", rank 0's workers" : ""),
                      use_serialized ? &inter_last : &last});
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
