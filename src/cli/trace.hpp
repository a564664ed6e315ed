#pragma once
#include <string>
#include <vector>

#include "hpmoe/step.hpp"

namespace hpmoe {

// Writes a Chrome / Perfetto trace (JSON) of traced steps: a process per run
// (e.g. "serialized", "interleaved"), a track per rank and worker, a slice per
// operator span or task, the waits visible as gaps.
struct TracedRun {
  std::string name;
  const StepResult* step = nullptr;
};
void write_chrome_trace(const std::string& path, const std::vector<TracedRun>& runs);

// The same as an SVG Gantt chart a person can read at a glance: the runs one
// above the other on a shared time axis, a row per rank and worker, a colour
// per operator or task kind, idle time left white.
void write_timeline_svg(const std::string& path, const std::vector<TracedRun>& runs);

}  // namespace hpmoe
