// The ops tensor (model) parallelism uses on each tensor rank (kernels/ops.h): the encoder over a
// vocabulary shard, position and bias ops, and the vocabulary-parallel cross-entropy chain, on every
// backend against float64 references and against the single-device ops they split (classifier,
// encoder, matmul_backward's dbias), in fp32 and over bf16/fp16 activations and logits; plus
// thread-count independence and argument validation.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/elementwise.h"
#include "kernels/ops.h"
#include "kernels/ref/ops_ref.h"
#include "op_test_util.h"
#include "runtime/device.h"

namespace zt {
namespace {

using namespace op_test;  // NOLINT(build/namespaces): the helpers shared by the op test binaries

// Column (vocabulary) ranges of `shards` near-equal shards of [0, V): the first V % shards get one
// more, as a padded vocabulary would not; ranks must not rely on equal shards.
std::vector<std::pair<int64_t, int64_t>> split(int64_t V, int64_t shards) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t begin = 0;
  for (int64_t k = 0; k < shards; ++k) {
    const int64_t len = V / shards + (k < V % shards ? 1 : 0);
    out.emplace_back(begin, begin + len);
    begin += len;
  }
  return out;
}

// Columns [c0, c1) of a row-major [N, V] matrix.
template <typename T>
std::vector<T> columns(const std::vector<T>& m, int64_t N, int64_t V, int64_t c0, int64_t c1) {
  std::vector<T> out;
  out.reserve(static_cast<size_t>(N * (c1 - c0)));
  for (int64_t r = 0; r < N; ++r)
    out.insert(out.end(), m.begin() + r * V + c0, m.begin() + r * V + c1);
  return out;
}

// |got - want| <= rtol |want| + atol per element (NaN fails).
::testing::AssertionResult within(const FVec& got, const FVec& want, double rtol, double atol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  size_t bad = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double{got[i]} - want[i]);
    if (!(err <= rtol * std::fabs(want[i]) + atol)) {
      if (bad < 5) msg << "\n  [" << i << "] got " << got[i] << " want " << want[i];
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ by more than "
                                       << rtol << " relative + " << atol << msg.str();
}

class TpOpsTest : public OpsFixture {
 protected:
  // A view of n fp32 elements starting `offset` elements into t (the caller's split of a gathered
  // buffer into halves).
  ConstTensorView slice(const DevTensor& t, int64_t offset, int64_t n) {
    return ConstTensorView(static_cast<const float*>(t.view().data) + offset, DType::kF32, Shape{n},
                           dev_->index());
  }
  // A tensor of 16-bit values (bits as Host16 rounds them) of dtype t.
  DevTensor tensor16(DType t, const std::vector<uint16_t>& host, Shape shape) {
    DevTensor d(*dev_, s(), t, shape);
    d.upload(host);
    return d;
  }
};

// wte[tokens[r]] for every row r (the encoder without position term), on the host.
FVec wte_rows(const FVec& wte, const IVec& tokens, int64_t C) {
  FVec out;
  for (int32_t t : tokens) out.insert(out.end(), wte.begin() + t * C, wte.begin() + (t + 1) * C);
  return out;
}

// ---- encoder over vocabulary shards ---------------------------------------------------------------

struct EncoderCase {
  int64_t B, T, C, V, maxT;
};
const EncoderCase kEncoderCases[] = {{1, 1, 1, 4, 1}, {2, 7, 13, 17, 8}, {3, 64, 127, 5, 64}, {4, 33, 200, 1000, 40}};

// Only one shard holds a token, so the shards' outputs (the position term on shard 0 only) sum to the
// whole table's output exactly; their gradients are the whole table's rows, bit for bit.
TEST_P(TpOpsTest, EncoderShardsAddUpToTheWholeTable) {
  for (const EncoderCase& c : kEncoderCases) {
    IVec tokens = rng_.ints(c.B * c.T, 0, static_cast<int32_t>(c.V));
    tokens[0] = static_cast<int32_t>(c.V - 1);
    const FVec wte = rng_.normal(c.V * c.C), wpe = rng_.normal(c.maxT * c.C);
    const FVec dout = rng_.normal(c.B * c.T * c.C);
    const FVec dwte0 = rng_.normal(c.V * c.C), dwpe0 = rng_.normal(c.maxT * c.C);
    const Shape out_shape{c.B, c.T, c.C};
    DevTensor ttok = tensor(tokens, {c.B, c.T}), twte = tensor(wte, {c.V, c.C}), twpe = tensor(wpe, {c.maxT, c.C});
    DevTensor full = poisoned(out_shape);
    ops::encoder_forward(s(), full, ttok, twte, twpe);
    DevTensor explicit_total = poisoned(out_shape);
    ops::encoder_forward(s(), explicit_total, ttok, twte, twpe, ops::VocabRange{0, c.V});
    EXPECT_TRUE(bitwise_equal(explicit_total.f(), full.f()));
    DevTensor tdout = tensor(dout, out_shape), full_dwte = tensor(dwte0, {c.V, c.C}),
              full_dwpe = tensor(dwpe0, {c.maxT, c.C});
    ops::encoder_backward(s(), full_dwte, full_dwpe, tdout, ttok);
    const FVec want_dwte = full_dwte.f();

    for (int64_t shards : {1, 2, 4}) {
      if (shards > c.V) continue;
      SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " C=" << c.C << " V=" << c.V
                                        << " shards=" << shards);
      FVec sum(static_cast<size_t>(out_shape.numel()), 0.0f);
      FVec dwte_parts;
      for (const auto& [v0, v1] : split(c.V, shards)) {
        const int64_t Vl = v1 - v0;
        const bool first = v0 == 0;
        const ops::VocabRange vocab{v0, c.V};
        const FVec wte_k(wte.begin() + v0 * c.C, wte.begin() + v1 * c.C);
        DevTensor twte_k = tensor(wte_k, {Vl, c.C}), out = poisoned(out_shape);
        ops::encoder_forward(s(), out, ttok, twte_k, first ? ConstTensorView(twpe) : ConstTensorView{}, vocab);
        const FVec got = out.f();
        DVec ref(static_cast<size_t>(out_shape.numel()));
        ref::encoder_forward_ref(ref, tokens, to_d(wte_k), first ? to_d(wpe) : DVec{}, c.B, c.T, c.C, v0);
        EXPECT_TRUE(close(got, ref, kTolElem)) << "shard at " << v0;
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += got[i];

        DevTensor dwte_k = tensor(FVec(dwte0.begin() + v0 * c.C, dwte0.begin() + v1 * c.C), {Vl, c.C});
        DevTensor dwpe_k = tensor(dwpe0, {c.maxT, c.C});
        ops::encoder_backward(s(), dwte_k, first ? TensorView(dwpe_k) : TensorView{}, tdout, ttok, vocab);
        const FVec part = dwte_k.f();
        dwte_parts.insert(dwte_parts.end(), part.begin(), part.end());
        DVec ref_dwte = to_d(FVec(dwte0.begin() + v0 * c.C, dwte0.begin() + v1 * c.C));
        ref::encoder_backward_ref(ref_dwte, ref::DSpan{}, to_d(dout), tokens, c.B, c.T, c.C, v0);
        EXPECT_TRUE(close(part, ref_dwte, kTolReduce)) << "shard at " << v0;
        if (first) {
          EXPECT_TRUE(bitwise_equal(dwpe_k.f(), full_dwpe.f()));
        } else {
          EXPECT_TRUE(bitwise_equal(dwpe_k.f(), dwpe0)) << "dwpe was not passed, so nothing may change";
        }
      }
      EXPECT_TRUE(bitwise_equal(sum, full.f()));
      EXPECT_TRUE(bitwise_equal(dwte_parts, want_dwte));
    }
  }
}

// Sequence parallelism splits the encoder into a token lookup and the position term: the two ops
// together are encoder_forward bit for bit, and position_backward over all rows is its dwpe.
TEST_P(TpOpsTest, EncoderWithoutPositionsPlusPositionOpsIsTheEncoder) {
  for (const EncoderCase& c : kEncoderCases) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " C=" << c.C << " V=" << c.V);
    const IVec tokens = rng_.ints(c.B * c.T, 0, static_cast<int32_t>(c.V));
    const FVec wte = rng_.normal(c.V * c.C), wpe = rng_.normal(c.maxT * c.C);
    const FVec dout = rng_.normal(c.B * c.T * c.C), dwpe0 = rng_.normal(c.maxT * c.C);
    const Shape shape{c.B, c.T, c.C};
    DevTensor ttok = tensor(tokens, {c.B, c.T}), twte = tensor(wte, {c.V, c.C}), twpe = tensor(wpe, {c.maxT, c.C});
    DevTensor want = poisoned(shape), got = poisoned(shape);
    ops::encoder_forward(s(), want, ttok, twte, twpe);
    ops::encoder_forward(s(), got, ttok, twte, ConstTensorView{});
    EXPECT_TRUE(bitwise_equal(got.f(), wte_rows(wte, tokens, c.C)));
    ops::position_forward(s(), got, twpe, 0, c.T);
    EXPECT_TRUE(bitwise_equal(got.f(), want.f()));

    DevTensor tdout = tensor(dout, shape), dwte = tensor(FVec(c.V * c.C), {c.V, c.C});
    DevTensor enc_dwpe = tensor(dwpe0, {c.maxT, c.C}), pos_dwpe = tensor(dwpe0, {c.maxT, c.C});
    ops::encoder_backward(s(), dwte, enc_dwpe, tdout, ttok);
    ops::position_backward(s(), pos_dwpe, tdout, 0, c.T);
    EXPECT_TRUE(bitwise_equal(pos_dwpe.f(), enc_dwpe.f()));
  }
}

struct PositionCase {
  int64_t R, C, row0, T, maxT;
};
// R not a multiple of T, row0 inside a sequence (a sequence-parallel rank's rows), T < maxT.
const PositionCase kPositionCases[] = {{1, 1, 0, 1, 1},       {5, 3, 2, 4, 4},      {33, 64, 17, 8, 9},
                                       {100, 65, 250, 64, 64}, {1000, 129, 3, 257, 300}};

TEST_P(TpOpsTest, PositionOps) {
  for (const PositionCase& c : kPositionCases) {
    SCOPED_TRACE(::testing::Message() << "R=" << c.R << " C=" << c.C << " row0=" << c.row0 << " T=" << c.T);
    const FVec x = rng_.normal(c.R * c.C), wpe = rng_.normal(c.maxT * c.C), dwpe0 = rng_.normal(c.maxT * c.C);
    DevTensor tx = tensor(x, {c.R, c.C}), twpe = tensor(wpe, {c.maxT, c.C});
    ops::position_forward(s(), tx, twpe, c.row0, c.T);
    DVec ref = to_d(x);
    ref::position_forward_ref(ref, to_d(wpe), c.R, c.C, c.row0, c.T);
    EXPECT_TRUE(close(tx.f(), ref, kTolElem));

    const FVec dx = rng_.normal(c.R * c.C);
    DevTensor tdx = tensor(dx, {c.R, c.C}), dwpe = tensor(dwpe0, {c.maxT, c.C});
    ops::position_backward(s(), dwpe, tdx, c.row0, c.T);
    DVec ref_dwpe = to_d(dwpe0);
    ref::position_backward_ref(ref_dwpe, to_d(dx), c.R, c.C, c.row0, c.T);
    EXPECT_TRUE(close(dwpe.f(), ref_dwpe, kTolReduce));
    // Rows of positions >= T are never touched.
    const FVec got = dwpe.f();
    EXPECT_TRUE(bitwise_equal(FVec(got.begin() + c.T * c.C, got.end()), FVec(dwpe0.begin() + c.T * c.C, dwpe0.end())));
  }
}

// ---- bias ------------------------------------------------------------------------------------------

struct BiasCase {
  int64_t N, C;
};
const BiasCase kBiasCases[] = {{1, 1}, {7, 63}, {300, 64}, {33, 65}, {1031, 129}, {64, 768}};

TEST_P(TpOpsTest, BiasOpsMatchReferencesAndMatmulBackward) {
  for (const BiasCase& c : kBiasCases) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " C=" << c.C);
    const FVec x = rng_.normal(c.N * c.C), bias = rng_.normal(c.C), dout = rng_.normal(c.N * c.C, 2.0f),
               dbias0 = rng_.normal(c.C);
    DevTensor tx = tensor(x, {c.N, c.C}), tbias = tensor(bias, {c.C});
    ops::bias_forward(s(), tx, tbias);
    DVec ref = to_d(x);
    ref::bias_forward_ref(ref, to_d(bias), c.N, c.C);
    EXPECT_TRUE(close(tx.f(), ref, kTolElem));

    DevTensor tdout = tensor(dout, {c.N, c.C}), dbias = tensor(dbias0, {c.C});
    ops::bias_backward(s(), dbias, tdout);
    DVec ref_dbias = to_d(dbias0);
    ref::bias_backward_ref(ref_dbias, to_d(dout), c.N, c.C);
    EXPECT_TRUE(close(dbias.f(), ref_dbias, kTolReduce));

    // matmul_backward's dbias for the same dout (a row-parallel layer's bias gradient must not
    // change when the bias moves out of the matmul): bitwise on the CPU; on CUDA cuBLASLt's BGRADB
    // epilogue sums in its own order (ops.h bias_backward).
    const int64_t K = 3;
    DevTensor in = tensor(rng_.normal(c.N * K), {c.N, K}), w = tensor(rng_.normal(c.C * K), {c.C, K}),
              dw = tensor(FVec(c.C * K), {c.C, K}), mm_dbias = tensor(dbias0, {c.C});
    ops::matmul_backward(s(), TensorView{}, dw, mm_dbias, tdout, in, w);
    if (GetParam() == Backend::kCpu) {
      EXPECT_TRUE(bitwise_equal(dbias.f(), mm_dbias.f()));
    } else {
      EXPECT_TRUE(close(mm_dbias.f(), ref_dbias, kTolReduce));
    }
  }
}

// ---- vocabulary-parallel cross-entropy -------------------------------------------------------------

TEST_P(TpOpsTest, VocabOpsMatchReferences) {
  const int64_t N = 19, V = 301, begin = 150, total = 700;
  const FVec logits = rng_.normal(N * V, 3.0f);
  IVec targets = rng_.ints(N, 0, static_cast<int32_t>(total));
  targets[0] = -1;
  targets[1] = static_cast<int32_t>(begin);
  targets[2] = static_cast<int32_t>(begin + V - 1);
  targets[3] = static_cast<int32_t>(begin + V);
  targets[4] = static_cast<int32_t>(begin - 1);
  const ops::VocabRange vocab{begin, total};
  DevTensor tlogits = tensor(logits, {N, V}), ttargets = tensor(targets, {N});

  DevTensor mx = poisoned({N});
  ops::row_max(s(), mx, tlogits);
  DVec ref_max(N);
  ref::row_max_ref(ref_max, to_d(logits), N, V);
  EXPECT_TRUE(bitwise_equal(mx.f(), to_f(ref_max)));  // max is exact

  // A max above the row's (as another shard's would be): the sums are smaller than 1.
  FVec gmax = mx.f();
  for (int64_t r = 0; r < N; r += 2) gmax[r] += 1.5f;
  DevTensor tgmax = tensor(gmax, {N}), partials = poisoned({2, N});
  ops::vocab_partials(s(), partials, tlogits, tgmax, ttargets, vocab);
  DVec ref_partials(2 * N);
  ref::vocab_partials_ref(ref_partials, to_d(logits), to_d(gmax), targets, N, V, begin);
  EXPECT_TRUE(close(partials.f(), ref_partials, kTolReduce));

  // As if other shards had added to the sums and held the other targets' logits.
  FVec sumexp = rng_.uniform(N, 1.0f, 50.0f), target_logit = rng_.normal(N, 3.0f);
  DevTensor tsum = tensor(sumexp, {N}), ttl = tensor(target_logit, {N}), losses = poisoned({N});
  const float dloss = 0.25f;
  ops::vocab_loss_grad(s(), tlogits, losses, tgmax, tsum, ttl, ttargets, vocab, dloss, false);
  DVec ref_losses(N), ref_dlogits(N * V);
  ref::vocab_loss_grad_ref(ref_losses, ref_dlogits, to_d(logits), to_d(gmax), to_d(sumexp), to_d(target_logit),
                           targets, N, V, begin, dloss);
  EXPECT_TRUE(close(losses.f(), ref_losses, kTolElem));
  EXPECT_TRUE(bitwise_equal(tlogits.f(), logits)) << "untouched without compute_grad";
  DevTensor losses2 = poisoned({N});
  ops::vocab_loss_grad(s(), tlogits, losses2, tgmax, tsum, ttl, ttargets, vocab, dloss, true);
  EXPECT_TRUE(close(losses2.f(), ref_losses, kTolElem));
  EXPECT_TRUE(close(tlogits.f(), ref_dlogits, kTolElem));
}

TEST_P(TpOpsTest, ReduceSlices) {
  for (int64_t S : {1, 2, 3, 4}) {
    for (int64_t n : {1, 257, 70001}) {
      SCOPED_TRACE(::testing::Message() << "S=" << S << " n=" << n);
      const FVec in = rng_.normal(S * n);
      DevTensor tin = tensor(in, {S, n});
      for (ops::SliceReduce kind : {ops::SliceReduce::kSum, ops::SliceReduce::kMax}) {
        const bool take_max = kind == ops::SliceReduce::kMax;
        DevTensor out = poisoned({n});
        ops::reduce_slices(s(), out, tin, kind);
        DVec ref(n);
        ref::reduce_slices_ref(ref, to_d(in), take_max);
        EXPECT_TRUE(close(out.f(), ref, kTolElem));
        // The order is fixed (k = 0, 1, ...), so fp32 sums in that order are the bits.
        FVec want(in.begin(), in.begin() + n);
        for (int64_t k = 1; k < S; ++k)
          for (int64_t j = 0; j < n; ++j) {
            const float v = in[k * n + j];
            want[j] = take_max ? std::max(want[j], v) : want[j] + v;
          }
        EXPECT_TRUE(bitwise_equal(out.f(), want)) << (take_max ? "max" : "sum");
      }
    }
  }
}

struct ChainCase {
  int64_t N, V;
};
const ChainCase kChainCases[] = {{1, 4}, {3, 7}, {5, 257}, {17, 1000}, {32, 50257}};

// Splits full logits [N, V] into 1, 2 and 4 column shards and runs the chain as the model does:
// row_max -> gather -> reduce_slices kMax -> vocab_partials -> gather -> reduce_slices kSum ->
// vocab_loss_grad on every shard (the gathers concatenate on the host). Every shard's losses and
// the re-assembled dlogits must be the classifier's on the whole matrix, and the float64 reference's.
TEST_P(TpOpsTest, VocabParallelChainMatchesClassifier) {
  DevTensor scale = tensor(FVec{1.0f}, {1});
  const auto* scale_ptr = static_cast<const float*>(scale.view().data);
  for (const ChainCase& c : kChainCases) {
    const int64_t N = c.N, V = c.V;
    const FVec logits = rng_.normal(N * V, 3.0f);
    IVec targets = rng_.ints(N, 0, static_cast<int32_t>(V));
    if (N > 2) targets[1] = -1;
    if (N > 3) targets[2] = static_cast<int32_t>(V - 1);
    if (N > 4) targets[3] = static_cast<int32_t>(V / 2);  // a shard boundary for 2 shards
    const float dloss = 1.0f / static_cast<float>(N);
    DevTensor ttargets = tensor(targets, {N});

    for (int64_t shards : {1, 2, 4}) {
      for (bool compute_grad : {false, true}) {
        for (float loss_scale : {0.0f, 1024.0f}) {  // 0: no scale pointer
          SCOPED_TRACE(::testing::Message() << "N=" << N << " V=" << V << " shards=" << shards << " grad="
                                            << compute_grad << " scale=" << loss_scale);
          const float* sp = loss_scale > 0 ? scale_ptr : nullptr;
          if (sp != nullptr) s().copy(scale.view().data, &loss_scale, sizeof(float));
          const auto ranges = split(V, shards);

          // Each shard's logits on the device, then step 1 and the first gather (on the host).
          std::vector<DevTensor> shard_logits;
          FVec maxima;
          for (const auto& [v0, v1] : ranges) {
            shard_logits.push_back(tensor(columns(logits, N, V, v0, v1), {N, v1 - v0}));
            DevTensor mx = poisoned({N});
            ops::row_max(s(), mx, shard_logits.back());
            const FVec m = mx.f();
            maxima.insert(maxima.end(), m.begin(), m.end());
          }
          DevTensor gathered_max = tensor(maxima, {shards, N}), gmax = poisoned({N});
          ops::reduce_slices(s(), gmax, gathered_max, ops::SliceReduce::kMax);

          FVec parts;
          for (size_t k = 0; k < ranges.size(); ++k) {
            DevTensor p = poisoned({2, N});
            ops::vocab_partials(s(), p, shard_logits[k], gmax, ttargets, ops::VocabRange{ranges[k].first, V});
            const FVec pk = p.f();
            parts.insert(parts.end(), pk.begin(), pk.end());
          }
          DevTensor gathered_parts = tensor(parts, {shards, 2 * N}), reduced = poisoned({2 * N});
          ops::reduce_slices(s(), reduced, gathered_parts, ops::SliceReduce::kSum);

          std::vector<FVec> shard_dlogits;
          FVec losses0;
          for (size_t k = 0; k < ranges.size(); ++k) {
            DevTensor losses = poisoned({N});
            ops::vocab_loss_grad(s(), shard_logits[k], losses, gmax, slice(reduced, 0, N), slice(reduced, N, N),
                                 ttargets, ops::VocabRange{ranges[k].first, V}, dloss, compute_grad, sp);
            if (k == 0) losses0 = losses.f();
            EXPECT_TRUE(bitwise_equal(losses.f(), losses0)) << "every rank computes the same losses";
            shard_dlogits.push_back(shard_logits[k].f());
          }
          FVec dlogits(static_cast<size_t>(N * V));
          for (size_t k = 0; k < ranges.size(); ++k) {
            const int64_t v0 = ranges[k].first, Vl = ranges[k].second - v0;
            for (int64_t r = 0; r < N; ++r)
              std::copy_n(shard_dlogits[k].begin() + r * Vl, Vl, dlogits.begin() + r * V + v0);
          }

          // The single-device op on the whole matrix.
          DevTensor full = tensor(logits, {N, V}), full_losses = poisoned({N});
          ops::classifier_forward_backward(s(), full, full_losses, ttargets, dloss, compute_grad, sp);
          EXPECT_TRUE(within(losses0, full_losses.f(), 1e-6, 0.0)) << "losses vs classifier";
          const double gscale = double{dloss} * (sp != nullptr ? loss_scale : 1.0f);
          // dlogits are (p - onehot) * dloss: relative to that scale (p - 1 cancels near p = 1).
          EXPECT_TRUE(within(dlogits, full.f(), 1e-6, 1e-6 * gscale)) << "dlogits vs classifier";

          DVec r_loss(N), r_dlogits(N * V);
          ref::classifier_ref(r_loss, r_dlogits, to_d(logits), targets, N, V, gscale);
          EXPECT_TRUE(close(losses0, r_loss, kTolReduce));
          if (compute_grad) {
            EXPECT_TRUE(close(dlogits, r_dlogits, kTolElem));
          } else {
            EXPECT_TRUE(bitwise_equal(dlogits, logits));
          }
        }
      }
    }
  }
}

// A padded vocabulary: T equal shards of W columns each, T * W >= V, the ids >= V filled with
// large logits that must not count. The chain equals the classifier on the real [N, V] logits, a
// shard of padding only included, and the padding's gradient is exactly 0.
TEST_P(TpOpsTest, PaddedVocabularyColumnsTakeNoPart) {
  const int64_t N = 5, V = 37;
  const FVec logits = rng_.normal(N * V, 3.0f);
  IVec targets = rng_.ints(N, 0, static_cast<int32_t>(V));
  targets[1] = -1;
  targets[2] = static_cast<int32_t>(V - 1);
  DevTensor ttargets = tensor(targets, {N});
  const float dloss = 0.5f;
  for (int64_t shards : {2, 4}) {
    const int64_t W = shards == 2 ? 24 : 16;  // 4 x 16 = 64: the last shard is all padding
    SCOPED_TRACE(::testing::Message() << shards << " shards of " << W);
    std::vector<DevTensor> shard_logits;
    FVec maxima;
    for (int64_t k = 0; k < shards; ++k) {
      FVec m(static_cast<size_t>(N * W), 0.0f);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < W; ++j) {
          const int64_t id = k * W + j;
          m[static_cast<size_t>(r * W + j)] = id < V ? logits[static_cast<size_t>(r * V + id)] : 50.0f + static_cast<float>(j);
        }
      shard_logits.push_back(tensor(m, {N, W}));
      DevTensor mx = poisoned({N});
      ops::row_max(s(), mx, shard_logits.back(), ops::VocabRange{k * W, V});
      const FVec mk = mx.f();
      maxima.insert(maxima.end(), mk.begin(), mk.end());
    }
    DevTensor gmax = poisoned({N});
    ops::reduce_slices(s(), gmax, tensor(maxima, {shards, N}), ops::SliceReduce::kMax);
    FVec parts;
    for (int64_t k = 0; k < shards; ++k) {
      DevTensor p = poisoned({2, N});
      ops::vocab_partials(s(), p, shard_logits[static_cast<size_t>(k)], gmax, ttargets, ops::VocabRange{k * W, V});
      const FVec pk = p.f();
      parts.insert(parts.end(), pk.begin(), pk.end());
    }
    DevTensor reduced = poisoned({2 * N});
    ops::reduce_slices(s(), reduced, tensor(parts, {shards, 2 * N}), ops::SliceReduce::kSum);
    FVec losses0, dlogits(static_cast<size_t>(N * V));
    for (int64_t k = 0; k < shards; ++k) {
      DevTensor losses = poisoned({N});
      ops::vocab_loss_grad(s(), shard_logits[static_cast<size_t>(k)], losses, gmax, slice(reduced, 0, N),
                           slice(reduced, N, N), ttargets, ops::VocabRange{k * W, V}, dloss, true);
      if (k == 0) losses0 = losses.f();
      const FVec g = shard_logits[static_cast<size_t>(k)].f();
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < W; ++j) {
          const int64_t id = k * W + j;
          if (id < V) dlogits[static_cast<size_t>(r * V + id)] = g[static_cast<size_t>(r * W + j)];
          else EXPECT_EQ(g[static_cast<size_t>(r * W + j)], 0.0f) << "padding id " << id << " got a gradient";
        }
    }
    DevTensor full = tensor(logits, {N, V}), full_losses = poisoned({N});
    ops::classifier_forward_backward(s(), full, full_losses, ttargets, dloss, true);
    EXPECT_TRUE(within(losses0, full_losses.f(), 1e-6, 0.0)) << "losses vs classifier";
    EXPECT_TRUE(within(dlogits, full.f(), 1e-6, 1e-6 * dloss)) << "dlogits vs classifier";
  }
}

// ---- 16-bit activations (the tensor-parallel GPT's --precision bf16|fp16) ------------------------
// x, dx, dout and logits of bf16/fp16, wpe and bias fp32 or of the activations' dtype, dwpe, dbias
// and every statistic fp32 (ops.h). Where the op is one fp32 operation per element (position and
// bias adds, ReLU, row maxima) every backend gives the bits of the host's widen-compute-round-once;
// the sums against float64 of the widened inputs. The CPU 16-bit paths of the position, bias and
// vocabulary ops are task tp16's (they throw until it lands); ReLU's are here.

TEST_P(TpOpsTest, SixteenBitPositionOps) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Host16 h{t};
    for (const bool wide_wpe : {true, false}) {
      for (const PositionCase& c : kPositionCases) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << (wide_wpe ? " fp32" : " 16-bit") << " wpe R=" << c.R
                                          << " C=" << c.C << " row0=" << c.row0 << " T=" << c.T);
        const std::vector<uint16_t> x = h.round(rng_.normal(c.R * c.C, 2.0f));
        const FVec wpe32 = rng_.normal(c.maxT * c.C);
        const std::vector<uint16_t> wpe16 = h.round(wpe32);
        const FVec wpe = wide_wpe ? wpe32 : h.widen(wpe16);  // the values the op reads
        DevTensor tx = tensor16(t, x, {c.R, c.C});
        DevTensor twpe = wide_wpe ? tensor(wpe32, {c.maxT, c.C}) : tensor16(t, wpe16, {c.maxT, c.C});
        ops::position_forward(s(), tx, twpe, c.row0, c.T);
        std::vector<uint16_t> want(x.size());
        DVec ref(x.size());
        for (int64_t r = 0; r < c.R; ++r)
          for (int64_t k = 0; k < c.C; ++k) {
            const size_t i = static_cast<size_t>(r * c.C + k);
            const float p = wpe[static_cast<size_t>(((c.row0 + r) % c.T) * c.C + k)];
            want[i] = h.round(h.widen(x[i]) + p);
            ref[i] = double{h.widen(x[i])} + p;
          }
        const std::vector<uint16_t> got = tx.download<uint16_t>();
        EXPECT_TRUE(bitwise_equal(got, want));
        EXPECT_TRUE(h.close(h.widen(got), ref));
      }
    }
    for (const PositionCase& c : kPositionCases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " backward R=" << c.R << " C=" << c.C << " row0="
                                        << c.row0 << " T=" << c.T);
      const std::vector<uint16_t> dx = h.round(rng_.normal(c.R * c.C));
      const FVec dwpe0 = rng_.normal(c.maxT * c.C);
      DevTensor tdx = tensor16(t, dx, {c.R, c.C}), dwpe = tensor(dwpe0, {c.maxT, c.C});
      ops::position_backward(s(), dwpe, tdx, c.row0, c.T);
      // Rows in increasing order into fp32 (ops.h): the sequential loop's bits, and float64 within
      // the reduction tolerance; rows of positions >= T keep theirs.
      FVec seq = dwpe0;
      DVec ref = to_d(dwpe0);
      for (int64_t r = 0; r < c.R; ++r)
        for (int64_t k = 0; k < c.C; ++k) {
          const size_t p = static_cast<size_t>(((c.row0 + r) % c.T) * c.C + k);
          const float d = h.widen(dx[static_cast<size_t>(r * c.C + k)]);
          seq[p] += d;
          ref[p] += d;
        }
      const FVec got = dwpe.f();
      EXPECT_TRUE(bitwise_equal(got, seq));
      EXPECT_TRUE(close(got, ref, kTolReduce));
    }
  }
}

TEST_P(TpOpsTest, SixteenBitBiasOps) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Host16 h{t};
    for (const BiasCase& c : kBiasCases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " N=" << c.N << " C=" << c.C);
      const std::vector<uint16_t> x = h.round(rng_.normal(c.N * c.C, 2.0f));
      const FVec bias32 = rng_.normal(c.C);
      const std::vector<uint16_t> bias16 = h.round(bias32);
      for (const bool wide_bias : {true, false}) {
        const FVec bias = wide_bias ? bias32 : h.widen(bias16);
        DevTensor tx = tensor16(t, x, {c.N, c.C});
        DevTensor tbias = wide_bias ? tensor(bias32, {c.C}) : tensor16(t, bias16, {c.C});
        ops::bias_forward(s(), tx, tbias);
        std::vector<uint16_t> want(x.size());
        DVec ref(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          const float b = bias[i % static_cast<size_t>(c.C)];
          want[i] = h.round(h.widen(x[i]) + b);
          ref[i] = double{h.widen(x[i])} + b;
        }
        const std::vector<uint16_t> got = tx.download<uint16_t>();
        EXPECT_TRUE(bitwise_equal(got, want)) << (wide_bias ? "fp32 bias" : "16-bit bias");
        EXPECT_TRUE(h.close(h.widen(got), ref)) << (wide_bias ? "fp32 bias" : "16-bit bias");
      }

      // dbias (fp32) += column sums of the widened dout, against float64; and matmul_backward's
      // dbias for the same 16-bit dout: bitwise on the CPU (ops.h bias_backward), within the
      // reduction tolerance where cuBLASLt's BGRADB epilogue sums it.
      const std::vector<uint16_t> dout = h.round(rng_.normal(c.N * c.C, 2.0f));
      const FVec dbias0 = rng_.normal(c.C);
      DevTensor tdout = tensor16(t, dout, {c.N, c.C}), dbias = tensor(dbias0, {c.C});
      ops::bias_backward(s(), dbias, tdout);
      DVec ref_dbias = to_d(dbias0);
      ref::bias_backward_ref(ref_dbias, to_d(h.widen(dout)), c.N, c.C);
      EXPECT_TRUE(close(dbias.f(), ref_dbias, kTolReduce));
      const int64_t K = 3;
      DevTensor in = tensor16(t, h.round(rng_.normal(c.N * K)), {c.N, K}),
                w = tensor16(t, h.round(rng_.normal(c.C * K)), {c.C, K}), dw = tensor(FVec(c.C * K), {c.C, K}),
                mm_dbias = tensor(dbias0, {c.C});
      ops::matmul_backward(s(), TensorView{}, dw, mm_dbias, tdout, in, w);
      if (GetParam() == Backend::kCpu) {
        EXPECT_TRUE(bitwise_equal(dbias.f(), mm_dbias.f()));
      } else {
        EXPECT_TRUE(close(mm_dbias.f(), ref_dbias, kTolReduce));
      }
    }
  }
}

// The vocabulary-parallel chain's three ops over a 16-bit shard that reaches past the vocabulary
// (padded: ids >= total take no part and get gradient 0), against float64 of the widened logits.
TEST_P(TpOpsTest, SixteenBitVocabOps) {
  const int64_t N = 19, V = 301, begin = 150, total = 400, real = total - begin;
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Host16 h{t};
    SCOPED_TRACE(dtype_name(t));
    std::vector<uint16_t> logits = h.round(rng_.normal(N * V, 3.0f));
    for (int64_t r = 0; r < N; ++r)  // padding with large values: counted anywhere, they would dominate
      for (int64_t j = real; j < V; ++j)
        logits[static_cast<size_t>(r * V + j)] = h.round(9.0f + static_cast<float>(j % 7));
    const FVec wide = h.widen(logits);
    const FVec wide_real = columns(wide, N, V, 0, real);  // what the references see
    IVec targets = rng_.ints(N, 0, static_cast<int32_t>(total));
    targets[0] = -1;
    targets[1] = static_cast<int32_t>(begin);
    targets[2] = static_cast<int32_t>(total - 1);
    targets[3] = static_cast<int32_t>(begin - 1);
    const ops::VocabRange vocab{begin, total};
    DevTensor tlogits = tensor16(t, logits, {N, V}), ttargets = tensor(targets, {N});

    DevTensor mx = poisoned({N});
    ops::row_max(s(), mx, tlogits, vocab);
    DVec ref_max(N);
    ref::row_max_ref(ref_max, to_d(wide_real), N, real);
    EXPECT_TRUE(bitwise_equal(mx.f(), to_f(ref_max)));  // a max of widened values is exact

    FVec gmax = mx.f();
    for (int64_t r = 0; r < N; r += 2) gmax[r] += 1.5f;  // as another shard's larger maximum
    DevTensor tgmax = tensor(gmax, {N}), partials = poisoned({2, N});
    ops::vocab_partials(s(), partials, tlogits, tgmax, ttargets, vocab);
    DVec ref_partials(2 * N);
    ref::vocab_partials_ref(ref_partials, to_d(wide_real), to_d(gmax), targets, N, real, begin);
    const FVec got_partials = partials.f();
    EXPECT_TRUE(close(got_partials, ref_partials, kTolReduce));
    // The target's logit is the widened value itself.
    EXPECT_TRUE(bitwise_equal(FVec(got_partials.begin() + N, got_partials.end()),
                              to_f(DVec(ref_partials.begin() + N, ref_partials.end()))));

    const FVec sumexp = rng_.uniform(N, 1.0f, 50.0f), target_logit = rng_.normal(N, 3.0f);
    DevTensor tsum = tensor(sumexp, {N}), ttl = tensor(target_logit, {N}), losses = poisoned({N});
    const float dloss = 0.25f;
    ops::vocab_loss_grad(s(), tlogits, losses, tgmax, tsum, ttl, ttargets, vocab, dloss, false);
    DVec ref_losses(N), ref_dlogits(N * real);
    ref::vocab_loss_grad_ref(ref_losses, ref_dlogits, to_d(wide_real), to_d(gmax), to_d(sumexp),
                             to_d(target_logit), targets, N, real, begin, dloss);
    EXPECT_TRUE(close(losses.f(), ref_losses, kTolElem));
    EXPECT_TRUE(bitwise_equal(tlogits.download<uint16_t>(), logits)) << "untouched without compute_grad";
    DevTensor losses2 = poisoned({N});
    ops::vocab_loss_grad(s(), tlogits, losses2, tgmax, tsum, ttl, ttargets, vocab, dloss, true);
    EXPECT_TRUE(close(losses2.f(), ref_losses, kTolElem));
    const std::vector<uint16_t> grad = tlogits.download<uint16_t>();
    EXPECT_TRUE(h.close(columns(h.widen(grad), N, V, 0, real), ref_dlogits));
    // Padding and the ignored row: gradient exactly +0 (bits 0).
    EXPECT_TRUE(bitwise_equal(columns(grad, N, V, real, V),
                              std::vector<uint16_t>(static_cast<size_t>(N * (V - real)), 0)));
    EXPECT_TRUE(bitwise_equal(std::vector<uint16_t>(grad.begin(), grad.begin() + V), std::vector<uint16_t>(V, 0)));
  }
}

// ReLU over 16-bit activations at odd sizes and an unaligned start (CUDA's scalar path) and aligned
// (its 128-bit path): one fp32 operation per element, so the host's bits on every backend.
TEST_P(TpOpsTest, SixteenBitRelu) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Host16 h{t};
    for (int64_t n : {1, 7, 8, 9, 1027, 100003}) {
      for (int64_t off : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " n=" << n << " offset=" << off);
        const int64_t m = n + off;
        const std::vector<uint16_t> x = h.round(rng_.normal(m, 2.0f)), g = h.round(rng_.normal(m)),
                                    d0 = h.round(rng_.normal(m));
        DevTensor tx = tensor16(t, x, {m}), tg = tensor16(t, g, {m}), tdin = tensor16(t, d0, {m}),
                  tout = tensor16(t, std::vector<uint16_t>(m, kPoison16), {m});
        auto view = [&](const DevTensor& d) {
          return TensorView{static_cast<char*>(d.view().data) + off * 2, t, Shape{n}, dev_->index()};
        };
        ops::relu_forward(s(), view(tout), view(tx));
        ops::relu_backward(s(), view(tdin), view(tx), view(tg));
        std::vector<uint16_t> want_out(x), want_din(d0);  // the elements before the view keep theirs
        std::fill(want_out.begin(), want_out.begin() + off, kPoison16);
        DVec ref_out(n), ref_din(n);
        for (int64_t i = off; i < m; ++i) {
          const float xi = h.widen(x[i]), gi = h.widen(g[i]), di = h.widen(d0[i]);
          want_out[i] = h.round(relu_forward_elem(xi));
          want_din[i] = h.round(di + relu_grad_elem(xi, gi));
          ref_out[i - off] = xi > 0 ? double{xi} : 0.0;
          ref_din[i - off] = double{di} + (xi > 0 ? double{gi} : 0.0);
        }
        const std::vector<uint16_t> got_out = tout.download<uint16_t>(), got_din = tdin.download<uint16_t>();
        EXPECT_TRUE(bitwise_equal(got_out, want_out));
        EXPECT_TRUE(bitwise_equal(got_din, want_din));
        EXPECT_TRUE(h.close(h.widen(std::vector<uint16_t>(got_din.begin() + off, got_din.end())), ref_din));
        EXPECT_TRUE(h.close(h.widen(std::vector<uint16_t>(got_out.begin() + off, got_out.end())), ref_out));
      }
    }
  }
}

// Mixed dtypes within a call are refused with one sentence naming the tensor.
TEST_P(TpOpsTest, SixteenBitOpsRefuseMixedDtypes) {
  const int64_t N = 4, C = 8;
  DevTensor xb = empty({N, C}, DType::kBF16), xh = empty({N, C}, DType::kF16), bias_h = empty({C}, DType::kF16),
            dbias_b = empty({C}, DType::kBF16), wpe_h = empty({N, C}, DType::kF16),
            dwpe_b = empty({N, C}, DType::kBF16),
            max_b = empty({N}, DType::kBF16), out = empty({N}), targets = empty({N}, DType::kI32);
  EXPECT_THAT(error_of([&] { ops::bias_forward(s(), xb, bias_h); }).what(), ::testing::HasSubstr("bias"));
  EXPECT_THAT(error_of([&] { ops::bias_backward(s(), dbias_b, xb); }).what(), ::testing::HasSubstr("dbias"));
  EXPECT_THAT(error_of([&] { ops::position_forward(s(), xb, wpe_h, 0, N); }).what(), ::testing::HasSubstr("wpe"));
  EXPECT_THAT(error_of([&] { ops::position_backward(s(), dwpe_b, xb, 0, N); }).what(), ::testing::HasSubstr("dwpe"));
  EXPECT_THAT(error_of([&] { ops::relu_forward(s(), xh, xb); }).what(), ::testing::HasSubstr("out"));
  EXPECT_THAT(error_of([&] { ops::relu_backward(s(), xb, xb, xh); }).what(), ::testing::HasSubstr("dout"));
  EXPECT_THAT(error_of([&] { ops::vocab_partials(s(), out, xb, max_b, targets, ops::VocabRange{0, C}); }).what(),
              ::testing::HasSubstr("max"));
  sync();
}

TEST_P(TpOpsTest, EmptyRowsLaunchNothingAndTouchNothing) {
  DevTensor logits = empty({0, 5}), out = empty({0}), parts = empty({2, 0}), targets = empty({0}, DType::kI32);
  ops::row_max(s(), out, logits);
  ops::vocab_partials(s(), parts, logits, out, targets, ops::VocabRange{5, 10});
  ops::vocab_loss_grad(s(), logits, out, out, out, out, targets, ops::VocabRange{5, 10}, 1.0f, true);
  DevTensor x = poisoned({0, 3}), bias = poisoned({3});
  ops::bias_forward(s(), x, bias);
  ops::bias_backward(s(), bias, x);
  sync();
  const FVec untouched = bias.f();
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](float v) { return std::isnan(v); }));
}

INSTANTIATE_TEST_SUITE_P(Backends, TpOpsTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(backend_name(info.param));
                         });

// ---- determinism ------------------------------------------------------------------------------

// Outputs of the new ops with cross-row reductions, on fixed inputs, as bytes.
std::vector<uint8_t> tp_outputs(Device& dev) {
  Stream& s = dev.compute();
  Rng rng(11);
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
  {  // encoder backward on a vocabulary shard, heavy repetition; position and bias backward
    const int64_t B = 4, T = 64, C = 200, V = 9, begin = 3, Vl = 4;
    DevTensor tokens(dev, s, DType::kI32, {B, T});
    tokens.upload(rng.ints(B * T, 0, V));
    DevTensor dout = tensor(rng.normal(B * T * C), {B, T, C}), dwte = tensor(rng.normal(Vl * C), {Vl, C}),
              dwpe = tensor(rng.normal(T * C), {T, C});
    ops::encoder_backward(s, dwte, dwpe, dout, tokens, ops::VocabRange{begin, V});
    DevTensor dx = tensor(rng.normal(1000 * C), {1000, C}), pos = tensor(rng.normal(T * C), {T, C}),
              dbias = tensor(rng.normal(C), {C});
    ops::position_backward(s, pos, dx, 37, T);
    ops::bias_backward(s, dbias, dx);
    for (const DevTensor* t : {&dwte, &dwpe, &pos, &dbias}) append(*t);
  }
  {  // the vocabulary-parallel chain on one shard of two, and reduce_slices
    const int64_t N = 33, V = 3001, total = 2 * V;
    DevTensor logits = tensor(rng.normal(N * V, 3.0f), {N, V}), mx = tensor(FVec(N), {N});
    DevTensor targets(dev, s, DType::kI32, {N});
    targets.upload(rng.ints(N, 0, total));
    ops::row_max(s, mx, logits);
    DevTensor parts = tensor(FVec(2 * N), {2, N}), losses = tensor(FVec(N), {N});
    ops::vocab_partials(s, parts, logits, mx, targets, ops::VocabRange{V, total});
    const auto* p = static_cast<const float*>(parts.view().data);
    const ConstTensorView sumexp(p, DType::kF32, Shape{N}, dev.index()), tl(p + N, DType::kF32, Shape{N}, dev.index());
    ops::vocab_loss_grad(s, logits, losses, mx, sumexp, tl, targets, ops::VocabRange{V, total}, 0.5f, true);
    DevTensor in = tensor(rng.normal(4 * 100003), {4, 100003}), out = tensor(FVec(100003), {100003});
    ops::reduce_slices(s, out, in, ops::SliceReduce::kSum);
    for (const DevTensor* t : {&mx, &parts, &logits, &losses, &out}) append(*t);
  }
  return bytes;
}

// The child half of SameBitsForAnyThreadCount (skips unless that test started it).
TEST(TpDeterminism, ChildWritesOutputs) {
  const char* path = std::getenv("ZT_DETERMINISM_OUT");
  if (path == nullptr) GTEST_SKIP() << "runs as a child of TpDeterminism.SameBitsForAnyThreadCount";
  auto rt = Runtime::create_cpu(1);
  const std::vector<uint8_t> bytes = tp_outputs(rt->device(0));
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good());
}

TEST(TpDeterminism, SameBitsForAnyThreadCount) {
  auto rt = Runtime::create_cpu(2);
  const std::vector<uint8_t> want = tp_outputs(rt->device(0));
  ASSERT_GT(want.size(), 0u);
  // Two devices at once: both share the worker pool, so chunks land on other threads.
  std::vector<uint8_t> other;
  std::thread t([&] { other = tp_outputs(rt->device(1)); });
  const std::vector<uint8_t> mine = tp_outputs(rt->device(0));
  t.join();
  EXPECT_TRUE(bitwise_equal(mine, want)) << "concurrent, device 0";
  EXPECT_TRUE(bitwise_equal(other, want)) << "concurrent, device 1";
  for (int threads : {1, 3}) {
    EXPECT_TRUE(bitwise_equal(outputs_of_child(threads, "TpDeterminism.ChildWritesOutputs"), want))
        << threads << " threads";
  }
}

// ---- argument validation ------------------------------------------------------------------------

using ::testing::HasSubstr;

using test_util::invalid_argument_message;

class TpOpsValidation : public ::testing::Test {
 protected:
  void SetUp() override { rt_ = Runtime::create_cpu(1); }
  DevTensor make(Shape shape, DType dtype = DType::kF32) {
    return DevTensor(rt_->device(0), rt_->device(0).compute(), dtype, shape);
  }
  Stream& s() { return rt_->device(0).compute(); }
  std::unique_ptr<Runtime> rt_;
};

TEST_F(TpOpsValidation, BadSizesNameTheOpAndTheSizes) {
  DevTensor tokens = make({2, 3}, DType::kI32), wte = make({5, 4}), wpe = make({3, 4}), out = make({2, 3, 4});
  EXPECT_THAT(invalid_argument_message([&] { ops::encoder_forward(s(), out, tokens, wte, wpe, ops::VocabRange{5, 0}); }),
              HasSubstr("encoder_forward: vocab begin 5 needs a vocab total"));
  EXPECT_THAT(invalid_argument_message([&] { ops::encoder_backward(s(), wte, wpe, out, tokens, ops::VocabRange{-2, 12}); }),
              HasSubstr("encoder_backward: dwte [5, 4] as the vocabulary rows [-2, 3) is not a shard of a "
                        "vocabulary of 12"));
  DevTensor x = make({7, 4}), wpe2 = make({3, 4});
  EXPECT_THAT(invalid_argument_message([&] { ops::position_forward(s(), x, wpe2, 0, 4); }),
              HasSubstr("position_forward: T = 4 and row0 = 0 with wpe [3, 4]"));
  EXPECT_THAT(invalid_argument_message([&] { ops::position_backward(s(), wpe2, make({7, 5}), 0, 3); }),
              HasSubstr("position_backward: dx [7, 5] and dwpe [3, 4]"));
  EXPECT_THAT(invalid_argument_message([&] { ops::bias_forward(s(), x, make({5})); }),
              HasSubstr("bias_forward: x [7, 4] but bias [5] (need [4])"));
  EXPECT_THAT(invalid_argument_message([&] { ops::bias_backward(s(), make({3}), x); }),
              HasSubstr("bias_backward: dout [7, 4] but dbias [3] (need [4])"));
  DevTensor logits = make({6, 10}), rows = make({6}), targets = make({6}, DType::kI32);
  EXPECT_THAT(invalid_argument_message([&] { ops::row_max(s(), make({5}), logits); }),
              HasSubstr("row_max: logits [6, 10] has 6 rows but out [5]"));
  EXPECT_THAT(invalid_argument_message([&] { ops::vocab_partials(s(), make({6}), logits, rows, targets, {}); }),
              HasSubstr("vocab_partials: logits [6, 10] has 6 rows but out [6] (need [2, 6])"));
  EXPECT_THAT(invalid_argument_message([&] { ops::vocab_partials(s(), make({2, 6}), logits, rows, make({6}), {}); }),
              HasSubstr("vocab_partials: targets [6] is fp32 but must be int32"));
  EXPECT_THAT(invalid_argument_message([&] {
                ops::vocab_loss_grad(s(), logits, rows, rows, make({3}), rows, targets, {}, 1.0f, true);
              }),
              HasSubstr("vocab_loss_grad: logits [6, 10] has 6 rows but sumexp [3]"));
  EXPECT_THAT(invalid_argument_message([&] {
                ops::vocab_loss_grad(s(), logits, rows, rows, rows, rows, targets, {-1, 100}, 1.0f, true);
              }),
              HasSubstr("vocab_loss_grad: logits [6, 10] as the vocabulary rows [-1, 9) is not a shard"));
  EXPECT_THAT(invalid_argument_message([&] { ops::reduce_slices(s(), make({5}), make({3, 4}), ops::SliceReduce::kSum); }),
              HasSubstr("reduce_slices: in [3, 4] must be [S, n] with S >= 1 slices of out [5]"));
}

// Ids are checked against the whole vocabulary, not the shard: a token another shard holds is fine.
TEST_F(TpOpsValidation, TokensAreCheckedAgainstTheWholeVocabulary) {
  DevTensor tokens = make({1, 3}, DType::kI32), wte = make({4, 2}), out = make({1, 3, 2});
  tokens.upload(IVec{9, 4, 3});
  ops::encoder_forward(s(), out, tokens, wte, ConstTensorView{}, ops::VocabRange{4, 10});
  s().synchronize();
  tokens.upload(IVec{9, 10, 3});
  ops::encoder_forward(s(), out, tokens, wte, ConstTensorView{}, ops::VocabRange{4, 10});
  try {
    s().synchronize();
    ADD_FAILURE() << "no error for token 10";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("token id 10 at (b=0, t=1) is outside the vocabulary [0, 10)"));
  }
}

// (A failed stream stays failed, so the target check gets a test of its own.)
TEST_F(TpOpsValidation, TargetsAreCheckedAgainstTheWholeVocabulary) {
  DevTensor logits = make({2, 4}), mx = make({2}), parts = make({2, 2}), targets = make({2}, DType::kI32);
  targets.upload(IVec{9, 10});
  ops::vocab_partials(s(), parts, logits, mx, targets, ops::VocabRange{4, 10});
  try {
    s().synchronize();
    ADD_FAILURE() << "no error for target 10";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("vocab_partials: target 10 of row 1 is outside the vocabulary [0, 10)"));
  }
}

}  // namespace
}  // namespace zt
