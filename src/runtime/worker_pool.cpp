#include "runtime/worker_pool.hpp"

#include <pthread.h>
#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "hpmoe/error.hpp"

namespace hpmoe {

WorkerPool::WorkerPool(int ranks, int workers_per_rank, bool pin, int first_core, WorkerThreads threads)
    : ranks_(ranks), workers_(workers_per_rank), first_core_(first_core), pin_(pin), threads_kind_(threads) {
  if (ranks < 1 || workers_per_rank < 1) throw Error("a worker pool needs at least one rank and one worker");
  if (threads_kind_ == WorkerThreads::own) start_threads();
}

void WorkerPool::start_threads() {
  if (!threads_.empty()) return;
  const int total = ranks_ * workers_;
  // The cores this process may use (taskset, a cluster host's share), in order.
  std::vector<int> cores;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  if (cores.empty()) cores.push_back(0);
  for (int i = 0; i < total; ++i) {
    try {
      threads_.emplace_back([this, i] { loop(i); });
    } catch (const std::exception& e) {
      // Out of threads or memory part-way (a ulimit, a container's pids
      // limit): stop and join the ones that started, so that nothing waits
      // on the condition variables being destroyed, then say so.
      stop_workers();
      stop_ = false;
      throw Error("could not start worker thread " + std::to_string(i + 1) + " of " + std::to_string(total) + " (" + e.what() +
                  "): use fewer ranks or workers per rank (-P, -W), or raise the process's thread or memory limit");
    }
    if (pin_) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cores[static_cast<std::size_t>(first_core_ + i) % cores.size()], &set);
      pthread_setaffinity_np(threads_.back().native_handle(), sizeof(set), &set);  // best effort
    }
  }
}

// One parallel region of P x W threads from the calling thread. Its
// workers wait on each other, so all must run: a team that came out short
// (nested in a parallel region, OMP_THREAD_LIMIT, dynamic teams) runs
// nothing, and the pool's own threads take the step. false: not run.
bool WorkerPool::run_on_openmp(const std::function<void(int, int)>& fn) {
#ifdef _OPENMP
  const int total = ranks_ * workers_;
  if (omp_in_parallel()) return false;
  bool whole = false;
  std::exception_ptr failure;
  std::mutex failure_mutex;
#pragma omp parallel num_threads(total)
  {
#pragma omp single
    whole = omp_get_num_threads() == total;
    // (the single's barrier: every thread sees `whole`)
    if (whole) {
      const int index = omp_get_thread_num();
      try {
        fn(index / workers_, index % workers_);
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
      }
    }
  }
  if (!whole) return false;
  ++openmp_runs_;
  if (failure) std::rethrow_exception(failure);
  return true;
#else
  (void)fn;
  return false;
#endif
}

void WorkerPool::stop_workers() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

WorkerPool::~WorkerPool() { stop_workers(); }

bool WorkerPool::openmp_built() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

void WorkerPool::run(const std::function<void(int, int)>& fn) {
  if (threads_kind_ == WorkerThreads::openmp && run_on_openmp(fn)) return;
  start_threads();
  std::unique_lock lock(mutex_);
  job_ = &fn;
  error_ = nullptr;
  running_ = static_cast<int>(threads_.size());
  ++generation_;
  start_.notify_all();
  done_.wait(lock, [this] { return running_ == 0; });
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

void WorkerPool::loop(int index) {
  const int rank = index / workers_, worker = index % workers_;
  unsigned long seen = 0;
  for (;;) {
    const std::function<void(int, int)>* job = nullptr;
    {
      std::unique_lock lock(mutex_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr failure;
    try {
      (*job)(rank, worker);
    } catch (...) {
      failure = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    if (failure && !error_) error_ = failure;
    if (--running_ == 0) done_.notify_one();
  }
}

}  // namespace hpmoe
