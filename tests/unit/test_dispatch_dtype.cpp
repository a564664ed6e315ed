// A dispatch narrower than the layer's dtype (fp8 e4m3 with per-128-channel
// scales, or bf16 under an fp32 layer): the codec, the config field, the
// programs (an encoding put per piece into the owner's staged rows, a decode
// per row tile; the backward's dy in bf16 under an fp32 layer), the
// verifier's mutation corpus for them, and the runtime:
// serialized = interleaved bit for bit, and the fp64 oracle that applies the
// same encode-decode to the dispatched tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "bit_identity.hpp"
#include "oracle_checks.hpp"
#include "cli/run.hpp"
#include "common/fp8.hpp"
#include "compiler/layout.hpp"
#include <nlohmann/json.hpp>
#include "hpmoe/error.hpp"
#include "hpmoe/reference.hpp"
#include "runtime/interleaved.hpp"
#include "source_dir.hpp"
#include "taskflow_cases.hpp"

using namespace hpmoe;
using namespace hpmoe::testing;
using hpmoe::testing::bit_identical;

namespace {

LayerConfig encoded_layer(DType dtype, DispatchDType dispatch, std::int64_t ranks, std::int64_t tokens) {
  LayerConfig c = preset("tiny");
  c.hidden = 256;  // two fp8 scale blocks, four column tiles
  c.expert_inter = 96;
  c.dtype = dtype;
  c.dispatch_dtype = dispatch;
  c.ranks = ranks;
  c.tokens_per_rank = tokens;
  c.validate();
  return c;
}

}  // namespace

// Every 4099th float bit pattern, and a few ulps around every rounding
// boundary (the midpoints between neighbouring codes, and 448); all 2^32
// floats agreed when the bit-level encode was written (a 25 s loop).
TEST(Fp8Codec, TheBitLevelEncodeAgreesWithTheDefinition) {
  const auto check = [](std::uint32_t bits) {
    float v;
    std::memcpy(&v, &bits, 4);
    ASSERT_EQ(fp8_e4m3_code(v), fp8_e4m3_code_by_definition(v)) << std::hexfloat << v;
  };
  for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 4099) check(static_cast<std::uint32_t>(b));
  for (int c = 0; c < 0x7E; ++c)
    for (const float sign : {1.0f, -1.0f}) {
      const float mid = sign * 0.5f * (fp8_e4m3_value(static_cast<std::uint8_t>(c)) + fp8_e4m3_value(static_cast<std::uint8_t>(c + 1)));
      std::uint32_t bits;
      std::memcpy(&bits, &mid, 4);
      for (std::uint32_t d = 0; d < 5; ++d) check(bits - 2 + d);
    }
  for (const float edge : {448.0f, -448.0f, 464.0f, std::numeric_limits<float>::infinity()}) {
    std::uint32_t bits;
    std::memcpy(&bits, &edge, 4);
    for (std::uint32_t d = 0; d < 5; ++d) check(bits - 2 + d);
  }
}

TEST(Fp8Codec, EncodesE4M3ByTheStandardsRounding) {
  EXPECT_EQ(fp8_e4m3_code(1.0f), 0x38);
  EXPECT_EQ(fp8_e4m3_code(-1.0f), 0xB8);
  EXPECT_EQ(fp8_e4m3_code(448.0f), 0x7E);
  EXPECT_EQ(fp8_e4m3_code(1e9f), 0x7E) << "saturates";
  EXPECT_EQ(fp8_e4m3_code(-470.0f), 0xFE) << "saturates below -448";
  EXPECT_EQ(fp8_e4m3_code(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
  EXPECT_EQ(fp8_e4m3_code(0.0f), 0x00);
  EXPECT_EQ(fp8_e4m3_code(std::ldexp(1.0f, -9)), 0x01) << "smallest subnormal";
  EXPECT_EQ(fp8_e4m3_code(std::ldexp(1.0f, -10)), 0x00) << "half the smallest subnormal: ties to even (0)";
  EXPECT_EQ(fp8_e4m3_code(std::ldexp(3.0f, -10)), 0x02) << "1.5 steps: ties to even (2)";
  EXPECT_EQ(fp8_e4m3_code(std::ldexp(1.0f, -6)), 0x08) << "smallest normal";
  EXPECT_EQ(fp8_e4m3_code(1.0625f), 0x38) << "tie between 1 and 1.125 goes to the even mantissa";
  EXPECT_EQ(fp8_e4m3_code(1.1875f), 0x3A) << "tie between 1.125 and 1.25 goes to the even mantissa";
  EXPECT_EQ(fp8_e4m3_code(1.124f), 0x39);
  // Every finite code decodes to a value that encodes back to itself.
  for (int code = 0; code < 256; ++code) {
    const float v = fp8_e4m3_value(static_cast<std::uint8_t>(code));
    if (std::isnan(v)) {
      EXPECT_EQ(code & 0x7F, 0x7F);
      continue;
    }
    const std::uint8_t back = fp8_e4m3_code(v);
    if (code == 0x80) EXPECT_EQ(back, 0x80) << "-0";
    else EXPECT_EQ(back, code) << "code " << code << " value " << v;
  }
  EXPECT_FLOAT_EQ(fp8_e4m3_value(0x7E), 448.0f);
  EXPECT_FLOAT_EQ(fp8_e4m3_value(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8Codec, ARowKeepsEachBlocksScaleAndRelativeError) {
  const std::int64_t H = 384;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(H), back(H);
  for (std::int64_t i = 0; i < H; ++i) x[i] = normal(gen) * (i < 128 ? 1e-3f : i < 256 ? 1.0f : 1e3f);
  x[200] = 0;
  std::vector<std::uint8_t> row(static_cast<std::size_t>(fp8_row_bytes(H)));
  ASSERT_EQ(row.size(), static_cast<std::size_t>(H + 12));
  fp8_encode_row(x.data(), H, row.data());
  fp8_decode_row(row.data(), H, back.data());
  for (std::int64_t b = 0; b < 3; ++b) {
    float amax = 0;
    for (std::int64_t i = b * 128; i < (b + 1) * 128; ++i) amax = std::max(amax, std::fabs(x[i]));
    for (std::int64_t i = b * 128; i < (b + 1) * 128; ++i)
      // E4M3 keeps 3 mantissa bits: half an ulp is at most 1/16 of the value,
      // and subnormals in the block's scale at most 2^-10 of its maximum.
      EXPECT_LE(std::fabs(back[i] - x[i]), std::max(std::fabs(x[i]) / 16, amax * std::ldexp(1.0f, -10) / 448 * 512))
          << "channel " << i;
  }
  EXPECT_EQ(back[200], 0.0f);
  std::vector<float> zeros(H, 0.0f);
  fp8_encode_row(zeros.data(), H, row.data());
  fp8_decode_row(row.data(), H, back.data());
  for (float v : back) EXPECT_EQ(v, 0.0f);
}

TEST(DispatchDtype, TheConfigFieldIsCheckedAndRoundTrips) {
  LayerConfig c = preset("tiny");
  c.set("dispatch_dtype", "fp8");
  EXPECT_THROW(
      {
        try {
          c.validate();  // tiny's hidden is not a multiple of 128
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("hidden"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("multiple of 128"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  c.hidden = 256;
  c.validate();
  EXPECT_TRUE(c.staged_dispatch());
  EXPECT_EQ(c.dispatch_row_bytes(), 256 + 8);
  EXPECT_EQ(config_from_json(to_json(c)).dispatch_dtype, DispatchDType::fp8);
  c.dtype = DType::bf16;
  c.set("dispatch_dtype", "fp32");
  try {
    c.validate();
    ADD_FAILURE() << "fp32 dispatch under a bf16 layer was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dispatch_dtype"), std::string::npos) << e.what();
  }
  c.set("dispatch_dtype", "bf16");
  c.validate();
  EXPECT_FALSE(c.staged_dispatch()) << "bf16 under a bf16 layer sends the rows as they are";
  EXPECT_THROW(c.set("dispatch_dtype", "fp4"), Error);
  EXPECT_FALSE(c.staged_grad_dispatch()) << "a bf16 layer's dy is bf16 already";
  c.dtype = DType::fp32;
  EXPECT_TRUE(c.staged_dispatch());
  EXPECT_EQ(c.dispatch_row_bytes(), 512);
  // The backward's dy: bf16 with an encoded forward dispatch (auto), unless asked otherwise.
  EXPECT_TRUE(c.staged_grad_dispatch());
  c.set("grad_dispatch_dtype", "layer");
  EXPECT_FALSE(c.staged_grad_dispatch());
  c.set("dispatch_dtype", "layer");
  c.set("grad_dispatch_dtype", "bf16");
  EXPECT_TRUE(c.staged_grad_dispatch());
  c.set("grad_dispatch_dtype", "auto");
  EXPECT_FALSE(c.staged_grad_dispatch());
  EXPECT_THROW(c.set("grad_dispatch_dtype", "fp8"), Error);
  c.grad_dispatch_dtype = GradDispatchDType::bf16;
  EXPECT_EQ(config_from_json(to_json(c)).grad_dispatch_dtype, GradDispatchDType::bf16);
}

TEST(DispatchDtype, ProgramsEncodeOnTheSourceAndDecodeEachTileOnce) {
  const LayerConfig c = encoded_layer(DType::fp32, DispatchDType::fp8, 3, 90);
  const auto counts = counts_for(c, "uniform");
  const auto programs = compile_checked(c, contiguous(c), counts, parse_machine("cpu:2"), Pass::forward, Policy::ratr);
  for (const auto& p : programs) {
    std::int64_t decodes = 0, plain = 0, encoded_rows = 0;
    for (const auto& t : p.tasks) {
      decodes += t.kind == TaskKind::dispatch_decode;
      plain += t.kind == TaskKind::dispatch_put;
      if (t.kind == TaskKind::dispatch_cast_put) {
        encoded_rows += t.rows;
        EXPECT_EQ(t.cols, c.dispatch_row_bytes());
      }
    }
    EXPECT_EQ(plain, 0) << "rank " << p.rank;
    EXPECT_EQ(encoded_rows, 90 * c.top_k) << "rank " << p.rank << ": every kept row goes out encoded";
    Exchange ex(c, contiguous(c), counts, p.machine.tile_rows);
    EXPECT_EQ(decodes, ex.row_tiles(p.rank)) << "rank " << p.rank;
    const auto* staged = p.buffer(BufferId::recv_staged);
    ASSERT_NE(staged, nullptr);
    EXPECT_EQ(staged->elem_bytes, 1);
    EXPECT_EQ(staged->cols, 256 + 8);
  }
  // The backward sends dy in bf16 (2 H bytes a row), decoded per tile.
  const auto backward = compile_checked(c, contiguous(c), counts, parse_machine("cpu:2"), Pass::backward, Policy::ratr);
  for (const auto& p : backward) {
    std::int64_t decodes = 0, encoded_rows = 0;
    for (const auto& t : p.tasks) {
      EXPECT_NE(t.kind, TaskKind::grad_dispatch_put);
      decodes += t.kind == TaskKind::grad_dispatch_decode;
      if (t.kind == TaskKind::grad_dispatch_cast_put) {
        encoded_rows += t.rows;
        EXPECT_EQ(t.cols, 2 * c.hidden);
      }
    }
    EXPECT_EQ(encoded_rows, 90 * c.top_k) << "rank " << p.rank;
    EXPECT_EQ(decodes, Exchange(c, contiguous(c), counts, p.machine.tile_rows).row_tiles(p.rank)) << "rank " << p.rank;
  }
  // ... unless asked to send it as it is.
  LayerConfig plain_grad = c;
  plain_grad.grad_dispatch_dtype = GradDispatchDType::layer;
  const auto plain = compile_checked(plain_grad, contiguous(c), counts, parse_machine("cpu:2"), Pass::backward, Policy::ratr);
  for (const auto& t : plain[0].tasks) EXPECT_NE(t.kind, TaskKind::grad_dispatch_cast_put);
}

TEST(DispatchDtype, MutationsOfTheEncodedDispatchAreRejected) {
  const LayerConfig c = encoded_layer(DType::fp32, DispatchDType::fp8, 2, 150);
  const auto counts = counts_for(c, "uniform");
  const Machine m = parse_machine("cpu:2");
  const auto base = compile(c, contiguous(c), counts, m, Pass::forward, Policy::critical_path);
  expect_ok(base);
  const auto backward = compile(c, contiguous(c), counts, m, Pass::backward, Policy::critical_path);
  expect_ok(backward);
  const auto rejected = [&](const std::vector<Program>& programs) {
    const auto whole = verify(programs);
    EXPECT_FALSE(whole.ok) << "the whole-set check accepted the corrupted set";
    Verifier verifier;
    std::string alone;
    for (const auto& p : programs)
      if (const auto r = verifier.verify_rank(p, c, contiguous(c), counts, m); !r.ok && alone.empty()) alone = r.error;
    EXPECT_NE(alone, "") << "every rank alone accepted the corrupted set (whole set: " << whole.error << ")";
    return whole.error;
  };
  {  // a decode that starts before its tile's last piece lands
    auto programs = base;
    auto& t = programs[1].tasks[first_task(programs[1], TaskKind::dispatch_decode)];
    t.wait_count -= 1;
    rejected(programs);
  }
  {  // the GEMM reads the staged tile's rows before they are decoded
    auto programs = base;
    auto& p = programs[0];
    const Task decode = p.tasks[first_task(p, TaskKind::dispatch_decode)];
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::gemm_gate_up && t.wait_event == decode.trigger_event) {
        t.wait_event = decode.wait_event;
        t.wait_count = decode.wait_count;
      }
    rejected(programs);
  }
  {  // an encoded piece signals another tile than the one it fills
    auto programs = base;
    auto& p = programs[0];
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::dispatch_cast_put && t.peer != p.rank) {
        t.trigger_event += 1;
        break;
      }
    rejected(programs);
  }
  {  // an encoded piece one row short: a staged row is decoded but never written
    auto programs = base;
    auto& p = programs[1];
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::dispatch_cast_put && t.peer != p.rank) {
        t.rows -= 1;
        break;
      }
    rejected(programs);
  }
  {  // a piece sent in the layer's width into the encoded rows
    auto programs = base;
    auto& t = programs[0].tasks[first_task(programs[0], TaskKind::dispatch_cast_put)];
    t.cols = static_cast<std::int32_t>(c.hidden * 4);
    rejected(programs);
  }
  {  // the backward's decode of dy before its tile's last piece lands
    auto programs = backward;
    auto& t = programs[0].tasks[first_task(programs[0], TaskKind::grad_dispatch_decode)];
    t.wait_count -= 1;
    rejected(programs);
  }
  {  // the backward's GEMM reads dy without waiting for its decode
    auto programs = backward;
    auto& p = programs[1];
    const Task decode = p.tasks[first_task(p, TaskKind::grad_dispatch_decode)];
    for (auto& t : p.tasks)
      if (t.kind == TaskKind::gemm_down_dgrad && t.wait_event == decode.trigger_event) {
        t.wait_event = decode.wait_event;
        t.wait_count = decode.wait_count;
      }
    rejected(programs);
  }
}

// Serialized and interleaved: bit for bit; both match the oracle that
// encodes and decodes the dispatched tokens as tightly as an unencoded
// layer matches the plain oracle; the plain oracle sees the encoding.
class EncodedDispatchExecution
    : public ::testing::TestWithParam<std::tuple<DType, DispatchDType, int, std::string, GradDispatchDType>> {};

TEST_P(EncodedDispatchExecution, IsBitIdenticalAcrossSchedulesAndMatchesTheEncodingOracle) {
  const auto [dtype, dispatch, ranks, routing, grad] = GetParam();
  LayerConfig c = encoded_layer(dtype, dispatch, ranks, 120 / ranks + 3);
  c.grad_dispatch_dtype = grad;
  const auto w = random_weights(c, 57);
  const auto in = random_inputs(c, 57);
  const std::string spec = routing == "trace" ? "trace:" + std::string(HPMOE_SOURCE_DIR) + "/data/routing/mixtral-8x7b/humanities.json:20" : routing;
  const auto forced = forced_selection(c, parse_routing_spec(spec, 3));
  InterleavedExecutor serial(c, w, serialized_schedule(RuntimeOptions{.workers_per_rank = 2, .backward = true, .pin = false}));
  InterleavedExecutor inter(c, w, RuntimeOptions{.workers_per_rank = 2, .backward = true, .policy = taskflow::Policy::ratr, .pin = false});
  StepResult a, b;
  serial.step(in, forced, a);
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out));
  EXPECT_TRUE(bit_identical(a.grads, b.grads));
  const OracleOptions oo = oracle_options_of(b);
  const auto ref = reference_layer(c, w, in, oo);
  const auto checks = checks_against(ref, b, dtype, 3);
  for (const auto& cmp : checks) EXPECT_TRUE(cmp.pass) << cmp.tensor << ": rel L2 " << cmp.rel_l2;
  // The oracle without the encoding: the output moves by the encoding's error
  // (fp8: about 2^-5 of each element, bf16 2^-9), far beyond the fp32 bound.
  if (dtype == DType::fp32 && c.staged_dispatch()) {
    LayerConfig plain = c;
    plain.dispatch_dtype = DispatchDType::layer;
    plain.grad_dispatch_dtype = GradDispatchDType::layer;
    const auto unencoded = reference_layer(plain, w, in, oo);
    const auto moved = compare("out", b.out.data, unencoded.out, dtype);
    EXPECT_GT(moved.rel_l2, dispatch == DispatchDType::fp8 ? 1e-3 : 1e-4) << "the dispatched tokens were not encoded";
  }
  if (c.staged_grad_dispatch()) {  // the weight gradients see dy in bf16: beyond the fp32 bound without it
    LayerConfig plain = c;
    plain.grad_dispatch_dtype = GradDispatchDType::layer;
    const auto unrounded = reference_layer(plain, w, in, oo);
    EXPECT_GT(compare("w2", b.grads.w2[0].data, unrounded.d_w2[0], dtype).rel_l2, 1e-4) << "dy was not sent in bf16";
  }
  inter.step(in, forced, b);
  EXPECT_TRUE(bit_identical(a.out, b.out)) << "second step";
  EXPECT_TRUE(bit_identical(a.grads, b.grads)) << "second step";
}

INSTANTIATE_TEST_SUITE_P(
    All, EncodedDispatchExecution,
    ::testing::Values(std::tuple{DType::fp32, DispatchDType::fp8, 1, std::string("uniform"), GradDispatchDType::automatic},
                      std::tuple{DType::fp32, DispatchDType::fp8, 2, std::string("zipf:1.2"), GradDispatchDType::automatic},
                      std::tuple{DType::fp32, DispatchDType::fp8, 3, std::string("trace"), GradDispatchDType::automatic},
                      std::tuple{DType::fp32, DispatchDType::fp8, 2, std::string("uniform"), GradDispatchDType::layer},
                      std::tuple{DType::fp32, DispatchDType::bf16, 2, std::string("uniform"), GradDispatchDType::automatic},
                      std::tuple{DType::fp32, DispatchDType::layer, 2, std::string("trace"), GradDispatchDType::bf16},
                      std::tuple{DType::bf16, DispatchDType::fp8, 2, std::string("uniform"), GradDispatchDType::automatic},
                      std::tuple{DType::bf16, DispatchDType::fp8, 3, std::string("trace"), GradDispatchDType::automatic}),
    [](const auto& info) {
      return to_string(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param)) + "_P" +
             std::to_string(std::get<2>(info.param)) + "_" +
             (std::get<3>(info.param) == "zipf:1.2" ? std::string("zipf") : std::get<3>(info.param)) + "_dy_" +
             to_string(std::get<4>(info.param));
    });
