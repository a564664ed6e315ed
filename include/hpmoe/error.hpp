#pragma once
#include <stdexcept>
#include <string>

namespace hpmoe {

// Every user-facing failure (bad config, bad flag, bad file, impossible layer)
// is an Error whose message says what was wrong and what to do. The CLI turns
// it into one line on stderr and exit code 2.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace hpmoe
