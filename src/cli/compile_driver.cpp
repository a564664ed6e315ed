#include "cli/compile_driver.hpp"

#include <chrono>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"
#include "hpmoe/tensors.hpp"
#include "sim/sim.hpp"

namespace hpmoe {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The target as the compiler sees it: a cpu:W or accel:M:V spec, or a
// machine model (a name in machines/ or a file) as `hpmoe simulate` runs it,
// its units, put workers and tiles, and its ranks per node where the layer
// sets none, so that the programs proved are the ones the simulator runs.
taskflow::Machine target_machine(const std::string& spec, LayerConfig& c) {
  if (spec.rfind("cpu:", 0) == 0 || spec.rfind("accel:", 0) == 0) return taskflow::parse_machine(spec);
  const sim::MachineModel m = sim::load_machine(spec);
  if (c.ranks_per_node == 0 && m.ranks_per_node > 1 && c.ranks % m.ranks_per_node == 0) c.ranks_per_node = m.ranks_per_node;
  if (c.ranks_per_node != 0 && c.ranks_per_node != m.ranks_per_node && !(m.ranks_per_node <= 1 && c.ranks_per_node == c.ranks))
    throw Error("the layer's ranks_per_node (" + std::to_string(c.ranks_per_node) + ") differs from the " +
                std::to_string(m.ranks_per_node) + " of machine '" + m.name + "': leave it unset to use the machine's");
  c.validate();
  return m.compiler_machine();
}

}  // namespace


CompileReport compile_layer(const CompileRequest& req) {
  LayerConfig c = req.config;
  c.validate();
  if (req.rank < 0 || req.rank >= c.ranks)
    throw Error("--rank " + std::to_string(req.rank) + " is outside 0.." + std::to_string(c.ranks - 1));
  const taskflow::Machine machine = target_machine(req.machine, c);
  CompileReport rep;
  rep.config = c;
  rep.routing = req.routing.describe();
  rep.machine = req.machine;
  rep.policy = taskflow::name(req.policy);
  rep.rank = req.rank;
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  const auto routing = route_step(c, req.routing, req.seed);
  rep.routing_stats = routing_stats(c, placement, routing);
  auto counts = taskflow::routing_counts(c, routing);
  if (c.exchange == ExchangeMode::rank)
    counts.token_counts = taskflow::rank_token_counts(c, placement, counts, routing, machine.tile_rows);
  for (auto pass : {taskflow::Pass::forward, taskflow::Pass::backward}) {
    if ((pass == taskflow::Pass::forward && !req.forward) || (pass == taskflow::Pass::backward && !req.backward)) continue;
    CompiledPass cp;
    cp.pass = pass;
    auto t0 = Clock::now();
    cp.programs = taskflow::compile(c, placement, counts, machine, pass, req.policy);
    cp.generate_seconds = since(t0);
    t0 = Clock::now();
    cp.verification = taskflow::verify(cp.programs);
    cp.verify_seconds = since(t0);
    cp.stats = taskflow::stats(cp.programs, req.rank);
    rep.passes.push_back(std::move(cp));
  }
  return rep;
}

nlohmann::json to_json(const CompileReport& r) {
  nlohmann::json j;
  j["layer"] = to_json(r.config);
  j["routing"] = {{"source", r.routing},
                  {"tokens_per_rank", r.routing_stats.tokens_per_rank},
                  {"rank_max_over_mean", r.routing_stats.rank_max_over_mean},
                  {"expert_max_over_mean", r.routing_stats.expert_max_over_mean}};
  j["machine"] = r.machine;
  j["schedule"] = r.policy;
  j["rank"] = r.rank;
  auto& passes = j["passes"] = nlohmann::json::array();
  for (const auto& p : r.passes) {
    nlohmann::json kinds = nlohmann::json::object();
    for (std::size_t k = 0; k < p.stats.tasks_by_kind.size(); ++k)
      if (p.stats.tasks_by_kind[k] > 0) kinds[taskflow::name(static_cast<taskflow::TaskKind>(k))] = p.stats.tasks_by_kind[k];
    passes.push_back({{"pass", p.pass == taskflow::Pass::forward ? "forward" : "backward"},
                      {"tasks_by_kind", kinds},
                      {"matrix_tasks", p.stats.matrix_tasks},
                      {"vector_tasks", p.stats.vector_tasks},
                      {"events", p.stats.events},
                      {"critical_path_s", p.stats.critical_path_s},
                      {"makespan_s", p.stats.makespan_s},
                      {"worker_load_s", p.stats.worker_load_s},
                      {"generate_and_schedule_s", p.generate_seconds},
                      {"generate_and_schedule_per_rank_s", p.generate_seconds / double(r.config.ranks)},
                      {"verify_s", p.verify_seconds},
                      {"verify_per_rank_s", p.verify_seconds / double(r.config.ranks)},
                      {"verified", p.verification.ok},
                      {"verify_error", p.verification.error}});
  }
  return j;
}

std::string format_report(const CompileReport& r) {
  const auto& c = r.config;
  std::ostringstream o;
  o << "layer    " << c.name << ": hidden " << c.hidden << ", expert inter " << c.expert_inter << ", experts "
    << c.routed_experts << " routed / " << c.shared_experts << " shared, top-" << c.top_k << ", EP " << c.ranks << ", "
    << c.tokens_per_rank << " tokens/rank, " << to_string(c.dtype) << "\n";
  o << std::setprecision(4);
  o << "routing  " << r.routing << ": rank max/mean " << r.routing_stats.rank_max_over_mean << ", expert max/mean "
    << r.routing_stats.expert_max_over_mean << "\n";
  o << "compile  machine " << r.machine << ", schedule " << r.policy << "; figures for rank " << r.rank << "\n";
  for (const auto& p : r.passes) {
    const auto& s = p.stats;
    o << (p.pass == taskflow::Pass::forward ? "forward " : "backward") << " " << s.matrix_tasks + s.vector_tasks
      << " tasks (" << s.matrix_tasks << " matrix, " << s.vector_tasks << " vector), " << s.events << " events\n";
    o << "        ";
    int shown = 0;
    for (std::size_t k = 0; k < s.tasks_by_kind.size(); ++k)
      if (s.tasks_by_kind[k] > 0) {
        o << (shown++ % 5 == 0 && shown > 1 ? "\n         " : " ") << taskflow::name(static_cast<taskflow::TaskKind>(k))
          << " " << s.tasks_by_kind[k];
      }
    o << "\n";
    o << std::fixed << std::setprecision(3);
    o << "         cost model: critical path " << s.critical_path_s * 1e3 << " ms, makespan " << s.makespan_s * 1e3
      << " ms, worker load";
    for (double l : s.worker_load_s) o << " " << l * 1e3;
    o << " ms\n";
    o << "         this compile (cold, all " << c.ranks << " ranks): generation + scheduling " << p.generate_seconds * 1e3
      << " ms, verification " << p.verify_seconds * 1e3 << " ms (warm per-step cost: bench/bench_compile)\n";
    o.unsetf(std::ios::fixed);
    o << "verify   " << (p.verification.ok ? "PASS: no deadlock, events consistent, every read covered, no write conflicts"
                                           : "FAIL: " + p.verification.error)
      << "\n";
  }
  return o.str();
}

nlohmann::json dump_programs(const std::vector<taskflow::Program>& programs) {
  nlohmann::json j;
  j["format"] = "hpmoe-taskflow-dump";
  j["version"] = taskflow::kFormatVersion;
  auto& list = j["programs"] = nlohmann::json::array();
  for (const auto& p : programs) list.push_back(taskflow::to_json(p));
  return j;
}

std::vector<taskflow::Program> load_programs(const std::string& path) {
  const nlohmann::json j = parse_json_file(path, "program dump '" + path + "'");
  return taskflow::programs_from_dump(j, "'" + path + "'");
}

}  // namespace hpmoe
