#pragma once
// Internal to the generator: a task as it writes one, and the emitters of
// each exchange scheme (per assignment: generate_assignment.cpp; per rank
// and per node: generate_rank.cpp; lent weights: generate_lend.cpp), which
// the step's generator (generate_step.cpp) calls for a rank's program and
// generate.cpp for the interface between two ranks' programs.
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "hpmoe/config.hpp"
#include "compiler/layout.hpp"

namespace hpmoe::taskflow {

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// A task as the generator writes it: named fields, 64-bit arithmetic, and
// defaults for what most tasks do not use.
struct TaskSpec {
  TaskKind kind = TaskKind::count;
  BufferId src = BufferId::none, dst = BufferId::none;
  std::int64_t expert = -1;
  std::int64_t peer = -1;  // -1: the generating rank
  std::int64_t row_begin = 0, rows = 0, col_begin = 0, cols = 0, src_row = 0;
  std::int64_t wait_event = -1, wait_count = 0, trigger_event = -1;
};
using Emit = std::function<void(const TaskSpec&)>;

// A rank's buffers as declare_buffers writes them (generate_buffers.cpp),
// in order: each buffer after the last one of its region, so that every
// rank derives the same offsets in the symmetric region. The schemes add
// their own (SchemeSteps).
struct BufferDecl {
  Program& p;
  const LayerConfig& c;
  const Exchange& ex;
  Pass pass;
  std::int64_t rank;
  std::int64_t H, K, T, elem, comb_elem, recv, send;
  void add(BufferId id, std::int64_t rows, std::int64_t cols, std::int64_t elem_bytes, Region region,
           Layout layout = Layout::row_major) const;
};
// The count an event of the generating rank completes at.
using RequiredOf = std::function<std::int64_t(std::int64_t)>;

// Puts of `rank`'s tokens (forward) or output gradients (backward) under
// the per-rank exchange: its token blocks to the ranks of its node, its
// node blocks to the forwarders of other nodes, the routes and combine
// lists to every destination (only those into `only_peer` when >= 0).
void rank_puts_to_experts(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t rank,
                          std::int64_t only_peer, const Emit&);
// The forwards `rank` makes as a forwarder (only into `only_peer` when >=
// 0); with_waits: each waits for its source's node event.
void node_forwards(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t rank, std::int64_t only_peer,
                   bool with_waits, const RequiredOf&, const Emit&);
// The forwarder's events of its sources' node blocks (with `event(id, required)`).
void node_events(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t rank,
                 const std::function<void(std::int64_t, std::int64_t)>& event);
// The per-rank exchange on the destination: one gather per source piece of
// row tile `tile` of instance `home`.
void rank_gathers_of_tile(const LayerConfig&, const Exchange&, const Program&, Pass, std::int64_t rank, std::int64_t home,
                          std::int64_t tile, const EventBases&, const Emit&);
// The per-node combine: the pieces that return to `rank` (its own node's
// ranks' sums and its forwarders'), the pieces a forwarder `f` waits for
// from its node's ranks for source s's slot j, its events (node_comb +
// s S + c: slots 0..c in), and its puts of each source's node sums by
// combine slot, with the relays that chain the slots (only the puts to
// `only_peer` when >= 0; with_waits: each waits for its slot's event).
std::int64_t sum_pieces_into(const Exchange&, std::int64_t tile_rows, std::int64_t rank);
std::int64_t node_sum_pieces(const Exchange&, std::int64_t tile_rows, std::int64_t s, std::int64_t f, std::int64_t j);
void node_sum_events(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t rank, const EventBases&,
                     const std::function<void(std::int64_t, std::int64_t)>& event);
void node_combines(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t rank, std::int64_t only_peer,
                   bool with_waits, const RequiredOf&, const Emit&);
// Which of the per-rank combine's return puts to make.
enum class ReturnPuts { all, gate_grads, sums };
// The per-rank combine's return puts from `rank` (only those into
// `only_peer` when >= 0: a source, or the forwarder of a source of another
// node); with_waits: each waits for the event its rows need.
void rank_puts_to_sources(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t rank,
                          std::int64_t only_peer, bool with_waits, const RequiredOf&, const Emit&, ReturnPuts);

// The per-assignment exchange (generate_assignment.cpp): `rank`'s rows to
// every expert's home (only `only_peer`'s when >= 0), split at the home's
// row tiles, in the order the destinations compute them; and the rows of
// `rank`'s experts back to each source (only `only_source` when >= 0),
// each piece waiting for the tile it reads (wait_base: the first of those
// events, -1: no waits; wait_count: their count).
void assignment_puts_to_experts(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t rank,
                                std::int64_t only_peer, const Emit&);
void assignment_puts_to_sources(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t rank,
                                std::int64_t only_source, std::int64_t wait_base, std::int64_t wait_count, const Emit&);

// Weights instead of tokens (generate_lend.cpp). The byte ranges of a lent
// block's pieces in a pass; the width of LENT_W (the larger pass's block);
// a lent instance's row in its rank's LENT_W in a pass (-1: not lent);
// whether it takes weights this step (lent, with rows).
std::vector<std::pair<std::int64_t, std::int64_t>> lent_pieces(const LayerConfig&, Pass);
// The order in which `rank` computes the row tiles of its home `home`: the
// order their rows arrive (each tile keyed by its latest source in the
// rotated put order; ties in row order).
std::vector<std::int64_t> arrival_tile_order(const LayerConfig&, const Exchange&, std::int64_t home, std::int64_t rank);
// Each tile's key in that order: its latest source's place in `rank`'s
// arrival order ((rank - source) mod P), into `key`.
void arrival_keys(const LayerConfig&, const Exchange&, std::int64_t home, std::int64_t rank, std::vector<std::int64_t>& key);
std::int64_t lent_block_width(const LayerConfig&);
std::int64_t lent_row(const Exchange&, Pass, std::int64_t instance);
bool lends_weights(const Exchange&, std::int64_t instance);
// The weight puts `from` makes as the owner of lent experts (only into
// `only_to` when >= 0).
void lent_weight_puts(const LayerConfig&, const Exchange&, Pass, std::int64_t from, std::int64_t only_to, const Emit&);
// On `rank`: each lent block's event (`event(id, required, expert, consumer)`), and
// one more arrival (`one_more(id)`) for each row tile event of a lent slot.
void lent_events(const LayerConfig&, const Exchange&, Pass, std::int64_t rank, const EventBases&,
                 const std::function<void(std::int64_t, std::int64_t, std::int64_t, TaskKind)>& event,
                 const std::function<void(std::int64_t)>& one_more);
// The relays of a lent instance's row tiles, before its GEMMs.
void lent_relays(const LayerConfig&, const Exchange&, Pass, std::int64_t instance, const EventBases&, const Emit&);

}  // namespace hpmoe::taskflow
