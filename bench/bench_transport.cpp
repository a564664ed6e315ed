// The MPI transport's costs, measured on the transport and runtime code
// itself (run under mpirun with 2 processes, one per core):
//   - signal-to-wake: a ping-pong of event signals between the two ranks'
//     workers (one way = half a round trip): a store to the peer's counter
//     in the shared-memory window, or a put+signal message through both
//     progress threads on the network path;
//   - put bandwidth: 64-row puts (hidden 2048, fp32: 512 KiB) with signal,
//     the rows produced (copied from a source) for each put as the runtime
//     does: on the network path both ways side by side, written straight
//     into the message (send_put, what the runtime does) and, as before,
//     into a staging buffer that put_signal copies into the message;
//   - per-task cost of a launch whose tiles do almost nothing.
//
//   mpirun -np 2 build/bench/bench_transport --mpi-path shared
//   mpirun -np 2 --mca btl self,tcp build/bench/bench_transport --mpi-path network
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <memory>
#include <vector>

#include "hpmoe/error.hpp"
#include "common/stats.hpp"
#include "hpmoe/layer.hpp"
#include "runtime/layer_inspect.hpp"
#include "hpmoe/transport.hpp"
#include "comm/event_wait.hpp"

using namespace hpmoe;
using Clock = std::chrono::steady_clock;

namespace {

// Rank `me` produces `rows` (a copy from the source) and sends them to the
// other rank: into its memory when addressable, else through the transport,
// written in place (send_put) or staged and copied (put_signal).
enum class Protocol { in_place, staged };
void send(Transport& tr, int me, std::int32_t event, std::span<const std::byte> rows, Protocol protocol,
          std::vector<std::byte>& staging) {
  const int peer = 1 - me;
  if (std::byte* seg = tr.segment(peer)) {
    if (!rows.empty()) std::memcpy(seg, rows.data(), rows.size());
    detail::signal(tr.counters(peer)[event]);
  } else if (protocol == Protocol::in_place) {
    std::vector<std::byte> message(tr.put_header_bytes() + rows.size());
    if (!rows.empty()) std::memcpy(message.data() + tr.put_header_bytes(), rows.data(), rows.size());
    tr.send_put(peer, 0, std::move(message), event);
  } else {
    staging.resize(rows.size());
    if (!rows.empty()) std::memcpy(staging.data(), rows.data(), rows.size());
    tr.put_signal(peer, 0, staging, event);
  }
}

// One-way time of `rounds` ping-pongs carrying `bytes` each way.
double ping_pong(Transport& tr, int me, std::int64_t& armed, int rounds, std::size_t bytes,
                 Protocol protocol = Protocol::in_place) {
  std::vector<std::byte> rows(bytes, std::byte{1}), staging;
  EventCounter& mine = tr.counters(me)[0];
  tr.launch_begin();
  const auto start = Clock::now();
  for (int i = 1; i <= rounds; ++i) {
    if (me == 0) {
      send(tr, me, 0, rows, protocol, staging);
      detail::wait_until(mine, armed + i, [] {});
    } else {
      detail::wait_until(mine, armed + i, [] {});
      send(tr, me, 0, rows, protocol, staging);
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  armed += rounds;
  tr.launch_end();
  return seconds / rounds / 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = "auto";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--mpi-path") path = argv[i + 1];
  MpiSession mpi(&argc, &argv);
  std::shared_ptr<Transport> tr;  // outlives the try: an error is printed before its last collective
  try {
    if (mpi.size() != 2) throw Error("run with mpirun -np 2");
    tr = make_mpi_transport(mpi, 2, MpiOptions{.path = parse_mpi_path(path)});
    const int me = mpi.rank();
    const std::int64_t seg = 1 << 20;
    tr->reserve_segments(std::vector<std::int64_t>{seg, seg});
    tr->reserve_events(std::vector<std::int64_t>{1, 1});
    std::int64_t armed = 0;
    ping_pong(*tr, me, armed, 200, 0);  // warm-up
    std::vector<double> wake, put, staged;
    for (int rep = 0; rep < 7; ++rep) wake.push_back(ping_pong(*tr, me, armed, 2000, 0));
    const std::size_t bytes = 64 * 2048 * 4;
    for (int rep = 0; rep < 7; ++rep) {  // alternating, side by side
      put.push_back(ping_pong(*tr, me, armed, 100, bytes, Protocol::in_place));
      staged.push_back(ping_pong(*tr, me, armed, 100, bytes, Protocol::staged));
    }

    const LayerConfig c = empty_tiles_layer(2, 2048);
    // Sharded: this process holds its rank's experts and tokens only.
    const auto placement = ExpertPlacement::contiguous(c.routed_experts, c.ranks);
    const auto own = placement.experts_of(me);
    const auto w = random_weights(c, 1, std::vector<std::int32_t>(own.begin(), own.end()));
    const auto in = random_inputs(c, 1, std::vector<int>{me});
    Layer layer(c, w, Parallel{.transport = tr, .backward = false});
    std::vector<double> launch;
    double tasks = 0;
    for (int i = 0; i < 21; ++i) {
      const Layer::Step done = layer.forward(in.x);
      if (i > 0) launch.push_back(done.result().dispatch_to_combine_seconds);
      tasks = double(StepInspector::programs(done)[static_cast<std::size_t>(me)].tasks.size());
    }
    if (me == 0) {
      std::printf("transport: %s\n", tr->describe().c_str());
      std::printf("signal-to-wake one way: %.2f us (median of 7 x 2000 round trips)\n", median(wake) * 1e6);
      std::printf("put 512 KiB + signal one way: %.1f us, %.2f GB/s\n", median(put) * 1e6, double(bytes) / median(put) / 1e9);
      if (!tr->segment(1))
        std::printf("  the same staged and copied by put_signal (before): %.1f us, %.2f GB/s\n", median(staged) * 1e6,
                    double(bytes) / median(staged) / 1e9);
      std::printf("per-task cost (hidden 2, 2048 tokens/rank, %.0f tasks/rank): %.0f ns (launch %.0f us, median of 20)\n",
                  tasks, median(launch) / tasks * 1e9, median(launch) * 1e6);
    }
    tr.reset();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: rank %d: %s\n", mpi.rank(), e.what());
    std::_Exit(2);
  }
}
