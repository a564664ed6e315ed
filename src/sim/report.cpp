#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hpmoe/error.hpp"
#include "compiler/layout.hpp"
#include "sim/sim.hpp"

namespace hpmoe::sim {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

double DeepEpExchange::cross_node_rows() const {
  double sum = 0;
  for (double r : dispatch_node) sum += r;
  return sum;
}

DeepEpExchange deepep_exchange(const LayerConfig& c, const ExpertPlacement& placement, const RouterOutput<float>& routing,
                               int ranks_per_node) {
  const int P = static_cast<int>(c.ranks), rpn = std::max(1, ranks_per_node);
  DeepEpExchange ex;
  ex.ranks = P;
  ex.nodes = (P + rpn - 1) / rpn;
  ex.dispatch_rank.assign(static_cast<std::size_t>(P) * P, 0);
  ex.dispatch_forward.assign(static_cast<std::size_t>(P) * P, 0);
  ex.dispatch_node.assign(static_cast<std::size_t>(P) * ex.nodes, 0);
  ex.received.assign(static_cast<std::size_t>(P), 0);
  ex.node_tokens.assign(static_cast<std::size_t>(P), 0);
  std::vector<std::int64_t> counted_node(static_cast<std::size_t>(ex.nodes), -1);
  std::vector<int> to_rank(static_cast<std::size_t>(P), -1), to_node(static_cast<std::size_t>(ex.nodes), -1);
  const std::int64_t K = routing.top_k;
  for (std::int64_t g = 0; g < routing.tokens; ++g) {
    const int s = static_cast<int>(g / c.tokens_per_rank), sn = s / rpn;
    for (std::int64_t k = 0; k < K; ++k) {
      const auto i = static_cast<std::size_t>(g * K + k);
      if (!routing.kept[i]) continue;
      const int d = placement.instance_rank(placement.first_instance(routing.expert[i])), dn = d / rpn;
      if (to_rank[static_cast<std::size_t>(d)] == g) continue;  // once per destination rank
      to_rank[static_cast<std::size_t>(d)] = static_cast<int>(g);
      ex.received[static_cast<std::size_t>(d)] += 1;
      if (counted_node[static_cast<std::size_t>(dn)] != g) {
        counted_node[static_cast<std::size_t>(dn)] = g;
        ex.node_tokens[static_cast<std::size_t>(s)] += 1;
      }
      if (dn == sn) {
        ex.dispatch_rank[static_cast<std::size_t>(s * P + d)] += 1;
        continue;
      }
      if (to_node[static_cast<std::size_t>(dn)] != g) {  // once per destination node, to the same-index rank there
        to_node[static_cast<std::size_t>(dn)] = static_cast<int>(g);
        ex.dispatch_node[static_cast<std::size_t>(s * ex.nodes + dn)] += 1;
      }
      const int f = std::min(P - 1, dn * rpn + s % rpn);
      if (f != d) ex.dispatch_forward[static_cast<std::size_t>(f * P + d)] += 1;
    }
  }
  return ex;
}

namespace {

// The rank that holds the most for the routing given, what its programs
// would declare under the worst routing, and the capacity check: the
// routing given must fit (an Error names the parts and the shortfall); the
// worst case is reported.
MemoryUse memory_check(const MachineModel& m, const LayerConfig& c, const ExpertPlacement& placement,
                       const taskflow::Machine& machine, const std::vector<double>& rank_buffers, bool backward,
                       bool optimizer_state, bool refuse) {
  MemoryUse most;
  for (std::int64_t r = 0; r < c.ranks; ++r) {
    MemoryUse here = parameter_bytes(c, placement, r, backward, optimizer_state);
    here.buffers = rank_buffers[static_cast<std::size_t>(r)];
    if (r == 0 || here.total() > most.total()) most = here;
  }
  // The worst routing, on the per-assignment exchange (the most rows a rank can receive).
  LayerConfig per_assignment = c;
  per_assignment.exchange = ExchangeMode::assignment;
  per_assignment.combine_dtype = CombineDType::layer;  // bf16 sums are the per-rank combine's; this one returns rows
  const auto worst = taskflow::routing_counts(per_assignment, worst_routing_for(c, placement, most.rank));
  taskflow::ScheduleScratch scratch;
  for (auto pass : {taskflow::Pass::forward, taskflow::Pass::backward}) {
    if (pass == taskflow::Pass::backward && !backward) break;
    most.worst_buffers = std::max(most.worst_buffers,
                                  declared_bytes(taskflow::generate(per_assignment, placement, worst, machine, pass, most.rank)));
  }
  most.worst_buffers = std::max(most.worst_buffers, most.buffers);
  most.capacity = m.memory_bytes_per_rank;
  if (refuse && most.capacity > 0 && most.total() > most.capacity) {
    const auto gb = [](double b) {
      char t[32];
      std::snprintf(t, sizeof t, "%.1f GB", b / 1e9);
      return std::string(t);
    };
    throw Error("rank " + std::to_string(most.rank) + " needs " + gb(most.total()) + " (weights " + gb(most.weights) +
                ", gradients " + gb(most.gradients) + ", optimizer state " + gb(most.optimizer) + ", buffers " +
                gb(most.buffers) + ") but machine '" + m.name + "' has " + gb(most.capacity) + " per rank: " +
                gb(most.total() - most.capacity) + " short; use more ranks, fewer tokens per rank, or a placement "
                "with fewer experts per rank");
  }
  return most;
}

// Before the step is routed or any program generated: a lower bound of
// what the fullest rank needs (its parameters; its own tokens in and out;
// the rows it receives, at least the average T K, each through the hidden
// width and the narrowest expert part's gate, up and SwiGLU columns). A
// layer that cannot fit even so is refused at once: routing and generating
// every rank's programs first took minutes and gigabytes of this host at
// millions of tokens. max_r (a_r + b_r) >= max(max_r a_r, min_r a_r + mean b).
void memory_precheck(const MachineModel& m, const LayerConfig& c, const ExpertPlacement& placement, bool backward,
                     bool optimizer_state) {
  if (m.memory_bytes_per_rank <= 0) return;
  const double elem = c.dtype == DType::fp32 ? 4.0 : 2.0, H = double(c.hidden);
  std::int64_t narrowest = c.expert_inter;
  for (std::int64_t i = 0; i < placement.instances(); ++i) {
    const auto [c0, c1] = placement.part_columns(i, c.expert_inter);
    narrowest = std::min(narrowest, c1 - c0);
  }
  double most = 0, least = -1;
  for (std::int64_t r = 0; r < c.ranks; ++r) {
    const MemoryUse p = parameter_bytes(c, placement, r, backward, optimizer_state);
    const double params = p.weights + p.gradients + p.optimizer;
    most = std::max(most, params);
    least = least < 0 ? params : std::min(least, params);
  }
  const double tokens = elem * 2.0 * double(c.tokens_per_rank) * H;
  // Under a capacity factor experts drop rows: then no bound from the rows.
  const double rows =
      c.capacity_factor > 0 ? 0.0 : elem * double(c.tokens_per_rank * c.top_k) * (H + 3.0 * double(narrowest));
  const double bound = std::max(most, least + rows) + tokens;
  if (bound <= m.memory_bytes_per_rank) return;
  const auto gb = [](double b) {
    char t[32];
    std::snprintf(t, sizeof t, "%.1f GB", b / 1e9);
    return std::string(t);
  };
  throw Error("the fullest rank needs at least " + gb(bound) + " (parameters " + gb(most) + " on the rank holding the most, " +
              "its tokens " + gb(tokens) + ", the rows it receives, at least " + gb(rows) + ") but machine '" + m.name +
              "' has " + gb(m.memory_bytes_per_rank) + " per rank: " + gb(bound - m.memory_bytes_per_rank) +
              " short; use more ranks, fewer tokens per rank, or a placement with fewer experts per rank (refused "
              "before the step was routed)");
}

// Every rank's program of a pass, scheduled.
std::vector<taskflow::Program> scheduled_programs(const LayerConfig& c, const ExpertPlacement& placement,
                                                 const taskflow::RoutingCounts& counts, const taskflow::Machine& machine,
                                                 taskflow::Pass pass, taskflow::Policy policy,
                                                 taskflow::ScheduleScratch& scratch) {
  std::vector<taskflow::Program> programs(static_cast<std::size_t>(c.ranks));
  for (std::int64_t r = 0; r < c.ranks; ++r) {
    programs[static_cast<std::size_t>(r)] = taskflow::generate(c, placement, counts, machine, pass, r);
    taskflow::schedule(programs[static_cast<std::size_t>(r)], policy, scratch);
  }
  return programs;
}

// The tasks' work, within the paper's kernel scope where asked: the per-rank
// combine computes the gate gradients where the expert rows live and puts K
// values per token: the products are gate_grad's work, outside the scope as
// there; the put is inside.
std::vector<std::vector<taskflow::TaskWork>> scoped_work(const std::vector<taskflow::Program>& set, bool kernel_scope) {
  auto work = task_work(set);
  if (kernel_scope)
    for (std::size_t r = 0; r < set.size(); ++r)
      for (std::size_t i = 0; i < set[r].tasks.size(); ++i) {
        switch (taskflow::role(set[r].tasks[i].kind).kernel_scope) {
          case taskflow::KernelScope::inside: break;
          case taskflow::KernelScope::outside: work[r][i].timed = false; break;
          case taskflow::KernelScope::put_only: work[r][i].local_bytes = 0; break;
        }
      }
  return work;
}

// A pass's tasks and the bytes its puts send to other ranks: in all, of
// lent weights, and across nodes.
void count_puts(const std::vector<taskflow::Program>& programs, const std::vector<std::vector<taskflow::TaskWork>>& work,
                int ranks_per_node, PassResult& out) {
  for (const auto& p : programs) {
    out.tasks += static_cast<std::int64_t>(p.tasks.size());
    for (std::size_t i = 0; i < p.tasks.size(); ++i) {
      const auto& t = p.tasks[i];
      if (!taskflow::is_put(t.kind)) continue;
      if (t.peer != p.rank) {
        const double b = taskflow::AccessTable::standard().work(p, t).bytes;
        out.put_bytes += b;
        if (taskflow::role(t.kind).scheme == taskflow::Scheme::lend) out.lent_bytes += b;
      }
      if (t.peer / ranks_per_node != p.rank / ranks_per_node)
        out.cross_node_bytes += work[static_cast<std::size_t>(p.rank)][i].bytes;
    }
  }
}

// The layer as the machine hosts it: its ranks sit in the machine's nodes,
// so the per-rank exchange forwards through them as the runtime would on
// that cluster.
LayerConfig hosted_layer(LayerConfig c, const MachineModel& m) {
  c.validate();
  if (c.ranks_per_node == 0 && m.ranks_per_node > 1 && c.ranks % m.ranks_per_node == 0) c.ranks_per_node = m.ranks_per_node;
  if (c.ranks_per_node != 0 && c.ranks_per_node != m.ranks_per_node && !(m.ranks_per_node <= 1 && c.ranks_per_node == c.ranks))
    throw Error("the layer's ranks_per_node (" + std::to_string(c.ranks_per_node) + ") differs from the " +
                std::to_string(m.ranks_per_node) + " of machine '" + m.name + "': leave it unset to use the machine's");
  return c;
}

// The per-node exchange's route of the step's tokens (SimReport::node_route).
SimReport::NodeRoute node_route(const LayerConfig& c, const ExpertPlacement& placement, const taskflow::RoutingCounts& counts,
                                std::int64_t tile_rows) {
  const taskflow::Exchange ex(c, placement, counts, tile_rows);
  SimReport::NodeRoute route;
  for (std::int64_t s = 0; s < c.ranks; ++s) {
    for (std::int64_t b = 0; b < ex.nodes(); ++b) route.crossings += ex.node_tokens(s, b);
    for (std::int64_t i = 0; i < ex.instances(); ++i) route.direct += ex.direct_first(s, i);
  }
  route.crossings += route.direct;
  for (std::int64_t d = 0; d < c.ranks; ++d) route.hot_ranks += !ex.takes_direct(d);
  return route;
}

}  // namespace

SimReport simulate(const MachineModel& given, const SimRequest& req) {
  req.config.validate();
  if (req.fp8_gemms && req.config.dtype != DType::bf16)
    throw Error("--gemm-dtype fp8 models a bf16 layer whose GEMMs take fp8 operands: use --dtype bf16");
  const MachineModel m = req.fp8_gemms ? given.with_fp8_gemms() : given;
  const LayerConfig c = hosted_layer(req.config, m);
  SimReport rep;
  rep.config = c;
  rep.machine = m;
  rep.routing = req.routing.describe();
  rep.policy = taskflow::name(req.policy);
  rep.has_backward = req.backward;
  rep.kernel_scope = req.kernel_scope;
  rep.fp8_gemms = req.fp8_gemms;
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  if (req.refuse_over_memory) memory_precheck(m, c, placement, req.backward, req.optimizer_state);
  const auto routing = route_step(c, req.routing, req.seed);
  rep.stats = routing_stats(c, placement, routing);
  auto counts = taskflow::routing_counts(c, routing);
  const taskflow::Machine machine = m.compiler_machine();
  // The per-rank exchange's blocks follow from the routing itself; the
  // DeepEP- and MindSpore-style baselines move rows their own way and take
  // the rest of their operators from the per-assignment programs.
  const bool by_rank = c.exchange == ExchangeMode::rank;
  if (by_rank) counts.token_counts = taskflow::rank_token_counts(c, placement, counts, routing, machine.tile_rows);
  if (c.forwards()) rep.node_route = node_route(c, placement, counts, machine.tile_rows);
  // The frameworks' exchanges lend no weights: their baselines run the layer without.
  LayerConfig per_assignment = c;
  per_assignment.exchange = ExchangeMode::assignment;
  per_assignment.combine_dtype = CombineDType::layer;  // bf16 sums are the per-rank combine's; this one returns rows
  per_assignment.lend_weights = 0;
  const bool lends = c.lend_weights != 0;
  // The (expert, rank) pairs the step lends: the exchange's own choice, from the counts.
  const auto lent_pairs = static_cast<std::int64_t>(lends ? taskflow::choose_lends(c, placement, counts).size() : 0);
  const double matrix_units = double(c.ranks) * (m.accelerator ? m.matrix_units : m.workers);
  const double vector_units = double(c.ranks) * (m.accelerator ? m.vector_units : m.workers);
  taskflow::ScheduleScratch scratch;
  DeepEpExchange deepep, rank_rows;
  std::vector<double> rank_buffers(static_cast<std::size_t>(c.ranks), 0.0);  // the larger pass's, per rank
  for (auto pass : {taskflow::Pass::forward, taskflow::Pass::backward}) {
    if (pass == taskflow::Pass::backward && !req.backward) break;
    const auto c0 = Clock::now();
    const auto programs = scheduled_programs(c, placement, counts, machine, pass, req.policy, scratch);
    const auto work = scoped_work(programs, req.kernel_scope);
    for (const auto& p : programs)
      rank_buffers[static_cast<std::size_t>(p.rank)] = std::max(rank_buffers[static_cast<std::size_t>(p.rank)], declared_bytes(p));
    // Refused before the pass is simulated where it cannot fit (the report's figures follow the loop).
    rep.memory = memory_check(m, c, placement, machine, rank_buffers, req.backward, req.optimizer_state, req.refuse_over_memory);
    const bool own_baseline = (by_rank || lends) && (m.deepep.enabled || m.mindspore.enabled);
    const auto baseline_programs = own_baseline
                                       ? scheduled_programs(per_assignment, placement, counts, machine, pass, req.policy, scratch)
                                       : std::vector<taskflow::Program>{};
    const auto& baseline = own_baseline ? baseline_programs : programs;
    const auto baseline_work = own_baseline ? scoped_work(baseline, req.kernel_scope) : work;
    rep.compile_seconds += since(c0);
    if (req.verify) {
      // A schedule that could deadlock or race must not be reported as a
      // time: the simulator would show a hang as a slow step, or not at all.
      const auto v0 = Clock::now();
      const taskflow::VerifyReport proof = taskflow::verify(programs);
      rep.verify_seconds += since(v0);
      if (!proof.ok)
        throw Error(std::string("simulate: the ") + (pass == taskflow::Pass::forward ? "forward" : "backward") +
                    " programs of " + std::to_string(c.ranks) + " ranks (schedule " + rep.policy +
                    ") failed the proof, so they are not simulated: " + proof.error +
                    "; this is a compiler bug: please report it with this command");
    }
    PassResult& out = pass == taskflow::Pass::forward ? rep.forward : rep.backward;
    count_puts(programs, work, m.ranks_per_node, out);
    out.lent = lent_pairs;
    const auto s0 = Clock::now();
    const Timeline ser = simulate_serialized(m, programs, work, c.dtype, req.trace);
    const Timeline inter = simulate_interleaved(m, programs, work, c.dtype, req.trace);
    rep.simulated_tasks += 2 * out.tasks;
    if (m.deepep.enabled) {
      if (pass == taskflow::Pass::forward) deepep = deepep_exchange(c, placement, routing, m.ranks_per_node);
      const Timeline t = simulate_deepep(m, baseline, baseline_work, c.dtype, deepep);
      out.deepep_s = t.makespan;
      out.deepep_exposed_comm = t.exposed_comm;
      rep.simulated_tasks += out.tasks;  // every task once more
      // Dispatch (fp8 in the forward pass where so configured) and combine cross the nodes once each way.
      const double h = double(c.hidden), elem = c.dtype == DType::bf16 ? 2.0 : 4.0;
      const double dispatch_row = pass == taskflow::Pass::forward && m.deepep.fp8_dispatch ? h + 4.0 * std::ceil(h / 128) : h * elem;
      out.deepep_cross_node_bytes = deepep.cross_node_rows() * (dispatch_row + h * elem);
      if (pass == taskflow::Pass::forward) rep.deepep_exchange = simulate_deepep_exchange(m, deepep, baseline[0].dims);
    }
    if (m.mindspore.enabled) {
      if (pass == taskflow::Pass::forward) rank_rows = deepep_exchange(c, placement, routing, static_cast<int>(c.ranks));
      const Timeline t = simulate_mindspore(m, baseline, baseline_work, c.dtype, rank_rows);
      out.mindspore_s = t.makespan;
      out.mindspore_exposed_comm = t.exposed_comm;
      rep.simulated_tasks += out.tasks;
    }
    rep.simulate_seconds += since(s0);
    out.serialized_s = ser.makespan;
    out.interleaved_s = inter.makespan;
    const double serialized_matrix_units = m.serialized_matrix_units > 0 ? double(c.ranks) * m.serialized_matrix_units : matrix_units;
    out.serialized_matrix_busy = ser.matrix_busy / (serialized_matrix_units * ser.makespan);
    // A serialized vector operator takes every unit that runs vector code.
    const double serialized_vector_units = m.matrix_runs_vector ? vector_units + matrix_units : vector_units;
    out.serialized_vector_busy = ser.vector_busy / (serialized_vector_units * ser.makespan);
    out.interleaved_matrix_busy = inter.matrix_busy / (matrix_units * inter.makespan);
    out.interleaved_vector_busy = inter.vector_busy / (vector_units * inter.makespan);
    out.serialized_exposed_comm = ser.exposed_comm;
    out.interleaved_exposed_comm = inter.exposed_comm;
    out.interleaved_link_busy_s = inter.busiest_link_s;
    if (req.trace) {  // backward after forward on one time axis
      const double shift_s = rep.serialized_trace.empty() ? 0 : rep.forward.serialized_s;
      const double shift_i = rep.interleaved_trace.empty() ? 0 : rep.forward.interleaved_s;
      for (auto s : ser.trace) s.start += shift_s, s.end += shift_s, rep.serialized_trace.push_back(std::move(s));
      for (auto s : inter.trace) s.start += shift_i, s.end += shift_i, rep.interleaved_trace.push_back(std::move(s));
    }
  }
  rep.verified = req.verify;
  return rep;  // rep.memory: checked in the last pass, on every pass's buffers
}

std::string format_report(const SimReport& r) {
  const auto& c = r.config;
  std::ostringstream o;
  o << "machine  " << r.machine.name << (r.machine.description.empty() ? "" : ": " + r.machine.description) << "\n";
  o << "layer    " << c.name << ": hidden " << c.hidden << ", expert inter " << c.expert_inter << ", experts "
    << c.routed_experts << " routed / " << c.shared_experts << " shared, top-" << c.top_k << ", " << to_string(c.dtype)
    << (r.fp8_gemms ? " (GEMMs at the machine's fp8 rates)" : "") << "\n";
  o << "run      EP " << c.ranks << ", " << c.tokens_per_rank << " tokens/rank, routing " << r.routing
    << " (rank max/mean " << std::setprecision(3) << r.stats.rank_max_over_mean << ", expert max/mean "
    << r.stats.expert_max_over_mean << "), schedule " << r.policy << "\n";
  if (!r.exchange_choice.empty()) o << "exchange auto: " << r.exchange_choice << "\n";
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
  if (r.kernel_scope) o << "scope    the fused kernel's: router backward and pack tasks take no time\n";
  o << std::setprecision(1) << "puts     " << r.forward.put_bytes / 1e6 << " MB forward";
  if (r.has_backward) o << " + " << r.backward.put_bytes / 1e6 << " MB backward";
  o << " to other ranks (all ranks)\n";
  if (const auto& n = r.node_route; n.crossings > 0)
    o << std::setprecision(1) << "nodes    " << 100.0 * double(n.direct) / double(n.crossings)
      << "% of the token crossings into other nodes straight to the one rank that takes them, the rest through forwarders"
      << (n.hot_ranks > 0 ? "; " + std::to_string(n.hot_ranks) + " hot ranks take theirs through the forwarders" : std::string()) << "\n";
  if (r.config.lend_weights != 0) {
    o << "lend     " << r.forward.lent << " (expert, rank) pairs lent (a rank's own rows >= " << r.config.lend_threshold()
      << "); their weights " << r.forward.lent_bytes / 1e6 << " MB forward";
    if (r.has_backward) o << " + " << r.backward.lent_bytes / 1e6 << " MB backward";
    o << " of the puts; the framework baselines lend none\n";
  }
  if (r.machine.deepep.enabled) {
    auto deepep = [&](const char* pass, const PassResult& p) {
      o << std::setprecision(3) << "  " << std::left << std::setw(9) << pass << std::right << "DeepEP-style " << p.deepep_s * 1e3
        << " ms, fused " << p.deepep_s / p.interleaved_s << "x faster; cross-node MB fused " << std::setprecision(1)
        << p.cross_node_bytes / 1e6 << ", DeepEP " << p.deepep_cross_node_bytes / 1e6 << "\n";
    };
    deepep("forward", r.forward);
    if (r.has_backward) deepep("backward", r.backward);
    const DeepEpExchangeAlone& x = r.deepep_exchange;
    o << std::setprecision(3) << "  exchange DeepEP-style alone (forward, no GEMMs; rank 0 counted as DeepEP's benchmark counts): "
      << "dispatch " << x.dispatch_s * 1e3 << " ms, combine " << x.combine_s * 1e3 << " ms; ";
    if (x.nodes > 1)
      o << std::setprecision(1) << "RDMA (logical) " << x.rdma_gbps(true) << " / " << x.rdma_gbps(false) << " GB/s, ";
    o << std::setprecision(1) << "NVL " << x.nvl_gbps(true) << " / " << x.nvl_gbps(false) << " GB/s; rank 0 sends "
      << x.cross_node_rows * x.dispatch_row_bytes / 1e6 << " MB across nodes, receives "
      << x.received_rows * x.dispatch_row_bytes / 1e6 << " MB\n";
  }
  if (r.machine.mindspore.enabled) {
    auto mindspore = [&](const char* pass, const PassResult& p) {
      o << std::setprecision(3) << "  " << std::left << std::setw(9) << pass << std::right << "MindSpore-style " << p.mindspore_s * 1e3
        << " ms, fused " << p.mindspore_s / p.interleaved_s << "x faster\n";
    };
    mindspore("forward", r.forward);
    if (r.has_backward) mindspore("backward", r.backward);
  }
  {
    const MemoryUse& mu = r.memory;
    const auto gb = [](double b) {
      std::ostringstream t;
      t << std::fixed << std::setprecision(b < 1e9 ? 3 : 1) << b / 1e9 << " GB";
      return t.str();
    };
    o << "memory   rank " << mu.rank << " holds the most: weights " << gb(mu.weights);
    if (mu.gradients > 0) o << ", gradients " << gb(mu.gradients);
    if (mu.optimizer > 0) o << ", optimizer state " << gb(mu.optimizer);
    o << ", buffers " << gb(mu.buffers) << " = " << gb(mu.total());
    if (mu.capacity > 0) o << " of " << gb(mu.capacity) << " (" << std::fixed << std::setprecision(0) << 100 * mu.total() / mu.capacity << "%)";
    o << std::defaultfloat << "\n         worst routing (every token's choices on its experts): buffers " << gb(mu.worst_buffers) << " = "
      << gb(mu.worst_total());
    if (mu.capacity > 0)
      o << (mu.worst_total() <= mu.capacity ? ": fits" : ": does NOT fit, " + gb(mu.worst_total() - mu.capacity) + " short");
    o << "\n";
  }
  o << std::setprecision(2) << "simulated " << r.simulated_tasks << " task executions in " << r.simulate_seconds
    << " s (" << std::setprecision(1) << double(r.simulated_tasks) / std::max(r.simulate_seconds, 1e-9) / 1e6
    << " M tasks/s); compile " << std::setprecision(2) << r.compile_seconds << " s";
  if (r.verified) o << "; proved (whole set: no deadlock, every read covered) " << r.verify_seconds << " s";
  o << "\n";
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
                          {"interleaved_link_busy_s", p.interleaved_link_busy_s},
                          {"tasks", p.tasks},
                          {"cross_node_bytes", p.cross_node_bytes},
                          {"put_bytes", p.put_bytes},
                          {"lent_bytes", p.lent_bytes},
                          {"lent", p.lent}};
  };
  nlohmann::json j = {{"machine", r.machine.name},
                      {"layer", hpmoe::to_json(r.config)},
                      {"routing", r.routing},
                      {"rank_max_over_mean", r.stats.rank_max_over_mean},
                      {"schedule", r.policy},
                      {"forward", pass(r.forward)},
                      {"simulate_seconds", r.simulate_seconds},
                      {"compile_seconds", r.compile_seconds},
                      {"verified", r.verified},
                      {"verify_seconds", r.verify_seconds},
                      {"simulated_tasks", r.simulated_tasks}};
  if (r.has_backward) j["backward"] = pass(r.backward);
  if (r.machine.deepep.enabled)
    for (auto [key, p] : {std::pair<const char*, const PassResult*>{"forward", &r.forward}, {"backward", &r.backward}})
      if (j.contains(key)) {
        j[key]["deepep_s"] = p->deepep_s;
        j[key]["deepep_speedup"] = p->deepep_s / p->interleaved_s;
        j[key]["deepep_cross_node_bytes"] = p->deepep_cross_node_bytes;
      }
  if (r.machine.deepep.enabled) {
    const DeepEpExchangeAlone& x = r.deepep_exchange;
    j["deepep_exchange"] = {{"dispatch_s", x.dispatch_s}, {"combine_s", x.combine_s},
                            {"dispatch_row_bytes", x.dispatch_row_bytes}, {"combine_row_bytes", x.combine_row_bytes},
                            {"rank0_received_rows", x.received_rows}, {"rank0_node_tokens", x.node_tokens},
                            {"rank0_cross_node_rows", x.cross_node_rows}, {"nodes", x.nodes},
                            {"dispatch_rdma_gbps", x.nodes > 1 ? x.rdma_gbps(true) : 0.0},
                            {"combine_rdma_gbps", x.nodes > 1 ? x.rdma_gbps(false) : 0.0},
                            {"dispatch_nvl_gbps", x.nvl_gbps(true)}, {"combine_nvl_gbps", x.nvl_gbps(false)}};
  }
  if (r.machine.mindspore.enabled)
    for (auto [key, p] : {std::pair<const char*, const PassResult*>{"forward", &r.forward}, {"backward", &r.backward}})
      if (j.contains(key)) {
        j[key]["mindspore_s"] = p->mindspore_s;
        j[key]["mindspore_speedup"] = p->mindspore_s / p->interleaved_s;
      }
  if (!r.exchange_choice.empty()) j["exchange_choice"] = r.exchange_choice;
  if (const auto& n = r.node_route; n.crossings > 0)
    j["node_route"] = {{"crossings", n.crossings}, {"direct", n.direct}, {"hot_ranks", n.hot_ranks}};
  j["kernel_scope"] = r.kernel_scope;
  j["gemm_dtype"] = r.fp8_gemms ? "fp8" : to_string(r.config.dtype);
  j["put_engine"] = name(r.machine.put_engine);
  const MemoryUse& mu = r.memory;
  j["memory"] = {{"rank", mu.rank},
                 {"weights_bytes", mu.weights},
                 {"gradients_bytes", mu.gradients},
                 {"optimizer_bytes", mu.optimizer},
                 {"buffers_bytes", mu.buffers},
                 {"total_bytes", mu.total()},
                 {"worst_routing_buffers_bytes", mu.worst_buffers},
                 {"worst_routing_total_bytes", mu.worst_total()},
                 {"capacity_bytes", mu.capacity}};
  if (mu.capacity > 0) j["memory"]["worst_routing_fits"] = mu.worst_total() <= mu.capacity;
  return j;
}

}  // namespace hpmoe::sim
