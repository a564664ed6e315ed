#include <gtest/gtest.h>

#include "source_dir.hpp"
#include "bit_identity.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <chrono>
#include <cstring>

#include "ops/access.hpp"
#include "runtime/interleaved.hpp"
#include "hpmoe/error.hpp"
#include "hpmoe/reference.hpp"
#include "cli/run.hpp"
#include "runtime/interleaved.hpp"
#include "hpmoe/transport.hpp"

#include <thread>

using namespace hpmoe;
using hpmoe::testing::bit_identical;

namespace {

std::string trace_spec() { return "trace:" + std::string(HPMOE_SOURCE_DIR) + "/data/routing/mixtral-8x7b/humanities.json:20"; }

RuntimeOptions runtime_options(int workers, taskflow::Policy policy, bool backward) {
  RuntimeOptions opt;
  opt.workers_per_rank = workers;
  opt.policy = policy;
  opt.backward = backward;
  opt.pin = false;
  return opt;
}

// A test-name fragment: every character that is not a letter or digit becomes '_'.
std::string identifier(std::string s) {
  for (auto& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

// "fp32_P2_W1_zipf": the parameters of a bit-identity case (routing without its argument).
std::string case_name(DType dtype, int ranks, int workers, const std::string& routing) {
  return to_string(dtype) + "_P" + std::to_string(ranks) + "_W" + std::to_string(workers) + "_" +
         identifier(routing.substr(0, routing.find(':')));
}

// The tiny preset with ragged tiles (hidden 160: 3 column tiles, the last
// ragged; inter 96).
LayerConfig ragged_tiny(DType dtype, std::int64_t ranks, std::int64_t tokens_per_rank) {
  LayerConfig c = preset("tiny");
  c.hidden = 160;
  c.expert_inter = 96;
  c.dtype = dtype;
  c.ranks = ranks;
  c.tokens_per_rank = tokens_per_rank;
  return c;
}

}  // namespace

// Forward and backward: outputs and every gradient bit for bit.
class InterleavedBackward : public ::testing::TestWithParam<std::tuple<DType, int, int, std::string, taskflow::Policy>> {};

TEST_P(InterleavedBackward, GradientsAreBitIdenticalToSerialized) {
  const auto [dtype, ranks, workers, routing, policy] = GetParam();
  LayerConfig c = preset("tiny");
  c.hidden = 160;
  c.expert_inter = 96;
  c.dtype = dtype;
  c.ranks = ranks;
  c.tokens_per_rank = 150 / ranks + 3;  // odd counts: bf16 K padding
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  const auto w = random_weights(c, 31);
  const auto in = random_inputs(c, 31);
  const auto forced = forced_selection(c, parse_routing_spec(routing == "trace" ? trace_spec() : routing, 6));
  InterleavedExecutor serial(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = workers, .backward = true, .pin = false}));
  InterleavedExecutor inter(c, w, runtime_options(workers, policy, true));
  StepResult a, b;
  serial.step(in, forced, a);
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads.x, b.grads.x)) << "dx";
  EXPECT_TRUE(bit_identical(a.grads.router, b.grads.router)) << "router";
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.grads, b.grads)) << "second step";
}

INSTANTIATE_TEST_SUITE_P(
    All, InterleavedBackward,
    ::testing::Combine(::testing::Values(DType::fp32, DType::bf16), ::testing::Values(1, 2, 4), ::testing::Values(1, 2),
                       ::testing::Values("uniform", "zipf:1.2", "trace"),
                       ::testing::Values(taskflow::Policy::fill, taskflow::Policy::critical_path,
                                         taskflow::Policy::interleave_wgrad, taskflow::Policy::ratr)),
    [](const auto& info) {
      return case_name(std::get<0>(info.param), std::get<1>(info.param), std::get<2>(info.param), std::get<3>(info.param)) +
             "_" + identifier(taskflow::name(std::get<4>(info.param)));
    });

// Interleaved and serialized on the same inputs: forward outputs bit for bit.
class InterleavedForward
    : public ::testing::TestWithParam<std::tuple<DType, int, int, std::string, taskflow::Policy>> {};

TEST_P(InterleavedForward, IsBitIdenticalToSerialized) {
  const auto [dtype, ranks, workers, routing, policy] = GetParam();
  LayerConfig c = preset("tiny");
  c.hidden = 160;       // ragged column tiles
  c.expert_inter = 96;
  c.dtype = dtype;
  c.ranks = ranks;
  c.tokens_per_rank = 200 / ranks + 3;
  const auto w = random_weights(c, 21);
  const auto in = random_inputs(c, 21);
  const auto forced = forced_selection(c, parse_routing_spec(routing == "trace" ? trace_spec() : routing, 5));
  InterleavedExecutor serial(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = workers, .backward = false, .pin = false}));
  InterleavedExecutor inter(c, w, runtime_options(workers, policy, false));
  StepResult a, b;
  serial.step(in, forced, a);
  inter.step(in, forced, b);
  EXPECT_EQ(a.routing.expert, b.routing.expert);
  EXPECT_TRUE(bit_identical(a.out, b.out));
  inter.step(in, forced, b);  // counters re-armed by offset, buffers reused
  EXPECT_TRUE(bit_identical(a.out, b.out));
}

INSTANTIATE_TEST_SUITE_P(
    All, InterleavedForward,
    ::testing::Combine(::testing::Values(DType::fp32, DType::bf16), ::testing::Values(1, 2, 4), ::testing::Values(1, 2),
                       ::testing::Values("router", "uniform", "zipf:1.2", "trace"),
                       ::testing::Values(taskflow::Policy::fill, taskflow::Policy::rank_rotated,
                                         taskflow::Policy::critical_path, taskflow::Policy::ratr)),
    [](const auto& info) {
      return case_name(std::get<0>(info.param), std::get<1>(info.param), std::get<2>(info.param), std::get<3>(info.param)) +
             "_" + identifier(taskflow::name(std::get<4>(info.param)));
    });

TEST(Interleaved, CapacityDropsNoSharedExpertsSingleTokens) {
  for (auto dtype : {DType::fp32, DType::bf16}) {
    LayerConfig c = preset("tiny");
    c.dtype = dtype;
    c.capacity_factor = 1.0;
    c.shared_experts = 0;
    c.ranks = 4;
    c.tokens_per_rank = 1;
    const auto w = random_weights(c, 3);
    const auto in = random_inputs(c, 3);
    InterleavedExecutor serial(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 2, .backward = false, .pin = false}));
    InterleavedExecutor inter(c, w, runtime_options(2, taskflow::Policy::critical_path, false));
    StepResult a, b;
    serial.step(in, {}, a);
    inter.step(in, {}, b);
    EXPECT_TRUE(bit_identical(a.out, b.out));
  }
}

TEST(Interleaved, OversubscribedWorkersStillFinish) {
  LayerConfig c = preset("tiny");
  c.ranks = 4;
  c.tokens_per_rank = 64;
  const auto w = random_weights(c, 8);
  const auto in = random_inputs(c, 8);
  // 12 spinning workers on a 2-core machine
  InterleavedExecutor inter(c, w, runtime_options(3, taskflow::Policy::critical_path, false));
  InterleavedExecutor serial(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = false, .pin = false}));
  StepResult a, b;
  serial.step(in, {}, a);
  for (int i = 0; i < 3; ++i) inter.step(in, {}, b);
  EXPECT_TRUE(bit_identical(a.out, b.out));
}

// The progress thread's nap (src/comm/mpi.cpp): a ring ends it at once, a
// change the napper's check sees keeps it from starting, and silence lets
// it run to its limit.
TEST(WorkerActivity, DoorbellEndsANapWhenAWorkerBeginsToWait) {
  using namespace std::chrono;
  WorkerActivity activity;
  WorkerActivity::Doorbell bell;
  activity.set_workers(1);
  activity.ring_on_wait(&bell);

  auto t0 = steady_clock::now();
  bell.nap(milliseconds(20), [] { return true; });  // nobody rings: the whole nap
  EXPECT_GE(steady_clock::now() - t0, milliseconds(19));

  t0 = steady_clock::now();
  std::thread worker([&] {
    std::this_thread::sleep_for(milliseconds(20));
    activity.begin_wait();
  });
  bell.nap(seconds(60), [&] { return !activity.any_waiting(); });
  const auto woken = steady_clock::now() - t0;
  worker.join();
  EXPECT_LT(woken, seconds(30)) << "the worker's begin_wait did not end the nap";
  EXPECT_TRUE(activity.any_waiting());

  t0 = steady_clock::now();  // a worker already waits: no nap at all
  bell.nap(seconds(60), [&] { return !activity.any_waiting(); });
  EXPECT_LT(steady_clock::now() - t0, seconds(30));
  activity.end_wait();
  EXPECT_FALSE(activity.any_waiting());

  // Rings racing the nap's start are never lost: each nap below ends long
  // before its 60 s limit, whichever of the two comes first.
  for (int i = 0; i < 200; ++i) {
    std::atomic<bool> flag{false};
    std::thread ringer([&] {
      flag.store(true, std::memory_order_seq_cst);
      bell.ring();
    });
    t0 = steady_clock::now();
    bell.nap(seconds(60), [&] { return !flag.load(std::memory_order_seq_cst); });
    ringer.join();
    ASSERT_LT(steady_clock::now() - t0, seconds(30)) << "round " << i;
  }
  activity.ring_on_wait(nullptr);
}

TEST(Interleaved, RejectsBadOptions) {
  const LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 1);
  RuntimeOptions opt;
  opt.workers_per_rank = 0;
  EXPECT_THROW(InterleavedExecutor(c, w, opt), Error);
  opt.workers_per_rank = 1;
  opt.watchdog_seconds = 0;
  EXPECT_THROW(InterleavedExecutor(c, w, opt), Error);
}

TEST(Interleaved, VerifierRejectsACorruptedProgramBeforeLaunch) {
  const LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 4);
  const auto in = random_inputs(c, 4);
  RuntimeOptions opt;
  opt.pin = false;
  opt.after_compile = [](std::vector<taskflow::Program>& programs) {
    for (auto& t : programs[1].tasks)
      if (t.kind == taskflow::TaskKind::swiglu) {
        t.trigger_event = -1;
        break;
      }
  };
  InterleavedExecutor inter(c, w, opt);
  StepResult r;
  try {
    inter.step(in, {}, r);
    FAIL() << "a corrupted program was launched";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("failed verification"), std::string::npos) << e.what();
  }
}

TEST(Interleaved, WatchdogNamesTheWaitingTaskAndEvent) {
  const LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 4);
  const auto in = random_inputs(c, 4);
  RuntimeOptions opt;
  opt.pin = false;
  opt.workers_per_rank = 2;
  opt.verify_programs = false;  // let the broken program run
  opt.watchdog_seconds = 0.3;
  opt.after_compile = [](std::vector<taskflow::Program>& programs) {
    for (auto& t : programs[1].tasks)
      if (t.kind == taskflow::TaskKind::swiglu) {
        t.trigger_event = -1;  // its GEMM2 tiles now wait forever
        break;
      }
  };
  InterleavedExecutor inter(c, w, opt);
  StepResult r;
  const auto start = std::chrono::steady_clock::now();
  try {
    inter.step(in, {}, r);
    FAIL() << "the hang was not detected";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("watchdog"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 1"), std::string::npos) << m;
    EXPECT_NE(m.find("gemm_down"), std::string::npos) << m;
    EXPECT_NE(m.find("at 0 of 1"), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

TEST(PackedWeights, SharedBetweenExecutorsAndCheckedForMisuse) {
  LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 12);
  const auto in = random_inputs(c, 12);
  const auto packed = pack_weights(c, w, true);
  InterleavedExecutor own(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = true, .pin = false}));
  InterleavedExecutor shared(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = true, .pin = false, .packed = packed}));
  RuntimeOptions opt;
  opt.backward = true;
  opt.pin = false;
  opt.packed = packed;
  InterleavedExecutor inter(c, w, opt);
  StepResult a, b, d;
  own.step(in, {}, a);
  shared.step(in, {}, b);
  inter.step(in, {}, d);
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  EXPECT_TRUE(bit_identical(a.grads, d.grads));
  const auto other = random_weights(c, 13);
  EXPECT_THROW(InterleavedExecutor(c, other, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = false, .pin = false, .packed = packed})), Error);  // other weights
  const auto forward_only = pack_weights(c, w, false);
  EXPECT_THROW(InterleavedExecutor(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = true, .pin = false, .packed = forward_only})), Error);  // no transposes
  LayerConfig b16 = c;
  b16.dtype = DType::bf16;
  EXPECT_THROW(InterleavedExecutor(b16, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = false, .pin = false, .packed = packed})), Error);  // dtype
}

// The serialized baseline is the runtime's phased mode: its results do not
// depend on how many workers share each operator's tiles, and it reports one
// operator per task kind, named as the task kinds and the simulator name them.
class SerializedBaseline : public ::testing::TestWithParam<std::tuple<DType, int, std::string>> {};

TEST_P(SerializedBaseline, IsIndependentOfWorkersAndNamesOperatorsByKind) {
  const auto [dtype, ranks, routing] = GetParam();
  LayerConfig c = preset("tiny");
  c.hidden = 160;
  c.expert_inter = 96;
  c.dtype = dtype;
  c.ranks = ranks;
  c.tokens_per_rank = 150 / ranks + 3;
  const auto w = random_weights(c, 32);
  const auto in = random_inputs(c, 32);
  const auto forced = forced_selection(c, parse_routing_spec(routing == "trace" ? trace_spec() : routing, 7));
  InterleavedExecutor one(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = true, .pin = false}));
  InterleavedExecutor two(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 2, .backward = true, .pin = false}));
  StepResult a, b;
  one.step(in, forced, a);
  two.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  for (const auto pass : {taskflow::Pass::forward, taskflow::Pass::backward}) {
    const auto& ops = pass == taskflow::Pass::forward ? a.forward_ops : a.backward_ops;
    std::vector<std::string> names;
    for (const auto& op : ops)
      if (op.name != "router" && op.name != "compile" && op.name != "verify" && op.name != "prepare" &&
          op.name != "reduce_replicated_grads")
        names.push_back(op.name);
    std::vector<std::string> expected;
    for (const auto kind : taskflow::operator_order(pass))
      if (kind != taskflow::TaskKind::part_reduce && kind != taskflow::TaskKind::grad_part_reduce &&
          kind != taskflow::TaskKind::dispatch_cast_put && kind != taskflow::TaskKind::dispatch_decode &&
          kind != taskflow::TaskKind::grad_dispatch_cast_put && kind != taskflow::TaskKind::grad_dispatch_decode &&
          kind != taskflow::TaskKind::dispatch_token_put && kind != taskflow::TaskKind::dispatch_route_put &&
          kind != taskflow::TaskKind::dispatch_gather && kind != taskflow::TaskKind::grad_dispatch_token_put &&
          kind != taskflow::TaskKind::grad_dispatch_gather && kind != taskflow::TaskKind::dispatch_relay &&
          kind != taskflow::TaskKind::grad_dispatch_relay && kind != taskflow::TaskKind::combine_route_put &&
          kind != taskflow::TaskKind::combine_rank_put && kind != taskflow::TaskKind::combine_rank_reduce &&
          kind != taskflow::TaskKind::gate_grad_put && kind != taskflow::TaskKind::gate_grad_gather &&
          kind != taskflow::TaskKind::grad_combine_rank_put && kind != taskflow::TaskKind::grad_rank_reduce &&
          kind != taskflow::TaskKind::combine_relay && kind != taskflow::TaskKind::grad_combine_relay &&
          kind != taskflow::TaskKind::dispatch_node_put && kind != taskflow::TaskKind::dispatch_node_route_put &&
          kind != taskflow::TaskKind::dispatch_forward && kind != taskflow::TaskKind::grad_dispatch_node_put &&
          kind != taskflow::TaskKind::grad_dispatch_forward && kind != taskflow::TaskKind::dispatch_node_relay &&
          kind != taskflow::TaskKind::grad_dispatch_node_relay && kind != taskflow::TaskKind::combine_node_part_put &&
          kind != taskflow::TaskKind::combine_node_put && kind != taskflow::TaskKind::grad_combine_node_part_put &&
          kind != taskflow::TaskKind::grad_combine_node_put && kind != taskflow::TaskKind::combine_node_relay &&
          kind != taskflow::TaskKind::grad_combine_node_relay && kind != taskflow::TaskKind::weight_put &&
          kind != taskflow::TaskKind::weight_relay && kind != taskflow::TaskKind::grad_weight_put &&
          kind != taskflow::TaskKind::grad_weight_relay)
        expected.push_back(taskflow::name(kind));
    // tiny has shared experts: every operator has tasks but the split
    // experts' reduction, the encoded dispatches' four and the per-rank
    // exchange's sixteen and the per-node exchange's thirteen
    EXPECT_EQ(names, expected);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, SerializedBaseline,
    ::testing::Combine(::testing::Values(DType::fp32, DType::bf16), ::testing::Values(1, 2, 4),
                       ::testing::Values("uniform", "zipf:1.2", "trace")),
    [](const auto& info) {
      return case_name(std::get<0>(info.param), std::get<1>(info.param), 1, std::get<2>(info.param));
    });

TEST(Interleaved, PhasedWatchdogNamesTheBarrier) {
  const LayerConfig c = preset("tiny");
  const auto w = random_weights(c, 4);
  const auto in = random_inputs(c, 4);
  RuntimeOptions opt = runtime_options(1, taskflow::Policy::fill, false);
  opt.phased = true;
  opt.watchdog_seconds = 0.3;
  opt.fault.kind = RuntimeFault::stall;  // rank 1's worker never arrives
  opt.fault.rank = 1;
  InterleavedExecutor inter(c, w, opt);
  StepResult r;
  try {
    inter.step(in, {}, r);
    FAIL() << "the stall was not detected";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("watchdog"), std::string::npos) << m;
    EXPECT_NE(m.find("barrier after operator dispatch_put"), std::string::npos) << m;
  }
}

// The executor takes every address from the access table and checks it
// against the declared buffers: widen a write past its buffer in a copy of
// the table, skip the verifier, and the launch stops with a bounds error
// naming the task instead of writing out of bounds.
TEST(Interleaved, BoundsChecksFollowThePerturbedAccessTable) {
  for (const auto& [kind, buffer, backward] :
       {std::tuple{taskflow::TaskKind::gemm_gate_up, taskflow::BufferId::h1, false},
        std::tuple{taskflow::TaskKind::combine_put, taskflow::BufferId::comb, false},
        std::tuple{taskflow::TaskKind::gemm_down_wgrad, taskflow::BufferId::dw2, true}}) {
    LayerConfig c = preset("tiny");
    const auto w = random_weights(c, 3);
    const auto in = random_inputs(c, 3);
    taskflow::AccessTable widened = taskflow::AccessTable::standard();
    for (auto& rule : widened.edit(kind).operands)
      if (rule.buffer == buffer && rule.use == taskflow::Use::write) rule.grow_rows = 1 << 20;
    RuntimeOptions opt = runtime_options(1, taskflow::Policy::fill, backward);
    opt.access_table = &widened;
    opt.verify_programs = false;
    InterleavedExecutor exec(c, w, opt);
    StepResult res;
    try {
      exec.step(in, {}, res);
      ADD_FAILURE() << taskflow::name(kind) << ": the widened write ran";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("bounds:"), std::string::npos) << what;
      EXPECT_NE(what.find(taskflow::name(kind)), std::string::npos) << what;
    }
    // The verifier, run with the same table, rejects the program first.
    opt.verify_programs = true;
    InterleavedExecutor checked(c, w, opt);
    EXPECT_THROW(checked.step(in, {}, res), Error);
  }
}

// The layer API a training framework holds: forward(x) now, backward(d_out)
// later, on views of its own tensors (here rows 3 floats apart wider than H,
// inside a larger buffer), bit-identical to step() on owned matrices; the
// weights given in Hugging Face's [out, in] layout give the same bits.
TEST(Interleaved, ForwardThenBackwardOnBorrowedViewsMatchesStep) {
  for (auto dtype : {DType::fp32, DType::bf16}) {
    LayerConfig c = preset("tiny");
    c.dtype = dtype;
    c.ranks = 2;
    const auto w = random_weights(c, 8);
    const auto in = random_inputs(c, 8);
    const std::int64_t N = c.total_tokens(), H = c.hidden, ld = H + 3;
    std::vector<float> x_store(static_cast<std::size_t>(N * ld), -1.0f), dout_store(x_store.size(), -1.0f);
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t h = 0; h < H; ++h) {
        x_store[static_cast<std::size_t>(t * ld + h)] = in.x.at(t, h);
        dout_store[static_cast<std::size_t>(t * ld + h)] = in.d_out.at(t, h);
      }
    const MatrixView x{x_store.data(), N, H, ld}, dout{dout_store.data(), N, H, ld};

    // The same weights as a Hugging Face checkpoint stores them.
    std::vector<std::vector<float>> kept;
    auto hf_of = [&](const Matrix& m, std::int64_t col0, std::int64_t cols) {  // columns of m as [out, in] rows
      kept.emplace_back(static_cast<std::size_t>(cols * m.rows));
      for (std::int64_t o = 0; o < cols; ++o)
        for (std::int64_t i = 0; i < m.rows; ++i) kept.back()[static_cast<std::size_t>(o * m.rows + i)] = m.at(i, col0 + o);
      return MatrixView{kept.back().data(), cols, m.rows, m.rows};
    };
    kept.reserve(64);
    HfMoeBlock hf;
    hf.gate = hf_of(w.router, 0, c.routed_experts);
    auto mlp = [&](const Matrix& w1, const Matrix& w2, std::int64_t inter) {
      return HfMlp{hf_of(w1, 0, inter), hf_of(w1, inter, inter), hf_of(w2, 0, H)};
    };
    for (std::int64_t e = 0; e < c.routed_experts; ++e) hf.experts.push_back(mlp(w.w1[e], w.w2[e], c.expert_inter));
    hf.shared = mlp(w.shared_w1, w.shared_w2, c.shared_inter_total());
    hf.e_score_correction_bias = w.expert_bias;
    const LayerWeights from_hf = weights_from_hf(c, hf);

    RuntimeOptions opt = runtime_options(2, taskflow::Policy::critical_path, true);
    InterleavedExecutor whole(c, w, opt), split(c, from_hf, opt);
    StepResult a, b;
    whole.step(in, {}, a);
    split.forward(x, {}, b);
    EXPECT_TRUE(bit_identical(a.out, b.out)) << to_string(dtype);
    split.backward(dout, b);
    EXPECT_TRUE(bit_identical(a.grads, b.grads)) << to_string(dtype);
    // Outputs written straight into the caller's strided memory.
    std::vector<float> out_store(x_store.size(), -7.0f), dx_store(x_store.size(), -7.0f);
    StepResult into;
    into.out_into = MutableMatrixView{out_store.data(), N, H, ld};
    into.dx_into = MutableMatrixView{dx_store.data(), N, H, ld};
    split.forward(x, {}, into);
    split.backward(dout, into);
    EXPECT_TRUE(into.out.data.empty() && into.grads.x.data.empty());
    bool same = true;
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t h = 0; h < ld; ++h) {
        const auto i = static_cast<std::size_t>(t * ld + h);
        const bool ok = h < H ? out_store[i] == a.out.at(t, h) && dx_store[i] == a.grads.x.at(t, h)
                              : out_store[i] == -7.0f && dx_store[i] == -7.0f;  // the gap between rows untouched
        if (!ok && same) ADD_FAILURE() << "token " << t << " column " << h << ": out " << out_store[i] << " dx " << dx_store[i];
        same = same && ok;
      }
    EXPECT_TRUE(same) << to_string(dtype);
    into.out_into.rows -= 1;
    EXPECT_THROW(split.forward(x, {}, into), Error);
    // The serialized baseline takes the same calls.
    InterleavedExecutor serial(c, from_hf, serialized_schedule(RuntimeOptions{.workers_per_rank = 1, .backward = true, .pin = false}));
    StepResult s;
    serial.forward(x, {}, s);
    serial.backward(dout, s);
    EXPECT_TRUE(bit_identical(a.out, s.out));
    EXPECT_TRUE(bit_identical(a.grads, s.grads));
    // Misuse is an Error, not a crash: backward without its forward, a view too narrow.
    StepResult other;
    EXPECT_THROW(split.backward(dout, other), Error);
    EXPECT_THROW(split.forward(MatrixView{x_store.data(), N, H, H - 1}, {}, other), Error);
    EXPECT_THROW(split.forward(MatrixView{x_store.data(), N - 1, H, ld}, {}, other), Error);
    hf.experts[3].down_proj.rows += 1;
    EXPECT_THROW(weights_from_hf(c, hf), Error);
  }
}

namespace {
// A placement's serialized and interleaved executors, and the interleaved
// one on the contiguous placement, over the same layer (forward + backward).
struct PlacedRuns {
  PlacedRuns(const LayerConfig& c, const LayerWeights& w, const ExpertPlacement& placement, int workers)
      : serial(c, w, serialized_schedule(serialized_options(placement, workers))),
        inter(c, w, placed_options(placement, workers)),
        plain(c, w, runtime_options(workers, taskflow::Policy::critical_path, true)) {}
  static RuntimeOptions serialized_options(const ExpertPlacement& placement, int workers) {
    RuntimeOptions o{.workers_per_rank = workers, .backward = true, .pin = false};
    o.placement = placement;
    return o;
  }
  static RuntimeOptions placed_options(const ExpertPlacement& placement, int workers) {
    RuntimeOptions o = runtime_options(workers, taskflow::Policy::critical_path, true);
    o.placement = placement;
    return o;
  }
  void step(const LayerInputs& in, std::span<const std::int32_t> forced, StepResult& a, StepResult& b, StepResult& p) {
    serial.step(in, forced, a);
    inter.step(in, forced, b);
    plain.step(in, forced, p);
  }
  InterleavedExecutor serial, inter, plain;
};
}  // namespace

// Replicated experts (EPLB-style redundant homes, quotas per step): the
// serialized and interleaved executors stay bit-identical for the same
// placement, forward and backward. Against the unreplicated layer the
// output and dx are bit-identical too (every row's arithmetic is the same,
// wherever it runs); an expert's weight gradient is the sum of its homes'
// partial gradients, so only its summation order differs.
class ReplicaExecution : public ::testing::TestWithParam<std::tuple<DType, int, std::string>> {};

TEST_P(ReplicaExecution, AreBitIdenticalAcrossExecutorsAndMatchTheUnreplicatedLayer) {
  const auto [dtype, workers, routing] = GetParam();
  LayerConfig c = ragged_tiny(dtype, 3, 61);
  c.routed_experts = 8;
  const auto w = random_weights(c, 41);
  const auto in = random_inputs(c, 41);
  const auto forced = forced_selection(c, parse_routing_spec(routing == "trace" ? trace_spec() : routing, 7));
  // Expert 0 (the hot one) on every rank, expert 5 on two; a budget of 4 slots.
  const auto replicated = ExpertPlacement::from_rank_lists(8, {{0, 1, 2}, {0, 3, 4, 5}, {0, 5, 6, 7}},
                                                           ExpertPlacement::Rules{.replicas = true, .slots_per_rank = 4});
  ASSERT_TRUE(replicated.has_replicas());
  PlacedRuns runs(c, w, replicated, workers);
  StepResult a, b, p;
  runs.step(in, forced, a, b, p);
  auto& inter = runs.inter;
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  EXPECT_TRUE(bit_identical(b.out, p.out)) << "output against the unreplicated layer";
  EXPECT_TRUE(bit_identical(b.grads.x, p.grads.x)) << "dx against the unreplicated layer";
  EXPECT_TRUE(bit_identical(b.grads.router, p.grads.router));
  for (std::size_t e = 0; e < 8; ++e)
    for (const auto* pair : {&b.grads.w1, &b.grads.w2}) {
      const auto& mine = (*pair)[e];
      const auto& theirs = (pair == &b.grads.w1 ? p.grads.w1 : p.grads.w2)[e];
      double diff = 0, norm = 0;
      for (std::size_t i = 0; i < mine.data.size(); ++i) {
        diff += std::pow(double(mine.data[i]) - double(theirs.data[i]), 2);
        norm += std::pow(double(theirs.data[i]), 2);
      }
      EXPECT_LE(std::sqrt(diff), 1e-6 * std::sqrt(norm) + 1e-30) << "expert " << e << " gradient";
    }
  // With half the rows on expert 0, more than one of its homes computed some
  // where it has more than one row tile of rows (the plan's unit is a whole
  // row tile of the runtime's height, so at these sizes not every one).
  std::int64_t hot_rows = 0;
  for (int r = 0; r < 3; ++r) hot_rows += a.expert_counts[static_cast<std::size_t>(r * 8)];
  const std::int64_t tile_rows = inter.programs()[0].machine.tile_rows;
  int computing = 0;
  for (int r = 0; r < 3; ++r) {
    const auto& prog = inter.programs()[static_cast<std::size_t>(r)];
    computing += std::any_of(prog.tasks.begin(), prog.tasks.end(), [](const taskflow::Task& t) {
      return t.kind == taskflow::TaskKind::gemm_gate_up && t.expert == 0;
    });
  }
  if (routing == "hot:0.5" && hot_rows > tile_rows) {
    EXPECT_GE(computing, 2) << "the hot expert's replicas computed nothing (" << hot_rows << " rows, tiles of "
                            << tile_rows << ")";
  }
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.grads, b.grads)) << "second step";
}

INSTANTIATE_TEST_SUITE_P(All, ReplicaExecution,
                         ::testing::Combine(::testing::Values(DType::fp32, DType::bf16), ::testing::Values(1, 2),
                                            ::testing::Values("hot:0.3", "hot:0.5", "trace")),
                         [](const auto& info) {
                           return case_name(std::get<0>(info.param), 3, std::get<1>(info.param), "x") +
                                  identifier(std::get<2>(info.param));
                         });

// Tensor-parallel split experts (HDA-MoE's hybrid): each part computes its
// columns of gate/up and SwiGLU and a partial down projection on all of the
// expert's rows; the partials are summed on the source by a declared
// reduction. Serialized and interleaved stay bit-identical for the same
// placement, forward and backward, and match the fp64 oracle. Against the
// unsplit layer, the unsplit experts' weight gradients are bit-identical
// (their rows' inputs and output gradients do not change); the output, dx
// and the split experts' results differ in summation order only.
class SplitExecution : public ::testing::TestWithParam<std::tuple<DType, int, std::string>> {};

TEST_P(SplitExecution, AreBitIdenticalAcrossExecutorsAndMatchTheOracle) {
  const auto [dtype, workers, routing] = GetParam();
  LayerConfig c = ragged_tiny(dtype, 3, 61);
  c.routed_experts = 8;
  const auto w = random_weights(c, 43);
  const auto in = random_inputs(c, 43);
  const auto forced = forced_selection(c, parse_routing_spec(routing == "trace" ? trace_spec() : routing, 9));
  // Expert 0 (the hot one) in three parts on every rank, expert 5 in two
  // uneven parts (not on tile boundaries), expert 3 replicated.
  ExpertPlacement::Rules rules{.replicas = true, .slots_per_rank = 4};
  rules.splits = {{0, {0, 32, 64, 96}}, {5, {0, 40, 96}}};
  const auto split = ExpertPlacement::from_rank_lists(8, {{0, 1, 2, 3}, {0, 3, 4, 5}, {0, 5, 6, 7}}, rules);
  ASSERT_TRUE(split.has_splits());
  ASSERT_TRUE(split.has_replicas());
  ASSERT_EQ(split.parts(0), 3);
  PlacedRuns runs(c, w, split, workers);
  StepResult a, b, p;
  runs.step(in, forced, a, b, p);
  auto& inter = runs.inter;
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  for (const std::size_t e : {1, 2, 4, 6, 7}) {
    EXPECT_TRUE(bit_identical(b.grads.w1[e], p.grads.w1[e])) << "unsplit expert " << e;
    EXPECT_TRUE(bit_identical(b.grads.w2[e], p.grads.w2[e])) << "unsplit expert " << e;
  }
  // Every part computed: a gate/up tile of expert 0 on each rank, and each
  // source that chose it reduced its partials.
  int reducing = 0;
  for (int r = 0; r < 3; ++r) {
    const auto& prog = inter.programs()[static_cast<std::size_t>(r)];
    EXPECT_TRUE(std::any_of(prog.tasks.begin(), prog.tasks.end(), [](const taskflow::Task& t) {
      return t.kind == taskflow::TaskKind::gemm_gate_up && t.expert == 0;
    })) << "rank " << r;
    reducing += std::any_of(prog.tasks.begin(), prog.tasks.end(),
                            [](const taskflow::Task& t) { return t.kind == taskflow::TaskKind::part_reduce; });
  }
  EXPECT_EQ(reducing, 3);
  // The fp64 oracle with the executor's routing.
  OracleOptions oo;
  oo.forced_ids = b.routing.expert;
  oo.forced_kept = b.routing.kept;
  oo.backward = true;
  const auto ref = reference_layer(c, w, in, oo);
  std::vector<std::pair<std::string, Comparison>> checks;
  checks.emplace_back("out", compare("out", b.out.data, ref.out, dtype));
  checks.emplace_back("dx", compare("dx", b.grads.x.data, ref.dx, dtype));
  checks.emplace_back("router", compare("router", b.grads.router.data, ref.d_router, dtype));
  for (const std::size_t e : {0, 5, 3, 1}) {
    checks.emplace_back("w1 " + std::to_string(e), compare("w1", b.grads.w1[e].data, ref.d_w1[e], dtype));
    checks.emplace_back("w2 " + std::to_string(e), compare("w2", b.grads.w2[e].data, ref.d_w2[e], dtype));
  }
  for (const auto& [what, cmp] : checks) EXPECT_TRUE(cmp.pass) << what << ": rel L2 " << cmp.rel_l2;
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out)) << "second step";
  EXPECT_TRUE(bit_identical(a.grads, b.grads)) << "second step";
}

INSTANTIATE_TEST_SUITE_P(All, SplitExecution,
                         ::testing::Combine(::testing::Values(DType::fp32, DType::bf16), ::testing::Values(1, 2),
                                            ::testing::Values("hot:0.3", "uniform", "trace")),
                         [](const auto& info) {
                           return case_name(std::get<0>(info.param), 3, std::get<1>(info.param), "x") +
                                  identifier(std::get<2>(info.param));
                         });
