#pragma once
// Internal: the scheduler's worker assignment (schedule_queues.cpp), used by
// schedule.cpp after it has ordered a program's tasks.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/access.hpp"
#include "compiler/taskflow.hpp"

namespace hpmoe::taskflow {

// How many vector workers the gathers and a forwarder's node sums get as
// queues of their own (0: none; see schedule_queues.cpp).
struct QueuesApart {
  std::size_t gathers = 0, node_sums = 0;
};
QueuesApart queues_apart(std::size_t vector_workers);
// Whether some task of the program has the kind's place `at`.
bool has_place(const Program&, Place at);
// The vector workers that do not carry puts (all of them where put_workers is 0).
std::size_t vector_workers_outside_puts(const Machine&);
// The workers the final reductions go to: those, and the matrix workers
// where they run vector code (Machine::matrix_runs_vector).
std::size_t reduction_workers(const Machine&);
// Each position of `order` its worker (scratch.worker_of).
void assign_workers(const Program&, Policy, const std::vector<std::int32_t>& order, ScheduleScratch&);

}  // namespace hpmoe::taskflow
