// The tensor-parallel GPT (model/gpt.cc, degree > 1) against the one-device GPT: on T simulated devices,
// with and without sequence parallelism, every rank's losses equal the one-device losses and the
// local gradients, mapped back through the TensorMap, equal the one-device gradients (fp32,
// within summation-order tolerance); the map itself tiles every logical tensor exactly once;
// recomputation keeps every bit.
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

// The tensor-parallel model's gradients (local[t][b]: rank t's block b) at their logical places in
// `logical` (the one-device layout): every logical element covered, replicated copies equal on
// every rank, bit for bit (their sums are all-reduced).
std::vector<std::vector<float>> logical_grads(const Model& model, const ParamLayout& logical,
                                              const std::vector<std::vector<std::vector<float>>>& local) {
  const TensorMap& map = *model.tensor_map();
  std::vector<std::vector<float>> got(static_cast<size_t>(logical.num_blocks()));
  std::vector<std::vector<int>> hits(got.size());
  for (size_t b = 0; b < got.size(); ++b) {
    got[b].assign(static_cast<size_t>(logical.block(static_cast<int>(b)).numel), 0.0f);
    hits[b].assign(got[b].size(), 0);
  }
  for (size_t t = 0; t < local.size(); ++t)
    for (int b = 0; b < model.layout().num_blocks(); ++b) {
      const std::vector<float>& g = local[t][static_cast<size_t>(b)];
      map.for_each_run(static_cast<int>(t), b, 0, model.layout().block(b).numel, [&](int lb, int64_t lo, int64_t li, int64_t n) {
        for (int64_t k = 0; k < n; ++k) {
          auto& slot = got[static_cast<size_t>(lb)][static_cast<size_t>(lo + k)];
          if (hits[static_cast<size_t>(lb)][static_cast<size_t>(lo + k)]++ > 0) {
            EXPECT_EQ(slot, g[static_cast<size_t>(li + k)]) << "replicated gradient differs between tensor ranks, block " << b;
          }
          slot = g[static_cast<size_t>(li + k)];
        }
      });
    }
  for (size_t b = 0; b < got.size(); ++b)
    for (const ParamTensor& pt : logical.block(static_cast<int>(b)).tensors)
      for (int64_t k = 0; k < pt.numel; ++k) EXPECT_GE(hits[b][static_cast<size_t>(pt.offset + k)], 1) << pt.name << " not covered";
  return got;
}

// The one-device GPT's local blocks (its wte padded to a multiple of 128 rows, model/gpt.cc) from
// logical blocks.
std::vector<std::vector<float>> one_device_local(const Model& model, const std::vector<std::vector<float>>& host) {
  std::vector<const float*> logical;
  for (const auto& b : host) logical.push_back(b.data());
  std::vector<std::vector<float>> local;
  for (int b = 0; b < model.layout().num_blocks(); ++b) local.push_back(model.tensor_map()->local_block(0, b, logical));
  return local;
}

void check_degree(int D, bool sequence, int vocab = 256) {
  const ModelConfig c = tiny_config(vocab);
  const Inputs in = make_inputs(c);
  const ParamLayout L = gpt_layout(c);  // the logical blocks
  // One device: the reference.
  auto rt1 = Runtime::create_cpu(1);
  auto ref_model = make_model(c);
  const auto host = init_blocks(L, 7);
  Params ref_p(rt1->device(0), ref_model->layout(), one_device_local(*ref_model, host));
  const Result ref = run_model(*ref_model, rt1->device(0), ref_p, in);
  std::vector<std::vector<float>> ref_local;
  for (int b = 0; b < ref_model->layout().num_blocks(); ++b) ref_local.push_back(ref_p.grad_host(b));
  const std::vector<std::vector<float>> ref_grads = logical_grads(*ref_model, L, {ref_local});

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
  std::vector<std::vector<std::vector<float>>> local(static_cast<size_t>(D));
  for (int t = 0; t < D; ++t)
    for (int b = 0; b < model->layout().num_blocks(); ++b) local[static_cast<size_t>(t)].push_back(params[static_cast<size_t>(t)]->grad_host(b));
  const std::vector<std::vector<float>> got = logical_grads(*model, L, local);
  for (size_t b = 0; b < got.size(); ++b)
    expect_close(got[b], ref_grads[b], 2e-5, "gradient of block " + L.block(static_cast<int>(b)).name);
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

// Relative L2 error of each logical tensor's gradient against `want`.
void expect_tensors_close(const ParamLayout& L, const std::vector<std::vector<float>>& got,
                          const std::vector<std::vector<float>>& want, double tol, const std::string& what) {
  for (int b = 0; b < L.num_blocks(); ++b)
    for (const ParamTensor& t : L.block(b).tensors) {
      double err = 0, norm = 0;
      for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
        const double a = got[static_cast<size_t>(b)][static_cast<size_t>(i)];
        const double e = want[static_cast<size_t>(b)][static_cast<size_t>(i)];
        err += (a - e) * (a - e), norm += e * e;
      }
      ASSERT_GT(norm, 0) << what << ": " << t.name;
      EXPECT_LE(std::sqrt(err / norm), tol) << what << ": " << t.name;
    }
}

double mean(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m += x;
  return m / static_cast<double>(v.size());
}

// The tensor-parallel GPT in bf16/fp16 (parameters read in 16 bits, activations and the tensor
// collectives' data 16-bit) against the fp32 tensor-parallel run of the same 16-bit-representable
// parameters, and against the one-device 16-bit GPT. Bounds as Gpt16's (test_model.cc): the
// loss within 4u relative, every gradient tensor within 16u relative L2 (u: bf16 2^-8, fp16
// 2^-11); the one-device 16-bit GPT rounds at the same points but sums in another order, so the
// two 16-bit runs differ by at most the sum of their distances to fp32 (32u). The 16-bit run
// must not be the fp32 run's bits (a model that secretly widened would be).
void check_degree_16(int D, bool sequence, DType dt, int vocab) {
  SCOPED_TRACE(std::string(dtype_name(dt)) + ", degree " + std::to_string(D) + (sequence ? "" : ", no SP") +
               ", vocab " + std::to_string(vocab));
  const double u = dt == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
  const ModelConfig c = tiny_config(vocab);
  const Inputs in = make_inputs(c);
  // Logical parameters, norms and biases moved off 1/0 (so their 16-bit paths matter), rounded to dt.
  auto rt1 = Runtime::create_cpu(1);
  Device& d1 = rt1->device(0);
  auto one16 = make_model(c, Recompute::kNone, {}, dt);
  const ParamLayout L = gpt_layout(c);  // the logical blocks (the one-device GPT pads wte locally)
  std::vector<std::vector<float>> host = init_blocks(L, 7);
  for (int b = 0; b < L.num_blocks(); ++b) {
    for (const ParamTensor& t : L.block(b).tensors)
      if (t.init != ParamInit::kNormal)
        for (int64_t i = 0; i < t.numel; ++i)
          host[static_cast<size_t>(b)][static_cast<size_t>(t.offset + i)] += 0.1f * static_cast<float>(((i * 7 + b) % 13) - 6) / 6;
    for (float& x : host[static_cast<size_t>(b)])  // representable in dt
      x = dt == DType::kBF16 ? bf16_bits_to_float(float_to_bf16_bits(x)) : half_bits_to_float(float_to_half_bits(x));
  }
  const std::vector<std::vector<float>> one_local = one_device_local(*one16, host);
  Params16 one_p(d1, one16->layout(), dt);
  for (int b = 0; b < one16->layout().num_blocks(); ++b) EXPECT_EQ(one_p.set(b, one_local[static_cast<size_t>(b)]), one_local[static_cast<size_t>(b)]);
  const Result one = run_model(*one16, d1, one_p, in);
  std::vector<std::vector<float>> one_local_grads;
  for (int b = 0; b < one16->layout().num_blocks(); ++b) {
    one_local_grads.emplace_back(static_cast<size_t>(one16->layout().block(b).numel));
    d1.compute().copy(one_local_grads.back().data(), one_p.grads(b), one_local_grads.back().size() * 4);
  }
  d1.compute().synchronize();
  const std::vector<std::vector<float>> one_grads = logical_grads(*one16, L, {one_local_grads});

  auto rt = Runtime::create_cpu(D);
  std::vector<Device*> devs;
  for (int r = 0; r < D; ++r) devs.push_back(&rt->device(r));
  Communicator comm(devs);
  const Mesh mesh(MeshShape{.tensor = D}, D);
  std::vector<const float*> logical;
  for (const auto& b : host) logical.push_back(b.data());
  // Rank t's losses and local gradients of one micro-batch of `model` in `dtype`.
  auto run_tp = [&](const Model& model, DType dtype, std::vector<std::vector<std::vector<float>>>& grads) {
    const TensorMap& map = *model.tensor_map();
    std::vector<std::unique_ptr<ParamAccess>> params;
    std::vector<Result> results(static_cast<size_t>(D));
    for (int t = 0; t < D; ++t) {
      std::vector<std::vector<float>> local;
      for (int b = 0; b < model.layout().num_blocks(); ++b) local.push_back(map.local_block(t, b, logical));
      if (dtype == DType::kF32) {
        params.push_back(std::make_unique<Params>(*devs[static_cast<size_t>(t)], model.layout(), local));
      } else {
        auto p16 = std::make_unique<Params16>(*devs[static_cast<size_t>(t)], model.layout(), dtype);
        for (int b = 0; b < model.layout().num_blocks(); ++b) {
          const std::vector<float> wide = p16->set(b, local[static_cast<size_t>(b)]);
          EXPECT_EQ(wide, local[static_cast<size_t>(b)]) << "parameters are representable in 16 bits";
        }
        params.push_back(std::move(p16));
      }
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < D; ++t)
      threads.emplace_back([&, t] {
        results[static_cast<size_t>(t)] = run_model(model, *devs[static_cast<size_t>(t)], *params[static_cast<size_t>(t)], in);
      });
    for (auto& th : threads) th.join();
    grads.assign(static_cast<size_t>(D), {});
    for (int t = 0; t < D; ++t) {
      Device& dv = *devs[static_cast<size_t>(t)];
      for (int b = 0; b < model.layout().num_blocks(); ++b) {
        grads[static_cast<size_t>(t)].emplace_back(static_cast<size_t>(model.layout().block(b).numel));
        dv.compute().copy(grads[static_cast<size_t>(t)].back().data(), params[static_cast<size_t>(t)]->grads(b),
                          grads[static_cast<size_t>(t)].back().size() * 4);
      }
      dv.compute().synchronize();
    }
    for (int t = 1; t < D; ++t) EXPECT_EQ(results[static_cast<size_t>(t)].losses, results[0].losses) << "rank " << t;
    return results[0];
  };
  auto m16 = make_model(c, Recompute::kNone, TensorParallel{D, sequence, &comm, &mesh}, dt);
  auto m32 = make_model(c, Recompute::kNone, TensorParallel{D, sequence, &comm, &mesh});
  EXPECT_EQ(m16->activation_dtype(), dt);
  std::vector<std::vector<std::vector<float>>> g16, g32;
  const Result r16 = run_tp(*m16, dt, g16), r32 = run_tp(*m32, DType::kF32, g32);
  const auto tp16 = logical_grads(*m16, L, g16), tp32 = logical_grads(*m32, L, g32);
  EXPECT_NEAR(mean(r16.losses), mean(r32.losses), 4 * u * mean(r32.losses));
  EXPECT_NEAR(mean(r16.losses), mean(one.losses), 8 * u * mean(r32.losses));
  expect_tensors_close(L, tp16, tp32, 16 * u, "16-bit TP vs fp32 TP");
  expect_tensors_close(L, tp16, one_grads, 32 * u, "16-bit TP vs 16-bit one device");
  EXPECT_NE(tp16, tp32) << "the 16-bit model computed the fp32 bits";
}

TEST(GptTensorParallel, SixteenBitTracksFp32AndTheOneDevice16BitGpt) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    check_degree_16(2, true, dt, 256);
    check_degree_16(2, false, dt, 256);
  }
  check_degree_16(4, true, DType::kBF16, 250);  // a padded vocabulary, a shard partly padding
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

// --recompute selective|full under tensor parallelism: every rank's losses and local gradients
// bitwise equal to --recompute none's (the re-run layers gather and reduce again in backward).
TEST(GptTensorParallel, RecomputeGivesTheBitsOfNone) {
  const ModelConfig c = tiny_config();
  const Inputs in = make_inputs(c);
  const auto host = init_blocks(gpt_layout(c), 7);
  std::vector<const float*> logical;
  for (const auto& b : host) logical.push_back(b.data());
  constexpr int D = 2;
  auto rt = Runtime::create_cpu(D);
  std::vector<Device*> devs = {&rt->device(0), &rt->device(1)};
  Communicator comm(devs);
  const Mesh mesh(MeshShape{.tensor = D}, D);
  for (bool sequence : {true, false}) {
    // Per rank: losses, then every local block's gradient.
    auto run = [&](Recompute r) {
      auto model = make_model(c, r, TensorParallel{D, sequence, &comm, &mesh});
      std::vector<std::unique_ptr<Params>> params;
      for (int t = 0; t < D; ++t) {
        std::vector<std::vector<float>> local;
        for (int b = 0; b < model->layout().num_blocks(); ++b) local.push_back(model->tensor_map()->local_block(t, b, logical));
        params.push_back(std::make_unique<Params>(*devs[static_cast<size_t>(t)], model->layout(), local));
      }
      std::vector<std::vector<std::vector<float>>> out(D);
      std::vector<std::thread> threads;
      for (int t = 0; t < D; ++t)
        threads.emplace_back([&, t] {
          out[static_cast<size_t>(t)].push_back(run_model(*model, *devs[static_cast<size_t>(t)], *params[static_cast<size_t>(t)], in).losses);
        });
      for (auto& th : threads) th.join();
      for (int t = 0; t < D; ++t)
        for (int b = 0; b < model->layout().num_blocks(); ++b) out[static_cast<size_t>(t)].push_back(params[static_cast<size_t>(t)]->grad_host(b));
      return out;
    };
    const auto none = run(Recompute::kNone);
    EXPECT_EQ(run(Recompute::kSelective), none) << "selective, sequence parallelism " << sequence;
    EXPECT_EQ(run(Recompute::kFull), none) << "full, sequence parallelism " << sequence;
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
}

}  // namespace
}  // namespace zt
