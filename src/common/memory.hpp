#pragma once
// Memory a command is about to take, checked against what the machine can
// give before it is taken: on a machine without swap an allocation past the
// memory is not an exception but the kernel's OOM killer ending the process
// with no word. Estimates are sums of the big buffers; commands refuse only
// where the estimate alone exceeds what is available.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

#include "hpmoe/error.hpp"

namespace hpmoe {

// MemAvailable + SwapFree from /proc/meminfo, in bytes; -1 where unknown.
inline std::int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::int64_t kib = 0, total = 0;
  bool found = false;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:" || key == "SwapFree:") {
      total += kib * 1024;
      found = found || key == "MemAvailable:";
    }
  }
  return found ? total : -1;
}

inline std::string gib_text(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", bytes / double(std::int64_t{1} << 30));
  return text;
}

// Throws, naming what does not fit and what to change, where `bytes`
// exceeds the memory available now by more than 10%: the estimates lean
// high (measured peaks 0.6-1.0x of them), and a run that fits with little
// to spare, such as the README's demo on a 24 GiB machine (peak 21.1 GiB,
// estimate 24.2 GiB), must not be refused. `parts` lists the estimate's terms.
inline void require_memory(double bytes, const std::string& what, const std::string& parts, const std::string& advice) {
  const std::int64_t available = available_memory_bytes();
  if (available < 0 || bytes <= 1.1 * double(available)) return;
  throw Error(what + " needs about " + gib_text(bytes) + " (" + parts + ") but this machine has " + gib_text(double(available)) +
              " available: " + advice);
}

}  // namespace hpmoe
