// hpmoe: the command-line front end. Every failure is one line on stderr and
// exit code 2; a run whose verification fails exits with 1.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>

#include "common/atomic_file.hpp"
#include "cli/compile_driver.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "placement/plan.hpp"
#include "cli/run.hpp"
#include "cli/calibrate.hpp"
#include "sim/sim.hpp"
#include "cli/trace.hpp"
#include "hpmoe/transport.hpp"
#include "cli/options.hpp"
#include "cli/simulate_commands.hpp"

namespace {

using namespace hpmoe;
using namespace hpmoe::front;

// "error: MESSAGE" as one line in one write(2), so that the lines of MPI
// ranks sharing a terminal never interleave mid-line.
void print_error(const std::string& message) {
  const std::string line = "error: " + one_line(message) + "\n";
  std::cerr.flush();
  for (std::size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(2, line.data() + done, line.size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
}

// An empty value ("-T ''") is a mistake, never a request for the default.
void refuse_empty_values(CLI::App& app) {
  const CLI::Validator not_empty(
      [](std::string& value) { return value.empty() ? std::string("an empty value is not allowed") : std::string(); },
      "", "not-empty");
  for (CLI::Option* option : app.get_options())
    if (option->get_type_size() != 0) option->check(not_empty);
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) refuse_empty_values(*sub);
}

// The options every layer command shares, and the checks of outputs before a run.

int parse_rank(const std::string& text, std::int64_t ranks) {
  std::size_t used = 0;
  int rank = -1;
  try {
    rank = std::stoi(text, &used);
  } catch (const std::exception&) {
  }
  if (used != text.size() || rank < 0 || rank >= ranks)
    throw Error("'" + text + "' is not a rank of this layer (0.." + std::to_string(ranks - 1) + ")");
  return rank;
}

// Progress on stderr: every phase, but the per-step lines of a long run at
// most every 5 s (3,000 iterations printed 1,690 lines, burying errors).
// Counted lines ("step 12 of 3000 ...", "change 3 of up to 64 ...") at most
// every 5 s per kind.
struct ProgressLine {
  std::map<std::string, double> last_s;  // by the line's first word
  void say(const std::string& what, double elapsed) {
    const std::string first = what.substr(0, what.find(' '));
    if (first == "step" || first == "change") {
      auto [it, fresh] = last_s.emplace(first, elapsed);
      if (!fresh) {
        if (elapsed - it->second < 5.0) return;
        it->second = elapsed;
      }
    }
    std::fprintf(stderr, "hpmoe: %s (%.1f s)\n", what.c_str(), elapsed);
  }
};

// One rank per MPI process. Errors end the process at once (exit code 2)
// rather than unwinding into collectives that a failed peer never joins;
// mpirun then stops the others.
int run_mpi(int argc, char** argv, RunRequest req, const MpiOptions& options, const std::string& json_file) {
  MpiSession mpi(&argc, &argv, 10 * options.peer_timeout_seconds);
  try {
    req.transport = make_mpi_transport(mpi, static_cast<int>(req.config.ranks), options);
    mpi.started();
    const bool root = req.transport->is_root();
    const auto start = std::chrono::steady_clock::now();
    ProgressLine line;
    auto progress = [&](const std::string& what) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (root && elapsed >= 2.0) line.say(what, elapsed);
    };
    const RunReport report = run_layer(req, progress);
    int status = 0;
    if (root) {
      std::cout << format_report(report) << std::flush;
      if (!json_file.empty()) write_json(json_file, to_json(report));
      status = report.verification.pass ? 0 : 1;
    }
    req.transport.reset();  // its last barrier, before MPI_Finalize
    return status;
  } catch (const std::exception& e) {
    print_error("rank " + std::to_string(mpi.rank()) + ": " + e.what());
    std::_Exit(2);
  }
}

// One struct per subcommand: its options, and what it does once parsed.
struct RunCommand {
  CLI::App* app = nullptr;
  LayerOptions layer;
  RunRequest req;
  std::string routing = "router", verify = "auto", json_file, run_mode = "auto", run_schedule = "critical-path";
  std::string transport = "inprocess", mpi_path = "auto", inject_fault;
  bool no_pin = false;
  double peer_timeout = 5.0;
  std::int64_t outbox_bytes = std::int64_t{64} << 20;
  std::string count_exchange = "auto";
  std::string auto_machine = "cpu-local";

  void add(CLI::App& parent) {
    app = parent.add_subcommand("run", "run a layer step on this machine, verified against the fp64 oracle");
    CLI::App* run = app;
    layer.add_to(*run);
    run->add_option("--workers,-W", req.workers_per_rank, "worker threads per rank")->check(CLI::Range(1, 256));
    run->add_option("--machine", auto_machine,
                    "with --exchange auto: the machine model the simulator chooses the scheme on (default cpu-local)");
    run->add_option("--routing", routing,
                    "router | uniform | grouped | balanced | zipf[:S] | hot[:SHARE] | trace:FILE[:LAYER][:repeat] | mixed (a new routing "
                    "every step: uniform, Zipf, a hot expert or idle ranks)");
    run->add_option("--seed", req.seed, "seed of weights, inputs and synthetic routing")->check(kSeedValidator);
    run->add_flag("--backward", req.backward, "run backward too (dx, dW1, dW2, router and shared gradients)");
    run->add_option("--iters", req.iterations, "measured iterations")->check(CLI::Range(1, 100000));
    run->add_option("--warmup", req.warmup, "warm-up iterations")->check(CLI::Range(0, 100000));
    run->add_option("--check-every", req.check_every,
                    "soak: every N steps compare the executors bit for bit and sample memory and open files")
        ->check(CLI::Range(1, 100000));
    run->add_option("--verify", verify, "auto | full | sample | off (auto: full oracle for small layers)");
    run->add_option("--sample", req.sample_tokens, "tokens recomputed in fp64 by --verify sample")->check(CLI::Range(1, 1 << 20));
    run->add_option("--json", json_file, "write the results as JSON");
    run->add_option("--save", req.save_dir, "write the run's tensors (safetensors) to this directory");
    run->add_option("--load", req.load_dir,
                    "run on a checkpoint (weights.safetensors, model.safetensors or a sharded model.safetensors.index.json; "
                    "DIR:PREFIX picks one layer of a whole model) and inputs.safetensors from this directory");
    run->add_flag("--no-pin", no_pin, "do not pin worker threads to cores");
    run->add_option("--mode", run_mode, "auto | serialized | interleaved | both (auto: both, side by side, checked bit-identical)");
    run->add_option("--trace", req.trace_file, "write a Chrome/Perfetto trace (JSON) of the last step of each executor");
    run->add_option("--timeline", req.timeline_file, "write the same as an SVG Gantt chart (serialized above interleaved)");
    run->add_option("--schedule", run_schedule, "scheduler policy of the interleaved runtime: fill | rank-rotated | critical-path | interleave-wgrad | ratr");
    run->add_option("--transport", transport,
                    "inprocess | mpi (mpi: one rank per process, `mpirun -np P hpmoe run --transport mpi ...`)");
    run->add_option("--mpi-path", mpi_path,
                    "auto | shared | network | hybrid: shared-memory windows on one machine, put+signal messages (TCP), "
                    "or windows inside each node (the layer's ranks_per_node consecutive ranks, else each machine's "
                    "processes) and messages across; auto: shared on one machine, hybrid where machines hold several "
                    "processes, else network");
    run->add_option("--watchdog", req.watchdog_seconds, "seconds without progress before a launch stops with an error")
        ->check(CLI::Range(0.01, 86400.0));
    run->add_option("--mpi-outbox", outbox_bytes,
                    "mpi network path: bytes of puts queued or in flight per process before workers wait for room")
        ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
    run->add_option("--count-exchange", count_exchange,
                    "mpi: auto | one-sided (shared memory: stores + arrival counter; network: the block sent straight "
                    "to every peer) | collective (MPI_Iallgather); auto: one-sided on shared memory, collective on the "
                    "network path (measured faster there)");
    run->add_flag("--check-inprocess", req.check_inprocess,
                  "mpi: also run the whole layer in process on rank 0 and check every rank's outputs and gradients "
                  "bit for bit against it (small layers)");
    run->add_flag("--verify-all-ranks", req.verify_all_ranks,
                  "mpi: each process regenerates every rank's program and verifies the whole set, an audit of the "
                  "per-rank proof (by default each rank proves only its own program against the exchanged counts)");
    run->add_option("--peer-timeout", peer_timeout, "mpi: seconds of silence after which a peer counts as failed")
        ->check(CLI::Range(0.1, 86400.0));
    run->add_option("--inject-fault", inject_fault, "testing: exit:RANK (that process dies at its first launch), freeze:RANK (it stops) or stall:RANK (a worker waits)")
        ->group("");
  }

  int execute(int argc, char** argv) {
    req.config = layer.resolve(true);
    req.placement = layer.resolve_placement(req.config);
    req.routing = parse_routing_spec(routing, req.seed);
    req.verify = parse_verify_mode(verify);
    req.mode = parse_run_mode(run_mode);
    req.policy = taskflow::parse_policy(run_schedule);
    if (layer.exchange_auto()) choose_run_exchange(req, auto_machine);
    else if (auto_machine != "cpu-local") throw Error("--machine names the model --exchange auto chooses on: give it with --exchange auto");
    req.pin = !no_pin;
    if (!inject_fault.empty()) {
      const auto colon = inject_fault.find(':');
      const std::string kind = inject_fault.substr(0, colon);
      if ((kind != "exit" && kind != "freeze" && kind != "stall") || colon == std::string::npos)
        throw Error("--inject-fault takes exit:RANK, freeze:RANK or stall:RANK, not '" + inject_fault + "'");
      req.fault.kind = kind == "exit"     ? RuntimeFault::exit_process
                       : kind == "freeze" ? RuntimeFault::freeze_process
                                          : RuntimeFault::stall;
      req.fault.rank = parse_rank(inject_fault.substr(colon + 1), req.config.ranks);
    }
    if (transport != "inprocess" && transport != "mpi")
      throw Error("--transport must be inprocess or mpi, not '" + transport + "'");
    if (transport == "inprocess" && mpi_path != "auto") throw Error("--mpi-path needs --transport mpi");
    if (count_exchange != "auto" && count_exchange != "collective" && count_exchange != "one-sided")
      throw Error("--count-exchange must be auto, one-sided or collective, not '" + count_exchange + "'");
    // Output paths are checked before the run, which can take minutes.
    for (const auto& [file, what] : {std::pair<const std::string&, const char*>{json_file, "JSON results"},
                                     {req.trace_file, "the trace"}, {req.timeline_file, "the timeline"}})
      if (!file.empty()) check_writable(file, what);
    check_distinct_outputs({{"--json", json_file}, {"--trace", req.trace_file}, {"--timeline", req.timeline_file}},
                           req.save_dir, {{"--config", layer.config_file}, {"--placement", layer.placement},
                                          {"--routing", req.routing.trace_path}});
    if (!req.save_dir.empty()) check_save_dir(req.save_dir);
    if (transport == "mpi")
      return run_mpi(argc, argv, req,
                     MpiOptions{.path = parse_mpi_path(mpi_path),
                                .peer_timeout_seconds = peer_timeout,
                                .outbox_bytes = outbox_bytes,
                                .count_exchange = count_exchange == "one-sided"    ? MpiOptions::CountExchange::one_sided
                                                  : count_exchange == "collective" ? MpiOptions::CountExchange::collective
                                                                                   : MpiOptions::CountExchange::automatic,
                                .ranks_per_node = static_cast<int>(req.config.ranks_per_node),
                                .agree = {}},
                     json_file);
    // Progress on stderr for anything that takes more than a couple of
    // seconds: always for large layers, otherwise once two seconds have passed.
    const auto start = std::chrono::steady_clock::now();
    const bool large = req.config.forward_flops() * (req.backward ? 3.0 : 1.0) > 2e10;
    ProgressLine line;
    auto progress = [&](const std::string& what) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (large || elapsed >= 2.0) line.say(what, elapsed);
    };
    const RunReport report = run_layer(req, progress);
    std::cout << format_report(report);
    if (!json_file.empty()) write_json(json_file, to_json(report));
    return report.verification.pass ? 0 : 1;
  }
};

struct PlanCommand {
  CLI::App* app = nullptr;
  LayerOptions layer;
  PlanRequest req;
  std::string routing = "zipf:1.2", out, json_file;
  bool inference = false, no_replicas = false;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("plan", "choose a placement with replicas (and, with --splits, tensor-parallel splits) of hot experts from load statistics");
    layer.add_to(*app);
    app->add_option("--machine", req.machine, "machine model whose rates price the experts (a file, or a name in machines/)");
    app->add_option("--routing", routing, "the load: uniform | grouped | balanced | zipf[:S] | hot[:SHARE] | trace:FILE[:LAYER][:repeat] | router");
    app->add_option("--steps", req.steps, "steps of load history (synthetic routing: the same hot experts, other draws each step; the router: seeds --seed, --seed + 1, ...)")->check(CLI::Range(1, 10000));
    app->add_option("--seed", req.seed, "seed of the first step's routing")->check(kSeedValidator);
    app->add_option("--slots-per-rank", req.slots_per_rank,
                    "experts a rank may hold, replicas included (default: one more than the starting placement's largest rank)")
        ->check(CLI::Range(1, 1 << 20));
    app->add_flag("--inference", inference, "do not charge replicas for refreshing weights and reducing gradients");
    app->add_flag("--splits", req.splits,
                  "also consider tensor-parallel splits of hot experts (HDA-MoE's hybrid TP/EP)");
    app->add_flag("--no-replicas", no_replicas, "add no replicas (with --splits: a static hybrid TP/EP mapping only)");
    app->add_option("--out", out, "write the placement here (JSON, for --placement)");
    app->add_option("--json", json_file, "write the report as JSON");
  }

  int execute() {
    req.config = layer.resolve(true, true);
    req.choose_exchange = !layer.exchange || layer.exchange_auto();  // auto unless a scheme is given
    req.choose_dispatch_dtype = layer.dispatch_auto();
    req.start = layer.resolve_placement(req.config);
    req.routing = parse_routing_spec(routing, req.seed);
    req.training = !inference;
    req.replicas = !no_replicas;
    if (!out.empty()) check_writable(out, "the placement");
    if (!json_file.empty()) check_writable(json_file, "JSON results");
    check_distinct_outputs({{"--out", out}, {"--json", json_file}}, "",
                           {{"--config", layer.config_file}, {"--placement", layer.placement}, {"--routing", req.routing.trace_path}});
    // Progress on stderr once a plan has run two seconds (a long history at EP 256 takes minutes).
    const auto start = std::chrono::steady_clock::now();
    ProgressLine line;
    const PlanReport report = plan_placement(req, [&](const std::string& what) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (elapsed >= 2.0) line.say(what, elapsed);
    });
    std::cout << format_report(report);
    if (!out.empty()) {
      write_file_atomically(out, to_json(report.after).dump(1) + "\n", "the placement");
      std::cout << "wrote " << out << "\n";
    }
    if (!json_file.empty()) write_json(json_file, to_json(report));
    return 0;
  }
};

struct CalibrateCommand {
  CLI::App* app = nullptr;
  sim::CalibrateOptions copt;
  std::string calibrate_out = "machines/cpu-local.json";

  void add(CLI::App& parent) {
    app = parent.add_subcommand("calibrate", "measure this machine and write the cpu-local machine model");
    app->add_option("--workers,-W", copt.workers, "workers per rank the model describes")->check(CLI::Range(1, 256));
    app->add_option("--out", calibrate_out, "where to write the model");
    app->add_flag("--quick", copt.quick, "one repetition per measurement (for tests)");
  }

  int execute() {
    check_writable(calibrate_out, "the machine model");
    const auto model = sim::calibrate(copt, [](const std::string& what) { std::fprintf(stderr, "hpmoe: calibrate: %s\n", what.c_str()); });
    sim::machine_from_json(model);  // what we write must load
    write_json(calibrate_out, model);
    std::cout << "wrote " << calibrate_out << "\n";
    return 0;
  }
};

struct ConfigCommand {
  CLI::App* app = nullptr;
  LayerOptions layer;
  bool list_fields = false, flat = false;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("config", "print a layer config (preset, imported file, overrides) as JSON");
    layer.add_to(*app, false);
    app->add_flag("--fields", list_fields, "list the field names --set accepts");
    app->add_flag("--flat", flat, "print one object of every field (what earlier versions printed) instead of the \"layer\" and \"run\" sections");
  }

  int execute() {
    if (list_fields) {
      for (const auto& f : config_fields()) std::cout << f << "\n";
      return 0;
    }
    const LayerConfig c = layer.resolve();
    std::cout << (flat ? to_json(c) : to_sections_json(c)).dump(2) << "\n";
    return 0;
  }
};

struct CompileCommand {
  CLI::App* app = nullptr;
  LayerOptions layer;
  CompileRequest creq;
  std::string compile_routing = "router", schedule = "critical-path", pass = "forward", compile_json, dump_file;
  std::uint64_t compile_seed = 1;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("compile", "compile a layer step into verified per-rank tile-task programs");
    CLI::App* compile = app;
    layer.add_to(*compile);
    compile->add_option("--routing", compile_routing, "router | uniform | grouped | balanced | zipf[:S] | hot[:SHARE] | trace:FILE[:LAYER][:repeat]");
    compile->add_option("--seed", compile_seed, "seed of the router's weights and inputs, and of synthetic routing")->check(kSeedValidator);
    compile->add_option("--machine", creq.machine, "cpu:W[:RxC] (W unified workers per rank), accel:MATRIX:VECTOR[:RxC], or a machine model as simulate takes it (a file, or a name in machines/: its units, put workers, tiles and ranks per node)");
    compile->add_option("--schedule", schedule, "fill | rank-rotated | critical-path | interleave-wgrad | ratr");
    compile->add_option("--pass", pass, "forward | backward | both");
    compile->add_option("--rank", creq.rank, "rank whose program the figures describe");
    compile->add_option("--dump", dump_file, "write every rank's program (JSON; with --pass both, FILE.forward.json and FILE.backward.json)");
    compile->add_option("--json", compile_json, "write the figures as JSON");
  }

  int execute() {
    creq.config = layer.resolve();
    creq.placement = layer.resolve_placement(creq.config);
    creq.routing = parse_routing_spec(compile_routing, compile_seed);
    creq.seed = compile_seed;
    creq.policy = taskflow::parse_policy(schedule);
    if (pass != "forward" && pass != "backward" && pass != "both")
      throw Error("--pass must be forward, backward or both, not '" + pass + "'");
    creq.forward = pass != "backward";
    creq.backward = pass != "forward";
    if (!compile_json.empty()) check_writable(compile_json, "JSON results");
    std::vector<std::pair<std::string, std::string>> outputs{{"--json", compile_json}};
    if (!dump_file.empty())
      for (const std::string& file : pass == "both" ? std::vector<std::string>{dump_file + ".forward.json", dump_file + ".backward.json"}
                                                    : std::vector<std::string>{dump_file}) {
        check_writable(file, "the program dump");
        outputs.emplace_back("--dump", file);
      }
    check_distinct_outputs(outputs, "",
                           {{"--config", layer.config_file}, {"--placement", layer.placement}, {"--machine", creq.machine},
                            {"--routing", creq.routing.trace_path}});
    const CompileReport report = compile_layer(creq);
    std::cout << format_report(report);
    if (!compile_json.empty()) write_json(compile_json, to_json(report));
    if (!dump_file.empty())
      for (const auto& p : report.passes) {
        const std::string file = report.passes.size() == 1
                                     ? dump_file
                                     : dump_file + (p.pass == taskflow::Pass::forward ? ".forward.json" : ".backward.json");
        write_file_atomically(file, dump_programs(p.programs).dump() + "\n", "the program dump");
      }
    bool ok = true;
    for (const auto& p : report.passes) ok = ok && p.verification.ok;
    return ok ? 0 : 1;
  }
};

struct VerifyCommand {
  CLI::App* app = nullptr;
  std::string verify_file;
  bool verify_listing = false;

  void add(CLI::App& parent) {
    app = parent.add_subcommand("verify", "verify a program dump written by `hpmoe compile --dump`");
    app->add_option("FILE", verify_file, "program dump")->required();
    app->add_flag("--list", verify_listing, "print a readable listing of rank 0's program");
  }

  int execute() {
    const auto programs = load_programs(verify_file);
    const auto report = taskflow::verify(programs);
    if (verify_listing) std::cout << taskflow::listing(programs.front());
    std::cout << programs.size() << " programs ("
              << (programs.front().pass == taskflow::Pass::forward ? "forward" : "backward") << "): "
              << (report.ok ? "PASS: no deadlock, events consistent, every read covered, no write conflicts"
                            : "FAIL: " + report.error)
              << "\n";
    return report.ok ? 0 : 1;
  }
};

int run_main(int argc, char** argv) {
  CLI::App app{"hpmoe: tile-level scheduling for expert-parallel MoE training (CPU runtime, oracle, baseline)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", HPMOE_VERSION);
  RunCommand run;
  SimulateCommand simulate;
  StepCommand step;
  SweepCommand sweep;
  CalibrateCommand calibrate;
  PlanCommand plan;
  ConfigCommand config;
  CompileCommand compile;
  VerifyCommand verify;
  run.add(app);
  simulate.add(app);
  step.add(app);
  sweep.add(app);
  calibrate.add(app);
  plan.add(app);
  config.add(app);
  auto* presets = app.add_subcommand("presets", "list the model presets");
  compile.add(app);
  verify.add(app);

  refuse_empty_values(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::CallForVersion&) {
    std::cout << HPMOE_VERSION << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    if (msg.empty()) msg = "invalid command line";
    print_error(msg + " (see hpmoe --help)");
    return 2;
  }

  if (presets->parsed()) {
    for (const auto& name : preset_names()) {
      const LayerConfig c = preset(name);
      std::cout << name << ": hidden " << c.hidden << ", expert inter " << c.expert_inter << ", experts "
                << c.routed_experts << "/" << c.shared_experts << ", top-" << c.top_k << "\n";
    }
    return 0;
  }
  if (compile.app->parsed()) return compile.execute();
  if (verify.app->parsed()) return verify.execute();
  if (simulate.app->parsed()) return simulate.execute();
  if (step.app->parsed()) return step.execute();
  if (sweep.app->parsed()) {
    std::string command = "hpmoe";
    for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
    return sweep.execute(command);
  }
  if (calibrate.app->parsed()) return calibrate.execute();
  if (plan.app->parsed()) return plan.execute();
  if (config.app->parsed()) return config.execute();
  return run.execute(argc, argv);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int rc = run_main(argc, argv);
    std::cout.flush();
    if (!std::cout) throw hpmoe::Error("cannot write to standard output (is the disk full, or the pipe closed?)");
    return rc;
  } catch (const hpmoe::Error& e) {
    print_error(e.what());
  } catch (const std::bad_alloc&) {
    print_error("out of memory: what this command was asked to hold does not fit this machine (use fewer tokens, ranks, experts, workers or steps)");
  } catch (const std::exception& e) {
    print_error(e.what());
  }
  return 2;
}
