// Optimizer offload (--offload optimizer, --offload-fraction) through the whole trainer: per-step
// losses and final master weights, working parameters and moments bitwise equal to the device
// optimizer at stages 1-3, fp32 and bf16, with clipping, accumulation, uneven shards, SGD, an
// injected overflow, fp16 dynamic scaling and the switch to bf16 after a collapse; device optimizer
// bytes drop by the offloaded part and the host arena holds what the plan says; the trace and the
// summary show the host update; stage 0 is refused with one sentence.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "sanitizer.h"
#include "test_util.h"
#include "train_checks.h"

#include "core/status.h"
#include "kernels/multi_tensor_elem.h"
#include "optimizers/optimizers.h"
#include "runtime/runtime.h"
#include "train/plan.h"
#include "train/trainer.h"
#include "zero/engine.h"

namespace zt {
namespace {

constexpr bool kSanitized = test::kSanitized;
// Fraction 0.5 has a host and a device part; 1 adds the empty device buffers. Sanitizer runs (CI,
// 2 cores) keep the first.
const std::vector<float> kFractions = kSanitized ? std::vector<float>{0.5f} : std::vector<float>{1.0f, 0.5f};

using test::expect_same_state;
using test::expect_train_error;

TrainConfig tiny(int devices, int stage, int steps, Precision p) {
  TrainConfig c = test_util::tiny_train_config(devices, stage, steps);
  test_util::set_sanitizer_shape(c, 2);
  c.batch_size = 12;
  c.precision = p;
  c.grad_clip = 0.05f;  // below the gradients' norm: every step clips
  test_util::set_length_independent_schedule(c);
  return c;
}

std::string name(const TrainConfig& c) {
  return c.devices + " stage " + std::to_string(c.zero_stage) + " " +
         (c.precision == Precision::kFp32 ? "fp32" : c.precision == Precision::kBf16 ? "bf16" : "fp16") +
         " micro " + std::to_string(c.micro_batch_size) + (c.offload_optimizer ? " offload " + std::to_string(c.offload_fraction) : "");
}

// The run with offload equals the run without, bit for bit.
void expect_offload_equals_device(TrainConfig c, const std::vector<float>& fractions) {
  c.offload_optimizer = false;
  const TrainResult device = train(c);
  for (const float f : fractions) {
    TrainConfig o = c;
    o.offload_optimizer = true;
    o.offload_fraction = f;
    SCOPED_TRACE(name(o));
    const TrainResult host = train(o);
    ASSERT_EQ(host.losses.size(), device.losses.size());
    for (size_t i = 0; i < host.losses.size(); ++i) EXPECT_EQ(host.losses[i], device.losses[i]) << "step " << i + 1;
    EXPECT_EQ(host.skipped_steps, device.skipped_steps);
    EXPECT_EQ(host.loss_scales, device.loss_scales);
    expect_same_state(host, device, "offload vs device optimizer");
  }
}

TEST(Offload, BitsEqualTheDeviceOptimizerAtEveryStageInFp32AndBf16) {
  for (Precision p : {Precision::kFp32, Precision::kBf16})
    for (int stage = 1; stage <= 3; ++stage) expect_offload_equals_device(tiny(2, stage, 3, p), kFractions);
}

TEST(Offload, BitsHoldWithAccumulationUnevenShardsAndSgd) {
  TrainConfig c = tiny(3, 2, 3, Precision::kBf16);  // 3 ranks: the last rank's shard is padded
  c.micro_batch_size = 2;                           // two micro-batches per step
  expect_offload_equals_device(c, kSanitized ? std::vector<float>{0.3f} : std::vector<float>{1.0f, 0.3f});
  c = tiny(4, 1, 3, Precision::kFp32);
  c.micro_batch_size = 1;
  c.optimizer = OptimizerKind::kSgd;
  expect_offload_equals_device(c, {1.0f});
  c = tiny(6, 3, 3, Precision::kBf16);  // ranks 4 and 5 hold no element of the 64-element blocks
  expect_offload_equals_device(c, {0.5f});
  c = tiny(2, 3, 3, Precision::kBf16);
  c.stochastic_rounding = true;  // the host draws the same Philox bits for the same elements
  expect_offload_equals_device(c, {0.5f});
}

TEST(Offload, OverflowSkipsTheHostUpdateTooAndFp16DynamicScalingIsUnchanged) {
  const float kInf = std::numeric_limits<float>::infinity();
  for (int stage = 1; stage <= 3; ++stage) {
    TrainConfig c = tiny(2, stage, 5, Precision::kFp16);
    c.initial_scale = 256;
    c.scale_window = 2;  // the scale grows and backs off within the run
    c.test.gradient_faults.push_back({3, 1, 2, 0, kInf});  // rank 1, offloaded element 0 of block 2
    c.test.gradient_faults.push_back({4, 0, 1, 5, std::numeric_limits<float>::quiet_NaN()});
    TrainConfig probe = c;
    probe.offload_optimizer = true;
    const TrainResult r = train(probe);
    ASSERT_EQ(r.skipped_steps, (std::vector<int>{3, 4}));
    expect_offload_equals_device(c, kFractions);
  }
}

TEST(Offload, SwitchingToBf16AfterAScaleCollapseDerivesTheSameParameters) {
  // fp16 gradients always overflow at this scale; --on-scale-collapse bf16 re-derives the 16-bit
  // parameters from the fp32 master, part of which is on the host.
  for (int stage = kSanitized ? 3 : 1; stage <= 3; ++stage) {
    TrainConfig c = tiny(2, stage, 4, Precision::kFp16);
    c.initial_scale = c.min_scale = c.max_scale = 1e9f;
    c.on_scale_collapse_bf16 = true;
    TrainConfig probe = c;
    probe.offload_optimizer = true;
    const TrainResult r = train(probe);
    ASSERT_EQ(r.switched_to_bf16_at, 1);
    expect_offload_equals_device(c, kFractions);
  }
}

TEST(Offload, SkippedStepLeavesTheOffloadedStateUnchanged) {
  // A run of 3 steps and the same run with a 4th step that overflows: the same state.
  TrainConfig c = tiny(2, 2, 3, Precision::kBf16);
  c.offload_optimizer = true;
  c.offload_fraction = 0.5f;
  const TrainResult before = train(c);
  c.steps = 4;
  c.test.gradient_faults.push_back({4, 0, 1, 0, std::numeric_limits<float>::quiet_NaN()});
  const TrainResult after = train(c);
  ASSERT_EQ(after.skipped_steps, std::vector<int>{4});
  expect_same_state(before, after, "after the skipped step vs before it");
}

TEST(Offload, DeviceOptimizerBytesDropAndTheHostArenaHoldsWhatThePlanSays) {
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    for (const float f : {1.0f, 0.5f}) {
      TrainConfig c = tiny(2, 2, 1, p);
      const TrainResult device = train(c);
      c.offload_optimizer = true;
      c.offload_fraction = f;
      SCOPED_TRACE(name(c));
      const TrainResult host = train(c);
      const ModelConfig mc = make_model_config(c.model, c.overrides);
      PlanInputs in;
      in.devices = 2;
      in.zero_stage = 2;
      in.micro_batch = c.batch_size / 2;
      in.seq_len = mc.seq_len;
      in.working = p == Precision::kBf16 ? DType::kBF16 : DType::kF32;
      in.offload = true;
      in.offload_fraction = f;
      const MemoryPlan plan = plan_memory(mc, in);
      const std::string text = format_plan(mc, plan);
      EXPECT_NE(text.find("host (offloaded optimizer, " + std::to_string(static_cast<int>(f * 100)) + "% of each shard): " +
                          format_plan_bytes(plan.per_device[0].host) + " per device"),
                std::string::npos)
          << text;
      const auto model = make_model(mc);
      // Independent count: per rank, f of its shard's parameters keep 12 bytes on the host (fp32
      // master and two moments) plus copies of the gradient (and, bf16, of the working
      // parameters); the device drops 12 bytes each in bf16, 8 in fp32 (where the device's
      // parameters are the master).
      const double psi = static_cast<double>(model->layout().total_parameters()) / 2;
      const bool bf16 = p == Precision::kBf16;
      const double w = bf16 ? 2 : 4, k = 12, dropped_per = bf16 ? 12 : 8;
      for (int r = 0; r < 2; ++r) {
        const size_t measured = host.host_peak_bytes_per_device[static_cast<size_t>(r)];
        EXPECT_EQ(measured, plan.per_device[static_cast<size_t>(r)].host);
        const double expect = f * psi * (k + w * (bf16 ? 2 : 1));
        EXPECT_NEAR(static_cast<double>(measured) / expect, 1.0, 0.05);
        EXPECT_EQ(device.host_peak_bytes_per_device[static_cast<size_t>(r)], 0u);
        // The device keeps the rest of the optimizer state: the model-state bytes drop by what the
        // host holds of it (master and moments; not the gradient/parameter copies).
        const double dropped = static_cast<double>(device.model_state_bytes_per_device[static_cast<size_t>(r)] -
                                                   host.model_state_bytes_per_device[static_cast<size_t>(r)]);
        EXPECT_NEAR(dropped / (f * psi * dropped_per), 1.0, 0.05);
        EXPECT_LT(host.peak_bytes_per_device[static_cast<size_t>(r)], device.peak_bytes_per_device[static_cast<size_t>(r)]);
      }
    }
  }
}

TEST(Offload, TheTraceShowsTheHostOptimizerAndTheSummaryItsTime) {
  TrainConfig c = tiny(2, 2, 2, Precision::kBf16);
  c.offload_optimizer = true;
  c.test.zero_trace = true;
  const TrainResult r = train(c);
  int spans = 0;
  for (const TraceSpan& s : r.trace)
    if (s.kind == TraceSpan::kHostOptimizer) {
      ++spans;
      EXPECT_GE(s.end_us, s.start_us);
    }
  EXPECT_EQ(spans, 2 * 2) << "one host update per rank per step";
  EXPECT_GT(r.time_split.host_optimizer, 0.0);
  EXPECT_LE(r.time_split.host_optimizer, r.time_split.optimizer);
}

TEST(Offload, StageZeroAndBadFractionsAreRefusedWithOneSentence) {
  TrainConfig c = tiny(2, 0, 1, Precision::kFp32);
  c.offload_optimizer = true;
  expect_train_error(c, ErrorKind::kInvalidArgument, "--offload optimizer needs --zero-stage 1, 2 or 3");
  c.zero_stage = 2;
  for (float f : {0.0f, 1.5f}) {
    c.offload_fraction = f;
    expect_train_error(c, ErrorKind::kInvalidArgument, "--offload-fraction must be in (0, 1]");
  }
}

TEST(Offload, HostAdamWEqualsTheStreamOpBitwise) {
  // The host update against the CPU backend's adamw_multi on the same fresh random inputs.
  const int64_t n = optim::kMultiTensorChunk + 37;  // more than one chunk, an odd tail
  std::vector<float> g(static_cast<size_t>(n)), master(g.size()), m(g.size()), v(g.size());
  uint32_t x = 12345;
  auto rnd = [&] {
    x = x * 1664525u + 1013904223u;
    return static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
  };
  for (size_t i = 0; i < g.size(); ++i) g[i] = rnd(), master[i] = rnd(), m[i] = rnd() * 0.1f, v[i] = rnd() * rnd();
  auto run = [&](bool host) {
    std::vector<float> w = master, mm = m, vv = v;
    std::vector<optim::OptimizerSegment> segs{{w.data(), g.data(), w.data(), mm.data(), vv.data(), n, 0.1f, 0}};
    const optim::AdamWConfig hp{1e-3f, 0.9f, 0.95f, 1e-8f, 3};
    optim::StepScalars sc;
    const float clip = 0.75f;  // host memory: the host update and the CPU backend's device both read it
    sc.clip = &clip;
    if (host) {
      optim::adamw_host(segs, DType::kF32, DType::kF32, hp, sc);
    } else {
      auto rt = Runtime::create_cpu(1);
      Stream& s = rt->device(0).compute();
      optim::adamw_multi(s, {segs, nullptr}, DType::kF32, DType::kF32, hp, sc);
      s.synchronize();
    }
    w.insert(w.end(), mm.begin(), mm.end());
    w.insert(w.end(), vv.begin(), vv.end());
    return w;
  };
  const std::vector<float> a = run(true), b = run(false);
  EXPECT_TRUE(test::same_bits({a}, {b}));
  EXPECT_FALSE(test::same_bits({a}, {master}));
}

}  // namespace
}  // namespace zt
