// `hpmoe run` over MPI, one rank per process: each process holds its own
// experts and tokens, checks its own tokens against the oracle, and the
// ranks agree on the report.
#include "cli/run_parts.hpp"
#include "cli/run_agree.hpp"
#include "common/stats.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <cmath>
#include <limits>
#include <fstream>
#include <optional>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "hpmoe/error.hpp"
#include "kernels/kernels.hpp"
#include "hpmoe/reference.hpp"
#include "cli/trace.hpp"
#include "hpmoe/safetensors.hpp"

namespace hpmoe {
namespace run_detail {

// Every rank's `mine` (the same length on every rank), in rank order.
std::vector<std::vector<double>> allgather_doubles(Transport& tr, int me, const std::vector<double>& mine) {
  const std::size_t n = mine.size();
  std::vector<double> all(n * static_cast<std::size_t>(tr.ranks()), 0.0);
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(me)));
  tr.allgather(std::as_writable_bytes(std::span<double>(all)), n * sizeof(double));
  std::vector<std::vector<double>> out(static_cast<std::size_t>(tr.ranks()));
  for (std::size_t q = 0; q < out.size(); ++q)
    out[q].assign(all.begin() + static_cast<std::ptrdiff_t>(q * n),
                  all.begin() + static_cast<std::ptrdiff_t>((q + 1) * n));
  return out;
}

// A sharded soak's figures: mismatches summed over ranks, and every rank's
// memory and open files at the first and last samples.
void gather_soak(Transport& tr, int me, int warmup, SoakReport& soak) {
  if (soak.samples.empty()) return;
  const auto after_warmup = std::find_if(soak.samples.begin(), soak.samples.end(),
                                         [&](const SoakSample& x) { return x.step > warmup; });
  const SoakSample& first = after_warmup != soak.samples.end() ? *after_warmup : soak.samples.back();
  const SoakSample& final_sample = soak.samples.back();
  const auto all = allgather_doubles(tr, me, {first.rss_bytes, final_sample.rss_bytes, double(first.open_files),
                                              double(final_sample.open_files), double(soak.mismatches)});
  soak.mismatches = 0;
  for (const auto& r : all) {
    soak.ranks.push_back({r[0], r[1], r[2], r[3]});
    soak.mismatches += static_cast<std::int64_t>(r[4]);
  }
}

// Each step's time as the slowest rank's: the step ends when every rank has.
void slowest_rank(Transport& tr, int me, std::vector<double>& samples) {
  const auto all = allgather_doubles(tr, me, samples);
  for (const auto& rank : all)
    for (std::size_t i = 0; i < samples.size(); ++i) samples[i] = std::max(samples[i], rank[i]);
}

// The experts a rank holds weights of (its own and its replicas).
std::vector<std::int32_t> experts_of(const ExpertPlacement& placement, int rank) {
  const auto span = placement.experts_of(rank);
  return {span.begin(), span.end()};
}

// The experts a rank owns: it holds their gradients and saves them.
std::vector<std::int32_t> owned_by(const ExpertPlacement& placement, int rank) {
  std::vector<std::int32_t> out;
  for (const std::int32_t e : placement.experts_of(rank))
    if (placement.owner(e) == rank) out.push_back(e);
  return out;
}

// Rows a rank computes in a step: its experts' rows, a replicated expert's
// as the quota plan divides them.
std::int64_t rows_into(const ExpertPlacement& placement, std::span<const std::int64_t> counts, int rank) {
  const auto per_instance = instance_rows(placement, counts);
  std::int64_t rows = 0;
  for (std::int64_t i = 0; i < placement.instances(); ++i)
    if (placement.instance_rank(i) == rank) rows += per_instance[static_cast<std::size_t>(i)];
  return rows;
}

// Rank `me`'s tokens checked against the fp64 oracle on this process alone:
// the oracle runs the layer as if it had one rank (routing, capacity and the
// balancing terms are per rank, so every per-token value is the same), with
// the experts the sampled tokens chose drawn again from their seeds (or
// read from the checkpoint) where another rank owns them.
Verification verify_own_tokens(const RunRequest& req, const LayerWeights& held, const LayerInputs& in,
                               const StepResult& res, int me, const Checkpoint* checkpoint) {
  LayerConfig lc = req.config;
  lc.ranks = 1;
  lc.ranks_per_node = 0;
  Verification v;
  OracleOptions opt;
  if (!plan_oracle(req, lc, res, 1e9, me, v, opt)) return v;
  const std::int64_t K = lc.top_k;
  if (opt.tokens.empty())  // every own token; weight gradients need every rank's tokens
    for (std::int64_t t = 0; t < lc.tokens_per_rank; ++t) opt.tokens.push_back(t);
  // The experts the checked tokens use: the replicated parameters are here,
  // the experts drawn (or read) one by one. Tokens go to the oracle in
  // batches whose experts fit in about 1 GB, so checking a large layer
  // never holds more than that of remote experts at once.
  LayerWeights w;
  w.router = held.router;
  w.expert_bias = held.expert_bias;
  w.shared_w1 = held.shared_w1;
  w.shared_w2 = held.shared_w2;
  w.w1.resize(static_cast<std::size_t>(lc.routed_experts));
  w.w2.resize(static_cast<std::size_t>(lc.routed_experts));
  const double expert_bytes = 12.0 * double(lc.hidden) * double(lc.expert_inter);
  const auto budget = static_cast<std::size_t>(std::max<double>(double(K), 1e9 / expert_bytes));
  std::vector<std::int32_t> present;
  std::vector<std::int64_t> batch;
  OracleResult ref;
  bool first = true;
  auto flush = [&] {
    if (batch.empty()) return;
    OracleOptions part = opt;
    part.tokens = batch;
    OracleResult r = reference_layer(lc, w, in, part);
    if (first) {
      ref.routing = std::move(r.routing);
      ref.own_choice_differences = r.own_choice_differences;
      first = false;
    }
    ref.tokens.insert(ref.tokens.end(), r.tokens.begin(), r.tokens.end());
    ref.out.insert(ref.out.end(), r.out.begin(), r.out.end());
    ref.dx.insert(ref.dx.end(), r.dx.begin(), r.dx.end());
    for (const auto e : present) w.w1[e] = Matrix(), w.w2[e] = Matrix();
    present.clear();
    batch.clear();
  };
  for (const auto t : opt.tokens) {
    std::vector<std::int32_t> fresh;
    for (std::int64_t k = 0; k < K; ++k) {
      const auto a = static_cast<std::size_t>(t * K + k);
      const std::int32_t e = res.routing.expert[a];
      if (res.routing.kept[a] && !holds_expert(w, e) && std::find(fresh.begin(), fresh.end(), e) == fresh.end())
        fresh.push_back(e);
    }
    if (present.size() + fresh.size() > budget) {
      flush();
      fresh.clear();
      for (std::int64_t k = 0; k < K; ++k) {
        const auto a = static_cast<std::size_t>(t * K + k);
        const std::int32_t e = res.routing.expert[a];
        if (res.routing.kept[a] && std::find(fresh.begin(), fresh.end(), e) == fresh.end()) fresh.push_back(e);
      }
    }
    for (const auto e : fresh) {
      if (checkpoint) load_expert(*checkpoint, req.config, e, w);
      else random_expert(req.config, req.seed, e, w);
      present.push_back(e);
    }
    batch.push_back(t);
  }
  flush();
  check_tokens(v, ref, res, lc.narrow_combine() ? DType::bf16 : lc.dtype, req.backward);
  for (const auto& ch : v.checks) v.pass = v.pass && ch.pass;
  return v;
}

// Every rank's verification, summarised on every process: each tensor's
// worst rank (largest relative L2), passing only if every rank passed.
Verification merge_verifications(Transport& tr, int me, const Verification& mine) {
  std::vector<double> block{double(mine.sample_tokens), double(mine.selection_mismatches), mine.pass ? 1.0 : 0.0};
  for (const auto& ch : mine.checks) block.insert(block.end(), {ch.rel_l2, ch.max_abs, ch.ref_max,
       ch.pass ? 1.0 : 0.0});
  const auto all = allgather_doubles(tr, me, block);
  Verification v = mine;
  v.sample_tokens = 0;
  v.selection_mismatches = 0;
  v.pass = true;
  for (std::size_t q = 0; q < all.size(); ++q) {
    v.sample_tokens += static_cast<std::int64_t>(all[q][0]);
    v.selection_mismatches += static_cast<std::int64_t>(all[q][1]);
    v.pass = v.pass && all[q][2] != 0;
  }
  for (std::size_t i = 0; i < v.checks.size(); ++i) {
    Comparison& ch = v.checks[i];
    std::size_t worst = 0;
    for (std::size_t q = 0; q < all.size(); ++q) {
      const double* f = all[q].data() + 3 + 4 * i;
      if (q == 0 || f[0] > all[worst][3 + 4 * i]) worst = q;
      ch.pass = (q == 0 ? true : ch.pass) && f[3] != 0;
    }
    const double* f = all[worst].data() + 3 + 4 * i;
    ch.rel_l2 = f[0];
    ch.max_abs = f[1];
    ch.ref_max = f[2];
    ch.tensor += " (worst: rank " + std::to_string(worst) + ")";
  }
  return v;
}

// One sharded step gathered onto the root: every rank's token rows and its
// experts' gradients (the replicated gradients are already on every rank).
StepResult gather_step(Transport& tr, int me, const LayerConfig& c, const ExpertPlacement& placement,
                       const StepResult& mine, bool backward) {
  const bool root = tr.is_root();
  const std::int64_t T = c.tokens_per_rank, H = c.hidden;
  StepResult all;
  if (root) {
    all.out = Matrix(c.total_tokens(), H);
    if (backward) {
      all.grads = zero_gradients(c);
      all.grads.router = mine.grads.router;
      all.grads.shared_w1 = mine.grads.shared_w1;
      all.grads.shared_w2 = mine.grads.shared_w2;
    }
  }
  auto rows = [&](const Matrix& local, Matrix& whole) {
    for (int q = 0; q < tr.ranks(); ++q) {
      if (q == me && root) {
        std::copy(local.data.begin(), local.data.end(), whole.data.begin() + static_cast<std::ptrdiff_t>(q * T * H));
        continue;
      }
      std::vector<float> piece = q == me ? local.data : std::vector<float>(root ? static_cast<std::size_t>(T * H) : 0);
      tr.gather(piece, q);
      if (root) std::copy(piece.begin(), piece.end(), whole.data.begin() + static_cast<std::ptrdiff_t>(q * T * H));
    }
  };
  rows(mine.out, all.out);
  if (!backward) return all;
  rows(mine.grads.x, all.grads.x);
  for (int q = 0; q < tr.ranks(); ++q) {
    const auto experts = owned_by(placement, q);
    const std::size_t each = static_cast<std::size_t>(H * 2 * c.expert_inter + c.expert_inter * H);
    std::vector<float> packed(q == me || root ? experts.size() * each : 0);
    if (q == me)
      for (std::size_t i = 0; i < experts.size(); ++i) {
        const auto& g1 = mine.grads.w1[experts[i]].data;
        const auto& g2 = mine.grads.w2[experts[i]].data;
        std::copy(g1.begin(), g1.end(), packed.begin() + static_cast<std::ptrdiff_t>(i * each));
        std::copy(g2.begin(), g2.end(), packed.begin() + static_cast<std::ptrdiff_t>(i * each + g1.size()));
      }
    if (!(q == me && root)) tr.gather(packed, q);
    if (!root) continue;
    for (std::size_t i = 0; i < experts.size(); ++i) {
      auto& g1 = all.grads.w1[experts[i]].data;
      auto& g2 = all.grads.w2[experts[i]].data;
      std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(i * each), g1.size(), g1.begin());
      std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(i * each + g1.size()), g2.size(), g2.begin());
    }
  }
  return all;
}

// A sharded save in two phases: every rank stages its files, the ranks
// agree that all succeeded, and only then is anything put in place (rank 0
// writing the index last). A rank that could not write (a full disk, a
// file-size limit) leaves the folder's earlier checkpoint whole on all, and
// every rank's error carries its reason: the ranks exit together, and
// mpirun may end the job before a slower process has printed its line.
void save_sharded(Transport& tr, int me, const std::string& dir, const RankTensors& t,
                  const ExpertPlacement& placement) {
  std::optional<SaveSet> staged;
  std::string failure;
  try {
    staged.emplace(stage_rank(dir, t));
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Each rank's failure, at most kReason bytes of it (empty: staged).
  constexpr std::size_t kReason = 512;
  std::vector<char> reasons(kReason * static_cast<std::size_t>(tr.ranks()), '\0');
  std::copy_n(failure.begin(), std::min(failure.size(), kReason - 1), reasons.begin() + static_cast<std::ptrdiff_t>(kReason * me));
  tr.allgather(std::as_writable_bytes(std::span<char>(reasons)), kReason);
  const std::string unchanged = ": nothing of this save was put in place, and the checkpoint there before is unchanged";
  if (!failure.empty()) throw Error(failure + unchanged);
  for (std::size_t q = 0; q < static_cast<std::size_t>(tr.ranks()); ++q)
    if (reasons[q * kReason] != '\0')
      throw Error("rank " + std::to_string(q) + " could not write its part of the save to '" + dir +
                  "': " + std::string(reasons.data() + q * kReason) + unchanged);
  staged->commit();
  allgather_doubles(tr, me, {1.0});  // every rank's files in place before rank 0 writes the index
  if (me == 0) finish_sharded_save(dir, t.config, placement);
}

RunReport run_sharded(const RunRequest& req, const std::function<void(const std::string&)>& say) {
  const LayerConfig& c = req.config;
  Transport& tr = *req.transport;
  int me = 0;
  while (!tr.hosts(me)) ++me;
  agree_on_request(tr, me, req);
  check_run_memory(req, true);
  const ExpertPlacement placement = placement_or_contiguous(req.placement, c.routed_experts, c.ranks);
  const auto held = experts_of(placement, me), owned = owned_by(placement, me);
  const std::vector<int> mine{me};
  say(req.load_dir.empty() ? "generating this rank's experts and tokens" : "loading this rank's experts and tokens from " + req.load_dir);
  // The replicated parameters now; each own expert generated (or read) and
  // packed in turn below.
  std::optional<Checkpoint> checkpoint;  // opened once: each expert is read from it by seeking
  if (!req.load_dir.empty()) checkpoint.emplace(req.load_dir);
  LayerWeights w = req.load_dir.empty() ? random_weights(c, req.seed, {}) : load_weights(req.load_dir, c, {});
  LayerInputs in = req.load_dir.empty() ? random_inputs(c, req.seed, mine) : load_inputs(req.load_dir, c, me,
                                      req.backward ? DOut::required : DOut::optional);
  StepChoices choices(c, req.routing, me);
  const RoutingSpec last_routing = choices.spec_of(req.warmup + req.iterations - 1);
  say("generating and packing this rank's experts for the tile kernels");
  const ExpertSource fetch = [&](std::int64_t e, LayerWeights& into) {
    if (checkpoint) load_expert(*checkpoint, c, e, into);
    else random_expert(c, req.seed, e, into);
  };
  // Whole experts packed as the layer is made; its engine packs only its
  // parts of split ones.
  Executors x = make_executors(req, std::move(w), placement, fetch);
  const LayerWeights& weights = x.layer->weights();

  RunReport rep = report_header(req, placement, x);
  rep.sharded = true;
  rep.verified_per_rank = !req.verify_all_ranks;
  rep.serialized_over = rep.transport;

  Steps steps;
  run_steps(req, x, in, choices, steps, rep.soak, say);
  gather_soak(tr, me, req.warmup, rep.soak);
  auto& serialized = steps.serialized;
  auto& interleaved = steps.interleaved;
  // The table's row of this rank, and every step's time as the slowest rank's.
  const StepResult& shown = x.use_interleaved ? steps.inter_last() : steps.last();
  const std::int64_t received = rows_into(placement, shown.expert_counts, me);
  const double elem = c.dtype == DType::fp32 ? 4.0 : 2.0;
  const std::vector<double> row{double(me), double(held.size()), double(received),
                                summarize(interleaved.forward).median, summarize(interleaved.backward).median,
                                summarize(serialized.forward).median, summarize(serialized.backward).median,
                                summarize(interleaved.host).median, peak_rss_bytes(),
                                double(held.size()) * double(3 * c.hidden * c.expert_inter) * elem * (req.backward ? 2.0 : 1.0),
                                double(shown.segment_bytes), double(shown.local_bytes)};
  for (const auto& r : allgather_doubles(tr, me, row))
    rep.ranks.push_back(RankSummary{static_cast<int>(r[0]), static_cast<std::int64_t>(r[1]),
                        static_cast<std::int64_t>(r[2]),
                                    r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11]});
  for (auto* v : {&interleaved.forward, &interleaved.backward, &serialized.forward, &serialized.backward})
    slowest_rank(tr, me, *v);
  summarize_into(rep, serialized, interleaved);
  describe_step(rep, c, weights, placement, shown);

  if (req.verify != VerifyMode::off) say("verifying this rank's tokens against the fp64 oracle");
  rep.verification = merge_verifications(tr, me, verify_own_tokens(req, weights, in, shown, me,
                                         checkpoint ? &*checkpoint : nullptr));
  auto record = [&](const Comparison& ch) {
    rep.verification.checks.push_back(ch);
    rep.verification.pass = rep.verification.pass && ch.pass;
  };
  if (x.use_interleaved && x.use_serialized) {  // on every rank, then whether all ranks agree
    const Comparison local = bit_identity("interleaved = serialized", steps.last(), steps.inter_last(), c, req.backward);
    Comparison ch = local;
    for (const auto& r : allgather_doubles(tr, me, {local.pass ? 1.0 : 0.0, double(local.tensors)})) {
      ch.pass = ch.pass && r[0] != 0;
      if (r[0] == 0 && ch.differing.empty()) ch.differing = "on some rank";
    }
    ch.tensor = "interleaved = serialized (every rank, its own tensors)";
    record(ch);
  }
  if (rep.soak.checks > 0) record(soak_check(rep.soak));
  if (req.check_inprocess) {
    // The whole layer once more on the root, in process, from the same seeds
    // (or checkpoint), as the bit-for-bit reference of every MPI executor.
    std::optional<Layer> serial;
    std::optional<Layer::Step> reference;
    LayerInputs whole_in;
    if (tr.is_root()) {
      say("running the whole layer in process on the root as the reference");
      whole_in = req.load_dir.empty() ? random_inputs(c, req.seed) : load_inputs(req.load_dir, c,
                                    req.backward ? DOut::required : DOut::optional);
      Parallel par;
      par.workers_per_rank = req.workers_per_rank;
      par.schedule = Schedule::serialized;
      par.backward = req.backward;
      par.pin = false;
      par.placement = placement;
      serial.emplace(c, req.load_dir.empty() ? random_weights(c, req.seed) : load_weights(req.load_dir, c), par);
      reference = one_step(*serial, whole_in, forced_selection(c, last_routing), Schedule::serialized, req.backward);
    }
    for (const auto& [name, result] :
         {std::pair<std::string, const StepResult*>{"phased (mpi)", x.use_serialized ? &steps.last() : nullptr},
          {"interleaved (mpi)", x.use_interleaved ? &steps.inter_last() : nullptr}}) {
      if (!result) continue;
      const StepResult gathered = gather_step(tr, me, c, placement, *result, req.backward);
      if (tr.is_root()) record(bit_identity(name + " = in-process serialized", gathered, reference->result(), c, req.backward));
    }
  }
  if (!req.save_dir.empty()) {
    say("saving this rank's tensors to " + req.save_dir);
    RankTensors t;
    t.config = c;
    t.placement = &placement;
    t.rank = me;
    t.experts = owned;
    t.expert = [&](std::int64_t e, LayerWeights& into) {  // released after packing: drawn or read again
      if (checkpoint) load_expert(*checkpoint, c, e, into);
      else random_expert(c, req.seed, e, into);
    };
    t.weights = &weights;
    t.inputs = &in;
    t.routing = &shown.routing;
    t.out = &shown.out;
    t.grads = req.backward ? &shown.grads : nullptr;
    save_sharded(tr, me, req.save_dir, t, placement);
  }
  if (x.trace && tr.is_root()) {
    std::vector<TracedRun> runs;
    if (x.use_serialized) runs.push_back({"serialized (phased, rank 0's workers)", &steps.last()});
    if (x.use_interleaved)
      runs.push_back({"interleaved (" + std::string(taskflow::name(req.policy)) + "), rank 0's workers", &steps.inter_last()});
    if (!req.trace_file.empty()) write_chrome_trace(req.trace_file, runs);
    if (!req.timeline_file.empty()) write_timeline_svg(req.timeline_file, runs);
  }
  return rep;
}

}  // namespace run_detail
}  // namespace hpmoe
