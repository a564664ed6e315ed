// hpmoe's layer as a Python extension (hpmoe._core): one MoE FFN layer run
// by either executor, forward and backward as two calls, with Hugging Face
// parameter names and layouts at the boundary. The nn.Module and autograd
// glue live in python/hpmoe/__init__.py.
//
// Tensors cross as NumPy arrays (torch.Tensor.numpy() and torch.from_numpy
// share memory): float32, C-contiguous inputs are read in place; anything
// else is converted once (pybind11's forcecast). Weights are packed for the
// tile kernels at every forward, because training changes them every step.
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
#include "hpmoe/routing.hpp"
#include "hpmoe/runtime.hpp"
#include "hpmoe/tensors.hpp"

namespace py = pybind11;
using namespace hpmoe;

namespace {

using Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

// A 2-D float32 array as a view, its shape checked against `rows` x `cols`.
MatrixView view_of(const Array& a, std::int64_t rows, std::int64_t cols, const std::string& what) {
  if (a.ndim() != 2 || a.shape(0) != rows || a.shape(1) != cols)
    throw Error(what + " must have shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " +
                std::string(py::str(py::cast(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim())))));
  return MatrixView{a.data(), rows, cols, cols};
}

Array new_array(std::int64_t rows, std::int64_t cols) { return Array({rows, cols}); }

// [rows, cols] of `m` starting at column c0, transposed: HF's [out, in].
Array transposed(const Matrix& m, std::int64_t c0, std::int64_t cols) {
  Array out = new_array(cols, m.rows);
  float* o = out.mutable_data();
  for (std::int64_t j = 0; j < cols; ++j)
    for (std::int64_t i = 0; i < m.rows; ++i) o[j * m.rows + i] = m.at(i, c0 + j);
  return out;
}

class Layer {
 public:
  Layer(const std::string& config_json, int workers, const std::string& executor, const std::string& schedule)
      : config_(config_from_json(nlohmann::json::parse(config_json))), workers_(workers),
        policy_(taskflow::parse_policy(schedule)) {
    if (executor != "interleaved" && executor != "serialized")
      throw Error("executor must be \"interleaved\" or \"serialized\", got \"" + executor + "\"");
    if (workers < 1 || workers > 256) throw Error("workers must be 1 to 256, got " + std::to_string(workers));
    interleaved_ = executor == "interleaved";
    LayerConfig probe = config_;
    if (probe.tokens_per_rank <= 0) probe.tokens_per_rank = 1;
    probe.validate();
  }

  const LayerConfig& config() const { return config_; }

  // out, aux loss, z loss, and kept rows per (rank, expert).
  py::tuple forward(const Array& x, const py::dict& params) {
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
    weights_ = weights_of(c, params);
    x_ = x;  // backward reads it again
    result_ = std::make_unique<StepResult>();
    out_ = new_array(N, H);
    result_->out_into = MutableMatrixView{out_.mutable_data(), N, H, H};
    const MatrixView xv = view_of(x_, N, H, "x");
    {
      py::gil_scoped_release release;
      if (interleaved_) {
        RuntimeOptions o;
        o.workers_per_rank = workers_;
        o.backward = true;
        o.pin = false;  // a Python process's threads are its framework's
        o.policy = policy_;
        auto ex = std::make_unique<InterleavedExecutor>(c, weights_, o);
        ex->forward(xv, {}, *result_);
        executor_ = std::move(ex);
      } else {
        ExecutorOptions o;
        o.workers_per_rank = workers_;
        o.backward = true;
        o.pin = false;
        auto ex = std::make_unique<SerializedExecutor>(c, weights_, o);
        ex->forward(xv, {}, *result_);
        executor_ = std::move(ex);
      }
    }
    step_config_ = c;
    const auto& counts = result_->expert_counts;
    py::array_t<std::int64_t> load({P, c.routed_experts});
    std::copy(counts.begin(), counts.end(), load.mutable_data());
    return py::make_tuple(out_, result_->routing.aux_loss, result_->routing.z_loss, load);
  }

  // Gradients of the last forward, by Hugging Face name, and "x".
  py::dict backward(const Array& d_out) {
    if (!result_ || std::holds_alternative<std::monostate>(executor_))
      throw Error("backward needs a forward first (each forward is followed by at most one backward)");
    const LayerConfig& c = step_config_;
    const std::int64_t N = c.total_tokens(), H = c.hidden;
    const Array dy = d_out;
    const MatrixView dv = view_of(dy, N, H, "d_out");
    Array dx = new_array(N, H);
    result_->dx_into = MutableMatrixView{dx.mutable_data(), N, H, H};
    {
      py::gil_scoped_release release;
      std::visit(
          [&](auto& ex) {
            if constexpr (!std::is_same_v<std::decay_t<decltype(ex)>, std::monostate>) ex->backward(dv, *result_);
          },
          executor_);
    }
    executor_ = std::monostate{};
    const LayerGradients& g = result_->grads;
    const std::int64_t I = c.expert_inter, Is = c.shared_inter_total();
    py::dict out;
    out["x"] = dx;
    out["gate.weight"] = transposed(g.router, 0, c.routed_experts);
    for (std::int64_t e = 0; e < c.routed_experts; ++e) {
      const std::string p = "experts." + std::to_string(e) + ".";
      out[py::str(p + "gate_proj.weight")] = transposed(g.w1[e], 0, I);
      out[py::str(p + "up_proj.weight")] = transposed(g.w1[e], I, I);
      out[py::str(p + "down_proj.weight")] = transposed(g.w2[e], 0, H);
    }
    if (c.shared_experts > 0) {
      out["shared_experts.gate_proj.weight"] = transposed(g.shared_w1, 0, Is);
      out["shared_experts.up_proj.weight"] = transposed(g.shared_w1, Is, Is);
      out["shared_experts.down_proj.weight"] = transposed(g.shared_w2, 0, H);
    }
    result_.reset();
    x_ = Array();
    return out;
  }

 private:
  // The parameters by Hugging Face name ([out, in] matrices).
  static LayerWeights weights_of(const LayerConfig& c, const py::dict& params) {
    std::vector<Array> keep;  // alive while weights_from_hf reads them
    auto get = [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
      if (!params.contains(name)) throw Error("parameter '" + name + "' is missing");
      keep.push_back(params[py::str(name)].cast<Array>());
      return view_of(keep.back(), rows, cols, "parameter '" + name + "'");
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
    Array bias;
    if (params.contains("gate.e_score_correction_bias")) {
      bias = params["gate.e_score_correction_bias"].cast<Array>();
      if (bias.ndim() != 1 || bias.shape(0) != E)
        throw Error("parameter 'gate.e_score_correction_bias' must have shape [" + std::to_string(E) + "]");
      b.e_score_correction_bias = std::span<const float>(bias.data(), static_cast<std::size_t>(E));
    }
    for (const Array& a : keep)
      for (py::ssize_t i = 0; i < a.size(); ++i)
        if (!std::isfinite(a.data()[i]))
          throw Error("a parameter holds NaN or Inf at flat index " + std::to_string(i));
    return weights_from_hf(c, b);
  }

  LayerConfig config_, step_config_;
  int workers_ = 1;
  taskflow::Policy policy_;
  bool interleaved_ = true;
  LayerWeights weights_;
  Array x_, out_;
  std::unique_ptr<StepResult> result_;
  std::variant<std::monostate, std::unique_ptr<InterleavedExecutor>, std::unique_ptr<SerializedExecutor>> executor_;
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
  py::class_<Layer>(m, "Layer")
      .def(py::init<const std::string&, int, const std::string&, const std::string&>(), py::arg("config_json"),
           py::arg("workers"), py::arg("executor"), py::arg("schedule"))
      .def("forward", &Layer::forward, py::arg("x"), py::arg("params"))
      .def("backward", &Layer::backward, py::arg("d_out"))
      .def_property_readonly("config_json", [](const Layer& l) { return to_json(l.config()).dump(); });
  m.def("preset_json", &preset_json, py::arg("name"));
  m.def("preset_names", &preset_names);
  m.def("config_file_json", &config_file_json, py::arg("path"), py::arg("base_json"));
  m.def("config_with", &config_with, py::arg("config_json"), py::arg("fields"));
  m.def("update_expert_bias", &bias_update, py::arg("bias"), py::arg("load"), py::arg("rate"));
}
