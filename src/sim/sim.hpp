#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "hpmoe/step.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/routing.hpp"
#include "ops/access.hpp"
#include "compiler/taskflow.hpp"

// The discrete-event simulator: the programs the compiler emits, and the
// serialized baseline's operator sequence over the same tiles, executed on a
// machine model (matrix and vector units, links shared by the transfers
// crossing them, launch and collective costs). Task costs come from the
// access table's work.
namespace hpmoe::sim {

// GEMM tile throughput of one matrix unit at one shape (measured or cited):
// with the weight panel already near the unit (reused by the tile before),
// and streamed from memory (its first use). 0 streamed: same as reused.
//
// A rate is given as FLOP/s (measured: `hpmoe calibrate`), or as an
// efficiency: the share of the unit's peak (MachineModel::peak_*) this tile
// shape reaches, for every precision the peak gives (accelerator models,
// whose efficiencies are estimates; docs/simulator.md).
struct TileRate {
  std::int64_t m = 64, k = 2048;
  double fp32_flops = 0, bf16_flops = 0;  // per second, one unit
  double fp32_streamed_flops = 0, bf16_streamed_flops = 0;
  double fp8_flops = 0;   // 0: the machine has no fp8 GEMM rate
  double efficiency = 0;  // > 0: the rates above are this share of the peak
};

// Who moves a put's bytes.
//   dma:    a copy engine: the issuing unit is free after the issue; at most
//           `put_in_flight` puts of a rank are on the wire at once (0: no bound),
//           the rest wait in issue order for an engine.
//   vector: the issuing vector unit copies the data itself (Ascend AIV puts:
//           through its local buffer, fence, then signal): it is held until
//           the bytes have landed at the receiver.
//   cpu:    the issuing core copies (put.copy_bytes_per_s); a receiver that
//           runs a protocol stack (TCP) spends core time per put and per byte
//           on the receiving rank (put.receive). The stack takes the bytes as
//           they arrive, so the put is whole when its last byte lands or when
//           the stack catches up, whichever is later; the share of that work
//           done while the rank computed stretches the task it ran. With put.stream_per_peer
//           a rank's puts to one peer travel one stream (a TCP connection):
//           one at a time, in issue order, so they land one after another
//           instead of together at the end of a shared transfer.
enum class PutEngine { dma, vector, cpu };
const char* name(PutEngine);

// Link rate of a level as a function of the EP degree where a source gives
// one (all-to-all bandwidth per rank falls as the fan-out grows): linear in
// log2(EP) between the given points, the end values beyond them.
struct RateAtDegree {
  int ranks = 0;
  double bytes_per_s = 0;
};

// The DeepEP-style baseline (GPU machines): operators as in the serialized
// baseline with every SM on the GEMMs, and DeepEP's exchange: a token goes
// once to each destination rank (not once per expert), across nodes once
// per destination node over RDMA to the same-index GPU there, which forwards
// it over NVLink; dispatch optionally in fp8 (1 byte per element plus one
// fp32 scale per 128), combine in bf16.
struct DeepEpBaseline {
  bool enabled = false;
  bool fp8_dispatch = true;
  double kernel_launch_s = 0;  // per dispatch or combine kernel (replaces the collective sync)
};

// The MindSpore/MindFormers baseline (Ascend): operators as in the
// serialized baseline, with the framework's token dispatcher around each
// exchange, as its code runs it: the routing map's all-to-all, two
// all-gathers of the send and receive lists, a device-to-host copy of them
// the host waits for, index_select permutes, an all-to-all-v of one row per
// token and destination rank, and on the way back scale, cast and index_add.
struct MindSporeBaseline {
  bool enabled = false;
  double host_sync_s = 0;  // the host's wait for the lists and the launch bubble after it
};

// A machine, as a file in machines/ (every figure with its source).
struct MachineModel {
  std::string name, description;
  bool accelerator = false;       // false: unified CPU workers
  int matrix_units = 0, vector_units = 0, workers = 1;  // per rank
  // "units.matrix_runs_vector": the matrix units run vector code too (a
  // GPU's SMs; Ascend's cube cores do not). A serialized run's vector
  // operators then take every unit, as its GEMMs do, and the fused
  // schedule's final reductions the matrix units too
  // (taskflow::Machine::matrix_runs_vector).
  bool matrix_runs_vector = false;
  std::int64_t tile_rows = 64, tile_cols = 64;
  std::int64_t weight_tile_rows = 0;  // rows of weight-gradient tiles ("tile.weight_rows"; 0: tile_rows)
  std::int64_t weight_tile_cols = 0;  // columns of a weight-gradient task ("tile.weight_cols", a multiple of cols; 0: cols)
  std::vector<TileRate> tile_rates;  // nearest shape wins
  // One matrix unit's peak FLOP/s ("matrix.peak"; 0: not given), which
  // tile rates given as an efficiency are a share of.
  double peak_fp32_flops = 0, peak_bf16_flops = 0, peak_fp8_flops = 0;
  // Every tile shape has an fp8 rate.
  bool has_fp8() const;
  // This machine with its GEMMs at their fp8 rates (a bf16 layer whose
  // GEMMs take fp8 operands, as DeepSeek-V3 trains): Error where it has none.
  MachineModel with_fp8_gemms() const;
  double vector_bytes_per_s = 0;     // per vector (or unified) unit
  // Where measured ("vector.by_kind", from `hpmoe calibrate`): a vector
  // kind's own rate, in the bytes its access-table traffic terms count per
  // second. One rate for all kinds was 1.5x to 4x off for some of them: a
  // SwiGLU streams, a gate gradient takes dot products over rows read top_k
  // times, a router backward writes x transposed. 0: vector_bytes_per_s.
  std::array<double, static_cast<std::size_t>(taskflow::TaskKind::count)> vector_kind_bytes_per_s{};
  double vector_rate(taskflow::TaskKind k) const {
    const double r = vector_kind_bytes_per_s[static_cast<std::size_t>(k)];
    return r > 0 ? r : vector_bytes_per_s;
  }
  double task_overhead_s = 0;        // per task, on its unit
  double signal_latency_s = 0;       // trigger to the waiter's start
  double put_issue_s = 0;            // sender unit per put
  double put_copy_bytes_per_s = 0;   // sender unit per byte (0: none)
  PutEngine put_engine = PutEngine::dma;
  int put_in_flight = 0;                 // dma: puts per rank on the wire at once (0: no bound)
  double put_receive_s = 0;              // cpu: receiver core time per put (0: none)
  double put_receive_bytes_per_s = 0;    // cpu: receiver core time per byte (0: none)
  bool put_stream_per_peer = false;      // cpu: a rank's puts to one peer go one at a time, in order
  // Links: each rank has one port per level; a transfer uses the sender's
  // and receiver's ports and gets min(capacity / sharers) of both.
  int ranks_per_node = 1;
  double intra_bytes_per_s = 0, intra_latency_s = 0;  // 0 bandwidth: no link cost
  double inter_bytes_per_s = 0, inter_latency_s = 0;
  std::vector<RateAtDegree> intra_by_ep;  // where given, replaces intra_bytes_per_s (see intra_rate)
  double intra_rate(int ranks) const;
  // Optional 2D mesh (near-memory processing): rank r at (r % cols, r / cols),
  // XY routing, every mesh link with this bandwidth and per-hop latency.
  int mesh_cols = 0;
  double mesh_link_bytes_per_s = 0, mesh_hop_latency_s = 0;
  // The serialized baseline: per operator and per all-to-all.
  double operator_launch_s = 0, collective_sync_s = 0;
  // Its own cost per task ("serialized.task_overhead_s"; < 0: task_overhead_s,
  // the interleaved launch's): the CPU baseline deals tiles out with no events.
  double serialized_task_overhead_s = -1;
  // Matrix units the serialized baseline's GEMMs use (0: the fused
  // schedule's): a GPU framework gives its GEMMs every SM.
  int serialized_matrix_units = 0;
  DeepEpBaseline deepep;
  MindSporeBaseline mindspore;
  // CPU models from `hpmoe calibrate`: the measured FMA peak of one core
  // (0 where the model has none) and the CPU it was measured on.
  double fma_peak_fp32_per_core = 0, bf16_peak_per_core = 0;
  std::string cpu;
  // Device memory of one rank ("memory.bytes_per_rank", an HBM size); 0:
  // unknown, no capacity check.
  double memory_bytes_per_rank = 0;
  // Where each figure comes from ("sources": field -> URL, paper section,
  // measurement command, or "estimate" with its reasoning).
  std::vector<std::pair<std::string, std::string>> sources;

  taskflow::Machine compiler_machine() const;  // what the compiler schedules for
  // A tile whose right-hand panel serves `reuse` row tiles in a row: its
  // time moves from the streamed rate (reuse 1) to the reused rate.
  double gemm_seconds(std::int64_t m, std::int64_t n, std::int64_t k, DType, double reuse = 1e9) const;
};

MachineModel machine_from_json(const nlohmann::json&);  // Error naming what is missing or wrong
MachineModel load_machine(const std::string& path_or_name);  // a file, or a name in machines/
// The model file's JSON as written (for tools that edit a field before
// machine_from_json); `resolved_path`: the file it was read from.
nlohmann::json load_machine_json(const std::string& path_or_name, std::string* resolved_path = nullptr);
// The schedule a machine runs by default: ratr where an accelerator bounds
// its puts in flight (its order keeps the few puts on the wire the ones the
// next GEMMs wait for; critical-path issues them in an order that a bound
// then serializes, 0.76x serialized on h200 at EP 32), critical-path on CPUs,
// as the runtime does.
taskflow::Policy default_policy(const MachineModel&);
nlohmann::json to_json(const MachineModel&);

struct SimRequest {
  LayerConfig config;
  RoutingSpec routing;
  ExpertPlacement placement;  // where the experts live; empty: contiguous
  std::uint64_t seed = 1;
  bool backward = false;
  taskflow::Policy policy = taskflow::Policy::critical_path;
  bool trace = false;  // fill SimReport::trace
  // The fused MoE kernel's scope, as the paper measures it: router backward
  // and the CPU runtime's pack (transpose) tasks take no time (their
  // dependencies stay).
  bool kernel_scope = false;
  // Count Adam's fp32 master weights and two moments (12 bytes a
  // parameter) in the memory check.
  bool optimizer_state = false;
  // The GEMMs at the machine's fp8 rates (a bf16 layer only; the runtime has
  // no fp8 GEMM, the simulator models what one would do).
  bool fp8_gemms = false;
  // Refuse a layer whose fullest rank does not fit the machine's memory
  // (off: report it in SimReport::memory and simulate anyway, as a planner
  // comparing a placement that does not fit with one that does needs).
  bool refuse_over_memory = true;
  // Prove the fused schedule's programs (the whole set: events consistent,
  // no deadlock under any timing, every read covered, no conflicting
  // writes) before simulating them, as the runtime does before it launches
  // them: a set the verifier rejects is an error naming the rank, task and
  // event, not a timeline. Off only where the caller proves the same
  // programs itself (a test timing the simulator alone).
  bool verify = true;
  // Read by simulate_choosing_exchange alone: whether it chooses the scheme
  // (--exchange auto) and the dispatch's wire dtype (--dispatch-dtype auto:
  // the layer's own, bf16 under an fp32 layer, or fp8), or keeps the
  // config's.
  bool choose_scheme = true;
  bool choose_dispatch_dtype = false;
};

// What one rank holds (bytes), for the rank that holds the most: its
// weights (experts and replicas, split parts by their share, the replicated
// router and shared experts) in the layer's dtype, fp32 gradients in a
// backward, the optimizer's state if asked, and the buffers its programs
// declare for the routing given (every declared buffer, forward and
// backward) and for the worst routing (every token's choices on its
// experts). `capacity`: the machine's memory per rank (0: unknown).
struct MemoryUse {
  double weights = 0, gradients = 0, optimizer = 0, buffers = 0, worst_buffers = 0, capacity = 0;
  std::int64_t rank = 0;  // the rank with the most, for the routing given
  double total() const { return weights + gradients + optimizer + buffers; }
  double worst_total() const { return weights + gradients + optimizer + worst_buffers; }
};

struct PassResult {
  double serialized_s = 0, interleaved_s = 0;
  // Busy share of the units of each class (time busy / (units x makespan)).
  double serialized_matrix_busy = 0, serialized_vector_busy = 0;
  double interleaved_matrix_busy = 0, interleaved_vector_busy = 0;
  // Share of the makespan, averaged over ranks, in which the rank has data in
  // flight on a link or in a put and no matrix work running.
  double serialized_exposed_comm = 0, interleaved_exposed_comm = 0;
  // The fused run's busiest link port (any rank's): the time it carried
  // bytes. Its hidden part is hidden under compute, not off the link, so
  // two micro-batches of the fused layer take at least twice this.
  double interleaved_link_busy_s = 0;
  std::int64_t tasks = 0;
  // Bytes crossing node boundaries in the exchanges (all ranks): as the
  // fused schedule sends them (one row per token and expert, layer dtype),
  // and as the DeepEP-style baseline does (deepep_s > 0 only where the
  // machine has that baseline).
  double cross_node_bytes = 0, deepep_cross_node_bytes = 0;
  // Bytes the fused schedule's puts carry to other ranks (all ranks), and
  // of those the lent weights' (LayerConfig::lend_weights); the (expert,
  // rank) pairs lent.
  double put_bytes = 0, lent_bytes = 0;
  std::int64_t lent = 0;
  double deepep_s = 0;
  double mindspore_s = 0;  // > 0 only where the machine has that baseline
  // Their exchanges' share of their makespans (nothing overlaps an exchange there).
  double deepep_exposed_comm = 0, mindspore_exposed_comm = 0;
};

// The DeepEP-style exchange alone, as DeepEP's benchmark times it: the
// forward's dispatch (fp8 rows with their scales where the machine model's
// baselines.deepep says so) and its combine (the layer's dtype) on fresh
// links, no GEMMs and no kernel launch; with rank 0's counts and the
// bandwidths DeepEP prints from them.
struct DeepEpExchangeAlone {
  double dispatch_s = 0, combine_s = 0;
  double dispatch_row_bytes = 0, combine_row_bytes = 0;
  double received_rows = 0, node_tokens = 0, cross_node_rows = 0;  // rank 0's
  int nodes = 1;
  // GB/s as DeepEP prints them: "RDMA" (node tokens, logical) and "NVL" (rows received).
  double rdma_gbps(bool dispatch) const {
    return node_tokens * (dispatch ? dispatch_row_bytes : combine_row_bytes) / (dispatch ? dispatch_s : combine_s) / 1e9;
  }
  double nvl_gbps(bool dispatch) const {
    return received_rows * (dispatch ? dispatch_row_bytes : combine_row_bytes) / (dispatch ? dispatch_s : combine_s) / 1e9;
  }
};

struct SimReport {
  LayerConfig config;
  MachineModel machine;
  std::string routing, policy;
  RoutingStats stats;
  PassResult forward, backward;
  DeepEpExchangeAlone deepep_exchange;  // where the machine has the DeepEP-style baseline
  std::string exchange_choice;          // --exchange auto: the scheme chosen and why (empty: the layer's own)
  // The per-node exchange: token crossings into other nodes (one per
  // (token, node)), those sent straight to their one rank (direct tokens),
  // and the ranks too hot to take theirs straight (taskflow::Exchange).
  struct NodeRoute {
    std::int64_t crossings = 0, direct = 0, hot_ranks = 0;
  } node_route;
  bool has_backward = false;
  bool kernel_scope = false;
  bool fp8_gemms = false;  // GEMMs at the machine's fp8 rates (machine: as simulated, fp8 rates in the bf16 columns)
  double simulate_seconds = 0;  // host time spent simulating
  double compile_seconds = 0;
  double verify_seconds = 0;  // host time spent proving the programs (SimRequest::verify)
  bool verified = false;      // every simulated program set was proved
  std::int64_t simulated_tasks = 0;
  MemoryUse memory;
  std::vector<TraceSlice> serialized_trace, interleaved_trace;
};

// The bytes of the buffers a rank's program declares (the layout the
// runtime allocates: symmetric segment and local region).
double declared_bytes(const taskflow::Program&);
// The weights, gradients and optimizer state of rank r (MemoryUse's terms).
MemoryUse parameter_bytes(const LayerConfig&, const ExpertPlacement&, std::int64_t r, bool backward, bool optimizer_state);
// Expert choices that send every token's top_k rows to rank r's experts
// (those it alone holds first), as far as it holds top_k of them: the
// routing that fills r's receive buffers most.
std::vector<std::int32_t> worst_routing_for(const LayerConfig&, const ExpertPlacement&, std::int64_t r);

SimReport simulate(const MachineModel&, const SimRequest&);
// --exchange auto: each exchange scheme the layer allows simulated as
// asked, the report of the fastest fused step returned, with
// SimReport::exchange_choice saying which and what the others took
// (choose_exchange.cpp). The wire dtypes stay as given unless the request
// leaves the dispatch's to it (choose_dispatch_dtype).
SimReport simulate_choosing_exchange(const MachineModel&, const SimRequest&);
std::string format_report(const SimReport&);
nlohmann::json to_json(const SimReport&);

// The core, on compiled programs (one per rank, scheduled). Durations come
// from the model; `work` per task (the access table's, see task_work): a
// GEMM tile's shape and reduction length, or the bytes a task moves.
struct Timeline {
  double makespan = 0;
  double matrix_busy = 0, vector_busy = 0, exposed_comm = 0;
  double busiest_link_s = 0;  // the fused run's busiest link port's time carrying bytes (Links::busiest_link_s)
  std::vector<TraceSlice> trace;
};
Timeline simulate_interleaved(const MachineModel&, const std::vector<taskflow::Program>&,
                              const std::vector<std::vector<taskflow::TaskWork>>& work, DType, bool trace);
Timeline simulate_serialized(const MachineModel&, const std::vector<taskflow::Program>&,
                             const std::vector<std::vector<taskflow::TaskWork>>& work, DType, bool trace);
// Rows of an exchange in the DeepEP scheme (the dispatch direction; the
// combine moves the same rows back): dispatch_rank[s * P + d] straight
// between ranks of a node (one row per token and destination rank),
// dispatch_node[s * nodes + n] over RDMA to the same-index rank of node n
// (one row per token and destination node), dispatch_forward[f * P + d]
// forwarded over NVLink inside node n by the rank f that received them.
struct DeepEpExchange {
  int ranks = 0, nodes = 0;
  std::vector<double> dispatch_rank, dispatch_node, dispatch_forward;
  // Per rank, the counts DeepEP's benchmark (test_internode.py and
  // test_intranode.py in its tests) divides by its time: the rows a rank receives (one
  // per token and destination rank: its "NVL" bytes), and its tokens times
  // the nodes each reaches, its own node included (its "RDMA" bytes, a
  // logical figure: the own node's share never crosses a NIC).
  std::vector<double> received, node_tokens;
  double cross_node_rows() const;
};
// Built from a step's routing (every kept token-expert choice; an expert's
// rows go to its first instance's rank).
DeepEpExchange deepep_exchange(const LayerConfig&, const ExpertPlacement&, const RouterOutput<float>&, int ranks_per_node);
// The DeepEP-style exchange alone (DeepEpExchangeAlone above).
DeepEpExchangeAlone simulate_deepep_exchange(const MachineModel&, const DeepEpExchange&, const taskflow::Dims&);
// The DeepEP-style baseline: serialized operators with its exchanges. The
// backward pass's gradient dispatch moves the combine's bytes (bf16) and its
// gradient combine the dispatch's rows in bf16.
Timeline simulate_deepep(const MachineModel&, const std::vector<taskflow::Program>&,
                         const std::vector<std::vector<taskflow::TaskWork>>& work, DType, const DeepEpExchange&);
// The MindSpore/MindFormers baseline; `rows` as from deepep_exchange with
// every rank in one node (the dispatcher sends a token once per rank).
Timeline simulate_mindspore(const MachineModel&, const std::vector<taskflow::Program>&,
                            const std::vector<std::vector<taskflow::TaskWork>>& work, DType, const DeepEpExchange& rows);
// The work of every task of every program, from the access table.
std::vector<std::vector<taskflow::TaskWork>> task_work(const std::vector<taskflow::Program>&);

}  // namespace hpmoe::sim
