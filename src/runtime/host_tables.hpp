#pragma once
// The host tables a scheme's tasks read, filled from the step's plan and
// routing before the launch: for the per-rank exchange (and its per-node
// part), each source's token list, routes (receive position and gate per
// send row), combine lists (ops/combine_list.hpp's rows) and each token's
// list rows; the per-node exchange's node lists and node routes. The
// per-assignment exchange's send rows are the layer's own (engine_memory.cpp).
#include <cstdint>

#include "hpmoe/config.hpp"
#include "hpmoe/routing.hpp"
#include "runtime/step_plan.hpp"

namespace hpmoe::detail {

// Where hosted rank r's tables go (its bound buffers of those ids).
struct RankTableTargets {
  std::int32_t* token_list;   // RANK_TOKEN
  std::int32_t* routes;       // RANK_ROUTE: [send rows, 2]
  std::int32_t* combine;      // RANK_COMB: [list rows, CombineList::words(K)]
  std::int64_t* list_slots;   // RANK_SLOT
  std::int32_t* node_tokens;  // NODE_TOKEN (the per-node exchange; null without)
  std::int32_t* node_index;   // NODE_INDEX (the per-node exchange; null without)
};

// Rank r's tables; `hosted` is r's place among this process's ranks (its
// assignments' place in `routing`).
void fill_rank_tables(const StepPlan& plan, const LayerConfig& c, int r, std::int64_t hosted,
                      const RouterOutput<float>& routing, const RankTableTargets& to);

}  // namespace hpmoe::detail
