// The training loop over every selected device: data (prefetched, each device its own rows of
// the global batch), forward/backward with gradient accumulation, ZeRO stage 0-3 sharding,
// global-norm clipping, AdamW/SGD, LR schedule, evaluation, sampling, metrics.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "model/config.h"
#include "pipeline/schedule.h"
#include "train/report.h"
#include "train/schedule.h"
#include "zero/engine.h"

namespace zt {

class LanguageData;
class ImageData;

enum class OptimizerKind { kAdamW, kSgd };
// Progress output: text (progress line, evaluations, summary table) or JSON lines on stdout (the
// same records as --metrics).
enum class LogFormat { kText, kJson };

// Data-parallel collectives across processes (--comm-topology): kFlat, one ring over every global
// rank (bitwise equal to one process with every device); kHierarchical, inside each process first
// and across processes second (sums in another order: equal up to rounding). One process: no
// difference, every collective stays inside it.
enum class CommTopology { kFlat, kHierarchical };
// --comm: what runs the ZeRO data group's collectives: the ring over peer copies (every backend,
// bitwise reproducible) or NCCL (CUDA devices, one GPU each, one process; src/comm/nccl_comm.h).
enum class CommEngine { kRing, kNccl };
// --cuda-graphs: each rank's micro-batch forward+backward captured once and replayed
// (train/graph_step.h). kAuto: on CUDA devices when the run can be captured, else eager;
// kOn: always (the CPU backend simulates capture), refused for a run that cannot be captured.
enum class CudaGraphs { kAuto, kOn, kOff };

// Mixed precision (--precision): parameters and gradients in fp32, bf16 or fp16 (fp32 master
// weights and moments in the optimizer shards either way). kAuto: bf16 on GPUs, fp32 on the CPU
// backend.
enum class Precision { kAuto, kFp32, kBf16, kFp16 };
const char* precision_name(Precision p);

// --loss-scale, parsed once on the command line: auto (dynamic for fp16, none otherwise),
// dynamic, none, or a fixed positive number.
struct LossScale {
  enum class Mode { kAuto, kDynamic, kNone, kFixed };
  Mode mode = Mode::kAuto;
  float fixed = 0;  // kFixed: the scale
};
LossScale parse_loss_scale(const std::string& text);  // throws kInvalidArgument with one sentence

// Tests: overwrite one gradient element with `value` (inf, NaN, ...) before the overflow check.
struct GradientFault {
  int step = 1;   // 1-based
  int rank = 0;
  int block = 0;
  int64_t offset = 0;  // element of rank's gradient shard of the block
  float value = 0;
};

// --inject-fault device=D,step=S[,kind=error|hang]: rank D's device fails at the start of step S.
struct FaultInjection {
  int device = -1;  // -1 = none
  int step = 0;     // 1-based
  bool hang = false;
};
FaultInjection parse_fault_injection(const std::string& spec);  // throws kInvalidArgument

// What only tests set: injected gradient faults, the order scalars are read in, and what a run
// hands back for comparison.
struct TestHooks {
  std::vector<GradientFault> gradient_faults;
  // false reads every step's scalars before the next step is enqueued (the eager order); true
  // reads them one step late where train/step.h allows it. Same numbers either way.
  bool read_scalars_late = true;
  bool keep_final_params = false;  // return the full parameters of every block
  bool zero_trace = false;         // record compute/comm spans (TrainResult::trace)
};

// One device lost and recovered from in-process.
struct Recovery {
  int failed_at_step = 0;      // the step that was running (1-based)
  std::string device;          // its name, e.g. "cpu:2"
  std::string cause;           // the error, or "stopped answering"
  int resumed_from_step = 0;   // the snapshot's step
  int devices_after = 0;
};

// What an on_eval hook (a sweep's scheduler) tells the loop after an evaluation.
enum class EvalAction {
  kContinue,
  kSave,  // save a checkpoint at this step (when checkpoint_dir is set) and go on
  kStop,  // save a checkpoint at this step (when checkpoint_dir is set) and end the run here
};

struct TrainConfig {
  std::string model = "gpt-tiny";
  ModelOverrides overrides;
  std::string data = "synthetic";
  std::string devices = "all";
  size_t device_memory = 0;  // --device-memory: bytes per simulated (CPU) device; 0 = unlimited
  int zero_stage = 2;
  int steps = -1;            // -1 = the default for the data (see resolve())
  int epochs = 0;            // image data: steps = epochs * batches per epoch when steps == -1
  int batch_size = -1;       // global, in sequences (GPT) or examples (MLP); -1 = default
  int micro_batch_size = 0;  // per device; 0 = batch_size / devices (no accumulation)
  int train_seq_len = 0;     // GPT: tokens per training sequence; 0 = the model's context
  float lr = -1;             // -1 = default for the optimizer
  float min_lr = -1;         // -1 = lr / 10
  int warmup_steps = -1;     // -1 = 13.5% of steps (GPT, AdamW: the default job's sweep), else 2%
  LrSchedule schedule = LrSchedule::kCosine;
  float weight_decay = 0.0f;
  float grad_clip = 1.0f;    // 0 = no clipping
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  float beta1 = 0.9f, beta2 = 0.95f, adam_eps = 1e-8f, momentum = 0.9f;
  Precision precision = Precision::kAuto;
  // --tf32: fp32 matrix products round their inputs to TF32 (tensor cores on CUDA; the same
  // rounding on the CPU backend); 16-bit products are unaffected.
  bool tf32 = false;
  // --deterministic-attention on|off: cuDNN's deterministic SDPA backward (bitwise reproducible,
  // a workspace quadratic in T) or its faster non-deterministic one; the CPU backend's attention
  // is deterministic either way (runtime/device.h MathMode).
  bool deterministic_attention = true;
  // MathMode::gemm_tiles on the run's devices (kernels/ops.h "GEMM tiles"): every 16-bit GEMM must
  // have M, N, K multiples of 8 and 16-byte-aligned operands, or the run stops with one sentence
  // naming the op and the shape. Off by default: small widths and token counts (a test's 16-wide
  // model, an odd batch) are legal, only slower on a GPU. Tests of the models' layouts set it; the
  // environment variable ZT_GEMM_TILES=on sets it for any run.
  bool gemm_tiles = false;
  LossScale loss_scale;  // --loss-scale
  Recompute recompute = Recompute::kNone;  // --recompute (model/config.h)
  // --offload optimizer: each rank's fp32 master shard and moments live in pinned host memory and
  // a host AdamW updates them; offload_fraction of each shard (the rest stays on the device).
  bool offload_optimizer = false;
  float offload_fraction = 1.0f;
  // --offload-delay-update: the host update of step k runs during step k+1's forward and backward,
  // which use the offloaded parameters from before it (ZeroOptions::offload_delay; changes the bits).
  bool offload_delay_update = false;
  // --tensor-parallel T: every GPT layer split over T devices (model/gpt_tp.cc); the ZeRO engine
  // shards over the devices / T data-parallel ranks. --no-sequence-parallel turns off sequence
  // parallelism (on by default when T > 1).
  int tensor_parallel = 1;
  bool sequence_parallel = true;
  // --pipeline-parallel P: the GPT's layers split into P stages (src/pipeline/), each stage a ZeRO
  // engine over the devices / P data ranks; the step's micro-batches are the schedule's.
  int pipeline_parallel = 1;
  PipeSchedule pp_schedule = PipeSchedule::k1F1B;  // --pp-schedule gpipe|1f1b|interleaved|zb-h1
  int virtual_stages = 1;            // --virtual-stages V (interleaved)
  std::string pp_layout;             // --pp-layout "4,4,3,1": blocks per virtual stage ("" = balanced)
  float initial_scale = 65536.0f;  // dynamic: 2^16
  int scale_window = 2000;         // overflow-free steps before the scale doubles
  int scale_hysteresis = 1;        // overflows tolerated (step skipped, scale kept) before a backoff
  float min_scale = 1.0f;
  float max_scale = 16777216.0f;
  bool stochastic_rounding = false;  // of the 16-bit parameters (seeded by --seed)
  bool on_scale_collapse_bf16 = false;  // --on-scale-collapse bf16: continue in bf16 (else stop)
  int max_skipped_steps = 20;      // consecutive skipped (overflowed) steps before giving up
  // Checkpoints (src/checkpoint/, train/state_io.h): saved every save_every steps and at the end
  // when checkpoint_dir is set; keep: how many complete checkpoints stay (0 = all).
  std::string checkpoint_dir;
  int save_every = 0;
  int keep = 3;
  // The resolved flags as TOML (apps: train --print-config); written to checkpoint_dir/config.toml
  // before the first step (Checkpointer::write_run_config), so `--config DIR/config.toml` reproduces
  // the run. "" = none.
  std::string run_config;
  ResumeFrom resume;  // --resume: fresh, auto (the newest complete checkpoint in checkpoint_dir) or a checkpoint
  std::string init_from;  // safetensors weights (GPT-2 names) to start from instead of the seeded init
  // Fault tolerance: a host snapshot of every shard every snapshot_every steps; when a device
  // fails, the run drops it and continues from the snapshot on the others (0 = off: a failure ends
  // the run). hang_timeout_s: this long without progress (core/heartbeat.h) is a hang.
  int snapshot_every = 0;
  std::vector<FaultInjection> inject_faults;  // each fires once; D is a position in the current device list
  double hang_timeout_s = 300;
  // Multi-process runs (mpirun): seconds any wait on another process may take before the run
  // stops with a sentence naming the rank that did not answer.
  double comm_timeout_s = 300;
  CommTopology comm_topology = CommTopology::kFlat;
  CommEngine comm = CommEngine::kRing;  // --comm ring|nccl (train/comm_engine.h)
  CudaGraphs cuda_graphs = CudaGraphs::kAuto;  // --cuda-graphs auto|on|off
  uint64_t seed = 1337;
  int eval_every = -1;       // -1 = default (a few evals per run); 0 = only at the end
  int eval_batches = 8;
  int sample_every = 0;      // 0 = only at the end
  int sample_tokens = 200;
  float temperature = 0.8f;
  int top_k = 40;
  std::string metrics_path;
  std::string trace_path;     // --trace: Chrome/Perfetto trace-event JSON (train/trace.h)
  std::string profile_steps;  // --profile-steps A:B: cudaProfilerStart before step A, Stop after B (1-based)
  bool quiet = false;        // no progress line (tests)
  LogFormat log_format = LogFormat::kText;
  TestHooks test;
  // Sweeps (src/sweep/): evaluations at these 1-based steps besides eval_every's (the rungs), a
  // hook called after every evaluation with its step and validation loss, and a dataset opened
  // once for many runs (used in place of opening `data`; it must be what `data`, `seed` and the
  // vocabulary would open — the sweep keys its cache by them). Read concurrently, never copied.
  std::vector<int> eval_steps;
  std::function<EvalAction(int step, double val_loss)> on_eval;
  std::shared_ptr<const LanguageData> language_data;
  std::shared_ptr<const ImageData> image_data;
};

struct TrainResult {
  int steps = 0;
  double final_loss = 0;     // mean training loss of the last step
  double val_loss = 0;       // last evaluation
  std::optional<double> accuracy;      // classifier: test accuracy at the end
  std::optional<double> entropy_floor;  // synthetic data: best reachable loss
  double tokens_per_s = 0;
  double seconds = 0;
  std::vector<double> losses;  // per step
  std::vector<std::pair<int, double>> val_losses;  // (step, validation loss) of every evaluation
  PhaseTimes time_split;       // host-measured, training steps only (see StepPhaseTimer)
  double flops_per_token = 0;  // training_flops_per_token()
  std::optional<double> mfu;   // when the devices' peak FLOP/s is known
  std::vector<size_t> peak_bytes_per_device;
  // The memory plan's prediction of that peak (DevicePlan::peak_allocated), as train() checked it
  // before allocating (after a recovery: the survivors' plan).
  std::vector<size_t> planned_peak_bytes_per_device;
  std::vector<size_t> model_state_bytes_per_device;
  std::vector<size_t> host_peak_bytes_per_device;  // --offload optimizer: each rank's host-arena peak
  std::vector<uint64_t> comm_bytes_per_step_per_device;  // bytes sent, averaged over steps
  std::vector<uint64_t> tensor_bytes_per_step_per_device;  // of those, on the tensor axis (--tensor-parallel)
  // Per training step, averaged over the steps: bytes this process's devices sent to each other
  // (peer copies) and bytes this process sent to other processes (0 in one process).
  uint64_t inside_bytes_per_step = 0;
  uint64_t across_bytes_per_step = 0;
  std::vector<size_t> activation_bytes_per_device;          // each rank's activation workspace
  int devices = 1;
  int zero_stage = 0;
  std::string precision;               // "fp32", "bf16", "fp16" (at the end of the run)
  bool cuda_graphs = false;            // some micro-batch ran from a captured graph (--cuda-graphs)
  std::vector<float> loss_scales;      // per step: the scale the step's backward used (1 without scaling)
  std::vector<int> skipped_steps;      // 1-based steps whose update was skipped (non-finite gradients)
  std::string first_nonfinite;         // tensor named by the first skipped step's diagnosis
  int switched_to_bf16_at = 0;         // --on-scale-collapse bf16: the step after which bf16 took over
  int start_step = 0;                  // steps already done by the checkpoint resumed from (0 = fresh)
  std::vector<std::string> checkpoints;  // paths of the checkpoints this run saved, in order
  std::vector<std::string> resume_notes;  // checkpoints --resume auto refused, and why
  std::vector<Recovery> recoveries;       // devices lost and recovered from
  std::string sample;
  std::vector<std::vector<float>> final_params;  // with keep_final_params: the fp32 master weights
  std::vector<std::vector<float>> final_working;  // with keep_final_params: the working parameters, widened to fp32
  std::vector<std::vector<float>> final_moments;  // with keep_final_params: per block, all first moments then all second ones
  // With keep_final_params, one engine and tensor degree 1: the model's local blocks as the devices
  // hold them (the GPT's wte with its padding rows), master and working (widened); else empty.
  std::vector<std::vector<float>> final_local_params, final_local_working;
  std::vector<int64_t> final_update_counts;       // with keep_final_params: each rank's device update counter
  std::vector<TraceSpan> trace;                  // with zero_trace (training steps only)
  // --pipeline-parallel: the bubble fraction measured over the steps and the schedule's closed form.
  double measured_bubble = 0, theoretical_bubble = 0;
  int stopped_at = 0;  // on_eval returned kStop after this step (0: it ran to the end)
  int signal = 0;  // SIGINT/SIGTERM that stopped the run after `steps` steps (0: it ran to the end)
};

// Runs a whole training job; prints progress to stdout unless quiet. All validation of the
// configuration, data and model happens before the first step; a bad input throws
// zt::Error(kInvalidArgument) with one sentence.
TrainResult train(const TrainConfig& config);

}  // namespace zt
