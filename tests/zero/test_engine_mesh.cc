// ZeRO over a (data x tensor) mesh: each tensor coordinate of a tensor-parallel engine computes the
// bits a separate data-parallel engine of N / T devices computes on the same blocks and batches,
// at every stage, in fp32 and bf16, with accumulation; the overflow flag spans the whole mesh; the
// memory plan shards over the data group.
#include <gtest/gtest.h>

#include "sanitizer.h"
#include "test_util.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <functional>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "runtime/host_staging.h"
#include "runtime/runtime.h"
#include "train/world.h"
#include "zero/engine.h"

namespace zt {
namespace {

constexpr bool kSanitizer = test::kThreadSanitizer;
constexpr int kMicro = 2;  // micro-batches per step (gradient accumulation)
constexpr int kRows = 2;   // rows per micro-batch

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

ModelConfig mlp_config() {
  ModelOverrides o;
  o.hidden = {32};
  return make_model_config("mlp", o);
}

ModelConfig gpt_config() {
  ModelOverrides o;
  o.layers = 2, o.embd = 32, o.heads = 2, o.seq_len = 16;
  return make_model_config("gpt-tiny", o);
}

// One micro-batch on the host, a pure function of (tensor coordinate, data index, step, micro):
// every tensor coordinate sees its own data, as a tensor-parallel model's ranks would not, so that
// mixing coordinates anywhere changes the bits.
struct HostBatch {
  std::vector<float> images;
  std::vector<int32_t> tokens, targets;
};

HostBatch make_batch(const ModelConfig& mc, int tensor, int data, int step, int micro) {
  test_util::Rng rng(1000003ull * static_cast<uint64_t>(tensor + 1) + 7919ull * static_cast<uint64_t>(data) +
                     101ull * static_cast<uint64_t>(step) + static_cast<uint64_t>(micro));
  HostBatch b;
  if (mc.kind == ModelKind::kMlp) {
    b.images = rng.normal(static_cast<int64_t>(kRows) * mc.input_dim);
    b.targets = rng.ints(kRows, 0, mc.classes);
  } else {
    b.tokens = rng.ints(static_cast<int64_t>(kRows) * mc.seq_len, 0, mc.vocab);
    b.targets = rng.ints(static_cast<int64_t>(kRows) * mc.seq_len, 0, mc.vocab);
  }
  return b;
}

// Full parameters of one tensor coordinate (its own seed).
std::vector<std::vector<float>> make_params(const Model& model, int tensor) {
  const ParamLayout& L = model.layout();
  std::vector<std::vector<float>> host(static_cast<size_t>(L.num_blocks()));
  for (int b = 0; b < L.num_blocks(); ++b) {
    host[static_cast<size_t>(b)].resize(static_cast<size_t>(L.block(b).numel));
    init_block_host(L.block(b), 17 + 31 * static_cast<uint64_t>(tensor), host[static_cast<size_t>(b)].data());
  }
  return host;
}

// What one rank saw in one step.
struct RankStep {
  std::vector<float> losses, norms;
  float found_inf = 0;
  optim::LossScaleState scale{};
};

struct Poke {
  int rank, block;
  int64_t offset;
  float value;
};

// An engine on its own simulated devices, driven the way the trainer drives it: one host thread
// per rank, every micro-batch's forward and backward, the gradient check, then the update. The
// model computes in the dtype a training run's would (run_activation_dtype: 16 bits with 16-bit
// working parameters, reading them as the engine holds them).
class EngineRun {
 public:
  // activations: the model's activation dtype, if not the run's.
  EngineRun(const ModelConfig& mc, int devices, const ZeroOptions& opt, CommPath path = CommPath::kAuto,
            std::optional<DType> activations = std::nullopt)
      : mc_(mc),
        model_(make_model(mc, Recompute::kNone, {}, activations.value_or(run_activation_dtype(opt.working)))),
        rt_(Runtime::create_cpu(devices)), mesh_({.data = devices / opt.tensor, .tensor = opt.tensor}, devices) {
    for (int r = 0; r < devices; ++r) devs_.push_back(&rt_->device(r));
    comm_ = std::make_unique<Communicator>(devs_, Communicator::kDefaultChunkBytes, path);
    engine_ = std::make_unique<ZeroEngine>(*model_, devs_, *comm_, opt);
    const int T = mc.kind == ModelKind::kGpt ? mc.seq_len : 1;
    const size_t in = static_cast<size_t>(kRows) * static_cast<size_t>(mc.kind == ModelKind::kGpt ? T : mc.input_dim) * 4;
    for (Device* d : devs_) {
      ranks_.push_back({});
      PerRank& R = ranks_.back();
      R.ws = model_->make_workspace(*d, kRows, T);
      R.inputs = DeviceBuffer(d->memory(), in, d->compute(), "batch");
      R.targets = DeviceBuffer(d->memory(), static_cast<size_t>(kRows) * static_cast<size_t>(T) * 4, d->compute(), "batch");
      R.norms = DeviceBuffer(d->memory(), static_cast<size_t>(2 * model_->layout().num_blocks()) * 4, d->compute(), "norms");
      // A clip factor, the same for every rank of both runs (device memory, read by the update).
      R.clip = DeviceBuffer(d->memory(), sizeof(float), d->compute(), "clip");
      ops::fill(d->compute(), TensorView{R.clip.data(), DType::kF32, Shape{1}, d->index()}, 0.75f);
    }
  }

  ZeroEngine& engine() { return *engine_; }
  Communicator& comm() { return *comm_; }
  const Model& model() const { return *model_; }
  const Mesh& mesh() const { return mesh_; }
  Device& device(int r) { return *devs_[static_cast<size_t>(r)]; }
  const std::vector<Device*>& devices() const { return devs_; }
  int size() const { return static_cast<int>(devs_.size()); }
  size_t extra_resident(int r) const {  // what this harness keeps besides the engine (pool blocks)
    const PerRank& R = ranks_[static_cast<size_t>(r)];
    return pool_rounded_size(R.ws->bytes()) + pool_rounded_size(R.inputs.size()) + pool_rounded_size(R.targets.size()) +
           pool_rounded_size(R.norms.size());
  }

  // Rank r's parameters: those of its tensor coordinate.
  void load(const std::function<std::vector<std::vector<float>>(int tensor)>& params) {
    for (int r = 0; r < size(); ++r) engine_->rank(r).load_parameters(params(mesh_.coord(r).tensor));
  }

  // One step. batch(r, m): rank r's micro-batch m. skip: mark the step overflowed on every rank
  // (after the gradient check) whatever the flag says.
  std::vector<RankStep> step(int step, const std::function<HostBatch(int, int)>& batch, const std::vector<Poke>& pokes,
                             bool skip, float dloss) {
    std::vector<RankStep> out(static_cast<size_t>(size()));
    const int nb = model_->layout().num_blocks();
    run_ranks(size(), [&](int r) {
      PerRank& R = ranks_[static_cast<size_t>(r)];
      Stream& s = device(r).compute();
      RankStep& o = out[static_cast<size_t>(r)];
      for (int m = 0; m < kMicro; ++m) {
        const HostBatch hb = batch(r, m);
        const bool gpt = mc_.kind == ModelKind::kGpt;
        const int T = gpt ? mc_.seq_len : 1;
        if (gpt) s.copy(R.inputs.data(), hb.tokens.data(), hb.tokens.size() * 4);
        else s.copy(R.inputs.data(), hb.images.data(), hb.images.size() * 4);
        s.copy(R.targets.data(), hb.targets.data(), hb.targets.size() * 4);
        Batch bt;
        bt.inputs = gpt ? ConstTensorView(R.inputs.data(), DType::kI32, Shape{kRows, T}, device(r).index())
                        : ConstTensorView(R.inputs.data(), DType::kF32, Shape{kRows, mc_.input_dim}, device(r).index());
        bt.targets = gpt ? ConstTensorView(R.targets.data(), DType::kI32, Shape{kRows, T}, device(r).index())
                         : ConstTensorView(R.targets.data(), DType::kI32, Shape{kRows}, device(r).index());
        bt.B = kRows, bt.T = T;
        bt.loss_scale = engine_->rank(r).scaler().scale_device();
        engine_->rank(r).begin_micro_batch(m);
        model_->forward(s, engine_->rank(r), *R.ws, bt, dloss, true);
        model_->backward(s, engine_->rank(r), *R.ws, bt);
        engine_->rank(r).end_micro_batch();
        std::vector<float> l(static_cast<size_t>(kRows * T));
        s.copy(l.data(), R.ws->losses().data, l.size() * 4);
        s.synchronize();  // hb and l live in this frame
        o.losses.insert(o.losses.end(), l.begin(), l.end());
      }
      for (const Poke& p : pokes)
        if (p.rank == r) engine_->rank(r).poke_gradient(p.block, p.offset, p.value);
      engine_->rank(r).check_gradients(R.norms.as<float>());
      o.norms.resize(static_cast<size_t>(nb));
      s.copy(o.norms.data(), R.norms.data(), o.norms.size() * 4);
      s.copy(&o.found_inf, engine_->rank(r).scaler().found_inf_device(), 4);
      s.synchronize();
    }, *comm_);
    if (skip)
      for (int r = 0; r < size(); ++r) engine_->rank(r).scaler().mark_overflow();
    OptimizerStep os;
    os.lr = 1e-2f;
    os.weight_decay = 0.1f;
    os.step = step + 1;
    run_ranks(size(), [&](int r) {
      OptimizerStep mine = os;
      mine.grad_scale = ranks_[static_cast<size_t>(r)].clip.as<float>();
      engine_->rank(r).optimizer_step(mine);
      device(r).compute().synchronize();
      out[static_cast<size_t>(r)].scale = engine_->rank(r).scaler().state();
    }, *comm_);
    return out;
  }

 private:
  struct PerRank {
    std::unique_ptr<Workspace> ws;
    DeviceBuffer inputs, targets, norms, clip;
  };
  ModelConfig mc_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Runtime> rt_;
  Mesh mesh_;
  std::vector<Device*> devs_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<ZeroEngine> engine_;
  std::vector<PerRank> ranks_;
};

struct Case {
  ModelConfig mc;
  int devices = 4, tensor = 2, stage = 0, steps = 3;
  DType working = DType::kF32;
  int poke_step = -1;    // this step, a non-finite gradient on the mesh's last rank
  int switch_step = -1;  // before this step, set_working_dtype(bf16) (from f16)
  float offload = 0;     // optimizer offload fraction (0: none)
};

std::string describe(const Case& c) {
  return c.mc.preset + " N=" + std::to_string(c.devices) + " T=" + std::to_string(c.tensor) + " stage " +
         std::to_string(c.stage) + " " + dtype_name(c.working);
}

ZeroOptions options(const Case& c, int tensor) {
  ZeroOptions o;
  o.stage = c.stage;
  o.tensor = tensor;
  o.micro_batches = kMicro;
  o.working = c.working;
  o.offload = c.offload > 0;
  o.offload_fraction = c.offload > 0 ? c.offload : 1.0f;
  if (c.working != DType::kF32) {
    o.scaling = ZeroOptions::Scaling::kDynamic;
    o.initial_scale = 1024.0f;
    o.scale_config.growth_interval = 2;  // the scale moves during the run
  }
  return o;
}

// The mesh engine against one data-parallel engine per tensor coordinate: losses, gradient norms,
// flags and loss-scale states each step; master weights, moments, working parameters and shards at
// the end; and the bytes each rank sent, all bit for bit.
void expect_mesh_matches_separate_engines(const Case& c) {
  SCOPED_TRACE(describe(c));
  const int N = c.devices, T = c.tensor, D = N / T;
  EngineRun mesh(c.mc, N, options(c, T));
  ASSERT_EQ(mesh.engine().world(), N);
  ASSERT_EQ(mesh.engine().data_size(), D);
  ASSERT_EQ(mesh.engine().tensor_size(), T);
  std::vector<std::unique_ptr<EngineRun>> refs;
  for (int t = 0; t < T; ++t) refs.push_back(std::make_unique<EngineRun>(c.mc, D, options(c, 1)));
  const float dloss = 1.0f / static_cast<float>(kRows * kMicro * D * (c.mc.kind == ModelKind::kGpt ? c.mc.seq_len : 1));
  mesh.load([&](int t) { return make_params(mesh.model(), t); });
  for (int t = 0; t < T; ++t) refs[static_cast<size_t>(t)]->load([&](int) { return make_params(mesh.model(), t); });

  const int steps = kSanitizer ? std::min(c.steps, 2) : c.steps;
  const int last = N - 1;
  const MeshCoord poked = mesh.mesh().coord(last);
  std::vector<std::vector<float>> before(static_cast<size_t>(T));  // block 0 before the poked step
  for (int step = 0; step < steps; ++step) {
    if (step == c.switch_step) {
      mesh.engine().set_working_dtype(DType::kBF16);
      for (auto& ref : refs) ref->engine().set_working_dtype(DType::kBF16);
    }
    const bool poke = step == c.poke_step;
    if (poke)
      for (int t = 0; t < T; ++t) before[static_cast<size_t>(t)] = mesh.engine().master_to_host(0, t);
    std::vector<Poke> mesh_pokes;
    if (poke) mesh_pokes.push_back({last, 0, 0, std::numeric_limits<float>::infinity()});
    const auto got = mesh.step(step, [&](int r, int m) {
      const MeshCoord x = mesh.mesh().coord(r);
      return make_batch(c.mc, x.tensor, x.data, step, m);
    }, mesh_pokes, false, dloss);
    for (int t = 0; t < T; ++t) {
      // The reference of the poked coordinate gets the same poke; the others are told to skip,
      // which is what the mesh's summed flag does to them.
      std::vector<Poke> ref_pokes;
      if (poke && t == poked.tensor) ref_pokes.push_back({poked.data, 0, 0, std::numeric_limits<float>::infinity()});
      const auto want = refs[static_cast<size_t>(t)]->step(step, [&](int d, int m) { return make_batch(c.mc, t, d, step, m); },
                                                          ref_pokes, poke && t != poked.tensor, dloss);
      for (int d = 0; d < D; ++d) {
        const int r = mesh.mesh().rank_at({.data = d, .tensor = t});
        const RankStep& g = got[static_cast<size_t>(r)];
        const RankStep& w = want[static_cast<size_t>(d)];
        SCOPED_TRACE("step " + std::to_string(step) + " rank " + std::to_string(r));
        EXPECT_TRUE(same_bits(g.losses, w.losses));
        EXPECT_TRUE(same_bits(g.norms, w.norms));
        EXPECT_EQ(std::memcmp(&g.scale, &w.scale, sizeof g.scale), 0) << "loss-scale state";
        EXPECT_EQ(g.found_inf > 0, poke) << "every rank of the mesh sees the overflow of rank " << last;
      }
    }
    for (int t = 0; t < T && poke; ++t) {
      EXPECT_TRUE(same_bits(before[static_cast<size_t>(t)], mesh.engine().master_to_host(0, t)))
            << "tensor " << t << " updated in an overflowed step";
    }
  }

  const int nb = mesh.model().layout().num_blocks();
  for (int t = 0; t < T; ++t) {
    ZeroEngine& ref = refs[static_cast<size_t>(t)]->engine();
    for (int b = 0; b < nb; ++b) {
      SCOPED_TRACE("tensor " + std::to_string(t) + " block " + std::to_string(b));
      EXPECT_TRUE(same_bits(mesh.engine().master_to_host(b, t), ref.master_to_host(b))) << "master weights";
      EXPECT_TRUE(same_bits(mesh.engine().block_to_host(b, t), ref.block_to_host(b))) << "working parameters";
      for (int d = 0; d < D; ++d) {
        const int r = mesh.mesh().rank_at({.data = d, .tensor = t});
        EXPECT_TRUE(same_bits(mesh.engine().rank(r).moments_to_host(b), ref.rank(d).moments_to_host(b))) << "moments, rank " << r;
        const ShardRange a = mesh.engine().rank(r).shard_of(b), e = ref.rank(d).shard_of(b);
        EXPECT_EQ(a.begin, e.begin);
        EXPECT_EQ(a.end, e.end);
        EXPECT_EQ(a.padded_numel, e.padded_numel);
        EXPECT_EQ(mesh.engine().rank(r).state_range(b), ref.rank(d).state_range(b));
        if (b == 0) {
          EXPECT_EQ(mesh.engine().rank(r).host_peak_bytes(), ref.rank(d).host_peak_bytes()) << "rank " << r;
        }
      }
    }
  }
  // The coordinates really hold different values (so a mix-up above could not pass unseen).
  if (T > 1) {
    EXPECT_FALSE(same_bits(mesh.engine().master_to_host(0, 0), mesh.engine().master_to_host(0, 1)));
  }
  // Gradients and parameters travel on the data group, as much as in a D-device engine; the world
  // group carries only the overflow flag (an all-reduce of N floats per step).
  const auto flag_bytes = [&](int n) { return static_cast<uint64_t>(steps) * 2 * static_cast<uint64_t>(n - 1) * 4; };
  for (int r = 0; r < N; ++r) {
    const MeshCoord x = mesh.mesh().coord(r);
    const uint64_t ref_sent = refs[static_cast<size_t>(x.tensor)]->comm().counters(x.data).bytes_sent;
    EXPECT_EQ(mesh.comm().counters(r).bytes_sent, ref_sent - flag_bytes(D) + flag_bytes(N)) << "rank " << r;
    if (T > 1) {
      EXPECT_EQ(mesh.comm().world_group().counters(r).bytes_sent, flag_bytes(N)) << "rank " << r;
    }
  }
}

TEST(ZeroMesh, EachTensorCoordinateMatchesItsOwnDataParallelEngineAtEveryStage) {
  for (DType w : {DType::kF32, DType::kBF16})
    for (int stage = 0; stage <= 3; ++stage) {
      Case c;
      c.mc = mlp_config();
      c.stage = stage;
      c.working = w;
      expect_mesh_matches_separate_engines(c);
    }
}

// The bf16 MLP computes in 16 bits (reading the engine's bf16 working parameters) and gives the
// same bits at every ZeRO stage: each step's losses, the master weights and working parameters at
// the end; and they are not the bits of the same engine run with fp32 activations (the widened
// parameters of before), so the 16-bit path really ran.
TEST(ZeroMesh, Bf16MlpStagesAgreeBitForBit) {
  const ModelConfig mc = mlp_config();
  const int devices = 2, steps = kSanitizer ? 2 : 3;
  const float dloss = 1.0f / static_cast<float>(kRows * kMicro * devices);
  struct Bits {
    std::vector<float> losses;
    std::vector<std::vector<float>> master, working;
  };
  auto run = [&](int stage, bool sixteen) {
    Case c;
    c.mc = mc, c.stage = stage, c.working = DType::kBF16;
    EngineRun e(mc, devices, options(c, 1), CommPath::kAuto,
                sixteen ? std::nullopt : std::optional<DType>(DType::kF32));
    EXPECT_EQ(e.model().activation_dtype(), sixteen ? DType::kBF16 : DType::kF32);
    e.load([&](int) { return make_params(e.model(), 0); });
    Bits out;
    for (int step = 0; step < steps; ++step) {
      const auto got = e.step(step, [&](int r, int m) { return make_batch(mc, 0, r, step, m); }, {}, false, dloss);
      for (const RankStep& g : got) out.losses.insert(out.losses.end(), g.losses.begin(), g.losses.end());
    }
    for (int b = 0; b < e.model().layout().num_blocks(); ++b) {
      out.master.push_back(e.engine().master_to_host(b));
      out.working.push_back(e.engine().block_to_host(b));
    }
    return out;
  };
  const Bits s0 = run(0, true);
  for (int stage = 1; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const Bits s = run(stage, true);
    EXPECT_TRUE(same_bits(s.losses, s0.losses));
    for (size_t b = 0; b < s0.master.size(); ++b) {
      EXPECT_TRUE(same_bits(s.master[b], s0.master[b])) << "master weights, block " << b;
      EXPECT_TRUE(same_bits(s.working[b], s0.working[b])) << "working parameters, block " << b;
    }
  }
  EXPECT_FALSE(same_bits(run(0, false).losses, s0.losses)) << "the bf16 MLP computed the fp32 bits";
}

TEST(ZeroMesh, TinyGptMatchesAtEveryStage) {
  for (auto [stage, w] : {std::pair{0, DType::kF32}, std::pair{1, DType::kBF16}, std::pair{2, DType::kF32},
                          std::pair{3, DType::kBF16}}) {
    Case c;
    c.mc = gpt_config();
    c.stage = stage;
    c.working = w;
    c.steps = 2;
    expect_mesh_matches_separate_engines(c);
  }
}

TEST(ZeroMesh, TensorDegreeFourLeavesOneRankPerDataGroup) {
  for (auto [stage, w] : {std::pair{0, DType::kF32}, std::pair{2, DType::kBF16}, std::pair{3, DType::kF32}}) {
    Case c;
    c.mc = mlp_config();
    c.tensor = 4;
    c.stage = stage;
    c.working = w;
    c.steps = 2;
    expect_mesh_matches_separate_engines(c);
  }
}

// A non-finite gradient on one rank makes all four skip: the other tensor coordinate, whose own
// gradients are finite, matches a data-parallel engine that was told to skip that step.
TEST(ZeroMesh, OneRanksOverflowSkipsTheStepOnEveryRankOfTheMesh) {
  for (int stage : {1, 3}) {
    Case c;
    c.mc = mlp_config();
    c.stage = stage;
    c.working = DType::kBF16;
    c.poke_step = 1;
    expect_mesh_matches_separate_engines(c);
  }
}

// Switching the working dtype mid-run re-gathers the parameters over each data group.
TEST(ZeroMesh, SwitchingTheWorkingDtypeGathersOverTheDataGroup) {
  for (int stage : {1, 2, 3}) {
    Case c;
    c.mc = mlp_config();
    c.stage = stage;
    c.working = DType::kF16;
    c.switch_step = 1;
    expect_mesh_matches_separate_engines(c);
  }
}

// Offload keeps the first part of each rank's data-group shard on the host.
TEST(ZeroMesh, OffloadedOptimizerStateFollowsTheDataGroupShards) {
  for (auto [stage, w] : {std::pair{1, DType::kBF16}, std::pair{3, DType::kF32}}) {
    Case c;
    c.mc = mlp_config();
    c.stage = stage;
    c.working = w;
    c.offload = 0.5f;
    c.steps = 2;
    expect_mesh_matches_separate_engines(c);
    // A rank's host arena: the 2-device plan's (its shards are over the data group of 2).
    const auto model = make_model(c.mc);
    EXPECT_GT(plan_engine_memory(*model, 4, options(c, 2)).host, 0u);
    EXPECT_EQ(plan_engine_memory(*model, 4, options(c, 2)).host, plan_engine_memory(*model, 2, options(c, 1)).host);
  }
}

TEST(ZeroMesh, TensorDegreeMustDivideTheDevices) {
  const auto model = make_model(mlp_config());
  auto rt = Runtime::create_cpu(4);
  std::vector<Device*> devs;
  for (int r = 0; r < 4; ++r) devs.push_back(&rt->device(r));
  Communicator comm(devs);
  for (int t : {3, 0, 8}) {
    ZeroOptions o;
    o.tensor = t;
    try {
      ZeroEngine e(*model, devs, comm, o);
      ADD_FAILURE() << "tensor " << t << " on 4 devices was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(e.message().find("does not divide the 4 devices"), std::string::npos) << e.message();
    }
    EXPECT_THROW(plan_engine_memory(*model, 4, o), Error);
  }
  ZeroOptions o;
  o.tensor = 2;
  ZeroEngine e(*model, devs, comm, o);
  EXPECT_THROW(e.block_to_host(0, 2), Error) << "tensor coordinate out of range";
}

// The plan of a tensor-2 engine on 4 devices is the 2-device plan (but for the overflow flags, one
// float per device), and it predicts the pool peak a training step reaches, as the trainer's plan
// does (train/test_plan.cc): resident blocks plus the transient peak, within 5%.
TEST(ZeroMesh, MemoryPlanShardsOverTheDataGroupAndMatchesThePoolPeak) {
  const ModelConfig mc = kSanitizer ? gpt_config() : make_model_config("gpt-tiny");
  const auto model = make_model(mc);
  const int nb = model->layout().num_blocks();
  for (int stage = 0; stage <= 3; ++stage)
    for (DType w : {DType::kF32, DType::kBF16}) {
      Case c;
      c.mc = mc;
      c.stage = stage;
      c.working = w;
      const EngineMemoryPlan p4 = plan_engine_memory(*model, 4, options(c, 2));
      const EngineMemoryPlan p2 = plan_engine_memory(*model, 2, options(c, 1));
      SCOPED_TRACE(describe(c));
      ASSERT_EQ(p4.resident.size(), p2.resident.size());
      // Resident order: the blocks' buffers, the loss-scale state, the flags, the two lists.
      const size_t flags = p4.resident.size() - 3;
      for (size_t i = 0; i < p4.resident.size(); ++i)
        EXPECT_EQ(p4.resident[i], i == flags ? p2.resident[i] * 2 : p2.resident[i]) << "resident buffer " << i;
      EXPECT_EQ(p4.resident[flags], 4 * sizeof(float));
      EXPECT_EQ(p4.state.total(), p2.state.total());
      ASSERT_EQ(p4.train_peak.size(), p2.train_peak.size());
      for (size_t i = 0; i < p4.train_peak.size(); ++i) EXPECT_EQ(p4.train_peak[i].bytes, p2.train_peak[i].bytes);
      EXPECT_EQ(plan_engine_memory(*model, 4, options(c, 2)).state.total(), p2.state.total());
      for (int b = 0; b < nb; ++b) {
        const BlockBufferBytes a = block_buffer_bytes(model->layout().block(b).numel, 4, options(c, 2));
        const BlockBufferBytes e = block_buffer_bytes(model->layout().block(b).numel, 2, options(c, 1));
        for (int role = 0; role < kNumBufferRoles; ++role) EXPECT_EQ(a.role[role], e.role[role]) << "block " << b;
      }
    }
  // The direct path allocates no receive buffers; the staged one its planned slots per rank.
  for (CommPath path : {CommPath::kAuto, CommPath::kStaged})
  for (auto [stage, w] : {std::pair{3, DType::kBF16}, std::pair{1, DType::kF32}}) {
    Case c;
    c.mc = mc;
    c.stage = stage;
    c.working = w;
    SCOPED_TRACE(describe(c) + (path == CommPath::kStaged ? ", staged ring" : ", direct path"));
    EngineRun run(mc, 4, options(c, 2), path);
    run.load([&](int t) { return make_params(run.model(), t); });
    for (int r = 0; r < 4; ++r) run.device(r).memory().reset_peak_stats();  // not the load's staging
    const float dloss = 1.0f / static_cast<float>(kRows * kMicro * 2 * mc.seq_len);
    run.step(0, [&](int r, int m) { return make_batch(mc, r % 2, r / 2, 0, m); }, {}, false, dloss);
    // The plan of the model the run drives (in bf16 a 16-bit model: no fp32 parameter copies).
    const EngineMemoryPlan plan = plan_engine_memory(run.model(), 4, options(c, 2));
    for (int r = 0; r < 4; ++r) {
      size_t predicted = run.extra_resident(r);
      for (size_t b : plan.resident) predicted += pool_rounded_size(b);
      for (const PlannedBuffer& b : plan.train_peak) predicted += pool_rounded_size(b.bytes);
      // The CPU backend's reductions are direct (no receive buffers) unless the ring is forced.
      const bool direct = Communicator::reduces_directly(run.devices(), path);
      EXPECT_EQ(direct, path == CommPath::kAuto);
      const size_t comm = direct ? 0 : Communicator::planned_buffer_bytes(4);
      EXPECT_EQ(run.comm().buffer_bytes(r), comm);
      for (int q = 0; q < Communicator::kRecvSlots && comm; ++q)
        predicted += pool_rounded_size(comm / Communicator::kRecvSlots);
      const double measured = static_cast<double>(run.device(r).memory().stats().peak_allocated_bytes);
      EXPECT_NEAR(static_cast<double>(predicted) / measured, 1.0, 0.05) << "rank " << r << ": predicted " << predicted
                                                                         << ", measured " << measured;
      EXPECT_EQ(run.engine().rank(r).model_state_bytes().total(), plan.state.total());
      // Host memory: the pinned staging of state export appears at the first export, as planned.
      EXPECT_EQ(run.engine().rank(r).host_staging_bytes(), 0u);
      const ShardRange sh = run.engine().rank(r).shard_of(0);
      std::vector<float> master(static_cast<size_t>(sh.size())), m(master.size()), v(master.size());
      std::vector<uint8_t> working(master.size() * dtype_size(w));
      run.engine().rank(r).state_to_host(0, master.data(), m.data(), v.data(), working.data());
      EXPECT_EQ(run.engine().rank(r).host_staging_bytes(), HostStaging::planned_pinned_bytes());
    }
  }
}


// --comm nccl's engine path (ZeroOptions::processes set, every rank in this process) with
// collectives that are enqueued on the comm streams and return at once, as NCCL's are: the in-process
// ring's per-rank calls stand in for NCCL here, so the bits must be those of the plain engine, at
// every stage, fp32 and bf16, with accumulation; a consumer not ordered after the comm stream would
// read unreduced data (and is a race under ThreadSanitizer).
class EnqueuedRingCollectives final : public DataCollectives {
 public:
  explicit EnqueuedRingCollectives(int world) : world_(world) {}
  void bind(Communicator& comm) { comm_ = &comm; }
  int world() const override { return world_; }
  int global_rank(int local) const override { return local; }
  void reduce_scatter(int local, TensorView full, Stream* producer) override { comm_->reduce_scatter(local, full, producer); }
  void all_gather(int local, TensorView full, Stream* producer) override { comm_->all_gather(local, full, producer); }
  void all_reduce(int local, TensorView full, Stream* producer) override { comm_->all_reduce(local, full, producer); }

 private:
  int world_;
  Communicator* comm_ = nullptr;
};

TEST(ZeroMesh, EnqueuedDataCollectivesInOneProcessGiveThePlainEnginesBits) {
  for (auto [stage, w] : {std::pair{0, DType::kF32}, std::pair{1, DType::kBF16}, std::pair{2, DType::kF32},
                          std::pair{3, DType::kBF16}, std::pair{3, DType::kF32}}) {
    Case c;
    c.mc = mlp_config();
    c.devices = 3;  // shards that do not divide evenly
    c.tensor = 1;
    c.stage = stage;
    c.working = w;
    SCOPED_TRACE(describe(c));
    EnqueuedRingCollectives enqueued(c.devices);
    ZeroOptions o = options(c, 1);
    o.processes = &enqueued;
    EngineRun via(c.mc, c.devices, o);
    enqueued.bind(via.comm());
    EngineRun plain(c.mc, c.devices, options(c, 1));
    via.load([&](int) { return make_params(via.model(), 0); });
    plain.load([&](int) { return make_params(via.model(), 0); });
    const float dloss = 1.0f / static_cast<float>(kRows * kMicro * c.devices);
    const int steps = kSanitizer ? 2 : 3;
    for (int step = 0; step < steps; ++step) {
      auto batch = [&](int r, int m) { return make_batch(c.mc, 0, r, step, m); };
      const auto got = via.step(step, batch, {}, false, dloss);
      const auto want = plain.step(step, batch, {}, false, dloss);
      for (int r = 0; r < c.devices; ++r) {
        SCOPED_TRACE("step " + std::to_string(step) + " rank " + std::to_string(r));
        EXPECT_TRUE(same_bits(got[static_cast<size_t>(r)].losses, want[static_cast<size_t>(r)].losses));
        EXPECT_TRUE(same_bits(got[static_cast<size_t>(r)].norms, want[static_cast<size_t>(r)].norms));
        EXPECT_EQ(std::memcmp(&got[static_cast<size_t>(r)].scale, &want[static_cast<size_t>(r)].scale,
                              sizeof(optim::LossScaleState)), 0);
      }
    }
    // The host-side helpers work when every global rank is local (they are refused across processes).
    for (int b = 0; b < via.model().layout().num_blocks(); ++b) {
      EXPECT_TRUE(same_bits(via.engine().master_to_host(b), plain.engine().master_to_host(b))) << "block " << b;
      EXPECT_TRUE(same_bits(via.engine().block_to_host(b), plain.engine().block_to_host(b))) << "block " << b;
    }
  }
}

}  // namespace
}  // namespace zt
