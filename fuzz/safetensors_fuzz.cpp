// libFuzzer target: the safetensors reader (--load). Any file either opens
// with every tensor readable at its declared dtype and shape, or is rejected
// with an hpmoe::Error naming it; nothing else may happen (no crash, no read
// past the file, no allocation from an unchecked size).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "hpmoe/error.hpp"
#include "hpmoe/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // The reader takes a path (it seeks to the tensors it is asked for).
  static const std::string path = "/tmp/hpmoe-fuzz-safetensors-" + std::to_string(::getpid());
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    const hpmoe::SafetensorsFile f(path);
    for (const auto& name : f.names()) {
      const auto& shape = f.shape(name);
      std::int64_t n = 1;
      for (const auto d : shape) n *= d;
      const std::string& dtype = f.dtype(name);
      try {
        if (dtype == "F32" || dtype == "F64" || dtype == "BF16") {
          if (static_cast<std::int64_t>(f.floats(name, shape).size()) != n) std::abort();
          if (!shape.empty() && shape[0] > 0) (void)f.rows(name, shape, shape[0] - 1, 1);
        } else if (dtype == "I32" || dtype == "I64") {
          if (static_cast<std::int64_t>(f.ints(name, shape).size()) != n) std::abort();
        }
      } catch (const hpmoe::Error&) {  // a tensor that cannot be read as asked: the next one
      }
    }
  } catch (const hpmoe::Error&) {
  }
  return 0;
}
