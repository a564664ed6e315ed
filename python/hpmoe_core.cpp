// hpmoe's layer as a Python extension (hpmoe._core): one MoE FFN layer run
// by either executor, forward and backward as two calls, with Hugging Face
// parameter names and layouts at the boundary. The nn.Module and autograd
// glue live in python/hpmoe/__init__.py.
//
// Tensors cross as NumPy arrays (torch.Tensor.numpy() and torch.from_numpy
// share memory): float32, C-contiguous inputs are read in place; anything
// else is converted once (pybind11's forcecast). Weights are packed for the
// tile kernels at every forward, because training changes them every step.
//
// executor="reference" runs the fp64 oracle instead (plain loops, float64
// parameters and inputs, float64 results): the layer for gradient checks
// tighter than float32 allows. It copies everything into the math layout and
// recomputes the forward in backward; it is for checking, not for speed.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <variant>

#include <nlohmann/json.hpp>

#include "hpmoe/baseline.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/reference.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/runtime.hpp"
#include "hpmoe/tensors.hpp"

namespace py = pybind11;
using namespace hpmoe;

namespace {

using Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Array64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

std::string shape_text(const py::array& a) {
  return std::string(py::str(py::cast(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()))));
}

// A 2-D float32 array as a view, its shape checked against `rows` x `cols`.
MatrixView view_of(const Array& a, std::int64_t rows, std::int64_t cols, const std::string& what) {
  if (a.ndim() != 2 || a.shape(0) != rows || a.shape(1) != cols)
    throw Error(what + " must have shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " +
                shape_text(a));
  return MatrixView{a.data(), rows, cols, cols};
}

// A 2-D float64 array copied into a matrix, transposed when `transpose`
// (Hugging Face's [out, in] into the math layout's [in, out]).
Matrix64 matrix64_of(const Array64& a, std::int64_t rows, std::int64_t cols, const std::string& what) {
  if (a.ndim() != 2 || a.shape(0) != rows || a.shape(1) != cols)
    throw Error(what + " must have shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " +
                shape_text(a));
  Matrix64 m(rows, cols);
  std::copy(a.data(), a.data() + rows * cols, m.data.begin());
  for (std::int64_t i = 0; i < rows * cols; ++i)
    if (!std::isfinite(m.data[static_cast<std::size_t>(i)]))
      throw Error(what + " holds NaN or Inf at flat index " + std::to_string(i));
  return m;
}

// Hugging Face [out, in] blocks placed side by side as columns of [in, sum out].
Matrix64 columns_of(const std::vector<Matrix64>& hf_blocks) {
  std::int64_t cols = 0;
  for (const auto& b : hf_blocks) cols += b.rows;
  Matrix64 m(hf_blocks.front().cols, cols);
  std::int64_t c0 = 0;
  for (const auto& b : hf_blocks) {
    for (std::int64_t o = 0; o < b.rows; ++o)
      for (std::int64_t i = 0; i < b.cols; ++i) m.at(i, c0 + o) = b.at(o, i);
    c0 += b.rows;
  }
  return m;
}

// Columns [c0, c0 + cols) of the [rows, ld] row-major `m`, as [cols, rows].
template <class T, class Out = T>
py::array_t<Out> transposed_columns(const T* m, std::int64_t rows, std::int64_t ld, std::int64_t c0, std::int64_t cols) {
  py::array_t<Out> out({cols, rows});
  Out* o = out.mutable_data();
  for (std::int64_t j = 0; j < cols; ++j)
    for (std::int64_t i = 0; i < rows; ++i) o[j * rows + i] = Out(m[i * ld + c0 + j]);
  return out;
}

Array new_array(std::int64_t rows, std::int64_t cols) { return Array({rows, cols}); }

// [rows, cols] of `m` starting at column c0, transposed: HF's [out, in].
Array transposed(const Matrix& m, std::int64_t c0, std::int64_t cols) {
  return transposed_columns(m.data.data(), m.rows, m.cols, c0, cols);
}
Array64 transposed(const std::vector<double>& m, std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  return transposed_columns(m.data(), rows, static_cast<std::int64_t>(m.size()) / rows, c0, cols);
}

// The Hugging Face names of a layer's gradients, from a function that gives
// each as (name, math-layout matrix id, first column, columns).
template <class Grad>
py::dict hf_gradients(const LayerConfig& c, Grad&& grad) {
  const std::int64_t I = c.expert_inter, Is = c.shared_inter_total(), H = c.hidden;
  py::dict out;
  out["gate.weight"] = grad("router", -1, 0, c.routed_experts);
  for (std::int64_t e = 0; e < c.routed_experts; ++e) {
    const std::string p = "experts." + std::to_string(e) + ".";
    out[py::str(p + "gate_proj.weight")] = grad("w1", e, 0, I);
    out[py::str(p + "up_proj.weight")] = grad("w1", e, I, I);
    out[py::str(p + "down_proj.weight")] = grad("w2", e, 0, H);
  }
  if (c.shared_experts > 0) {
    out["shared_experts.gate_proj.weight"] = grad("shared_w1", -1, 0, Is);
    out["shared_experts.up_proj.weight"] = grad("shared_w1", -1, Is, Is);
    out["shared_experts.down_proj.weight"] = grad("shared_w2", -1, 0, H);
  }
  return out;
}

// The parameters by Hugging Face name ([out, in] matrices), checked finite.
LayerWeights weights_of(const LayerConfig& c, const py::dict& params) {
  std::vector<std::pair<std::string, Array>> keep;  // alive while weights_from_hf reads them
  auto get = [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
    if (!params.contains(name)) throw Error("parameter '" + name + "' is missing");
    keep.emplace_back(name, params[py::str(name)].cast<Array>());
    return view_of(keep.back().second, rows, cols, "parameter '" + name + "'");
  };
  const std::int64_t H = c.hidden, I = c.expert_inter, E = c.routed_experts, Is = c.shared_inter_total();
  HfMoeBlock b;
  b.gate = get("gate.weight", E, H);
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string p = "experts." + std::to_string(e) + ".";
    b.experts.push_back({get(p + "gate_proj.weight", I, H), get(p + "up_proj.weight", I, H),
                         get(p + "down_proj.weight", H, I)});
  }
  if (c.shared_experts > 0)
    b.shared = {get("shared_experts.gate_proj.weight", Is, H), get("shared_experts.up_proj.weight", Is, H),
                get("shared_experts.down_proj.weight", H, Is)};
  if (params.contains("gate.e_score_correction_bias")) {
    keep.emplace_back("gate.e_score_correction_bias", params["gate.e_score_correction_bias"].cast<Array>());
    const Array& bias = keep.back().second;
    if (bias.ndim() != 1 || bias.shape(0) != E)
      throw Error("parameter 'gate.e_score_correction_bias' must have shape [" + std::to_string(E) + "]");
    b.e_score_correction_bias = std::span<const float>(bias.data(), static_cast<std::size_t>(E));
  }
  for (const auto& [name, a] : keep)
    for (py::ssize_t i = 0; i < a.size(); ++i)
      if (!std::isfinite(a.data()[i]))
        throw Error("parameter '" + name + "' holds NaN or Inf at flat index " + std::to_string(i));
  return weights_from_hf(c, b);
}

// The float64 parameters by Hugging Face name, in the math layout.
LayerWeights64 weights64_of(const LayerConfig& c, const py::dict& params) {
  auto get = [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
    if (!params.contains(name)) throw Error("parameter '" + name + "' is missing");
    return matrix64_of(params[py::str(name)].cast<Array64>(), rows, cols, "parameter '" + name + "'");
  };
  const std::int64_t H = c.hidden, I = c.expert_inter, E = c.routed_experts, Is = c.shared_inter_total();
  LayerWeights64 w;
  w.router = columns_of({get("gate.weight", E, H)});
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string p = "experts." + std::to_string(e) + ".";
    w.w1.push_back(columns_of({get(p + "gate_proj.weight", I, H), get(p + "up_proj.weight", I, H)}));
    w.w2.push_back(columns_of({get(p + "down_proj.weight", H, I)}));
  }
  if (c.shared_experts > 0) {
    w.shared_w1 = columns_of({get("shared_experts.gate_proj.weight", Is, H), get("shared_experts.up_proj.weight", Is, H)});
    w.shared_w2 = columns_of({get("shared_experts.down_proj.weight", H, Is)});
  }
  w.expert_bias.assign(static_cast<std::size_t>(c.expert_bias ? E : 0), 0.0f);
  if (params.contains("gate.e_score_correction_bias")) {
    const auto bias = params["gate.e_score_correction_bias"].cast<Array>();  // selection runs on fp32 biases
    if (bias.ndim() != 1 || bias.shape(0) != E)
      throw Error("parameter 'gate.e_score_correction_bias' must have shape [" + std::to_string(E) + "]");
    w.expert_bias.assign(bias.data(), bias.data() + E);
    for (std::int64_t e = 0; e < E; ++e)
      if (!std::isfinite(w.expert_bias[static_cast<std::size_t>(e)]))
        throw Error("parameter 'gate.e_score_correction_bias' holds NaN or Inf at index " + std::to_string(e));
  }
  return w;
}

// Kept rows per (rank, expert) of a routing.
template <class Real>
py::array_t<std::int64_t> kept_load(const LayerConfig& c, const RouterOutput<Real>& r) {
  const std::int64_t E = c.routed_experts, K = c.top_k;
  py::array_t<std::int64_t> load({c.ranks, E});
  std::int64_t* l = load.mutable_data();
  std::fill(l, l + c.ranks * E, std::int64_t{0});
  for (std::int64_t a = 0; a < c.total_tokens() * K; ++a)
    if (r.kept[static_cast<std::size_t>(a)]) ++l[(a / K / c.tokens_per_rank) * E + r.expert[static_cast<std::size_t>(a)]];
  return load;
}

// One forward's state until its backward: the packed weights, the inputs
// and the executor that ran it. Each forward has its own, so several forwards
// may be in flight (micro-batches, recomputation) and each backward reads
// the forward that made its graph.
class Step {
 public:
  virtual ~Step() = default;
  virtual py::dict backward(const py::array& d_out) = 0;
};

class FastStep final : public Step {
 public:
  FastStep(const LayerConfig& c, const Array& x, const py::dict& params, int workers, bool interleaved,
           const taskflow::Policy& policy)
      : config_(c), weights_(weights_of(c, params)), x_(x), out_(new_array(c.total_tokens(), c.hidden)) {
    const std::int64_t N = c.total_tokens(), H = c.hidden;
    result_.out_into = MutableMatrixView{out_.mutable_data(), N, H, H};
    const MatrixView xv = view_of(x_, N, H, "x");
    py::gil_scoped_release release;
    if (interleaved) {
      RuntimeOptions o;
      o.workers_per_rank = workers;
      o.backward = true;
      o.pin = false;  // a Python process's threads are its framework's
      o.policy = policy;
      auto ex = std::make_unique<InterleavedExecutor>(config_, weights_, o);
      ex->forward(xv, {}, result_);
      executor_ = std::move(ex);
    } else {
      ExecutorOptions o;
      o.workers_per_rank = workers;
      o.backward = true;
      o.pin = false;
      auto ex = std::make_unique<SerializedExecutor>(config_, weights_, o);
      ex->forward(xv, {}, result_);
      executor_ = std::move(ex);
    }
  }

  py::tuple outputs() const {
    py::array_t<std::int64_t> load({config_.ranks, config_.routed_experts});
    std::copy(result_.expert_counts.begin(), result_.expert_counts.end(), load.mutable_data());
    return py::make_tuple(out_, result_.routing.aux_loss, result_.routing.z_loss, load);
  }

  py::dict backward(const py::array& d_out) override {
    if (std::holds_alternative<std::monostate>(executor_))
      throw Error("this forward's backward has already run (the float32 executors run one backward per forward; "
                  "use retain_graph=False, or executor=\"reference\" for repeated backwards)");
    const std::int64_t N = config_.total_tokens(), H = config_.hidden;
    const Array dy = d_out.cast<Array>();
    const MatrixView dv = view_of(dy, N, H, "d_out");
    Array dx = new_array(N, H);
    result_.dx_into = MutableMatrixView{dx.mutable_data(), N, H, H};
    {
      py::gil_scoped_release release;
      std::visit(
          [&](auto& ex) {
            if constexpr (!std::is_same_v<std::decay_t<decltype(ex)>, std::monostate>) ex->backward(dv, result_);
          },
          executor_);
    }
    executor_ = std::monostate{};
    const LayerGradients& g = result_.grads;
    py::dict out = hf_gradients(config_, [&](const std::string& m, std::int64_t e, std::int64_t c0, std::int64_t cols) {
      const Matrix& src = m == "router" ? g.router : m == "w1" ? g.w1[e] : m == "w2" ? g.w2[e]
                          : m == "shared_w1" ? g.shared_w1 : g.shared_w2;
      return transposed(src, c0, cols);
    });
    out["x"] = dx;
    result_ = StepResult{};
    return out;
  }

 private:
  LayerConfig config_;
  LayerWeights weights_;  // the executor packs and reads these: they stay put for the Step's life
  Array x_, out_;
  StepResult result_;
  std::variant<std::monostate, std::unique_ptr<InterleavedExecutor>, std::unique_ptr<SerializedExecutor>> executor_;
};

// The fp64 oracle: backward recomputes from the kept float64 copies, so it
// may run any number of times (torch.autograd.gradcheck does).
class ReferenceStep final : public Step {
 public:
  ReferenceStep(const LayerConfig& c, const Array64& x, const py::dict& params)
      : config_(c), weights_(weights64_of(c, params)) {
    inputs_.x = matrix64_of(x, c.total_tokens(), c.hidden, "x");
    inputs_.d_out = Matrix64(c.total_tokens(), c.hidden);
  }

  py::tuple outputs() const {
    OracleResult r;
    {
      py::gil_scoped_release release;
      r = reference_layer(config_, weights_, inputs_);
    }
    Array64 out({config_.total_tokens(), config_.hidden});
    std::copy(r.out.begin(), r.out.end(), out.mutable_data());
    return py::make_tuple(out, r.routing.aux_loss, r.routing.z_loss, kept_load(config_, r.routing));
  }

  py::dict backward(const py::array& d_out) override {
    const LayerConfig& c = config_;
    const std::int64_t N = c.total_tokens(), H = c.hidden;
    LayerInputs64 in{inputs_.x, matrix64_of(d_out.cast<Array64>(), N, H, "d_out")};
    OracleOptions o;
    o.backward = true;
    OracleResult r;
    {
      py::gil_scoped_release release;
      r = reference_layer(c, weights_, in, o);
    }
    py::dict out = hf_gradients(c, [&](const std::string& m, std::int64_t e, std::int64_t c0, std::int64_t cols) {
      if (m == "router") return transposed(r.d_router, H, c0, cols);
      if (m == "w1") return transposed(r.d_w1[e], H, c0, cols);
      if (m == "w2") return transposed(r.d_w2[e], c.expert_inter, c0, cols);
      if (m == "shared_w1") return transposed(r.d_shared_w1, H, c0, cols);
      return transposed(r.d_shared_w2, c.shared_inter_total(), c0, cols);
    });
    Array64 dx({N, H});
    std::copy(r.dx.begin(), r.dx.end(), dx.mutable_data());
    out["x"] = dx;
    return out;
  }

 private:
  LayerConfig config_;
  LayerWeights64 weights_;
  LayerInputs64 inputs_;
};

class Layer {
 public:
  Layer(const std::string& config_json, int workers, const std::string& executor, const std::string& schedule)
      : config_(config_from_json(nlohmann::json::parse(config_json))), workers_(workers),
        policy_(taskflow::parse_policy(schedule)) {
    if (executor != "interleaved" && executor != "serialized" && executor != "reference")
      throw Error("executor must be \"interleaved\", \"serialized\" or \"reference\" (the fp64 oracle), got \"" +
                  executor + "\"");
    if (workers < 1 || workers > 256) throw Error("workers must be 1 to 256, got " + std::to_string(workers));
    interleaved_ = executor == "interleaved";
    reference_ = executor == "reference";
    LayerConfig probe = config_;
    if (probe.tokens_per_rank <= 0) probe.tokens_per_rank = 1;
    probe.validate();
  }

  const LayerConfig& config() const { return config_; }

  // out, aux loss, z loss, kept rows per (rank, expert), and the Step whose
  // backward gives this forward's gradients.
  py::tuple forward(const py::array& x, const py::dict& params) const {
    const std::int64_t H = config_.hidden, P = config_.ranks;
    if (x.ndim() != 2 || x.shape(1) != H)
      throw Error("x must have shape [tokens, " + std::to_string(H) + "] (hidden " + std::to_string(H) + ")");
    const std::int64_t N = x.shape(0);
    if (N <= 0 || N % P != 0)
      throw Error("x has " + std::to_string(N) + " tokens, which the " + std::to_string(P) +
                  " ranks cannot share evenly (tokens must be a positive multiple of ranks)");
    LayerConfig c = config_;
    c.tokens_per_rank = N / P;
    c.validate();
    if (reference_) {
      auto step = std::make_unique<ReferenceStep>(c, x.cast<Array64>(), params);
      const py::tuple o = step->outputs();
      return py::make_tuple(o[0], o[1], o[2], o[3], py::cast(std::unique_ptr<Step>(std::move(step))));
    }
    auto step = std::make_unique<FastStep>(c, x.cast<Array>(), params, workers_, interleaved_, policy_);
    const py::tuple o = step->outputs();
    return py::make_tuple(o[0], o[1], o[2], o[3], py::cast(std::unique_ptr<Step>(std::move(step))));
  }

 private:
  LayerConfig config_;
  int workers_ = 1;
  taskflow::Policy policy_;
  bool interleaved_ = true;
  bool reference_ = false;
};

std::string preset_json(const std::string& name) { return to_json(preset(name)).dump(); }

std::string config_file_json(const std::string& path, const std::string& base_json) {
  return to_json(load_config_file(path, config_from_json(nlohmann::json::parse(base_json)))).dump();
}

// The config with `field=value` overrides applied (LayerConfig::set), checked.
std::string config_with(const std::string& config_json, const std::map<std::string, std::string>& fields) {
  LayerConfig c = config_from_json(nlohmann::json::parse(config_json));
  for (const auto& [k, v] : fields) c.set(k, v);
  return to_json(c).dump();
}

void bias_update(py::array_t<float, py::array::c_style> bias, const py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>& load, double rate) {
  if (bias.ndim() != 1 || load.ndim() != 1 || bias.shape(0) != load.shape(0))
    throw Error("bias and load must both be [experts]");
  update_expert_bias(std::span<float>(bias.mutable_data(), static_cast<std::size_t>(bias.shape(0))),
                     std::span<const std::int64_t>(load.data(), static_cast<std::size_t>(load.shape(0))), rate);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "hpmoe's MoE layer (C++): forward and backward by either executor";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const nlohmann::json::exception& e) {
      PyErr_SetString(PyExc_ValueError, (std::string("config JSON: ") + e.what()).c_str());
    }
  });
  py::class_<Step>(m, "Step").def("backward", &Step::backward, py::arg("d_out"));
  py::class_<Layer>(m, "Layer")
      .def(py::init<const std::string&, int, const std::string&, const std::string&>(), py::arg("config_json"),
           py::arg("workers"), py::arg("executor"), py::arg("schedule"))
      .def("forward", &Layer::forward, py::arg("x"), py::arg("params"))
      .def_property_readonly("config_json", [](const Layer& l) { return to_json(l.config()).dump(); });
  m.def("preset_json", &preset_json, py::arg("name"));
  m.def("preset_names", &preset_names);
  m.def("config_file_json", &config_file_json, py::arg("path"), py::arg("base_json"));
  m.def("config_with", &config_with, py::arg("config_json"), py::arg("fields"));
  m.def("update_expert_bias", &bias_update, py::arg("bias"), py::arg("load"), py::arg("rate"));
}
