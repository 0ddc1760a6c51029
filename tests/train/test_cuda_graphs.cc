// --cuda-graphs through the trainer on simulated devices (the CPU backend captures and replays
// with CUDA's rules): `on` gives per-step losses, gradient norms and final states bitwise equal to
// `off` at ZeRO stages 0-3, in fp32, bf16 and fp16, on two devices with several micro-batches per
// step, with and without recomputation; it refuses the runs it cannot capture (tensor and
// pipeline parallelism) with one sentence, and `auto` stays eager on CPU devices. The summary
// record says whether graphs ran. MicroBatchGraph alone: pieces whose engine buffers moved are
// captured again; on the ZeRO engine at stages 2-3 none move (its transient arena), so `auto`
// replays every micro-batch after the warm-up.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "resident_params.h"
#include "sanitizer.h"
#include "stage_fixtures.h"
#include "test_util.h"
#include "train_checks.h"
#include "comm/communicator.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "model/layout.h"
#include "runtime/cpu/cpu_device.h"
#include "runtime/runtime.h"
#include "checkpoint/checkpoint.h"
#include "train/graph_step.h"
#include "train/trainer.h"
#include "zero/engine.h"

namespace zt {
namespace {

// ---- MicroBatchGraph on a model of two hook-separated ops ---------------------------------------

// Counts the hooks; block 0's "parameters" are one device float.
class CountingAccess final : public ParamAccess {
 public:
  explicit CountingAccess(float* p) : p_(p) {}
  int device_index() const override { return 0; }
  float* params(int) override { return p_; }
  float* grads(int) override { return p_ + 1; }
  void before_forward(int) override { ++forwards; }
  void before_backward(int) override { ++backwards; }
  void after_backward(int) override { ++afters; }
  int forwards = 0, backwards = 0, afters = 0;

 private:
  float* p_;
};

struct NoWorkspace final : Workspace {
  int B() const override { return 1; }
  int T() const override { return 1; }
  TensorView losses() override { return {}; }
  TensorView logits() override { return {}; }
  size_t bytes() const override { return 0; }
};

// forward: x = 3 x + 1 (params[0]); backward: g += x (grads = params + 1). With allocate, the
// forward also asks the pool for scratch, which a capture refuses.
class TwoOpModel final : public Model {
 public:
  explicit TwoOpModel(bool allocate) : allocate_(allocate) {}
  const ModelConfig& config() const override { return config_; }
  const ParamLayout& layout() const override { return layout_; }
  size_t workspace_bytes(int, int) const override { return 0; }
  std::unique_ptr<Workspace> make_workspace(Device&, int, int) const override { return std::make_unique<NoWorkspace>(); }
  void forward(Stream& s, ParamAccess& p, Workspace&, const Batch&, float, bool) const override {
    p.before_forward(0);
    if (on_forward) on_forward();
    const TensorView x{p.params(0), DType::kF32, Shape{1}, 0};
    if (allocate_) DeviceBuffer scratch(s.device().memory(), 64, s, "scratch");
    ops::scale(s, x, 3.0f);
    ops::add(s, x, x, one_);
  }
  void backward(Stream& s, ParamAccess& p, Workspace&, const Batch&) const override {
    p.before_backward(0);
    const TensorView g{p.grads(0), DType::kF32, Shape{1}, 0};
    ops::accumulate(s, g, TensorView{p.params(0), DType::kF32, Shape{1}, 0});
    p.after_backward(0);
  }
  std::vector<int> forward_order() const override { return {0}; }
  std::vector<int> backward_order() const override { return {0}; }
  TensorView one_;
  std::function<void()> on_forward;  // run at each forward's issue

 private:
  bool allocate_;
  ModelConfig config_;
  ParamLayout layout_;
};

struct GraphFixture {
  std::unique_ptr<Runtime> rt = Runtime::create_cpu(1);
  Stream& s = rt->device(0).compute();
  DeviceBuffer buf{rt->device(0).memory(), 3 * sizeof(float), s, "x, g, one"};
  float host[3] = {1, 0, 1};
  NoWorkspace ws;
  Batch batch;
  GraphFixture() {
    s.copy(buf.data(), host, sizeof host);
    s.synchronize();
  }
  // Runs `micro` micro-batches through g and returns (x, g) as the stream left them.
  std::pair<float, float> run(MicroBatchGraph& g, TwoOpModel& m, CountingAccess& a, int micro) {
    m.one_ = TensorView{buf.as<float>() + 2, DType::kF32, Shape{1}, 0};
    for (int i = 0; i < micro; ++i) g.run(m, s, a, ws, batch, 1.0f);
    float out[3];
    s.copy(out, buf.data(), sizeof out);
    s.synchronize();
    return {out[0], out[1]};
  }
};

// The closed form of `micro` micro-batches from x = 1, g = 0.
std::pair<float, float> expected(int micro) {
  float x = 1, g = 0;
  for (int i = 0; i < micro; ++i) x = 3 * x + 1, g += x;
  return {x, g};
}

TEST(MicroBatchGraph, WarmsUpThenCapturesOnceAndReplaysPiecewiseWithTheHooksEager) {
  GraphFixture f;
  TwoOpModel model(false);
  CountingAccess access(f.buf.as<float>());
  MicroBatchGraph g(/*required=*/true);
  EXPECT_EQ(f.run(g, model, access, 5), expected(5));
  EXPECT_EQ(g.replays(), 4u);   // the first micro-batch is the warm-up, the second the capture
  EXPECT_EQ(g.segments(), 2u);  // the forward's ops and the backward's, between the three hooks
  EXPECT_EQ(g.recaptures(), 0u);
  EXPECT_EQ(access.forwards, 5);  // every hook once per micro-batch, capture and replays alike
  EXPECT_EQ(access.backwards, 5);
  EXPECT_EQ(access.afters, 5);
  EXPECT_EQ(g.take_note(), "");
}

// A stream's library block freed for a larger one (kernels/ops.h stream_block_generation: on CUDA
// cuDNN's workspace or a scratch growing; simulated here) leaves every captured graph pointing at
// freed memory: the next micro-batch runs eagerly and the one after captures again, as for a new
// shape. A block that grows during the warm-up is the one the capture uses: no second warm-up.
TEST(MicroBatchGraph, ALibraryBlockThatMovedIsCapturedAgain) {
  GraphFixture f;
  TwoOpModel model(false);
  int grow = 1;  // the warm-up's forward grows a block
  model.on_forward = [&grow] {
    if (grow-- > 0) ops::note_stream_block_replaced();
  };
  CountingAccess access(f.buf.as<float>());
  MicroBatchGraph g(/*required=*/true);
  EXPECT_EQ(f.run(g, model, access, 3), expected(3));
  EXPECT_EQ(g.replays(), 2u);  // warm-up, capture, replay
  ops::note_stream_block_replaced();  // say, an evaluation between steps grew one
  EXPECT_EQ(f.run(g, model, access, 3), expected(6));
  EXPECT_EQ(g.replays(), 4u);  // eager, then a capture and a replay again
  EXPECT_EQ(g.recaptures(), 0u);
}

TEST(MicroBatchGraph, AutoFallsBackToEagerWithOneNoteWhenTheCaptureFails) {
  GraphFixture f;
  TwoOpModel model(/*allocate=*/true);
  CountingAccess access(f.buf.as<float>());
  MicroBatchGraph g(/*required=*/false);
  EXPECT_EQ(f.run(g, model, access, 4), expected(4));
  EXPECT_EQ(g.replays(), 0u);
  EXPECT_EQ(access.forwards, 4);  // the failed capture's micro-batch was finished eagerly, its hooks once
  EXPECT_EQ(access.backwards, 4);
  EXPECT_EQ(access.afters, 4);
  const std::string note = g.take_note();
  EXPECT_NE(note.find("--cuda-graphs auto runs eagerly from here on"), std::string::npos) << note;
  EXPECT_NE(note.find("'scratch'"), std::string::npos) << note;
  EXPECT_EQ(g.take_note(), "") << "the note is given once";
  EXPECT_FALSE(f.s.capturing());
}

TEST(MicroBatchGraph, OnThrowsTheCapturesReason) {
  GraphFixture f;
  TwoOpModel model(/*allocate=*/true);
  CountingAccess access(f.buf.as<float>());
  MicroBatchGraph g(/*required=*/true);
  try {
    f.run(g, model, access, 2);
    ADD_FAILURE() << "a failed capture under --cuda-graphs on did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("--cuda-graphs on could not capture a micro-batch"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("allocate before the capture"), std::string::npos) << e.message();
  }
  EXPECT_FALSE(f.s.capturing());
  // The warm-up's hook and the capture's (it precedes the piece that failed); nothing after it.
  EXPECT_EQ(access.forwards, 2);
  EXPECT_EQ(access.backwards, 1);
}

// Like CountingAccess, but each before_backward hands out the gradient slot of `slots` (one float
// each, after x) that `pattern` names for that micro-batch, as the engine's gradient buckets land
// where the pool puts them.
class MovingAccess final : public ParamAccess {
 public:
  MovingAccess(float* p, std::vector<int> pattern) : p_(p), pattern_(std::move(pattern)) {}
  int device_index() const override { return 0; }
  float* params(int) override { return p_; }
  float* grads(int) override {
    EXPECT_GE(slot_, 0) << "gradient asked for outside the backward";
    return p_ + 1 + slot_;
  }
  void before_backward(int) override { slot_ = pattern_[static_cast<size_t>(micro_++) % pattern_.size()]; }
  void after_backward(int) override { slot_ = -1; }

 private:
  float* p_;
  std::vector<int> pattern_;
  int micro_ = 0, slot_ = -1;
};

TEST(MicroBatchGraph, APieceWhoseBufferMovedIsCapturedAgainAndKeptPerAddress) {
  struct Case {
    std::vector<int> pattern;
    bool required;
    uint64_t replays, recaptures;  // of 12 micro-batches: the warm-up, the capture, 10 replays
  };
  // Two slots alternating: the second is captured once, then both graphs serve. Five slots in a
  // cycle, more than kMaxVariants: every replay captures its piece again, and auto gives graphs up
  // at the kJudgeAfter-th micro-batch from graphs (one of the two working pieces recaptured each
  // time is more than a quarter).
  static_assert(MicroBatchGraph::kMaxVariants == 4 && MicroBatchGraph::kJudgeAfter == 8);
  const std::vector<int> five = {0, 1, 2, 3, 4};
  for (const Case& c : {Case{{0}, true, 11, 0}, Case{{0, 1}, true, 11, 1}, Case{{0, 1}, false, 11, 1},
                        Case{{0, 1, 1, 0}, true, 11, 1}, Case{five, true, 11, 10}, Case{five, false, 8, 7}}) {
    const auto rt = Runtime::create_cpu(1);
    Stream& s = rt->device(0).compute();
    std::vector<float> host(7, 0.0f);
    host[0] = 1;  // x; gradient slots 1..5; the constant one at 6
    host[6] = 1;
    DeviceBuffer buf(rt->device(0).memory(), host.size() * sizeof(float), s, "x, slots, one");
    s.copy(buf.data(), host.data(), host.size() * sizeof(float));
    TwoOpModel model(false);
    model.one_ = TensorView{buf.as<float>() + 6, DType::kF32, Shape{1}, 0};
    MovingAccess access(buf.as<float>(), c.pattern);
    MicroBatchGraph g(c.required);
    NoWorkspace ws;
    const int micro = 12;
    for (int i = 0; i < micro; ++i) g.run(model, s, access, ws, Batch{}, 1.0f);
    std::vector<float> out(host.size());
    s.copy(out.data(), buf.data(), out.size() * sizeof(float));
    s.synchronize();
    // Closed form: x = 3x + 1 each micro-batch, added into that micro-batch's slot.
    std::vector<float> want(host.size(), 0.0f);
    want[0] = 1;
    want[6] = 1;
    for (int i = 0; i < micro; ++i) {
      want[0] = 3 * want[0] + 1;
      want[1 + static_cast<size_t>(c.pattern[static_cast<size_t>(i) % c.pattern.size()])] += want[0];
    }
    const std::string what = "pattern of " + std::to_string(c.pattern.size()) + (c.required ? ", on" : ", auto");
    EXPECT_EQ(out, want) << what;
    EXPECT_EQ(g.replays(), c.replays) << what;
    EXPECT_EQ(g.recaptures(), c.recaptures) << what;
    const std::string note = g.take_note();
    EXPECT_EQ(note.empty(), c.recaptures == 0) << what;
    const bool gave_up = note.find("runs eagerly from here on") != std::string::npos;
    EXPECT_EQ(gave_up, c.replays < micro - 1) << what << ": " << note;
  }
}

// ---- MicroBatchGraph on the ZeRO engine ----------------------------------------------------------

// Two ranks of a ZeRO engine over the tiny GPT, each micro-batch through its rank's
// MicroBatchGraph as `auto` runs it (not required: it would give graphs up when pieces keep being
// captured again). The engine places its transient buffers (buckets, gathered blocks) at fixed
// offsets of its arena (zero/visit_plan.h), so no piece is ever captured again: every micro-batch
// after the warm-up replays, at stages 2 and 3 with accumulation, in fp32 and in 16 bits.
TEST(MicroBatchGraph, EngineBuffersKeepTheirAddressesSoNoPieceIsCapturedAgain) {
  struct Case {
    int stage;
    DType working;
  };
  const std::vector<Case> cases = test::kThreadSanitizer
                                      ? std::vector<Case>{{3, DType::kF32}}
                                      : std::vector<Case>{{2, DType::kF32}, {3, DType::kF32}, {3, DType::kBF16}};
  constexpr int kSteps = 3, kMicro = 4;
  const ModelConfig mc = stage_test::tiny_config();
  for (const Case& c : cases) {
    const std::string what = "stage " + std::to_string(c.stage) + ", " + dtype_name(c.working);
    const auto model = make_model(mc, Recompute::kNone, {}, c.working);
    const auto rt = Runtime::create_cpu(2);
    std::vector<Device*> devs = {&rt->device(0), &rt->device(1)};
    Communicator comm(devs);
    ZeroOptions o;
    o.stage = c.stage;
    o.working = c.working;
    o.micro_batches = kMicro;
    ZeroEngine engine(*model, devs, comm, o);
    const auto host = init_blocks(model->layout(), 7);
    std::vector<std::unique_ptr<MicroBatchGraph>> graphs;
    for (int r = 0; r < 2; ++r) graphs.push_back(std::make_unique<MicroBatchGraph>(/*required=*/false));
    std::vector<std::string> notes(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        Device& d = *devs[static_cast<size_t>(r)];
        engine.rank(r).load_parameters(host);
        // One batch buffer for every micro-batch, as the trainer uploads into one.
        stage_test::DeviceBatches db(mc, d, 1);
        Batch batch = db.batches[0];
        batch.loss_scale = engine.rank(r).scaler().scale_device();
        const auto ws = model->make_workspace(d, stage_test::kB, stage_test::kT);
        for (int step = 0; step < kSteps; ++step)
          for (int m = 0; m < kMicro; ++m) {
            engine.rank(r).begin_micro_batch(m);
            graphs[static_cast<size_t>(r)]->run(*model, d.compute(), engine.rank(r), *ws, batch,
                                               stage_test::dloss_of(kMicro));
            engine.rank(r).end_micro_batch();
          }
        d.synchronize();
        notes[static_cast<size_t>(r)] = graphs[static_cast<size_t>(r)]->take_note();
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      const MicroBatchGraph& g = *graphs[static_cast<size_t>(r)];
      EXPECT_EQ(g.replays(), uint64_t{kSteps * kMicro - 1}) << what << ", rank " << r << ": auto gave graphs up";
      EXPECT_EQ(g.recaptures(), 0u) << what << ", rank " << r;
      EXPECT_GT(g.segments(), 3u) << what << ", rank " << r;
      EXPECT_EQ(notes[static_cast<size_t>(r)], "") << what << ", rank " << r;
    }
  }
}

// ---- the trainer ------------------------------------------------------------------------------

struct RunOut {
  TrainResult result;
  std::vector<double> grad_norms;  // per step, from the metrics records
  bool summary_graphs = false;     // the summary record's cuda_graphs
  uint64_t host_syncs = 0;         // host synchronisations of the whole run
};

// A 2-layer GPT small enough for TSan on 2 devices: batch 8, micro-batch `micro` (accumulation
// 8 / (2 micro)).
TrainConfig small_run(CudaGraphs graphs, int stage, int micro) {
  TrainConfig c = test_util::tiny_train_config(2, stage, test::kThreadSanitizer ? 2 : 3);
  c.overrides.layers = 2;
  c.overrides.embd = 32;
  c.overrides.heads = 2;
  c.overrides.seq_len = 16;
  c.train_seq_len = 16;
  c.batch_size = 8;
  c.micro_batch_size = micro;
  c.precision = Precision::kFp32;
  c.cuda_graphs = graphs;
  return c;
}

RunOut run(TrainConfig c, const std::string& name) {
  test_util::TempDir dir("cuda_graphs_" + name);
  c.metrics_path = dir.path("metrics.jsonl");
  RunOut r;
  const uint64_t syncs = cpu::host_synchronizations();
  r.result = train(c);
  r.host_syncs = cpu::host_synchronizations() - syncs;
  std::ifstream in(c.metrics_path);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("event")) r.grad_norms.push_back(j["grad_norm"].get<double>());
    else if (j["event"] == "summary") r.summary_graphs = j["cuda_graphs"].get<bool>();
  }
  return r;
}

void expect_same_run(const RunOut& a, const RunOut& b, const std::string& what) {
  ASSERT_EQ(a.result.losses.size(), b.result.losses.size()) << what;
  ASSERT_EQ(a.grad_norms.size(), a.result.losses.size()) << what;
  for (size_t i = 0; i < a.result.losses.size(); ++i) {
    EXPECT_EQ(a.result.losses[i], b.result.losses[i]) << what << ", step " << i + 1;
    EXPECT_EQ(a.grad_norms[i], b.grad_norms[i]) << what << ", step " << i + 1;
  }
  test::expect_same_state(a.result, b.result, what);
}

TEST(CudaGraphs, OnBitwiseEqualToOffAtEveryStageWithAccumulation) {
  for (int stage : {0, 1, 2, 3}) {
    // 4 and 2 micro-batches per step and device (4 only under TSan, which is ~10x slower).
    for (int micro : test::kThreadSanitizer ? std::vector<int>{1} : std::vector<int>{1, 2}) {
      const std::string what = "stage " + std::to_string(stage) + ", micro-batch " + std::to_string(micro);
      const RunOut off = run(small_run(CudaGraphs::kOff, stage, micro), "off");
      const RunOut on = run(small_run(CudaGraphs::kOn, stage, micro), "on");
      EXPECT_FALSE(off.result.cuda_graphs) << what;
      EXPECT_FALSE(off.summary_graphs) << what;
      EXPECT_TRUE(on.result.cuda_graphs) << what << ": no micro-batch was replayed";
      EXPECT_TRUE(on.summary_graphs) << what;
      expect_same_run(off, on, what);
      EXPECT_EQ(on.host_syncs, off.host_syncs) << what << ": capture or replay synchronised the host";
    }
  }
}

TEST(CudaGraphs, OnBitwiseEqualToOffIn16Bits) {
  // The GPT computes in 16 bits on the engine's 16-bit parameters (param_data); its fp32 gradient
  // buckets are transient at every stage. Stage 1 keeps the parameters resident, stage 3 gathers
  // them per visit; fp16 adds the dynamic loss scale the backward reads from the device.
  struct Case {
    Precision precision;
    int stage;
  };
  const std::vector<Case> cases = test::kThreadSanitizer
                                      ? std::vector<Case>{{Precision::kBf16, 3}}
                                      : std::vector<Case>{{Precision::kBf16, 1}, {Precision::kBf16, 3},
                                                          {Precision::kFp16, 2}};
  for (const Case& c : cases) {
    const std::string what = std::string(c.precision == Precision::kBf16 ? "bf16" : "fp16") + ", stage " +
                             std::to_string(c.stage);
    TrainConfig off = small_run(CudaGraphs::kOff, c.stage, 2);
    off.precision = c.precision;
    TrainConfig on = off;
    on.cuda_graphs = CudaGraphs::kOn;
    const RunOut a = run(off, "16bit_off"), b = run(on, "16bit_on");
    EXPECT_TRUE(b.result.cuda_graphs) << what;
    expect_same_run(a, b, what);
    EXPECT_EQ(b.host_syncs, a.host_syncs) << what;
  }
}

TEST(CudaGraphs, OnWithRecomputationAndOneMicroBatchPerStep) {
  // Full recomputation times each layer's re-run by host functions: captured and run by every
  // replay. One micro-batch per step: the warm-up is step 1, the capture step 2.
  TrainConfig off = small_run(CudaGraphs::kOff, 1, 4);
  off.recompute = Recompute::kFull;
  off.steps = 3;
  TrainConfig on = off;
  on.cuda_graphs = CudaGraphs::kOn;
  const RunOut a = run(off, "recompute_off"), b = run(on, "recompute_on");
  EXPECT_TRUE(b.result.cuda_graphs);
  expect_same_run(a, b, "recompute full, stage 1");
  EXPECT_GT(b.result.time_split.recompute, 0);
}

// Recovery snapshots, checkpoint saves and an in-process recovery happen between steps, outside
// every capture (a capture holds one piece of a micro-batch): with graphs on they are legal under
// CUDA's rules, the replays after them (and the graphs captured anew on the survivors) give the
// eager run's bits, and the checkpoints hold the same arrays.
TEST(CudaGraphs, OnWithSnapshotsSavesAndARecoveryEqualsOff) {
  test_util::TempDir dir("cuda_graphs_snapshots");
  TrainConfig off = small_run(CudaGraphs::kOff, 2, 2);
  off.precision = Precision::kBf16;
  off.steps = 6;
  off.snapshot_every = 2;
  off.save_every = 4;
  off.inject_faults = {{1, 6, false}};  // device 1 fails at step 6: the run goes on from step 4 on device 0
  TrainConfig on = off;
  on.cuda_graphs = CudaGraphs::kOn;
  off.checkpoint_dir = dir.path("off");
  on.checkpoint_dir = dir.path("on");
  const RunOut a = run(off, "snapshots_off"), b = run(on, "snapshots_on");
  EXPECT_TRUE(b.result.cuda_graphs);
  ASSERT_EQ(a.result.recoveries.size(), 1u);
  ASSERT_EQ(b.result.recoveries.size(), 1u);
  EXPECT_EQ(b.result.recoveries[0].resumed_from_step, 4);
  EXPECT_EQ(b.result.devices, 1);
  // The metrics hold step 5 twice (before the fault and again on the survivor).
  EXPECT_EQ(a.grad_norms, b.grad_norms);
  EXPECT_EQ(a.result.losses, b.result.losses);
  test::expect_same_state(a.result, b.result, "snapshots, saves and a recovery, bf16 stage 2");
  ASSERT_EQ(a.result.checkpoints.size(), b.result.checkpoints.size());
  ASSERT_FALSE(b.result.checkpoints.empty());
  for (size_t k = 0; k < a.result.checkpoints.size(); ++k) {
    const CheckpointReader x = CheckpointReader::open(a.result.checkpoints[k]);
    const CheckpointReader y = CheckpointReader::open(b.result.checkpoints[k]);
    for (const ManifestArray& arr : x.manifest().arrays) {
      const size_t bytes = arr.numel * storage_dtype_size(arr.dtype);
      std::vector<uint8_t> u(bytes, 0xAB), v(bytes, 0xCD);
      x.read(arr.name, 0, arr.numel, u.data());
      y.read(arr.name, 0, arr.numel, v.data());
      EXPECT_EQ(u, v) << b.result.checkpoints[k] << " " << arr.name;
    }
  }
}

TEST(CudaGraphs, AutoStaysEagerOnCpuDevices) {
  const RunOut off = run(small_run(CudaGraphs::kOff, 1, 2), "auto_off");
  const RunOut aut = run(small_run(CudaGraphs::kAuto, 1, 2), "auto");
  EXPECT_FALSE(aut.result.cuda_graphs);
  EXPECT_FALSE(aut.summary_graphs);
  expect_same_run(off, aut, "auto on CPU devices");
}

// auto's choice on CUDA devices, as a function (no GPU needed): capture, except where the run cannot
// be captured or --trace wants per-op times (a replay records none); on captures under --trace.
TEST(CudaGraphs, AutoCapturesOnCudaExceptUnderTrace) {
  TrainConfig c = small_run(CudaGraphs::kAuto, 1, 2);
  EXPECT_TRUE(use_cuda_graphs(c, Backend::kCuda, DType::kBF16));
  EXPECT_EQ(cuda_graphs_note(c, Backend::kCuda, DType::kBF16), "");
  EXPECT_FALSE(use_cuda_graphs(c, Backend::kCpu, DType::kBF16));
  EXPECT_EQ(cuda_graphs_note(c, Backend::kCpu, DType::kBF16), "");
  c.trace_path = "trace.json";
  EXPECT_FALSE(use_cuda_graphs(c, Backend::kCuda, DType::kF32));
  EXPECT_EQ(cuda_graphs_note(c, Backend::kCuda, DType::kF32),
            "--cuda-graphs auto runs eagerly: --trace times every op, which a replayed graph does not "
            "(--cuda-graphs on captures anyway)");
  c.cuda_graphs = CudaGraphs::kOn;
  EXPECT_TRUE(use_cuda_graphs(c, Backend::kCuda, DType::kF32));
  EXPECT_EQ(cuda_graphs_note(c, Backend::kCuda, DType::kF32), "");
  c.cuda_graphs = CudaGraphs::kAuto;
  c.trace_path.clear();
  c.tensor_parallel = 2;
  EXPECT_FALSE(use_cuda_graphs(c, Backend::kCuda, DType::kBF16));
  EXPECT_EQ(cuda_graphs_note(c, Backend::kCuda, DType::kBF16),
            "--cuda-graphs auto runs eagerly: tensor parallelism runs collectives inside every layer's forward "
            "and backward");
}

TEST(CudaGraphs, OnRefusesRunsItCannotCapture) {
  TrainConfig c = small_run(CudaGraphs::kOn, 1, 2);
  c.tensor_parallel = 2;
  test::expect_train_error(c, ErrorKind::kInvalidArgument,
                           "--cuda-graphs on cannot capture this run's micro-batches: tensor parallelism runs "
                           "collectives inside every layer's forward and backward");
  c.tensor_parallel = 1;
  c.pipeline_parallel = 2;
  c.micro_batch_size = 1;
  test::expect_train_error(c, ErrorKind::kInvalidArgument, "pipeline stages exchange activations");
}

}  // namespace
}  // namespace zt
