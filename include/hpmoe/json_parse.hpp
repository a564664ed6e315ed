#pragma once
// Reading hpmoe's JSON inputs (configs, traces, placements, machine models,
// program dumps, safetensors headers, checkpoint indexes) with one set of
// rules: malformed JSON, numbers out of range (1e400) and unreadable files
// are one Error naming the input; nesting deeper than kMaxJsonDepth is
// refused while parsing (no hpmoe file nests past a handful of levels, and a
// 100,000-deep value would overflow the stack of anything that walks it).
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>

namespace hpmoe {

inline constexpr int kMaxJsonDepth = 64;

// `what` names the input in errors ("config file 'x.json'").
nlohmann::json parse_json(std::istream& in, const std::string& what, bool ignore_comments = false);
nlohmann::json parse_json(const std::string& text, const std::string& what, bool ignore_comments = false);

}  // namespace hpmoe
