#pragma once
// Internal: the exchange layout of one step, derived from the routing counts
// and the expert placement alone, and the event numbering of a rank's
// program. Every rank computes the same layout, so a source knows the
// receiver's row offsets and event ids without asking. Both executors and
// the compiler use this one layout. The per-assignment rows every scheme
// starts from, the lent homes and the event numbering are in layout.cpp;
// the per-rank and per-node token blocks, lists and routes in
// layout_rank.cpp.
#include <cstdint>
#include <span>
#include <vector>

#include "hpmoe/placement.hpp"
#include "compiler/taskflow.hpp"

namespace hpmoe::taskflow {

// Rows a source sends are ordered by expert id, then token, then k. Rows a
// rank receives are ordered by its experts' slots, then source rank, then
// the same. Each expert's region starts a new row tile.
//
// The layout is per instance (an expert's home, ExpertPlacement): a
// replicated expert's rows from a source are split among its instances by
// the quota plan (plan_quotas), in home order within the source's block of
// that expert. Without replicas instance e is expert e. Every method below
// that names an instance takes an instance id.
//
// Weights instead of tokens (LayerConfig::lend_weights): the exchange lends
// an expert to every rank whose own rows of it reach the threshold
// (choose_lends, a pure function of the counts: every rank lends alike), and
// placement() is then the step's placement with those lent homes.
class Exchange {
 public:
  Exchange(const LayerConfig&, const ExpertPlacement&, const RoutingCounts&, std::int64_t tile_rows);

  const ExpertPlacement& placement() const { return placement_; }
  std::int64_t ranks() const { return ranks_; }
  std::int64_t experts() const { return experts_; }
  std::int64_t instances() const { return instances_; }
  std::int64_t tile_rows() const { return tile_rows_; }

  // Rows source s sends to expert e.
  std::int64_t count(std::int64_t s, std::int64_t e) const {
    return source_prefix_[static_cast<std::size_t>((s + 1) * instances_ + e)] -
           source_prefix_[static_cast<std::size_t>(s * instances_ + e)];
  }
  // Row of (s, e)'s first row within expert e's region on its owner.
  std::int64_t source_offset(std::int64_t s, std::int64_t e) const {
    return source_prefix_[static_cast<std::size_t>(s * instances_ + e)];
  }
  // Row of (s, e)'s first row in s's send order (and in its COMB rows).
  std::int64_t send_offset(std::int64_t s, std::int64_t e) const {
    return send_offset_[static_cast<std::size_t>(s * (instances_ + 1) + e)];
  }
  std::int64_t send_rows(std::int64_t s) const { return send_offset(s, instances_); }
  // Rows of expert e, from all sources.
  std::int64_t expert_rows(std::int64_t e) const { return source_offset(ranks_, e); }
  // Row of expert e's region in its owner's receive buffer.
  std::int64_t expert_start(std::int64_t e) const { return expert_start_[static_cast<std::size_t>(e)]; }
  // Row of (s, e)'s first row in e's owner's receive buffer.
  std::int64_t recv_offset(std::int64_t s, std::int64_t e) const { return expert_start(e) + source_offset(s, e); }
  // First row tile of expert e on its owner, and its number of row tiles.
  std::int64_t tile_start(std::int64_t e) const { return tile_start_[static_cast<std::size_t>(e)]; }
  std::int64_t tiles_of(std::int64_t e) const { return (expert_rows(e) + tile_rows_ - 1) / tile_rows_; }
  // First row of expert e in its owner's K-padded weight-gradient operands
  // (bf16 pads each expert's rows to an even count).
  std::int64_t kpad_start(std::int64_t e) const { return kpad_start_[static_cast<std::size_t>(e)]; }
  std::int64_t padded(std::int64_t rows) const { return pad_pairs_ ? (rows + 1) & ~std::int64_t{1} : rows; }
  // Per destination rank: received rows, row tiles, K-padded rows.
  std::int64_t recv_rows(std::int64_t d) const { return recv_rows_[static_cast<std::size_t>(d)]; }
  std::int64_t row_tiles(std::int64_t d) const { return row_tiles_[static_cast<std::size_t>(d)]; }
  std::int64_t kpad_rows(std::int64_t d) const { return kpad_rows_[static_cast<std::size_t>(d)]; }

  // Put pieces of (s, e): its rows split at the owner's row tiles.
  std::int64_t pieces(std::int64_t s, std::int64_t e) const;
  std::int64_t pieces_into(std::int64_t s) const;  // over all experts: what s receives in the combine
  // Put pieces landing in row tile `tile` of expert e: one per source chunk overlapping it.
  std::int32_t arrivals(std::int64_t e, std::int64_t tile) const;

  // The per-rank exchange (LayerConfig::exchange rank): source s sends each
  // of its tokens once to every rank that holds one of its rows, one block
  // per destination. A block is cut into sub-blocks by the token's first
  // instance on the destination (in slot order), each in token order, so
  // the rows of the instance in slot j read only sub-blocks 0..j. Which
  // tokens those are depends on the routing, not only its counts: every
  // rank's sources report theirs (rank_token_counts), [s * N + i] tokens of
  // s whose first instance on instance i's rank is i.
  // The same tokens cut by their last instance on the destination make the
  // combine's list (RankRoutes::list_block): their sums can go once the
  // instances up to it are done. `counts`: [s N + i] by first instance,
  // then [P N + s N + i] by last.
  void set_rank_tokens(std::vector<std::int64_t> counts, std::int64_t tokens_per_rank);
  bool has_rank_tokens() const { return !first_tokens_.empty(); }
  // Tokens of s in the sub-block of instance i.
  std::int64_t first_tokens(std::int64_t s, std::int64_t i) const { return first_tokens_[static_cast<std::size_t>(s * instances_ + i)]; }
  // Tokens s sends to d.
  std::int64_t rank_tokens(std::int64_t s, std::int64_t d) const { return rank_tokens_[static_cast<std::size_t>(s * ranks_ + d)]; }
  // Row of s's block in d's received token blocks (s = P: their total).
  std::int64_t token_start(std::int64_t s, std::int64_t d) const { return token_start_[static_cast<std::size_t>(s * ranks_ + d)]; }
  std::int64_t token_recv_rows(std::int64_t d) const { return token_start(ranks_, d); }
  // Row of d's block in s's token list (d = P: its length).
  std::int64_t token_send_offset(std::int64_t s, std::int64_t d) const {
    return token_send_[static_cast<std::size_t>(s * (ranks_ + 1) + d)];
  }
  // Row of the sub-block of (s, i) within s's block for i's rank.
  std::int64_t sub_block_offset(std::int64_t s, std::int64_t i) const { return sub_offset_[static_cast<std::size_t>(s * instances_ + i)]; }
  // Tokens of s whose last instance on i's rank is i, and the row of their
  // sub-list within s's combine list for that rank.
  std::int64_t last_tokens(std::int64_t s, std::int64_t i) const {
    return first_tokens_[static_cast<std::size_t>((ranks_ + s) * instances_ + i)];
  }
  std::int64_t sub_list_offset(std::int64_t s, std::int64_t i) const { return list_offset_[static_cast<std::size_t>(s * instances_ + i)]; }
  // Slot of instance i on its rank.
  std::int64_t instance_slot(std::int64_t i) const { return instance_slot_[static_cast<std::size_t>(i)]; }

  // The per-node exchange's direct tokens: a token of s that only one rank
  // d of another node takes goes to d straight (no forwarder, no node sum:
  // across nodes once, as through a forwarder, and no hop inside the
  // node), and its sum comes back straight. Each sub-block of s for such a
  // d is its relayed tokens (through the forwarder), then its direct ones,
  // each in token order; each combine sub-list likewise. Counts: after the
  // node counts, [2 P N + P B' + s N + i] the direct tokens of s among
  // those whose first instance on i's rank is i, then [.. + P N + s N + i]
  // by last (B' = 2 B S). 0 where s's tokens reach i's rank straight anyway,
  // and where i's rank takes no direct tokens (takes_direct).
  std::int64_t direct_first(std::int64_t s, std::int64_t i) const {
    return direct_.empty() ? 0 : direct_[static_cast<std::size_t>(s * instances_ + i)];
  }
  std::int64_t direct_last(std::int64_t s, std::int64_t i) const {
    return direct_.empty() ? 0 : direct_[static_cast<std::size_t>((ranks_ + s) * instances_ + i)];
  }
  // Whether rank d takes direct tokens (not where its node's other ranks
  // would spread them better: choose_direct_ranks).
  bool takes_direct(std::int64_t d) const { return !direct_to_.empty() && direct_to_[static_cast<std::size_t>(d)] != 0; }
  // The tokens of sub-block (s, i) that the forwarder puts (the rest come straight).
  std::int64_t relayed_first(std::int64_t s, std::int64_t i) const { return first_tokens(s, i) - direct_first(s, i); }
  std::int64_t relayed_last(std::int64_t s, std::int64_t i) const { return last_tokens(s, i) - direct_last(s, i); }
  // Row of s's direct sums from rank d (a rank of another node) on s, and
  // of (s, i)'s direct sub-list among them.
  std::int64_t direct_sum_start(std::int64_t s, std::int64_t d) const {
    return node_sum_start(s, nodes()) + (direct_sum_.empty() ? 0 : direct_sum_[static_cast<std::size_t>(s * (ranks_ + 1) + d)]);
  }
  std::int64_t direct_list_offset(std::int64_t s, std::int64_t i) const { return direct_list_[static_cast<std::size_t>(s * instances_ + i)]; }
  // How many values set_rank_tokens takes.
  std::int64_t token_count_values() const {
    return 2 * ranks_ * instances_ + (forwards_ ? ranks_ * 2 * nodes() * node_slots_ + 2 * ranks_ * instances_ : 0);
  }

  // The per-node exchange (LayerConfig::forwards): with ranks in nodes of
  // R, a token of source s crosses to node b != s's once, to the rank of b
  // with s's local index (its forwarder), in s's node block for b: the
  // tokens the ranks of b take through it (all but the direct tokens,
  // above), in token order. With it, s puts the node's
  // routes: for each row of its token list for each rank of b, that
  // token's row in the node block. The forwarder puts each rank's token
  // block from the node block, into the place and with the events that s's
  // own put would have had. Routes and combine lists still go from s.
  // A node block is cut into node sub-blocks by each token's node slot:
  // its lowest first-instance slot over the node's ranks that take it, so
  // that rank d's sub-block j needs node sub-blocks 0..j only (a token's
  // node slot is at most its slot on d). Counts: [2 P N + 2 s B S + b S + j]
  // the tokens of s in node b's sub-block j, S = node_slots(), then
  // [2 P N + 2 s B S + B S + b S + c] its tokens of node combine slot c.
  bool forwards() const { return forwards_; }
  std::int64_t node_slots() const { return node_slots_; }
  std::int64_t node_first(std::int64_t s, std::int64_t b, std::int64_t j) const {
    return node_first_[static_cast<std::size_t>((s * nodes() + b) * node_slots_ + j)];
  }
  // Row of node sub-block j within s's node block for b (j = S: the block's rows).
  std::int64_t node_sub_offset(std::int64_t s, std::int64_t b, std::int64_t j) const {
    return node_sub_[static_cast<std::size_t>((s * nodes() + b) * (node_slots_ + 1) + j)];
  }
  // The per-node combine, streamed: a token's node combine slot is its
  // highest last-instance slot over the node's ranks that take it, so its
  // sum on the forwarder can be made once the node's ranks have put their
  // sub-lists 0..c of s. The forwarder's sums of s come back in that order
  // (node sum rows by combine slot, each in token order):
  // node_last(s, b, c) tokens of combine slot c, from row
  // node_sum_offset(s, b, c) of s's node sums for b (c = S: all of them).
  std::int64_t node_last(std::int64_t s, std::int64_t b, std::int64_t c) const {
    return node_last_[static_cast<std::size_t>((s * nodes() + b) * node_slots_ + c)];
  }
  std::int64_t node_sum_offset(std::int64_t s, std::int64_t b, std::int64_t c) const {
    return node_sum_sub_[static_cast<std::size_t>((s * nodes() + b) * (node_slots_ + 1) + c)];
  }
  // NODE_COMB (and NODE_DCOMB) of s on its forwarder in b, slot-major: for
  // each slot j, each rank d of b in order, d's sub-list j of s (the tokens
  // whose last instance on d is in slot j), so that sub-lists 0..c of every
  // rank are one prefix. The row of (j, d)'s segment within s's rows there
  // (j = S: their count); d's rank is global.
  std::int64_t node_part_start(std::int64_t s, std::int64_t j, std::int64_t d) const;
  std::int64_t nodes() const { return ranks_ / node_ranks_; }
  std::int64_t node_of(std::int64_t r) const { return r / node_ranks_; }
  std::int64_t forwarder(std::int64_t s, std::int64_t b) const { return b * node_ranks_ + s % node_ranks_; }
  // Whether s's tokens reach d through d's node's forwarder.
  bool forwarded(std::int64_t s, std::int64_t d) const { return forwards_ && node_of(s) != node_of(d); }
  // Whether s's node blocks for f's node land on f.
  bool forwards_through(std::int64_t s, std::int64_t f) const {
    return forwards_ && node_of(s) != node_of(f) && s % node_ranks_ == f % node_ranks_;
  }
  std::int64_t node_tokens(std::int64_t s, std::int64_t b) const { return node_sub_offset(s, b, node_slots_); }
  // Row of s's block for node b in its node list (b = B: its length).
  std::int64_t node_send_offset(std::int64_t s, std::int64_t b) const { return node_send_[static_cast<std::size_t>(s * (nodes() + 1) + b)]; }
  // Row of s's node block (and of its routes) on its forwarder in node b.
  std::int64_t node_start(std::int64_t s, std::int64_t b) const { return node_start_[static_cast<std::size_t>(s * nodes() + b)]; }
  std::int64_t node_route_start(std::int64_t s, std::int64_t b) const { return route_start_[static_cast<std::size_t>(s * nodes() + b)]; }
  // The rows of s's routes for node b: its token list's rows for b's ranks.
  std::int64_t node_route_rows(std::int64_t s, std::int64_t b) const {
    return token_send_offset(s, (b + 1) * node_ranks_) - token_send_offset(s, b * node_ranks_);
  }
  // The rows the per-rank combine's sums come back to on source s
  // (COMB_RANK, DCOMB_RANK): those of each rank whose sums come straight,
  // in its list's order (with the per-node combine, only its own node's
  // ranks'), then those of each node block it sent, one per token (the
  // forwarders' sums), then the direct tokens' sums, by rank
  // (direct_sum_start).
  std::int64_t sum_start(std::int64_t s, std::int64_t d) const {
    return token_send_offset(s, d) - (forwards_ ? token_send_offset(s, node_of(s) * node_ranks_) : 0);
  }
  std::int64_t node_sum_start(std::int64_t s, std::int64_t b) const { return own_node_list(s) + node_send_offset(s, b); }
  std::int64_t sum_rows(std::int64_t s) const {
    return forwards_ ? direct_sum_start(s, ranks_) : token_send_offset(s, ranks_);
  }
  std::int64_t own_node_list(std::int64_t s) const {
    const std::int64_t b = node_of(s);
    return token_send_offset(s, (b + 1) * node_ranks_) - token_send_offset(s, b * node_ranks_);
  }
  // Rows a forwarder receives: node blocks, routes.
  std::int64_t node_recv_rows(std::int64_t f) const { return node_recv_[static_cast<std::size_t>(f)]; }
  std::int64_t node_route_recv_rows(std::int64_t f) const { return route_recv_[static_cast<std::size_t>(f)]; }

 private:
  ExpertPlacement placement_;
  std::int64_t ranks_, experts_, tile_rows_, instances_ = 0;
  bool pad_pairs_;
  std::vector<std::int64_t> source_prefix_;  // [s * N + i]: rows of instance i from sources < s (s = 0..P)
  std::vector<std::int64_t> send_offset_;    // [s * (N + 1) + i]
  std::vector<std::int64_t> expert_start_, tile_start_, kpad_start_;  // [i]
  std::vector<std::int64_t> recv_rows_, row_tiles_, kpad_rows_;       // [d]
  std::vector<std::int64_t> instance_slot_;                           // [i]
  std::vector<std::int64_t> first_tokens_, sub_offset_, list_offset_;  // the per-rank exchange: [s * N + i] (first_tokens_: then by last)
  std::vector<std::int64_t> rank_tokens_, token_start_, token_send_;
  std::int64_t node_ranks_ = 1, node_slots_ = 0;
  bool forwards_ = false;
  std::vector<std::int64_t> node_first_, node_sub_, node_send_, node_start_, route_start_, node_recv_, route_recv_;
  std::vector<std::int64_t> node_last_, node_sum_sub_;
  std::vector<std::int64_t> direct_;                   // [2 P N]: by first, then by last
  std::vector<std::int64_t> direct_sum_;               // [s (P + 1) + d]: row of d's among s's direct sums (d = P: their count)
  std::vector<std::int64_t> direct_list_;              // [s N + i]
  void set_node_tokens(std::span<const std::int64_t> counts, std::int64_t tokens_per_rank);
  void set_direct_tokens(std::span<const std::int64_t> counts);
  void choose_direct_ranks();
  std::vector<char> direct_to_;  // [d]
};

// The (expert, rank) pairs whose weights a step lends under the layer's
// lend_weights: every rank's own rows of a remote, unsplit expert at or over
// the threshold, in rank then expert order. Empty when lending is off or the
// placement already has lent homes.
std::vector<ExpertPlacement::Lend> choose_lends(const LayerConfig&, const ExpertPlacement&, const RoutingCounts&);

// The per-rank exchange of one source rank: the token of each of its send
// rows (a split expert's rows repeated in every part's block), the token
// list it sends (each destination's block: its sub-blocks by first
// instance, each in token order) and the route of each send row: the row of
// its token in its destination's block.
struct RankRoutes {
  std::vector<std::int32_t> row_token;   // [send_rows]
  std::vector<std::int64_t> row_assign;  // [send_rows]: assignment t K + k
  std::vector<std::int32_t> tokens;      // [token_send_offset(s, P)]
  std::vector<std::int32_t> position;    // [send_rows]
  // [2 N] tokens whose first instance on its rank is i, then whose last
  // is; with the per-node exchange [2 N] more: those of them that are
  // direct tokens (Exchange::direct_first, direct_last).
  std::vector<std::int64_t> first;
  // The per-rank combine's list, one per destination like the token list
  // and as long, but cut by each token's last instance there (sub-lists in
  // slot order, each in token order): for each list row, the token's row
  // in its block and the row each of its K choices fills on the
  // destination (-1: elsewhere or dropped); for each token (2 P + B
  // columns): its row in the lists for each rank (-1: none), the row each
  // rank's sum comes back to (Exchange::sum_start, or for a direct token
  // direct_sum_start; -1: none, or through a forwarder), and the row each
  // node's sum comes back to (the per-node
  // combine's forwarders'; -1: none, or straight).
  std::vector<std::int32_t> list_block;  // [token list rows]
  std::vector<std::int32_t> comb_row;    // [token list rows * K]
  std::vector<std::int64_t> list_slot;   // [T * (2 P + B)]
  // The per-node exchange: the tokens each other node needs (0 for its
  // own), its node list (each node block by node slot, then in token
  // order) and two columns over the token list's rows for the ranks of
  // other nodes (-1 for its own node's ranks): the first, per row, the
  // token's row in that node's block (the forwards' routes); the second,
  // laid out as the forwarder's NODE_COMB (slot-major by the rows of the
  // ranks' combine lists, Exchange::node_part_start), the token's row
  // among the node sums the forwarder returns (by node combine slot, then
  // token).
  std::vector<std::int64_t> node_count;  // [2 B S]: per node, its sub-blocks' tokens; then per node, its combine slots'
  std::vector<std::int32_t> node_tokens;  // [node_send_offset(s, B)]
  std::vector<std::int32_t> node_index;   // [token list rows * 2]
};
// slot: the send row of each of s's assignments (send_slots, -1 dropped);
// expert: their experts. `tokens` and `position` need the exchange's rank
// tokens only for their sizes, and are filled whether it has them or not.
RankRoutes rank_routes(const LayerConfig&, const Exchange&, std::int64_t s, std::span<const std::int64_t> slot,
                       std::span<const std::int32_t> expert);


// Row in the source's send order of every kept assignment of `ranks`'
// tokens (routing covers those ranks in that order: token t of the i-th,
// choice k, is assignment (i T + t) K + k); -1 for a dropped one.
std::vector<std::int64_t> send_slots(const LayerConfig&, const Exchange&, const RouterOutput<float>&,
                                     std::span<const int> ranks);

// Event ids of one rank's program, by role.
struct EventBases {
  // staged: the pass's dispatch is encoded (staged_in), its pieces land in
  // `staged` tiles and a decode per tile fills `recv` (backward: `dy`).
  // token_sources: the per-rank exchange's (source, local slot) pairs (P L;
  // 0 without it; by_rank: it is in use): `tok` + s L + j completes once s's sub-blocks 0..j and
  // its routes for slot j have arrived.
  EventBases(Pass, std::int64_t row_tiles, std::int64_t local, std::int64_t token_tiles, bool staged,
             std::int64_t token_sources = 0, bool by_rank = false, std::int64_t node_sources = 0, std::int64_t node_sums = 0);
  // forward
  std::int64_t recv = 0, h = 0, a = 0, y = 0, comb_done = 0, sh_h = 0, sh_a = 0, staged = 0;
  // both passes, the per-rank exchange: source s's sub-blocks up to a slot (and routes) arrived
  std::int64_t tok = 0;
  // both passes, the per-rank combine: `slot_done` + j completes once the
  // output rows (forward Y, backward DXE) of the instances in slots 0..j
  // are written, which the sums of the tokens whose last instance is j wait
  // for; backward: every rank's gate gradients of this rank's tokens arrived
  std::int64_t slot_done = 0, gw_done = 0;
  // both passes, the per-node exchange on a forwarder: `node` + s S + j
  // completes once source s's node sub-blocks 0..j (and forward, its
  // routes) arrived
  std::int64_t node = 0;
  // both passes, the per-node combine on a forwarder: `node_comb` + s S + c
  // completes once its node's ranks have put their sums of source s's
  // tokens whose last instance on them is in slots 0..c (forward Y,
  // backward DXE)
  std::int64_t node_comb = 0;
  // both passes: the split experts' partial rows reduced (part_reduce tasks)
  std::int64_t reduced = 0;
  // both passes, weights instead of tokens: `lent` + b completes once every
  // piece of the weights lent into LENT_W block b has arrived
  std::int64_t lent = 0;
  // backward
  std::int64_t dy = 0, da = 0, dh = 0, dxe = 0, dy_packed = 0, dh_packed = 0, gw = 0, dl_all = 0, sh_da = 0, sh_dh = 0,
               sh_dout_packed = 0, sh_dh_packed = 0, dx_ready = 0;
  std::int64_t total = 0;
};

// Whether a pass's dispatch lands in staged tiles that a decode per tile
// fills the GEMM's rows from (the forward's: staged_dispatch, the
// backward's: staged_grad_dispatch; never under the per-rank exchange,
// whose gathers decode).
bool staged_in(const LayerConfig&, Pass);
// The event ids of `rank`'s program for a pass.
EventBases event_bases(const LayerConfig&, const Exchange&, Pass, std::int64_t rank);
// The buffers of a rank's program for a pass (what generate declares).
void declare_buffers(Program&, const LayerConfig&, const Exchange&, Pass, std::int64_t rank);
void generate(Program& out, const LayerConfig&, const Exchange&, const Machine&, Pass, std::int64_t rank);
// A rank's program without tasks or events: its identity, expert layout and
// buffers, as generate writes them.
void program_header(Program&, const LayerConfig&, const Exchange&, const Machine&, Pass, std::int64_t rank);
// The interface between two ranks' programs: the puts that `from`'s program
// makes into `to` in a pass (from != to), with their pieces, rectangles and
// target events exactly as generate emits them, but without their waits
// (which are local to `from`). A pure function of the exchange; appended to
// `out`.
void interface_puts(const LayerConfig&, const Exchange&, std::int64_t tile_rows, Pass, std::int64_t from, std::int64_t to,
                    std::vector<Task>& out);

}  // namespace hpmoe::taskflow
