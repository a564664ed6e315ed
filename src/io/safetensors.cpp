#include "hpmoe/safetensors.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "common/atomic_file.hpp"
#include "common/input_file.hpp"
#include "hpmoe/bf16.hpp"
#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"

namespace hpmoe {

namespace {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

template <class V>
std::vector<char> raw_bytes(std::span<const V> values) {
  std::vector<char> bytes(values.size_bytes());
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// Bytes per element of the format's dtypes; 0 for a name it does not define.
std::uint64_t dtype_bytes(const std::string& dtype) {
  static constexpr std::pair<std::string_view, std::uint64_t> kWidths[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  for (const auto& [name, width] : kWidths)
    if (dtype == name) return width;
  return 0;
}

std::int64_t elements(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

}  // namespace

void SafetensorsWriter::add(const std::string& name, std::vector<std::int64_t> shape, std::span<const float> v) {
  if (elements(shape) != static_cast<std::int64_t>(v.size())) throw Error("tensor " + name + ": shape/size mismatch");
  entries_[name] = Entry{"F32", std::move(shape), raw_bytes(v)};
}
void SafetensorsWriter::add(const std::string& name, std::vector<std::int64_t> shape, std::span<const std::int32_t> v) {
  if (elements(shape) != static_cast<std::int64_t>(v.size())) throw Error("tensor " + name + ": shape/size mismatch");
  entries_[name] = Entry{"I32", std::move(shape), raw_bytes(v)};
}
void SafetensorsWriter::add(const std::string& name, std::vector<std::int64_t> shape, std::span<const std::uint8_t> v) {
  if (elements(shape) != static_cast<std::int64_t>(v.size())) throw Error("tensor " + name + ": shape/size mismatch");
  entries_[name] = Entry{"U8", std::move(shape), raw_bytes(v)};
}

void SafetensorsWriter::write_into(const std::function<void(std::string_view)>& sink) const {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}, {"producer", "hpmoe"}};
  std::size_t offset = 0;
  for (const auto& [name, e] : entries_) {
    header[name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string text = header.dump();
  while (text.size() % 8) text += ' ';  // keeps the data aligned
  const std::uint64_t size = text.size();
  sink(std::string_view(reinterpret_cast<const char*>(&size), 8));
  sink(text);
  for (const auto& [name, e] : entries_) sink(std::string_view(e.bytes.data(), e.bytes.size()));
}

void SafetensorsWriter::write(const std::string& path) const {
  // Written beside the target and renamed over it: a reader never sees a
  // half-written file, and a failed write leaves the old one.
  AtomicFile out(path, "the safetensors file");
  write_into([&](std::string_view bytes) { out.write(bytes); });
  out.commit();
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  std::ifstream in = open_input(path, "'" + path + "'", std::ios::in | std::ios::binary | std::ios::ate);
  const auto size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  std::uint64_t header_size = 0;
  if (size < 8 || !in.read(reinterpret_cast<char*>(&header_size), 8))
    throw Error("'" + path + "' is not a safetensors file (too short)");
  if (header_size > size - 8 || header_size > (std::uint64_t{100} << 20))
    throw Error("'" + path + "' is not a safetensors file (header size " + std::to_string(header_size) +
                " does not fit the file)");
  std::string text(header_size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_size));
  const nlohmann::json header = parse_json(text, "the safetensors header of '" + path + "'");
  if (!header.is_object()) throw Error("'" + path + "' has a malformed safetensors header (not an object)");
  // Only the header is read here: a tensor's bytes are read when asked for,
  // seeking to them, so a rank reads its own experts and nothing else.
  data_start_ = 8 + header_size;
  data_size_ = size - 8 - header_size;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      Entry e;
      e.dtype = v.at("dtype").get<std::string>();
      e.shape = v.at("shape").get<std::vector<std::int64_t>>();
      const auto& offsets = v.at("data_offsets");
      if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
          !offsets[1].is_number_unsigned())
        throw Error("data_offsets must be two non-negative integers, not " + offsets.dump());
      e.begin = offsets[0].get<std::uint64_t>();
      e.end = offsets[1].get<std::uint64_t>();
      if (e.begin > e.end || e.end > data_size_) throw Error("data offsets outside the file");
      std::uint64_t elements = 1;
      for (auto d : e.shape) {
        if (d < 0) throw Error("negative dimension");
        if (d > 0 && elements > (std::uint64_t{1} << 62) / static_cast<std::uint64_t>(d))
          throw Error("its shape " + shape_text(e.shape) + " has too many elements");
        elements *= static_cast<std::uint64_t>(d);
      }
      const std::uint64_t width = dtype_bytes(e.dtype);
      if (width == 0) throw Error("unknown dtype '" + e.dtype + "'");
      if (e.end - e.begin != elements * width)
        throw Error("its data_offsets hold " + std::to_string(e.end - e.begin) + " bytes, but " + e.dtype + " " +
                    shape_text(e.shape) + " needs " + std::to_string(elements * width));
      entries_[name] = e;
    } catch (const Error& err) {
      throw Error("'" + path + "' tensor '" + name + "': " + err.what());
    } catch (const nlohmann::json::exception& err) {
      throw Error("'" + path + "' tensor '" + name + "' has a malformed header entry: " + err.what());
    }
  }
  // The tensors tile the data exactly, as the format requires: no overlaps,
  // no gaps, nothing after the last one.
  std::vector<std::pair<std::uint64_t, std::string>> order;
  for (const auto& [name, e] : entries_)
    if (e.end > e.begin) order.emplace_back(e.begin, name);
  std::sort(order.begin(), order.end());
  std::uint64_t covered = 0;
  for (const auto& [begin, name] : order) {
    if (begin != covered)
      throw Error("'" + path + "' tensor '" + name + "' starts at data byte " + std::to_string(begin) + ", not at " +
                  std::to_string(covered) + (begin < covered ? " (it overlaps the tensor before it)" : " (a gap)"));
    covered = entries_.at(name).end;
  }
  if (covered != data_size_)
    throw Error("'" + path + "' has " + std::to_string(data_size_ - covered) +
                " bytes after its last tensor (not a safetensors file, or a damaged one)");
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw Error("'" + path_ + "' has no tensor '" + name + "'");
  return it->second;
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name,
                                                     const std::vector<std::int64_t>& shape) const {
  const Entry& e = entry(name);
  if (e.shape != shape)
    throw Error("'" + path_ + "' tensor '" + name + "' has shape " + shape_text(e.shape) + ", expected " +
                shape_text(shape));
  return e;
}

std::vector<char> SafetensorsFile::read(const Entry& e, const std::string& name, std::size_t skip, std::size_t count) const {
  std::vector<char> bytes(count);
  if (count == 0) return bytes;
  std::ifstream in(path_, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(data_start_ + e.begin + skip));
  if (!in || !in.read(bytes.data(), static_cast<std::streamsize>(count)))
    throw Error("'" + path_ + "' is truncated: tensor '" + name + "' cannot be read");
  return bytes;
}

std::vector<float> SafetensorsFile::floats(const std::string& name, const std::vector<std::int64_t>& shape) const {
  return rows(name, shape, 0, shape.empty() ? 1 : shape[0]);
}

std::vector<float> SafetensorsFile::rows(const std::string& name, const std::vector<std::int64_t>& shape,
                                         std::int64_t row0, std::int64_t count) const {
  const Entry& e = entry(name, shape);
  const std::int64_t all_rows = shape.empty() ? 1 : shape[0];
  if (row0 < 0 || count < 0 || row0 + count > all_rows)
    throw Error("'" + path_ + "' tensor '" + name + "': rows [" + std::to_string(row0) + ", " +
                std::to_string(row0 + count) + ") outside its " + std::to_string(all_rows));
  const auto total = static_cast<std::size_t>(elements(shape));
  const std::size_t per_row = all_rows > 0 ? total / static_cast<std::size_t>(all_rows) : 0;
  const std::size_t n = per_row * static_cast<std::size_t>(count);
  std::vector<float> out(n);
  const std::size_t bytes = e.end - e.begin;
  auto need = [](std::size_t) {};
  auto read_rows = [&](std::size_t width) {
    need(width);
    return read(e, name, per_row * static_cast<std::size_t>(row0) * width, n * width);
  };
  auto need_total = [&](std::size_t width) {
    if (bytes != total * width)
      throw Error("'" + path_ + "' tensor '" + name + "' holds " + std::to_string(bytes) + " bytes, expected " +
                  std::to_string(total * width));
  };
  if (e.dtype == "F32") {
    need_total(4);
    const auto data = read_rows(4);
    if (n) std::memcpy(out.data(), data.data(), n * 4);
  } else if (e.dtype == "F64") {
    need_total(8);
    const auto data = read_rows(8);
    const char* p = data.data();
    for (std::size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, p + i * 8, 8);
      if (std::isfinite(d) && std::fabs(d) > double(std::numeric_limits<float>::max())) {
        const std::size_t at = per_row * static_cast<std::size_t>(row0) + i;
        throw Error("'" + path_ + "' tensor '" + name + "' holds " + std::to_string(d).substr(0, 24) + " at element " +
                    std::to_string(at) + ", a finite F64 value beyond float32's range (3.4e38): hpmoe computes in "
                    "float32 or bf16; scale or fix the tensor");
      }
      out[i] = static_cast<float>(d);
    }
  } else if (e.dtype == "BF16") {
    need_total(2);
    const auto data = read_rows(2);
    const char* p = data.data();
    for (std::size_t i = 0; i < n; ++i) {
      bf16 b;
      std::memcpy(&b.bits, p + i * 2, 2);
      out[i] = b.to_float();
    }
  } else {
    throw Error("'" + path_ + "' tensor '" + name + "' has dtype " + e.dtype + " (expected F32, F64 or BF16)");
  }
  // NaN or Inf in a weight or an input is bad input: the oracle would see
  // the same value and agree with a wrong answer (or route every token to
  // the same experts), so it is refused here, once, at load.
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(out[i])) {
      const std::size_t at = per_row * static_cast<std::size_t>(row0) + i;
      throw Error("'" + path_ + "' tensor '" + name + "' holds " + (std::isnan(out[i]) ? "NaN" : "an infinity") +
                  " at element " + std::to_string(at) +
                  (shape.size() == 2 ? " (row " + std::to_string(at / per_row) + ", column " + std::to_string(at % per_row) + ")"
                                     : std::string()) +
                  ": hpmoe takes finite values only; fix the checkpoint or inputs");
    }
  return out;
}

std::vector<std::int32_t> SafetensorsFile::ints(const std::string& name, const std::vector<std::int64_t>& shape) const {
  const Entry& e = entry(name, shape);
  const auto n = static_cast<std::size_t>(elements(shape));
  std::vector<std::int32_t> out(n);
  const std::size_t bytes = e.end - e.begin;
  if (e.dtype == "I32" && bytes == n * 4) {
    const auto data = read(e, name, 0, bytes);
    if (n) std::memcpy(out.data(), data.data(), n * 4);
  } else if (e.dtype == "I64" && bytes == n * 8) {
    const auto data = read(e, name, 0, bytes);
    for (std::size_t i = 0; i < n; ++i) {
      std::int64_t v;
      std::memcpy(&v, data.data() + i * 8, 8);
      if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
        throw Error("'" + path_ + "' tensor '" + name + "' holds " + std::to_string(v) + " at index " +
                    std::to_string(i) + ", outside the 32-bit range of expert ids and counts");
      out[i] = static_cast<std::int32_t>(v);
    }
  } else {
    throw Error("'" + path_ + "' tensor '" + name + "' must be I32 or I64 of shape " + shape_text(shape));
  }
  return out;
}

Checkpoint::Checkpoint(const std::string& location) {
  namespace fs = std::filesystem;
  // DIR or DIR:PREFIX (the layer's tensor names in a whole model's checkpoint).
  dir_ = location;
  bool named = false;
  if (const auto colon = location.rfind(':'); colon != std::string::npos && !fs::exists(location)) {
    dir_ = location.substr(0, colon);
    prefix_ = location.substr(colon + 1);
    named = true;
  }
  const fs::path index = fs::path(dir_) / "model.safetensors.index.json";
  bool single = false;
  for (const char* name : {"weights.safetensors", "model.safetensors"})
    if (!single && !fs::exists(index) && fs::exists(fs::path(dir_) / name)) {
      paths_.push_back((fs::path(dir_) / name).string());
      files_.push_back(std::make_unique<SafetensorsFile>(paths_.back()));
      for (const auto& tensor : files_.back()->names()) file_of_[tensor] = 0;
      single = true;
    }
  if (!single) {
    if (!fs::exists(index))
      throw Error("'" + dir_ + "' holds no checkpoint: expected weights.safetensors, model.safetensors or "
                  "model.safetensors.index.json (with the files it names)");
    std::ifstream in = open_input(index.string(), "the checkpoint index '" + index.string() + "'");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::map<std::string, std::size_t> opened;
    for (const auto& [tensor, file] : parse_weight_map(text, index.string())) {
      auto [it, fresh] = opened.emplace(file, files_.size());
      if (fresh) paths_.push_back((fs::path(dir_) / file).string()), files_.emplace_back();
      file_of_[tensor] = it->second;
    }
  }
  if (!named && !file_of_.count("mlp." + hf_name::router)) prefix_ = find_prefix("mlp." + hf_name::router);
}

Checkpoint::~Checkpoint() = default;

bool Checkpoint::has(const std::string& name) const { return file_of_.count(prefix_ + name) != 0; }

std::vector<float> Checkpoint::floats(const std::string& name, const std::vector<std::int64_t>& shape) const {
  const std::string full = prefix_ + name;
  const auto it = file_of_.find(full);
  if (it == file_of_.end()) throw Error("the checkpoint in '" + dir_ + "' has no tensor '" + full + "'");
  auto& f = files_[it->second];
  if (!f) f = std::make_unique<SafetensorsFile>(paths_[it->second]);  // headers only, opened when first needed
  if (!f->has(full)) throw Error("'" + paths_[it->second] + "' has no tensor '" + full + "' (the index says it does)");
  return f->floats(full, shape);
}

std::string Checkpoint::find_prefix(const std::string& suffix) const {
  std::vector<std::string> found;
  for (const auto& [name, file] : file_of_)
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        name[name.size() - suffix.size() - 1] == '.')
      found.push_back(name.substr(0, name.size() - suffix.size()));
  if (found.empty()) throw Error("the checkpoint in '" + dir_ + "' has no tensor named '" + suffix + "' (or ending in it)");
  if (found.size() > 1)
    throw Error("the checkpoint in '" + dir_ + "' has " + std::to_string(found.size()) + " MoE layers ('" + found[0] +
                suffix + "', '" + found[1] + suffix + "', ...): name the layer with --load DIR:PREFIX, e.g. --load " +
                dir_ + ":" + found[1]);
  return found[0];
}

void load_expert(const Checkpoint& ck, const LayerConfig& c, std::int64_t e, LayerWeights& w) {
  if (e < 0 || e >= c.routed_experts) throw Error("expert " + std::to_string(e) + " is not in the layer");
  const std::string name = "mlp." + hf_name::expert(e);
  const auto gate = ck.floats(hf_name::projection(name, hf_name::gate_proj), {c.expert_inter, c.hidden});
  const auto up = ck.floats(hf_name::projection(name, hf_name::up_proj), {c.expert_inter, c.hidden});
  const auto down = ck.floats(hf_name::projection(name, hf_name::down_proj), {c.hidden, c.expert_inter});
  expert_from_hf(c, e,
                 HfMlp{MatrixView{gate.data(), c.expert_inter, c.hidden, c.hidden},
                       MatrixView{up.data(), c.expert_inter, c.hidden, c.hidden},
                       MatrixView{down.data(), c.hidden, c.expert_inter, c.expert_inter}},
                 w);
}

LayerWeights load_weights(const std::string& dir, const LayerConfig& c) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(c.routed_experts));
  for (std::size_t e = 0; e < all.size(); ++e) all[e] = static_cast<std::int32_t>(e);
  return load_weights(dir, c, all);
}

LayerWeights load_weights(const std::string& location, const LayerConfig& c, std::span<const std::int32_t> experts) {
  const Checkpoint ck(location);
  // The file's tensors, kept while the views of them are converted.
  std::vector<std::vector<float>> kept;
  auto tensor = [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
    kept.push_back(ck.floats(name, {rows, cols}));
    return MatrixView{kept.back().data(), rows, cols, cols};
  };
  kept.reserve(8);
  HfMoeBlock hf;
  hf.gate = tensor("mlp." + hf_name::router, c.routed_experts, c.hidden);
  hf.experts.resize(static_cast<std::size_t>(c.routed_experts));  // empty views: experts read below, one at a time
  if (c.shared_experts > 0) {
    const std::int64_t is = c.shared_inter_total();
    const std::string mlp = "mlp." + hf_name::shared;
    hf.shared = HfMlp{tensor(hf_name::projection(mlp, hf_name::gate_proj), is, c.hidden),
                      tensor(hf_name::projection(mlp, hf_name::up_proj), is, c.hidden),
                      tensor(hf_name::projection(mlp, hf_name::down_proj), c.hidden, is)};
  }
  std::vector<float> bias;
  if (ck.has("mlp." + hf_name::expert_bias)) bias = ck.floats("mlp." + hf_name::expert_bias, {c.routed_experts});
  hf.e_score_correction_bias = bias;
  LayerWeights w = weights_from_hf(c, hf);
  for (const std::int32_t e : experts) load_expert(ck, c, e, w);
  return w;
}

}  // namespace hpmoe
