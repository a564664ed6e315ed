#include <vector>

#include "hpmoe/error.hpp"
#include "hpmoe/transport.hpp"

namespace hpmoe {
namespace {

// Every rank in this process: segments and counters are plain memory that
// all workers address directly, so put_signal is never needed.
class InProcess final : public Transport {
 public:
  explicit InProcess(int ranks) : segments_(static_cast<std::size_t>(ranks)), counters_(static_cast<std::size_t>(ranks)),
                                  capacity_(static_cast<std::size_t>(ranks), 0) {}

  std::string describe() const override { return "in-process"; }
  int ranks() const override { return static_cast<int>(segments_.size()); }
  bool hosts(int rank) const override { return rank >= 0 && rank < ranks(); }

  void reserve_segments(std::span<const std::int64_t> bytes) override {
    check(bytes.size());
    for (std::size_t r = 0; r < bytes.size(); ++r) {
      const auto lines = static_cast<std::size_t>((bytes[r] + 63) / 64);
      // Grow with headroom; after a spike, give the memory back once the
      // need falls below a quarter of what is held.
      if (segments_[r].size() < lines || segments_[r].size() > 4 * (lines + lines / 2) + kKeepLines)
        segments_[r] = std::vector<Line>(lines + lines / 2);
    }
  }
  void reserve_events(std::span<const std::int64_t> events) override {
    check(events.size());
    for (std::size_t r = 0; r < events.size(); ++r) {
      const auto n = static_cast<std::size_t>(events[r]);
      if (capacity_[r] < n) {  // quiescent between launches: a fresh array is safe
        capacity_[r] = n * 2;
        counters_[r] = std::make_unique<EventCounter[]>(capacity_[r]);
      }
    }
  }
  std::byte* segment(int rank) override { return reinterpret_cast<std::byte*>(segments_.at(static_cast<std::size_t>(rank)).data()); }
  EventCounter* counters(int rank) override { return counters_.at(static_cast<std::size_t>(rank)).get(); }
  void put_signal(int to, std::int64_t, std::span<const std::byte>, std::int32_t) override {
    throw Error("in-process transport: rank " + std::to_string(to) + " is addressable; put_signal is not used");
  }

 private:
  void check(std::size_t n) const {
    if (n != segments_.size()) throw Error("transport: sizes given for " + std::to_string(n) + " ranks, expected " + std::to_string(segments_.size()));
  }
  struct alignas(64) Line {
    std::byte bytes[64];
  };
  static constexpr std::size_t kKeepLines = 1 << 14;  // 1 MiB is never worth giving back
  std::vector<std::vector<Line>> segments_;
  std::vector<std::unique_ptr<EventCounter[]>> counters_;
  std::vector<std::size_t> capacity_;
};

}  // namespace

// A process that hosts every rank already holds every block and every part.
void Transport::allgather(std::span<std::byte>, std::size_t) {
  if (ranks() > 1) throw Error(describe() + " transport: allgather is for transports with one rank per process");
}
void Transport::sum_in_rank_order(std::span<float>) {
  if (ranks() > 1) throw Error(describe() + " transport: sum_in_rank_order is for transports with one rank per process");
}
void Transport::sum_in_rank_order(std::span<double>) {
  if (ranks() > 1) throw Error(describe() + " transport: sum_in_rank_order is for transports with one rank per process");
}

std::shared_ptr<Transport> make_inprocess_transport(int ranks) {
  if (ranks < 1) throw Error("a transport needs at least one rank");
  return std::make_shared<InProcess>(ranks);
}

MpiPath parse_mpi_path(const std::string& s) {
  if (s == "auto") return MpiPath::automatic;
  if (s == "shared") return MpiPath::shared;
  if (s == "network") return MpiPath::network;
  if (s == "hybrid") return MpiPath::hybrid;
  throw Error("unknown MPI path '" + s + "' (use auto, shared, network or hybrid)");
}

}  // namespace hpmoe
