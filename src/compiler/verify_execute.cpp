// The checker runs every rank's queues against the counters, checks what
// each task reads, and matches the per-rank interface; prove() runs it all.
#include <algorithm>
#include <sstream>
#include <tuple>

#include "compiler/layout.hpp"
#include "compiler/verify_checker.hpp"
#include "hpmoe/error.hpp"

namespace hpmoe::taskflow::verify_detail {

template <bool kTiming>
void Checker::execute() {
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
        if (wk.rank == focus_ && t.peer != focus_ && wk.dep >= put_level(t.kind)) level_violation(wk.w, id, wk.dep,
            wk.dep_origin);
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

void Checker::coverage() {
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

void Checker::match_interface(std::vector<Task>& expected) {
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

VerifyReport Checker::prove(std::vector<Task>* expected) {
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

template void Checker::execute<true>();
template void Checker::execute<false>();

}  // namespace hpmoe::taskflow::verify_detail
