#pragma once
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>

namespace hpmoe {

// Every user-facing failure (bad config, bad flag, bad file, impossible layer)
// is an Error whose message says what was wrong and what to do. The CLI turns
// it into one line on stderr and exit code 2.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// `message` as one printable line for a terminal or log: control bytes (a
// newline inside a flag's value) written as \n or \xNN, and at most
// `limit` bytes, so an error is always exactly one line.
inline std::string one_line(std::string_view message, std::size_t limit = 2000) {
  std::string out;
  for (const char ch : message) {
    if (out.size() >= limit) {
      out += "...";
      break;
    }
    const auto byte = static_cast<unsigned char>(ch);
    if (ch == '\n') {
      out += "\\n";
    } else if (byte < 0x20 || byte == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", byte);
      out += hex;
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace hpmoe
