// The verifier's checker (internal to the compiler target), split by what it
// checks: verify_structure.cpp (layouts, reductions, trigger counts),
// verify_execute.cpp (the queues run against the counters, read coverage,
// the per-rank interface), verify_access.cpp (who writes what, and what
// happens before what); verify.cpp holds the rules and the public face.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "compiler/levels.hpp"
#include "compiler/taskflow.hpp"
#include "ops/access.hpp"

namespace hpmoe::taskflow {
namespace verify_detail {

std::string describe(const Program& p, std::int32_t id);

std::string describe_event(const Program& p, std::int32_t ev);

// What a pass starts from, written before the launch: the tokens and the
// step's routing; in the backward also the forward's buffers (saved
// activations), the router's logits and the output gradient.
bool is_input(Pass pass, BufferId b);

struct Write {
  std::int32_t r0, r1, c0, c1;
  std::int32_t rank, task;
  bool accumulate;  // a declared reduction's in-place update (Use::accumulate)
};

// What an event's triggers write into one buffer of the waiting rank: the
// bounding box, and whether their writes fill it.
struct Box {
  BufferId buf;
  std::int64_t r0, r1, c0, c1, area;
  bool full() const { return area == (r1 - r0) * (c1 - c0); }
};

// Up to four buffers that an event's triggers write; more disables the fast path.
struct EventBoxes {
  Box box[4];
  std::uint8_t n = 0;
  bool overflow = false;
  void add(const Box& b) {
    for (std::uint8_t i = 0; i < n; ++i)
      if (box[i].buf == b.buf) {
        box[i].r0 = std::min(box[i].r0, b.r0);
        box[i].r1 = std::max(box[i].r1, b.r1);
        box[i].c0 = std::min(box[i].c0, b.c0);
        box[i].c1 = std::max(box[i].c1, b.c1);
        box[i].area += b.area;
        return;
      }
    if (n == 4) overflow = true;
    else box[n++] = b;
  }
};

struct SlottedWrite {
  std::uint32_t slot;
  Write write;
};

// The programs checked together, one per rank: all ranks' real programs, or
// (the per-rank check) one rank's own program among stand-ins for its peers.
class ProgramSet {
 public:
  explicit ProgramSet(std::span<const Program> programs) {
    for (const auto& p : programs) ptr_.push_back(&p);
  }
  explicit ProgramSet(std::vector<const Program*> programs) : ptr_(std::move(programs)) {}
  const Program& operator[](std::size_t i) const { return *ptr_[i]; }
  std::size_t size() const { return ptr_.size(); }
  struct iterator {
    const Program* const* at;
    const Program& operator*() const { return **at; }
    iterator& operator++() {
      ++at;
      return *this;
    }
    bool operator!=(const iterator& o) const { return at != o.at; }
  };
  iterator begin() const { return {ptr_.data()}; }
  iterator end() const { return {ptr_.data() + ptr_.size()}; }

 private:
  std::vector<const Program*> ptr_;
};




}  // namespace verify_detail

// Storage the checker reuses from one verification to the next.
struct VerifierScratch {
  std::vector<std::int32_t> buffer_slot, triggers, count, first_blocked, work, worker_of;
  std::vector<double> done, cp_done, loads;
  std::vector<std::int64_t> trig_begin, trig_fill, write_begin, write_fill, max_height, stack;
  std::vector<std::pair<std::int32_t, std::int32_t>> trig;
  std::vector<std::uint32_t> visit_stamp;
  std::vector<std::uint8_t> accumulated;  // [rank * buffers + buffer]: some task accumulates into it
  std::vector<verify_detail::Write> writes;
  std::vector<verify_detail::SlottedWrite> flat_writes;
  std::vector<verify_detail::EventBoxes> event_boxes;  // [event of the checked ranks]
  // The per-rank check: the peers' stand-ins, the expected puts out of the
  // rank, its own puts, and each event's level of remote dependence.
  std::vector<Program> stubs;
  std::vector<Task> expected, actual;
  std::vector<std::int8_t> event_dep, event_remote_level;
  std::vector<std::int64_t> event_dep_origin;
};

namespace verify_detail {

class Checker {
 public:
  // focus < 0: every program is a rank's real program, all checked. focus
  // = r: only rank r's program is real; the others stand in for its peers
  // (their puts into r, and events for r's puts to count), and only what r
  // reads and when it may send is checked.
  Checker(ProgramSet programs, VerifierScratch& scratch, const AccessTable& table, std::int32_t focus = -1)
      : p_(std::move(programs)), s_(scratch), table_(table), focus_(focus) {
    for (const auto& p : p_) {
      event_base_.push_back(total_events_);
      total_events_ += static_cast<std::int64_t>(p.events.size());
    }
    boxed_begin_ = focus_ < 0 ? 0 : event_base_[static_cast<std::size_t>(focus_)];
    boxed_end_ = focus_ < 0 ? total_events_ : boxed_begin_ + static_cast<std::int64_t>(p_[static_cast<std::size_t>(focus_)].events.size());
  }

  void structure();

  // A rank's slot parts and declared reductions are well formed: parts
  // inside the intermediate dimension, reductions sorted, disjoint, inside
  // the rank's send rows, each of a split expert.
  void check_split_layout(const Program& p);

  // Every split expert's parts, over all ranks, are parts 0..k-1 once each
  // and their columns tile the intermediate dimension in part order.
  void check_parts_tile_experts();

  // The declared reduction whose blocks (all parts) hold `row` of p's
  // COMB / DCOMB, or null.
  static const Reduction* reduction_block(const Program& p, std::int64_t row);

  // A returned piece of a split expert's part lands in that part's block of
  // a reduction the source declared for it; any other piece lands outside
  // every reduction. So no partial row is combined unreduced.
  void check_partial_put(const Program& p, std::int32_t id);

  // Every declared reduction's target block is accumulated exactly once,
  // element by element, by the rank's own reduce tasks (the write index
  // then orders each after the parts' puts and forbids a second one).
  void check_reduction_coverage();

  void check_trigger_counts();

  // Runs every rank's queues against the counters in any order that respects
  // the waits; also yields the cost model's critical path and makespan.
  template <bool kTiming>
  void execute();

  // No two tasks write the same element of a buffer; every element a task
  // reads is written by tasks it (transitively) waits for.
  void coverage();

  // The per-rank check's interface: rank focus_'s puts to its peers must be
  // exactly the pieces the exchange predicts (`expected`), since every peer
  // checked itself assuming them.
  void match_interface(std::vector<Task>& expected);

  // Every check in order; `expected`: the per-rank check's predicted puts
  // out of the focus rank (null for the whole set).
  VerifyReport prove(std::vector<Task>* expected);

  const std::string& error() const { return error_; }
  double critical() const { return critical_; }
  double makespan() const { return makespan_; }
  const std::vector<double>& loads() const { return loads_; }

 private:
  static std::size_t slot(std::int32_t rank, BufferId b);

  // Writes of every task, grouped by (rank, buffer) with a counting sort, each
  // group ordered by rows; overlapping writes are conflicts.
  void build_write_index();

  // Fast path: R lies inside what the reader's own wait event's triggers
  // write, and they fill it. With no conflicting writes nothing else writes
  // there, so R is covered and race-free. Boxes are computed once per event.
  bool inside_filled_box(std::int32_t r, std::int32_t wait, const Rect& R) const;

  // What the caller takes from a pass is written whole: the forward's
  // output; the backward's dx and every weight gradient, each local slot's
  // over its own part's columns. No task reads these, so the read coverage
  // above does not see a tile that is missing or cut short. (Overlaps are
  // write conflicts already, so the areas add up.)
  void outputs_written();

  // Every write overlapping R must happen before the reader, and together
  // they must cover R.
  void check_read(std::int32_t r, std::int32_t id, const Rect& R);

  [[noreturn]] void level_violation(int worker, std::int32_t id, std::int8_t dep, std::int64_t origin);

  [[noreturn]] void fail(const std::string& message);

  void check_bounds(const Program& owner, const Rect& R, const Program& p, std::int32_t id, const char* verb);

  static constexpr std::size_t kBuffers = static_cast<std::size_t>(BufferId::count);

  void build_trigger_index();

  // Does (pr, pt) finish before (cr, ct) starts, through the chain of waits?
  bool happens_before(std::int32_t pr, std::int32_t pt, std::int32_t cr, std::int32_t ct);

  ProgramSet p_;
  std::vector<std::int64_t> event_base_;
  std::int64_t boxed_begin_ = 0, boxed_end_ = 0;  // events whose writers' boxes are kept
  std::int64_t total_events_ = 0;
  std::string error_;
  double critical_ = 0, makespan_ = 0;
  std::vector<double> loads_;
  VerifierScratch& s_;
  const AccessTable& table_;
  std::uint32_t stamp_ = 0;
  bool trigger_index_built_ = false;
  std::int64_t reached_from_ = -1;  // the wait event whose ancestors visit_stamp == stamp_ marks (happens_before)
  std::int32_t focus_ = -1;
};

}  // namespace verify_detail
}  // namespace hpmoe::taskflow
