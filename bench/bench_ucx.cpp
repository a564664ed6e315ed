// UCX evaluated as the engine of the network path (issue 11), on the same
// two measurements as bench_transport's message protocol, between two
// processes (MPI only exchanges the UCX addresses and keys):
//   - signal-to-wake: a ping-pong of 64-bit atomic adds into the peer's
//     counter (ucp_atomic_op_nbx), one way = half a round trip;
//   - put 512 KiB + signal: ucp_put_nbx of the rows into the peer's
//     registered segment, ucp_worker_fence, then the atomic add; the
//     receiver waits for its counter and answers the same way.
// The waiting side polls its counter and drives ucp_worker_progress (over
// TCP, UCX's puts and atomics are carried out by the target's progress
// calls; over shared memory and RDMA they are not).
//
//   UCX_TLS=tcp        mpirun -np 2 -x UCX_TLS build/bench/bench_ucx
//   UCX_TLS=sm,self    mpirun -np 2 -x UCX_TLS build/bench/bench_ucx
// and, side by side, bench_transport --mpi-path network over TCP and over
// Open MPI's shared-memory BTL. It first runs the same ping-pongs on MPI's
// own messages from one thread per process, the engine under hpmoe's network
// path without its progress thread:
//   UCX_TLS=tcp mpirun -np 2 --mca pml ob1 --mca btl self,tcp -x UCX_TLS build/bench/bench_ucx
#include <mpi.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/stats.hpp"

using Clock = std::chrono::steady_clock;

using hpmoe::median;

namespace {

void check(ucs_status_t status, const char* what) {
  if (status != UCS_OK) throw std::runtime_error(std::string(what) + ": " + ucs_status_string(status));
}

// Exchanges a byte blob with the other rank.
std::vector<char> swap_with_peer(const void* data, std::size_t size, int peer) {
  std::uint64_t mine = size, theirs = 0;
  MPI_Sendrecv(&mine, 1, MPI_UINT64_T, peer, 0, &theirs, 1, MPI_UINT64_T, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  std::vector<char> out(theirs);
  MPI_Sendrecv(data, static_cast<int>(size), MPI_BYTE, peer, 1, out.data(), static_cast<int>(theirs), MPI_BYTE, peer, 1,
               MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  return out;
}

class Ucx {
 public:
  Ucx(int me, std::size_t segment_bytes) : me_(me), peer_(1 - me), segment_(segment_bytes + 64) {
    ucp_config_t* config = nullptr;
    check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AMO64;
    check(ucp_init(&params, config, &context_), "ucp_init");
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    check(ucp_worker_create(context_, &wp, &worker_), "ucp_worker_create");
    ucp_address_t* address = nullptr;
    std::size_t address_bytes = 0;
    check(ucp_worker_get_address(worker_, &address, &address_bytes), "ucp_worker_get_address");
    const auto peer_address = swap_with_peer(address, address_bytes, peer_);
    ucp_worker_release_address(worker_, address);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
    check(ucp_ep_create(worker_, &ep, &ep_), "ucp_ep_create");
    // The segment: a counter in its first cache line, then the rows.
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = segment_.data();
    mp.length = segment_.size() * sizeof(Line);
    check(ucp_mem_map(context_, &mp, &memh_), "ucp_mem_map");
    void* packed = nullptr;
    std::size_t packed_bytes = 0;
    check(ucp_rkey_pack(context_, memh_, &packed, &packed_bytes), "ucp_rkey_pack");
    const auto peer_key = swap_with_peer(packed, packed_bytes, peer_);
    ucp_rkey_buffer_release(packed);
    check(ucp_ep_rkey_unpack(ep_, peer_key.data(), &rkey_), "ucp_ep_rkey_unpack");
    const auto base = reinterpret_cast<std::uint64_t>(segment_.data());
    const auto peer_base = swap_with_peer(&base, sizeof base, peer_);
    std::memcpy(&peer_base_, peer_base.data(), sizeof peer_base_);
  }

  ~Ucx() {
    ucp_rkey_destroy(rkey_);
    ucp_request_param_t rp{};
    wait(ucp_ep_close_nbx(ep_, &rp));
    MPI_Barrier(MPI_COMM_WORLD);
    ucp_mem_unmap(context_, memh_);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }

  std::uint64_t counter() const { return std::atomic_ref<std::uint64_t>(counter_word()).load(std::memory_order_acquire); }

  // Rows into the peer's segment, ordered before the signal by a fence.
  void put_signal(const void* rows, std::size_t bytes) {
    ucp_request_param_t rp{};
    if (bytes) wait(ucp_put_nbx(ep_, rows, bytes, peer_base_ + sizeof(Line), rkey_, &rp));
    check(ucp_worker_fence(worker_), "ucp_worker_fence");
    static const std::uint64_t one = 1;
    ucp_request_param_t ap{};
    ap.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
    ap.datatype = ucp_dt_make_contig(sizeof one);
    wait(ucp_atomic_op_nbx(ep_, UCP_ATOMIC_OP_ADD, &one, 1, peer_base_, rkey_, &ap));
  }

  void wait_counter(std::uint64_t target) {
    while (counter() < target) ucp_worker_progress(worker_);
  }

  // The atomic or put is only known to be out when its request completes.
  void wait(ucs_status_ptr_t request) {
    if (request == nullptr) return;
    if (UCS_PTR_IS_ERR(request)) check(UCS_PTR_STATUS(request), "a UCX operation");
    ucs_status_t status;
    while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    ucp_request_free(request);
    check(status, "a UCX operation");
  }

 private:
  struct alignas(64) Line {
    std::byte bytes[64];
  };
  std::uint64_t& counter_word() const { return *reinterpret_cast<std::uint64_t*>(const_cast<Line*>(segment_.data())); }

  int me_, peer_;
  std::vector<Line> segment_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  ucp_rkey_h rkey_ = nullptr;
  std::uint64_t peer_base_ = 0;
};

// One-way time of `rounds` ping-pongs carrying `bytes` each way; the rows are
// produced (copied from a source) for each put, as bench_transport does.
double ping_pong(Ucx& ucx, int me, std::uint64_t& armed, int rounds, std::size_t bytes) {
  std::vector<std::byte> source(bytes, std::byte{1}), rows(bytes);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = Clock::now();
  for (int i = 1; i <= rounds; ++i) {
    if (me == 1) ucx.wait_counter(armed + i);
    if (bytes) std::memcpy(rows.data(), source.data(), bytes);
    ucx.put_signal(rows.data(), bytes);
    if (me == 0) ucx.wait_counter(armed + i);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  armed += rounds;
  MPI_Barrier(MPI_COMM_WORLD);
  return seconds / rounds / 2;
}

// The same two ping-pongs on MPI's two-sided messages from one thread per
// process (the engine under hpmoe's network path, without its progress
// thread): rows and signal as one message.
double mpi_ping_pong(int me, int rounds, std::size_t bytes) {
  std::vector<std::byte> source(bytes + 16, std::byte{1}), message(bytes + 16), inbox(bytes + 16);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = Clock::now();
  for (int i = 1; i <= rounds; ++i) {
    if (me == 1) MPI_Recv(inbox.data(), static_cast<int>(inbox.size()), MPI_BYTE, 0, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    std::memcpy(message.data(), source.data(), message.size());
    MPI_Send(message.data(), static_cast<int>(message.size()), MPI_BYTE, 1 - me, 7, MPI_COMM_WORLD);
    if (me == 0) MPI_Recv(inbox.data(), static_cast<int>(inbox.size()), MPI_BYTE, 1, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  MPI_Barrier(MPI_COMM_WORLD);
  return seconds / rounds / 2;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int me = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int code = 0;
  try {
    if (size != 2) throw std::runtime_error("run with mpirun -np 2");
    const std::size_t bytes = 64 * 2048 * 4;  // 512 KiB, as bench_transport
    {
      std::vector<double> wake, put;
      mpi_ping_pong(me, 200, 0);
      for (int rep = 0; rep < 7; ++rep) wake.push_back(mpi_ping_pong(me, 2000, 0));
      for (int rep = 0; rep < 7; ++rep) put.push_back(mpi_ping_pong(me, 100, bytes));
      if (me == 0) {
        std::printf("engine: MPI two-sided messages, one thread per process (the BTLs mpirun was given)\n");
        std::printf("signal-to-wake one way: %.2f us (median of 7 x 2000 round trips)\n", median(wake) * 1e6);
        std::printf("put 512 KiB + signal one way (one message): %.1f us, %.2f GB/s\n", median(put) * 1e6,
                    double(bytes) / median(put) / 1e9);
      }
    }
    Ucx ucx(me, bytes);
    std::uint64_t armed = 0;
    ping_pong(ucx, me, armed, 200, 0);  // warm-up
    std::vector<double> wake, put;
    for (int rep = 0; rep < 7; ++rep) wake.push_back(ping_pong(ucx, me, armed, 2000, 0));
    for (int rep = 0; rep < 7; ++rep) put.push_back(ping_pong(ucx, me, armed, 100, bytes));
    if (me == 0) {
      const char* tls = std::getenv("UCX_TLS");
      std::printf("engine: UCX %s, UCX_TLS=%s, 2 processes\n", ucp_get_version_string(), tls ? tls : "(default)");
      std::printf("signal-to-wake one way: %.2f us (median of 7 x 2000 round trips)\n", median(wake) * 1e6);
      std::printf("put 512 KiB + fence + signal one way: %.1f us, %.2f GB/s\n", median(put) * 1e6,
                  double(bytes) / median(put) / 1e9);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    code = 2;
  }
  MPI_Finalize();
  return code;
}
