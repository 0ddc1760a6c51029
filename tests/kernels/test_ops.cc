// Every op of kernels/ops.h on every available backend (CPU always, CUDA when a usable GPU exists,
// else GTEST_SKIP) against the float64 references of kernels/ref/, in the manner of ggml's
// test-backend-ops: fresh random inputs of awkward sizes (1, primes, block size +- 1, one large
// case), outputs poisoned with NaN so unwritten elements fail, gradient outputs pre-filled with
// random values so accumulation (+=) is checked. Also: finite-difference checks of every layer's
// backward (which verify the references themselves), bitwise determinism across thread counts and
// runs, and argument validation.
//
// Tolerances (|got - ref| <= rtol |ref| + rms_tol * rms(ref), per element). The rms term is the
// error scale of a sum: a float sum of K terms is off by ~sqrt(K) eps times the size of the terms,
// which is the size of the outputs, not of the element (an output that cancels to ~0 has no
// relative accuracy in any fp32 implementation).
//  - kTolExact: integer results and pure data movement / single roundings (bitwise).
//  - kTolElem (1e-5 rel, 1e-6 rms): a handful of fp32 roundings per element (GELU, AdamW, ...),
//    i.e. ~100 ulp of headroom over the few-ulp error expected.
//  - kTolReduce (1e-4 rel, 2e-5 rms): fp32 reductions over up to ~5e4 terms in a blocked order
//    (GEMM via OpenBLAS/cuBLAS, layernorm rows, softmax rows, accumulated gradients): the typical
//    error is ~sqrt(K) eps ~ 1e-5 of the output scale for K ~ 1e3; the bound keeps a 2-10x margin
//    for K up to the large cases while still catching any wrong term (which is O(1/K) or larger).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/philox.h"
#include "core/status.h"
#include "kernels/elementwise.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "op_test_util.h"
#include "memory/caching_allocator.h"
#include "runtime/observer.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

using namespace op_test;  // NOLINT(build/namespaces): the helpers shared by the op test binaries

// Entries (t, t2) with t2 <= t of [BH, T, T] matrices.
template <typename T>
std::vector<T> lower_triangle(const std::vector<T>& m, int64_t BH, int64_t Tn) {
  std::vector<T> out;
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t t = 0; t < Tn; ++t)
      for (int64_t t2 = 0; t2 <= t; ++t2) out.push_back(m[(bh * Tn + t) * Tn + t2]);
  return out;
}

class OpsTest : public OpsFixture {};

// ---- elementwise / utility -------------------------------------------------------------------

const int64_t kElemSizes[] = {1, 7, 255, 256, 257, 4099, 100003};

TEST_P(OpsTest, FillScaleAdd) {
  for (int64_t n : kElemSizes) {
    SCOPED_TRACE("n = " + std::to_string(n));
    DevTensor x = poisoned({n});
    ops::fill(s(), x, 1.25f);
    EXPECT_TRUE(bitwise_equal(x.f(), FVec(n, 1.25f)));

    const FVec a = rng_.normal(n), b = rng_.normal(n);
    DevTensor ta = tensor(a, {n});
    ops::scale(s(), ta, -0.3f);
    FVec want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = a[i] * -0.3f;
    EXPECT_TRUE(bitwise_equal(ta.f(), want));

    DevTensor tb = tensor(b, {n}), out = poisoned({n});
    ops::add(s(), out, ta, tb);
    for (int64_t i = 0; i < n; ++i) want[i] = a[i] * -0.3f + b[i];
    EXPECT_TRUE(bitwise_equal(out.f(), want));
    ops::add(s(), ta, ta, tb);  // out aliasing an input
    EXPECT_TRUE(bitwise_equal(ta.f(), want));
  }
}

TEST_P(OpsTest, CastMatchesHostConversions) {
  const DType types[] = {DType::kF32, DType::kF16, DType::kBF16};
  for (int64_t n : {int64_t{1}, int64_t{257}, int64_t{70001}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    // Normal values over a wide range plus the special cases (inf, NaN, subnormals, overflow).
    FVec src = rng_.normal(n, 1.0f);
    const FVec scale_exp = rng_.uniform(n, -30.0f, 30.0f);
    for (int64_t i = 0; i < n; ++i) src[i] *= std::exp2(std::round(scale_exp[i]));
    const float specials[] = {0.0f,     -0.0f, INFINITY, -INFINITY, NAN,    65504.0f,
                              65520.0f, 1e-8f, -3e-5f,   1e-40f,    3.0e38f};
    for (size_t i = 0; i < std::size(specials) && static_cast<int64_t>(i) < n; ++i)
      src[i] = specials[i];
    for (DType from : types) {
      // Source bits: the random floats rounded into `from` on the host.
      std::vector<uint16_t> src16(n);
      for (int64_t i = 0; i < n; ++i)
        src16[i] = from == DType::kF16 ? float_to_half_bits(src[i]) : float_to_bf16_bits(src[i]);
      DevTensor tsrc = empty({n}, from);
      tsrc.upload_bytes(from == DType::kF32 ? static_cast<const void*>(src.data()) : src16.data());
      FVec as_float(n);
      for (int64_t i = 0; i < n; ++i)
        as_float[i] = from == DType::kF32   ? src[i]
                      : from == DType::kF16 ? half_bits_to_float(src16[i])
                                            : bf16_bits_to_float(src16[i]);
      for (DType to : types) {
        SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + dtype_name(to));
        DevTensor tdst = empty({n}, to);
        if (to == DType::kF32) {
          tdst.upload(nan_vec(n));
          ops::cast(s(), tdst, tsrc);
          EXPECT_TRUE(bitwise_equal(tdst.f(), as_float));
        } else {
          tdst.upload(std::vector<uint16_t>(n, 0x7e01));  // a NaN payload no conversion produces
          ops::cast(s(), tdst, tsrc);
          std::vector<uint16_t> want(n);
          for (int64_t i = 0; i < n; ++i)
            want[i] = to == DType::kF16 ? float_to_half_bits(as_float[i])
                                        : float_to_bf16_bits(as_float[i]);
          EXPECT_TRUE(bitwise_equal(tdst.download<uint16_t>(), want));
        }
      }
    }
  }
}

// dst += src in each storage type: both widened to fp32, added, rounded once (nearest even); the
// host computes the same with core/dtype.h's conversions, so the bits must match exactly.
TEST_P(OpsTest, AccumulateMatchesHostRounding) {
  // (dst, src) pairs at the edges: rounding ties (to even, down and up) in f16/bf16/f32, overflow
  // to inf, exact cancellation (+0), signed zeros, subnormals of each type.
  const std::pair<float, float> specials[] = {
      {1.0f, 0x1p-11f},      {1.0f + 0x1p-10f, 0x1p-11f}, {1.0f, 0x1p-8f},
      {1.0f + 0x1p-7f, 0x1p-8f}, {1.0f, 0x1p-24f},         {1.0f + 0x1p-23f, 0x1p-24f},
      {65504.0f, 65504.0f},  {-65504.0f, -16.0f},         {3.0e38f, 3.0e38f},
      {INFINITY, 1.0f},      {-INFINITY, -INFINITY},      {2.5f, -2.5f},
      {-0.0f, -0.0f},        {0.0f, -0.0f},               {6e-8f, 6e-8f},
      {1e-40f, 1e-40f},      {1e-40f, -3e-40f},           {3e-5f, -1e-7f}};
  // Only where the sum is rounded into f16/bf16 (which canonicalise NaN to 0x7fff): an fp32 NaN's
  // bits are the hardware's (x86 and NVIDIA GPUs make different ones).
  const std::pair<float, float> nan_specials[] = {{INFINITY, -INFINITY}, {NAN, 1.0f}};
  for (int64_t n : {int64_t{1}, int64_t{257}, int64_t{70001}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    // Similar magnitudes (a few binades apart) so most sums round, plus some wide spreads.
    FVec a = rng_.normal(n), b = rng_.normal(n);
    const FVec ea = rng_.uniform(n, -4.0f, 4.0f), eb = rng_.uniform(n, -4.0f, 4.0f);
    for (int64_t i = 0; i < n; ++i) {
      a[i] *= std::exp2(std::round(ea[i] * (i % 7 == 0 ? 5.0f : 1.0f)));
      b[i] *= std::exp2(std::round(eb[i]));
    }
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(dtype_name(t));
      FVec da = a, db = b;
      int64_t k = 0;
      const auto put = [&](const std::pair<float, float>& p) {
        if (k >= n) return;
        da[k] = p.first;
        db[k] = p.second;
        ++k;
      };
      for (const auto& p : specials) put(p);
      if (t != DType::kF32)
        for (const auto& p : nan_specials) put(p);
      DevTensor dst = empty({n}, t), src = empty({n}, t);
      if (t == DType::kF32) {
        dst.upload(da);
        src.upload(db);
        ops::accumulate(s(), dst, src);
        FVec want(n);
        for (int64_t i = 0; i < n; ++i) want[i] = da[i] + db[i];
        EXPECT_TRUE(bitwise_equal(dst.f(), want));
        EXPECT_TRUE(bitwise_equal(src.f(), db));
        continue;
      }
      // The inputs as stored (rounded into t), and the sum of their widened values, rounded once.
      const auto to_bits = [t](float x) {
        return t == DType::kF16 ? float_to_half_bits(x) : float_to_bf16_bits(x);
      };
      const auto from_bits = [t](uint16_t h) {
        return t == DType::kF16 ? half_bits_to_float(h) : bf16_bits_to_float(h);
      };
      std::vector<uint16_t> ha(n), hb(n), want(n);
      for (int64_t i = 0; i < n; ++i) {
        ha[i] = to_bits(da[i]);
        hb[i] = to_bits(db[i]);
        want[i] = to_bits(from_bits(ha[i]) + from_bits(hb[i]));
      }
      dst.upload(ha);
      src.upload(hb);
      ops::accumulate(s(), dst, src);
      EXPECT_TRUE(bitwise_equal(dst.download<uint16_t>(), want));
      EXPECT_TRUE(bitwise_equal(src.download<uint16_t>(), hb));
    }
  }
}

// ---- encoder
// -------------------------------------------------------------------------------------

struct EncoderCase {
  int64_t B, T, C, V, maxT;
};
const EncoderCase kEncoderCases[] = {{1, 1, 1, 1, 1},
                                     {2, 7, 13, 17, 8},
                                     {3, 64, 127, 5, 64},
                                     {4, 257, 64, 1000, 300},
                                     {8, 256, 768, 3001, 256}};

TEST_P(OpsTest, Encoder) {
  for (const EncoderCase& c : kEncoderCases) {
    SCOPED_TRACE(::testing::Message()
                 << "B=" << c.B << " T=" << c.T << " C=" << c.C << " V=" << c.V);
    const IVec tokens = rng_.ints(c.B * c.T, 0, static_cast<int32_t>(c.V));  // small V: repeats
    const FVec wte = rng_.normal(c.V * c.C), wpe = rng_.normal(c.maxT * c.C);
    const FVec dout = rng_.normal(c.B * c.T * c.C);
    const FVec dwte0 = rng_.normal(c.V * c.C), dwpe0 = rng_.normal(c.maxT * c.C);
    DevTensor ttok = tensor(tokens, {c.B, c.T}), twte = tensor(wte, {c.V, c.C}),
              twpe = tensor(wpe, {c.maxT, c.C}), out = poisoned({c.B, c.T, c.C});
    ops::encoder_forward(s(), out, ttok, twte, twpe);
    DVec ref_out(c.B * c.T * c.C);
    ref::encoder_forward_ref(ref_out, tokens, to_d(wte), to_d(wpe), c.B, c.T, c.C);
    EXPECT_TRUE(close(out.f(), ref_out, kTolElem));  // one addition: exact up to rounding

    DevTensor tdout = tensor(dout, {c.B, c.T, c.C}), dwte = tensor(dwte0, {c.V, c.C}),
              dwpe = tensor(dwpe0, {c.maxT, c.C});
    ops::encoder_backward(s(), dwte, dwpe, tdout, ttok);
    DVec ref_dwte = to_d(dwte0), ref_dwpe = to_d(dwpe0);
    ref::encoder_backward_ref(ref_dwte, ref_dwpe, to_d(dout), tokens, c.B, c.T, c.C);
    EXPECT_TRUE(close(dwte.f(), ref_dwte, kTolReduce));
    EXPECT_TRUE(close(dwpe.f(), ref_dwpe, kTolReduce));
  }
}

// ---- layernorm
// -------------------------------------------------------------------------------------

struct RowsCase {
  int64_t N, C;
};
const RowsCase kLayernormCases[] = {{1, 1},   {1, 7},    {3, 255},    {5, 256},
                                    {7, 257}, {64, 768}, {1031, 129}, {4096, 64}};

TEST_P(OpsTest, Layernorm) {
  const float eps = 1e-5f;
  for (const RowsCase& c : kLayernormCases) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C);
    const int64_t N = c.N, C = c.C;
    // An offset mean and a non-unit spread, as activations have.
    const FVec in = rng_.normal(N * C, 2.0f, 3.0f), w = rng_.normal(C), b = rng_.normal(C);
    // [B, T, C] when N factors, to exercise leading dims.
    const Shape shape = N % 8 == 0 ? Shape{8, N / 8, C} : Shape{N, C};
    DevTensor tin = tensor(in, shape), tw = tensor(w, {C}), tb = tensor(b, {C});
    DevTensor out = poisoned(shape), mean = poisoned({N}), rstd = poisoned({N});
    ops::layernorm_forward(s(), out, mean, rstd, tin, tw, tb, eps);
    DVec r_out(N * C), r_mean(N), r_rstd(N);
    ref::layernorm_forward_ref(r_out, r_mean, r_rstd, to_d(in), to_d(w), to_d(b), N, C, eps);
    EXPECT_TRUE(close(out.f(), r_out, kTolReduce));
    EXPECT_TRUE(close(mean.f(), r_mean, kTolElem));
    EXPECT_TRUE(close(rstd.f(), r_rstd, kTolReduce));

    const FVec dout = rng_.normal(N * C), din0 = rng_.normal(N * C), dw0 = rng_.normal(C),
               db0 = rng_.normal(C);
    DevTensor tdout = tensor(dout, shape), din = tensor(din0, shape), dw = tensor(dw0, {C}),
              db = tensor(db0, {C});
    ops::layernorm_backward(s(), din, dw, db, tdout, tin, tw, mean, rstd);
    DVec r_din = to_d(din0), r_dw = to_d(dw0), r_db = to_d(db0);
    ref::layernorm_backward_ref(r_din, r_dw, r_db, to_d(dout), to_d(in), to_d(w), r_mean, r_rstd, N,
                                C);
    EXPECT_TRUE(close(din.f(), r_din, kTolReduce));
    EXPECT_TRUE(close(dw.f(), r_dw, kTolReduce));
    EXPECT_TRUE(close(db.f(), r_db, kTolReduce));
  }
}

// ---- matmul
// -------------------------------------------------------------------------------------------

struct MatmulCase {
  int64_t N, C, OC;
  bool bias, din;
};
const MatmulCase kMatmulCases[] = {{1, 1, 1, true, true},       {3, 5, 7, false, true},
                                   {17, 255, 257, true, true},  {64, 256, 256, true, false},
                                   {257, 31, 129, false, true}, {300, 520, 1030, true, true}};

TEST_P(OpsTest, Matmul) {
  for (const MatmulCase& c : kMatmulCases) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C << " OC=" << c.OC
                                      << " bias=" << c.bias << " din=" << c.din);
    const int64_t N = c.N, C = c.C, OC = c.OC;
    const FVec in = rng_.normal(N * C), w = rng_.normal(OC * C), b = rng_.normal(OC);
    DevTensor tin = tensor(in, {N, C}), tw = tensor(w, {OC, C}), tb = tensor(b, {OC});
    DevTensor out = poisoned({N, OC});
    ops::matmul_forward(s(), out, tin, tw, c.bias ? tb.view() : TensorView{});
    DVec r_out(N * OC);
    ref::matmul_forward_ref(r_out, to_d(in), to_d(w), c.bias ? to_d(b) : DVec{}, N, C, OC);
    EXPECT_TRUE(close(out.f(), r_out, kTolReduce));

    const FVec dout = rng_.normal(N * OC), din0 = rng_.normal(N * C), dw0 = rng_.normal(OC * C),
               db0 = rng_.normal(OC);
    DevTensor tdout = tensor(dout, {N, OC}), din = tensor(din0, {N, C}), dw = tensor(dw0, {OC, C}),
              db = tensor(db0, {OC});
    ops::matmul_backward(s(), c.din ? din.view() : TensorView{}, dw,
                         c.bias ? db.view() : TensorView{}, tdout, tin, tw);
    DVec r_din = to_d(din0), r_dw = to_d(dw0), r_db = to_d(db0);
    ref::matmul_backward_ref(c.din ? ref::DSpan(r_din) : ref::DSpan{}, r_dw,
                             c.bias ? ref::DSpan(r_db) : ref::DSpan{}, to_d(dout), to_d(in),
                             to_d(w), N, C, OC);
    EXPECT_TRUE(close(din.f(), r_din, kTolReduce));  // untouched (== din0) when absent
    EXPECT_TRUE(close(dw.f(), r_dw, kTolReduce));
    EXPECT_TRUE(close(db.f(), r_db, kTolReduce));
  }
}

// With the device's MathMode::tf32 both GEMM inputs are rounded to TF32 (round to nearest even)
// and accumulated in fp32: the float64 product of the rounded inputs is the reference (tight), and
// the result is measurably not the fp32 product (loose rounding of 13 mantissa bits per input).
TEST_P(OpsTest, MatmulTf32RoundsInputs) {
  EXPECT_EQ(round_to_tf32(1.0f + 0x1p-11f), 1.0f);                    // a tie: to even
  EXPECT_EQ(round_to_tf32(1.0f + 0x1p-10f + 0x1p-11f), 1.0f + 0x1p-9f);  // a tie: to even, up
  EXPECT_EQ(round_to_tf32(-(1.0f + 0x1p-11f + 0x1p-20f)), -(1.0f + 0x1p-10f));
  EXPECT_EQ(round_to_tf32(3.4028235e38f), INFINITY);
  s().device().set_math_mode(MathMode{.tf32 = true});  // the fixture's runtime lives for this test only
  const int64_t N = 33, C = 255, OC = 65;
  const FVec in = rng_.normal(N * C), w = rng_.normal(OC * C), b = rng_.normal(OC), dout = rng_.normal(N * OC),
             din0 = rng_.normal(N * C), dw0 = rng_.normal(OC * C), db0 = rng_.normal(OC);
  auto tf32 = [](const FVec& x) {
    DVec r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = round_to_tf32(x[i]);
    return r;
  };
  DevTensor tin = tensor(in, {N, C}), tw = tensor(w, {OC, C}), tb = tensor(b, {OC});
  DevTensor out = poisoned({N, OC});
  ops::matmul_forward(s(), out, tin, tw, tb);
  DVec r_out(N * OC), r_fp32(N * OC);
  ref::matmul_forward_ref(r_out, tf32(in), tf32(w), to_d(b), N, C, OC);
  ref::matmul_forward_ref(r_fp32, to_d(in), to_d(w), to_d(b), N, C, OC);
  EXPECT_TRUE(close(out.f(), r_out, kTolReduce));
  EXPECT_FALSE(close(out.f(), r_fp32, kTolReduce));

  DevTensor tdout = tensor(dout, {N, OC}), din = tensor(din0, {N, C}), dw = tensor(dw0, {OC, C}),
            db = tensor(db0, {OC});
  ops::matmul_backward(s(), din, dw, db, tdout, tin, tw);
  DVec r_din = to_d(din0), r_dw = to_d(dw0), r_db = to_d(db0);
  // The bias gradient is a sum of dout, not a product: unrounded.
  ref::matmul_backward_ref(r_din, r_dw, ref::DSpan{}, tf32(dout), tf32(in), tf32(w), N, C, OC);
  DVec scratch(OC * C);
  ref::matmul_backward_ref(ref::DSpan{}, scratch, r_db, to_d(dout), to_d(in), to_d(w), N, C, OC);
  EXPECT_TRUE(close(din.f(), r_din, kTolReduce));
  EXPECT_TRUE(close(dw.f(), r_dw, kTolReduce));
  EXPECT_TRUE(close(db.f(), r_db, kTolReduce));
  DVec f_dw = to_d(dw0);
  ref::matmul_backward_ref(ref::DSpan{}, f_dw, ref::DSpan{}, to_d(dout), to_d(in), to_d(w), N, C, OC);
  EXPECT_FALSE(close(dw.f(), f_dw, kTolReduce));

  // Back to fp32: the same call matches the unrounded reference again.
  s().device().set_math_mode(MathMode{});
  ops::matmul_forward(s(), out, tin, tw, tb);
  EXPECT_TRUE(close(out.f(), r_fp32, kTolReduce));
}

// ---- attention
// ------------------------------------------------------------------------------------

struct AttentionCase {
  int64_t B, T, C, NH;
};
// T around the CPU kernel's 64-row blocks; hs from 1 to 64.
const AttentionCase kAttentionCases[] = {{1, 1, 4, 1},    {2, 7, 12, 3},  {1, 63, 32, 2},
                                         {2, 64, 64, 4},  {1, 65, 48, 3}, {2, 129, 96, 2},
                                         {1, 257, 128, 2}};

TEST_P(OpsTest, Attention) {
  for (const AttentionCase& c : kAttentionCases) {
    SCOPED_TRACE(::testing::Message()
                 << "B=" << c.B << " T=" << c.T << " C=" << c.C << " NH=" << c.NH);
    const int64_t B = c.B, T = c.T, C = c.C, NH = c.NH;
    const FVec qkv = rng_.normal(B * T * 3 * C);
    DevTensor tqkv = tensor(qkv, {B, T, 3 * C});
    DevTensor out = poisoned({B, T, C}), preatt = poisoned({B, NH, T, T}),
              att = poisoned({B, NH, T, T});
    ops::attention_forward(s(), out, preatt, att, tqkv, static_cast<int>(NH));
    DVec r_out(B * T * C), r_pre(B * NH * T * T, 0.0), r_att(B * NH * T * T);
    ref::attention_forward_ref(r_out, r_pre, r_att, to_d(qkv), B, T, C, NH);
    EXPECT_TRUE(close(out.f(), r_out, kTolReduce));
    EXPECT_TRUE(
        close(lower_triangle(preatt.f(), B * NH, T), lower_triangle(r_pre, B * NH, T), kTolReduce));
    const FVec got_att = att.f();
    EXPECT_TRUE(close(got_att, r_att, kTolReduce));
    for (int64_t bh = 0; bh < B * NH; ++bh)  // masked entries are exactly 0
      for (int64_t t = 0; t < T; ++t)
        for (int64_t t2 = t + 1; t2 < T; ++t2) ASSERT_EQ(got_att[(bh * T + t) * T + t2], 0.0f);

    // Backward from the reference att (the contract: 0 above the diagonal); scratch poisoned.
    const FVec dout = rng_.normal(B * T * C), dqkv0 = rng_.normal(B * T * 3 * C);
    DevTensor tdout = tensor(dout, {B, T, C}), tatt = tensor(to_f(r_att), {B, NH, T, T}),
              dqkv = tensor(dqkv0, {B, T, 3 * C});
    DevTensor dpreatt = poisoned({B, NH, T, T}), datt = poisoned({B, NH, T, T});
    ops::attention_backward(s(), dqkv, dpreatt, datt, tdout, tqkv, tatt, static_cast<int>(NH));
    DVec r_dqkv = to_d(dqkv0);
    ref::attention_backward_ref(r_dqkv, to_d(dout), to_d(qkv), r_att, B, T, C, NH);
    EXPECT_TRUE(close(dqkv.f(), r_dqkv, kTolReduce));
  }
}

// ---- activations --------------------------------------------------------------------------------

// Wide inputs with the edges of the activations' formulas (saturation, the kink at 0, NaN-free).
FVec activation_inputs(Rng& rng, int64_t n) {
  FVec x = rng.normal(n, 3.0f);
  const float edges[] = {0.0f,   -0.0f, 1e-30f, -1e-30f, 10.0f,
                         -10.0f, 30.0f, -30.0f, 100.0f,  -100.0f};
  for (size_t i = 0; i < std::size(edges) && static_cast<int64_t>(i) < n; ++i)
    x[n - 1 - i] = edges[i];
  return x;
}

TEST_P(OpsTest, Gelu) {
  for (int64_t n : kElemSizes) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const FVec x = activation_inputs(rng_, n), dout = rng_.normal(n), din0 = rng_.normal(n);
    DevTensor tx = tensor(x, {n}), out = poisoned({n});
    ops::gelu_forward(s(), out, tx);
    DVec r_out(n);
    ref::gelu_forward_ref(r_out, to_d(x));
    EXPECT_TRUE(close(out.f(), r_out, kTolElem));

    DevTensor tdout = tensor(dout, {n}), din = tensor(din0, {n});
    ops::gelu_backward(s(), din, tx, tdout);
    DVec r_din = to_d(din0);
    ref::gelu_backward_ref(r_din, to_d(x), to_d(dout));
    EXPECT_TRUE(close(din.f(), r_din, kTolElem));
  }
}

TEST_P(OpsTest, Relu) {
  for (int64_t n : kElemSizes) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const FVec x = activation_inputs(rng_, n), dout = rng_.normal(n), din0 = rng_.normal(n);
    DevTensor tx = tensor(x, {n}), out = poisoned({n});
    ops::relu_forward(s(), out, tx);
    FVec want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = x[i] < 0 ? 0.0f : x[i];  // -0 stays -0
    EXPECT_TRUE(bitwise_equal(out.f(), want));

    DevTensor tdout = tensor(dout, {n}), din = tensor(din0, {n});
    ops::relu_backward(s(), din, tx, tdout);
    for (int64_t i = 0; i < n; ++i) want[i] = din0[i] + (x[i] > 0 ? dout[i] : 0.0f);
    EXPECT_TRUE(bitwise_equal(din.f(), want));
  }
}

// ---- classifier
// ------------------------------------------------------------------------------------

const RowsCase kClassifierCases[] = {{1, 1}, {3, 7}, {5, 257}, {17, 1000}, {64, 50257}};

TEST_P(OpsTest, Classifier) {
  for (const RowsCase& c : kClassifierCases) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " V=" << c.C);
    const int64_t N = c.N, V = c.C;
    const FVec logits = rng_.normal(N * V, 3.0f);
    IVec targets = rng_.ints(N, 0, static_cast<int32_t>(V));
    if (N > 2) targets[1] = -1;  // ignored row
    const float dloss = 1.0f / static_cast<float>(N);
    DVec r_loss(N), r_dlogits(N * V);
    ref::classifier_ref(r_loss, r_dlogits, to_d(logits), targets, N, V, dloss);

    DevTensor ttargets = tensor(targets, {N});
    DevTensor tlogits = tensor(logits, {N, V}), losses = poisoned({N});
    ops::classifier_forward_backward(s(), tlogits, losses, ttargets, dloss, /*compute_grad=*/false);
    EXPECT_TRUE(close(losses.f(), r_loss, kTolReduce));
    EXPECT_TRUE(bitwise_equal(tlogits.f(), logits));  // untouched without compute_grad

    DevTensor losses2 = poisoned({N});
    ops::classifier_forward_backward(s(), tlogits, losses2, ttargets, dloss, /*compute_grad=*/true);
    EXPECT_TRUE(close(losses2.f(), r_loss, kTolReduce));
    EXPECT_TRUE(close(tlogits.f(), r_dlogits, kTolElem));
  }
}

// Dynamic loss scaling: dloss_scale is one fp32 in device memory, read when the op runs (here
// written on the stream right before it); dlogits are bit for bit those of dloss * scale, the
// losses those of the unscaled call.
TEST_P(OpsTest, ClassifierDlossScaleIsReadFromDeviceMemory) {
  const int64_t N = 9, V = 515;
  const FVec logits = rng_.normal(N * V, 3.0f);
  IVec targets = rng_.ints(N, 0, static_cast<int32_t>(V));
  targets[2] = -1;
  const float dloss = 1.0f / static_cast<float>(N);
  DevTensor ttargets = tensor(targets, {N});
  DevTensor dscale = tensor(FVec{1.0f}, {1});
  const auto* scale_ptr = static_cast<const float*>(dscale.view().data);
  DevTensor plain = tensor(logits, {N, V}), plain_losses = poisoned({N});
  ops::classifier_forward_backward(s(), plain, plain_losses, ttargets, dloss, true);
  DevTensor plain_fwd = tensor(logits, {N, V}), plain_fwd_losses = poisoned({N});
  ops::classifier_forward_backward(s(), plain_fwd, plain_fwd_losses, ttargets, dloss, false);
  for (float scale : {4096.0f, 3.0f}) {
    SCOPED_TRACE(::testing::Message() << "scale " << scale);
    s().copy(dscale.view().data, &scale, sizeof(float));
    DevTensor scaled = tensor(logits, {N, V}), scaled_losses = poisoned({N});
    ops::classifier_forward_backward(s(), scaled, scaled_losses, ttargets, dloss, true, scale_ptr);
    DevTensor direct = tensor(logits, {N, V}), direct_losses = poisoned({N});
    ops::classifier_forward_backward(s(), direct, direct_losses, ttargets, dloss * scale, true);
    EXPECT_TRUE(bitwise_equal(scaled.f(), direct.f()));
    EXPECT_TRUE(bitwise_equal(scaled_losses.f(), plain_losses.f()));
    DVec r_loss(N), r_dlogits(N * V);
    ref::classifier_ref(r_loss, r_dlogits, to_d(logits), targets, N, V, double{dloss} * scale);
    EXPECT_TRUE(close(scaled.f(), r_dlogits, kTolElem));
    // Without compute_grad the scale changes nothing.
    DevTensor untouched = tensor(logits, {N, V}), losses = poisoned({N});
    ops::classifier_forward_backward(s(), untouched, losses, ttargets, dloss, false, scale_ptr);
    EXPECT_TRUE(bitwise_equal(untouched.f(), logits));
    EXPECT_TRUE(bitwise_equal(losses.f(), plain_fwd_losses.f()));
  }
}

// ---- optimizers
// ------------------------------------------------------------------------------------

TEST_P(OpsTest, AdamW) {
  for (int64_t n : {int64_t{1}, int64_t{257}, int64_t{100003}}) {
    for (int step : {1, 17}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " step=" << step);
      const FVec p = rng_.normal(n), g = rng_.normal(n, 0.01f), m = rng_.normal(n, 1e-3f),
                 v = rng_.uniform(n, 0.0f, 1e-4f);
      const ops::AdamWParams hp{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step};
      const float grad_scale = 0.5f;
      DevTensor tp = tensor(p, {n}), tg = tensor(g, {n}), tm = tensor(m, {n}), tv = tensor(v, {n});
      ops::adamw_update(s(), tp, tg, tm, tv, hp, grad_scale);
      DVec rp = to_d(p), rm = to_d(m), rv = to_d(v);
      ref::adamw_ref(rp, to_d(g), rm, rv,
                     {hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, step}, grad_scale);
      EXPECT_TRUE(close(tp.f(), rp, kTolElem));
      EXPECT_TRUE(close(tm.f(), rm, kTolElem));
      EXPECT_TRUE(close(tv.f(), rv, kTolElem));
    }
  }
}

TEST_P(OpsTest, Sgd) {
  for (int64_t n : {int64_t{1}, int64_t{257}, int64_t{100003}}) {
    for (bool nesterov : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " nesterov=" << nesterov);
      const FVec p = rng_.normal(n), g = rng_.normal(n), buf = rng_.normal(n, 0.1f);
      const ops::SgdParams hp{0.1f, 0.9f, 0.01f, nesterov};
      DevTensor tp = tensor(p, {n}), tg = tensor(g, {n}), tb = tensor(buf, {n});
      ops::sgd_update(s(), tp, tg, tb, hp, 2.0f);
      DVec rp = to_d(p), rb = to_d(buf);
      ref::sgd_ref(rp, to_d(g), rb, {hp.lr, hp.momentum, hp.weight_decay, nesterov}, 2.0);
      EXPECT_TRUE(close(tp.f(), rp, kTolElem));
      EXPECT_TRUE(close(tb.f(), rb, kTolElem));
    }
  }
}

// ---- reductions
// ------------------------------------------------------------------------------------

TEST_P(OpsTest, SumSquares) {
  for (int64_t n :
       {int64_t{0}, int64_t{1}, int64_t{4095}, int64_t{4096}, int64_t{4097}, int64_t{1000003}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const FVec x = rng_.normal(n, 0.5f, 0.1f);
    DevTensor tx = tensor(x, {n}), out = poisoned({1});
    ops::sum_squares(s(), out, tx);
    EXPECT_TRUE(close(out.f(), {ref::sum_squares_ref(to_d(x))}, kTolElem));
  }
}

// The step's loss sum (train/step.cc): the float64 sum, rounded once; deterministic.
TEST_P(OpsTest, Sum) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{4095}, int64_t{4097}, int64_t{1000003}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const FVec x = rng_.normal(n, 0.5f, 0.1f);
    DevTensor tx = tensor(x, {n}), out = poisoned({1}), again = poisoned({1});
    ops::sum(s(), out, tx);
    double want = 0;
    for (float v : x) want += v;
    EXPECT_TRUE(close(out.f(), {want}, kTolElem));
    ops::sum(s(), again, tx);
    EXPECT_TRUE(bitwise_equal(again.f(), out.f()));
  }
}

// ---- finite differences: the references' and the ops' backward against d(sum(out * R)) ----------

// Central differences in float64 with h = 1e-5: truncation ~h^2 |f'''| ~ 1e-10, cancellation
// ~1e-16 |L| / h ~ 1e-10, so the numerical gradient is good to ~1e-8 relative at these sizes.
constexpr Tol kTolFd{1e-6, 1e-7};

DVec numeric_grad(DVec& x, const std::function<double()>& loss) {
  constexpr double h = 1e-5;
  DVec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double lp = loss();
    x[i] = saved - h;
    const double lm = loss();
    x[i] = saved;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

double dot(const DVec& a, const DVec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

DVec plus(const FVec& a, const DVec& b) {
  DVec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

// Inputs as the op sees them: rounded to float, then widened, so both sides use the same values.
DVec rounded(const FVec& v) { return to_d(v); }

TEST_P(OpsTest, LayernormBackwardMatchesFiniteDifferences) {
  const int64_t N = 3, C = 7;
  const float eps = 1e-5f;
  const FVec fin = rng_.normal(N * C, 2.0f, 1.0f), fw = rng_.normal(C), fb = rng_.normal(C),
             fR = rng_.normal(N * C);
  DVec in = rounded(fin), w = rounded(fw), b = rounded(fb), R = rounded(fR);
  auto loss = [&] {
    DVec out(N * C), mean(N), rstd(N);
    ref::layernorm_forward_ref(out, mean, rstd, in, w, b, N, C, eps);
    return dot(out, R);
  };
  const DVec fd_in = numeric_grad(in, loss), fd_w = numeric_grad(w, loss),
             fd_b = numeric_grad(b, loss);

  DVec out(N * C), mean(N), rstd(N), din(N * C, 0.0), dw(C, 0.0), db(C, 0.0);
  ref::layernorm_forward_ref(out, mean, rstd, in, w, b, N, C, eps);
  ref::layernorm_backward_ref(din, dw, db, R, in, w, mean, rstd, N, C);
  EXPECT_TRUE(close(to_f(din), fd_in, kTolElem)) << "reference backward, din";
  EXPECT_TRUE(close(to_f(dw), fd_w, kTolElem)) << "reference backward, dweight";
  EXPECT_TRUE(close(to_f(db), fd_b, kTolElem)) << "reference backward, dbias";
  for (size_t i = 0; i < din.size(); ++i)
    EXPECT_NEAR(din[i], fd_in[i], 1e-7 + 1e-6 * std::fabs(fd_in[i]));

  const FVec g_in = rng_.normal(N * C), g_w = rng_.normal(C), g_b = rng_.normal(C);
  DevTensor tin = tensor(fin, {N, C}), tw = tensor(fw, {C}), tb = tensor(fb, {C}),
            tR = tensor(fR, {N, C});
  DevTensor tout = poisoned({N, C}), tmean = poisoned({N}), trstd = poisoned({N});
  DevTensor tdin = tensor(g_in, {N, C}), tdw = tensor(g_w, {C}), tdb = tensor(g_b, {C});
  ops::layernorm_forward(s(), tout, tmean, trstd, tin, tw, tb, eps);
  ops::layernorm_backward(s(), tdin, tdw, tdb, tR, tin, tw, tmean, trstd);
  EXPECT_TRUE(close(tdin.f(), plus(g_in, fd_in), kTolReduce)) << "op backward, din";
  EXPECT_TRUE(close(tdw.f(), plus(g_w, fd_w), kTolReduce)) << "op backward, dweight";
  EXPECT_TRUE(close(tdb.f(), plus(g_b, fd_b), kTolReduce)) << "op backward, dbias";
}

TEST_P(OpsTest, MatmulBackwardMatchesFiniteDifferences) {
  const int64_t N = 3, C = 5, OC = 4;
  const FVec fin = rng_.normal(N * C), fw = rng_.normal(OC * C), fb = rng_.normal(OC),
             fR = rng_.normal(N * OC);
  DVec in = rounded(fin), w = rounded(fw), b = rounded(fb), R = rounded(fR);
  auto loss = [&] {
    DVec out(N * OC);
    ref::matmul_forward_ref(out, in, w, b, N, C, OC);
    return dot(out, R);
  };
  const DVec fd_in = numeric_grad(in, loss), fd_w = numeric_grad(w, loss),
             fd_b = numeric_grad(b, loss);
  DVec din(N * C, 0.0), dw(OC * C, 0.0), db(OC, 0.0);
  ref::matmul_backward_ref(din, dw, db, R, in, w, N, C, OC);
  EXPECT_TRUE(close(to_f(din), fd_in, kTolFd)) << "reference backward, din";
  EXPECT_TRUE(close(to_f(dw), fd_w, kTolFd)) << "reference backward, dweight";
  EXPECT_TRUE(close(to_f(db), fd_b, kTolFd)) << "reference backward, dbias";

  const FVec g_in = rng_.normal(N * C), g_w = rng_.normal(OC * C), g_b = rng_.normal(OC);
  DevTensor tin = tensor(fin, {N, C}), tw = tensor(fw, {OC, C}), tR = tensor(fR, {N, OC});
  DevTensor tdin = tensor(g_in, {N, C}), tdw = tensor(g_w, {OC, C}), tdb = tensor(g_b, {OC});
  ops::matmul_backward(s(), tdin, tdw, tdb, tR, tin, tw);
  EXPECT_TRUE(close(tdin.f(), plus(g_in, fd_in), kTolReduce)) << "op backward, din";
  EXPECT_TRUE(close(tdw.f(), plus(g_w, fd_w), kTolReduce)) << "op backward, dweight";
  EXPECT_TRUE(close(tdb.f(), plus(g_b, fd_b), kTolReduce)) << "op backward, dbias";
}

TEST_P(OpsTest, AttentionBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 5, C = 6, NH = 2;
  const FVec fqkv = rng_.normal(B * T * 3 * C), fR = rng_.normal(B * T * C);
  DVec qkv = rounded(fqkv), R = rounded(fR);
  DVec out(B * T * C), pre(B * NH * T * T, 0.0), att(B * NH * T * T);
  auto loss = [&] {
    ref::attention_forward_ref(out, pre, att, qkv, B, T, C, NH);
    return dot(out, R);
  };
  const DVec fd = numeric_grad(qkv, loss);
  loss();  // att at the unperturbed point
  DVec dqkv(B * T * 3 * C, 0.0);
  ref::attention_backward_ref(dqkv, R, qkv, att, B, T, C, NH);
  EXPECT_TRUE(close(to_f(dqkv), fd, kTolFd)) << "reference backward";

  const FVec g = rng_.normal(B * T * 3 * C);
  DevTensor tqkv = tensor(fqkv, {B, T, 3 * C}), tR = tensor(fR, {B, T, C}),
            tdqkv = tensor(g, {B, T, 3 * C});
  DevTensor tout = poisoned({B, T, C}), tpre = poisoned({B, NH, T, T}),
            tatt = poisoned({B, NH, T, T});
  DevTensor tdpre = poisoned({B, NH, T, T}), tdatt = poisoned({B, NH, T, T});
  ops::attention_forward(s(), tout, tpre, tatt, tqkv, static_cast<int>(NH));
  ops::attention_backward(s(), tdqkv, tdpre, tdatt, tR, tqkv, tatt, static_cast<int>(NH));
  EXPECT_TRUE(close(tdqkv.f(), plus(g, fd), kTolReduce)) << "op backward";
}

TEST_P(OpsTest, ActivationBackwardsMatchFiniteDifferences) {
  const int64_t n = 64;
  FVec fx = rng_.normal(n, 2.0f);
  for (float& v : fx) v += v >= 0 ? 0.01f : -0.01f;  // away from ReLU's kink
  const FVec fR = rng_.normal(n);
  DVec x = rounded(fx), R = rounded(fR);
  for (bool gelu : {true, false}) {
    SCOPED_TRACE(gelu ? "gelu" : "relu");
    auto loss = [&] {
      DVec out(n);
      gelu ? ref::gelu_forward_ref(out, x) : ref::relu_forward_ref(out, x);
      return dot(out, R);
    };
    const DVec fd = numeric_grad(x, loss);
    DVec din(n, 0.0);
    gelu ? ref::gelu_backward_ref(din, x, R) : ref::relu_backward_ref(din, x, R);
    EXPECT_TRUE(close(to_f(din), fd, kTolFd)) << "reference backward";

    const FVec g = rng_.normal(n);
    DevTensor tx = tensor(fx, {n}), tR = tensor(fR, {n}), tdin = tensor(g, {n});
    gelu ? ops::gelu_backward(s(), tdin, tx, tR) : ops::relu_backward(s(), tdin, tx, tR);
    EXPECT_TRUE(close(tdin.f(), plus(g, fd), kTolElem)) << "op backward";
  }
}

TEST_P(OpsTest, EncoderBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 3, C = 4, V = 5, maxT = 4;
  const IVec tokens = {0, 3, 3, 4, 0, 0};  // repeats accumulate
  const FVec fwte = rng_.normal(V * C), fwpe = rng_.normal(maxT * C), fR = rng_.normal(B * T * C);
  DVec wte = rounded(fwte), wpe = rounded(fwpe), R = rounded(fR);
  auto loss = [&] {
    DVec out(B * T * C);
    ref::encoder_forward_ref(out, tokens, wte, wpe, B, T, C);
    return dot(out, R);
  };
  const DVec fd_wte = numeric_grad(wte, loss), fd_wpe = numeric_grad(wpe, loss);
  DVec dwte(V * C, 0.0), dwpe(maxT * C, 0.0);
  ref::encoder_backward_ref(dwte, dwpe, R, tokens, B, T, C);
  EXPECT_TRUE(close(to_f(dwte), fd_wte, kTolFd)) << "reference backward, dwte";
  EXPECT_TRUE(close(to_f(dwpe), fd_wpe, kTolFd)) << "reference backward, dwpe";

  const FVec g_wte = rng_.normal(V * C), g_wpe = rng_.normal(maxT * C);
  DevTensor ttok = tensor(tokens, {B, T}), tR = tensor(fR, {B, T, C});
  DevTensor tdwte = tensor(g_wte, {V, C}), tdwpe = tensor(g_wpe, {maxT, C});
  ops::encoder_backward(s(), tdwte, tdwpe, tR, ttok);
  EXPECT_TRUE(close(tdwte.f(), plus(g_wte, fd_wte), kTolReduce)) << "op backward, dwte";
  EXPECT_TRUE(close(tdwpe.f(), plus(g_wpe, fd_wpe), kTolReduce)) << "op backward, dwpe";
}

TEST_P(OpsTest, ClassifierGradientMatchesFiniteDifferences) {
  const int64_t N = 4, V = 6;
  const IVec targets = {2, -1, 0, 5};
  const double dloss = 0.37;
  const FVec flogits = rng_.normal(N * V, 2.0f);
  DVec logits = rounded(flogits);
  auto loss = [&] {
    DVec losses(N), dl(N * V);
    ref::classifier_ref(losses, dl, logits, targets, N, V, dloss);
    double total = 0;
    for (double l : losses) total += l;
    return dloss * total;
  };
  const DVec fd = numeric_grad(logits, loss);
  DVec losses(N), dlogits(N * V);
  ref::classifier_ref(losses, dlogits, logits, targets, N, V, dloss);
  EXPECT_TRUE(close(to_f(dlogits), fd, kTolFd)) << "reference gradient";

  DevTensor tlogits = tensor(flogits, {N, V}), tlosses = poisoned({N}),
            ttargets = tensor(targets, {N});
  ops::classifier_forward_backward(s(), tlogits, tlosses, ttargets, static_cast<float>(dloss),
                                   true);
  EXPECT_TRUE(close(tlogits.f(), fd, kTolElem)) << "op gradient";
}

INSTANTIATE_TEST_SUITE_P(Backends, OpsTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(backend_name(info.param));
                         });

// ---- determinism
// -------------------------------------------------------------------------------------

// Outputs of the ops with cross-row reductions or BLAS calls on fixed inputs, as bytes.
std::vector<uint8_t> determinism_outputs(Device& dev) {
  Stream& s = dev.compute();
  Rng rng(7);
  std::vector<uint8_t> bytes;
  auto tensor = [&](const FVec& v, Shape shape) {
    DevTensor t(dev, s, DType::kF32, shape);
    t.upload(v);
    return t;
  };
  auto append = [&](const DevTensor& t) {
    const FVec v = t.f();
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    bytes.insert(bytes.end(), p, p + v.size() * sizeof(float));
  };
  {  // matmul forward + backward
    const int64_t N = 300, C = 257, OC = 129;
    DevTensor in = tensor(rng.normal(N * C), {N, C}), w = tensor(rng.normal(OC * C), {OC, C}),
              b = tensor(rng.normal(OC), {OC}), out = tensor(FVec(N * OC), {N, OC});
    ops::matmul_forward(s, out, in, w, b);
    DevTensor dout = tensor(rng.normal(N * OC), {N, OC}), din = tensor(rng.normal(N * C), {N, C}),
              dw = tensor(rng.normal(OC * C), {OC, C}), db = tensor(rng.normal(OC), {OC});
    ops::matmul_backward(s, din, dw, db, dout, in, w);
    for (const DevTensor* t : {&out, &din, &dw, &db}) append(*t);
  }
  {  // layernorm backward over many rows
    const int64_t N = 1000, C = 300;
    DevTensor in = tensor(rng.normal(N * C), {N, C}), w = tensor(rng.normal(C), {C}),
              b = tensor(rng.normal(C), {C}), out = tensor(FVec(N * C), {N, C}),
              mean = tensor(FVec(N), {N}), rstd = tensor(FVec(N), {N});
    ops::layernorm_forward(s, out, mean, rstd, in, w, b, 1e-5f);
    DevTensor dout = tensor(rng.normal(N * C), {N, C}), din = tensor(rng.normal(N * C), {N, C}),
              dw = tensor(rng.normal(C), {C}), db = tensor(rng.normal(C), {C});
    ops::layernorm_backward(s, din, dw, db, dout, in, w, mean, rstd);
    for (const DevTensor* t : {&out, &din, &dw, &db}) append(*t);
  }
  {  // attention forward + backward
    const int64_t B = 2, T = 130, C = 64, NH = 4;
    DevTensor qkv = tensor(rng.normal(B * T * 3 * C), {B, T, 3 * C}),
              out = tensor(FVec(B * T * C), {B, T, C}),
              pre = tensor(FVec(B * NH * T * T), {B, NH, T, T}),
              att = tensor(FVec(B * NH * T * T), {B, NH, T, T});
    ops::attention_forward(s, out, pre, att, qkv, NH);
    DevTensor dout = tensor(rng.normal(B * T * C), {B, T, C}),
              dqkv = tensor(rng.normal(B * T * 3 * C), {B, T, 3 * C}),
              dpre = tensor(FVec(B * NH * T * T), {B, NH, T, T}),
              datt = tensor(FVec(B * NH * T * T), {B, NH, T, T});
    ops::attention_backward(s, dqkv, dpre, datt, dout, qkv, att, NH);
    for (const DevTensor* t : {&out, &att, &dqkv}) append(*t);
  }
  {  // encoder backward with heavy token repetition
    const int64_t B = 4, T = 64, C = 200, V = 7;
    DevTensor tokens(dev, s, DType::kI32, {B, T});
    tokens.upload(rng.ints(B * T, 0, V));
    DevTensor dout = tensor(rng.normal(B * T * C), {B, T, C}),
              dwte = tensor(rng.normal(V * C), {V, C}), dwpe = tensor(rng.normal(T * C), {T, C});
    ops::encoder_backward(s, dwte, dwpe, dout, tokens);
    append(dwte);
    append(dwpe);
  }
  {  // classifier + sum of squares
    const int64_t N = 33, V = 3001;
    DevTensor logits = tensor(rng.normal(N * V, 3.0f), {N, V}), losses = tensor(FVec(N), {N});
    DevTensor targets(dev, s, DType::kI32, {N});
    targets.upload(rng.ints(N, 0, V));
    ops::classifier_forward_backward(s, logits, losses, targets, 0.5f, true);
    DevTensor x = tensor(rng.normal(1000003), {1000003}), out = tensor(FVec(1), {1});
    ops::sum_squares(s, out, x);
    for (const DevTensor* t : {&logits, &losses, &out}) append(*t);
  }
  return bytes;
}


// The child half of SameBitsForAnyThreadCount (skips unless that test started it).
TEST(Determinism, ChildWritesOutputs) {
  const char* path = std::getenv("ZT_DETERMINISM_OUT");
  if (path == nullptr) GTEST_SKIP() << "runs as a child of Determinism.SameBitsForAnyThreadCount";
  auto rt = Runtime::create_cpu(1);
  const std::vector<uint8_t> bytes = determinism_outputs(rt->device(0));
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good());
}

TEST(Determinism, SameBitsForAnyThreadCount) {
  auto rt = Runtime::create_cpu(2);
  const std::vector<uint8_t> want = determinism_outputs(rt->device(0));
  ASSERT_GT(want.size(), 0u);
  EXPECT_TRUE(bitwise_equal(determinism_outputs(rt->device(0)), want)) << "run to run";

  // Two devices at once: both share the worker pool and OpenBLAS, so chunks land on other threads.
  std::vector<uint8_t> other;
  std::thread t([&] { other = determinism_outputs(rt->device(1)); });
  const std::vector<uint8_t> mine = determinism_outputs(rt->device(0));
  t.join();
  EXPECT_TRUE(bitwise_equal(mine, want)) << "concurrent, device 0";
  EXPECT_TRUE(bitwise_equal(other, want)) << "concurrent, device 1";

  for (int threads : {1, 3}) {
    EXPECT_TRUE(bitwise_equal(outputs_of_child(threads, "Determinism.ChildWritesOutputs"), want)) << threads << " threads";
  }
}

// ---- argument validation
// --------------------------------------------------------------------------------

using ::testing::HasSubstr;

using op_test::error_of;

class OpsValidation : public ::testing::Test {
 protected:
  void SetUp() override {
    rt_ = Runtime::create_cpu(2);
    dev_ = &rt_->device(0);
  }
  DevTensor make(Shape shape, DType dtype = DType::kF32, int device = 0) {
    return DevTensor(rt_->device(device), rt_->device(device).compute(), dtype, shape);
  }
  Stream& s() { return dev_->compute(); }
  std::unique_ptr<Runtime> rt_;
  Device* dev_ = nullptr;
};

TEST_F(OpsValidation, ShapeMismatchNamesOpAndShapes) {
  DevTensor in = make({4, 64}), out = make({4, 64}), w = make({32}), b = make({64}),
            mean = make({4}), rstd = make({4});
  const Error e = error_of([&] { ops::layernorm_forward(s(), out, mean, rstd, in, w, b, 1e-5f); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_THAT(e.message(), HasSubstr("layernorm_forward: in [4, 64] but weight [32]"));

  DevTensor x = make({3, 5}), wt = make({7, 6}), o = make({3, 7});
  EXPECT_THAT(error_of([&] { ops::matmul_forward(s(), o, x, wt, TensorView{}); }).message(),
              HasSubstr("matmul_forward: in [3, 5] but weight [7, 6]"));
  DevTensor qkv = make({2, 4, 12}), aout = make({2, 4, 4}), pre = make({2, 3, 4, 4}),
            att = make({2, 3, 4, 4});
  EXPECT_THAT(error_of([&] { ops::attention_forward(s(), aout, pre, att, qkv, 3); }).message(),
              HasSubstr("3 heads do not divide"));
}

TEST_F(OpsValidation, DtypeAndDeviceAreChecked) {
  DevTensor a = make({8}), b = make({8}, DType::kF16), c = make({8}, DType::kF32, /*device=*/1);
  const Error e1 = error_of([&] { ops::add(s(), a, a, b); });
  EXPECT_EQ(e1.kind(), ErrorKind::kInvalidArgument);
  EXPECT_THAT(e1.message(), HasSubstr("add: b [8] is fp16 but must be fp32"));
  const Error e2 = error_of([&] { ops::add(s(), a, a, c); });
  EXPECT_THAT(e2.message(), HasSubstr("add: b [8] is on device 1 but the stream runs on cpu:0"));
  DevTensor i = make({8}, DType::kI32);
  EXPECT_THAT(error_of([&] { ops::cast(s(), a, i); }).message(), HasSubstr("cast:"));
}

TEST_F(OpsValidation, BadTokenIsADeviceErrorNamingTheToken) {
  DevTensor tokens = make({1, 3}, DType::kI32), wte = make({5, 4}), wpe = make({3, 4}),
            out = make({1, 3, 4});
  tokens.upload(IVec{1, 5, 0});
  ops::encoder_forward(s(), out, tokens, wte, wpe);
  const Error e = error_of([&] { s().synchronize(); });
  EXPECT_EQ(e.kind(), ErrorKind::kDevice);
  EXPECT_THAT(e.message(), HasSubstr("token id 5 at (b=0, t=1)"));
}

// Counts the stream tasks a runtime reports, by name; installed on the fixture's runtime for one
// scope (removed before it goes: the runtime outlives the test body).
class TaskNames final : public TaskObserver {
 public:
  explicit TaskNames(Runtime& rt) : rt_(rt) { rt_.set_observer(this); }
  ~TaskNames() override { rt_.set_observer(nullptr); }
  void on_task(int, int, const char* name, Clock::time_point, Clock::time_point) override {
    std::lock_guard<std::mutex> lock(mu_);
    names_.emplace_back(name);
  }
  std::vector<std::string> names() {
    std::lock_guard<std::mutex> lock(mu_);
    return names_;
  }

 private:
  Runtime& rt_;
  std::mutex mu_;
  std::vector<std::string> names_;
};

TEST_F(OpsValidation, EmptyTensorsLaunchNothing) {
  DevTensor in = make({0, 8}), out = make({0, 8}), w = make({8}), b = make({8}), mean = make({0}),
            rstd = make({0}), x = make({3, 0}), y = make({0}), bias = make({0}), wt = make({0, 8}),
            ssq = make({1});
  TaskNames tasks(*rt_);
  ops::layernorm_forward(s(), out, mean, rstd, in, w, b, 1e-5f);
  ops::gelu_forward(s(), out, in);
  ops::gelu_backward(s(), out, in, out);
  ops::fill(s(), y, 1.0f);
  ops::scale(s(), y, 2.0f);
  ops::add(s(), y, y, y);
  ops::accumulate(s(), y, y);
  ops::cast(s(), y, y);
  ops::matmul_forward(s(), make({0, 0}), in, wt, bias);
  ops::matmul_forward(s(), x, make({3, 8}), wt, bias);
  s().synchronize();
  EXPECT_TRUE(tasks.names().empty()) << tasks.names().size() << " tasks ran, the first " << tasks.names()[0];
  // The observer does see a launch: the check above can fail.
  ops::sum_squares(s(), ssq, y);  // an empty sum still writes out[0] = 0
  ops::fill(s(), w, 1.0f);
  s().synchronize();
  EXPECT_EQ(tasks.names(), (std::vector<std::string>{"sum_squares", "fill"}));
}

TEST_F(OpsValidation, EveryOpHasACpuKernelAndADistinctName) {
  std::vector<std::string> names;
  for (int i = 0; i < static_cast<int>(OpId::kCount); ++i) {
    const auto op = static_cast<OpId>(i);
    EXPECT_TRUE(cpu_op_table().has_entry(op)) << op_name(op);
    names.emplace_back(op_name(op));
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::adjacent_find(names.begin(), names.end()), names.end());
  EXPECT_EQ(std::count(names.begin(), names.end(), "unknown op"), 0);
  EXPECT_EQ(op_table(Backend::kCpu), &cpu_op_table());
}

TEST_F(OpsValidation, MissingKernelFallsBackOrIsRefusedNamingOpDtypesAndBackend) {
  // A CPU table without accumulate and cast kernels.
  OpTable t = cpu_op_table();
  t.accumulate = nullptr;
  t.cast = nullptr;
  ScopedOpTable scoped(Backend::kCpu, &t);
  TaskNames tasks(*rt_);

  // fp32 accumulate falls back to add(dst, dst, src): the same bits.
  const int64_t n = 1031;
  Rng rng(7);
  FVec a = rng.normal(n), b = rng.normal(n), want(static_cast<size_t>(n));
  for (size_t i = 0; i < want.size(); ++i) want[i] = a[i] + b[i];
  DevTensor dst = make({n}), src = make({n});
  dst.upload(a);
  src.upload(b);
  ops::accumulate(s(), dst, src);
  EXPECT_EQ(dst.f(), want);

  // A same-type cast falls back to a copy.
  std::vector<uint16_t> h(static_cast<size_t>(n));
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i * 40503u);
  DevTensor h1 = make({n}, DType::kF16), h2 = make({n}, DType::kF16);
  h1.upload(h);
  ops::cast(s(), h2, h1);
  EXPECT_EQ(h2.download<uint16_t>(), h);
  const std::vector<std::string> ran = tasks.names();
  EXPECT_EQ(std::count(ran.begin(), ran.end(), "add"), 1);
  EXPECT_EQ(std::count(ran.begin(), ran.end(), "accumulate"), 0);

  // No fallback applies: one sentence naming the op, the dtypes and the backend.
  DevTensor g1 = make({n}, DType::kBF16), g2 = make({n}, DType::kBF16), f = make({n});
  const Error e1 = error_of([&] { ops::accumulate(s(), g1, g2); });
  EXPECT_EQ(e1.kind(), ErrorKind::kInvalidArgument);
  EXPECT_THAT(e1.message(), HasSubstr("accumulate: the cpu backend (cpu:0) has no kernel for " +
                                      std::string(dtype_name(DType::kBF16)) + " and no fallback applies"));
  const Error e2 = error_of([&] { ops::cast(s(), g1, f); });
  EXPECT_THAT(e2.message(), HasSubstr("cast: the cpu backend (cpu:0) has no kernel for " +
                                      std::string(dtype_name(DType::kBF16)) + ", " +
                                      dtype_name(DType::kF32)));
}

}  // namespace
}  // namespace zt
