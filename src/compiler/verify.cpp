#include <algorithm>
#include <sstream>
#include <tuple>

#include "ops/access.hpp"
#include "hpmoe/error.hpp"
#include "compiler/taskflow.hpp"
#include "compiler/layout.hpp"

namespace hpmoe::taskflow {

namespace {

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

// What a pass starts from: the tokens, and in the backward the forward's
// buffers (saved activations) and the output gradient.
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

// Levels of the events that other ranks' puts feed: the dispatch of rows to
// experts (forward recv tiles, backward dy tiles) is level 0, the return of
// expert outputs to their sources (comb_done, dx_ready) level 1. A put into a
// peer's level-l event may depend only on local events and on remote-fed
// events of levels below l (docs/architecture.md, the per-rank proof).
// The kind of task that waits on the event a put signals at its peer.
TaskKind remote_consumer(TaskKind put) {
  switch (put) {
    case TaskKind::dispatch_put: return TaskKind::gemm_gate_up;
    case TaskKind::dispatch_cast_put: return TaskKind::dispatch_decode;
    case TaskKind::grad_dispatch_put: return TaskKind::gemm_down_dgrad;
    case TaskKind::grad_dispatch_cast_put: return TaskKind::grad_dispatch_decode;
    case TaskKind::dispatch_token_put: case TaskKind::dispatch_route_put: case TaskKind::combine_route_put:
      return TaskKind::dispatch_gather;
    case TaskKind::grad_dispatch_token_put: case TaskKind::grad_dispatch_forward: return TaskKind::grad_dispatch_gather;
    case TaskKind::dispatch_forward: return TaskKind::dispatch_gather;
    case TaskKind::dispatch_node_put: case TaskKind::dispatch_node_route_put: return TaskKind::dispatch_forward;
    case TaskKind::grad_dispatch_node_put: return TaskKind::grad_dispatch_forward;
    case TaskKind::combine_put: return TaskKind::combine_reduce;
    case TaskKind::combine_rank_put: return TaskKind::combine_rank_reduce;
    case TaskKind::gate_grad_put: return TaskKind::gate_grad_gather;
    case TaskKind::grad_combine_rank_put: return TaskKind::grad_rank_reduce;
    case TaskKind::combine_node_part_put: return TaskKind::combine_node_put;
    case TaskKind::combine_node_put: return TaskKind::combine_rank_reduce;
    case TaskKind::grad_combine_node_part_put: return TaskKind::grad_combine_node_put;
    case TaskKind::grad_combine_node_put: return TaskKind::grad_rank_reduce;
    case TaskKind::weight_put: return TaskKind::weight_relay;
    case TaskKind::grad_weight_put: return TaskKind::grad_weight_relay;
    default: return TaskKind::grad_reduce;
  }
}

std::int8_t put_level(TaskKind put) {
  switch (put) {
    case TaskKind::dispatch_put: case TaskKind::dispatch_cast_put: case TaskKind::grad_dispatch_put:
    case TaskKind::grad_dispatch_cast_put: case TaskKind::dispatch_token_put: case TaskKind::dispatch_route_put:
    case TaskKind::grad_dispatch_token_put: case TaskKind::combine_route_put: case TaskKind::dispatch_node_put:
    case TaskKind::dispatch_node_route_put: case TaskKind::grad_dispatch_node_put:
    // Lent weights wait for nothing: they travel with the dispatch.
    case TaskKind::weight_put: case TaskKind::grad_weight_put:
      return 0;
    // The per-node exchange's second hop: a forwarder's puts wait for
    // node blocks that other ranks put.
    case TaskKind::dispatch_forward: case TaskKind::grad_dispatch_forward:
      return 1;
    // The per-rank combine returns after rows that may have come through a
    // forwarder: the sums and the gate gradients (which the router, and so
    // dx, wait for) at level 2, the backward's dx sums, which may be queued
    // after the router, at level 3.
    // The per-node combine's sums go to the forwarder at the level of the
    // per-rank sums, and the forwarder's return one level up.
    case TaskKind::combine_rank_put: case TaskKind::gate_grad_put: case TaskKind::combine_node_part_put:
      return 2;
    case TaskKind::grad_combine_rank_put: case TaskKind::combine_node_put: case TaskKind::grad_combine_node_part_put:
      return 3;
    case TaskKind::grad_combine_node_put:
      return 4;
    default:
      return 1;
  }
}


}  // namespace

// Storage the checker reuses from one verification to the next.
struct VerifierScratch {
  std::vector<std::int32_t> buffer_slot, triggers, count, first_blocked, work, worker_of;
  std::vector<double> done, cp_done, loads;
  std::vector<std::int64_t> trig_begin, trig_fill, write_begin, write_fill, max_height, stack;
  std::vector<std::pair<std::int32_t, std::int32_t>> trig;
  std::vector<std::uint32_t> visit_stamp;
  std::vector<std::uint8_t> accumulated;  // [rank * buffers + buffer]: some task accumulates into it
  std::vector<Write> writes;
  std::vector<SlottedWrite> flat_writes;
  std::vector<EventBoxes> event_boxes;  // [event of the checked ranks]
  // The per-rank check: the peers' stand-ins, the expected puts out of the
  // rank, its own puts, and each event's level of remote dependence.
  std::vector<Program> stubs;
  std::vector<Task> expected, actual;
  std::vector<std::int8_t> event_dep, event_remote_level;
  std::vector<std::int64_t> event_dep_origin;
};

namespace {

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

  void structure() {
    const std::int32_t P = static_cast<std::int32_t>(p_.size());
    s_.buffer_slot.assign(static_cast<std::size_t>(P) * kBuffers, -1);
    for (std::int32_t r = 0; r < P; ++r)
      for (std::size_t b = 0; b < p_[r].buffers.size(); ++b) {
        const auto id = static_cast<std::size_t>(p_[r].buffers[b].id);
        if (id == 0 || id >= kBuffers) fail("rank " + std::to_string(r) + " has a buffer with an invalid id");
        if (s_.buffer_slot[static_cast<std::size_t>(r) * kBuffers + id] >= 0)
          fail(std::string("rank ") + std::to_string(r) + " lists buffer " + name(p_[r].buffers[b].id) + " twice");
        s_.buffer_slot[static_cast<std::size_t>(r) * kBuffers + id] = static_cast<std::int32_t>(b);
      }
    // Expert layouts first: tasks are checked against every rank's.
    for (std::int32_t r = 0; r < P; ++r) {
      const Program& p = p_[r];
      if (p.expert_begin.size() != p.local_experts.size() + 1 || p.kpad_begin.size() != p.expert_begin.size() ||
          p.expert_slot.size() != static_cast<std::size_t>(p.dims.experts) || p.dims.experts != p_[0].dims.experts)
        fail("rank " + std::to_string(r) + " has a malformed expert layout");
      for (std::size_t le = 0; le < p.local_experts.size(); ++le)
        if (p.slot_of(p.local_experts[le]) != static_cast<std::int64_t>(le))
          fail("rank " + std::to_string(r) + " lists expert " + std::to_string(p.local_experts[le]) + " in slot " +
               std::to_string(le) + " but its slot table disagrees");
      for (std::size_t le = 0; le + 1 < p.expert_begin.size(); ++le)
        if (p.expert_begin[le] < 0 || p.expert_begin[le + 1] < p.expert_begin[le] || p.kpad_begin[le] < 0 ||
            p.kpad_begin[le + 1] < p.kpad_begin[le])
          fail("rank " + std::to_string(r) + " has expert regions out of order");
      check_split_layout(p);
    }
    check_parts_tile_experts();
    for (std::int32_t r = 0; r < P; ++r) {
      const Program& p = p_[r];
      if (p.rank != r || p.ranks != P)
        fail("program " + std::to_string(r) + " says it is rank " + std::to_string(p.rank) + " of " +
             std::to_string(p.ranks) + ", expected " + std::to_string(r) + " of " + std::to_string(P));
      if (p.pass != p_[0].pass) fail("rank " + std::to_string(r) + " runs a different pass from rank 0");
      const int W = p.machine.workers();
      if (static_cast<int>(p.queue_begin.size()) != W + 1 || p.queue_begin.front() != 0 ||
          p.queue_begin.back() != static_cast<std::int32_t>(p.queue_tasks.size()))
        fail("rank " + std::to_string(r) + " has malformed queues for " + std::to_string(W) + " workers");
      if (p.cost.size() != p.tasks.size()) fail("rank " + std::to_string(r) + " lacks task costs");
      // Each task's worker, written in queue order into a small array, then
      // checked in task order: the tasks are read once, front to back.
      auto& worker_of = s_.worker_of;
      worker_of.assign(p.tasks.size(), -1);
      for (int w = 0; w < W; ++w)
        for (auto i = p.queue_begin[w]; i < p.queue_begin[w + 1]; ++i) {
          const auto id = p.queue_tasks[i];
          if (id < 0 || id >= static_cast<std::int32_t>(p.tasks.size()))
            fail("rank " + std::to_string(r) + " worker " + std::to_string(w) + " queues task " + std::to_string(id) +
                 " which does not exist");
          if (worker_of[id] >= 0) fail(describe(p, id) + " is queued twice");
          worker_of[id] = w;
        }
      for (std::size_t i = 0; i < worker_of.size(); ++i) {
        const auto id = static_cast<std::int32_t>(i);
        if (worker_of[i] < 0) fail(describe(p, id) + " is on no worker's queue");
        if (!p.machine.takes(worker_of[i], p.tasks[i].queue))
          fail(describe(p, id) + " is a " + name(p.tasks[i].queue) + " task on worker " + std::to_string(worker_of[i]) +
               " which does not take that class");
      }
      // Buffers: sane sizes, none overlapping another of its region. Each
      // rank sizes its buffers for its own rows; a put is checked against
      // the target rank's declared buffer (check_bounds with its program).
      for (const auto& b : p.buffers) {
        if (b.rows < 0 || b.cols < 0 || b.offset_bytes < 0 || (b.elem_bytes != 1 && b.elem_bytes != 2 && b.elem_bytes != 4 && b.elem_bytes != 8) ||
            b.rows > (std::int64_t{1} << 31) || b.cols > (std::int64_t{1} << 31))
          fail("rank " + std::to_string(r) + " declares buffer " + name(b.id) + " with an impossible shape");
        if (b.region != Region::symmetric) continue;
        const BufferLayout* first = p_[0].buffer(b.id);
        if (!first || first->region != Region::symmetric || first->cols != b.cols || first->elem_bytes != b.elem_bytes)
          fail("rank " + std::to_string(r) + " declares put target " + name(b.id) + " unlike rank 0 (its width or element type)");
      }
      for (std::size_t a = 0; a < p.buffers.size(); ++a)
        for (std::size_t b = a + 1; b < p.buffers.size(); ++b) {
          const auto& x = p.buffers[a];
          const auto& y = p.buffers[b];
          const std::int64_t xe = x.offset_bytes + x.rows * x.cols * x.elem_bytes;
          const std::int64_t ye = y.offset_bytes + y.rows * y.cols * y.elem_bytes;
          if (x.region != y.region || x.region == Region::bound) continue;  // separate memory
          if (x.offset_bytes < ye && y.offset_bytes < xe && x.rows * x.cols > 0 && y.rows * y.cols > 0)
            fail(std::string("rank ") + std::to_string(r) + " buffers " + name(x.id) + " and " + name(y.id) + " overlap");
        }
      for (std::size_t i = 0; i < p.tasks.size(); ++i) {
        const Task& t = p.tasks[i];
        const auto id = static_cast<std::int32_t>(i);
        if (t.peer < 0 || t.peer >= P) fail(describe(p, id) + " targets rank " + std::to_string(t.peer) + " which does not exist");
        if (t.kind == TaskKind::combine_put || t.kind == TaskKind::grad_combine_put) check_partial_put(p, id);
        if (t.wait_event < -1 || t.wait_event >= static_cast<std::int32_t>(p.events.size()))
          fail(describe(p, id) + " waits on event " + std::to_string(t.wait_event) + " which does not exist");
        if (t.trigger_event < -1 || t.trigger_event >= static_cast<std::int32_t>(p_[t.peer].events.size()))
          fail(describe(p, id) + " triggers event " + std::to_string(t.trigger_event) + " on rank " +
               std::to_string(t.peer) + " which does not exist");
        if (t.wait_event >= 0 && t.wait_count != p.events[t.wait_event].required)
          fail(describe(p, id) + " waits for " + describe_event(p, t.wait_event) + " to reach " +
               std::to_string(t.wait_count) + " but it completes at " + std::to_string(p.events[t.wait_event].required));
        if (t.rows < 0 || t.cols < 0) fail(describe(p, id) + " has a negative tile size");
        if (static_cast<std::size_t>(t.kind) >= static_cast<std::size_t>(TaskKind::count))
          fail("rank " + std::to_string(r) + " task #" + std::to_string(id) + " has no known kind");
        // The expert a task names lives where the task needs it.
        const ExpertHome home = table_[t.kind].expert_home;
        if (home == ExpertHome::none) {
          if (t.expert != -1) fail(describe(p, id) + " names an expert, which a " + name(t.kind) + " task has none of");
          continue;
        }
        if (t.expert < 0 || t.expert >= p.dims.experts)
          fail(describe(p, id) + " names expert " + std::to_string(t.expert) + ", which does not exist (the layer has " +
               std::to_string(p.dims.experts) + ")");
        const std::int32_t where = home == ExpertHome::own_rank ? r : t.peer;
        if (p_[where].expert_slot[static_cast<std::size_t>(t.expert)] < 0)
          fail(describe(p, id) + " needs expert " + std::to_string(t.expert) + " on rank " + std::to_string(where) +
               ", which does not hold it");
      }
    }
  }

  // A rank's slot parts and declared reductions are well formed: parts
  // inside the intermediate dimension, reductions sorted, disjoint, inside
  // the rank's send rows, each of a split expert.
  void check_split_layout(const Program& p) {
    const std::string who = "rank " + std::to_string(p.rank);
    if (p.slot_parts.size() != p.local_experts.size()) fail(who + " lacks a slot part per local expert");
    for (std::size_t le = 0; le < p.slot_parts.size(); ++le) {
      const SlotPart& sp = p.slot_parts[le];
      if (sp.inter_begin < 0 || sp.inter < 1 || sp.inter_begin + sp.inter > p.dims.inter || sp.parts < 1 || sp.part < 0 ||
          sp.part >= sp.parts || (sp.parts == 1 && sp.inter != p.dims.inter))
        fail(who + " slot " + std::to_string(le) + " (expert " + std::to_string(p.local_experts[le]) +
             ") computes an impossible part: columns [" + std::to_string(sp.inter_begin) + ", +" + std::to_string(sp.inter) +
             ") part " + std::to_string(sp.part) + " of " + std::to_string(sp.parts) + " of an intermediate size " +
             std::to_string(p.dims.inter));
    }
    std::int64_t end = 0;
    for (const Reduction& red : p.reductions) {
      if (red.expert < 0 || red.expert >= p.dims.experts || red.parts < 2 || red.rows < 1 || red.row_begin < end ||
          red.row_begin + red.parts * red.rows > p.send_rows)
        fail(who + " declares an impossible reduction (expert " + std::to_string(red.expert) + ", " +
             std::to_string(red.parts) + " parts of " + std::to_string(red.rows) + " rows at row " +
             std::to_string(red.row_begin) + "): reductions must be of split experts, in order, disjoint and inside its " +
             std::to_string(p.send_rows) + " send rows");
      end = red.row_begin + red.parts * red.rows;
    }
  }

  // Every split expert's parts, over all ranks, are parts 0..k-1 once each
  // and their columns tile the intermediate dimension in part order.
  void check_parts_tile_experts() {
    std::vector<std::vector<SlotPart>> parts(static_cast<std::size_t>(p_[0].dims.experts));
    for (const auto& p : p_)
      for (std::size_t le = 0; le < p.slot_parts.size(); ++le)
        if (p.slot_parts[le].parts > 1) parts[static_cast<std::size_t>(p.local_experts[le])].push_back(p.slot_parts[le]);
    for (std::size_t e = 0; e < parts.size(); ++e) {
      auto& list = parts[e];
      if (list.empty()) continue;
      std::sort(list.begin(), list.end(), [](const SlotPart& a, const SlotPart& b) { return a.part < b.part; });
      std::int64_t next = 0;
      bool ok = static_cast<std::int64_t>(list.size()) == list.front().parts;
      for (std::size_t j = 0; ok && j < list.size(); ++j) {
        ok = list[j].part == static_cast<std::int32_t>(j) && list[j].parts == list.front().parts && list[j].inter_begin == next;
        next = list[j].inter_begin + list[j].inter;
      }
      if (!ok || next != p_[0].dims.inter)
        fail("the parts of split expert " + std::to_string(e) + " over the ranks do not tile its intermediate dimension [0, " +
             std::to_string(p_[0].dims.inter) + ") once each, in part order");
    }
  }

  // The declared reduction whose blocks (all parts) hold `row` of p's
  // COMB / DCOMB, or null.
  static const Reduction* reduction_block(const Program& p, std::int64_t row) {
    auto it = std::upper_bound(p.reductions.begin(), p.reductions.end(), row,
                               [](std::int64_t v, const Reduction& x) { return v < x.row_begin; });
    if (it == p.reductions.begin()) return nullptr;
    --it;
    return row < it->row_begin + it->parts * it->rows ? &*it : nullptr;
  }

  // A returned piece of a split expert's part lands in that part's block of
  // a reduction the source declared for it; any other piece lands outside
  // every reduction. So no partial row is combined unreduced.
  void check_partial_put(const Program& p, std::int32_t id) {
    const Task& t = p.tasks[static_cast<std::size_t>(id)];
    const std::int64_t slot = p.slot_of(t.expert);
    if (slot < 0 || t.rows <= 0) return;  // the expert check names it
    const SlotPart& sp = p.slot_parts[static_cast<std::size_t>(slot)];
    const Program& target = p_[static_cast<std::size_t>(t.peer)];
    const Reduction* red = reduction_block(target, t.row_begin);
    const Reduction* last = reduction_block(target, std::int64_t{t.row_begin} + t.rows - 1);
    if (sp.parts == 1) {
      if (red || last)
        fail(describe(p, id) + " returns whole-expert rows into a reduction that rank " + std::to_string(t.peer) +
             " declared for split expert " + std::to_string((red ? red : last)->expert));
      return;
    }
    const std::int64_t lo = red ? red->row_begin + sp.part * red->rows : 0;
    if (!red || red != last || red->expert != t.expert || red->parts != sp.parts || t.row_begin < lo ||
        std::int64_t{t.row_begin} + t.rows > lo + red->rows)
      fail(describe(p, id) + " returns part " + std::to_string(sp.part) + " of " + std::to_string(sp.parts) +
           " of split expert " + std::to_string(t.expert) + " into rows [" + std::to_string(t.row_begin) + ", " +
           std::to_string(std::int64_t{t.row_begin} + t.rows) + ") of rank " + std::to_string(t.peer) +
           ", outside that part's block of a reduction declared for it: its partial sums would not be reduced");
  }

  // Every declared reduction's target block is accumulated exactly once,
  // element by element, by the rank's own reduce tasks (the write index
  // then orders each after the parts' puts and forbids a second one).
  void check_reduction_coverage() {
    for (std::int32_t r = 0; r < static_cast<std::int32_t>(p_.size()); ++r) {
      if (focus_ >= 0 && r != focus_) continue;
      const Program& p = p_[r];
      std::vector<std::int64_t> area(p.reductions.size(), 0);
      for (std::size_t i = 0; i < p.tasks.size(); ++i)
        table_.for_each(p, p.tasks[i], Use::write, [&](const Operand& o) {
          if (o.use != Use::accumulate || o.rect.area() == 0) return;
          const Reduction* red = p.reduction_at(o.rect.r0);
          if (!red || o.rect.r1 > red->row_begin + red->rows || o.rank != r)
            fail(describe(p, static_cast<std::int32_t>(i)) + " accumulates into " + name(o.rect.buffer) + " rows [" +
                 std::to_string(o.rect.r0) + ", " + std::to_string(o.rect.r1) + ") outside every declared reduction");
          area[static_cast<std::size_t>(red - p.reductions.data())] += o.rect.area();
        });
      for (std::size_t k = 0; k < p.reductions.size(); ++k) {
        const Reduction& red = p.reductions[k];
        if (area[k] != red.rows * p.dims.hidden)
          fail("rank " + std::to_string(r) + " reduces " + std::to_string(area[k]) + " of the " +
               std::to_string(red.rows * p.dims.hidden) + " elements of its reduction of split expert " +
               std::to_string(red.expert) + " (rows [" + std::to_string(red.row_begin) + ", " +
               std::to_string(red.row_begin + red.rows) + ")): every partial row must be summed exactly once");
      }
    }
  }

  void check_trigger_counts() {
    const std::int32_t P = static_cast<std::int32_t>(p_.size());
    // Every event is triggered exactly as often as it requires.
    auto& triggers = s_.triggers;
    triggers.assign(static_cast<std::size_t>(total_events_), 0);
    for (const auto& p : p_)
      for (const auto& t : p.tasks)
        if (t.trigger_event >= 0) ++triggers[event_base_[t.peer] + t.trigger_event];
    for (std::int32_t r = 0; r < P; ++r)
      for (std::size_t e = 0; e < p_[r].events.size(); ++e)
        if (triggers[event_base_[r] + static_cast<std::int64_t>(e)] != p_[r].events[e].required)
          fail(describe_event(p_[r], static_cast<std::int32_t>(e)) + " requires " +
               std::to_string(p_[r].events[e].required) + " triggers but is triggered by " +
               std::to_string(triggers[event_base_[r] + static_cast<std::int64_t>(e)]) + " tasks");
  }

  // Runs every rank's queues against the counters in any order that respects
  // the waits; also yields the cost model's critical path and makespan.
  template <bool kTiming>
  void execute() {
    auto& count = s_.count;
    auto& done = s_.done;
    auto& cp_done = s_.cp_done;
    auto& first_blocked = s_.first_blocked;
    count.assign(static_cast<std::size_t>(total_events_), 0);
    if constexpr (kTiming) {
      done.assign(static_cast<std::size_t>(total_events_), 0.0);
      cp_done.assign(static_cast<std::size_t>(total_events_), 0.0);
    }
    first_blocked.assign(static_cast<std::size_t>(total_events_), -1);
    struct Worker {
      std::int32_t rank, w, head, end, next_blocked;
      double time;
      // The highest level of remote-fed event that this worker's tasks so
      // far depend on (-1: none), and that event (per-rank check only).
      std::int8_t dep = -1;
      std::int64_t dep_origin = -1;
    };
    std::vector<Worker> workers;
    for (std::int32_t r = 0; r < static_cast<std::int32_t>(p_.size()); ++r)
      for (int w = 0; w < p_[r].machine.workers(); ++w)
        workers.push_back(Worker{r, w, p_[r].queue_begin[w], p_[r].queue_begin[w + 1], -1, 0.0});
    const bool levels = focus_ >= 0;
    if (levels) {
      s_.event_dep.assign(static_cast<std::size_t>(total_events_), -1);
      s_.event_dep_origin.assign(static_cast<std::size_t>(total_events_), -1);
    }
    loads_.assign(workers.size(), 0.0);
    auto& work = s_.work;
    work.resize(workers.size());
    for (std::size_t i = 0; i < work.size(); ++i) work[i] = static_cast<std::int32_t>(work.size() - 1 - i);
    while (!work.empty()) {
      const auto wi = work.back();
      work.pop_back();
      Worker& wk = workers[wi];
      const Program& p = p_[wk.rank];
      while (wk.head < wk.end) {
        const auto id = p.queue_tasks[wk.head];
        const Task& t = p.tasks[id];
        double start = wk.time, cp_start = 0;
        if (t.wait_event >= 0) {
          const auto ev = event_base_[wk.rank] + t.wait_event;
          if (count[ev] < t.wait_count) {
            wk.next_blocked = first_blocked[ev];
            first_blocked[ev] = wi;
            break;
          }
          if constexpr (kTiming) {
            start = std::max(start, done[ev]);
            cp_start = cp_done[ev];
          }
        }
        if (levels) {
          if (t.wait_event >= 0) {
            const auto ev = event_base_[wk.rank] + t.wait_event;
            if (s_.event_dep[ev] > wk.dep) {
              wk.dep = s_.event_dep[ev];
              wk.dep_origin = s_.event_dep_origin[ev];
            }
          }
          if (wk.rank == focus_ && t.peer != focus_ && wk.dep >= put_level(t.kind)) level_violation(wk.w, id, wk.dep, wk.dep_origin);
        }
        if constexpr (kTiming) {
          const double cost = double(p.cost[id]);
          wk.time = start + cost;
          loads_[wi] += cost;
          makespan_ = std::max(makespan_, wk.time);
          critical_ = std::max(critical_, cp_start + cost);
        }
        if (t.trigger_event >= 0) {
          const auto ev = event_base_[t.peer] + t.trigger_event;
          ++count[ev];
          if (levels) {
            std::int8_t dep = wk.dep;
            std::int64_t origin = wk.dep_origin;
            if (wk.rank != focus_ && t.peer == focus_ && put_level(t.kind) > dep) {  // a peer's put feeds this event
              dep = put_level(t.kind);
              origin = ev;
            }
            if (dep > s_.event_dep[ev]) {
              s_.event_dep[ev] = dep;
              s_.event_dep_origin[ev] = origin;
            }
          }
          if constexpr (kTiming) {
            done[ev] = std::max(done[ev], wk.time);
            cp_done[ev] = std::max(cp_done[ev], cp_start + double(p.cost[id]));
          }
          for (auto b = first_blocked[ev]; b >= 0; b = workers[b].next_blocked) work.push_back(b);
          first_blocked[ev] = -1;
        }
        ++wk.head;
      }
    }
    bool stuck = false;
    for (const auto& wk : workers) stuck = stuck || wk.head < wk.end;
    // Every task ran exactly once, so each counter now holds its event's
    // trigger count; a mismatch (or, on a deadlock, a missing trigger) is
    // reported as the more precise cause.
    if (stuck) check_trigger_counts();
    for (std::int32_t r = 0; r < static_cast<std::int32_t>(p_.size()); ++r)
      for (std::size_t e = 0; e < p_[r].events.size(); ++e)
        if (count[event_base_[r] + static_cast<std::int64_t>(e)] != p_[r].events[e].required) check_trigger_counts();
    for (const auto& wk : workers) {
      if (wk.head >= wk.end) continue;
      const Program& p = p_[wk.rank];
      const Task& t = p.tasks[p.queue_tasks[wk.head]];
      fail("deadlock: " + describe(p, p.queue_tasks[wk.head]) + " on worker " + std::to_string(wk.w) + " waits for " +
           describe_event(p, t.wait_event) + ", which reached " +
           std::to_string(count[event_base_[wk.rank] + t.wait_event]) + " of " + std::to_string(t.wait_count));
    }
  }

  // No two tasks write the same element of a buffer; every element a task
  // reads is written by tasks it (transitively) waits for.
  void coverage() {
    const std::int32_t P = static_cast<std::int32_t>(p_.size());
    trigger_index_built_ = false;
    build_write_index();
    // Tiles of one row band read the same rectangle with the same wait:
    // check it once. Column-tile reads of panel operands are widened to the
    // full width, which covers every tile of the band.
    struct Checked {
      std::int64_t r0 = -1, r1 = -1, c0 = -1, c1 = -1;
      std::int32_t wait = -2;
    };
    std::vector<Checked> last(kBuffers);
    for (std::int32_t r = 0; r < P; ++r) {
      if (focus_ >= 0 && r != focus_) continue;  // stand-ins read nothing that is checked
      const Program& p = p_[r];
      std::fill(last.begin(), last.end(), Checked{});
      const auto same_band = [](const Task& x, const Task& y) {
        return x.kind == y.kind && x.row_begin == y.row_begin && x.rows == y.rows && x.wait_event == y.wait_event &&
               x.src_row == y.src_row && x.expert == y.expert && queue_class(y.kind) == QueueClass::matrix;
      };
      std::int64_t band_c0 = 0, band_c1 = 0;
      for (std::size_t i = 0; i < p.tasks.size(); ++i) {
        const Task& t = p.tasks[i];
        // The next column tile of the same row band reads what the previous
        // one read (column-tile reads are widened below to the columns of
        // the whole band): already checked.
        if (i > 0 && same_band(p.tasks[i - 1], t)) continue;
        band_c0 = t.col_begin;
        band_c1 = std::int64_t{t.col_begin} + t.cols;
        for (std::size_t j = i + 1; j < p.tasks.size() && same_band(p.tasks[j - 1], p.tasks[j]); ++j) {
          band_c0 = std::min<std::int64_t>(band_c0, p.tasks[j].col_begin);
          band_c1 = std::max<std::int64_t>(band_c1, std::int64_t{p.tasks[j].col_begin} + p.tasks[j].cols);
        }
        table_.for_each(p, t, Use::read, [&](const Operand& o) {
          Rect R = o.rect;
          if (R.area() == 0) return;
          if (is_input(p.pass, R.buffer)) {
            check_bounds(p, R, p, static_cast<std::int32_t>(i), "reads");
            return;
          }
          if (o.by_column_tiles) {
            check_bounds(p, R, p, static_cast<std::int32_t>(i), "reads");
            R.c0 = band_c0;
            R.c1 = band_c1;
          }
          Checked& seen = last[static_cast<std::size_t>(R.buffer)];
          if (seen.r0 == R.r0 && seen.r1 == R.r1 && seen.c0 == R.c0 && seen.c1 == R.c1 && seen.wait == t.wait_event) return;
          seen = Checked{R.r0, R.r1, R.c0, R.c1, t.wait_event};
          check_bounds(p, R, p, static_cast<std::int32_t>(i), "reads");
          if (!inside_filled_box(r, t.wait_event, R)) check_read(r, static_cast<std::int32_t>(i), R);
        });
      }
    }
  }

  // The per-rank check's interface: rank focus_'s puts to its peers must be
  // exactly the pieces the exchange predicts (`expected`), since every peer
  // checked itself assuming them.
  void match_interface(std::vector<Task>& expected) {
    const Program& p = p_[static_cast<std::size_t>(focus_)];
    auto& actual = s_.actual;
    actual.clear();
    for (const auto& t : p.tasks)
      if (t.peer != focus_) actual.push_back(t);
    const auto key = [](const Task& t) {
      return std::tuple(t.peer, t.kind, t.trigger_event, t.row_begin, t.col_begin, t.rows, t.cols, t.src_row, t.expert,
                        t.src, t.dst);
    };
    const auto before = [&](const Task& a, const Task& b) { return key(a) < key(b); };
    std::sort(actual.begin(), actual.end(), before);
    std::sort(expected.begin(), expected.end(), before);
    const auto describe_put = [](const Task& t) {
      std::ostringstream o;
      o << name(t.kind) << " of expert " << t.expert << " into rank " << t.peer << "'s " << name(t.dst) << " rows ["
        << t.row_begin << ", " << t.row_begin + t.rows << ") cols [" << t.col_begin << ", " << t.col_begin + t.cols
        << ") from rows [" << t.src_row << ", " << t.src_row + t.rows << "), signalling its event " << t.trigger_event;
      return o.str();
    };
    for (const auto& t : actual)
      if (!std::binary_search(expected.begin(), expected.end(), t, before))
        fail("interface: rank " + std::to_string(focus_) + " makes a put the routing counts do not predict (" +
             describe_put(t) + "); its peers proved their programs assuming only the predicted pieces");
    for (const auto& t : expected)
      if (!std::binary_search(actual.begin(), actual.end(), t, before))
        fail("interface: rank " + std::to_string(focus_) + " lacks a put that the routing counts predict (" +
             describe_put(t) + "); its peer counts on it");
    if (actual.size() != expected.size())
      fail("interface: rank " + std::to_string(focus_) + " makes " + std::to_string(actual.size()) +
           " puts to its peers where the routing counts predict " + std::to_string(expected.size()) + " (one twice)");
  }

  // Every check in order; `expected`: the per-rank check's predicted puts
  // out of the focus rank (null for the whole set).
  VerifyReport prove(std::vector<Task>* expected) {
    try {
      structure();
      check_reduction_coverage();
      if (expected) match_interface(*expected);
      execute<false>();
      coverage();
      outputs_written();
      return {};
    } catch (const Error& e) {
      return {false, e.what()};
    }
  }

  const std::string& error() const { return error_; }
  double critical() const { return critical_; }
  double makespan() const { return makespan_; }
  const std::vector<double>& loads() const { return loads_; }

 private:
  static std::size_t slot(std::int32_t rank, BufferId b) {
    return static_cast<std::size_t>(rank) * kBuffers + static_cast<std::size_t>(b);
  }

  // Writes of every task, grouped by (rank, buffer) with a counting sort, each
  // group ordered by rows; overlapping writes are conflicts.
  void build_write_index() {
    const std::int32_t P = static_cast<std::int32_t>(p_.size());
    s_.write_begin.assign(static_cast<std::size_t>(P) * kBuffers + 1, 0);
    s_.event_boxes.assign(static_cast<std::size_t>(boxed_end_ - boxed_begin_), EventBoxes{});
    auto& flat = s_.flat_writes;  // one pass over the tasks, then a counting sort
    flat.clear();
    s_.accumulated.assign(static_cast<std::size_t>(P) * kBuffers, 0);
    for (std::int32_t r = 0; r < P; ++r)
      for (std::size_t i = 0; i < p_[r].tasks.size(); ++i) {
        const Task& t = p_[r].tasks[i];
        table_.for_each(p_[r], t, Use::write, [&](const Operand& o) {
          const Rect& w = o.rect;
          check_bounds(p_[o.rank], w, p_[r], static_cast<std::int32_t>(i), "writes");
          if (w.area() == 0) return;
          const auto where = slot(o.rank, w.buffer);
          ++s_.write_begin[where + 1];
          const bool accumulate = o.use == Use::accumulate;
          const std::int64_t ev = t.trigger_event >= 0 ? event_base_[t.peer] + t.trigger_event : -1;
          // Accumulations are not what fills a buffer: they stay out of the
          // fast path's boxes, and buffers with them take the full check.
          if (accumulate) s_.accumulated[where] = 1;
          else if (ev >= boxed_begin_ && ev < boxed_end_)
            s_.event_boxes[static_cast<std::size_t>(ev - boxed_begin_)].add(Box{w.buffer, w.r0, w.r1, w.c0, w.c1, w.area()});
          flat.push_back(SlottedWrite{static_cast<std::uint32_t>(where),
                                      Write{static_cast<std::int32_t>(w.r0), static_cast<std::int32_t>(w.r1),
                                            static_cast<std::int32_t>(w.c0), static_cast<std::int32_t>(w.c1), r,
                                            static_cast<std::int32_t>(i), accumulate}});
        });
      }
    for (std::size_t i = 1; i < s_.write_begin.size(); ++i) s_.write_begin[i] += s_.write_begin[i - 1];
    s_.writes.resize(flat.size());
    auto& fill = s_.write_fill;
    fill.assign(s_.write_begin.begin(), s_.write_begin.end() - 1);
    for (const auto& sw : flat) s_.writes[static_cast<std::size_t>(fill[sw.slot]++)] = sw.write;
    s_.max_height.assign(static_cast<std::size_t>(P) * kBuffers, 0);
    const auto before = [](const Write& a, const Write& b) {
      return a.r0 != b.r0 ? a.r0 < b.r0 : (a.r1 != b.r1 ? a.r1 < b.r1 : a.c0 < b.c0);
    };
    for (std::size_t k = 0; k + 1 < s_.write_begin.size(); ++k) {
      const auto first = s_.writes.begin() + s_.write_begin[k], last = s_.writes.begin() + s_.write_begin[k + 1];
      if (!std::is_sorted(first, last, before)) std::sort(first, last, before);
      for (auto a = first; a != last; ++a) {
        s_.max_height[k] = std::max<std::int64_t>(s_.max_height[k], a->r1 - a->r0);
        // Later writes starting within this one's rows must not share columns.
        for (auto b = a + 1; b != last && b->r0 < a->r1; ++b) {
          if (b->c0 < a->c1 && a->c0 < b->c1) {
            // A declared reduction may update what one plain write wrote,
            // after it; two plain writes, or two updates, of one element conflict.
            const Write* plain = a->accumulate ? &*b : &*a;
            const Write* update = a->accumulate ? &*a : &*b;
            const bool ordered = a->accumulate != b->accumulate &&
                                 happens_before(plain->rank, plain->task, update->rank, update->task);
            if (!ordered)
              fail("write conflict in buffer " + std::string(name(static_cast<BufferId>(k % kBuffers))) + " of rank " +
                   std::to_string(k / kBuffers) + ": " + describe(p_[a->rank], a->task) + " and " +
                   describe(p_[b->rank], b->task) +
                   (a->accumulate && b->accumulate ? " (both accumulate: each element is reduced once)"
                    : a->accumulate || b->accumulate ? " (the reduction does not wait for the write it updates)"
                                                     : ""));
          }
          if (b->r0 == a->r0 && b->r1 == a->r1) break;  // same band, sorted by column
        }
      }
    }
  }

  // Fast path: R lies inside what the reader's own wait event's triggers
  // write, and they fill it. With no conflicting writes nothing else writes
  // there, so R is covered and race-free. Boxes are computed once per event.
  bool inside_filled_box(std::int32_t r, std::int32_t wait, const Rect& R) const {
    if (wait < 0 || s_.accumulated[slot(r, R.buffer)]) return false;
    const std::int64_t ev = event_base_[r] + wait;
    if (ev < boxed_begin_ || ev >= boxed_end_) return false;
    const EventBoxes& boxes = s_.event_boxes[static_cast<std::size_t>(ev - boxed_begin_)];
    if (boxes.overflow) return false;
    for (std::uint8_t b = 0; b < boxes.n; ++b) {
      const Box& box = boxes.box[b];
      if (box.buf == R.buffer)
        return box.full() && box.r0 <= R.r0 && R.r1 <= box.r1 && box.c0 <= R.c0 && R.c1 <= box.c1;
    }
    return false;
  }

  // What the caller takes from a pass is written whole: the forward's
  // output; the backward's dx and every weight gradient, each local slot's
  // over its own part's columns. No task reads these, so the read coverage
  // above does not see a tile that is missing or cut short. (Overlaps are
  // write conflicts already, so the areas add up.)
  void outputs_written() {
    const std::int32_t P = static_cast<std::int32_t>(p_.size());
    for (std::int32_t r = 0; r < P; ++r) {
      if (focus_ >= 0 && r != focus_) continue;
      const Program& p = p_[r];
      const Dims& d = p.dims;
      std::vector<Rect> want;
      if (p.pass == Pass::forward) {
        want.push_back(Rect{BufferId::out, 0, d.tokens, 0, d.hidden});
      } else {
        want.push_back(Rect{BufferId::dx, 0, d.tokens, 0, d.hidden});
        want.push_back(Rect{BufferId::dwg, 0, d.hidden, 0, d.experts});
        for (std::size_t le = 0; le < p.slot_parts.size(); ++le) {
          const std::int64_t L = static_cast<std::int64_t>(le), inter = p.slot_parts[le].inter;
          want.push_back(Rect{BufferId::dw1, L * d.hidden, (L + 1) * d.hidden, 0, 2 * inter});
          want.push_back(Rect{BufferId::dw2, L * d.inter, L * d.inter + inter, 0, d.hidden});
        }
        if (d.shared_inter > 0) {
          want.push_back(Rect{BufferId::dws1, 0, d.hidden, 0, 2 * d.shared_inter});
          want.push_back(Rect{BufferId::dws2, 0, d.shared_inter, 0, d.hidden});
        }
      }
      for (const Rect& R : want) {
        if (R.area() == 0) continue;
        const std::size_t k = slot(r, R.buffer);
        std::int64_t covered = 0;
        for (auto it = s_.writes.begin() + s_.write_begin[k]; it != s_.writes.begin() + s_.write_begin[k + 1]; ++it) {
          const std::int64_t rows = std::min<std::int64_t>(R.r1, it->r1) - std::max<std::int64_t>(R.r0, it->r0);
          const std::int64_t cols = std::min<std::int64_t>(R.c1, it->c1) - std::max<std::int64_t>(R.c0, it->c0);
          if (rows > 0 && cols > 0 && !it->accumulate) covered += rows * cols;
        }
        if (covered != R.area())
          fail("outputs: rank " + std::to_string(r) + " writes " + std::to_string(covered) + " of the " +
               std::to_string(R.area()) + " elements of its result " + name(R.buffer) + " rows [" + std::to_string(R.r0) +
               ", " + std::to_string(R.r1) + ") cols [" + std::to_string(R.c0) + ", " + std::to_string(R.c1) +
               "); a tile of it is missing or cut short");
      }
    }
  }

  // Every write overlapping R must happen before the reader, and together
  // they must cover R.
  void check_read(std::int32_t r, std::int32_t id, const Rect& R) {
    const Program& p = p_[r];
    const std::size_t k = slot(r, R.buffer);
    const auto first = s_.writes.begin() + s_.write_begin[k], last = s_.writes.begin() + s_.write_begin[k + 1];
    auto it = std::lower_bound(first, last, R.r0 - s_.max_height[k] + 1, [](const Write& w, std::int64_t v) { return w.r0 < v; });
    std::int64_t covered = 0;
    for (; it != last && it->r0 < R.r1; ++it) {
      const std::int64_t rows = std::min<std::int64_t>(R.r1, it->r1) - std::max<std::int64_t>(R.r0, it->r0);
      const std::int64_t cols = std::min<std::int64_t>(R.c1, it->c1) - std::max<std::int64_t>(R.c0, it->c0);
      if (rows <= 0 || cols <= 0 || (it->rank == r && it->task == id)) continue;  // an update reads what it updates
      if (!happens_before(it->rank, it->task, r, id))
        fail("race: " + describe(p, id) + " reads " + name(R.buffer) + " written by " + describe(p_[it->rank], it->task) +
             ", which it does not wait for");
      if (!it->accumulate) covered += rows * cols;  // an update covers nothing by itself
    }
    if (covered != R.area())
      fail("coverage: " + describe(p, id) + " reads " + name(R.buffer) + " rows [" + std::to_string(R.r0) + ", " +
           std::to_string(R.r1) + ") cols [" + std::to_string(R.c0) + ", " + std::to_string(R.c1) + ") but only " +
           std::to_string(covered) + " of " + std::to_string(R.area()) + " elements are written in this pass");
  }


  [[noreturn]] void level_violation(int worker, std::int32_t id, std::int8_t dep, std::int64_t origin) {
    const Program& p = p_[static_cast<std::size_t>(focus_)];
    const Task& t = p.tasks[static_cast<std::size_t>(id)];
    const auto local = static_cast<std::int32_t>(origin - event_base_[static_cast<std::size_t>(focus_)]);
    fail("level: " + describe(p, id) + " on worker " + std::to_string(worker) + " feeds a level-" +
         std::to_string(put_level(t.kind)) + " event of rank " + std::to_string(t.peer) + " but runs only after " +
         describe_event(p, local) + ", which other ranks' level-" + std::to_string(dep) +
         " puts feed: the ranks could wait on each other. Queue every put before any task that waits on what peers "
         "send at its level or above");
  }

  [[noreturn]] void fail(const std::string& message) {
    error_ = message;
    throw Error(message);
  }

  void check_bounds(const Program& owner, const Rect& R, const Program& p, std::int32_t id, const char* verb) {
    if (R.area() == 0) return;
    const auto slot = s_.buffer_slot[static_cast<std::size_t>(owner.rank) * kBuffers + static_cast<std::size_t>(R.buffer)];
    if (slot < 0)
      fail(describe(p, id) + " " + verb + " buffer " + name(R.buffer) + ", which rank " + std::to_string(owner.rank) +
           " does not have");
    const auto& l = owner.buffers[static_cast<std::size_t>(slot)];
    if (R.r0 < 0 || R.c0 < 0 || R.r1 > l.rows || R.c1 > l.cols)
      fail(describe(p, id) + " " + verb + " " + name(R.buffer) + " rows [" + std::to_string(R.r0) + ", " +
           std::to_string(R.r1) + ") cols [" + std::to_string(R.c0) + ", " + std::to_string(R.c1) +
           ") outside the buffer [" + std::to_string(l.rows) + " x " + std::to_string(l.cols) + "]");
  }

  static constexpr std::size_t kBuffers = static_cast<std::size_t>(BufferId::count);

  void build_trigger_index() {
    s_.trig_begin.assign(static_cast<std::size_t>(total_events_ + 1), 0);
    for (const auto& p : p_)
      for (const auto& t : p.tasks)
        if (t.trigger_event >= 0) ++s_.trig_begin[event_base_[t.peer] + t.trigger_event + 1];
    for (std::size_t i = 1; i < s_.trig_begin.size(); ++i) s_.trig_begin[i] += s_.trig_begin[i - 1];
    s_.trig.assign(static_cast<std::size_t>(s_.trig_begin.back()), {});
    auto& fill = s_.trig_fill;
    fill.assign(s_.trig_begin.begin(), s_.trig_begin.end() - 1);
    for (std::int32_t r = 0; r < static_cast<std::int32_t>(p_.size()); ++r)
      for (std::size_t i = 0; i < p_[r].tasks.size(); ++i) {
        const Task& t = p_[r].tasks[i];
        if (t.trigger_event >= 0) s_.trig[fill[event_base_[t.peer] + t.trigger_event]++] = {r, static_cast<std::int32_t>(i)};
      }
  }

  // Does (pr, pt) finish before (cr, ct) starts, through the chain of waits?
  bool happens_before(std::int32_t pr, std::int32_t pt, std::int32_t cr, std::int32_t ct) {
    const Task& producer = p_[pr].tasks[pt];
    const Task& consumer = p_[cr].tasks[ct];
    if (consumer.wait_event < 0 || producer.trigger_event < 0) return false;
    const std::int64_t target = event_base_[producer.peer] + producer.trigger_event;
    const std::int64_t start = event_base_[cr] + consumer.wait_event;
    if (target == start) return true;
    if (!trigger_index_built_) {  // only reads not covered by their own wait's producers get here
      build_trigger_index();
      s_.visit_stamp.assign(static_cast<std::size_t>(total_events_), 0);
      trigger_index_built_ = true;
    }
    ++stamp_;
    s_.stack.assign(1, start);
    s_.visit_stamp[start] = stamp_;
    while (!s_.stack.empty()) {
      const auto ev = s_.stack.back();
      s_.stack.pop_back();
      for (auto k = s_.trig_begin[ev]; k < s_.trig_begin[ev + 1]; ++k) {
        const auto [r, id] = s_.trig[k];
        const Task& t = p_[r].tasks[id];
        if (t.wait_event < 0) continue;
        const std::int64_t up = event_base_[r] + t.wait_event;
        if (up == target) return true;
        if (s_.visit_stamp[up] != stamp_) {
          s_.visit_stamp[up] = stamp_;
          s_.stack.push_back(up);
        }
      }
    }
    return false;
  }

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
  std::int32_t focus_ = -1;
};

}  // namespace

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
