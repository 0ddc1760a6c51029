// The tiled (flash-style) attention ops of kernels/ops.h on every available backend: forward
// (out, lse) and backward (dqkv +=) against the float64 reference and against today's
// attention_forward/backward, bits independent of the thread count, no pool allocation.
// Tolerances: kTolReduce, as test_ops.cc explains (fp32 sums over up to T * hs terms).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <vector>

#include "core/status.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "memory/caching_allocator.h"
#include "op_test_util.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

using namespace op_test;  // NOLINT(build/namespaces): the helpers shared by the op test binaries
using ::testing::HasSubstr;

class FlashAttentionTest : public OpsFixture {};

struct Case {
  int64_t B, T, C, NH;
};
// The T values at head size 16 (T = 7 and 257 leave a partial tile), plus head sizes that
// are odd or small (hs = 3, 5) and B > 1.
const Case kCases[] = {{1, 1, 32, 2},    {2, 7, 32, 2},   {1, 64, 32, 2}, {1, 257, 32, 2},
                       {1, 1024, 32, 2}, {2, 65, 15, 5},  {3, 130, 9, 3}};

// lse of the reference scores: log sum_{t2 <= t} exp(pre[t, t2]).
DVec reference_lse(const DVec& pre, int64_t BH, int64_t T) {
  DVec lse(static_cast<size_t>(BH * T));
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t t = 0; t < T; ++t) {
      const double* row = &pre[(bh * T + t) * T];
      double mx = -INFINITY, sum = 0;
      for (int64_t t2 = 0; t2 <= t; ++t2) mx = std::max(mx, row[t2]);
      for (int64_t t2 = 0; t2 <= t; ++t2) sum += std::exp(row[t2] - mx);
      lse[bh * T + t] = mx + std::log(sum);
    }
  return lse;
}

int64_t scratch_floats(int64_t B, int64_t T, int64_t C, int64_t NH) {
  return static_cast<int64_t>(ops::flash_attention_scratch_bytes(B, T, C, NH) / sizeof(float));
}

TEST_P(FlashAttentionTest, MatchesReferenceAndTodaysAttention) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " C=" << c.C
                                      << " NH=" << c.NH);
    const int64_t B = c.B, T = c.T, C = c.C, NH = c.NH;
    const int nh = static_cast<int>(NH);
    const FVec qkv = rng_.normal(B * T * 3 * C, 1.5f), dout = rng_.normal(B * T * C),
               dqkv0 = rng_.normal(B * T * 3 * C);
    DevTensor tqkv = tensor(qkv, {B, T, 3 * C}), tdout = tensor(dout, {B, T, C});

    // Outputs and scratch poisoned: every element must be written (or, for scratch, ignored).
    DevTensor out = poisoned({B, T, C}), lse = poisoned({B, NH, T});
    ops::flash_attention_forward(s(), out, lse, tqkv, nh);
    DevTensor dqkv = tensor(dqkv0, {B, T, 3 * C});
    DevTensor scratch = poisoned({scratch_floats(B, T, C, NH)});
    ops::flash_attention_backward(s(), dqkv, tdout, tqkv, out, lse, nh, scratch);

    DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
    ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
    DVec r_dqkv = to_d(dqkv0);
    ref::attention_backward_ref(r_dqkv, to_d(dout), to_d(qkv), r_att, B, T, C, NH);
    const FVec got_out = out.f(), got_dqkv = dqkv.f();
    EXPECT_TRUE(close(got_out, r_out, kTolReduce)) << "out vs float64";
    EXPECT_TRUE(close(lse.f(), reference_lse(r_pre, B * NH, T), kTolReduce)) << "lse vs float64";
    EXPECT_TRUE(close(got_dqkv, r_dqkv, kTolReduce)) << "dqkv vs float64";

    // Today's T x T ops on the same inputs.
    DevTensor t_out = poisoned({B, T, C}), pre = poisoned({B, NH, T, T}),
              att = poisoned({B, NH, T, T});
    ops::attention_forward(s(), t_out, pre, att, tqkv, nh);
    DevTensor t_dqkv = tensor(dqkv0, {B, T, 3 * C}), dpre = poisoned({B, NH, T, T}),
              datt = poisoned({B, NH, T, T});
    ops::attention_backward(s(), t_dqkv, dpre, datt, tdout, tqkv, att, nh);
    EXPECT_TRUE(close(got_out, to_d(t_out.f()), kTolReduce)) << "out vs attention_forward";
    EXPECT_TRUE(close(got_dqkv, to_d(t_dqkv.f()), kTolReduce)) << "dqkv vs attention_backward";
  }
}

// Scores far apart (a large q scale) and rows whose maximum moves late: the online softmax's
// rescaling must keep exp from overflowing and the result equal to the one-pass softmax.
TEST_P(FlashAttentionTest, LargeScoresRescaleWithoutOverflow) {
  const int64_t B = 1, T = 200, C = 8, NH = 1;
  FVec qkv = rng_.normal(B * T * 3 * C);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < C; ++i) qkv[t * 3 * C + i] *= 30.0f;                  // q
    for (int64_t i = 0; i < C; ++i) qkv[t * 3 * C + C + i] *= 0.2f + t / 20.0f;  // k grows with t
  }
  DevTensor tqkv = tensor(qkv, {B, T, 3 * C});
  DevTensor out = poisoned({B, T, C}), lse = poisoned({B, NH, T});
  ops::flash_attention_forward(s(), out, lse, tqkv, static_cast<int>(NH));
  DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
  ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
  EXPECT_TRUE(close(out.f(), r_out, kTolReduce));
  EXPECT_TRUE(close(lse.f(), reference_lse(r_pre, B * NH, T), kTolReduce));
}

// The backward takes no memory from the pool beyond the scratch it is given (the forward none).
TEST_P(FlashAttentionTest, AllocatesNothingBeyondItsScratch) {
  const int64_t B = 2, T = 300, C = 32, NH = 2;
  DevTensor tqkv = tensor(rng_.normal(B * T * 3 * C), {B, T, 3 * C}),
            tdout = tensor(rng_.normal(B * T * C), {B, T, C});
  DevTensor out = poisoned({B, T, C}), lse = poisoned({B, NH, T}),
            dqkv = tensor(FVec(B * T * 3 * C), {B, T, 3 * C});
  DevTensor scratch = poisoned({scratch_floats(B, T, C, NH)});
  EXPECT_EQ(ops::flash_attention_scratch_bytes(B, T, C, NH),
            static_cast<size_t>(B * NH * T) * sizeof(float));
  sync();
  const MemoryStats before = dev_->memory().stats();
  ops::flash_attention_forward(s(), out, lse, tqkv, static_cast<int>(NH));
  ops::flash_attention_backward(s(), dqkv, tdout, tqkv, out, lse, static_cast<int>(NH), scratch);
  sync();
  const MemoryStats after = dev_->memory().stats();
  EXPECT_EQ(after.num_allocs, before.num_allocs);
  EXPECT_EQ(after.peak_allocated_bytes, before.peak_allocated_bytes);
}

INSTANTIATE_TEST_SUITE_P(Backends, FlashAttentionTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

// ---- validation ----------------------------------------------------------------------------------

template <typename F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no zt::Error thrown";
  return Error(ErrorKind::kInternal, "none");
}

TEST(FlashAttentionValidation, ShapesAndScratchSizeAreChecked) {
  auto rt = Runtime::create_cpu(1);
  Device& dev = rt->device(0);
  Stream& s = dev.compute();
  auto make = [&](Shape shape) { return DevTensor(dev, s, DType::kF32, shape); };
  const int64_t B = 2, T = 5, C = 12, NH = 3;
  DevTensor qkv = make({B, T, 3 * C}), out = make({B, T, C}), lse = make({B, NH, T}),
            dqkv = make({B, T, 3 * C}), bad_lse = make({B, NH, T + 1});
  DevTensor short_scratch = make({scratch_floats(B, T, C, NH) - 1});
  Error e = error_of([&] { ops::flash_attention_forward(s, out, bad_lse, qkv, 3); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_THAT(e.message(), HasSubstr("flash_attention_forward: qkv [2, 5, 36] with 3 heads but lse "
                                     "[2, 3, 6] (need [2, 3, 5])"));
  e = error_of([&] { ops::flash_attention_forward(s, out, lse, qkv, 5); });
  EXPECT_THAT(e.message(), HasSubstr("5 heads do not divide"));
  e = error_of(
      [&] { ops::flash_attention_backward(s, dqkv, out, qkv, out, lse, 3, short_scratch); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_THAT(e.message(), HasSubstr("flash_attention_backward: scratch [29] holds 116 bytes but "
                                     "qkv [2, 5, 36] with 3 heads needs 120"));
}

// ---- determinism ---------------------------------------------------------------------------------

// Forward and backward outputs of a few shapes (partial tiles, many tasks) as bytes. The CPU
// backward runs one task per head when there are at least as many heads as threads, else two
// passes over tiles: B * NH = 2 at T = 1024 takes the first with 1 thread and the second with 3,
// so this also checks that both schedules give the same bits.
std::vector<uint8_t> flash_outputs(Device& dev) {
  Stream& s = dev.compute();
  Rng rng(test_seed() + 5);
  std::vector<uint8_t> bytes;
  const int64_t shapes[][4] = {{2, 257, 32, 2}, {1, 1024, 32, 2}, {3, 70, 15, 5}};
  for (const auto& sh : shapes) {
    const int64_t B = sh[0], T = sh[1], C = sh[2], NH = sh[3];
    auto make = [&](const FVec& host, Shape shape) {
      DevTensor t(dev, s, DType::kF32, shape);
      t.upload(host);
      return t;
    };
    DevTensor qkv = make(rng.normal(B * T * 3 * C), {B, T, 3 * C}),
              dout = make(rng.normal(B * T * C), {B, T, C}),
              dqkv = make(rng.normal(B * T * 3 * C), {B, T, 3 * C});
    DevTensor out = make(nan_vec(B * T * C), {B, T, C}), lse = make(nan_vec(B * NH * T), {B, NH, T});
    DevTensor scratch = make(nan_vec(scratch_floats(B, T, C, NH)), {scratch_floats(B, T, C, NH)});
    ops::flash_attention_forward(s, out, lse, qkv, static_cast<int>(NH));
    ops::flash_attention_backward(s, dqkv, dout, qkv, out, lse, static_cast<int>(NH), scratch);
    for (const DevTensor* t : {&out, &lse, &dqkv}) {
      const FVec f = t->f();
      const auto* p = reinterpret_cast<const uint8_t*>(f.data());
      bytes.insert(bytes.end(), p, p + f.size() * sizeof(float));
    }
  }
  return bytes;
}

// The child half of SameBitsForAnyThreadCount (skips unless that test started it).
TEST(FlashAttentionDeterminism, ChildWritesOutputs) {
  const char* path = std::getenv("ZT_DETERMINISM_OUT");
  if (path == nullptr) GTEST_SKIP() << "runs as a child of SameBitsForAnyThreadCount";
  auto rt = Runtime::create_cpu(1);
  const std::vector<uint8_t> bytes = flash_outputs(rt->device(0));
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good());
}

TEST(FlashAttentionDeterminism, SameBitsForAnyThreadCount) {
  auto rt = Runtime::create_cpu(1);
  const std::vector<uint8_t> want = flash_outputs(rt->device(0));
  ASSERT_GT(want.size(), 0u);
  EXPECT_TRUE(bitwise_equal(flash_outputs(rt->device(0)), want)) << "run to run";
  for (int threads : {1, 3})
    EXPECT_TRUE(
        bitwise_equal(outputs_of_child(threads, "FlashAttentionDeterminism.ChildWritesOutputs"),
                      want))
        << threads << " threads";
}

}  // namespace
}  // namespace zt
