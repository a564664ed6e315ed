// libFuzzer target: hpmoe's layer config (--config FILE.json in hpmoe's own
// format, flat or in "layer" and "run" sections, and `--set field=value`). Any input either gives a layer that
// validates and survives a JSON round trip unchanged, or is rejected with an
// hpmoe::Error; nothing else may happen (no crash, no other exception).
// Input: a JSON object, optionally followed by "\n=" and "field=value"
// lines applied with LayerConfig::set.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const auto split = input.find("\n=");
  const std::string json_text = input.substr(0, split);
  try {
    hpmoe::LayerConfig c =
        hpmoe::config_from_model_json(hpmoe::parse_json(json_text, "fuzz"), hpmoe::preset("tiny"), "fuzz");
    if (split != std::string::npos) {
      std::istringstream lines(input.substr(split + 2));
      for (std::string line; std::getline(lines, line);) {
        const auto eq = line.find('=');
        if (eq != std::string::npos) c.set(line.substr(0, eq), line.substr(eq + 1));
      }
    }
    c.validate();
    const auto j = hpmoe::to_json(c);
    const hpmoe::LayerConfig back = hpmoe::config_from_json(j);
    back.validate();
    if (hpmoe::to_json(back) != j) std::abort();  // a valid layer round-trips exactly
    // and so do its two parts, as `hpmoe config` prints them
    if (hpmoe::to_json(hpmoe::config_from_json(hpmoe::to_sections_json(c))) != j) std::abort();
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
