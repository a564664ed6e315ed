// libFuzzer target: importing a Hugging Face config.json or a DeepSeek
// inference config (--config). Any input either gives a layer that
// validates, or is rejected with an hpmoe::Error; nothing else may happen.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto j = hpmoe::parse_json(text, "fuzz");
    hpmoe::LayerConfig c = hpmoe::config_from_model_json(j, hpmoe::preset("mixtral-8x7b"), "fuzz");
    c.validate();
    if (c.hidden <= 0 || c.routed_experts <= 0 || c.top_k <= 0 || c.top_k > c.routed_experts) std::abort();
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
