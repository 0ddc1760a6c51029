// resolve_run_shape and check_run_paths (train/run_shape.h): the defaults train and plan agree on,
// every data-independent check's sentence, 64-bit shape limits, and the input/output path rules.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <functional>
#include <filesystem>
#include <fstream>
#include <string>

#include "comm/nccl_comm.h"
#include "flag_rules.h"
#include "core/status.h"
#include "train/processes.h"
#include "model/config.h"
#include "test_util.h"
#include "train/run_shape.h"
#include "train/state_io.h"

namespace zt {
namespace {

namespace fs = std::filesystem;

// Runs fn and returns the zt::Error's message ("" when nothing was thrown); the kind must be
// kInvalidArgument (a user's mistake, exit code 2).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.message();
    return e.message();
  }
  return "";
}

TEST(RunShape, DefaultBatchIsTheSmallestMultipleOfTheDevicesAtOrAbove8Per2) {
  EXPECT_EQ(default_batch_size(true, 1), 8);
  EXPECT_EQ(default_batch_size(true, 2), 8);   // today's default job
  EXPECT_EQ(default_batch_size(true, 4), 16);  // unchanged where it already divided
  EXPECT_EQ(default_batch_size(true, 3), 18);
  EXPECT_EQ(default_batch_size(false, 2), 128);
  EXPECT_EQ(default_batch_size(false, 3), 258);
  for (int n = 1; n <= 64; ++n)
    for (bool gpt : {true, false}) {
      const int floor = (gpt ? 8 : 128) * ((n + 1) / 2), b = default_batch_size(gpt, n);
      EXPECT_EQ(b % n, 0) << n;
      EXPECT_GE(b, floor) << n;
      EXPECT_LT(b - n, floor) << n;  // the smallest such multiple
      // And the whole run shape resolves with it.
      const ModelConfig mc = make_model_config(gpt ? "gpt-tiny" : "mlp");
      EXPECT_EQ(resolve_run_shape(TrainConfig{}, mc, n, Backend::kCpu).cfg.batch_size, b) << n;
    }
}

TEST(RunShape, DefaultsOfTheDefaultJob) {
  const RunContext s = resolve_run_shape(TrainConfig{}, make_model_config("gpt-tiny"), 2, Backend::kCpu);
  EXPECT_EQ(s.cfg.batch_size, 8);
  EXPECT_EQ(s.cfg.micro_batch_size, 4);
  EXPECT_EQ(s.accum, 1);
  EXPECT_EQ(s.T, 64);
  EXPECT_EQ(s.cfg.train_seq_len, 64);
  EXPECT_EQ(s.cfg.steps, 1500);
  EXPECT_EQ(s.cfg.warmup_steps, 202);  // the sweep's pick (README): 13.5% of 1500
  EXPECT_EQ(s.cfg.eval_every, 375);
  EXPECT_FLOAT_EQ(s.cfg.lr, 1.88e-3f);
  EXPECT_FLOAT_EQ(s.cfg.min_lr, 1.88e-4f);
  EXPECT_EQ(s.precision, Precision::kFp32);
  EXPECT_EQ(s.working, DType::kF32);
  EXPECT_EQ(s.scaling, ZeroOptions::Scaling::kNone);
  EXPECT_EQ(s.plan.devices, 2);
  EXPECT_EQ(s.plan.zero_stage, 2);
  EXPECT_EQ(s.plan.micro_batch, 4);
  EXPECT_EQ(s.plan.seq_len, 64);
  EXPECT_EQ(s.plan.micro_batches, 1);
  EXPECT_TRUE(s.plan.sampling);
  EXPECT_FALSE(s.plan.sgd);
}

// The default job on a machine with GPUs (a fake device count; no GPU runs here): every GPU, bf16,
// the same batch per 2 devices, and --device-memory (the simulated devices' memory) and --tf32 (no fp32
// products in a bf16 run) refused.
TEST(RunShape, DefaultJobOnGpus) {
  const ModelConfig mc = make_model_config("gpt-tiny");
  for (int gpus : {1, 2, 8}) {
    const RunContext s = resolve_run_shape(TrainConfig{}, mc, gpus, Backend::kCuda);
    EXPECT_EQ(s.precision, Precision::kBf16) << gpus;
    EXPECT_EQ(s.working, DType::kBF16) << gpus;
    EXPECT_EQ(s.scaling, ZeroOptions::Scaling::kNone) << gpus;
    EXPECT_EQ(s.cfg.batch_size, default_batch_size(true, gpus)) << gpus;
    EXPECT_EQ(s.cfg.micro_batch_size * gpus, s.cfg.batch_size) << gpus;
    EXPECT_EQ(s.plan.zero_stage, 2) << gpus;
    EXPECT_EQ(s.cfg.steps, 1500) << gpus;
    auto named = [](const std::vector<InapplicableFlag>& flags, const std::string& name) {
      return std::any_of(flags.begin(), flags.end(), [&](const InapplicableFlag& f) { return f.flag == name; });
    };
    EXPECT_TRUE(named(inapplicable_run_flags(s, mc), "device-memory")) << gpus;
    // --tf32 rounds fp32 products only: the default bf16 run on GPUs has none.
    EXPECT_TRUE(named(inapplicable_run_flags(s, mc), "tf32")) << gpus;
    TrainConfig fp32;
    fp32.precision = Precision::kFp32;
    EXPECT_FALSE(named(inapplicable_run_flags(resolve_run_shape(fp32, mc, gpus, Backend::kCuda), mc), "tf32")) << gpus;
    EXPECT_FALSE(named(inapplicable_run_flags(resolve_run_shape(TrainConfig{}, mc, gpus, Backend::kCpu), mc),
                       "device-memory"))
        << gpus;
  }
}

TEST(RunShape, AccumulationPrecisionAndScaling) {
  TrainConfig c;
  c.batch_size = 48;
  c.micro_batch_size = 2;
  c.train_seq_len = 16;
  c.optimizer = OptimizerKind::kSgd;
  c.sample_tokens = 0;
  const ModelConfig mc = make_model_config("gpt-tiny");
  RunContext s = resolve_run_shape(c, mc, 4, Backend::kCuda);
  EXPECT_EQ(s.accum, 48 / 4 / 2);
  EXPECT_EQ(s.plan.micro_batches, 6);
  EXPECT_EQ(s.T, 16);
  EXPECT_EQ(s.precision, Precision::kBf16);  // auto on GPUs
  EXPECT_EQ(s.working, DType::kBF16);
  EXPECT_FLOAT_EQ(s.cfg.lr, 0.05f);  // SGD
  EXPECT_FALSE(s.plan.sampling);
  EXPECT_TRUE(s.plan.sgd);
  c.precision = Precision::kFp16;
  s = resolve_run_shape(c, mc, 4, Backend::kCpu);
  EXPECT_EQ(s.working, DType::kF16);
  EXPECT_EQ(s.scaling, ZeroOptions::Scaling::kDynamic);
  EXPECT_FLOAT_EQ(s.initial_scale, 65536.0f);
  c.loss_scale = parse_loss_scale("128");
  s = resolve_run_shape(c, mc, 4, Backend::kCpu);
  EXPECT_EQ(s.scaling, ZeroOptions::Scaling::kFixed);
  EXPECT_FLOAT_EQ(s.initial_scale, 128.0f);
  c.loss_scale = parse_loss_scale("none");
  EXPECT_EQ(resolve_run_shape(c, mc, 4, Backend::kCpu).scaling, ZeroOptions::Scaling::kNone);
}

TEST(RunShape, ImageDataLeavesTheStepsToTheData) {
  const RunContext s = resolve_run_shape(TrainConfig{}, make_model_config("mlp"), 2, Backend::kCpu);
  EXPECT_EQ(s.cfg.steps, -1);
  EXPECT_EQ(s.cfg.warmup_steps, -1);
  EXPECT_EQ(s.cfg.eval_every, -1);
  EXPECT_EQ(s.T, 1);
  EXPECT_EQ(s.cfg.batch_size, 128);
  EXPECT_FLOAT_EQ(s.cfg.lr, 1e-3f);
}

TEST(RunShape, EveryCheckSaysWhatIsWrong) {
  const ModelConfig tiny = make_model_config("gpt-tiny");
  struct Case {
    std::function<void(TrainConfig&)> set;
    int devices;
    const char* message;
  };
  const Case cases[] = {
      {[](TrainConfig& c) { c.batch_size = 9; }, 2, "--batch-size 9 does not split evenly over 2 devices"},
      {[](TrainConfig& c) { c.batch_size = 8, c.micro_batch_size = 3; }, 2, "is 4 per device, not a multiple of --micro-batch-size 3"},
      {[](TrainConfig& c) { c.batch_size = 0; }, 2, "--batch-size must be at least 1"},
      {[](TrainConfig& c) { c.micro_batch_size = -2; }, 2, "--micro-batch-size must be at least 1"},
      {[](TrainConfig& c) { c.train_seq_len = 65; }, 2, "above the model's context of 64"},
      {[](TrainConfig& c) { c.zero_stage = 4; }, 2, "--zero-stage must be 0, 1, 2 or 3"},
      {[](TrainConfig& c) { c.data = "fashion-mnist"; }, 2, "--data fashion-mnist is an image dataset"},
      {[](TrainConfig& c) { c.lr = INFINITY; }, 2, "--lr is out of range for a float"},
      {[](TrainConfig& c) { c.min_lr = INFINITY; }, 2, "--min-lr is out of range for a float"},
      {[](TrainConfig& c) { c.steps = 0; }, 2, "--steps must be at least 1"},
      {[](TrainConfig& c) { c.min_scale = 8, c.initial_scale = 4; }, 2, "0 < --min-scale <= --initial-scale"},
      {[](TrainConfig& c) { c.scale_window = 0; }, 2, "--scale-window must be at least 1"},
      {[](TrainConfig& c) { c.on_scale_collapse_bf16 = true; }, 2, "--precision fp16 runs only"},
      {[](TrainConfig& c) { c.weight_decay = -1; }, 2, "--weight-decay must not be negative"},
      {[](TrainConfig& c) { c.temperature = 0; }, 2, "--temperature > 0"},
      {[](TrainConfig& c) { c.resume = ResumeFrom::newest(); }, 2, "--resume auto needs --checkpoint-dir"},
      {[](TrainConfig& c) { c.steps = 10, c.profile_steps = "5:11"; }, 2, "--profile-steps 5:11 must satisfy"},
      {[](TrainConfig& c) { c.batch_size = INT_MAX - 1; }, 2, "tokens, above the limit of 2147483648"},
      {[](TrainConfig& c) { c.batch_size = 8; }, 0, "at least one device"},
  };
  for (const Case& k : cases) {
    TrainConfig c;
    k.set(c);
    const std::string msg = error_of([&] { resolve_run_shape(c, tiny, k.devices, Backend::kCpu); });
    EXPECT_NE(msg.find(k.message), std::string::npos) << "expected '" << k.message << "', got '" << msg << "'";
  }
}

// --loss-scale is parsed once, where the flag is read: the words, a fixed positive number, and one
// sentence for anything else.
TEST(RunShape, LossScaleIsParsedOnceIntoAMode) {
  EXPECT_EQ(parse_loss_scale("auto").mode, LossScale::Mode::kAuto);
  EXPECT_EQ(parse_loss_scale("dynamic").mode, LossScale::Mode::kDynamic);
  EXPECT_EQ(parse_loss_scale("none").mode, LossScale::Mode::kNone);
  const LossScale fixed = parse_loss_scale("128");
  EXPECT_EQ(fixed.mode, LossScale::Mode::kFixed);
  EXPECT_EQ(fixed.fixed, 128.0f);
  for (const char* bad : {"lots", "", "0", "-4", "inf", "nan", "12x"})
    EXPECT_NE(error_of([&] { parse_loss_scale(bad); }).find("--loss-scale must be dynamic, none or a positive number"),
              std::string::npos)
        << bad;
  // A number too large for the float that holds the scale says so.
  EXPECT_NE(error_of([&] { parse_loss_scale("1e39"); }).find("is above 3.4e38, the largest fp32 number"), std::string::npos);
}

// --comm nccl: refused before any device wherever NCCL cannot run the data group, one sentence
// each; the CUDA-backend cases are planned (no GPU needed), and a build without NCCL says that.
TEST(RunShape, CommNcclIsRefusedWhereItCannotRun) {
  const ModelConfig tiny = make_model_config("gpt-tiny");
  auto refusal = [&](const std::function<void(TrainConfig&)>& set, int devices, Backend backend) {
    TrainConfig c;
    c.comm = CommEngine::kNccl;
    set(c);
    return error_of([&] { resolve_run_shape(c, tiny, devices, backend); });
  };
  EXPECT_EQ(refusal([](TrainConfig& c) { c.devices = "cpu:4"; }, 4, Backend::kCpu),
            "--comm nccl needs CUDA devices; this run uses cpu:4");
  EXPECT_EQ(refusal([](TrainConfig& c) { c.devices = "all"; }, 2, Backend::kCpu),
            "--comm nccl needs CUDA devices; this run uses cpu:2 (--devices all without a usable GPU)");
  TrainConfig ring;
  ring.devices = "cpu:2";
  EXPECT_NO_THROW(resolve_run_shape(ring, tiny, 2, Backend::kCpu));
  if (!nccl_built()) {
    EXPECT_NE(refusal([](TrainConfig& c) { c.devices = "cuda:0"; }, 1, Backend::kCuda).find("built without it"),
              std::string::npos);
    return;
  }
  EXPECT_EQ(refusal([](TrainConfig& c) { c.devices = "cuda:0"; }, 1, Backend::kCuda), "");
  EXPECT_NE(refusal([](TrainConfig& c) { c.devices = "cuda:0x2"; }, 2, Backend::kCuda).find("shares a GPU"),
            std::string::npos);
  const std::pair<std::function<void(TrainConfig&)>, const char*> ring_only[] = {
      {[](TrainConfig& c) { c.tensor_parallel = 2; }, "--tensor-parallel"},
      {[](TrainConfig& c) { c.pipeline_parallel = 2; }, "--pipeline-parallel"},
      {[](TrainConfig& c) { c.offload_optimizer = true; }, "--offload optimizer"},
      {[](TrainConfig& c) { c.snapshot_every = 2; }, "--snapshot-every"},
  };
  for (const auto& [set, flag] : ring_only) {
    const std::string msg = refusal(
        [&](TrainConfig& c) {
          c.devices = "cuda:0,1";
          set(c);
        },
        2, Backend::kCuda);
    EXPECT_EQ(msg, std::string("--comm nccl runs the data-parallel collectives only and ") + flag +
                       " is built on the ring, so use --comm ring with it");
  }
}

// --comm nccl over processes: two ranks on one GPU of one host are refused before NCCL's init; a
// GPU is its PCI address, so processes that CUDA_VISIBLE_DEVICES gave one GPU each (all "cuda:0")
// pass, and one GPU under two ordinals does not.
TEST(RunShape, NcclProcessesOnOneGpuAreFoundByTheirPciAddress) {
  const std::string h100 = "NVIDIA H100 80GB HBM3, compute capability 9.0, 132 SMs";
  const auto gpu = [&](int ordinal, const char* bus) {
    return "cuda:" + std::to_string(ordinal) + " (" + h100 + ", PCI " + bus + ")";
  };
  // srun --gpus-per-task=1: every process sees its own GPU as cuda:0.
  EXPECT_NO_THROW(refuse_shared_nccl_gpus(
      {{"node1", gpu(0, "00000000:18:00.0")}, {"node1", gpu(0, "00000000:2A:00.0")}, {"node2", gpu(0, "00000000:18:00.0")}}));
  const std::string twice =
      error_of([&] { refuse_shared_nccl_gpus({{"node1", gpu(0, "00000000:18:00.0"), gpu(1, "00000000:2A:00.0")},
                                              {"node1", gpu(0, "00000000:2A:00.0")}}); });
  EXPECT_EQ(twice, "--comm nccl: processes 0 and 1 both drive one GPU (" + gpu(1, "00000000:2A:00.0") + " and " +
                       gpu(0, "00000000:2A:00.0") +
                       ") on host node1 (NCCL needs one rank per GPU); give each process its own GPUs, e.g. one "
                       "process per node with --devices all");
  // Names without an address (another backend) compare whole.
  EXPECT_NE(error_of([] { refuse_shared_nccl_gpus({{"h", "cuda:0 (X)"}, {"h", "cuda:0 (X)"}}); }), "");
  EXPECT_NO_THROW(refuse_shared_nccl_gpus({{"h", "cuda:0 (X)"}, {"h", "cuda:1 (X)"}}));
}

// --pipeline-parallel (issue #15 item 6): one sentence for each mistake, and for each combination
// that is not built yet, before any device is touched.
TEST(RunShape, PipelineMistakesAreOneSentenceEach) {
  const ModelConfig tiny = make_model_config("gpt-tiny");  // 4 blocks
  struct Case {
    std::function<void(TrainConfig&)> set;
    int devices;
    const char* message;
  };
  const auto pp = [](int p, const char* schedule = "1f1b") {
    return [p, schedule](TrainConfig& c) { c.pipeline_parallel = p, c.pp_schedule = parse_pipe_schedule(schedule), c.batch_size = 8; };
  };
  const Case cases[] = {
      {pp(3), 4, "--pipeline-parallel 3 does not divide the 4 devices"},
      {[&](TrainConfig& c) { pp(8)(c); }, 8, "--pipeline-parallel 8"},  // more stages than the 4 blocks
      {[&](TrainConfig& c) { pp(2)(c), c.pp_layout = "3,2"; }, 2, "covers 5 blocks but the model has 4"},
      {[&](TrainConfig& c) { pp(2)(c), c.pp_layout = "4"; }, 2, "has 1 entries but the pipeline has 2"},
      {[&](TrainConfig& c) { pp(2)(c), c.pp_layout = "4,0"; }, 2, "every stage needs at least one block"},
      {[&](TrainConfig& c) { pp(2)(c), c.pp_layout = "2,x"; }, 2, "'x' is not a block count"},
      {[&](TrainConfig& c) { pp(2)(c), c.virtual_stages = 2; }, 2, "--virtual-stages 2 needs --pp-schedule interleaved"},
      {[&](TrainConfig& c) { c.virtual_stages = 2; }, 2, "need --pipeline-parallel 2 or more"},
      {[&](TrainConfig& c) { pp(2, "interleaved")(c), c.micro_batch_size = 8; }, 2,
       "--pp-schedule interleaved needs the micro-batches per data rank (1 = --batch-size 8 / 1 / --micro-batch-size 8)"},
      {[&](TrainConfig& c) { pp(2)(c), c.model = "mlp"; }, 2, "--pipeline-parallel splits GPT models only"},
      {[&](TrainConfig& c) { pp(2)(c), c.tensor_parallel = 2; }, 6, "--pipeline-parallel 2 does not divide the 3"},
      {[&](TrainConfig& c) { pp(2)(c), c.zero_stage = 3; }, 2, "--zero-stage 3 with --pipeline-parallel"},
      {[&](TrainConfig& c) { pp(2, "zb-h1")(c), c.recompute = Recompute::kFull; }, 2,
       "--recompute with --pp-schedule zb-h1"},
  };
  for (const Case& k : cases) {
    TrainConfig c;
    k.set(c);
    const ModelConfig mc = c.model == "mlp" ? make_model_config("mlp") : tiny;
    const std::string msg = error_of([&] { resolve_run_shape(c, mc, k.devices, Backend::kCpu); });
    EXPECT_NE(msg.find(k.message), std::string::npos) << "expected '" << k.message << "', got '" << msg << "'";
  }
  // A valid pipeline: micro-batches per data rank are the schedule's.
  TrainConfig c;
  pp(2, "zb-h1")(c);
  c.micro_batch_size = 1;
  EXPECT_EQ(resolve_run_shape(c, tiny, 4, Backend::kCpu).accum, 4);  // 8 rows over 2 data ranks, 1 per micro-batch
  // Without --micro-batch-size: the largest micro-batch that gives each data rank at least 2P
  // micro-batches (a multiple of P for interleaved), else micro-batches of one sequence.
  struct Default {
    int devices, pipeline, batch;
    const char* schedule;
    int micro, accum;
  };
  for (const Default& d : {Default{2, 2, 8, "1f1b", 2, 4}, Default{4, 2, 16, "1f1b", 2, 4},
                           Default{2, 2, 12, "interleaved", 3, 4}, Default{4, 4, 8, "gpipe", 1, 8},
                           Default{2, 2, 6, "interleaved", 1, 6}}) {
    TrainConfig k;
    pp(d.pipeline, d.schedule)(k);
    k.batch_size = d.batch;
    const RunContext rs = resolve_run_shape(k, tiny, d.devices, Backend::kCpu);
    EXPECT_EQ(rs.cfg.micro_batch_size, d.micro) << d.devices << " devices, batch " << d.batch << ", " << d.schedule;
    EXPECT_EQ(rs.accum, d.accum) << d.devices << " devices, batch " << d.batch << ", " << d.schedule;
  }
}

TEST(RunShape, ShapesBeyondTheLimitsAreRefusedBeforeAnythingIsSized) {
  ModelOverrides o;
  o.embd = INT_MAX, o.heads = 1;  // issue 12 item 5: shard_range(n=-23622319953)
  EXPECT_NE(error_of([&] { make_model_config("gpt-tiny", o); }).find("above the limit of 1099511627776"),
            std::string::npos);
  o = {};
  o.layers = INT_MAX;
  EXPECT_NE(error_of([&] { make_model_config("gpt-tiny", o); }).find("parameters"), std::string::npos);
  o = {};
  o.hidden = {1 << 20, 1 << 20, 1 << 20};
  EXPECT_NE(error_of([&] { make_model_config("mlp", o); }).find("parameters"), std::string::npos);
  // The largest preset, and a model just under the bound's order, are accepted.
  EXPECT_EQ(error_of([] { make_model_config("gpt2-1558m"); }), "");
  // A long context: one layer's T x T attention for every head of a micro-batch.
  o = {};
  o.seq_len = 1 << 20, o.heads = 64, o.embd = 64 * 8;
  const ModelConfig wide = make_model_config("gpt-tiny", o);
  TrainConfig c;
  c.batch_size = 2;
  EXPECT_NE(error_of([&] { resolve_run_shape(c, wide, 1, Backend::kCpu); }).find("one layer's activations"),
            std::string::npos);
  c.train_seq_len = 1024;
  EXPECT_EQ(error_of([&] { resolve_run_shape(c, wide, 1, Backend::kCpu); }), "");
}

// A GPT whose attention the CUDA kernels cannot run (the tiled fallback's head-size buckets, the
// heads as a grid dimension: kernels/ops.h) is refused on the CUDA backend before anything is
// sized, with the fix named; the CPU backend trains it. Planned without a GPU.
TEST(RunShape, AttentionTheCudaKernelsCannotRunIsRefusedBeforeTheRun) {
  auto refusal = [](int embd, int heads, Backend backend, int tensor = 1) {
    ModelOverrides o;
    o.embd = embd, o.heads = heads;
    const ModelConfig mc = make_model_config("gpt-tiny", o);
    TrainConfig c;
    c.batch_size = tensor, c.tensor_parallel = tensor;
    return error_of([&] { resolve_run_shape(c, mc, tensor, backend); });
  };
  EXPECT_EQ(refusal(1024, 4, Backend::kCuda),
            "the model's heads are 256 wide (1024 / 4 heads), above the 128 that the CUDA attention kernels take; "
            "use --heads 8 or more (a divisor of 1024), or the CPU backend");
  EXPECT_NE(refusal(1000, 4, Backend::kCuda).find("use --heads 8 or more (a divisor of 1000)"), std::string::npos);
  EXPECT_NE(refusal(129, 1, Backend::kCuda).find("use --heads 3 or more"), std::string::npos);  // 129 = 3 x 43
  EXPECT_EQ(refusal(1024, 4, Backend::kCpu), "");
  // The largest bucket, and GPT-2's own heads of 64 (also under tensor parallelism, whose ranks
  // keep the head size), run.
  EXPECT_EQ(refusal(1024, 8, Backend::kCuda), "");
  EXPECT_EQ(refusal(1600, 25, Backend::kCuda, 5), "");
  EXPECT_NE(refusal(1024, 4, Backend::kCuda, 2).find("256 wide"), std::string::npos);
  EXPECT_NE(refusal(1 << 16, 1 << 16, Backend::kCuda).find("65536 heads, above the 65535"), std::string::npos);
}

TEST(RunShape, OutputsNeverOverwriteInputsOrEachOther) {
  test_util::TempDir dir("run_paths");
  const std::string data = dir.path("book.txt");
  std::ofstream(data) << "some text";
  fs::create_hard_link(data, dir.path("alias.txt"));
  TrainConfig c;
  c.data = data;
  EXPECT_EQ(error_of([&] { check_run_paths(c, dir.path("curve.svg")); }), "");
  EXPECT_NE(error_of([&] { check_run_paths(c, data); }).find("--plot '" + data + "' is the --data input"),
            std::string::npos);
  c.metrics_path = dir.path("alias.txt");  // the same inode under another name
  EXPECT_NE(error_of([&] { check_run_paths(c); }).find("is the --data input"), std::string::npos);
  c.metrics_path = dir.path("sub/../m.jsonl");  // not there yet: canonical paths
  c.trace_path = dir.path("m.jsonl");
  EXPECT_NE(error_of([&] { check_run_paths(c); }).find("--metrics and --trace both name"), std::string::npos);
  c.trace_path = dir.path("t.json");
  EXPECT_EQ(error_of([&] { check_run_paths(c); }), "");
  c.checkpoint_dir = dir.path("ckpt");
  c.resume = ResumeFrom::checkpoint(dir.path("ckpt"));  // resuming from the checkpoint directory is how --resume works
  EXPECT_EQ(error_of([&] { check_run_paths(c); }), "");
  c.init_from = dir.path("w.safetensors");
  EXPECT_NE(error_of([&] { check_run_paths(c); }).find("--init-from only seeds a fresh run"), std::string::npos);
  c.resume = ResumeFrom::newest();  // nothing to resume in an empty --checkpoint-dir: --init-from seeds the run
  EXPECT_EQ(error_of([&] { check_run_paths(c); }), "");
}

// The launch's size from the launcher's environment: OpenMPI first, then PMI, PMIx, and Slurm's
// task count only under a PMIx server; nothing set is one process.
TEST(RunShape, LaunchedProcessesReadsTheLaunchersEnvironment) {
  const char* names[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "PMIX_RANK", "SLURM_STEP_NUM_TASKS",
                         "SLURM_NTASKS"};
  for (const char* n : names) unsetenv(n);
  EXPECT_EQ(launched_processes(), 1);
  setenv("SLURM_NTASKS", "6", 1);
  EXPECT_EQ(launched_processes(), 1) << "a Slurm variable alone is a plain srun: singletons";
  setenv("PMIX_RANK", "0", 1);
  EXPECT_EQ(launched_processes(), 6);
  setenv("SLURM_STEP_NUM_TASKS", "4", 1);
  EXPECT_EQ(launched_processes(), 4);
  setenv("PMIX_SIZE", "3", 1);
  EXPECT_EQ(launched_processes(), 3);
  setenv("PMI_SIZE", "2", 1);
  EXPECT_EQ(launched_processes(), 2);
  setenv("OMPI_COMM_WORLD_SIZE", "5", 1);
  EXPECT_EQ(launched_processes(), 5);
  for (const char* n : names) unsetenv(n);
}

// A plain launch is one process of one, every exchange between processes the identity: all_gather
// returns its input, no checkpoint team (the process writes alone), a snapshot holds every rank,
// the header names no processes, and of the configuration only a topology that does nothing here
// gets a note (the final sample stays: only several processes drop it).
TEST(RunShape, OneProcessIsTheIdentityOfSeveral) {
  for (const char* n : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "PMIX_RANK"}) unsetenv(n);
  TrainConfig cfg;
  cfg.sample_tokens = 32;
  const std::unique_ptr<Processes> procs = Processes::join(cfg);
  EXPECT_EQ(procs->rank(), 0);
  EXPECT_EQ(procs->size(), 1);
  EXPECT_EQ(procs->all_gather({1.5, -2.0}, "test"), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(procs->checkpoint_team(), nullptr);
  EXPECT_EQ(procs->span(), "");
  HostSnapshot snap;
  snap.shards.resize(3);
  procs->own_part(snap, 3);
  EXPECT_EQ(snap.shards.size(), 3u);
  EXPECT_EQ(snap.first_rank, 0);
  EXPECT_EQ(snap.world_ranks, 0);  // every rank: a complete snapshot
  EXPECT_TRUE(procs->settle(cfg).empty());
  cfg.comm_topology = CommTopology::kHierarchical;
  const std::vector<std::string> notes = procs->settle(cfg);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("--comm-topology hierarchical changes nothing in one process"), std::string::npos);
  EXPECT_EQ(cfg.sample_tokens, 32);
}

}  // namespace
}  // namespace zt
