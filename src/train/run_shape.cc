// Run-shape resolution (train/run_shape.h): defaults, accumulation, precision and loss scaling,
// and the checks that need neither the data nor a device.
#include "train/run_shape.h"

#include <sys/stat.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <utility>

#include "checkpoint/checkpoint.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "pipeline/check.h"
#include "pipeline/partition.h"
#include "pipeline/schedule.h"
#include "train/comm_engine.h"
#include "train/graph_step.h"
#include "train/processes.h"
#include "train/trace.h"

namespace zt {

namespace {

// The float flags arrive as floats: a value beyond FLT_MAX became inf when it was parsed.
void require_float(float v, const char* flag) {
  ZT_REQUIRE(std::isfinite(v), flag, " is out of range for a float (at most ", FLT_MAX, "), got ", v);
}

}  // namespace

int default_batch_size(bool gpt, int devices) {
  const int64_t base = int64_t{gpt ? 8 : 128} * ((devices + 1) / 2);
  return static_cast<int>((base + devices - 1) / devices * devices);
}

namespace {

// The model's own requirements of the flags: GPT's training sequence and the data kind.
void resolve_sequence(RunContext& s) {
  TrainConfig& cfg = s.cfg;
  const ModelConfig& mc = s.mc;
  if (!s.is_gpt) return;
  ZT_REQUIRE(cfg.data != "fashion-mnist", "--data fashion-mnist is an image dataset; use it with --model mlp");
  if (cfg.train_seq_len == 0) cfg.train_seq_len = mc.seq_len;
  ZT_REQUIRE(cfg.train_seq_len >= 1 && cfg.train_seq_len <= mc.seq_len, "sequence length ", cfg.train_seq_len,
             " is above the model's context of ", mc.seq_len, " tokens; raise --seq-len or lower --train-seq-len");
}

// Tensor parallelism: the devices form a (data x tensor) mesh; the batch splits over the data
// ranks only (the ranks of a tensor group run the same rows).
void check_tensor_parallel(const RunContext& s) {
  const TrainConfig& cfg = s.cfg;
  const ModelConfig& mc = s.mc;
  const int N = s.devices, TP = cfg.tensor_parallel;
  ZT_REQUIRE(TP >= 1, "--tensor-parallel must be at least 1, got ", TP);
  if (TP == 1) return;
  ZT_REQUIRE(s.is_gpt, "--tensor-parallel splits GPT models only; run --model ", mc.preset.empty() ? "mlp" : mc.preset,
             " with --tensor-parallel 1");
  if (N % TP != 0) {
    int nearest = 1;
    for (int k = 1; k <= N; ++k)
      if (N % k == 0 && std::abs(k - TP) < std::abs(nearest - TP)) nearest = k;
    ZT_THROW(ErrorKind::kInvalidArgument, "--tensor-parallel ", TP, " does not divide the ", N, " device",
             N == 1 ? "" : "s", "; the nearest valid degree is ", nearest);
  }
  make_model(mc, cfg.recompute, TensorParallel{TP, cfg.sequence_parallel});  // the model's own checks
}

// Shapes the CPU backend trains but the CUDA kernels cannot (kernels/ops.h "attention shapes the
// CUDA kernels take"): refused here, before anything is allocated, rather than at the first
// attention call that a library declines, mid-run.
void check_cuda_shapes(const RunContext& s) {
  if (s.backend != Backend::kCuda || !s.is_gpt) return;
  ops::require_cuda_attention_shape(s.mc.embd, s.mc.heads);
}

// Pipeline parallelism: P stages of contiguous blocks; the batch splits over the N / P data
// ranks of every stage, and each data rank's micro-batches are the schedule's.
void check_pipeline(const RunContext& s) {
  const TrainConfig& cfg = s.cfg;
  const ModelConfig& mc = s.mc;
  const int PP = cfg.pipeline_parallel;
  ZT_REQUIRE(PP >= 1, "--pipeline-parallel must be at least 1, got ", PP);
  ZT_REQUIRE(cfg.virtual_stages >= 1, "--virtual-stages must be at least 1, got ", cfg.virtual_stages);
  if (PP == 1) {
    ZT_REQUIRE(cfg.virtual_stages == 1 && cfg.pp_layout.empty(),
               "--virtual-stages and --pp-layout need --pipeline-parallel 2 or more");
    return;
  }
  ZT_REQUIRE(s.is_gpt, "--pipeline-parallel splits GPT models only; run --model ",
             mc.preset.empty() ? "mlp" : mc.preset, " with --pipeline-parallel 1");
  ZT_REQUIRE(cfg.virtual_stages == 1 || cfg.pp_schedule == PipeSchedule::kInterleaved,
             "--virtual-stages ", cfg.virtual_stages, " needs --pp-schedule interleaved");
  validate_pipeline_shape(s.devices / cfg.tensor_parallel, PP, cfg.virtual_stages, mc.layers);  // over the tensor groups
  if (!cfg.pp_layout.empty())
    validate_pp_layout(parse_pp_layout(cfg.pp_layout), mc.layers, PP, cfg.virtual_stages);
  // What pipelines do not compose with yet: one sentence each, never a silent fallback.
  ZT_REQUIRE(cfg.zero_stage <= 2, "--zero-stage 3 with --pipeline-parallel would gather every block again for "
             "each micro-batch of the schedule; use --zero-stage 0, 1 or 2");
  ZT_REQUIRE(!cfg.offload_optimizer, "--offload optimizer with --pipeline-parallel is not built yet");
  ZT_REQUIRE(cfg.recompute == Recompute::kNone || cfg.pp_schedule != PipeSchedule::kZbH1,
             "--recompute with --pp-schedule zb-h1 is not built: the split backward keeps what the weight "
             "gradients need, which recomputation would drop; use --pp-schedule 1f1b or interleaved");
  ZT_REQUIRE(cfg.test.gradient_faults.empty(), "gradient faults with --pipeline-parallel are not built yet");
}

// The global batch over the data ranks, the micro-batch and the accumulation; a pipeline's
// schedule is built and checked for these micro-batches.
void resolve_batch(RunContext& s) {
  TrainConfig& cfg = s.cfg;
  const int TP = cfg.tensor_parallel, PP = cfg.pipeline_parallel;
  const PipeSchedule pp_kind = cfg.pp_schedule;
  const int DP = s.devices / TP / PP;
  const char* unit = TP > 1 || PP > 1 ? " data-parallel rank" : " device";
  if (cfg.batch_size < 0) cfg.batch_size = default_batch_size(s.is_gpt, DP);
  ZT_REQUIRE(cfg.batch_size >= 1, "--batch-size must be at least 1, got ", cfg.batch_size);
  ZT_REQUIRE(cfg.batch_size % DP == 0, "--batch-size ", cfg.batch_size, " does not split evenly over ", DP, unit,
             "s; use a multiple of ", DP);
  if (cfg.micro_batch_size == 0) {
    cfg.micro_batch_size = cfg.batch_size / DP;
    if (PP > 1) {
      // A pipeline fills its stages with micro-batches: by default the largest micro-batch that
      // still gives at least 2P of them per data rank (a multiple of P for the interleaved
      // schedule), else one sequence each.
      const int rows = cfg.batch_size / DP;
      cfg.micro_batch_size = 1;
      for (int mb = rows; mb >= 1; --mb) {
        const int m = rows / mb;
        if (rows % mb == 0 && m >= 2 * PP && (pp_kind != PipeSchedule::kInterleaved || m % PP == 0)) {
          cfg.micro_batch_size = mb;
          break;
        }
      }
    }
  }
  ZT_REQUIRE(cfg.micro_batch_size >= 1, "--micro-batch-size must be at least 1, got ", cfg.micro_batch_size);
  ZT_REQUIRE((cfg.batch_size / DP) % cfg.micro_batch_size == 0, "--batch-size ", cfg.batch_size, " over ", DP, unit,
             DP == 1 ? "" : "s", " is ", cfg.batch_size / DP, " per", unit, ", not a multiple of --micro-batch-size ",
             cfg.micro_batch_size, "; the global batch must split into whole micro-batches");
  s.accum = cfg.batch_size / DP / cfg.micro_batch_size;
  if (PP > 1) {
    ZT_REQUIRE(pp_kind != PipeSchedule::kInterleaved || s.accum % PP == 0, "--pp-schedule interleaved needs the ",
               "micro-batches per data rank (", s.accum, " = --batch-size ", cfg.batch_size, " / ", DP, " / --micro-batch-size ",
               cfg.micro_batch_size, ") to be a multiple of --pipeline-parallel ", PP,
               "; change --micro-batch-size or --batch-size");
    // The schedule's own checks, then the deadlock check of its lists (a schedule that could hang
    // is a bug caught here, before any device), as the run will execute them.
    check_schedule(make_schedule(pp_kind, PP, s.accum, cfg.virtual_stages));
  }
  s.T = s.is_gpt ? cfg.train_seq_len : 1;
}

// Sizes that follow from the batch, in 64 bits: one micro-batch's tokens and the largest
// per-layer activation (the MLP's widest layer; GPT's 4C-wide MLP input or the T x T attention).
void check_activation_limits(const RunContext& s) {
  const ModelConfig& mc = s.mc;
  const int64_t B = s.cfg.micro_batch_size, T = s.T;
  const int64_t tokens = B * T;  // both < 2^31: no overflow
  ZT_REQUIRE(tokens <= kMaxMicroBatchTokens, "a micro-batch of ", B, " sequences of ", T, " tokens is ", tokens,
             " tokens, above the limit of ", kMaxMicroBatchTokens, "; lower --micro-batch-size or --train-seq-len");
  int64_t widest = 0;
  if (s.is_gpt) {
    widest = std::max<int64_t>(int64_t{4} * mc.embd, int64_t{mc.heads} * T);
    widest = std::max<int64_t>(widest, mc.vocab);
  } else {
    widest = std::max<int64_t>(mc.input_dim, mc.classes);
    for (int h : mc.hidden) widest = std::max<int64_t>(widest, h);
  }
  // tokens <= 2^31 and widest < 2^33: the product fits in 64 bits.
  ZT_REQUIRE(tokens * widest <= kMaxLayerActivation, "one layer's activations for a micro-batch of ", tokens,
             " tokens would hold ", tokens * widest, " elements, above the limit of ", kMaxLayerActivation,
             "; lower --micro-batch-size, --train-seq-len or the model's width");
}

// Precision and loss scaling.
void resolve_precision(RunContext& s) {
  const TrainConfig& cfg = s.cfg;
  s.precision = cfg.precision != Precision::kAuto ? cfg.precision
                : s.backend == Backend::kCuda     ? Precision::kBf16
                                                  : Precision::kFp32;
  s.working = s.precision == Precision::kBf16   ? DType::kBF16
              : s.precision == Precision::kFp16 ? DType::kF16
                                                : DType::kF32;
  switch (cfg.loss_scale.mode) {
    case LossScale::Mode::kAuto:
      if (s.precision == Precision::kFp16) s.scaling = ZeroOptions::Scaling::kDynamic, s.initial_scale = cfg.initial_scale;
      break;
    case LossScale::Mode::kDynamic: s.scaling = ZeroOptions::Scaling::kDynamic, s.initial_scale = cfg.initial_scale; break;
    case LossScale::Mode::kNone: break;
    case LossScale::Mode::kFixed: s.scaling = ZeroOptions::Scaling::kFixed, s.initial_scale = cfg.loss_scale.fixed; break;
  }
  require_float(cfg.initial_scale, "--initial-scale");
  require_float(cfg.min_scale, "--min-scale");
  require_float(cfg.max_scale, "--max-scale");
  ZT_REQUIRE(cfg.scale_window >= 1, "--scale-window must be at least 1, got ", cfg.scale_window);
  ZT_REQUIRE(cfg.scale_hysteresis >= 1, "--scale-hysteresis must be at least 1, got ", cfg.scale_hysteresis);
  ZT_REQUIRE(cfg.min_scale > 0 && cfg.min_scale <= cfg.max_scale && cfg.initial_scale >= cfg.min_scale &&
                 cfg.initial_scale <= cfg.max_scale,
             "the loss scales must satisfy 0 < --min-scale <= --initial-scale <= --max-scale, got ", cfg.min_scale, ", ",
             cfg.initial_scale, ", ", cfg.max_scale);
  ZT_REQUIRE(cfg.max_skipped_steps >= 1, "--max-skipped-steps must be at least 1, got ", cfg.max_skipped_steps);
  ZT_REQUIRE(!cfg.on_scale_collapse_bf16 || s.precision == Precision::kFp16,
             "--on-scale-collapse bf16 applies to --precision fp16 runs only");
  if (cfg.cuda_graphs == CudaGraphs::kOn) {
    const std::string why = cuda_graphs_unsupported(cfg, s.working);
    ZT_REQUIRE(why.empty(), "--cuda-graphs on cannot capture this run's micro-batches: ", why,
               " (or run --cuda-graphs auto or off)");
  }
}

// Steps, the learning-rate schedule, sampling and the remaining single-flag checks. Image data
// knows its steps only from its size (trainer: epochs).
void resolve_schedule(RunContext& s) {
  TrainConfig& cfg = s.cfg;
  const bool is_gpt = s.is_gpt;
  ZT_REQUIRE(cfg.steps == -1 || cfg.steps >= 1, "--steps must be at least 1, got ", cfg.steps);
  if (cfg.steps < 0 && is_gpt) cfg.steps = 1500;  // gpt-tiny reaches within ~0.15 nats of the synthetic floor
  if (!cfg.profile_steps.empty() && cfg.steps > 0) parse_step_range(cfg.profile_steps, cfg.steps);
  require_float(cfg.lr, "--lr");
  // GPT's AdamW defaults (lr 1.88e-3, warmup 13.5% of the steps) are the pick of a sweep over the
  // default job (README, "The default job's hyper-parameters"); 3e-3 with 2% warmup spiked at step 11.
  if (cfg.lr < 0) cfg.lr = cfg.optimizer == OptimizerKind::kAdamW ? (is_gpt ? 1.88e-3f : 1e-3f) : 0.05f;
  ZT_REQUIRE(cfg.lr > 0, "--lr must be positive, got ", cfg.lr);
  require_float(cfg.min_lr, "--min-lr");
  if (cfg.min_lr < 0) cfg.min_lr = cfg.lr / 10;
  ZT_REQUIRE(cfg.schedule == LrSchedule::kConstant || cfg.min_lr <= cfg.lr, "--min-lr ", cfg.min_lr,
             " is above --lr ", cfg.lr, "; the schedule decays from --lr down to --min-lr");
  if (cfg.steps > 0) {
    if (cfg.warmup_steps < 0)
      cfg.warmup_steps = std::max(1, is_gpt && cfg.optimizer == OptimizerKind::kAdamW ? static_cast<int>(cfg.steps * 27LL / 200)
                                                                                   : cfg.steps / 50);
    if (cfg.eval_every < 0) cfg.eval_every = std::max(1, cfg.steps / 4);
  }
  require_float(cfg.weight_decay, "--weight-decay");
  require_float(cfg.grad_clip, "--grad-clip");
  require_float(cfg.temperature, "--temperature");
  ZT_REQUIRE(cfg.weight_decay >= 0, "--weight-decay must not be negative, got ", cfg.weight_decay);
  ZT_REQUIRE(cfg.grad_clip >= 0, "--grad-clip must not be negative, got ", cfg.grad_clip);
  ZT_REQUIRE(cfg.top_k >= 0 && cfg.temperature > 0, "--top-k must be >= 0 and --temperature > 0");
  ZT_REQUIRE(!cfg.resume.newest_in_dir() || !cfg.checkpoint_dir.empty(), "--resume auto needs --checkpoint-dir");
  // A fault that can never fire would make a recovery test pass without testing anything.
  const int N = s.devices;
  for (const FaultInjection& f : cfg.inject_faults) {
    ZT_REQUIRE(f.device < N, "--inject-fault device=", f.device, " is not a device of this run (it has ", N,
               " device", N == 1 ? "" : "s", ", numbered from 0)");
    ZT_REQUIRE(cfg.steps < 0 || f.step <= cfg.steps, "--inject-fault step=", f.step, " is past the run's last step (",
               cfg.steps, "), so it would never fire");
  }
}

// The memory plan's inputs (micro-batch and accumulation follow the split).
void fill_plan(RunContext& s) {
  const TrainConfig& cfg = s.cfg;
  const int TP = cfg.tensor_parallel, PP = cfg.pipeline_parallel;
  s.plan.devices = s.devices;
  s.plan.zero_stage = cfg.zero_stage;
  s.plan.micro_batch = cfg.micro_batch_size;
  s.plan.seq_len = s.T;
  s.plan.sgd = cfg.optimizer == OptimizerKind::kSgd;
  s.plan.micro_batches = s.accum;
  s.plan.sampling = s.is_gpt && (cfg.sample_tokens > 0 || cfg.sample_every > 0);
  s.plan.working = s.working;
  s.plan.recompute = cfg.recompute;
  s.plan.offload = cfg.offload_optimizer;
  s.plan.offload_fraction = cfg.offload_fraction;
  s.plan.offload_delay = cfg.offload_delay_update;
  s.plan.tensor = TP;
  s.plan.sequence_parallel = cfg.sequence_parallel;
  s.plan.pipeline = PP;
  s.plan.pp_schedule = cfg.pp_schedule;
  s.plan.virtual_stages = cfg.virtual_stages;
  s.plan.pp_layout = cfg.pp_layout;
  s.plan.deterministic_attention = cfg.deterministic_attention;
  // A pipeline's sample runs one-row chunk workspaces: the evaluation's (always run at the end)
  // are larger, and the per-stage plan holds those.
  if (PP > 1) s.plan.sampling = false;
  if (TP > 1) {
    ZT_REQUIRE(!cfg.sequence_parallel || (int64_t{cfg.micro_batch_size} * s.T) % TP == 0,
               "sequence parallelism over ", TP, " ranks needs the micro-batch's tokens (", cfg.micro_batch_size, " x ",
               s.T, ") to be a multiple of ", TP, "; change --micro-batch-size or --train-seq-len, or pass --no-sequence-parallel");
  }
}

}  // namespace

RunContext resolve_run_shape(const TrainConfig& cfg, const ModelConfig& mc, int N, Backend backend) {
  RunContext s;
  s.processes = &Processes::alone();  // train() joins the launch's processes
  s.cfg = cfg;
  s.mc = mc;
  s.is_gpt = mc.kind == ModelKind::kGpt;
  s.devices = N;
  s.backend = backend;
  ZT_REQUIRE(N >= 1, "a run needs at least one device, got ", N);
  resolve_sequence(s);
  ZT_REQUIRE(cfg.zero_stage >= 0 && cfg.zero_stage <= 3, "--zero-stage must be 0, 1, 2 or 3, got ", cfg.zero_stage);
  check_comm_engine(s.cfg, backend, N);
  check_tensor_parallel(s);
  check_cuda_shapes(s);
  check_pipeline(s);
  resolve_batch(s);
  check_activation_limits(s);
  resolve_precision(s);
  resolve_schedule(s);
  fill_plan(s);
  return s;
}

namespace {

struct RunPath {
  const char* flag;
  std::string path;
};

// Same file: the same inode when both exist, else the same canonical path.
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa{}, sb{};
  if (::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0)
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(a, ea), cb = std::filesystem::weakly_canonical(b, eb);
  if (ea || eb) return a == b;
  return ca == cb;
}

}  // namespace

void check_run_paths(const TrainConfig& cfg, const std::string& plot) {
  std::vector<RunPath> inputs, outputs;
  std::error_code ec;
  // --data names a built-in dataset, a file, or a glob of shards (a glob's files are never
  // outputs' names: those contain no '*').
  if (std::filesystem::is_regular_file(cfg.data, ec)) inputs.push_back({"--data", cfg.data});
  if (!cfg.init_from.empty()) inputs.push_back({"--init-from", cfg.init_from});
  if (!cfg.metrics_path.empty()) outputs.push_back({"--metrics", cfg.metrics_path});
  if (!cfg.trace_path.empty()) outputs.push_back({"--trace", cfg.trace_path});
  if (!plot.empty()) outputs.push_back({"--plot", plot});
  if (!cfg.checkpoint_dir.empty()) outputs.push_back({"--checkpoint-dir", cfg.checkpoint_dir});
  // --resume reads from (a checkpoint under) --checkpoint-dir by design, so it is checked against
  // the file outputs only.
  if (cfg.resume.kind == ResumeFrom::Kind::kCheckpoint) inputs.push_back({"--resume", cfg.resume.path});
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (const RunPath& in : inputs) {
      if (std::string(in.flag) == "--resume" && std::string(outputs[i].flag) == "--checkpoint-dir") continue;
      ZT_REQUIRE(!same_file(outputs[i].path, in.path), outputs[i].flag, " '", outputs[i].path, "' is the ", in.flag,
                 " input; writing it would destroy the input, so choose another path");
    }
    for (size_t j = 0; j < i; ++j)
      ZT_REQUIRE(!same_file(outputs[i].path, outputs[j].path), outputs[j].flag, " and ", outputs[i].flag,
                 " both name '", outputs[i].path, "'; give each output its own path");
  }
  if (!cfg.init_from.empty() && !cfg.resume.fresh()) {
    bool resumes = !cfg.resume.newest_in_dir();
    if (!resumes)
      for (const CheckpointEntry& e : list_checkpoints(cfg.checkpoint_dir)) resumes = resumes || e.has_manifest;
    ZT_REQUIRE(!resumes, "--init-from only seeds a fresh run, but --resume ", cfg.resume.text(),
               cfg.resume.newest_in_dir() ? " finds a checkpoint in " + cfg.checkpoint_dir : std::string(" resumes a checkpoint"),
               " whose weights would replace it; drop --init-from or --resume");
  }
}

}  // namespace zt
