// hpmoe sweep: the simulator over a grid, in parallel, as CSV, JSON and markdown.
#include "cli/sweep.hpp"
#include "cli/options.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "common/memory.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/safetensors.hpp"
#include "hpmoe/schedule.hpp"

namespace hpmoe {
namespace {

using nlohmann::json;

// The point's layer options, as `hpmoe simulate` would take them: the model
// (a preset or a config file), the overrides, -P, -T, the placement.
front::LayerOptions layer_options(const SweepRequest& req, const std::string& model, std::int64_t ranks, std::int64_t tokens,
                                  const std::string& lend) {
  const auto names = preset_names();
  front::LayerOptions o;
  if (std::find(names.begin(), names.end(), model) != names.end()) {
    o.preset_name = model;
  } else if (std::filesystem::exists(model)) {
    o.config_file = model;
  } else {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    throw Error("--model '" + model + "' is neither a preset (" + list + ") nor a layer config file");
  }
  o.sets = req.sets;
  o.ranks = ranks;
  o.tokens = tokens;
  o.dtype = req.dtype;
  o.dispatch_dtype = req.dispatch_dtype;
  o.exchange = req.exchange;
  o.combine_dtype = req.combine_dtype;
  if (!lend.empty()) o.lend = lend;
  o.placement = req.placement;
  return o;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char ch : s) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

std::string fixed(double v, int digits = 3) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(digits) << v;
  return o.str();
}

// The machine's framework exchange (the baseline its figures compare against), if it has one.
const char* baseline_of(const sim::MachineModel& m) {
  return m.deepep.enabled ? "DeepEP-style" : m.mindspore.enabled ? "MindSpore-style" : "";
}
double baseline_s(const sim::MachineModel& m, const sim::PassResult& p) {
  return m.deepep.enabled ? p.deepep_s : m.mindspore.enabled ? p.mindspore_s : 0;
}

const sim::StepWay* way(const sim::StepReport& r, const std::string& name) {
  for (const auto& w : r.ways)
    if (w.name == name) return &w;
  return nullptr;
}

// One row's columns, by name, in CSV order.
std::vector<std::pair<std::string, std::string>> columns(const SweepRequest& req, const SweepRow& row) {
  const auto& p = row.point;
  std::vector<std::pair<std::string, std::string>> c = {{"machine", p.machine}, {"model", p.model},
                                                        {"ranks", std::to_string(p.ranks)}, {"tokens", std::to_string(p.tokens)},
                                                        {"routing", p.routing}, {"schedule", p.schedule}};
  if (!req.lends.empty()) c.emplace_back("lend", p.lend);
  for (std::size_t i = 0; i < req.vary.size(); ++i) c.emplace_back(req.vary[i].first, p.vary_values[i]);
  c.emplace_back("error", row.error);
  const bool ok = row.error.empty();
  const auto& L = row.layer;
  const auto ms = [&](double s) { return ok ? fixed(s * 1e3) : std::string(); };
  const auto ratio = [&](double a, double b) { return ok && b > 0 && a > 0 ? fixed(a / b) : std::string(); };
  const std::string base = ok ? baseline_of(L.machine) : "";
  // The scheme the point ran: the one given, or auto's choice (the fastest fused step predicted).
  c.emplace_back("exchange", ok ? to_string(L.config.exchange) + (L.exchange_choice.empty() ? "" : " (auto)") : "");
  if (req.dispatch_dtype && *req.dispatch_dtype == "auto")  // the wire auto chose
    c.emplace_back("dispatch", ok ? to_string(L.config.dispatch_dtype) + " (auto)" : "");
  c.emplace_back("baseline", base);
  for (const auto& [pass, r] : {std::pair<const char*, const sim::PassResult*>{"forward", &L.forward}, {"backward", &L.backward}}) {
    if (std::string(pass) == "backward" && !req.backward && !req.step) continue;
    const std::string pre = std::string(pass) + "_";
    c.emplace_back(pre + "serialized_ms", ms(r->serialized_s));
    c.emplace_back(pre + "fused_ms", ms(r->interleaved_s));
    c.emplace_back(pre + "speedup", ratio(r->serialized_s, r->interleaved_s));
    c.emplace_back(pre + "baseline_ms", ok && !base.empty() ? ms(baseline_s(L.machine, *r)) : "");
    c.emplace_back(pre + "fused_vs_baseline", ok && !base.empty() ? ratio(baseline_s(L.machine, *r), r->interleaved_s) : "");
    c.emplace_back(pre + "exposed_comm_serialized", ok ? fixed(r->serialized_exposed_comm) : "");
    c.emplace_back(pre + "exposed_comm_fused", ok ? fixed(r->interleaved_exposed_comm) : "");
    c.emplace_back(pre + "put_mb", ok ? fixed(r->put_bytes / 1e6, 1) : "");
    if (!req.lends.empty()) {
      c.emplace_back(pre + "lent", ok ? std::to_string(r->lent) : "");
      c.emplace_back(pre + "lent_mb", ok ? fixed(r->lent_bytes / 1e6, 1) : "");
    }
  }
  const auto gb = [&](double b) { return ok ? fixed(b / 1e9, 2) : std::string(); };
  c.emplace_back("memory_gb", gb(L.memory.total()));
  c.emplace_back("worst_memory_gb", gb(L.memory.worst_total()));
  c.emplace_back("capacity_gb", ok && L.memory.capacity > 0 ? gb(L.memory.capacity) : "");
  c.emplace_back("worst_fits", ok && L.memory.capacity > 0 ? (L.memory.worst_total() <= L.memory.capacity ? "yes" : "no") : "");
  if (req.step) {
    const std::string b = ok && row.step ? row.step->baseline : "";
    const auto step_ms = [&](const std::string& name) {
      const sim::StepWay* w = ok && row.step ? way(*row.step, name) : nullptr;
      return w ? fixed(w->step_s() * 1e3) : std::string();
    };
    c.emplace_back("step_serialized_ms", step_ms("serialized"));
    c.emplace_back("step_serialized_micro_ms", step_ms("serialized + 2 micro-batches"));
    c.emplace_back("step_baseline_ms", b == "serialized" ? "" : step_ms(b));
    c.emplace_back("step_baseline_micro_ms", b == "serialized" ? "" : step_ms(b + " + 2 micro-batches"));
    c.emplace_back("step_fused_ms", step_ms("fused (hpmoe)"));
    c.emplace_back("step_fused_micro_ms", step_ms("fused (hpmoe) + 2 micro-batches"));
    std::string best;
    if (ok && row.step)
      best = std::min_element(row.step->ways.begin(), row.step->ways.end(), [](const sim::StepWay& a, const sim::StepWay& x) {
               return a.step_s() < x.step_s();
             })->name;
    c.emplace_back("step_fastest", best);
  }
  c.emplace_back("simulate_s", ok ? fixed(L.simulate_seconds + L.compile_seconds, 2) : "");
  return c;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", &tm);
  return buf;
}

// A point's machine with its varied values: points that share it share one model.
std::string machine_key(const SweepPoint& p) {
  std::string key = p.machine;
  for (const auto& v : p.vary_values) key += "\x1f" + v;
  return key;
}

}  // namespace

std::vector<SweepPoint> sweep_points(const SweepRequest& req) {
  const auto need = [](bool ok, const char* what) {
    if (!ok) throw Error(std::string("the sweep needs at least one ") + what);
  };
  need(!req.machines.empty(), "--machine");
  need(!req.models.empty(), "--model");
  need(!req.ranks.empty(), "-P value");
  need(!req.tokens.empty(), "-T value");
  need(!req.routings.empty(), "--routing");
  for (const auto& [path, values] : req.vary)
    if (values.empty()) throw Error("--vary " + path + " names no values (--vary PATH=V1,V2,...)");
  // The grid's size from its axes, before any point (or combination of
  // varied values) is built: 64 million points used to be built, past 6 GB,
  // before the cap was checked.
  {
    long double total = 1;
    for (const std::size_t n : {req.machines.size(), req.models.size(), req.ranks.size(), req.tokens.size(),
                                std::max<std::size_t>(req.lends.size(), 1), req.routings.size(),
                                std::max<std::size_t>(req.schedules.size(), 1)})
      total *= static_cast<long double>(n);
    for (const auto& [path, values] : req.vary) total *= static_cast<long double>(values.size());
    if (total > 100000)
      throw Error("the sweep has " + std::to_string(static_cast<unsigned long long>(std::min<long double>(total, 1e19L))) +
                  " points; at most 100000 (fewer values per axis, or several sweeps)");
  }
  // The varied fields' value lists, as a mixed-radix counter.
  std::vector<std::vector<std::string>> combos{{}};
  for (const auto& [path, values] : req.vary) {
    std::vector<std::vector<std::string>> next;
    for (const auto& prefix : combos)
      for (const auto& v : values) {
        next.push_back(prefix);
        next.back().push_back(v);
      }
    combos = std::move(next);
  }
  std::vector<SweepPoint> points;
  for (const auto& machine : req.machines) {
    const sim::MachineModel model = sim::load_machine(machine);  // checked once per machine
    if (req.fp8_gemms) (void)model.with_fp8_gemms();
    const std::vector<std::string> schedules =
        req.schedules.empty() ? std::vector<std::string>{name(sim::default_policy(model))} : req.schedules;
    for (const auto& s : schedules) (void)taskflow::parse_policy(s);
    const std::vector<std::string> lends = req.lends.empty() ? std::vector<std::string>{""} : req.lends;
    for (const auto& m : req.models)
      for (const std::int64_t P : req.ranks)
        for (const std::int64_t T : req.tokens)
          for (const auto& lend : lends) {
            LayerConfig c;
            try {
              const front::LayerOptions options = layer_options(req, m, P, T, lend);
              c = options.resolve(true, true);
              (void)options.resolve_placement(c);
            } catch (const Error& e) {
              throw Error("sweep point " + m + " at -P " + std::to_string(P) + " -T " + std::to_string(T) + ": " + e.what());
            }
            if (req.fp8_gemms && c.dtype != DType::bf16)
              throw Error("sweep point " + m + ": --gemm-dtype fp8 models a bf16 layer's GEMMs: use --dtype bf16");
            if (req.step) {
              sim::StepRequest step = *req.step;
              step.moe.config = c;
              check_step_request(step);
            }
            for (const auto& routing : req.routings) {
              (void)parse_routing_spec(routing, req.seed);
              for (const auto& schedule : schedules)
                for (const auto& values : combos) points.push_back({machine, m, routing, schedule, lend, P, T, values, c});
            }
          }
  }
  if (points.size() > 100000) throw Error("the sweep has " + std::to_string(points.size()) + " points; at most 100000");
  // Each machine with its varied fields is a valid model: checked before any point runs.
  std::map<std::string, bool> checked;
  for (const auto& p : points)
    if (checked.emplace(machine_key(p), true).second) (void)sweep_machine(req, p);
  return points;
}

sim::MachineModel sweep_machine(const SweepRequest& req, const SweepPoint& p) {
  return varied_machine(p.machine, req.vary, p.vary_values);
}

std::size_t sweep_jobs(const SweepRequest& req, const std::vector<SweepPoint>& points) {
  const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  return std::min<std::size_t>(points.size(), req.jobs > 0 ? static_cast<std::size_t>(req.jobs) : hardware);
}

double sweep_point_bytes(const sim::MachineModel& m, const SweepPoint& p, bool backward) {
  // The simulator holds every rank's programs of a pass (and the
  // baselines'): about 290 bytes a task, measured (deepseek-v3 on h800,
  // bf16 forward + backward: 230 MB at EP 16 for 812 k tasks, 626 MB at
  // EP 64 for 2.19 M), counted here with a fifth more. Tasks: a row tile's
  // GEMM column tiles and a dozen more (dispatch, SwiGLU, combine) per pass,
  // and in backward each expert's weight-gradient tiles (within 1.2x of the
  // counts measured there).
  const LayerConfig& c = p.config;
  const double tile_rows = double(std::max<std::int64_t>(m.tile_rows, 1)),
               tile_cols = double(std::max<std::int64_t>(m.tile_cols, 1));
  const double H = double(c.hidden), I = double(c.expert_inter);
  const double row_tiles = std::ceil(double(c.ranks) * double(c.tokens_per_rank) * double(c.top_k) / tile_rows);
  const double per_pass = row_tiles * (std::ceil((2.0 * I + H) / tile_cols) + 12.0);
  const double wgrad = double(c.routed_experts) * 4.0 * I * H / (tile_rows * tile_cols);
  const double tasks = backward ? 2.0 * per_pass + wgrad : per_pass;
  return 350.0 * tasks + 16e6;
}

void check_sweep_memory(const SweepRequest& req, const std::vector<SweepPoint>& points) {
  if (points.empty()) return;
  // The largest `jobs` points running at once: what -j asks this host to hold.
  std::vector<double> bytes;
  bytes.reserve(points.size());
  std::map<std::string, sim::MachineModel> machines;  // each machine with its varied fields, loaded once
  for (const auto& p : points) {
    const std::string key = machine_key(p);
    auto it = machines.find(key);
    if (it == machines.end()) it = machines.emplace(key, sweep_machine(req, p)).first;
    bytes.push_back(sweep_point_bytes(it->second, p, req.backward));
  }
  const std::size_t jobs = sweep_jobs(req, points);
  std::partial_sort(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(jobs), bytes.end(), std::greater<>());
  double total = 0;
  for (std::size_t i = 0; i < jobs; ++i) total += bytes[i];
  require_memory(total, "the sweep at -j " + std::to_string(jobs),
                 std::to_string(jobs) + " points at once, the largest " + gib_text(bytes[0]),
                 "use a smaller -j, or split the sweep so its largest points run apart");
}

std::vector<SweepRow> run_sweep(const SweepRequest& req, const std::vector<SweepPoint>& points,
                                const std::function<void(std::size_t, std::size_t)>& done) {
  std::vector<SweepRow> rows(points.size());
  std::atomic<std::size_t> next{0}, finished{0};
  std::mutex report;
  const auto worker = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < points.size();) {
      SweepRow& row = rows[i];
      row.point = points[i];
      try {
        const sim::MachineModel m = sweep_machine(req, row.point);
        sim::SimRequest sreq;
        sreq.config = row.point.config;
        sreq.placement = layer_options(req, row.point.model, row.point.ranks, row.point.tokens, row.point.lend).resolve_placement(sreq.config);
        sreq.routing = parse_routing_spec(row.point.routing, req.seed);
        sreq.seed = req.seed;
        sreq.backward = req.backward;
        sreq.kernel_scope = req.kernel_scope;
        sreq.optimizer_state = req.optimizer_state;
        sreq.fp8_gemms = req.fp8_gemms;
        sreq.policy = taskflow::parse_policy(row.point.schedule);
        const bool choose = !req.exchange || *req.exchange == "auto";  // auto unless a scheme is given
        sreq.choose_scheme = choose;
        sreq.choose_dispatch_dtype = req.dispatch_dtype && *req.dispatch_dtype == "auto";
        if (req.step) {
          sim::StepRequest step = *req.step;
          step.moe = sreq;
          step.choose_exchange = choose;
          row.step = sim::simulate_step(m, step);
          row.layer = row.step->layer;
        } else {
          row.layer = choose || sreq.choose_dispatch_dtype ? sim::simulate_choosing_exchange(m, sreq) : sim::simulate(m, sreq);
        }
      } catch (const Error& e) {
        row.error = one_line(e.what());
      }
      const std::size_t k = ++finished;
      if (done) {
        std::lock_guard<std::mutex> lock(report);
        done(k, points.size());
      }
    }
  };
  const std::size_t jobs = sweep_jobs(req, points);
  check_sweep_memory(req, points);
  std::vector<std::thread> threads;
  for (std::size_t t = 1; t < jobs; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  return rows;
}

std::string sweep_csv(const SweepRequest& req, const std::vector<SweepRow>& rows) {
  std::ostringstream o;
  bool header = true;
  for (const auto& row : rows) {
    const auto c = columns(req, row);
    if (header) {
      for (std::size_t i = 0; i < c.size(); ++i) o << (i ? "," : "") << csv_field(c[i].first);
      o << "\n";
      header = false;
    }
    for (std::size_t i = 0; i < c.size(); ++i) o << (i ? "," : "") << csv_field(c[i].second);
    o << "\n";
  }
  return o.str();
}

void write_sweep(const std::string& dir, const SweepRequest& req, const std::vector<SweepRow>& rows, const std::string& command) {
  json j;
  j["command"] = command;
  j["date"] = utc_now();
  j["points"] = json::array();
  for (const auto& row : rows) {
    json point;
    for (const auto& [k, v] : columns(req, row)) point[k] = v;
    if (row.error.empty()) point["layer"] = sim::to_json(row.layer);
    if (row.error.empty() && row.step) point["step"] = sim::to_json(*row.step);
    j["points"].push_back(std::move(point));
  }
  // The report: the grid as a table of the CSV's main columns.
  std::ostringstream md;
  md << "# hpmoe sweep\n\nPredicted by the simulator (machine models in machines/; figures marked ESTIMATE there are "
        "estimates), "
     << utc_now() << ". Command: `" << command << "`.\n\n";
  std::size_t failed = 0;
  for (const auto& row : rows) failed += row.error.empty() ? 0 : 1;
  md << rows.size() << " points";
  if (failed) md << ", " << failed << " not simulated (the error column says why)";
  md << ". Columns: times in ms; speedups are the serialized (or the machine's framework baseline) time over the fused "
        "one.\n\n";
  std::vector<std::string> keep = {"machine", "model", "ranks", "tokens", "routing", "schedule", "lend", "exchange"};
  for (const auto& v : req.vary) keep.push_back(v.first);
  for (const char* k : {"forward_serialized_ms", "forward_fused_ms", "forward_speedup", "forward_lent", "forward_put_mb", "baseline", "forward_fused_vs_baseline",
                        "backward_speedup", "backward_fused_vs_baseline", "memory_gb", "capacity_gb", "step_fused_ms",
                        "step_fastest", "error"})
    keep.emplace_back(k);
  if (!rows.empty()) {
    const auto first = columns(req, rows.front());
    std::vector<std::string> shown;
    for (const auto& k : keep)
      if (std::any_of(first.begin(), first.end(), [&](const auto& c) { return c.first == k; })) shown.push_back(k);
    md << "|";
    for (const auto& k : shown) md << " " << k << " |";
    md << "\n|";
    for (std::size_t i = 0; i < shown.size(); ++i) md << "---|";
    md << "\n";
    for (const auto& row : rows) {
      const auto c = columns(req, row);
      md << "|";
      for (const auto& k : shown)
        for (const auto& [name, value] : c)
          if (name == k) {
            std::string v = value;
            std::replace(v.begin(), v.end(), '|', '/');
            md << " " << v << " |";
          }
      md << "\n";
    }
  }
  SaveSet set(dir);
  set.add_text("sweep.csv", sweep_csv(req, rows));
  set.add_text("sweep.json", j.dump(2) + "\n");
  set.add_text("report.md", md.str());
  set.commit();
}

}  // namespace hpmoe
