// The index of a Hugging Face sharded checkpoint: its own file so that the
// parser's fuzz target builds it alone.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"
#include "hpmoe/safetensors.hpp"

namespace hpmoe {

std::map<std::string, std::string> parse_weight_map(const std::string& text, const std::string& source) {
  const nlohmann::json j = parse_json(text, "'" + source + "'");
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw Error("'" + source + "' has no \"weight_map\" object (tensor name -> file)");
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw Error("'" + source + "': weight_map[\"" + name + "\"] is not a file name");
    const std::string f = file.get<std::string>();
    if (std::any_of(f.begin(), f.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f; }))
      throw Error("'" + source + "': weight_map[\"" + name + "\"] names a file with a control character (a NUL, a newline)");
    if (f.empty() || f.find('/') != std::string::npos || f.find("..") != std::string::npos)
      throw Error("'" + source + "': weight_map[\"" + name + "\"] names '" + f + "', not a file in the directory");
    map[name] = f;
  }
  return map;
}

}  // namespace hpmoe
