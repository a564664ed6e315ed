// The MPI transport's collectives: gathers, the allgather (one-sided on shared
// memory, direct messages on the network), ordered sums and the barrier.
#include <algorithm>

#include "comm/mpi_transport.hpp"

#ifdef HPMOE_HAVE_MPI

namespace hpmoe::mpi_detail {

void Mpi::gather(std::span<float> data, int owner) {
  if (owner == 0 || (rank_ != 0 && rank_ != owner)) return;
  if (data.size() > static_cast<std::size_t>(INT32_MAX)) throw Error("gather: more than 2^31 values in one piece");
  MPI_Request req = MPI_REQUEST_NULL;
  run([&](bool first) {
    if (first) {
      if (rank_ == 0)
        check_mpi(MPI_Irecv(data.data(), static_cast<int>(data.size()), MPI_FLOAT, owner, kGather, comm_, &req), "Irecv");
      else
        check_mpi(MPI_Isend(data.data(), static_cast<int>(data.size()), MPI_FLOAT, 0, kGather, comm_, &req), "Isend");
    }
    int done = 0;
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "Test");
    return done != 0;
  });
}

void Mpi::allgather(std::span<std::byte> all, std::size_t block) {
  if (all.size() != block * static_cast<std::size_t>(size_)) throw Error("allgather: wrong buffer size");
  if (block > static_cast<std::size_t>(INT32_MAX)) throw Error("allgather: a block of more than 2^31 bytes");
  if (one_sided_exchange_ && shared_) {
    one_sided_allgather(all, block);
    return;
  }
  if (one_sided_exchange_) {
    direct_allgather(all, block);
    return;
  }
  MPI_Request req = MPI_REQUEST_NULL;
  run([&](bool first) {
    if (first)
      check_mpi(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, all.data(), static_cast<int>(block), MPI_BYTE, comm_, &req),
                "Iallgather");
    int done = 0;
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "Test");
    return done != 0;
  });
}

template <class V>
void Mpi::chain_sum(std::span<V> data, MPI_Datatype type) {
  if (data.size() > static_cast<std::size_t>(INT32_MAX)) throw Error("sum_in_rank_order: more than 2^31 values");
  const int n = static_cast<int>(data.size());
  std::vector<V> partial(rank_ > 0 ? data.size() : 0);
  enum { receive, add, send, broadcast, done } stage = rank_ > 0 ? receive : add;
  MPI_Request req = MPI_REQUEST_NULL;
  bool posted = false;
  auto finished = [&] {
    int flag = 0;
    check_mpi(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "Test");
    if (flag) posted = false;
    return flag != 0;
  };
  run([&](bool) {
    for (;;) {
      switch (stage) {
        case receive:
          if (!posted) {
            check_mpi(MPI_Irecv(partial.data(), n, type, rank_ - 1, kSum, comm_, &req), "Irecv");
            posted = true;
          }
          if (!finished()) return false;
          stage = add;
          break;
        case add:
          for (std::size_t i = 0; i < data.size(); ++i) data[i] = (rank_ > 0 ? partial[i] : V(0)) + data[i];
          stage = rank_ + 1 < size_ ? send : broadcast;
          break;
        case send:
          if (!posted) {
            check_mpi(MPI_Isend(data.data(), n, type, rank_ + 1, kSum, comm_, &req), "Isend");
            posted = true;
          }
          if (!finished()) return false;
          stage = broadcast;
          break;
        case broadcast:
          if (!posted) {
            check_mpi(MPI_Ibcast(data.data(), n, type, size_ - 1, comm_, &req), "Ibcast");
            posted = true;
          }
          if (!finished()) return false;
          stage = done;
          break;
        case done:
          return true;
      }
    }
  });
}

void Mpi::one_sided_allgather(std::span<std::byte> all, std::size_t block) {
  const auto P = static_cast<std::size_t>(size_);
  const std::size_t area = ((block * P + 63) / 64) * 64;
  if (area > control_area_) {  // collective: every rank asks with the same block
    control_area_ = area;
    std::vector<std::int64_t> bytes(P, static_cast<std::int64_t>(64 + 2 * area));
    run_collective(share_, [&] { allocate_shared(control_win_, bytes, control_); });
    control_calls_ = 0;
  }
  // Two areas of the window's size, whatever this call's block: a peer one
  // call ahead writes the other one, even when its call's block differs.
  const std::size_t turn = static_cast<std::size_t>(control_calls_ % 2), stride = control_area_;
  ++control_calls_;
  const std::byte* mine = all.data() + static_cast<std::size_t>(rank_) * block;
  for (std::size_t q = 0; q < P; ++q) {
    if (static_cast<int>(q) == rank_) continue;
    std::memcpy(control_[q] + 64 + turn * stride + static_cast<std::size_t>(rank_) * block, mine, block);
    reinterpret_cast<std::atomic<std::int64_t>*>(control_[q])->fetch_add(1, std::memory_order_release);
  }
  auto& arrived = *reinterpret_cast<std::atomic<std::int64_t>*>(control_[static_cast<std::size_t>(rank_)]);
  const std::int64_t expected = control_calls_ * static_cast<std::int64_t>(P - 1);
  const auto start = Clock::now();
  for (int spins = 0; arrived.load(std::memory_order_acquire) < expected; ++spins) {
    if (spins % 1024 == 1023 && Clock::now() - start > std::chrono::duration<double>(peer_timeout_)) {
      const std::string failed = failed_peers();
      if (!failed.empty()) throw Error("a peer failed during the count exchange: " + failed);
    }
    std::this_thread::yield();
  }
  for (std::size_t q = 0; q < P; ++q)
    if (static_cast<int>(q) != rank_)
      std::memcpy(all.data() + q * block, control_[static_cast<std::size_t>(rank_)] + 64 + turn * stride + q * block,
                  block);
}

void Mpi::direct_allgather(std::span<std::byte> all, std::size_t block) {
  std::vector<MPI_Request> requests;
  requests.reserve(2 * static_cast<std::size_t>(size_));
  const std::byte* mine = all.data() + static_cast<std::size_t>(rank_) * block;
  run([&](bool first) {
    if (first) {
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        requests.emplace_back(MPI_REQUEST_NULL);
        check_mpi(MPI_Irecv(all.data() + static_cast<std::size_t>(q) * block, static_cast<int>(block), MPI_BYTE, q,
                  kCount,
                            comm_, &requests.back()),
                  "Irecv (counts)");
      }
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        requests.emplace_back(MPI_REQUEST_NULL);
        check_mpi(MPI_Isend(mine, static_cast<int>(block), MPI_BYTE, q, kCount, comm_, &requests.back()), "Isend (counts)");
      }
    }
    int done = 0;
    check_mpi(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE), "Testall");
    return done != 0;
  });
}

bool Mpi::barrier_step(bool first) {
  if (first) check_mpi(MPI_Ibarrier(comm_, &barrier_), "Ibarrier");
  int done = 0;
  check_mpi(MPI_Test(&barrier_, &done, MPI_STATUS_IGNORE), "Test");
  return done != 0;
}

template void Mpi::chain_sum<float>(std::span<float>, MPI_Datatype);
template void Mpi::chain_sum<double>(std::span<double>, MPI_Datatype);

}  // namespace hpmoe::mpi_detail

#endif  // HPMOE_HAVE_MPI
