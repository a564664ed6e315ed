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
// The JSON in the file `path`. A missing or unreadable file, or a directory,
// is one Error: `open_error` when given, else "cannot open WHAT".
nlohmann::json parse_json_file(const std::string& path, const std::string& what, const std::string& open_error = {});

}  // namespace hpmoe
