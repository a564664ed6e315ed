#pragma once
// The gradients a backward launch leaves in pieces, made whole after it:
// the replicated weights' (router, shared experts) summed over ranks, the
// partials of an expert's replicas and lent homes onto its owner, and a
// split expert's parts placed in its whole matrices. Every sum runs in rank
// order from +0, in process as over MPI (Transport::sum_in_rank_order), so
// the bits agree. The engine binds each replica's and part's dW buffers to
// the partials kept here.
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "hpmoe/config.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/step.hpp"
#include "hpmoe/transport.hpp"
#include "ir/ir.hpp"

namespace hpmoe::detail {

class GradientReducer {
 public:
  // layer_placement: the layer's (what is split, whose parts); it must
  // outlive the reducer (the engine owns both).
  GradientReducer(const LayerConfig& c, const ExpertPlacement& layer_placement)
      : H_(c.hidden), I_(c.expert_inter), E_(c.routed_experts), ranks_(c.ranks), shared_(c.shared_experts > 0),
        placement_(layer_placement) {}

  // A replica's (or lent home's, or split part's) partial gradient of
  // expert e on rank r: W1 or W2 shaped, the buffer its dW tiles write.
  std::vector<float>& partial(int r, std::int32_t e, bool w1);

  // What a reduction reads of the launch: the ranks this process hosts
  // (one, when sharded), the transport that sums across processes, and
  // rank q's buffer `id` of the backward program (DWG, DWS1, DWS2).
  struct Launch {
    Transport& transport;
    std::span<const int> hosted;
    bool sharded;
    std::function<const float*(int rank, taskflow::BufferId id)> buffer;
  };
  // The step's gradients made whole in res.grads; step_placement: the
  // step's (with the homes it lent).
  void reduce(StepResult& res, const ExpertPlacement& step_placement, const Launch& launch);

 private:
  void replicated_weights(StepResult& res, const Launch& launch);
  void replicas(StepResult& res, const ExpertPlacement& step_placement, const Launch& launch);
  void split_parts(StepResult& res, const Launch& launch);

  std::int64_t H_, I_, E_, ranks_;
  bool shared_;
  const ExpertPlacement& placement_;
  std::map<std::pair<int, std::int32_t>, std::vector<float>> w1_, w2_;  // (rank, expert): a partial
  std::vector<float> scratch_;
};

}  // namespace hpmoe::detail
