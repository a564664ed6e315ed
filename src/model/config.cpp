#include "hpmoe/config.hpp"

#include "common/finite_number.hpp"
#include "common/fp8.hpp"

#include <charconv>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"

namespace hpmoe {

std::string to_string(Scoring s) { return s == Scoring::softmax ? "softmax" : "sigmoid"; }
std::string to_string(DType d) { return d == DType::fp32 ? "fp32" : "bf16"; }
std::string to_string(DropPolicy d) { return d == DropPolicy::probs ? "probs" : "position"; }
std::string to_string(GradDispatchDType d) {
  switch (d) {
    case GradDispatchDType::automatic: return "auto";
    case GradDispatchDType::layer: return "layer";
    case GradDispatchDType::bf16: return "bf16";
  }
  return "?";
}
std::string to_string(ExchangeMode m) { return m == ExchangeMode::rank ? "rank" : "assignment"; }

std::string to_string(CombineDType d) { return d == CombineDType::bf16 ? "bf16" : "layer"; }

std::string to_string(DispatchDType d) {
  switch (d) {
    case DispatchDType::layer: return "layer";
    case DispatchDType::fp32: return "fp32";
    case DispatchDType::bf16: return "bf16";
    case DispatchDType::fp8: return "fp8";
  }
  return "?";
}

namespace {

constexpr std::int64_t kMaxDim = std::int64_t{1} << 22;  // keeps every index product in 64 bits

std::int64_t parse_int(std::string_view field, std::string_view text) {
  std::int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range)
    throw Error("config field '" + std::string(field) + "': " + std::string(text) + " is out of range");
  if (ec != std::errc{} || end != text.data() + text.size()) {
    throw Error("config field '" + std::string(field) + "': '" + std::string(text) +
                "' is not an integer");
  }
  return v;
}

double parse_double(std::string_view field, std::string_view text) {
  if (const auto v = detail::finite_number(text)) return *v;
  throw Error("config field '" + std::string(field) + "': '" + std::string(text) + "' is not a finite number");
}

bool parse_bool(std::string_view field, std::string_view text) {
  if (text == "true" || text == "1" || text == "yes" || text == "on") return true;
  if (text == "false" || text == "0" || text == "no" || text == "off") return false;
  throw Error("config field '" + std::string(field) + "': '" + std::string(text) +
              "' is not a boolean (use true or false)");
}

using Setter = std::function<void(LayerConfig&, std::string_view field, std::string_view value)>;

const std::map<std::string, Setter, std::less<>>& setters() {
  static const std::map<std::string, Setter, std::less<>> table = [] {
    std::map<std::string, Setter, std::less<>> t;
    auto integer = [](std::int64_t LayerConfig::*member) {
      return [member](LayerConfig& c, std::string_view f, std::string_view v) { c.*member = parse_int(f, v); };
    };
    auto real = [](double LayerConfig::*member) {
      return [member](LayerConfig& c, std::string_view f, std::string_view v) { c.*member = parse_double(f, v); };
    };
    auto boolean = [](bool LayerConfig::*member) {
      return [member](LayerConfig& c, std::string_view f, std::string_view v) { c.*member = parse_bool(f, v); };
    };
    t["name"] = [](LayerConfig& c, std::string_view, std::string_view v) { c.name = std::string(v); };
    t["hidden"] = integer(&LayerConfig::hidden);
    t["expert_inter"] = integer(&LayerConfig::expert_inter);
    t["routed_experts"] = integer(&LayerConfig::routed_experts);
    t["shared_experts"] = integer(&LayerConfig::shared_experts);
    t["shared_inter"] = integer(&LayerConfig::shared_inter);
    t["top_k"] = integer(&LayerConfig::top_k);
    t["scoring"] = [](LayerConfig& c, std::string_view f, std::string_view v) {
      if (v == "softmax") c.scoring = Scoring::softmax;
      else if (v == "sigmoid") c.scoring = Scoring::sigmoid;
      else throw Error("config field '" + std::string(f) + "': '" + std::string(v) + "' is not softmax or sigmoid");
    };
    t["groups"] = integer(&LayerConfig::groups);
    t["groups_kept"] = integer(&LayerConfig::groups_kept);
    t["normalize_topk"] = boolean(&LayerConfig::normalize_topk);
    t["route_scale"] = real(&LayerConfig::route_scale);
    t["capacity_factor"] = real(&LayerConfig::capacity_factor);
    t["drop_policy"] = [](LayerConfig& c, std::string_view f, std::string_view v) {
      if (v == "probs") c.drop_policy = DropPolicy::probs;
      else if (v == "position") c.drop_policy = DropPolicy::position;
      else throw Error("config field '" + std::string(f) + "': '" + std::string(v) + "' is not probs or position");
    };
    t["aux_loss_coef"] = real(&LayerConfig::aux_loss_coef);
    t["z_loss_coef"] = real(&LayerConfig::z_loss_coef);
    t["expert_bias"] = boolean(&LayerConfig::expert_bias);
    t["bias_update_rate"] = real(&LayerConfig::bias_update_rate);
    t["tokens_per_rank"] = integer(&LayerConfig::tokens_per_rank);
    t["ranks"] = integer(&LayerConfig::ranks);
    t["ranks_per_node"] = integer(&LayerConfig::ranks_per_node);
    t["node_forwarding"] = boolean(&LayerConfig::node_forwarding);
    t["lend_weights"] = [](LayerConfig& c, std::string_view f, std::string_view v) {
      if (v == "off") c.lend_weights = 0;
      else if (v == "auto") c.lend_weights = LayerConfig::kLendAuto;
      else if (v.empty() || v.find_first_not_of("0123456789") != std::string_view::npos || v.size() > 18)
        throw Error("config field '" + std::string(f) + "': '" + std::string(v) + "' is not off, auto or a count of rows");
      else c.lend_weights = parse_int(f, v);
    };
    t["dtype"] = [](LayerConfig& c, std::string_view f, std::string_view v) {
      if (v == "fp32") c.dtype = DType::fp32;
      else if (v == "bf16") c.dtype = DType::bf16;
      else throw Error("config field '" + std::string(f) + "': '" + std::string(v) + "' is not fp32 or bf16");
    };
    t["dispatch_dtype"] = [](LayerConfig& c, std::string_view f, std::string_view v) {
      if (v == "layer") c.dispatch_dtype = DispatchDType::layer;
      else if (v == "fp32") c.dispatch_dtype = DispatchDType::fp32;
      else if (v == "bf16") c.dispatch_dtype = DispatchDType::bf16;
      else if (v == "fp8") c.dispatch_dtype = DispatchDType::fp8;
      else throw Error("config field '" + std::string(f) + "': '" + std::string(v) + "' is not layer, fp32, bf16 or fp8");
    };
    t["grad_dispatch_dtype"] = [](LayerConfig& c, std::string_view f, std::string_view v) {
      if (v == "auto") c.grad_dispatch_dtype = GradDispatchDType::automatic;
      else if (v == "layer") c.grad_dispatch_dtype = GradDispatchDType::layer;
      else if (v == "bf16") c.grad_dispatch_dtype = GradDispatchDType::bf16;
      else throw Error("config field '" + std::string(f) + "': '" + std::string(v) + "' is not auto, layer or bf16");
    };
    t["combine_dtype"] = [](LayerConfig& c, std::string_view f, std::string_view v) {
      if (v == "layer") c.combine_dtype = CombineDType::layer;
      else if (v == "bf16") c.combine_dtype = CombineDType::bf16;
      else throw Error("config field '" + std::string(f) + "': '" + std::string(v) + "' is not layer or bf16");
    };
    t["exchange"] = [](LayerConfig& c, std::string_view f, std::string_view v) {
      if (v == "assignment") c.exchange = ExchangeMode::assignment;
      else if (v == "rank") c.exchange = ExchangeMode::rank;
      else throw Error("config field '" + std::string(f) + "': '" + std::string(v) + "' is not assignment or rank");
    };
    return t;
  }();
  return table;
}

// "(value)" built without the literal + to_string pattern that trips GCC 12's -Wrestrict.
std::string quoted(std::int64_t v) {
  std::string s = std::to_string(v);
  s.insert(s.begin(), '(');
  s.push_back(')');
  return s;
}

void require(bool ok, const std::string& field, const std::string& why) {
  if (!ok) throw Error("invalid layer: " + field + " " + why);
}

}  // namespace

std::vector<std::string> config_fields() {
  std::vector<std::string> names;
  for (const auto& [k, v] : setters()) names.push_back(k);
  return names;
}

void LayerConfig::set(std::string_view field, std::string_view value) {
  auto it = setters().find(field);
  if (it == setters().end()) {
    std::string known;
    for (const auto& f : config_fields()) known += (known.empty() ? "" : ", ") + f;
    throw Error("unknown config field '" + std::string(field) + "' (known: " + known + ")");
  }
  it->second(*this, field, value);
}

std::int64_t LayerConfig::expert_capacity() const {
  if (capacity_factor <= 0) return -1;
  return static_cast<std::int64_t>(
      std::ceil(capacity_factor * double(tokens_per_rank) * double(top_k) / double(routed_experts)));
}

void LayerConfig::validate() const {
  auto positive = [](std::int64_t v, const char* field) {
    require(v > 0, field, "must be positive (got " + std::to_string(v) + ")");
    require(v <= kMaxDim, field, "is too large (got " + std::to_string(v) + ", limit " + std::to_string(kMaxDim) + ")");
  };
  positive(hidden, "hidden");
  positive(expert_inter, "expert_inter");
  positive(routed_experts, "routed_experts");
  positive(top_k, "top_k");
  positive(tokens_per_rank, "tokens_per_rank");
  positive(ranks, "ranks");
  positive(groups, "groups");
  positive(groups_kept, "groups_kept");
  // Expert parallelism beyond any cluster hpmoe models (compile and
  // simulation time grow about as P^3: EP 4096 took minutes).
  require(ranks <= 1024, "ranks", "must be at most 1024 (got " + std::to_string(ranks) + ")");
  require(ranks_per_node >= 0 && ranks_per_node <= ranks && (ranks_per_node == 0 || ranks % ranks_per_node == 0),
          "ranks_per_node", "must divide the " + std::to_string(ranks) + " ranks into whole nodes (got " +
                                std::to_string(ranks_per_node) + "; 0: one node)");
  require(lend_weights == kLendAuto || lend_weights >= 0, "lend_weights",
          "must be off, auto or a count of rows >= 1 (got " + std::to_string(lend_weights) + ")");
  require(routed_experts <= 16384, "routed_experts", "must be at most 16384 (got " + std::to_string(routed_experts) + ")");
  // The name goes into reports and JSON: printable ASCII only.
  require(name.size() <= 256 && std::all_of(name.begin(), name.end(), [](char ch) { return ch >= 0x20 && ch < 0x7f; }),
          "name", "must be up to 256 printable ASCII characters");
  require(shared_experts >= 0 && shared_experts <= 64, "shared_experts", "must be between 0 and 64");
  require(shared_inter >= 0 && shared_inter <= kMaxDim, "shared_inter", "must be between 0 and " + std::to_string(kMaxDim));
  require(top_k <= routed_experts, "top_k",
          quoted(top_k) + " must not exceed routed_experts (" + std::to_string(routed_experts) + ")");
  require(routed_experts % groups == 0, "groups",
          quoted(groups) + " must divide routed_experts (" + std::to_string(routed_experts) + ")");
  require(groups_kept <= groups, "groups_kept",
          quoted(groups_kept) + " must not exceed groups (" + std::to_string(groups) + ")");
  require(top_k <= groups_kept * (routed_experts / groups), "top_k",
          quoted(top_k) + " must not exceed the experts in the kept groups (" +
              std::to_string(groups_kept * (routed_experts / groups)) + ")");
  // Upper bounds a real layer never comes near, below which the fp32 paths
  // stay finite (route_scale 1e300 made every gate weight infinite).
  require(std::isfinite(route_scale) && route_scale > 0 && route_scale <= 1e4, "route_scale",
          "must be a positive number up to 1e4");
  require(std::isfinite(capacity_factor) && capacity_factor >= 0, "capacity_factor",
          "must be 0 (dropless) or positive");
  require(std::isfinite(aux_loss_coef) && aux_loss_coef >= 0 && aux_loss_coef <= 1e3, "aux_loss_coef", "must be between 0 and 1e3");
  require(std::isfinite(z_loss_coef) && z_loss_coef >= 0 && z_loss_coef <= 1e3, "z_loss_coef", "must be between 0 and 1e3");
  require(std::isfinite(bias_update_rate) && bias_update_rate >= 0 && bias_update_rate <= 1e3, "bias_update_rate",
          "must be between 0 and 1e3");
  require(tokens_per_rank * top_k <= (std::int64_t{1} << 31), "tokens_per_rank",
          "times top_k must stay below 2^31 assignments per rank");
  require(!(dispatch_dtype == DispatchDType::fp32 && dtype == DType::bf16), "dispatch_dtype",
          "fp32 is wider than the layer's bf16: dispatch in bf16 (layer) or fp8");
  require(combine_dtype == CombineDType::layer || exchange == ExchangeMode::rank, "combine_dtype",
          "bf16 needs exchange rank (the per-assignment combine returns rows in the layer's dtype)");
  require(dispatch_dtype != DispatchDType::fp8 || hidden % kFp8BlockChannels == 0, "hidden",
          quoted(hidden) + " must be a multiple of " + std::to_string(kFp8BlockChannels) +
              " for fp8 dispatch (one scale per " + std::to_string(kFp8BlockChannels) + " channels)");
  if (dtype == DType::bf16) {
    require(hidden % 2 == 0, "hidden", "must be even for bf16 (the bf16 GEMM packs K in pairs)");
    require(expert_inter % 2 == 0, "expert_inter", "must be even for bf16 (the bf16 GEMM packs K in pairs)");
    require(shared_inter_total() % 2 == 0, "shared_inter", "must be even for bf16 (the bf16 GEMM packs K in pairs)");
  }
}

bool LayerConfig::staged_dispatch() const {
  return dispatch_dtype == DispatchDType::fp8 || (dispatch_dtype == DispatchDType::bf16 && dtype == DType::fp32);
}

std::int64_t LayerConfig::dispatch_row_bytes() const {
  if (dispatch_dtype == DispatchDType::fp8) return fp8_row_bytes(hidden);
  if (dispatch_dtype == DispatchDType::bf16) return 2 * hidden;
  return hidden * (dtype == DType::bf16 ? 2 : 4);
}

bool LayerConfig::staged_grad_dispatch() const {
  if (dtype != DType::fp32) return false;
  return grad_dispatch_dtype == GradDispatchDType::bf16 ||
         (grad_dispatch_dtype == GradDispatchDType::automatic && staged_dispatch());
}

std::int64_t LayerConfig::lend_threshold() const {
  if (lend_weights != kLendAuto) return lend_weights;
  // Per link direction: the owner sends the weights where it would have
  // sent the rows' outputs back, and the borrower receives them where it
  // would have received those outputs (and sends no rows out). Lending
  // moves no more bytes either way on either end when the rows' narrower
  // leg alone outweighs the weights.
  const std::int64_t elem = dtype == DType::bf16 ? 2 : 4;
  const std::int64_t combine_row = narrow_combine() ? 2 * hidden : elem * hidden;
  const std::int64_t weight_bytes =
      packed_weight_bytes(hidden, 2 * expert_inter, dtype) + packed_weight_bytes(expert_inter, hidden, dtype);
  const std::int64_t row_bytes = std::min(dispatch_row_bytes(), combine_row);
  return (weight_bytes + row_bytes - 1) / row_bytes;
}

double LayerConfig::forward_flops() const {
  const double n = double(total_tokens());
  return n * double(top_k) * 6.0 * double(hidden) * double(expert_inter) +
         n * 6.0 * double(hidden) * double(shared_inter_total()) + n * 2.0 * double(hidden) * double(routed_experts);
}

namespace {

nlohmann::json spec_json(const LayerSpec& c) {
  return nlohmann::json{{"name", c.name},
                        {"hidden", c.hidden},
                        {"expert_inter", c.expert_inter},
                        {"routed_experts", c.routed_experts},
                        {"shared_experts", c.shared_experts},
                        {"shared_inter", c.shared_inter},
                        {"top_k", c.top_k},
                        {"scoring", to_string(c.scoring)},
                        {"groups", c.groups},
                        {"groups_kept", c.groups_kept},
                        {"normalize_topk", c.normalize_topk},
                        {"route_scale", c.route_scale},
                        {"capacity_factor", c.capacity_factor},
                        {"drop_policy", to_string(c.drop_policy)},
                        {"aux_loss_coef", c.aux_loss_coef},
                        {"z_loss_coef", c.z_loss_coef},
                        {"expert_bias", c.expert_bias},
                        {"bias_update_rate", c.bias_update_rate},
                        {"dtype", to_string(c.dtype)}};
}

nlohmann::json run_json(const RunOptions& c) {
  return nlohmann::json{{"tokens_per_rank", c.tokens_per_rank},
                        {"ranks", c.ranks},
                        {"dispatch_dtype", to_string(c.dispatch_dtype)},
                        {"grad_dispatch_dtype", to_string(c.grad_dispatch_dtype)},
                        {"exchange", to_string(c.exchange)},
                        {"combine_dtype", to_string(c.combine_dtype)},
                        {"ranks_per_node", c.ranks_per_node},
                        {"node_forwarding", c.node_forwarding},
                        {"lend_weights", c.lend_weights == 0                     ? nlohmann::json("off")
                                         : c.lend_weights == RunOptions::kLendAuto ? nlohmann::json("auto")
                                                                                  : nlohmann::json(c.lend_weights)}};
}

std::vector<std::string> keys_of(const nlohmann::json& j) {
  std::vector<std::string> out;
  for (const auto& [k, v] : j.items()) out.push_back(k);
  return out;
}

// A config in either of hpmoe's forms as one object of fields: the two
// sections' fields, each checked to be in its own section.
nlohmann::json flat_fields(const nlohmann::json& j, const std::string& source = "layer config") {
  if (!j.is_object()) throw Error("a layer config must be a JSON object");
  if (!j.contains("layer") && !j.contains("run")) return j;
  nlohmann::json flat = nlohmann::json::object();
  for (const auto& [section, fields] : j.items()) {
    if (section != "layer" && section != "run")
      throw Error(source + ": '" + section + "' beside \"layer\" and \"run\": a config is either one object of fields "
                  "or those two sections");
    if (!fields.is_object()) throw Error(source + ": \"" + section + "\" must be an object of fields");
    const auto own = section == "layer" ? layer_fields() : run_fields();
    for (const auto& [key, value] : fields.items()) {
      if (std::find(own.begin(), own.end(), key) == own.end()) {
        const auto other = section == "layer" ? run_fields() : layer_fields();
        if (std::find(other.begin(), other.end(), key) != other.end())
          throw Error(source + ": '" + key + "' is " + (section == "layer" ? "how the layer runs: put it under \"run\""
                                                                               : "part of the layer: put it under \"layer\""));
        throw Error(source + ": unknown config field '" + key + "' in \"" + section + "\" (`hpmoe config --fields` lists them)");
      }
      flat[key] = value;
    }
  }
  return flat;
}

}  // namespace

std::vector<std::string> layer_fields() { return keys_of(spec_json(LayerSpec{})); }
std::vector<std::string> run_fields() { return keys_of(run_json(RunOptions{})); }

nlohmann::json to_json(const LayerConfig& c) {
  nlohmann::json j = spec_json(c.spec());
  j.update(run_json(c.run()));
  return j;
}

nlohmann::json to_sections_json(const LayerConfig& c) {
  return nlohmann::json{{"layer", spec_json(c.spec())}, {"run", run_json(c.run())}};
}

namespace {
std::string scalar_text(const std::string& key, const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_unsigned()) return std::to_string(v.get<std::uint64_t>());  // parse_int range-checks it
  if (v.is_number_integer()) return std::to_string(v.get<std::int64_t>());
  if (v.is_number_float()) {
    std::ostringstream s;
    s.precision(17);
    s << v.get<double>();
    return s.str();
  }
  throw Error("config key '" + key + "' must be a number, string or boolean, not " + v.dump());
}
}  // namespace

LayerConfig config_from_json(const nlohmann::json& j) {
  LayerConfig c;
  const nlohmann::json fields = flat_fields(j);
  for (const auto& [key, value] : fields.items()) c.set(key, scalar_text(key, value));
  return c;
}

std::vector<std::string> preset_names() {
  return {"tiny", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"};
}

LayerConfig empty_tiles_layer(std::int64_t ranks, std::int64_t tokens_per_rank) {
  LayerConfig c = preset("tiny");
  c.name = "empty-tiles";
  c.hidden = 2;
  c.expert_inter = 2;
  c.routed_experts = 8;
  c.shared_experts = 0;
  c.top_k = 2;
  c.ranks = ranks;
  c.tokens_per_rank = tokens_per_rank;
  c.validate();
  return c;
}

LayerConfig preset(std::string_view name) {
  LayerConfig c;
  c.name = std::string(name);
  c.tokens_per_rank = 4096;
  c.ranks = 1;
  if (name == "tiny") {
    c.hidden = 32; c.expert_inter = 16; c.routed_experts = 8; c.shared_experts = 1; c.top_k = 2;
    c.normalize_topk = true; c.tokens_per_rank = 24; c.ranks = 2; c.aux_loss_coef = 0.01; c.z_loss_coef = 0.001;
  } else if (name == "deepseek-v2-lite") {
    c.hidden = 2048; c.expert_inter = 1408; c.routed_experts = 64; c.shared_experts = 2; c.top_k = 6;
    c.aux_loss_coef = 0.001;
  } else if (name == "deepseek-v2") {
    c.hidden = 5120; c.expert_inter = 1536; c.routed_experts = 160; c.shared_experts = 2; c.top_k = 6;
    c.groups = 8; c.groups_kept = 3; c.route_scale = 16.0; c.aux_loss_coef = 0.003;
  } else if (name == "deepseek-v3") {
    c.hidden = 7168; c.expert_inter = 2048; c.routed_experts = 256; c.shared_experts = 1; c.top_k = 8;
    c.groups = 8; c.groups_kept = 4; c.scoring = Scoring::sigmoid; c.normalize_topk = true; c.route_scale = 2.5;
    c.expert_bias = true; c.aux_loss_coef = 0.0001;
  } else if (name == "qwen3-30b-a3b") {
    c.hidden = 2048; c.expert_inter = 768; c.routed_experts = 128; c.top_k = 8; c.normalize_topk = true;
    c.aux_loss_coef = 0.001;
  } else if (name == "qwen3-235b-a22b") {
    c.hidden = 4096; c.expert_inter = 1536; c.routed_experts = 128; c.top_k = 8; c.normalize_topk = true;
    c.aux_loss_coef = 0.001;
  } else if (name == "mixtral-8x7b") {
    c.hidden = 4096; c.expert_inter = 14336; c.routed_experts = 8; c.top_k = 2; c.normalize_topk = true;
    c.aux_loss_coef = 0.02;
  } else {
    std::string known;
    for (const auto& p : preset_names()) known += (known.empty() ? "" : ", ") + p;
    throw Error("unknown preset '" + std::string(name) + "' (presets: " + known + ")");
  }
  return c;
}

namespace {

struct ModelJson {
  const nlohmann::json& j;
  const std::string& source;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
  std::int64_t integer(const char* key) const {
    const auto& v = j.at(key);
    if (!v.is_number_integer() && !v.is_number_unsigned())
      throw Error(source + ": '" + key + "' must be an integer, not " + v.dump());
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
      throw Error(source + ": '" + key + "' is " + v.dump() + ", beyond any layer size");
    return v.get<std::int64_t>();
  }
  double real(const char* key) const {
    const auto& v = j.at(key);
    if (!v.is_number()) throw Error(source + ": '" + key + "' must be a number, not " + v.dump());
    return v.get<double>();
  }
  bool boolean(const char* key) const {
    const auto& v = j.at(key);
    if (!v.is_boolean()) throw Error(source + ": '" + key + "' must be true or false, not " + v.dump());
    return v.get<bool>();
  }
  std::string text(const char* key) const {
    const auto& v = j.at(key);
    if (!v.is_string()) throw Error(source + ": '" + key + "' must be a string, not " + v.dump());
    return v.get<std::string>();
  }
  std::int64_t required_int(std::initializer_list<const char*> keys) const {
    for (const char* k : keys)
      if (has(k)) return integer(k);
    std::string names;
    for (const char* k : keys) names += std::string(names.empty() ? "" : " or ") + "'" + k + "'";
    throw Error(source + ": missing " + names);
  }
};

Scoring scoring_from(const ModelJson& m, const char* key) {
  const std::string s = m.text(key);
  if (s == "softmax") return Scoring::softmax;
  if (s == "sigmoid") return Scoring::sigmoid;
  throw Error(m.source + ": '" + key + "' is '" + s + "', expected softmax or sigmoid");
}

}  // namespace

LayerConfig config_from_model_json(const nlohmann::json& j, const LayerConfig& base, const std::string& source) {
  if (!j.is_object()) throw Error(source + ": expected a JSON object");
  LayerConfig c = base;
  ModelJson m{j, source};
  if (j.contains("hidden") || j.contains("layer")) {  // hpmoe's own format, flat or in sections
    const nlohmann::json fields = flat_fields(j, source);
    for (const char* key : {"hidden", "expert_inter", "routed_experts", "top_k"})
      if (!fields.contains(key))
        throw Error(source + ": missing '" + key + "' (an hpmoe layer config sets at least hidden, expert_inter, "
                    "routed_experts and top_k; `hpmoe config --preset tiny` prints a complete one)");
    // How the layer runs, and its dtype, stay the base's where the file is silent.
    nlohmann::json merged = run_json(base.run());
    merged["dtype"] = to_string(base.dtype);
    for (const auto& [key, value] : fields.items()) merged[key] = value;
    return config_from_json(merged);
  }
  if (j.contains("dim") && j.contains("moe_inter_dim")) {  // DeepSeek inference config
    c.hidden = m.integer("dim");
    c.expert_inter = m.integer("moe_inter_dim");
    c.routed_experts = m.required_int({"n_routed_experts"});
    c.shared_experts = m.has("n_shared_experts") ? m.integer("n_shared_experts") : 0;
    c.shared_inter = 0;
    c.top_k = m.required_int({"n_activated_experts"});
    c.groups = m.has("n_expert_groups") ? m.integer("n_expert_groups") : 1;
    c.groups_kept = m.has("n_limited_groups") ? m.integer("n_limited_groups") : 1;
    c.route_scale = m.has("route_scale") ? m.real("route_scale") : 1.0;
    c.scoring = m.has("score_func") ? scoring_from(m, "score_func") : Scoring::softmax;
    // DeepSeek's reference model normalises the K weights and carries the
    // selection bias exactly when it scores with sigmoid (V3).
    c.normalize_topk = c.scoring == Scoring::sigmoid;
    c.expert_bias = c.scoring == Scoring::sigmoid;
    return c;
  }
  if (j.contains("hidden_size")) {  // Hugging Face config.json
    c.hidden = m.integer("hidden_size");
    c.expert_inter = m.required_int({"moe_intermediate_size", "intermediate_size"});
    c.routed_experts = m.required_int({"n_routed_experts", "num_experts", "num_local_experts"});
    c.top_k = m.required_int({"num_experts_per_tok"});
    c.shared_experts = m.has("n_shared_experts") ? m.integer("n_shared_experts") : 0;
    c.shared_inter = 0;
    if (m.has("shared_expert_intermediate_size") && m.integer("shared_expert_intermediate_size") > 0) {
      c.shared_experts = 1;  // Qwen2-MoE style: one shared expert of its own size
      c.shared_inter = m.integer("shared_expert_intermediate_size");
    }
    c.scoring = m.has("scoring_func") ? scoring_from(m, "scoring_func") : Scoring::softmax;
    c.groups = m.has("n_group") ? m.integer("n_group") : 1;
    c.groups_kept = m.has("topk_group") ? m.integer("topk_group") : 1;
    const bool mixtral = m.has("model_type") && m.text("model_type") == "mixtral";
    c.normalize_topk = m.has("norm_topk_prob") ? m.boolean("norm_topk_prob") : mixtral;
    c.route_scale = m.has("routed_scaling_factor") ? m.real("routed_scaling_factor") : 1.0;
    c.aux_loss_coef = m.has("router_aux_loss_coef") ? m.real("router_aux_loss_coef")
                      : m.has("aux_loss_alpha")     ? m.real("aux_loss_alpha")
                                                    : 0.0;
    c.z_loss_coef = m.has("router_z_loss_coef") ? m.real("router_z_loss_coef") : 0.0;
    c.expert_bias = m.has("topk_method") && m.text("topk_method") == "noaux_tc";
    return c;
  }
  throw Error(source + ": unrecognised config format (expected hpmoe keys such as 'hidden', Hugging Face keys such "
                       "as 'hidden_size', or DeepSeek inference keys such as 'dim' and 'moe_inter_dim')");
}

LayerConfig load_config_file(const std::string& path, const LayerConfig& base) {
  const nlohmann::json j = parse_json_file(path, "config file '" + path + "'");
  LayerConfig c = config_from_model_json(j, base, "config file '" + path + "'");
  if (!j.contains("hidden") && !j.contains("layer") && !j.contains("name")) {  // an imported model config: named by its file
    c.name = std::filesystem::path(path).stem().string().substr(0, 256);
    for (char& ch : c.name)  // the name must be printable ASCII (validate): a file's may not be
      if (ch < 0x20 || ch >= 0x7f) ch = '_';
  }
  return c;
}

}  // namespace hpmoe
