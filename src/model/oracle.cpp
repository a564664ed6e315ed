#include "hpmoe/reference.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "hpmoe/bf16.hpp"
#include "hpmoe/error.hpp"
#include "common/fp8.hpp"

namespace hpmoe {

namespace {

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// One SwiGLU MLP applied to one token, with what backward needs kept.
struct MlpToken {
  std::vector<double> h;  // [2I]
  std::vector<double> a;  // [I]
  std::vector<double> y;  // [H]
};

template <class X, class T>
MlpToken mlp_forward(const X* x, const DenseMatrix<T>& w1, const DenseMatrix<T>& w2) {
  const std::int64_t hidden = w1.rows, inter = w2.rows;
  MlpToken m{std::vector<double>(static_cast<std::size_t>(2 * inter), 0.0),
             std::vector<double>(static_cast<std::size_t>(inter), 0.0),
             std::vector<double>(static_cast<std::size_t>(hidden), 0.0)};
  for (std::int64_t i = 0; i < hidden; ++i)
    for (std::int64_t j = 0; j < 2 * inter; ++j) m.h[j] += double(x[i]) * double(w1.at(i, j));
  for (std::int64_t j = 0; j < inter; ++j) {
    const double g = m.h[j];
    m.a[j] = g * sigmoid(g) * m.h[inter + j];
  }
  for (std::int64_t j = 0; j < inter; ++j)
    for (std::int64_t o = 0; o < hidden; ++o) m.y[o] += m.a[j] * double(w2.at(j, o));
  return m;
}

// Given dL/dy for one token, adds dL/dx into dx and, when dw1/dw2 are
// non-null, the weight gradients.
template <class X, class T>
void mlp_backward(const X* x, const DenseMatrix<T>& w1, const DenseMatrix<T>& w2, const MlpToken& m, const std::vector<double>& dy,
                  double* dx, double* dw1, double* dw2) {
  const std::int64_t hidden = w1.rows, inter = w2.rows;
  std::vector<double> da(static_cast<std::size_t>(inter), 0.0), dh(static_cast<std::size_t>(2 * inter), 0.0);
  for (std::int64_t j = 0; j < inter; ++j)
    for (std::int64_t o = 0; o < hidden; ++o) da[j] += dy[o] * double(w2.at(j, o));
  for (std::int64_t j = 0; j < inter; ++j) {
    const double g = m.h[j], u = m.h[inter + j], s = sigmoid(g);
    dh[j] = da[j] * u * s * (1.0 + g * (1.0 - s));
    dh[inter + j] = da[j] * g * s;
  }
  for (std::int64_t i = 0; i < hidden; ++i)
    for (std::int64_t j = 0; j < 2 * inter; ++j) dx[i] += dh[j] * double(w1.at(i, j));
  if (dw2)
    for (std::int64_t j = 0; j < inter; ++j)
      for (std::int64_t o = 0; o < hidden; ++o) dw2[j * hidden + o] += m.a[j] * dy[o];
  if (dw1)
    for (std::int64_t i = 0; i < hidden; ++i)
      for (std::int64_t j = 0; j < 2 * inter; ++j) dw1[i * 2 * inter + j] += double(x[i]) * dh[j];
}

// The token as the routed experts see it: sent narrower than the layer's
// dtype (bf16, or fp8 with per-128-channel scales), then decoded, exactly as
// the exchange's encode and decode do (from fp32 values; a bf16 layer's
// runtime encodes its bf16-rounded tokens, inside the bf16 tolerance).
template <class T>
std::vector<double> as_dispatched(const LayerConfig& c, const T* x) {
  std::vector<float> in(static_cast<std::size_t>(c.hidden)), back(in.size());
  for (std::int64_t i = 0; i < c.hidden; ++i) in[static_cast<std::size_t>(i)] = static_cast<float>(x[i]);
  if (c.dispatch_dtype == DispatchDType::fp8) {
    std::vector<std::uint8_t> row(static_cast<std::size_t>(fp8_row_bytes(c.hidden)));
    fp8_encode_row(in.data(), c.hidden, row.data());
    fp8_decode_row(row.data(), c.hidden, back.data());
  } else {
    for (std::size_t i = 0; i < in.size(); ++i) back[i] = round_to_bf16(in[i]);
  }
  return {back.begin(), back.end()};
}

bool held(const LayerWeights& w, std::int64_t e) { return holds_expert(w, e); }
bool held(const LayerWeights64& w, std::int64_t e) {
  return e >= 0 && static_cast<std::size_t>(e) < w.w1.size() && static_cast<std::size_t>(e) < w.w2.size() &&
         w.w1[e].rows > 0 && w.w2[e].rows > 0;
}

void expect_shape(const Matrix64& m, std::int64_t rows, std::int64_t cols, const std::string& what) {
  if (m.rows != rows || m.cols != cols || m.data.size() != static_cast<std::size_t>(rows * cols))
    throw Error(what + " has shape [" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "], expected [" +
                std::to_string(rows) + ", " + std::to_string(cols) + "]");
}

void check_shapes(const LayerConfig& c, const LayerWeights64& w, const LayerInputs64& in) {
  const std::int64_t H = c.hidden, E = c.routed_experts, I = c.expert_inter, Is = c.shared_inter_total();
  expect_shape(w.router, H, E, "router");
  if (c.expert_bias && w.expert_bias.size() != static_cast<std::size_t>(E))
    throw Error("expert_bias has " + std::to_string(w.expert_bias.size()) + " values, expected " + std::to_string(E));
  if (w.w1.size() != static_cast<std::size_t>(E) || w.w2.size() != static_cast<std::size_t>(E))
    throw Error("the float64 oracle needs all " + std::to_string(E) + " experts' weights");
  for (std::int64_t e = 0; e < E; ++e) {
    expect_shape(w.w1[e], H, 2 * I, "expert " + std::to_string(e) + " w1");
    expect_shape(w.w2[e], I, H, "expert " + std::to_string(e) + " w2");
  }
  if (c.shared_experts > 0) {
    expect_shape(w.shared_w1, H, 2 * Is, "shared w1");
    expect_shape(w.shared_w2, Is, H, "shared w2");
  }
  expect_shape(in.x, c.total_tokens(), H, "input x");
  expect_shape(in.d_out, c.total_tokens(), H, "output gradient d_out");
}

template <class Weights, class Inputs>
OracleResult oracle(const LayerConfig& c, const Weights& w, const Inputs& in, const OracleOptions& opt) {
  c.validate();
  check_shapes(c, w, in);
  const std::int64_t n = c.total_tokens(), hidden = c.hidden, e = c.routed_experts, k = c.top_k;
  OracleResult r;

  std::vector<double> logits(static_cast<std::size_t>(n * e), 0.0);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t i = 0; i < hidden; ++i)
      for (std::int64_t j = 0; j < e; ++j) logits[t * e + j] += double(in.x.at(t, i)) * double(w.router.at(i, j));
  r.routing = route<double>(c, logits, w.expert_bias, opt.forced_ids, opt.forced_kept);
  if (opt.count_own_choice_differences && !opt.forced_ids.empty()) {
    const auto own = route<double>(c, logits, w.expert_bias);
    for (std::int64_t t = 0; t < n; ++t)
      if (!std::equal(own.expert.begin() + t * k, own.expert.begin() + (t + 1) * k, r.routing.expert.begin() + t * k))
        ++r.own_choice_differences;
  }

  r.tokens = opt.tokens;
  const bool all_tokens = r.tokens.empty();
  if (all_tokens) {
    r.tokens.resize(static_cast<std::size_t>(n));
    std::iota(r.tokens.begin(), r.tokens.end(), 0);
  }
  for (auto t : r.tokens)
    if (t < 0 || t >= n) throw Error("oracle token " + std::to_string(t) + " is out of range");
  const bool weight_grads = opt.backward && all_tokens;
  if (weight_grads) {
    r.d_router.assign(static_cast<std::size_t>(hidden * e), 0.0);
    r.d_w1.assign(static_cast<std::size_t>(e), std::vector<double>(static_cast<std::size_t>(hidden * 2 * c.expert_inter)));
    r.d_w2.assign(static_cast<std::size_t>(e), std::vector<double>(static_cast<std::size_t>(c.expert_inter * hidden)));
    if (c.shared_experts > 0) {
      r.d_shared_w1.assign(static_cast<std::size_t>(hidden * 2 * c.shared_inter_total()), 0.0);
      r.d_shared_w2.assign(static_cast<std::size_t>(c.shared_inter_total() * hidden), 0.0);
    }
  }
  r.out.assign(r.tokens.size() * static_cast<std::size_t>(hidden), 0.0);
  if (opt.backward) r.dx.assign(r.tokens.size() * static_cast<std::size_t>(hidden), 0.0);

  for (std::size_t row = 0; row < r.tokens.size(); ++row) {
    const std::int64_t t = r.tokens[row];
    const auto* x = in.x.row(t);
    const auto* dout = in.d_out.row(t);
    // The routed experts compute on the dispatched token (the router and the
    // shared experts on x itself); its gradient passes straight through.
    std::vector<double> sent;
    if (c.staged_dispatch()) sent = as_dispatched(c, x);
    const bool grad_in_bf16 = c.staged_grad_dispatch();
    if (grad_in_bf16 && !opt.dispatched_gates.empty() && opt.dispatched_gates.size() != r.routing.weight.size())
      throw Error("oracle: " + std::to_string(opt.dispatched_gates.size()) + " dispatched gate weights for " +
                  std::to_string(r.routing.weight.size()) + " assignments");
    double* out = r.out.data() + row * hidden;
    std::vector<MlpToken> expert_act;
    for (std::int64_t j = 0; j < k; ++j) {
      const auto a = static_cast<std::size_t>(t * k + j);
      if (!r.routing.kept[a]) {
        expert_act.emplace_back();
        continue;
      }
      const auto ex = r.routing.expert[a];
      if (!held(w, ex))
        throw Error("the oracle needs expert " + std::to_string(ex) + " (token " + std::to_string(t) +
                    ") but its weights are not held here");
      expert_act.push_back(sent.empty() ? mlp_forward(x, w.w1[ex], w.w2[ex]) : mlp_forward(sent.data(), w.w1[ex], w.w2[ex]));
      for (std::int64_t o = 0; o < hidden; ++o) out[o] += r.routing.weight[a] * expert_act.back().y[o];
    }
    MlpToken shared;
    if (c.shared_experts > 0) {
      shared = mlp_forward(x, w.shared_w1, w.shared_w2);
      for (std::int64_t o = 0; o < hidden; ++o) out[o] += shared.y[o];
    }
    for (std::int64_t o = 0; o < hidden; ++o) r.loss += double(dout[o]) * out[o];
    if (!opt.backward) continue;

    double* dx = r.dx.data() + row * hidden;
    std::vector<double> dy(static_cast<std::size_t>(hidden)), d_weight(static_cast<std::size_t>(k), 0.0);
    for (std::int64_t j = 0; j < k; ++j) {
      const auto a = static_cast<std::size_t>(t * k + j);
      if (!r.routing.kept[a]) continue;
      const auto ex = r.routing.expert[a];
      for (std::int64_t o = 0; o < hidden; ++o) {
        // Under the per-rank exchange the expert's rank computes it from
        // the token's dout as it travelled (bf16 where the backward's
        // dispatch is).
        const double dout_sent = grad_in_bf16 && c.exchange == ExchangeMode::rank ? round_to_bf16(static_cast<float>(dout[o])) : double(dout[o]);
        d_weight[j] += dout_sent * expert_act[j].y[o];
        dy[o] = r.routing.weight[a] * double(dout[o]);
        // Sent to the expert in bf16 (an fp32 layer's encoded backward
        // dispatch): the runtime's product in fp32, rounded; under the
        // per-rank exchange the token's dout travels rounded and the
        // expert's side weights it.
        if (grad_in_bf16) {
          const float gate = opt.dispatched_gates.empty() ? static_cast<float>(r.routing.weight[a]) : opt.dispatched_gates[a];
          dy[o] = c.exchange == ExchangeMode::rank ? double(gate * static_cast<float>(round_to_bf16(static_cast<float>(dout[o]))))
                                                   : round_to_bf16(gate * static_cast<float>(dout[o]));
        }
      }
      double* dw1 = weight_grads ? r.d_w1[ex].data() : nullptr;
      double* dw2 = weight_grads ? r.d_w2[ex].data() : nullptr;
      if (sent.empty()) mlp_backward(x, w.w1[ex], w.w2[ex], expert_act[j], dy, dx, dw1, dw2);
      else mlp_backward(sent.data(), w.w1[ex], w.w2[ex], expert_act[j], dy, dx, dw1, dw2);
    }
    if (c.shared_experts > 0) {
      for (std::int64_t o = 0; o < hidden; ++o) dy[o] = dout[o];
      mlp_backward(x, w.shared_w1, w.shared_w2, shared, dy, dx, weight_grads ? r.d_shared_w1.data() : nullptr,
                   weight_grads ? r.d_shared_w2.data() : nullptr);
    }
    std::vector<double> d_logits(static_cast<std::size_t>(e));
    router_backward_token<double>(c, r.routing, std::span<const double>(logits.data() + t * e, e), t, d_weight,
                                  d_logits);
    for (std::int64_t i = 0; i < hidden; ++i)
      for (std::int64_t j = 0; j < e; ++j) {
        dx[i] += d_logits[j] * double(w.router.at(i, j));
        if (weight_grads) r.d_router[i * e + j] += double(x[i]) * d_logits[j];
      }
  }
  if (all_tokens) r.loss += r.routing.aux_loss + r.routing.z_loss;
  return r;
}

}  // namespace

OracleResult reference_layer(const LayerConfig& c, const LayerWeights& w, const LayerInputs& in,
                             const OracleOptions& opt) {
  return oracle(c, w, in, opt);
}

OracleResult reference_layer(const LayerConfig& c, const LayerWeights64& w, const LayerInputs64& in,
                             const OracleOptions& opt) {
  return oracle(c, w, in, opt);
}

}  // namespace hpmoe
