#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string_view>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/tensors.hpp"

namespace hpmoe {

// Writes a safetensors file (little-endian, JSON header, raw data).
class SafetensorsWriter {
 public:
  void add(const std::string& name, std::vector<std::int64_t> shape, std::span<const float> values);
  void add(const std::string& name, std::vector<std::int64_t> shape, std::span<const std::int32_t> values);
  void add(const std::string& name, std::vector<std::int64_t> shape, std::span<const std::uint8_t> values);
  void write(const std::string& path) const;
  // The file's bytes, in order, handed to `sink` piece by piece.
  void write_into(const std::function<void(std::string_view)>& sink) const;

 private:
  struct Entry {
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::vector<char> bytes;
  };
  std::map<std::string, Entry> entries_;
};

// Reads a safetensors file; every problem (truncated file, bad header,
// missing tensor, wrong shape or dtype) is an Error naming file and tensor.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  // F32, F64 or BF16 data, converted to fp32; the shape must match.
  std::vector<float> floats(const std::string& name, const std::vector<std::int64_t>& shape) const;
  // Rows [row0, row0 + count) of it only (read by seeking to them).
  std::vector<float> rows(const std::string& name, const std::vector<std::int64_t>& shape, std::int64_t row0,
                          std::int64_t count) const;
  std::vector<std::int32_t> ints(const std::string& name, const std::vector<std::int64_t>& shape) const;
  // The header's dtype and shape of a tensor it holds.
  const std::string& dtype(const std::string& name) const { return entry(name).dtype; }
  const std::vector<std::int64_t>& shape(const std::string& name) const { return entry(name).shape; }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, e] : entries_) out.push_back(name);
    return out;
  }

 private:
  struct Entry {
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::size_t begin = 0, end = 0;
  };
  const Entry& entry(const std::string& name) const;
  const Entry& entry(const std::string& name, const std::vector<std::int64_t>& shape) const;
  std::vector<char> read(const Entry&, const std::string& name, std::size_t skip, std::size_t count) const;
  std::string path_;
  std::uint64_t data_start_ = 0, data_size_ = 0;  // only the header is read up front
  std::map<std::string, Entry> entries_;
};

// The weights of a checkpoint: hpmoe's weights.safetensors, a single
// model.safetensors, or Hugging Face's sharded form
// (model.safetensors.index.json naming the file of every tensor), at
// `location` = DIR or DIR:PREFIX (one layer of a whole model's checkpoint;
// without a prefix, the one layer with an "mlp.gate.weight"). Files are
// opened (headers only) when a tensor in them is first asked for, and a
// tensor is read by seeking to it.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& location);
  ~Checkpoint();
  Checkpoint(Checkpoint&&) noexcept = default;
  Checkpoint& operator=(Checkpoint&&) noexcept = default;
  // Names are the layer's ("mlp.gate.weight"); the prefix is added here.
  bool has(const std::string& name) const;
  // Error names the tensor and the file.
  std::vector<float> floats(const std::string& name, const std::vector<std::int64_t>& shape) const;

 private:
  std::string find_prefix(const std::string& suffix) const;
  std::string dir_, prefix_;
  std::map<std::string, std::size_t> file_of_;
  std::vector<std::string> paths_;
  mutable std::vector<std::unique_ptr<SafetensorsFile>> files_;
};

// A run's tensors under Hugging Face style names ([out, in] weight layout):
//   weights.safetensors  mlp.gate.weight, mlp.gate.e_score_correction_bias,
//                        mlp.experts.{e}.{gate,up,down}_proj.weight,
//                        mlp.shared_experts.{gate,up,down}_proj.weight
//   inputs.safetensors   x, d_out
//   routing.safetensors  expert_ids, gate_weights, kept
//   outputs.safetensors  out and, after backward, grad.x and grad.<weight name>
// Files written into a folder as one set: each is written and synced beside
// its target as it is added; commit() then renames them all into place. A
// set destroyed uncommitted (a full disk, a file-size limit, an exception,
// a caught signal) removes its temporaries and leaves the folder as it was.
class SaveSet {
 public:
  explicit SaveSet(std::string dir);  // creates the folder
  ~SaveSet();
  SaveSet(SaveSet&&) noexcept;
  SaveSet& operator=(SaveSet&&) noexcept;
  void add(const std::string& name, const SafetensorsWriter&);
  void add_text(const std::string& name, std::string_view text);
  void commit();
  const std::string& dir() const { return dir_; }

 private:
  struct Staged;
  std::string dir_;
  std::vector<std::unique_ptr<Staged>> files_;
};

// The whole run's set (weights, inputs, routing, outputs) as one SaveSet;
// once it is in place, the files of an earlier sharded save there (its
// index and its per-rank files) are removed, so a later --load reads this
// save and nothing older. A failed save leaves the earlier checkpoint whole.
void save_layer(const std::string& dir, const LayerConfig&, const LayerWeights&, const LayerInputs&,
                const RouterOutput<float>& routing, const Matrix& out, const LayerGradients* grads);
// Each file alone (atomically), for callers that write one kind.
void save_weights(const std::string& dir, const LayerConfig&, const LayerWeights&);
void save_inputs(const std::string& dir, const LayerInputs&);
void save_routing(const std::string& dir, const LayerConfig&, const RouterOutput<float>&);
void save_outputs(const std::string& dir, const LayerConfig&, const Matrix& out, const LayerGradients* grads);
// What one rank of a sharded run writes with save_rank: its experts (drawn
// or read one at a time by `expert`), its tokens, routing, output and
// gradients. Files are <kind>-rank<r>-of-<P>.safetensors (weights, inputs,
// routing, outputs); rank 0 adds the replicated tensors and
// model.safetensors.index.json, so load_weights reads the set back (at any
// P, in process too). Every file is written atomically.
struct RankTensors {
  LayerConfig config;
  const ExpertPlacement* placement = nullptr;
  std::int64_t rank = 0;
  std::vector<std::int32_t> experts;                          // the rank's own
  std::function<void(std::int64_t, LayerWeights&)> expert;    // brings expert e into the weights given
  const LayerWeights* weights = nullptr;                      // the replicated parameters
  const LayerInputs* inputs = nullptr;                        // the rank's tokens
  const RouterOutput<float>* routing = nullptr;               // optional: the rank's routing
  const Matrix* out = nullptr;                                // optional: its output
  const LayerGradients* grads = nullptr;                      // optional: its gradients
};
void save_rank(const std::string& dir, const RankTensors&);
// A sharded save in two phases, for a caller that agrees across ranks in
// between: every rank stages its files (stage_rank; nothing is in place
// yet), and only once all ranks have staged theirs does each commit; then
// rank 0 calls finish_sharded_save, which checks that it sees every rank's
// files (the folder must be shared), writes the index and removes an
// earlier save's files of another kind or rank count.
SaveSet stage_rank(const std::string& dir, const RankTensors&);
void finish_sharded_save(const std::string& dir, const LayerConfig&, const ExpertPlacement&);

// `dir` may be DIR:PREFIX to pick one layer of a whole model's checkpoint.
LayerWeights load_weights(const std::string& dir, const LayerConfig&);
// The replicated parameters and only `experts` (each read by seeking to it).
LayerWeights load_weights(const std::string& dir, const LayerConfig&, std::span<const std::int32_t> experts);
// Expert e alone into w (sized for E experts), read by seeking to it.
void load_expert(const Checkpoint&, const LayerConfig&, std::int64_t e, LayerWeights& w);
// The "weight_map" of a model.safetensors.index.json (tensor name -> file
// in the same directory); Error naming `source` and the field otherwise.
std::map<std::string, std::string> parse_weight_map(const std::string& text, const std::string& source);
// The tokens of a save: inputs.safetensors, or a sharded save's per-rank
// files (at the rank count its index names, which may differ from the
// layer's: rows are read across files). A missing d_out reads as zeros,
// or is an error naming the file where a backward pass needs it.
enum class DOut { optional, required };
LayerInputs load_inputs(const std::string& dir, const LayerConfig&, DOut = DOut::optional);
// Rank `rank`'s tokens only: [T, H].
LayerInputs load_inputs(const std::string& dir, const LayerConfig&, std::int64_t rank, DOut = DOut::optional);

}  // namespace hpmoe
