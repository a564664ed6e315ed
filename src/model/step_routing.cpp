#include <string>

#include "common/memory.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/routing.hpp"
#include "hpmoe/tensors.hpp"

namespace hpmoe {

RouterOutput<float> route_step(const LayerConfig& c, const RoutingSpec& spec, std::uint64_t seed) {
  // The step's logits, scores and routes live on this host whatever the
  // machine modelled: refused before they are taken (millions of tokens per
  // rank ran out of this host's memory after a long wait).
  const double host = double(c.total_tokens()) * (double(c.routed_experts) * 4.0 * 3.0 + double(c.top_k) * 16.0);
  require_memory(host, "routing the step", std::to_string(c.total_tokens()) + " tokens x " +
                                               std::to_string(c.routed_experts) + " experts of logits and scores",
                 "use fewer tokens per rank (-T) or ranks");
  const auto forced = forced_selection(c, spec);
  std::vector<float> logits(static_cast<std::size_t>(c.total_tokens() * c.routed_experts), 0.0f);
  const LayerWeights w = random_router(c, seed);
  if (spec.source == RoutingSource::router) {
    const double bytes = double(c.total_tokens()) * double(c.hidden) * 4.0;
    if (bytes > 4e9)
      throw Error("router routing needs the layer's inputs (" + std::to_string(static_cast<long long>(bytes / 1e9)) +
                  " GB here); compile with --routing uniform, zipf, hot or trace at this size");
    const LayerInputs in = random_inputs(c, seed);
    for (std::int64_t t = 0; t < c.total_tokens(); ++t) {
      float* row = logits.data() + t * c.routed_experts;
      for (std::int64_t i = 0; i < c.hidden; ++i) {
        const float xv = in.x.at(t, i);
        const float* wr = w.router.row(i);
        for (std::int64_t e = 0; e < c.routed_experts; ++e) row[e] += xv * wr[e];
      }
    }
  }
  return route<float>(c, logits, w.expert_bias, forced);
}

}  // namespace hpmoe
