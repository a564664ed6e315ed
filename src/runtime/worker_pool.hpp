#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "hpmoe/layer.hpp"

namespace hpmoe {

// P ranks x W workers. run() is one bulk-synchronous step: every worker
// runs the function once, all at the same time (the interleaved schedule's
// workers wait on each other's events), and run() returns when all have
// finished (the serialized baseline's operator boundary). A worker's
// exception is rethrown by run().
//
// Whose threads (WorkerThreads): persistent threads of the pool's own, each
// pinned to a core where asked; or the OpenMP runtime's, one parallel
// region of P x W threads per run() from the calling thread (a framework's
// operator threads, reused), with the pool's own threads as the fallback
// when that team comes out short.
class WorkerPool {
 public:
  // Worker i is pinned to the (first_core + i)-th core, modulo the cores
  // this process may run on (its affinity mask); OpenMP's threads are not.
  WorkerPool(int ranks, int workers_per_rank, bool pin, int first_core = 0,
             WorkerThreads threads = WorkerThreads::own);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void run(const std::function<void(int rank, int worker)>& fn);
  int ranks() const { return ranks_; }
  int workers_per_rank() const { return workers_; }
  // Steps the OpenMP runtime's threads ran (the rest ran on the pool's own).
  long openmp_runs() const { return openmp_runs_; }
  // Whether this build has OpenMP (without it WorkerThreads::openmp runs
  // every step on the pool's own threads).
  static bool openmp_built();

 private:
  void start_threads();  // the pool's own, once
  bool run_on_openmp(const std::function<void(int, int)>& fn);
  void loop(int index);
  void stop_workers();  // stops and joins every started worker

  int ranks_, workers_, first_core_;
  bool pin_;
  WorkerThreads threads_kind_;
  long openmp_runs_ = 0;
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
