// The serialized baselines on a machine model: the same tiles, one operator
// at a time. Each operator's tasks are list-scheduled on the units of each
// rank, the operator ends when every rank's tasks and transfers are done,
// then the next pays a launch (and, after an all-to-all, a collective
// synchronisation). Also DeepEP's exchange and MindSpore's dispatcher as
// operator sequences, and the work of each task.
#include <algorithm>
#include <queue>

#include "hpmoe/error.hpp"
#include "sim/simulate_parts.hpp"

namespace hpmoe::sim {

using namespace detail;

namespace {

// The serialized baseline's operators: one task kind each; an exchange is
// preceded by a permute (the gather of the rows into a send buffer).
struct Operator {
  TaskKind kind;
  bool all_to_all = false;
  bool permute_first = false;
};

std::vector<Operator> operators(taskflow::Pass pass) {
  std::vector<Operator> ops;
  for (TaskKind k : taskflow::operator_order(pass)) {
    const bool exchange = is_put(k);
    ops.push_back({k, exchange, exchange && taskflow::role(k).permute_first});
  }
  return ops;
}

}  // namespace

namespace {

// Rows of an exchange in the DeepEP scheme, in the direction of `kind`:
// dispatch-like (tokens to experts) or combine-like (back), started at `now`
// on `links`; returns when the last lands.
// A row of the exchange: the forward dispatch optionally in fp8 with one
// fp32 scale per 128 elements; the rest in the layer's dtype.
double deepep_row_bytes(const MachineModel& m, taskflow::Collective op, const taskflow::Dims& dims) {
  return op == taskflow::Collective::dispatch && m.deepep.fp8_dispatch
             ? double(dims.hidden) + 4.0 * double((dims.hidden + 127) / 128)
             : double(dims.hidden * dims.elem_bytes);
}

double run_deepep_exchange(const MachineModel& m, const DeepEpExchange& ex, taskflow::Collective op,
                           const taskflow::Dims& dims, double now, Links& links, std::vector<int>& resources) {
  const int P = ex.ranks;
  const bool to_experts = op == taskflow::Collective::dispatch || op == taskflow::Collective::grad_dispatch;
  const double row_bytes = deepep_row_bytes(m, op, dims);
  std::vector<std::pair<int, int>> ends;
  const auto send = [&](int from, int to, double rows) {
    if (rows <= 0 || from == to) return;
    if (!to_experts) std::swap(from, to);
    const auto [latency, bw] = links.path(from, to, resources);
    (void)latency;
    if (bw > 0) links.start(now, rows * row_bytes, resources, (std::int64_t{from} << 32) | to);
    ends.push_back({from, to});
  };
  const int rpn = m.ranks_per_node;
  for (int s = 0; s < P; ++s) {
    for (int d = 0; d < P; ++d) {
      send(s, d, ex.dispatch_rank[static_cast<std::size_t>(s * P + d)]);
      send(s, d, ex.dispatch_forward[static_cast<std::size_t>(s * P + d)]);
    }
    for (int n = 0; n < ex.nodes; ++n)
      send(s, std::min(P - 1, n * rpn + s % rpn), ex.dispatch_node[static_cast<std::size_t>(s * ex.nodes + n)]);
  }
  double end = now;
  for (const auto& [from, to] : ends) end = std::max(end, now + links.path(from, to, resources).first);
  while (links.next_time() < kInf) {
    const auto [t, tag] = links.pop();
    end = std::max(end, t + links.path(static_cast<int>(tag >> 32), static_cast<int>(tag & 0xFFFFFFFF),
                   resources).first);
  }
  return end;
}

// One operator of the MindSpore/MindFormers token dispatcher
// (MoEAlltoAllZeroRedundancyTokenDispatcher), as its code runs it: a vector
// kernel over all vector units, an exchange, or a collective's handshake, and
// where the host waits for the device.
struct FrameworkOp {
  std::vector<double> vector_bytes;           // per rank, read + written (empty: none)
  const std::vector<double>* rows = nullptr;  // exchange rows [s * P + d] (a token once per destination rank)
  bool reverse = false;                       // the rows go d -> s
  double row_bytes = 0;
  double pair_bytes = 0;  // an all-to-all of equal blocks between every pair
  bool collective = false, host_sync = false;
};

// The dispatcher's operators around one exchange of hpmoe's operator order.
// N tokens a rank, E experts, H hidden, `el` bytes a bf16 element, f an fp32
// one; sent / received: a rank's rows in the token all-to-all-v (one per token
// and destination rank); expert: its rows for the grouped GEMM (one per token
// and expert). The backward pass runs the autograd mirror of each forward
// step (gathers become scatter-adds), without the routing map, the list
// all-gathers and the host copy, whose results the forward kept.
std::vector<FrameworkOp> mindspore_ops(TaskKind kind, const std::vector<Program>& programs, const DeepEpExchange& ex) {
  const int P = ex.ranks;
  const taskflow::Dims& d = programs[0].dims;
  const double H = double(d.hidden), N = double(d.tokens), E = double(d.experts), el = double(d.elem_bytes), f = 4;
  std::vector<double> sent(static_cast<std::size_t>(P), 0), received(sent), expert(sent);
  for (int a = 0; a < P; ++a)
    for (int b = 0; b < P; ++b) {
      sent[static_cast<std::size_t>(a)] += ex.dispatch_rank[static_cast<std::size_t>(a * P + b)];
      received[static_cast<std::size_t>(b)] += ex.dispatch_rank[static_cast<std::size_t>(a * P + b)];
    }
  for (int r = 0; r < P; ++r) expert[static_cast<std::size_t>(r)] = double(programs[static_cast<std::size_t>(r)].expert_begin.back());
  const auto per_rank = [&](auto&& bytes) {
    std::vector<double> v(static_cast<std::size_t>(P));
    for (int r = 0; r < P; ++r) v[static_cast<std::size_t>(r)] = bytes(static_cast<std::size_t>(r));
    return v;
  };
  const auto vec = [&](auto&& bytes) { return FrameworkOp{per_rank(bytes)}; };
  const FrameworkOp exchange{{}, &ex.dispatch_rank, false, H * el};
  FrameworkOp exchange_back = exchange;
  exchange_back.reverse = true;
  exchange_back.collective = true;
  FrameworkOp exchange_out = exchange;
  exchange_out.collective = true;
  std::vector<FrameworkOp> ops;
  // Forward combine and its mirror (the backward's gradient dispatch): scale
  // by the gate, sum a token's local experts (zeros, cast to fp32, index_add,
  // cast back), the all-to-all-v, then the same sum over the returned rows.
  const auto combine_like = [&](bool back) {
    ops.push_back(vec([&](std::size_t r) { return 2 * expert[r] * H * el; }));  // * probs
    ops.push_back(vec([&](std::size_t r) { return received[r] * H * f; }));     // zeros
    ops.push_back(vec([&](std::size_t r) { return expert[r] * H * (el + f); }));  // cast to fp32
    ops.push_back(vec([&](std::size_t r) { return expert[r] * H * f + 2 * received[r] * H * f; }));  // index_add
    ops.push_back(vec([&](std::size_t r) { return received[r] * H * (f + el); }));  // cast to bf16
    ops.push_back(back ? exchange_out : exchange_back);
    ops.push_back(vec([&](std::size_t) { return N * H * f; }));  // zeros
    ops.push_back(vec([&](std::size_t r) { return sent[r] * H * (el + f); }));  // cast to fp32
    ops.push_back(vec([&](std::size_t r) { return sent[r] * H * f + 2 * N * H * f; }));  // index_add
    ops.push_back(vec([&](std::size_t) { return N * H * (f + el); }));  // cast to bf16
  };
  switch (taskflow::role(kind).collective) {
    case taskflow::Collective::dispatch: {
      ops.push_back(vec([&](std::size_t) { return 3 * N * E * el; }));  // routing map: zeros, scatter, transpose
      FrameworkOp map;
      map.pair_bytes = N * E / P * el;  // the (ep, N, local E) map, all to all
      map.collective = true;
      ops.push_back(map);
      FrameworkOp gather_lists;
      gather_lists.collective = true;
      ops.push_back(gather_lists);  // send list
      ops.push_back(gather_lists);  // receive list
      FrameworkOp to_host;
      to_host.host_sync = true;  // MoveTo(CPU) of both lists: AlltoAllVC needs their counts on the host
      ops.push_back(to_host);
      ops.push_back(vec([&](std::size_t r) { return 2 * sent[r] * H * el; }));  // index_select for the all-to-all-v
      ops.push_back(exchange_out);
      ops.push_back(vec([&](std::size_t r) { return (received[r] + expert[r]) * H * el; }));  // index_select for the GMM
      break;
    }
    case taskflow::Collective::combine: combine_like(false); break;
    case taskflow::Collective::grad_dispatch: combine_like(true); break;
    default:  // the backward's combine (and any other put): the dispatch's gathers, mirrored
      ops.push_back(vec([&](std::size_t r) { return received[r] * H * el + (received[r] + expert[r]) * H * el; }));  // zeros + scatter-add
      ops.push_back(exchange_back);
      ops.push_back(vec([&](std::size_t) { return N * H * el; }));  // zeros
      ops.push_back(vec([&](std::size_t r) { return sent[r] * H * el + 2 * N * H * el; }));  // scatter-add
      break;
  }
  return ops;
}

// Runs framework operators from `now`; returns when the last one ends.
double run_framework_ops(const MachineModel& m, const std::vector<FrameworkOp>& ops, int P, double now, Links& links,
                         std::vector<int>& resources, double& exposed) {
  const int vector_units = m.vector_units + (m.matrix_runs_vector ? m.matrix_units : 0);
  const double vector_rate = double(m.accelerator ? vector_units : m.workers) * m.vector_bytes_per_s;
  for (const FrameworkOp& op : ops) {
    now += m.operator_launch_s;
    const double start = now;
    double end = now;
    for (double bytes : op.vector_bytes) end = std::max(end, now + bytes / vector_rate + m.task_overhead_s);
    if (op.rows || op.pair_bytes > 0) {
      for (int s = 0; s < P; ++s)
        for (int d = 0; d < P; ++d) {
          if (s == d) continue;
          const double bytes = op.rows ? (*op.rows)[static_cast<std::size_t>(s * P + d)] * op.row_bytes : op.pair_bytes;
          if (bytes <= 0) continue;
          const int from = op.reverse ? d : s, to = op.reverse ? s : d;
          const auto [latency, bw] = links.path(from, to, resources);
          if (bw > 0) links.start(now, bytes, resources, (std::int64_t{from} << 32) | to);
          end = std::max(end, now + latency);
        }
      while (links.next_time() < kInf) {
        const auto [t, tag] = links.pop();
        end = std::max(end, t + links.path(static_cast<int>(tag >> 32), static_cast<int>(tag & 0xFFFFFFFF),
                       resources).first);
      }
    }
    if (op.collective) end += m.collective_sync_s;
    if (op.host_sync) end += m.mindspore.host_sync_s;
    if (op.rows || op.pair_bytes > 0 || op.collective || op.host_sync) exposed += end - start;
    now = end;
  }
  return now;
}

enum class Baseline { framework, deepep, mindspore };

Timeline serialized(const MachineModel& m, const std::vector<Program>& programs,
                    const std::vector<std::vector<TaskWork>>& work, DType dtype, bool trace, Baseline baseline,
                    const DeepEpExchange* deepep) {
  check_programs(programs, work);
  const int P = static_cast<int>(programs.size());
  const taskflow::Machine& machine = programs[0].machine;
  const int Q = machine.workers();
  Timeline out;
  double exposed = 0;
  std::vector<int> resources;
  std::vector<std::pair<double, int>> dealt;  // CPU: each worker's free time, in turn
  const double overhead = m.serialized_task_overhead_s >= 0 ? m.serialized_task_overhead_s : m.task_overhead_s;
  Durations duration(m, dtype, overhead);
  // Task ids of each kind, per rank, in generation order.
  constexpr auto kinds = static_cast<std::size_t>(TaskKind::count);
  std::vector<std::vector<std::int32_t>> by_kind(static_cast<std::size_t>(P) * kinds);
  for (int r = 0; r < P; ++r) {
    const auto& p = programs[static_cast<std::size_t>(r)];
    for (std::size_t id = 0; id < p.tasks.size(); ++id)
      by_kind[static_cast<std::size_t>(r) * kinds + static_cast<std::size_t>(p.tasks[id].kind)].push_back(static_cast<std::int32_t>(id));
  }
  double now = 0;
  bool first = true;
  for (const Operator& op : operators(programs[0].pass)) {
    // DeepEP's dispatch format is its own (baselines.deepep.fp8_dispatch),
    // and its fp8 rows go to the GEMM with their scales: it runs no decode,
    // whatever format hpmoe's programs dispatch in.
    if (baseline == Baseline::deepep && taskflow::role(op.kind).scheme == taskflow::Scheme::assignment_staged &&
        !is_put(op.kind))
      continue;
    bool any = false;
    for (int r = 0; r < P && !any; ++r)
      for (const std::int32_t id : by_kind[static_cast<std::size_t>(r) * kinds + static_cast<std::size_t>(op.kind)])
        if (work[static_cast<std::size_t>(r)][static_cast<std::size_t>(id)].timed) {
          any = true;
          break;
        }
    if (!any) continue;  // nothing of it in scope: no operator
    // 0: the permute before an exchange, a framework's own operator (the CPU
    // baseline's dispatch gathers its rows itself, as the runtime's does).
    const bool permute = op.permute_first && baseline != Baseline::mindspore && m.accelerator;
    for (int pass = permute ? 0 : 1; pass < 2; ++pass) {
      if (!first) now += m.operator_launch_s;
      first = false;
      Links links(m, P);
      double end = now;
      if (baseline == Baseline::mindspore && op.all_to_all) {  // the dispatcher's own operators, permutes included
        now = run_framework_ops(m, mindspore_ops(op.kind, programs, *deepep), P, now - m.operator_launch_s, links,
                                resources, exposed);
        continue;
      }
      if (baseline == Baseline::deepep && pass == 1 && op.all_to_all) {  // DeepEP's kernel moves the rows its own way
        const double op_end = run_deepep_exchange(m, *deepep, taskflow::role(op.kind).collective, programs[0].dims, now,
                                                  links, resources) + m.deepep.kernel_launch_s;
        exposed += op_end - now;
        now = op_end;
        continue;
      }
      // A vector operator takes every unit that runs vector code (all of a
      // GPU's SMs, as its GEMMs do: serialized.matrix_units); the
      // exchange's puts stay on the units that carry them.
      const QueueClass op_class = taskflow::queue_class(op.kind);
      const bool puts = pass == 1 && is_put(op.kind);
      const auto units_of_operator = [&](int w) { return puts ? machine.takes(w, op_class) : machine.runs(w, op_class); };
      for (int r = 0; r < P; ++r) {
        const auto& p = programs[static_cast<std::size_t>(r)];
        // The units of the operator's class. An accelerator's framework
        // hands each tile to the earliest free unit (ties: lowest unit); the
        // CPU baseline deals an operator's tiles out in turn, tile i to
        // worker i mod W, as the runtime's serialized operator sequence does
        // (src/runtime/engine.hpp).
        std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>, std::greater<>> units;
        dealt.clear();
        if (taskflow::queue_class(op.kind) == QueueClass::matrix && m.serialized_matrix_units > 0)
          for (int w = 0; w < m.serialized_matrix_units; ++w) units.push({now,
               w});  // every SM on the framework's GEMMs
        else
          for (int w = 0; w < Q; ++w)
            if (units_of_operator(w)) {
              units.push({now, w});
              dealt.push_back({now, w});
            }
        const bool in_turn = !m.accelerator && !dealt.empty();
        std::size_t turn = 0;
        for (const std::int32_t task_id : by_kind[static_cast<std::size_t>(r) * kinds + static_cast<std::size_t>(op.kind)]) {
          const auto id = static_cast<std::size_t>(task_id);
          const Task& t = p.tasks[id];
          std::pair<double, int>* next_unit = in_turn ? &dealt[turn++ % dealt.size()] : nullptr;
          const auto [start, unit] = in_turn ? *next_unit : units.top();
          if (!in_turn) units.pop();
          const TaskWork& w = work[static_cast<std::size_t>(r)][id];
          const double bytes = w.bytes;
          const double d = !w.timed ? 0.0 : pass == 0 ? bytes / m.vector_bytes_per_s + overhead : duration(p, t, w);
          if (in_turn) next_unit->first = start + d;
          else units.push({start + d, unit});
          (t.queue == QueueClass::matrix ? out.matrix_busy : out.vector_busy) += d;
          const bool exchange = pass == 1 && is_put(t.kind);
          if (trace) {
            out.trace.push_back(slice(r, unit, start, start + d, t));
            if (pass == 0) out.trace.back().name = "permute";
          }
          end = std::max(end, start + d);
          if (exchange && t.peer != r) {
            const auto [latency, bw] = links.path(r, t.peer, resources);
            if (bw > 0) links.start(start + d, bytes, resources, (std::int64_t{r} << 32) | t.peer);
            else end = std::max(end, start + d + latency);
          }
        }
      }
      while (links.next_time() < kInf) {
        const auto [t, tag] = links.pop();
        end = std::max(end, t + links.path(static_cast<int>(tag >> 32), static_cast<int>(tag & 0xFFFFFFFF),
                       resources).first);
      }
      const double op_end = end + (pass == 1 && op.all_to_all ? m.collective_sync_s : 0.0);
      // Nothing overlaps an exchange in a serialized step: all of it is exposed.
      if (pass == 1 && op.all_to_all) exposed += op_end - now;
      now = op_end;
    }
  }
  out.makespan = now;
  out.exposed_comm = now > 0 ? exposed / now : 0;
  return out;
}

}  // namespace

Timeline simulate_serialized(const MachineModel& m, const std::vector<Program>& programs,
                             const std::vector<std::vector<TaskWork>>& work, DType dtype, bool trace) {
  return serialized(m, programs, work, dtype, trace, Baseline::framework, nullptr);
}

Timeline simulate_deepep(const MachineModel& m, const std::vector<Program>& programs,
                         const std::vector<std::vector<TaskWork>>& work, DType dtype, const DeepEpExchange& ex) {
  if (ex.ranks != static_cast<int>(programs.size())) throw Error("simulate: the DeepEP exchange is for another number of ranks");
  return serialized(m, programs, work, dtype, false, Baseline::deepep, &ex);
}

DeepEpExchangeAlone simulate_deepep_exchange(const MachineModel& m, const DeepEpExchange& ex, const taskflow::Dims& dims) {
  if (ex.ranks < 1 || ex.received.size() != static_cast<std::size_t>(ex.ranks))
    throw Error("simulate: the DeepEP exchange has no rows to time");
  DeepEpExchangeAlone out;
  std::vector<int> resources;
  for (const auto op : {taskflow::Collective::dispatch, taskflow::Collective::combine}) {
    Links links(m, ex.ranks);  // each kernel alone on idle links, as the benchmark runs it
    const double seconds = run_deepep_exchange(m, ex, op, dims, 0.0, links, resources);
    (op == taskflow::Collective::dispatch ? out.dispatch_s : out.combine_s) = seconds;
    (op == taskflow::Collective::dispatch ? out.dispatch_row_bytes : out.combine_row_bytes) = deepep_row_bytes(m, op, dims);
  }
  out.nodes = ex.nodes;
  out.received_rows = ex.received[0];
  out.node_tokens = ex.node_tokens[0];
  for (int n = 0; n < ex.nodes; ++n) out.cross_node_rows += ex.dispatch_node[static_cast<std::size_t>(n)];
  return out;
}

Timeline simulate_mindspore(const MachineModel& m, const std::vector<Program>& programs,
                            const std::vector<std::vector<TaskWork>>& work, DType dtype, const DeepEpExchange& ex) {
  if (ex.ranks != static_cast<int>(programs.size())) throw Error("simulate: the exchange is for another number of ranks");
  return serialized(m, programs, work, dtype, false, Baseline::mindspore, &ex);
}

std::vector<std::vector<TaskWork>> task_work(const std::vector<Program>& programs) {
  const auto& table = taskflow::AccessTable::standard();
  std::vector<std::vector<TaskWork>> work(programs.size());
  for (std::size_t r = 0; r < programs.size(); ++r) {
    work[r].reserve(programs[r].tasks.size());
    for (const Task& t : programs[r].tasks) work[r].push_back(table.work(programs[r], t));
  }
  return work;
}

}  // namespace hpmoe::sim
