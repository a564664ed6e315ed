#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <nlohmann/json.hpp>

#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"
#include "sim/sim.hpp"

namespace hpmoe::sim {

namespace {

using nlohmann::json;

// The value at a dotted path, or an error naming the path.
const json& at(const json& j, const std::string& path) {
  const json* cur = &j;
  std::size_t begin = 0;
  while (begin <= path.size()) {
    const auto dot = path.find('.', begin);
    const std::string key = path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin);
    if (!cur->is_object() || !cur->contains(key)) throw Error("machine model: missing field '" + path + "'");
    cur = &(*cur)[key];
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return *cur;
}

// Physical ranges of a machine model's figures: a value outside them is a
// typo or a unit error, and would make the simulation's times inf or NaN.
constexpr double kMaxSeconds = 1.0;        // a latency, an overhead, a launch
constexpr double kMaxBytesPerS = 1e15;     // a link, a memory, a copy engine
constexpr double kMaxFlops = 1e18;         // a unit's GEMM rate
constexpr double kMinRate = 1e3;           // a non-zero bandwidth or rate below this is not a machine

double number(const json& j, const std::string& path, double min, bool optional = false, double max = 1e300) {
  if (optional) {
    try {
      at(j, path);
    } catch (const Error&) {
      return 0;
    }
  }
  const json& v = at(j, path);
  if (!v.is_number()) throw Error("machine model: field '" + path + "' must be a number");
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < min)
    throw Error("machine model: field '" + path + "' must be at least " + std::to_string(min) + " (got " + v.dump() + ")");
  if (x > max)
    throw Error("machine model: field '" + path + "' = " + v.dump() + " is beyond any machine (at most " + json(max).dump() +
                "); check its unit");
  return x;
}
double seconds(const json& j, const std::string& path) { return number(j, path, 0, false, kMaxSeconds); }
// A bandwidth or rate: 0 (where the model allows it: no cost) or within [kMinRate, max].
double rate(const json& j, const std::string& path, double min, double max, bool optional = false) {
  const double x = number(j, path, min, optional, max);
  if (x > 0 && x < kMinRate)
    throw Error("machine model: field '" + path + "' = " + json(x).dump() + " is below any machine (at least " +
                json(kMinRate).dump() + ", or 0); check its unit");
  return x;
}

int count(const json& j, const std::string& path, int min, bool optional = false) {
  const double x = number(j, path, min, optional);
  if (x != std::floor(x) || x > 1e6) throw Error("machine model: field '" + path + "' must be a whole number");
  return static_cast<int>(x);
}

}  // namespace

const char* name(PutEngine e) {
  switch (e) {
    case PutEngine::dma: return "dma";
    case PutEngine::vector: return "vector";
    case PutEngine::cpu: return "cpu";
  }
  return "?";
}

double MachineModel::intra_rate(int ranks) const {
  if (intra_by_ep.empty()) return intra_bytes_per_s;
  if (ranks <= intra_by_ep.front().ranks) return intra_by_ep.front().bytes_per_s;
  for (std::size_t i = 1; i < intra_by_ep.size(); ++i) {
    const RateAtDegree &a = intra_by_ep[i - 1], &b = intra_by_ep[i];
    if (ranks <= b.ranks) {
      const double f = std::log2(double(ranks) / a.ranks) / std::log2(double(b.ranks) / a.ranks);
      return a.bytes_per_s + f * (b.bytes_per_s - a.bytes_per_s);
    }
  }
  return intra_by_ep.back().bytes_per_s;
}

taskflow::Machine MachineModel::compiler_machine() const {
  taskflow::Machine m = accelerator ? taskflow::accel_machine(matrix_units, vector_units) : taskflow::cpu_machine(workers);
  m.tile_rows = tile_rows;
  m.tile_cols = tile_cols;
  m.weight_tile_rows = weight_tile_rows;
  m.weight_tile_cols = weight_tile_cols;
  if (accelerator) {  // the scheduler's cost estimates from the model (CPU: as the runtime schedules)
    m.matrix_flops = tile_rates.front().bf16_flops;
    m.vector_bytes_per_s = vector_bytes_per_s;
    m.put_bytes_per_s = intra_bytes_per_s > 0 ? intra_bytes_per_s : vector_bytes_per_s;
    m.task_overhead_s = task_overhead_s;
    m.matrix_runs_vector = matrix_runs_vector;
    if (put_engine == PutEngine::vector && put_in_flight > 0) {
      // Puts on their own units, sharing the link: each one's time is its share.
      m.put_workers = put_in_flight;
      m.put_bytes_per_s = std::min(vector_bytes_per_s, m.put_bytes_per_s / put_in_flight);
    }
  }
  return m;
}

double MachineModel::gemm_seconds(std::int64_t m, std::int64_t n, std::int64_t k, DType dtype, double reuse) const {
  // A tile's time is interpolated linearly between the measured shapes on
  // either side, in K and in rows. At a fixed K a tile's time is affine in
  // its rows (reading the weight panel costs the same for 52 rows as for 48,
  // the FMAs grow with the rows): mixtral's 52- to 72-row tiles measured
  // about 3 us a row (docs/results/simulation.md, "Rows between the measured ones").
  // Timing a tile at the rate of the nearest measured row count, as before,
  // charged a 52-row tile the 48-row rate per FLOP (132 GFLOP/s against the
  // 64-row 150 with a fresh panel at K 4096 in that calibration), a step the
  // machine does not have. Short K: a tile's time is mostly writing its
  // output, so its rate is far from constant in K either. Outside the
  // measured shapes the rate of the nearest one stays.
  const bool fp32 = dtype == DType::fp32;
  const auto rate_of = [&](const TileRate& r, bool streamed) {
    return streamed ? (fp32 ? r.fp32_streamed_flops : r.bf16_streamed_flops) : (fp32 ? r.fp32_flops : r.bf16_flops);
  };
  // Seconds of an m x n x k tile at the measured row count `rows`, from its rate there.
  const auto at_rows = [&](std::int64_t rows, bool streamed) {
    const TileRate *below = nullptr, *above = nullptr;
    for (const auto& r : tile_rates) {
      if (r.m != rows) continue;
      if (r.k <= k && (!below || r.k > below->k)) below = &r;
      if (r.k >= k && (!above || r.k < above->k)) above = &r;
    }
    const double per_k = 2.0 * double(m) * double(n);  // FLOPs per unit of K
    const auto time = [&](const TileRate& r) { return per_k * double(r.k) / rate_of(r, streamed); };
    if (!below) return time(*above) * double(k) / double(above->k);
    if (!above) return time(*below) * double(k) / double(below->k);
    if (below->k == above->k) return time(*below);
    const double f = double(k - below->k) / double(above->k - below->k);
    return time(*below) + f * (time(*above) - time(*below));
  };
  std::int64_t rows_below = 0, rows_above = 0;  // measured row counts on either side of m (0: none)
  for (const auto& r : tile_rates) {
    if (r.m <= m && r.m > rows_below) rows_below = r.m;
    if (r.m >= m && (rows_above == 0 || r.m < rows_above)) rows_above = r.m;
  }
  const auto seconds_of = [&](bool streamed) {
    // at_rows(r) times m rows at the rate of r rows: the time of r rows is at_rows(r) * r / m.
    if (rows_below == 0) return at_rows(rows_above, streamed);
    if (rows_above == 0 || rows_above == rows_below) return at_rows(rows_below, streamed);
    const double lo = at_rows(rows_below, streamed) * double(rows_below) / double(m);
    const double hi = at_rows(rows_above, streamed) * double(rows_above) / double(m);
    return lo + double(m - rows_below) / double(rows_above - rows_below) * (hi - lo);
  };
  const double hot = seconds_of(false);
  bool has_streamed = true;  // every measured shape used has a streamed rate
  for (const auto& r : tile_rates)
    if ((r.m == rows_below || r.m == rows_above) && rate_of(r, true) <= 0) has_streamed = false;
  if (!has_streamed) return hot;
  return hot + (seconds_of(true) - hot) / std::max(reuse, 1.0);
}

bool MachineModel::has_fp8() const {
  return !tile_rates.empty() &&
         std::all_of(tile_rates.begin(), tile_rates.end(), [](const TileRate& r) { return r.fp8_flops > 0; });
}

MachineModel MachineModel::with_fp8_gemms() const {
  if (!has_fp8())
    throw Error("machine model '" + name + "' has no fp8 GEMM rate (matrix.peak.fp8_flops, or fp8_flops for every tile rate)");
  MachineModel m = *this;
  for (auto& r : m.tile_rates) {
    r.bf16_flops = r.fp8_flops;
    r.bf16_streamed_flops = 0;  // no streamed fp8 rate is modelled
  }
  m.peak_bf16_flops = peak_fp8_flops;
  return m;
}

namespace {
json tile_json(const MachineModel& m) {
  json t{{"rows", m.tile_rows}, {"cols", m.tile_cols}};
  if (m.weight_tile_rows > 0) t["weight_rows"] = m.weight_tile_rows;
  if (m.weight_tile_cols > 0) t["weight_cols"] = m.weight_tile_cols;
  return t;
}
}  // namespace

// Every field a machine model may hold; under an open path any key is
// allowed (sources, the measured peak's notes, per-kind and per-EP tables).
// A key outside both is a typo whose figure would silently not be used.
void check_known_fields(const json& j, const std::string& prefix = "") {
  static const std::set<std::string> known = {
      "name", "description", "kind", "signal_latency_s", "task_overhead_s",
      "units", "units.matrix", "units.vector", "units.workers", "units.matrix_runs_vector",
      "tile", "tile.rows", "tile.cols", "tile.weight_rows", "tile.weight_cols",
      "matrix", "matrix.tile_rates", "matrix.peak", "matrix.peak.fp32_flops", "matrix.peak.bf16_flops",
      "matrix.peak.fp8_flops", "vector", "vector.bytes_per_s", "vector.by_kind",
      "put", "put.engine", "put.in_flight", "put.issue_s", "put.copy_bytes_per_s", "put.receive",
      "put.receive.per_put_s", "put.receive.bytes_per_s", "put.stream_per_peer",
      "links", "links.intra", "links.intra.bytes_per_s", "links.intra.latency_s", "links.intra.by_ep",
      "links.inter", "links.inter.bytes_per_s", "links.inter.latency_s", "links.ranks_per_node",
      "mesh", "mesh.cols", "mesh.hop_latency_s", "mesh.link_bytes_per_s",
      "serialized", "serialized.task_overhead_s", "serialized.operator_launch_s", "serialized.collective_sync_s",
      "serialized.matrix_units",
      "baselines", "baselines.deepep", "baselines.deepep.kernel_launch_s", "baselines.deepep.fp8_dispatch",
      "baselines.mindspore", "baselines.mindspore.host_sync_s",
      "memory", "memory.bytes_per_rank", "peak", "sources"};
  static const std::set<std::string> open = {"vector.by_kind", "links.intra.by_ep", "put.stream_per_peer",
                                             "baselines.deepep.fp8_dispatch", "peak", "sources"};
  for (const auto& [key, value] : j.items()) {
    const std::string path = prefix.empty() ? key : prefix + "." + key;
    if (!known.count(path))
      throw Error("machine model: unknown field '" + path + "' (a typo? docs/simulator.md lists the fields)");
    if (value.is_object() && !open.count(path)) check_known_fields(value, path);
  }
}

// A name or description goes into reports and terminals: printable text only.
void check_printable(const json& j, const char* field) {
  if (!j.contains(field) || !j[field].is_string()) return;
  for (const char ch : j[field].get<std::string>())
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f)
      throw Error(std::string("machine model: '") + field + "' holds a control character");
}

namespace {

// What runs tasks: a CPU's workers, or an accelerator's matrix and vector units; their tiles.
void read_units(const json& j, MachineModel& m) {
  const json& kind = at(j, "kind");
  if (kind != "cpu" && kind != "accelerator") throw Error("machine model: 'kind' must be \"cpu\" or \"accelerator\"");
  m.accelerator = kind == "accelerator";
  if (m.accelerator) {
    m.matrix_units = count(j, "units.matrix", 1);
    m.vector_units = count(j, "units.vector", 1);
    m.workers = 0;
    if (const json& u = j.at("units"); u.contains("matrix_runs_vector")) {
      if (!u["matrix_runs_vector"].is_boolean()) throw Error("machine model: 'units.matrix_runs_vector' must be true or false");
      m.matrix_runs_vector = u["matrix_runs_vector"].get<bool>();
    }
  } else {
    m.workers = count(j, "units.workers", 1);
    if (j.at("units").contains("matrix_runs_vector"))
      throw Error("machine model: 'units.matrix_runs_vector' is for an accelerator's matrix units; a CPU's workers take "
                  "every class of task already: remove it");
  }
  m.tile_rows = count(j, "tile.rows", 1);
  m.tile_cols = count(j, "tile.cols", 1);
  if (const json* t = j.contains("tile") && j["tile"].is_object() ? &j["tile"] : nullptr; t && t->contains("weight_rows"))
    m.weight_tile_rows = count(j, "tile.weight_rows", 1);
  if (const json* t = j.contains("tile") && j["tile"].is_object() ? &j["tile"] : nullptr; t && t->contains("weight_cols")) {
    m.weight_tile_cols = count(j, "tile.weight_cols", 1);
    if (m.weight_tile_cols % m.tile_cols != 0)
      throw Error("machine model: 'tile.weight_cols' must be a multiple of 'tile.cols' (got " +
                  std::to_string(m.weight_tile_cols) + " and " + std::to_string(m.tile_cols) + ")");
  }
}

// The matrix units' rate per tile shape (FLOP/s, or a share of the peak).
void read_matrix(const json& j, MachineModel& m) {
  const json& rates = at(j, "matrix.tile_rates");
  if (!rates.is_array() || rates.empty()) throw Error("machine model: 'matrix.tile_rates' must be a non-empty array");
  if (const json& matrix = at(j, "matrix"); matrix.is_object() && matrix.contains("peak")) {
    if (!matrix["peak"].is_object()) throw Error("machine model: 'matrix.peak' must be an object of FLOP/s per precision");
    m.peak_fp32_flops = rate(j, "matrix.peak.fp32_flops", 0, kMaxFlops, true);
    m.peak_bf16_flops = rate(j, "matrix.peak.bf16_flops", 0, kMaxFlops, true);
    m.peak_fp8_flops = rate(j, "matrix.peak.fp8_flops", 0, kMaxFlops, true);
  }
  for (std::size_t i = 0; i < rates.size(); ++i) {
    const std::string p = "matrix.tile_rates." + std::to_string(i);
    json wrapped = {{"matrix", {{"tile_rates", {{std::to_string(i), rates[i]}}}}}};
    TileRate r;
    r.m = count(wrapped, p + ".m", 1);
    r.k = count(wrapped, p + ".k", 1);
    if (rates[i].is_object() && rates[i].contains("efficiency")) {
      // A share of the peak, for every precision the peak gives; no FLOP/s beside it.
      r.efficiency = number(wrapped, p + ".efficiency", 0.001, false, 1.0);
      for (const char* key : {"fp32_flops", "bf16_flops", "fp8_flops", "fp32_streamed_flops", "bf16_streamed_flops"})
        if (rates[i].contains(key))
          throw Error("machine model: '" + p + "' gives both an efficiency and '" + key + "': give one or the other");
      if (m.peak_fp32_flops <= 0 || m.peak_bf16_flops <= 0)
        throw Error("machine model: '" + p + ".efficiency' needs 'matrix.peak.fp32_flops' and 'matrix.peak.bf16_flops'");
      r.fp32_flops = r.efficiency * m.peak_fp32_flops;
      r.bf16_flops = r.efficiency * m.peak_bf16_flops;
      r.fp8_flops = r.efficiency * m.peak_fp8_flops;
    } else {
      r.fp32_flops = rate(wrapped, p + ".fp32_flops", 1, kMaxFlops);
      r.bf16_flops = rate(wrapped, p + ".bf16_flops", 1, kMaxFlops);
      r.fp32_streamed_flops = rate(wrapped, p + ".fp32_streamed_flops", 0, kMaxFlops, true);
      r.bf16_streamed_flops = rate(wrapped, p + ".bf16_streamed_flops", 0, kMaxFlops, true);
      r.fp8_flops = rate(wrapped, p + ".fp8_flops", 0, kMaxFlops, true);
    }
    m.tile_rates.push_back(r);
  }
}

// The vector units' bandwidth, overall and per vector task kind.
void read_vector(const json& j, MachineModel& m) {
  m.vector_bytes_per_s = rate(j, "vector.bytes_per_s", 1, kMaxBytesPerS);
  if (const json& vector = at(j, "vector"); vector.is_object() && vector.contains("by_kind")) {
    const json& by_kind = vector["by_kind"];
    if (!by_kind.is_object())
      throw Error("machine model: 'vector.by_kind' must be an object of vector task kind: bytes per second");
    const auto& table = taskflow::AccessTable::standard();
    for (const auto& [kind_name, value] : by_kind.items()) {
      int found = -1;
      for (int k = 0; k < static_cast<int>(taskflow::TaskKind::count) && found < 0; ++k) {
        const auto kind = static_cast<taskflow::TaskKind>(k);
        if (kind_name == taskflow::name(kind) && table[kind].queue == taskflow::QueueClass::vector && !taskflow::is_put(kind)) found = k;
      }
      if (found < 0)
        throw Error("machine model: 'vector.by_kind." + kind_name +
                    "' is not a vector task kind (a kind of the vector queue that is not a put, e.g. swiglu, gate_grad)");
      m.vector_kind_bytes_per_s[static_cast<std::size_t>(found)] = rate(j, "vector.by_kind." + kind_name, 1, kMaxBytesPerS);
    }
  }
}

// A task's own cost, the signal's latency, and how puts move: their engine, its bound, the receiver's work.
void read_puts(const json& j, MachineModel& m) {
  m.task_overhead_s = seconds(j, "task_overhead_s");
  m.signal_latency_s = seconds(j, "signal_latency_s");
  m.put_issue_s = seconds(j, "put.issue_s");
  m.put_copy_bytes_per_s = rate(j, "put.copy_bytes_per_s", 0, kMaxBytesPerS);
  // Older models name no engine: a CPU's core copies, an accelerator's DMA engine moves the bytes.
  m.put_engine = m.accelerator ? PutEngine::dma : PutEngine::cpu;
  if (const json& put = at(j, "put"); put.is_object() && put.contains("engine")) {
    const json& e = put["engine"];
    if (e == "dma") m.put_engine = PutEngine::dma;
    else if (e == "vector") m.put_engine = PutEngine::vector;
    else if (e == "cpu") m.put_engine = PutEngine::cpu;
    else throw Error("machine model: 'put.engine' must be \"dma\", \"vector\" or \"cpu\" (got " + e.dump() + ")");
    if (m.put_engine == PutEngine::vector && !m.accelerator)
      throw Error("machine model: 'put.engine' \"vector\" needs vector units (kind \"accelerator\")");
  }
  m.put_in_flight = count(j, "put.in_flight", 0, true);
  // An accelerator that lets puts run unbounded delivers, on processor-shared
  // links, every put of a dispatch at its end: a model would win or lose by
  // that alone. Every accelerator model whose DMA engines or vector units move
  // the puts states its bound, with its source (a core that copies is its own bound).
  if (m.accelerator && m.put_engine != PutEngine::cpu && m.put_in_flight == 0)
    throw Error("machine model: 'put.in_flight' is required for an accelerator: the puts a rank keeps on the wire at "
                "once (DMA engines or communication SMs, or the vector units that carry puts), with its source in "
                "'sources'");
  if (m.put_in_flight > 0 && m.put_engine == PutEngine::cpu)
    throw Error("machine model: 'put.in_flight' bounds DMA engines or the vector units carrying puts; with put.engine \"cpu\" "
                "every worker copies its own puts");
  if (m.put_engine == PutEngine::vector && m.put_in_flight > m.vector_units)
    throw Error("machine model: 'put.in_flight' (" + std::to_string(m.put_in_flight) + ") is more than the " +
                std::to_string(m.vector_units) + " vector units that could carry puts");
  if (const json& put = at(j, "put"); put.is_object() && put.contains("receive")) {
    if (m.put_engine != PutEngine::cpu) throw Error("machine model: 'put.receive' (protocol work on the receiver's core) needs put.engine \"cpu\"");
    m.put_receive_s = seconds(j, "put.receive.per_put_s");
    m.put_receive_bytes_per_s = rate(j, "put.receive.bytes_per_s", 0, kMaxBytesPerS);
  }
  if (const json& put = at(j, "put"); put.is_object() && put.contains("stream_per_peer")) {
    if (!put["stream_per_peer"].is_boolean()) throw Error("machine model: 'put.stream_per_peer' must be true or false");
    m.put_stream_per_peer = put["stream_per_peer"].get<bool>();
    if (m.put_stream_per_peer && m.put_engine != PutEngine::cpu)
      throw Error("machine model: 'put.stream_per_peer' (one TCP stream per peer) needs put.engine \"cpu\"");
  }
}

// The links within and between nodes, and an accelerator's mesh.
void read_links(const json& j, MachineModel& m) {
  m.ranks_per_node = count(j, "links.ranks_per_node", 1);
  m.intra_bytes_per_s = rate(j, "links.intra.bytes_per_s", 0, kMaxBytesPerS);
  m.intra_latency_s = seconds(j, "links.intra.latency_s");
  m.inter_bytes_per_s = rate(j, "links.inter.bytes_per_s", 0, kMaxBytesPerS);
  m.inter_latency_s = seconds(j, "links.inter.latency_s");
  if (const json& intra = at(j, "links.intra"); intra.is_object() && intra.contains("by_ep")) {
    const json& list = intra["by_ep"];
    if (!list.is_array() || list.empty()) throw Error("machine model: 'links.intra.by_ep' must be a non-empty array of {ranks, bytes_per_s}");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string p = "links.intra.by_ep." + std::to_string(i);
      const json wrapped = {{"links", {{"intra", {{"by_ep", {{std::to_string(i), list[i]}}}}}}}};
      RateAtDegree r{count(wrapped, p + ".ranks", 1), rate(wrapped, p + ".bytes_per_s", 1, kMaxBytesPerS)};
      if (!m.intra_by_ep.empty() && r.ranks <= m.intra_by_ep.back().ranks)
        throw Error("machine model: '" + p + ".ranks' must grow along the list");
      m.intra_by_ep.push_back(r);
    }
  }
  if (j.contains("mesh")) {
    m.mesh_cols = count(j, "mesh.cols", 1);
    m.mesh_link_bytes_per_s = rate(j, "mesh.link_bytes_per_s", 1, kMaxBytesPerS);
    m.mesh_hop_latency_s = seconds(j, "mesh.hop_latency_s");
  }
}

// The serialized baselines' costs, and DeepEP's and MindSpore's.
void read_baselines(const json& j, MachineModel& m) {
  m.operator_launch_s = seconds(j, "serialized.operator_launch_s");
  m.collective_sync_s = seconds(j, "serialized.collective_sync_s");
  if (j.contains("serialized") && j["serialized"].is_object() && j["serialized"].contains("task_overhead_s"))
    m.serialized_task_overhead_s = seconds(j, "serialized.task_overhead_s");
  m.serialized_matrix_units = count(j, "serialized.matrix_units", 0, true);
  if (m.serialized_matrix_units > 0 && !m.accelerator)
    throw Error("machine model: 'serialized.matrix_units' is for accelerators (a CPU's workers run both schedules)");
  if (j.contains("baselines") && j["baselines"].is_object() && j["baselines"].contains("deepep")) {
    const json& d = j["baselines"]["deepep"];
    if (!d.is_object()) throw Error("machine model: 'baselines.deepep' must be an object");
    m.deepep.enabled = true;
    if (d.contains("fp8_dispatch")) {
      if (!d["fp8_dispatch"].is_boolean()) throw Error("machine model: 'baselines.deepep.fp8_dispatch' must be true or false");
      m.deepep.fp8_dispatch = d["fp8_dispatch"].get<bool>();
    }
    m.deepep.kernel_launch_s = seconds(j, "baselines.deepep.kernel_launch_s");
  }
  if (j.contains("baselines") && j["baselines"].is_object() && j["baselines"].contains("mindspore")) {
    if (!j["baselines"]["mindspore"].is_object()) throw Error("machine model: 'baselines.mindspore' must be an object");
    m.mindspore.enabled = true;
    m.mindspore.host_sync_s = seconds(j, "baselines.mindspore.host_sync_s");
  }
}

// The peaks measured on the machine, its memory, and where every figure comes from.
void read_peak_and_sources(const json& j, MachineModel& m) {
  m.fma_peak_fp32_per_core = rate(j, "peak.fp32_fma_flops_per_core", 0, kMaxFlops, true);
  m.bf16_peak_per_core = rate(j, "peak.bf16_dot_flops_per_core", 0, kMaxFlops, true);
  if (j.contains("peak") && j["peak"].is_object() && j["peak"].contains("cpu") && j["peak"]["cpu"].is_string())
    m.cpu = j["peak"]["cpu"].get<std::string>();
  if (j.contains("memory")) m.memory_bytes_per_rank = rate(j, "memory.bytes_per_rank", 1e6, 1e15);
  const json& sources = at(j, "sources");
  if (!sources.is_object() || sources.empty())
    throw Error("machine model: 'sources' must say where the figures come from (an object of field: source)");
  for (const auto& [field, source] : sources.items()) {
    if (!source.is_string() || source.get<std::string>().empty())
      throw Error("machine model: 'sources." + field + "' must be a non-empty string (a URL, paper section, command or estimate)");
    m.sources.emplace_back(field, source.get<std::string>());
  }
}

}  // namespace

MachineModel machine_from_json(const json& j) {
  if (!j.is_object()) throw Error("machine model: expected a JSON object");
  check_known_fields(j);
  check_printable(j, "name");
  check_printable(j, "description");
  MachineModel m;
  const json& name = at(j, "name");
  if (!name.is_string() || name.get<std::string>().empty()) throw Error("machine model: 'name' must be a non-empty string");
  m.name = name.get<std::string>();
  if (j.contains("description") && j["description"].is_string()) m.description = j["description"].get<std::string>();
  read_units(j, m);
  read_matrix(j, m);
  read_vector(j, m);
  read_puts(j, m);
  read_links(j, m);
  read_baselines(j, m);
  read_peak_and_sources(j, m);
  return m;
}

taskflow::Policy default_policy(const MachineModel& m) {
  return m.accelerator && m.put_in_flight > 0 ? taskflow::Policy::ratr : taskflow::Policy::critical_path;
}

namespace {
// share/hpmoe/machines beside the library (or program) this code is in:
// <prefix>/lib/libhpmoe.so finds <prefix>/share/hpmoe/machines wherever the
// package was installed.
std::string machines_beside_this_binary() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(&machines_beside_this_binary), &info) == 0 || !info.dli_fname) return {};
  std::error_code ec;
  const auto binary = std::filesystem::weakly_canonical(info.dli_fname, ec);
  if (ec) return {};
  return (binary.parent_path().parent_path() / "share" / "hpmoe" / "machines").string();
}
}  // namespace

json load_machine_json(const std::string& spec, std::string* resolved_path) {
  namespace fs = std::filesystem;
  std::string path = spec;
  if (!fs::exists(path)) {
    // A bare name: machines/NAME.json next to the working directory, the
    // source tree, the installed package (relocated, or where it was built for).
    for (const std::string& dir : {std::string("machines"), std::string(HPMOE_SOURCE_DIR) + "/machines",
                                   machines_beside_this_binary(), std::string(HPMOE_INSTALLED_MACHINES)})
      if (fs::exists(dir + "/" + spec + ".json")) {
        path = dir + "/" + spec + ".json";
        break;
      }
  }
  if (resolved_path) *resolved_path = path;
  return parse_json_file(path, "machine model '" + path + "'",
                         "cannot open the machine model '" + spec +
                             "' (a file, or a name in machines/: cpu-local, ascend-a3, h800, h200, nmp-mesh)");
}

MachineModel load_machine(const std::string& spec) {
  std::string path;
  const json j = load_machine_json(spec, &path);
  try {
    return machine_from_json(j);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (in " + path + ")");
  }
}

json to_json(const MachineModel& m) {
  json rates = json::array();
  for (const auto& r : m.tile_rates) {
    if (r.efficiency > 0) {  // as the file gives it: a share of matrix.peak (the rates follow from it)
      rates.push_back({{"m", r.m}, {"k", r.k}, {"efficiency", r.efficiency}});
      continue;
    }
    rates.push_back({{"m", r.m}, {"k", r.k}, {"fp32_flops", r.fp32_flops}, {"bf16_flops", r.bf16_flops},
                     {"fp32_streamed_flops", r.fp32_streamed_flops}, {"bf16_streamed_flops", r.bf16_streamed_flops}});
    if (r.fp8_flops > 0) rates.back()["fp8_flops"] = r.fp8_flops;
  }
  json j = {{"name", m.name},
            {"description", m.description},
            {"kind", m.accelerator ? "accelerator" : "cpu"},
            {"tile", tile_json(m)},
            {"matrix", {{"tile_rates", rates}}},
            {"vector", {{"bytes_per_s", m.vector_bytes_per_s}}},
            {"task_overhead_s", m.task_overhead_s},
            {"signal_latency_s", m.signal_latency_s},
            {"put", {{"engine", sim::name(m.put_engine)}, {"issue_s", m.put_issue_s}, {"copy_bytes_per_s", m.put_copy_bytes_per_s}}},
            {"links",
             {{"ranks_per_node", m.ranks_per_node},
              {"intra", {{"bytes_per_s", m.intra_bytes_per_s}, {"latency_s", m.intra_latency_s}}},
              {"inter", {{"bytes_per_s", m.inter_bytes_per_s}, {"latency_s", m.inter_latency_s}}}}},
            {"serialized", {{"operator_launch_s", m.operator_launch_s}, {"collective_sync_s", m.collective_sync_s}}}};
  if (m.fma_peak_fp32_per_core > 0)
    j["peak"] = {{"cpu", m.cpu}, {"fp32_fma_flops_per_core", m.fma_peak_fp32_per_core},
                 {"bf16_dot_flops_per_core", m.bf16_peak_per_core}};
  if (m.accelerator) j["units"] = {{"matrix", m.matrix_units}, {"vector", m.vector_units}};
  else j["units"] = {{"workers", m.workers}};
  if (m.matrix_runs_vector) j["units"]["matrix_runs_vector"] = true;
  for (int k = 0; k < static_cast<int>(taskflow::TaskKind::count); ++k)
    if (const double r = m.vector_kind_bytes_per_s[static_cast<std::size_t>(k)]; r > 0)
      j["vector"]["by_kind"][taskflow::name(static_cast<taskflow::TaskKind>(k))] = r;
  if (m.put_in_flight > 0) j["put"]["in_flight"] = m.put_in_flight;
  if (m.put_receive_s > 0 || m.put_receive_bytes_per_s > 0)
    j["put"]["receive"] = {{"per_put_s", m.put_receive_s}, {"bytes_per_s", m.put_receive_bytes_per_s}};
  if (m.put_stream_per_peer) j["put"]["stream_per_peer"] = true;
  if (!m.intra_by_ep.empty()) {
    auto& list = j["links"]["intra"]["by_ep"] = nlohmann::json::array();
    for (const auto& r : m.intra_by_ep) list.push_back({{"ranks", r.ranks}, {"bytes_per_s", r.bytes_per_s}});
  }
  if (m.serialized_matrix_units > 0) j["serialized"]["matrix_units"] = m.serialized_matrix_units;
  if (m.serialized_task_overhead_s >= 0) j["serialized"]["task_overhead_s"] = m.serialized_task_overhead_s;
  if (m.deepep.enabled)
    j["baselines"]["deepep"] = {{"fp8_dispatch", m.deepep.fp8_dispatch}, {"kernel_launch_s", m.deepep.kernel_launch_s}};
  if (m.mindspore.enabled) j["baselines"]["mindspore"] = {{"host_sync_s", m.mindspore.host_sync_s}};
  if (m.mesh_cols > 0)
    j["mesh"] = {{"cols", m.mesh_cols}, {"link_bytes_per_s", m.mesh_link_bytes_per_s}, {"hop_latency_s", m.mesh_hop_latency_s}};
  if (m.memory_bytes_per_rank > 0) j["memory"] = {{"bytes_per_rank", m.memory_bytes_per_rank}};
  if (m.peak_fp32_flops > 0 || m.peak_bf16_flops > 0 || m.peak_fp8_flops > 0) {
    auto& peak = j["matrix"]["peak"] = json::object();
    if (m.peak_fp32_flops > 0) peak["fp32_flops"] = m.peak_fp32_flops;
    if (m.peak_bf16_flops > 0) peak["bf16_flops"] = m.peak_bf16_flops;
    if (m.peak_fp8_flops > 0) peak["fp8_flops"] = m.peak_fp8_flops;
  }
  j["sources"] = json::object();
  for (const auto& [field, source] : m.sources) j["sources"][field] = source;
  return j;
}

}  // namespace hpmoe::sim
