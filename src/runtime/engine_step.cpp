// The engine's step: hosting and packing at construction, the batch's
// token count, routing, the count exchange, compile and verify, forward and
// backward as the caller makes them.
#include <tuple>

#include "runtime/engine.hpp"

namespace hpmoe::detail {

template <class T>
Interleaved<T>::Interleaved(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt)
    : c_(c),
      w_(w),
      opt_(opt),
      layer_placement_(placement_or_contiguous(opt.placement, c.routed_experts, c.ranks)),
      table_(opt.access_table ? opt.access_table : &taskflow::AccessTable::standard()),
      tr_(opt.transport ? opt.transport : make_inprocess_transport(static_cast<int>(c.ranks))),
      local_(hosted_ranks(*tr_, c.ranks)),
      lc_(hosted_config(c, local_)),
      pool_(static_cast<int>(local_.size()), opt.workers_per_rank, opt.pin, tr_->node_index() * opt.workers_per_rank, opt.threads),
      packed_((kernels::init(), resolve_packing<T>(c, w, opt.packed, opt.backward))) {
  machine_ = taskflow::cpu_machine(opt.workers_per_rank);
  machine_.tile_rows = kernels::token_tile_rows<T>();
  machine_.weight_tile_rows = kernels::weight_tile_rows<T>();
  machine_.weight_tile_cols = kernels::kWeightTileCols;
  machine_.tile_cols = kTileCols;
  plan.forward.resize(static_cast<std::size_t>(c.ranks));
  plan.backward.resize(static_cast<std::size_t>(c.ranks));
  ranks_.resize(static_cast<std::size_t>(c.ranks));
  const auto workers = local_.size() * static_cast<std::size_t>(opt.workers_per_rank);
  waiting_ = std::make_unique<std::atomic<std::int32_t>[]>(workers);
  for (std::size_t i = 0; i < workers; ++i) waiting_[i].store(-1);
  staging_.resize(workers);
  index_of_.assign(static_cast<std::size_t>(c.ranks), -1);
  for (int r = 0; r < c.ranks; ++r) all_ranks_.push_back(r);
  for (std::size_t i = 0; i < local_.size(); ++i) {
    index_of_[static_cast<std::size_t>(local_[i])] = static_cast<int>(i);
    for (const std::int32_t e : layer_placement_.experts_of(local_[i])) {
      // A split expert's parts are packed below; a fetched replica's
      // weights come from its owner by puts every step.
      if (!packed_->holds(e) && !layer_placement_.is_split(e) && !layer_placement_.borrows(layer_placement_.instance_on(e, local_[i])))
        throw Error("rank " + std::to_string(local_[i]) + " owns expert " + std::to_string(e) +
                    " but this process holds no weights for it: give every process its own experts' weights");
      if (layer_placement_.owner(e) == local_[i]) owned_.push_back(e);  // replicas: the owner holds the gradient
    }
  }
  if (sharded() && local_.size() != 1)
    throw Error("a transport that spreads ranks over processes must host one rank per process (this one hosts " +
                std::to_string(local_.size()) + ")");
  layer_placement_.check_fits(c.routed_experts, c.ranks, c.expert_inter, c.dtype == DType::bf16 ? 2 : 1);
  if (layer_placement_.has_splits()) pack_split_parts(opt.backward);
  phases_ = {taskflow::layer_operators(c, layer_placement_.has_splits(), taskflow::Pass::forward, layer_placement_.fetches_replicas()),
             taskflow::layer_operators(c, layer_placement_.has_splits(), taskflow::Pass::backward, layer_placement_.fetches_replicas())};
  fingerprint_ = layer_fingerprint(c, layer_placement_, w);
  tr_->watch_workers(&activity_);
}

template <class T>
void Interleaved<T>::set_tokens(const MatrixView& x) {
  const auto hosted = static_cast<std::int64_t>(local_.size());
  if (x.rows <= 0 || x.rows % hosted != 0)
    throw Error("input x has " + std::to_string(x.rows) + " rows, which the " + std::to_string(hosted) +
                " ranks of this process cannot share evenly (give a positive multiple of " + std::to_string(hosted) +
                " tokens)");
  const std::int64_t tokens = x.rows / hosted;
  if (tokens == c_.tokens_per_rank) return;
  LayerConfig next = c_;
  next.tokens_per_rank = tokens;
  next.validate();
  c_ = next;
  lc_.tokens_per_rank = tokens;
  fingerprint_ = layer_fingerprint(c_, layer_placement_, w_);
}

template <class T>
void Interleaved<T>::weights_changed(std::shared_ptr<const PackedWeights> packed) {
  forward_done_ = nullptr;  // a forward before the change has no backward after it
  if (packed) packed_ = resolve_packing<T>(c_, w_, packed, opt_.backward);
  if (layer_placement_.has_splits()) pack_split_parts(opt_.backward);
  fingerprint_ = layer_fingerprint(c_, layer_placement_, w_);
}

template <class T>
void Interleaved<T>::pack_split_parts(bool backward) {
  std::vector<std::int64_t> jobs;
  for (const int r : local_)
    for (const std::int64_t i : layer_placement_.instances_of(r))
      if (layer_placement_.is_split(layer_placement_.instance_expert(i))) jobs.push_back(i);
  part_packed_.assign(static_cast<std::size_t>(layer_placement_.instances()), PartWeights{});
  if (std::all_of(jobs.begin(), jobs.end(), [&](std::int64_t i) { return holds_expert(w_, layer_placement_.instance_expert(i)); })) {
    on_all_cores(jobs.size(), [&](std::size_t j) { pack_part(jobs[j], w_, backward); });
    return;
  }
  // Sharded: each part's expert fetched in turn, packed, and released.
  if (!opt_.expert_source)
    throw Error("this process computes parts of split experts whose weights it was not given: pass their weights or an "
                "expert source");
  LayerWeights fetched;
  fetched.w1.resize(static_cast<std::size_t>(c_.routed_experts));
  fetched.w2.resize(static_cast<std::size_t>(c_.routed_experts));
  for (const std::int64_t i : jobs) {
    const auto e = static_cast<std::size_t>(layer_placement_.instance_expert(i));
    const bool here = holds_expert(w_, static_cast<std::int64_t>(e));
    if (!here) opt_.expert_source(static_cast<std::int64_t>(e), fetched);
    pack_part(i, here ? w_ : fetched, backward);
    fetched.w1[e] = Matrix();
    fetched.w2[e] = Matrix();
  }
}

template <class T>
void Interleaved<T>::pack_part(std::int64_t i, const LayerWeights& w, bool backward) {
  const std::int64_t H = c_.hidden, I = c_.expert_inter, e = layer_placement_.instance_expert(i);
  {
    const auto [c0, c1] = layer_placement_.part_columns(i, I);
    const std::int64_t Ip = c1 - c0;
    const Matrix& w1 = w.w1[static_cast<std::size_t>(e)];
    const Matrix& w2 = w.w2[static_cast<std::size_t>(e)];
    if (w1.rows != H || w1.cols != 2 * I || w2.rows != I || w2.cols != H)
      throw Error("split expert " + std::to_string(e) + "'s weights are not [hidden, 2 expert_inter] and [expert_inter, hidden]");
    Matrix p1(H, 2 * Ip), p2(Ip, H);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t k = 0; k < Ip; ++k) {
        p1.data[static_cast<std::size_t>(h * 2 * Ip + k)] = w1.data[static_cast<std::size_t>(h * 2 * I + c0 + k)];
        p1.data[static_cast<std::size_t>(h * 2 * Ip + Ip + k)] = w1.data[static_cast<std::size_t>(h * 2 * I + I + c0 + k)];
      }
    std::copy_n(w2.data.begin() + c0 * H, Ip * H, p2.data.begin());
    PartWeights& pw = part_packed_[static_cast<std::size_t>(i)];
    pw.w1 = operand_of<T>(p1);
    pw.w2 = operand_of<T>(p2);
    if (backward) {
      pw.w1_t = transposed_operand_of<T>(p1);
      pw.w2_t = transposed_operand_of<T>(p2);
    }
  }
}

template <class T>
void Interleaved<T>::forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& res) {
  set_tokens(x);
  check_token_view(lc_, x, "input x");
  x_ = x;
  forward_done_ = nullptr;
  res.forward_ops.clear();
  res.backward_ops.clear();
  res.trace.clear();
  step_start_ = Clock::now();
  check_output_view(res.out_into, "output view");
  if (res.out_into) res.out = Matrix();
  else if (res.out.rows != lc_.total_tokens() || res.out.cols != c_.hidden) res.out = Matrix(lc_.total_tokens(), c_.hidden);
  auto t0 = Clock::now();
  res.routing = run_router(pool_, lc_, packed_->router.view(), x_, w_.expert_bias, forced, logits_);
  auto t1 = Clock::now();
  res.forward_ops.push_back({"router", seconds(t0, t1)});
  res.router_seconds = seconds(t0, t1);
  exchange_counts(res);
  const auto t1x = Clock::now();
  if (sharded()) res.forward_ops.push_back({"count_exchange", seconds(t1, t1x)});
  t1 = t1x;
  // The step's plan: its layout, the per-rank exchange's routes and token
  // counts, then the forward's programs, proved. (The backward's join the
  // plan when the backward runs: a forward may have none.)
  planner_.lay_out(plan, c_, layer_placement_, machine_.tile_rows, res.routing, local_);
  if (c_.exchange == ExchangeMode::rank) exchange_rank_tokens(res);
  const auto times = planner_.compile(plan, c_, machine_, taskflow::Pass::forward, compiled_ranks(), local_);
  res.forward_ops.push_back({"compile", seconds(t1, Clock::now()) - times.verify_seconds});
  res.forward_ops.push_back({"verify", times.verify_seconds});
  res.forward_put_bytes = plan.forward_bytes.all;
  res.forward_cross_node_bytes = plan.forward_bytes.cross_node;
  res.forward_lent_bytes = plan.forward_bytes.lent;
  res.lent_experts = static_cast<std::int64_t>(plan.placement().lends().size());
  const auto t3 = Clock::now();
  res_ = &res;
  prepare_forward(res);
  res.forward_ops.push_back({"prepare", seconds(t3, Clock::now())});
  res.dispatch_to_combine_seconds = launch(plan.forward, res);
  if (!opt_.phased) res.forward_ops.push_back({"launch", res.dispatch_to_combine_seconds});
  forward_done_ = &res;
}

template <class T>
void Interleaved<T>::backward(MatrixView d_out, StepResult& res) {
  if (!opt_.backward)
    throw Error("backward: this executor was made for forward only; construct it with the backward option");
  if (forward_done_ != &res)
    throw Error("backward: call forward first, with the same result object (it holds the step's routing)");
  check_token_view(lc_, d_out, "output gradient d_out");
  d_out_ = d_out;
  res.backward_ops.clear();
  auto b0 = Clock::now();
  const auto times = planner_.compile(plan, c_, machine_, taskflow::Pass::backward, compiled_ranks(), local_);
  const auto b2 = Clock::now();
  res.backward_ops.push_back({"compile", seconds(b0, b2) - times.verify_seconds});
  res.backward_ops.push_back({"verify", times.verify_seconds});
  res.backward_put_bytes = plan.backward_bytes.all;
  res.backward_cross_node_bytes = plan.backward_bytes.cross_node;
  res.backward_lent_bytes = plan.backward_bytes.lent;
  check_output_view(res.dx_into, "dx view");
  check_gradient_views(res);
  if (!gradients_fit(res.grads)) res.grads = zero_gradients(c_, owned_, lc_.total_tokens());
  if (res.dx_into) res.grads.x = Matrix();
  else if (res.grads.x.rows != lc_.total_tokens()) res.grads.x = Matrix(lc_.total_tokens(), c_.hidden);
  prepare_backward(res);
  res.backward_ops.push_back({"prepare", seconds(b2, Clock::now())});
  res.backward_seconds = launch(plan.backward, res);
  if (!opt_.phased) res.backward_ops.push_back({"launch", res.backward_seconds});
  const auto r0 = Clock::now();
  reducer_.reduce(res, plan.placement(),
                  {*tr_, local_, sharded(), [this](int q, BufferId id) -> const float* { return base<float>(q, id); }});
  transpose_remaining_gradients(res);
  res.backward_ops.push_back({"reduce_replicated_grads", seconds(r0, Clock::now())});
  forward_done_ = nullptr;  // one backward per forward
}

template <class T>
void Interleaved<T>::check_gradient_views(const StepResult& res) const {
  const auto& into = res.expert_grads_into;
  if (into.empty()) return;
  if (into.size() != static_cast<std::size_t>(c_.routed_experts))
    throw Error("expert gradient views: " + std::to_string(into.size()) + " given, the layer has " +
                std::to_string(c_.routed_experts) + " routed experts (give one per expert, or none)");
  const std::int64_t H = c_.hidden, I = c_.expert_inter;
  for (std::size_t e = 0; e < into.size(); ++e) {
    const ExpertGradientsInto& v = into[e];
    const bool fp32 = v.w1_t || v.w2_t, half = v.w1_t_bf16 || v.w2_t_bf16;
    if (!fp32 && !half) continue;
    const std::string what = "expert " + std::to_string(e) + "'s gradient view ";
    if (fp32 && half) throw Error(what + "is given in float32 and in bfloat16: give one pair");
    if (std::find(owned_.begin(), owned_.end(), static_cast<std::int32_t>(e)) == owned_.end())
      throw Error(what + "given, but this process does not own the expert (its owner returns its gradients)");
    const auto check = [&](bool set, std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t want_rows,
                           std::int64_t want_cols, const char* name) {
      if (!set || rows != want_rows || cols != want_cols || ld < cols)
        throw Error(what + name + " must be [" + std::to_string(want_rows) + ", " + std::to_string(want_cols) +
                    "] with a row stride >= " + std::to_string(want_cols) + " (got [" + std::to_string(rows) + ", " +
                    std::to_string(cols) + "], stride " + std::to_string(ld) + ")");
    };
    if (fp32) {
      check(bool(v.w1_t), v.w1_t.rows, v.w1_t.cols, v.w1_t.ld, 2 * I, H, "w1_t");
      check(bool(v.w2_t), v.w2_t.rows, v.w2_t.cols, v.w2_t.ld, H, I, "w2_t");
    } else {
      check(bool(v.w1_t_bf16), v.w1_t_bf16.rows, v.w1_t_bf16.cols, v.w1_t_bf16.ld, 2 * I, H, "w1_t_bf16");
      check(bool(v.w2_t_bf16), v.w2_t_bf16.rows, v.w2_t_bf16.cols, v.w2_t_bf16.ld, H, I, "w2_t_bf16");
    }
  }
}

// Replicated, lent and split experts are summed in the math layout; their
// sums, the only ones not stored by their tiles, are transposed in here.
template <class T>
void Interleaved<T>::transpose_remaining_gradients(StepResult& res) const {
  for (std::size_t e = 0; e < res.expert_grads_into.size(); ++e) {
    const ExpertGradientsInto& into = res.expert_grads_into[e];
    if (!into || gradient_stored_transposed(res, static_cast<std::int32_t>(e))) continue;
    for (const bool w1 : {true, false}) {
      const Matrix& src = w1 ? res.grads.w1[e] : res.grads.w2[e];
      const MutableMatrixView& f = w1 ? into.w1_t : into.w2_t;
      const MutableBf16View& b = w1 ? into.w1_t_bf16 : into.w2_t_bf16;
      for (std::int64_t i = 0; i < src.rows; ++i)
        for (std::int64_t j = 0; j < src.cols; ++j) {
          const float v = src.data[static_cast<std::size_t>(i * src.cols + j)];
          if (into.in_bf16()) b.data[j * b.ld + i] = bf16::from_float(v);
          else f.data[j * f.ld + i] = v;
        }
    }
  }
}

template <class T>
bool Interleaved<T>::gradients_fit(const LayerGradients& g) const {
  if (g.w1.size() != static_cast<std::size_t>(c_.routed_experts) || g.w2.size() != g.w1.size()) return false;
  for (const std::int32_t e : owned_)
    if (g.w1[e].rows != c_.hidden || g.w2[e].rows != c_.expert_inter) return false;
  return g.router.rows == c_.hidden && g.router.cols == c_.routed_experts;
}

template <class T>
void Interleaved<T>::exchange_counts(StepResult& res) {
  const std::int64_t P = c_.ranks, E = c_.routed_experts;
  const auto local = taskflow::routing_counts(lc_, res.routing);  // [hosted ranks, E]
  // A step's counts start empty: nothing of the last step's may reach this
  // one's exchange (its per-rank token counts, sized and valued for the
  // last routing, made the second step of a kept layer fail).
  auto& counts = plan.counts;
  counts = taskflow::RoutingCounts{};
  counts.ranks = P;
  counts.experts = E;
  if (!sharded()) {
    counts.counts = local.counts;
    res.expert_counts = counts.counts;
    return;
  }
  // One block per rank: fingerprint, aux-loss term, z-loss term, E counts.
  const std::int64_t width = 3 + E;
  const int me = local_.front();
  count_block_.assign(static_cast<std::size_t>(P * width), 0);
  std::uint64_t* mine = count_block_.data() + me * width;
  mine[0] = fingerprint_;
  std::memcpy(&mine[1], &res.routing.aux_loss, sizeof(double));
  std::memcpy(&mine[2], &res.routing.z_loss, sizeof(double));
  for (std::int64_t e = 0; e < E; ++e) mine[3 + e] = static_cast<std::uint64_t>(local.counts[static_cast<std::size_t>(e)]);
  tr_->allgather(std::as_writable_bytes(std::span<std::uint64_t>(count_block_)), static_cast<std::size_t>(width) * 8);
  counts.counts.assign(static_cast<std::size_t>(P * E), 0);
  double aux = 0, z = 0;
  const std::int64_t limit = c_.tokens_per_rank * c_.top_k;
  for (std::int64_t q = 0; q < P; ++q) {
    const std::uint64_t* block = count_block_.data() + q * width;
    if (block[0] != fingerprint_)
      throw Error("rank " + std::to_string(q) + " runs a different layer, placement or checkpoint than rank " +
                  std::to_string(me) + ", or another number of tokens (fingerprint " + hex(block[0]) + " vs " +
                  hex(fingerprint_) + "): start every rank with the same configuration, --placement and --load, and "
                  "give every rank the same number of tokens");
    double term = 0;
    std::memcpy(&term, &block[1], sizeof(double));
    aux += term;
    std::memcpy(&term, &block[2], sizeof(double));
    z += term;
    std::int64_t sum = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      const auto n = static_cast<std::int64_t>(block[3 + e]);
      if (n < 0 || n > limit) throw Error("rank " + std::to_string(q) + " reports " + std::to_string(n) + " rows for expert " + std::to_string(e) + ", more than its " + std::to_string(limit) + " assignments");
      sum += n;
      counts.counts[static_cast<std::size_t>(q * E + e)] = n;
    }
    if (sum > limit) throw Error("rank " + std::to_string(q) + " reports " + std::to_string(sum) + " kept assignments, more than its " + std::to_string(limit));
  }
  res.routing.aux_loss = aux;
  res.routing.z_loss = z;
  res.expert_counts = counts.counts;
}

template <class T>
void Interleaved<T>::exchange_rank_tokens(const StepResult& res) {
  // Per source: its tokens by first instance [s N + i], then by last
  // [P N + s N + i], then (the per-node exchange) per node and node slot
  // [2 P N + 2 s B S + b S + j], per node and node combine slot
  // [2 P N + 2 s B S + B S + b S + c] (B below: 2 B S), and its direct
  // tokens by first and by last instance [2 P N + P B + s N + i],
  // [2 P N + P B + P N + s N + i] (Exchange::set_rank_tokens).
  const std::int64_t P = c_.ranks, N = plan.ex().instances(), B = c_.forwards() ? 2 * c_.nodes() * plan.ex().node_slots() : 0;
  const std::int64_t D = c_.forwards() ? 2 * N : 0;
  planner_.route(plan, c_, res.routing, local_);
  std::vector<std::int64_t> first(static_cast<std::size_t>(plan.ex().token_count_values()), 0);
  const auto place = [&](std::int64_t s, std::int64_t k) {  // value k of source s's 2 N + B + D
    if (k < 2 * N) return static_cast<std::size_t>(k < N ? s * N + k : (P + s) * N + k - N);
    if (k < 2 * N + B) return static_cast<std::size_t>(2 * P * N + s * B + k - 2 * N);
    k -= 2 * N + B;
    return static_cast<std::size_t>(2 * P * N + P * B + (k < N ? s * N + k : (P + s) * N + k - N));
  };
  for (std::size_t i = 0; i < local_.size(); ++i) {
    const std::int64_t s = local_[i];
    for (std::int64_t k = 0; k < 2 * N; ++k) first[place(s, k)] = plan.routes[i].first[static_cast<std::size_t>(k)];
    for (std::int64_t k = 0; k < B; ++k) first[place(s, 2 * N + k)] = plan.routes[i].node_count[static_cast<std::size_t>(k)];
    for (std::int64_t k = 0; k < D; ++k) first[place(s, 2 * N + B + k)] = plan.routes[i].first[static_cast<std::size_t>(2 * N + k)];
  }
  if (sharded()) {  // one row per rank (set_rank_tokens checks the values against each other)
    const int me = local_.front();
    const std::int64_t W = 2 * N + B + D;
    std::vector<std::uint64_t> block(static_cast<std::size_t>(P * W));
    for (std::int64_t k = 0; k < W; ++k) block[static_cast<std::size_t>(me * W + k)] = static_cast<std::uint64_t>(first[place(me, k)]);
    tr_->allgather(std::as_writable_bytes(std::span<std::uint64_t>(block)), static_cast<std::size_t>(W) * 8);
    for (std::size_t k = 0; k < block.size(); ++k) {
      const std::int64_t q = static_cast<std::int64_t>(k) / W, i = static_cast<std::int64_t>(k) % W;
      if (block[k] > static_cast<std::uint64_t>(c_.tokens_per_rank))
        throw Error("rank " + std::to_string(q) + " reports " + std::to_string(block[k]) + " tokens for " +
                    (i < 2 * N        ? "expert instance " + std::to_string(i % N)
                     : i < 2 * N + B ? "node slot count " + std::to_string(i - 2 * N)
                                     : "the direct tokens of expert instance " + std::to_string((i - 2 * N - B) % N)) +
                    ", more than its " + std::to_string(c_.tokens_per_rank));
      first[place(q, i)] = static_cast<std::int64_t>(block[k]);
    }
  }
  plan.exchange->set_rank_tokens(first, c_.tokens_per_rank);
  plan.counts.token_counts = std::move(first);
}

// Instantiations of the members above.
template void Interleaved<float>::set_tokens(const MatrixView& x);
template void Interleaved<bf16>::set_tokens(const MatrixView& x);
template Interleaved<float>::Interleaved(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt);
template Interleaved<bf16>::Interleaved(const LayerConfig& c, const LayerWeights& w, RuntimeOptions opt);
template void Interleaved<float>::weights_changed(std::shared_ptr<const PackedWeights> packed);
template void Interleaved<bf16>::weights_changed(std::shared_ptr<const PackedWeights> packed);
template void Interleaved<float>::pack_split_parts(bool backward);
template void Interleaved<bf16>::pack_split_parts(bool backward);
template void Interleaved<float>::pack_part(std::int64_t i, const LayerWeights& w, bool backward);
template void Interleaved<bf16>::pack_part(std::int64_t i, const LayerWeights& w, bool backward);
template void Interleaved<float>::forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& res);
template void Interleaved<bf16>::forward(MatrixView x, std::span<const std::int32_t> forced, StepResult& res);
template void Interleaved<float>::backward(MatrixView d_out, StepResult& res);
template void Interleaved<bf16>::backward(MatrixView d_out, StepResult& res);
template bool Interleaved<float>::gradients_fit(const LayerGradients& g) const;
template bool Interleaved<bf16>::gradients_fit(const LayerGradients& g) const;
template void Interleaved<float>::exchange_rank_tokens(const StepResult& res);
template void Interleaved<bf16>::exchange_rank_tokens(const StepResult& res);
template void Interleaved<float>::exchange_counts(StepResult& res);
template void Interleaved<bf16>::exchange_counts(StepResult& res);

}  // namespace hpmoe::detail
