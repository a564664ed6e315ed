// A training step: attention and dense blocks from their FLOPs and bytes,
// MoE layers simulated tile by tile, six ways to run the MoE layers.
#include "sim/step.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hpmoe/error.hpp"

namespace hpmoe::sim {
namespace {

double elem_bytes(DType d) { return d == DType::bf16 ? 2.0 : 4.0; }

// Matrix units a framework's kernels use (a GPU framework gives a GEMM every
// SM), and the units its elementwise kernels stream memory with.
double framework_matrix_units(const MachineModel& m) {
  if (!m.accelerator) return m.workers;
  return m.serialized_matrix_units > 0 ? m.serialized_matrix_units : m.matrix_units;
}
double framework_vector_units(const MachineModel& m) {
  if (!m.accelerator) return m.workers;
  return m.serialized_matrix_units > 0 ? m.serialized_matrix_units : m.vector_units;
}

// An M x N x K GEMM as the machine's tiles, spread over the units, each tile
// at the model's rate for its shape with its weight panel reused down the
// rows (no launch: the callers count their kernels).
double gemm_time(const MachineModel& m, std::int64_t rows, std::int64_t n, std::int64_t k, DType dtype) {
  if (rows <= 0 || n <= 0 || k <= 0) return 0;
  const std::int64_t tr = m.tile_rows, tc = m.tile_cols;
  const std::int64_t row_tiles = (rows + tr - 1) / tr, col_tiles = (n + tc - 1) / tc;
  const double tile = m.gemm_seconds(std::min(rows, tr), std::min(n, tc), k, dtype, double(row_tiles));
  const double tasks = double(row_tiles) * double(col_tiles);
  return tasks * (tile + m.task_overhead_s) / framework_matrix_units(m);
}

double vector_time(const MachineModel& m, double bytes, int operators) {
  return bytes / (framework_vector_units(m) * m.vector_bytes_per_s) + operators * m.operator_launch_s;
}

// The blocks' weights: one attention block (default Q, K, V, O: 4 hidden^2)
// and one dense FFN (gate, up, down: 3 hidden x inter, default inter 4 hidden).
double attention_weights(const StepRequest& req) {
  const double h = double(req.moe.config.hidden);
  return req.attention_params > 0 ? req.attention_params : 4.0 * h * h;
}
std::int64_t dense_inter(const StepRequest& req) {
  return req.dense_inter > 0 ? req.dense_inter : 4 * req.moe.config.hidden;
}

}  // namespace

// A layer takes two phases of one micro-batch's compute with the other's
// exchange under it. Two micro-batches carry twice the bytes over the same
// links: before 2026-12-07 the fused way counted only its exposed part,
// which let its two micro-batches at EP 64 on the H800 model finish in
// less time than their links took.
double micro_batched_layer_s(double compute, double exchange, double share, double link_busy) {
  const double phases = exchange <= 0 ? 2 * compute : 2 * std::max(compute + share * std::min(exchange, compute), exchange);
  return std::max(phases, 2 * link_busy);
}

BlockCost attention_cost(const MachineModel& m, const StepRequest& req, std::int64_t tokens) {
  const LayerConfig& c = req.moe.config;
  if (req.attention_s >= 0) return {req.attention_s * double(tokens) / double(c.tokens_per_rank), 0};
  const std::int64_t h = c.hidden;
  const double params = attention_weights(req);
  const std::int64_t width = req.attention_width > 0 ? req.attention_width : h;
  BlockCost cost;
  // Q, K, V, O projections: 2 params FLOPs a token, as one GEMM with K = hidden
  // (at the fp8 rates where the step's GEMMs take fp8; the scores stay bf16).
  const MachineModel projections = req.moe.fp8_gemms ? m.with_fp8_gemms() : m;
  cost.gemm_s = gemm_time(projections, tokens, static_cast<std::int64_t>(std::llround(params / double(h))), h, c.dtype) +
                4 * m.operator_launch_s;
  // Scores and their weighted sum (causal: a token sees half the sequence on
  // average), heads of 128 each: 2 x 2 x context x width FLOPs a token.
  const std::int64_t heads = std::max<std::int64_t>(1, width / 128), context = std::max<std::int64_t>(1, req.seq_len / 2);
  // One batched kernel over the heads (a fused attention kernel).
  cost.gemm_s += 2.0 * double(heads) * gemm_time(m, tokens, context, 128, c.dtype) + m.operator_launch_s;
  // Two norms and two residual adds over [tokens, hidden] (read and write),
  // rotary embedding over the scores' width: about 12 hidden + 2 width
  // elements a token. ESTIMATE: the softmax stays inside a fused attention
  // kernel and moves no extra bytes.
  cost.vector_s = vector_time(m, double(tokens) * (12.0 * double(h) + 2.0 * double(width)) * elem_bytes(c.dtype), 5);
  return cost;
}

BlockCost dense_cost(const MachineModel& m, const StepRequest& req, std::int64_t tokens) {
  const LayerConfig& c = req.moe.config;
  if (req.dense_s >= 0) return {req.dense_s * double(tokens) / double(c.tokens_per_rank), 0};
  const std::int64_t h = c.hidden, inter = dense_inter(req);
  const MachineModel g = req.moe.fp8_gemms ? m.with_fp8_gemms() : m;
  BlockCost cost;
  cost.gemm_s = gemm_time(g, tokens, 2 * inter, h, c.dtype) + gemm_time(g, tokens, h, inter, c.dtype) + 2 * m.operator_launch_s;
  cost.vector_s = vector_time(m, double(tokens) * 3.0 * double(inter) * elem_bytes(c.dtype), 1);  // SwiGLU
  return cost;
}

std::int64_t micro_batch_tokens(std::int64_t tokens_per_rank) {
  // An odd T splits into (T + 1) / 2 and T / 2; the step waits for the
  // larger (T / 2 modelled T = 3 as micro-batches of 1 token, a third less
  // than the tokens it has).
  return (tokens_per_rank + 1) / 2;
}

void check_step_request(const StepRequest& req) {
  const LayerConfig& c = req.moe.config;
  if (req.layers < 1) throw Error("--layers must be at least 1 (the transformer layers of the model on a rank)");
  if (req.dense_layers < 0 || req.dense_layers > req.layers)
    throw Error("--dense-layers must be between 0 and --layers (" + std::to_string(req.layers) + "), not " +
                std::to_string(req.dense_layers));
  if (c.tokens_per_rank < 2)
    throw Error("a step with micro-batches needs at least 2 tokens per rank (-T), not " + std::to_string(c.tokens_per_rank));
  if (!(req.comm_share >= 0 && req.comm_share < 1)) throw Error("--comm-share must be in [0, 1)");
  if (std::isnan(req.attention_params) || req.attention_params < 0 || !std::isfinite(req.attention_params))
    throw Error("--attention-params must be a finite count of weights");
  // A measured time is >= 0 (a negative one means "none"); NaN is neither.
  if (std::isnan(req.attention_s) || std::isinf(req.attention_s)) throw Error("--attention-ms must be a finite time >= 0");
  if (std::isnan(req.dense_s) || std::isinf(req.dense_s)) throw Error("--dense-ms must be a finite time >= 0");
  if (!(req.other_s >= 0) || !std::isfinite(req.other_s)) throw Error("--other-ms must be a finite time >= 0");
}

StepReport simulate_step(const MachineModel& m, const StepRequest& req) {
  const auto t0 = std::chrono::steady_clock::now();
  const LayerConfig& c = req.moe.config;
  check_step_request(req);
  StepReport rep;
  rep.request = req;
  SimRequest full = req.moe, half = req.moe;
  full.backward = half.backward = true;
  full.trace = half.trace = false;
  half.config.tokens_per_rank = micro_batch_tokens(c.tokens_per_rank);
  if (req.choose_exchange || req.moe.choose_dispatch_dtype) {  // the scheme first, at the full token count; the micro-batches run it too
    full.choose_scheme = req.choose_exchange;
    rep.layer = simulate_choosing_exchange(m, full);
    half.config.exchange = rep.layer.config.exchange;
    half.config.dispatch_dtype = rep.layer.config.dispatch_dtype;
    rep.half = simulate(m, half);
  } else {
    // The two token counts are independent simulations: one on each of two cores.
    auto half_report = std::async(std::launch::async, [&] { return simulate(m, half); });
    rep.layer = simulate(m, full);
    rep.half = half_report.get();
  }

  const std::int64_t tokens = c.tokens_per_rank, tokens_half = micro_batch_tokens(c.tokens_per_rank);
  rep.attention = attention_cost(m, req, tokens);
  rep.attention_half = attention_cost(m, req, tokens_half);
  rep.dense = dense_cost(m, req, tokens);
  rep.dense_half = dense_cost(m, req, tokens_half);

  const double moe_layers = double(req.layers - req.dense_layers), dense_layers = double(req.dense_layers);
  // A pass of the non-MoE part: the backward of a block costs twice its forward (data and weight gradients).
  const auto pass_rest = [&](bool backward) {
    return (backward ? 2.0 : 1.0) * (double(req.layers) * rep.attention.total() + dense_layers * rep.dense.total());
  };
  // A way: the MoE layer's time in each pass (a member of PassResult), and
  // its exposed exchange's share of it; alone at T tokens, then as two
  // micro-batches of T / 2.
  // `link_busy`: where the way's exposed share is not all its link time
  // (the fused run hides most of it under compute), the busiest link's
  // time; null where the exchanges are all exposed (the operator-by-operator
  // ways, whose two exchanges already run one after the other).
  const auto add_way = [&](const std::string& name, double PassResult::*time, double PassResult::*exposed,
                           double PassResult::*link_busy) {
    const PassResult &fwd = rep.layer.forward, &bwd = rep.layer.backward;
    const PassResult &fwd_half = rep.half.forward, &bwd_half = rep.half.backward;
    {
      StepWay w;
      w.name = name;
      w.moe_forward_s = fwd.*time;
      w.moe_backward_s = bwd.*time;
      w.forward_s = pass_rest(false) + moe_layers * w.moe_forward_s;
      w.backward_s = pass_rest(true) + moe_layers * w.moe_backward_s;
      rep.ways.push_back(w);
    }
    StepWay w;
    w.name = name + " + 2 micro-batches";
    w.micro_batches = true;
    // Per MoE layer: each micro-batch's attention and its MoE layer's
    // compute on the units, its exchange's exposed part under the other's.
    const auto layer = [&](const PassResult& p, double attention) {
      const double exchange = p.*exposed * p.*time;
      return micro_batched_layer_s(attention + p.*time - exchange, exchange, req.comm_share, link_busy ? p.*link_busy : 0);
    };
    w.moe_forward_s = layer(fwd_half, 0);
    w.moe_backward_s = layer(bwd_half, 0);
    // The attention blocks of MoE layers are counted inside `layer`; the dense layers' as they are.
    const double attn_f = rep.attention_half.total(), attn_b = 2 * attn_f;
    w.forward_s = 2 * dense_layers * (attn_f + rep.dense_half.total()) + moe_layers * layer(fwd_half, attn_f);
    w.backward_s = 2 * dense_layers * (attn_b + 2 * rep.dense_half.total()) + moe_layers * layer(bwd_half, attn_b);
    rep.ways.push_back(w);
  };
  add_way("serialized", &PassResult::serialized_s, &PassResult::serialized_exposed_comm, nullptr);
  rep.baseline = "serialized";
  if (m.deepep.enabled) {
    add_way("DeepEP-style", &PassResult::deepep_s, &PassResult::deepep_exposed_comm, nullptr);
    rep.baseline = "DeepEP-style";
  }
  if (m.mindspore.enabled) {
    add_way("MindSpore-style", &PassResult::mindspore_s, &PassResult::mindspore_exposed_comm, nullptr);
    rep.baseline = "MindSpore-style";
  }
  add_way("fused (hpmoe)", &PassResult::interleaved_s, &PassResult::interleaved_exposed_comm, &PassResult::interleaved_link_busy_s);
  for (auto& w : rep.ways) w.backward_s += req.other_s;  // after the backward, the same for every way
  {
    const double attention = attention_weights(req), dense = 3.0 * double(c.hidden) * double(dense_inter(req));
    const double per_parameter = elem_bytes(c.dtype) + 4.0 + (req.moe.optimizer_state ? 12.0 : 0.0);
    const MemoryUse& moe = rep.layer.memory;
    rep.stack_parameter_bytes = moe_layers * (moe.weights + moe.gradients + moe.optimizer) +
                                (double(req.layers) * attention + dense_layers * dense) * per_parameter;
  }
  rep.simulate_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

namespace {
const StepWay& way_named(const StepReport& r, const std::string& name) {
  for (const auto& w : r.ways)
    if (w.name == name) return w;
  throw Error("no way named " + name + " in the step report");
}
}  // namespace

std::string format_step_report(const StepReport& r) {
  const auto& req = r.request;
  const auto& c = req.moe.config;
  std::ostringstream o;
  o << std::fixed;
  o << "machine  " << r.layer.machine.name << "\n";
  o << "model    " << req.layers << " layers (" << req.dense_layers << " dense, " << req.layers - req.dense_layers
    << " MoE: " << c.name << ", " << c.routed_experts << " experts top-" << c.top_k << ", hidden " << c.hidden << ", "
    << to_string(c.dtype) << "), sequence " << req.seq_len << "\n";
  o << "run      EP " << c.ranks << ", " << c.tokens_per_rank << " tokens/rank (micro-batches of " << micro_batch_tokens(c.tokens_per_rank)
    << (c.tokens_per_rank % 2 ? " and " + std::to_string(c.tokens_per_rank / 2) + ", both modelled at the larger" : "") << "), routing "
    << r.layer.routing << ", schedule " << r.layer.policy << "\n";
  if (!r.layer.exchange_choice.empty()) o << "exchange auto: " << r.layer.exchange_choice << "\n";
  o << std::setprecision(3);
  o << "per layer (ms, forward)  attention " << r.attention.total() * 1e3 << " (GEMMs " << r.attention.gemm_s * 1e3
    << (req.attention_s >= 0 ? ", given" : "") << ")";
  if (req.dense_layers > 0) o << ", dense FFN " << r.dense.total() * 1e3;
  o << ", MoE serialized " << r.layer.forward.serialized_s * 1e3 << " / fused " << r.layer.forward.interleaved_s * 1e3 << "\n";
  const StepWay& base = way_named(r, r.baseline);
  o << "step (ms)                              forward   backward       step   MoE layer fwd/bwd   vs " << r.baseline << "\n";
  for (const auto& w : r.ways) {
    // A space before every column: times past the widths (minutes of a
    // step, in ms) used to run into each other.
    o << "  " << std::left << std::setw(34) << w.name << std::right << ' ' << std::setw(9) << w.forward_s * 1e3 << ' '
      << std::setw(10) << w.backward_s * 1e3 << ' ' << std::setw(10) << w.step_s() * 1e3 << ' ' << std::setw(9)
      << w.moe_forward_s * 1e3 << " / " << std::setw(8) << w.moe_backward_s * 1e3 << ' ' << std::setw(8)
      << base.step_s() / w.step_s() << "x\n";
  }
  const auto best = std::min_element(r.ways.begin(), r.ways.end(), [](const StepWay& a, const StepWay& b) { return a.step_s() < b.step_s(); });
  o << "fastest  " << best->name << ": " << base.step_s() / best->step_s() << "x the " << r.baseline << " step";
  const double moe_share = (req.layers - req.dense_layers) * (base.moe_forward_s + base.moe_backward_s) / base.step_s();
  o << "; MoE layers are " << std::setprecision(0) << moe_share * 100 << "% of the " << r.baseline << " step\n";
  const double capacity = r.layer.memory.capacity;
  o << std::setprecision(1) << "memory   the stack's parameters (weights, fp32 gradients"
    << (req.moe.optimizer_state ? ", Adam's state" : "") << "; activations not counted) need " << r.stack_parameter_bytes / 1e9
    << " GB on the fullest rank";
  if (capacity > 0)
    o << " of " << capacity / 1e9 << " GB: "
      << (r.stack_parameter_bytes <= capacity ? std::string("fits")
                                              : "does NOT fit (" + std::to_string(static_cast<long long>(std::ceil(r.stack_parameter_bytes / capacity))) +
                                                    " pipeline stages or more, or optimizer state sharded over data-parallel ranks; neither modelled)");
  o << "\n";
  o << std::setprecision(2) << "simulated in " << r.simulate_seconds << " s (one MoE layer at " << c.tokens_per_rank << " and at "
    << micro_batch_tokens(c.tokens_per_rank) << " tokens, shared by the " << req.layers - req.dense_layers << " MoE layers)\n";
  return o.str();
}

nlohmann::json to_json(const StepReport& r) {
  const auto& req = r.request;
  nlohmann::json j;
  j["machine"] = r.layer.machine.name;
  j["layer"] = r.layer.config.name;
  j["ranks"] = r.layer.config.ranks;
  j["tokens_per_rank"] = r.layer.config.tokens_per_rank;
  j["exchange"] = to_string(r.layer.config.exchange);
  if (!r.layer.exchange_choice.empty()) j["exchange_choice"] = r.layer.exchange_choice;
  j["routing"] = r.layer.routing;
  j["schedule"] = r.layer.policy;
  j["layers"] = req.layers;
  j["dense_layers"] = req.dense_layers;
  j["seq_len"] = req.seq_len;
  j["comm_share"] = req.comm_share;
  j["other_s"] = req.other_s;
  j["attention_forward_s"] = r.attention.total();
  j["dense_forward_s"] = r.dense.total();
  j["attention_forward_micro_batch_s"] = r.attention_half.total();
  j["dense_forward_micro_batch_s"] = r.dense_half.total();
  j["baseline"] = r.baseline;
  const StepWay& base = way_named(r, r.baseline);
  for (const auto& w : r.ways)
    j["ways"].push_back({{"name", w.name},
                         {"micro_batches", w.micro_batches ? 2 : 1},
                         {"forward_s", w.forward_s},
                         {"backward_s", w.backward_s},
                         {"step_s", w.step_s()},
                         {"moe_forward_s", w.moe_forward_s},
                         {"moe_backward_s", w.moe_backward_s},
                         {"speedup", base.step_s() / w.step_s()}});
  j["moe_layer"] = to_json(r.layer);
  j["moe_layer_micro_batch"] = to_json(r.half);
  j["stack_parameter_bytes"] = r.stack_parameter_bytes;
  j["capacity_bytes"] = r.layer.memory.capacity;
  j["simulate_seconds"] = r.simulate_seconds;
  return j;
}

namespace {
std::string xml_text(const std::string& s) {  // names from files may hold markup characters
  std::string out;
  for (char ch : s) out += ch == '<' ? "&lt;" : ch == '>' ? "&gt;" : ch == '&' ? "&amp;" : std::string(1, ch);
  return out;
}
}  // namespace

std::string step_chart_svg(const StepReport& r) {
  // One horizontal bar per way: forward, backward (and the rest of the step
  // where given), to scale, with the step's time and its speedup.
  const double widest = std::max_element(r.ways.begin(), r.ways.end(), [](const StepWay& a, const StepWay& b) {
                          return a.step_s() < b.step_s();
                        })->step_s();
  const StepWay& base = way_named(r, r.baseline);
  const auto& c = r.request.moe.config;
  std::ostringstream title;
  title << "Training step on " << r.layer.machine.name << ": " << r.request.layers << " layers, MoE " << c.name << " at EP "
        << c.ranks << ", " << c.tokens_per_rank << " tokens/rank, routing " << r.layer.routing;
  const int label_w = 270, bar_w = 460, row_h = 30, top = 56;
  const int width = std::max(label_w + bar_w + 150, 20 + 9 * static_cast<int>(title.str().size()));
  const int height = top + row_h * static_cast<int>(r.ways.size()) + 40;
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" font-family=\"sans-serif\" font-size=\"13\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"10\" y=\"20\" font-size=\"15\" font-weight=\"bold\">" << xml_text(title.str()) << "</text>\n";
  // Where the attention and dense blocks' times came from: the user's, or
  // the model's FLOPs and bytes (the chart said "from FLOPs" either way).
  const auto& req = r.request;
  const bool given = req.attention_s >= 0 && (req.dense_layers == 0 || req.dense_s >= 0);
  const bool some_given = req.attention_s >= 0 || (req.dense_layers > 0 && req.dense_s >= 0);
  o << "<text x=\"10\" y=\"40\" fill=\"#555\">predicted by hpmoe step (simulated MoE layers; attention and dense blocks "
    << (given ? "as given" : some_given ? "as given where given, else from FLOPs" : "from FLOPs")
    << (req.other_s > 0 ? "; the rest of the step as given" : "") << "); speedup against " << xml_text(r.baseline) << "</text>\n";
  const double scale = widest > 0 ? bar_w / widest : 0;
  int y = top;
  for (const auto& w : r.ways) {
    const double fwd = w.forward_s * scale, bwd = (w.backward_s - r.request.other_s) * scale, rest = r.request.other_s * scale;
    o << "<text x=\"" << label_w - 8 << "\" y=\"" << y + 19 << "\" text-anchor=\"end\">" << xml_text(w.name) << "</text>\n";
    o << "<rect x=\"" << label_w << "\" y=\"" << y + 5 << "\" width=\"" << fwd << "\" height=\"20\" fill=\"#4878a8\"/>\n";
    o << "<rect x=\"" << label_w + fwd << "\" y=\"" << y + 5 << "\" width=\"" << bwd << "\" height=\"20\" fill=\"#e08a3c\"/>\n";
    if (rest > 0)
      o << "<rect x=\"" << label_w + fwd + bwd << "\" y=\"" << y + 5 << "\" width=\"" << rest
        << "\" height=\"20\" fill=\"#999\"/>\n";
    o << std::setprecision(0) << "<text x=\"" << label_w + fwd + bwd + rest + 6 << "\" y=\"" << y + 19 << "\">"
      << w.step_s() * 1e3 << " ms  " << std::setprecision(2) << base.step_s() / w.step_s() << "x</text>\n"
      << std::setprecision(1);
    y += row_h;
  }
  const auto legend = [&](int x, const char* colour, const char* what) {
    o << "<rect x=\"" << x << "\" y=\"" << y + 10 << "\" width=\"12\" height=\"12\" fill=\"" << colour << "\"/>"
      << "<text x=\"" << x + 16 << "\" y=\"" << y + 21 << "\">" << what << "</text>\n";
  };
  legend(label_w, "#4878a8", "forward");
  legend(label_w + 90, "#e08a3c", "backward");
  if (r.request.other_s > 0) legend(label_w + 190, "#999", "rest of the step (--other-ms)");
  o << "</svg>\n";
  return o.str();
}

}  // namespace hpmoe::sim
