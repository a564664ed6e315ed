#include <algorithm>
#include <array>
#include <charconv>
#include <nlohmann/json.hpp>
#include <limits>
#include <sstream>

#include "hpmoe/error.hpp"
#include "ir/ir.hpp"

namespace hpmoe::taskflow {

namespace {
constexpr std::array<const char*, static_cast<std::size_t>(BufferId::count)> kBufferNames = {
    "none", "x", "recv", "h1", "a", "y", "comb", "out", "sh_h", "sh_a", "sh_y", "dout", "gw", "dlogits", "xtf", "rdx",
    "dwg", "dy", "da", "dyp", "at", "dw2", "dh", "dxe", "dhp", "xt", "dw1", "dcomb", "sh_da", "sh_doutp", "sh_at",
    "sh_xt", "dws2", "sh_dh", "sdx", "sh_dhp", "dws1", "dx", "xf", "slot", "gate", "send_token", "send_assign",
    "logits", "sh_dout", "recv_staged", "dy_staged", "rank_token", "rank_route", "recv_tok", "recv_route",
    "dy_tok", "rank_comb", "recv_comb", "comb_rank", "rank_slot", "gw_rank", "dcomb_rank", "node_token", "node_index",
    "node_tok", "node_route", "node_dy", "node_comb", "node_dcomb", "lent_w"};
constexpr std::array<const char*, 3> kRegionNames = {"symmetric", "local", "bound"};
constexpr std::array<const char*, 2> kLayoutNames = {"row_major", "panels"};

}  // namespace

const char* name(BufferId b) { return kBufferNames.at(static_cast<std::size_t>(b)); }
const char* name(Region r) { return kRegionNames.at(static_cast<std::size_t>(r)); }
const char* name(Layout l) { return kLayoutNames.at(static_cast<std::size_t>(l)); }

std::int64_t Program::region_bytes(Region region) const {
  std::int64_t end = 0;
  for (const auto& b : buffers)
    if (b.region == region) end = std::max(end, b.offset_bytes + b.bytes());
  return end;
}

const char* name(QueueClass c) { return c == QueueClass::matrix ? "matrix" : "vector"; }




bool Machine::takes(int worker, QueueClass c) const {
  if (worker < matrix_workers) return c == QueueClass::matrix;
  if (worker < matrix_workers + vector_workers) return c == QueueClass::vector;
  return worker < workers();
}

bool Machine::runs(int worker, QueueClass c) const {
  return takes(worker, c) || (matrix_runs_vector && c == QueueClass::vector && worker >= 0 && worker < matrix_workers);
}

namespace {
int parse_count(const std::string& spec, const std::string& text, int lo, int hi) {
  int v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || v < lo || v > hi)
    throw Error("machine '" + spec + "': '" + text + "' must be an integer between " + std::to_string(lo) + " and " +
                std::to_string(hi));
  return v;
}
}  // namespace

Machine cpu_machine(int workers) {
  if (workers < 1 || workers > 256) throw Error("a cpu machine needs 1 to 256 workers per rank (got " + std::to_string(workers) + ")");
  Machine m;
  m.name = "cpu";
  m.unified_workers = workers;
  return m;
}

Machine accel_machine(int matrix_workers, int vector_workers) {
  if (matrix_workers < 1 || matrix_workers > 1024 || vector_workers < 1 || vector_workers > 1024)
    throw Error("an accelerator needs 1 to 1024 matrix and vector workers per rank (got " + std::to_string(matrix_workers) +
                " and " + std::to_string(vector_workers) + ")");
  Machine m;
  m.name = "accel";
  m.unified_workers = 0;
  m.matrix_workers = matrix_workers;
  m.vector_workers = vector_workers;
  return m;
}

Machine parse_machine(const std::string& spec) {
  std::vector<std::string> parts;
  std::stringstream in(spec);
  for (std::string part; std::getline(in, part, ':');) parts.push_back(part);
  Machine m;
  auto tile = [&](const std::string& text) {
    const auto x = text.find('x');
    if (x == std::string::npos) throw Error("machine '" + spec + "': tile '" + text + "' must be ROWSxCOLS, e.g. 64x64");
    m.tile_rows = parse_count(spec, text.substr(0, x), 1, 1 << 16);
    m.tile_cols = parse_count(spec, text.substr(x + 1), 1, 1 << 16);
    if (m.tile_cols % 64 != 0 && m.tile_cols != 64)
      throw Error("machine '" + spec + "': tile columns must be a multiple of 64 (the kernels' operand panels)");
  };
  if (!parts.empty() && parts[0] == "cpu" && (parts.size() == 2 || parts.size() == 3)) {
    m = cpu_machine(static_cast<int>(parse_count(spec, parts[1], 1, 256)));
    if (parts.size() == 3) tile(parts[2]);
  } else if (!parts.empty() && parts[0] == "accel" && (parts.size() == 3 || parts.size() == 4)) {
    m = accel_machine(static_cast<int>(parse_count(spec, parts[1], 1, 1024)),
                      static_cast<int>(parse_count(spec, parts[2], 1, 1024)));
    if (parts.size() == 4) tile(parts[3]);
  } else {
    throw Error("unknown machine '" + spec + "' (use cpu:W[:RxC] or accel:MATRIX:VECTOR[:RxC])");
  }
  return m;
}

}  // namespace hpmoe::taskflow
