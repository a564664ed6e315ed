#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hpmoe {

// P ranks x W persistent worker threads, each pinned to a core. run() is one
// bulk-synchronous step: every worker runs the function once, and run()
// returns when all have finished (the serialized baseline's operator
// boundary). A worker's exception is rethrown by run().
class WorkerPool {
 public:
  // Worker i is pinned to the (first_core + i)-th core, modulo the cores
  // this process may run on (its affinity mask).
  WorkerPool(int ranks, int workers_per_rank, bool pin, int first_core = 0);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void run(const std::function<void(int rank, int worker)>& fn);
  int ranks() const { return ranks_; }
  int workers_per_rank() const { return workers_; }

 private:
  void loop(int index);
  void stop_workers();  // stops and joins every started worker

  int ranks_, workers_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int, int)>* job_ = nullptr;
  unsigned long generation_ = 0;
  int running_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace hpmoe
