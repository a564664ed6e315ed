// Program dumps (JSON, read back with every field checked), listings, and
// the schedule policies' names.
#include <algorithm>
#include <array>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "compiler/taskflow.hpp"
#include "hpmoe/error.hpp"
#include "common/fp8.hpp"

namespace hpmoe::taskflow {

namespace {
// An integer field of a dump as T, or an Error naming it: JSON's
// get<int32_t>() would truncate 4294967296 to 0 without a word.
template <class T>
T integer(const nlohmann::json& v, const std::string& what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u <= static_cast<std::uint64_t>(std::numeric_limits<T>::max())) return static_cast<T>(u);
  } else if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if (i >= static_cast<std::int64_t>(std::numeric_limits<T>::min()) && i <= static_cast<std::int64_t>(std::numeric_limits<T>::max()))
      return static_cast<T>(i);
  }
  throw Error("program dump: " + what + " = " + v.dump().substr(0, 40) + " is not an integer of " + std::to_string(sizeof(T) * 8) +
              " bits");
}

// A list of integers of a dump, each read as integer<T>.
template <class T>
std::vector<T> integers(const nlohmann::json& v, const std::string& what) {
  if (!v.is_array()) throw Error("program dump: " + what + " must be a list of integers");
  std::vector<T> out;
  out.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out.push_back(integer<T>(v[i], what + "[" + std::to_string(i) + "]"));
  return out;
}

// The value of an enum (of n values) whose name() is s.
template <class Enum>
Enum enum_from(std::size_t n, const std::string& s, const char* what) {
  for (std::size_t i = 0; i < n; ++i)
    if (s == name(static_cast<Enum>(i))) return static_cast<Enum>(i);
  throw Error(std::string("program dump: unknown ") + what + " '" + s + "'");
}
}  // namespace

Policy parse_policy(const std::string& s) {
  if (s == "fill") return Policy::fill;
  if (s == "rank-rotated") return Policy::rank_rotated;
  if (s == "critical-path") return Policy::critical_path;
  if (s == "interleave-wgrad") return Policy::interleave_wgrad;
  if (s == "ratr") return Policy::ratr;
  throw Error("unknown schedule '" + s + "' (use fill, rank-rotated, critical-path, interleave-wgrad or ratr)");
}

const char* name(Policy p) {
  switch (p) {
    case Policy::fill: return "fill";
    case Policy::rank_rotated: return "rank-rotated";
    case Policy::critical_path: return "critical-path";
    case Policy::interleave_wgrad: return "interleave-wgrad";
    case Policy::ratr: return "ratr";
  }
  return "?";
}

nlohmann::json to_json(const Program& p) {
  nlohmann::json j;
  j["format"] = "hpmoe-taskflow-program";
  j["version"] = p.version;
  j["pass"] = p.pass == Pass::forward ? "forward" : "backward";
  j["rank"] = p.rank;
  j["ranks"] = p.ranks;
  j["machine"] = {{"name", p.machine.name}, {"matrix_workers", p.machine.matrix_workers},
                  {"vector_workers", p.machine.vector_workers}, {"unified_workers", p.machine.unified_workers},
                  {"tile_rows", p.machine.tile_rows}, {"tile_cols", p.machine.tile_cols},
                  {"weight_tile_rows", p.machine.weight_tile_rows}, {"weight_tile_cols", p.machine.weight_tile_cols}};
  if (p.machine.matrix_runs_vector) j["machine"]["matrix_runs_vector"] = true;
  j["dims"] = {{"hidden", p.dims.hidden}, {"inter", p.dims.inter}, {"shared_inter", p.dims.shared_inter},
               {"experts", p.dims.experts}, {"top_k", p.dims.top_k}, {"tokens", p.dims.tokens},
               {"elem_bytes", p.dims.elem_bytes}};
  if (p.dims.dispatch_format != 0) {
    j["dims"]["dispatch_format"] = p.dims.dispatch_format;
    j["dims"]["dispatch_row_bytes"] = p.dims.dispatch_row_bytes;
  }
  j["local_experts"] = p.local_experts;
  j["expert_begin"] = p.expert_begin;
  j["kpad_begin"] = p.kpad_begin;
  j["send_rows"] = p.send_rows;
  if (!p.token_begin.empty()) j["token_begin"] = p.token_begin;  // the per-rank exchange
  if (!p.lent_block.empty()) j["lent_block"] = p.lent_block;     // weights lent to this rank
  if (!p.node_begin.empty()) {  // the per-node exchange
    j["node_begin"] = p.node_begin;
    j["node_route_begin"] = p.node_route_begin;
    j["node_comb_begin"] = p.node_comb_begin;
    j["node_sum_begin"] = p.node_sum_begin;
  }
  // Tensor-parallel splits (absent: every slot computes its whole expert).
  const bool split = !p.reductions.empty() ||
                     std::any_of(p.slot_parts.begin(), p.slot_parts.end(), [](const SlotPart& s) { return s.parts > 1; });
  if (split) {
    auto& parts = j["slot_parts"] = nlohmann::json::array();
    for (const auto& s : p.slot_parts) parts.push_back({s.inter_begin, s.inter, s.part, s.parts});
    auto& reductions = j["reductions"] = nlohmann::json::array();
    for (const auto& r : p.reductions) reductions.push_back({r.expert, r.parts, r.row_begin, r.rows});
  }
  auto& buffers = j["buffers"] = nlohmann::json::array();
  for (const auto& b : p.buffers)
    buffers.push_back({{"id", name(b.id)}, {"rows", b.rows}, {"cols", b.cols}, {"elem_bytes", b.elem_bytes},
                       {"offset_bytes", b.offset_bytes}, {"region", name(b.region)}, {"layout", name(b.layout)}});
  auto& events = j["events"] = nlohmann::json::array();
  // An event no task counts (a source that sends this rank nothing) has no consumer: "none".
  for (const auto& e : p.events)
    events.push_back({e.required, e.consumer == TaskKind::count ? "none" : name(e.consumer), e.expert, e.tile});
  j["task_fields"] = {"kind", "src", "dst", "expert", "peer", "row_begin", "rows", "col_begin", "cols", "src_row",
                      "wait_event", "wait_count", "trigger_event", "cost_s"};
  auto& tasks = j["tasks"] = nlohmann::json::array();
  for (std::size_t i = 0; i < p.tasks.size(); ++i) {
    const Task& t = p.tasks[i];
    tasks.push_back({name(t.kind), name(t.src), name(t.dst), t.expert, t.peer, t.row_begin, t.rows, t.col_begin, t.cols,
                     t.src_row, t.wait_event, t.wait_count, t.trigger_event, i < p.cost.size() ? p.cost[i] : 0.0f});
  }
  auto& queues = j["queues"] = nlohmann::json::array();
  for (std::size_t w = 0; w + 1 < p.queue_begin.size(); ++w)
    queues.push_back(std::vector<std::int32_t>(p.queue_tasks.begin() + p.queue_begin[w],
                                               p.queue_tasks.begin() + p.queue_begin[w + 1]));
  return j;
}

std::vector<Program> programs_from_dump(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object() || !j.contains("format") || !j["format"].is_string() ||
      j["format"].get<std::string>() != "hpmoe-taskflow-dump" || !j.contains("programs") || !j["programs"].is_array() ||
      j["programs"].empty())
    throw Error(source + " is not an hpmoe program dump (expected \"format\": \"hpmoe-taskflow-dump\" and programs)");
  if (j.contains("version") && (!j["version"].is_number_integer() || j["version"].get<std::int64_t>() != kFormatVersion))
    throw Error(source + ": dump format version " + j["version"].dump().substr(0, 20) + ", this hpmoe reads version " +
                std::to_string(kFormatVersion));
  std::vector<Program> programs;
  for (const auto& p : j["programs"]) programs.push_back(program_from_json(p));
  return programs;
}

namespace {

// The program's format version, pass and rank.
void read_header(const nlohmann::json& j, Program& p) {
  p.version = integer<int>(j.at("version"), "version");
  if (p.version != kFormatVersion)
    throw Error("program dump: format version " + std::to_string(p.version) + ", this hpmoe reads version " +
                std::to_string(kFormatVersion));
  const std::string pass = j.at("pass").get<std::string>();
  if (pass != "forward" && pass != "backward") throw Error("program dump: pass must be forward or backward");
  p.pass = pass == "forward" ? Pass::forward : Pass::backward;
  p.rank = integer<std::int32_t>(j.at("rank"), "rank");
  p.ranks = integer<std::int32_t>(j.at("ranks"), "ranks");
  if (p.ranks < 1 || p.rank < 0 || p.rank >= p.ranks) throw Error("program dump: rank outside 0..ranks-1");
}

// The machine it was compiled for: workers and tiles.
void read_machine(const nlohmann::json& j, Program& p) {
  const auto& m = j.at("machine");
  p.machine.name = m.at("name").get<std::string>();
  p.machine.matrix_workers = integer<int>(m.at("matrix_workers"), "machine.matrix_workers");
  p.machine.vector_workers = integer<int>(m.at("vector_workers"), "machine.vector_workers");
  p.machine.unified_workers = integer<int>(m.at("unified_workers"), "machine.unified_workers");
  p.machine.tile_rows = integer<std::int64_t>(m.at("tile_rows"), "machine.tile_rows");
  p.machine.tile_cols = integer<std::int64_t>(m.at("tile_cols"), "machine.tile_cols");
  p.machine.weight_tile_rows = m.contains("weight_tile_rows") ? integer<std::int64_t>(m.at("weight_tile_rows"), "machine.weight_tile_rows") : 0;
  p.machine.weight_tile_cols = m.contains("weight_tile_cols") ? integer<std::int64_t>(m.at("weight_tile_cols"), "machine.weight_tile_cols") : 0;
  if (m.contains("matrix_runs_vector")) {
    if (!m.at("matrix_runs_vector").is_boolean()) throw Error("program dump: machine.matrix_runs_vector must be true or false");
    p.machine.matrix_runs_vector = m.at("matrix_runs_vector").get<bool>();
  }
  if (p.machine.tile_rows < 1 || p.machine.tile_cols < 1 || p.machine.weight_tile_rows < 0 || p.machine.weight_tile_cols < 0 ||
      p.machine.tile_rows > (1 << 16) || p.machine.tile_cols > (1 << 16) || p.machine.weight_tile_rows > (1 << 16) ||
      p.machine.weight_tile_cols > (1 << 16) || p.machine.weight_tile_cols % p.machine.tile_cols != 0)
    throw Error("program dump: impossible tile sizes");
  if (p.machine.matrix_workers < 0 || p.machine.vector_workers < 0 || p.machine.unified_workers < 0 ||
      p.machine.workers() < 1 || p.machine.workers() > 4096)
    throw Error("program dump: impossible worker counts");
}

// The layer's sizes and the dispatch's row format.
void read_dims(const nlohmann::json& j, Program& p) {
  const auto& d = j.at("dims");
  // Layer sizes: positive (shared_inter and tokens may be 0) and within int32.
  const auto dim = [&](const char* name, std::int64_t lo) {
    const auto v = integer<std::int64_t>(d.at(name), std::string("dims.") + name);
    if (v < lo || v > std::numeric_limits<std::int32_t>::max())
      throw Error(std::string("program dump: dims.") + name + " = " + std::to_string(v) + " is not a layer size (" +
                  std::to_string(lo) + " to 2^31 - 1)");
    return v;
  };
  p.dims = Dims{dim("hidden", 1), dim("inter", 1), dim("shared_inter", 0), dim("experts", 1), dim("top_k", 1),
                dim("tokens", 0), integer<std::int64_t>(d.at("elem_bytes"), "dims.elem_bytes")};
  if (p.dims.elem_bytes != 2 && p.dims.elem_bytes != 4) throw Error("program dump: dims.elem_bytes must be 2 or 4");
  if (d.contains("dispatch_format")) {
    p.dims.dispatch_format = integer<std::int64_t>(d.at("dispatch_format"), "dims.dispatch_format");
    p.dims.dispatch_row_bytes = integer<std::int64_t>(d.at("dispatch_row_bytes"), "dims.dispatch_row_bytes");
    const std::int64_t expected = p.dims.dispatch_format == 1   ? fp8_row_bytes(p.dims.hidden)
                                  : p.dims.dispatch_format == 2 ? 2 * p.dims.hidden
                                                                : -1;
    if (expected < 0) throw Error("program dump: dims.dispatch_format must be 1 (fp8) or 2 (bf16)");
    if (p.dims.dispatch_row_bytes != expected || (p.dims.dispatch_format == 1 && p.dims.hidden % kFp8BlockChannels != 0))
      throw Error("program dump: dims.dispatch_row_bytes = " + std::to_string(p.dims.dispatch_row_bytes) +
                  " does not fit dispatch_format " + std::to_string(p.dims.dispatch_format) + " and hidden " +
                  std::to_string(p.dims.hidden));
  }
  if (p.dims.experts < 1 || p.dims.experts > (1 << 20))
    throw Error("program dump: dims.experts must be between 1 and 1048576");
}

// The rank's slots and the exchange's row layouts: receive order, K padding, token blocks, lent blocks, node blocks, split parts, declared reductions.
void read_slots(const nlohmann::json& j, Program& p) {
  p.local_experts = integers<std::int32_t>(j.at("local_experts"), "local_experts");
  p.expert_slot.assign(static_cast<std::size_t>(p.dims.experts), -1);
  for (std::size_t le = 0; le < p.local_experts.size(); ++le) {
    const std::int32_t e = p.local_experts[le];
    if (e < 0 || e >= p.dims.experts)
      throw Error("program dump: local_experts names expert " + std::to_string(e) + ", outside 0.." +
                  std::to_string(p.dims.experts - 1));
    if (p.expert_slot[static_cast<std::size_t>(e)] >= 0)
      throw Error("program dump: local_experts lists expert " + std::to_string(e) + " twice");
    p.expert_slot[static_cast<std::size_t>(e)] = static_cast<std::int32_t>(le);
  }
  p.expert_begin = integers<std::int64_t>(j.at("expert_begin"), "expert_begin");
  if (p.expert_begin.size() != p.local_experts.size() + 1)
    throw Error("program dump: expert_begin must have one entry more than local_experts");
  p.kpad_begin = integers<std::int64_t>(j.at("kpad_begin"), "kpad_begin");
  if (p.kpad_begin.size() != p.expert_begin.size())
    throw Error("program dump: kpad_begin must have one entry more than local_experts");
  p.send_rows = integer<std::int64_t>(j.at("send_rows"), "send_rows");
  if (p.send_rows < 0 || p.send_rows > (std::int64_t{1} << 40)) throw Error("program dump: send_rows is impossible");
  if (j.contains("token_begin")) {
    p.token_begin = integers<std::int64_t>(j.at("token_begin"), "token_begin");
    if (p.token_begin.size() != static_cast<std::size_t>(p.ranks) * p.local_experts.size() + 1 || p.token_begin.front() != 0 ||
        !std::is_sorted(p.token_begin.begin(), p.token_begin.end()) || p.token_begin.back() > (std::int64_t{1} << 40))
      throw Error("program dump: token_begin must be ranks x local experts + 1 increasing rows from 0");
  }
  if (j.contains("lent_block")) {
    p.lent_block = integers<std::int32_t>(j.at("lent_block"), "lent_block");
    if (p.lent_block.size() != p.local_experts.size() ||
        std::any_of(p.lent_block.begin(), p.lent_block.end(), [&](std::int32_t b) {
          return b < -1 || b >= 2 * static_cast<std::int32_t>(p.local_experts.size());
        }))
      throw Error("program dump: lent_block must give each local expert its LENT_W row (-1: not lent), below twice "
                  "the local experts");
  }
  for (const auto& [key, field] : {std::pair{"node_begin", &Program::node_begin}, std::pair{"node_route_begin", &Program::node_route_begin},
                                   std::pair{"node_comb_begin", &Program::node_comb_begin}, std::pair{"node_sum_begin", &Program::node_sum_begin}}) {
    if (!j.contains(key)) continue;
    auto& v = p.*field;
    v = integers<std::int64_t>(j.at(key), key);
    // node_begin, node_sum_begin: ranks x node slots + 1; node_route_begin,
    // node_comb_begin: ranks x node ranks x node slots + 1.
    if (v.empty() || (v.size() - 1) % static_cast<std::size_t>(p.ranks) != 0 || v.size() > (std::size_t{1} << 24) ||
        v.front() != 0 || !std::is_sorted(v.begin(), v.end()) || v.back() > (std::int64_t{1} << 40))
      throw Error(std::string("program dump: ") + key + " must be a multiple of ranks + 1 increasing rows from 0");
  }
  if (p.node_begin.empty() != p.node_route_begin.empty() || p.node_begin.empty() != p.node_comb_begin.empty() ||
      p.node_begin.empty() != p.node_sum_begin.empty())
    throw Error("program dump: node_begin, node_route_begin, node_comb_begin and node_sum_begin come together (the per-node exchange)");
  if (!p.node_begin.empty() &&
      (p.node_sum_begin.size() != p.node_begin.size() || p.node_comb_begin.size() != p.node_route_begin.size() ||
       p.node_comb_begin.back() > p.node_route_begin.back() || p.node_sum_begin.back() != p.node_begin.back()))
    throw Error("program dump: node_sum_begin must be as long as node_begin with as many rows, and node_comb_begin as long as "
                "node_route_begin with at most as many (a source's sums by combine slot, and its parts slot by slot)");
  if (j.contains("slot_parts")) {
    const auto& parts = j.at("slot_parts");
    if (!parts.is_array() || parts.size() != p.local_experts.size())
      throw Error("program dump: slot_parts must have one [inter_begin, inter, part, parts] per local expert");
    for (const auto& s : parts) {
      if (!s.is_array() || s.size() != 4) throw Error("program dump: a slot part must be [inter_begin, inter, part, parts]");
      p.slot_parts.push_back(SlotPart{integer<std::int64_t>(s[0], "slot_parts inter_begin"),
                                      integer<std::int64_t>(s[1], "slot_parts inter"),
                                      integer<std::int32_t>(s[2], "slot_parts part"),
                                      integer<std::int32_t>(s[3], "slot_parts parts")});
    }
  } else {
    p.slot_parts.assign(p.local_experts.size(), SlotPart{0, p.dims.inter, 0, 1});
  }
  if (j.contains("reductions")) {
    const auto& reds = j.at("reductions");
    if (!reds.is_array()) throw Error("program dump: reductions must be a list of [expert, parts, row_begin, rows]");
    for (const auto& r : reds) {
      if (!r.is_array() || r.size() != 4) throw Error("program dump: a reduction must be [expert, parts, row_begin, rows]");
      p.reductions.push_back(Reduction{integer<std::int32_t>(r[0], "reduction expert"),
                                       integer<std::int32_t>(r[1], "reduction parts"),
                                       integer<std::int64_t>(r[2], "reduction row_begin"),
                                       integer<std::int64_t>(r[3], "reduction rows")});
    }
  }
}

// Its buffers and events.
void read_buffers_and_events(const nlohmann::json& j, Program& p) {
  for (const auto& b : j.at("buffers"))
    p.buffers.push_back(BufferLayout{enum_from<BufferId>(std::size_t(BufferId::count), b.at("id").get<std::string>(), "buffer"),
                                     integer<std::int64_t>(b.at("rows"), "buffer rows"),
                                     integer<std::int64_t>(b.at("cols"), "buffer cols"),
                                     integer<std::int64_t>(b.at("elem_bytes"), "buffer elem_bytes"),
                                     integer<std::int64_t>(b.at("offset_bytes"), "buffer offset_bytes"),
                                     enum_from<Region>(3, b.at("region").get<std::string>(), "region"),
                                     enum_from<Layout>(2, b.at("layout").get<std::string>(), "layout")});
  for (const auto& e : j.at("events")) {
    if (!e.is_array() || e.size() != 4) throw Error("program dump: an event must be [required, consumer, expert, tile]");
    const std::string consumer = e[1].get<std::string>();
    const std::string which = "event " + std::to_string(p.events.size());
    p.events.push_back(Event{integer<std::int32_t>(e[0], which + " required"),
                             consumer == "none" ? TaskKind::count : enum_from<TaskKind>(std::size_t(TaskKind::count), consumer, "task kind"),
                             integer<std::int32_t>(e[2], which + " expert"), integer<std::int32_t>(e[3], which + " tile")});
    if (p.events.back().required < 0) throw Error("program dump: negative required count");
  }
}

// Its tasks and their costs.
void read_tasks(const nlohmann::json& j, Program& p) {
  for (const auto& t : j.at("tasks")) {
    if (!t.is_array() || t.size() != 14) throw Error("program dump: a task must have 14 fields (see task_fields)");
    const TaskKind kind = enum_from<TaskKind>(std::size_t(TaskKind::count), t[0].get<std::string>(), "task kind");
    const auto field = [&](std::size_t i) {
      static const char* names[] = {"kind", "src", "dst", "expert", "peer", "row_begin", "rows", "col_begin", "cols",
                                    "src_row", "wait_event", "wait_count", "trigger_event"};
      return integer<std::int32_t>(t[i], "task " + std::to_string(p.tasks.size()) + " " + names[i]);
    };
    Task task{kind, queue_class(kind), enum_from<BufferId>(std::size_t(BufferId::count), t[1].get<std::string>(), "buffer"),
              enum_from<BufferId>(std::size_t(BufferId::count), t[2].get<std::string>(), "buffer"), field(3), field(4), field(5), field(6),
              field(7), field(8), field(9), field(10), field(11), field(12)};
    // Rectangles are computed in 64 bits, but a row or column end must
    // also be an int32 for the executor's views.
    if (task.rows < 0 || task.cols < 0 || std::int64_t{task.row_begin} + task.rows > std::numeric_limits<std::int32_t>::max() ||
        std::int64_t{task.col_begin} + task.cols > std::numeric_limits<std::int32_t>::max() ||
        std::int64_t{task.src_row} + task.rows > std::numeric_limits<std::int32_t>::max())
      throw Error("program dump: task " + std::to_string(p.tasks.size()) + " has an impossible rectangle");
    p.tasks.push_back(task);
    p.cost.push_back(t[13].get<float>());
  }
}

// Its workers' queues.
void read_queues(const nlohmann::json& j, Program& p) {
  p.queue_begin.push_back(0);
  for (const auto& q : j.at("queues")) {
    for (const auto& id : q) {
      const auto v = integer<std::int32_t>(id, "a queue's task");
      if (v < 0 || v >= static_cast<std::int32_t>(p.tasks.size())) throw Error("program dump: queue names task " + std::to_string(v) + " which does not exist");
      p.queue_tasks.push_back(v);
    }
    p.queue_begin.push_back(static_cast<std::int32_t>(p.queue_tasks.size()));
  }
  if (static_cast<int>(p.queue_begin.size()) - 1 != p.machine.workers())
    throw Error("program dump: " + std::to_string(p.queue_begin.size() - 1) + " queues for " +
                std::to_string(p.machine.workers()) + " workers");
}

}  // namespace

Program program_from_json(const nlohmann::json& j) {
  try {
    if (!j.is_object() || j.value("format", "") != "hpmoe-taskflow-program")
      throw Error("program dump: not an hpmoe taskflow program (missing \"format\": \"hpmoe-taskflow-program\")");
    Program p;
    read_header(j, p);
    read_machine(j, p);
    read_dims(j, p);
    read_slots(j, p);
    read_buffers_and_events(j, p);
    read_tasks(j, p);
    read_queues(j, p);
    return p;
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("program dump is malformed: ") + e.what());
  }
}

std::string listing(const Program& p, std::size_t max_tasks) {
  std::ostringstream o;
  o << "program rank " << p.rank << "/" << p.ranks << " " << (p.pass == Pass::forward ? "forward" : "backward") << ": "
    << p.tasks.size() << " tasks, " << p.events.size() << " events, " << p.machine.workers() << " workers\n";
  o << "buffers:";
  for (const auto& b : p.buffers) o << " " << name(b.id) << "[" << b.rows << "x" << b.cols << "]";
  o << "\n";
  std::size_t shown = 0;
  for (std::size_t w = 0; w + 1 < p.queue_begin.size(); ++w) {
    o << "worker " << w << " (" << (p.machine.takes(static_cast<int>(w), QueueClass::matrix) ? "matrix" : "")
      << (p.machine.takes(static_cast<int>(w), QueueClass::vector) ? "vector" : "") << "), "
      << (p.queue_begin[w + 1] - p.queue_begin[w]) << " tasks\n";
    for (auto i = p.queue_begin[w]; i < p.queue_begin[w + 1]; ++i) {
      if (shown++ >= max_tasks) {
        o << "  ... (--dump writes all)\n";
        return o.str();
      }
      const Task& t = p.tasks[p.queue_tasks[i]];
      o << "  #" << p.queue_tasks[i] << " " << name(t.kind);
      if (t.expert >= 0) o << " e" << t.expert;
      o << " " << name(t.src) << "->" << name(t.dst);
      if (t.peer != p.rank) o << "@" << t.peer;
      o << " rows[" << t.row_begin << "," << t.row_begin + t.rows << ") cols[" << t.col_begin << ","
        << t.col_begin + t.cols << ")";
      if (t.wait_event >= 0) o << " wait ev" << t.wait_event << ">=" << t.wait_count;
      if (t.trigger_event >= 0) {
        o << " -> ev" << t.trigger_event;
        if (t.peer != p.rank) o << "@" << t.peer;
      }
      o << "\n";
    }
  }
  return o.str();
}

}  // namespace hpmoe::taskflow
