// Mixed precision through the whole trainer on simulated devices: overflow injected into one
// device's gradient shard skips the step on every device without changing a single bit of
// parameters, master weights or moments (every ZeRO stage); the dynamic loss scale follows its
// backoff/growth schedule exactly; collapse stops with kDiverged or continues in bf16; bf16/fp16
// runs land within 2% of fp32 (the GPT and the MLP, which computes in 16 bits too); stages agree
// bit for bit in bf16; model-state memory follows the 2 + 2 + 12 ZeRO formulas.
#include <gtest/gtest.h>

#include "sanitizer.h"
#include "test_util.h"
#include "train_checks.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "comm/communicator.h"
#include "core/status.h"
#include "data/image_data.h"
#include "model/model.h"
#include "runtime/runtime.h"
#include "train/trainer.h"
#include "zero/engine.h"

namespace zt {
namespace {

constexpr bool kSanitized = test::kSanitized;

TrainConfig tiny(int devices, int stage, int steps, Precision p) {
  TrainConfig c = test_util::tiny_train_config(devices, stage, steps);
  if (kSanitized) test_util::set_sanitizer_shape(c);
  c.batch_size = 8;
  c.precision = p;
  test_util::set_length_independent_schedule(c);
  return c;
}

using test::expect_same_state;
using test::expect_train_error;
using test::same_bits;

TEST(MixedPrecision, OverflowOnOneDeviceSkipsTheStepEverywhereAndChangesNoBit) {
  const float kInf = std::numeric_limits<float>::infinity();
  const float values[] = {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()};
  for (int stage = 0; stage <= 3; ++stage) {
    TrainConfig base = tiny(2, stage, 3, Precision::kFp16);
    base.initial_scale = 256;  // no natural overflow in these few steps
    // 2 layers in release (the sanitizers' shape has 1): block 2, where the fault goes, is then
    // h.1, between the embeddings and ln_f. The skip does not depend on the depth; the 16 fp16 runs
    // of the 4-layer model took 20 s of CI.
    if (!kSanitized) base.overrides.layers = 2;
    const TrainResult before = train(base);
    ASSERT_TRUE(before.skipped_steps.empty());
    for (const float value : values) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", injected " + std::to_string(value));
      TrainConfig faulty = base;
      faulty.steps = 4;
      // Rank 1 only, a block in the middle of the model, into its gradient shard.
      faulty.test.gradient_faults.push_back({4, 1, 2, 3, value});
      const TrainResult after = train(faulty);
      ASSERT_EQ(after.skipped_steps, std::vector<int>{4});
      expect_same_state(before, after, "state after the skipped step 4 vs after step 3");
      EXPECT_FALSE(after.first_nonfinite.empty());
      // The skipped step ran at the initial scale.
      ASSERT_EQ(after.loss_scales.size(), 4u);
      EXPECT_EQ(after.loss_scales[3], 256.0f);
    }
  }
}

TEST(MixedPrecision, SkippedStepInBf16WithoutScalingChangesNoBit) {
  // bf16 has no loss scale: a NaN gradient (or loss) still skips the step on every device.
  for (int stage : {1, 3}) {
    TrainConfig base = tiny(2, stage, 2, Precision::kBf16);
    const TrainResult before = train(base);
    TrainConfig faulty = base;
    faulty.steps = 3;
    faulty.test.gradient_faults.push_back({3, 0, 1, 0, std::numeric_limits<float>::quiet_NaN()});
    const TrainResult after = train(faulty);
    ASSERT_EQ(after.skipped_steps, std::vector<int>{3}) << "stage " << stage;
    expect_same_state(before, after, "bf16 stage " + std::to_string(stage));
    EXPECT_EQ(after.loss_scales[2], 1.0f);
  }
}

TEST(MixedPrecision, DynamicScaleFollowsBackoffAndGrowthExactly) {
  TrainConfig c = tiny(2, 2, 12, Precision::kFp16);
  c.test.keep_final_params = false;
  c.initial_scale = 256;
  c.scale_window = 3;
  const float kInf = std::numeric_limits<float>::infinity();
  for (int s : {2, 6, 7}) c.test.gradient_faults.push_back({s, s % 2, 0, 1, kInf});
  const TrainResult r = train(c);
  ASSERT_EQ(r.skipped_steps, (std::vector<int>{2, 6, 7}));
  // Scale used by each step, worked out by hand: halve after an overflow, double after 3 clean
  // steps in a row (the count restarts at every change).
  const std::vector<float> expect = {256, 256, 128, 128, 128, 256, 128, 64, 64, 64, 128, 128};
  EXPECT_EQ(r.loss_scales, expect);

  // Hysteresis 2: the first overflow of a run keeps the scale, the second halves it.
  c.scale_hysteresis = 2;
  const TrainResult h = train(c);
  ASSERT_EQ(h.skipped_steps, (std::vector<int>{2, 6, 7}));
  const std::vector<float> expect_h = {256, 256, 256, 256, 256, 512, 512, 256, 256, 256, 512, 512};
  EXPECT_EQ(h.loss_scales, expect_h);
}

TEST(MixedPrecision, ScaleCollapseStopsWithDivergedOrContinuesInBf16) {
  // A scale so large that fp16 gradients always overflow, and no room to back off.
  TrainConfig c = tiny(2, 2, 6, Precision::kFp16);
  c.test.keep_final_params = false;
  c.initial_scale = c.min_scale = c.max_scale = 1e9f;
  expect_train_error(c, ErrorKind::kDiverged, "collapsed");
  c.on_scale_collapse_bf16 = true;
  const TrainResult r = train(c);
  EXPECT_EQ(r.switched_to_bf16_at, 1);
  EXPECT_EQ(r.precision, "bf16");
  EXPECT_EQ(r.skipped_steps, std::vector<int>{1});
  EXPECT_LT(r.losses.back(), r.losses.front()) << "it trains on in bf16";
}

TEST(MixedPrecision, TooManyConsecutiveSkippedStepsStop) {
  TrainConfig c = tiny(1, 0, 8, Precision::kBf16);
  c.test.keep_final_params = false;
  c.max_skipped_steps = 2;
  for (int s = 2; s <= 5; ++s) c.test.gradient_faults.push_back({s, 0, 0, 0, std::numeric_limits<float>::quiet_NaN()});
  expect_train_error(c, ErrorKind::kDiverged, "3 consecutive steps");
}

TEST(MixedPrecision, Bf16StagesAgreeBitForBit) {
  const int kSteps = kSanitized ? 3 : 10;
  auto config = [&](int stage) {
    TrainConfig c = tiny(4, stage, kSteps, Precision::kBf16);
    c.weight_decay = 0.1f;  // per-tensor decay in the fused update's lists
    return c;
  };
  const TrainResult s0 = train(config(0));
  for (int stage = 1; stage <= 3; ++stage) {
    const TrainResult s = train(config(stage));
    EXPECT_EQ(s.losses, s0.losses) << "stage " << stage;
    expect_same_state(s0, s, "bf16 stage " + std::to_string(stage) + " vs stage 0");
  }
}

// One data rank (one GPU): stages 2 and 3 round each block's gradient straight into the shard
// accumulator at the first micro-batch (the reduce-scatter moves nothing, so no bucket copy) and
// add later micro-batches from the bucket; both keep stage 0's bits, with one micro-batch, and with
// two and half of each shard's update offloaded (its gradient copied to the host from the
// accumulator). Stages 0-1 do not take that path (their bucket is the accumulator).
TEST(MixedPrecision, Bf16OneDeviceStagesAgreeBitForBit) {
  const int kSteps = kSanitized ? 2 : 3;
  for (const bool accumulate_offload : {false, true}) {
    auto config = [&](int stage) {
      TrainConfig c = tiny(1, stage, kSteps, Precision::kBf16);
      if (accumulate_offload) {
        c.micro_batch_size = 4;  // 2 micro-batches of the 8 sequences
        c.offload_optimizer = stage > 0, c.offload_fraction = 0.5f;
      }
      return c;
    };
    const TrainResult s0 = train(config(0));
    for (int stage : {2, 3}) {
      const std::string what = "bf16 stage " + std::to_string(stage) +
                               (accumulate_offload ? ", 2 micro-batches, offload" : "") + " vs stage 0";
      const TrainResult s = train(config(stage));
      EXPECT_EQ(s.losses, s0.losses) << what;
      expect_same_state(s0, s, what);
    }
  }
}

// gpt-tiny with 2 layers, not 4: half the time (this was CI's longest test, 140 s), and 400 steps
// reach a lower loss (1.22, 4 layers 1.28; bf16 +0.03%, fp16 +0.9% from fp32). The bound still
// catches what it is for: with the fp32 master weights removed (each update rounded to bf16) bf16
// lands 5.3% above fp32 (4 layers: 4.8%). Not fewer steps: at 300 fp16 is still 8% behind fp32,
// not yet at the floor; not 1 layer: its runs end 3% apart by chance.
TEST(MixedPrecision, Bf16AndFp16LandWithinTwoPercentOfFp32) {
  if (kSanitized) GTEST_SKIP() << "a convergence run; too slow under sanitizers";
  TrainConfig c = tiny(2, 2, 400, Precision::kFp32);
  c.overrides.layers = 2;
  c.test.keep_final_params = false;
  c.schedule = LrSchedule::kCosine;
  c.lr = -1, c.warmup_steps = -1;  // the default job's learning rate and warmup
  auto tail = [](const TrainResult& r) {  // mean of the last 20 steps: one step's loss is noisy
    double s = 0;
    for (size_t i = r.losses.size() - 20; i < r.losses.size(); ++i) s += r.losses[i];
    return s / 20;
  };
  const TrainResult fp32 = train(c);
  c.precision = Precision::kBf16;
  const TrainResult bf16 = train(c);
  c.precision = Precision::kFp16;
  c.scale_window = 50;
  const TrainResult fp16 = train(c);
  EXPECT_NEAR(tail(bf16) / tail(fp32), 1.0, 0.02) << tail(bf16) << " vs " << tail(fp32);
  EXPECT_NEAR(tail(fp16) / tail(fp32), 1.0, 0.02) << tail(fp16) << " vs " << tail(fp32);
  bool grew = false;
  for (size_t i = 1; i < fp16.loss_scales.size(); ++i) grew = grew || fp16.loss_scales[i] > fp16.loss_scales[i - 1];
  EXPECT_TRUE(grew) << "the fp16 scale never grew";
  EXPECT_LT(fp32.losses.back(), fp32.losses.front() - 1.0) << "it trains";
}

// The default MLP job (zerotrain train --model mlp --data fashion-mnist: 784-256-128-10, AdamW,
// batch 128) on 2 devices in bf16 computes in 16 bits (its workspace is the bf16 model's) and lands
// where fp32 does: the mean of the last 20 steps' losses within 2% of fp32's (the bound the GPT's
// bf16 run meets above). The runs see the same batches, so the difference is precision, not data:
// rounding the working parameters (2^-8 relative) and activations once per layer moves each step's
// loss by well under 1% of it, and 300 steps of AdamW do not amplify that past 2%.
TEST(MixedPrecision, Bf16MlpLandsWithinTwoPercentOfFp32) {
  if (kSanitized) GTEST_SKIP() << "a convergence run; too slow under sanitizers";
  if (!std::filesystem::exists(kFashionMnistDir)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TrainConfig c = test_util::tiny_train_config(2, 2, 300);
  c.model = "mlp";
  c.data = "fashion-mnist";
  c.lr = -1, c.warmup_steps = -1;  // the default job's learning rate and warmup
  c.test.keep_final_params = false;
  auto tail = [](const TrainResult& r) {
    double s = 0;
    for (size_t i = r.losses.size() - 20; i < r.losses.size(); ++i) s += r.losses[i];
    return s / 20;
  };
  const TrainResult fp32 = train(c);
  c.precision = Precision::kBf16;
  const TrainResult bf16 = train(c);
  const int micro = 64;  // 128 over 2 devices
  const ModelConfig mc = make_model_config("mlp");
  ASSERT_EQ(bf16.activation_bytes_per_device.size(), 2u);
  EXPECT_EQ(bf16.activation_bytes_per_device[0], make_model(mc, Recompute::kNone, {}, DType::kBF16)->workspace_bytes(micro, 1));
  EXPECT_EQ(fp32.activation_bytes_per_device[0], make_model(mc)->workspace_bytes(micro, 1));
  EXPECT_NEAR(tail(bf16) / tail(fp32), 1.0, 0.02) << tail(bf16) << " vs " << tail(fp32);
  EXPECT_NE(bf16.losses, fp32.losses);
  EXPECT_LT(fp32.losses.back(), fp32.losses.front() - 1.0) << "it trains";
  // The final evaluation reads the bf16 logits (widened) for its accuracy: 10000 test images, so
  // two runs this close in loss agree within a few hundred predictions.
  ASSERT_TRUE(bf16.accuracy && fp32.accuracy);
  EXPECT_GT(*fp32.accuracy, 0.75);
  EXPECT_NEAR(*bf16.accuracy, *fp32.accuracy, 0.02);
}

TEST(MixedPrecision, StochasticRoundingIsReproducibleAndDiffersFromNearest) {
  TrainConfig c = tiny(2, 1, 3, Precision::kBf16);
  c.stochastic_rounding = true;
  const TrainResult a = train(c), b = train(c);
  expect_same_state(a, b, "two stochastic-rounding runs with one seed");
  c.stochastic_rounding = false;
  const TrainResult n = train(c);
  EXPECT_FALSE(same_bits(a.final_working, n.final_working));
  // The working parameters stay within one bf16 step of the master either way.
  for (size_t blk = 0; blk < a.final_params.size(); ++blk)
    for (size_t i = 0; i < a.final_params[blk].size(); ++i) {
      const float m = a.final_params[blk][i], w = a.final_working[blk][i];
      ASSERT_LE(std::fabs(m - w), std::fabs(m) * (1.0f / 128) + 1e-30f) << "block " << blk << " element " << i;
    }
}

TEST(MixedPrecision, ModelStateBytesFollowTheTwoTwoTwelveFormulas) {
  const ModelConfig mc = make_model_config("gpt-tiny");
  auto model = make_model(mc);
  const double psi = static_cast<double>(model->layout().total_parameters());
  for (int n : {2, 4}) {
    auto rt = Runtime::create_cpu(n);
    std::vector<Device*> devs;
    for (int r = 0; r < n; ++r) devs.push_back(&rt->device(r));
    Communicator comm(devs);
    for (DType w : {DType::kBF16, DType::kF16}) {
      for (int stage = 0; stage <= 3; ++stage) {
        ZeroOptions o;
        o.stage = stage;
        o.working = w;
        ZeroEngine engine(*model, devs, comm, o);
        const double formula[] = {16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n};
        // Tensor alignment and shard padding: at most (16 + n*16) elements per block, 16 bytes each.
        const double slack = static_cast<double>(model->layout().num_blocks()) * (16.0 + 16.0 * n) * 16;
        for (int r = 0; r < n; ++r) {
          const ModelStateBytes b = engine.rank(r).model_state_bytes();
          const double got = static_cast<double>(b.total());
          EXPECT_GE(got, formula[stage] * 0.999) << "stage " << stage << " N=" << n;
          EXPECT_LE(got, formula[stage] + slack) << "stage " << stage << " N=" << n;
          // 16-bit parameters; fp32 master + moments in the shard.
          EXPECT_LE(static_cast<double>(b.params), (stage == 3 ? 2 * psi / n : 2 * psi) + slack);
          EXPECT_GE(static_cast<double>(b.optimizer), (stage == 0 ? 12 * psi : 12 * psi / n) * 0.999);
        }
      }
    }
  }
}

}  // namespace
}  // namespace zt
