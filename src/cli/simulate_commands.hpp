#pragma once
#include <set>
// The front end's model commands: `hpmoe simulate` (one MoE layer's step on
// a machine model) and `hpmoe step` (a training step of a whole model).
#include <CLI/CLI.hpp>
#include <chrono>
#include <iostream>
#include <string>

#include "cli/sweep.hpp"
#include "cli/trace.hpp"
#include "sim/sim.hpp"
#include "sim/step.hpp"
#include "cli/options.hpp"

namespace hpmoe::front {

struct SimulateCommand {
  CLI::App* app = nullptr;
  LayerOptions layer;
  sim::SimRequest sreq;
  std::string sim_machine, sim_routing = "uniform", sim_schedule, sim_json, sim_trace, sim_timeline, gemm_dtype = "layer";
  int sim_workers = 0;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("simulate", "predict a layer step on a machine model (serialized vs interleaved)");
    CLI::App* simulate = app;
    layer.add_to(*simulate);
    simulate->add_option("--machine", sim_machine, "machine model: a file, or a name in machines/ (cpu-local, ascend-a3, h800, h200, nmp-mesh)")
        ->required();
    simulate->add_option("--routing", sim_routing, "uniform | grouped | balanced | zipf[:S] | hot[:SHARE] | trace:FILE[:LAYER][:repeat] | router");
    simulate->add_option("--seed", sreq.seed, "seed of synthetic routing")->check(kSeedValidator);
    simulate->add_flag("--backward", sreq.backward, "simulate the backward pass too");
    simulate->add_flag("--optimizer-state", sreq.optimizer_state,
                       "count Adam's fp32 master weights and moments (12 bytes a parameter) in the memory check");
    simulate->add_option("--schedule", sim_schedule,
                         "fill | rank-rotated | critical-path | interleave-wgrad | ratr (default: ratr on accelerator models, whose "
                         "puts in flight are bounded; critical-path on CPU models, as the runtime does)");
    simulate->add_flag("--kernel-scope", sreq.kernel_scope,
                       "time only what a fused MoE kernel does (as the paper measures): router backward and pack tasks take no time");
    simulate->add_option("--gemm-dtype", gemm_dtype, "what the GEMMs compute in: layer (default) | fp8 (a bf16 layer's GEMMs at the machine model's fp8 rates, as DeepSeek-V3 trains; H800/H200 models)");
    simulate->add_option("--json", sim_json, "write the prediction as JSON");
    simulate->add_option("--workers,-W", sim_workers, "cpu models: workers per rank (default: the model's)")->check(CLI::Range(1, 256));
    simulate->add_option("--trace", sim_trace, "write the simulated timelines as a Chrome/Perfetto trace");
    simulate->add_option("--timeline", sim_timeline, "write the simulated timelines as an SVG Gantt chart");
  }

  int execute() {
    sim::MachineModel model = sim::load_machine(sim_machine);
    if (sim_workers > 0) {
      if (model.accelerator) throw Error("--workers applies to cpu models; " + model.name + " has matrix and vector units");
      model.workers = sim_workers;
    }
    sreq.config = layer.resolve(true, true);
    sreq.choose_scheme = layer.exchange_auto();
    sreq.choose_dispatch_dtype = layer.dispatch_auto();
    sreq.placement = layer.resolve_placement(sreq.config);
    sreq.routing = parse_routing_spec(sim_routing, sreq.seed);
    sreq.fp8_gemms = fp8_gemms_from(gemm_dtype);
    sreq.policy = sim_schedule.empty() ? sim::default_policy(model) : taskflow::parse_policy(sim_schedule);
    sreq.trace = !sim_trace.empty() || !sim_timeline.empty();
    for (const auto& [file, what] : {std::pair<const std::string&, const char*>{sim_json, "JSON results"},
                                     {sim_trace, "the trace"}, {sim_timeline, "the timeline"}})
      if (!file.empty()) check_writable(file, what);
    check_distinct_outputs({{"--json", sim_json}, {"--trace", sim_trace}, {"--timeline", sim_timeline}}, "",
                           {{"--config", layer.config_file}, {"--placement", layer.placement}, {"--machine", sim_machine},
                            {"--routing", sreq.routing.trace_path}});
    const sim::SimReport report =
        layer.exchange_auto() || layer.dispatch_auto() ? sim::simulate_choosing_exchange(model, sreq) : sim::simulate(model, sreq);
    std::cout << sim::format_report(report);
    if (!sim_json.empty()) write_json(sim_json, sim::to_json(report));
    if (sreq.trace) {
      StepResult serialized, interleaved;
      serialized.trace = report.serialized_trace;
      interleaved.trace = report.interleaved_trace;
      const std::vector<TracedRun> runs{{"serialized (simulated on " + model.name + ")", &serialized},
                                        {"interleaved (simulated on " + model.name + ")", &interleaved}};
      if (!sim_trace.empty()) write_chrome_trace(sim_trace, runs);
      if (!sim_timeline.empty()) write_timeline_svg(sim_timeline, runs);
    }
    return 0;
  }
};


// The step model's options (hpmoe step, and hpmoe sweep with --layers).
struct StepModelOptions {
  sim::StepRequest req;
  double attention_ms = -1, dense_ms = -1, other_ms = 0;

  void add_to(CLI::App& app, bool layers_required) {
    auto* layers = app.add_option("--layers", req.layers, "transformer layers on a rank")->check(CLI::Range(1, 100000));
    if (layers_required) layers->required();
    app.add_option("--dense-layers", req.dense_layers, "of them, the first ones with a dense FFN instead of the MoE layer (default 0)")
        ->check(CLI::Range(0, 100000));
    app.add_option("--dense-inter", req.dense_inter, "the dense FFN's intermediate width (default: 4 x hidden)")->check(CLI::Range(1, 1 << 24));
    app.add_option("--seq-len", req.seq_len, "tokens of one sequence: the attention's context (default 4096)")->check(CLI::Range(1, 1 << 24));
    app.add_option("--attention-params", req.attention_params, "weights of one attention block (default: 4 x hidden^2)")
        ->check(CLI::Range(1.0, 1e13));
    app.add_option("--attention-width", req.attention_width, "heads x head dim of the attention scores (default: hidden)")
        ->check(CLI::Range(1, 1 << 24));
    app.add_option("--attention-ms", attention_ms, "measured forward time of one attention block at -T tokens (replaces the FLOP estimate)")
        ->check(CLI::Range(0.0, 1e7));
    app.add_option("--dense-ms", dense_ms, "measured forward time of one dense FFN at -T tokens (replaces the FLOP estimate)")
        ->check(CLI::Range(0.0, 1e7));
    app.add_option("--comm-share", req.comm_share,
                   "share of the compute units one micro-batch's exchange takes while it overlaps the other's compute "
                   "(default 0.152: DeepSeek-V3's 20 of 132 SMs)")
        ->check(CLI::Range(0.0, 0.99));
    app.add_option("--other-ms", other_ms, "time of the rest of the step, the same for every way (optimizer, gradient reduction; default 0)")
        ->check(CLI::Range(0.0, 1e9));
  }
  // The request with the times in seconds.
  sim::StepRequest resolve() const {
    sim::StepRequest r = req;
    r.attention_s = attention_ms < 0 ? -1 : attention_ms * 1e-3;
    r.dense_s = dense_ms < 0 ? -1 : dense_ms * 1e-3;
    r.other_s = other_ms * 1e-3;
    return r;
  }
};

struct StepCommand {
  CLI::App* app = nullptr;
  LayerOptions layer;
  StepModelOptions model_options;
  sim::StepRequest req;
  std::string machine, routing = "uniform", schedule, json_file, chart_file, gemm_dtype = "layer";

  void add(CLI::App& parent) {
    app = parent.add_subcommand("step", "predict a training step of a whole model (attention, dense and MoE layers, forward and "
                                        "backward): serialized, micro-batch overlap, fused, and fused with micro-batch overlap");
    layer.add_to(*app);
    app->add_option("--machine", machine, "machine model: a file, or a name in machines/ (cpu-local, ascend-a3, h800, h200, nmp-mesh)")
        ->required();
    model_options.add_to(*app, true);
    app->add_option("--routing", routing, "uniform | grouped | balanced | zipf[:S] | hot[:SHARE] | trace:FILE[:LAYER][:repeat] | router");
    app->add_option("--seed", req.moe.seed, "seed of synthetic routing")->check(kSeedValidator);
    app->add_option("--schedule", schedule, "the fused schedule's policy (default: the machine's, as for simulate)");
    app->add_flag("--optimizer-state", req.moe.optimizer_state,
                  "count Adam's fp32 master weights and moments in the MoE layer's memory check");
    app->add_option("--gemm-dtype", gemm_dtype, "what the GEMMs compute in: layer (default) | fp8 (a bf16 layer's GEMMs at the machine model's fp8 rates, as DeepSeek-V3 trains; H800/H200 models)");
    app->add_option("--json", json_file, "write the prediction as JSON");
    app->add_option("--chart", chart_file, "draw every way's step as an SVG bar chart");
  }

  int execute() {
    const sim::MachineModel model = sim::load_machine(machine);
    const std::uint64_t seed = req.moe.seed;
    const bool optimizer_state = req.moe.optimizer_state;
    req = model_options.resolve();
    req.moe.seed = seed;
    req.moe.optimizer_state = optimizer_state;
    req.moe.config = layer.resolve(true, true);
    req.choose_exchange = !layer.exchange || layer.exchange_auto();  // auto unless a scheme is given
    req.moe.choose_dispatch_dtype = layer.dispatch_auto();
    req.moe.placement = layer.resolve_placement(req.moe.config);
    req.moe.routing = parse_routing_spec(routing, req.moe.seed);
    req.moe.fp8_gemms = fp8_gemms_from(gemm_dtype);
    req.moe.policy = schedule.empty() ? sim::default_policy(model) : taskflow::parse_policy(schedule);
    if (!json_file.empty()) check_writable(json_file, "JSON results");
    if (!chart_file.empty()) check_writable(chart_file, "the chart");
    check_distinct_outputs({{"--json", json_file}, {"--chart", chart_file}}, "",
                           {{"--config", layer.config_file}, {"--placement", layer.placement}, {"--machine", machine},
                            {"--routing", req.moe.routing.trace_path}});
    const sim::StepReport report = sim::simulate_step(model, req);
    std::cout << sim::format_step_report(report);
    if (!json_file.empty()) write_json(json_file, sim::to_json(report));
    if (!chart_file.empty()) write_file_atomically(chart_file, sim::step_chart_svg(report), "the chart");
    return 0;
  }
};

struct SweepCommand {
  CLI::App* app = nullptr;
  SweepRequest req;
  StepModelOptions model_options;
  std::string out;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("sweep", "simulate a grid of machines, models, EP degrees, tokens, routings, schedules and "
                                         "machine-model parameters in parallel; CSV, JSON and a markdown report");
    app->add_option("--machine", req.machines, "machine models, comma-separated (names in machines/ or files)")
        ->required()->delimiter(',');
    app->add_option("--model", req.models, "presets or layer config files, comma-separated")->required()->delimiter(',');
    app->add_option("--ranks,-P", req.ranks, "EP degrees, comma-separated")->required()->delimiter(',')->check(CLI::Range(1, 1 << 20));
    app->add_option("--tokens,-T", req.tokens, "tokens per rank, comma-separated")->required()->delimiter(',')
        ->check(CLI::Range(1, 1 << 30));
    app->add_option("--routing", req.routings, "routings, comma-separated (uniform, zipf:1.2, hot:0.3, trace:FILE:LAYER, ...)")
        ->delimiter(',');
    app->add_option("--schedule", req.schedules, "fused schedule policies, comma-separated (default: each machine's)")->delimiter(',');
    app->add_option("--lend", req.lends, "weights instead of tokens, comma-separated: off | auto | ROWS (see `hpmoe simulate --help`)")
        ->delimiter(',');
    app->add_option("--vary", vary_specs,
                    "a machine-model field over values: PATH=V1,V2,... (dotted path into the model file, * for every array "
                    "element, A+B for two fields together; a value is a number or xF, the file's value times F); repeatable, "
                    "the grid takes every combination");
    app->add_option("--set", req.sets, "override a layer field in every model: --set shared_experts=0 (repeatable)");
    app->add_option("--dtype", req.dtype, "fp32 or bf16");
    app->add_option("--dispatch-dtype", req.dispatch_dtype, "layer | bf16 | fp8 | fp32 | auto (each point's fastest, predicted)");
    app->add_option("--exchange", req.exchange, "assignment | rank | auto (each point's fastest, predicted)");
    app->add_option("--combine-dtype", req.combine_dtype, "layer | bf16");
    app->add_option("--placement", req.placement, "contiguous | round-robin | random[:SEED] (a file fits one EP degree only)");
    app->add_option("--seed", req.seed, "seed of synthetic routing")->check(kSeedValidator);
    app->add_flag("--backward", req.backward, "simulate the backward pass too");
    app->add_flag("--kernel-scope", req.kernel_scope, "time only what a fused MoE kernel does (the paper's scope)");
    app->add_flag("--optimizer-state", req.optimizer_state, "count Adam's state in the memory check");
    app->add_option("--gemm-dtype", gemm_dtype, "what the GEMMs compute in: layer (default) | fp8 (a bf16 layer's GEMMs at the machine model's fp8 rates, as DeepSeek-V3 trains; H800/H200 models)");
    model_options.add_to(*app, false);
    app->add_option("--jobs,-j", req.jobs, "points simulated at once (default: the hardware threads)")->check(CLI::Range(1, 1024));
    app->add_option("--out", out, "folder for sweep.csv, sweep.json and report.md")->required();
  }

  int execute(const std::string& command) {
    if (req.routings.empty()) req.routings = {"uniform"};
    req.fp8_gemms = fp8_gemms_from(gemm_dtype);
    for (const auto& spec : vary_specs) req.vary.push_back(parse_vary(spec));
    {  // a field varied twice would run one value while the CSV shows both
      std::set<std::string> fields;
      for (const auto& [paths, values] : req.vary)
        for (const std::string& path : vary_fields(paths))
          if (!fields.insert(path).second)
            throw Error("--vary names the field '" + path + "' twice: give its values in one --vary (PATH=V1,V2,...)");
    }
    if (model_options.req.layers > 0) req.step = model_options.resolve();
    else if (model_options.req.dense_layers > 0 || model_options.attention_ms >= 0 || model_options.dense_ms >= 0 ||
             model_options.other_ms > 0 || model_options.req.dense_inter > 0 || model_options.req.attention_params > 0 ||
             model_options.req.attention_width > 0)
      throw Error("the step options (--dense-layers, --attention-*, ...) need --layers: a sweep of whole steps");
    std::error_code ec;
    if (std::filesystem::exists(out, ec) && !std::filesystem::is_directory(out, ec))
      throw Error("--out '" + out + "' is a file: the sweep writes a folder (sweep.csv, sweep.json, report.md)");
    check_save_dir(out);
    // Its three files, checked before the work: each writable, none of them
    // a file the sweep reads (a --model or --machine file in that folder).
    const std::string csv = (std::filesystem::path(out) / "sweep.csv").string(),
                      json = (std::filesystem::path(out) / "sweep.json").string(),
                      md = (std::filesystem::path(out) / "report.md").string();
    if (std::filesystem::is_directory(out, ec)) {  // else check_save_dir saw that it can be made
      check_writable(csv, "the sweep's CSV");
      check_writable(json, "the sweep's JSON");
      check_writable(md, "the sweep's report");
    }
    std::vector<std::pair<std::string, std::string>> inputs;
    for (const auto& m : req.models) inputs.emplace_back("--model", m);
    for (const auto& m : req.machines) inputs.emplace_back("--machine", m);
    inputs.emplace_back("--placement", req.placement);
    for (const auto& r : req.routings)
      if (r.rfind("trace:", 0) == 0) inputs.emplace_back("--routing", parse_routing_spec(r, req.seed).trace_path);
    check_distinct_outputs({{"--out (sweep.csv)", csv}, {"--out (sweep.json)", json}, {"--out (report.md)", md}}, "", inputs);
    const auto points = sweep_points(req);
    const auto start = std::chrono::steady_clock::now();
    auto last = start;
    const auto rows = run_sweep(req, points, [&](std::size_t k, std::size_t n) {
      const auto now = std::chrono::steady_clock::now();
      if (k == n || now - last > std::chrono::seconds(5)) {
        last = now;
        std::cerr << "sweep: " << k << " of " << n << " points, "
                  << std::chrono::duration_cast<std::chrono::seconds>(now - start).count() << " s\n";
      }
    });
    write_sweep(out, req, rows, command);
    std::size_t failed = 0;
    for (const auto& r : rows) failed += r.error.empty() ? 0 : 1;
    std::cout << "sweep: " << rows.size() << " points";
    if (failed) std::cout << " (" << failed << " not simulated: see the error column)";
    std::cout << " -> " << out << "/sweep.csv, sweep.json, report.md\n";
    return 0;
  }

 private:
  std::vector<std::string> vary_specs;
  std::string gemm_dtype = "layer";
};

}  // namespace hpmoe::front
