#pragma once
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
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
  std::vector<std::int32_t> ints(const std::string& name, const std::vector<std::int64_t>& shape) const;

 private:
  struct Entry {
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::size_t begin = 0, end = 0;
  };
  const Entry& entry(const std::string& name, const std::vector<std::int64_t>& shape) const;
  std::string path_;
  std::vector<char> data_;
  std::map<std::string, Entry> entries_;
};

// A run's tensors under Hugging Face style names ([out, in] weight layout):
//   weights.safetensors  mlp.gate.weight, mlp.gate.e_score_correction_bias,
//                        mlp.experts.{e}.{gate,up,down}_proj.weight,
//                        mlp.shared_experts.{gate,up,down}_proj.weight
//   inputs.safetensors   x, d_out
//   routing.safetensors  expert_ids, gate_weights, kept
//   outputs.safetensors  out and, after backward, grad.x and grad.<weight name>
void save_weights(const std::string& dir, const LayerConfig&, const LayerWeights&);
void save_inputs(const std::string& dir, const LayerInputs&);
void save_routing(const std::string& dir, const LayerConfig&, const RouterOutput<float>&);
void save_outputs(const std::string& dir, const LayerConfig&, const Matrix& out, const LayerGradients* grads);
LayerWeights load_weights(const std::string& dir, const LayerConfig&);
LayerInputs load_inputs(const std::string& dir, const LayerConfig&);

}  // namespace hpmoe
