#pragma once
// Internal: how a worker waits for an event counter and how it signals one.
// One counter per cache line; waits spin briefly (pause), then yield so that
// an oversubscribed machine still makes progress. Shared by the runtime and
// its microbenchmarks, so that they measure the same code.
#include <atomic>
#include <cstdint>
#include <thread>

#include "hpmoe/transport.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hpmoe::detail {

using hpmoe::EventCounter;

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Release: everything written before (the rows of a put) is visible to the
// waiter that sees the new count.
inline void signal(EventCounter& c) { c.value.fetch_add(1, std::memory_order_release); }

// Returns once the counter reaches target (acquire). on_block() is called
// once, when spinning has not reached it and yielding begins; on_slow()
// every 256 yields after (watchdog, abort checks); either may throw.
template <class OnBlock, class OnSlow>
void wait_until(const EventCounter& c, std::int64_t target, OnBlock&& on_block, OnSlow&& on_slow) {
  for (std::uint64_t spins = 0;; ++spins) {
    if (c.value.load(std::memory_order_acquire) >= target) return;
    if (spins < 256) {
      cpu_relax();
      continue;
    }
    if (spins == 256) on_block();
    std::this_thread::yield();
    if ((spins & 255) == 0) on_slow();
  }
}

template <class OnSlow>
void wait_until(const EventCounter& c, std::int64_t target, OnSlow&& on_slow) {
  wait_until(c, target, [] {}, on_slow);
}

}  // namespace hpmoe::detail
