// The engine's reductions after a backward launch: replicated weights'
// gradients summed over ranks in rank order, replicas' partials onto the
// owner, split experts' parts placed, and a source's sum of split parts.
#include "runtime/engine.hpp"

namespace hpmoe::detail {

template <class T>
std::vector<float>& Interleaved<T>::replica_partial(int r, std::int32_t e, bool w1) {
  auto& part = (w1 ? replica_w1_ : replica_w2_)[{r, e}];
  part.resize(static_cast<std::size_t>(w1 ? c_.hidden * 2 * c_.expert_inter : c_.expert_inter * c_.hidden));
  return part;
}

template <class T>
void Interleaved<T>::reduce_replica_gradients(StepResult& res) {
  // The step's placement: its lent homes computed partials like replicas'.
  const ExpertPlacement& placement = plan.placement();
  for (std::int64_t e = 0; e < c_.routed_experts; ++e) {
    if (placement.home_count(e) < 2 || placement.is_split(e)) continue;
    for (const bool w1 : {true, false}) {
      const auto n = static_cast<std::size_t>(c_.hidden * c_.expert_inter * (w1 ? 2 : 1));
      const int owner = placement.owner(e);
      const auto contribution = [&](int r) -> const float* {
        if (placement.instance_on(e, r) < 0) return nullptr;
        if (r == owner) return (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.data();
        return replica_partial(r, static_cast<std::int32_t>(e), w1).data();
      };
      if (sharded()) {
        const int me = local_.front();
        reduce_scratch_.assign(n, 0.0f);
        if (const float* mine = contribution(me)) std::copy_n(mine, n, reduce_scratch_.begin());
        tr_->sum_in_rank_order(std::span<float>(reduce_scratch_));
        if (me == owner) std::copy_n(reduce_scratch_.begin(), n, (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.begin());
        continue;
      }
      float* dst = (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.data();
      for (std::size_t i = 0; i < n; ++i) {
        float sum = 0;
        for (std::int64_t j = 0; j < placement.home_count(e); ++j)
          sum += contribution(placement.instance_rank(placement.first_instance(e) + j))[i];
        dst[i] = sum;
      }
    }
  }
}

template <class T>
void Interleaved<T>::assemble_split_gradients(StepResult& res) {
  const std::int64_t H = c_.hidden, I = c_.expert_inter;
  // Rank r's part of expert e written into a whole [H, 2I] and [I, H] pair.
  const auto scatter = [&](int r, std::int64_t e, float* dw1, float* dw2) {
    const std::int64_t i = layer_placement_.instance_on(e, r);
    if (i < 0) return;
    const auto [c0, c1] = layer_placement_.part_columns(i, I);
    const std::int64_t Ip = c1 - c0;
    const float* p1 = replica_partial(r, static_cast<std::int32_t>(e), true).data();
    const float* p2 = replica_partial(r, static_cast<std::int32_t>(e), false).data();
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t k = 0; k < Ip; ++k) {
        dw1[h * 2 * I + c0 + k] = 0.0f + p1[h * 2 * I + k];
        dw1[h * 2 * I + I + c0 + k] = 0.0f + p1[h * 2 * I + Ip + k];
      }
    for (std::int64_t k = 0; k < Ip * H; ++k) dw2[c0 * H + k] = 0.0f + p2[k];
  };
  for (const auto& sp : layer_placement_.splits()) {
    const auto e = static_cast<std::size_t>(sp.expert);
    if (!sharded()) {
      for (std::int64_t j = 0; j < layer_placement_.home_count(sp.expert); ++j)
        scatter(layer_placement_.instance_rank(layer_placement_.first_instance(sp.expert) + j), sp.expert, res.grads.w1[e].data.data(),
                res.grads.w2[e].data.data());
      continue;
    }
    const auto n1 = static_cast<std::size_t>(H * 2 * I), n2 = static_cast<std::size_t>(I * H);
    reduce_scratch_.assign(n1 + n2, 0.0f);
    const int me = local_.front();
    scatter(me, sp.expert, reduce_scratch_.data(), reduce_scratch_.data() + n1);
    tr_->sum_in_rank_order(std::span<float>(reduce_scratch_));
    if (me == layer_placement_.owner(sp.expert)) {
      std::copy_n(reduce_scratch_.begin(), n1, res.grads.w1[e].data.begin());
      std::copy_n(reduce_scratch_.begin() + static_cast<std::ptrdiff_t>(n1), n2, res.grads.w2[e].data.begin());
    }
  }
}

template <class T>
void Interleaved<T>::reduce_replicated(StepResult& res) {
  auto reduce = [&](std::vector<float>& dst, BufferId part) {
    const auto n = dst.size();
    if (sharded()) {
      std::copy_n(base<float>(local_.front(), part), n, dst.begin());
      tr_->sum_in_rank_order(std::span<float>(dst));
      return;
    }
    for (std::size_t i = 0; i < n; ++i) {
      float sum = 0;
      for (std::int64_t q = 0; q < c_.ranks; ++q) sum += base<float>(q, part)[i];
      dst[i] = sum;
    }
  };
  reduce(res.grads.router.data, BufferId::dwg);
  if (c_.shared_experts > 0) {
    reduce(res.grads.shared_w1.data, BufferId::dws1);
    reduce(res.grads.shared_w2.data, BufferId::dws2);
  }
}

// Instantiations of the members above.
template std::vector<float>& Interleaved<float>::replica_partial(int r, std::int32_t e, bool w1);
template std::vector<float>& Interleaved<bf16>::replica_partial(int r, std::int32_t e, bool w1);
template void Interleaved<float>::reduce_replica_gradients(StepResult& res);
template void Interleaved<bf16>::reduce_replica_gradients(StepResult& res);
template void Interleaved<float>::assemble_split_gradients(StepResult& res);
template void Interleaved<bf16>::assemble_split_gradients(StepResult& res);
template void Interleaved<float>::reduce_replicated(StepResult& res);
template void Interleaved<bf16>::reduce_replicated(StepResult& res);

}  // namespace hpmoe::detail
