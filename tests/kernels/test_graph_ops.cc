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

class GraphOpsTest : public OpsFixture {};

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
  c.issue(s());  // warm-up: library state a stream creates on first use comes from the pool
  sync();

  s().begin_capture();
  c.issue(s());
  const std::unique_ptr<StreamGraph> g = s().end_capture();
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
