#pragma once
// The first half of hpmoe._core (python/hpmoe_core.cpp includes it, and
// nothing else does): NumPy arrays in and out, Hugging Face names and
// layouts to and from hpmoe's, the pool of the arrays a step hands to
// PyTorch. Private to that one translation unit, hence the unnamed
// namespace and the using-directive.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <chrono>
#include <atomic>
#include <exception>
#include <map>
#include <unordered_map>
#include <mutex>
#include <span>
#include <thread>
#include <memory>
#include <optional>
#include <string>
#include <variant>

#include <nlohmann/json.hpp>

#include "hpmoe/hpmoe.hpp"

namespace py = pybind11;
using namespace hpmoe;  // NOLINT: one translation unit

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

// Columns [c0, c0 + cols) of the [rows, ld] row-major `m` into o, as [cols, rows].
template <class T, class Out>
void transpose_columns(const T* m, std::int64_t rows, std::int64_t ld, std::int64_t c0, std::int64_t cols, Out* o) {
  // In 32 x 32 blocks: a row-at-a-time transpose of a [H, 2I] gradient reads
  // with a stride of whole rows, and rows 4 KiB apart share cache sets.
  constexpr std::int64_t kBlock = 32;
  for (std::int64_t j0 = 0; j0 < cols; j0 += kBlock)
    for (std::int64_t i0 = 0; i0 < rows; i0 += kBlock) {
      const std::int64_t j1 = std::min(cols, j0 + kBlock), i1 = std::min(rows, i0 + kBlock);
      for (std::int64_t j = j0; j < j1; ++j)
        for (std::int64_t i = i0; i < i1; ++i) o[j * rows + i] = Out(m[i * ld + c0 + j]);
    }
}
template <class T, class Out = T>
py::array_t<Out> transposed_columns(const T* m, std::int64_t rows, std::int64_t ld, std::int64_t c0, std::int64_t cols) {
  py::array_t<Out> out({cols, rows});
  transpose_columns(m, rows, ld, c0, cols, out.mutable_data());
  return out;
}

// job(0 .. n-1) on one thread per core (the GIL released by the caller): the
// conversions between Hugging Face's layout and hpmoe's, expert by expert.
template <class Job>
void on_cores(std::size_t n, Job&& job) {
  const std::size_t threads = std::min<std::size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<std::size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < n;) try {
        job(i);
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
      }
  };
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
}

// The memory of the arrays a step hands to PyTorch (its output, dx, every
// weight's gradient), kept when PyTorch frees them and handed out again at
// the next step: in a training loop the same sizes come back every step,
// and fresh blocks of a few hundred KiB are mapped by malloc one by one, so
// filling them took a page fault per 4 KiB (20 ms of a 38 ms backward on a
// small layer in this VM, against 2 ms in reused memory). Arrays are made
// and freed with the GIL held, which serialises the pool. Free blocks are
// kept up to kKeepBytes; beyond it they go back to the system.
class ArrayPool {
 public:
  static ArrayPool& get() {
    static ArrayPool* pool = new ArrayPool;  // never destroyed: an array may outlive the module's teardown
    return *pool;
  }
  Array make(std::int64_t rows, std::int64_t cols) {
    const auto n = static_cast<std::size_t>(rows * cols);
    float* p = take(n);
    py::capsule owner(p, [](void* q) { ArrayPool::get().give(static_cast<float*>(q)); });
    return Array({rows, cols}, {cols * std::int64_t(sizeof(float)), std::int64_t(sizeof(float))}, p, owner);
  }
  // 16-bit words (bfloat16 bits) in a block of half as many floats.
  py::array_t<std::int16_t> make_bits16(std::int64_t rows, std::int64_t cols) {
    float* p = take(static_cast<std::size_t>(rows * cols + 1) / 2);
    py::capsule owner(p, [](void* q) { ArrayPool::get().give(static_cast<float*>(q)); });
    return py::array_t<std::int16_t>({rows, cols}, {cols * std::int64_t(sizeof(std::int16_t)), std::int64_t(sizeof(std::int16_t))},
                                     reinterpret_cast<std::int16_t*>(p), owner);
  }

 private:
  static constexpr std::size_t kKeepBytes = std::size_t{2} << 30;
  float* take(std::size_t n) {
    auto& list = free_[n];
    float* p = nullptr;
    if (!list.empty()) {
      p = list.back();
      list.pop_back();
      kept_bytes_ -= n * sizeof(float);
    } else {
      p = static_cast<float*>(::operator new(std::max<std::size_t>(n, 1) * sizeof(float), std::align_val_t{64}));
    }
    size_of_[p] = n;
    return p;
  }
  void give(float* p) {
    const auto it = size_of_.find(p);
    const std::size_t n = it->second;
    size_of_.erase(it);
    if (kept_bytes_ + n * sizeof(float) > kKeepBytes) {
      ::operator delete(p, std::align_val_t{64});
      return;
    }
    free_[n].push_back(p);
    kept_bytes_ += n * sizeof(float);
  }
  std::unordered_map<std::size_t, std::vector<float*>> free_;
  std::unordered_map<float*, std::size_t> size_of_;
  std::size_t kept_bytes_ = 0;
};

Array new_array(std::int64_t rows, std::int64_t cols) { return ArrayPool::get().make(rows, cols); }
using Bits16 = py::array_t<std::int16_t>;
Bits16 new_bits16(std::int64_t rows, std::int64_t cols) { return ArrayPool::get().make_bits16(rows, cols); }

Array64 transposed(const std::vector<double>& m, std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  return transposed_columns(m.data(), rows, static_cast<std::int64_t>(m.size()) / rows, c0, cols);
}

// The Hugging Face names of a layer's gradients, from a function that gives
// each as (name, math-layout matrix id, first column, columns).
template <class Grad>
py::dict hf_gradients(const LayerConfig& c, Grad&& grad, const std::vector<std::int32_t>* held = nullptr) {
  const std::int64_t I = c.expert_inter, Is = c.shared_inter_total(), H = c.hidden;
  py::dict out;
  using namespace hf_name;
  out[py::str(router)] = grad("router", -1, 0, c.routed_experts);
  for (std::int64_t e = 0; e < c.routed_experts; ++e) {
    if (held && !std::binary_search(held->begin(), held->end(), static_cast<std::int32_t>(e))) continue;
    const std::string mlp = expert(e);
    out[py::str(projection(mlp, gate_proj))] = grad("w1", e, 0, I);
    out[py::str(projection(mlp, up_proj))] = grad("w1", e, I, I);
    out[py::str(projection(mlp, down_proj))] = grad("w2", e, 0, H);
  }
  if (c.shared_experts > 0) {
    out[py::str(projection(shared, gate_proj))] = grad("shared_w1", -1, 0, Is);
    out[py::str(projection(shared, up_proj))] = grad("shared_w1", -1, Is, Is);
    out[py::str(projection(shared, down_proj))] = grad("shared_w2", -1, 0, H);
  }
  return out;
}

// A parameter as a float32 array: float arrays as they are (other float
// types converted), bfloat16 ones widened, exactly (bf16 is float32's upper
// half). NumPy has no bfloat16, so hpmoe.MoELayer passes those as their
// int16 bits; no other integer array is a parameter. The widening may wait
// (`bits` set, `values` not yet filled) so that it runs on every core with
// the GIL released, into pooled memory that a training loop reuses.
struct KeptArray {
  std::string name;
  Array values;
  py::array_t<std::int16_t> bits;  // set: bfloat16 bits to be widened into values
  bool pending = false;             // not yet widened
  // The parameter's own bytes (its float array, or its bfloat16 bits): what
  // the module's content hash reads.
  const std::byte* source = nullptr;
  std::size_t source_bytes = 0;
};
using KeptArrays = std::vector<KeptArray>;  // alive while views of them are read

KeptArray kept_array(const py::handle& h, const std::string& name) {
  const auto a = py::reinterpret_borrow<py::array>(h);
  const auto bytes_of = [](const py::array& v) {
    return std::pair{static_cast<const std::byte*>(v.data()), static_cast<std::size_t>(v.nbytes())};
  };
  if (a.dtype().kind() != 'i' && a.dtype().kind() != 'u') {
    Array values = h.cast<Array>();
    const auto [source, n] = bytes_of(a);
    return {name, std::move(values), {}, false, source, n};
  }
  if (a.itemsize() != 2) throw Error("parameter '" + name + "' is an integer array; hpmoe needs floating-point parameters");
  auto bits = py::array_t<std::int16_t, py::array::c_style | py::array::forcecast>::ensure(h);
  Array values = a.ndim() == 2 ? new_array(a.shape(0), a.shape(1)) : Array(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
  const auto [source, n] = bytes_of(a);
  return {name, std::move(values), std::move(bits), true, source, n};
}

// A kept array's bfloat16 bits widened into its values, once. It touches no
// Python object's reference count, so it runs with the GIL released.
void widen(KeptArray& k) {
  if (!k.pending) return;
  const std::int16_t* src = k.bits.data();
  float* dst = k.values.mutable_data();
  for (py::ssize_t i = 0; i < k.values.size(); ++i) {
    const std::uint32_t word = std::uint32_t(std::uint16_t(src[i])) << 16;
    std::memcpy(dst + i, &word, sizeof word);
  }
  k.pending = false;
}

// A parameter by Hugging Face name as a view ([out, in]), its array kept.
MatrixView param_view(const py::dict& params, const std::string& name, std::int64_t rows, std::int64_t cols,
                      KeptArrays& keep) {
  if (!params.contains(name)) throw Error("parameter '" + name + "' is missing");
  keep.push_back(kept_array(params[py::str(name)], name));
  return view_of(keep.back().values, rows, cols, "parameter '" + name + "'");
}

// The flat index of the first NaN or Inf among v[0, n), or -1. A NaN or Inf
// has every exponent bit set: tested on the bits (an integer reduction,
// which vectorises; a training step checks every parameter and its tokens),
// the index sought only when one is there.
std::int64_t first_non_finite(const float* v, std::int64_t n) {
  std::uint32_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, v + i, sizeof bits);
    bad |= static_cast<std::uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  if (!bad) return -1;
  for (std::int64_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return i;
  return -1;
}

// Widened first where they wait for it.
void check_finite(std::span<KeptArray> keep) {
  for (KeptArray& k : keep) {
    widen(k);
    if (const std::int64_t i = first_non_finite(k.values.data(), k.values.size()); i >= 0)
      throw Error("parameter '" + k.name + "' holds NaN or Inf at flat index " + std::to_string(i));
  }
}

// The same for bfloat16 bits (NaN or Inf: every exponent bit set), on the
// bits as they are: a bfloat16 parameter a bf16 layer packs without widening.
std::int64_t first_non_finite_bits(const std::int16_t* v, std::int64_t n) {
  std::uint32_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) bad |= static_cast<std::uint32_t>((std::uint16_t(v[i]) & 0x7f80u) == 0x7f80u);
  if (!bad) return -1;
  for (std::int64_t i = 0; i < n; ++i)
    if ((std::uint16_t(v[i]) & 0x7f80u) == 0x7f80u) return i;
  return -1;
}

// bfloat16 parameters checked on their bits, not widened (bf16_views).
void check_finite_bits(std::span<const KeptArray> keep) {
  for (const KeptArray& k : keep)
    if (const std::int64_t i = first_non_finite_bits(k.bits.data(), k.bits.size()); i >= 0)
      throw Error("parameter '" + k.name + "' holds NaN or Inf at flat index " + std::to_string(i));
}

// Whether all of keep's arrays are bfloat16 bits not yet widened.
bool all_bits(std::span<const KeptArray> keep) {
  return std::all_of(keep.begin(), keep.end(), [](const KeptArray& k) { return k.pending; });
}

// An expert's three kept bfloat16 arrays (expert_views' order) as views of
// their bits, for Layer::update_experts of a bf16 layer.
HfMlpBf16 bf16_views(std::span<const KeptArray> three) {
  const auto v = [](const KeptArray& k) {
    return Bf16View{reinterpret_cast<const bf16*>(k.bits.data()), k.bits.shape(0), k.bits.shape(1), k.bits.shape(1)};
  };
  return {v(three[0]), v(three[1]), v(three[2])};
}

// A [tokens, H] float32 token matrix checked finite. `what` names it, `why`
// says what it means when it fails (an input given, an output that overflowed).
void check_tokens_finite(const float* v, std::int64_t tokens, std::int64_t H, const std::string& what, const std::string& why) {
  if (const std::int64_t i = first_non_finite(v, tokens * H); i >= 0)
    throw Error(what + " holds NaN or Inf at token " + std::to_string(i / H) + ", channel " + std::to_string(i % H) + why);
}

HfMlp expert_views(const LayerConfig& c, const py::dict& params, std::int64_t e, KeptArrays& keep) {
  const std::int64_t H = c.hidden, I = c.expert_inter;
  using namespace hf_name;
  const std::string mlp = expert(e);
  return {param_view(params, projection(mlp, gate_proj), I, H, keep),
          param_view(params, projection(mlp, up_proj), I, H, keep),
          param_view(params, projection(mlp, down_proj), H, I, keep)};
}

// The parameters by Hugging Face name ([out, in] matrices), checked finite;
// without the routed experts when `experts` is false.
// `held`: the experts this process holds (sharded over processes); null: all.
LayerWeights weights_of(const LayerConfig& c, const py::dict& params, bool experts = true,
                        const std::vector<std::int32_t>* held = nullptr) {
  KeptArrays keep;
  auto get = [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
    return param_view(params, name, rows, cols, keep);
  };
  const std::int64_t H = c.hidden, E = c.routed_experts, Is = c.shared_inter_total();
  HfMoeBlock b;
  using namespace hf_name;
  b.gate = get(router, E, H);
  b.experts.resize(static_cast<std::size_t>(E));  // all views empty: not converted
  if (experts)
    for (std::int64_t e = 0; e < E; ++e)
      if (!held || std::binary_search(held->begin(), held->end(), static_cast<std::int32_t>(e)))
        b.experts[static_cast<std::size_t>(e)] = expert_views(c, params, e, keep);
  if (c.shared_experts > 0)
    b.shared = {get(projection(shared, gate_proj), Is, H), get(projection(shared, up_proj), Is, H),
                get(projection(shared, down_proj), H, Is)};
  if (params.contains(expert_bias)) {
    keep.push_back(kept_array(params[py::str(expert_bias)], expert_bias));
    widen(keep.back());
    const Array& bias = keep.back().values;
    if (bias.ndim() != 1 || bias.shape(0) != E)
      throw Error("parameter 'gate.e_score_correction_bias' must have shape [" + std::to_string(E) + "]");
    b.e_score_correction_bias = std::span<const float>(bias.data(), static_cast<std::size_t>(E));
  }
  check_finite(keep);
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
  using namespace hf_name;
  w.router = columns_of({get(router, E, H)});
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string mlp = expert(e);
    w.w1.push_back(columns_of({get(projection(mlp, gate_proj), I, H), get(projection(mlp, up_proj), I, H)}));
    w.w2.push_back(columns_of({get(projection(mlp, down_proj), H, I)}));
  }
  if (c.shared_experts > 0) {
    w.shared_w1 = columns_of({get(projection(shared, gate_proj), Is, H), get(projection(shared, up_proj), Is, H)});
    w.shared_w2 = columns_of({get(projection(shared, down_proj), H, Is)});
  }
  w.expert_bias.assign(static_cast<std::size_t>(c.expert_bias ? E : 0), 0.0f);
  if (params.contains(expert_bias)) {
    const auto bias = params[py::str(expert_bias)].cast<Array>();  // selection runs on fp32 biases
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

}  // namespace
