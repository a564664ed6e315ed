#pragma once
// The hpmoe front end's shared pieces: the options that describe a layer,
// the seed validator, and the checks every command makes of its outputs
// before it runs. Included by the front end's commands (one program).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include "common/atomic_file.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/placement.hpp"

namespace hpmoe::front {

// A seed is a whole number 0 .. 2^64-1: "-1" or "1e23" would otherwise wrap or round.
inline const CLI::Validator kSeedValidator(
    [](std::string& value) {
      const bool digits = !value.empty() && value.size() <= 20 &&
                          std::all_of(value.begin(), value.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
                          (value.size() < 20 || value <= "18446744073709551615");
      return digits ? std::string() : "must be a whole number from 0 to 18446744073709551615, got '" + value + "'";
    },
    "", "seed");

// Options shared by every command that describes a layer.
struct LayerOptions {
  std::string preset_name;
  std::string config_file;
  std::vector<std::string> sets;
  std::optional<std::int64_t> ranks, tokens;
  std::optional<std::string> dtype, dispatch_dtype, exchange, combine_dtype, lend;
  std::string placement = "contiguous";

  void add_to(CLI::App& app, bool with_placement = true) {
    app.add_option("--preset", preset_name, "model preset (see `hpmoe presets`)");
    app.add_option("--config", config_file,
                   "layer from a file: hpmoe JSON, Hugging Face config.json, or DeepSeek inference config");
    app.add_option("--set", sets, "override a field: --set top_k=4 (repeatable; `hpmoe config --fields` lists them)");
    app.add_option("--ranks,-P", ranks, "expert-parallel degree");
    app.add_option("--tokens,-T", tokens, "tokens per rank");
    app.add_option("--dtype", dtype, "fp32 or bf16");
    app.add_option("--dispatch-dtype", dispatch_dtype,
                   "what the dispatch sends tokens in: layer (default) | bf16 | fp8 (e4m3, one scale per 128 channels; "
                   "hidden a multiple of 128) | fp32 (fp32 layers) | auto (simulate, step, sweep, plan: the fastest "
                   "predicted, narrower wires accepted)");
    app.add_option("--exchange", exchange,
                   "how tokens travel to their experts: assignment (default: a row per token and expert) | rank (each "
                   "token once per destination rank; its experts there gather their rows from it; once per node "
                   "across nodes) | auto (the scheme the simulator predicts fastest; the default of plan, step and sweep)");
    app.add_option("--combine-dtype", combine_dtype,
                   "what the per-rank combine's sums and the backward's dx sums travel in: layer (default) | bf16 "
                   "(fp32 layers; needs --exchange rank)");
    app.add_option("--lend", lend,
                   "weights instead of tokens: off (default) | auto (lend an expert's weights to a rank whose own rows of "
                   "it would move more bytes there and back) | ROWS (lend where a rank has ROWS rows or more)");
    if (with_placement)
      app.add_option("--placement", placement,
                   "where the experts live: contiguous | round-robin | random[:SEED] | FILE.json "
                   "({\"experts_of_rank\": [[...], ...]} or {\"owner\": [...]}; \"replicas\", \"owners\", \"fetch_replicas\", \"slots_per_rank\", "
                   "\"splits\": docs/placement.schema.json)");
  }

  ExpertPlacement resolve_placement(const LayerConfig& c) const {
    ExpertPlacement p = parse_placement(placement, c.routed_experts, c.ranks);
    try {
      p.check_fits(c.routed_experts, c.ranks, c.expert_inter);
    } catch (const Error& e) {
      throw Error("--placement '" + placement + "': " + e.what());
    }
    return p;
  }

  // --exchange auto, --dispatch-dtype auto: the simulator chooses
  // (simulate_choosing_exchange); the config keeps what was given.
  bool exchange_auto() const { return exchange && *exchange == "auto"; }
  bool dispatch_auto() const { return dispatch_dtype && *dispatch_dtype == "auto"; }

  LayerConfig resolve(bool exchange_auto_allowed = false, bool dispatch_auto_allowed = false) const {
    if (exchange_auto() && !exchange_auto_allowed)
      throw Error("--exchange auto is chosen by the simulator (hpmoe run, simulate, step, sweep and plan take it); give "
                  "assignment or rank here");
    if (dispatch_auto() && !dispatch_auto_allowed)
      throw Error("--dispatch-dtype auto is chosen by the simulator (hpmoe simulate, step, sweep and plan take it); give "
                  "layer, bf16, fp8 or fp32 here");
    if (!preset_name.empty() && !config_file.empty()) throw Error("give either --preset or --config, not both");
    LayerConfig base = preset(preset_name.empty() ? "tiny" : preset_name);
    LayerConfig c = config_file.empty() ? base : load_config_file(config_file, base);
    for (const auto& s : sets) {
      const auto eq = s.find('=');
      if (eq == std::string::npos || eq == 0) throw Error("--set expects field=value, got '" + s + "'");
      c.set(s.substr(0, eq), s.substr(eq + 1));
    }
    if (ranks) c.set("ranks", std::to_string(*ranks));
    if (tokens) c.set("tokens_per_rank", std::to_string(*tokens));
    if (dtype) c.set("dtype", *dtype);
    if (dispatch_dtype && !dispatch_auto()) c.set("dispatch_dtype", *dispatch_dtype);
    if (exchange && !exchange_auto()) c.set("exchange", *exchange);
    if (combine_dtype) c.set("combine_dtype", *combine_dtype);
    if (lend) {
      if (*lend != "off" && *lend != "auto" && (lend->empty() || lend->find_first_not_of("0123456789") != std::string::npos ||
                                                lend->size() > 9 || std::stoll(*lend) < 1))
        throw Error("--lend '" + *lend + "': give off, auto or a count of rows from 1 to 999999999");
      c.set("lend_weights", *lend);
    }
    c.validate();
    return c;
  }
};

// Fails now, before the work, if `path` cannot be written later; creates
// nothing (a probe file would be left behind by an interrupted run).
// Outputs of one command that would overwrite each other or one of its
// inputs (--json X --trace X; --json D/weights.safetensors with --save D;
// --json over the --config read): refused before anything runs. Each entry
// is (flag, path); `save_dir` is the folder --save fills; inputs as given.
inline void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& outputs, const std::string& save_dir,
                            const std::vector<std::pair<std::string, std::string>>& inputs = {}) {
  namespace fs = std::filesystem;
  auto canonical = [](const std::string& p) {
    std::error_code ec;
    const fs::path c = fs::weakly_canonical(fs::absolute(p), ec);
    return ec ? fs::absolute(p).lexically_normal() : c;
  };
  std::vector<std::pair<std::string, fs::path>> seen;
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    const fs::path c = canonical(path);
    for (const auto& [other, p] : seen)
      if (p == c) throw Error(flag + " and " + other + " both write '" + path + "': give each output its own file");
    for (const auto& [in_flag, in_path] : inputs)
      if (!in_path.empty() && canonical(in_path) == c)
        throw Error(flag + " would overwrite '" + path + "', which " + in_flag + " reads: write the output elsewhere");
    if (!save_dir.empty() && c.parent_path() == canonical(save_dir)) {
      static const std::regex saved("(weights|inputs|routing|outputs)(-rank[0-9]+-of-[0-9]+)?\\.safetensors|"
                                    "model\\.safetensors\\.index\\.json");
      if (std::regex_match(c.filename().string(), saved))
        throw Error(flag + " '" + path + "' is a file that --save " + save_dir + " writes: give it another name or folder");
    }
    seen.emplace_back(flag, c);
  }
}

inline void check_writable(const std::string& path, const std::string& what) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::is_directory(status)) throw Error("cannot write " + what + " to '" + path + "': it is a directory");
  if (!ec && std::filesystem::exists(status)) {
    if (::access(path.c_str(), W_OK) != 0)
      throw Error("cannot write " + what + " to '" + path + "': " + std::strerror(errno));
    if (std::filesystem::is_regular_file(status)) {  // replaced by a rename: the directory must take a new file
      const auto dir = std::filesystem::path(path).parent_path();
      if (::access(dir.empty() ? "." : dir.c_str(), W_OK) != 0)
        throw Error("cannot write " + what + " to '" + path + "': its directory is not writable");
    }
    return;
  }
  const auto dir = std::filesystem::path(path).parent_path();
  if (::access(dir.empty() ? "." : dir.c_str(), W_OK) != 0)
    throw Error("cannot write " + what + " to '" + path + "': " + (dir.empty() ? std::string(".") : dir.string()) + ": " +
                std::strerror(errno));
}

// --save DIR, before the run: DIR is a directory this process can write
// (or can be made), and none of the files a run saves is a directory there.
inline void check_save_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path existing = fs::absolute(dir, ec);
  while (!existing.empty() && !fs::exists(existing, ec)) existing = existing.parent_path();
  if (existing.empty() || !fs::is_directory(existing, ec))
    throw Error("cannot save to '" + dir + "': " + (existing.empty() ? std::string("no such path") : existing.string() + " is not a directory"));
  if (::access(existing.c_str(), W_OK) != 0)
    throw Error("cannot save to '" + dir + "': " + existing.string() + ": " + std::strerror(errno));
  if (fs::exists(dir, ec))
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.path().extension() == ".safetensors" || entry.path().filename() == "model.safetensors.index.json")
        if (fs::is_directory(entry.path(), ec))
          throw Error("cannot save to '" + dir + "': " + entry.path().string() + " is a directory where a file would go");
}

inline void write_json(const std::string& path, const nlohmann::json& j) { write_file_atomically(path, j.dump(2) + "\n", "JSON results"); }

// --gemm-dtype: "layer" (the layer's dtype) or "fp8" (a bf16 layer's GEMMs at
// the machine model's fp8 rates; the simulator only).
inline bool fp8_gemms_from(const std::string& gemm_dtype) {
  if (gemm_dtype == "layer" || gemm_dtype == "bf16") return false;
  if (gemm_dtype == "fp8") return true;
  throw Error("--gemm-dtype '" + gemm_dtype + "': use layer (the layer's dtype) or fp8 (a bf16 layer's GEMMs at the machine's fp8 rates)");
}

}  // namespace hpmoe::front
