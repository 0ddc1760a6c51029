// The tiled (flash-style) attention ops of kernels/ops.h on every available backend: forward
// (out, lse) and backward (dqkv +=) against the float64 reference and against today's
// attention_forward/backward, bits independent of the thread count, no pool allocation beyond a
// library path's block; 16-bit activations (f16, bf16) against float64, and on a GPU the library
// paths (cuDNN for 16 bits, the cuBLAS GEMM attention for fp32, also under --tf32) against the
// tiled CUDA kernel and the CPU backend. Tolerances: kTolReduce, as test_ops.cc explains (fp32
// sums over up to T * hs terms); 16-bit outputs add one rounding to the dtype (kTol16) on the CPU
// backend, and on every backend they are within tests/tolerance.h's attention bound of float64
// (cuDNN rounds P and dS to 16 bits where our kernels do not: tests/README.md). Library and tiled
// results are each compared with float64, never with each other.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "kernels/gemm_attention_plan.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "memory/caching_allocator.h"
#include "op_test_util.h"
#include "runtime/runtime.h"
#include "tolerance.h"

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

// The tiled kernels take no memory from the pool beyond the backward's scratch. A library path
// (CUDA's fp32 GEMM attention) takes its stream's attention block, at most
// flash_attention_library_bytes (and the stream's GEMM workspace if no GEMM ran on it yet), at the
// shape's first call and nothing on later ones (so a captured graph can replay them).
TEST_P(FlashAttentionTest, AllocatesNothingBeyondItsScratch) {
  const int64_t B = 2, T = 300, C = 32, NH = 2;
  DevTensor tqkv = tensor(rng_.normal(B * T * 3 * C), {B, T, 3 * C}),
            tdout = tensor(rng_.normal(B * T * C), {B, T, C});
  DevTensor out = poisoned({B, T, C}), lse = poisoned({B, NH, T}),
            dqkv = tensor(FVec(B * T * 3 * C), {B, T, 3 * C});
  DevTensor scratch = poisoned({scratch_floats(B, T, C, NH)});
  EXPECT_EQ(ops::flash_attention_scratch_bytes(B, T, C, NH),
            static_cast<size_t>(B * NH * T) * sizeof(float));
  const std::optional<ops::AttentionWorkspace> ws =
      ops::fused_attention_workspace(s(), B, T, C, NH, DType::kF32, true);
  EXPECT_EQ(ws.has_value(), GetParam() == Backend::kCuda);
  const size_t library = ws ? ops::flash_attention_library_bytes(B, T, C, DType::kF32, *ws) : 0;
  // The GEMM attention's first call may also make the stream's cuBLAS handle and its workspace.
  const size_t gemm = library ? dev_->gemm_workspace_bytes() : 0;
  auto step = [&] {
    ops::flash_attention_forward(s(), out, lse, tqkv, static_cast<int>(NH));
    ops::flash_attention_backward(s(), dqkv, tdout, tqkv, out, lse, static_cast<int>(NH), scratch);
    sync();
  };
  sync();
  const MemoryStats before = dev_->memory().stats();
  step();
  const MemoryStats first = dev_->memory().stats();
  EXPECT_LE(first.num_allocs - before.num_allocs, (library ? 1u : 0u) + (gemm ? 1u : 0u));
  EXPECT_LE(first.peak_allocated_bytes - before.peak_allocated_bytes,
            pool_rounded_size(library) + pool_rounded_size(gemm));
  step();
  const MemoryStats after = dev_->memory().stats();
  EXPECT_EQ(after.num_allocs, first.num_allocs);
  EXPECT_EQ(after.peak_allocated_bytes, first.peak_allocated_bytes);
}

INSTANTIATE_TEST_SUITE_P(Backends, FlashAttentionTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

// ---- 16-bit activations -------------------------------------------------------------------------

// One rounding to the dtype on top of fp32 math (half an ulp: 2^-9 bf16, 2^-12 f16, relative),
// with room for the fp32 sums.
Tol tol16(DType t) { return t == DType::kBF16 ? Tol{1e-2, 1e-3} : Tol{2e-3, 1e-4}; }

uint16_t to_bits16(float x, DType t) {
  return t == DType::kF16 ? float_to_half_bits(x) : float_to_bf16_bits(x);
}
float from_bits16(uint16_t b, DType t) {
  return t == DType::kF16 ? half_bits_to_float(b) : bf16_bits_to_float(b);
}
// v rounded to the dtype (the values a 16-bit tensor holds), as fp32.
FVec rounded16(const FVec& v, DType t) {
  FVec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = from_bits16(to_bits16(v[i], t), t);
  return r;
}
// A device tensor of dtype t (f32, or 16 bits holding host's values rounded) and back as fp32.
DevTensor tensor_as(Device& dev, Stream& s, const FVec& host, Shape shape, DType t) {
  if (t == DType::kF32) {
    DevTensor d(dev, s, t, shape);
    d.upload(host);
    return d;
  }
  std::vector<uint16_t> bits(host.size());
  for (size_t i = 0; i < host.size(); ++i) bits[i] = to_bits16(host[i], t);
  DevTensor d(dev, s, t, shape);
  d.upload(bits);
  return d;
}
FVec download_as(const DevTensor& d, DType t) {
  if (t == DType::kF32) return d.f();
  const std::vector<uint16_t> bits = d.download<uint16_t>();
  FVec r(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) r[i] = from_bits16(bits[i], t);
  return r;
}

// One forward + backward (accumulate into dqkv0 and overwrite into NaN) in dtype t on a device.
struct AttentionRun {
  FVec out, lse, dqkv_acc, dqkv_over;
};
AttentionRun run_attention(Device& dev, DType t, const FVec& qkv, const FVec& dout, const FVec& dqkv0, int64_t B,
                           int64_t T, int64_t C, int64_t NH) {
  Stream& s = dev.compute();
  const int nh = static_cast<int>(NH);
  DevTensor tqkv = tensor_as(dev, s, qkv, {B, T, 3 * C}, t), tdout = tensor_as(dev, s, dout, {B, T, C}, t);
  DevTensor out = tensor_as(dev, s, nan_vec(B * T * C), {B, T, C}, t);
  DevTensor lse(dev, s, DType::kF32, {B, NH, T});
  lse.upload(nan_vec(B * NH * T));
  ops::flash_attention_forward(s, out, lse, tqkv, nh);
  const int64_t sn = scratch_floats(B, T, C, NH);
  DevTensor scratch(dev, s, DType::kF32, {sn});
  scratch.upload(nan_vec(sn));
  DevTensor acc = tensor_as(dev, s, dqkv0, {B, T, 3 * C}, t);
  ops::flash_attention_backward(s, acc, tdout, tqkv, out, lse, nh, scratch);
  DevTensor over = tensor_as(dev, s, nan_vec(B * T * 3 * C), {B, T, 3 * C}, t);
  ops::flash_attention_backward(s, over, tdout, tqkv, out, lse, nh, scratch, ops::GradWrite::kOverwrite);
  return {download_as(out, t), lse.f(), download_as(acc, t), download_as(over, t)};
}

// float64 gradient of causal attention given the saved output `out` (dqkv +=): the softmax
// backward's row dot D_t = dout_t . out_t uses the out the forward stored, as the tiled and the
// fused kernels do. With out rounded to 16 bits that is the specified rounding point (D then
// differs from the exact sum_j P_tj dP_tj by about an ulp of out, which the cancellation in
// dP - D amplifies): the reference follows it, so the tolerance stays one rounding.
void backward_given_out_ref(DVec& dqkv, const FVec& dout, const FVec& qkv, const FVec& out, int64_t B,
                            int64_t T, int64_t C, int64_t NH) {
  const int64_t hs = C / NH, ld = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> p(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* q = &qkv[(b * T + t) * ld + h * hs];
        const float* dy = &dout[(b * T + t) * C + h * hs];
        const float* y = &out[(b * T + t) * C + h * hs];
        double mx = -INFINITY, sum = 0, D = 0;
        for (int64_t j = 0; j <= t; ++j) {
          const float* k = &qkv[(b * T + j) * ld + C + h * hs];
          double dot = 0;
          for (int64_t i = 0; i < hs; ++i) dot += double{q[i]} * k[i];
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        for (int64_t j = 0; j <= t; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int64_t i = 0; i < hs; ++i) D += double{dy[i]} * y[i];
        for (int64_t j = 0; j <= t; ++j) {
          const double P = p[j] / sum;
          const float* k = &qkv[(b * T + j) * ld + C + h * hs];
          const float* v = &qkv[(b * T + j) * ld + 2 * C + h * hs];
          double dp = 0;
          for (int64_t i = 0; i < hs; ++i) dp += double{dy[i]} * v[i];
          const double ds = P * (dp - D) * scale;
          double* dq = &dqkv[(b * T + t) * ld + h * hs];
          double* dk = &dqkv[(b * T + j) * ld + C + h * hs];
          double* dv = &dqkv[(b * T + j) * ld + 2 * C + h * hs];
          for (int64_t i = 0; i < hs; ++i) {
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
            dv[i] += P * dy[i];
          }
        }
      }
}

// A run's out, dqkv += and dqkv = against float64 within tests/tolerance.h's attention bound (the
// backward's bound given the out that run stored, as backward_given_out_ref); u_in: the GEMM
// inputs' rounding (tolerance::kTf32Roundoff under --tf32).
void expect_within_attention_bounds(const AttentionRun& got, const DVec& r_out, const DVec& r_acc, const DVec& r_over,
                                    DType t, const FVec& qkv, const FVec& dout, const FVec& dqkv0, int64_t B, int64_t T,
                                    int64_t C, int64_t NH, double u_in = 0) {
  const tolerance::AttentionBounds ab =
      tolerance::attention_bounds(t, to_d(qkv), to_d(dout), to_d(got.out), B, T, C, NH, u_in);
  EXPECT_TRUE(tolerance::within(got.out, r_out, tolerance::stored_bounds(t, ab.out, ab.out_mag))) << "out";
  EXPECT_TRUE(tolerance::within(got.dqkv_acc, r_acc, tolerance::stored_bounds(t, ab.dqkv, ab.dqkv_mag, to_d(dqkv0))))
      << "dqkv +=";
  EXPECT_TRUE(tolerance::within(got.dqkv_over, r_over, tolerance::stored_bounds(t, ab.dqkv, ab.dqkv_mag))) << "dqkv =";
}

// The T values (partial tiles at 7 and 257) at small C so that ASan on 2 cores stays fast.
const Case kCases16[] = {{2, 1, 32, 2}, {2, 7, 32, 2}, {1, 64, 32, 2}, {1, 257, 32, 2}, {1, 1024, 16, 2}};

TEST_P(FlashAttentionTest, SixteenBitMatchesReference) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (const Case& c : kCases16) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " B=" << c.B << " T=" << c.T << " C=" << c.C
                                        << " NH=" << c.NH);
      const int64_t B = c.B, T = c.T, C = c.C, NH = c.NH;
      // The reference sees exactly the 16-bit values the op reads.
      const FVec qkv = rounded16(rng_.normal(B * T * 3 * C, 1.5f), t), dout = rounded16(rng_.normal(B * T * C), t),
                 dqkv0 = rounded16(rng_.normal(B * T * 3 * C), t);
      const AttentionRun got = run_attention(*dev_, t, qkv, dout, dqkv0, B, T, C, NH);
      DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
      ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
      DVec r_acc = to_d(dqkv0), r_over(static_cast<size_t>(B * T * 3 * C), 0.0);
      backward_given_out_ref(r_acc, dout, qkv, got.out, B, T, C, NH);
      backward_given_out_ref(r_over, dout, qkv, got.out, B, T, C, NH);
      if (GetParam() == Backend::kCpu) {  // ZeroTrain's own kernels: one rounding to the dtype
        EXPECT_TRUE(close(got.out, r_out, tol16(t))) << "out vs float64";
        EXPECT_TRUE(close(got.dqkv_acc, r_acc, tol16(t))) << "dqkv += vs float64";
        EXPECT_TRUE(close(got.dqkv_over, r_over, tol16(t))) << "dqkv = vs float64";
      }
      // lse is fp32 from exactly widened inputs: the fp32 tolerance.
      EXPECT_TRUE(close(got.lse, reference_lse(r_pre, B * NH, T), kTolReduce)) << "lse vs float64";
      expect_within_attention_bounds(got, r_out, r_acc, r_over, t, qkv, dout, dqkv0, B, T, C, NH);
    }
  }
}

// decode_attention (generation's KV cache): the last n rows of causal attention over qkv [S, 3C]
// against the float64 reference of the whole sequence, fp32 (kTolReduce) and 16 bits (one rounding
// of the output, tol16, from the rounded inputs). n = S is a prefill, n = 1 a decode step; S = 1,
// odd head sizes and a long cache. Outputs poisoned; bad shapes refused with one sentence.
TEST_P(FlashAttentionTest, DecodeAttentionMatchesTheLastRowsOfFloat64) {
  const int64_t cases[][4] = {{1, 1, 32, 2}, {9, 1, 32, 2}, {9, 9, 32, 2}, {70, 5, 15, 5}, {300, 1, 48, 3}};
  for (const auto& c : cases) {
    const int64_t S = c[0], n = c[1], C = c[2], NH = c[3];
    SCOPED_TRACE(::testing::Message() << "S=" << S << " n=" << n << " C=" << C << " NH=" << NH);
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(dtype_name(t));
      FVec qkv = rng_.normal(S * 3 * C, 1.5f);
      if (t != DType::kF32) qkv = rounded16(qkv, t);
      DVec r_out(S * C), r_pre(NH * S * S, 0.0), r_att(NH * S * S);
      ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), 1, S, C, NH);
      const DVec want(r_out.end() - n * C, r_out.end());
      if (t == DType::kF32) {
        DevTensor out = poisoned({n, C});
        ops::decode_attention(s(), out, tensor(qkv, {S, 3 * C}), static_cast<int>(NH));
        EXPECT_TRUE(close(out.f(), want, kTolReduce));
      } else {
        DevTensor out = tensor_as(*dev_, s(), nan_vec(n * C), {n, C}, t);
        ops::decode_attention(s(), out, tensor_as(*dev_, s(), qkv, {S, 3 * C}, t), static_cast<int>(NH));
        EXPECT_TRUE(close(download_as(out, t), want, tol16(t)));
      }
    }
  }
  DevTensor qkv = poisoned({4, 36}), out = poisoned({5, 12});
  Error e = error_of([&] { ops::decode_attention(s(), out, qkv, 3); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_THAT(e.message(), HasSubstr("decode_attention: qkv [4, 36] but out [5, 12] (need [n, 12] with 1 <= n <= 4)"));
}

// fp32 with GradWrite::kOverwrite: the old contents (NaN here) are ignored, not added.
TEST_P(FlashAttentionTest, OverwriteIgnoresOldGradient) {
  const int64_t B = 2, T = 70, C = 24, NH = 3;
  const FVec qkv = rng_.normal(B * T * 3 * C), dout = rng_.normal(B * T * C);
  DevTensor tqkv = tensor(qkv, {B, T, 3 * C}), tdout = tensor(dout, {B, T, C});
  DevTensor out = poisoned({B, T, C}), lse = poisoned({B, NH, T}), dqkv = poisoned({B, T, 3 * C});
  DevTensor scratch = poisoned({scratch_floats(B, T, C, NH)});
  ops::flash_attention_forward(s(), out, lse, tqkv, static_cast<int>(NH));
  ops::flash_attention_backward(s(), dqkv, tdout, tqkv, out, lse, static_cast<int>(NH), scratch,
                                ops::GradWrite::kOverwrite);
  DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T), r_dqkv(B * T * 3 * C, 0.0);
  ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
  ref::attention_backward_ref(r_dqkv, to_d(dout), to_d(qkv), r_att, B, T, C, NH);
  EXPECT_TRUE(close(dqkv.f(), r_dqkv, kTolReduce));
}

// The fused-attention entries' contract in ops.cc: an entry that serves a call replaces the tiled
// kernel; one that declines leaves it to the tiled kernel. A CPU table whose fused entries serve
// bf16 only (by running the tiled kernel themselves) and count what they were asked.
std::atomic<int> g_fused_asked{0}, g_fused_served{0};
TEST(FlashAttentionDispatch, FusedEntryServesOrDeclines) {
  auto rt = Runtime::create_cpu(1);
  Device& dev = rt->device(0);
  Stream& s = dev.compute();
  OpTable t = cpu_op_table();
  t.fused_attention_forward = [](Stream& st, void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                                 int64_t C, int64_t NH, DType dt) {
    ++g_fused_asked;
    if (dt != DType::kBF16) return false;
    ++g_fused_served;
    cpu_op_table().flash_attention_forward(st, out, lse, qkv, B, T, C, NH, dt);
    return true;
  };
  ScopedOpTable scoped(Backend::kCpu, &t);
  const int64_t B = 1, T = 9, C = 8, NH = 2;
  Rng rng(test_seed() + 11);
  const FVec qkv = rounded16(rng.normal(B * T * 3 * C), DType::kBF16);
  DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
  ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto input = [&] {
      if (dt != DType::kF32) return tensor_as(dev, s, qkv, {B, T, 3 * C}, dt);
      DevTensor d(dev, s, dt, {B, T, 3 * C});
      d.upload(qkv);
      return d;
    };
    DevTensor tq = input(), out(dev, s, dt, {B, T, C}), lse(dev, s, DType::kF32, {B, NH, T});
    ops::flash_attention_forward(s, out, lse, tq, static_cast<int>(NH));
    const FVec got = dt == DType::kF32 ? out.f() : download_as(out, dt);
    EXPECT_TRUE(close(got, r_out, dt == DType::kF32 ? kTolReduce : tol16(dt))) << dtype_name(dt);
  }
  EXPECT_EQ(g_fused_asked.load(), 2);
  EXPECT_EQ(g_fused_served.load(), 1);
}

// ---- the fused (library) path on a GPU ------------------------------------------------------------
// The CUDA table's fused entries, wrapped to count the calls they served. Without a GPU: skipped.
const OpTable* g_cuda_real = nullptr;
std::atomic<int> g_cuda_served{0};

// The fp32 GEMM attention's variants against float64 (FusedMatchesTiledAndCpu's second part): --tf32
// (its products on TF32 tensor cores, inputs rounded to 10-bit mantissas: the attention bound with
// that rounding of every GEMM input) at T 64 and 1024, and causal row blocks (a benchmark's knob,
// ops::set_gemm_attention_row_splits) at T 257 (2 splits: blocks of 192 rows, a short last one)
// and T 1024 (4 splits), which check the row kernels' widths on the GPU (the plan itself is
// checked on the CPU: GemmAttentionPlan). `counting` serves through the CUDA table, counted.
void expect_gemm_attention_variants(Device& gpu, const OpTable& counting, const Case& t64, const Case& t257,
                                    const Case& t1024, Rng& rng) {
  struct Variant {
    Case c;
    bool tf32;
    int64_t splits;
  };
  for (const Variant& v : {Variant{t64, true, 1}, Variant{t1024, true, 1}, Variant{t257, false, 2},
                           Variant{t1024, false, 4}}) {
    SCOPED_TRACE(::testing::Message() << (v.tf32 ? "tf32" : "fp32") << " splits=" << v.splits << " B=" << v.c.B
                                      << " T=" << v.c.T << " C=" << v.c.C << " NH=" << v.c.NH);
    const int64_t B = v.c.B, T = v.c.T, C = v.c.C, NH = v.c.NH;
    const FVec qkv = rng.normal(B * T * 3 * C, 1.5f), dout = rng.normal(B * T * C), dqkv0 = rng.normal(B * T * 3 * C);
    const int before = g_cuda_served.load();
    gpu.set_math_mode(MathMode{.tf32 = v.tf32});
    ops::set_gemm_attention_row_splits(v.splits);
    AttentionRun fused;
    {
      ScopedOpTable scoped(Backend::kCuda, &counting);
      fused = run_attention(gpu, DType::kF32, qkv, dout, dqkv0, B, T, C, NH);
    }
    ops::set_gemm_attention_row_splits(0);
    gpu.set_math_mode(MathMode{});
    EXPECT_EQ(g_cuda_served.load() - before, 3);
    DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
    ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
    DVec r_acc = to_d(dqkv0), r_over(static_cast<size_t>(B * T * 3 * C), 0.0);
    backward_given_out_ref(r_acc, dout, qkv, fused.out, B, T, C, NH);
    backward_given_out_ref(r_over, dout, qkv, fused.out, B, T, C, NH);
    expect_within_attention_bounds(fused, r_out, r_acc, r_over, DType::kF32, qkv, dout, dqkv0, B, T, C, NH,
                                   v.tf32 ? tolerance::kTf32Roundoff : 0.0);
  }
}

TEST(FlashAttentionCuda, FusedMatchesTiledAndCpu) {
  std::string reason;
  auto gpu = make_runtime(Backend::kCuda, &reason);
  if (!gpu) GTEST_SKIP() << reason;
  auto cpu = Runtime::create_cpu(1);
  g_cuda_real = op_table(Backend::kCuda);
  OpTable counting = *g_cuda_real, tiled = *g_cuda_real;
  counting.fused_attention_forward = [](Stream& st, void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                                        int64_t C, int64_t NH, DType dt) {
    const bool served = g_cuda_real->fused_attention_forward(st, out, lse, qkv, B, T, C, NH, dt);
    g_cuda_served += served;
    return served;
  };
  counting.fused_attention_backward = [](Stream& st, void* dqkv, const void* dout, const void* qkv,
                                         const void* out, const float* lse, int64_t B, int64_t T, int64_t C,
                                         int64_t NH, DType dt, bool acc) {
    const bool served = g_cuda_real->fused_attention_backward(st, dqkv, dout, qkv, out, lse, B, T, C, NH, dt, acc);
    g_cuda_served += served;
    return served;
  };
  tiled.fused_attention_forward = nullptr;
  tiled.fused_attention_backward = nullptr;
  // GPT-2's head size 64 and 128, the T values; C = NH * hs. Then GPT-2 XL's 25 heads of 64
  // (C 1600: an odd head count, grid y 25, and the fp32 GEMM attention's groups) and a head of 80
  // (the tiled kernel's 128 bucket zero-padded).
  const Case cases[] = {{2, 1, 128, 2},    {2, 7, 128, 2},    {1, 64, 128, 2}, {2, 257, 128, 2},
                        {1, 1024, 128, 2}, {1, 300, 256, 2},  {1, 130, 1600, 25}, {2, 64, 160, 2}};
  Rng rng(test_seed() + 23);
  auto as_type = [](const FVec& v, DType t) { return t == DType::kF32 ? v : rounded16(v, t); };
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " B=" << c.B << " T=" << c.T << " C=" << c.C
                                        << " NH=" << c.NH);
      const int64_t B = c.B, T = c.T, C = c.C, NH = c.NH;
      const FVec qkv = as_type(rng.normal(B * T * 3 * C, 1.5f), t), dout = as_type(rng.normal(B * T * C), t),
                 dqkv0 = as_type(rng.normal(B * T * 3 * C), t);
      const int before = g_cuda_served.load();
      AttentionRun fused, fallback;
      {
        ScopedOpTable scoped(Backend::kCuda, &counting);
        fused = run_attention(gpu->device(0), t, qkv, dout, dqkv0, B, T, C, NH);
      }
      {
        ScopedOpTable scoped(Backend::kCuda, &tiled);
        fallback = run_attention(gpu->device(0), t, qkv, dout, dqkv0, B, T, C, NH);
      }
      const AttentionRun host = run_attention(cpu->device(0), t, qkv, dout, dqkv0, B, T, C, NH);
      if (t == DType::kF32) {  // the GEMM attention (cuBLAS) serves every fp32 shape
        EXPECT_EQ(g_cuda_served.load() - before, 3) << "the fp32 GEMM attention did not serve every call";
      } else {
#if defined(ZT_WITH_CUDNN)
        // cuDNN's SDPA backward does not take s_q = s_kv = 1 (the first GPU run): at T = 1 only the
        // forward is served and the tiled kernel runs both backwards.
        EXPECT_EQ(g_cuda_served.load() - before, T == 1 ? 1 : 3)
            << "cuDNN is built but did not serve forward and both backwards";
#endif
      }
      DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
      ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
      const DVec r_lse = reference_lse(r_pre, B * NH, T);
      for (const auto& [name, run] : {std::pair<const char*, const AttentionRun*>{"fused", &fused},
                                      {"tiled CUDA", &fallback},
                                      {"CPU backend", &host}}) {
        SCOPED_TRACE(name);
        DVec r_acc = to_d(dqkv0), r_over(static_cast<size_t>(B * T * 3 * C), 0.0);
        backward_given_out_ref(r_acc, dout, qkv, run->out, B, T, C, NH);
        backward_given_out_ref(r_over, dout, qkv, run->out, B, T, C, NH);
        EXPECT_TRUE(close(run->lse, r_lse, kTolReduce)) << "lse vs float64";
        expect_within_attention_bounds(*run, r_out, r_acc, r_over, t, qkv, dout, dqkv0, B, T, C, NH);
      }
    }
  }
  expect_gemm_attention_variants(gpu->device(0), counting, cases[2], cases[3], cases[4], rng);
}

// The tiled CUDA kernels (fused entries off) at shapes small enough for compute-sanitizer's
// racecheck and synccheck, which gpu-check runs on this case (the tiny model's run never reaches
// these kernels: cuDNN serves its 16-bit attention). Head sizes 16 (the 64 bucket, zero-padded
// columns) and 80 (the 128 bucket); T = 40 and 33: a full and a partial key tile, two query blocks
// and a partial one, rows past T inside a block. Within the float64 bounds, and two runs equal bit
// for bit (each output row has one owner: a shared-memory race would show as run-to-run noise).
TEST(FlashAttentionCuda, TiledKernelsAtSmallShapes) {
  std::string reason;
  auto gpu = make_runtime(Backend::kCuda, &reason);
  if (!gpu) GTEST_SKIP() << reason;
  OpTable tiled = *op_table(Backend::kCuda);
  tiled.fused_attention_forward = nullptr;
  tiled.fused_attention_backward = nullptr;
  const ScopedOpTable scoped(Backend::kCuda, &tiled);
  const Case cases[] = {{2, 40, 32, 2}, {1, 33, 160, 2}};
  Rng rng(test_seed() + 29);
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " B=" << c.B << " T=" << c.T << " C=" << c.C
                                        << " NH=" << c.NH);
      const int64_t B = c.B, T = c.T, C = c.C, NH = c.NH;
      auto as_type = [t](const FVec& v) { return t == DType::kF32 ? v : rounded16(v, t); };
      const FVec qkv = as_type(rng.normal(B * T * 3 * C, 1.5f)), dout = as_type(rng.normal(B * T * C)),
                 dqkv0 = as_type(rng.normal(B * T * 3 * C));
      const AttentionRun run = run_attention(gpu->device(0), t, qkv, dout, dqkv0, B, T, C, NH);
      const AttentionRun again = run_attention(gpu->device(0), t, qkv, dout, dqkv0, B, T, C, NH);
      DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
      ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
      DVec r_acc = to_d(dqkv0), r_over(static_cast<size_t>(B * T * 3 * C), 0.0);
      backward_given_out_ref(r_acc, dout, qkv, run.out, B, T, C, NH);
      backward_given_out_ref(r_over, dout, qkv, run.out, B, T, C, NH);
      EXPECT_TRUE(close(run.lse, reference_lse(r_pre, B * NH, T), kTolReduce)) << "lse vs float64";
      expect_within_attention_bounds(run, r_out, r_acc, r_over, t, qkv, dout, dqkv0, B, T, C, NH);
      EXPECT_TRUE(bitwise_equal(again.out, run.out)) << "out: two runs differ";
      EXPECT_TRUE(bitwise_equal(again.lse, run.lse)) << "lse: two runs differ";
      EXPECT_TRUE(bitwise_equal(again.dqkv_acc, run.dqkv_acc)) << "dqkv +=: two runs differ";
      EXPECT_TRUE(bitwise_equal(again.dqkv_over, run.dqkv_over)) << "dqkv =: two runs differ";
    }
  }
}

// ---- the GEMM attention's plan, on the CPU ---------------------------------------------------------
// CUDA's fp32 GEMM attention (kernels/cuda/gemm_attention.cu) runs kernels/gemm_attention_plan.h's
// GEMMs through cuBLAS. Here the same plan runs through a column-major strided-batched GEMM with
// cuBLAS's semantics in float64, with float64 versions of the two row kernels: the result must be
// the float64 attention (forward, lse, dqkv += and dqkv =) to 1e-12, for groups of one head, of all
// heads and a last group smaller than the others, and in causal row blocks (2 and 4 splits, a short
// last block) (head size 4: the plan's fp32 scale 0.5 is exact). The score buffers are NaN at each
// chunk's start, so a GEMM or row kernel that reads a score nothing wrote (above a row block) fails
// too. A wrong transpose, leading dimension, stride, offset or scale in the plan fails here, without
// a GPU.
namespace plan = zt::gemm_attention;
using PlanBuffers = std::array<DVec*, 6>;

double* at(const PlanBuffers& p, const plan::Operand& o, int64_t i) {
  return p[static_cast<size_t>(o.buf)]->data() + o.offset + i * o.stride;
}

// What cuBLAS asks of a strided-batched call and the float64 GEMM below would not notice: each
// leading dimension at least its stored matrix's rows (else CUBLAS_STATUS_INVALID_VALUE on a GPU),
// and the batch's C matrices disjoint (whole matrices apart, or row blocks of one column-major
// matrix, as heads are), so no two of them write one element.
void expect_cublas_accepts(const plan::Gemm& g) {
  EXPECT_GE(g.a.ld, std::max<int64_t>(1, g.ta ? g.k : g.m));
  EXPECT_GE(g.b.ld, std::max<int64_t>(1, g.tb ? g.n : g.k));
  EXPECT_GE(g.c.ld, std::max<int64_t>(1, g.m));
  EXPECT_TRUE(g.batch == 1 || g.c.stride >= g.c.ld * g.n ||
              (g.c.stride >= g.m && g.c.stride * (g.batch - 1) + g.m <= g.c.ld))
      << "C matrices of the batch overlap: stride " << g.c.stride << ", ld " << g.c.ld << ", " << g.m << " x " << g.n;
}

void reference_gemm(const plan::Gemm& g, const PlanBuffers& p) {
  expect_cublas_accepts(g);
  for (int64_t i = 0; i < g.batch; ++i) {
    const double *A = at(p, g.a, i), *Bm = at(p, g.b, i);
    double* Cm = at(p, g.c, i);
    for (int64_t col = 0; col < g.n; ++col)
      for (int64_t row = 0; row < g.m; ++row) {
        double acc = 0;
        for (int64_t l = 0; l < g.k; ++l)
          acc += (g.ta ? A[l + row * g.a.ld] : A[row + l * g.a.ld]) * (g.tb ? Bm[col + l * g.b.ld] : Bm[l + col * g.b.ld]);
        double& c = Cm[row + col * g.c.ld];
        c = g.alpha * acc + (g.beta == 0 ? 0.0 : g.beta * c);  // beta 0 never reads C (cuBLAS)
      }
  }
}

struct PlanRun {
  DVec out, lse, dqkv;
};
PlanRun run_plan(const DVec& qkv, const DVec& dout, const DVec& dqkv0, int64_t B, int64_t T, int64_t C, int64_t NH,
                 int64_t group, int64_t splits, bool accumulate) {
  const plan::Dims d = plan::dims(B, T, C, NH, group, splits);
  PlanRun r{DVec(B * T * C, NAN), DVec(B * NH * T, NAN), dqkv0};
  DVec in = qkv, dy = dout, S, G;
  const PlanBuffers p{&in, &r.out, &dy, &r.dqkv, &S, &G};
  auto poison = [&] { S.assign(static_cast<size_t>(group * T * T), NAN), G.assign(S.size(), NAN); };
  for (const plan::Chunk& c : plan::chunks(d)) {  // forward
    const plan::Phases g = plan::forward_gemms(d, c);
    poison();
    for (const plan::Gemm& gemm : g.before) reference_gemm(gemm, p);
    for (int64_t row = 0; row < c.nh * T; ++row) {  // causal softmax in place, and lse
      double* x = &S[row * T];
      const int64_t t = row % T;
      double m = -INFINITY, l = 0;
      for (int64_t j = 0; j <= t; ++j) m = std::max(m, x[j]);
      for (int64_t j = 0; j <= t; ++j) l += std::exp(x[j] - m);
      for (int64_t j = 0; j < plan::row_width(d, t); ++j) x[j] = j <= t ? std::exp(x[j] - m) / l : 0.0;
      r.lse[c.lse_offset(d) + row] = m + std::log(l);
    }
    for (const plan::Gemm& gemm : g.after) reference_gemm(gemm, p);
  }
  for (const plan::Chunk& c : plan::chunks(d)) {  // backward
    const plan::Phases g = plan::backward_gemms(d, c, accumulate);
    poison();
    for (const plan::Gemm& gemm : g.before) reference_gemm(gemm, p);
    for (int64_t row = 0; row < c.nh * T; ++row) {  // P and dS in place, D from out and dout
      const int64_t h = row / T, t = row % T, base = c.head_offset(d) + t * C + h * d.hs;
      double D = 0;
      for (int64_t i = 0; i < d.hs; ++i) D += dout[base + i] * r.out[base + i];
      for (int64_t j = 0; j < plan::row_width(d, t); ++j) {
        const double pj = j <= t ? std::exp(S[row * T + j] - r.lse[c.lse_offset(d) + row]) : 0.0;
        S[row * T + j] = pj;
        G[row * T + j] = pj * (G[row * T + j] - D);
      }
    }
    for (const plan::Gemm& gemm : g.after) reference_gemm(gemm, p);
  }
  return r;
}

// Multiply-adds of a direction's GEMMs for one chunk.
double plan_work(const plan::Phases& g) {
  double w = 0;
  for (const auto* list : {&g.before, &g.after})
    for (const plan::Gemm& x : *list) w += static_cast<double>(x.m) * static_cast<double>(x.n) * x.k * x.batch;
  return w;
}

double max_diff(const DVec& a, const DVec& b) {
  double m = a.size() == b.size() ? 0.0 : INFINITY;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::isnan(a[i]) ? INFINITY : std::fabs(a[i] - b[i]));
  return m;
}

TEST(GemmAttentionPlan, RunsAsFloat64Attention) {
  struct PlanCase {
    int64_t B, T, C, NH, group, splits;
  };
  Rng rng(test_seed() + 31);
  // Row blocks are multiples of 64 rows: T 150 in 2 splits is blocks [0, 128) and [128, 150); T 200
  // in 4 is [0, 64), [64, 128), [128, 192), [192, 200).
  for (const PlanCase& c : {PlanCase{2, 7, 12, 3, 1, 1}, PlanCase{1, 9, 16, 4, 3, 1}, PlanCase{2, 5, 8, 2, 2, 1},
                            PlanCase{1, 1, 8, 2, 2, 1}, PlanCase{1, 150, 8, 2, 1, 2}, PlanCase{2, 200, 12, 3, 2, 4}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " C=" << c.C << " NH=" << c.NH
                                      << " group=" << c.group << " splits=" << c.splits);
    const int64_t B = c.B, T = c.T, C = c.C, NH = c.NH;
    const DVec qkv = to_d(rng.normal(B * T * 3 * C, 1.5f)), dout = to_d(rng.normal(B * T * C)),
               dqkv0 = to_d(rng.normal(B * T * 3 * C));
    DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
    ref::attention_forward_ref(r_out, r_pre, r_att, qkv, B, T, C, NH);
    DVec r_acc = dqkv0, r_over(static_cast<size_t>(B * T * 3 * C), 0.0);
    ref::attention_backward_ref(r_acc, dout, qkv, r_att, B, T, C, NH);
    ref::attention_backward_ref(r_over, dout, qkv, r_att, B, T, C, NH);
    const PlanRun acc = run_plan(qkv, dout, dqkv0, B, T, C, NH, c.group, c.splits, true);
    const PlanRun over = run_plan(qkv, dout, DVec(B * T * 3 * C, NAN), B, T, C, NH, c.group, c.splits, false);
    EXPECT_LT(max_diff(acc.out, r_out), 1e-12);
    EXPECT_LT(max_diff(acc.lse, reference_lse(r_pre, B * NH, T)), 1e-12);
    EXPECT_LT(max_diff(acc.dqkv, r_acc), 1e-12) << "dqkv +=";
    EXPECT_LT(max_diff(over.dqkv, r_over), 1e-12) << "dqkv =";
  }
  // The production grouping: every head of GPT-2 124M's T = 1024 in one chunk per batch row; with
  // s splits (blocks of 1024 / s rows) each GEMM does (s + 1) / (2 s) of the square's work.
  for (const int64_t splits : {1, 2, 4}) {
    const plan::Dims gpt2 = plan::dims(16, 1024, 768, 12, ops::gemm_attention_heads_per_chunk(1024, 12), splits);
    EXPECT_EQ(gpt2.row_block, 1024 / splits);
    EXPECT_EQ(plan::chunks(gpt2).size(), 16u);
    for (const plan::Chunk& c : plan::chunks(gpt2)) {
      for (const plan::Gemm& g : plan::forward_gemms(gpt2, c).before) expect_cublas_accepts(g);
      for (const plan::Gemm& g : plan::forward_gemms(gpt2, c).after) expect_cublas_accepts(g);
      for (const plan::Gemm& g : plan::backward_gemms(gpt2, c, true).before) expect_cublas_accepts(g);
      for (const plan::Gemm& g : plan::backward_gemms(gpt2, c, true).after) expect_cublas_accepts(g);
    }
    const plan::Dims full = plan::dims(16, 1024, 768, 12, 12);
    const plan::Chunk c0 = plan::chunks(full)[0];
    const double share = static_cast<double>(splits + 1) / static_cast<double>(2 * splits);
    EXPECT_EQ(plan_work(plan::forward_gemms(gpt2, c0)), share * plan_work(plan::forward_gemms(full, c0)));
    EXPECT_EQ(plan_work(plan::backward_gemms(gpt2, c0, true)), share * plan_work(plan::backward_gemms(full, c0, true)));
  }
}

// ---- validation ----------------------------------------------------------------------------------

using op_test::error_of;

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
