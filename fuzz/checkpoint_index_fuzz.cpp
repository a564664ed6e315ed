// libFuzzer target: the index of a Hugging Face sharded checkpoint
// (model.safetensors.index.json, read by --load). Any input either parses
// into a map of tensor names to plain file names in the checkpoint's
// directory, or is rejected with an hpmoe::Error; nothing else may happen.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "hpmoe/error.hpp"
#include "hpmoe/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    for (const auto& [name, file] : hpmoe::parse_weight_map(text, "fuzz"))
      if (file.empty() || file.find('/') != std::string::npos || file.find("..") != std::string::npos) std::abort();
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
