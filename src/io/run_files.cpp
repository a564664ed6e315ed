// A run's tensors on disk: the single-process save (weights, inputs,
// routing, outputs), the sharded save of an MPI run (a set per rank and an
// index), and the inputs read back from either. Saves are sets of files put
// in place together (SaveSet): a save that fails leaves the folder's earlier
// checkpoint whole, and one that succeeds removes the earlier save's files
// of the other kind, so a load never pairs new weights with old tokens.
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string_view>
#include <utility>

#include "common/atomic_file.hpp"
#include "common/json_parse.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/safetensors.hpp"

namespace hpmoe {

namespace {

namespace fs = std::filesystem;
constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kSingleFiles[] = {"weights.safetensors", "inputs.safetensors", "routing.safetensors",
                                        "outputs.safetensors"};

std::string file_in(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

void ensure_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error("cannot create directory '" + dir + "': " + ec.message());
}

// HF stores Linear weights as [out, in]; hpmoe computes x W with W [in, out].
std::vector<float> columns_as_rows(const Matrix& m, std::int64_t col0, std::int64_t cols) {
  std::vector<float> out(static_cast<std::size_t>(cols * m.rows));
  for (std::int64_t j = 0; j < cols; ++j)
    for (std::int64_t i = 0; i < m.rows; ++i) out[j * m.rows + i] = m.at(i, col0 + j);
  return out;
}

void add_mlp(SafetensorsWriter& w, const std::string& prefix, const Matrix& w1, const Matrix& w2) {
  const std::int64_t h = w1.rows, inter = w2.rows;
  w.add(hf_name::projection(prefix, hf_name::gate_proj), {inter, h}, columns_as_rows(w1, 0, inter));
  w.add(hf_name::projection(prefix, hf_name::up_proj), {inter, h}, columns_as_rows(w1, inter, inter));
  w.add(hf_name::projection(prefix, hf_name::down_proj), {h, inter}, columns_as_rows(w2, 0, h));
}

void add_weights(SafetensorsWriter& w, const std::string& prefix, const LayerConfig& c, const Matrix& router,
                 const std::vector<Matrix>& w1, const std::vector<Matrix>& w2, const Matrix& sw1, const Matrix& sw2) {
  w.add(prefix + "mlp." + hf_name::router, {c.routed_experts, c.hidden}, columns_as_rows(router, 0, c.routed_experts));
  for (std::int64_t e = 0; e < c.routed_experts; ++e)
    add_mlp(w, prefix + "mlp." + hf_name::expert(e), w1[e], w2[e]);
  if (c.shared_experts > 0) add_mlp(w, prefix + "mlp." + hf_name::shared, sw1, sw2);
}

SafetensorsWriter weights_file(const LayerConfig& c, const LayerWeights& lw) {
  SafetensorsWriter w;
  add_weights(w, "", c, lw.router, lw.w1, lw.w2, lw.shared_w1, lw.shared_w2);
  w.add("mlp." + hf_name::expert_bias, {c.routed_experts}, lw.expert_bias);
  return w;
}
SafetensorsWriter inputs_file(const LayerInputs& in) {
  SafetensorsWriter w;
  w.add("x", {in.x.rows, in.x.cols}, in.x.data);
  w.add("d_out", {in.d_out.rows, in.d_out.cols}, in.d_out.data);
  return w;
}
SafetensorsWriter routing_file(const RouterOutput<float>& r, std::int64_t tokens, std::int64_t top_k) {
  SafetensorsWriter w;
  w.add("expert_ids", {tokens, top_k}, r.expert);
  w.add("gate_weights", {tokens, top_k}, r.weight);
  w.add("kept", {tokens, top_k}, r.kept);
  return w;
}
SafetensorsWriter outputs_file(const LayerConfig& c, const Matrix& out, const LayerGradients* g) {
  SafetensorsWriter w;
  w.add("out", {out.rows, out.cols}, out.data);
  if (g) {
    w.add("grad.x", {g->x.rows, g->x.cols}, g->x.data);
    add_weights(w, "grad.", c, g->router, g->w1, g->w2, g->shared_w1, g->shared_w2);
  }
  return w;
}

std::string rank_file(const char* kind, std::int64_t rank, std::int64_t ranks) {
  return std::string(kind) + "-rank" + std::to_string(rank) + "-of-" + std::to_string(ranks) + ".safetensors";
}

// The rank count of a sharded save's file name (KIND-rankR-of-P.safetensors), or 0.
std::int64_t ranks_of_rank_file(const std::string& name) {
  static const std::regex pattern("(weights|inputs|routing|outputs)-rank[0-9]+-of-([0-9]{1,9})\\.safetensors");
  std::smatch m;
  return std::regex_match(name, m, pattern) ? std::stoll(m[2].str()) : 0;
}

// Removes the folder's files that `stale` picks (an earlier save's), after
// the new set is in place. A file that cannot be removed is an error: it
// would be read instead of the new one.
void remove_stale(const std::string& dir, const std::function<bool(const std::string&)>& stale) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!stale(name)) continue;
    std::error_code rm;
    fs::remove(it->path(), rm);
    if (rm) throw Error("saved to '" + dir + "', but cannot remove the earlier save's '" + name + "': " + rm.message());
  }
}

// The rank count recorded in a sharded save's index (hpmoe's metadata), or
// 0 where it names none.
std::int64_t saved_ranks(const std::string& dir) {
  const nlohmann::json j = parse_json_file(file_in(dir, kIndex), "the checkpoint index '" + file_in(dir, kIndex) + "'");
  if (!j.is_object() || !j.contains("metadata") || !j["metadata"].is_object() || !j["metadata"].contains("ranks"))
    return 0;
  const auto& r = j["metadata"]["ranks"];
  if (!r.is_number_integer() || r.get<std::int64_t>() < 1 || r.get<std::int64_t>() > (std::int64_t{1} << 20))
    throw Error("the checkpoint index '" + file_in(dir, kIndex) + "': metadata.ranks must be a positive integer");
  return r.get<std::int64_t>();
}

}  // namespace

struct SaveSet::Staged {
  Staged(const std::string& dir, const std::string& name) : file(file_in(dir, name), "'" + name + "' of the save") {}
  AtomicFile file;
};

SaveSet::SaveSet(std::string dir) : dir_(std::move(dir)) { ensure_dir(dir_); }
SaveSet::~SaveSet() = default;  // uncommitted files remove their temporaries
SaveSet::SaveSet(SaveSet&&) noexcept = default;
SaveSet& SaveSet::operator=(SaveSet&&) noexcept = default;

void SaveSet::add(const std::string& name, const SafetensorsWriter& w) {
  auto staged = std::make_unique<Staged>(dir_, name);
  w.write_into([&](std::string_view bytes) { staged->file.write(bytes); });
  staged->file.finish();
  files_.push_back(std::move(staged));
}

void SaveSet::add_text(const std::string& name, std::string_view text) {
  auto staged = std::make_unique<Staged>(dir_, name);
  staged->file.write(text);
  staged->file.finish();
  files_.push_back(std::move(staged));
}

void SaveSet::commit() {
  const DeferTerminationSignals whole;  // a signal between two renames waits for the last
  for (auto& f : files_) f->file.commit();
}

void save_layer(const std::string& dir, const LayerConfig& c, const LayerWeights& w, const LayerInputs& in,
                const RouterOutput<float>& routing, const Matrix& out, const LayerGradients* grads) {
  std::optional<SaveSet> set;
  try {
    set.emplace(dir);
    set->add("weights.safetensors", weights_file(c, w));
    set->add("inputs.safetensors", inputs_file(in));
    set->add("routing.safetensors", routing_file(routing, c.total_tokens(), c.top_k));
    set->add("outputs.safetensors", outputs_file(c, out, grads));
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + ": nothing of this save was put in place, and the checkpoint there before is unchanged");
  }
  // The renames and the removal of the files this set replaces, as one: a
  // signal in between waits for both (the files were written above).
  const DeferTerminationSignals whole;
  set->commit();
  remove_stale(dir, [](const std::string& name) { return name == kIndex || ranks_of_rank_file(name) > 0; });
}

void save_weights(const std::string& dir, const LayerConfig& c, const LayerWeights& lw) {
  ensure_dir(dir);
  weights_file(c, lw).write(file_in(dir, "weights.safetensors"));
  std::error_code ec;  // a sharded save's index here would shadow this file: removed once it is written
  fs::remove(fs::path(dir) / kIndex, ec);
}

void save_inputs(const std::string& dir, const LayerInputs& in) {
  ensure_dir(dir);
  inputs_file(in).write(file_in(dir, "inputs.safetensors"));
}

void save_routing(const std::string& dir, const LayerConfig& c, const RouterOutput<float>& r) {
  ensure_dir(dir);
  routing_file(r, c.total_tokens(), c.top_k).write(file_in(dir, "routing.safetensors"));
}

void save_outputs(const std::string& dir, const LayerConfig& c, const Matrix& out, const LayerGradients* g) {
  ensure_dir(dir);
  outputs_file(c, out, g).write(file_in(dir, "outputs.safetensors"));
}

SaveSet stage_rank(const std::string& dir, const RankTensors& t) {
  const LayerConfig& c = t.config;
  const std::int64_t r = t.rank, P = c.ranks;
  SaveSet set(dir);
  const auto& owned = t.experts;
  // Weights: the rank's experts, and on rank 0 the replicated parameters.
  {
    SafetensorsWriter w;
    for (const auto e : owned) {
      LayerWeights one;
      t.expert(e, one);
      add_mlp(w, "mlp." + hf_name::expert(e), one.w1[static_cast<std::size_t>(e)], one.w2[static_cast<std::size_t>(e)]);
    }
    if (r == 0) {
      w.add("mlp." + hf_name::router, {c.routed_experts, c.hidden}, columns_as_rows(t.weights->router, 0, c.routed_experts));
      w.add("mlp." + hf_name::expert_bias, {c.routed_experts}, t.weights->expert_bias);
      if (c.shared_experts > 0) add_mlp(w, "mlp." + hf_name::shared, t.weights->shared_w1, t.weights->shared_w2);
    }
    set.add(rank_file("weights", r, P), w);
  }
  set.add(rank_file("inputs", r, P), inputs_file(*t.inputs));
  if (t.routing) set.add(rank_file("routing", r, P), routing_file(*t.routing, c.tokens_per_rank, c.top_k));
  if (t.out) {
    SafetensorsWriter w;
    w.add("out", {t.out->rows, t.out->cols}, t.out->data);
    if (const LayerGradients* g = t.grads) {
      w.add("grad.x", {g->x.rows, g->x.cols}, g->x.data);
      for (const auto e : owned)
        add_mlp(w, "grad.mlp." + hf_name::expert(e), g->w1[static_cast<std::size_t>(e)], g->w2[static_cast<std::size_t>(e)]);
      if (r == 0) {
        w.add("grad.mlp." + hf_name::router, {c.routed_experts, c.hidden}, columns_as_rows(g->router, 0, c.routed_experts));
        if (c.shared_experts > 0) add_mlp(w, "grad.mlp." + hf_name::shared, g->shared_w1, g->shared_w2);
      }
    }
    set.add(rank_file("outputs", r, P), w);
  }
  return set;
}

void finish_sharded_save(const std::string& dir, const LayerConfig& c, const ExpertPlacement& placement) {
  const std::int64_t P = c.ranks;
  for (std::int64_t r = 0; r < P; ++r)
    for (const char* kind : {"weights", "inputs"})
      if (!fs::exists(file_in(dir, rank_file(kind, r, P))))
        throw Error("rank 0 does not see '" + rank_file(kind, r, P) + "' in '" + dir + "', which rank " + std::to_string(r) +
                    " saved: ranks on several hosts need a --save folder they all share (a network file system); "
                    "no index was written");
  nlohmann::json map = nlohmann::json::object();
  auto mlp_names = [&](const std::string& prefix, const std::string& file) {
    for (const auto* part : {&hf_name::gate_proj, &hf_name::up_proj, &hf_name::down_proj})
      map[hf_name::projection(prefix, *part)] = file;
  };
  for (std::int64_t e = 0; e < c.routed_experts; ++e)
    mlp_names("mlp." + hf_name::expert(e), rank_file("weights", placement.owner(e), P));
  map["mlp." + hf_name::router] = map["mlp." + hf_name::expert_bias] = rank_file("weights", 0, P);
  if (c.shared_experts > 0) mlp_names("mlp." + hf_name::shared, rank_file("weights", 0, P));
  write_file_atomically(file_in(dir, kIndex),
                        nlohmann::json{{"metadata", {{"producer", "hpmoe"}, {"ranks", P}}}, {"weight_map", map}}.dump(1) + "\n",
                        "the checkpoint index");
  // An in-process save's files here would be read instead of (or beside)
  // this set, and another rank count's files are not this save's.
  remove_stale(dir, [P](const std::string& name) {
    const std::int64_t of = ranks_of_rank_file(name);
    return (of > 0 && of != P) || std::find(std::begin(kSingleFiles), std::end(kSingleFiles), name) != std::end(kSingleFiles);
  });
}

void save_rank(const std::string& dir, const RankTensors& t) {
  SaveSet set = stage_rank(dir, t);
  set.commit();
  if (t.rank == 0) finish_sharded_save(dir, t.config, *t.placement);
}

namespace {

// Rows [first, first + count) of tensor `name` ([total tokens, H]) of a
// save: its inputs.safetensors, or across a sharded save's per-rank files.
// Empty when the tensor is absent (only d_out may be).
std::vector<float> input_rows(const std::string& dir, const LayerConfig& c, const std::string& name, std::int64_t first,
                              std::int64_t count, bool need) {
  const std::int64_t total = c.total_tokens(), H = c.hidden;
  // hpmoe's sharded save names its rank count in the index; a model's own
  // index (no such metadata) beside an inputs.safetensors is a single save.
  const std::int64_t saved = fs::exists(file_in(dir, kIndex)) ? saved_ranks(dir) : 0;
  if (saved == 0 && fs::exists(file_in(dir, "inputs.safetensors"))) {
    SafetensorsFile f(file_in(dir, "inputs.safetensors"));
    if (!f.has(name)) {
      if (need) throw Error("'" + file_in(dir, "inputs.safetensors") + "' has no tensor '" + name + "', which --backward needs");
      return {};
    }
    return f.rows(name, {total, H}, first, count);
  }
  const std::int64_t P = saved > 0 ? saved : c.ranks;  // no hpmoe index: the layer's own count
  if (!fs::exists(file_in(dir, rank_file("inputs", 0, P)))) {
    if (saved == 0)  // no hpmoe index: a model's own checkpoint, or nothing
      throw Error("'" + dir + "' holds no inputs: expected inputs.safetensors, or a sharded save's " +
                  rank_file("inputs", 0, P) + " and " + kIndex + " (a model's checkpoint holds weights only; a run's "
                  "inputs come from a folder written by --save)");
    throw Error("'" + dir + "' is a sharded save of " + std::to_string(P) + " ranks but has no " +
                rank_file("inputs", 0, P) + " (the save is incomplete)");
  }
  if (total % P != 0)
    throw Error("'" + dir + "' was saved by " + std::to_string(P) + " ranks, which do not split this layer's " +
                std::to_string(total) + " tokens evenly: load it with the token count it was saved with");
  const std::int64_t per = total / P;
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(count * H));
  for (std::int64_t q = first / per; q < P && q * per < first + count; ++q) {
    SafetensorsFile f(file_in(dir, rank_file("inputs", q, P)));
    if (!f.has(name)) {
      if (need) throw Error("'" + file_in(dir, rank_file("inputs", q, P)) + "' has no tensor '" + name + "', which --backward needs");
      return {};
    }
    const std::int64_t lo = std::max(first, q * per), hi = std::min(first + count, (q + 1) * per);
    const auto part = f.rows(name, {per, H}, lo - q * per, hi - lo);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

LayerInputs read_inputs(const std::string& dir, const LayerConfig& c, std::int64_t first, std::int64_t count,
                        bool need_d_out) {
  LayerInputs in{Matrix(count, c.hidden), Matrix(count, c.hidden)};
  in.x.data = input_rows(dir, c, "x", first, count, true);
  auto d_out = input_rows(dir, c, "d_out", first, count, need_d_out);
  if (!d_out.empty()) in.d_out.data = std::move(d_out);
  if (c.dtype == DType::bf16) round_to_bf16(in);
  return in;
}

}  // namespace

LayerInputs load_inputs(const std::string& dir, const LayerConfig& c, DOut d_out) {
  return read_inputs(dir, c, 0, c.total_tokens(), d_out == DOut::required);
}

LayerInputs load_inputs(const std::string& dir, const LayerConfig& c, std::int64_t rank, DOut d_out) {
  return read_inputs(dir, c, rank * c.tokens_per_rank, c.tokens_per_rank, d_out == DOut::required);
}

}  // namespace hpmoe
