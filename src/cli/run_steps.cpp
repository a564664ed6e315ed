// The measured steps of `hpmoe run`: its executors, their samples, the
// bit-identity checks between them and what the report says of a step.
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
namespace run_detail {

Executors make_executors(const RunRequest& req, LayerWeights w, const ExpertPlacement& placement,
                         ExpertSource expert_source) {
  Executors x;
  const RunMode mode = req.mode == RunMode::automatic ? RunMode::both : req.mode;
  x.use_serialized = mode != RunMode::interleaved;
  x.use_interleaved = mode != RunMode::serialized;
  x.trace = !req.trace_file.empty() || !req.timeline_file.empty();
  Parallel par;
  par.workers_per_rank = req.workers_per_rank;
  par.schedule = x.use_interleaved ? Schedule::interleaved : Schedule::serialized;
  par.policy = req.policy;
  par.placement = placement;
  par.transport = req.transport;
  par.backward = req.backward;
  par.pin = req.pin;  // both schedules' workers on the same cores: they never run at once
  par.watchdog_seconds = req.watchdog_seconds;
  par.trace = x.trace;
  par.verify_all_ranks = req.verify_all_ranks;
  par.expert_source = std::move(expert_source);
  par.fault = req.fault;  // into the interleaved runtime's engines (the serialized one's in a serialized-only run)
  x.layer = std::make_unique<Layer>(req.config, std::move(w), std::move(par));
  return x;
}

Comparison bit_identity(const std::string& name, const StepResult& a, const StepResult& b, const LayerConfig& c,
                        bool backward) {
  Comparison ch;
  ch.tensor = name;
  ch.bitwise = true;
  auto same = [&](const std::string& tensor, const Matrix& x, const Matrix& y) {
    ++ch.tensors;
    const bool equal = x.data.size() == y.data.size() &&
                       (x.data.empty() || std::memcmp(x.data.data(), y.data.data(),
                        x.data.size() * sizeof(float)) == 0);
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

std::int64_t open_files() {
  std::error_code ec;
  std::int64_t n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec))
    ++n;
  return n;
}

// A whole step of `schedule`: the forward and, with backward, its backward.
Layer::Step one_step(Layer& layer, const LayerInputs& in, std::span<const std::int32_t> forced, Schedule schedule,
                     bool backward) {
  Layer::Step step = layer.forward(view(in.x), ForwardOptions{forced, {}, schedule});
  if (backward) step.backward(view(in.d_out));
  return step;
}

void run_steps(const RunRequest& req, Executors& x, const LayerInputs& in, StepChoices& choices, Steps& steps,
               SoakReport& soak, const std::function<void(const std::string&)>& say) {
  steps.serialized.workers = steps.interleaved.workers = double(req.config.ranks * req.workers_per_rank);
  const int total = req.warmup + req.iterations;
  for (int it = 0; it < total; ++it) {
    say("step " + std::to_string(it + 1) + "/" + std::to_string(total) + (it < req.warmup ? " (warm-up)" : ""));
    const bool measured = it >= req.warmup;
    const std::span<const std::int32_t> forced = choices.at(it);
    if (x.use_interleaved) {
      steps.inter_step.reset();  // its buffers go to the layer's spares, and this step takes them
      steps.inter_step = one_step(*x.layer, in, forced, Schedule::interleaved, req.backward);
      if (measured) {
        double h = 0;
        for (const auto& op : steps.inter_last().forward_ops)
          if (op.name != "launch") h += op.seconds;
        steps.interleaved.add(steps.inter_last(), h);
      }
    }
    if (x.use_serialized) {
      steps.serial_step.reset();
      steps.serial_step = one_step(*x.layer, in, forced, Schedule::serialized, req.backward);
      if (measured) steps.serialized.add(steps.serial_step->result());
    }
    if (req.check_every > 0 && ((it + 1) % req.check_every == 0 || it + 1 == total)) {
      if (x.use_interleaved && x.use_serialized) {
        const Comparison ch = bit_identity("interleaved = serialized", steps.last(), steps.inter_last(), req.config,
                                           req.backward);
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
  rep.exchange_choice = req.exchange_choice;
  rep.routing = req.routing.describe();
  rep.placement = describe(placement);
  rep.workers_per_rank = req.workers_per_rank;
  rep.iterations = req.iterations;
  rep.backward = req.backward;
  return rep;
}

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

Comparison soak_check(const SoakReport& soak) {
  Comparison ch;
  ch.tensor = "soak: interleaved = serialized, spot checks (a tensor = a step checked whole)";
  ch.bitwise = true;
  ch.tensors = soak.checks;
  ch.pass = soak.mismatches == 0;
  if (soak.mismatches > 0) ch.differing = std::to_string(soak.mismatches) + " steps, first at " + soak.first_mismatch;
  return ch;
}

}  // namespace run_detail
}  // namespace hpmoe
