// The tolerance policy's bounds (tests/tolerance.h, tests/README.md): the bound functions on
// constructed cases (the rounding the first GPU run showed passes, twice the bound fails), and the
// mutation check: every GEMM epilogue family and attention, run on the CPU backend, is judged
// against float64 references of deliberately wrong ops (a transposed operand, a dropped bias or
// accumulation, a scale x2, a wrong softmax scale, no causal mask) and must fail the derived bounds
// that the correct reference passes. CPU only: it is what runs in CI, and it exercises the same
// checks the CUDA instances of test_gemm, test_classifier and test_flash_attention make.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "op_test_util.h"
#include "runtime/runtime.h"
#include "tolerance.h"

namespace zt {
namespace {

using namespace op_test;  // NOLINT(build/namespaces): the helpers shared by the op test binaries
namespace tol = tolerance;
using U16 = std::vector<uint16_t>;

uint16_t to_bits(double x, DType t) {
  return t == DType::kBF16 ? float_to_bf16_bits(static_cast<float>(x)) : float_to_half_bits(static_cast<float>(x));
}
double from_bits(uint16_t b, DType t) { return t == DType::kBF16 ? bf16_bits_to_float(b) : half_bits_to_float(b); }
double round16(double x, DType t) { return from_bits(to_bits(x, t), t); }

// ---- the bound functions on constructed cases --------------------------------------------------

// A bf16 GEMM output one ulp off (1 + 2^-7 for an exact 1: what a double rounding gives) passes;
// off by twice the bound, or NaN, fails.
TEST(ToleranceBounds, OneUlpOfBf16PassesTwiceTheBoundFails) {
  for (const int64_t K : {1, 64, 4096}) {
    SCOPED_TRACE(K);
    const double bound = tol::dot_bound(DType::kBF16, K, 1.0);
    EXPECT_TRUE(tol::within(std::vector<double>{1.0 + 0x1p-7}, DVec{1.0}, DVec{bound}));
    EXPECT_TRUE(tol::within(std::vector<double>{1.0 - 0x1p-8}, DVec{1.0}, DVec{bound}));
    EXPECT_FALSE(tol::within(std::vector<double>{1.0 + 2 * bound}, DVec{1.0}, DVec{bound}));
    EXPECT_FALSE(tol::within(std::vector<double>{NAN}, DVec{1.0}, DVec{bound}));
    // Two roundings of bf16 and the accumulation term, nothing more: below 3 ulps at K = 4096.
    EXPECT_LT(bound, 3 * 0x1p-7);
  }
  // fp32 at K = 1: a few fp32 ulps. The accumulation term grows linearly with K.
  EXPECT_LT(tol::dot_bound(DType::kF32, 1, 1.0), 4 * 0x1p-23);
  EXPECT_NEAR(tol::dot_bound(DType::kF32, 1000, 1.0) / tol::dot_bound(DType::kF32, 100, 1.0), 10.0, 0.2);
  EXPECT_DOUBLE_EQ(tol::gamma(1, 0x1p-23), 0x1p-23 / (1 - 0x1p-23));
  EXPECT_EQ(tol::gamma(1 << 24, 0x1p-23), INFINITY);
}

// What cuBLASLt's BIAS and beta = 1 epilogues did on the GPU: the product rounded to the output type,
// then the bias (or old value) added and rounded again. Within the bound for every sign mix
// (cancellation included: the magnitude, not the result, sets the bound), in bf16 and fp16.
TEST(ToleranceBounds, DoubleRoundingOfAProductPlusBiasPasses) {
  Rng rng(test_seed() + 101);
  for (const DType t : {DType::kBF16, DType::kF16}) {
    const FVec a = rng.normal(4000), b = rng.normal(4000);
    for (size_t i = 0; i < a.size(); ++i) {
      const double product = round16(a[i], t) * 0.75, bias = round16(b[i], t);
      const double got = round16(round16(product, t) + bias, t), want = product + bias;
      const double bound = tol::dot_bound(t, 2, std::fabs(product) + std::fabs(bias));
      ASSERT_LE(std::fabs(got - want), bound) << dtype_name(t) << " product " << product << " bias " << bias;
    }
  }
}

// The GELU helpers against the reference GELU: gelu_grad is its derivative (central differences),
// kGeluLipschitz bounds it, and an error dt in tanh moves gelu and gelu' by at most the stated
// sensitivities.
TEST(ToleranceBounds, GeluSensitivities) {
  const int n = 2001;
  DVec x(n), y(n), yp(n), ym(n);
  for (int i = 0; i < n; ++i) x[i] = -8.0 + 16.0 * i / (n - 1);
  const double h = 1e-5;
  DVec xp = x, xm = x;
  for (int i = 0; i < n; ++i) xp[i] += h, xm[i] -= h;
  ref::gelu_forward_ref(y, x);
  ref::gelu_forward_ref(yp, xp);
  ref::gelu_forward_ref(ym, xm);
  const double c = 0.7978845608028654, dt = 1e-4;
  for (int i = 0; i < n; ++i) {
    const double g = tol::gelu_grad(x[i]);
    ASSERT_NEAR(g, (yp[i] - ym[i]) / (2 * h), 1e-6) << x[i];
    ASSERT_LE(std::fabs(g), tol::kGeluLipschitz) << x[i];
    const double t = std::tanh(c * (x[i] + 0.044715 * x[i] * x[i] * x[i]));
    const double shifted = 0.5 * x[i] * (1 + t + dt);
    ASSERT_LE(std::fabs(shifted - y[i]), tol::gelu_tanh_sensitivity(x[i]) * dt * (1 + 1e-9) + 1e-15);
    const double du = c * (1 + 3 * 0.044715 * x[i] * x[i]);
    const double gp = 0.5 * (1 + t + dt) + 0.5 * x[i] * (1 - (t + dt) * (t + dt)) * du;
    ASSERT_LE(std::fabs(gp - g), tol::gelu_grad_tanh_sensitivity(x[i]) * dt * (1 + 1e-3) + 1e-12) << x[i];
  }
}

// One query (T = 1): P = 1 and out = v. The stored bf16 out one ulp off passes; fp32 bounds are
// far below bf16's (2^-8 relative).
TEST(ToleranceBounds, AttentionOfOneTokenIsItsValue) {
  const int64_t B = 1, T = 1, C = 4, NH = 1;
  const DVec qkv = {0.5, -1.25, 2.0, 0.75, 1.0, 0.5, -0.5, 0.25, 1.5, -3.0, 0.375, 1.0};
  const DVec dout = {1.0, 1.0, -1.0, 0.5}, v = {1.5, -3.0, 0.375, 1.0};
  for (const DType t : {DType::kBF16, DType::kF32}) {
    const tol::AttentionBounds ab = tol::attention_bounds(t, qkv, dout, v, B, T, C, NH);
    const DVec bound = tol::stored_bounds(t, ab.out, ab.out_mag);
    std::vector<double> one_ulp(v.size());
    for (size_t i = 0; i < v.size(); ++i) one_ulp[i] = v[i] * (1 + 2 * tol::unit_roundoff(t));
    EXPECT_TRUE(tol::within(one_ulp, v, bound)) << dtype_name(t);
    std::vector<double> twice(v.size());
    for (size_t i = 0; i < v.size(); ++i) twice[i] = v[i] + 2 * bound[i];
    EXPECT_FALSE(tol::within(twice, v, bound)) << dtype_name(t);
    if (t == DType::kF32) {
      EXPECT_LT(*std::max_element(bound.begin(), bound.end()), 1e-4);
    }
  }
}

// ---- the mutation check --------------------------------------------------------------------------

// The fraction of elements a wrong reference puts beyond the bounds: the check must fail (> 0), and
// for these mutations on random inputs it flags most elements.
double flagged(const FVec& got, const DVec& wrong, const DVec& bound) {
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) bad += !(std::fabs(got[i] - wrong[i]) <= bound[i]);
  return static_cast<double>(bad) / static_cast<double>(got.size());
}
constexpr double kMinFlagged = 0.5;

#define EXPECT_CAUGHT(got, wrong, bound, what)                                   \
  do {                                                                           \
    const double f = flagged((got), (wrong), (bound));                           \
    EXPECT_FALSE(tol::within((got), (wrong), (bound))) << (what);                \
    EXPECT_GE(f, kMinFlagged) << (what) << ": only " << f << " of the elements"; \
  } while (0)

DVec scaled(const DVec& v, double k) {
  DVec r(v);
  for (double& x : r) x *= k;
  return r;
}
// A [R, C] row-major matrix read as if stored [C, R]: what a wrong transpose flag does.
DVec transposed_read(const DVec& m, int64_t R, int64_t C) {
  DVec r(m.size());
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) r[i * C + j] = m[j * R + i];
  return r;
}

class MutationTest : public ::testing::Test {
 protected:
  void SetUp() override { rt_ = Runtime::create_cpu(1); }
  Stream& s() { return rt_->device(0).compute(); }
  // A tensor of type t holding x rounded to t; `values` gets what it holds.
  DevTensor make(const FVec& x, Shape shape, DType t, DVec* values = nullptr) {
    DevTensor d(rt_->device(0), s(), t, shape);
    if (values) values->resize(x.size());
    if (t == DType::kF32) {
      d.upload(x);
      if (values) *values = to_d(x);
    } else {
      U16 bits(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        bits[i] = to_bits(x[i], t);
        if (values) (*values)[i] = from_bits(bits[i], t);
      }
      d.upload(bits);
    }
    return d;
  }
  DevTensor nan_as(Shape shape, DType t) { return make(nan_vec(shape.numel()), shape, t); }
  static FVec values(const DevTensor& d) {
    const DType t = d.view().dtype;
    if (t == DType::kF32) return d.f();
    const U16 bits = d.download<uint16_t>();
    FVec v(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) v[i] = static_cast<float>(from_bits(bits[i], t));
    return v;
  }
  std::unique_ptr<Runtime> rt_;
  Rng rng_{test_seed() + 211};
};

const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
constexpr int64_t kN = 19, kC = 40, kOC = 24;  // tiny: a few ms per type

// matmul_forward with the BIAS epilogue, and the LM head (no bias).
TEST_F(MutationTest, MatmulForwardAndLmHead) {
  const int64_t N = kN, C = kC, OC = kOC;
  for (const DType t : kTypes) {
    SCOPED_TRACE(dtype_name(t));
    DVec in, w, b;
    DevTensor tin = make(rng_.normal(N * C), {N, C}, t, &in), tw = make(rng_.normal(OC * C), {OC, C}, t, &w);
    DevTensor tb = make(rng_.normal(OC), {OC}, t, &b), out = nan_as({N, OC}, t), head = nan_as({N, OC}, t);
    ops::matmul_forward(s(), out, tin, tw, tb);
    ops::lm_head_forward(s(), head, tin, tw);
    DVec r(N * OC), r_nobias(N * OC), r_t(N * OC);
    ref::matmul_forward_ref(r, in, w, b, N, C, OC);
    ref::matmul_forward_ref(r_nobias, in, w, {}, N, C, OC);
    ref::matmul_forward_ref(r_t, in, transposed_read(w, OC, C), b, N, C, OC);
    const DVec bound = tol::matmul_forward_bound(t, in, w, b, N, C, OC);
    const FVec got = values(out);
    ASSERT_TRUE(tol::within(got, r, bound));
    EXPECT_CAUGHT(got, r_t, bound, "weight transposed");
    EXPECT_CAUGHT(got, r_nobias, bound, "bias dropped");
    EXPECT_CAUGHT(got, scaled(r, 2), bound, "scale x2");

    const DVec head_bound = tol::matmul_forward_bound(t, in, w, {}, N, C, OC);
    DVec h_t(N * OC);
    ref::matmul_forward_ref(h_t, in, transposed_read(w, OC, C), {}, N, C, OC);
    const FVec got_head = values(head);
    ASSERT_TRUE(tol::within(got_head, r_nobias, head_bound));
    EXPECT_CAUGHT(got_head, h_t, head_bound, "lm_head weight transposed");
    EXPECT_CAUGHT(got_head, scaled(r_nobias, 2), head_bound, "lm_head scale x2");
  }
}

// matmul_backward: din += dout @ W (16-bit, beta = 1), dweight += dout^T in and the BGRADB bias
// gradient (fp32).
TEST_F(MutationTest, MatmulBackward) {
  const int64_t N = kN, C = kC, OC = kOC;
  for (const DType t : kTypes) {
    SCOPED_TRACE(dtype_name(t));
    DVec in, w, dout, din0;
    DevTensor tin = make(rng_.normal(N * C), {N, C}, t, &in), tw = make(rng_.normal(OC * C), {OC, C}, t, &w);
    DevTensor tdout = make(rng_.normal(N * OC), {N, OC}, t, &dout), din = make(rng_.normal(N * C), {N, C}, t, &din0);
    const FVec dw0 = rng_.normal(OC * C), db0 = rng_.normal(OC);
    DevTensor dw = make(dw0, {OC, C}, DType::kF32), db = make(db0, {OC}, DType::kF32);
    ops::matmul_backward(s(), din, dw, db, tdout, tin, tw);
    DVec r_din = din0, r_dw = to_d(dw0), r_db = to_d(db0);
    ref::matmul_backward_ref(r_din, r_dw, r_db, dout, in, w, N, C, OC);
    const tol::MatmulBackwardBounds bb = tol::matmul_backward_bounds(t, dout, in, w, din0, to_d(dw0), to_d(db0), N, C, OC);
    const FVec got_din = values(din), got_dw = dw.f(), got_db = db.f();
    ASSERT_TRUE(tol::within(got_din, r_din, bb.din));
    ASSERT_TRUE(tol::within(got_dw, r_dw, bb.dweight));
    ASSERT_TRUE(tol::within(got_db, r_db, bb.dbias));

    DVec t_din = din0, t_dw = to_d(dw0), t_db = to_d(db0);  // weight and input read transposed
    ref::matmul_backward_ref(t_din, t_dw, t_db, dout, transposed_read(in, N, C), transposed_read(w, OC, C), N, C, OC);
    EXPECT_CAUGHT(got_din, t_din, bb.din, "din: weight transposed");
    EXPECT_CAUGHT(got_dw, t_dw, bb.dweight, "dweight: input transposed");
    DVec o_din(N * C, 0.0), o_dw(OC * C, 0.0), o_db(OC, 0.0);  // beta = 0: the accumulation dropped
    ref::matmul_backward_ref(o_din, o_dw, o_db, dout, in, w, N, C, OC);
    EXPECT_CAUGHT(got_din, o_din, bb.din, "din: old value dropped");
    EXPECT_CAUGHT(got_dw, o_dw, bb.dweight, "dweight: old value dropped");
    EXPECT_CAUGHT(got_db, to_d(db0), bb.dbias, "dbias: bias gradient dropped");
    DVec x_din = din0, x_dw = to_d(dw0), x_db = to_d(db0);  // alpha = 2
    ref::matmul_backward_ref(x_din, x_dw, x_db, scaled(dout, 2), in, w, N, C, OC);
    EXPECT_CAUGHT(got_din, x_din, bb.din, "din: scale x2");
    EXPECT_CAUGHT(got_dw, x_dw, bb.dweight, "dweight: scale x2");
    EXPECT_CAUGHT(got_db, x_db, bb.dbias, "dbias: scale x2");
  }
}

// matmul_gelu_forward (GELU_AUX_BIAS): the pre-activation and the GELU output.
TEST_F(MutationTest, MatmulGeluForward) {
  const int64_t N = kN, C = kC, OC = kOC;
  for (const DType t : kTypes) {
    SCOPED_TRACE(dtype_name(t));
    DVec in, w, b;
    DevTensor tin = make(rng_.normal(N * C, 0.3f), {N, C}, t, &in), tw = make(rng_.normal(OC * C, 0.3f), {OC, C}, t, &w);
    DevTensor tb = make(rng_.normal(OC), {OC}, t, &b), pre = nan_as({N, OC}, t), out = nan_as({N, OC}, t);
    ops::matmul_gelu_forward(s(), out, pre, tin, tw, tb);
    auto refs = [&](const DVec& w_used, const DVec& b_used, double k, DVec& r_pre, DVec& r_out) {
      r_pre.assign(N * OC, 0.0), r_out.assign(N * OC, 0.0);
      ref::matmul_forward_ref(r_pre, in, w_used, b_used, N, C, OC);
      r_pre = scaled(r_pre, k);
      ref::gelu_forward_ref(r_out, r_pre);
    };
    DVec r_pre, r_out;
    refs(w, b, 1, r_pre, r_out);
    const tol::GeluForwardBounds gb = tol::matmul_gelu_forward_bounds(t, in, w, b, r_pre, r_out, N, C, OC);
    const FVec got_pre = values(pre), got_out = values(out);
    ASSERT_TRUE(tol::within(got_pre, r_pre, gb.pre));
    ASSERT_TRUE(tol::within(got_out, r_out, gb.out));
    DVec m_pre, m_out;
    refs(transposed_read(w, OC, C), b, 1, m_pre, m_out);
    EXPECT_CAUGHT(got_pre, m_pre, gb.pre, "pre: weight transposed");
    EXPECT_CAUGHT(got_out, m_out, gb.out, "gelu: weight transposed");
    refs(w, {}, 1, m_pre, m_out);
    EXPECT_CAUGHT(got_pre, m_pre, gb.pre, "pre: bias dropped");
    EXPECT_CAUGHT(got_out, m_out, gb.out, "gelu: bias dropped");
    refs(w, b, 2, m_pre, m_out);
    EXPECT_CAUGHT(got_pre, m_pre, gb.pre, "pre: scale x2");
    EXPECT_CAUGHT(got_out, m_out, gb.out, "gelu: scale x2");
  }
}

// matmul_backward_dgelu (DGELU_BGRAD): dpre = gelu'(pre) (dout @ W) and the bias gradient.
TEST_F(MutationTest, MatmulBackwardDgelu) {
  const int64_t N = kN, C = kC, OC = kOC;  // dpre [N, C], dout [N, OC], W [OC, C]
  for (const DType t : kTypes) {
    SCOPED_TRACE(dtype_name(t));
    DVec dout, w, pre;
    DevTensor tdout = make(rng_.normal(N * OC), {N, OC}, t, &dout), tw = make(rng_.normal(OC * C), {OC, C}, t, &w);
    DevTensor tpre = make(rng_.normal(N * C, 1.5f), {N, C}, t, &pre), dpre = nan_as({N, C}, t);
    const FVec db0 = rng_.normal(C);
    DevTensor db = make(db0, {C}, DType::kF32);
    ops::matmul_backward_dgelu(s(), dpre, db, tdout, tw, tpre);
    auto refs = [&](const DVec& w_used, double k, DVec& r_dgrad, DVec& r_dpre, DVec& r_db) {
      r_dgrad.assign(N * C, 0.0), r_dpre.assign(N * C, 0.0), r_db = to_d(db0);
      DVec unused(OC * C, 0.0);
      ref::matmul_backward_ref(r_dgrad, unused, ref::DSpan{}, scaled(dout, k), DVec(N * C, 0.0), w_used, N, C, OC);
      ref::gelu_backward_ref(r_dpre, pre, r_dgrad);
      ref::bias_backward_ref(r_db, r_dpre, N, C);
    };
    DVec r_dgrad, r_dpre, r_db;
    refs(w, 1, r_dgrad, r_dpre, r_db);
    const tol::DgeluBounds gb = tol::matmul_backward_dgelu_bounds(t, dout, w, pre, r_dgrad, to_d(db0), N, C, OC);
    const FVec got_dpre = values(dpre), got_db = db.f();
    ASSERT_TRUE(tol::within(got_dpre, r_dpre, gb.dpre));
    ASSERT_TRUE(tol::within(got_db, r_db, gb.dbias));
    DVec m_dgrad, m_dpre, m_db;
    refs(transposed_read(w, OC, C), 1, m_dgrad, m_dpre, m_db);
    EXPECT_CAUGHT(got_dpre, m_dpre, gb.dpre, "dpre: weight transposed");
    EXPECT_CAUGHT(got_db, m_db, gb.dbias, "dbias: weight transposed");
    refs(w, 2, m_dgrad, m_dpre, m_db);
    EXPECT_CAUGHT(got_dpre, m_dpre, gb.dpre, "dpre: scale x2");
    EXPECT_CAUGHT(got_db, m_db, gb.dbias, "dbias: scale x2");
    EXPECT_CAUGHT(got_db, to_d(db0), gb.dbias, "dbias: bias gradient dropped");
    EXPECT_CAUGHT(got_dpre, r_dgrad, gb.dpre, "dpre: gelu' dropped");
  }
}

// Causal attention in float64 with the mutations a kernel could make: the softmax scale, the
// causal mask, q and k swapped (the score matrix transposed), the out scale, the softmax
// backward's D term. D uses the stored out (as the kernels and backward_given_out_ref do).
struct AttnMutation {
  double score_scale = 1, out_scale = 1;
  bool causal = true, swap_qk = false, drop_D = false;
};
void attention_ref(DVec& out, DVec& dqkv, const DVec& qkv, const DVec& dout, const DVec& stored_out, int64_t B,
                   int64_t T, int64_t C, int64_t NH, const AttnMutation& m) {
  const int64_t hs = C / NH, ld = 3 * C;
  const double scale = m.score_scale / std::sqrt(static_cast<double>(hs));
  out.assign(B * T * C, 0.0), dqkv.assign(B * T * ld, 0.0);
  DVec p(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t last = m.causal ? t : T - 1;
        const double* q = &qkv[(b * T + t) * ld + h * hs];
        double mx = -INFINITY, sum = 0, D = 0;
        for (int64_t j = 0; j <= last; ++j) {
          const double* k = &qkv[(b * T + j) * ld + C + h * hs];
          const double* qq = m.swap_qk ? &qkv[(b * T + j) * ld + h * hs] : q;
          const double* kk = m.swap_qk ? &qkv[(b * T + t) * ld + C + h * hs] : k;
          double dot = 0;
          for (int64_t i = 0; i < hs; ++i) dot += qq[i] * kk[i];
          mx = std::max(mx, p[j] = dot * scale);
        }
        for (int64_t j = 0; j <= last; ++j) sum += (p[j] = std::exp(p[j] - mx));
        const double* dy = &dout[(b * T + t) * C + h * hs];
        const double* y = &stored_out[(b * T + t) * C + h * hs];
        if (!m.drop_D)
          for (int64_t i = 0; i < hs; ++i) D += dy[i] * y[i];
        for (int64_t j = 0; j <= last; ++j) {
          const double P = p[j] / sum;
          const double* k = &qkv[(b * T + j) * ld + C + h * hs];
          const double* v = &qkv[(b * T + j) * ld + 2 * C + h * hs];
          double dp = 0;
          for (int64_t i = 0; i < hs; ++i) {
            out[(b * T + t) * C + h * hs + i] += m.out_scale * P * v[i];
            dp += dy[i] * v[i];
          }
          const double ds = P * (dp - D) * scale;
          for (int64_t i = 0; i < hs; ++i) {
            dqkv[(b * T + t) * ld + h * hs + i] += ds * k[i];
            dqkv[(b * T + j) * ld + C + h * hs + i] += ds * q[i];
            dqkv[(b * T + j) * ld + 2 * C + h * hs + i] += P * dy[i];
          }
        }
      }
}

// The attention op's results (out, dqkv =) pass their bounds against the float64 reference and
// fail them against every mutation of it.
void expect_attention_mutations_caught(const FVec& got_out, const FVec& got_dqkv, const DVec& r_out,
                                       const DVec& r_dqkv, const DVec& out_bound, const DVec& dqkv_bound,
                                       const DVec& qkv, const DVec& dout, const DVec& stored, int64_t B, int64_t T,
                                       int64_t C, int64_t NH) {
  ASSERT_TRUE(tol::within(got_out, r_out, out_bound));
  ASSERT_TRUE(tol::within(got_dqkv, r_dqkv, dqkv_bound));
  struct Named {
    const char* name;
    AttnMutation m;
  };
  const Named mutations[] = {{"softmax scale x2", {.score_scale = 2}},
                             {"no causal mask", {.causal = false}},
                             {"q and k swapped (scores transposed)", {.swap_qk = true}},
                             {"out scale x2", {.out_scale = 2}},
                             {"D term dropped", {.drop_D = true}}};
  for (const Named& n : mutations) {
    DVec m_out, m_dqkv;
    attention_ref(m_out, m_dqkv, qkv, dout, stored, B, T, C, NH, n.m);
    // out scale and D change one side only: the other is expected equal.
    if (n.m.out_scale == 1 && !n.m.drop_D) EXPECT_CAUGHT(got_out, m_out, out_bound, std::string("out: ") + n.name);
    if (n.m.out_scale == 1) EXPECT_CAUGHT(got_dqkv, m_dqkv, dqkv_bound, std::string("dqkv: ") + n.name);
    if (n.m.out_scale != 1) EXPECT_CAUGHT(got_out, m_out, out_bound, std::string("out: ") + n.name);
  }
}

TEST_F(MutationTest, FlashAttention) {
  const int64_t B = 2, T = 33, C = 32, NH = 2;
  for (const DType t : kTypes) {
    SCOPED_TRACE(dtype_name(t));
    DVec qkv, dout;
    DevTensor tqkv = make(rng_.normal(B * T * 3 * C, 1.5f), {B, T, 3 * C}, t, &qkv);
    DevTensor tdout = make(rng_.normal(B * T * C), {B, T, C}, t, &dout);
    DevTensor out = nan_as({B, T, C}, t), lse = nan_as({B, NH, T}, DType::kF32), dqkv = nan_as({B, T, 3 * C}, t);
    const int64_t sn = static_cast<int64_t>(ops::flash_attention_scratch_bytes(B, T, C, NH) / sizeof(float));
    DevTensor scratch = nan_as({sn}, DType::kF32);
    ops::flash_attention_forward(s(), out, lse, tqkv, static_cast<int>(NH));
    ops::flash_attention_backward(s(), dqkv, tdout, tqkv, out, lse, static_cast<int>(NH), scratch,
                                  ops::GradWrite::kOverwrite);
    const FVec got_out = values(out), got_dqkv = values(dqkv);
    const DVec stored = to_d(got_out);
    DVec r_out, r_dqkv;
    attention_ref(r_out, r_dqkv, qkv, dout, stored, B, T, C, NH, {});
    // fp32 twice: as stored, and with the GEMM inputs rounded to TF32 (CUDA's GEMM attention under
    // --tf32), whose looser bound must still catch every mutation.
    for (const double u_in : {0.0, t == DType::kF32 ? tol::kTf32Roundoff : -1.0}) {
      if (u_in < 0) continue;
      SCOPED_TRACE(u_in > 0 ? "TF32 GEMM inputs" : "as stored");
      const tol::AttentionBounds ab = tol::attention_bounds(t, qkv, dout, stored, B, T, C, NH, u_in);
      expect_attention_mutations_caught(got_out, got_dqkv, r_out, r_dqkv,
                                        tol::stored_bounds(t, ab.out, ab.out_mag),
                                        tol::stored_bounds(t, ab.dqkv, ab.dqkv_mag), qkv, dout, stored, B, T, C, NH);
    }
  }
}

}  // namespace
}  // namespace zt
