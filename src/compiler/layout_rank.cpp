// The per-rank and per-node exchanges' layout (compiler/layout.hpp): each
// source's token blocks and sub-blocks by first instance, its combine lists
// by last instance, the node blocks a forwarder receives, and one source's
// routes. The per-assignment rows and the event numbering are layout.cpp's.
#include <algorithm>
#include <array>
#include <utility>

#include "hpmoe/error.hpp"
#include "compiler/taskflow.hpp"
#include "compiler/layout.hpp"

namespace hpmoe::taskflow {

void Exchange::set_rank_tokens(std::vector<std::int64_t> first, std::int64_t tokens_per_rank) {
  const std::int64_t P = ranks_, N = instances_, B = forwards_ ? 2 * nodes() * node_slots_ : 0;
  if (first.size() != static_cast<std::size_t>(token_count_values()))
    throw Error("the per-rank exchange's token counts are " + std::to_string(first.size()) +
                " values; the layer needs two per (source, expert instance) pair" +
                (forwards_ ? ", two per (source, node, node slot) and two more per (source, expert instance) pair (its direct tokens), "
                           : ", ") +
                std::to_string(token_count_values()));
  rank_tokens_.assign(static_cast<std::size_t>(P * P), 0);
  sub_offset_.assign(static_cast<std::size_t>(P * N), 0);
  list_offset_.assign(static_cast<std::size_t>(P * N), 0);
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t d = 0; d < P; ++d) {
      std::int64_t rows = 0, n = 0;  // what s sends to d's instances: at least one token iff any row
      for (const std::int64_t i : placement_.instances_of(d)) {
        const std::int64_t f = first[static_cast<std::size_t>(s * N + i)];
        if (f < 0 || f > count(s, i))
          throw Error("rank " + std::to_string(s) + " reports " + std::to_string(f) + " tokens first sent to expert instance " +
                      std::to_string(i) + ", which takes " + std::to_string(count(s, i)) + " of its rows");
        sub_offset_[static_cast<std::size_t>(s * N + i)] = n;
        rows += count(s, i);
        n += f;
      }
      std::int64_t by_last = 0;  // the same tokens again, by their last instance
      for (const std::int64_t i : placement_.instances_of(d)) {
        const std::int64_t l = first[static_cast<std::size_t>(P * N + s * N + i)];
        if (l < 0 || l > count(s, i))
          throw Error("rank " + std::to_string(s) + " reports " + std::to_string(l) + " tokens last sent to expert instance " +
                      std::to_string(i) + ", which takes " + std::to_string(count(s, i)) + " of its rows");
        list_offset_[static_cast<std::size_t>(s * N + i)] = by_last;
        by_last += l;
      }
      if (by_last != n)
        throw Error("rank " + std::to_string(s) + " reports " + std::to_string(n) + " tokens for rank " + std::to_string(d) +
                    " by their first expert there but " + std::to_string(by_last) + " by their last");
      if (n > tokens_per_rank || (rows > 0) != (n > 0))
        throw Error("rank " + std::to_string(s) + " reports " + std::to_string(n) + " tokens for rank " + std::to_string(d) +
                    ", impossible with " + std::to_string(rows) + " rows for it and " + std::to_string(tokens_per_rank) +
                    " tokens per rank");
      rank_tokens_[static_cast<std::size_t>(s * P + d)] = n;
    }
  direct_.clear();
  if (forwards_) {
    direct_.assign(first.begin() + 2 * P * N + P * B, first.end());
    first.resize(static_cast<std::size_t>(2 * P * N + P * B));
    set_direct_tokens(first);
    set_node_tokens(std::span<const std::int64_t>(first).subspan(static_cast<std::size_t>(2 * P * N)), tokens_per_rank);
  }
  first_tokens_ = std::move(first);
  token_start_.assign(static_cast<std::size_t>((P + 1) * P), 0);
  token_send_.assign(static_cast<std::size_t>(P * (P + 1)), 0);
  for (std::int64_t d = 0; d < P; ++d)
    for (std::int64_t s = 0; s < P; ++s)
      token_start_[static_cast<std::size_t>((s + 1) * P + d)] = token_start(s, d) + rank_tokens(s, d);
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t d = 0; d < P; ++d)
      token_send_[static_cast<std::size_t>(s * (P + 1) + d + 1)] = token_send_offset(s, d) + rank_tokens(s, d);
}

void Exchange::set_direct_tokens(std::span<const std::int64_t> counts) {
  // counts: first_tokens_'s values, which this checks the direct ones against.
  const std::int64_t P = ranks_, N = instances_;
  direct_sum_.assign(static_cast<std::size_t>(P * (P + 1)), 0);
  direct_list_.assign(static_cast<std::size_t>(P * N), 0);
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t d = 0; d < P; ++d) {
      std::int64_t by_first = 0, by_last = 0;
      for (const std::int64_t i : placement_.instances_of(d)) {
        const std::int64_t f = direct_first(s, i), l = direct_last(s, i);
        const std::int64_t all_f = counts[static_cast<std::size_t>(s * N + i)], all_l = counts[static_cast<std::size_t>((P + s) * N + i)];
        if (f < 0 || l < 0 || f > all_f || l > all_l || ((!forwarded(s, d) || !takes_direct(d)) && (f != 0 || l != 0)))
          throw Error("rank " + std::to_string(s) + " reports " + std::to_string(f) + " and " + std::to_string(l) +
                      " direct tokens (by first and by last instance) for expert instance " + std::to_string(i) + " of its " +
                      std::to_string(all_f) + " and " + std::to_string(all_l) +
                      (!forwarded(s, d)      ? ", though its tokens reach that rank straight anyway"
                       : !takes_direct(d) ? ", though that rank takes its tokens through the forwarder"
                                          : ""));
        direct_list_[static_cast<std::size_t>(s * N + i)] = by_last;
        by_first += f;
        by_last += l;
      }
      if (by_first != by_last)
        throw Error("rank " + std::to_string(s) + " reports " + std::to_string(by_first) + " direct tokens for rank " +
                    std::to_string(d) + " by their first expert there but " + std::to_string(by_last) + " by their last");
      direct_sum_[static_cast<std::size_t>(s * (P + 1) + d + 1)] = direct_sum_[static_cast<std::size_t>(s * (P + 1) + d)] + by_first;
    }
}

void Exchange::set_node_tokens(std::span<const std::int64_t> counts, std::int64_t tokens_per_rank) {
  const std::int64_t P = ranks_, B = nodes(), R = node_ranks_, S = node_slots_;
  // Per source: B S by node slot, then B S by node combine slot.
  node_first_.assign(static_cast<std::size_t>(P * B * S), 0);
  node_last_.assign(static_cast<std::size_t>(P * B * S), 0);
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t k = 0; k < B * S; ++k) {
      node_first_[static_cast<std::size_t>(s * B * S + k)] = counts[static_cast<std::size_t>(2 * s * B * S + k)];
      node_last_[static_cast<std::size_t>(s * B * S + k)] = counts[static_cast<std::size_t>(2 * s * B * S + B * S + k)];
    }
  node_sub_.assign(static_cast<std::size_t>(P * B * (S + 1)), 0);
  node_sum_sub_.assign(static_cast<std::size_t>(P * B * (S + 1)), 0);
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < S; ++j) {
        const std::int64_t n = node_first(s, b, j), m = node_last(s, b, j);
        for (const auto& [v, what] : {std::pair{n, "node slot "}, std::pair{m, "node combine slot "}})
          if (v < 0 || v > tokens_per_rank)
            throw Error("rank " + std::to_string(s) + " reports " + std::to_string(v) + " tokens in " + what + std::to_string(j) +
                        " of node " + std::to_string(b) + ", impossible with " + std::to_string(tokens_per_rank) + " tokens per rank");
        node_sub_[static_cast<std::size_t>((s * B + b) * (S + 1) + j + 1)] = node_sub_offset(s, b, j) + n;
        node_sum_sub_[static_cast<std::size_t>((s * B + b) * (S + 1) + j + 1)] = node_sum_offset(s, b, j) + m;
      }
  node_send_.assign(static_cast<std::size_t>(P * (B + 1)), 0);
  node_start_.assign(static_cast<std::size_t>(P * B), 0);
  route_start_.assign(static_cast<std::size_t>(P * B), 0);
  node_recv_.assign(static_cast<std::size_t>(P), 0);
  route_recv_.assign(static_cast<std::size_t>(P), 0);
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t b = 0; b < B; ++b) {
      // A node block holds each token the node's ranks take through the
      // forwarder, once (a token only one takes goes to it straight, if
      // that rank takes direct tokens).
      std::int64_t most = 0, sum = 0;
      for (std::int64_t d = b * R; d < (b + 1) * R; ++d) {
        const std::int64_t relayed = rank_tokens(s, d) - (direct_sum_[static_cast<std::size_t>(s * (P + 1) + d + 1)] -
                                                          direct_sum_[static_cast<std::size_t>(s * (P + 1) + d)]);
        most = std::max(most, relayed);
        sum += relayed;
      }
      const std::int64_t n = node_tokens(s, b);
      if (b == node_of(s) ? n != 0 : (n < most || n > std::min(sum, tokens_per_rank)))
        throw Error("rank " + std::to_string(s) + " reports " + std::to_string(n) + " tokens for node " + std::to_string(b) +
                    (b == node_of(s) ? ", its own node (which takes none through a forwarder)"
                                     : ", impossible when its ranks take " + std::to_string(most) + " at most and " +
                                           std::to_string(sum) + " in all of its " + std::to_string(tokens_per_rank) +
                                           " through the forwarder"));
      if (node_sum_offset(s, b, S) != n)
        throw Error("rank " + std::to_string(s) + " reports " + std::to_string(n) + " tokens for node " + std::to_string(b) +
                    " by their node slot but " + std::to_string(node_sum_offset(s, b, S)) + " by their node combine slot");
      node_send_[static_cast<std::size_t>(s * (B + 1) + b + 1)] = node_send_offset(s, b) + n;
    }
  // On each forwarder, its sources' blocks in source order.
  for (std::int64_t s = 0; s < P; ++s)
    for (std::int64_t b = 0; b < B; ++b) {
      if (b == node_of(s)) continue;
      const auto f = static_cast<std::size_t>(forwarder(s, b));
      node_start_[static_cast<std::size_t>(s * B + b)] = node_recv_[f];
      route_start_[static_cast<std::size_t>(s * B + b)] = route_recv_[f];
      node_recv_[f] += node_tokens(s, b);
      for (std::int64_t d = b * R; d < (b + 1) * R; ++d) route_recv_[f] += rank_tokens(s, d);
    }
}

std::int64_t Exchange::node_part_start(std::int64_t s, std::int64_t j, std::int64_t d) const {
  // Slots before j, every rank of d's node; then slot j of the ranks before
  // d (their relayed tokens: a direct token's sum goes straight).
  const std::int64_t b = node_of(d), R = node_ranks_;
  std::int64_t at = 0;
  for (std::int64_t q = 0; q <= j && q < node_slots_; ++q)
    for (std::int64_t r = b * R; r < (b + 1) * R && (q < j || r < d); ++r) {
      const auto homes = placement_.instances_of(r);
      if (q < static_cast<std::int64_t>(homes.size())) at += relayed_last(s, homes[static_cast<std::size_t>(q)]);
    }
  return at;
}

namespace {
// The per-node exchange's lists of source s (RankRoutes::node_*), from its
// token list (list_begin: each destination's rows there).
void node_lists(const Exchange& ex, std::int64_t s, std::int64_t T, std::span<const std::size_t> list_begin, RankRoutes& r) {
  const std::int64_t B = ex.nodes(), R = ex.ranks() / B, S = ex.node_slots();
  r.node_count.assign(static_cast<std::size_t>(2 * B * S), 0);
  r.node_tokens.clear();
  r.node_index.assign(2 * r.tokens.size(), -1);
  std::vector<std::int32_t> at(static_cast<std::size_t>(T));
  std::vector<std::int64_t> slot_of(static_cast<std::size_t>(T)), last_of(static_cast<std::size_t>(T)),
      sum_at(static_cast<std::size_t>(T)), next(static_cast<std::size_t>(S));
  for (std::int64_t b = 0; b < B; ++b) {
    if (b == ex.node_of(s)) continue;
    // Each token's node slot: its lowest slot over the node's ranks (a
    // rank's list runs sub-block by sub-block, r.first[i] rows each).
    // Its direct tokens (each sub-block's last rows) are not in the block.
    const std::int64_t N = ex.instances();
    std::fill(slot_of.begin(), slot_of.end(), S);
    for (std::int64_t d = b * R; d < (b + 1) * R; ++d) {
      std::size_t row = list_begin[static_cast<std::size_t>(d)];
      for (const std::int64_t i : ex.placement().instances_of(d)) {
        const std::int64_t relayed = r.first[static_cast<std::size_t>(i)] - r.first[static_cast<std::size_t>(2 * N + i)];
        for (std::int64_t k = 0; k < r.first[static_cast<std::size_t>(i)]; ++k, ++row)
          if (k < relayed) {
            auto& j = slot_of[static_cast<std::size_t>(r.tokens[row])];
            j = std::min(j, ex.instance_slot(i));
          }
      }
    }
    // A counting sort by node slot, each sub-block in token order.
    std::int64_t* count = r.node_count.data() + b * S;
    for (std::int64_t t = 0; t < T; ++t)
      if (const std::int64_t j = slot_of[static_cast<std::size_t>(t)]; j < S) ++count[j];
    const auto base = static_cast<std::int64_t>(r.node_tokens.size());
    std::int64_t total = 0;
    for (std::int64_t j = 0; j < S; ++j) next[static_cast<std::size_t>(j)] = total, total += count[j];
    r.node_tokens.resize(static_cast<std::size_t>(base + total));
    for (std::int64_t t = 0; t < T; ++t)
      if (const std::int64_t j = slot_of[static_cast<std::size_t>(t)]; j < S) {
        const std::int64_t row = next[static_cast<std::size_t>(j)]++;
        at[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(row);
        r.node_tokens[static_cast<std::size_t>(base + row)] = static_cast<std::int32_t>(t);
      }
    // Each token's node combine slot: its highest last-instance slot over
    // the node's ranks (a rank's combine list runs sub-list by sub-list,
    // r.first[N + i] rows each, its relayed rows first); the forwarder
    // returns the node's sums in that order, each combine slot in token
    // order.
    std::fill(last_of.begin(), last_of.end(), -1);
    const auto combine_rows = [&](std::int64_t d, auto&& fn) {  // fn(slot, token) for each relayed row of d's combine list
      const std::size_t lo = list_begin[static_cast<std::size_t>(d)];
      std::size_t row = lo;
      const auto homes = ex.placement().instances_of(d);
      for (std::size_t j = 0; j < homes.size(); ++j) {
        const auto i = static_cast<std::size_t>(homes[j]);
        const std::int64_t relayed = r.first[N + i] - r.first[3 * static_cast<std::size_t>(N) + i];
        for (std::int64_t k = 0; k < r.first[N + i]; ++k, ++row)
          if (k < relayed) fn(static_cast<std::int64_t>(j), r.tokens[lo + static_cast<std::size_t>(r.list_block[row])]);
      }
    };
    for (std::int64_t d = b * R; d < (b + 1) * R; ++d)
      combine_rows(d, [&](std::int64_t j, std::int32_t t) {
        auto& c = last_of[static_cast<std::size_t>(t)];
        c = std::max(c, j);
      });
    std::int64_t* last_count = r.node_count.data() + B * S + b * S;
    for (std::int64_t t = 0; t < T; ++t)
      if (const std::int64_t c = last_of[static_cast<std::size_t>(t)]; c >= 0) ++last_count[c];
    total = 0;
    for (std::int64_t c = 0; c < S; ++c) next[static_cast<std::size_t>(c)] = total, total += last_count[c];
    for (std::int64_t t = 0; t < T; ++t)
      if (const std::int64_t c = last_of[static_cast<std::size_t>(t)]; c >= 0) sum_at[static_cast<std::size_t>(t)] = next[static_cast<std::size_t>(c)]++;
    // Per row of the node's ranks' token lists, the token's row in the node
    // block (the forwards' routes); per row of their combine lists, laid
    // out slot-major as the forwarder's NODE_COMB (segment (j, d) at
    // `segment`), the token's row among the node sums.
    std::vector<std::int64_t> segment(static_cast<std::size_t>(S * R));
    std::int64_t rows = 0;
    for (std::int64_t j = 0; j < S; ++j)
      for (std::int64_t d = b * R; d < (b + 1) * R; ++d) {
        segment[static_cast<std::size_t>(j * R + d - b * R)] = rows;
        const auto homes = ex.placement().instances_of(d);
        if (j < static_cast<std::int64_t>(homes.size())) {
          const auto i = static_cast<std::size_t>(homes[static_cast<std::size_t>(j)]);
          rows += r.first[static_cast<std::size_t>(N) + i] - r.first[3 * static_cast<std::size_t>(N) + i];
        }
      }
    const std::size_t routes = list_begin[static_cast<std::size_t>(b * R)];
    for (std::int64_t d = b * R; d < (b + 1) * R; ++d) {
      const std::size_t lo = list_begin[static_cast<std::size_t>(d)], hi = list_begin[static_cast<std::size_t>(d + 1)];
      for (std::size_t row = lo; row < hi; ++row)
        if (const auto t = static_cast<std::size_t>(r.tokens[row]); slot_of[t] < S) r.node_index[2 * row] = at[t];
      std::int64_t sub = 0, in_sub = 0, sub_of = -1;
      combine_rows(d, [&](std::int64_t j, std::int32_t t) {
        if (j != sub_of) sub_of = j, in_sub = 0, sub = segment[static_cast<std::size_t>(j * R + d - b * R)];
        r.node_index[2 * (routes + static_cast<std::size_t>(sub + in_sub++)) + 1] = static_cast<std::int32_t>(sum_at[static_cast<std::size_t>(t)]);
      });
    }
    // Each token's row among the sums the forwarder returns (after the
    // token lists' rows: Exchange::node_sum_start, from this list's own
    // offsets).
    const std::int64_t cols = 2 * ex.ranks() + B, own = ex.node_of(s);
    const auto own_list = static_cast<std::int64_t>(list_begin[static_cast<std::size_t>((own + 1) * R)] - list_begin[static_cast<std::size_t>(own * R)]);
    for (std::int64_t t = 0; t < T; ++t)
      if (last_of[static_cast<std::size_t>(t)] >= 0)
        r.list_slot[static_cast<std::size_t>(t * cols + 2 * ex.ranks() + b)] = own_list + base + sum_at[static_cast<std::size_t>(t)];
  }
}
}  // namespace

RankRoutes rank_routes(const LayerConfig& c, const Exchange& ex, std::int64_t s, std::span<const std::int64_t> slot,
                       std::span<const std::int32_t> expert) {
  const std::int64_t T = c.tokens_per_rank, K = c.top_k, P = ex.ranks(), N = ex.instances();
  const ExpertPlacement& placement = ex.placement();
  if (static_cast<std::int64_t>(slot.size()) != T * K || expert.size() != slot.size())
    throw Error("rank_routes: " + std::to_string(slot.size()) + " send slots and " + std::to_string(expert.size()) +
                " experts for " + std::to_string(T * K) + " assignments");
  RankRoutes r;
  const std::int64_t send = ex.send_rows(s);
  r.row_token.assign(static_cast<std::size_t>(send), -1);
  r.row_assign.assign(static_cast<std::size_t>(send), -1);
  for (std::int64_t a = 0; a < T * K; ++a) {
    const std::int64_t row = slot[static_cast<std::size_t>(a)];
    if (row < 0) continue;
    if (row >= send) throw Error("rank_routes: send row " + std::to_string(row) + " is outside rank " + std::to_string(s) + "'s " + std::to_string(send));
    const std::int32_t e = expert[static_cast<std::size_t>(a)];
    // A split expert's rows go to every part: the same token in each part's
    // block of the source's send order.
    const std::int64_t parts = placement.is_split(e) ? placement.parts(e) : 1;
    const std::int64_t n = ex.count(s, placement.first_instance(e));
    for (std::int64_t part = 0; part < parts; ++part) {
      r.row_token[static_cast<std::size_t>(row + part * n)] = static_cast<std::int32_t>(a / K);
      r.row_assign[static_cast<std::size_t>(row + part * n)] = a;
    }
  }
  for (std::int64_t row = 0; row < send; ++row)
    if (r.row_token[static_cast<std::size_t>(row)] < 0)
      throw Error("rank_routes: no assignment of rank " + std::to_string(s) + " fills its send row " + std::to_string(row) +
                  ": the send slots do not match the exchange's counts");
  // Each token's first instance on each destination (lowest slot), then
  // the destination's block: sub-block by sub-block, each its relayed
  // tokens then its direct ones (the per-node exchange; Exchange::
  // direct_first), each in token order.
  const bool forwards = c.forwards();
  r.first.assign(static_cast<std::size_t>((forwards ? 4 : 2) * N), 0);
  const std::int64_t slot_cols = 2 * P + ex.nodes();  // each token's list rows, sum rows by rank, sum rows by node
  r.list_slot.assign(static_cast<std::size_t>(T * slot_cols), -1);
  r.position.assign(static_cast<std::size_t>(send), -1);
  std::vector<std::int64_t> first_of(static_cast<std::size_t>(T)), last_of(static_cast<std::size_t>(T)),
      at(static_cast<std::size_t>(T)), list_at(static_cast<std::size_t>(T));
  const auto rows_to = [&](std::int64_t d, auto&& fn) {  // fn(send row, its instance) for every row s sends to d
    for (std::int64_t i = 0; i < N; ++i)
      if (placement.instance_rank(i) == d)
        for (std::int64_t row = ex.send_offset(s, i); row < ex.send_offset(s, i) + ex.count(s, i); ++row) fn(row, i);
  };
  // How many ranks of each node take each token: a token only one rank of
  // another node takes goes there straight, unless that rank is hot
  // (Exchange::takes_direct).
  const std::int64_t B = ex.nodes();
  std::vector<std::int32_t> takers(forwards ? static_cast<std::size_t>(T * B) : 0), seen(forwards ? static_cast<std::size_t>(T) : 0, -1);
  for (std::int64_t d = 0; d < P && forwards; ++d)
    rows_to(d, [&](std::int64_t row, std::int64_t) {
      const auto t = static_cast<std::size_t>(r.row_token[static_cast<std::size_t>(row)]);
      if (seen[t] != d) seen[t] = static_cast<std::int32_t>(d), ++takers[t * static_cast<std::size_t>(B) + static_cast<std::size_t>(ex.node_of(d))];
    });
  // Each direct token's sum row, known once the node lists' length is:
  // (token, destination, row among s's direct sums).
  std::vector<std::array<std::int64_t, 3>> direct_sums;
  std::int64_t direct_rows = 0;
  std::vector<std::size_t> list_begin(static_cast<std::size_t>(P + 1), 0);  // each destination's rows in the token list
  for (std::int64_t d = 0; d < P; ++d) {
    list_begin[static_cast<std::size_t>(d)] = r.tokens.size();
    std::fill(first_of.begin(), first_of.end(), -1);
    std::fill(last_of.begin(), last_of.end(), -1);
    rows_to(d, [&](std::int64_t row, std::int64_t i) {
      const auto t = static_cast<std::size_t>(r.row_token[static_cast<std::size_t>(row)]);
      if (first_of[t] < 0 || ex.instance_slot(i) < ex.instance_slot(first_of[t])) first_of[t] = i;
      if (last_of[t] < 0 || ex.instance_slot(i) > ex.instance_slot(last_of[t])) last_of[t] = i;
    });
    const bool across = ex.forwarded(s, d), straight_across = across && ex.takes_direct(d);
    const auto direct = [&](std::int64_t t) -> std::int64_t {
      return straight_across && takers[static_cast<std::size_t>(t * B + ex.node_of(d))] == 1;
    };
    // A counting sort by (slot, direct) of the first instance (the block)
    // and of the last (the combine list), in O(T) per destination; r.first
    // counts by instance, and (columns 2, 3) the direct tokens.
    const std::size_t L = placement.instances_of(d).size();
    std::vector<std::int64_t> next(2 * L);
    const auto sort = [&](const std::vector<std::int64_t>& key_of, std::size_t column, std::vector<std::int64_t>& row_of) {
      std::fill(next.begin(), next.end(), 0);
      for (std::int64_t t = 0; t < T; ++t)
        if (const std::int64_t f = key_of[static_cast<std::size_t>(t)]; f >= 0) {
          const std::int64_t is_direct = direct(t);
          ++r.first[column * static_cast<std::size_t>(N) + static_cast<std::size_t>(f)];
          if (is_direct) ++r.first[(column + 2) * static_cast<std::size_t>(N) + static_cast<std::size_t>(f)];
          ++next[static_cast<std::size_t>(2 * ex.instance_slot(f) + is_direct)];
        }
      std::int64_t total = 0;
      for (auto& n : next) total += std::exchange(n, total);
      for (std::int64_t t = 0; t < T; ++t)
        if (const std::int64_t f = key_of[static_cast<std::size_t>(t)]; f >= 0)
          row_of[static_cast<std::size_t>(t)] = next[static_cast<std::size_t>(2 * ex.instance_slot(f) + direct(t))]++;
      return static_cast<std::size_t>(total);
    };
    const std::size_t base = r.tokens.size(), rows = sort(first_of, 0, at);
    r.tokens.resize(base + rows);
    for (std::int64_t t = 0; t < T; ++t)
      if (first_of[static_cast<std::size_t>(t)] >= 0) r.tokens[base + static_cast<std::size_t>(at[static_cast<std::size_t>(t)])] = static_cast<std::int32_t>(t);
    // The combine's list: the same tokens by last instance.
    sort(last_of, 1, list_at);
    r.list_block.resize(r.tokens.size());
    std::vector<std::int32_t> list_token(rows);
    for (std::int64_t t = 0; t < T; ++t)
      if (const std::int64_t l = last_of[static_cast<std::size_t>(t)]; l >= 0) {
        const std::int64_t row = list_at[static_cast<std::size_t>(t)];
        list_token[static_cast<std::size_t>(row)] = static_cast<std::int32_t>(t);
        r.list_block[base + static_cast<std::size_t>(row)] = static_cast<std::int32_t>(at[static_cast<std::size_t>(t)]);
        r.list_slot[static_cast<std::size_t>(t * slot_cols + d)] = static_cast<std::int64_t>(base) + row;
        // Its sum's row (Exchange::sum_start, from this list's own offsets:
        // the exchange may not hold the token counts yet).
        if (!across)
          r.list_slot[static_cast<std::size_t>(t * slot_cols + P + d)] =
              static_cast<std::int64_t>(base - (forwards ? list_begin[static_cast<std::size_t>(ex.node_of(s) * (P / B))] : 0)) + row;
      }
    for (const std::int32_t t : list_token)  // the direct sums, in list order
      if (direct(t)) direct_sums.push_back({t, d, direct_rows++});
    r.comb_row.resize(r.tokens.size() * static_cast<std::size_t>(K), -1);
    rows_to(d, [&](std::int64_t row, std::int64_t i) {
      const auto t = static_cast<std::size_t>(r.row_token[static_cast<std::size_t>(row)]);
      const std::int64_t list_row = list_at[t];
      r.position[static_cast<std::size_t>(row)] = static_cast<std::int32_t>(at[t]);
      // The row this send row fills on d, for the sum there of the token's choices.
      const std::int64_t k = r.row_assign[static_cast<std::size_t>(row)] % K;
      r.comb_row[(base + static_cast<std::size_t>(list_row)) * static_cast<std::size_t>(K) + static_cast<std::size_t>(k)] =
          static_cast<std::int32_t>(ex.expert_start(i) + ex.source_offset(s, i) + (row - ex.send_offset(s, i)));
    });
  }
  list_begin[static_cast<std::size_t>(P)] = r.tokens.size();
  if (!forwards) return r;
  node_lists(ex, s, T, list_begin, r);
  // The direct sums come back after the own node's lists and the node sums
  // (Exchange::direct_sum_start).
  const std::int64_t R = P / B, own = ex.node_of(s);
  const auto before = static_cast<std::int64_t>(list_begin[static_cast<std::size_t>((own + 1) * R)] - list_begin[static_cast<std::size_t>(own * R)] +
                                                r.node_tokens.size());
  for (const auto& [t, d, k] : direct_sums) r.list_slot[static_cast<std::size_t>(t * slot_cols + P + d)] = before + k;
  return r;
}

std::vector<std::int64_t> rank_token_counts(const LayerConfig& c, const ExpertPlacement& placement, const RoutingCounts& counts,
                                             const RouterOutput<float>& r, std::int64_t tile_rows) {
  const Exchange ex(c, placement, counts, tile_rows);
  const std::int64_t P = c.ranks, n = c.tokens_per_rank * c.top_k;
  std::vector<int> all(static_cast<std::size_t>(P));
  for (std::int64_t q = 0; q < P; ++q) all[static_cast<std::size_t>(q)] = static_cast<int>(q);
  const std::vector<std::int64_t> slot = send_slots(c, ex, r, all);
  const std::int64_t N = ex.instances();
  const std::int64_t B = c.forwards() ? 2 * c.nodes() * ex.node_slots() : 0;
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(ex.token_count_values()));
  for (std::int64_t s = 0; s < P; ++s) {
    const auto first = static_cast<std::size_t>(s * n);
    const RankRoutes routes = rank_routes(c, ex, s, std::span<const std::int64_t>(slot).subspan(first, static_cast<std::size_t>(n)),
                                          std::span<const std::int32_t>(r.expert).subspan(first, static_cast<std::size_t>(n)));
    // Laid out as Exchange::set_rank_tokens reads them: by first, by last,
    // the node counts, then (forwarding) the direct tokens by first and by last.
    const auto part = [&](std::int64_t k) { return routes.first.begin() + k * N; };
    std::copy(part(0), part(1), tokens.begin() + s * N);
    std::copy(part(1), part(2), tokens.begin() + (P + s) * N);
    std::copy(routes.node_count.begin(), routes.node_count.end(), tokens.begin() + 2 * P * N + s * B);
    if (!c.forwards()) continue;
    std::copy(part(2), part(3), tokens.begin() + 2 * P * N + P * B + s * N);
    std::copy(part(3), part(4), tokens.begin() + 2 * P * N + P * B + (P + s) * N);
  }
  return tokens;
}

}  // namespace hpmoe::taskflow
