// The tensor-parallel GPT (model/gpt_tp.cc) against the one-device GPT: on T simulated devices,
// with and without sequence parallelism, every rank's losses equal the one-device losses and the
// local gradients, mapped back through the TensorMap, equal the one-device gradients (fp32,
// within summation-order tolerance); the map itself tiles every logical tensor exactly once.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "resident_params.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

// vocab 256 splits evenly at T = 2 and 4 (padded to a multiple of 64 T: no padding); 250 pads to
// 256, the last shard partly padding.
ModelConfig tiny_config(int vocab = 256) {
  ModelOverrides o;
  o.layers = 2;
  o.embd = 32;
  o.heads = 4;
  o.seq_len = 16;
  o.vocab = vocab;
  return make_model_config("gpt-tiny", o);
}


using Params = ResidentParams;

struct Inputs {
  int B = 2, T = 8;
  std::vector<int32_t> tokens, targets;
};

Inputs make_inputs(const ModelConfig& c) {
  Inputs in;
  for (int i = 0; i < in.B * in.T; ++i) {
    in.tokens.push_back((i * 37 + 11) % c.vocab);
    in.targets.push_back(i % 7 == 3 ? -1 : (i * 53 + 5) % c.vocab);  // some ignored positions
  }
  return in;
}

struct Result {
  std::vector<float> losses;
  std::vector<std::vector<float>> grads;  // logical blocks
};

// Forward (train) + backward of one micro-batch on one device.
Result run_model(const Model& model, Device& d, ParamAccess& p, const Inputs& in) {
  Stream& s = d.compute();
  auto ws = model.make_workspace(d, in.B, in.T);
  DeviceBuffer tok(d.memory(), in.tokens.size() * 4, s, "t"), tgt(d.memory(), in.targets.size() * 4, s, "t");
  s.copy(tok.data(), in.tokens.data(), in.tokens.size() * 4);
  s.copy(tgt.data(), in.targets.data(), in.targets.size() * 4);
  Batch batch;
  batch.B = in.B;
  batch.T = in.T;
  batch.inputs = ConstTensorView{tok.data(), DType::kI32, Shape{in.B, in.T}, d.index()};
  batch.targets = ConstTensorView{tgt.data(), DType::kI32, Shape{in.B, in.T}, d.index()};
  const float dloss = 1.0f / static_cast<float>(in.B * in.T);
  model.forward(s, p, *ws, batch, dloss, true);
  Result r;
  r.losses.resize(static_cast<size_t>(in.B * in.T));
  s.copy(r.losses.data(), ws->losses().data, r.losses.size() * 4);
  model.backward(s, p, *ws, batch);
  s.synchronize();
  return r;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * std::max(scale, 1e-3)) << what << " element " << i;
}

void check_degree(int D, bool sequence, int vocab = 256) {
  const ModelConfig c = tiny_config(vocab);
  const Inputs in = make_inputs(c);
  // One device: the reference.
  auto rt1 = Runtime::create_cpu(1);
  auto ref_model = make_model(c);
  const auto host = init_blocks(ref_model->layout(), 7);
  Params ref_p(rt1->device(0), ref_model->layout(), host);
  const Result ref = run_model(*ref_model, rt1->device(0), ref_p, in);
  std::vector<std::vector<float>> ref_grads;
  for (int b = 0; b < ref_model->layout().num_blocks(); ++b) ref_grads.push_back(ref_p.grad_host(b));

  auto rt = Runtime::create_cpu(D);
  std::vector<Device*> devs;
  for (int r = 0; r < D; ++r) devs.push_back(&rt->device(r));
  Communicator comm(devs);
  const Mesh mesh(MeshShape{.tensor = D}, D);
  auto model = make_model(c, Recompute::kNone, TensorParallel{D, sequence, &comm, &mesh});
  const TensorMap& map = *model->tensor_map();
  std::vector<const float*> logical;
  for (const auto& b : host) logical.push_back(b.data());
  std::vector<std::unique_ptr<Params>> params;
  for (int t = 0; t < D; ++t) {
    std::vector<std::vector<float>> local;
    for (int b = 0; b < model->layout().num_blocks(); ++b) local.push_back(map.local_block(t, b, logical));
    params.push_back(std::make_unique<Params>(*devs[static_cast<size_t>(t)], model->layout(), local));
  }
  std::vector<Result> results(static_cast<size_t>(D));
  std::vector<std::thread> threads;
  for (int t = 0; t < D; ++t)
    threads.emplace_back([&, t] { results[static_cast<size_t>(t)] = run_model(*model, *devs[static_cast<size_t>(t)], *params[static_cast<size_t>(t)], in); });
  for (auto& th : threads) th.join();

  // Losses: every rank holds every position's loss.
  for (int t = 0; t < D; ++t) expect_close(results[static_cast<size_t>(t)].losses, ref.losses, 1e-5, "losses of rank " + std::to_string(t));
  // Gradients: each local element back at its logical place; replicated copies must agree too.
  std::vector<std::vector<float>> got(ref_grads.size());
  std::vector<std::vector<int>> hits(ref_grads.size());
  for (size_t b = 0; b < got.size(); ++b) got[b].assign(ref_grads[b].size(), 0.0f), hits[b].assign(ref_grads[b].size(), 0);
  for (int t = 0; t < D; ++t)
    for (int b = 0; b < model->layout().num_blocks(); ++b) {
      const std::vector<float> g = params[static_cast<size_t>(t)]->grad_host(b);
      map.for_each_run(t, b, 0, model->layout().block(b).numel, [&](int lb, int64_t lo, int64_t li, int64_t n) {
        for (int64_t k = 0; k < n; ++k) {
          auto& slot = got[static_cast<size_t>(lb)][static_cast<size_t>(lo + k)];
          if (hits[static_cast<size_t>(lb)][static_cast<size_t>(lo + k)]++ > 0) {
            ASSERT_EQ(slot, g[static_cast<size_t>(li + k)]) << "replicated gradient differs between tensor ranks, block " << b;
          }
          slot = g[static_cast<size_t>(li + k)];
        }
      });
    }
  for (size_t b = 0; b < got.size(); ++b) {
    for (const ParamTensor& pt : ref_model->layout().block(static_cast<int>(b)).tensors)
      for (int64_t k = 0; k < pt.numel; ++k) ASSERT_GE(hits[b][static_cast<size_t>(pt.offset + k)], 1) << pt.name << " not covered";
    expect_close(got[b], ref_grads[b], 2e-5, "gradient of block " + ref_model->layout().block(static_cast<int>(b)).name);
  }
}

TEST(GptTensorParallel, MatchesOneDeviceWithSequenceParallelism) {
  check_degree(2, true);
  check_degree(4, true);
}

TEST(GptTensorParallel, MatchesOneDeviceWithoutSequenceParallelism) {
  check_degree(2, false);
  check_degree(4, false);
}

// GPT-2's vocabulary divides by no degree: it is padded (here 250 -> 256), and the padding rows
// neither change the loss nor appear in the gradients.
TEST(GptTensorParallel, MatchesOneDeviceWithAPaddedVocabulary) {
  check_degree(2, true, 250);
  check_degree(4, true, 250);
  check_degree(4, false, 250);
}

TEST(GptTensorParallel, MapTilesEveryLogicalTensorOncePerSplit) {
  const ModelConfig c = tiny_config(250);
  for (int D : {2, 4}) {
    auto model = make_model(c, Recompute::kNone, TensorParallel{D, true, nullptr, nullptr});
    const TensorMap& map = *model->tensor_map();
    const ParamLayout& L = *map.logical;
    const auto host = init_blocks(L, 3);
    std::vector<const float*> logical;
    for (const auto& b : host) logical.push_back(b.data());
    // Rebuild every logical tensor from the local blocks: split tensors are covered once by the
    // union of the ranks, replicated ones once by each rank.
    for (int t = 0; t < D; ++t) {
      for (int b = 0; b < model->layout().num_blocks(); ++b) {
        const std::vector<float> local = map.local_block(t, b, logical);
        map.for_each_run(t, b, 0, model->layout().block(b).numel, [&](int lb, int64_t lo, int64_t li, int64_t n) {
          for (int64_t k = 0; k < n; ++k)
            ASSERT_EQ(local[static_cast<size_t>(li + k)], host[static_cast<size_t>(lb)][static_cast<size_t>(lo + k)]);
        });
      }
    }
    int64_t replicated = 0;
    for (int b = 0; b < model->layout().num_blocks(); ++b) {
      const auto& tensors = model->layout().block(b).tensors;
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (map.places[static_cast<size_t>(b)][i].split != TensorSplit::kReplicated) continue;
        replicated += tensors[i].numel;
        EXPECT_GE(tensors[i].offset, map.replicated_from(b)) << "replicated tensors come last in " << tensors[i].name;
      }
    }
    // Split tensors hold 1/D of their elements on each rank (wte: of its padded rows), replicated
    // ones all of them.
    const int64_t padding = (model->layout().block(0).tensors[0].shape[0] * D - c.vocab) * c.embd;
    EXPECT_EQ(model->layout().total_parameters() * D, L.total_parameters() + (D - 1) * replicated + padding);
  }
}

TEST(GptTensorParallel, RefusesDegreesThatDoNotDivideTheModel) {
  const ModelConfig c = tiny_config();  // 4 heads, width 32
  try {
    make_model(c, Recompute::kNone, TensorParallel{3, true, nullptr, nullptr});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("heads (4)"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("nearest valid degree is 2"), std::string::npos) << e.message();
  }
  EXPECT_THROW(make_model(c, Recompute::kFull, TensorParallel{2, true, nullptr, nullptr}), Error);
}

}  // namespace
}  // namespace zt
