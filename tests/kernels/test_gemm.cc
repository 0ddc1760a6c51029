// The matmul family with 16-bit inputs and the fused GELU epilogues (kernels/ops.h: matmul_forward,
// matmul_backward, matmul_gelu_forward, matmul_backward_dgelu) on every backend against float64
// references, their ops.cc fallbacks against the backend's fused kernels, and, on CUDA, the plain
// cuBLAS path against cuBLASLt (ZT_CUBLASLT=off). The cuda instances skip without a GPU.
//
// Inputs are drawn in fp32 and rounded to the tested type, so the float64 reference sees exactly
// the values the kernels read. Tolerances (tests/README.md): on every backend each result is within
// the bound tests/tolerance.h derives from its type and reduction length (what cuBLAS/cuBLASLt are
// held to); the CPU backend, ZeroTrain's own kernels, is also held to the tight tolerances below:
// fp32 results as kTolReduce (tests/kernels/test_ops.cc); a result rounded once to a 16-bit type is
// within half an ulp of the exact value (2^-8 relative for bf16, 2^-11 for fp16) plus the fp32
// accumulation error, which the rms term covers; its fused and composed paths give the same bits.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "kernels/elementwise.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "op_test_util.h"
#include "runtime/runtime.h"
#include "tolerance.h"

namespace zt {
namespace {

using namespace op_test;  // NOLINT(build/namespaces): the helpers shared by the op test binaries
using ::testing::HasSubstr;
using U16 = std::vector<uint16_t>;

const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

Tol tol_for(DType out) {
  if (out == DType::kBF16) return Tol{4e-3, 2e-5};  // 2^-8 = 3.9e-3
  if (out == DType::kF16) return Tol{5e-4, 2e-5};   // 2^-11 = 4.9e-4
  return kTolReduce;
}

class GemmTest : public OpsFixture {
 protected:
  DevTensor poisoned_as(Shape shape, DType t) {
    if (t == DType::kF32) return poisoned(shape);
    DevTensor d = empty(shape, t);
    d.upload(U16(static_cast<size_t>(shape.numel()), 0x7fff));  // NaN in both 16-bit types
    return d;
  }
  // Bits of any floating tensor, for bitwise comparisons.
  static std::vector<uint32_t> bits_of(const DevTensor& d) {
    std::vector<uint32_t> out;
    if (d.view().dtype == DType::kF32) {
      for (float f : d.f()) out.push_back(float_as_bits(f));
    } else {
      for (uint16_t b : d.download<uint16_t>()) out.push_back(b);
    }
    return out;
  }
  // Bitwise on the CPU backend (one implementation behind both paths). Two vendor call shapes (a
  // fused epilogue and the composed ops) are never compared with each other (tests/README.md):
  // elsewhere this passes and each result is checked against float64 instead.
  ::testing::AssertionResult same_bits_on_cpu(const DevTensor& got, const DevTensor& want) {
    if (GetParam() != Backend::kCpu) return ::testing::AssertionSuccess();
    return bitwise_equal(bits_of(got), bits_of(want));
  }
  // Within the derived bound of float64 on every backend; on the CPU backend also within `cpu`.
  ::testing::AssertionResult matches(const FVec& got, const DVec& ref, const DVec& bound, Tol cpu) {
    if (GetParam() == Backend::kCpu) {
      ::testing::AssertionResult tight = close(got, ref, cpu);
      if (!tight) return tight;
    }
    return tolerance::within(got, ref, bound);
  }
};

struct GemmCase {
  int64_t N, C, OC;
};
// Sizes around nothing in particular: 1, primes, odd and even, one wider than a GEMM tile.
const GemmCase kGemmCases[] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 65}, {31, 96, 130}, {129, 37, 257}};

std::string dtype_trace(DType in, DType out) {
  return std::string("in ") + dtype_name(in) + ", out " + dtype_name(out);
}

// Forward and backward of matmul for every input type and both output types it allows: out,
// din (accumulated onto random values) against the float64 reference of the rounded inputs,
// dweight and dbias (fp32, accumulated) likewise.
TEST_P(GemmTest, MatmulTakes16BitInputsWithFp32Accumulation) {
  for (const DType in_t : kTypes) {
    for (const DType out_t : {DType::kF32, in_t}) {
      if (in_t == DType::kF32 && out_t != DType::kF32) continue;
      for (const GemmCase& c : kGemmCases) {
        SCOPED_TRACE(::testing::Message() << dtype_trace(in_t, out_t) << " N=" << c.N << " C=" << c.C
                                          << " OC=" << c.OC);
        const int64_t N = c.N, C = c.C, OC = c.OC;
        const FVec in = round_to(rng_.normal(N * C), in_t), w = round_to(rng_.normal(OC * C), in_t);
        const FVec b = round_to(rng_.normal(OC), out_t);  // the bias takes out's type here
        DevTensor tin = typed(in, {N, C}, in_t), tw = typed(w, {OC, C}, in_t), tb = typed(b, {OC}, out_t);
        DevTensor out = poisoned_as({N, OC}, out_t);
        ops::matmul_forward(s(), out, tin, tw, tb);
        DVec r_out(N * OC);
        ref::matmul_forward_ref(r_out, to_d(in), to_d(w), to_d(b), N, C, OC);
        EXPECT_TRUE(matches(values(out), r_out,
                            tolerance::matmul_forward_bound(out_t, to_d(in), to_d(w), to_d(b), N, C, OC),
                            tol_for(out_t)));

        const FVec dout = round_to(rng_.normal(N * OC), in_t), din0 = round_to(rng_.normal(N * C), out_t);
        const FVec dw0 = rng_.normal(OC * C), db0 = rng_.normal(OC);
        DevTensor tdout = typed(dout, {N, OC}, in_t), din = typed(din0, {N, C}, out_t);
        DevTensor dw = tensor(dw0, {OC, C}), db = tensor(db0, {OC});
        ops::matmul_backward(s(), din, dw, db, tdout, tin, tw);
        DVec r_din = to_d(din0), r_dw = to_d(dw0), r_db = to_d(db0);
        ref::matmul_backward_ref(r_din, r_dw, r_db, to_d(dout), to_d(in), to_d(w), N, C, OC);
        const tolerance::MatmulBackwardBounds bb = tolerance::matmul_backward_bounds(
            out_t, to_d(dout), to_d(in), to_d(w), to_d(din0), to_d(dw0), to_d(db0), N, C, OC);
        EXPECT_TRUE(matches(values(din), r_din, bb.din, tol_for(out_t)));
        EXPECT_TRUE(matches(dw.f(), r_dw, bb.dweight, kTolReduce));
        EXPECT_TRUE(matches(db.f(), r_db, bb.dbias, kTolReduce));
      }
    }
  }
}

// A 16-bit output is the fp32 result rounded once (nearest even): the same call with an fp32
// output, rounded on the host, gives the same bits on the CPU backend (one rounding, no double
// rounding through an intermediate); on every backend both are within their bounds of float64.
TEST_P(GemmTest, SixteenBitOutputIsTheFp32ResultRoundedOnce) {
  const int64_t N = 19, C = 77, OC = 45;
  for (const DType t : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(t));
    const FVec in = round_to(rng_.normal(N * C), t), w = round_to(rng_.normal(OC * C), t);
    const FVec b = round_to(rng_.normal(OC), t);
    DevTensor tin = typed(in, {N, C}, t), tw = typed(w, {OC, C}, t), tb = typed(b, {OC}, t);
    DevTensor o16 = poisoned_as({N, OC}, t), o32 = poisoned({N, OC});
    ops::matmul_forward(s(), o16, tin, tw, tb);
    ops::matmul_forward(s(), o32, tin, tw, tb);
    const FVec wide = o32.f();
    DevTensor rounded = typed(wide, {N, OC}, t);
    EXPECT_TRUE(same_bits_on_cpu(o16, rounded));
    DVec r(N * OC);
    ref::matmul_forward_ref(r, to_d(in), to_d(w), to_d(b), N, C, OC);
    EXPECT_TRUE(matches(values(o16), r, tolerance::matmul_forward_bound(t, to_d(in), to_d(w), to_d(b), N, C, OC),
                        tol_for(t)));
    EXPECT_TRUE(matches(wide, r, tolerance::matmul_forward_bound(DType::kF32, to_d(in), to_d(w), to_d(b), N, C, OC),
                        kTolReduce));
  }
}

// matmul_gelu_forward: pre_gelu = in @ W^T + b and out_gelu = gelu(pre_gelu), both from the fp32
// sum; with and without bias; every type.
TEST_P(GemmTest, MatmulGeluForwardMatchesReference) {
  for (const DType t : kTypes) {
    for (const GemmCase& c : kGemmCases) {
      for (const bool bias : {true, false}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " N=" << c.N << " C=" << c.C << " OC=" << c.OC
                                          << " bias=" << bias);
        const int64_t N = c.N, C = c.C, OC = c.OC;
        const FVec in = round_to(rng_.normal(N * C, 0.2f), t), w = round_to(rng_.normal(OC * C, 0.2f), t);
        const FVec b = round_to(rng_.normal(OC), t);
        DevTensor tin = typed(in, {N, C}, t), tw = typed(w, {OC, C}, t), tb = typed(b, {OC}, t);
        DevTensor pre = poisoned_as({N, OC}, t), out = poisoned_as({N, OC}, t);
        ops::matmul_gelu_forward(s(), out, pre, tin, tw, bias ? tb.view() : TensorView{});
        DVec r_pre(N * OC), r_out(N * OC);
        ref::matmul_forward_ref(r_pre, to_d(in), to_d(w), bias ? to_d(b) : DVec{}, N, C, OC);
        ref::gelu_forward_ref(r_out, r_pre);
        const tolerance::GeluForwardBounds gb = tolerance::matmul_gelu_forward_bounds(
            t, to_d(in), to_d(w), bias ? to_d(b) : DVec{}, r_pre, r_out, N, C, OC);
        EXPECT_TRUE(matches(values(pre), r_pre, gb.pre, tol_for(t)));
        EXPECT_TRUE(matches(values(out), r_out, gb.out, tol_for(t)));
      }
    }
  }
}

// matmul_backward_dgelu: dpre = gelu'(pre) * (dout @ W) overwrites a NaN-poisoned dpre; dbias
// accumulates the stored dpre's column sums onto random values (ops.h: bias_backward's bits on the
// CPU backend; a 16-bit dpre's rounding is in them, so summing the fp32 values before it fails the
// tight check); every type.
TEST_P(GemmTest, MatmulBackwardDgeluMatchesReference) {
  for (const DType t : kTypes) {
    for (const GemmCase& c : kGemmCases) {
      for (const bool bias : {true, false}) {
        // The layer: out[N, OC] = gelu(pre)[N, C] @ W[OC, C]^T, so dpre is [N, C].
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " N=" << c.N << " C=" << c.C << " OC=" << c.OC
                                          << " bias=" << bias);
        const int64_t N = c.N, C = c.C, OC = c.OC;
        const FVec dout = round_to(rng_.normal(N * OC), t), w = round_to(rng_.normal(OC * C), t);
        const FVec pre = round_to(rng_.normal(N * C, 2.0f), t), db0 = rng_.normal(C);
        DevTensor tdout = typed(dout, {N, OC}, t), tw = typed(w, {OC, C}, t), tpre = typed(pre, {N, C}, t);
        DevTensor dpre = poisoned_as({N, C}, t), db = tensor(db0, {C});
        ops::matmul_backward_dgelu(s(), dpre, bias ? db.view() : TensorView{}, tdout, tw, tpre);
        DVec dgrad(N * C, 0.0), r_dpre(N * C, 0.0), r_db = to_d(db0);
        DVec unused(OC * C, 0.0);
        // dgrad = dout @ W is matmul_backward's din of a layer with input [N, C].
        ref::matmul_backward_ref(dgrad, unused, ref::DSpan{}, to_d(dout), DVec(N * C, 0.0), to_d(w), N, C, OC);
        ref::gelu_backward_ref(r_dpre, to_d(pre), dgrad);
        if (bias) ref::bias_backward_ref(r_db, r_dpre, N, C);
        const tolerance::DgeluBounds gb =
            tolerance::matmul_backward_dgelu_bounds(t, to_d(dout), to_d(w), to_d(pre), dgrad, to_d(db0), N, C, OC);
        EXPECT_TRUE(matches(values(dpre), r_dpre, gb.dpre, tol_for(t)));
        if (bias) {
          DVec r_db_stored = to_d(db0);  // the column sums of what dpre holds
          ref::bias_backward_ref(r_db_stored, to_d(values(dpre)), N, C);
          EXPECT_TRUE(matches(db.f(), r_db_stored, gb.dbias, kTolReduce));
          EXPECT_TRUE(tolerance::within(db.f(), r_db, gb.dbias));  // and the exact dpre's within the bound
          DevTensor db_again = tensor(db0, {C});
          ops::bias_backward(s(), db_again, dpre);
          EXPECT_TRUE(same_bits_on_cpu(db, db_again));
        } else {
          EXPECT_TRUE(bitwise_equal(db.f(), db0));  // untouched without bias
        }
      }
    }
  }
}

// Backends without the fused entries run ops.cc's composition of the unfused ops: on the CPU the
// bits of the fused kernels (for f32 the bits of the ops the model ran before the fusion); on every
// backend each path within the derived bounds of float64 (on CUDA the fused path is cuBLASLt's
// epilogues, the composed one other calls: never compared with each other). Also the unfused
// matmul_forward + gelu_forward sequence for f32.
TEST_P(GemmTest, FusedOpsEqualTheirFallbacks) {
  const int64_t N = 37, C = 48, OC = 29;
  const OpTable& builtin = *op_table(GetParam());
  OpTable without = builtin;
  without.matmul_gelu_forward = nullptr;
  without.matmul_backward_dgelu = nullptr;
  for (const DType t : kTypes) {
    SCOPED_TRACE(dtype_name(t));
    const FVec in = round_to(rng_.normal(N * C), t), w = round_to(rng_.normal(OC * C), t);
    const FVec b = round_to(rng_.normal(OC), t), dout = round_to(rng_.normal(N * OC), t);
    const FVec w2 = round_to(rng_.normal(OC * C), t), db0 = rng_.normal(OC);
    DevTensor tin = typed(in, {N, C}, t), tw = typed(w, {OC, C}, t), tb = typed(b, {OC}, t);
    DevTensor pre_a = poisoned_as({N, OC}, t), out_a = poisoned_as({N, OC}, t);
    DevTensor pre_b = poisoned_as({N, OC}, t), out_b = poisoned_as({N, OC}, t);
    // backward of a second layer [N, OC] -> [N, C]: its dout [N, C], weight w2 [C, OC]
    const FVec dout2 = round_to(rng_.normal(N * C), t);
    DevTensor tdout2 = typed(dout2, {N, C}, t), tw2 = typed(w2, {C, OC}, t);
    DevTensor dpre_a = poisoned_as({N, OC}, t), dpre_b = poisoned_as({N, OC}, t);
    DevTensor db_a = tensor(db0, {OC}), db_b = tensor(db0, {OC});

    ops::matmul_gelu_forward(s(), out_a, pre_a, tin, tw, tb);
    ops::matmul_backward_dgelu(s(), dpre_a, db_a, tdout2, tw2, pre_a);
    sync();
    {
      const ScopedOpTable scoped(GetParam(), &without);
      ops::matmul_gelu_forward(s(), out_b, pre_b, tin, tw, tb);
      ops::matmul_backward_dgelu(s(), dpre_b, db_b, tdout2, tw2, pre_a);
      sync();
    }
    EXPECT_TRUE(same_bits_on_cpu(pre_b, pre_a));
    EXPECT_TRUE(same_bits_on_cpu(out_b, out_a));
    EXPECT_TRUE(same_bits_on_cpu(dpre_b, dpre_a));
    EXPECT_TRUE(same_bits_on_cpu(db_b, db_a));
    // float64: the forward of (in, w, b); the backward of the second layer reads pre_a in every path.
    DVec r_pre(N * OC), r_out(N * OC), r_dgrad(N * OC, 0.0), unused(C * OC, 0.0), r_dpre(N * OC, 0.0);
    ref::matmul_forward_ref(r_pre, to_d(in), to_d(w), to_d(b), N, C, OC);
    ref::gelu_forward_ref(r_out, r_pre);
    const DVec pre_used = to_d(values(pre_a));
    ref::matmul_backward_ref(r_dgrad, unused, ref::DSpan{}, to_d(dout2), DVec(N * OC, 0.0), to_d(w2), N, OC, C);
    ref::gelu_backward_ref(r_dpre, pre_used, r_dgrad);
    DVec r_db = to_d(db0);
    ref::bias_backward_ref(r_db, r_dpre, N, OC);
    const tolerance::GeluForwardBounds fb =
        tolerance::matmul_gelu_forward_bounds(t, to_d(in), to_d(w), to_d(b), r_pre, r_out, N, C, OC);
    const tolerance::DgeluBounds bb =
        tolerance::matmul_backward_dgelu_bounds(t, to_d(dout2), to_d(w2), pre_used, r_dgrad, to_d(db0), N, OC, C);
    for (const auto& [name, pre, out, dpre, db] :
         {std::tuple<const char*, DevTensor*, DevTensor*, DevTensor*, DevTensor*>{"fused", &pre_a, &out_a, &dpre_a, &db_a},
          {"fallback", &pre_b, &out_b, &dpre_b, &db_b}}) {
      EXPECT_TRUE(tolerance::within(values(*pre), r_pre, fb.pre)) << name << " pre";
      EXPECT_TRUE(tolerance::within(values(*out), r_out, fb.out)) << name << " out";
      EXPECT_TRUE(tolerance::within(values(*dpre), r_dpre, bb.dpre)) << name << " dpre";
      EXPECT_TRUE(tolerance::within(db->f(), r_db, bb.dbias)) << name << " dbias";
    }

    if (t != DType::kF32) continue;
    // The model's ops before the fusion: matmul_forward, gelu_forward; zeroed buffers, matmul_backward's
    // din, gelu_backward, bias_backward.
    DevTensor pre_c = poisoned({N, OC}), out_c = poisoned({N, OC});
    ops::matmul_forward(s(), pre_c, tin, tw, tb);
    ops::gelu_forward(s(), out_c, pre_c);
    DevTensor dgrad = tensor(FVec(N * OC, 0.0f), {N, OC}), dpre_c = tensor(FVec(N * OC, 0.0f), {N, OC});
    DevTensor db_c = tensor(db0, {OC});
    ops::matmul_backward(s(), dgrad, TensorView{}, TensorView{}, tdout2, pre_a, tw2);
    ops::gelu_backward(s(), dpre_c, pre_a, dgrad);
    ops::bias_backward(s(), db_c, dpre_c);
    EXPECT_TRUE(same_bits_on_cpu(pre_c, pre_a));
    EXPECT_TRUE(same_bits_on_cpu(out_c, out_a));
    EXPECT_TRUE(same_bits_on_cpu(dpre_c, dpre_a));
    EXPECT_TRUE(same_bits_on_cpu(db_c, db_a));
    EXPECT_TRUE(tolerance::within(pre_c.f(), r_pre, fb.pre)) << "unfused pre";
    EXPECT_TRUE(tolerance::within(out_c.f(), r_out, fb.out)) << "unfused out";
    EXPECT_TRUE(tolerance::within(dpre_c.f(), r_dpre, bb.dpre)) << "unfused dpre";
    EXPECT_TRUE(tolerance::within(db_c.f(), r_db, bb.dbias)) << "unfused dbias";
  }
}

// The CUDA backend's plain cuBLAS path (taken where cuBLASLt refuses a shape; forced here with
// ZT_CUBLASLT=off, read when a stream's handles are made) and its cuBLASLt path, every op of the
// family and every type, including the epilogues' bias gradient and 16-bit din: each against
// float64 within the derived bounds (two cuBLAS call shapes are never compared with each other).
TEST_P(GemmTest, CublasFallbackMatchesCublasLt) {
  if (GetParam() != Backend::kCuda) GTEST_SKIP() << "the cuBLAS fallback exists on the CUDA backend only";
  const int64_t N = 45, C = 72, OC = 33;
  for (const DType t : kTypes) {
    SCOPED_TRACE(dtype_name(t));
    const FVec in = round_to(rng_.normal(N * C), t), w = round_to(rng_.normal(OC * C), t);
    const FVec b = round_to(rng_.normal(OC), t), dout = round_to(rng_.normal(N * OC), t);
    const FVec din0 = round_to(rng_.normal(N * C), t), dw0 = rng_.normal(OC * C), db0 = rng_.normal(OC);
    const FVec dout2 = round_to(rng_.normal(N * C), t), w2 = round_to(rng_.normal(C * OC), t);
    struct Results {
      FVec out, pre, gelu, din, dw, db, dpre, db2;
    };
    auto run = [&](Runtime& rt) {
      Device& dev = rt.device(0);
      Stream& st = dev.compute();
      auto make = [&](const FVec& host, Shape shape, DType dt) {
        DevTensor d(dev, st, dt, shape);
        if (dt == DType::kF32) {
          d.upload(host);
        } else {
          U16 bits(host.size());
          for (size_t i = 0; i < host.size(); ++i) bits[i] = bits16(host[i], dt);
          d.upload(bits);
        }
        return d;
      };
      DevTensor tin = make(in, {N, C}, t), tw = make(w, {OC, C}, t), tb = make(b, {OC}, t);
      DevTensor out = make(FVec(N * OC, 0.f), {N, OC}, t), pre = make(FVec(N * OC, 0.f), {N, OC}, t);
      DevTensor gelu = make(FVec(N * OC, 0.f), {N, OC}, t), tdout = make(dout, {N, OC}, t);
      DevTensor din = make(din0, {N, C}, t), dw = make(dw0, {OC, C}, DType::kF32), db = make(db0, {OC}, DType::kF32);
      DevTensor tdout2 = make(dout2, {N, C}, t), tw2 = make(w2, {C, OC}, t);
      DevTensor dpre = make(FVec(N * OC, 0.f), {N, OC}, t), db2 = make(db0, {OC}, DType::kF32);
      ops::matmul_forward(st, out, tin, tw, tb);
      ops::matmul_gelu_forward(st, gelu, pre, tin, tw, tb);
      ops::matmul_backward(st, din, dw, db, tdout, tin, tw);
      ops::matmul_backward_dgelu(st, dpre, db2, tdout2, tw2, pre);
      st.synchronize();
      return Results{values(out), values(pre), values(gelu), values(din), dw.f(), db.f(), values(dpre), db2.f()};
    };
    // One runtime at a time: the first's streams (and their cuBLASLt handles) go before the second
    // makes new ones under ZT_CUBLASLT=off; the fixture's runtime is rebuilt for the next type.
    std::string reason;
    const Results lt = run(*rt_);
    rt_.reset();
    setenv("ZT_CUBLASLT", "off", 1);
    std::unique_ptr<Runtime> plain_rt = make_runtime(Backend::kCuda, &reason);
    ASSERT_TRUE(plain_rt) << reason;
    const Results plain = run(*plain_rt);  // its stream's handles are made (env read) in here
    unsetenv("ZT_CUBLASLT");
    plain_rt.reset();
    rt_ = make_runtime(Backend::kCuda, &reason);
    ASSERT_TRUE(rt_) << reason;
    dev_ = &rt_->device(0);
    s_ = &dev_->compute();
    DVec r_out(N * OC), r_gelu(N * OC), r_din = to_d(din0), r_dw = to_d(dw0), r_db = to_d(db0);
    ref::matmul_forward_ref(r_out, to_d(in), to_d(w), to_d(b), N, C, OC);
    ref::gelu_forward_ref(r_gelu, r_out);
    ref::matmul_backward_ref(r_din, r_dw, r_db, to_d(dout), to_d(in), to_d(w), N, C, OC);
    // the second layer [N, OC] -> [N, C]: dgrad = dout2 @ w2, through gelu' of each path's own pre
    DVec r_dgrad(N * OC, 0.0), unused(C * OC, 0.0);
    ref::matmul_backward_ref(r_dgrad, unused, ref::DSpan{}, to_d(dout2), DVec(N * OC, 0.0), to_d(w2), N, OC, C);
    const tolerance::GeluForwardBounds fb =
        tolerance::matmul_gelu_forward_bounds(t, to_d(in), to_d(w), to_d(b), r_out, r_gelu, N, C, OC);
    const tolerance::MatmulBackwardBounds bb = tolerance::matmul_backward_bounds(
        t, to_d(dout), to_d(in), to_d(w), to_d(din0), to_d(dw0), to_d(db0), N, C, OC);
    for (const auto& [name, got] : {std::pair<const char*, const Results*>{"cuBLASLt", &lt}, {"cuBLAS", &plain}}) {
      EXPECT_TRUE(tolerance::within(got->out, r_out, tolerance::matmul_forward_bound(t, to_d(in), to_d(w), to_d(b),
                                                                                      N, C, OC)))
          << name << " out";
      EXPECT_TRUE(tolerance::within(got->pre, r_out, fb.pre)) << name << " pre";
      EXPECT_TRUE(tolerance::within(got->gelu, r_gelu, fb.out)) << name << " gelu";
      EXPECT_TRUE(tolerance::within(got->din, r_din, bb.din)) << name << " din";
      EXPECT_TRUE(tolerance::within(got->dw, r_dw, bb.dweight)) << name << " dweight";
      EXPECT_TRUE(tolerance::within(got->db, r_db, bb.dbias)) << name << " dbias";
      DVec r_dpre(N * OC, 0.0), r_db2 = to_d(db0);
      ref::gelu_backward_ref(r_dpre, to_d(got->pre), r_dgrad);
      ref::bias_backward_ref(r_db2, r_dpre, N, OC);
      const tolerance::DgeluBounds gb = tolerance::matmul_backward_dgelu_bounds(t, to_d(dout2), to_d(w2),
                                                                                to_d(got->pre), r_dgrad, to_d(db0), N, OC, C);
      EXPECT_TRUE(tolerance::within(got->dpre, r_dpre, gb.dpre)) << name << " dpre";
      EXPECT_TRUE(tolerance::within(got->db2, r_db2, gb.dbias)) << name << " dbias (dgelu)";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, GemmTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(backend_name(info.param));
                         });

// ---- validation: one sentence naming the op, the tensor and the dtypes -----------------------------

using op_test::error_of;

class GemmValidation : public ::testing::Test {
 protected:
  void SetUp() override { rt_ = Runtime::create_cpu(1); }
  DevTensor make(Shape shape, DType dtype = DType::kF32) {
    return DevTensor(rt_->device(0), rt_->device(0).compute(), dtype, shape);
  }
  Stream& s() { return rt_->device(0).compute(); }
  std::unique_ptr<Runtime> rt_;
};

TEST_F(GemmValidation, MixedOrWrongDtypesAreRefused) {
  DevTensor in = make({4, 8}, DType::kBF16), w16 = make({6, 8}, DType::kF16), w = make({6, 8}, DType::kBF16);
  DevTensor out_h = make({4, 6}, DType::kF16), out = make({4, 6}, DType::kBF16), b = make({6});
  Error e = error_of([&] { ops::matmul_forward(s(), out, in, w16, b); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_THAT(e.message(), HasSubstr("matmul_forward: weight [6, 8] is fp16 but must be bf16"));
  EXPECT_THAT(error_of([&] { ops::matmul_forward(s(), out_h, in, w, b); }).message(),
              HasSubstr("matmul_forward: out [4, 6] is fp16 but must be fp32 or bf16 (in is bf16)"));
  DevTensor dw16 = make({6, 8}, DType::kBF16), dout = make({4, 6}, DType::kBF16);
  EXPECT_THAT(error_of([&] { ops::matmul_backward(s(), TensorView{}, dw16, TensorView{}, dout, in, w); }).message(),
              HasSubstr("matmul_backward: dweight [6, 8] is bf16 but must be fp32"));
  DevTensor i32 = make({4, 8}, DType::kI32);
  EXPECT_THAT(error_of([&] { ops::matmul_forward(s(), out, i32, w, b); }).message(),
              HasSubstr("matmul_forward: in [4, 8] is int32 but must be fp32, fp16 or bf16"));
  DevTensor pre = make({4, 6}, DType::kBF16), gelu32 = make({4, 6});
  EXPECT_THAT(error_of([&] { ops::matmul_gelu_forward(s(), gelu32, pre, in, w, b); }).message(),
              HasSubstr("matmul_gelu_forward: out_gelu [4, 6] is fp32 but must be bf16"));
  DevTensor dpre = make({4, 8}, DType::kBF16), pre_bad = make({4, 7}, DType::kBF16);
  EXPECT_THAT(error_of([&] { ops::matmul_backward_dgelu(s(), dpre, TensorView{}, dout, w, pre_bad); }).message(),
              HasSubstr("matmul_backward_dgelu: dout [4, 6] and weight [6, 8] but dpre [4, 8] and pre_gelu [4, 7]"));
}

}  // namespace
}  // namespace zt
