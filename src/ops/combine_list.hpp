#pragma once
// The per-rank combine list's row: one codec for its one format. The host
// writes a list row per (token, destination rank) when it prepares a
// forward (runtime), the list travels with the tokens (combine_route_put),
// and the destination's bodies read it to sum, put and differentiate
// (ops/rank_combine.cpp). Its words, 4 bytes each: the token's row in its
// block; for each of the token's K choices, the receive row it fills on the
// destination (-1: it lives elsewhere, or was dropped); then the K gates
// (floats, bit for bit).
#include <cstdint>
#include <cstring>
#include <string>

#include "hpmoe/error.hpp"

namespace hpmoe::ops {

struct CombineList {
  // Words of one row for top-K routing (the buffers' width: RANK_COMB, RECV_COMB).
  static constexpr std::int64_t words(std::int64_t K) { return 2 * K + 1; }

  // Writes one row.
  struct Writer {
    std::int32_t* words;
    std::int64_t K;
    void block_row(std::int32_t row) const { words[0] = row; }
    void choice(std::int64_t k, std::int32_t recv_row, float gate) const {
      words[1 + k] = recv_row;
      std::memcpy(&words[1 + K + k], &gate, sizeof gate);
    }
  };

  // Reads one row, checking its rows against what the rank received (a
  // corrupt put is an error naming the task, never a wild read; the name
  // becomes a string only then).
  struct Row {
    const std::int32_t* words;
    std::int64_t K;
    std::int64_t block_row(const char* task, std::int64_t block_rows) const {
      if (words[0] < 0 || words[0] >= block_rows)
        throw Error(std::string(task) + ": a combine list names row " + std::to_string(words[0]) + " of a token block of " +
                    std::to_string(block_rows) + " rows (a corrupt put)");
      return words[0];
    }
    std::int64_t row(const char* task, std::int64_t k, std::int64_t recv_rows) const {
      const std::int64_t r = words[1 + k];
      if (r < -1 || r >= recv_rows)
        throw Error(std::string(task) + ": a combine list names receive row " + std::to_string(r) + " of " +
                    std::to_string(recv_rows) + ": the list does not match the exchange (a corrupt put)");
      return r;
    }
    float gate(std::int64_t k) const {
      float g = 0;
      std::memcpy(&g, words + 1 + K + k, sizeof g);
      return g;
    }
  };
};

}  // namespace hpmoe::ops
