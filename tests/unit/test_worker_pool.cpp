// The worker pool's two sources of threads (WorkerThreads): its own, and the
// OpenMP runtime's team from the calling thread (what the Python module
// uses, so that PyTorch's idle OpenMP threads do not spin beside the
// workers). Either way every worker of a step runs once and all of them at
// the same time (the interleaved schedule's workers wait on each other);
// a team that comes out short falls back to the pool's own threads.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "hpmoe/error.hpp"
#include "runtime/worker_pool.hpp"

using namespace hpmoe;

namespace {

// Every worker of the step arrives, then waits until all have: a pool that
// ran them one after another would time out here instead of hanging.
struct AllAtOnce {
  explicit AllAtOnce(int workers) : total(workers) {}
  int total;
  std::atomic<int> arrived{0};
  std::mutex mutex;
  std::set<std::pair<int, int>> seen;
  bool all_met = true;
  void operator()(int rank, int worker) {
    {
      std::lock_guard lock(mutex);
      seen.insert({rank, worker});
    }
    arrived.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived.load() < total)
      if (std::chrono::steady_clock::now() > deadline) {
        std::lock_guard lock(mutex);
        all_met = false;
        return;
      }
  }
};

}  // namespace

TEST(WorkerPool, OpenmpTeamRunsEveryWorkerOnceAndAllAtOnce) {
#ifdef HPMOE_TESTS_HAVE_OPENMP
  EXPECT_TRUE(WorkerPool::openmp_built()) << "CMake found OpenMP, but the runtime was built without it";
#endif
  WorkerPool pool(2, 2, false, 0, WorkerThreads::openmp);
  for (int step = 0; step < 3; ++step) {
    AllAtOnce job(4);
    pool.run([&](int r, int w) { job(r, w); });
    EXPECT_TRUE(job.all_met) << "step " << step << ": the workers did not run at the same time";
    EXPECT_EQ(job.seen, (std::set<std::pair<int, int>>{{0, 0}, {0, 1}, {1, 0}, {1, 1}}));
  }
  EXPECT_EQ(pool.openmp_runs(), WorkerPool::openmp_built() ? 3 : 0);
  WorkerPool own(2, 2, false);  // the pool's own threads: the same contract
  AllAtOnce job(4);
  own.run([&](int r, int w) { job(r, w); });
  EXPECT_TRUE(job.all_met);
  EXPECT_EQ(job.seen.size(), 4u);
  EXPECT_EQ(own.openmp_runs(), 0);
}

// Called from inside a parallel region (a step of another OpenMP pool), a
// pool cannot have a team of its own: it runs the step on its own threads.
TEST(WorkerPool, ANestedStepFallsBackToThePoolsOwnThreads) {
  WorkerPool outer(1, 2, false, 0, WorkerThreads::openmp);
  WorkerPool inner(2, 1, false, 0, WorkerThreads::openmp);
  AllAtOnce nested(2);
  outer.run([&](int, int w) {
    if (w == 0) inner.run([&](int r, int v) { nested(r, v); });
  });
  EXPECT_TRUE(nested.all_met);
  EXPECT_EQ(nested.seen, (std::set<std::pair<int, int>>{{0, 0}, {1, 0}}));
  EXPECT_EQ(inner.openmp_runs(), 0);
  EXPECT_EQ(outer.openmp_runs(), WorkerPool::openmp_built() ? 1 : 0);
}

// A worker's exception comes back from run(), and the pool runs the next step.
TEST(WorkerPool, AWorkersExceptionComesBackAndThePoolGoesOn) {
  for (const WorkerThreads threads : {WorkerThreads::own, WorkerThreads::openmp}) {
    WorkerPool pool(1, 2, false, 0, threads);
    EXPECT_THROW(pool.run([](int, int w) {
      if (w == 1) throw Error("worker 1 failed");
    }),
                 Error);
    std::atomic<int> ran{0};
    pool.run([&](int, int) { ran.fetch_add(1); });
    EXPECT_EQ(ran.load(), 2);
  }
}
