// The checker's structural checks: expert layouts, split parts and their
// declared reductions, queues, and that every event counts its triggers.
#include <algorithm>
#include <sstream>
#include <tuple>

#include "compiler/layout.hpp"
#include "compiler/verify_checker.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe::taskflow::verify_detail {

void Checker::structure() {
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
      if (!p.machine.runs(worker_of[i], p.tasks[i].queue))
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
      if (role(t.kind).place == Place::expert_return) check_partial_put(p, id);
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

void Checker::check_split_layout(const Program& p) {
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

void Checker::check_parts_tile_experts() {
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

const Reduction* Checker::reduction_block(const Program& p, std::int64_t row) {
  auto it = std::upper_bound(p.reductions.begin(), p.reductions.end(), row,
                             [](std::int64_t v, const Reduction& x) { return v < x.row_begin; });
  if (it == p.reductions.begin()) return nullptr;
  --it;
  return row < it->row_begin + it->parts * it->rows ? &*it : nullptr;
}

void Checker::check_partial_put(const Program& p, std::int32_t id) {
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

void Checker::check_reduction_coverage() {
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

void Checker::check_trigger_counts() {
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

}  // namespace hpmoe::taskflow::verify_detail
