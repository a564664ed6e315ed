#include "hpmoe/routing.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>

#include "hpmoe/error.hpp"
#include "common/json_parse.hpp"
#include "common/finite_number.hpp"
#include "hpmoe/tensors.hpp"

namespace hpmoe {

std::string RoutingSpec::describe() const {
  switch (source) {
    case RoutingSource::router: return "router";
    case RoutingSource::uniform: return "uniform";
    case RoutingSource::balanced: return "balanced";
    case RoutingSource::zipf: return "zipf:" + std::to_string(zipf_exponent).substr(0, 5);
    case RoutingSource::hot: return "hot:" + std::to_string(hot_share).substr(0, 5);
    case RoutingSource::trace: return "trace:" + trace_path + ":" + trace_layer + (trace_repeat ? ":repeat" : "");
    case RoutingSource::mixed: return "mixed (a new routing every step)";
    case RoutingSource::grouped: return "grouped";
  }
  return "?";
}

RoutingSpec RoutingSpec::at_step(const LayerConfig& c, std::uint64_t step_index) const {
  if (source != RoutingSource::mixed) {
    RoutingSpec s = *this;
    s.step = step_index;
    return s;
  }
  Rng rng(seed * 104729 + step_index * 2654435761ull + 7);
  RoutingSpec s;
  s.seed = seed + step_index * 7919;  // a new popularity too (Zipf's hot experts move)
  const std::int64_t e = c.routed_experts, k = c.top_k, p = std::min<std::int64_t>(c.ranks, 64);
  const std::int64_t block = e / std::max<std::int64_t>(c.ranks, 1);
  switch (rng.below(4)) {
    case 0: s.source = RoutingSource::uniform; break;
    case 1:
      s.source = RoutingSource::zipf;
      s.zipf_exponent = 0.5 + 1.5 * rng.uniform();
      break;
    case 2:
      if (k < e) {
        s.source = RoutingSource::hot;
        s.hot_expert = rng.below(e);
        s.hot_share = 0.9 * rng.uniform() / double(k);
        break;
      }
      s.source = RoutingSource::uniform;
      break;
    default:
      s.source = RoutingSource::uniform;
      if (p > 1 && block > 0) {
        const std::int64_t idle = 1 + rng.below(p - 1);
        std::vector<std::int64_t> order(static_cast<std::size_t>(p));
        std::iota(order.begin(), order.end(), 0);
        for (std::int64_t i = p - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
        for (std::int64_t i = 0; i < idle && (e - (i + 1) * block) >= k; ++i) s.idle_blocks |= std::uint64_t{1} << order[i];
      }
  }
  return s;
}

namespace {

double parse_param(const std::string& spec, const std::string& text) {
  if (const auto v = detail::finite_number(text)) return *v;
  throw Error("routing '" + spec + "': '" + text + "' is not a number");
}

}  // namespace

RoutingSpec parse_routing_spec(const std::string& text, std::uint64_t seed) {
  RoutingSpec s;
  s.seed = seed;
  const auto colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  std::string rest = colon == std::string::npos ? "" : text.substr(colon + 1);
  if (kind == "router" && rest.empty()) {
    s.source = RoutingSource::router;
  } else if (kind == "uniform" && rest.empty()) {
    s.source = RoutingSource::uniform;
  } else if (kind == "grouped" && rest.empty()) {
    s.source = RoutingSource::grouped;
  } else if (kind == "balanced" && rest.empty()) {
    s.source = RoutingSource::balanced;
  } else if (kind == "zipf") {
    s.source = RoutingSource::zipf;
    if (colon != std::string::npos) s.zipf_exponent = parse_param(text, rest);
    // Past 4 nearly every token wants the same few experts, and drawing
    // top_k distinct ones by rejection takes millions of tries a token.
    if (s.zipf_exponent < 0 || s.zipf_exponent > 4)
      throw Error("routing '" + text + "': the Zipf exponent must be in [0, 4]");
  } else if (kind == "hot") {
    s.source = RoutingSource::hot;
    if (colon != std::string::npos) s.hot_share = parse_param(text, rest);
    if (s.hot_share < 0 || s.hot_share > 1) throw Error("routing '" + text + "': the hot share must be in [0, 1]");
  } else if (kind == "mixed" && rest.empty()) {
    s.source = RoutingSource::mixed;
  } else if (kind == "trace" && !rest.empty()) {
    s.source = RoutingSource::trace;
    if (rest.size() > 7 && rest.compare(rest.size() - 7, 7, ":repeat") == 0) {
      s.trace_repeat = true;
      rest.resize(rest.size() - 7);
    }
    const auto last = rest.rfind(':');
    const std::string tail = last == std::string::npos ? "" : rest.substr(last + 1);
    const bool signed_number = tail.size() > 1 && (tail[0] == '-' || tail[0] == '+') &&
                               std::all_of(tail.begin() + 1, tail.end(), ::isdigit);
    if (signed_number)
      throw Error("routing '" + text + "': the trace layer '" + tail + "' must be a layer index (0, 1, ...)");
    if (!tail.empty() && std::all_of(tail.begin(), tail.end(), ::isdigit)) {
      s.trace_path = rest.substr(0, last);
      s.trace_layer = tail;
    } else {
      s.trace_path = rest;
    }
    if (s.trace_path.empty()) throw Error("routing '" + text + "': give the trace file (trace:FILE[:LAYER][:repeat])");
  } else {
    throw Error("unknown routing '" + text + "' (use router, uniform, grouped, balanced, zipf[:S], hot[:SHARE], trace:FILE[:LAYER][:repeat] or mixed)");
  }
  return s;
}

namespace {
std::vector<std::int32_t> trace_from_json(const nlohmann::json& j, const std::string& path, const std::string& layer,
                                          std::int64_t top_k, std::int64_t experts, std::int64_t* trace_tokens) {
  if (!j.is_object()) throw Error("routing trace '" + path + "' must be an object of layers");
  if (!j.contains(layer)) {
    std::string known;
    for (const auto& [k, v] : j.items()) known += (known.empty() ? "" : ", ") + k;
    throw Error("routing trace '" + path + "' has no layer '" + layer + "' (layers: " + known + ")");
  }
  const auto& rows = j.at(layer);
  if (!rows.is_array() || rows.empty())
    throw Error("routing trace '" + path + "' layer " + layer + " must be a non-empty array of expert lists");
  std::vector<std::int32_t> ids;
  ids.reserve(rows.size() * static_cast<std::size_t>(top_k));
  for (std::size_t t = 0; t < rows.size(); ++t) {
    const auto& row = rows[t];
    const std::string where = "routing trace '" + path + "' layer " + layer + " token " + std::to_string(t);
    if (!row.is_array()) throw Error(where + ": expected a list of expert ids");
    if (static_cast<std::int64_t>(row.size()) != top_k)
      throw Error(where + " has " + std::to_string(row.size()) + " experts but the layer's top_k is " +
                  std::to_string(top_k));
    for (std::size_t k = 0; k < row.size(); ++k) {
      if (!row[k].is_number_integer()) throw Error(where + ": expert id " + row[k].dump() + " is not an integer");
      const auto id = row[k].get<std::int64_t>();
      if (id < 0 || id >= experts)
        throw Error(where + ": expert id " + std::to_string(id) + " does not fit the layer's " +
                    std::to_string(experts) + " experts");
      for (std::size_t p = 0; p < k; ++p)
        if (ids[ids.size() - k + p] == id) throw Error(where + ": expert " + std::to_string(id) + " chosen twice");
      ids.push_back(static_cast<std::int32_t>(id));
    }
  }
  if (trace_tokens) *trace_tokens = static_cast<std::int64_t>(rows.size());
  return ids;
}
}  // namespace

std::vector<std::int32_t> load_trace(const std::string& path, const std::string& layer, std::int64_t top_k,
                                     std::int64_t experts, std::int64_t* trace_tokens) {
  return trace_from_json(parse_json_file(path, "routing trace '" + path + "'"), path, layer, top_k, experts,
                         trace_tokens);
}

std::vector<std::int32_t> parse_trace(const std::string& text, const std::string& source, const std::string& layer,
                                      std::int64_t top_k, std::int64_t experts, std::int64_t* trace_tokens) {
  return trace_from_json(parse_json(text, "routing trace '" + source + "'"), source, layer, top_k, experts,
                         trace_tokens);
}

namespace {

// Draws experts with probability proportional to their weights (binary
// search in the cumulative weights), K distinct ones by rejection.
class ExpertSampler {
 public:
  explicit ExpertSampler(std::span<const double> weights) : cdf_(weights.size()) {
    double total = 0;
    for (std::size_t i = 0; i < weights.size(); ++i) {
      total += weights[i];
      cdf_[i] = total;
      if (weights[i] > 0) ++nonzero_;
    }
  }
  void draw_distinct(Rng& rng, std::int64_t k, std::int32_t* out) const {
    if (k > nonzero_) throw Error("cannot draw " + std::to_string(k) + " distinct experts from " + std::to_string(nonzero_));
    for (std::int64_t i = 0; i < k; ++i) {
      std::int32_t pick;
      do {
        const double u = rng.uniform() * cdf_.back();
        pick = static_cast<std::int32_t>(std::upper_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin());
        if (pick >= static_cast<std::int32_t>(cdf_.size())) pick = static_cast<std::int32_t>(cdf_.size()) - 1;
      } while (std::find(out, out + i, pick) != out + i || (pick > 0 ? cdf_[pick] == cdf_[pick - 1] : cdf_[0] == 0));
      out[i] = pick;
    }
  }

 private:
  std::vector<double> cdf_;
  std::int64_t nonzero_ = 0;
};

}  // namespace

namespace {

// Routing "grouped": per token, groups_kept of the layer's groups drawn
// uniformly, then top_k distinct experts uniformly among their experts (a
// partial Fisher-Yates shuffle of each, on the token's own candidates).
std::vector<std::int32_t> grouped_selection(const LayerConfig& c, Rng& rng) {
  const std::int64_t n = c.total_tokens(), k = c.top_k, e = c.routed_experts, g = c.groups, kept = c.groups_kept;
  if (g < 2 || e % g != 0 || kept < 1 || kept > g || kept * (e / g) < k)
    throw Error("routing 'grouped' draws from the layer's expert groups: it needs groups >= 2 dividing the experts and "
                "groups_kept groups holding top_k experts (this layer: groups " + std::to_string(g) + ", groups_kept " +
                std::to_string(kept) + ", " + std::to_string(e) + " experts, top_k " + std::to_string(k) +
                "); use 'uniform' for a layer without groups");
  const std::int64_t per = e / g;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n * k)), groups(static_cast<std::size_t>(g)),
      candidates(static_cast<std::size_t>(kept * per));
  for (std::int64_t t = 0; t < n; ++t) {
    std::iota(groups.begin(), groups.end(), 0);
    for (std::int64_t i = 0; i < kept; ++i) std::swap(groups[i], groups[i + rng.below(g - i)]);
    for (std::int64_t i = 0; i < kept; ++i)
      for (std::int64_t j = 0; j < per; ++j) candidates[i * per + j] = static_cast<std::int32_t>(groups[i] * per + j);
    const std::int64_t m = kept * per;
    for (std::int64_t j = 0; j < k; ++j) {
      std::swap(candidates[j], candidates[j + rng.below(m - j)]);
      ids[static_cast<std::size_t>(t * k + j)] = candidates[j];
    }
  }
  return ids;
}

}  // namespace

std::vector<std::int32_t> forced_selection(const LayerConfig& c, const RoutingSpec& s) {
  const std::int64_t n = c.total_tokens(), k = c.top_k, e = c.routed_experts;
  std::vector<std::int32_t> ids;
  if (s.source == RoutingSource::router) return ids;
  if (s.source == RoutingSource::mixed) return forced_selection(c, s.at_step(c, s.step));
  ids.resize(static_cast<std::size_t>(n * k));
  Rng rng(s.seed * 7919 + 17);
  if (s.source == RoutingSource::balanced) {
    // Force-balanced: token t's choices are experts tK, tK + 1, ... (mod E),
    // so every expert gets the same count from every rank when T K is a
    // multiple of E (the ideal the balancing schemes are measured against).
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t j = 0; j < k; ++j) ids[static_cast<std::size_t>(t * k + j)] = static_cast<std::int32_t>((t * k + j) % e);
    return ids;
  }
  if (s.source == RoutingSource::trace) {
    std::int64_t trace_tokens = 0;
    const auto trace = load_trace(s.trace_path, s.trace_layer, k, e, &trace_tokens);
    if (trace_tokens < n && !s.trace_repeat)
      throw Error("routing trace '" + s.trace_path + "' layer " + s.trace_layer + " has " + std::to_string(trace_tokens) +
                  " tokens, fewer than the " + std::to_string(n) + " a step routes (ranks x tokens per rank): use fewer "
                  "tokens, or trace:" + s.trace_path + ":" + s.trace_layer + ":repeat to repeat the recording");
    // Step k reads the trace's next window of tokens (wrapping around at its
    // end), so a history of steps sees the recording's drift, not one window
    // again and again.
    const auto first = static_cast<std::int64_t>((s.step % static_cast<std::uint64_t>(trace_tokens)) *
                                                 static_cast<std::uint64_t>(n % trace_tokens) % static_cast<std::uint64_t>(trace_tokens));
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t j = 0; j < k; ++j) ids[t * k + j] = trace[((first + t) % trace_tokens) * k + j];
    return ids;
  }
  if (s.source == RoutingSource::grouped) return grouped_selection(c, rng);
  std::vector<double> weights(static_cast<std::size_t>(e), 1.0);
  if (s.source == RoutingSource::zipf) {
    // Popularity 1/rank^s over a seeded permutation, so the hot experts are
    // spread over ranks the way real hot experts are.
    std::vector<std::int64_t> perm(static_cast<std::size_t>(e));
    std::iota(perm.begin(), perm.end(), 0);
    for (std::int64_t i = e - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
    for (std::int64_t r = 0; r < e; ++r) weights[perm[r]] = 1.0 / std::pow(double(r + 1), s.zipf_exponent);
  }
  if (s.source == RoutingSource::hot) {
    if (s.hot_expert < 0 || s.hot_expert >= e)
      throw Error("hot expert " + std::to_string(s.hot_expert) + " does not fit the layer's " + std::to_string(e) +
                  " experts");
    if (s.hot_share * double(k) > 1.0 + 1e-12)
      throw Error("hot share " + std::to_string(s.hot_share) + " is impossible with top_k " + std::to_string(k) +
                  ": one expert can take at most 1/top_k of the assignments");
    if (k == e) throw Error("hot routing needs top_k below routed_experts");
    weights[s.hot_expert] = 0;
  }
  if (s.idle_blocks != 0) {
    const std::int64_t block = e / std::max<std::int64_t>(c.ranks, 1);
    for (std::int64_t i = 0; i < e; ++i)
      if (block > 0 && i / block < 64 && (s.idle_blocks >> (i / block)) & 1) weights[static_cast<std::size_t>(i)] = 0;
  }
  const ExpertSampler sampler(weights);
  // Later steps of the same routing: the same popularity (the permutation
  // above), other draws.
  if (s.step > 0) rng = Rng(s.seed * 7919 + 17 + s.step * 1000003);
  for (std::int64_t t = 0; t < n; ++t) {
    std::int32_t* row = ids.data() + t * k;
    if (s.source == RoutingSource::hot && rng.uniform() < s.hot_share * double(k)) {
      row[0] = static_cast<std::int32_t>(s.hot_expert);
      sampler.draw_distinct(rng, k - 1, row + 1);
    } else {
      sampler.draw_distinct(rng, k, row);
    }
  }
  return ids;
}

template <class Real>
RouterOutput<Real> route(const LayerConfig& c, std::span<const Real> logits, std::span<const float> expert_bias,
                         std::span<const std::int32_t> forced, std::span<const std::uint8_t> forced_kept) {
  const std::int64_t n = c.total_tokens(), e = c.routed_experts, k = c.top_k, tpr = c.tokens_per_rank;
  if (static_cast<std::int64_t>(logits.size()) != n * e) throw Error("router logits have the wrong size");
  if (!forced.empty() && static_cast<std::int64_t>(forced.size()) != n * k)
    throw Error("forced routing has " + std::to_string(forced.size()) + " ids, expected tokens x top_k = " +
                std::to_string(n * k));
  RouterOutput<Real> r;
  r.tokens = n;
  r.experts = e;
  r.top_k = k;
  r.scores.resize(static_cast<std::size_t>(n * e));
  r.lse.resize(static_cast<std::size_t>(n));
  r.expert.resize(static_cast<std::size_t>(n * k));
  r.weight.resize(static_cast<std::size_t>(n * k));
  r.kept.assign(static_cast<std::size_t>(n * k), 1);
  r.selected.assign(static_cast<std::size_t>(c.ranks * e), 0);

  const std::int64_t group_size = e / c.groups;
  std::vector<Real> sel(static_cast<std::size_t>(e));
  std::vector<std::int32_t> order(static_cast<std::size_t>(e));
  std::vector<Real> group_score(static_cast<std::size_t>(c.groups));
  std::vector<std::int32_t> group_order(static_cast<std::size_t>(c.groups));
  for (std::int64_t t = 0; t < n; ++t) {
    const Real* l = logits.data() + t * e;
    Real* s = r.scores.data() + t * e;
    Real mx = *std::max_element(l, l + e);
    Real sum = 0;
    for (std::int64_t i = 0; i < e; ++i) sum += std::exp(l[i] - mx);
    r.lse[t] = mx + std::log(sum);
    for (std::int64_t i = 0; i < e; ++i)
      s[i] = c.scoring == Scoring::softmax ? std::exp(l[i] - mx) / sum : Real(1) / (Real(1) + std::exp(-l[i]));

    std::int32_t* ids = r.expert.data() + t * k;
    if (!forced.empty()) {
      std::copy_n(forced.data() + t * k, k, ids);
    } else {
      for (std::int64_t i = 0; i < e; ++i) sel[i] = s[i] + (c.expert_bias ? Real(expert_bias[i]) : Real(0));
      if (c.groups > 1) {
        // DeepSeek: a group's score is its best expert, or (with the
        // selection bias) the sum of its best two.
        for (std::int64_t g = 0; g < c.groups; ++g) {
          std::vector<Real> members(sel.begin() + g * group_size, sel.begin() + (g + 1) * group_size);
          std::sort(members.begin(), members.end(), std::greater<Real>());
          group_score[g] = members[0] + (c.expert_bias && group_size > 1 ? members[1] : Real(0));
        }
        std::iota(group_order.begin(), group_order.end(), 0);
        std::stable_sort(group_order.begin(), group_order.end(),
                         [&](std::int32_t a, std::int32_t b) { return group_score[a] > group_score[b]; });
        for (std::int64_t gi = c.groups_kept; gi < c.groups; ++gi)
          for (std::int64_t i = 0; i < group_size; ++i)
            sel[group_order[gi] * group_size + i] = -std::numeric_limits<Real>::infinity();
      }
      std::iota(order.begin(), order.end(), 0);
      // Ties go to the lower expert id, so the choice is deterministic.
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](std::int32_t a, std::int32_t b) {
        return sel[a] > sel[b] || (sel[a] == sel[b] && a < b);
      });
      std::copy_n(order.begin(), k, ids);
    }
    Real* w = r.weight.data() + t * k;
    Real total = 0;
    for (std::int64_t j = 0; j < k; ++j) total += s[ids[j]];
    for (std::int64_t j = 0; j < k; ++j)
      w[j] = (c.normalize_topk ? s[ids[j]] / total : s[ids[j]]) * Real(c.route_scale);
    for (std::int64_t j = 0; j < k; ++j) r.selected[(t / tpr) * e + ids[j]] += 1;
  }

  // Capacity: per rank and expert, keep at most `cap` assignments.
  if (!forced_kept.empty()) {
    if (static_cast<std::int64_t>(forced_kept.size()) != n * k) throw Error("forced capacity mask has the wrong size");
    std::copy(forced_kept.begin(), forced_kept.end(), r.kept.begin());
  } else if (const std::int64_t cap = c.expert_capacity(); cap >= 0) {
    for (std::int64_t rank = 0; rank < c.ranks; ++rank) {
      std::vector<std::vector<std::int64_t>> by_expert(static_cast<std::size_t>(e));
      for (std::int64_t a = rank * tpr * k; a < (rank + 1) * tpr * k; ++a) by_expert[r.expert[a]].push_back(a);
      for (auto& list : by_expert) {
        if (static_cast<std::int64_t>(list.size()) <= cap) continue;
        if (c.drop_policy == DropPolicy::probs)
          std::stable_sort(list.begin(), list.end(),
                           [&](std::int64_t a, std::int64_t b) { return r.weight[a] > r.weight[b]; });
        for (std::size_t i = static_cast<std::size_t>(cap); i < list.size(); ++i) r.kept[list[i]] = 0;
      }
    }
  }
  for (std::int64_t a = 0; a < n * k; ++a) {
    if (!r.kept[a]) {
      r.weight[a] = 0;
      ++r.dropped;
    }
  }

  // Balancing losses, per rank (a rank's micro-batch), summed.
  for (std::int64_t rank = 0; rank < c.ranks; ++rank) {
    if (c.aux_loss_coef > 0) {
      double acc = 0;
      for (std::int64_t t = rank * tpr; t < (rank + 1) * tpr; ++t) {
        const Real* s = r.scores.data() + t * e;
        double norm = 1;
        if (c.scoring == Scoring::sigmoid) norm = std::accumulate(s, s + e, 0.0);
        for (std::int64_t i = 0; i < e; ++i) acc += double(r.selected[rank * e + i]) * double(s[i]) / norm;
      }
      r.aux_loss += c.aux_loss_coef * double(e) / (double(tpr) * double(tpr) * double(k)) * acc;
    }
    if (c.z_loss_coef > 0) {
      double acc = 0;
      for (std::int64_t t = rank * tpr; t < (rank + 1) * tpr; ++t) acc += double(r.lse[t]) * double(r.lse[t]);
      r.z_loss += c.z_loss_coef * acc / double(tpr);
    }
  }
  return r;
}

template <class Real>
void router_backward_token(const LayerConfig& c, const RouterOutput<Real>& r, std::span<const Real> l,
                           std::int64_t t, std::span<const Real> dw, std::span<Real> dl) {
  const std::int64_t e = c.routed_experts, k = c.top_k, tpr = c.tokens_per_rank;
  const Real* s = r.scores.data() + t * e;
  const std::int32_t* ids = r.expert.data() + t * k;
  std::vector<Real> ds(static_cast<std::size_t>(e), Real(0));
  // Gate weights -> scores: w_j = scale * s_j (/ sum_k s_k).
  const Real scale = Real(c.route_scale);
  if (c.normalize_topk) {
    // d w_j / d s_i = (delta_ij - g_j) / total with g_j = s_j / total, so
    // ds_i = (dw_i - sum_j dw_j g_j) / total. In this form the terms cancel
    // exactly where the math says they do: under top-1, g = s / s = 1 and
    // dw - dw * 1 = 0 (dw / total - dot / total^2 left ~1e-7 of rounding,
    // which a relative check on a zero reference cannot pass).
    Real total = 0, mean = 0;
    for (std::int64_t j = 0; j < k; ++j) total += s[ids[j]];
    for (std::int64_t j = 0; j < k; ++j) mean += dw[j] * (s[ids[j]] / total);
    for (std::int64_t j = 0; j < k; ++j) ds[ids[j]] += scale * ((dw[j] - mean) / total);
  } else {
    for (std::int64_t j = 0; j < k; ++j) ds[ids[j]] += scale * dw[j];
  }
  // Aux loss: d/dp_te = coef E c_e / (T^2 K), p = scores (sigmoid: normalised).
  if (c.aux_loss_coef > 0) {
    const std::int64_t rank = t / tpr;
    const Real factor = Real(c.aux_loss_coef * double(e) / (double(tpr) * double(tpr) * double(k)));
    if (c.scoring == Scoring::softmax) {
      for (std::int64_t i = 0; i < e; ++i) ds[i] += factor * Real(r.selected[rank * e + i]);
    } else {
      Real total = 0, dot = 0;
      for (std::int64_t i = 0; i < e; ++i) total += s[i];
      for (std::int64_t i = 0; i < e; ++i) dot += factor * Real(r.selected[rank * e + i]) * s[i] / total;
      for (std::int64_t i = 0; i < e; ++i) ds[i] += (factor * Real(r.selected[rank * e + i]) - dot) / total;
    }
  }
  // Scores -> logits.
  if (c.scoring == Scoring::softmax) {
    Real dot = 0;
    for (std::int64_t i = 0; i < e; ++i) dot += ds[i] * s[i];
    for (std::int64_t i = 0; i < e; ++i) dl[i] = s[i] * (ds[i] - dot);
  } else {
    for (std::int64_t i = 0; i < e; ++i) dl[i] = ds[i] * s[i] * (Real(1) - s[i]);
  }
  // z-loss: d/dl (coef/T lse^2) = coef/T * 2 lse * softmax(l).
  if (c.z_loss_coef > 0) {
    const Real factor = Real(c.z_loss_coef * 2.0 / double(tpr)) * r.lse[t];
    for (std::int64_t i = 0; i < e; ++i) dl[i] += factor * std::exp(l[i] - r.lse[t]);
  }
}

void update_expert_bias(std::span<float> bias, std::span<const std::int64_t> load, double rate) {
  if (bias.size() != load.size()) throw Error("expert bias and load sizes differ");
  if (load.empty()) return;
  const double mean = double(std::accumulate(load.begin(), load.end(), std::int64_t{0})) / double(load.size());
  for (std::size_t i = 0; i < bias.size(); ++i) {
    const double diff = mean - double(load[i]);
    bias[i] += static_cast<float>(rate * double((diff > 0) - (diff < 0)));
  }
}

RoutingStats routing_stats(const LayerConfig& c, const ExpertPlacement& placement, std::span<const std::int64_t> counts,
                           std::int64_t dropped) {
  placement.check_fits(c.routed_experts, c.ranks);
  if (counts.size() != static_cast<std::size_t>(c.ranks * c.routed_experts))
    throw Error("routing counts: " + std::to_string(counts.size()) + " values, expected ranks x experts = " +
                std::to_string(c.ranks * c.routed_experts));
  RoutingStats st;
  st.tokens_per_expert.assign(static_cast<std::size_t>(c.routed_experts), 0);
  st.tokens_per_rank.assign(static_cast<std::size_t>(c.ranks), 0);
  for (std::int64_t s = 0; s < c.ranks; ++s)
    for (std::int64_t e = 0; e < c.routed_experts; ++e) st.tokens_per_expert[e] += counts[s * c.routed_experts + e];
  if (placement.instances() > placement.experts()) {
    // A replicated expert's rows go where the step's quota plan sends them;
    // a split expert's part counts its rows times its share of the columns.
    const std::int64_t N = placement.instances();
    const auto rows = instance_rows(placement, counts);
    for (std::int64_t i = 0; i < N; ++i) {
      const auto [c0, c1] = placement.part_columns(i, c.expert_inter);
      st.tokens_per_rank[static_cast<std::size_t>(placement.instance_rank(i))] +=
          rows[static_cast<std::size_t>(i)] * (c1 - c0) / c.expert_inter;
    }
  } else {
    for (std::int64_t i = 0; i < c.routed_experts; ++i)
      st.tokens_per_rank[static_cast<std::size_t>(placement.owner(i))] += st.tokens_per_expert[i];
  }
  st.dropped = dropped;
  st.assignments = c.total_tokens() * c.top_k;
  auto max_over_mean = [](const std::vector<std::int64_t>& v) {
    const double total = double(std::accumulate(v.begin(), v.end(), std::int64_t{0}));
    if (total == 0) return 0.0;
    return double(*std::max_element(v.begin(), v.end())) / (total / double(v.size()));
  };
  st.expert_max_over_mean = max_over_mean(st.tokens_per_expert);
  st.rank_max_over_mean = max_over_mean(st.tokens_per_rank);
  std::vector<std::int64_t> sorted = st.tokens_per_expert;
  std::sort(sorted.begin(), sorted.end());
  double weighted = 0, total = 0;
  const double m = double(sorted.size());
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    weighted += double(i + 1) * double(sorted[i]);
    total += double(sorted[i]);
  }
  st.expert_gini = total > 0 ? (2.0 * weighted) / (m * total) - (m + 1.0) / m : 0.0;
  return st;
}

template <class Real>
RoutingStats routing_stats(const LayerConfig& c, const ExpertPlacement& placement, const RouterOutput<Real>& r) {
  if (static_cast<std::int64_t>(r.expert.size()) != c.total_tokens() * c.top_k)
    throw Error("routing statistics need every rank's routing");
  std::vector<std::int64_t> counts(static_cast<std::size_t>(c.ranks * c.routed_experts), 0);
  const std::int64_t per_rank = c.tokens_per_rank * c.top_k;
  for (std::size_t a = 0; a < r.expert.size(); ++a)
    if (r.kept[a]) ++counts[static_cast<std::size_t>((static_cast<std::int64_t>(a) / per_rank) * c.routed_experts + r.expert[a])];
  return routing_stats(c, placement, counts, r.dropped);
}

template RouterOutput<float> route<float>(const LayerConfig&, std::span<const float>, std::span<const float>,
                                          std::span<const std::int32_t>, std::span<const std::uint8_t>);
template RouterOutput<double> route<double>(const LayerConfig&, std::span<const double>, std::span<const float>,
                                            std::span<const std::int32_t>, std::span<const std::uint8_t>);
template void router_backward_token<float>(const LayerConfig&, const RouterOutput<float>&, std::span<const float>,
                                           std::int64_t, std::span<const float>, std::span<float>);
template void router_backward_token<double>(const LayerConfig&, const RouterOutput<double>&, std::span<const double>,
                                            std::int64_t, std::span<const double>, std::span<double>);
template RoutingStats routing_stats<float>(const LayerConfig&, const ExpertPlacement&, const RouterOutput<float>&);
template RoutingStats routing_stats<double>(const LayerConfig&, const ExpertPlacement&, const RouterOutput<double>&);

}  // namespace hpmoe
