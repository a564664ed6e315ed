#pragma once
// Internal to the generator: one rank's program of one pass as the step's
// generator writes it (StepEmitter, generate_step.cpp), and what it asks of
// the exchange scheme the run options choose (SchemeSteps: per assignment
// in generate_assignment.cpp, per rank and per node in generate_rank.cpp).
// The step's own kinds (the router, the routed and shared experts' GEMMs,
// vector steps and packs) are written by the step; a scheme writes its
// own kinds: its events, puts, gathers, relays, returns and reductions.
#include <cstdint>
#include <span>
#include <vector>

#include "compiler/generate_parts.hpp"
#include "compiler/layout.hpp"
#include "ops/access.hpp"

namespace hpmoe::taskflow {

class Builder {
 public:
  Builder(Program& p, const Machine& m) : p_(p), m_(m), table_(AccessTable::standard()) {}

  std::int32_t event(std::int64_t id, std::int32_t required, TaskKind consumer, std::int64_t expert, std::int64_t tile) {
    p_.events[static_cast<std::size_t>(id)] = Event{required, consumer, static_cast<std::int32_t>(expert),
                                                    static_cast<std::int32_t>(tile)};
    return static_cast<std::int32_t>(id);
  }

  // Appends a task; its cost comes from the access table's work and the
  // machine's rates (the scheduler's cost model).
  void task(const TaskSpec& s) {
    auto i32 = [](std::int64_t v) { return static_cast<std::int32_t>(v); };
    const KindAccess& access = table_[s.kind];
    p_.tasks.push_back(Task{s.kind, access.queue, s.src, s.dst, i32(s.expert), i32(s.peer < 0 ? p_.rank : s.peer),
                            i32(s.row_begin), i32(s.rows), i32(s.col_begin), i32(s.cols), i32(s.src_row),
                            i32(s.wait_event), i32(s.wait_count), i32(s.trigger_event)});
    const TaskWork w = table_.work(p_, p_.tasks.back());
    const double seconds = access.queue == QueueClass::matrix ? w.flops / m_.matrix_flops
                           : access.put ? w.bytes / m_.put_bytes_per_s + w.local_bytes / m_.vector_bytes_per_s
                                        : w.bytes / m_.vector_bytes_per_s;
    p_.cost.push_back(static_cast<float>(seconds + m_.task_overhead_s));
  }

  // GEMM output tiles of [M, N]: add(row, rows, col, cols).
  template <class Fn>
  void gemm_tiles(std::int64_t M, std::int64_t N, Fn&& add) {
    gemm_tiles(M, N, m_.tile_rows, m_.tile_cols, add);
  }
  // Weight-gradient tiles: Machine::weight_rows x Machine::weight_cols.
  template <class Fn>
  void weight_tiles(std::int64_t M, std::int64_t N, Fn&& add) {
    gemm_tiles(M, N, m_.weight_rows(), m_.weight_cols(), add);
  }
  template <class Fn>
  void gemm_tiles(std::int64_t M, std::int64_t N, std::int64_t rows, std::int64_t cols, Fn&& add) {
    for (std::int64_t i = 0; i < M; i += rows)
      for (std::int64_t j = 0; j < N; j += cols) add(i, std::min(rows, M - i), j, std::min(cols, N - j));
  }

 private:
  Program& p_;
  const Machine& m_;
  const AccessTable& table_;
};

class SchemeSteps;

// The state of one rank's generation: its layer, exchange and machine, its
// slots, the bases of its events, and the builder that appends to it.
struct StepEmitter {
  StepEmitter(Program& program, const LayerConfig& layer, const Exchange& exchange, const Machine& machine, Pass p_,
              std::int64_t r);

  Program& p;
  const LayerConfig& c;
  const Exchange& ex;
  const Machine& m;
  const Pass pass;
  const bool forward_pass;
  const std::int64_t rank;
  const std::span<const std::int32_t> mine;  // this rank's experts, in slot order
  const std::vector<std::int64_t> homes;     // and their instances (the exchange's indexes)
  const std::int64_t H, I, Is, L, T, E, TR, TC;
  const bool shared, staged;
  const std::int64_t token_tiles, n_down;
  const EventBases ev;
  const SchemeSteps& scheme;
  Builder b;
  const Emit emit;
  const RequiredOf required;

  // A slot's intermediate width: the whole expert's, or its split part's.
  std::int64_t inter_of(std::int64_t le) const { return p.slot_parts[static_cast<std::size_t>(le)].inter; }
  std::int64_t expert_of(std::int64_t le) const { return mine[static_cast<std::size_t>(le)]; }
  std::int64_t home_of(std::int64_t le) const { return homes[static_cast<std::size_t>(le)]; }

  void run();

 private:
  // A routed row tile's events, by their bases, and the kinds that wait on them.
  struct TileChain {
    std::int64_t arrived, first_done, step_done, first_tiles;
    TaskKind first, step, second;
  };
  void tile_events(std::int64_t le, const TileChain&);
  void lend_events();
  void first_hop();
  void combined_events(std::int64_t base_pieces);
  void final_reduces(BufferId out, std::int64_t combined);

  void forward();
  void forward_events();
  void shared_forward();
  void expert_forward(std::int64_t le);

  void backward();
  void backward_events();
  void shared_backward();
  void expert_backward(std::int64_t le);

 public:
  // The router's backward (the scheme places it: before the expert work,
  // or after the gate gradients come back).
  void router();
};

// What the step's generator asks of the exchange scheme, at the points
// where the schemes differ. Each hook writes the scheme's own events and
// tasks into the step's program.
class SchemeSteps {
 public:
  virtual ~SchemeSteps() = default;
  // The scheme's events that no slot tile owns (token chains, node blocks, node sums).
  virtual void events(StepEmitter&) const {}
  // Row tile i of slot le: the event its rows' arrival completes (how many
  // arrivals: the exchange's), given the kind that waits on it.
  virtual void arrival_event(StepEmitter&, std::int64_t le, std::int64_t tile, std::int64_t arrived, TaskKind first) const;
  // The events of the slots' outputs (after every tile's own).
  virtual void output_events(StepEmitter&) const = 0;
  // The event a slot's second-GEMM tile signals.
  virtual std::int64_t output_event(const StepEmitter&, std::int64_t le, std::int64_t tile) const = 0;
  // What the combined rows' event counts (the returned pieces) and the kind
  // that waits on it; and the kind that waits on the split sums' event.
  virtual std::int64_t returned_pieces(const StepEmitter&) const = 0;
  virtual TaskKind combined_consumer(const StepEmitter&) const = 0;
  virtual TaskKind final_reduce(const StepEmitter&) const = 0;
  virtual BufferId final_source(const StepEmitter&) const = 0;
  // Split experts' sums: how many tasks (emit: write them too).
  virtual std::int64_t split_sums(StepEmitter&, bool emit) const { (void)emit; return 0; }
  // The first hop: rows to the experts' homes (and a forwarder's forwards).
  virtual void first_hop(StepEmitter&) const = 0;
  virtual void before_slot(StepEmitter&, std::int64_t) const {}
  virtual void before_tile(StepEmitter&, std::int64_t le, std::int64_t tile) const = 0;
  virtual void after_slot(StepEmitter&, std::int64_t) const {}
  // The router's first task of token tile t: the gate gradients, computed
  // here or gathered from the experts' ranks.
  virtual void gate_gradients(StepEmitter&, std::int64_t tile, std::int64_t rows) const = 0;
  // Whether the router's backward runs before the expert work (else the
  // returns place it).
  virtual bool router_first() const = 0;
  // The returns of the pass (the backward's may place the router).
  virtual void returns(StepEmitter&) const = 0;
  // The scheme's buffers, at their places in a rank's list: the forward's
  // returned rows (before the output), the forward's exchange (after it),
  // and the backward's returns and exchange.
  virtual void forward_return_buffers(const BufferDecl&) const {}
  virtual void forward_exchange_buffers(const BufferDecl&) const = 0;
  virtual void backward_buffers(const BufferDecl&) const = 0;
  // The interface between two ranks' programs: the puts `from` makes into
  // `to`, without their waits (interface_puts, the per-rank proof's).
  virtual void interface(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t from, std::int64_t to,
                         const Emit&) const = 0;
};

// The scheme a layer's run options choose (one place).
const SchemeSteps& scheme_steps(const LayerConfig&);
const SchemeSteps& assignment_steps();
const SchemeSteps& rank_steps();

}  // namespace hpmoe::taskflow
