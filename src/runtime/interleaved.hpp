#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "runtime/serialized.hpp"
#include "hpmoe/config.hpp"
#include "compiler/taskflow.hpp"
#include "hpmoe/tensors.hpp"
#include "hpmoe/transport.hpp"

namespace hpmoe {
namespace taskflow {
class AccessTable;
}

// Faults injected on purpose (tests of the watchdog and of peer failure).
struct RuntimeFault {
  enum Kind { none, exit_process, freeze_process, stall } kind = none;
  // exit_process: the process hosting this rank dies at its first launch;
  // freeze_process: it stops (SIGSTOP: alive but silent, like a host whose
  // link went down); stall: this rank's worker 0 waits before its first task
  int rank = 0;
};

struct RuntimeOptions {
  int workers_per_rank = 1;
  bool backward = false;           // also run the backward program (a second launch)
  taskflow::Policy policy = taskflow::Policy::critical_path;
  bool pin = true;
  bool verify_programs = true;     // run the verifier before every launch
  // Sharded (MPI): every rank proves its own program against the interface
  // the exchanged counts predict (taskflow::verify_rank), at the cost of its
  // own program. This audit instead regenerates every rank's program on
  // every process and verifies the whole set (P times the compile cost).
  bool verify_all_ranks = false;
  double watchdog_seconds = 10.0;  // a wait longer than this stops the launch with an error
  // Fault injection (tests, tools): called with the step's programs after
  // compilation and before verification and launch.
  std::function<void(std::vector<taskflow::Program>&)> after_compile;
  std::shared_ptr<const PackedWeights> packed;  // optional, see pack_weights
  // Where a tensor-parallel split expert's raw weights come from when the
  // given weights do not hold them (a sharded run keeps only packed copies,
  // and packs only its parts of a split expert): called once per part this
  // process computes, one at a time.
  ExpertSource expert_source;
  bool trace = false;                           // record StepResult::trace (a slice per task)
  // Where the ranks run and how rows reach peers; null: all ranks in this
  // process. With an MPI transport each process runs its own rank, and the
  // root process's StepResult holds every rank's outputs and gradients.
  std::shared_ptr<Transport> transport;
  RuntimeFault fault;
  // Run the same tiles as the serialized baseline does: one operator at a
  // time (taskflow::operator_order), each rank's tasks of the operator
  // shared round-robin by its workers, and a barrier across all workers of
  // all ranks after every operator. Over MPI this is the serialized
  // baseline on the same transport and links.
  bool phased = false;
  ExpertPlacement placement;  // where the experts live; empty: contiguous
  // Where every task's operands come from (tests perturb a copy); null: the
  // standard table. It must outlive the executor.
  const taskflow::AccessTable* access_table = nullptr;
};

// The interleaved single-launch runtime, in process: every step compiles the
// routing into per-rank tile programs (same tiles, operands and kernels as
// the serialized baseline), verifies them, and runs them in one launch in
// which all P x W workers walk their queues concurrently, waiting on event
// counters and moving rows with put + signal. With backward, a second launch
// runs the backward program; the replicated weights' gradients (router,
// shared experts) are then summed over ranks in rank order.
class InterleavedExecutor {
 public:
  InterleavedExecutor(const LayerConfig&, const LayerWeights&, RuntimeOptions);
  ~InterleavedExecutor();
  InterleavedExecutor(const InterleavedExecutor&) = delete;
  InterleavedExecutor& operator=(const InterleavedExecutor&) = delete;

  // One step. result.dispatch_to_combine_seconds is the forward launch and
  // result.backward_seconds the backward one; routing, compile and
  // verification are reported as host-side operators.
  void step(const LayerInputs&, std::span<const std::int32_t> forced, StepResult& result);
  // The same in two calls, as a training framework makes them: forward saves
  // what backward needs in the executor and in `result`; backward runs later
  // on the output gradient, with the same result object. x and d_out are
  // views of the caller's memory ([P T, H], any row stride >= H), read
  // without copies; x must stay alive and unchanged until backward returns.
  void forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& result);
  void backward(MatrixView d_out, StepResult& result);
  // The caller changed the weights this executor was built on, in place
  // (and repacked `packed`, the shared packing, if it gave one): re-read
  // what the executor derives from them. Not between a forward and its
  // backward.
  void weights_changed(std::shared_ptr<const PackedWeights> packed = nullptr);
  // The programs of the last step (one per rank).
  const std::vector<taskflow::Program>& programs(taskflow::Pass = taskflow::Pass::forward) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  bool backward_ = false;
};

}  // namespace hpmoe
