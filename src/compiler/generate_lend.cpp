// Weights instead of tokens (LayerConfig::lend_weights), and replicas that
// fetch their weights (ExpertPlacement::Rules::fetch_replicas): the tasks
// that lend an expert's weights to a rank for one step. The owner puts the pass's
// packed weights into the lent rank's LENT_W block in pieces (weight_put),
// each signalling the block's event there; on the lent rank a relay per row
// tile of the lent slot waits for the whole block and counts as one more
// arrival of the tile, so the slot's first GEMM of every tile (gate/up
// forward, the down projection's data gradient backward) waits for its
// rows and its weights alike. A pure function of the exchange: the sender
// and the receiver derive the same pieces, rows and event ids.
#include <algorithm>

#include "compiler/generate_parts.hpp"

namespace hpmoe::taskflow {

namespace {
// A weight put carries at most this many bytes: a large expert's weights
// travel in pieces that several put workers (and, over MPI, messages of a
// sensible size) share.
constexpr std::int64_t kLendPieceBytes = 4 << 20;

Dims lend_dims(const LayerConfig& c) {
  Dims d;
  d.hidden = c.hidden;
  d.inter = c.expert_inter;
  d.elem_bytes = c.dtype == DType::bf16 ? 2 : 4;
  return d;
}
}  // namespace

std::vector<std::pair<std::int64_t, std::int64_t>> lent_pieces(const LayerConfig& c, Pass pass) {
  const Dims d = lend_dims(c);
  const std::int64_t split = lent_second_region(d, pass), end = lent_block_bytes(d, pass);
  std::vector<std::pair<std::int64_t, std::int64_t>> pieces;
  for (const auto& [begin, stop] : {std::pair{std::int64_t{0}, split}, std::pair{split, end}})
    for (std::int64_t a = begin; a < stop; a += kLendPieceBytes) pieces.emplace_back(a, std::min(stop, a + kLendPieceBytes));
  return pieces;
}

std::int64_t lent_block_width(const LayerConfig& c) {
  const Dims d = lend_dims(c);
  return std::max(lent_block_bytes(d, Pass::forward), lent_block_bytes(d, Pass::backward));
}

std::int64_t lent_row(const Exchange& ex, Pass pass, std::int64_t instance) {
  const ExpertPlacement& p = ex.placement();
  const std::int64_t block = p.lent_block(instance);
  return block < 0 ? -1 : block + (pass == Pass::backward ? p.lent_count(p.instance_rank(instance)) : 0);
}

bool lends_weights(const Exchange& ex, std::int64_t instance) {
  return ex.placement().borrows(instance) && ex.expert_rows(instance) > 0;
}

void lent_weight_puts(const LayerConfig& c, const Exchange& ex, Pass pass, std::int64_t from, std::int64_t only_to,
                      const Emit& emit) {
  const ExpertPlacement& p = ex.placement();
  if (!p.has_borrowed()) return;
  const auto pieces = lent_pieces(c, pass);
  const TaskKind kind = pass == Pass::forward ? TaskKind::weight_put : TaskKind::grad_weight_put;
  for (std::int64_t i = 0; i < p.instances(); ++i) {
    const std::int64_t e = p.instance_expert(i), d = p.instance_rank(i);
    if (!lends_weights(ex, i) || p.owner(e) != from || (only_to >= 0 && d != only_to)) continue;
    const std::int64_t event = event_bases(c, ex, pass, d).lent + p.lent_block(i);
    for (const auto& [a, b] : pieces)
      emit(TaskSpec{.kind = kind, .dst = BufferId::lent_w, .expert = e, .peer = d, .row_begin = lent_row(ex, pass, i),
                    .rows = 1, .col_begin = a, .cols = b - a, .trigger_event = event});
  }
}

void lent_events(const LayerConfig& c, const Exchange& ex, Pass pass, std::int64_t rank, const EventBases& ev,
                 const std::function<void(std::int64_t id, std::int64_t required, std::int64_t expert, TaskKind consumer)>& event,
                 const std::function<void(std::int64_t id)>& one_more) {
  const ExpertPlacement& p = ex.placement();
  if (!p.has_borrowed()) return;
  const auto pieces = static_cast<std::int64_t>(lent_pieces(c, pass).size());
  for (const std::int64_t i : p.instances_of(rank)) {
    if (!p.borrows(i)) continue;
    // A borrowed slot without rows this step (a fetched replica the quota
    // plan gave nothing) takes no weights; its event is complete at zero
    // and nothing waits for it.
    const bool lends = lends_weights(ex, i);
    event(ev.lent + p.lent_block(i), lends ? pieces : 0, p.instance_expert(i),
          pass == Pass::forward ? TaskKind::weight_relay : TaskKind::grad_weight_relay);
    if (!lends) continue;
    const std::int64_t first = pass == Pass::forward ? ev.recv : ev.dy;
    for (std::int64_t t = 0; t < ex.tiles_of(i); ++t) one_more(first + ex.tile_start(i) + t);
  }
}

void lent_relays(const LayerConfig& c, const Exchange& ex, Pass pass, std::int64_t instance, const EventBases& ev,
                 const Emit& emit) {
  if (!lends_weights(ex, instance)) return;
  const auto pieces = static_cast<std::int64_t>(lent_pieces(c, pass).size());
  const std::int64_t first = pass == Pass::forward ? ev.recv : ev.dy;
  for (std::int64_t t = 0; t < ex.tiles_of(instance); ++t)
    emit(TaskSpec{.kind = pass == Pass::forward ? TaskKind::weight_relay : TaskKind::grad_weight_relay,
                  .wait_event = ev.lent + ex.placement().lent_block(instance), .wait_count = pieces,
                  .trigger_event = first + ex.tile_start(instance) + t});
}

}  // namespace hpmoe::taskflow
