// What the MPI transport's puts take from a computing worker's core, on the
// transport itself (Open MPI, hpmoe's progress thread, the kernel's TCP
// stack together): rank 1 puts rows to rank 0 as the runtime's workers do
// (each put's rows copied into the message, then send_put), while on each
// process a meter thread computes GEMM tiles from cache, as a worker does.
// The meter's tiles per second alone, against its tiles during the
// transfer, give the core time the transfer took on each side: the sender's
// copies and send path, the receiver's receive path and its progress
// thread's copies into the segment. Two put sizes separate the cost per put
// from the cost per byte.
//
// bench/cluster_link.py measures the same for a bare TCP stream. With that
// stream's figures the cluster model was 6-33% short on the unshaped link
// (the MPI transport costs the sender 2.4x the bare stream per byte there,
// the receiver 1.3x; docs/results/cluster.md), so bench/cluster_sweep.sh takes the
// model's put costs from here.
//
// Run through scripts/cluster.sh (which prepends `run -P 2 --transport mpi
// --mpi-path network`; they are ignored), or mpirun -np 2:
//   HPMOE=build/bench/bench_put_cost scripts/cluster.sh -- --bytes 268435456 [--put-bytes 524288,32768] [--reps 3] [--window 16 | --burst 16] [--buffers reuse|fresh] [--direction one-way|both] [--peer-timeout 60]
// With --direction both, both ranks put to each other at once (a layer's
// traffic), and each core's time per put covers its sending and receiving.
// Prints one JSON line (from rank 0) per put size, and one with the fit.
#include <hpmoe/error.hpp>
#include "kernels/kernels.hpp"
#include "common/stats.hpp"
#include "runtime/interleaved.hpp"
#include <hpmoe/transport.hpp>

#include "common/finite_number.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using namespace hpmoe;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A worker stand-in: 64 x 64 x 256 fp32 tiles from cache, counted.
class Meter {
 public:
  Meter() : a_(64 * 256, 0.25f), b_(kernels::weight_padded_k<float>(256) * kernels::kTileCols, 0.5f), c_(64 * 64) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Meter() {
    stop_.store(true, std::memory_order_relaxed);
    thread_.join();
  }
  Meter(const Meter&) = delete;
  Meter& operator=(const Meter&) = delete;
  std::int64_t tiles() const { return tiles_.load(std::memory_order_relaxed); }

 private:
  void loop() {
    const auto view = kernels::panel_view<float>(b_.data(), 256);
    while (!stop_.load(std::memory_order_relaxed)) {
      kernels::gemm_tile<float>(a_.data(), 256, view, 0, c_.data(), 64, 64, kernels::kTileCols, 256, false);
      tiles_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  std::vector<float> a_, b_, c_;
  std::atomic<std::int64_t> tiles_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Every rank's double, on every rank (also a barrier).
std::vector<double> gather(Transport& tr, double mine) {
  std::vector<double> all(static_cast<std::size_t>(tr.ranks()));
  std::byte* bytes = reinterpret_cast<std::byte*>(all.data());
  for (int r = 0; r < tr.ranks(); ++r)
    if (tr.hosts(r)) std::memcpy(bytes + r * sizeof(double), &mine, sizeof(double));
  tr.allgather(std::span<std::byte>(bytes, all.size() * sizeof(double)), sizeof(double));
  return all;
}

struct Measured {
  double window_s;   // the transfer, barrier to barrier
  double stolen_s;   // core time the meter lost over it
};

// One transfer of `puts` puts of `put_bytes` from rank 1 to rank 0 (or both ways), the meter
// running on both; its rate measured alone just before.
struct Counts {
  std::int64_t arrived = 0;       // puts rank 0 has received
  std::int64_t acknowledged = 0;  // bursts rank 1 has had acknowledged
};

struct Traffic {
  std::int64_t window = 16;  // a stream's puts queued or in flight at most
  std::int64_t burst = 0;    // > 0: bursts of this many puts instead of a stream
  bool fresh_buffers = false;  // a new message for every put, not the transport's kept ones
  bool both_ways = false;      // both ranks put to each other at once, as a layer's ranks do
};

Measured transfer(Transport& tr, const Meter& meter, int me, std::int64_t put_bytes, std::int64_t puts, const Traffic& shape,
                  Counts& counts) {
  gather(tr, 0);
  std::int64_t c0 = meter.tiles();
  auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double alone = double(meter.tiles() - c0) / seconds_since(t0);  // tiles per second with the core to itself

  gather(tr, 0);
  c0 = meter.tiles();
  t0 = Clock::now();
  tr.launch_begin();
  // The sender issues its puts as fast as it can, at most `window` of them
  // queued or in flight (the outbox's room; a sender that finds none waits,
  // spinning, as a worker does): a steady stream. With `burst`, in bursts
  // instead: `burst` puts at once (the outbox holds them), then the
  // receiver's acknowledgement, awaited asleep. (Per byte, bursts cost the
  // sender 3x the stream on the unshaped link of 2026-12-02: docs/results/cluster.md.)
  // One way, rank 0's counter counts puts arrived and rank 1's the bursts
  // acknowledged; both ways, each rank's counts the peer's puts arrived.
  const EventCounter& counter = tr.counters(me)[0];
  auto wait_for = [&](std::int64_t target) {  // asleep: the meter is the computing worker
    while (counter.value.load(std::memory_order_acquire) < target) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  const std::vector<std::byte> rows(static_cast<std::size_t>(put_bytes), std::byte{1});
  auto send = [&](std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::size_t bytes = tr.put_header_bytes() + rows.size();
      std::vector<std::byte> message = shape.fresh_buffers ? std::vector<std::byte>(bytes) : tr.message_buffer(bytes);
      std::memcpy(message.data() + tr.put_header_bytes(), rows.data(), rows.size());
      tr.send_put(1 - me, 0, std::move(message), 0);
    }
  };
  const std::int64_t step = shape.burst > 0 ? shape.burst : puts;
  for (std::int64_t sent = 0; sent < puts;) {
    const std::int64_t n = std::min(step, puts - sent);
    if (shape.both_ways) {
      send(n);
      wait_for(counts.arrived += n);  // the peer's burst (or whole stream) has landed here
    } else if (me == 1) {
      send(n);
      if (shape.burst > 0) wait_for(++counts.acknowledged);
    } else {
      wait_for(counts.arrived += n);
      if (shape.burst > 0) tr.put_signal(1, 0, {}, 0);
    }
    sent += n;
  }
  tr.launch_end();
  gather(tr, 0);
  const double window = seconds_since(t0);
  const double stolen = std::max(0.0, window - double(meter.tiles() - c0) / alone);
  return {window, stolen};
}

// The whole of `text` as a finite number, or an error that names the flag.
double number(const std::string& flag, const std::string& text) {
  if (const auto v = detail::finite_number(text)) return *v;
  throw Error(flag + " takes a number (got '" + text + "')");
}

// A whole number in [lo, hi], or an error that names the flag and the range.
std::int64_t whole(const std::string& flag, const std::string& text, std::int64_t lo, std::int64_t hi) {
  const double v = number(flag, text);
  if (v != std::floor(v) || v < double(lo) || v > double(hi))
    throw Error(flag + " takes a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) + " (got '" + text + "')");
  return static_cast<std::int64_t>(v);
}

std::vector<std::int64_t> parse_sizes(const std::string& text) {
  std::vector<std::int64_t> sizes;
  for (std::size_t at = 0; at <= text.size();) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    sizes.push_back(whole("--put-bytes (each size)", text.substr(at, comma - at), 1024, std::int64_t{64} << 20));
    at = comma + 1;
  }
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t total = std::int64_t{256} << 20;
  std::string sizes_text = "524288,32768";
  int reps = 3;
  Traffic traffic;
  double peer_timeout = 60.0;  // heartbeats queue behind a long stream of puts (docs/results/cluster.md)
  MpiSession mpi(&argc, &argv);
  std::shared_ptr<Transport> tr;  // outlives the try: an error is printed before its last collective
  try {
    // scripts/cluster.sh runs its program as `PROGRAM run -P N --transport mpi
    // --mpi-path network ARGS...`: that prefix is skipped, anything else unknown is an error.
    int first = 1;
    if (argc > 1 && std::string(argv[1]) == "run") ++first;
    for (int i = first; i < argc; ++i) {
      const std::string a = argv[i];
      if (i + 1 >= argc) throw Error(a + " needs a value (or is not a flag of bench_put_cost)");
      const std::string value = argv[++i];
      if (a == "--bytes") total = whole(a, value, std::int64_t{1} << 20, std::int64_t{1} << 40);
      else if (a == "--put-bytes") sizes_text = value;
      else if (a == "--reps") reps = static_cast<int>(whole(a, value, 1, 100));
      else if (a == "--window") traffic.window = whole(a, value, 1, 4096);
      else if (a == "--burst") traffic.burst = whole(a, value, 0, 4096);  // 0: a stream
      else if (a == "--peer-timeout") peer_timeout = number(a, value);
      else if (a == "--buffers" && (value == "reuse" || value == "fresh")) traffic.fresh_buffers = value == "fresh";
      else if (a == "--buffers") throw Error("--buffers takes reuse or fresh (got '" + value + "')");
      else if (a == "--direction" && (value == "one-way" || value == "both")) traffic.both_ways = value == "both";
      else if (a == "--direction") throw Error("--direction takes one-way or both (got '" + value + "')");
      else if (first == 2 && (a == "-P" || a == "--transport" || a == "--mpi-path")) continue;  // cluster.sh's prefix
      else
        throw Error("unknown flag " + a +
                    " (bench_put_cost takes --bytes, --put-bytes, --reps, --window, --burst, --buffers, --direction, --peer-timeout)");
    }
    if (!(peer_timeout > 0 && peer_timeout < 1e6)) throw Error("--peer-timeout takes a positive number of seconds");
    const auto sizes = parse_sizes(sizes_text);
    if (mpi.size() != 2) throw Error("run with 2 processes (mpirun -np 2, or scripts/cluster.sh)");
    kernels::init();
    const int me = mpi.rank();
    // As in a launch: one worker, inside a task, not waiting (the progress
    // thread naps between messages as it does while a worker computes).
    WorkerActivity activity;
    activity.set_workers(1);
    activity.enter();
    Meter meter;
    // One way: the sender's (rank 1's) and the receiver's (rank 0's) core
    // time per put. Both ways: each core's, sending and receiving at once
    // (the mean of the two ranks), in the sender's fields; the receiver's are 0.
    std::vector<double> per_put_sender, per_put_receiver;
    for (const std::int64_t size : sizes) {
      // A transport per put size: its outbox holds the window (or a burst).
      tr = make_mpi_transport(mpi, 2, MpiOptions{.path = MpiPath::network, .peer_timeout_seconds = peer_timeout,
                                                 .outbox_bytes = (traffic.burst > 0 ? traffic.burst + 1 : traffic.window) * (size + 64)});
      tr->reserve_segments(std::vector<std::int64_t>{size, size});
      tr->reserve_events(std::vector<std::int64_t>{1, 1});
      tr->watch_workers(&activity);
      Counts counts;
      transfer(*tr, meter, me, size, std::min<std::int64_t>(64, total / size), traffic, counts);  // warm: connections, buffers, pages
      const std::int64_t puts = std::max<std::int64_t>(8, total / size);
      std::vector<double> window_s, sender, receiver;
      for (int rep = 0; rep < reps; ++rep) {
        const Measured m = transfer(*tr, meter, me, size, puts, traffic, counts);
        const auto stolen = gather(*tr, m.stolen_s);
        window_s.push_back(m.window_s);
        if (traffic.both_ways) {
          sender.push_back((stolen[0] + stolen[1]) / 2 / double(puts));
          receiver.push_back(0);
        } else {
          sender.push_back(stolen[1] / double(puts));
          receiver.push_back(stolen[0] / double(puts));
        }
      }
      tr->watch_workers(nullptr);
      tr.reset();
      per_put_sender.push_back(median(sender));
      per_put_receiver.push_back(median(receiver));
      const double bytes = double(puts) * double(size);  // each way
      if (me == 0)
        std::printf("{\"rank\": 0, \"put_bytes\": %lld, \"puts\": %lld, \"window\": %lld, \"burst\": %lld, \"buffers\": \"%s\", "
                    "\"direction\": \"%s\", \"goodput_bytes_per_s\": %.6g, "
                    "\"sender_s_per_put\": %.6g, \"receiver_s_per_put\": %.6g, \"sender_bytes_per_stolen_s\": %.6g, "
                    "\"receiver_bytes_per_stolen_s\": %.6g}\n",
                    static_cast<long long>(size), static_cast<long long>(puts), static_cast<long long>(traffic.window),
                    static_cast<long long>(traffic.burst), traffic.fresh_buffers ? "fresh" : "reuse",
                    traffic.both_ways ? "both" : "one-way", bytes / median(window_s), median(sender), median(receiver),
                    double(size) / std::max(1e-12, median(sender)), double(size) / std::max(1e-12, median(receiver)));
    }
    if (me == 0 && sizes.size() >= 2) {
      // Cost per put = fixed + bytes / rate, through the largest and the smallest size.
      const auto lo = static_cast<std::size_t>(std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
      const auto hi = static_cast<std::size_t>(std::max_element(sizes.begin(), sizes.end()) - sizes.begin());
      auto fit = [&](const std::vector<double>& s) {
        const double per_byte = std::max(1e-15, (s[hi] - s[lo]) / double(sizes[hi] - sizes[lo]));
        const double fixed = std::max(0.0, s[lo] - per_byte * double(sizes[lo]));
        return std::pair{fixed, 1.0 / per_byte};
      };
      const auto [sf, sr] = fit(per_put_sender);
      const auto [rf, rr] = fit(per_put_receiver);
      std::printf("{\"rank\": 0, \"fit\": true, \"direction\": \"%s\", \"sender_s_per_put\": %.6g, \"sender_bytes_per_s\": %.6g, "
                  "\"receiver_s_per_put\": %.6g, \"receiver_bytes_per_s\": %.6g}\n",
                  traffic.both_ways ? "both" : "one-way", sf, sr, rf, rr);
    }
    std::fflush(stdout);
    activity.leave();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: rank %d: %s\n", mpi.rank(), e.what());
    std::_Exit(2);
  }
}
