// The checker's index of writes and its happens-before relation: no two
// writes overlap, every read is covered by writes ordered before it.
#include <algorithm>
#include <sstream>
#include <tuple>

#include "compiler/layout.hpp"
#include "compiler/verify_checker.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe::taskflow::verify_detail {

std::size_t Checker::slot(std::int32_t rank, BufferId b) {
  return static_cast<std::size_t>(rank) * kBuffers + static_cast<std::size_t>(b);
}

void Checker::build_write_index() {
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
          s_.event_boxes[static_cast<std::size_t>(ev - boxed_begin_)].add(Box{w.buffer, w.r0, w.r1, w.c0, w.c1,
                                                  w.area()});
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

bool Checker::inside_filled_box(std::int32_t r, std::int32_t wait, const Rect& R) const {
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

void Checker::outputs_written() {
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

void Checker::check_read(std::int32_t r, std::int32_t id, const Rect& R) {
  const Program& p = p_[r];
  const std::size_t k = slot(r, R.buffer);
  const auto first = s_.writes.begin() + s_.write_begin[k], last = s_.writes.begin() + s_.write_begin[k + 1];
  auto it = std::lower_bound(first, last, R.r0 - s_.max_height[k] + 1, [](const Write& w,
                             std::int64_t v) { return w.r0 < v; });
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

[[noreturn]] void Checker::level_violation(int worker, std::int32_t id, std::int8_t dep, std::int64_t origin) {
  const Program& p = p_[static_cast<std::size_t>(focus_)];
  const Task& t = p.tasks[static_cast<std::size_t>(id)];
  const auto local = static_cast<std::int32_t>(origin - event_base_[static_cast<std::size_t>(focus_)]);
  fail("level: " + describe(p, id) + " on worker " + std::to_string(worker) + " feeds a level-" +
       std::to_string(put_level(t.kind)) + " event of rank " + std::to_string(t.peer) + " but runs only after " +
       describe_event(p, local) + ", which other ranks' level-" + std::to_string(dep) +
       " puts feed: the ranks could wait on each other. Queue every put before any task that waits on what peers "
       "send at its level or above");
}

[[noreturn]] void Checker::fail(const std::string& message) {
  error_ = message;
  throw Error(message);
}

void Checker::check_bounds(const Program& owner, const Rect& R, const Program& p, std::int32_t id, const char* verb) {
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

void Checker::build_trigger_index() {
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
      if (t.trigger_event >= 0) s_.trig[fill[event_base_[t.peer] + t.trigger_event]++] = {r,
          static_cast<std::int32_t>(i)};
    }
}

bool Checker::happens_before(std::int32_t pr, std::int32_t pt, std::int32_t cr, std::int32_t ct) {
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
  // The search back from the consumer's wait is kept while the next
  // questions ask about the same wait, and resumed where it stopped: a read
  // is checked against each of its writers in turn, and the reads of a
  // tile's tasks (a gather's sub-blocks, a GEMM's K panels) share their
  // wait. A search per question from scratch was quadratic where many
  // writers feed one read through relays (the per-rank exchange: minutes at
  // EP 16 on 4096 tokens). An event is expanded whole before the answer is
  // read, so the kept stack holds exactly the events still to expand.
  if (start != reached_from_) {
    reached_from_ = start;
    ++stamp_;
    s_.stack.assign(1, start);
    s_.visit_stamp[start] = stamp_;
  }
  while (s_.visit_stamp[target] != stamp_ && !s_.stack.empty()) {
    const auto ev = s_.stack.back();
    s_.stack.pop_back();
    for (auto k = s_.trig_begin[ev]; k < s_.trig_begin[ev + 1]; ++k) {
      const auto [r, id] = s_.trig[k];
      const Task& t = p_[r].tasks[id];
      if (t.wait_event < 0) continue;
      const std::int64_t up = event_base_[r] + t.wait_event;
      if (s_.visit_stamp[up] != stamp_) {
        s_.visit_stamp[up] = stamp_;
        s_.stack.push_back(up);
      }
    }
  }
  return s_.visit_stamp[target] == stamp_;
}

}  // namespace hpmoe::taskflow::verify_detail
