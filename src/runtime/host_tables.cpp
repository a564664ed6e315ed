#include "runtime/host_tables.hpp"

#include <algorithm>
#include <cstring>

#include "ops/combine_list.hpp"

namespace hpmoe::detail {

void fill_rank_tables(const StepPlan& plan, const LayerConfig& c, int r, std::int64_t hosted,
                      const RouterOutput<float>& routing, const RankTableTargets& to) {
  const std::int64_t K = c.top_k, T = c.tokens_per_rank;
  const auto gate_of = [&](std::int64_t assignment) {
    return routing.weight[static_cast<std::size_t>(hosted * T * K + assignment)];
  };
  const taskflow::RankRoutes& routes = plan.routes[static_cast<std::size_t>(hosted)];
  std::copy(routes.tokens.begin(), routes.tokens.end(), to.token_list);
  for (std::size_t row = 0; row < routes.position.size(); ++row) {
    to.routes[2 * row] = routes.position[row];
    const float g = gate_of(routes.row_assign[row]);
    std::memcpy(&to.routes[2 * row + 1], &g, sizeof g);
  }
  // The combine lists: per list row, the token's row in its block, the
  // receive row of each of its K choices on the list's destination, and
  // their gates; each token's list rows.
  const std::int64_t words = ops::CombineList::words(K);
  const taskflow::Exchange& ex = plan.ex();
  for (std::int64_t d = 0, row = 0; d < c.ranks; ++d)
    for (const std::int64_t block = ex.token_send_offset(r, d); row < ex.token_send_offset(r, d + 1); ++row) {
      const ops::CombineList::Writer w{to.combine + row * words, K};
      const std::int32_t at = routes.list_block[static_cast<std::size_t>(row)];
      const std::int64_t t = routes.tokens[static_cast<std::size_t>(block + at)];
      w.block_row(at);
      for (std::int64_t k = 0; k < K; ++k) w.choice(k, routes.comb_row[static_cast<std::size_t>(row * K + k)], gate_of(t * K + k));
    }
  std::copy(routes.list_slot.begin(), routes.list_slot.end(), to.list_slots);
  if (!c.forwards()) return;
  std::copy(routes.node_tokens.begin(), routes.node_tokens.end(), to.node_tokens);
  std::copy(routes.node_index.begin(), routes.node_index.end(), to.node_index);
}

}  // namespace hpmoe::detail
