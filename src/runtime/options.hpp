#pragma once
// Internal to the runtime: what the engine is built with (one options struct
// for the interleaved and the phased schedule; hpmoe::Layer fills it from
// its Parallel setting), and the packing of the weights it reads.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "compiler/taskflow.hpp"
#include "hpmoe/config.hpp"
#include "hpmoe/layer.hpp"
#include "hpmoe/placement.hpp"
#include "hpmoe/tensors.hpp"
#include "hpmoe/transport.hpp"

namespace hpmoe {
namespace taskflow {
class AccessTable;
}

// A layer's weights packed for the tile kernels, to share between executors
// of the same weights (the packing is as large as the weights, twice with
// the transposes backward needs). The weights must outlive it.
struct PackedWeights;
std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig&, const LayerWeights&, bool backward);
// The same for a process that holds only `experts`, brought into w one at a
// time by `fetch` (generated or read from a checkpoint) and released once
// packed, so that the raw and packed copies of all experts never coexist
// (ExpertSource: hpmoe/layer.hpp).
std::shared_ptr<const PackedWeights> pack_weights(const LayerConfig&, LayerWeights&, bool backward,
                                                  std::span<const std::int32_t> experts, const ExpertSource& fetch);

// The operands of the weights a caller changed in place, packed again into
// the same memory: `experts` (every held one when all_experts) and, when
// `replicated`, the router and shared experts. Only for packing that no
// step in flight reads (the caller's to ensure; hpmoe::Layer does).
void repack_weights(const PackedWeights&, const LayerConfig&, std::span<const std::int32_t> experts, bool all_experts,
                    bool replicated);

// Experts' operands packed again in place straight from their Hugging Face
// projections (`views[i]` for `experts[i]`, each checked against the layer's
// shapes), with no math-layout copy: the same bits as expert_from_hf and then
// repack_weights. The packed weights' math layout of those experts is then
// stale until unpack_experts brings it back (hpmoe::Layer does, lazily).
// Only for packing that no step in flight reads.
void repack_experts_from_hf(const PackedWeights&, const LayerConfig&, std::span<const std::int32_t> experts,
                            std::span<const HfMlp> views);
// The same from bfloat16 projections, for a bf16 layer (their bits packed as they are).
void repack_experts_from_hf(const PackedWeights&, const LayerConfig&, std::span<const std::int32_t> experts,
                            std::span<const HfMlpBf16> views);
// The math layout of `experts` (w.w1, w.w2) recovered from their packed
// forward operands, exactly: the packing holds each weight as the layer
// computes with it (rounded to bf16 for a bf16 layer, as expert_from_hf
// rounds the math layout too).
void unpack_experts(const PackedWeights&, const LayerConfig&, std::span<const std::int32_t> experts, LayerWeights& w);

struct RuntimeOptions {
  int workers_per_rank = 1;
  bool backward = false;           // also run the backward program (a second launch)
  taskflow::Policy policy = taskflow::Policy::critical_path;
  bool pin = true;
  WorkerThreads threads = WorkerThreads::own;
  bool verify_programs = true;     // run the verifier before every launch
  // Sharded (MPI): every rank proves its own program against the interface
  // the exchanged counts predict (taskflow::verify_rank), at the cost of its
  // own program. This audit instead regenerates every rank's program on
  // every process and verifies the whole set (P times the compile cost).
  bool verify_all_ranks = false;
  double watchdog_seconds = 10.0;  // a wait longer than this stops the launch with an error
  // Fault injection (tests, tools): called with the step's programs after
  // compilation and before verification and launch.
  std::function<void(std::vector<taskflow::Program>&)> after_compile{};
  std::shared_ptr<const PackedWeights> packed{};  // optional, see pack_weights
  // Where a tensor-parallel split expert's raw weights come from when the
  // given weights do not hold them (a sharded run keeps only packed copies,
  // and packs only its parts of a split expert): called once per part this
  // process computes, one at a time.
  ExpertSource expert_source{};
  bool trace = false;                           // record StepResult::trace (a slice per task)
  // Where the ranks run and how rows reach peers; null: all ranks in this
  // process. With an MPI transport each process runs its own rank, and the
  // root process's StepResult holds every rank's outputs and gradients.
  std::shared_ptr<Transport> transport{};
  RuntimeFault fault{};
  // Run the same tiles as the serialized baseline does: one operator at a
  // time (taskflow::operator_order), each rank's tasks of the operator
  // shared round-robin by its workers, and a barrier across all workers of
  // all ranks after every operator. Over MPI this is the serialized
  // baseline on the same transport and links.
  bool phased = false;
  ExpertPlacement placement{};  // where the experts live; empty: contiguous
  // Where every task's operands come from (tests perturb a copy); null: the
  // standard table. It must outlive the executor.
  const taskflow::AccessTable* access_table = nullptr;
};

}  // namespace hpmoe
