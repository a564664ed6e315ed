// hpmoe's layer as a Python extension (hpmoe._core): one MoE FFN layer run
// by either executor, forward and backward as two calls, with Hugging Face
// parameter names and layouts at the boundary. The nn.Module and autograd
// glue live in python/hpmoe/__init__.py.
//
// Tensors cross as NumPy arrays (torch.Tensor.numpy() and torch.from_numpy
// share memory): float32, C-contiguous inputs are read in place; anything
// else is converted once (pybind11's forcecast). The layer is kept across
// calls (hpmoe::Layer): a forward converts and repacks only the parameters
// whose PyTorch version changed. The array and layout helpers are in
// hpmoe_core_arrays.hpp.
//
// executor="reference" runs the fp64 oracle instead (plain loops, float64
// parameters and inputs, float64 results): the layer for gradient checks
// tighter than float32 allows. It copies everything into the math layout and
// recomputes the forward in backward; it is for checking, not for speed.
#include "hpmoe_core_arrays.hpp"

#include "hpmoe/planning.hpp"

namespace {

// One forward's state until its backward. Each forward has its own, so
// several forwards may be in flight (micro-batches, recomputation) and each
// backward reads the forward that made its graph.
class Step {
 public:
  virtual ~Step() = default;
  // bf16_experts: the routed experts' gradients as bfloat16 bits (int16
  // arrays, rounded to nearest even here), for bfloat16 parameters.
  virtual py::dict backward(const py::array& d_out, bool bf16_experts) = 0;
  // Seconds by part, {"forward": {...}, "backward": {...}} (the fast executors; empty for the oracle).
  virtual py::dict times() const { return py::dict(); }
  // What the exchange moved: put bytes to other ranks, the weights lent
  // (LayerConfig::lend_weights) and their bytes (the fast executors).
  virtual py::dict exchange() const { return py::dict(); }
};

py::dict seconds_of(const std::vector<OperatorTime>& ops) {
  py::dict d;
  for (const auto& op : ops) d[py::str(op.name)] = op.seconds;
  return d;
}

// The fast executors' step: a step of the layer's kept hpmoe::Layer, with
// the input and output arrays it reads and writes in place.
class FastStep final : public Step {
 public:
  // `check`: x and d_out refused where they hold NaN or Inf, and out and dx
  // where they overflowed (as the CLI and the reference executor do).
  FastStep(const LayerConfig& c, hpmoe::Layer& layer, const Array& x, const std::vector<std::int32_t>* held, bool check)
      : config_(c), x_(x), out_(new_array(x.shape(0), c.hidden)), held_(held), check_(check) {
    const std::int64_t N = x.shape(0), H = c.hidden;
    const MatrixView xv = view_of(x_, N, H, "x");
    py::gil_scoped_release release;
    if (check_) check_tokens_finite(x_.data(), N, H, "x", kCheckOff);
    step_.emplace(layer.forward(xv, {}, MutableMatrixView{out_.mutable_data(), N, H, H}));
    forward_ops_ = step_->result().forward_ops;
    if (check_)
      check_tokens_finite(out_.data(), N, H, "the layer's output",
                          " although x is finite: the inputs or weights are too large for float32 (it overflowed)" +
                              std::string(kCheckOff));
  }

  // The host's part before the step: the changed parameters converted and repacked (ModuleLayer::forward).
  void set_sync_seconds(double s) { forward_ops_.insert(forward_ops_.begin(), OperatorTime{"convert_and_repack", s}); }

  py::dict times() const override {
    py::dict d;
    d["forward"] = seconds_of(forward_ops_);
    d["backward"] = seconds_of(backward_ops_);
    return d;
  }

  py::dict exchange() const override {
    const StepResult& r = step_->result();
    py::dict d;
    d["forward_put_bytes"] = r.forward_put_bytes;
    d["backward_put_bytes"] = r.backward_put_bytes;
    d["lent_experts"] = r.lent_experts;
    d["forward_lent_bytes"] = r.forward_lent_bytes;
    d["backward_lent_bytes"] = r.backward_lent_bytes;
    return d;
  }

  // Kept rows per (rank, expert), all ranks.
  std::span<const std::int64_t> counts() const { return step_->result().expert_counts; }

  py::tuple outputs() const {
    const StepResult& r = step_->result();
    py::array_t<std::int64_t> load({config_.ranks, config_.routed_experts});
    std::copy(r.expert_counts.begin(), r.expert_counts.end(), load.mutable_data());
    return py::make_tuple(out_, r.routing.aux_loss, r.routing.z_loss, load);
  }

  py::dict backward(const py::array& d_out, bool bf16_experts) override {
    if (!step_)
      throw Error("this forward's backward has already run (the float32 executors run one backward per forward; "
                  "use retain_graph=False, or executor=\"reference\" for repeated backwards)");
    const std::int64_t N = x_.shape(0), H = config_.hidden, I = config_.expert_inter;
    const Array dy = d_out.cast<Array>();
    const MatrixView dv = view_of(dy, N, H, "d_out");
    Array dx = new_array(N, H);
    // The routed experts' gradients in Hugging Face's layout, written by
    // their tiles straight into the arrays PyTorch gets: gate_proj's and
    // up_proj's one [2I, H] block, down_proj's [H, I]; for bfloat16
    // parameters in bfloat16 (int16 arrays of its bits), rounded as stored.
    BackwardOptions options{MutableMatrixView{dx.mutable_data(), N, H, H}, {}};
    std::vector<std::pair<py::array, py::array>> expert_arrays(static_cast<std::size_t>(config_.routed_experts));
    options.experts.resize(expert_arrays.size());
    for (std::int64_t e = 0; e < config_.routed_experts; ++e) {
      if (held_ && !std::binary_search(held_->begin(), held_->end(), static_cast<std::int32_t>(e))) continue;
      auto& [w1_t, w2_t] = expert_arrays[static_cast<std::size_t>(e)];
      ExpertGradientsInto& into = options.experts[static_cast<std::size_t>(e)];
      if (bf16_experts) {
        Bits16 a = new_bits16(2 * I, H), b = new_bits16(H, I);
        into.w1_t_bf16 = {reinterpret_cast<bf16*>(a.mutable_data()), 2 * I, H, H};
        into.w2_t_bf16 = {reinterpret_cast<bf16*>(b.mutable_data()), H, I, I};
        w1_t = std::move(a);
        w2_t = std::move(b);
      } else {
        Array a = new_array(2 * I, H), b = new_array(H, I);
        into.w1_t = {a.mutable_data(), 2 * I, H, H};
        into.w2_t = {b.mutable_data(), H, I, I};
        w1_t = std::move(a);
        w2_t = std::move(b);
      }
    }
    {
      py::gil_scoped_release release;
      if (check_) check_tokens_finite(dy.data(), N, H, "d_out (the gradient reaching the layer)", kCheckOff);
      step_->backward(dv, options);
      if (check_)
        check_tokens_finite(dx.data(), N, H, "the gradient of x",
                            " although d_out is finite: the values are too large for float32 (it overflowed)" +
                                std::string(kCheckOff));
    }
    const LayerGradients& g = step_->gradients();
    backward_ops_ = step_->result().backward_ops;
    const auto fill_start = std::chrono::steady_clock::now();
    // The arrays are made with the GIL held, and filled on every core without it.
    struct Fill {
      const Matrix* src;
      std::int64_t c0, cols;
      float* dst;
    };
    std::vector<Fill> fills;
    py::dict out = hf_gradients(config_, [&](const std::string& m, std::int64_t e, std::int64_t c0, std::int64_t cols) {
      if (m == "w1" || m == "w2") {  // rows [c0, c0 + cols) of the expert's array (a view: no copy)
        const auto& [w1_t, w2_t] = expert_arrays[static_cast<std::size_t>(e)];
        return py::array((m == "w1" ? w1_t : w2_t)[py::slice(c0, c0 + cols, 1)]);
      }
      const Matrix& src = m == "router" ? g.router : m == "shared_w1" ? g.shared_w1 : g.shared_w2;  // transposed below
      Array a = new_array(cols, src.rows);
      fills.push_back({&src, c0, cols, a.mutable_data()});
      return py::array(a);
    }, held_);
    {
      py::gil_scoped_release release;
      on_cores(fills.size(), [&](std::size_t i) {
        const Fill& f = fills[i];
        transpose_columns(f.src->data.data(), f.src->rows, f.src->cols, f.c0, f.cols, f.dst);
      });
    }
    out["x"] = dx;
    backward_ops_.push_back({"gradients_to_hf", std::chrono::duration<double>(std::chrono::steady_clock::now() - fill_start).count()});
    step_.reset();  // its buffers go back to the layer for the next step
    return out;
  }

 private:
  LayerConfig config_;
  static constexpr const char* kCheckOff = " (MoELayer(check_finite=False) skips this check)";
  Array x_, out_;  // x is read in place until backward
  std::vector<OperatorTime> forward_ops_, backward_ops_;
  const std::vector<std::int32_t>* held_;  // over MPI: this process's experts (their gradients only)
  bool check_ = true;
  std::optional<hpmoe::Layer::Step> step_;
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

  py::dict backward(const py::array& d_out, bool /*bf16_experts: the oracle's are float64*/) override {
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

// A parameter's identity and version as PyTorch tracks them: its storage's
// address and the tensor's version counter, which every in-place update (an
// optimizer's step, load_state_dict's copy_) increments.
using ParamVersion = std::pair<std::int64_t, std::int64_t>;

// A parameter's bytes as one value: 32 interleaved 32-bit lanes, each
// taking its words through x = (lane + w) K, lane = x ^ (x >> 16) (K odd),
// then the lanes folded. Each step is a bijection of the lane for a given
// word, so a change of any one word always changes the value; the shift
// makes changes of the top bit (a sign flip, in every word: neg_) reach the
// low bits, where a plain multiply-add let them cancel in pairs (2^31 times
// an even count of odd numbers is 0 mod 2^32). The lanes are independent, so
// the compiler vectorises them and the hash runs at memory speed.
// What it catches are the writes PyTorch's version counter does not see:
// through p.data, or NumPy on p.numpy().
std::uint64_t content_hash(const std::byte* bytes, std::size_t n) {
  constexpr std::uint32_t K = 0x9E3779B1u;
  constexpr std::size_t kLanes = 32;
  std::uint32_t lane[kLanes];
  for (std::size_t j = 0; j < kLanes; ++j) lane[j] = static_cast<std::uint32_t>(j + 1);
  const std::size_t blocks = n / (4 * kLanes);
  for (std::size_t i = 0; i < blocks; ++i) {
    std::uint32_t w[kLanes];
    std::memcpy(w, bytes + i * 4 * kLanes, sizeof w);
    for (std::size_t j = 0; j < kLanes; ++j) {
      const std::uint32_t x = (lane[j] + w[j]) * K;
      lane[j] = x ^ (x >> 16);  // high bits reach the low ones: sign flips in pairs no longer cancel
    }
  }
  std::uint64_t h = n;
  constexpr std::uint64_t K64 = 0x9E3779B97F4A7C15ull;
  for (std::size_t b = blocks * 4 * kLanes; b < n; ++b) h = (h + static_cast<std::uint64_t>(bytes[b])) * K64;
  for (const std::uint32_t l : lane) h = (h ^ l) * K64;
  return h;
}

// The process's MPI session: MPI_Init_thread at the first layer made with
// ep="mpi" (the process was started by mpirun), MPI_Finalize at exit.
const MpiSession& mpi_session() {
  static MpiSession session(nullptr, nullptr);
  return session;
}

// MoELayer(placement=...): a placement's JSON (an object, as a placement
// file holds) or a spec hpmoe run --placement takes (contiguous,
// round-robin, random[:SEED], a file's path). Empty: contiguous.
ExpertPlacement module_placement(const std::string& text, const LayerConfig& c) {
  if (text.empty()) return ExpertPlacement::contiguous(c.routed_experts, c.ranks);
  if (text.front() == '{')
    return placement_from_json(nlohmann::json::parse(text), c.routed_experts, c.ranks, "MoELayer(placement=...)");
  return parse_placement(text, c.routed_experts, c.ranks);
}

// MoELayer(online=...): the online policy's settings, every key optional.
struct OnlineSetup {
  OnlinePlacement::Options options;
  std::string machine = "cpu-local";  // the cost model's machine model
  bool training = true;               // replicas pay their gradient reduction
  std::optional<bool> fetch;          // replicas fetch their weights (unset: over MPI only)
};

OnlineSetup parse_online(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  if (!j.is_object()) throw Error("online must be True or a dict of the online policy's settings");
  OnlineSetup s;
  const auto integer = [&](const std::string& key, std::int64_t& into, std::int64_t least) {
    const auto& v = j.at(key);
    if (!v.is_number_integer() || v.get<std::int64_t>() < least)
      throw Error("online[\"" + key + "\"] must be an integer of at least " + std::to_string(least) + ", got " + v.dump());
    into = v.get<std::int64_t>();
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "every") integer(key, s.options.every, 1);
    else if (key == "window") integer(key, s.options.window, 1);
    else if (key == "max_changes") integer(key, s.options.max_changes, 0);
    else if (key == "slots_per_rank") integer(key, s.options.slots_per_rank, 0);
    else if (key == "drift") {
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
        throw Error("online[\"drift\"] must be a number >= 0 (0: revise on schedule only), got " + v.dump());
      s.options.drift = v.get<double>();
    } else if (key == "machine") {
      if (!v.is_string()) throw Error("online[\"machine\"] must be a machine model's name or file, got " + v.dump());
      s.machine = v.get<std::string>();
    } else if (key == "training" || key == "fetch") {
      if (!v.is_boolean()) throw Error("online[\"" + key + "\"] must be True or False, got " + v.dump());
      (key == "training" ? s.training : s.fetch.emplace()) = v.get<bool>();
    } else {
      throw Error("online has no setting \"" + key +
                  "\" (every, window, drift, max_changes, slots_per_rank, machine, training, fetch)");
    }
  }
  return s;
}

class ModuleLayer {
 public:
  ModuleLayer(const std::string& config_json, int workers, const std::string& executor, const std::string& schedule,
              const std::string& transport, const std::string& mpi_path, const std::string& placement,
              const std::string& online)
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
    if (reference_ && (!placement.empty() || !online.empty()))
      throw Error("executor=\"reference\" computes every expert once, in one place: placement and online apply to "
                  "the fast executors (\"interleaved\", \"serialized\")");
    placement_ = module_placement(placement, probe);
    placement_.check_fits(config_.routed_experts, config_.ranks, config_.expert_inter, config_.dtype == DType::bf16 ? 2 : 1);
    // Over MPI a process holds only the experts it owns: replicas fetch their
    // weights (bit for bit held ones), and so do an online revision's.
    if (transport == "mpi") placement_ = placement_.with_fetched_replicas();
    const MpiPath path = parse_mpi_path(mpi_path);  // checked whatever the transport: a bad value is never ignored
    if (transport == "mpi") {
      if (reference_) throw Error("executor=\"reference\" runs in one process; use ep=\"mpi\" with \"interleaved\" or \"serialized\"");
      const MpiSession& session = mpi_session();
      if (session.size() != config_.ranks)
        throw Error("the layer has " + std::to_string(config_.ranks) + " expert-parallel ranks but " +
                    std::to_string(session.size()) + " MPI processes were started: one process per rank (mpirun -np " +
                    std::to_string(config_.ranks) + ")");
      MpiOptions options;
      options.path = path;
      options.ranks_per_node = static_cast<int>(config_.ranks_per_node);
      // What every process must construct alike, compared before anything
      // is built from it (a difference is one ValueError naming it).
      options.agree = {{"MoELayer(workers=...)", std::to_string(workers)},
                       {"MoELayer(executor=...)", executor},
                       {"MoELayer(schedule=...)", schedule},
                       {"MoELayer(placement=...)", placement},
                       {"MoELayer(online=...)", online},
                       {"the layer's config (MoELayer(config=...) and its dtype, exchange, ... arguments)", config_json}};
      transport_ = make_mpi_transport(session, static_cast<int>(config_.ranks), options);
      rank_ = session.rank();
      for (std::int64_t e = 0; e < config_.routed_experts; ++e)  // the experts it owns (replicas fetch theirs)
        if (placement_.owner(e) == rank_) held_.push_back(static_cast<std::int32_t>(e));
    } else if (transport != "inprocess") {
      throw Error("ep must be \"inprocess\" (every rank a thread group of this process) or \"mpi\" (one process per rank), got \"" +
                  transport + "\"");
    }
    if (!online.empty()) {
      // Over MPI owners stay (a process's parameters and their optimizer
      // state are PyTorch's) and replicas fetch their weights, so a
      // revision has nothing to load; a replica may sit below its owner
      // (the placement then names its owners). In process every rank reads
      // the module's one copy of every parameter, so an owner may move
      // (which rank sums the expert's gradient; nothing is copied), unless
      // the replicas fetch as over MPI (online["fetch"]).
      const OnlineSetup s = parse_online(online);
      if (transport_ && s.fetch == false)
        throw Error("online[\"fetch\"] = False: over MPI a process holds only the experts it owns, so its replicas "
                    "fetch their weights (leave \"fetch\" out)");
      if (s.fetch == true) placement_ = placement_.with_fetched_replicas();
      const bool fetched = placement_.fetches_replicas();  // always over MPI
      OnlinePlacement::Options o = s.options;
      o.relocate = !fetched;
      online_.emplace(config_, placement_, ExpertCostModel::from_machine(s.machine, config_, s.training, fetched), o);
    }
  }

  // Over MPI: this process's rank and the experts it holds; in process: rank 0 and every expert.
  int rank() const { return rank_; }
  std::vector<std::int32_t> held_experts() const {
    if (transport_) return held_;
    std::vector<std::int32_t> all(static_cast<std::size_t>(config_.routed_experts));
    for (std::size_t e = 0; e < all.size(); ++e) all[e] = static_cast<std::int32_t>(e);
    return all;
  }

  const LayerConfig& config() const { return config_; }

  // out, aux loss, z loss, kept rows per (rank, expert), and the Step whose
  // backward gives this forward's gradients. `versions` (name -> (address,
  // version)) says which parameters changed since the last forward: only
  // those are converted and repacked.
  py::tuple forward(const py::array& x, const py::dict& params, const std::map<std::string, ParamVersion>& versions) {
    const std::int64_t H = config_.hidden, P = config_.ranks;
    if (x.ndim() != 2 || x.shape(1) != H)
      throw Error("x must have shape [tokens, " + std::to_string(H) + "] (hidden " + std::to_string(H) + ")");
    const std::int64_t N = x.shape(0);
    // Over MPI, x is this process's own tokens (one rank's); in process, all ranks' tokens.
    const std::int64_t hosted = transport_ ? 1 : P;
    if (N <= 0 || N % hosted != 0)
      throw Error("x has " + std::to_string(N) + " tokens, which the " + std::to_string(P) +
                  " ranks cannot share evenly (tokens must be a positive multiple of ranks)");
    LayerConfig c = config_;
    c.tokens_per_rank = N / hosted;
    c.validate();
    if (reference_) {
      auto step = std::make_unique<ReferenceStep>(c, x.cast<Array64>(), params);
      const py::tuple o = step->outputs();
      return py::make_tuple(o[0], o[1], o[2], o[3], py::cast(std::unique_ptr<Step>(std::move(step))));
    }
    const auto sync_start = std::chrono::steady_clock::now();
    sync_weights(c, params, versions);
    const double sync_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - sync_start).count();
    auto step = std::make_unique<FastStep>(c, *layer_, x.cast<Array>(), transport_ ? &held_ : nullptr, check_finite_);
    step->set_sync_seconds(sync_seconds);
    const py::tuple o = step->outputs();
    if (online_) observe(step->counts());
    return py::make_tuple(o[0], o[1], o[2], o[3], py::cast(std::unique_ptr<Step>(std::move(step))));
  }

  // The placement the next forward runs on, as a placement file holds it.
  std::string placement_json() const { return to_json(placement_).dump(); }
  // Revisions the online policy made, and the last one's changes.
  std::int64_t revisions() const { return revisions_; }
  py::object last_revision() const {
    if (revisions_ == 0) return py::none();
    py::dict d;
    d["step"] = revised_at_;
    d["added"] = last_.added;
    d["dropped"] = last_.dropped;
    d["moved"] = last_.moved;
    d["bytes_moved"] = last_.bytes_moved;
    return d;
  }

  // Parameters converted and repacked so far (a measure of what was reused).
  std::int64_t conversions() const { return conversions_; }
  std::int64_t engines() const { return layer_ ? static_cast<std::int64_t>(layer_->engines()) : 0; }

 private:
  // The kept layer's weights brought up to the parameters: all of them the
  // first time, then only the experts and replicated tensors whose
  // parameters changed (by version), in place.
  // The content hashes (check_parameters), on every core: of the routed
  // experts' parameters whose version counter did not move (all of them
  // when the layer is made), where the writes the counters miss are sought,
  // and of the replicated ones (small). An expert whose counter moved is
  // converted anyway (an optimizer moves them all every step), and its
  // conversion job hashes it on the way (sync_weights): hashing it here too
  // read every weight once more per training step.
  std::map<std::string, std::uint64_t> content_hashes(const py::dict& params,
                                                      const std::map<std::string, ParamVersion>& versions) const {
    std::map<std::string, std::uint64_t> out;
    if (!check_parameters_) return out;
    std::vector<std::pair<const std::byte*, std::size_t>> spans;
    std::vector<std::string> names;
    std::vector<py::array> keep;  // alive while hashed
    for (const auto& [name, version] : versions) {
      const auto seen = versions_.find(name);
      const bool moved = seen == versions_.end() || seen->second != version;
      if (layer_ && moved && name.rfind("experts.", 0) == 0) continue;
      names.push_back(name);
      keep.push_back(py::reinterpret_borrow<py::array>(params[py::str(name)]));
      spans.emplace_back(static_cast<const std::byte*>(keep.back().data()), static_cast<std::size_t>(keep.back().nbytes()));
    }
    std::vector<std::uint64_t> h(spans.size());
    {
      py::gil_scoped_release release;
      on_cores(spans.size(), [&](std::size_t i) { h[i] = content_hash(spans[i].first, spans[i].second); });
    }
    for (std::size_t i = 0; i < names.size(); ++i) out[names[i]] = h[i];
    return out;
  }

  void sync_weights(const LayerConfig& c, const py::dict& params, const std::map<std::string, ParamVersion>& versions) {
    auto hashes = content_hashes(params, versions);
    if (!layer_) {
      LayerWeights w = weights_of(c, params, true, transport_ ? &held_ : nullptr);
      py::gil_scoped_release release;
      Parallel p;
      p.workers_per_rank = workers_;
      p.schedule = interleaved_ ? Schedule::interleaved : Schedule::serialized;
      p.policy = policy_;
      p.transport = transport_;
      p.pin = false;  // a Python process's threads are its framework's
      p.threads = WorkerThreads::openmp;  // PyTorch's OpenMP threads run the workers: none spins beside them
      p.placement = placement_;
      layer_.emplace(c, std::move(w), p);
      versions_ = versions;
      hashes_ = std::move(hashes);
      conversions_ += static_cast<std::int64_t>(versions.size());
      return;
    }
    bool replicated = false;
    std::vector<std::int32_t> experts;
    for (const auto& [name, version] : versions) {
      const auto seen = versions_.find(name);
      const auto content = hashes_.find(name);
      const auto now = hashes.find(name);  // none where the counter moved (or was not there)
      const bool same_content =
          !check_parameters_ || (content != hashes_.end() && now != hashes.end() && content->second == now->second);
      if (seen != versions_.end() && seen->second == version && same_content) continue;
      ++conversions_;
      if (name.rfind("experts.", 0) == 0) experts.push_back(static_cast<std::int32_t>(std::stol(name.substr(8))));
      else replicated = true;
    }
    if (versions.size() != versions_.size()) replicated = true;  // a tensor appeared or went (the bias buffer): the replicated ones again; new expert names are changed above
    versions_ = versions;
    hashes_ = std::move(hashes);
    if (!replicated && experts.empty()) return;
    std::sort(experts.begin(), experts.end());
    experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
    // The changed experts' views taken with the GIL held, checked on every
    // core without it, then packed by the layer straight from them (no
    // math-layout copy: Layer::update_experts).
    // A bf16 layer takes bfloat16 parameters' bits as they are (no widening).
    KeptArrays keep;
    std::vector<HfMlp> mlps;
    for (const std::int32_t e : experts) mlps.push_back(expert_views(c, params, e, keep));
    std::vector<char> bits(experts.size());
    for (std::size_t i = 0; i < experts.size(); ++i)
      bits[i] = c.dtype == DType::bf16 && all_bits(std::span<const KeptArray>(keep).subspan(3 * i, 3));
    std::vector<std::uint64_t> converted_hashes(keep.size());
    {
      py::gil_scoped_release release;
      on_cores(experts.size(), [&](std::size_t i) {
        if (check_parameters_)  // the bytes content_hashes reads, while they are read anyway
          for (std::size_t j = 3 * i; j < 3 * i + 3; ++j) converted_hashes[j] = content_hash(keep[j].source, keep[j].source_bytes);
        const auto three = std::span<KeptArray>(keep).subspan(3 * i, 3);
        if (bits[i]) check_finite_bits(three);
        else check_finite(three);  // widens bfloat16 ones first
      });
      std::vector<std::int32_t> as_float, as_bits;
      std::vector<HfMlp> float_views;
      std::vector<HfMlpBf16> bits_views;
      for (std::size_t i = 0; i < experts.size(); ++i) {
        if (bits[i]) {
          as_bits.push_back(experts[i]);
          bits_views.push_back(bf16_views(std::span<const KeptArray>(keep).subspan(3 * i, 3)));
        } else {
          as_float.push_back(experts[i]);
          float_views.push_back(mlps[i]);
        }
      }
      if (!as_float.empty()) layer_->update_experts(as_float, float_views);
      if (!as_bits.empty()) layer_->update_experts(as_bits, bits_views);
    }
    if (check_parameters_)
      for (std::size_t j = 0; j < keep.size(); ++j) hashes_[keep[j].name] = converted_hashes[j];
    if (replicated) layer_->update_replicated(weights_of(c, params, /*experts=*/false));
  }

  // A forward's counts fed to the online policy; a revision is the next
  // forward's placement (this step and its backward finish on theirs).
  // Every process feeds the same counts, so all revise alike.
  void observe(std::span<const std::int64_t> counts) {
    std::optional<Revision> r = online_->observe(counts);
    if (!r || r->placement == placement_) return;
    layer_->set_placement(r->placement);
    placement_ = r->placement;
    last_ = *r;
    revised_at_ = online_->steps();
    ++revisions_;
  }

  LayerConfig config_;
  int workers_ = 1;
  taskflow::Policy policy_;
  ExpertPlacement placement_;
  std::optional<OnlinePlacement> online_;
  Revision last_;
  std::int64_t revisions_ = 0, revised_at_ = 0;
  bool interleaved_ = true;
  bool reference_ = false;
  std::shared_ptr<Transport> transport_;  // null: every rank in this process
  int rank_ = 0;
  std::vector<std::int32_t> held_;  // over MPI: this process's experts, sorted
  std::optional<hpmoe::Layer> layer_;  // made at the first forward, from its parameters

 public:
  bool check_finite_ = true;  // the fast executors' token checks (FastStep)
  // Hash every parameter's bytes at each forward, so that writes the version
  // counters miss (p.data, NumPy) are converted too (MoELayer(check_parameters=...)).
  bool check_parameters_ = true;

 private:
  std::map<std::string, ParamVersion> versions_;
  std::map<std::string, std::uint64_t> hashes_;  // check_parameters: each parameter's content at its last conversion
  std::int64_t conversions_ = 0;
};

std::string preset_json(const std::string& name) { return to_json(preset(name)).dump(); }

std::string config_file_json(const std::string& path, const std::string& base_json) {
  return to_json(load_config_file(path, config_from_json(nlohmann::json::parse(base_json)))).dump();
}

// The config with `field=value` overrides applied (LayerConfig::set), checked.
std::string config_with(const std::string& config_json, const std::map<std::string, std::string>& fields) {
  LayerConfig c = config_from_json(nlohmann::json::parse(config_json));
  for (const auto& [k, v] : fields) c.set(k, v);
  c.validate();  // a field out of range is refused here, not when a module is built from it
  return to_json(c).dump();
}

// A config in either of hpmoe's forms (`hpmoe config`'s "layer" and "run"
// sections, or one object of fields) as one object of fields, checked.
std::string flat_config(const std::string& config_json) {
  return to_json(config_from_json(nlohmann::json::parse(config_json))).dump();
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
  py::class_<Step>(m, "Step").def("backward", &Step::backward, py::arg("d_out"), py::arg("bf16_experts") = false).def("times", &Step::times).def("exchange", &Step::exchange);
  py::class_<ModuleLayer>(m, "Layer")
      .def(py::init<const std::string&, int, const std::string&, const std::string&, const std::string&, const std::string&,
                    const std::string&, const std::string&>(),
           py::arg("config_json"), py::arg("workers"), py::arg("executor"), py::arg("schedule"),
           py::arg("transport") = "inprocess", py::arg("mpi_path") = "auto", py::arg("placement") = "",
           py::arg("online") = "")
      .def_property_readonly("rank", &ModuleLayer::rank)
      .def_property_readonly("held_experts", &ModuleLayer::held_experts)
      .def_readwrite("check_finite", &ModuleLayer::check_finite_)
      .def_readwrite("check_parameters", &ModuleLayer::check_parameters_)
      .def("forward", &ModuleLayer::forward, py::arg("x"), py::arg("params"), py::arg("versions"))
      .def_property_readonly("conversions", &ModuleLayer::conversions)
      .def_property_readonly("engines", &ModuleLayer::engines)
      .def_property_readonly("placement_json", &ModuleLayer::placement_json)
      .def_property_readonly("revisions", &ModuleLayer::revisions)
      .def_property_readonly("last_revision", &ModuleLayer::last_revision)
      .def_property_readonly("config_json", [](const ModuleLayer& l) { return to_json(l.config()).dump(); });
  m.def("preset_json", &preset_json, py::arg("name"));
  m.def("preset_names", &preset_names);
  // Ends the whole MPI job (hpmoe's excepthook under ep="mpi"): the line on
  // stderr with this process's rank, then MPI_Abort, which mpirun turns into
  // the end of every process.
  m.def("mpi_abort", [](const std::string& message, int code) { mpi_session().abort(message, code); },
        py::arg("message"), py::arg("code") = 2);
  m.def("config_file_json", &config_file_json, py::arg("path"), py::arg("base_json"));
  m.def("config_with", &config_with, py::arg("config_json"), py::arg("fields"));
  m.def("flat_config", &flat_config, py::arg("config_json"));
  m.def(
      "choose_exchange",
      [](const std::string& config_json, const std::string& machine, const std::string& routing, bool backward) {
        const ExchangeChoice c = choose_exchange(config_from_json(nlohmann::json::parse(config_json)), machine, routing, backward);
        return py::make_tuple(to_string(c.exchange), c.why);
      },
      py::arg("config_json"), py::arg("machine"), py::arg("routing"), py::arg("backward"));
  m.def("update_expert_bias", &bias_update, py::arg("bias"), py::arg("load"), py::arg("rate"));
}
