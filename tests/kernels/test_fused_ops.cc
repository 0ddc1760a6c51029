// The fused and vectorised memory-bound ops of issue #13 on every backend (CUDA instances skip
// without a GPU): the residual add + layernorm against its composition (bits) and float64 (fp32,
// bf16, fp16; fp32 or 16-bit weights), matmul_backward's overwrite_din against zero fill +
// accumulate, the two-stage column sums (bias and layernorm parameter gradients) against float64 at
// C = 768 and odd shapes, the 128-bit elementwise paths at odd sizes and unaligned pointers against
// the scalar expressions, 16-bit layernorm forward/backward and LM head (padded vocabulary), and
// fill, add, GELU and the encoder over bf16/fp16 activations, against float64 of the widened inputs
// (the rounding bits, one dtype per call). Tolerances as tests/kernels/test_ops.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "kernels/elementwise.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "op_test_util.h"
#include "tolerance.h"

namespace zt {
namespace {

using namespace op_test;  // NOLINT(build/namespaces): the helpers shared by the op test binaries

class FusedOpsTest : public OpsFixture {
 protected:
  // A view of n elements of `t` starting `offset` elements in: offset 1 makes fp32 and 16-bit
  // pointers 4 and 2 bytes off a 16-byte boundary (the scalar paths).
  static TensorView at(const DevTensor& t, int64_t offset, Shape shape) {
    const TensorView& v = t.view();
    return TensorView{static_cast<char*>(v.data) + offset * static_cast<int64_t>(dtype_size(v.dtype)), v.dtype,
                      shape, v.device};
  }
  template <typename T>
  std::vector<T> download_at(const DevTensor& t, int64_t offset, int64_t n) {
    const std::vector<T> all = t.download<T>();
    return std::vector<T>(all.begin() + offset, all.begin() + offset + n);
  }
};

struct RowsCase {
  int64_t N, C;
};
// Odd C (not a multiple of 4 or 8) exercises the short last chunk of a row; 768 is GPT-2's.
const RowsCase kResidualCases[] = {{1, 1}, {3, 7}, {5, 8}, {7, 255}, {9, 257}, {64, 768}, {130, 129}, {33, 1030}};

// ---- residual add + layernorm, fp32 -------------------------------------------------------------
TEST_P(FusedOpsTest, ResidualLayernormIsTheCompositionBitForBit) {
  const float eps = 1e-5f;
  for (const RowsCase& c : kResidualCases) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C);
    const int64_t N = c.N, C = c.C, n = N * C;
    const FVec a = rng_.normal(n, 2.0f, 3.0f), b = rng_.normal(n), w = rng_.normal(C), bias = rng_.normal(C);
    DevTensor ta = tensor(a, {N, C}), tb = tensor(b, {N, C}), tw = tensor(w, {C}), tbias = tensor(bias, {C});

    // The composition on this backend.
    DevTensor res_c = poisoned({N, C}), ln_c = poisoned({N, C}), mean_c = poisoned({N}), rstd_c = poisoned({N});
    ops::add(s(), res_c, ta, tb);
    ops::layernorm_forward(s(), ln_c, mean_c, rstd_c, res_c, tw, tbias, eps);

    DevTensor res = poisoned({N, C}), ln = poisoned({N, C}), mean = poisoned({N}), rstd = poisoned({N});
    ops::residual_layernorm_forward(s(), res, ln, mean, rstd, ta, tb, tw, tbias, eps);
    EXPECT_TRUE(bitwise_equal(res.f(), res_c.f()));
    EXPECT_TRUE(bitwise_equal(ln.f(), ln_c.f()));
    EXPECT_TRUE(bitwise_equal(mean.f(), mean_c.f()));
    EXPECT_TRUE(bitwise_equal(rstd.f(), rstd_c.f()));

    // float64: the residual is one fp32 rounding of the sum; the layernorm of that residual.
    FVec want_res(n);
    for (int64_t i = 0; i < n; ++i) want_res[i] = a[i] + b[i];
    EXPECT_TRUE(bitwise_equal(res.f(), want_res));
    DVec r_ln(n), r_mean(N), r_rstd(N);
    ref::layernorm_forward_ref(r_ln, r_mean, r_rstd, to_d(want_res), to_d(w), to_d(bias), N, C, eps);
    EXPECT_TRUE(close(ln.f(), r_ln, kTolReduce));
    EXPECT_TRUE(close(mean.f(), r_mean, kTolElem));
    EXPECT_TRUE(close(rstd.f(), r_rstd, kTolReduce));

    // residual_out aliasing a (as an in-place residual stream would), and every pointer off a
    // 16-byte boundary (the scalar path): the same bits.
    ops::residual_layernorm_forward(s(), ta, ln, mean, rstd, ta, tb, tw, tbias, eps);
    EXPECT_TRUE(bitwise_equal(ta.f(), want_res));
    EXPECT_TRUE(bitwise_equal(ln.f(), ln_c.f()));
    FVec a1(n + 1), b1(n + 1);
    std::copy(a.begin(), a.end(), a1.begin() + 1);
    std::copy(b.begin(), b.end(), b1.begin() + 1);
    DevTensor ua = tensor(a1, {n + 1}), ub = tensor(b1, {n + 1}), ures = poisoned({n + 1}), uln = poisoned({n + 1});
    ops::residual_layernorm_forward(s(), at(ures, 1, {N, C}), at(uln, 1, {N, C}), mean, rstd, at(ua, 1, {N, C}),
                                    at(ub, 1, {N, C}), tw, tbias, eps);
    EXPECT_TRUE(bitwise_equal(download_at<float>(ures, 1, n), want_res));
    EXPECT_TRUE(bitwise_equal(download_at<float>(uln, 1, n), ln_c.f()));
    EXPECT_TRUE(bitwise_equal(rstd.f(), rstd_c.f()));
  }
}

// Without the backend's kernel fp32 runs the composition (the same bits), 16 bits are refused.
TEST_P(FusedOpsTest, ResidualLayernormFallsBackToTheComposition) {
  const int64_t N = 17, C = 130, n = N * C;
  const FVec a = rng_.normal(n), b = rng_.normal(n), w = rng_.normal(C), bias = rng_.normal(C);
  DevTensor ta = tensor(a, {N, C}), tb = tensor(b, {N, C}), tw = tensor(w, {C}), tbias = tensor(bias, {C});
  DevTensor res = poisoned({N, C}), ln = poisoned({N, C}), mean = poisoned({N}), rstd = poisoned({N});
  ops::residual_layernorm_forward(s(), res, ln, mean, rstd, ta, tb, tw, tbias, 1e-5f);
  const FVec want_res = res.f(), want_ln = ln.f();

  OpTable without = *op_table(GetParam());
  without.residual_layernorm_forward = nullptr;
  sync();
  ScopedOpTable scoped(GetParam(), &without);
  DevTensor res2 = poisoned({N, C}), ln2 = poisoned({N, C});
  ops::residual_layernorm_forward(s(), res2, ln2, mean, rstd, ta, tb, tw, tbias, 1e-5f);
  EXPECT_TRUE(bitwise_equal(res2.f(), want_res));
  EXPECT_TRUE(bitwise_equal(ln2.f(), want_ln));

  DevTensor h = empty({N, C}, DType::kBF16), h2 = empty({N, C}, DType::kBF16);
  try {
    ops::residual_layernorm_forward(s(), h, h2, mean, rstd, h, h, tw, tbias, 1e-5f);
    ADD_FAILURE() << "a bf16 residual_layernorm_forward without a kernel must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("residual_layernorm_forward"), std::string::npos) << e.what();
  }
  sync();
}

TEST_P(FusedOpsTest, ResidualLayernormRejectsBadArguments) {
  const int64_t N = 4, C = 8;
  DevTensor a = tensor(rng_.normal(N * C), {N, C}), w = tensor(rng_.normal(C), {C}), out = poisoned({N, C});
  DevTensor mean = poisoned({N}), rstd = poisoned({N}), wrong = poisoned({N, C + 1}), half = empty({N, C}, DType::kF16);
  EXPECT_THROW(ops::residual_layernorm_forward(s(), out, a, mean, rstd, a, a, w, w, 1e-5f), Error);  // ln_out = a
  EXPECT_THROW(ops::residual_layernorm_forward(s(), out, wrong, mean, rstd, a, a, w, w, 1e-5f), Error);
  EXPECT_THROW(ops::residual_layernorm_forward(s(), out, half, mean, rstd, a, a, w, w, 1e-5f), Error);
  EXPECT_THROW(ops::residual_layernorm_forward(s(), out, poisoned({N, C}), mean, rstd, a, a, w, w, -1.0f), Error);
  sync();
}

// ---- residual add + layernorm, 16-bit activations -------------------------------------------------
// The residual is the sum rounded once to the activation dtype (bits of core/dtype.h's rounding);
// the statistics come from that rounded residual, ln_out is rounded once: float64 of the rounded
// residual within the dtype's tolerance.
template <typename T>
void check_residual_layernorm_16(Device& dev, Stream& s, Rng& rng, DType dtype, Tol tol) {
  const float eps = 1e-5f;
  for (const RowsCase& c : kResidualCases) {
    SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " N=" << c.N << " C=" << c.C);
    const int64_t N = c.N, C = c.C, n = N * C;
    const FVec a = rng.normal(n, 2.0f, 3.0f), b = rng.normal(n), w = rng.normal(C), bias = rng.normal(C);
    std::vector<T> a16(n), b16(n), want_res(n);
    DVec res_d(n);
    for (int64_t i = 0; i < n; ++i) {
      a16[i] = from_float<T>(a[i]);
      b16[i] = from_float<T>(b[i]);
      want_res[i] = from_float<T>(to_float(a16[i]) + to_float(b16[i]));
      res_d[i] = to_float(want_res[i]);
    }
    DevTensor ta(dev, s, dtype, {N, C}), tb(dev, s, dtype, {N, C}), res(dev, s, dtype, {N, C}),
        ln(dev, s, dtype, {N, C}), tw(dev, s, DType::kF32, {C}), tbias(dev, s, DType::kF32, {C}),
        mean(dev, s, DType::kF32, {N}), rstd(dev, s, DType::kF32, {N});
    ta.upload(a16);
    tb.upload(b16);
    tw.upload(w);
    tbias.upload(bias);
    ln.upload(std::vector<T>(n, T{0x7e01}));  // NaN in fp16, ~1.7e38 in bf16: no layernorm output
    mean.upload(nan_vec(N));
    rstd.upload(nan_vec(N));
    ops::residual_layernorm_forward(s, res, ln, mean, rstd, ta, tb, tw, tbias, eps);
    const std::vector<T> got_res = res.download<T>(), got_ln = ln.download<T>();
    std::vector<uint16_t> got_bits(n), want_bits(n);
    for (int64_t i = 0; i < n; ++i) got_bits[i] = got_res[i].bits, want_bits[i] = want_res[i].bits;
    EXPECT_TRUE(bitwise_equal(got_bits, want_bits));
    DVec r_ln(n), r_mean(N), r_rstd(N);
    ref::layernorm_forward_ref(r_ln, r_mean, r_rstd, res_d, to_d(w), to_d(bias), N, C, eps);
    FVec ln_f(n);
    for (int64_t i = 0; i < n; ++i) ln_f[i] = to_float(got_ln[i]);
    EXPECT_TRUE(close(ln_f, r_ln, tol));
    EXPECT_TRUE(close(mean.f(), r_mean, kTolElem));
    EXPECT_TRUE(close(rstd.f(), r_rstd, kTolReduce));
  }
}

TEST_P(FusedOpsTest, ResidualLayernormBf16) {
  check_residual_layernorm_16<BFloat16>(*dev_, s(), rng_, DType::kBF16, Tol{1e-2, 4e-3});
}
TEST_P(FusedOpsTest, ResidualLayernormFp16) {
  check_residual_layernorm_16<Half>(*dev_, s(), rng_, DType::kF16, Tol{1e-3, 5e-4});
}

// ---- column sums: bias gradient and layernorm dweight/dbias ----------------------------------------
// Shapes from one row to many chunks of rows (the CUDA kernels split N into up to 64 chunks of
// >= 256 rows; 20000 rows reach the 64-chunk cap) at C = 768 and odd widths; gradients pre-filled so the += is checked.
const RowsCase kColumnCases[] = {{1, 1}, {3, 7}, {255, 33}, {257, 129}, {1300, 768}, {20000, 3}};

TEST_P(FusedOpsTest, BiasGradientColumnSums) {
  for (const RowsCase& c : kColumnCases) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C);
    const int64_t N = c.N, C = c.C;
    const FVec dout = rng_.normal(N * C), db0 = rng_.normal(C);
    DevTensor tdout = tensor(dout, {N, C}), db = tensor(db0, {C});
    ops::bias_backward(s(), db, tdout);
    DVec r_db = to_d(db0);
    ref::bias_backward_ref(r_db, to_d(dout), N, C);
    const FVec got = db.f();
    EXPECT_TRUE(close(got, r_db, kTolReduce));
    // matmul_backward's dbias is the same reduction (ops.h): the same bits.
    DevTensor in = tensor(rng_.normal(N * 2), {N, 2}), w = tensor(rng_.normal(C * 2), {C, 2}), db2 = tensor(db0, {C});
    ops::matmul_backward(s(), TensorView{}, TensorView{}, db2, tdout, in, w);
    EXPECT_TRUE(bitwise_equal(db2.f(), got));
    // Run to run: a fixed order.
    DevTensor db3 = tensor(db0, {C});
    ops::bias_backward(s(), db3, tdout);
    EXPECT_TRUE(bitwise_equal(db3.f(), got));
  }
}

TEST_P(FusedOpsTest, LayernormParameterGradientColumnSums) {
  for (const RowsCase& c : kColumnCases) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C);
    const int64_t N = c.N, C = c.C;
    const FVec in = rng_.normal(N * C, 2.0f, 1.0f), w = rng_.normal(C), b = rng_.normal(C);
    DevTensor tin = tensor(in, {N, C}), tw = tensor(w, {C}), tb = tensor(b, {C});
    DevTensor out = poisoned({N, C}), mean = poisoned({N}), rstd = poisoned({N});
    ops::layernorm_forward(s(), out, mean, rstd, tin, tw, tb, 1e-5f);
    const FVec dout = rng_.normal(N * C), din0 = rng_.normal(N * C), dw0 = rng_.normal(C), db0 = rng_.normal(C);
    DevTensor tdout = tensor(dout, {N, C}), din = tensor(din0, {N, C}), dw = tensor(dw0, {C}), db = tensor(db0, {C});
    ops::layernorm_backward(s(), din, dw, db, tdout, tin, tw, mean, rstd);
    DVec r_din = to_d(din0), r_dw = to_d(dw0), r_db = to_d(db0);
    // The reference normalises with the op's own (fp32) statistics, as the kernels do.
    ref::layernorm_backward_ref(r_din, r_dw, r_db, to_d(dout), to_d(in), to_d(w), to_d(mean.f()), to_d(rstd.f()),
                                N, C);
    EXPECT_TRUE(close(dw.f(), r_dw, kTolReduce));
    EXPECT_TRUE(close(db.f(), r_db, kTolReduce));
    EXPECT_TRUE(close(din.f(), r_din, kTolReduce));
    DevTensor dw2 = tensor(dw0, {C}), db2 = tensor(db0, {C}), din2 = tensor(din0, {N, C});
    ops::layernorm_backward(s(), din2, dw2, db2, tdout, tin, tw, mean, rstd);
    EXPECT_TRUE(bitwise_equal(dw2.f(), dw.f()));
    EXPECT_TRUE(bitwise_equal(db2.f(), db.f()));
  }
}

// ---- no zero fill before the first writer: matmul_backward's overwrite_din -------------------------
// din = dout @ weight into a poisoned din: the bits of zero-filling din and accumulating (random
// inputs: no exact zeros, whose sign is the one documented difference); dweight/dbias still add.
TEST_P(FusedOpsTest, MatmulBackwardOverwriteDinIsZeroFillPlusAccumulate) {
  for (const RowsCase& c : {RowsCase{1, 1}, RowsCase{17, 33}, RowsCase{130, 257}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C);
    const int64_t N = c.N, C = c.C, OC = 2 * C + 1;
    DevTensor dout = tensor(rng_.normal(N * OC), {N, OC}), in = tensor(rng_.normal(N * C), {N, C}),
              w = tensor(rng_.normal(OC * C), {OC, C});
    const FVec dw0 = rng_.normal(OC * C), db0 = rng_.normal(OC);
    DevTensor din = tensor(FVec(N * C, 0.0f), {N, C}), dw = tensor(dw0, {OC, C}), db = tensor(db0, {OC});
    ops::matmul_backward(s(), din, dw, db, dout, in, w);
    DevTensor din2 = poisoned({N, C}), dw2 = tensor(dw0, {OC, C}), db2 = tensor(db0, {OC});
    ops::matmul_backward(s(), din2, dw2, db2, dout, in, w, /*overwrite_din=*/true);
    EXPECT_TRUE(bitwise_equal(din2.f(), din.f()));
    EXPECT_TRUE(bitwise_equal(dw2.f(), dw.f()));
    EXPECT_TRUE(bitwise_equal(db2.f(), db.f()));
  }
}

// ---- 128-bit elementwise paths: odd sizes, unaligned pointers, the scalar expressions' bits --------
const int64_t kVecSizes[] = {1, 3, 4, 5, 7, 8, 9, 1027, 100003};

TEST_P(FusedOpsTest, ElementwiseVectorPathsKeepTheScalarBits) {
  for (int64_t n : kVecSizes) {
    for (int64_t off : {int64_t{0}, int64_t{1}}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " offset=" << off);
      const FVec a = rng_.normal(n + off), b = rng_.normal(n + off), d = rng_.normal(n + off);
      DevTensor ta = tensor(a, {n + off}), tb = tensor(b, {n + off});
      auto slice = [&](const FVec& v) { return FVec(v.begin() + off, v.begin() + off + n); };
      const FVec as = slice(a), bs = slice(b), ds = slice(d);

      DevTensor x = poisoned({n + off});
      ops::fill(s(), at(x, off, {n}), -2.5f);
      EXPECT_TRUE(bitwise_equal(download_at<float>(x, off, n), FVec(n, -2.5f)));

      DevTensor sc = tensor(a, {n + off});
      ops::scale(s(), at(sc, off, {n}), 0.7f);
      FVec want(n);
      for (int64_t i = 0; i < n; ++i) want[i] = as[i] * 0.7f;
      EXPECT_TRUE(bitwise_equal(download_at<float>(sc, off, n), want));

      DevTensor out = poisoned({n + off});
      ops::add(s(), at(out, off, {n}), at(ta, off, {n}), at(tb, off, {n}));
      for (int64_t i = 0; i < n; ++i) want[i] = as[i] + bs[i];
      EXPECT_TRUE(bitwise_equal(download_at<float>(out, off, n), want));

      DevTensor acc = tensor(a, {n + off});
      ops::accumulate(s(), at(acc, off, {n}), at(tb, off, {n}));
      EXPECT_TRUE(bitwise_equal(download_at<float>(acc, off, n), want));

      // GELU: the CPU loop calls the shared element functions (exact); nvcc may contract into FMAs
      // (kernels/elementwise.h), so the GPU is held to the element tolerance, and to its own
      // aligned bits below.
      DevTensor g = poisoned({n + off});
      ops::gelu_forward(s(), at(g, off, {n}), at(ta, off, {n}));
      DevTensor gd = tensor(d, {n + off});
      ops::gelu_backward(s(), at(gd, off, {n}), at(ta, off, {n}), at(tb, off, {n}));
      DVec want_g(n), want_gd(n);
      for (int64_t i = 0; i < n; ++i) {
        want_g[i] = gelu_forward_elem(as[i]);
        want_gd[i] = ds[i] + gelu_grad_elem(as[i]) * bs[i];
      }
      EXPECT_TRUE(close(download_at<float>(g, off, n), want_g, kTolElem));
      EXPECT_TRUE(close(download_at<float>(gd, off, n), want_gd, kTolElem));
      if (GetParam() == Backend::kCpu) {
        EXPECT_TRUE(bitwise_equal(download_at<float>(g, off, n), to_f(want_g)));
      }
      // The aligned run of the same values gives the same bits as this one.
      DevTensor ua = tensor(as, {n}), ub = tensor(bs, {n}), ug = poisoned({n}), ugd = tensor(ds, {n});
      ops::gelu_forward(s(), ug, ua);
      ops::gelu_backward(s(), ugd, ua, ub);
      EXPECT_TRUE(bitwise_equal(ug.f(), download_at<float>(g, off, n)));
      EXPECT_TRUE(bitwise_equal(ugd.f(), download_at<float>(gd, off, n)));
    }
  }
}

// 16-bit accumulate and casts move 8 elements per 128-bit access: odd sizes and offsets against
// core/dtype.h's host rounding, bit for bit.
TEST_P(FusedOpsTest, SixteenBitVectorPathsKeepTheScalarBits) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (int64_t n : kVecSizes) {
      for (int64_t off : {int64_t{0}, int64_t{1}, int64_t{3}}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " n=" << n << " offset=" << off);
        const FVec x = rng_.normal(n + off, 4.0f), y = rng_.normal(n + off, 4.0f);
        auto bits = [t](float v) { return t == DType::kBF16 ? float_to_bf16_bits(v) : float_to_half_bits(v); };
        auto value = [t](uint16_t h) { return t == DType::kBF16 ? bf16_bits_to_float(h) : half_bits_to_float(h); };
        std::vector<uint16_t> x16(n + off), y16(n + off);
        for (int64_t i = 0; i < n + off; ++i) x16[i] = bits(x[i]), y16[i] = bits(y[i]);
        DevTensor tx(*dev_, s(), t, {n + off}), ty(*dev_, s(), t, {n + off});
        tx.upload(x16);
        ty.upload(y16);
        ops::accumulate(s(), at(tx, off, {n}), at(ty, off, {n}));
        std::vector<uint16_t> want(n);
        for (int64_t i = 0; i < n; ++i) want[i] = bits(value(x16[off + i]) + value(y16[off + i]));
        EXPECT_TRUE(bitwise_equal(download_at<uint16_t>(tx, off, n), want));

        // cast f32 -> 16 bits -> f32 (the float source at the same offset).
        DevTensor src = tensor(x, {n + off}), h(*dev_, s(), t, {n + off}), back = poisoned({n + off});
        h.upload(std::vector<uint16_t>(n + off, 0x7e01));
        ops::cast(s(), at(h, off, {n}), at(src, off, {n}));
        ops::cast(s(), at(back, off, {n}), at(h, off, {n}));
        FVec want_back(n);
        for (int64_t i = 0; i < n; ++i) want[i] = bits(x[off + i]), want_back[i] = value(want[i]);
        EXPECT_TRUE(bitwise_equal(download_at<uint16_t>(h, off, n), want));
        EXPECT_TRUE(bitwise_equal(download_at<float>(back, off, n), want_back));
      }
    }
  }
}

// ---- 16-bit layernorm (forward, backward) and LM head -----------------------------------------
// The contract (ops.h): 16-bit inputs widened exactly, fp32 arithmetic, each 16-bit output rounded
// once. So a 16-bit output is within half an ulp of its dtype of the fp32 result, which is within
// fp32 slack of the float64 reference on the same widened inputs; fp32 outputs (statistics,
// parameter gradients) compare with the fp32 tolerances.

template <typename T>
std::vector<T> round_to(const FVec& v) {
  std::vector<T> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = from_float<T>(v[i]);
  return r;
}
template <typename T>
FVec widen(const std::vector<T>& v) {
  FVec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = to_float(v[i]);
  return r;
}

// Half an ulp of `t` at magnitude a (subnormal spacing below the normal range; 0 for fp32).
double half_ulp(double a, DType t) {
  if (t == DType::kF32) return 0.0;
  const int e = a > 0 ? std::ilogb(a) : -1000;
  return t == DType::kBF16 ? std::ldexp(1.0, std::max(e, -126) - 8) : std::ldexp(1.0, std::max(e, -14) - 11);
}

// got (a 16-bit output of dtype t, widened) against ref: half an ulp of t plus the fp32 slack.
::testing::AssertionResult close16(const FVec& got, const DVec& ref, DType t, Tol slack) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  double sq = 0;
  for (double r : ref) sq += r * r;
  const double atol = slack.rms_tol * std::sqrt(sq / std::max<size_t>(1, ref.size()));
  size_t bad = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    const double bound =
        half_ulp(std::max(std::fabs(ref[i]), std::fabs(double{got[i]})), t) + slack.rtol * std::fabs(ref[i]) + atol;
    if (!(err <= bound)) {
      if (bad < 5) msg << "\n  [" << i << "] got " << got[i] << " want " << ref[i] << " (err " << err << " > " << bound << ")";
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements beyond half an ulp of "
                                       << dtype_name(t) << " plus fp32 slack" << msg.str();
}

// A device tensor of dtype T holding host values (fp32 tensors through the same path).
template <typename T>
DevTensor upload_as(Device& dev, Stream& s, Shape shape, const std::vector<T>& host) {
  DevTensor t(dev, s, DTypeOf<T>::value, shape);
  t.upload(host);
  return t;
}

// 16-bit NaN patterns: poison for outputs that must be written, padding that must not be read.
template <typename T>
T nan16() {
  return T{static_cast<uint16_t>(std::is_same_v<T, BFloat16> ? 0x7fc0 : 0x7e00)};
}

// Activations T (bf16/f16), parameters W (fp32 or T).
template <typename T, typename W>
void check_layernorm_16(Device& dev, Stream& s, Rng& rng) {
  constexpr DType act = DTypeOf<T>::value;
  const float eps = 1e-5f;
  for (const RowsCase& c : kResidualCases) {
    SCOPED_TRACE(::testing::Message() << dtype_name(act) << " activations, " << dtype_name(DTypeOf<W>::value)
                                      << " weights, N=" << c.N << " C=" << c.C);
    const int64_t N = c.N, C = c.C, n = N * C;
    const std::vector<T> x = round_to<T>(rng.normal(n, 2.0f, 3.0f));
    const std::vector<W> w = round_to<W>(rng.normal(C)), b = round_to<W>(rng.normal(C));
    DevTensor tx = upload_as(dev, s, {N, C}, x), tw = upload_as(dev, s, {C}, w), tb = upload_as(dev, s, {C}, b);
    DevTensor out = upload_as(dev, s, {N, C}, std::vector<T>(n, nan16<T>()));
    DevTensor mean = upload_as(dev, s, {N}, nan_vec(N)), rstd = upload_as(dev, s, {N}, nan_vec(N));
    ops::layernorm_forward(s, out, mean, rstd, tx, tw, tb, eps);
    const FVec xw = widen(x), ww = widen(w), bw = widen(b);
    DVec r_out(n), r_mean(N), r_rstd(N);
    ref::layernorm_forward_ref(r_out, r_mean, r_rstd, to_d(xw), to_d(ww), to_d(bw), N, C, eps);
    const std::vector<T> got = out.download<T>();
    EXPECT_TRUE(close16(widen(got), r_out, act, kTolElem));
    EXPECT_TRUE(close(mean.f(), r_mean, kTolElem));
    EXPECT_TRUE(close(rstd.f(), r_rstd, kTolReduce));

    // The fused residual kernel normalises its stored residual as this op does: a + 0 is a, so
    // its ln_out has these bits.
    DevTensor zero = upload_as(dev, s, {N, C}, std::vector<T>(n, from_float<T>(0.0f)));
    DevTensor res(dev, s, act, {N, C}), ln = upload_as(dev, s, {N, C}, std::vector<T>(n, nan16<T>()));
    ops::residual_layernorm_forward(s, res, ln, mean, rstd, tx, zero, tw, tb, eps);
    const std::vector<T> got_ln = ln.download<T>();
    std::vector<uint16_t> bits(n), fused_bits(n);
    for (int64_t i = 0; i < n; ++i) bits[i] = got[i].bits, fused_bits[i] = got_ln[i].bits;
    EXPECT_TRUE(bitwise_equal(fused_bits, bits));

    // Backward with the op's own statistics; din (16-bit) and dweight/dbias (fp32) accumulate.
    const std::vector<T> dout = round_to<T>(rng.normal(n)), din0 = round_to<T>(rng.normal(n));
    const FVec dw0 = rng.normal(C), db0 = rng.normal(C);
    DevTensor tdout = upload_as(dev, s, {N, C}, dout), din = upload_as(dev, s, {N, C}, din0);
    DevTensor dw = upload_as(dev, s, {C}, dw0), db = upload_as(dev, s, {C}, db0);
    ops::layernorm_backward(s, din, dw, db, tdout, tx, tw, mean, rstd);
    DVec r_din = to_d(widen(din0)), r_dw = to_d(dw0), r_db = to_d(db0);
    ref::layernorm_backward_ref(r_din, r_dw, r_db, to_d(widen(dout)), to_d(xw), to_d(ww), to_d(mean.f()),
                                to_d(rstd.f()), N, C);
    EXPECT_TRUE(close16(widen(din.download<T>()), r_din, act, kTolReduce));
    EXPECT_TRUE(close(dw.f(), r_dw, kTolReduce));
    EXPECT_TRUE(close(db.f(), r_db, kTolReduce));
  }
}

TEST_P(FusedOpsTest, LayernormBf16) {
  check_layernorm_16<BFloat16, float>(*dev_, s(), rng_);
  check_layernorm_16<BFloat16, BFloat16>(*dev_, s(), rng_);
}
TEST_P(FusedOpsTest, LayernormFp16) {
  check_layernorm_16<Half, float>(*dev_, s(), rng_);
  check_layernorm_16<Half, Half>(*dev_, s(), rng_);
}

// residual_layernorm_forward with 16-bit weight and bias: the residual rounded once, ln_out within
// half an ulp of the float64 layernorm of that residual with the widened parameters.
template <typename T>
void check_residual_layernorm_16_weights(Device& dev, Stream& s, Rng& rng) {
  constexpr DType act = DTypeOf<T>::value;
  const float eps = 1e-5f;
  for (const RowsCase& c : kResidualCases) {
    SCOPED_TRACE(::testing::Message() << dtype_name(act) << " N=" << c.N << " C=" << c.C);
    const int64_t N = c.N, C = c.C, n = N * C;
    const std::vector<T> a = round_to<T>(rng.normal(n, 2.0f, 3.0f)), b = round_to<T>(rng.normal(n));
    const std::vector<T> w = round_to<T>(rng.normal(C)), bias = round_to<T>(rng.normal(C));
    DevTensor ta = upload_as(dev, s, {N, C}, a), tb = upload_as(dev, s, {N, C}, b), tw = upload_as(dev, s, {C}, w),
              tbias = upload_as(dev, s, {C}, bias);
    DevTensor res(dev, s, act, {N, C}), ln = upload_as(dev, s, {N, C}, std::vector<T>(n, nan16<T>()));
    DevTensor mean = upload_as(dev, s, {N}, nan_vec(N)), rstd = upload_as(dev, s, {N}, nan_vec(N));
    ops::residual_layernorm_forward(s, res, ln, mean, rstd, ta, tb, tw, tbias, eps);
    std::vector<T> want_res(n);
    for (int64_t i = 0; i < n; ++i) want_res[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
    const std::vector<T> got_res = res.download<T>();
    std::vector<uint16_t> got_bits(n), want_bits(n);
    for (int64_t i = 0; i < n; ++i) got_bits[i] = got_res[i].bits, want_bits[i] = want_res[i].bits;
    EXPECT_TRUE(bitwise_equal(got_bits, want_bits));
    DVec r_ln(n), r_mean(N), r_rstd(N);
    ref::layernorm_forward_ref(r_ln, r_mean, r_rstd, to_d(widen(want_res)), to_d(widen(w)), to_d(widen(bias)), N, C,
                               eps);
    EXPECT_TRUE(close16(widen(ln.download<T>()), r_ln, act, kTolElem));
    EXPECT_TRUE(close(mean.f(), r_mean, kTolElem));
    EXPECT_TRUE(close(rstd.f(), r_rstd, kTolReduce));
  }
}

TEST_P(FusedOpsTest, ResidualLayernormSixteenBitWeights) {
  check_residual_layernorm_16_weights<BFloat16>(*dev_, s(), rng_);
  check_residual_layernorm_16_weights<Half>(*dev_, s(), rng_);
}

// The LM head in 16 bits over a padded vocabulary: logits against the float64 product of the
// widened inputs (the CPU backend within half an ulp, every backend within tests/tolerance.h's
// bound), the padding neither written (forward) nor read (backward: NaN there would reach both
// gradients); din += (16 bits), dwte fp32 +=.
template <typename T>
void check_lm_head_16(Device& dev, Stream& s, Rng& rng, Backend backend) {
  constexpr DType act = DTypeOf<T>::value;
  struct HeadCase {
    int64_t N, C, V;
  };
  for (const HeadCase& c : {HeadCase{37, 24, 300}, HeadCase{3, 16, 1025}, HeadCase{5, 8, 128}}) {
    const int64_t N = c.N, C = c.C, V = c.V, Vp = ops::padded_vocab(V);
    SCOPED_TRACE(::testing::Message() << dtype_name(act) << " N=" << N << " C=" << C << " V=" << V << " Vp=" << Vp);
    const std::vector<T> in = round_to<T>(rng.normal(N * C)), wte = round_to<T>(rng.normal(V * C, 0.2f));
    DevTensor tin = upload_as(dev, s, {N, C}, in), twte = upload_as(dev, s, {V, C}, wte);
    DevTensor logits = upload_as(dev, s, {N, Vp}, std::vector<T>(N * Vp, nan16<T>()));
    ops::lm_head_forward(s, logits, tin, twte);
    DVec r_logits(N * V);
    ref::matmul_forward_ref(r_logits, to_d(widen(in)), to_d(widen(wte)), {}, N, C, V);
    const std::vector<T> got = logits.download<T>();
    FVec real(N * V);
    int64_t padding_written = 0;
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t j = 0; j < V; ++j) real[r * V + j] = to_float(got[r * Vp + j]);
      for (int64_t j = V; j < Vp; ++j) padding_written += got[r * Vp + j].bits != nan16<T>().bits;
    }
    // One rounding on the CPU backend (half an ulp); cuBLASLt's result within the derived bound
    // (tests/README.md), which the CPU result meets too.
    if (backend == Backend::kCpu) {
      EXPECT_TRUE(close16(real, r_logits, act, kTolReduce));
    }
    EXPECT_TRUE(tolerance::within(real, r_logits,
                                  tolerance::matmul_forward_bound(act, to_d(widen(in)), to_d(widen(wte)), {}, N, C, V)));
    EXPECT_EQ(padding_written, 0);

    std::vector<T> dl = round_to<T>(rng.normal(N * Vp, 0.1f));
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = V; j < Vp; ++j) dl[r * Vp + j] = nan16<T>();
    const std::vector<T> din0 = round_to<T>(rng.normal(N * C));
    const FVec dwte0 = rng.normal(V * C);
    DevTensor tdl = upload_as(dev, s, {N, Vp}, dl), din = upload_as(dev, s, {N, C}, din0),
              dwte = upload_as(dev, s, {V, C}, dwte0);
    ops::lm_head_backward(s, din, dwte, tdl, tin, twte);
    DVec dl_real(N * V);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < V; ++j) dl_real[r * V + j] = to_float(dl[r * Vp + j]);
    DVec r_din = to_d(widen(din0)), r_dwte = to_d(dwte0);
    ref::matmul_backward_ref(r_din, r_dwte, {}, dl_real, to_d(widen(in)), to_d(widen(wte)), N, C, V);
    // din += dl @ wte in 16 bits: cuBLAS may round the product before adding din0 (tests/README.md),
    // so on CUDA the derived bound; the CPU backend (one rounding) also half an ulp.
    if (backend == Backend::kCpu) {
      EXPECT_TRUE(close16(widen(din.download<T>()), r_din, act, kTolReduce));
    }
    EXPECT_TRUE(tolerance::within(widen(din.download<T>()), r_din,
                                  tolerance::matmul_backward_bounds(act, dl_real, to_d(widen(in)), to_d(widen(wte)),
                                                                    to_d(widen(din0)), to_d(dwte0), {}, N, C, V)
                                      .din));
    EXPECT_TRUE(close(dwte.f(), r_dwte, kTolReduce));

    // Either gradient alone: the same values as together.
    DevTensor din_only = upload_as(dev, s, {N, C}, din0), dwte_only = upload_as(dev, s, {V, C}, dwte0);
    ops::lm_head_backward(s, din_only, TensorView{}, tdl, tin, twte);
    ops::lm_head_backward(s, TensorView{}, dwte_only, tdl, tin, twte);
    EXPECT_TRUE(bitwise_equal(din_only.download<uint16_t>(), din.download<uint16_t>()));
    EXPECT_TRUE(bitwise_equal(dwte_only.f(), dwte.f()));

    // The CPU backend (the specification) with Vp == V: matmul's 16-bit bits.
    if (backend == Backend::kCpu) {
      DevTensor a(dev, s, act, {N, V}), b(dev, s, act, {N, V});
      ops::lm_head_forward(s, a, tin, twte);
      ops::matmul_forward(s, b, tin, twte, ConstTensorView{});
      EXPECT_TRUE(bitwise_equal(a.download<uint16_t>(), b.download<uint16_t>()));
      std::vector<T> g(N * V);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < V; ++j) g[r * V + j] = dl[r * Vp + j];
      DevTensor tg = upload_as(dev, s, {N, V}, g);
      DevTensor din_a = upload_as(dev, s, {N, C}, din0), din_b = upload_as(dev, s, {N, C}, din0);
      DevTensor dwte_a = upload_as(dev, s, {V, C}, dwte0), dwte_b = upload_as(dev, s, {V, C}, dwte0);
      ops::lm_head_backward(s, din_a, dwte_a, tg, tin, twte);
      ops::matmul_backward(s, din_b, dwte_b, TensorView{}, tg, tin, twte);
      EXPECT_TRUE(bitwise_equal(din_a.download<uint16_t>(), din_b.download<uint16_t>()));
      EXPECT_TRUE(bitwise_equal(dwte_a.f(), dwte_b.f()));
    }
  }
}

// ---- 16-bit activations: fill, add, GELU, the encoder ------------------------------------------------

TEST_P(FusedOpsTest, SixteenBitFillAddGelu) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Host16 h{t};
    for (int64_t n : kVecSizes) {
      for (int64_t off : {int64_t{0}, int64_t{1}, int64_t{3}}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " n=" << n << " offset=" << off);
        const int64_t m = n + off;
        auto tensor16 = [&](const std::vector<uint16_t>& v) {
          DevTensor d(*dev_, s(), t, {static_cast<int64_t>(v.size())});
          d.upload(v);
          return d;
        };
        auto slice = [&](const std::vector<uint16_t>& v) {
          return std::vector<uint16_t>(v.begin() + off, v.begin() + off + n);
        };
        const std::vector<uint16_t> poison(m, kPoison16);

        // fill: -2.5 is representable (bf16 0xc020, fp16 0xc100) and stored exactly; 0.1 is rounded
        // once. The elements before the view keep their poison.
        DevTensor x = tensor16(poison);
        ops::fill(s(), at(x, off, {n}), -2.5f);
        EXPECT_TRUE(bitwise_equal(download_at<uint16_t>(x, off, n),
                                  std::vector<uint16_t>(n, t == DType::kBF16 ? 0xc020 : 0xc100)));
        ops::fill(s(), at(x, off, {n}), 0.1f);
        const std::vector<uint16_t> got_fill = x.download<uint16_t>();
        EXPECT_TRUE(bitwise_equal(slice(got_fill), std::vector<uint16_t>(n, h.round(0.1f))));
        EXPECT_TRUE(std::all_of(got_fill.begin(), got_fill.begin() + off, [](uint16_t b) { return b == kPoison16; }));

        // add: the widened sum rounded once (exact in fp32 here, so also correctly rounded).
        const std::vector<uint16_t> a = h.round(rng_.normal(m, 4.0f)), b = h.round(rng_.normal(m, 4.0f));
        DevTensor ta = tensor16(a), tb = tensor16(b), out = tensor16(poison);
        ops::add(s(), at(out, off, {n}), at(ta, off, {n}), at(tb, off, {n}));
        std::vector<uint16_t> want(n);
        DVec r_add(n);
        for (int64_t i = 0; i < n; ++i) {
          want[i] = h.round(h.widen(a[off + i]) + h.widen(b[off + i]));
          r_add[i] = double{h.widen(a[off + i])} + h.widen(b[off + i]);
        }
        const std::vector<uint16_t> got_add = download_at<uint16_t>(out, off, n);
        EXPECT_TRUE(bitwise_equal(got_add, want));
        EXPECT_TRUE(h.close(h.widen(got_add), r_add));
        ops::add(s(), at(ta, off, {n}), at(ta, off, {n}), at(tb, off, {n}));  // out aliasing a
        EXPECT_TRUE(bitwise_equal(download_at<uint16_t>(ta, off, n), want));

        // GELU forward and backward (din += in fp32, rounded once) against float64 of the widened
        // inputs; on the CPU (the specification) the bits of the shared element functions.
        const std::vector<uint16_t> xs = h.round(rng_.normal(m, 3.0f)), d0 = h.round(rng_.normal(m)),
                                    g = h.round(rng_.normal(m));
        DevTensor tx = tensor16(xs), tg = tensor16(g), gout = tensor16(poison), gdin = tensor16(d0);
        ops::gelu_forward(s(), at(gout, off, {n}), at(tx, off, {n}));
        ops::gelu_backward(s(), at(gdin, off, {n}), at(tx, off, {n}), at(tg, off, {n}));
        const FVec wx = h.widen(slice(xs)), wd = h.widen(slice(d0)), wg = h.widen(slice(g));
        DVec r_out(n), r_din = to_d(wd);
        ref::gelu_forward_ref(r_out, to_d(wx));
        ref::gelu_backward_ref(r_din, to_d(wx), to_d(wg));
        const std::vector<uint16_t> got_out = download_at<uint16_t>(gout, off, n),
                                    got_din = download_at<uint16_t>(gdin, off, n);
        EXPECT_TRUE(h.close(h.widen(got_out), r_out));
        EXPECT_TRUE(h.close(h.widen(got_din), r_din));
        if (GetParam() == Backend::kCpu) {
          std::vector<uint16_t> want_out(n), want_din(n);
          for (int64_t i = 0; i < n; ++i) {
            want_out[i] = h.round(gelu_forward_elem(wx[i]));
            want_din[i] = h.round(wd[i] + gelu_grad_elem(wx[i]) * wg[i]);
          }
          EXPECT_TRUE(bitwise_equal(got_out, want_out));
          EXPECT_TRUE(bitwise_equal(got_din, want_din));
        }
        // The aligned run of the same values (the 128-bit path on CUDA) gives the same bits.
        DevTensor ux = tensor16(slice(xs)), ug = tensor16(slice(g)), uout = tensor16(slice(poison)),
                  udin = tensor16(slice(d0));
        ops::gelu_forward(s(), uout, ux);
        ops::gelu_backward(s(), udin, ux, ug);
        EXPECT_TRUE(bitwise_equal(uout.download<uint16_t>(), got_out));
        EXPECT_TRUE(bitwise_equal(udin.download<uint16_t>(), got_din));
      }
    }
  }
}

// The encoder over 16-bit tables: each output the widened rows' fp32 sum rounded once (one fp32
// addition: the same bits on every backend), over the whole vocabulary and over a shard; backward
// adds the widened dout into fp32 dwte/dwpe in position order, so repeated token ids give the bits
// of the sequential fp32 loop, and float64 within the fp32 reduction tolerance.
TEST_P(FusedOpsTest, SixteenBitEncoder) {
  struct Case {
    int64_t B, T, C, V, maxT;
    ops::VocabRange vocab;
  };
  const Case cases[] = {{1, 1, 1, 1, 1, {}},          {2, 7, 13, 5, 8, {}},        {3, 64, 127, 17, 64, {}},
                        {4, 33, 64, 9, 40, {4, 20}},  {8, 256, 768, 301, 256, {}}};
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Host16 h{t};
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " B=" << c.B << " T=" << c.T << " C=" << c.C
                                        << " V=" << c.V << " vocab [" << c.vocab.begin << ", " << c.vocab.total
                                        << ")");
      const int64_t BT = c.B * c.T, C = c.C, total = c.vocab.total > 0 ? c.vocab.total : c.V;
      const IVec tokens = rng_.ints(BT, 0, static_cast<int32_t>(total));  // small vocabularies: repeats
      const std::vector<uint16_t> wte = h.round(rng_.normal(c.V * C)), wpe = h.round(rng_.normal(c.maxT * C)),
                                  dout = h.round(rng_.normal(BT * C));
      DevTensor ttok = tensor(tokens, {c.B, c.T}), twte(*dev_, s(), t, {c.V, C}), twpe(*dev_, s(), t, {c.maxT, C}),
                out(*dev_, s(), t, {c.B, c.T, C}), tdout(*dev_, s(), t, {c.B, c.T, C});
      twte.upload(wte);
      twpe.upload(wpe);
      tdout.upload(dout);
      auto row_of = [&](int64_t r) {  // the shard's wte row of position r, or -1
        const int64_t local = tokens[r] - c.vocab.begin;
        return local >= 0 && local < c.V ? local : int64_t{-1};
      };

      for (bool with_wpe : {true, false}) {
        out.upload(std::vector<uint16_t>(BT * C, kPoison16));
        ops::encoder_forward(s(), out, ttok, twte, with_wpe ? ConstTensorView(twpe) : ConstTensorView{}, c.vocab);
        std::vector<uint16_t> want(BT * C);
        DVec r_out(BT * C);
        for (int64_t r = 0; r < BT; ++r) {
          const int64_t v = row_of(r);
          for (int64_t k = 0; k < C; ++k) {
            const float w = v >= 0 ? h.widen(wte[v * C + k]) : 0.0f;
            const float p = with_wpe ? h.widen(wpe[(r % c.T) * C + k]) : 0.0f;
            want[r * C + k] = h.round(w + p);
            r_out[r * C + k] = double{w} + p;
          }
        }
        const std::vector<uint16_t> got = out.download<uint16_t>();
        EXPECT_TRUE(bitwise_equal(got, want)) << (with_wpe ? "with wpe" : "without wpe");
        EXPECT_TRUE(h.close(h.widen(got), r_out)) << (with_wpe ? "with wpe" : "without wpe");
      }

      const FVec dwte0 = rng_.normal(c.V * C), dwpe0 = rng_.normal(c.maxT * C);
      DevTensor dwte = tensor(dwte0, {c.V, C}), dwpe = tensor(dwpe0, {c.maxT, C});
      ops::encoder_backward(s(), dwte, dwpe, tdout, ttok, c.vocab);
      FVec seq_wte = dwte0, seq_wpe = dwpe0;
      DVec r_wte = to_d(dwte0), r_wpe = to_d(dwpe0);
      for (int64_t r = 0; r < BT; ++r) {
        const int64_t v = row_of(r), p = r % c.T;
        for (int64_t k = 0; k < C; ++k) {
          const float d = h.widen(dout[r * C + k]);
          if (v >= 0) seq_wte[v * C + k] += d, r_wte[v * C + k] += d;
          seq_wpe[p * C + k] += d;
          r_wpe[p * C + k] += d;
        }
      }
      const FVec got_wte = dwte.f(), got_wpe = dwpe.f();
      EXPECT_TRUE(bitwise_equal(got_wte, seq_wte));
      EXPECT_TRUE(bitwise_equal(got_wpe, seq_wpe));
      EXPECT_TRUE(close(got_wte, r_wte, kTolReduce));
      EXPECT_TRUE(close(got_wpe, r_wpe, kTolReduce));
    }
  }
}

// The tensor-parallel GPT's bias and position ops over 16-bit activations (parameters fp32 or
// the activations' dtype): each forward output the widened sum rounded once (one fp32 addition:
// the same bits on every backend); backward sums the widened rows into fp32 in row order, within
// the reduction tolerance of float64.
TEST_P(FusedOpsTest, SixteenBitBiasAndPosition) {
  struct Case {
    int64_t R, C, row0, T;
  };
  const Case cases[] = {{1, 1, 0, 1}, {7, 13, 3, 5}, {33, 64, 16, 16}, {64, 768, 64, 32}};
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Host16 h{t};
    for (const Case& c : cases) {
      for (bool param16 : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " R=" << c.R << " C=" << c.C << " row0=" << c.row0
                                          << (param16 ? " 16-bit parameters" : " fp32 parameters"));
        const int64_t n = c.R * c.C;
        const std::vector<uint16_t> x0 = h.round(rng_.normal(n));
        FVec wpe = rng_.normal(c.T * c.C), bias = rng_.normal(c.C);
        if (param16) wpe = h.widen(h.round(wpe)), bias = h.widen(h.round(bias));
        DevTensor tx(*dev_, s(), t, {c.R, c.C}), twpe(*dev_, s(), param16 ? t : DType::kF32, {c.T, c.C}),
            tbias(*dev_, s(), param16 ? t : DType::kF32, {c.C});
        if (param16) {
          twpe.upload(h.round(wpe)), tbias.upload(h.round(bias));
        } else {
          twpe.upload(wpe), tbias.upload(bias);
        }
        std::vector<uint16_t> want_p(n), want_b(n);
        DVec ref_p(n), ref_b(n);
        for (int64_t r = 0; r < c.R; ++r)
          for (int64_t k = 0; k < c.C; ++k) {
            const float x = h.widen(x0[r * c.C + k]), p = wpe[((c.row0 + r) % c.T) * c.C + k], b = bias[k];
            want_p[r * c.C + k] = h.round(x + p), ref_p[r * c.C + k] = double{x} + p;
            want_b[r * c.C + k] = h.round(x + b), ref_b[r * c.C + k] = double{x} + b;
          }
        tx.upload(x0);
        ops::position_forward(s(), tx, twpe, c.row0, c.T);
        const std::vector<uint16_t> got_p = tx.download<uint16_t>();
        EXPECT_TRUE(bitwise_equal(got_p, want_p)) << "position_forward";
        EXPECT_TRUE(h.close(h.widen(got_p), ref_p)) << "position_forward";
        tx.upload(x0);
        ops::bias_forward(s(), tx, tbias);
        const std::vector<uint16_t> got_b = tx.download<uint16_t>();
        EXPECT_TRUE(bitwise_equal(got_b, want_b)) << "bias_forward";
        EXPECT_TRUE(h.close(h.widen(got_b), ref_b)) << "bias_forward";
      }
      // Backward: dwpe and dbias fp32 += the widened rows.
      const std::vector<uint16_t> dx = h.round(rng_.normal(c.R * c.C));
      DevTensor tdx(*dev_, s(), t, {c.R, c.C});
      tdx.upload(dx);
      const FVec dwpe0 = rng_.normal(c.T * c.C), dbias0 = rng_.normal(c.C);
      DevTensor dwpe = tensor(dwpe0, {c.T, c.C}), dbias = tensor(dbias0, {c.C});
      ops::position_backward(s(), dwpe, tdx, c.row0, c.T);
      ops::bias_backward(s(), dbias, tdx);
      DVec r_wpe = to_d(dwpe0), r_bias = to_d(dbias0);
      ref::position_backward_ref(r_wpe, to_d(h.widen(dx)), c.R, c.C, c.row0, c.T);
      ref::bias_backward_ref(r_bias, to_d(h.widen(dx)), c.R, c.C);
      EXPECT_TRUE(close(dwpe.f(), r_wpe, kTolReduce)) << dtype_name(t) << " position_backward";
      EXPECT_TRUE(close(dbias.f(), r_bias, kTolReduce)) << dtype_name(t) << " bias_backward";
    }
  }
}

// The vocabulary-parallel cross-entropy over a shard of 16-bit logits, the last shard partly
// padding: row maxima exact (of the widened real columns), the partial sums and losses within the
// fp32 tolerance of float64 on the widened logits, dlogits rounded once (the dtype's half ulp), the
// padding columns' gradient 0.
TEST_P(FusedOpsTest, SixteenBitVocabParallelCrossEntropy) {
  struct Case {
    int64_t N, Vl, begin, total;
  };
  // {7, 64, 64, 100}: a last shard of 36 real and 28 padding columns; {5, 128, 128, 128}: padding only.
  const Case cases[] = {{1, 1, 0, 1}, {7, 64, 64, 100}, {9, 257, 0, 514}, {16, 1024, 1024, 2000}, {5, 128, 128, 128}};
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Host16 h{t};
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " N=" << c.N << " Vl=" << c.Vl << " begin=" << c.begin
                                        << " total=" << c.total);
      const int64_t real = std::clamp<int64_t>(c.total - c.begin, 0, c.Vl);
      const ops::VocabRange vocab{c.begin, c.total};
      FVec raw = rng_.normal(c.N * c.Vl);
      for (float& v : raw) v *= 3.0f;
      const std::vector<uint16_t> logits = h.round(raw);
      const FVec wide = h.widen(logits);
      IVec targets = rng_.ints(c.N, 0, static_cast<int32_t>(c.total));
      for (int64_t r = 0; r < c.N; ++r)
        if (r % 3 == 1) targets[r] = static_cast<int32_t>(c.begin + (r % std::max<int64_t>(real, 1)));  // here
      if (c.N > 2) targets[2] = -1;  // ignored
      DevTensor tl(*dev_, s(), t, {c.N, c.Vl}), ttg = tensor(targets, {c.N});
      tl.upload(logits);
      // Real columns only (widened) for the references, which know no padding.
      DVec real_logits;
      for (int64_t r = 0; r < c.N; ++r)
        for (int64_t k = 0; k < real; ++k) real_logits.push_back(wide[r * c.Vl + k]);
      DevTensor mx = tensor(FVec(c.N, NAN), {c.N});
      ops::row_max(s(), mx, tl, vocab);
      const FVec got_max = mx.f();
      for (int64_t r = 0; r < c.N; ++r) {
        float want = -INFINITY;
        for (int64_t k = 0; k < real; ++k) want = std::max(want, wide[r * c.Vl + k]);
        EXPECT_EQ(got_max[r], want) << "row " << r;
      }
      if (real == 0) continue;  // a shard of padding only: its maxima are the whole check
      DevTensor part = tensor(FVec(2 * c.N, NAN), {2, c.N});
      ops::vocab_partials(s(), part, tl, mx, ttg, vocab);
      DVec r_part(2 * c.N);
      ref::vocab_partials_ref(r_part, real_logits, to_d(got_max), targets, c.N, real, c.begin);
      const FVec got_part = part.f();
      EXPECT_TRUE(close(got_part, r_part, kTolReduce)) << "vocab_partials";
      // One shard holds the whole real vocabulary here: its partials are the global sums.
      const FVec sumexp(got_part.begin(), got_part.begin() + c.N), tlog(got_part.begin() + c.N, got_part.end());
      DevTensor tsum = tensor(sumexp, {c.N}), ttl = tensor(tlog, {c.N}), losses = tensor(FVec(c.N, NAN), {c.N});
      const float dloss = 0.25f;
      ops::vocab_loss_grad(s(), tl, losses, mx, tsum, ttl, ttg, vocab, dloss, true);
      DVec r_loss(c.N), r_grad(c.N * real);
      ref::vocab_loss_grad_ref(r_loss, r_grad, real_logits, to_d(got_max), to_d(sumexp), to_d(tlog), targets, c.N,
                               real, c.begin, dloss);
      EXPECT_TRUE(close(losses.f(), r_loss, kTolReduce)) << "losses";
      const FVec got = h.widen(tl.download<uint16_t>());
      FVec got_real;
      for (int64_t r = 0; r < c.N; ++r) {
        for (int64_t k = 0; k < real; ++k) got_real.push_back(got[r * c.Vl + k]);
        for (int64_t k = real; k < c.Vl; ++k) EXPECT_EQ(got[r * c.Vl + k], 0.0f) << "padding column " << k;
      }
      EXPECT_TRUE(h.close(got_real, r_grad)) << "dlogits";
    }
  }
}

TEST_P(FusedOpsTest, LmHeadBf16) { check_lm_head_16<BFloat16>(*dev_, s(), rng_, GetParam()); }
TEST_P(FusedOpsTest, LmHeadFp16) { check_lm_head_16<Half>(*dev_, s(), rng_, GetParam()); }

// GPT-2's vocabulary: 50257 real columns of 50304, a few rows (the padding as above).
TEST_P(FusedOpsTest, LmHeadBf16Gpt2Vocabulary) {
  const int64_t N = 2, C = 16, V = 50257, Vp = ops::padded_vocab(V);
  ASSERT_EQ(Vp, 50304);
  const std::vector<BFloat16> in = round_to<BFloat16>(rng_.normal(N * C)),
                              wte = round_to<BFloat16>(rng_.normal(V * C, 0.2f));
  DevTensor tin = upload_as(*dev_, s(), {N, C}, in), twte = upload_as(*dev_, s(), {V, C}, wte);
  DevTensor logits = upload_as(*dev_, s(), {N, Vp}, std::vector<BFloat16>(N * Vp, nan16<BFloat16>()));
  ops::lm_head_forward(s(), logits, tin, twte);
  DVec r_logits(N * V);
  ref::matmul_forward_ref(r_logits, to_d(widen(in)), to_d(widen(wte)), {}, N, C, V);
  const std::vector<BFloat16> got = logits.download<BFloat16>();
  FVec real(N * V);
  int64_t padding_written = 0;
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t j = 0; j < V; ++j) real[r * V + j] = to_float(got[r * Vp + j]);
    for (int64_t j = V; j < Vp; ++j) padding_written += got[r * Vp + j].bits != nan16<BFloat16>().bits;
  }
  EXPECT_TRUE(close16(real, r_logits, DType::kBF16, kTolReduce));
  EXPECT_EQ(padding_written, 0);
  std::vector<BFloat16> dl = round_to<BFloat16>(rng_.normal(N * Vp, 0.1f));
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = V; j < Vp; ++j) dl[r * Vp + j] = nan16<BFloat16>();
  const FVec dwte0 = rng_.normal(V * C);
  DevTensor tdl = upload_as(*dev_, s(), {N, Vp}, dl), din(*dev_, s(), DType::kBF16, {N, C}),
            dwte = upload_as(*dev_, s(), {V, C}, dwte0);
  din.upload(std::vector<BFloat16>(N * C, from_float<BFloat16>(0.0f)));
  ops::lm_head_backward(s(), din, dwte, tdl, tin, twte);
  DVec dl_real(N * V);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < V; ++j) dl_real[r * V + j] = to_float(dl[r * Vp + j]);
  DVec r_din(N * C, 0.0), r_dwte = to_d(dwte0);
  ref::matmul_backward_ref(r_din, r_dwte, {}, dl_real, to_d(widen(in)), to_d(widen(wte)), N, C, V);
  EXPECT_TRUE(close16(widen(din.download<BFloat16>()), r_din, DType::kBF16, kTolReduce));
  EXPECT_TRUE(close(dwte.f(), r_dwte, kTolReduce));
}

// Tensors that must share the activation dtype, or parameters of a third dtype: one sentence.
TEST_P(FusedOpsTest, SixteenBitNormAndHeadRefuseMixedDtypes) {
  const int64_t N = 4, C = 8, V = 20;
  DevTensor x(*dev_, s(), DType::kBF16, {N, C}), xh(*dev_, s(), DType::kF16, {N, C}),
      wh(*dev_, s(), DType::kF16, {C}), wb(*dev_, s(), DType::kBF16, {C}), w32 = poisoned({C}),
      mean = poisoned({N}), rstd = poisoned({N}), dw = poisoned({C}), db = poisoned({C});
  auto message = [](auto&& f) { return error_of(f).message(); };
  EXPECT_THAT(message([&] { ops::layernorm_forward(s(), xh, mean, rstd, x, w32, w32, 1e-5f); }),
              ::testing::HasSubstr("layernorm_forward: out [4, 8] is fp16 but must be bf16"));
  EXPECT_THAT(message([&] { ops::layernorm_forward(s(), x, mean, rstd, x, wh, wh, 1e-5f); }),
              ::testing::HasSubstr("layernorm_forward: weight [8] is fp16 but must be fp32 or bf16"));
  EXPECT_THAT(message([&] { ops::layernorm_forward(s(), x, mean, rstd, x, wb, w32, 1e-5f); }),
              ::testing::HasSubstr("layernorm_forward: bias [8] is fp32 but must be bf16"));
  EXPECT_THAT(message([&] { ops::layernorm_backward(s(), x, dw, db, xh, x, w32, mean, rstd); }),
              ::testing::HasSubstr("layernorm_backward: dout [4, 8] is fp16 but must be bf16"));
  EXPECT_THAT(message([&] { ops::layernorm_backward(s(), x, wb, db, x, x, w32, mean, rstd); }),
              ::testing::HasSubstr("layernorm_backward: dweight [8] is bf16 but must be fp32"));
  DevTensor a = poisoned({N, C}), res = poisoned({N, C}), ln = poisoned({N, C});
  EXPECT_THAT(message([&] { ops::residual_layernorm_forward(s(), res, ln, mean, rstd, a, a, wb, wb, 1e-5f); }),
              ::testing::HasSubstr("residual_layernorm_forward: weight [8] is bf16 but must be fp32"));
  DevTensor wte(*dev_, s(), DType::kBF16, {V, C}), wte32 = poisoned({V, C}), logits(*dev_, s(), DType::kBF16, {N, V}),
      logits_h(*dev_, s(), DType::kF16, {N, V}), dwte(*dev_, s(), DType::kBF16, {V, C});
  EXPECT_THAT(message([&] { ops::lm_head_forward(s(), logits, x, wte32); }),
              ::testing::HasSubstr("lm_head_forward: wte [20, 8] is fp32 but must be bf16"));
  EXPECT_THAT(message([&] { ops::lm_head_forward(s(), logits_h, x, wte); }),
              ::testing::HasSubstr("lm_head_forward: logits [4, 20] is fp16 but must be bf16"));
  EXPECT_THAT(message([&] { ops::lm_head_backward(s(), x, dwte, logits, x, wte); }),
              ::testing::HasSubstr("lm_head_backward: dwte [20, 8] is bf16 but must be fp32"));
  EXPECT_THAT(message([&] { ops::lm_head_backward(s(), xh, TensorView{}, logits, x, wte); }),
              ::testing::HasSubstr("lm_head_backward: din [4, 8] is fp16 but must be bf16"));
  sync();
}

// All activation tensors of a call share one dtype; parameter gradients stay fp32; a backend
// without the kernel refuses. Each in one sentence naming the op and the tensor.
TEST_P(FusedOpsTest, SixteenBitActivationOpsRefuseMixedDtypes) {
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                                : ::testing::AssertionFailure() << "\"" << text << "\" lacks \""
                                                                                << part << "\"";
  };
  DevTensor a = empty({8}, DType::kBF16), hf = empty({8}, DType::kF16), f = empty({8}), i = empty({8}, DType::kI32);
  EXPECT_TRUE(has(message([&] { ops::add(s(), a, a, hf); }), "add: b [8] is fp16 but must be bf16"));
  EXPECT_TRUE(has(message([&] { ops::add(s(), f, a, a); }), "add: a [8] is bf16 but must be fp32"));
  EXPECT_TRUE(has(message([&] { ops::fill(s(), i, 1.0f); }), "fill: x [8] is int32 but must be fp32, fp16 or bf16"));
  EXPECT_TRUE(has(message([&] { ops::gelu_forward(s(), f, a); }), "gelu_forward: out [8] is fp32 but must be bf16"));
  EXPECT_TRUE(
      has(message([&] { ops::gelu_backward(s(), a, a, hf); }), "gelu_backward: dout [8] is fp16 but must be bf16"));

  DevTensor tokens = tensor(IVec{0, 1}, {1, 2}), out = empty({1, 2, 4}, DType::kBF16),
            wte = empty({5, 4}, DType::kBF16), wte32 = empty({5, 4}), wpe = empty({3, 4}, DType::kBF16),
            wpe16 = empty({3, 4}, DType::kF16), dwpe = empty({3, 4});
  EXPECT_TRUE(has(message([&] { ops::encoder_forward(s(), out, tokens, wte32, wpe); }),
                  "encoder_forward: wte [5, 4] is fp32 but must be bf16"));
  EXPECT_TRUE(has(message([&] { ops::encoder_forward(s(), out, tokens, wte, wpe16); }),
                  "encoder_forward: wpe [3, 4] is fp16 but must be bf16"));
  EXPECT_TRUE(has(message([&] { ops::encoder_backward(s(), wte, dwpe, out, tokens); }),
                  "encoder_backward: dwte [5, 4] is bf16 but must be fp32"));

  OpTable without = *op_table(GetParam());
  without.gelu_forward = nullptr;
  sync();
  ScopedOpTable scoped(GetParam(), &without);
  EXPECT_TRUE(has(message([&] { ops::gelu_forward(s(), a, a); }), "gelu_forward: the "));
  EXPECT_TRUE(has(message([&] { ops::gelu_forward(s(), a, a); }), "has no kernel for bf16"));
  sync();
}

INSTANTIATE_TEST_SUITE_P(Backends, FusedOpsTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(backend_name(info.param));
                         });

}  // namespace
}  // namespace zt
