#include <chrono>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hpmoe/error.hpp"
#include "hpmoe/sim.hpp"

namespace hpmoe::sim {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

SimReport simulate(const MachineModel& m, const SimRequest& req) {
  const LayerConfig& c = req.config;
  c.validate();
  SimReport rep;
  rep.config = c;
  rep.machine = m;
  rep.routing = req.routing.describe();
  rep.policy = taskflow::name(req.policy);
  rep.has_backward = req.backward;
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  const auto routing = route_step(c, req.routing, req.seed);
  rep.stats = routing_stats(c, placement, routing);
  const auto counts = taskflow::routing_counts(c, routing);
  const taskflow::Machine machine = m.compiler_machine();
  const double matrix_units = double(c.ranks) * (m.accelerator ? m.matrix_units : m.workers);
  const double vector_units = double(c.ranks) * (m.accelerator ? m.vector_units : m.workers);
  taskflow::ScheduleScratch scratch;
  for (auto pass : {taskflow::Pass::forward, taskflow::Pass::backward}) {
    if (pass == taskflow::Pass::backward && !req.backward) break;
    const auto c0 = Clock::now();
    std::vector<taskflow::Program> programs(static_cast<std::size_t>(c.ranks));
    for (std::int64_t r = 0; r < c.ranks; ++r) {
      programs[r] = taskflow::generate(c, placement, counts, machine, pass, r);
      taskflow::schedule(programs[r], req.policy, scratch);
    }
    const auto work = task_work(programs);
    rep.compile_seconds += since(c0);
    const auto s0 = Clock::now();
    const Timeline ser = simulate_serialized(m, programs, work, c.dtype, req.trace);
    const Timeline inter = simulate_interleaved(m, programs, work, c.dtype, req.trace);
    rep.simulate_seconds += since(s0);
    PassResult& out = pass == taskflow::Pass::forward ? rep.forward : rep.backward;
    for (const auto& p : programs) out.tasks += static_cast<std::int64_t>(p.tasks.size());
    rep.simulated_tasks += 2 * out.tasks;
    out.serialized_s = ser.makespan;
    out.interleaved_s = inter.makespan;
    out.serialized_matrix_busy = ser.matrix_busy / (matrix_units * ser.makespan);
    out.serialized_vector_busy = ser.vector_busy / (vector_units * ser.makespan);
    out.interleaved_matrix_busy = inter.matrix_busy / (matrix_units * inter.makespan);
    out.interleaved_vector_busy = inter.vector_busy / (vector_units * inter.makespan);
    out.serialized_exposed_comm = ser.exposed_comm;
    out.interleaved_exposed_comm = inter.exposed_comm;
    if (req.trace) {  // backward after forward on one time axis
      const double shift_s = rep.serialized_trace.empty() ? 0 : rep.forward.serialized_s;
      const double shift_i = rep.interleaved_trace.empty() ? 0 : rep.forward.interleaved_s;
      for (auto s : ser.trace) s.start += shift_s, s.end += shift_s, rep.serialized_trace.push_back(std::move(s));
      for (auto s : inter.trace) s.start += shift_i, s.end += shift_i, rep.interleaved_trace.push_back(std::move(s));
    }
  }
  return rep;
}

std::string format_report(const SimReport& r) {
  const auto& c = r.config;
  std::ostringstream o;
  o << "machine  " << r.machine.name << (r.machine.description.empty() ? "" : ": " + r.machine.description) << "\n";
  o << "layer    " << c.name << ": hidden " << c.hidden << ", expert inter " << c.expert_inter << ", experts "
    << c.routed_experts << " routed / " << c.shared_experts << " shared, top-" << c.top_k << ", " << to_string(c.dtype)
    << "\n";
  o << "run      EP " << c.ranks << ", " << c.tokens_per_rank << " tokens/rank, routing " << r.routing
    << " (rank max/mean " << std::setprecision(3) << r.stats.rank_max_over_mean << ", expert max/mean "
    << r.stats.expert_max_over_mean << "), schedule " << r.policy << "\n";
  o << std::fixed;
  auto row = [&](const char* pass, const PassResult& p) {
    o << std::setprecision(3) << "  " << std::left << std::setw(9) << pass << std::right << std::setw(12)
      << p.serialized_s * 1e3 << std::setw(13) << p.interleaved_s * 1e3 << std::setw(9)
      << p.serialized_s / p.interleaved_s << "x" << std::setprecision(0) << std::setw(8)
      << p.serialized_matrix_busy * 100 << "%" << std::setw(7) << p.interleaved_matrix_busy * 100 << "%" << std::setw(8)
      << p.serialized_vector_busy * 100 << "%" << std::setw(7) << p.interleaved_vector_busy * 100 << "%" << std::setw(9)
      << p.serialized_exposed_comm * 100 << "%" << std::setw(7) << p.interleaved_exposed_comm * 100 << "%"
      << std::setw(11) << p.tasks << "\n";
  };
  o << "predicted (ms)   serialized  interleaved  speedup  matrix busy ser/int  vector busy ser/int  exposed comm ser/int  tasks\n";
  row("forward", r.forward);
  if (r.has_backward) row("backward", r.backward);
  o << std::setprecision(2) << "simulated " << r.simulated_tasks << " task executions in " << r.simulate_seconds
    << " s (" << std::setprecision(1) << double(r.simulated_tasks) / std::max(r.simulate_seconds, 1e-9) / 1e6
    << " M tasks/s); compile " << std::setprecision(2) << r.compile_seconds << " s\n";
  return o.str();
}

nlohmann::json to_json(const SimReport& r) {
  auto pass = [](const PassResult& p) {
    return nlohmann::json{{"serialized_s", p.serialized_s},
                          {"interleaved_s", p.interleaved_s},
                          {"speedup", p.serialized_s / p.interleaved_s},
                          {"serialized_matrix_busy", p.serialized_matrix_busy},
                          {"interleaved_matrix_busy", p.interleaved_matrix_busy},
                          {"serialized_vector_busy", p.serialized_vector_busy},
                          {"interleaved_vector_busy", p.interleaved_vector_busy},
                          {"serialized_exposed_comm", p.serialized_exposed_comm},
                          {"interleaved_exposed_comm", p.interleaved_exposed_comm},
                          {"tasks", p.tasks}};
  };
  nlohmann::json j = {{"machine", r.machine.name},
                      {"layer", hpmoe::to_json(r.config)},
                      {"routing", r.routing},
                      {"rank_max_over_mean", r.stats.rank_max_over_mean},
                      {"schedule", r.policy},
                      {"forward", pass(r.forward)},
                      {"simulate_seconds", r.simulate_seconds},
                      {"compile_seconds", r.compile_seconds},
                      {"simulated_tasks", r.simulated_tasks}};
  if (r.has_backward) j["backward"] = pass(r.backward);
  return j;
}

}  // namespace hpmoe::sim
