// The fixed-order backward kernels of issue #28 on every backend (CUDA instances skip without a
// GPU): the embedding backward (dwte bucketed by token id, dwpe over the batch) equals the
// sequential fp32 loop bit for bit and float64 within the loop's derived error bound, at repeated,
// uniform and distinct token ids, T = 1, a prime T, tiny and padded-size vocabularies, a vocabulary
// shard and 16-bit dout; layernorm_backward's dweight/dbias equal kernels/layernorm_order.h's fp32
// order (emulated here from its description), din its float64 reference and, in fp32, its
// composition (din from zero, then the residual gradient added); and both give the same bits run to
// run and for 1 or 3 CPU threads. Accumulated outputs start from random values and are compared
// bitwise, so an element a kernel fails to write (or writes twice) differs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/layernorm_order.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "op_test_util.h"

namespace zt {
namespace {

using namespace op_test;  // NOLINT(build/namespaces): the helpers shared by the op test binaries

constexpr double kU = 0x1p-24;  // fp32 unit roundoff

// Dout of a dtype: the fp32 values the kernel reads (16 bits: the rounded values, widened) and the
// device tensor holding them.
struct Dout {
  FVec widened;
  DevTensor tensor;
};

class BackwardOrderTest : public OpsFixture {
 protected:
  Dout make_dout(DType t, Shape shape) {
    const FVec v = rng_.normal(shape.numel());
    DevTensor d(*dev_, s(), t, shape);
    if (t == DType::kF32) {
      d.upload(v);
      return {v, std::move(d)};
    }
    const Host16 h{t};
    const std::vector<uint16_t> bits = h.round(v);
    d.upload(bits);
    return {h.widen(bits), std::move(d)};
  }
};

// ---- embedding backward ------------------------------------------------------------------------
enum class Ids { kRandom, kOne, kDistinct };
struct EmbCase {
  int64_t B, T, C, V, maxT;
  Ids ids;
  ops::VocabRange vocab;
};
const EmbCase kEmbCases[] = {
    {1, 1, 1, 1, 1, Ids::kRandom, {}},            // one position, one id
    {4, 1, 5, 3, 2, Ids::kRandom, {}},            // T = 1
    {3, 131, 24, 7, 131, Ids::kRandom, {}},       // a prime T, few ids: many duplicates
    {2, 97, 33, 50, 100, Ids::kOne, {}},          // one id everywhere: one bucket of every position
    {2, 64, 40, 128, 64, Ids::kDistinct, {}},     // every id once
    {4, 64, 768, 301, 64, Ids::kRandom, {}},      // GPT-2's width (128-bit paths)
    {1, 24, 1600, 37, 32, Ids::kRandom, {}},      // GPT-2 XL's width: several blocks of channels per bucket
    {2, 37, 8, 50304, 40, Ids::kRandom, {}},      // the padded GPT-2 vocabulary: V from the shape
    {3, 29, 13, 9, 32, Ids::kRandom, {4, 20}},    // a vocabulary shard: other ids add nothing to dwte
};

IVec make_ids(Rng& rng, const EmbCase& c) {
  const int64_t BT = c.B * c.T;
  const int32_t total = static_cast<int32_t>(c.vocab.total > 0 ? c.vocab.total : c.V);
  switch (c.ids) {
    case Ids::kOne:
      return IVec(static_cast<size_t>(BT), total / 3);
    case Ids::kDistinct: {
      // A permutation of [0, BT) (BT <= V): no id repeats.
      IVec ids(static_cast<size_t>(BT));
      std::iota(ids.begin(), ids.end(), 0);
      const IVec r = rng.ints(BT, 0, std::numeric_limits<int32_t>::max());
      for (int64_t i = BT - 1; i > 0; --i) std::swap(ids[i], ids[r[i] % (i + 1)]);
      return ids;
    }
    case Ids::kRandom:
      break;
  }
  return rng.ints(BT, 0, total);
}

TEST_P(BackwardOrderTest, EmbeddingBackwardIsTheSequentialLoopAndFloat64) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const EmbCase& c : kEmbCases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " B=" << c.B << " T=" << c.T << " C=" << c.C
                                        << " V=" << c.V << " vocab [" << c.vocab.begin << ", " << c.vocab.total
                                        << ")");
      const int64_t BT = c.B * c.T, C = c.C;
      const IVec ids = make_ids(rng_, c);
      const Dout dout = make_dout(t, {c.B, c.T, C});
      const FVec dwte0 = rng_.normal(c.V * C), dwpe0 = rng_.normal(c.maxT * C);
      DevTensor tids = tensor(ids, {c.B, c.T}), dwte = tensor(dwte0, {c.V, C}), dwpe = tensor(dwpe0, {c.maxT, C});
      ops::encoder_backward(s(), dwte, dwpe, dout.tensor, tids, c.vocab);

      // The specification: fp32 additions in position order onto the old value; the float64 sum
      // and, per element, the bound gamma_n * (|start| + sum |terms|) of n sequential additions.
      FVec want_wte = dwte0, want_wpe = dwpe0;
      DVec r_wte = to_d(dwte0), r_wpe = to_d(dwpe0), abs_wte(r_wte.size()), abs_wpe(r_wpe.size());
      std::vector<int64_t> n_wte(r_wte.size(), 0), n_wpe(r_wpe.size(), 0);
      for (size_t i = 0; i < abs_wte.size(); ++i) abs_wte[i] = std::fabs(r_wte[i]);
      for (size_t i = 0; i < abs_wpe.size(); ++i) abs_wpe[i] = std::fabs(r_wpe[i]);
      for (int64_t r = 0; r < BT; ++r) {
        const int64_t v = ids[r] - c.vocab.begin;
        for (int64_t k = 0; k < C; ++k) {
          const float d = dout.widened[r * C + k];
          if (v >= 0 && v < c.V) {
            const size_t e = static_cast<size_t>(v * C + k);
            want_wte[e] += d;
            r_wte[e] += d;
            abs_wte[e] += std::fabs(d);
            ++n_wte[e];
          }
          const size_t p = static_cast<size_t>((r % c.T) * C + k);
          want_wpe[p] += d;
          r_wpe[p] += d;
          abs_wpe[p] += std::fabs(d);
          ++n_wpe[p];
        }
      }
      const FVec got_wte = dwte.f(), got_wpe = dwpe.f();
      EXPECT_TRUE(bitwise_equal(got_wte, want_wte));
      EXPECT_TRUE(bitwise_equal(got_wpe, want_wpe));
      auto within = [](const FVec& got, const DVec& ref, const DVec& abs, const std::vector<int64_t>& n) {
        for (size_t i = 0; i < got.size(); ++i) {
          const double nu = static_cast<double>(n[i]) * kU;
          const double bound = nu / (1 - nu) * abs[i];
          if (!(std::fabs(got[i] - ref[i]) <= bound))
            return ::testing::AssertionFailure() << "[" << i << "] got " << got[i] << " want " << ref[i] << " ("
                                                 << n[i] << " additions, bound " << bound << ")";
        }
        return ::testing::AssertionSuccess();
      };
      EXPECT_TRUE(within(got_wte, r_wte, abs_wte, n_wte));
      EXPECT_TRUE(within(got_wpe, r_wpe, abs_wpe, n_wpe));

      // Run to run, and without dwpe (dwte alone: the same bits).
      DevTensor dwte2 = tensor(dwte0, {c.V, C}), dwpe2 = tensor(dwpe0, {c.maxT, C});
      ops::encoder_backward(s(), dwte2, dwpe2, dout.tensor, tids, c.vocab);
      EXPECT_TRUE(bitwise_equal(dwte2.f(), got_wte));
      EXPECT_TRUE(bitwise_equal(dwpe2.f(), got_wpe));
      DevTensor dwte3 = tensor(dwte0, {c.V, C});
      ops::encoder_backward(s(), dwte3, TensorView{}, dout.tensor, tids, c.vocab);
      EXPECT_TRUE(bitwise_equal(dwte3.f(), got_wte));
    }
  }
}

// ---- layernorm backward ------------------------------------------------------------------------
// dweight/dbias in kernels/layernorm_order.h's order, from the description there (not from either
// kernel): fp32, each product norm * dout rounded before it is added.
void emulate_layernorm_param_grads(FVec& dweight, FVec& dbias, const FVec& dout, const FVec& in, const FVec& mean,
                                   const FVec& rstd, int64_t N, int64_t C) {
  const detail::LayernormBackwardOrder o = detail::layernorm_backward_order(N, C);
  constexpr int kStripes = detail::LayernormBackwardOrder::kStripes;
  std::vector<FVec> partial(static_cast<size_t>(o.blocks), FVec(2 * C));
  for (int64_t b = 0; b < o.blocks; ++b) {
    std::vector<FVec> warp(static_cast<size_t>(o.warps), FVec(2 * C, 0.0f));
    const int64_t r0 = b * o.rows_per_block, r1 = std::min(N, r0 + o.rows_per_block);
    for (int w = 0; w < o.warps; ++w)
      for (int64_t r = r0 + w; r < r1; r += o.warps)
        for (int64_t c = 0; c < C; ++c) {
          const float dy = dout[r * C + c];
          const float norm = (in[r * C + c] - mean[r]) * rstd[r];
          const float term = norm * dy;  // rounded here: tests/CMakeLists.txt builds this file without FMA contraction
          warp[w][c] += term;
          warp[w][C + c] += dy;
        }
    partial[b] = warp[0];
    for (int w = 1; w < o.warps; ++w)
      for (int64_t i = 0; i < 2 * C; ++i) partial[b][i] += warp[w][i];
  }
  for (int64_t i = 0; i < 2 * C; ++i) {
    float total;
    if (o.blocks == 1) {
      total = partial[0][i];
    } else {
      float stripe[kStripes];
      for (int st = 0; st < kStripes; ++st) {
        stripe[st] = 0.0f;
        for (int64_t k = st; k < o.blocks; k += kStripes) stripe[st] += partial[k][i];
      }
      for (int h = kStripes / 2; h > 0; h /= 2)
        for (int st = 0; st < h; ++st) stripe[st] += stripe[st + h];
      total = stripe[0];
    }
    (i < C ? dweight[i] : dbias[i - C]) += total;
  }
}

struct LnCase {
  int64_t N, C;
};
// One block (few rows), many blocks with a partial last stripe, a prime N, GPT-2's C, odd C (the
// short last 128-bit chunk), GPT-2 large's and XL's widths (1280, 1600: 4 and 3 warps of shared
// sums, rows too long for the CUDA kernels' register caches) and a C whose sums exceed shared
// memory (one warp per block, the sums in global memory).
const LnCase kLnCases[] = {{1, 1},     {7, 5},     {257, 33},  {1031, 129}, {300, 768},
                           {33, 1280}, {67, 1600}, {20000, 3}, {5, 6200}};

TEST_P(BackwardOrderTest, LayernormBackwardFollowsTheOrderAndFloat64) {
  const float eps = 1e-5f;
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (const LnCase& c : kLnCases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " N=" << c.N << " C=" << c.C);
      const int64_t N = c.N, C = c.C;
      const Dout in = make_dout(t, {N, C}), dout = make_dout(t, {N, C});
      const FVec w = rng_.normal(C), b = rng_.normal(C);
      DevTensor tw = tensor(w, {C}), tb = tensor(b, {C});
      DevTensor out(*dev_, s(), t, {N, C}), mean = poisoned({N}), rstd = poisoned({N});
      ops::layernorm_forward(s(), out, mean, rstd, in.tensor, tw, tb, eps);
      const FVec fmean = mean.f(), frstd = rstd.f();

      const FVec dw0 = rng_.normal(C), db0 = rng_.normal(C);
      DevTensor dw = tensor(dw0, {C}), db = tensor(db0, {C});
      const Dout din0 = make_dout(t, {N, C});  // the residual gradient din accumulates onto
      DevTensor din(*dev_, s(), t, {N, C});
      // din starts as the residual gradient (its stored bits).
      if (t == DType::kF32) {
        din.upload(din0.widened);
      } else {
        din.upload(Host16{t}.round(din0.widened));
      }
      ops::layernorm_backward(s(), din, dw, db, dout.tensor, in.tensor, tw, mean, rstd);

      FVec want_dw = dw0, want_db = db0;
      emulate_layernorm_param_grads(want_dw, want_db, dout.widened, in.widened, fmean, frstd, N, C);
      const FVec got_dw = dw.f(), got_db = db.f();
      EXPECT_TRUE(bitwise_equal(got_dw, want_dw));
      EXPECT_TRUE(bitwise_equal(got_db, want_db));

      // float64, with the op's own fp32 statistics (as the kernels normalise).
      DVec r_din = to_d(din0.widened), r_dw = to_d(dw0), r_db = to_d(db0);
      ref::layernorm_backward_ref(r_din, r_dw, r_db, to_d(dout.widened), to_d(in.widened), to_d(w), to_d(fmean),
                                  to_d(frstd), N, C);
      EXPECT_TRUE(close(got_dw, r_dw, kTolReduce));
      EXPECT_TRUE(close(got_db, r_db, kTolReduce));
      const FVec got_din = t == DType::kF32 ? din.f() : Host16{t}.widen(din.download<uint16_t>());
      if (t == DType::kF32) {
        EXPECT_TRUE(close(got_din, r_din, kTolReduce));
      } else {
        EXPECT_TRUE(Host16{t}.close(got_din, r_din));
      }

      // Run to run: the same bits.
      DevTensor dw2 = tensor(dw0, {C}), db2 = tensor(db0, {C}), din2(*dev_, s(), t, {N, C});
      if (t == DType::kF32) {
        din2.upload(din0.widened);
      } else {
        din2.upload(Host16{t}.round(din0.widened));
      }
      ops::layernorm_backward(s(), din2, dw2, db2, dout.tensor, in.tensor, tw, mean, rstd);
      EXPECT_TRUE(bitwise_equal(dw2.f(), got_dw));
      EXPECT_TRUE(bitwise_equal(db2.f(), got_db));
      if (t == DType::kF32) {
        EXPECT_TRUE(bitwise_equal(din2.f(), got_din));
        // The composition: din from zero, then the residual gradient added (one fp32 addition
        // either way: the same bits); the parameter gradients do not depend on din.
        DevTensor din3 = tensor(FVec(N * C, 0.0f), {N, C}), dw3 = tensor(dw0, {C}), db3 = tensor(db0, {C});
        ops::layernorm_backward(s(), din3, dw3, db3, dout.tensor, in.tensor, tw, mean, rstd);
        DevTensor res = tensor(din0.widened, {N, C}), sum = poisoned({N, C});
        ops::add(s(), sum, res, din3);
        EXPECT_TRUE(bitwise_equal(sum.f(), got_din));
        EXPECT_TRUE(bitwise_equal(dw3.f(), got_dw));
        EXPECT_TRUE(bitwise_equal(db3.f(), got_db));
      } else {
        EXPECT_TRUE(bitwise_equal(din2.download<uint16_t>(), din.download<uint16_t>()));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, BackwardOrderTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(backend_name(info.param));
                         });

// ---- thread counts ----------------------------------------------------------------------------
// Both ops on the CPU backend with heavy id repetition and many row blocks; the bytes of their
// outputs.
std::vector<uint8_t> backward_order_outputs() {
  auto rt = Runtime::create_cpu(1);
  Device& dev = rt->device(0);
  Stream& s = dev.compute();
  Rng rng(test_seed());
  auto tensor = [&](const FVec& v, Shape shape) {
    DevTensor t(dev, s, DType::kF32, shape);
    t.upload(v);
    return t;
  };
  std::vector<uint8_t> bytes;
  auto append = [&](const DevTensor& t) {
    const FVec v = t.f();
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    bytes.insert(bytes.end(), p, p + v.size() * sizeof(float));
  };
  {
    const int64_t B = 4, T = 97, C = 136, V = 11;
    DevTensor ids(dev, s, DType::kI32, {B, T});
    ids.upload(rng.ints(B * T, 0, V));
    DevTensor dout = tensor(rng.normal(B * T * C), {B, T, C}), dwte = tensor(rng.normal(V * C), {V, C}),
              dwpe = tensor(rng.normal(T * C), {T, C});
    ops::encoder_backward(s, dwte, dwpe, dout, ids);
    append(dwte);
    append(dwpe);
  }
  {
    const int64_t N = 3001, C = 96;
    DevTensor in = tensor(rng.normal(N * C, 2.0f, 1.0f), {N, C}), w = tensor(rng.normal(C), {C}),
              b = tensor(rng.normal(C), {C}), out = tensor(FVec(N * C), {N, C}), mean = tensor(FVec(N), {N}),
              rstd = tensor(FVec(N), {N});
    ops::layernorm_forward(s, out, mean, rstd, in, w, b, 1e-5f);
    DevTensor dout = tensor(rng.normal(N * C), {N, C}), din = tensor(rng.normal(N * C), {N, C}),
              dw = tensor(rng.normal(C), {C}), db = tensor(rng.normal(C), {C});
    ops::layernorm_backward(s, din, dw, db, dout, in, w, mean, rstd);
    for (const DevTensor* t : {&din, &dw, &db}) append(*t);
  }
  return bytes;
}

// The child half of SameBitsForAnyThreadCount (skips unless that test started it).
TEST(BackwardOrderDeterminism, ChildWritesOutputs) {
  const char* path = std::getenv("ZT_DETERMINISM_OUT");
  if (path == nullptr) GTEST_SKIP() << "runs as a child of BackwardOrderDeterminism.SameBitsForAnyThreadCount";
  const std::vector<uint8_t> bytes = backward_order_outputs();
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good());
}

TEST(BackwardOrderDeterminism, SameBitsForAnyThreadCount) {
  const std::vector<uint8_t> want = backward_order_outputs();
  ASSERT_GT(want.size(), 0u);
  for (int threads : {1, 3})
    EXPECT_TRUE(bitwise_equal(outputs_of_child(threads, "BackwardOrderDeterminism.ChildWritesOutputs"), want))
        << threads << " threads";
}

}  // namespace
}  // namespace zt
