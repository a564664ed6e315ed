#include "runtime/worker_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include "hpmoe/error.hpp"

namespace hpmoe {

WorkerPool::WorkerPool(int ranks, int workers_per_rank, bool pin, int first_core) : ranks_(ranks), workers_(workers_per_rank) {
  if (ranks < 1 || workers_per_rank < 1) throw Error("a worker pool needs at least one rank and one worker");
  const int total = ranks * workers_per_rank;
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
      throw Error("could not start worker thread " + std::to_string(i + 1) + " of " + std::to_string(total) + " (" + e.what() +
                  "): use fewer ranks or workers per rank (-P, -W), or raise the process's thread or memory limit");
    }
    if (pin) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cores[static_cast<std::size_t>(first_core + i) % cores.size()], &set);
      pthread_setaffinity_np(threads_.back().native_handle(), sizeof(set), &set);  // best effort
    }
  }
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

void WorkerPool::run(const std::function<void(int, int)>& fn) {
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
