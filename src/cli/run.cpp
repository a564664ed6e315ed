#include "cli/run.hpp"
#include "cli/run_parts.hpp"
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
  // A relative check cannot pass on a reference that vanishes (a gradient
  // that is zero in exact arithmetic, computed to rounding noise): where the
  // reference's RMS is below the stated floor, the difference's RMS must be
  // below it instead.
  const double n = std::max<double>(1.0, static_cast<double>(ref.size()));
  c.abs_floor = dtype == DType::fp32 ? kFp32AbsFloor : kBf16AbsFloor;
  const bool vanishing = std::sqrt(ref2 / n) <= c.abs_floor && std::sqrt(diff2 / n) <= c.abs_floor;
  if (dtype == DType::fp32) c.pass = finite && (c.rel_l2 <= 1e-5 || vanishing);
  else c.pass = finite && ((c.rel_l2 <= 1e-2 && c.max_abs <= 0.02 * c.ref_max + 1e-30) || vanishing);
  return c;
}

namespace run_detail {

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

bool plan_oracle(const RunRequest& req, const LayerConfig& c, const StepResult& res, double full_flops,
                 std::int64_t salt,
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

}  // namespace run_detail

using namespace run_detail;

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
  LayerInputs in = req.load_dir.empty() ? random_inputs(c, req.seed) : load_inputs(req.load_dir, c,
                                      req.backward ? DOut::required : DOut::optional);
  check_shapes(c, w, in);
  StepChoices choices(c, req.routing, -1);
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  say("packing weights for the tile kernels");
  Executors x = make_executors(req, std::move(w), placement);
  const LayerWeights& weights = x.layer->weights();

  RunReport rep = report_header(req, placement, x);

  Steps steps;
  run_steps(req, x, in, choices, steps, rep.soak, say);
  summarize_into(rep, steps.serialized, steps.interleaved);
  const StepResult& last = steps.last();  // the serialized step's, or the interleaved one's when it runs alone
  describe_step(rep, c, weights, placement, last);

  if (req.verify != VerifyMode::off) say("verifying against the fp64 oracle");
  rep.verification = verify(req, weights, in, last);
  auto record = [&](const Comparison& ch) {
    rep.verification.checks.push_back(ch);
    rep.verification.pass = rep.verification.pass && ch.pass;
  };
  if (x.use_serialized && x.use_interleaved)
    record(bit_identity("interleaved = serialized", last, steps.inter_last(), c, req.backward));
  if (rep.soak.checks > 0) record(soak_check(rep.soak));
  if (x.trace) {
    std::vector<TracedRun> runs;
    if (x.use_serialized) runs.push_back({"serialized", &last});
    if (x.use_interleaved)
      runs.push_back({"interleaved (" + std::string(taskflow::name(req.policy)) + ")", &steps.inter_last()});
    if (!req.trace_file.empty()) write_chrome_trace(req.trace_file, runs);
    if (!req.timeline_file.empty()) write_timeline_svg(req.timeline_file, runs);
  }
  if (!req.save_dir.empty()) {
    say("saving tensors to " + req.save_dir);
    save_layer(req.save_dir, c, weights, in, last.routing, last.out, req.backward ? &last.grads : nullptr);
  }
  return rep;
}

}  // namespace hpmoe
