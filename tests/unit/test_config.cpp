#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "source_dir.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"

using namespace hpmoe;

namespace {
std::string data_file(const std::string& rel) { return std::string(HPMOE_SOURCE_DIR) + "/data/" + rel; }

std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("hpmoe_test_" + name);
  std::ofstream(path) << text;
  return path.string();
}

// Expects validate() (or set()) to throw an Error whose message names `field`.
template <class Fn>
void expect_error_naming(Fn&& fn, const std::string& field) {
  try {
    fn();
    FAIL() << "expected an error naming " << field;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(Config, EveryPresetIsValidAndMatchesTheDesignTable) {
  for (const auto& name : preset_names()) EXPECT_NO_THROW(preset(name).validate()) << name;
  const auto v3 = preset("deepseek-v3");
  EXPECT_EQ(v3.hidden, 7168);
  EXPECT_EQ(v3.expert_inter, 2048);
  EXPECT_EQ(v3.routed_experts, 256);
  EXPECT_EQ(v3.shared_experts, 1);
  EXPECT_EQ(v3.top_k, 8);
  EXPECT_EQ(v3.groups, 8);
  EXPECT_EQ(v3.groups_kept, 4);
  EXPECT_EQ(v3.scoring, Scoring::sigmoid);
  EXPECT_DOUBLE_EQ(v3.route_scale, 2.5);
  EXPECT_TRUE(v3.expert_bias);
  const auto lite = preset("deepseek-v2-lite");
  EXPECT_EQ(lite.hidden, 2048);
  EXPECT_EQ(lite.expert_inter, 1408);
  EXPECT_EQ(lite.routed_experts, 64);
  EXPECT_EQ(lite.shared_experts, 2);
  EXPECT_EQ(lite.top_k, 6);
  const auto v2 = preset("deepseek-v2");
  EXPECT_EQ(v2.routed_experts, 160);
  EXPECT_EQ(v2.groups_kept, 3);
  const auto q30 = preset("qwen3-30b-a3b");
  EXPECT_EQ(q30.expert_inter, 768);
  EXPECT_TRUE(q30.normalize_topk);
  EXPECT_EQ(preset("qwen3-235b-a22b").hidden, 4096);
  EXPECT_EQ(preset("mixtral-8x7b").expert_inter, 14336);
  EXPECT_THROW(preset("gpt-5"), Error);
}

TEST(Config, ImportsDeepSeekInferenceConfigs) {
  const LayerConfig base = preset("tiny");
  const auto lite = load_config_file(data_file("model-configs/deepseek-config_16B.json"), base);
  EXPECT_EQ(lite.hidden, 2048);
  EXPECT_EQ(lite.expert_inter, 1408);
  EXPECT_EQ(lite.routed_experts, 64);
  EXPECT_EQ(lite.shared_experts, 2);
  EXPECT_EQ(lite.top_k, 6);
  EXPECT_EQ(lite.groups, 1);
  EXPECT_EQ(lite.scoring, Scoring::softmax);
  EXPECT_EQ(lite.tokens_per_rank, base.tokens_per_rank);
  const auto v2 = load_config_file(data_file("model-configs/deepseek-config_236B.json"), base);
  EXPECT_EQ(v2.groups, 8);
  EXPECT_EQ(v2.groups_kept, 3);
  EXPECT_DOUBLE_EQ(v2.route_scale, 16.0);
  const auto v3 = load_config_file(data_file("model-configs/deepseek-config_671B.json"), base);
  EXPECT_EQ(v3.hidden, 7168);
  EXPECT_EQ(v3.routed_experts, 256);
  EXPECT_EQ(v3.top_k, 8);
  EXPECT_EQ(v3.scoring, Scoring::sigmoid);
  EXPECT_TRUE(v3.normalize_topk);
  EXPECT_TRUE(v3.expert_bias);
  EXPECT_DOUBLE_EQ(v3.route_scale, 2.5);
  EXPECT_EQ(v3.name, "deepseek-config_671B");
}

TEST(Config, ImportsHuggingFaceConfigs) {
  const auto qwen = write_temp("qwen.json", R"({"model_type": "qwen3_moe", "hidden_size": 2048,
      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
      "router_aux_loss_coef": 0.001, "intermediate_size": 6144})");
  const auto q = load_config_file(qwen, preset("tiny"));
  EXPECT_EQ(q.hidden, 2048);
  EXPECT_EQ(q.expert_inter, 768);
  EXPECT_EQ(q.routed_experts, 128);
  EXPECT_EQ(q.top_k, 8);
  EXPECT_TRUE(q.normalize_topk);
  EXPECT_DOUBLE_EQ(q.aux_loss_coef, 0.001);
  const auto mixtral = write_temp("mixtral.json", R"({"model_type": "mixtral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02})");
  const auto m = load_config_file(mixtral, preset("tiny"));
  EXPECT_EQ(m.expert_inter, 14336);
  EXPECT_EQ(m.routed_experts, 8);
  EXPECT_TRUE(m.normalize_topk);
  const auto dsv3 = write_temp("dsv3.json", R"({"hidden_size": 7168, "moe_intermediate_size": 2048,
      "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
      "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc"})");
  const auto d = load_config_file(dsv3, preset("tiny"));
  EXPECT_EQ(d.groups, 8);
  EXPECT_TRUE(d.expert_bias);
  EXPECT_EQ(d.scoring, Scoring::sigmoid);
}

TEST(Config, JsonRoundTrip) {
  LayerConfig c = preset("deepseek-v3");
  c.capacity_factor = 1.25;
  c.drop_policy = DropPolicy::position;
  c.dtype = DType::bf16;
  const LayerConfig back = config_from_json(to_json(c));
  EXPECT_EQ(to_json(back), to_json(c));
}

// The layer apart from how it runs: every field is in exactly one part,
// `hpmoe config`'s sections load back to the same config, old flat files
// and presets load as before, and a field in the other part's section is
// named.
TEST(Config, EveryFieldIsOfTheLayerOrOfHowItRuns) {
  std::vector<std::string> both = layer_fields();
  const auto run = run_fields();
  both.insert(both.end(), run.begin(), run.end());
  std::sort(both.begin(), both.end());
  EXPECT_EQ(std::adjacent_find(both.begin(), both.end()), both.end()) << "a field in both parts";
  auto all = config_fields();
  std::sort(all.begin(), all.end());
  EXPECT_EQ(both, all);
  EXPECT_EQ(run, (std::vector<std::string>{"combine_dtype", "dispatch_dtype", "exchange", "grad_dispatch_dtype", "lend_weights",
                                           "node_forwarding", "ranks", "ranks_per_node", "tokens_per_rank"}));
}

TEST(Config, SectionsRoundTripAndKeepTheBasesRunOptions) {
  for (const auto& name : preset_names()) {
    LayerConfig c = preset(name);
    c.ranks = 4;
    c.exchange = ExchangeMode::rank;
    c.ranks_per_node = 2;
    c.lend_weights = LayerConfig::kLendAuto;
    const auto sections = to_sections_json(c);
    EXPECT_EQ(sections.size(), 2u);
    EXPECT_EQ(to_json(config_from_json(sections)), to_json(c)) << name;
    EXPECT_EQ(to_json(LayerConfig(c.spec(), c.run())), to_json(c)) << name;
  }
  // A file that gives only the layer keeps how the base runs (and its dtype).
  LayerConfig base = preset("tiny");
  base.ranks = 8;
  base.tokens_per_rank = 100;
  base.dtype = DType::bf16;
  base.exchange = ExchangeMode::rank;
  const auto only_layer = to_sections_json(preset("qwen3-30b-a3b"));
  nlohmann::json file{{"layer", only_layer["layer"]}};
  file["layer"].erase("dtype");
  const LayerConfig c = config_from_model_json(file, base, "test");
  EXPECT_EQ(c.hidden, 2048);
  EXPECT_EQ(c.ranks, 8);
  EXPECT_EQ(c.tokens_per_rank, 100);
  EXPECT_EQ(c.dtype, DType::bf16);
  EXPECT_EQ(c.exchange, ExchangeMode::rank);
  // The flat form, as before.
  const LayerConfig flat = config_from_model_json(to_json(preset("qwen3-30b-a3b")), base, "test");
  EXPECT_EQ(to_json(flat), to_json(preset("qwen3-30b-a3b"))) << "a flat file gives every field, run options too";
}

TEST(Config, AFieldInTheOtherSectionIsNamed) {
  const auto refused = [](const nlohmann::json& j) {
    try {
      config_from_model_json(j, preset("tiny"), "cfg.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto j = to_sections_json(preset("tiny"));
  j["layer"]["ranks"] = 4;
  EXPECT_NE(refused(j).find("'ranks' is how the layer runs: put it under \"run\""), std::string::npos) << refused(j);
  j = to_sections_json(preset("tiny"));
  j["run"]["hidden"] = 64;
  EXPECT_NE(refused(j).find("'hidden' is part of the layer: put it under \"layer\""), std::string::npos) << refused(j);
  j = to_sections_json(preset("tiny"));
  j["run"]["bogus"] = 1;
  EXPECT_NE(refused(j).find("unknown config field 'bogus' in \"run\""), std::string::npos) << refused(j);
  j = to_sections_json(preset("tiny"));
  j["extra"] = nlohmann::json::object();
  EXPECT_NE(refused(j).find("'extra' beside \"layer\" and \"run\""), std::string::npos) << refused(j);
  j = to_sections_json(preset("tiny"));
  j["run"] = 3;
  EXPECT_NE(refused(j).find("\"run\" must be an object"), std::string::npos) << refused(j);
  j = to_sections_json(preset("tiny"));
  j["layer"].erase("top_k");
  EXPECT_NE(refused(j).find("missing 'top_k'"), std::string::npos) << refused(j);
}

TEST(Config, SetParsesAndRejects) {
  LayerConfig c = preset("tiny");
  c.set("top_k", "3");
  EXPECT_EQ(c.top_k, 3);
  c.set("normalize_topk", "false");
  EXPECT_FALSE(c.normalize_topk);
  c.set("route_scale", "2.5");
  EXPECT_DOUBLE_EQ(c.route_scale, 2.5);
  expect_error_naming([&] { c.set("hidden", "abc"); }, "hidden");
  expect_error_naming([&] { c.set("hidden", "12x"); }, "hidden");
  expect_error_naming([&] { c.set("route_scale", "nan"); }, "route_scale");
  expect_error_naming([&] { c.set("scoring", "relu"); }, "scoring");
  expect_error_naming([&] { c.set("no_such_field", "1"); }, "no_such_field");
}

struct BadLayer {
  const char* field;
  const char* value;
  const char* named;
};

class ImpossibleLayers : public ::testing::TestWithParam<BadLayer> {};

TEST_P(ImpossibleLayers, AreRejectedNamingTheField) {
  LayerConfig c = preset("tiny");
  c.set(GetParam().field, GetParam().value);
  expect_error_naming([&] { c.validate(); }, GetParam().named);
}

INSTANTIATE_TEST_SUITE_P(
    Table, ImpossibleLayers,
    ::testing::Values(BadLayer{"hidden", "0", "hidden"}, BadLayer{"expert_inter", "-4", "expert_inter"},
                      BadLayer{"routed_experts", "0", "routed_experts"}, BadLayer{"top_k", "9", "top_k"},
                      BadLayer{"top_k", "0", "top_k"}, BadLayer{"ranks", "0", "ranks"}, BadLayer{"tokens_per_rank", "0", "tokens_per_rank"},
                      BadLayer{"groups", "3", "groups"}, BadLayer{"groups_kept", "2", "groups_kept"},
                      BadLayer{"route_scale", "0", "route_scale"}, BadLayer{"capacity_factor", "-1", "capacity_factor"},
                      BadLayer{"aux_loss_coef", "-0.1", "aux_loss_coef"}, BadLayer{"z_loss_coef", "-1", "z_loss_coef"},
                      BadLayer{"shared_experts", "-1", "shared_experts"}, BadLayer{"hidden", "99999999", "hidden"}));

TEST(Config, GroupsMustLeaveRoomForTopK) {
  LayerConfig c = preset("tiny");  // 8 experts
  c.groups = 4;
  c.groups_kept = 1;  // 2 experts reachable, top_k 2: fine
  EXPECT_NO_THROW(c.validate());
  c.top_k = 3;
  expect_error_naming([&] { c.validate(); }, "top_k");
}

TEST(Config, Bf16NeedsEvenSizes) {
  LayerConfig c = preset("tiny");
  c.dtype = DType::bf16;
  c.hidden = 33;
  expect_error_naming([&] { c.validate(); }, "hidden");
}

TEST(Config, CapacityFollowsMegatronFormula) {
  LayerConfig c = preset("tiny");  // T 24, K 2, E 8
  EXPECT_EQ(c.expert_capacity(), -1);
  c.capacity_factor = 1.0;
  EXPECT_EQ(c.expert_capacity(), 6);
  c.capacity_factor = 1.1;
  EXPECT_EQ(c.expert_capacity(), 7);  // ceil(6.6)
}

TEST(Config, MalformedFilesAreClearErrors) {
  EXPECT_THROW(load_config_file("/nonexistent/config.json", preset("tiny")), Error);
  EXPECT_THROW(load_config_file(write_temp("bad1.json", "{not json"), preset("tiny")), Error);
  EXPECT_THROW(load_config_file(write_temp("bad2.json", R"({"foo": 1})"), preset("tiny")), Error);
  EXPECT_THROW(load_config_file(write_temp("bad3.json", R"({"hidden_size": "big", "moe_intermediate_size": 1,
      "num_experts": 8, "num_experts_per_tok": 2})"), preset("tiny")), Error);
  EXPECT_THROW(load_config_file(write_temp("bad4.json", R"({"hidden_size": 64, "num_experts": 8,
      "num_experts_per_tok": 2})"), preset("tiny")), Error);  // no intermediate size
  EXPECT_THROW(load_config_file(write_temp("bad5.json", "[1, 2]"), preset("tiny")), Error);
  EXPECT_THROW(load_config_file(write_temp("bad6.json", R"({"hidden": 64, "bogus": 1})"), preset("tiny")), Error);
}
