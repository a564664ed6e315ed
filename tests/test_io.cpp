#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "hpmoe/baseline.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/safetensors.hpp"

using namespace hpmoe;

namespace {
std::string temp_dir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() / ("hpmoe_io_" + name);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}
void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }
std::string header_file(const std::string& json) {
  std::string s(8, '\0');
  const std::uint64_t n = json.size();
  std::memcpy(s.data(), &n, 8);
  return s + json;
}
}  // namespace

TEST(Safetensors, RoundTripReproducesTheRun) {
  LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 4);
  const auto in = random_inputs(c, 4);
  const auto dir = temp_dir("roundtrip");
  save_weights(dir, c, w);
  save_inputs(dir, in);
  const auto w2 = load_weights(dir, c);
  const auto in2 = load_inputs(dir, c);
  EXPECT_EQ(w2.router.data, w.router.data);
  EXPECT_EQ(w2.w1[5].data, w.w1[5].data);
  EXPECT_EQ(w2.w2[7].data, w.w2[7].data);
  EXPECT_EQ(w2.shared_w1.data, w.shared_w1.data);
  EXPECT_EQ(in2.x.data, in.x.data);
  SerializedExecutor a(c, w, ExecutorOptions{.workers_per_rank = 1, .backward = false, .pin = false}), b(c, w2, ExecutorOptions{.workers_per_rank = 1, .backward = false, .pin = false});
  EXPECT_EQ(a.step(in).out.data, b.step(in2).out.data);
  // Hugging Face layout: gate_proj is [I, H] and holds the first I columns of w1.
  SafetensorsFile f(dir + "/weights.safetensors");
  const auto gate = f.floats("mlp.experts.2.gate_proj.weight", {c.expert_inter, c.hidden});
  EXPECT_EQ(gate[1 * c.hidden + 3], w.w1[2].at(3, 1));
}

TEST(Safetensors, MalformedFilesAreClearErrors) {
  const auto dir = temp_dir("bad");
  const LayerConfig c = preset("tiny");
  EXPECT_THROW(load_weights(dir, c), Error);  // missing file
  write_bytes(dir + "/weights.safetensors", "abc");
  EXPECT_THROW(load_weights(dir, c), Error);  // too short
  write_bytes(dir + "/weights.safetensors", header_file("{not json"));
  EXPECT_THROW(load_weights(dir, c), Error);
  std::string huge(8, '\xff');
  write_bytes(dir + "/weights.safetensors", huge);
  EXPECT_THROW(load_weights(dir, c), Error);  // header size beyond the file
  write_bytes(dir + "/weights.safetensors",
              header_file(R"({"mlp.gate.weight": {"dtype": "F32", "shape": [8, 32], "data_offsets": [0, 1024]}})"));
  EXPECT_THROW(load_weights(dir, c), Error);  // data offsets beyond the file
  // Right file, wrong layer: every shape mismatch names the tensor.
  save_weights(dir, c, random_weights(c, 1));
  LayerConfig bigger = c;
  bigger.hidden = 64;
  try {
    load_weights(dir, bigger);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.gate.weight"), std::string::npos) << e.what();
  }
  LayerConfig more = c;
  more.routed_experts = 16;
  EXPECT_THROW(load_weights(dir, more), Error);
}
