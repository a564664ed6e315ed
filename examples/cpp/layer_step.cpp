// One MoE layer forward and backward through hpmoe's installed header.
#include <algorithm>
#include <cstdio>
#include <hpmoe/hpmoe.hpp>

int main() {
  hpmoe::LayerConfig spec = hpmoe::preset("tiny");  // or hpmoe::load_config_file("config.json", ...)
  spec.ranks = 2;                                    // expert-parallel ranks, in this process
  hpmoe::Layer layer(spec, hpmoe::random_weights(spec, 1), {.workers_per_rank = 1, .pin = false});
  // Placement from the library: an online policy fed every step's loads on a machine model's costs; a
  // revision (replicas added, moved, dropped) is the next step's placement.
  hpmoe::OnlinePlacement online(spec, hpmoe::ExpertPlacement::contiguous(spec.routed_experts, spec.ranks),
                                hpmoe::ExpertCostModel::from_machine("cpu-local", spec, /*training=*/true),
                                {.window = 1, .every = 1});
  int revisions = 0;
  for (int tokens : {64, 96}) {                      // any number of tokens per call
    hpmoe::Matrix x(tokens, spec.hidden), dy(tokens, spec.hidden);
    for (std::size_t i = 0; i < x.data.size(); ++i) x.data[i] = dy.data[i] = float(i % 7) / 7 - 0.5f;
    auto step = layer.forward(x);
    step.backward(hpmoe::view(dy));
    std::printf("%d tokens: out[0][0] = %.6f, d router[0][0] = %.6f, max expert load %lld\n", tokens, step.out().at(0, 0),
                step.gradients().router.at(0, 0), static_cast<long long>(*std::max_element(
                    step.result().expert_counts.begin(), step.result().expert_counts.end())));
    if (const auto revision = online.observe(step.result().expert_counts)) {
      layer.set_placement(revision->placement);
      ++revisions;
    }
  }
  std::printf("placement: %d online revisions, %lld expert homes now\n", revisions,
              static_cast<long long>(online.placement().instances()));
}
