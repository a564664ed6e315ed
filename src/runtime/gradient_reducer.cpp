#include "runtime/gradient_reducer.hpp"

#include <algorithm>

namespace hpmoe::detail {

std::vector<float>& GradientReducer::partial(int r, std::int32_t e, bool w1) {
  auto& part = (w1 ? w1_ : w2_)[{r, e}];
  part.resize(static_cast<std::size_t>(w1 ? H_ * 2 * I_ : I_ * H_));
  return part;
}

void GradientReducer::reduce(StepResult& res, const ExpertPlacement& step_placement, const Launch& launch) {
  replicated_weights(res, launch);
  replicas(res, step_placement, launch);
  split_parts(res, launch);
}

// The router's and shared experts' gradients: each rank's part is its
// backward program's local buffer; over MPI the ranks pass the partial sum
// along in rank order.
void GradientReducer::replicated_weights(StepResult& res, const Launch& launch) {
  auto reduce = [&](std::vector<float>& dst, taskflow::BufferId part) {
    const auto n = dst.size();
    if (launch.sharded) {
      std::copy_n(launch.buffer(launch.hosted.front(), part), n, dst.begin());
      launch.transport.sum_in_rank_order(std::span<float>(dst));
      return;
    }
    // Each rank's buffer looked up once (a std::function call per element
    // and rank was most of this sum), then summed in rank order from +0.
    std::vector<const float*> parts(static_cast<std::size_t>(ranks_));
    for (std::int64_t q = 0; q < ranks_; ++q) parts[static_cast<std::size_t>(q)] = launch.buffer(static_cast<int>(q), part);
    std::fill(dst.begin(), dst.end(), 0.0f);
    for (const float* p : parts)
      for (std::size_t i = 0; i < n; ++i) dst[i] += p[i];
  };
  reduce(res.grads.router.data, taskflow::BufferId::dwg);
  if (shared_) {
    reduce(res.grads.shared_w1.data, taskflow::BufferId::dws1);
    reduce(res.grads.shared_w2.data, taskflow::BufferId::dws2);
  }
}

// Replicated experts (and lent homes, which computed partials like
// replicas'): each home computed the gradient of the rows it received; the
// expert's gradient is their sum in home order (ranks ascending), from +0,
// on its owner. Over MPI the same sum runs through every rank in rank order
// (ranks without the expert add zeros, which leaves every partial sum bit
// for bit as it is).
void GradientReducer::replicas(StepResult& res, const ExpertPlacement& placement, const Launch& launch) {
  for (std::int64_t e = 0; e < E_; ++e) {
    if (placement.home_count(e) < 2 || placement.is_split(e)) continue;
    for (const bool w1 : {true, false}) {
      const auto n = static_cast<std::size_t>(H_ * I_ * (w1 ? 2 : 1));
      const int owner = placement.owner(e);
      const auto contribution = [&](int r) -> const float* {
        if (placement.instance_on(e, r) < 0) return nullptr;
        if (r == owner) return (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.data();
        return partial(r, static_cast<std::int32_t>(e), w1).data();
      };
      if (launch.sharded) {
        const int me = launch.hosted.front();
        scratch_.assign(n, 0.0f);
        if (const float* mine = contribution(me)) std::copy_n(mine, n, scratch_.begin());
        launch.transport.sum_in_rank_order(std::span<float>(scratch_));
        if (me == owner) std::copy_n(scratch_.begin(), n, (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.begin());
        continue;
      }
      float* dst = (w1 ? res.grads.w1 : res.grads.w2)[static_cast<std::size_t>(e)].data.data();
      std::vector<const float*> homes;  // in home order, looked up once
      for (std::int64_t j = 0; j < placement.home_count(e); ++j)
        homes.push_back(contribution(placement.instance_rank(placement.first_instance(e) + j)));
      // The owner's own contribution may be dst itself: each element is read
      // by every home before it is written.
      for (std::size_t i = 0; i < n; ++i) {
        float sum = 0;
        for (const float* h : homes) sum += h[i];
        dst[i] = sum;
      }
    }
  }
}

// Split experts: each part computed the gradient of its own columns (W1's
// gate and up columns side by side, W2's rows), complete. The expert's
// gradient, on its owner (part 0's rank), is the sum in rank order from +0
// of every rank's columns, zeros elsewhere: over MPI through every rank, in
// process the same sum, so the bits agree (each element has one non-zero
// term; +0 + v is v, but +0 for v = -0).
void GradientReducer::split_parts(StepResult& res, const Launch& launch) {
  const std::int64_t H = H_, I = I_;
  // Rank r's part of expert e written into a whole [H, 2I] and [I, H] pair.
  const auto scatter = [&](int r, std::int64_t e, float* dw1, float* dw2) {
    const std::int64_t i = placement_.instance_on(e, r);
    if (i < 0) return;
    const auto [c0, c1] = placement_.part_columns(i, I);
    const std::int64_t Ip = c1 - c0;
    const float* p1 = partial(r, static_cast<std::int32_t>(e), true).data();
    const float* p2 = partial(r, static_cast<std::int32_t>(e), false).data();
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t k = 0; k < Ip; ++k) {
        dw1[h * 2 * I + c0 + k] = 0.0f + p1[h * 2 * I + k];
        dw1[h * 2 * I + I + c0 + k] = 0.0f + p1[h * 2 * I + Ip + k];
      }
    for (std::int64_t k = 0; k < Ip * H; ++k) dw2[c0 * H + k] = 0.0f + p2[k];
  };
  for (const auto& sp : placement_.splits()) {
    const auto e = static_cast<std::size_t>(sp.expert);
    if (!launch.sharded) {
      for (std::int64_t j = 0; j < placement_.home_count(sp.expert); ++j)
        scatter(placement_.instance_rank(placement_.first_instance(sp.expert) + j), sp.expert, res.grads.w1[e].data.data(),
                res.grads.w2[e].data.data());
      continue;
    }
    const auto n1 = static_cast<std::size_t>(H * 2 * I), n2 = static_cast<std::size_t>(I * H);
    scratch_.assign(n1 + n2, 0.0f);
    const int me = launch.hosted.front();
    scatter(me, sp.expert, scratch_.data(), scratch_.data() + n1);
    launch.transport.sum_in_rank_order(std::span<float>(scratch_));
    if (me == placement_.owner(sp.expert)) {
      std::copy_n(scratch_.begin(), n1, res.grads.w1[e].data.begin());
      std::copy_n(scratch_.begin() + static_cast<std::ptrdiff_t>(n1), n2, res.grads.w2[e].data.begin());
    }
  }
}

}  // namespace hpmoe::detail
