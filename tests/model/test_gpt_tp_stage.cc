// Pipeline stages of the tensor-parallel GPT (make_gpt_stage with tp.degree > 1): on P x T
// simulated devices (a data x tensor x pipeline mesh with data = 1) every schedule's step, run by
// run_pipeline_stage on one host thread per rank, gives a one-device run's loss and every logical
// block's gradient (tensor shards assembled through each stage's tensor_map, the tied head copy
// added to the embeddings), with and without sequence parallelism; the split backward adds the
// fused backward's bits; the stage's blocks are the whole tensor-parallel model's blocks.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "pipeline/model_stage.h"
#include "pipeline/runtime.h"
#include "resident_params.h"
#include "stage_fixtures.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

using namespace stage_test;

struct Case {
  PipeSchedule kind;
  int P, T, m, V;
  bool sequence;
  int data = 1;  // replicas on the data axis, each running the same micro-batches
};

std::string name(const Case& k) {
  return std::string(pipe_schedule_name(k.kind)) + " P=" + std::to_string(k.P) + " T=" + std::to_string(k.T) +
         " m=" + std::to_string(k.m) + " V=" + std::to_string(k.V) + (k.sequence ? " sp" : " no-sp") +
         (k.data > 1 ? " data=" + std::to_string(k.data) : "");
}

// One step of the schedule on data x P x T devices: rank r is stage mesh.index(pipeline, r) at
// tensor coordinate mesh.index(tensor, r); one stage model per stage, shared by its tensor and data
// ranks. Every data replica must compute data replica 0's bits (the result is replica 0's).
using Jitter = std::function<void(const Action&, Stream&, Stream&)>;

StepResult run_3d(const ModelConfig& c, const Blocks& host, const Case& k,
                  const std::function<Jitter(int rank)>& jitter = {}) {
  const Schedule sched = make_schedule(k.kind, k.P, k.m, k.V);
  const int N = k.data * k.P * k.T;
  auto rt = Runtime::create_cpu(N);
  std::vector<Device*> devs;
  for (int r = 0; r < N; ++r) devs.push_back(&rt->device(r));
  Communicator comm(devs);
  const Mesh mesh(MeshShape{.data = k.data, .tensor = k.T, .pipeline = k.P}, N);
  PipelinePartition part;
  part.stages = k.P, part.virtual_stages = k.V;
  part.blocks_per_part.assign(static_cast<size_t>(k.P * k.V), c.layers / (k.P * k.V));
  const auto specs = pipeline_stage_specs(part, sched.splits_backward());
  std::vector<std::unique_ptr<Model>> models;
  for (int s = 0; s < k.P; ++s)
    models.push_back(make_gpt_stage(c, specs[static_cast<size_t>(s)], Recompute::kNone,
                                    TensorParallel{k.T, k.sequence, &comm, &mesh}));
  std::vector<const float*> logical;
  for (const auto& b : host) logical.push_back(b.data());

  std::vector<std::unique_ptr<ResidentParams>> params;
  std::vector<std::unique_ptr<DeviceBatches>> batches;
  std::vector<std::unique_ptr<ModelStageWork>> work;
  for (int r = 0; r < N; ++r) {
    const int s = mesh.index(MeshAxis::kPipeline, r), t = mesh.index(MeshAxis::kTensor, r);
    const Model& m = *models[static_cast<size_t>(s)];
    Blocks local;
    for (int b = 0; b < m.layout().num_blocks(); ++b) local.push_back(m.tensor_map()->local_block(t, b, logical));
    params.push_back(std::make_unique<ResidentParams>(*devs[static_cast<size_t>(r)], m.layout(), local));
    batches.push_back(std::make_unique<DeviceBatches>(c, *devs[static_cast<size_t>(r)], k.m));
    work.push_back(std::make_unique<ModelStageWork>(m, *devs[static_cast<size_t>(r)], *params.back(), kB, kT, sched, s));
    for (int mb = 0; mb < k.m; ++mb)
      work.back()->set_batch(mb, batches.back()->batches[static_cast<size_t>(mb)], dloss_of(k.m));
  }

  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r)
    threads.emplace_back([&, r] {
      try {
        StageRunOptions opt;
        if (jitter) opt.before_action = jitter(r);
        run_pipeline_stage(sched, mesh.index(MeshAxis::kPipeline, r), comm, mesh.pipeline_group(r),
                           *work[static_cast<size_t>(r)], opt);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        comm.abort(e.what());
      }
    });
  for (auto& th : threads) th.join();
  for (const auto& e : errors) EXPECT_EQ(e, "") << name(k);
  rt->synchronize();

  StepResult res;
  const ParamLayout whole = gpt_layout(c);
  for (int b = 0; b < whole.num_blocks(); ++b) res.grads.emplace_back(static_cast<size_t>(whole.block(b).numel), 0.0f);
  std::vector<int> held(static_cast<size_t>(whole.num_blocks()), 0);
  // Every tensor rank of the last stage holds every position's loss.
  for (int t = 0; t < k.T; ++t) {
    const double l = work[static_cast<size_t>(mesh.rank_at({.data = 0, .tensor = t, .pipeline = k.P - 1}))]->loss_sum();
    if (t == 0) res.loss = l;
    EXPECT_EQ(l, res.loss) << name(k) << ": the loss of tensor rank " << t;
  }
  for (int s = 0; s < k.P; ++s) {
    const Model& m = *models[static_cast<size_t>(s)];
    const TensorMap& map = *m.tensor_map();
    for (int b = 0; b < m.layout().num_blocks(); ++b) {
      const int lb = m.logical_block(b);
      // The logical block from the tensor shards: split elements from one rank each, replicated ones
      // from every rank, equal.
      std::vector<float> got(res.grads[static_cast<size_t>(lb)].size(), 0.0f);
      std::vector<int> hits(got.size(), 0);
      for (int t = 0; t < k.T; ++t) {
        const int r = mesh.rank_at({.data = 0, .tensor = t, .pipeline = s});
        const std::vector<float> g = params[static_cast<size_t>(r)]->grad_host(b);
        for (int d = 1; d < k.data; ++d) {
          const int rd = mesh.rank_at({.data = d, .tensor = t, .pipeline = s});
          EXPECT_EQ(params[static_cast<size_t>(rd)]->grad_host(b), g) << name(k) << ": data replica " << d;
        }
        map.for_each_run(t, b, 0, m.layout().block(b).numel, [&](int blk, int64_t lo, int64_t li, int64_t n) {
          ASSERT_EQ(blk, lb) << "local block " << b << " of stage " << s << " maps to two logical blocks";
          for (int64_t i = 0; i < n; ++i) {
            const auto at = static_cast<size_t>(lo + i);
            if (hits[at]++ > 0) {
              ASSERT_EQ(got[at], g[static_cast<size_t>(li + i)]) << "replicated gradient differs, stage " << s;
            }
            got[at] = g[static_cast<size_t>(li + i)];
          }
        });
      }
      for (const ParamTensor& pt : whole.block(lb).tensors) {
        int64_t uncovered = 0;
        for (int64_t i = 0; i < pt.numel; ++i) uncovered += hits[static_cast<size_t>(pt.offset + i)] == 0;
        EXPECT_EQ(uncovered, 0) << pt.name << " on stage " << s;
      }
      auto& out = res.grads[static_cast<size_t>(lb)];
      for (size_t i = 0; i < out.size(); ++i) out[i] += got[i];
      ++held[static_cast<size_t>(lb)];
    }
  }
  for (int b = 0; b < whole.num_blocks(); ++b)
    EXPECT_EQ(held[static_cast<size_t>(b)], b == 0 && k.P > 1 ? 2 : 1) << name(k) << ": logical block " << b;
  return res;
}

TEST(GptTensorParallelStage, EveryScheduleMatchesOneDevice) {
  const ModelConfig c = tiny_config();
  const Blocks host = init_blocks(gpt_layout(c), 11);
  const std::vector<Case> cases = {
      {PipeSchedule::k1F1B, 2, 2, 4, 1, true},        {PipeSchedule::k1F1B, 2, 2, 4, 1, false},
      {PipeSchedule::kZbH1, 2, 2, 4, 1, true},        {PipeSchedule::kZbH1, 2, 2, 4, 1, false},
      {PipeSchedule::kInterleaved, 2, 2, 4, 2, true}, {PipeSchedule::kInterleaved, 2, 2, 2, 2, false},
      {PipeSchedule::kGpipe, 2, 2, 2, 1, true},       {PipeSchedule::kZbH1, 2, 2, 4, 1, true, 2},
  };
  for (const Case& k : cases) {
    const StepResult want = run_one_device(c, host, k.m);
    // Only the order of additions differs from one device (the tensor group's sums, the tied
    // embedding's two halves summed at the end).
    expect_close(run_3d(c, host, k), want, 2e-6, name(k));
  }
}

// Training: 50 steps of SGD on the logical blocks (each step loads both tied copies from the same
// logical embeddings, as summing their gradients and updating both alike keeps them) give per-step
// losses within 1e-5 relative of one device. At lr 0.1 this tiny model's loss oscillates and the
// round-off of the tensor group's sums (1e-9 relative at step 1) grows past 1e-5 by step 20; at
// 0.05 it stays below 3e-6.
TEST(GptTensorParallelStage, FiftyTrainingStepsTrackOneDevice) {
  const ModelConfig c = tiny_config();
  const Blocks init = init_blocks(gpt_layout(c), 13);
  const Case k{PipeSchedule::kZbH1, 2, 2, 4, 1, true};
  Blocks w1 = init, w3 = init;
  const float lr = 0.05f;
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    const StepResult a = run_one_device(c, w1, k.m), b = run_3d(c, w3, k);
    ASSERT_NEAR(b.loss, a.loss, 1e-5 * std::fabs(a.loss)) << name(k) << " step " << step + 1;
    (step == 0 ? first : last) = a.loss;
    for (size_t i = 0; i < w1.size(); ++i)
      for (size_t j = 0; j < w1[i].size(); ++j) w1[i][j] -= lr * a.grads[i][j], w3[i][j] -= lr * b.grads[i][j];
  }
  EXPECT_LT(last, 0.85 * first) << "the run must train for the comparison to mean something";
}

// ZB-H1's B runs every collective and W none; together they add the bits of 1F1B's fused backward.
TEST(GptTensorParallelStage, SplitBackwardGivesTheFusedBackwardsBits) {
  const ModelConfig c = tiny_config();
  const Blocks host = init_blocks(gpt_layout(c), 5);
  for (bool sp : {true, false}) {
    const StepResult fused = run_3d(c, host, {PipeSchedule::k1F1B, 2, 2, 4, 1, sp});
    const StepResult split = run_3d(c, host, {PipeSchedule::kZbH1, 2, 2, 4, 1, sp});
    EXPECT_TRUE(same_bits(split, fused)) << (sp ? "sp" : "no-sp");
  }
}

// Delays of up to 1 ms before random actions of every rank, on its compute or comm stream or its
// host thread: the tensor group's collectives and the stages' transfers never hang and never
// change a bit.
TEST(GptTensorParallelStage, RandomDelaysNeverHangOrChangeBits) {
  const ModelConfig c = tiny_config();
  const Blocks host = init_blocks(gpt_layout(c), 3);
  for (const Case& k : {Case{PipeSchedule::kZbH1, 2, 2, 4, 1, true}, Case{PipeSchedule::kInterleaved, 2, 2, 2, 2, false}}) {
    const StepResult calm = run_3d(c, host, k);
    for (int rep = 0; rep < 3; ++rep) {
      auto jitter = [rep](int rank) -> Jitter {
        auto rng = std::make_shared<std::mt19937>(static_cast<unsigned>(1000 * rep + rank));
        return [rng](const Action&, Stream& compute, Stream& comm) {
          std::uniform_int_distribution<int> pick(0, 5), us(0, 1000);
          const int where = pick(*rng);
          const auto delay = std::chrono::microseconds(us(*rng));
          auto sleep = [delay] { std::this_thread::sleep_for(delay); };
          if (where == 0) compute.host_func(sleep);
          if (where == 1) comm.host_func(sleep);
          if (where == 2) sleep();
        };
      };
      EXPECT_TRUE(same_bits(run_3d(c, host, k, jitter), calm)) << name(k) << " repeat " << rep;
    }
  }
}

// The split's promise to zb-h1: backward_input runs every collective of the tensor group and writes
// no parameter gradient (a sharding engine reduces a block once, after its W); backward_weight
// runs no collective, so ranks of a group may put it anywhere between their collectives.
TEST(GptTensorParallelStage, BackwardWeightRunsNoCollective) {
  const ModelConfig c = tiny_config();
  const Blocks host = init_blocks(gpt_layout(c), 7);
  std::vector<const float*> logical;
  for (const auto& b : host) logical.push_back(b.data());
  PipelineStageSpec spec;
  spec.chunks.push_back(PipelineChunk{0, c.layers, true, true});
  spec.split_backward = true;
  for (bool sp : {true, false}) {
    auto rt = Runtime::create_cpu(2);
    std::vector<Device*> devs = {&rt->device(0), &rt->device(1)};
    Communicator comm(devs);
    const Mesh mesh(MeshShape{.tensor = 2}, 2);
    const auto model = make_gpt_stage(c, spec, Recompute::kNone, TensorParallel{2, sp, &comm, &mesh});
    std::vector<std::unique_ptr<ResidentParams>> params;
    std::vector<std::unique_ptr<DeviceBatches>> batches;
    std::vector<std::unique_ptr<Workspace>> ws;
    for (int t = 0; t < 2; ++t) {
      Blocks local;
      for (int b = 0; b < model->layout().num_blocks(); ++b) local.push_back(model->tensor_map()->local_block(t, b, logical));
      params.push_back(std::make_unique<ResidentParams>(*devs[static_cast<size_t>(t)], model->layout(), local));
      batches.push_back(std::make_unique<DeviceBatches>(c, *devs[static_cast<size_t>(t)], 1));
      ws.push_back(model->make_workspace(*devs[static_cast<size_t>(t)], kB, kT));
    }
    auto on_both = [&](const std::function<void(int)>& fn) {
      std::vector<std::thread> threads;
      for (int t = 0; t < 2; ++t) threads.emplace_back([&, t] { fn(t); });
      for (auto& th : threads) th.join();
      rt->synchronize();
    };
    auto batch = [&](int t) -> const Batch& { return batches[static_cast<size_t>(t)]->batches[0]; };
    on_both([&](int t) {
      model->forward(devs[static_cast<size_t>(t)]->compute(), *params[static_cast<size_t>(t)], *ws[static_cast<size_t>(t)],
                     batch(t), dloss_of(1), true);
    });
    const uint64_t after_forward = comm.counters(0).collectives;
    on_both([&](int t) {
      model->backward_input(devs[static_cast<size_t>(t)]->compute(), *params[static_cast<size_t>(t)],
                            *ws[static_cast<size_t>(t)], batch(t));
    });
    const uint64_t after_input = comm.counters(0).collectives;
    EXPECT_GT(after_input, after_forward);
    for (int t = 0; t < 2; ++t)
      for (int b = 0; b < model->layout().num_blocks(); ++b)
        for (float g : params[static_cast<size_t>(t)]->grad_host(b)) ASSERT_EQ(g, 0.0f) << "backward_input wrote a gradient";
    on_both([&](int t) {
      model->backward_weight(devs[static_cast<size_t>(t)]->compute(), *params[static_cast<size_t>(t)],
                             *ws[static_cast<size_t>(t)], batch(t));
    });
    EXPECT_EQ(comm.counters(0).collectives, after_input) << (sp ? "sp" : "no-sp");
    EXPECT_EQ(comm.counters(1).collectives, after_input) << (sp ? "sp" : "no-sp");
    double norm = 0;
    for (int b = 0; b < model->layout().num_blocks(); ++b)
      for (float g : params[0]->grad_host(b)) norm += static_cast<double>(g) * g;
    EXPECT_GT(norm, 0.0);
  }
}

// What the engine relies on to load a (tensor, pipeline) rank: a stage's block b is block
// logical_block(b) of the whole tensor-parallel model, tensor for tensor, and the stage's map gives
// the same local values as the whole model's map; what crosses stages is the rank's residual rows.
TEST(GptTensorParallelStage, BlocksAreTheWholeTensorParallelModels) {
  const ModelConfig c = tiny_config();
  const Blocks host = init_blocks(gpt_layout(c), 3);
  std::vector<const float*> logical;
  for (const auto& b : host) logical.push_back(b.data());
  PipelinePartition part;
  part.stages = 2, part.virtual_stages = 2;
  part.blocks_per_part = {1, 1, 1, 1};
  const auto specs = pipeline_stage_specs(part, false);
  for (bool sp : {true, false}) {
    const TensorParallel plan_tp{2, sp, nullptr, nullptr};
    const auto whole = make_model(c, Recompute::kNone, plan_tp);
    for (int s = 0; s < 2; ++s) {
      const auto stage = make_gpt_stage(c, specs[static_cast<size_t>(s)], Recompute::kNone, plan_tp);
      ASSERT_EQ(stage->chunks(), 2);
      // stage 0: embeddings, h.0, h.2; stage 1: h.1, h.3, ln_f, the head copy of the embeddings.
      const std::vector<int> want = s == 0 ? std::vector<int>{0, 1, 3} : std::vector<int>{2, 4, 5, 0};
      ASSERT_EQ(stage->layout().num_blocks(), static_cast<int>(want.size()));
      for (int b = 0; b < stage->layout().num_blocks(); ++b) {
        const int lb = stage->logical_block(b);
        EXPECT_EQ(lb, want[static_cast<size_t>(b)]) << "stage " << s << " block " << b;
        const ParamBlock& mine = stage->layout().block(b);
        const ParamBlock& theirs = whole->layout().block(lb);
        ASSERT_EQ(mine.numel, theirs.numel);
        ASSERT_EQ(mine.tensors.size(), theirs.tensors.size());
        for (size_t i = 0; i < mine.tensors.size(); ++i) {
          EXPECT_EQ(mine.tensors[i].name, theirs.tensors[i].name);
          EXPECT_EQ(mine.tensors[i].offset, theirs.tensors[i].offset);
          EXPECT_EQ(mine.tensors[i].numel, theirs.tensors[i].numel);
        }
        EXPECT_EQ(stage->tensor_map()->replicated_from(b), whole->tensor_map()->replicated_from(lb));
        for (int t = 0; t < 2; ++t)
          EXPECT_EQ(stage->tensor_map()->local_block(t, b, logical), whole->tensor_map()->local_block(t, lb, logical));
      }
    }
  }
  // Workspaces: the rank's rows cross stages with sequence parallelism, all rows without.
  auto rt = Runtime::create_cpu(4);
  std::vector<Device*> devs;
  for (int r = 0; r < 4; ++r) devs.push_back(&rt->device(r));
  Communicator comm(devs);
  const Mesh mesh(MeshShape{.tensor = 2, .pipeline = 2}, 4);
  for (bool sp : {true, false}) {
    const auto stage = make_gpt_stage(c, specs[1], Recompute::kNone, TensorParallel{2, sp, &comm, &mesh});
    const int r = mesh.rank_at({.tensor = 1, .pipeline = 1});
    auto first = stage->make_chunk_workspace(*devs[static_cast<size_t>(r)], kB, kT, 0);
    auto last = stage->make_chunk_workspace(*devs[static_cast<size_t>(r)], kB, kT, 1);
    const Shape rows = sp ? Shape{kB * kT / 2, c.embd} : Shape{kB, kT, c.embd};
    EXPECT_EQ(first->stage_input().shape, rows);
    EXPECT_EQ(first->stage_output().shape, rows);
    EXPECT_EQ(first->stage_gradient().shape, rows);
    EXPECT_EQ(first->losses().data, nullptr);
    EXPECT_EQ(last->stage_output().data, nullptr);
    EXPECT_EQ(last->losses().numel(), kB * kT);
    EXPECT_EQ(stage->chunk_workspace_bytes(kB, kT, 1), last->bytes());
  }
}

// Recompute with tensor parallelism is built; with a split backward (zb-h1) it is refused, as
// without tensor parallelism: backward_weight reads layer inputs a recompute would overwrite.
TEST(GptTensorParallelStage, RefusesRecomputeOnlyWithASplitBackward) {
  const ModelConfig c = tiny_config();
  PipelinePartition part;
  part.stages = 2;
  part.blocks_per_part = {2, 2};
  const TensorParallel tp{2, true, nullptr, nullptr};
  EXPECT_NO_THROW(make_gpt_stage(c, pipeline_stage_specs(part, false)[0], Recompute::kSelective, tp));
  try {
    make_gpt_stage(c, pipeline_stage_specs(part, true)[0], Recompute::kSelective, tp);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("split backward"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace zt
