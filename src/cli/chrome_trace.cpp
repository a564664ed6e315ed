#include <algorithm>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/atomic_file.hpp"
#include "common/fnv.hpp"
#include "hpmoe/error.hpp"
#include "cli/trace.hpp"

namespace hpmoe {

void write_chrome_trace(const std::string& path, const std::vector<TracedRun>& runs) {
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t pid = 0; pid < runs.size(); ++pid) {
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", runs[pid].name}}}});
    std::map<std::pair<int, int>, int> tracks;  // (rank, worker) -> tid, in order
    for (const auto& s : runs[pid].step->trace) tracks.emplace(std::make_pair(s.rank, s.worker), 0);
    int tid = 0;
    for (auto& [key, id] : tracks) {
      id = tid++;
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", id},
                        {"args", {{"name", "rank " + std::to_string(key.first) + " worker " + std::to_string(key.second)}}}});
    }
    for (const auto& s : runs[pid].step->trace)
      events.push_back({{"name", s.name},
                        {"ph", "X"},
                        {"pid", pid},
                        {"tid", tracks.at({s.rank, s.worker})},
                        {"ts", s.start * 1e6},
                        {"dur", (s.end - s.start) * 1e6},
                        {"args", {{"detail", s.detail}}}});
  }
  write_file_atomically(path, nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n",
                        "the trace");
}

namespace {

// A stable, readable colour per name.
std::string colour_of(const std::string& name) {
  static const char* palette[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
                                  "#ff9da7", "#9c755f", "#bab0ac", "#1f77b4", "#2ca02c", "#d62728", "#9467bd"};
  return palette[fnv1a(name) % (sizeof(palette) / sizeof(palette[0]))];
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

}  // namespace

void write_timeline_svg(const std::string& path, const std::vector<TracedRun>& runs) {
  double end = 0;
  for (const auto& run : runs)
    for (const auto& s : run.step->trace) end = std::max(end, s.end);
  if (end <= 0) end = 1e-6;
  const double left = 150, width = 1100, row_h = 16, gap = 28;
  std::ostringstream body;
  std::map<std::string, std::string> legend;
  double y = 20;
  for (const auto& run : runs) {
    body << "<text x='4' y='" << y + 12 << "' font-weight='bold'>" << escape(run.name) << "</text>\n";
    y += 18;
    std::map<std::pair<int, int>, int> rows;
    for (const auto& s : run.step->trace) rows.emplace(std::make_pair(s.rank, s.worker), 0);
    int index = 0;
    for (auto& [key, row] : rows) {
      row = index++;
      body << "<text x='4' y='" << y + row * row_h + 12 << "' font-size='11'>rank " << key.first << " worker "
           << key.second << "</text>\n";
      body << "<rect x='" << left << "' y='" << y + row * row_h << "' width='" << width << "' height='" << row_h - 2
           << "' fill='#f4f4f4'/>\n";
    }
    for (const auto& s : run.step->trace) {
      const double x = left + s.start / end * width, w = std::max(0.5, (s.end - s.start) / end * width);
      const std::string colour = colour_of(s.name);
      legend.emplace(s.name, colour);
      body << "<rect x='" << x << "' y='" << y + rows.at({s.rank, s.worker}) * row_h << "' width='" << w
           << "' height='" << row_h - 2 << "' fill='" << colour << "'><title>" << escape(s.name + " " + s.detail)
           << "</title></rect>\n";
    }
    y += static_cast<double>(rows.size()) * row_h + gap;
  }
  // Time axis and legend.
  body << "<line x1='" << left << "' y1='" << y - gap + 6 << "' x2='" << left + width << "' y2='" << y - gap + 6
       << "' stroke='#333'/>\n";
  for (int i = 0; i <= 10; ++i)
    body << "<text x='" << left + width * i / 10 - 10 << "' y='" << y - gap + 20 << "' font-size='10'>"
         << std::fixed << std::setprecision(end < 0.01 ? 3 : 1) << end * 1e3 * i / 10 << "</text>\n";
  body << "<text x='4' y='" << y - gap + 20 << "' font-size='10'>time (ms)</text>\n";
  double lx = left;
  y += 4;
  for (const auto& [name, colour] : legend) {
    if (lx + 150 > left + width) {
      lx = left;
      y += 16;
    }
    body << "<rect x='" << lx << "' y='" << y << "' width='12' height='12' fill='" << colour << "'/><text x='" << lx + 16
         << "' y='" << y + 10 << "' font-size='11'>" << escape(name) << "</text>\n";
    lx += 150;
  }
  y += 24;
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << left + width + 40 << "' height='" << y
      << "' font-family='sans-serif'>\n<rect width='100%' height='100%' fill='white'/>\n"
      << body.str() << "</svg>\n";
  write_file_atomically(path, svg.str(), "the timeline");
}

}  // namespace hpmoe
