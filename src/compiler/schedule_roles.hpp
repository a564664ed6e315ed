#pragma once
// Internal: what the scheduler's passes (schedule.cpp, schedule_ratr.cpp)
// ask of a kind: its role in the op table (ops/kind_role.hpp), never its
// name; and the RATR order.
#include <cstdint>
#include <vector>

#include "ops/access.hpp"
#include "compiler/taskflow.hpp"

namespace hpmoe::taskflow::schedule_roles {

inline TileStep step(TaskKind k) { return role(k).step; }
inline Place place(TaskKind k) { return role(k).place; }
// A routed expert's tile (its rows on the expert's rank), not the shared
// experts' or the router's.
inline bool routed(TaskKind k) { return expert_home(k) == ExpertHome::own_rank; }
inline bool is_wgrad(TaskKind k) { return step(k) == TileStep::weight_gradient && routed(k); }
// The backward's data-gradient chain of a routed expert's row tile.
inline bool is_expert_chain(TaskKind k) {
  const TileStep s = step(k);
  return routed(k) && s != TileStep::none && s != TileStep::weight_gradient;
}

}  // namespace hpmoe::taskflow::schedule_roles

namespace hpmoe::taskflow {
// The RATR policy's order of a program's tasks (schedule_ratr.cpp).
std::vector<std::int32_t> ratr_order(const Program& p);
}  // namespace hpmoe::taskflow
