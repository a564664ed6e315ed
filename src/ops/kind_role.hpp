#pragma once
// A kind's part in the step beyond what it touches: which exchange emits
// it, what a put feeds at its peer and at which proof level, where the
// scheduler's passes put it, which framework operator it stands for in the
// serialized baselines. It is a field of the kind's op-table entry
// (ops/op.hpp), read through `role(kind)`; the verifier, the scheduler and
// the simulator derive every decision about kinds from it, so a new kind is
// written in its family's file and the enum only.
#include <cstdint>

#include "ir/ir.hpp"

namespace hpmoe::taskflow {

// Which exchange, or which option of the layer, emits a kind (what
// `layer_operators` lists for a configuration, and the kinds of a scheme).
enum class Scheme : std::uint8_t {
  layer,              // every layer: the router and the routed experts' GEMMs and vector steps
  shared,             // layers with shared experts
  assignment,         // the per-assignment exchange: a row per (token, expert)
  assignment_direct,  //   its dispatch in the layer's dtype
  assignment_staged,  //   its dispatch cast (fp8, bf16) into a stage, decoded at the expert
  assignment_splits,  //   the sums of a tensor-parallel split expert's parts
  rank,               // the per-rank exchange: a token once per destination rank
  node,               // the per-node exchange: once per destination node, forwarded inside it
  lend,               // weights instead of tokens (lent, or fetched replicas)
};

// Where the scheduler's passes put a kind's tasks (compiler/schedule.cpp).
enum class Place : std::uint8_t {
  none,
  expert_put,     // the per-assignment dispatch: its pieces keep the generator's order
  token_put,      // the per-rank and per-node exchanges' first hop: the forwards go after them
  forward,        // a forwarder's second hop (and its relays): before anything that waits on tokens
  token_wait,     // waits on delivered tokens (the gathers and their relays)
  expert_return,  // an expert's rows back to their source (per assignment)
  rank_relay,     // the per-rank combine's relay: after the GEMMs it counts
  sum_return,     // the per-rank and per-node combines' sums back to their sources
  node_sum,       // a forwarder's node sums: after the rank's other puts
  side_gradient,  // a data gradient only the final reductions read (the router's): after the expert chains
  reduction,      // the final reductions: they wait for every return
};

// A kind's step in a row tile's expert work (the scheduler's chains and
// lookahead, the simulator's weight reuse); routed or shared by its scheme.
enum class TileStep : std::uint8_t { none, first_gemm, vector_step, pack, second_gemm, weight_gradient };

// The all-to-all a framework runs where a put of this kind is (the
// serialized, DeepEP-style and MindSpore-style baselines, sim/baselines.cpp).
enum class Collective : std::uint8_t { none, dispatch, combine, grad_dispatch, grad_combine };

// What of a kind the paper's fused kernel times (`--kernel-scope`): not the
// router's backward, nor the CPU runtime's transposing packs (an
// accelerator's matrix unit reads transposed operands directly).
enum class KernelScope : std::uint8_t {
  inside,
  outside,        // the router's backward, the CPU's weight-gradient packs
  put_only,       // a put whose local work is an outside kind's (the per-rank gate gradients)
};

struct KindRole {
  Scheme scheme = Scheme::layer;
  Place place = Place::none;
  TileStep step = TileStep::none;
  // A put: the kind of task that waits at the peer on the event the put
  // signals (the per-rank proof's stand-in events), and that event's level
  // (compiler/levels.hpp): a put into a level-l event may depend only on
  // local events and remote-fed events below l.
  TaskKind consumer = TaskKind::count;
  std::int8_t level = 1;
  // A put: the kinds whose local critical path stands for what it feeds at
  // the peer (the critical-path scheduler's estimate); count: the consumer.
  // Returned rows feed the combine, or first a split expert's reduction.
  TaskKind feeds = TaskKind::count, feeds_split = TaskKind::count;
  // A relay whose event counts the same peers' puts as this kind's event
  // (a chain of slots: its level is that event's).
  TaskKind relay_of = TaskKind::count;
  Collective collective = Collective::none;
  // The serialized baseline gathers an exchange's rows into a send buffer
  // (a permute operator) before its all-to-all.
  bool permute_first = false;
  KernelScope kernel_scope = KernelScope::inside;
};

// What the scheduler, verifier and simulator ask of a kind on their hot
// paths, flat by kind (built once from the op table, ops/table.cpp): its
// role, whether it is a put, its queue and where its expert lives.
struct KindFacts {
  KindRole role;
  bool put = false;
  QueueClass queue = QueueClass::vector;
  ExpertHome expert_home = ExpertHome::none;
};
namespace detail {
const KindFacts* kind_facts();
[[noreturn]] void bad_kind(TaskKind);
}  // namespace detail
inline const KindFacts& facts(TaskKind k) {
  static const KindFacts* const table = detail::kind_facts();
  if (static_cast<std::size_t>(k) >= static_cast<std::size_t>(TaskKind::count)) [[unlikely]]
    detail::bad_kind(k);
  return table[static_cast<std::size_t>(k)];
}
// The role of a kind (the op table's entry).
inline const KindRole& role(TaskKind k) { return facts(k).role; }

// What a put feeds at its peer, for the critical-path estimate.
inline TaskKind fed_kind(const KindRole& r) { return r.feeds != TaskKind::count ? r.feeds : r.consumer; }
inline TaskKind fed_split_kind(const KindRole& r) {
  return r.feeds_split != TaskKind::count ? r.feeds_split : fed_kind(r);
}

}  // namespace hpmoe::taskflow
