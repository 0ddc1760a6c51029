// The fused classifier over a padded vocabulary and 16-bit logits, and the LM head's GEMMs over
// padded logits rows, on every available backend, against float64 references: the issue's
// T in {1, 7, 64, 257, 1024}, f32/bf16/f16 logits, padded columns masked with gradient exactly 0.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "op_test_util.h"
#include "tolerance.h"

namespace zt {
namespace {

using namespace op_test;  // NOLINT(build/namespaces): the helpers shared by the op test binaries
using ::testing::HasSubstr;

class ClassifierTest : public OpsFixture {};

// Host copies of logits in `dtype`: the stored bits, and their exact values (what the op reads).
struct HostLogits {
  std::vector<uint16_t> bits16;  // bf16 / f16
  FVec f32;                      // f32
  DVec values;                   // every stored value, as double
};

uint16_t to_bits(DType t, float v) { return t == DType::kBF16 ? float_to_bf16_bits(v) : float_to_half_bits(v); }
float from_bits(DType t, uint16_t b) { return t == DType::kBF16 ? bf16_bits_to_float(b) : half_bits_to_float(b); }

HostLogits make_logits(DType t, const FVec& x) {
  HostLogits h;
  h.values.resize(x.size());
  if (t == DType::kF32) {
    h.f32 = x;
    for (size_t i = 0; i < x.size(); ++i) h.values[i] = x[i];
  } else {
    h.bits16.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      h.bits16[i] = to_bits(t, x[i]);
      h.values[i] = from_bits(t, h.bits16[i]);
    }
  }
  return h;
}

// A dlogit rounded once to `t` after fp32 math: twice the format's unit roundoff (2^-9 bf16,
// 2^-11 f16), which covers the rounding plus fp32's error; fp32 as the other element-wise ops.
Tol grad_tol(DType t) {
  if (t == DType::kBF16) return {1.0 / 256, 1.0 / 256};
  if (t == DType::kF16) return {1.0 / 1024, 1.0 / 1024};
  return kTolElem;
}

struct Case {
  int64_t B, T, V, Vp;
};
// GPT-2's vocabulary padded as the model pads it (50257 -> 50304) at small N, a small one at
// large N (1000 -> 1024), plus unpadded rows (Vp == V) and a vocabulary below one 128-column tile.
const Case kCases[] = {{2, 1, 50257, 50304}, {1, 7, 50257, 50304}, {2, 64, 1000, 1024},
                       {1, 257, 1000, 1024}, {1, 1024, 1000, 1024}, {3, 7, 1000, 1000},
                       {1, 64, 37, 128}};

TEST_P(ClassifierTest, PaddedVocabularyAndSixteenBitLogitsMatchFloat64) {
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Case& c : kCases) {
      const int64_t N = c.B * c.T, V = c.V, Vp = c.Vp;
      ASSERT_EQ(c.Vp == c.V ? c.V : ops::padded_vocab(c.V), c.Vp);
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " B=" << c.B << " T=" << c.T << " V=" << V
                                        << " Vp=" << Vp);
      // fp16 has no range for gradients of 1/N (they would flush to zero): the trainer gives it
      // a loss scale, as here.
      const float dloss = dtype == DType::kF16 ? 1.0f : 1.0f / static_cast<float>(N);
      FVec x = rng_.normal(N * Vp, 3.0f);
      // Padding holds NaN: an op that let a padded column into the max or the sums would fail.
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = V; j < Vp; ++j) x[r * Vp + j] = std::numeric_limits<float>::quiet_NaN();
      IVec targets = rng_.ints(N, 0, static_cast<int32_t>(V));
      if (N > 2) targets[1] = -1;  // ignored row
      targets[N - 1] = static_cast<int32_t>(V - 1);  // the last real column
      const HostLogits h = make_logits(dtype, x);

      // The reference sees the real columns only (the values the op reads).
      DVec real(static_cast<size_t>(N * V)), r_loss(N), r_dlogits(N * V);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < V; ++j) real[r * V + j] = h.values[r * Vp + j];
      ref::classifier_ref(r_loss, r_dlogits, real, targets, N, V, dloss);

      DevTensor tl = empty({N, Vp}, dtype), ttargets = tensor(targets, {N});
      auto upload = [&] {
        if (dtype == DType::kF32)
          tl.upload(h.f32);
        else
          tl.upload(h.bits16);
      };
      const ops::VocabRange vocab{0, V};
      // Forward only: losses, logits untouched (padding included).
      upload();
      DevTensor losses = poisoned({N});
      ops::classifier_forward_backward(s(), tl, losses, ttargets, dloss, /*compute_grad=*/false, nullptr, vocab);
      EXPECT_TRUE(close(losses.f(), r_loss, kTolReduce));
      if (dtype == DType::kF32)
        EXPECT_TRUE(bitwise_equal(tl.download<float>(), h.f32));
      else
        EXPECT_TRUE(bitwise_equal(tl.download<uint16_t>(), h.bits16));

      // Forward and gradient: the same losses, dlogits in the logits' dtype, padding exactly +0.
      DevTensor losses2 = poisoned({N});
      ops::classifier_forward_backward(s(), tl, losses2, ttargets, dloss, /*compute_grad=*/true, nullptr, vocab);
      EXPECT_TRUE(bitwise_equal(losses2.f(), losses.f()));
      FVec got(static_cast<size_t>(N * V));
      int64_t padding_not_zero = 0;
      if (dtype == DType::kF32) {
        const FVec d = tl.download<float>();
        for (int64_t r = 0; r < N; ++r) {
          for (int64_t j = 0; j < V; ++j) got[r * V + j] = d[r * Vp + j];
          for (int64_t j = V; j < Vp; ++j) padding_not_zero += float_as_bits(d[r * Vp + j]) != 0;
        }
      } else {
        const std::vector<uint16_t> d = tl.download<uint16_t>();
        for (int64_t r = 0; r < N; ++r) {
          for (int64_t j = 0; j < V; ++j) got[r * V + j] = from_bits(dtype, d[r * Vp + j]);
          for (int64_t j = V; j < Vp; ++j) padding_not_zero += d[r * Vp + j] != 0;
        }
      }
      EXPECT_EQ(padding_not_zero, 0);
      EXPECT_TRUE(close(got, r_dlogits, grad_tol(dtype)));
    }
  }
}

// A 16-bit classifier reads the same values an fp32 one reads after the rounding: its losses are
// those of the fp32 op on the widened logits (both compute in fp32), to reduction tolerance.
TEST_P(ClassifierTest, SixteenBitLossesEqualFp32OnTheRoundedLogits) {
  const int64_t N = 33, V = 515, Vp = ops::padded_vocab(V);
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const HostLogits h = make_logits(dtype, rng_.normal(N * Vp, 2.0f));
    const IVec targets = rng_.ints(N, 0, static_cast<int32_t>(V));
    FVec widened(h.values.begin(), h.values.end());
    DevTensor t16 = empty({N, Vp}, dtype), t32 = tensor(widened, {N, Vp}), ttargets = tensor(targets, {N});
    t16.upload(h.bits16);
    DevTensor l16 = poisoned({N}), l32 = poisoned({N});
    ops::classifier_forward_backward(s(), t16, l16, ttargets, 1.0f, false, nullptr, {0, V});
    ops::classifier_forward_backward(s(), t32, l32, ttargets, 1.0f, false, nullptr, {0, V});
    EXPECT_TRUE(close(l16.f(), to_d(l32.f()), kTolReduce));
  }
}

// The 16-bit kernel has the rounding points of widening the logits (exactly) to fp32, running the
// fp32 kernel and rounding dlogits back once. The CPU kernel widens each row the same way, so there
// the two agree bit for bit; the CUDA kernel's pack width differs by dtype (another summation
// order), so there they agree to the tolerances above.
TEST_P(ClassifierTest, SixteenBitKernelMatchesWideningToFp32) {
  const int64_t N = 19, V = 1000, Vp = ops::padded_vocab(V);
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const HostLogits h = make_logits(dtype, rng_.normal(N * Vp, 3.0f));
    IVec targets = rng_.ints(N, 0, static_cast<int32_t>(V));
    targets[4] = -1;
    DevTensor ttargets = tensor(targets, {N});
    DevTensor kernel = empty({N, Vp}, dtype), kernel_losses = poisoned({N});
    kernel.upload(h.bits16);
    ops::classifier_forward_backward(s(), kernel, kernel_losses, ttargets, 1.0f, true, nullptr, {0, V});
    DevTensor fallback = empty({N, Vp}, dtype), wide = poisoned({N, Vp}), fallback_losses = poisoned({N});
    fallback.upload(h.bits16);
    ops::cast(s(), wide, fallback);
    ops::classifier_forward_backward(s(), wide, fallback_losses, ttargets, 1.0f, true, nullptr, {0, V});
    ops::cast(s(), fallback, wide);
    sync();
    const std::vector<uint16_t> a = kernel.download<uint16_t>(), b = fallback.download<uint16_t>();
    if (GetParam() == Backend::kCpu) {
      EXPECT_TRUE(bitwise_equal(fallback_losses.f(), kernel_losses.f()));
      EXPECT_TRUE(bitwise_equal(b, a));
    } else {
      EXPECT_TRUE(close(fallback_losses.f(), to_d(kernel_losses.f()), kTolReduce));
      FVec fa(a.size()), fb(b.size());
      for (size_t i = 0; i < a.size(); ++i) fa[i] = from_bits(dtype, a[i]), fb[i] = from_bits(dtype, b[i]);
      EXPECT_TRUE(close(fb, to_d(fa), grad_tol(dtype)));
    }
  }
}

TEST_P(ClassifierTest, RefusesBadVocabularyRanges) {
  DevTensor tl = tensor(rng_.normal(2 * 8), {2, 8}), losses = poisoned({2}), targets = tensor(IVec{0, 1}, {2});
  auto message = [&](ops::VocabRange v) {
    try {
      ops::classifier_forward_backward(s(), tl, losses, targets, 1.0f, false, nullptr, v);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_THAT(message({0, 9}), HasSubstr("must start at 0 and fit in the 8 columns"));
  EXPECT_THAT(message({2, 6}), HasSubstr("shards use row_max"));
  DevTensor ints = tensor(IVec(16, 0), {2, 8});
  EXPECT_THROW(ops::classifier_forward_backward(s(), ints, losses, targets, 1.0f, false), Error);
}

// ---- LM head over padded logits rows -------------------------------------------------------------

// Forward writes the V real columns and leaves the padding alone; backward reads only the real
// columns (NaN padding would spread into both gradients otherwise). With Vp == V the op is
// matmul_forward/backward bit for bit on the CPU backend; on CUDA these are two cuBLAS call shapes,
// each held to the derived bound of float64 instead (tests/README.md).
TEST_P(ClassifierTest, LmHeadWritesAndReadsOnlyTheRealColumns) {
  const int64_t N = 37, C = 24, V = 300, Vp = ops::padded_vocab(V);
  const FVec in = rng_.normal(N * C), wte = rng_.normal(V * C, 0.2f), din0 = rng_.normal(N * C),
             dwte0 = rng_.normal(V * C);
  FVec dl = rng_.normal(N * Vp, 0.1f);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = V; j < Vp; ++j) dl[r * Vp + j] = std::numeric_limits<float>::quiet_NaN();
  DevTensor tin = tensor(in, {N, C}), twte = tensor(wte, {V, C});

  DevTensor logits = poisoned({N, Vp});
  ops::lm_head_forward(s(), logits, tin, twte);
  DVec r_logits(N * V);
  ref::matmul_forward_ref(r_logits, to_d(in), to_d(wte), {}, N, C, V);
  const FVec got = logits.f();
  FVec real(static_cast<size_t>(N * V));
  int64_t padding_written = 0;
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t j = 0; j < V; ++j) real[r * V + j] = got[r * Vp + j];
    for (int64_t j = V; j < Vp; ++j) padding_written += !std::isnan(got[r * Vp + j]);
  }
  EXPECT_TRUE(close(real, r_logits, kTolReduce));
  EXPECT_EQ(padding_written, 0);

  DevTensor din = tensor(din0, {N, C}), dwte = tensor(dwte0, {V, C}), tdl = tensor(dl, {N, Vp});
  ops::lm_head_backward(s(), din, dwte, tdl, tin, twte);
  DVec dl_real(N * V);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < V; ++j) dl_real[r * V + j] = dl[r * Vp + j];
  DVec r_din = to_d(din0), r_dwte = to_d(dwte0);
  ref::matmul_backward_ref(r_din, r_dwte, {}, dl_real, to_d(in), to_d(wte), N, C, V);
  EXPECT_TRUE(close(din.f(), r_din, kTolReduce));
  EXPECT_TRUE(close(dwte.f(), r_dwte, kTolReduce));

  // Vp == V: matmul's bits.
  DevTensor a = poisoned({N, V}), b = poisoned({N, V});
  ops::lm_head_forward(s(), a, tin, twte);
  ops::matmul_forward(s(), b, tin, twte, ConstTensorView{});
  const bool own_kernels = GetParam() == Backend::kCpu;
  if (own_kernels) {
    EXPECT_TRUE(bitwise_equal(a.f(), b.f()));
  }
  const DVec logits_bound = tolerance::matmul_forward_bound(DType::kF32, to_d(in), to_d(wte), {}, N, C, V);
  EXPECT_TRUE(tolerance::within(a.f(), r_logits, logits_bound)) << "lm_head_forward";
  EXPECT_TRUE(tolerance::within(b.f(), r_logits, logits_bound)) << "matmul_forward";
  const FVec g = rng_.normal(N * V, 0.1f);
  DevTensor tg = tensor(g, {N, V});
  DevTensor din_a = tensor(din0, {N, C}), dwte_a = tensor(dwte0, {V, C});
  DevTensor din_b = tensor(din0, {N, C}), dwte_b = tensor(dwte0, {V, C});
  ops::lm_head_backward(s(), din_a, dwte_a, tg, tin, twte);
  ops::matmul_backward(s(), din_b, dwte_b, TensorView{}, tg, tin, twte);
  if (own_kernels) {
    EXPECT_TRUE(bitwise_equal(din_a.f(), din_b.f()));
  }
  if (own_kernels) {
    EXPECT_TRUE(bitwise_equal(dwte_a.f(), dwte_b.f()));
  }
  DVec r_din_g = to_d(din0), r_dwte_g = to_d(dwte0);
  ref::matmul_backward_ref(r_din_g, r_dwte_g, {}, to_d(g), to_d(in), to_d(wte), N, C, V);
  const tolerance::MatmulBackwardBounds gb =
      tolerance::matmul_backward_bounds(DType::kF32, to_d(g), to_d(in), to_d(wte), to_d(din0), to_d(dwte0), {}, N, C, V);
  for (const auto& [name, din_x, dwte_x] : {std::tuple<const char*, DevTensor*, DevTensor*>{"lm_head", &din_a, &dwte_a},
                                            {"matmul", &din_b, &dwte_b}}) {
    EXPECT_TRUE(tolerance::within(din_x->f(), r_din_g, gb.din)) << name << " din";
    EXPECT_TRUE(tolerance::within(dwte_x->f(), r_dwte_g, gb.dweight)) << name << " dwte";
  }
}

// A backend without the LM head entries: unpadded rows fall back to matmul (on the CPU backend the
// same bits; on CUDA lm_head_forward and matmul_forward are two cuBLAS call shapes, each held to
// the derived bound of float64 instead), padded ones are refused with one sentence naming the op.
TEST_P(ClassifierTest, LmHeadFallsBackToMatmulOrRefuses) {
  OpTable table = *op_table(GetParam());
  table.lm_head_forward = nullptr;
  table.lm_head_backward = nullptr;
  const int64_t N = 5, C = 8, V = 20;
  const FVec in = rng_.normal(N * C), wte = rng_.normal(V * C);
  DevTensor tin = tensor(in, {N, C}), twte = tensor(wte, {V, C});
  DevTensor want = poisoned({N, V});
  ops::lm_head_forward(s(), want, tin, twte);
  sync();
  const ScopedOpTable scoped(GetParam(), &table);
  DevTensor got = poisoned({N, V});
  ops::lm_head_forward(s(), got, tin, twte);
  if (GetParam() == Backend::kCpu) {
    EXPECT_TRUE(bitwise_equal(got.f(), want.f()));
  }
  DVec r_logits(static_cast<size_t>(N * V));
  ref::matmul_forward_ref(r_logits, to_d(in), to_d(wte), {}, N, C, V);
  const DVec bound = tolerance::matmul_forward_bound(DType::kF32, to_d(in), to_d(wte), {}, N, C, V);
  EXPECT_TRUE(tolerance::within(want.f(), r_logits, bound)) << "lm_head_forward";
  EXPECT_TRUE(tolerance::within(got.f(), r_logits, bound)) << "matmul_forward (the fallback)";
  DevTensor padded = poisoned({N, ops::padded_vocab(V)});
  try {
    ops::lm_head_forward(s(), padded, tin, twte);
    FAIL() << "padded rows without a kernel";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("lm_head_forward"));
    EXPECT_THAT(e.message(), HasSubstr("no fallback applies"));
  }
  sync();
}

INSTANTIATE_TEST_SUITE_P(Backends, ClassifierTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace zt
