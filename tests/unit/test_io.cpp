#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <iterator>
#include <filesystem>
#include <fstream>

#include "source_dir.hpp"
#include "common/atomic_file.hpp"
#include "runtime/interleaved.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/safetensors.hpp"
#include <nlohmann/json.hpp>
#include <algorithm>

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
  InterleavedExecutor a(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = false, .pin = false})), b(c, w2, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = false, .pin = false}));
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

// Sharded runs: each process draws only its experts and its rank's tokens,
// and gets exactly the values of the whole layer's draw.
TEST(Sharding, PerTensorSeedsGiveTheSameValuesWhateverIsDrawn) {
  const LayerConfig c = preset("tiny");
  const auto whole = random_weights(c, 9);
  const std::vector<std::int32_t> some{1, 6};
  const auto part = random_weights(c, 9, some);
  EXPECT_EQ(part.router.data, whole.router.data);
  EXPECT_EQ(part.shared_w2.data, whole.shared_w2.data);
  EXPECT_EQ(part.w1[6].data, whole.w1[6].data);
  EXPECT_EQ(part.w2[1].data, whole.w2[1].data);
  EXPECT_FALSE(holds_expert(part, 0));
  EXPECT_TRUE(holds_expert(part, 1));
  EXPECT_NO_THROW(check_weight_shapes(c, part));  // experts held elsewhere fit
  EXPECT_THROW(require_experts(part, std::vector<std::int32_t>{2}, "rank 1"), Error);
  const auto inputs = random_inputs(c, 9);
  const std::vector<int> rank{1};
  const auto mine = random_inputs(c, 9, rank);
  ASSERT_EQ(mine.x.rows, c.tokens_per_rank);
  EXPECT_TRUE(std::equal(mine.x.data.begin(), mine.x.data.end(), inputs.x.row(c.tokens_per_rank)));
  EXPECT_TRUE(std::equal(mine.d_out.data.begin(), mine.d_out.data.end(), inputs.d_out.row(c.tokens_per_rank)));
  // The fingerprint follows the replicated weights and the placement.
  const auto placement = ExpertPlacement::contiguous(c.routed_experts, c.ranks);
  EXPECT_EQ(layer_fingerprint(c, placement, part), layer_fingerprint(c, placement, whole));
  EXPECT_NE(layer_fingerprint(c, placement, random_weights(c, 10, some)), layer_fingerprint(c, placement, whole));
  EXPECT_NE(layer_fingerprint(c, ExpertPlacement::round_robin(c.routed_experts, c.ranks), whole),
            layer_fingerprint(c, placement, whole));
}

TEST(Sharding, LoadsOnlyTheRanksExpertsAndRows) {
  const LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 4);
  const auto in = random_inputs(c, 4);
  const auto dir = temp_dir("shard");
  save_weights(dir, c, w);
  save_inputs(dir, in);
  const std::vector<std::int32_t> some{3, 4};
  const auto part = load_weights(dir, c, some);
  EXPECT_EQ(part.w1[3].data, w.w1[3].data);
  EXPECT_EQ(part.w2[4].data, w.w2[4].data);
  EXPECT_FALSE(holds_expert(part, 0));
  EXPECT_EQ(part.router.data, w.router.data);
  const auto rows = load_inputs(dir, c, 1);
  EXPECT_TRUE(std::equal(rows.x.data.begin(), rows.x.data.end(), in.x.row(c.tokens_per_rank)));
}

// Hugging Face's sharded form: an index naming each tensor's file, with a
// whole model's layer prefix; errors name the tensor and the file.
TEST(Sharding, ReadsHuggingFaceShardedCheckpoints) {
  const LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 5);
  const auto src = temp_dir("hf_src");
  save_weights(src, c, w);
  SafetensorsFile whole(src + "/weights.safetensors");
  const auto dir = temp_dir("hf_sharded");
  // Experts < 4 (and the gate) in the first file, the rest in the second,
  // under "model.layers.1." as a whole model names them.
  SafetensorsWriter first, second;
  nlohmann::json map = nlohmann::json::object();
  for (const auto& name : whole.names()) {
    const bool later = name.rfind("mlp.experts.", 0) == 0 && std::stoi(name.substr(12)) >= 4;
    const bool bias = name.find("bias") != std::string::npos;
    const std::vector<std::int64_t> shape =
        bias ? std::vector<std::int64_t>{c.routed_experts}
        : name == "mlp.gate.weight" ? std::vector<std::int64_t>{c.routed_experts, c.hidden}
        : name.find("down_proj") != std::string::npos
            ? std::vector<std::int64_t>{c.hidden, name.find("shared") != std::string::npos ? c.shared_inter_total() : c.expert_inter}
            : std::vector<std::int64_t>{name.find("shared") != std::string::npos ? c.shared_inter_total() : c.expert_inter, c.hidden};
    const auto values = whole.floats(name, shape);
    (later ? second : first).add("model.layers.1." + name, shape, values);
    map["model.layers.1." + name] = later ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  first.write(dir + "/model-00001-of-00002.safetensors");
  second.write(dir + "/model-00002-of-00002.safetensors");
  std::ofstream(dir + "/model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
  const std::vector<std::int32_t> some{2, 6};
  const auto part = load_weights(dir, c, some);
  EXPECT_EQ(part.w1[2].data, w.w1[2].data);
  EXPECT_EQ(part.w2[6].data, w.w2[6].data);
  EXPECT_EQ(part.router.data, w.router.data);
  EXPECT_EQ(load_weights(dir + ":model.layers.1.", c).w1[7].data, w.w1[7].data);
  // A missing expert tensor: the error names the tensor and the file.
  map["model.layers.1.mlp.experts.6.up_proj.weight"] = "model-00001-of-00002.safetensors";
  std::ofstream(dir + "/model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
  try {
    load_weights(dir, c, some);
    FAIL();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("mlp.experts.6.up_proj.weight"), std::string::npos) << what;
    EXPECT_NE(what.find("model-00001-of-00002.safetensors"), std::string::npos) << what;
  }
}


namespace {
std::string read_all(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace

TEST(AtomicFile, CommitReplacesAndLeavesNoTemporary) {
  const auto dir = std::filesystem::temp_directory_path() / ("hpmoe-atomic-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto target = dir / "out.json";
  write_file_atomically(target.string(), "old", "the test file");
  {
    AtomicFile f(target.string(), "the test file");
    f.write("half");
    // Destroyed without commit (an exception on the way): the old file stays.
  }
  EXPECT_EQ(read_all(target), "old");
  write_file_atomically(target.string(), "new", "the test file");
  EXPECT_EQ(read_all(target), "new");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);  // no temporaries
  EXPECT_THROW(write_file_atomically(dir.string(), "x", "the test file"), Error);  // a directory
  EXPECT_THROW(write_file_atomically("/dev/full", "x", "the test file"), Error);  // written through, checked
  std::filesystem::remove_all(dir);
}

// A process killed by SIGTERM in the middle of a write leaves the previous
// file and no temporary (issue 15, item 11).
TEST(AtomicFile, SignalDuringWriteLeavesThePreviousFileAndNoTemporary) {
  const auto dir = std::filesystem::temp_directory_path() / ("hpmoe-atomic-sig-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto target = dir / "weights.safetensors";
  write_file_atomically(target.string(), "previous", "the test file");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    AtomicFile f(target.string(), "the test file");
    f.write(std::string(1 << 20, 'x'));
    ::raise(SIGTERM);
    ::_exit(0);  // not reached
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
  EXPECT_EQ(read_all(target), "previous");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);
  std::filesystem::remove_all(dir);
}

// A SIGTERM between the renames of a set of files (a save's weights, inputs,
// ... or a sweep's CSV, JSON and report) waits until the set is in place:
// never new files beside old ones (issue 58, class 4).
TEST(AtomicFile, SignalBetweenTheRenamesOfASetLeavesTheWholeNewSet) {
  const auto dir = std::filesystem::temp_directory_path() / ("hpmoe-atomic-set-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto a = dir / "a.json", b = dir / "b.json";
  write_file_atomically(a.string(), "old", "the test file");
  write_file_atomically(b.string(), "old", "the test file");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    AtomicFile fa(a.string(), "the test file"), fb(b.string(), "the test file");
    fa.write("new");
    fb.write("new");
    fa.finish();
    fb.finish();
    {
      const DeferTerminationSignals whole;
      fa.commit();
      ::raise(SIGTERM);  // between the two renames: noted, acted on when the set is whole
      fb.commit();
    }
    ::_exit(0);  // not reached: the signal ends the process when `whole` ends
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << "the deferred signal was lost";
  EXPECT_EQ(read_all(a), "new");
  EXPECT_EQ(read_all(b), "new");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 2);  // no temporaries
  std::filesystem::remove_all(dir);
}
