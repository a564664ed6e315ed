#pragma once
// The taskflow compiler: one layer step (layer, expert placement, routing
// counts, machine) -> per-rank programs of tile tasks on worker queues. A
// task waits for one event counter to reach a count, runs, and adds one to
// one counter (on a peer rank for a put); nothing else orders tasks. The
// verifier proves a set of programs safe before launch. The IR itself is
// ir/ir.hpp; what each task kind does is the op table (ops/access.hpp).
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/schedule.hpp"
#include "ir/ir.hpp"
#include "ops/access.hpp"

namespace hpmoe::taskflow {

// Rows each (source rank, expert) pair exchanges: counts[s * E + e].
struct RoutingCounts {
  std::int64_t ranks = 0, experts = 0;
  std::vector<std::int64_t> counts;
  // The per-rank exchange: [s * N + i] tokens of s whose first instance on
  // instance i's rank is i, then [P N + s N + i] those whose last instance
  // there is i (N: the placement's instances; RankRoutes::first of each
  // source); empty where unknown.
  std::vector<std::int64_t> token_counts;
  std::int64_t at(std::int64_t s, std::int64_t e) const { return counts[s * experts + e]; }
};

// Kept rows per (source rank, expert) of a routed step.
template <class Real>
RoutingCounts routing_counts(const LayerConfig&, const RouterOutput<Real>&);
// The per-rank exchange's tokens of each source by first and by last
// instance (RoutingCounts::token_counts) under a routing of every
// rank's tokens; `counts` are its routing_counts.
std::vector<std::int64_t> rank_token_counts(const LayerConfig&, const ExpertPlacement&, const RoutingCounts& counts,
                                            const RouterOutput<float>&, std::int64_t tile_rows);
// Of expert choices with nothing dropped ([tokens, K], e.g. forced_selection).
RoutingCounts routing_counts(const LayerConfig&, std::span<const std::int32_t> expert_ids);

// Compiles every rank's program (tasks, events, buffers) and schedules them.
std::vector<Program> compile(const LayerConfig&, const ExpertPlacement&, const RoutingCounts&, const Machine&, Pass,
                             Policy);
// Generation alone (tasks in generation order, unscheduled), and scheduling.
Program generate(const LayerConfig&, const ExpertPlacement&, const RoutingCounts&, const Machine&, Pass,
                 std::int64_t rank);
// The same into an existing program, reusing its storage (the per-step path:
// a rank recompiles every step and allocates nothing once warm).
void generate_into(Program&, const LayerConfig&, const ExpertPlacement&, const RoutingCounts&, const Machine&, Pass,
                   std::int64_t rank);
// The serialized baseline's operators for a layer: operator_order's kinds
// that the generator may emit for it (its exchange, encoded dispatches,
// shared experts, split experts: `has_splits`), so that no barrier is
// spent on an operator the layer never runs. The same on every rank.
std::vector<TaskKind> layer_operators(const LayerConfig&, bool has_splits, Pass, bool fetched_replicas = false);
// Scratch space of the scheduler, kept between steps.
struct ScheduleScratch {
  std::vector<std::int32_t> order, worker_of, fill;
  std::vector<std::uint64_t> keys, keys_tmp;
  std::vector<double> free_at, event_done;
};
void schedule(Program&, Policy, ScheduleScratch&);
void schedule(Program&, Policy);

struct VerifyReport {
  bool ok = true;
  std::string error;  // first problem, naming rank, worker, task and event
};
// Proves a set of programs (one per rank) safe: event consistency, no
// deadlock under any timing, every read produced by what it waits for,
// no conflicting writes.
VerifyReport verify(std::span<const Program>);

// Proves one rank's program safe with that program alone and the step's
// interface: the puts between ranks, a pure function of (layer, placement,
// counts, machine). Its own puts must be exactly the predicted ones, every
// event it waits on must count its own triggers plus the predicted puts into
// it, and no put into a peer's level-l event (dispatch 0, return 1) may come
// after, or wait on, an event that peers' puts of level >= l feed. If every
// rank's check passes, the whole set is free of deadlock, races and
// conflicting writes (docs/proofs.md); no peer's program is generated.
VerifyReport verify_rank(const Program& own, const LayerConfig&, const ExpertPlacement&, const RoutingCounts&,
                         const Machine&);

// The same, keeping its working storage between calls (the per-step path).
struct VerifierScratch;
class AccessTable;
class Exchange;
class Verifier {
 public:
  // Checks programs against `table` (the standard one unless a test
  // perturbs it); the table must outlive the verifier.
  Verifier();
  explicit Verifier(const AccessTable& table);
  ~Verifier();
  Verifier(const Verifier&) = delete;
  Verifier& operator=(const Verifier&) = delete;
  VerifyReport verify(std::span<const Program>);
  VerifyReport verify_rank(const Program& own, const LayerConfig&, const ExpertPlacement&, const RoutingCounts&,
                           const Machine&);
  // The same with the step's exchange layout already built (the executor's).
  VerifyReport verify_rank(const Program& own, const LayerConfig&, const Exchange&, const Machine&);

 private:
  std::unique_ptr<VerifierScratch> scratch_;
  const AccessTable* table_;
};

// Estimated critical path (seconds) through the event graph and per-worker
// load, from the cost model.
struct ProgramStats {
  std::vector<std::int64_t> tasks_by_kind;   // [TaskKind::count]
  std::int64_t matrix_tasks = 0, vector_tasks = 0, events = 0;
  double critical_path_s = 0;  // unlimited workers
  double makespan_s = 0;       // these queues, all ranks
  std::vector<double> worker_load_s;
};
ProgramStats stats(std::span<const Program>, std::int64_t rank);

nlohmann::json to_json(const Program&);
Program program_from_json(const nlohmann::json&);  // Error on anything malformed
// Every rank's program from a dump ({"format": "hpmoe-taskflow-dump",
// "programs": [...]}); `source` names it in errors.
std::vector<Program> programs_from_dump(const nlohmann::json&, const std::string& source);
std::string listing(const Program&, std::size_t max_tasks = 200);

}  // namespace hpmoe::taskflow
