#include <algorithm>

#include "hpmoe/error.hpp"
#include "hpmoe/taskflow.hpp"
#include "taskflow/layout.hpp"

namespace hpmoe::taskflow {

Exchange::Exchange(const LayerConfig& c, const RoutingCounts& counts, std::int64_t tile_rows)
    : ranks(c.ranks), experts(c.routed_experts), local(c.local_experts()), tile_rows(tile_rows) {
  if (counts.ranks != ranks || counts.experts != experts ||
      counts.counts.size() != static_cast<std::size_t>(ranks * experts))
    throw Error("routing counts are for " + std::to_string(counts.ranks) + " ranks x " +
                std::to_string(counts.experts) + " experts, the layer has " + std::to_string(ranks) + " x " +
                std::to_string(experts));
  source_prefix.assign(static_cast<std::size_t>((ranks + 1) * experts), 0);
  for (std::int64_t s = 0; s < ranks; ++s)
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::int64_t n = counts.at(s, e);
      if (n < 0 || n > c.tokens_per_rank)
        throw Error("routing count " + std::to_string(n) + " for rank " + std::to_string(s) + ", expert " +
                    std::to_string(e) + " is impossible with " + std::to_string(c.tokens_per_rank) + " tokens per rank");
      source_prefix[(s + 1) * experts + e] = source_prefix[s * experts + e] + n;
    }
  send_offset.assign(static_cast<std::size_t>(ranks * (experts + 1)), 0);
  for (std::int64_t s = 0; s < ranks; ++s) {
    std::int64_t total = 0;
    for (std::int64_t e = 0; e < experts; ++e) {
      send_offset[s * (experts + 1) + e] = total;
      total += counts.at(s, e);
    }
    send_offset[s * (experts + 1) + experts] = total;
  }
  expert_begin.assign(static_cast<std::size_t>(ranks * (local + 1)), 0);
  tile_base.assign(static_cast<std::size_t>(ranks * (local + 1)), 0);
  for (std::int64_t d = 0; d < ranks; ++d)
    for (std::int64_t le = 0; le < local; ++le) {
      const std::int64_t n = expert_rows(d * local + le);
      expert_begin[d * (local + 1) + le + 1] = expert_begin[d * (local + 1) + le] + n;
      tile_base[d * (local + 1) + le + 1] = tile_base[d * (local + 1) + le] + (n + tile_rows - 1) / tile_rows;
    }
}

std::int64_t Exchange::pieces(std::int64_t s, std::int64_t e) const {
  const std::int64_t begin = source_offset(s, e), end = begin + count(s, e);
  if (end == begin) return 0;
  return (end - 1) / tile_rows - begin / tile_rows + 1;
}

std::int32_t Exchange::arrivals(std::int64_t e, std::int64_t tile) const {
  std::int32_t n = 0;
  for (std::int64_t s = 0; s < ranks; ++s) {
    const std::int64_t first = source_offset(s, e), rows = count(s, e);
    if (rows > 0 && first < (tile + 1) * tile_rows && first + rows > tile * tile_rows) ++n;
  }
  return n;
}

std::int64_t Exchange::pieces_into(std::int64_t s) const {
  std::int64_t n = 0;
  for (std::int64_t e = 0; e < experts; ++e) n += pieces(s, e);
  return n;
}

template <class Real>
RoutingCounts routing_counts(const LayerConfig& c, const RouterOutput<Real>& r) {
  RoutingCounts rc{c.ranks, c.routed_experts, std::vector<std::int64_t>(static_cast<std::size_t>(c.ranks * c.routed_experts), 0)};
  const std::int64_t per_rank = c.tokens_per_rank * c.top_k;
  for (std::size_t a = 0; a < r.expert.size(); ++a)
    if (r.kept[a]) ++rc.counts[(static_cast<std::int64_t>(a) / per_rank) * c.routed_experts + r.expert[a]];
  return rc;
}
RoutingCounts routing_counts(const LayerConfig& c, std::span<const std::int32_t> expert_ids) {
  if (static_cast<std::int64_t>(expert_ids.size()) != c.total_tokens() * c.top_k)
    throw Error("expert choices for " + std::to_string(expert_ids.size()) + " assignments, the step has " +
                std::to_string(c.total_tokens() * c.top_k));
  RoutingCounts rc{c.ranks, c.routed_experts, std::vector<std::int64_t>(static_cast<std::size_t>(c.ranks * c.routed_experts), 0)};
  const std::int64_t per_rank = c.tokens_per_rank * c.top_k;
  for (std::size_t a = 0; a < expert_ids.size(); ++a) {
    const auto e = expert_ids[a];
    if (e < 0 || e >= c.routed_experts) throw Error("expert id " + std::to_string(e) + " is out of range");
    ++rc.counts[(static_cast<std::int64_t>(a) / per_rank) * c.routed_experts + e];
  }
  return rc;
}

template RoutingCounts routing_counts<float>(const LayerConfig&, const RouterOutput<float>&);
template RoutingCounts routing_counts<double>(const LayerConfig&, const RouterOutput<double>&);

EventBases::EventBases(Pass pass, std::int64_t row_tiles, std::int64_t local, std::int64_t token_tiles) {
  std::int64_t next = 0;
  auto take = [&](std::int64_t n) {
    const std::int64_t at = next;
    next += n;
    return at;
  };
  if (pass == Pass::forward) {
    recv = take(row_tiles);
    h = take(row_tiles);
    a = take(row_tiles);
    y = take(row_tiles);
    comb_done = take(1);
    sh_h = take(token_tiles);
    sh_a = take(token_tiles);
  } else {
    dy = take(row_tiles);
    da = take(row_tiles);
    dh = take(row_tiles);
    dxe = take(row_tiles);
    dy_packed = take(local);
    dh_packed = take(local);
    gw = take(token_tiles);
    dl_all = take(1);
    sh_da = take(token_tiles);
    sh_dh = take(token_tiles);
    sh_dout_packed = take(1);
    sh_dh_packed = take(1);
    dx_ready = take(1);
  }
  total = next;
}

namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

class Builder {
 public:
  Builder(Program& p, const Machine& m) : p_(p), m_(m) {}

  std::int32_t event(std::int64_t id, std::int32_t required, TaskKind consumer, std::int64_t expert, std::int64_t tile) {
    p_.events[static_cast<std::size_t>(id)] = Event{required, consumer, static_cast<std::int32_t>(expert),
                                                    static_cast<std::int32_t>(tile)};
    return static_cast<std::int32_t>(id);
  }

  void task(TaskKind kind, BufferId src, BufferId dst, std::int64_t expert, std::int64_t peer, std::int64_t row_begin,
            std::int64_t rows, std::int64_t col_begin, std::int64_t cols, std::int64_t src_row, std::int64_t wait_event,
            std::int64_t wait_count, std::int64_t trigger_event, double cost) {
    p_.tasks.push_back(Task{kind, queue_class(kind), src, dst, static_cast<std::int32_t>(expert),
                            static_cast<std::int32_t>(peer), static_cast<std::int32_t>(row_begin),
                            static_cast<std::int32_t>(rows), static_cast<std::int32_t>(col_begin),
                            static_cast<std::int32_t>(cols), static_cast<std::int32_t>(src_row),
                            static_cast<std::int32_t>(wait_event), static_cast<std::int32_t>(wait_count),
                            static_cast<std::int32_t>(trigger_event)});
    p_.cost.push_back(static_cast<float>(cost + m_.task_overhead_s));
  }

  double gemm_cost(std::int64_t m, std::int64_t n, std::int64_t k) const {
    return 2.0 * double(m) * double(n) * double(k) / m_.matrix_flops;
  }
  double vector_cost(std::int64_t bytes) const { return double(bytes) / m_.vector_bytes_per_s; }
  double put_cost(std::int64_t bytes) const { return double(bytes) / m_.put_bytes_per_s; }

  // GEMM output tiles of [M, N], each triggering `trigger`.
  template <class Fn>
  void gemm_tiles(std::int64_t M, std::int64_t N, std::int64_t K, Fn&& add) {
    for (std::int64_t i = 0; i < M; i += m_.tile_rows)
      for (std::int64_t j = 0; j < N; j += m_.tile_cols)
        add(i, std::min(m_.tile_rows, M - i), j, std::min(m_.tile_cols, N - j), gemm_cost(std::min(m_.tile_rows, M - i),
                                                                                         std::min(m_.tile_cols, N - j), K));
  }

 private:
  Program& p_;
  const Machine& m_;
};

void add_buffer(Program& p, BufferId id, std::int64_t rows, std::int64_t cols, std::int64_t elem) {
  std::int64_t offset = 0;
  if (!p.buffers.empty()) {
    const auto& last = p.buffers.back();
    offset = last.offset_bytes + ((last.rows * last.cols * last.elem_bytes + 63) / 64) * 64;
  }
  p.buffers.push_back(BufferLayout{id, rows, cols, elem, offset});
}

}  // namespace

Program generate(const LayerConfig& c, const RoutingCounts& counts, const Machine& m, Pass pass, std::int64_t rank) {
  Program p;
  generate_into(p, c, counts, m, pass, rank);
  return p;
}

void generate_into(Program& p, const LayerConfig& c, const RoutingCounts& counts, const Machine& m, Pass pass,
                   std::int64_t rank) {
  c.validate();
  if (rank < 0 || rank >= c.ranks) throw Error("rank " + std::to_string(rank) + " is outside 0.." + std::to_string(c.ranks - 1));
  generate(p, c, Exchange(c, counts, m.tile_rows), m, pass, rank);
}

void generate(Program& p, const LayerConfig& c, const Exchange& ex, const Machine& m, Pass pass, std::int64_t rank) {
  const std::int64_t H = c.hidden, I = c.expert_inter, Is = c.shared_inter_total(), L = c.local_experts(),
                     T = c.tokens_per_rank, P = c.ranks, E = c.routed_experts, TR = m.tile_rows, TC = m.tile_cols;
  const std::int64_t elem = c.dtype == DType::bf16 ? 2 : 4;
  const bool shared = c.shared_experts > 0;
  // Reuse the vectors' storage: a rank recompiles every step.
  p.tasks.clear();
  p.cost.clear();
  p.events.clear();
  p.buffers.clear();
  p.expert_begin.clear();
  p.pass = pass;
  p.rank = static_cast<std::int32_t>(rank);
  p.ranks = static_cast<std::int32_t>(P);
  p.machine = m;
  p.dims = Dims{H, I, Is, E, L, c.top_k, T};
  for (std::int64_t le = 0; le <= L; ++le) p.expert_begin.push_back(ex.expert_begin[rank * (L + 1) + le]);
  p.send_rows = ex.send_rows(rank);

  const std::int64_t row_tiles = ex.row_tiles(rank), token_tiles = ceil_div(T, TR);
  const EventBases ev(pass, row_tiles, L, token_tiles);
  p.events.assign(static_cast<std::size_t>(ev.total), Event{0, TaskKind::count, -1, -1});
  Builder b(p, m);
  const std::int64_t n_gate_up = ceil_div(2 * I, TC), n_down = ceil_div(H, TC), n_inter = ceil_div(I, TC);

  // Symmetric buffers: the receive side is sized for the busiest rank.
  std::int64_t max_recv = 0, max_send = 0;
  for (std::int64_t d = 0; d < P; ++d) {
    max_recv = std::max(max_recv, ex.recv_rows(d));
    max_send = std::max(max_send, ex.send_rows(d));
  }

  // Puts from this rank's tokens (or gradients) to every expert, split at the
  // receiver's row tiles so that each piece signals exactly the tile it fills.
  auto puts_to_experts = [&](TaskKind kind, BufferId src, BufferId dst, std::int64_t remote_base) {
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t d = e / L, le = e % L, n = ex.count(rank, e);
      const std::int64_t first = ex.source_offset(rank, e);
      for (std::int64_t r = first; r < first + n;) {
        const std::int64_t tile = r / TR, end = std::min(first + n, (tile + 1) * TR);
        b.task(kind, src, dst, e, d, ex.expert_start(d, le) + r, end - r, 0, H, ex.send_offset[rank * (E + 1) + e] + (r - first),
               -1, 0, remote_base + ex.tile_base[d * (L + 1) + le] + tile, b.put_cost((end - r) * H * elem));
        r = end;
      }
    }
  };
  // Puts of this rank's expert outputs back to each source, split at this
  // rank's row tiles (each piece waits for the one tile it reads).
  auto puts_to_sources = [&](TaskKind kind, BufferId src, BufferId dst, std::int64_t wait_base, std::int64_t wait_count,
                             bool forward) {
    for (std::int64_t le = 0; le < L; ++le) {
      const std::int64_t e = rank * L + le;
      for (std::int64_t s = 0; s < P; ++s) {
        const std::int64_t n = ex.count(s, e), first = ex.source_offset(s, e);
        const std::int64_t source_tiles = ceil_div(T, TR);
        const EventBases source_events(forward ? Pass::forward : Pass::backward, ex.row_tiles(s), L, source_tiles);
        const std::int64_t target = forward ? source_events.comb_done : source_events.dx_ready;
        for (std::int64_t r = first; r < first + n;) {
          const std::int64_t tile = r / TR, end = std::min(first + n, (tile + 1) * TR);
          b.task(kind, src, dst, e, s, ex.send_offset[s * (E + 1) + e] + (r - first), end - r, 0, H,
                 ex.expert_start(rank, le) + r, wait_base + ex.tile_base[rank * (L + 1) + le] + tile, wait_count, target,
                 b.put_cost((end - r) * H * elem));
          r = end;
        }
      }
    }
  };

  if (pass == Pass::forward) {
    add_buffer(p, BufferId::x, T, H, elem);
    add_buffer(p, BufferId::recv, max_recv, H, elem);
    add_buffer(p, BufferId::h1, max_recv, 2 * I, 4);
    add_buffer(p, BufferId::a, max_recv, I, elem);
    add_buffer(p, BufferId::y, max_recv, H, elem);
    add_buffer(p, BufferId::comb, max_send, H, elem);
    add_buffer(p, BufferId::out, T, H, 4);
    if (shared) {
      add_buffer(p, BufferId::sh_h, T, 2 * Is, 4);
      add_buffer(p, BufferId::sh_a, T, Is, elem);
      add_buffer(p, BufferId::sh_y, T, H, 4);
    }
    // Events of this rank.
    for (std::int64_t le = 0; le < L; ++le) {
      const std::int64_t e = rank * L + le, tiles = ex.tiles_of(rank, le), tb = ex.tile_base[rank * (L + 1) + le];
      for (std::int64_t i = 0; i < tiles; ++i) {
        b.event(ev.recv + tb + i, ex.arrivals(e, i), TaskKind::gemm_gate_up, e, i);
        b.event(ev.h + tb + i, static_cast<std::int32_t>(n_gate_up), TaskKind::swiglu, e, i);
        b.event(ev.a + tb + i, 1, TaskKind::gemm_down, e, i);
        b.event(ev.y + tb + i, static_cast<std::int32_t>(n_down), TaskKind::combine_put, e, i);
      }
    }
    b.event(ev.comb_done,
            static_cast<std::int32_t>(ex.pieces_into(rank) + (shared ? token_tiles * n_down : 0)),
            TaskKind::combine_reduce, -1, -1);
    if (shared)
      for (std::int64_t t = 0; t < token_tiles; ++t) {
        b.event(ev.sh_h + t, static_cast<std::int32_t>(ceil_div(2 * Is, TC)), TaskKind::shared_swiglu, -1, t);
        b.event(ev.sh_a + t, 1, TaskKind::shared_down, -1, t);
      }

    puts_to_experts(TaskKind::dispatch_put, BufferId::x, BufferId::recv, ev.recv);
    if (shared) {
      for (std::int64_t t = 0; t < token_tiles; ++t) {
        const std::int64_t rows = std::min(TR, T - t * TR);
        b.gemm_tiles(rows, 2 * Is, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n, double cost) {
          b.task(TaskKind::shared_gate_up, BufferId::x, BufferId::sh_h, -1, rank, t * TR, rows, j, n, t * TR, -1, 0,
                 ev.sh_h + t, cost);
        });
        b.task(TaskKind::shared_swiglu, BufferId::sh_h, BufferId::sh_a, -1, rank, t * TR, rows, 0, Is, t * TR,
               ev.sh_h + t, ceil_div(2 * Is, TC), ev.sh_a + t, b.vector_cost(rows * 3 * Is * 4));
        b.gemm_tiles(rows, H, Is, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n, double cost) {
          b.task(TaskKind::shared_down, BufferId::sh_a, BufferId::sh_y, -1, rank, t * TR, rows, j, n, t * TR,
                 ev.sh_a + t, 1, ev.comb_done, cost);
        });
      }
    }
    for (std::int64_t le = 0; le < L; ++le) {
      const std::int64_t e = rank * L + le, n_e = ex.rows_of(rank, le), start = ex.expert_start(rank, le);
      const std::int64_t tb = ex.tile_base[rank * (L + 1) + le];
      for (std::int64_t i = 0; i * TR < n_e; ++i) {
        const std::int64_t rows = std::min(TR, n_e - i * TR), row0 = start + i * TR;
        b.gemm_tiles(rows, 2 * I, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n, double cost) {
          b.task(TaskKind::gemm_gate_up, BufferId::recv, BufferId::h1, e, rank, row0, rows, j, n, row0, ev.recv + tb + i,
                 p.events[ev.recv + tb + i].required, ev.h + tb + i, cost);
        });
        b.task(TaskKind::swiglu, BufferId::h1, BufferId::a, e, rank, row0, rows, 0, I, row0, ev.h + tb + i, n_gate_up,
               ev.a + tb + i, b.vector_cost(rows * (2 * I * 4 + I * elem)));
        b.gemm_tiles(rows, H, I, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n, double cost) {
          b.task(TaskKind::gemm_down, BufferId::a, BufferId::y, e, rank, row0, rows, j, n, row0, ev.a + tb + i, 1,
                 ev.y + tb + i, cost);
        });
      }
    }
    puts_to_sources(TaskKind::combine_put, BufferId::y, BufferId::comb, ev.y, n_down, true);
    // A reduce tile reads its tokens' rows by slot, scattered over every
    // expert's returned rows; counts alone do not say which pieces hold them,
    // so each reduce tile waits for all pieces (and the shared expert).
    for (std::int64_t t = 0; t < token_tiles; ++t) {
      const std::int64_t rows = std::min(TR, T - t * TR);
      b.task(TaskKind::combine_reduce, BufferId::comb, BufferId::out, -1, rank, t * TR, rows, 0, H, t * TR, ev.comb_done,
             p.events[ev.comb_done].required, -1, b.vector_cost(rows * c.top_k * H * elem + rows * H * 4));
    }
    return;
  }

  // ---- backward ----
  add_buffer(p, BufferId::dout, T, H, 4);
  add_buffer(p, BufferId::gw, T, c.top_k, 4);
  add_buffer(p, BufferId::dlogits, T, E, 4);
  add_buffer(p, BufferId::xtf, H, T, 4);
  add_buffer(p, BufferId::rdx, T, H, 4);
  add_buffer(p, BufferId::dwg, H, E, 4);
  add_buffer(p, BufferId::dy, max_recv, H, elem);
  add_buffer(p, BufferId::da, max_recv, I, 4);
  add_buffer(p, BufferId::dyp, max_recv + L, H, elem);
  add_buffer(p, BufferId::at, I, max_recv + L, elem);
  add_buffer(p, BufferId::dw2, L * I, H, 4);
  add_buffer(p, BufferId::dh, max_recv, 2 * I, elem);
  add_buffer(p, BufferId::dxe, max_recv, H, elem);
  add_buffer(p, BufferId::dhp, max_recv + L, 2 * I, elem);
  add_buffer(p, BufferId::xt, H, max_recv + L, elem);
  add_buffer(p, BufferId::dw1, L * H, 2 * I, 4);
  add_buffer(p, BufferId::dcomb, max_send, H, elem);
  if (shared) {
    add_buffer(p, BufferId::sh_da, T, Is, 4);
    add_buffer(p, BufferId::sh_doutp, T + 1, H, elem);
    add_buffer(p, BufferId::sh_at, Is, T + 1, elem);
    add_buffer(p, BufferId::sh_xt, H, T + 1, elem);
    add_buffer(p, BufferId::dws2, Is, H, 4);
    add_buffer(p, BufferId::sh_dh, T, 2 * Is, elem);
    add_buffer(p, BufferId::sdx, T, H, 4);
    add_buffer(p, BufferId::sh_dhp, T + 1, 2 * Is, elem);
    add_buffer(p, BufferId::dws1, H, 2 * Is, 4);
  }
  add_buffer(p, BufferId::dx, T, H, 4);

  const std::int64_t n_router_dgrad = token_tiles * n_down;
  const std::int64_t n_shared_dgrad = shared ? token_tiles * n_down : 0;
  for (std::int64_t le = 0; le < L; ++le) {
    const std::int64_t e = rank * L + le, tiles = ex.tiles_of(rank, le), tb = ex.tile_base[rank * (L + 1) + le];
    for (std::int64_t i = 0; i < tiles; ++i) {
      b.event(ev.dy + tb + i, ex.arrivals(e, i), TaskKind::gemm_down_dgrad, e, i);
      b.event(ev.da + tb + i, static_cast<std::int32_t>(n_inter), TaskKind::swiglu_bwd, e, i);
      b.event(ev.dh + tb + i, 1, TaskKind::gemm_gate_up_dgrad, e, i);
      b.event(ev.dxe + tb + i, static_cast<std::int32_t>(n_down), TaskKind::grad_combine_put, e, i);
    }
    b.event(ev.dy_packed + le, static_cast<std::int32_t>(tiles), TaskKind::gemm_down_wgrad, e, -1);
    b.event(ev.dh_packed + le, static_cast<std::int32_t>(tiles), TaskKind::gemm_gate_up_wgrad, e, -1);
  }
  for (std::int64_t t = 0; t < token_tiles; ++t) b.event(ev.gw + t, 1, TaskKind::router_bwd, -1, t);
  b.event(ev.dl_all, static_cast<std::int32_t>(token_tiles), TaskKind::router_dgrad, -1, -1);
  if (shared) {
    for (std::int64_t t = 0; t < token_tiles; ++t) {
      b.event(ev.sh_da + t, static_cast<std::int32_t>(ceil_div(Is, TC)), TaskKind::shared_swiglu_bwd, -1, t);
      b.event(ev.sh_dh + t, 1, TaskKind::shared_gate_up_dgrad, -1, t);
    }
    b.event(ev.sh_dout_packed, static_cast<std::int32_t>(token_tiles), TaskKind::shared_down_wgrad, -1, -1);
    b.event(ev.sh_dh_packed, static_cast<std::int32_t>(token_tiles), TaskKind::shared_gate_up_wgrad, -1, -1);
  }
  b.event(ev.dx_ready, static_cast<std::int32_t>(ex.pieces_into(rank) + n_router_dgrad + n_shared_dgrad),
          TaskKind::grad_reduce, -1, -1);

  puts_to_experts(TaskKind::grad_dispatch_put, BufferId::dout, BufferId::dy, ev.dy);
  // Router: gate-weight gradients, logits gradients, then its GEMMs.
  for (std::int64_t t = 0; t < token_tiles; ++t) {
    const std::int64_t rows = std::min(TR, T - t * TR);
    b.task(TaskKind::gate_grad, BufferId::comb, BufferId::gw, -1, rank, t * TR, rows, 0, c.top_k, t * TR, -1, 0, ev.gw + t,
           b.vector_cost(rows * c.top_k * H * (elem + 4)));
    b.task(TaskKind::router_bwd, BufferId::gw, BufferId::dlogits, -1, rank, t * TR, rows, 0, E, t * TR, ev.gw + t, 1,
           ev.dl_all, b.vector_cost(rows * (E * 8 + H * 8)));
  }
  b.gemm_tiles(T, H, E, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n, double cost) {
    b.task(TaskKind::router_dgrad, BufferId::dlogits, BufferId::rdx, -1, rank, i, rows, j, n, i, ev.dl_all, token_tiles,
           ev.dx_ready, cost);
  });
  b.gemm_tiles(H, E, T, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n, double cost) {
    b.task(TaskKind::router_wgrad, BufferId::xtf, BufferId::dwg, -1, rank, i, rows, j, n, 0, ev.dl_all, token_tiles, -1,
           cost);
  });
  if (shared) {
    for (std::int64_t t = 0; t < token_tiles; ++t) {
      const std::int64_t rows = std::min(TR, T - t * TR);
      b.gemm_tiles(rows, Is, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n, double cost) {
        b.task(TaskKind::shared_down_dgrad, BufferId::dout, BufferId::sh_da, -1, rank, t * TR, rows, j, n, t * TR, -1, 0,
               ev.sh_da + t, cost);
      });
      b.task(TaskKind::pack_shared_down_grad, BufferId::dout, BufferId::sh_doutp, -1, rank, t * TR, rows, 0, H, t * TR,
             -1, 0, ev.sh_dout_packed, b.vector_cost(rows * (H + Is + H) * elem * 2));
      b.task(TaskKind::shared_swiglu_bwd, BufferId::sh_da, BufferId::sh_dh, -1, rank, t * TR, rows, 0, 2 * Is, t * TR,
             ev.sh_da + t, ceil_div(Is, TC), ev.sh_dh + t, b.vector_cost(rows * Is * 16));
      b.gemm_tiles(rows, H, 2 * Is, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n, double cost) {
        b.task(TaskKind::shared_gate_up_dgrad, BufferId::sh_dh, BufferId::sdx, -1, rank, t * TR, rows, j, n, t * TR,
               ev.sh_dh + t, 1, ev.dx_ready, cost);
      });
      b.task(TaskKind::pack_shared_gate_up_grad, BufferId::sh_dh, BufferId::sh_dhp, -1, rank, t * TR, rows, 0, 2 * Is,
             t * TR, ev.sh_dh + t, 1, ev.sh_dh_packed, b.vector_cost(rows * 2 * Is * elem * 2));
    }
    b.gemm_tiles(Is, H, T, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n, double cost) {
      b.task(TaskKind::shared_down_wgrad, BufferId::sh_at, BufferId::dws2, -1, rank, i, rows, j, n, 0, ev.sh_dout_packed,
             token_tiles, -1, cost);
    });
    b.gemm_tiles(H, 2 * Is, T, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n, double cost) {
      b.task(TaskKind::shared_gate_up_wgrad, BufferId::sh_xt, BufferId::dws1, -1, rank, i, rows, j, n, 0,
             ev.sh_dh_packed, token_tiles, -1, cost);
    });
  }
  for (std::int64_t le = 0; le < L; ++le) {
    const std::int64_t e = rank * L + le, n_e = ex.rows_of(rank, le), start = ex.expert_start(rank, le);
    const std::int64_t tb = ex.tile_base[rank * (L + 1) + le], tiles = ex.tiles_of(rank, le);
    for (std::int64_t i = 0; i < tiles; ++i) {
      const std::int64_t rows = std::min(TR, n_e - i * TR), row0 = start + i * TR;
      const std::int32_t arrivals = p.events[ev.dy + tb + i].required;
      b.gemm_tiles(rows, I, H, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n, double cost) {
        b.task(TaskKind::gemm_down_dgrad, BufferId::dy, BufferId::da, e, rank, row0, rows, j, n, row0, ev.dy + tb + i,
               arrivals, ev.da + tb + i, cost);
      });
      b.task(TaskKind::pack_down_grad, BufferId::dy, BufferId::dyp, e, rank, row0, rows, 0, H, row0, ev.dy + tb + i,
             arrivals, ev.dy_packed + le, b.vector_cost(rows * (H + I) * elem * 2));
      b.task(TaskKind::swiglu_bwd, BufferId::da, BufferId::dh, e, rank, row0, rows, 0, 2 * I, row0, ev.da + tb + i,
             n_inter, ev.dh + tb + i, b.vector_cost(rows * I * 16));
      b.gemm_tiles(rows, H, 2 * I, [&](std::int64_t, std::int64_t, std::int64_t j, std::int64_t n, double cost) {
        b.task(TaskKind::gemm_gate_up_dgrad, BufferId::dh, BufferId::dxe, e, rank, row0, rows, j, n, row0,
               ev.dh + tb + i, 1, ev.dxe + tb + i, cost);
      });
      b.task(TaskKind::pack_gate_up_grad, BufferId::dh, BufferId::dhp, e, rank, row0, rows, 0, 2 * I, row0,
             ev.dh + tb + i, 1, ev.dh_packed + le, b.vector_cost(rows * (2 * I + H) * elem * 2));
    }
    // Weight gradients of expert e: one task per output tile, K = all its rows.
    b.gemm_tiles(I, H, n_e, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n, double cost) {
      b.task(TaskKind::gemm_down_wgrad, BufferId::at, BufferId::dw2, e, rank, le * I + i, rows, j, n, start,
             ev.dy_packed + le, tiles, -1, cost);
    });
    b.gemm_tiles(H, 2 * I, n_e, [&](std::int64_t i, std::int64_t rows, std::int64_t j, std::int64_t n, double cost) {
      b.task(TaskKind::gemm_gate_up_wgrad, BufferId::xt, BufferId::dw1, e, rank, le * H + i, rows, j, n, start,
             ev.dh_packed + le, tiles, -1, cost);
    });
  }
  puts_to_sources(TaskKind::grad_combine_put, BufferId::dxe, BufferId::dcomb, ev.dxe, n_down, false);
  for (std::int64_t t = 0; t < token_tiles; ++t) {
    const std::int64_t rows = std::min(TR, T - t * TR);
    b.task(TaskKind::grad_reduce, BufferId::dcomb, BufferId::dx, -1, rank, t * TR, rows, 0, H, t * TR, ev.dx_ready,
           p.events[ev.dx_ready].required, -1, b.vector_cost(rows * (c.top_k * H * elem + 3 * H * 4)));
  }
}

}  // namespace hpmoe::taskflow
