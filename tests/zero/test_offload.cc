// Optimizer offload (--offload optimizer, --offload-fraction) through the whole trainer: per-step
// losses and final master weights, working parameters and moments bitwise equal to the device
// optimizer at stages 1-3, fp32 and bf16, with clipping, accumulation, uneven shards, SGD, an
// injected overflow, fp16 dynamic scaling and the switch to bf16 after a collapse; device optimizer
// bytes drop by the offloaded part and the host arena holds what the plan says; the trace and the
// summary show the host update; stage 0 is refused with one sentence. --offload-delay-update: the
// stages agree, it follows an independent float64 loop with one-step-stale gradients, and a
// checkpoint resumes it bit for bit.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "sanitizer.h"
#include "stage_fixtures.h"
#include "test_util.h"
#include "train_checks.h"

#include "comm/communicator.h"
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
  for (const bool delay : {false, true}) {
    TrainConfig c = tiny(2, 2, 2, Precision::kBf16);
    c.offload_optimizer = true;
    c.offload_delay_update = delay;
    c.test.zero_trace = true;
    SCOPED_TRACE(delay ? "delayed update" : "update in its step");
    const TrainResult r = train(c);
    int spans = 0;
    for (const TraceSpan& s : r.trace)
      if (s.kind == TraceSpan::kHostOptimizer) {
        ++spans;
        EXPECT_GE(s.end_us, s.start_us);
      }
    EXPECT_EQ(spans, 2 * 2) << "one host update per rank per step";
    // The whole host time, and of it the part the devices waited for (the delayed update's last
    // step is waited for when the final state is read, after the last step's timing).
    EXPECT_GT(r.time_split.host_optimizer_total, 0.0);
    EXPECT_GE(r.time_split.host_optimizer, 0.0);
    EXPECT_LE(r.time_split.host_optimizer, r.time_split.host_optimizer_total);
  }
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

// --offload-delay-update: the host update of step k runs during step k+1, whose forward and
// backward use the parameters from before it. Every stage still computes the same bits as the
// others (the delay is the same everywhere), and they are not the bits of the update in its step.
TEST(OffloadDelay, StagesAgreeBitwiseAndDifferFromTheUpdateInItsStep) {
  TrainConfig c = tiny(2, 1, 4, Precision::kBf16);
  c.offload_optimizer = true;
  const TrainResult now = train(c);
  c.offload_delay_update = true;
  const TrainResult first = train(c);
  // Steps 1 and 2 both run at the initial parameters: step 1 is the same as without the delay.
  ASSERT_EQ(first.losses.size(), now.losses.size());
  EXPECT_EQ(first.losses[0], now.losses[0]);
  EXPECT_NE(first.losses[1], now.losses[1]);
  EXPECT_FALSE(test::same_bits(first.final_params, now.final_params));
  // Stage 2 updates and all-gathers as stage 1 does; stage 3 gathers each block before its use.
  c.zero_stage = 3;
  const TrainResult third = train(c);
  EXPECT_EQ(third.losses, first.losses);
  expect_same_state(third, first, "delayed update, stage 3 vs 1");
}

// A checkpoint applies the pending update before it saves (the step after it uses the updated
// parameters, as a resumed run does): resuming continues bit for bit.
TEST(OffloadDelay, ResumeFromACheckpointIsBitExact) {
  const test_util::TempDir dir("offload_delay");
  TrainConfig whole = tiny(2, 3, 5, Precision::kBf16);
  whole.offload_optimizer = true;
  whole.offload_delay_update = true;
  whole.checkpoint_dir = dir.path("run");
  whole.save_every = 3;
  whole.keep = 0;
  const TrainResult full = train(whole);
  ASSERT_EQ(full.checkpoints.size(), 2u);
  TrainConfig resumed = whole;
  resumed.checkpoint_dir.clear();
  resumed.resume = ResumeFrom::checkpoint(full.checkpoints[0]);
  const TrainResult rest = train(resumed);
  ASSERT_EQ(rest.losses.size(), 2u);
  for (size_t k = 0; k < rest.losses.size(); ++k) EXPECT_EQ(rest.losses[k], full.losses[3 + k]) << "step " << 4 + k;
  expect_same_state(rest, full, "resumed vs continued");
}

// The delayed update against an independent float64 loop: SGD with momentum on one device, where
// step k's gradient is taken by the model on resident parameters (no engine) at the parameters of
// two updates before, p_{k-2} (p_{-1} = p_0), and applied to p_{k-1} in double precision. The same
// loop with p_{k-1} (no delay) is far from the engine's result: the check can tell the two apart.
TEST(OffloadDelay, SgdFollowsAFloat64LoopWhoseGradientsAreOneStepStale) {
  using stage_test::Blocks;
  const ModelConfig mc = stage_test::tiny_config();
  constexpr int kSteps = 4;
  constexpr float kLr = 0.5f, kMomentum = 0.9f;
  const float dloss = stage_test::dloss_of(1);
  auto rt = Runtime::create_cpu(2);  // device 0: the engine; device 1: the reference
  const auto model = make_model(mc);
  const ParamLayout& L = model->layout();
  const Blocks p0 = init_blocks(L, 7);
  // The engine: one device, stage 1, everything offloaded, the update delayed.
  Device& d = rt->device(0);
  std::vector<Device*> devs{&d};
  Communicator comm(devs);
  ZeroOptions zo;
  zo.stage = 1;
  zo.sgd = true;
  zo.offload = true;
  zo.offload_delay = true;
  ZeroEngine engine(*model, devs, comm, zo);
  engine.rank(0).load_parameters(p0);
  {
    stage_test::DeviceBatches db(mc, d, kSteps);
    const auto ws = model->make_workspace(d, stage_test::kB, stage_test::kT);
    DeviceBuffer norms(d.memory(), static_cast<size_t>(2 * L.num_blocks()) * 4, d.compute(), "norms");
    Stream& s = d.compute();
    ZeroRank& R = engine.rank(0);
    for (int k = 0; k < kSteps; ++k) {
      Batch b = db.batches[static_cast<size_t>(k)];
      b.loss_scale = R.scaler().scale_device();
      R.begin_micro_batch(0);
      model->forward(s, R, *ws, b, dloss, true);
      model->backward(s, R, *ws, b);
      R.end_micro_batch();
      R.check_gradients(norms.as<float>());
      OptimizerStep os;
      os.adamw = false;
      os.lr = kLr;
      os.momentum = kMomentum;
      os.step = k + 1;
      R.optimizer_step(os);
    }
    d.synchronize();
  }
  Blocks got;
  for (int b = 0; b < L.num_blocks(); ++b) got.push_back(engine.master_to_host(b));  // applies the pending update

  // The reference: gradients of the model on resident parameters, SGD in double.
  Device& d2 = rt->device(1);
  ResidentParams rp(d2, L, p0);
  stage_test::DeviceBatches db2(mc, d2, kSteps);
  const auto ws2 = model->make_workspace(d2, stage_test::kB, stage_test::kT);
  auto reference = [&](bool delayed) {
    std::vector<std::vector<double>> p, buf;
    for (const auto& blk : p0) p.emplace_back(blk.begin(), blk.end()), buf.emplace_back(blk.size(), 0.0);
    std::vector<Blocks> history{p0};  // p_0, p_1, ... in fp32, as the model reads them
    for (int k = 0; k < kSteps; ++k) {
      const Blocks& at = history[static_cast<size_t>(delayed ? std::max(k - 1, 0) : k)];
      rp.load([&](int b) -> const std::vector<float>& { return at[static_cast<size_t>(b)]; });
      const Batch& bt = db2.batches[static_cast<size_t>(k)];
      model->forward(d2.compute(), rp, *ws2, bt, dloss, true);
      model->backward(d2.compute(), rp, *ws2, bt);
      Blocks next;
      for (int b = 0; b < L.num_blocks(); ++b) {
        const std::vector<float> g = rp.grad_host(b);
        auto& pb = p[static_cast<size_t>(b)];
        auto& mb = buf[static_cast<size_t>(b)];
        for (size_t i = 0; i < pb.size(); ++i) {
          mb[i] = kMomentum * mb[i] + g[i];
          pb[i] -= kLr * mb[i];
        }
        next.emplace_back(pb.begin(), pb.end());
      }
      history.push_back(std::move(next));
    }
    return p;
  };
  const auto stale = reference(true), fresh = reference(false);
  for (int b = 0; b < L.num_blocks(); ++b) {
    const auto& g = got[static_cast<size_t>(b)];
    const auto& want = stale[static_cast<size_t>(b)];
    const auto& other = fresh[static_cast<size_t>(b)];
    double moved = 0, err = 0, apart = 0;  // largest movement from p_0, error, distance to the undelayed loop
    for (size_t i = 0; i < g.size(); ++i) {
      moved = std::max(moved, std::fabs(want[i] - p0[static_cast<size_t>(b)][i]));
      err = std::max(err, std::fabs(g[i] - want[i]));
      apart = std::max(apart, std::fabs(g[i] - other[i]));
    }
    SCOPED_TRACE("block " + L.block(b).name);
    ASSERT_GT(moved, 0.0);
    EXPECT_LE(err, 3e-5 * moved + 1e-7);  // fp32 steps against double: ~1e-7 here
    EXPECT_GT(apart, 1e-2 * moved) << "the undelayed loop lands as close: the test cannot tell them apart";
  }
}

TEST(OffloadDelay, NeedsOffload) {
  TrainConfig c = tiny(2, 2, 1, Precision::kFp32);
  c.offload_delay_update = true;
  expect_train_error(c, ErrorKind::kInvalidArgument, "--offload-delay-update needs --offload optimizer");
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
