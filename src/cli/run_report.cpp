// The report of `hpmoe run`: its JSON and its text, with every GFLOP/s
// figure also given as a share of the peak measured at the start of the run.
#include <cmath>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/run.hpp"
#include "kernels/kernels.hpp"

namespace hpmoe {

namespace {
nlohmann::json summary_json(const Summary& s) {
  return {{"median_s", s.median}, {"min_s", s.min}, {"max_s", s.max}, {"samples_s", s.samples}};
}
// The peak every share is of: the cores used x the per-core peak of the
// instructions the layer's GEMMs run on (bf16: AMX or AVX512-BF16; fp32: FMA).
double report_peak(const RunReport& r) {
  const bool bf16_peak = r.config.dtype == DType::bf16 && r.peak.bf16_tile_peak_per_core() > 0;
  return (bf16_peak ? r.peak.bf16_tile_peak_per_core() : r.peak.fp32_flops_per_core) * r.peak_cores;
}
}  // namespace

nlohmann::json to_json(const RunReport& r) {
  nlohmann::json j;
  j["layer"] = to_json(r.config);
  j["cpu"] = {{"model", r.peak.cpu}, {"isa", r.peak.isa}, {"fp32_fma_flops_per_core", r.peak.fp32_flops_per_core},
              {"bf16_isa", r.peak.bf16_isa}, {"bf16_dot_flops_per_core", r.peak.bf16_flops_per_core},
              {"amx_bf16_flops_per_core", r.peak.amx_bf16_flops_per_core},
              {"bf16_engine", kernels::name(kernels::bf16_engine())},
              {"bf16_tile_peak_flops", r.peak.bf16_tile_peak_per_core() * r.peak_cores},
              {"cores", r.peak_cores}, {"fma_peak_flops", r.peak.fp32_flops_per_core * r.peak_cores}};
  j["placement"] = r.placement;
  j["exchange"] = to_string(r.config.exchange);
  if (!r.exchange_choice.empty()) j["exchange_choice"] = r.exchange_choice;
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
  const double peak = report_peak(r);
  const auto add = [&](const std::string& name, const char* pass, const Summary& s) {
    nlohmann::json op = {{"name", name}, {"pass", pass}, {"time", summary_json(s)}};
    if (const auto f = r.operator_flops.find(name); f != r.operator_flops.end() && s.median > 0) {
      op["flops"] = f->second;
      op["gflops"] = f->second / s.median / 1e9;
      if (peak > 0) op["share_of_peak"] = f->second / s.median / peak;
    }
    ops.push_back(op);
  };
  for (const auto& [name, s] : r.forward_ops) add(name, "forward", s);
  for (const auto& [name, s] : r.backward_ops) add(name, "backward", s);
  j["operators"] = ops;
  j["exchange_bytes"] = {{"forward", r.forward_put_bytes}, {"backward", r.backward_put_bytes},
                         {"exchange", to_string(r.config.exchange)}, {"scope", r.sharded ? "this process" : "all ranks"}};
  if (r.config.lend_weights != 0)
    j["exchange_bytes"]["lent"] = {{"experts", r.lent_experts}, {"forward", r.forward_lent_bytes}, {"backward", r.backward_lent_bytes},
                                   {"threshold_rows", r.config.lend_threshold()}};
  if (r.config.nodes() > 1)
    j["exchange_bytes"]["cross_node"] = {{"forward", r.forward_cross_node_bytes}, {"backward", r.backward_cross_node_bytes},
                                         {"ranks_per_node", r.config.node_ranks()}};
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
                                                {"ref_max", c.ref_max}, {"abs_floor", c.abs_floor}, {"pass", c.pass}});
  if (r.sharded) {
    j["proof"] = r.verified_per_rank ? "per-rank" : "all-ranks";
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& k : r.ranks)
      ranks.push_back({{"rank", k.rank},
                       {"experts", k.experts},
                       {"received_rows", k.received_rows},
                       {"interleaved_forward_s", k.interleaved_forward},
                       {"interleaved_backward_s", k.interleaved_backward},
                       {"serialized_forward_s", k.serialized_forward},
                       {"serialized_backward_s", k.serialized_backward},
                       {"host_s", k.host},
                       {"expert_weight_bytes", k.expert_weight_bytes},
                       {"segment_bytes", k.segment_bytes},
                       {"local_bytes", k.local_bytes},
                       {"peak_rss_bytes", k.peak_rss_bytes}});
    j["ranks"] = ranks;
  }
  if (r.soak.checks > 0 || !r.soak.samples.empty()) {
    nlohmann::json samples = nlohmann::json::array(), ranks = nlohmann::json::array();
    for (const auto& x : r.soak.samples) samples.push_back({{"step", x.step}, {"rss_bytes", x.rss_bytes}, {"open_files", x.open_files}});
    for (const auto& k : r.soak.ranks)
      ranks.push_back({{"rss_first_bytes", k[0]}, {"rss_last_bytes", k[1]}, {"open_files_first", k[2]}, {"open_files_last", k[3]}});
    j["soak"] = {{"checks", r.soak.checks}, {"mismatches", r.soak.mismatches}, {"first_mismatch", r.soak.first_mismatch},
                 {"samples", samples}, {"ranks", ranks}};
  }
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

namespace {

// GFLOP/s, then its share of the measured peak of the cores used: a bf16
// layer's GEMMs run on the bf16 tile instructions (AMX or AVX512-BF16), so
// its figures are shares of that peak; fp32's of the FMA peak.
struct PeakRate {
  explicit PeakRate(const RunReport& r)
      : bf16(r.config.dtype == DType::bf16 && r.peak.bf16_tile_peak_per_core() > 0), peak(report_peak(r)),
        name(bf16 ? "of " + r.peak.bf16_tile_isa() + " peak" : "of FMA peak") {}
  std::string operator()(double flops, double seconds) const {
    std::ostringstream g;
    g << std::fixed << std::setprecision(1) << flops / seconds / 1e9 << " GFLOP/s";
    if (peak > 0) g << " (" << std::setprecision(0) << 100.0 * flops / seconds / peak << "% " << name << ")";
    return g.str();
  }
  bool bf16;
  double peak;
  std::string name;
};

// The CPU and the peak the figures are shares of.
void write_machine(std::ostringstream& o, const RunReport& r, const PeakRate& rate) {
  const auto& c = r.config;
  o << "cpu      " << r.peak.cpu << ": FMA peak " << std::fixed << std::setprecision(1)
    << r.peak.fp32_flops_per_core / 1e9 << " GFLOP/s per core fp32 (" << r.peak.isa << ")";
  if (r.peak.bf16_flops_per_core > 0) o << ", " << r.peak.bf16_flops_per_core / 1e9 << " bf16 (" << r.peak.bf16_isa << ")";
  if (r.peak.amx_bf16_flops_per_core > 0) o << ", " << r.peak.amx_bf16_flops_per_core / 1e9 << " bf16 (amx-bf16)";
  if (!r.peak.not_measured.empty()) o << ", " << r.peak.not_measured << " not measured";
  o << "; measured now, x " << r.peak_cores << " cores = " << rate.peak / 1e9 << " GFLOP/s " << (rate.bf16 ? "bf16" : "fp32");
  if (c.dtype == DType::bf16) o << "; bf16 tiles on " << kernels::name(kernels::bf16_engine());
  o << "\n";
  o << std::defaultfloat << std::setprecision(4);
}

// The layer, the run, the placement and the routing.
void write_layer_and_routing(std::ostringstream& o, const RunReport& r) {
  const auto& c = r.config;
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
  if (!r.exchange_choice.empty()) o << "exchange auto: " << r.exchange_choice << "\n";
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
}

// Each operator's time, then the step times of both schedules.
void write_times(std::ostringstream& o, const RunReport& r, const PeakRate& rate) {
  o << "\noperators (median ms over iterations)\n";
  auto table = [&](const char* pass, const auto& ops) {
    for (const auto& [name, s] : ops) {
      o << "  " << std::left << std::setw(9) << pass << std::setw(26) << name << std::right << std::setw(11) << ms(s.median);
      if (const auto f = r.operator_flops.find(name); f != r.operator_flops.end() && s.median > 0)
        o << "  " << rate(f->second, s.median);
      o << "\n";
    }
  };
  table("forward", r.forward_ops);
  table("backward", r.backward_ops);
  o << std::setprecision(1) << std::fixed;
  if (r.serialized)
    o << "serialized router " << ms(r.router.median) << " ms; dispatch-to-combine " << ms(r.dispatch_to_combine.median)
      << " ms (min " << ms(r.dispatch_to_combine.min) << ", max " << ms(r.dispatch_to_combine.max) << "), "
      << rate(r.forward_flops, r.dispatch_to_combine.median) << busy_idle(r.serialized_busy) << "\n";
  if (r.interleaved) {
    o << "interleaved (" << r.policy << ") dispatch-to-combine " << ms(r.interleaved_d2c.median) << " ms (min "
      << ms(r.interleaved_d2c.min) << ", max " << ms(r.interleaved_d2c.max) << "), "
      << rate(r.forward_flops, r.interleaved_d2c.median) << busy_idle(r.interleaved_busy);
    if (r.serialized) o << "; speedup " << std::setprecision(3) << r.dispatch_to_combine.median / r.interleaved_d2c.median << "x" << std::setprecision(1);
    if (r.backward) {
      o << "\ninterleaved backward " << ms(r.interleaved_backward.median) << " ms (min " << ms(r.interleaved_backward.min)
        << ", max " << ms(r.interleaved_backward.max) << "), " << rate(r.backward_flops, r.interleaved_backward.median)
        << busy_idle(r.interleaved_backward_busy);
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
      << ms(r.backward_time.max) << "), " << rate(r.backward_flops, r.backward_time.median)
      << busy_idle(r.serialized_backward_busy) << "\n";
}

// The bytes put to other ranks: lent weights, cross-node.
void write_exchange(std::ostringstream& o, const RunReport& r) {
  if (r.config.ranks > 1) {
    o << std::setprecision(2) << "exchange " << double(r.forward_put_bytes) / 1e6 << " MB forward";
    if (r.backward) o << " + " << double(r.backward_put_bytes) / 1e6 << " MB backward";
    o << " put to other ranks per step (" << to_string(r.config.exchange) << " exchange, dispatch "
      << to_string(r.config.dispatch_dtype) << (r.sharded ? "; this process's rank" : "; all ranks") << ")\n";
    if (r.config.lend_weights != 0) {
      o << "         of which " << double(r.forward_lent_bytes) / 1e6 << " MB forward";
      if (r.backward) o << " + " << double(r.backward_lent_bytes) / 1e6 << " MB backward";
      o << " lent weights: " << r.lent_experts << " (expert, rank) pairs lent in the last step (a rank's own rows of an expert >= "
        << r.config.lend_threshold() << ")\n";
    }
    if (r.config.nodes() > 1) {
      o << "         of which " << double(r.forward_cross_node_bytes) / 1e6 << " MB forward";
      if (r.backward) o << " + " << double(r.backward_cross_node_bytes) / 1e6 << " MB backward";
      o << " cross nodes of " << r.config.node_ranks() << " ranks" << (r.config.forwards() ? " (forwarded inside them)" : "") << "\n";
    }
    o << std::setprecision(1);
  }
}

// Sharded runs: the proof, and each rank's figures.
void write_ranks(std::ostringstream& o, const RunReport& r) {
  if (r.sharded) {
    o << "proof    " << (r.verified_per_rank ? "each rank proved its own program against the exchanged counts (per-rank check)"
                                          : "every process verified all ranks' programs (--verify-all-ranks)")
      << "\n";
    o << "ranks    each process holds its rank's tokens and experts; step times above are the slowest rank's\n"
      << "         rank  experts  rows in  interleaved fwd/bwd ms  serialized fwd/bwd ms  host ms  expert weights MB  "
         "segment MB  local MB  peak RSS MB\n";
    for (const auto& k : r.ranks) {
      o << "         " << std::setw(4) << k.rank << std::setw(9) << k.experts << std::setw(9) << k.received_rows
        << std::setw(13) << ms(k.interleaved_forward) << " / " << std::left << std::setw(8) << ms(k.interleaved_backward)
        << std::right << std::setw(12) << ms(k.serialized_forward) << " / " << std::left << std::setw(8)
        << ms(k.serialized_backward) << std::right << std::setw(9) << ms(k.host) << std::setw(19)
        << k.expert_weight_bytes / 1e6 << std::setw(12) << k.segment_bytes / 1e6 << std::setw(10) << k.local_bytes / 1e6
        << std::setw(13) << k.peak_rss_bytes / 1e6 << "\n";
    }
  }
}

// A soak run's bit-identity checks, memory and open files.
void write_soak(std::ostringstream& o, const RunReport& r) {
  if (!r.soak.samples.empty()) {
    const auto& f = r.soak.samples.front();
    const auto& l = r.soak.samples.back();
    o << "soak     " << r.soak.checks << " bit-identity spot checks, " << r.soak.mismatches << " mismatches"
      << (r.soak.first_mismatch.empty() ? "" : " (first: " + r.soak.first_mismatch + ")") << "; RSS "
      << std::fixed << std::setprecision(1) << f.rss_bytes / 1e6 << " MB at step " << f.step << ", "
      << l.rss_bytes / 1e6 << " MB at step " << l.step << "; open files " << f.open_files << " -> " << l.open_files
      << "\n";
  }
}

// The check against the fp64 oracle, tensor by tensor.
void write_verification(std::ostringstream& o, const RunReport& r) {
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
}

}  // namespace

std::string format_report(const RunReport& r) {
  std::ostringstream o;
  o << std::setprecision(4);
  const PeakRate rate(r);
  write_machine(o, r, rate);
  write_layer_and_routing(o, r);
  write_times(o, r, rate);
  write_exchange(o, r);
  write_ranks(o, r);
  write_soak(o, r);
  write_verification(o, r);
  return o.str();
}

}  // namespace hpmoe
