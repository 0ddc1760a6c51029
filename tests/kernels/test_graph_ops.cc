// Stream capture with real ops on every backend (cuda instances skip without a GPU): a captured
// chain of ops replayed equals the same ops run eagerly, bit for bit, on fresh inputs each time
// (the graph holds addresses, not values), and a capture that breaks a rule fails with its reason
// and CUDA's error (core/capture_rules.h) while the stream stays usable. The ops' launches
// inside a capture ask CUDA for nothing it refuses there (the first GPU run's capture failed on a
// cudaStreamGetDevice in every launch). scripts/gpu-check.sh runs the cuda instances among the first.
#include <gtest/gtest.h>

#include "core/capture_rules.h"
#include "kernels/ops.h"
#include "op_test_util.h"

namespace zt {
namespace {

using namespace op_test;

class GraphOpsTest : public OpsFixture {
 protected:
  // `issue` once eagerly (warm-up: library state a stream makes on first use, such as cuBLAS
  // handles, cuDNN graphs and the attention block, comes from the pool, which a capture refuses),
  // then once under capture: the graph.
  template <typename F>
  std::unique_ptr<StreamGraph> warm_up_and_capture(F&& issue) {
    issue();
    sync();
    s().begin_capture();
    issue();
    return s().end_capture();
  }
};

// out = gelu(in @ w^T + b); din/dw/db from the backward with out as dout; res = out + h. (Not
// ops::sum: its CUDA entry takes a workspace from the pool per call, which a capture refuses.)
struct Chain {
  int64_t N = 37, C = 24, OC = 40;  // not multiples of any tile
  DevTensor in, w, b, h, out, din, dw, db, res;
  Chain(Device& d, Stream& s)
      : in(d, s, DType::kF32, Shape{37, 24}), w(d, s, DType::kF32, Shape{40, 24}), b(d, s, DType::kF32, Shape{40}),
        h(d, s, DType::kF32, Shape{37, 40}), out(d, s, DType::kF32, Shape{37, 40}), din(d, s, DType::kF32, Shape{37, 24}),
        dw(d, s, DType::kF32, Shape{40, 24}), db(d, s, DType::kF32, Shape{40}), res(d, s, DType::kF32, Shape{37, 40}) {}
  void issue(Stream& s) const {
    ops::matmul_forward(s, h, in, w, b);
    ops::gelu_forward(s, out, h);
    ops::fill(s, din, 0.0f);
    ops::fill(s, dw, 0.0f);
    ops::fill(s, db, 0.0f);
    ops::matmul_backward(s, din, dw, db, out, in, w);
    ops::add(s, res, out, h);
  }
  std::vector<FVec> results() const { return {out.f(), din.f(), dw.f(), db.f(), res.f()}; }
};

TEST_P(GraphOpsTest, ReplayEqualsEagerOnFreshInputs) {
  Chain c(*dev_, s());
  c.w.upload(rng_.normal(c.OC * c.C, 0.2f));
  c.b.upload(rng_.normal(c.OC, 0.1f));
  c.in.upload(rng_.normal(c.N * c.C));
  const std::unique_ptr<StreamGraph> g = warm_up_and_capture([&] { c.issue(s()); });
  ASSERT_GE(g->size(), 5u);
  for (int round = 0; round < 3; ++round) {
    const FVec x = rng_.normal(c.N * c.C);
    c.in.upload(x);
    c.issue(s());
    const std::vector<FVec> eager = c.results();
    for (DevTensor* t : {&c.out, &c.din, &c.dw, &c.db, &c.res}) t->upload(nan_vec(t->view().numel()));
    c.in.upload(x);
    g->launch(s());
    const std::vector<FVec> replayed = c.results();
    for (size_t i = 0; i < eager.size(); ++i) EXPECT_TRUE(bitwise_equal(replayed[i], eager[i])) << "round " << round << " output " << i;
  }
}

// A transformer block's 16-bit ops as a bf16/fp16 run captures them: attention (CUDA: cuDNN's
// SDPA where it serves, else the tiled kernels), the fused GELU matmuls (CUDA: cuBLASLt's
// GELU_AUX_BIAS, DGELU_BGRAD and BGRADB epilogues, or the plain path where cuBLASLt refuses), and
// the backward through them. Every launch must be capturable: no pool allocation per call (the plain
// matmul path takes its 16-bit scratch from the pool), no library set-up, no synchronisation. The
// replay equals the eager run bit for bit (cuDNN's deterministic backward, the default).
struct Block16 {
  static constexpr int64_t B = 2, T = 64, C = 64, NH = 2, OC = 4 * C;  // tile-friendly: the fast paths serve
  DType t;
  DevTensor qkv, att, lse, w1, b1, pre, gelu, w2, b2, y, dpre, datt, dqkv, scratch, dw1, db1, dw2, db2;
  Block16(Device& d, Stream& s, DType dtype)
      : t(dtype), qkv(d, s, t, Shape{B, T, 3 * C}), att(d, s, t, Shape{B, T, C}),
        lse(d, s, DType::kF32, Shape{B, NH, T}), w1(d, s, t, Shape{OC, C}), b1(d, s, t, Shape{OC}),
        pre(d, s, t, Shape{B, T, OC}), gelu(d, s, t, Shape{B, T, OC}),
        w2(d, s, t, Shape{C, OC}), b2(d, s, t, Shape{C}), y(d, s, t, Shape{B, T, C}), dpre(d, s, t, Shape{B, T, OC}),
        datt(d, s, t, Shape{B, T, C}), dqkv(d, s, t, Shape{B, T, 3 * C}), scratch(d, s, DType::kF32, Shape{B * NH * T}),
        dw1(d, s, DType::kF32, Shape{OC, C}), db1(d, s, DType::kF32, Shape{OC}), dw2(d, s, DType::kF32, Shape{C, OC}),
        db2(d, s, DType::kF32, Shape{C}) {}
  void issue(Stream& s) const {
    ops::flash_attention_forward(s, att, lse, qkv, static_cast<int>(NH));
    ops::matmul_gelu_forward(s, gelu, pre, att, w1, b1);
    ops::matmul_forward(s, y, gelu, w2, b2);
    for (const DevTensor* g : {&dw1, &db1, &dw2, &db2, &datt, &dqkv}) ops::fill(s, *g, 0.0f);
    // y stands in for its own gradient, as Chain's out does.
    ops::matmul_backward(s, TensorView{}, dw2, db2, y, gelu, w2);
    ops::matmul_backward_dgelu(s, dpre, db1, y, w2, pre);
    ops::matmul_backward(s, datt, dw1, TensorView{}, dpre, att, w1);
    ops::flash_attention_backward(s, dqkv, datt, qkv, att, lse, static_cast<int>(NH), scratch);
  }
  std::vector<DevTensor*> outputs() {
    return {&att, &lse, &pre, &gelu, &y, &dpre, &datt, &dqkv, &dw1, &db1, &dw2, &db2};
  }
};

TEST_P(GraphOpsTest, SixteenBitBlockCapturesAndReplaysTheEagerBits) {
  for (const DType t : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(t));
    Block16 k(*dev_, s(), t);
    auto upload = [&](DevTensor& d, float scale) { upload_typed(d, rng_.normal(d.view().numel(), scale)); };
    upload(k.w1, 0.1f), upload(k.b1, 0.1f), upload(k.w2, 0.1f), upload(k.b2, 0.1f), upload(k.qkv, 1.0f);
    const std::unique_ptr<StreamGraph> g = warm_up_and_capture([&] { k.issue(s()); });
    ASSERT_GE(g->size(), 8u);
    for (int round = 0; round < 2; ++round) {
      upload(k.qkv, 1.0f);
      const std::vector<uint16_t> x = k.qkv.download<uint16_t>();
      k.issue(s());
      std::vector<FVec> eager;
      for (const DevTensor* o : k.outputs()) eager.push_back(values(*o));
      for (DevTensor* o : k.outputs()) {
        DevTensor& d = *o;
        if (d.view().dtype == DType::kF32) {
          d.upload(nan_vec(d.view().numel()));
        } else {
          d.upload(std::vector<uint16_t>(static_cast<size_t>(d.view().numel()), op_test::bits16(NAN, t)));
        }
      }
      k.qkv.upload(x);
      g->launch(s());
      for (size_t i = 0; i < eager.size(); ++i)
        EXPECT_TRUE(bitwise_equal(values(*k.outputs()[i]), eager[i])) << "round " << round << " output " << i;
    }
  }
}

TEST_P(GraphOpsTest, CaptureDoesNotRunTheWork) {
  DevTensor x = tensor(FVec{1, 2, 3}, Shape{3});
  s().begin_capture();
  ops::scale(s(), x, 2.0f);
  const std::unique_ptr<StreamGraph> g = s().end_capture();
  EXPECT_TRUE(bitwise_equal(x.f(), FVec{1, 2, 3}));
  g->launch(s());
  g->launch(s());
  EXPECT_TRUE(bitwise_equal(x.f(), FVec{4, 8, 12}));
}

TEST_P(GraphOpsTest, FailedCaptureNamesWhyAndLeavesTheStreamUsable) {
  DevTensor x = tensor(FVec{1, 2, 3}, Shape{3});
  s().begin_capture();
  ops::scale(s(), x, 2.0f);
  try {
    s().synchronize();
    ADD_FAILURE() << "synchronize() inside a capture was accepted";
  } catch (const CaptureError& e) {  // before CUDA sees the call, on both backends
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(e.cuda_error(), "cudaErrorStreamCaptureUnsupported");
  }
  try {
    ops::scale(s(), x, 2.0f);  // work submitted to the failed capture
    ADD_FAILURE() << "an op was captured into a failed capture";
  } catch (const CaptureError& e) {
    EXPECT_EQ(e.cuda_error(), "cudaErrorStreamCaptureInvalidated");
  }
  try {
    s().end_capture();
    ADD_FAILURE() << "the broken capture produced a graph";
  } catch (const CaptureError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(e.cuda_error(), "cudaErrorStreamCaptureInvalidated");
    EXPECT_NE(e.message().find("synchronize() of a capturing stream"), std::string::npos) << e.message();
  }
  EXPECT_FALSE(s().capturing());
  ops::scale(s(), x, 3.0f);  // eager again; nothing of the failed capture ran
  EXPECT_TRUE(bitwise_equal(x.f(), FVec{3, 6, 9}));
}

INSTANTIATE_TEST_SUITE_P(Backends, GraphOpsTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(backend_name(info.param));
                         });

}  // namespace
}  // namespace zt
