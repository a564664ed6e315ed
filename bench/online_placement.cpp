// Online placement against static placement on drifting sequences
// (docs/results/placement.md). Two scenarios:
//   traces  Mixtral-8x7B (bf16) at EP 4, TOKENS per rank, built from the
//           recorded routing: 10 segments of SEGMENT steps, each a MT-Bench
//           category and layer (five categories, layers 7, 15 and 23);
//           within a segment step k replays the trace's k-th window of
//           tokens (wrapping at its end).
//   zipf    deepseek-v3 (bf16, no shared expert) at EP 64, TOKENS per rank:
//           6 segments of SEGMENT steps of Zipf 1.2 routing, each segment a
//           new popularity (other hot experts), each step new draws.
// Each step is priced by the planner's cost model (hpmoe plan's: the
// slowest rank's expert GEMMs and, in training, replicas' weight refresh
// and gradient reduction) on a machine model. Four policies:
//   none      the contiguous placement
//   static    hpmoe plan's replicas from the sequence's first WINDOW steps, kept
//   online    the static plan, revised every REVISE steps from the last WINDOW
//             steps (revise_placement: at most CHANGES adds, drops, moves or
//             relocations); a revision's new homes receive their weights (a
//             moved owner its optimizer state too) over the link before the
//             next step, charged to that step in full. With DRIFT > 0, also
//             at once after a step whose slowest rank took more than 1 +
//             DRIFT times what the placement gave over its window when it
//             was last revised: then from that step alone, and later windows
//             start no earlier (the drift made the older steps stale). Every
//             rank sees the same counts, so every rank detects the same drift.
//   per-step  for the step, the plan made from that step alone and free to
//             move any weights (a bound no causal policy reaches); at EP 64
//             computed on every REVISE-th step only, mid-way between
//             revisions (its mean over those steps is the reference)
// With `fetched` (the 10th argument; `held` by default), replicas fetch their
// weights from the owner every step (a placement's fetch_replicas, what the
// PyTorch module's online placement uses over MPI): every policy's replicas
// pay the weights of every pass each step, a revision moves nothing, and no
// owner moves (its optimizer state stays).
// Prints each policy's mean step time (the slowest rank's expert time,
// milliseconds), its ratio to the per-step bound, and the online policy's
// bytes moved per step.
//
//   build/bench/online_placement traces|zipf [MACHINE] [SEGMENT] [WINDOW] [REVISE] [CHANGES] [TOKENS] [training|inference] [DRIFT] [held|fetched]
//   (defaults: h800 200 16 10 2 4096 training 0; run from the repository root: it reads data/routing)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "hpmoe/planning.hpp"
#include "placement/plan.hpp"
#include "compiler/taskflow.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/routing.hpp"
#include "sim/sim.hpp"

using namespace hpmoe;

namespace {

double slowest(const ExpertPlacement& p, const std::vector<std::int64_t>& counts, const ExpertCostModel& cost) {
  const auto t = rank_seconds(p, counts, cost);
  double m = 0;
  for (const double x : t) m = std::max(m, x);
  return m;
}

// The counts of every step of the sequence.
std::vector<std::vector<std::int64_t>> drifting_sequence(const LayerConfig& c, const std::string& data, std::int64_t segment) {
  const char* categories[] = {"coding", "roleplay", "writing", "extraction", "humanities"};
  const char* layers[] = {"7", "15", "23"};
  std::vector<std::vector<std::int64_t>> steps;
  const std::int64_t n = c.total_tokens(), k = c.top_k;
  for (int s = 0; s < 10; ++s) {
    std::int64_t tokens = 0;
    const auto trace = load_trace(data + "/" + categories[s % 5] + ".json", layers[s % 3], k, c.routed_experts, &tokens);
    for (std::int64_t step = 0; step < segment; ++step) {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(n * k));
      const std::int64_t first = (step * n) % tokens;
      for (std::int64_t t = 0; t < n; ++t)
        for (std::int64_t j = 0; j < k; ++j)
          ids[static_cast<std::size_t>(t * k + j)] = trace[static_cast<std::size_t>(((first + t) % tokens) * k + j)];
      steps.push_back(taskflow::routing_counts(c, ids).counts);
    }
  }
  return steps;
}

std::vector<std::vector<std::int64_t>> zipf_sequence(const LayerConfig& c, std::int64_t segment) {
  std::vector<std::vector<std::int64_t>> steps;
  for (std::uint64_t s = 0; s < 6; ++s) {
    RoutingSpec spec = parse_routing_spec("zipf:1.2", 11 + s * 101);  // a new popularity per segment
    for (std::int64_t step = 0; step < segment; ++step) {
      spec.step = static_cast<std::uint64_t>(step);
      steps.push_back(taskflow::routing_counts(c, forced_selection(c, spec)).counts);
    }
  }
  return steps;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "traces";
  const std::string machine_name = argc > 2 ? argv[2] : "h800";
  const std::int64_t segment = argc > 3 ? std::atoll(argv[3]) : 200, window = argc > 4 ? std::atoll(argv[4]) : 16;
  const std::int64_t revise = argc > 5 ? std::atoll(argv[5]) : 10, changes = argc > 6 ? std::atoll(argv[6]) : 2;
  const std::int64_t tokens_per_rank = argc > 7 ? std::atoll(argv[7]) : 4096;
  const bool training = argc > 8 ? std::string(argv[8]) != "inference" : true;
  const double drift = argc > 9 ? std::atof(argv[9]) : 0.0;
  const std::string replicas = argc > 10 ? argv[10] : "held";
  if ((scenario != "traces" && scenario != "zipf") || segment < 1 || window < 1 || revise < 1 || changes < 0 || tokens_per_rank < 1 ||
      !(drift >= 0) || (replicas != "held" && replicas != "fetched")) {
    std::fprintf(stderr, "online_placement: the scenario is traces or zipf; SEGMENT, WINDOW, REVISE and TOKENS must be positive, CHANGES and DRIFT not negative; replicas held or fetched\n");
    return 2;
  }
  const bool traces = scenario == "traces";
  LayerConfig c = preset(traces ? "mixtral-8x7b" : "deepseek-v3");
  c.ranks = traces ? 4 : 64;
  c.shared_experts = 0;
  c.tokens_per_rank = tokens_per_rank;
  c.dtype = DType::bf16;
  c.validate();
  const sim::MachineModel machine = sim::load_machine(machine_name);
  const bool fetched = replicas == "fetched";
  const ExpertCostModel cost = cost_model_of(machine, c, training, fetched);
  const auto steps = traces ? drifting_sequence(c, "data/routing/mixtral-8x7b", segment) : zipf_sequence(c, segment);
  const std::int64_t sample = traces ? 1 : revise;  // steps between per-step bounds
  const auto S = static_cast<std::int64_t>(steps.size());
  const ExpertPlacement contiguous = ExpertPlacement::contiguous(c.routed_experts, c.ranks);
  const std::int64_t budget = contiguous.max_local_count() + 1;
  const std::span<const std::vector<std::int64_t>> all(steps);
  ExpertPlacement fixed = plan_replicas(c, contiguous, all.subspan(0, static_cast<std::size_t>(std::min(window, S))), cost, budget);
  if (fetched) fixed = fixed.with_fetched_replicas();  // its revisions fetch too

  double none = 0, stat = 0, online = 0, bytes = 0, move_s = 0, fetched_bytes = 0;
  double bound_at = 0;  // the bound, on the steps it is computed for
  std::int64_t added = 0, dropped = 0, moved = 0, relocated = 0, sampled = 0;
  // The online policy (hpmoe/planning.hpp): revisions every REVISE steps and, with DRIFT, after a drifted step.
  OnlinePlacement policy(c, fixed, cost,
                         {.window = window, .every = revise, .max_changes = changes, .drift = drift, .slots_per_rank = budget,
                          .relocate = !fetched});
  double pending = 0;  // seconds of weight transfer before the next step
  for (std::int64_t t = 0; t < S; ++t) {
    const auto& counts = steps[static_cast<std::size_t>(t)];
    const double n = slowest(contiguous, counts, cost), f = slowest(fixed, counts, cost);
    if (t % sample == sample / 2) {  // mid-way between revisions: not only the steps that pay for a revision's moves
      bound_at += slowest(plan_replicas(c, contiguous, all.subspan(static_cast<std::size_t>(t), 1), cost, budget), counts, cost);
      ++sampled;
    }
    if (fetched)  // the replicas the step runs with take their weights for every pass
      fetched_bytes += double(policy.placement().instances() - policy.placement().experts()) * cost.weight_bytes * (training ? 2.0 : 1.0);
    // The policy prices the step on the placement it ran with (last_step_s), then may revise.
    const auto r = policy.observe(counts);
    none += n, stat += f, online += policy.last_step_s() + pending;
    move_s += pending;
    pending = 0;
    if (r) {
      added += r->added, dropped += r->dropped, moved += r->moved, relocated += r->relocated;
      bytes += r->bytes_moved;
      pending = r->bytes_moved / cost.weight_bytes * cost.move_s;
    }
  }
  const std::int64_t reactions = policy.drifts();
  const auto ms = [&](double total) { return total / double(S) * 1e3; };
  std::printf("%s bf16, EP %lld, %lld tokens/rank, %s, replicas %s, %lld steps (%s), machine %s\n", c.name.c_str(),
              static_cast<long long>(c.ranks), static_cast<long long>(tokens_per_rank), training ? "training" : "inference",
              fetched ? "fetched every step (owners stay)" : "held",
              static_cast<long long>(S), traces ? "10 segments: category and layer switch" : "6 segments of Zipf 1.2: the hot experts change",
              machine.name.c_str());
  std::printf("window %lld steps, revision every %lld steps, at most %lld changes each, %lld slots per rank; bound on %lld steps\n",
              static_cast<long long>(window), static_cast<long long>(revise), static_cast<long long>(changes),
              static_cast<long long>(budget), static_cast<long long>(sampled));
  if (drift > 0)
    std::printf("revised at once after a step over %.2fx its placement's expected time: %lld times\n", 1 + drift,
                static_cast<long long>(reactions));
  std::printf("| policy | mean step (ms, cost model) | over the per-step bound |\n|---|---|---|\n");
  const double bound_ms = bound_at / double(sampled) * 1e3;
  std::printf("| none (contiguous) | %.3f | %.3fx |\n", ms(none), ms(none) / bound_ms);
  std::printf("| static (first %lld steps) | %.3f | %.3fx |\n", static_cast<long long>(window), ms(stat), ms(stat) / bound_ms);
  std::printf("| online | %.3f | %.3fx |\n", ms(online), ms(online) / bound_ms);
  std::printf("| per-step bound | %.3f | 1.000x |\n", bound_ms);
  std::printf("online: %lld replicas added, %lld dropped, %lld moved, %lld experts relocated; %.2f MB of weights (and moved owners' optimizer state) per step (%.3f ms of link per step, included)\n",
              static_cast<long long>(added), static_cast<long long>(dropped), static_cast<long long>(moved),
              static_cast<long long>(relocated), bytes / double(S) / 1e6,
              ms(move_s));
  if (fetched)
    std::printf("online: replicas fetched %.2f MB of weights per step (priced in each step's time)\n", fetched_bytes / double(S) / 1e6);
  return 0;
}
