#include <algorithm>
#include <sstream>
#include <tuple>

#include "compiler/layout.hpp"
#include "compiler/verify_checker.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe::taskflow {

namespace verify_detail {

std::string describe(const Program& p, std::int32_t id) {
  const Task& t = p.tasks[static_cast<std::size_t>(id)];
  std::ostringstream o;
  o << "rank " << p.rank << " task #" << id << " (" << name(t.kind);
  if (t.expert >= 0) o << " expert " << t.expert;
  o << " rows [" << t.row_begin << ", " << t.row_begin + t.rows << ") cols [" << t.col_begin << ", "
    << t.col_begin + t.cols << "))";
  return o.str();
}

std::string describe_event(const Program& p, std::int32_t ev) {
  const Event& e = p.events[static_cast<std::size_t>(ev)];
  std::ostringstream o;
  o << "event " << ev << " on rank " << p.rank << " (for " << name(e.consumer);
  if (e.expert >= 0) o << ", expert " << e.expert;
  if (e.tile >= 0) o << ", tile " << e.tile;
  o << ")";
  return o.str();
}

// What a pass starts from, written before the launch: the tokens and the
// step's routing; in the backward also the forward's buffers (saved
// activations), the router's logits and the output gradient.
bool is_input(Pass pass, BufferId b) {
  switch (b) {
    case BufferId::x: case BufferId::xf: case BufferId::slot: case BufferId::gate: case BufferId::send_token:
    case BufferId::send_assign: case BufferId::rank_token: case BufferId::rank_route: case BufferId::rank_comb:
    case BufferId::rank_slot: case BufferId::node_token: case BufferId::node_index:
      return true;
    case BufferId::recv: case BufferId::h1: case BufferId::a: case BufferId::y: case BufferId::comb:
    case BufferId::out: case BufferId::sh_h: case BufferId::sh_a: case BufferId::sh_y: case BufferId::dout:
    case BufferId::sh_dout: case BufferId::logits: case BufferId::recv_tok: case BufferId::recv_route:
    case BufferId::recv_comb: case BufferId::comb_rank: case BufferId::node_tok: case BufferId::node_route:
      return pass == Pass::backward;
    default:
      return false;
  }
}

}  // namespace verify_detail

using verify_detail::Checker;
using verify_detail::ProgramSet;

Verifier::Verifier() : Verifier(AccessTable::standard()) {}
Verifier::Verifier(const AccessTable& table) : scratch_(std::make_unique<VerifierScratch>()), table_(&table) {}
Verifier::~Verifier() = default;

VerifyReport verify(std::span<const Program> programs) {
  Verifier v;
  return v.verify(programs);
}

VerifyReport Verifier::verify(std::span<const Program> programs) {
  if (programs.empty()) return {false, "no programs to verify"};
  Checker check(ProgramSet(programs), *scratch_, *table_);
  return check.prove(nullptr);
}

VerifyReport verify_rank(const Program& own, const LayerConfig& c, const ExpertPlacement& placement,
                         const RoutingCounts& counts, const Machine& m) {
  Verifier v;
  return v.verify_rank(own, c, placement, counts, m);
}

VerifyReport Verifier::verify_rank(const Program& own, const LayerConfig& c, const ExpertPlacement& placement,
                                   const RoutingCounts& counts, const Machine& m) {
  try {
    c.validate();
    return verify_rank(own, c, Exchange(c, placement, counts, m.tile_rows), m);
  } catch (const Error& e) {
    return {false, e.what()};
  }
}

VerifyReport Verifier::verify_rank(const Program& own, const LayerConfig& c, const Exchange& ex, const Machine& m) {
  const std::int64_t P = c.ranks, r = own.rank;
  if (r < 0 || r >= P || own.ranks != P)
    return {false, "the program says it is rank " + std::to_string(own.rank) + " of " + std::to_string(own.ranks) +
                       ", the layer has " + std::to_string(P) + " ranks"};
  int vector_worker = -1;
  for (int w = m.workers() - 1; w >= 0; --w)
    if (m.takes(w, QueueClass::vector)) vector_worker = w;
  if (vector_worker < 0) return {false, "machine '" + m.name + "' has no worker for vector tasks"};
  // Stand-ins for the peers, from the exchange alone: each holds its puts
  // into this rank (waiting on nothing: the level argument covers when they
  // are sent) and events that count this rank's predicted puts into it.
  auto& s = *scratch_;
  s.stubs.resize(static_cast<std::size_t>(P));
  s.expected.clear();
  std::vector<const Program*> set(static_cast<std::size_t>(P), &own);
  for (std::int64_t q = 0; q < P; ++q) {
    if (q == r) continue;
    Program& stub = s.stubs[static_cast<std::size_t>(q)];
    program_header(stub, c, ex, m, own.pass, q);
    const std::size_t first = s.expected.size();
    interface_puts(c, ex, m.tile_rows, own.pass, r, q, s.expected);
    std::int32_t events = 0;
    for (std::size_t i = first; i < s.expected.size(); ++i) events = std::max(events, s.expected[i].trigger_event + 1);
    stub.events.assign(static_cast<std::size_t>(events), Event{0, TaskKind::count, -1, -1});
    for (std::size_t i = first; i < s.expected.size(); ++i) {
      Event& e = stub.events[static_cast<std::size_t>(s.expected[i].trigger_event)];
      ++e.required;
      e.consumer = remote_consumer(s.expected[i].kind);
    }
    stub.tasks.clear();
    interface_puts(c, ex, m.tile_rows, own.pass, q, r, stub.tasks);
    const auto n = static_cast<std::int32_t>(stub.tasks.size());
    stub.cost.assign(stub.tasks.size(), 0.0f);
    stub.queue_begin.assign(static_cast<std::size_t>(m.workers()) + 1, 0);
    for (int w = vector_worker + 1; w <= m.workers(); ++w) stub.queue_begin[static_cast<std::size_t>(w)] = n;
    stub.queue_tasks.resize(stub.tasks.size());
    for (std::int32_t i = 0; i < n; ++i) stub.queue_tasks[static_cast<std::size_t>(i)] = i;
    set[static_cast<std::size_t>(q)] = &stub;
  }
  Checker check(ProgramSet(std::move(set)), s, *table_, static_cast<std::int32_t>(r));
  return check.prove(&s.expected);
}

ProgramStats stats(std::span<const Program> programs, std::int64_t rank) {
  if (rank < 0 || rank >= static_cast<std::int64_t>(programs.size())) throw Error("no program for rank " + std::to_string(rank));
  ProgramStats s;
  const Program& p = programs[static_cast<std::size_t>(rank)];
  s.tasks_by_kind.assign(static_cast<std::size_t>(TaskKind::count), 0);
  for (const auto& t : p.tasks) {
    ++s.tasks_by_kind[static_cast<std::size_t>(t.kind)];
    (t.queue == QueueClass::matrix ? s.matrix_tasks : s.vector_tasks)++;
  }
  s.events = static_cast<std::int64_t>(p.events.size());
  VerifierScratch scratch;
  Checker check(ProgramSet(programs), scratch, AccessTable::standard());
  try {
    check.structure();
    check.execute<true>();
  } catch (const Error&) {
    return s;  // not executable: no timing figures
  }
  s.critical_path_s = check.critical();
  s.makespan_s = check.makespan();
  std::int64_t first = 0;
  for (std::int64_t r = 0; r < rank; ++r) first += programs[static_cast<std::size_t>(r)].machine.workers();
  s.worker_load_s.assign(check.loads().begin() + first, check.loads().begin() + first + p.machine.workers());
  return s;
}

}  // namespace hpmoe::taskflow
