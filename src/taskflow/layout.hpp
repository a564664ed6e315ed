#pragma once
// Internal: the exchange layout of one step, derived from the routing counts
// alone, and the event numbering of a rank's program. Every rank computes
// the same layout, so a source knows the receiver's row offsets and event ids
// without asking.
#include <cstdint>
#include <vector>

#include "hpmoe/taskflow.hpp"

namespace hpmoe::taskflow {

struct Exchange {
  Exchange(const LayerConfig&, const RoutingCounts&, std::int64_t tile_rows);

  std::int64_t ranks, experts, local, tile_rows;
  std::vector<std::int64_t> source_prefix;  // [(s) * E + e]: rows of expert e from sources < s
  std::vector<std::int64_t> send_offset;    // [s * (E + 1) + e]: row of (s, e) in s's send order
  std::vector<std::int64_t> expert_begin;   // [d * (L + 1) + le]: rows of local expert le in d's RECV
  std::vector<std::int64_t> tile_base;      // [d * (L + 1) + le]: first row tile of le on d

  std::int64_t count(std::int64_t s, std::int64_t e) const {
    return source_prefix[(s + 1) * experts + e] - source_prefix[s * experts + e];
  }
  // Row of (s, e)'s first row within expert e's region on its owner.
  std::int64_t source_offset(std::int64_t s, std::int64_t e) const { return source_prefix[s * experts + e]; }
  std::int64_t expert_rows(std::int64_t e) const { return source_prefix[ranks * experts + e]; }
  std::int64_t expert_start(std::int64_t d, std::int64_t le) const { return expert_begin[d * (local + 1) + le]; }
  std::int64_t rows_of(std::int64_t d, std::int64_t le) const { return expert_rows(d * local + le); }
  std::int64_t tiles_of(std::int64_t d, std::int64_t le) const {
    return tile_base[d * (local + 1) + le + 1] - tile_base[d * (local + 1) + le];
  }
  std::int64_t row_tiles(std::int64_t d) const { return tile_base[d * (local + 1) + local]; }
  std::int64_t recv_rows(std::int64_t d) const { return expert_begin[d * (local + 1) + local]; }
  std::int64_t send_rows(std::int64_t s) const { return send_offset[s * (experts + 1) + experts]; }
  // Put pieces of (s, e): its rows split at the owner's row tiles.
  std::int64_t pieces(std::int64_t s, std::int64_t e) const;
  std::int64_t pieces_into(std::int64_t s) const;  // over all experts: what s receives in the combine
  // Put pieces landing in row tile `tile` of expert e: one per source chunk overlapping it.
  std::int32_t arrivals(std::int64_t e, std::int64_t tile) const;
};

// Event ids of one rank's program, by role.
struct EventBases {
  EventBases(Pass, std::int64_t row_tiles, std::int64_t local, std::int64_t token_tiles);
  // forward
  std::int64_t recv = 0, h = 0, a = 0, y = 0, comb_done = 0, sh_h = 0, sh_a = 0;
  // backward
  std::int64_t dy = 0, da = 0, dh = 0, dxe = 0, dy_packed = 0, dh_packed = 0, gw = 0, dl_all = 0, sh_da = 0, sh_dh = 0,
               sh_dout_packed = 0, sh_dh_packed = 0, dx_ready = 0;
  std::int64_t total = 0;
};

void generate(Program& out, const LayerConfig&, const Exchange&, const Machine&, Pass, std::int64_t rank);

}  // namespace hpmoe::taskflow
