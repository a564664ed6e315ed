// The engine's memory: every rank's symmetric segment and local region for
// a step's programs, each buffer bound to its memory (the caller's tensors
// for the bound ones), and the host's part of the forward and backward.
#include "runtime/engine.hpp"
#include "runtime/host_tables.hpp"

namespace hpmoe::detail {

template <class T>
void Interleaved<T>::reserve_memory(StepResult& res) {
  std::vector<std::int64_t> bytes(static_cast<std::size_t>(c_.ranks));
  for (auto* layouts : {&forward_layouts_, &backward_layouts_}) layouts->resize(static_cast<std::size_t>(c_.ranks));
  for (auto* index : {&forward_peer_, &backward_peer_}) index->assign(static_cast<std::size_t>(c_.ranks), {});
  // Each rank's buffers by id, so a put finds its target's layout without a search.
  auto index_of = [](const taskflow::Program& p, PeerBuffers& by_id) {
    for (const auto& b : p.buffers) by_id[static_cast<std::size_t>(b.id)] = &b;
  };
  for (std::int64_t r = 0; r < c_.ranks; ++r) {
    taskflow::Program& forward = forward_layouts_[static_cast<std::size_t>(r)];
    taskflow::declare_buffers(forward, c_, plan.ex(), taskflow::Pass::forward, r);
    std::int64_t symmetric = forward.region_bytes(taskflow::Region::symmetric);
    std::int64_t local = forward.region_bytes(taskflow::Region::local);
    index_of(forward, forward_peer_[static_cast<std::size_t>(r)]);
    if (opt_.backward) {
      taskflow::Program& backward = backward_layouts_[static_cast<std::size_t>(r)];
      taskflow::declare_buffers(backward, c_, plan.ex(), taskflow::Pass::backward, r);
      index_of(backward, backward_peer_[static_cast<std::size_t>(r)]);
      symmetric = std::max(symmetric, backward.region_bytes(taskflow::Region::symmetric));
      local = std::max(local, backward.region_bytes(taskflow::Region::local));
    }
    bytes[static_cast<std::size_t>(r)] = symmetric;
    if (tr_->hosts(static_cast<int>(r))) ranks_[r].local.reserve(local);
    if (r == local_.front()) {
      res.segment_bytes = symmetric;
      res.local_bytes = local;
    }
  }
  tr_->reserve_segments(bytes);
  for (std::int64_t r = 0; r < c_.ranks; ++r) ranks_[r].segment = tr_->segment(static_cast<int>(r));
}

template <class T>
void Interleaved<T>::bind(const taskflow::Program& p, int r, StepResult& res) {
  RankState& s = ranks_[r];
  const std::int64_t T_ = c_.tokens_per_rank;
  s.base.fill(nullptr);
  s.layout.fill(nullptr);
  for (const auto& b : p.buffers) {
    s.layout[static_cast<std::size_t>(b.id)] = &b;
    s.ld[static_cast<std::size_t>(b.id)] = b.cols;
  }
  auto bytes_of = [](const float* f) { return reinterpret_cast<std::byte*>(const_cast<float*>(f)); };
  // Rank r's rows of a caller's tensor of the hosted ranks' tokens, with its row stride.
  const std::int64_t i = index_of_[static_cast<std::size_t>(r)];
  auto rows_of = [&](BufferId id, const float* first_row, std::int64_t ld) {
    s.ld[static_cast<std::size_t>(id)] = ld;
    return bytes_of(first_row + i * T_ * ld);
  };
  for (const auto& b : p.buffers) {
    std::byte*& at = s.base[static_cast<std::size_t>(b.id)];
    switch (b.region) {
      case taskflow::Region::symmetric: at = s.segment + b.offset_bytes; break;
      case taskflow::Region::local: at = s.local.data.get() + b.offset_bytes; break;
      case taskflow::Region::bound:
        switch (b.id) {
          case BufferId::xf: case BufferId::x: at = rows_of(b.id, x_.data, x_.ld); break;
          case BufferId::dout: at = rows_of(b.id, d_out_.data, d_out_.ld); break;
          case BufferId::out:
            at = res.out_into ? rows_of(b.id, res.out_into.data, res.out_into.ld) : rows_of(b.id, res.out.data.data(), c_.hidden);
            break;
          case BufferId::dx:
            at = res.dx_into ? rows_of(b.id, res.dx_into.data, res.dx_into.ld)
                             : rows_of(b.id, res.grads.x.data.data(), c_.hidden);
            break;
          case BufferId::logits: at = rows_of(b.id, logits_.data(), c_.routed_experts); break;
          case BufferId::dw1: case BufferId::dw2: {
            // The owner's instance writes the expert's gradient; a replica
            // its own partial, added to the owner's after the launch; a
            // split expert's part its columns, placed after the launch.
            // An expert the caller takes in its own layout, computed whole
            // here, is stored there transposed by its tiles.
            const bool w1 = b.id == BufferId::dw1;
            auto& slots = w1 ? s.dw1_slots : s.dw2_slots;
            auto& transposed = w1 ? s.dw1_transposed : s.dw2_transposed;
            slots.clear();
            transposed.clear();
            for (const std::int32_t e : p.local_experts) {
              if (gradient_stored_transposed(res, e)) {
                const ExpertGradientsInto& into = res.expert_grads_into[static_cast<std::size_t>(e)];
                if (into.in_bf16()) {
                  const MutableBf16View& v = w1 ? into.w1_t_bf16 : into.w2_t_bf16;
                  slots.push_back(reinterpret_cast<std::byte*>(v.data));
                  transposed.push_back({v.ld, true});
                } else {
                  const MutableMatrixView& v = w1 ? into.w1_t : into.w2_t;
                  slots.push_back(bytes_of(v.data));
                  transposed.push_back({v.ld, false});
                }
                continue;
              }
              slots.push_back(layer_placement_.owner(e) == r && !layer_placement_.is_split(e)
                                  ? bytes_of((w1 ? res.grads.w1 : res.grads.w2)[e].data.data())
                                  : bytes_of(reducer_.partial(r, e, w1).data()));
              transposed.push_back({});
            }
            break;
          }
          default:
            throw Error(std::string("the runtime cannot bind buffer ") + taskflow::name(b.id) + " to caller memory");
        }
        break;
    }
  }
}

template <class T>
void Interleaved<T>::prepare_forward(StepResult& res) {
  const std::int64_t K = c_.top_k, T_ = c_.tokens_per_rank, H = c_.hidden;
  reserve_memory(res);
  for (const int r : local_) {
    const taskflow::Program& p = plan.forward[r];
    const std::int64_t i = index_of_[static_cast<std::size_t>(r)];
    bind(p, r, res);
    auto* slot = base<std::int64_t>(r, BufferId::slot);
    auto* gate = base<float>(r, BufferId::gate);
    auto* send_token = base<std::int32_t>(r, BufferId::send_token);
    auto* send_assign = base<std::int64_t>(r, BufferId::send_assign);
    for (std::int64_t a = 0; a < T_ * K; ++a) {
      const std::int64_t global = i * T_ * K + a, row = plan.slots[static_cast<std::size_t>(global)];
      slot[a] = row;
      gate[a] = res.routing.weight[static_cast<std::size_t>(global)];
      if (row >= 0) {
        send_token[row] = static_cast<std::int32_t>(a / K);
        send_assign[row] = a;
        // A split expert's rows go to every part: the same token in each
        // part's block of the source's send order. The exchange numbers the
        // step's instances (lent homes included, which shift the numbers of
        // the experts after them), so its placement names the first part.
        const std::int32_t e = res.routing.expert[static_cast<std::size_t>(global)];
        if (layer_placement_.is_split(e)) {
          const std::int64_t n = plan.ex().count(r, plan.placement().first_instance(e));
          for (std::int64_t part = 1; part < layer_placement_.parts(e); ++part) {
            send_token[row + part * n] = static_cast<std::int32_t>(a / K);
            send_assign[row + part * n] = a;
          }
        }
      }
    }
    if (c_.exchange == ExchangeMode::rank)  // the per-rank exchange's tables
      fill_rank_tables(plan, c_, r, i, res.routing,
                       {base<std::int32_t>(r, BufferId::rank_token), base<std::int32_t>(r, BufferId::rank_route),
                        base<std::int32_t>(r, BufferId::rank_comb), base<std::int64_t>(r, BufferId::rank_slot),
                        c_.forwards() ? base<std::int32_t>(r, BufferId::node_token) : nullptr,
                        c_.forwards() ? base<std::int32_t>(r, BufferId::node_index) : nullptr});
    if constexpr (!std::is_same_v<T, float>)
      for (std::int64_t t = 0; t < T_; ++t) kernels::store<T>(x_.row(i * T_ + t), base<T>(r, BufferId::x) + t * H, H);
  }
}

template <class T>
void Interleaved<T>::prepare_backward(StepResult& res) {
  const std::int64_t T_ = c_.tokens_per_rank, H = c_.hidden;
  for (const int r : local_) {
    const std::int64_t i = index_of_[static_cast<std::size_t>(r)];
    bind(plan.backward[r], r, res);
    if (c_.shared_experts > 0)
      for (std::int64_t t = 0; t < T_; ++t)
        kernels::store<T>(d_out_.row(i * T_ + t), base<T>(r, BufferId::sh_dout) + t * H, H);
  }
}

template <class T>
taskflow::Operands Interleaved<T>::operands_of(const taskflow::Program& p, const Task& t) const {
  const taskflow::Operands o = table_->operands(p, t);
  for (const auto& op : o) {
    const taskflow::BufferLayout* l = op.rank == p.rank
                                          ? ranks_[static_cast<std::size_t>(p.rank)].layout[static_cast<std::size_t>(op.rect.buffer)]
                                          : peer_layout(op.rank, op.rect.buffer);
    const auto& r = op.rect;
    if (!l || r.r0 < 0 || r.c0 < 0 || r.r1 < r.r0 || r.c1 < r.c0 || r.r1 > l->rows || r.c1 > l->cols)
      throw Error("bounds: rank " + std::to_string(p.rank) + " task " + taskflow::name(t.kind) + " rows [" +
                  std::to_string(t.row_begin) + ", " + std::to_string(t.row_begin + t.rows) + ") " +
                  (op.use == taskflow::Use::read ? "reads " : "writes ") + taskflow::name(r.buffer) + " rows [" +
                  std::to_string(r.r0) + ", " + std::to_string(r.r1) + ") cols [" + std::to_string(r.c0) + ", " +
                  std::to_string(r.c1) + ") outside the declared " +
                  (l ? std::to_string(l->rows) + " x " + std::to_string(l->cols) : std::string("(undeclared)")) + " buffer");
  }
  return o;
}

// Instantiations of the members above.
template void Interleaved<float>::reserve_memory(StepResult& res);
template void Interleaved<bf16>::reserve_memory(StepResult& res);
template void Interleaved<float>::bind(const taskflow::Program& p, int r, StepResult& res);
template void Interleaved<bf16>::bind(const taskflow::Program& p, int r, StepResult& res);
template void Interleaved<float>::prepare_forward(StepResult& res);
template void Interleaved<bf16>::prepare_forward(StepResult& res);
template void Interleaved<float>::prepare_backward(StepResult& res);
template void Interleaved<bf16>::prepare_backward(StepResult& res);
template taskflow::Operands Interleaved<float>::operands_of(const taskflow::Program& p, const Task& t) const;
template taskflow::Operands Interleaved<bf16>::operands_of(const taskflow::Program& p, const Task& t) const;

}  // namespace hpmoe::detail
