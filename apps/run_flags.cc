// The shared run flags (apps/run_flags.h): definitions, help texts and validators in one place.
#include "run_flags.h"

#include <string>
#include <vector>

#include "cli_checks.h"
#include "cli_choice.h"
#include "core/status.h"
#include "model/config.h"
#include "train/plan.h"
#include "train/schedule.h"

namespace zt {

using zt_cli::add_choice;
using zt_cli::add_parsed;
using zt_cli::Choices;
using zt_cli::named;

std::vector<int> parse_hidden(const std::string& hidden) {
  std::vector<int> out;
  size_t pos = 0;
  while (!hidden.empty() && pos <= hidden.size()) {
    const size_t comma = hidden.find(',', pos);
    const std::string item = hidden.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    ZT_REQUIRE(!item.empty() && *end == '\0' && v > 0, "--hidden '", hidden,
               "' must be positive sizes separated by commas, e.g. 256,128");
    ZT_REQUIRE(v <= (1 << 20), "--hidden '", hidden, "': layer size ", item, " is above 1048576, the widest layer "
               "an MLP may have");
    out.push_back(static_cast<int>(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

TrainConfig RunFlags::to_config() const {
  TrainConfig tc = config;
  if (!hidden.empty()) tc.overrides.hidden = parse_hidden(hidden);
  for (const std::string& f : inject_faults) tc.inject_faults.push_back(parse_fault_injection(f));
  return tc;
}

void add_device_memory_option(CLI::App& sub, size_t& bytes) {
  add_parsed(sub, "--device-memory", bytes, [](const std::string& text) { return parse_memory_size(text); },
             "Memory of each simulated CPU device (e.g. 16GiB, 512MiB); plan: also overrides a GPU's memory")
      ->type_name("SIZE");
}

namespace {

// The flag groups, in the order --help and --print-config list them.
void add_job_flags(CLI::App& sub, TrainConfig& tc) {
  using zt_cli::non_empty;
  std::string presets;
  for (const auto& n : model_preset_names()) presets += (presets.empty() ? "" : ", ") + n;
  sub.add_option("--model", tc.model, "Model preset: " + presets)->capture_default_str();
  sub.add_option("--data", tc.data,
                 "synthetic, a text file, llm.c token shards (*.bin glob), or fashion-mnist (MLP); plan does not "
                 "open it")
      ->capture_default_str()->check(non_empty());
  sub.add_option("--devices", tc.devices, "Devices: all (every GPU, else 2 simulated), cpu:N, cuda:0,1,3, cuda:0x4")
      ->capture_default_str();
  sub.add_option("--zero-stage", tc.zero_stage,
                 "ZeRO stage: 0 data parallel, 1 shard optimizer state, 2 + gradients, 3 + parameters")
      ->capture_default_str()->check(CLI::Range(0, 3));
  sub.add_option("--steps", tc.steps, "Optimizer steps (default 1500; MLP: --epochs worth)")->check(zt_cli::whole(1));
  sub.add_option("--epochs", tc.epochs, "Image data: epochs to train when --steps is not given (default 3)")
      ->check(zt_cli::whole(1));
  sub.add_option("--batch-size", tc.batch_size,
                 "Global batch in sequences/examples (default 8 per 2 devices, MLP 128, rounded up to a multiple of "
                 "the devices)")
      ->check(zt_cli::whole(1));
  sub.add_option("--micro-batch-size", tc.micro_batch_size, "Per-device micro-batch; accumulation = batch / (devices x micro-batch)")
      ->check(zt_cli::whole(1));
  sub.add_option("--lr", tc.lr, "Peak learning rate (default 1.88e-3 GPT, 1e-3 MLP, 0.05 SGD)")->check(zt_cli::number(0, true));
  sub.add_option("--min-lr", tc.min_lr, "Final learning rate (default lr/10)")->check(zt_cli::number(0, false));
  sub.add_option("--warmup-steps", tc.warmup_steps, "Linear warmup steps (default 13.5% of steps for GPT with AdamW, else 2%)")
      ->check(zt_cli::whole(0));
  add_choice(sub, "--lr-schedule", tc.schedule,
             named({LrSchedule::kCosine, LrSchedule::kLinear, LrSchedule::kConstant}, lr_schedule_name),
             "cosine, linear or constant");
  sub.add_option("--weight-decay", tc.weight_decay, "Decoupled weight decay (matrices and embeddings)")
      ->capture_default_str()->check(zt_cli::number(0, false));
  sub.add_option("--grad-clip", tc.grad_clip, "Clip the global gradient norm to this (0 = off)")
      ->capture_default_str()->check(zt_cli::number(0, false));
  add_choice(sub, "--optimizer", tc.optimizer, Choices<OptimizerKind>{{"adamw", OptimizerKind::kAdamW}, {"sgd", OptimizerKind::kSgd}},
             "adamw or sgd (momentum 0.9)");
  sub.add_option("--seed", tc.seed, "Seed for initialisation, data order and sampling")->capture_default_str()
      ->check(zt_cli::seed());
}

void add_output_flags(CLI::App& sub, TrainConfig& tc) {
  using zt_cli::non_empty;
  sub.add_option("--eval-every", tc.eval_every, "Evaluate every N steps (default 4 times a run)")
      ->check(zt_cli::whole(0));
  sub.add_option("--eval-batches", tc.eval_batches, "Validation batches per evaluation")->capture_default_str()
      ->check(zt_cli::whole(1));
  sub.add_option("--sample-every", tc.sample_every, "Print a text sample every N steps (0 = only at the end)")
      ->check(zt_cli::whole(0));
  sub.add_option("--sample-tokens", tc.sample_tokens, "Tokens per sample")->capture_default_str()
      ->check(zt_cli::whole(0));
  sub.add_option("--temperature", tc.temperature, "Sampling temperature")->capture_default_str()
      ->check(zt_cli::number(0, true));
  sub.add_option("--top-k", tc.top_k, "Sample from the k most likely tokens (0 = all)")->capture_default_str()
      ->check(zt_cli::whole(0));
  sub.add_option("--metrics", tc.metrics_path, "Write JSON lines: one per step, eval and a summary")->check(non_empty());
  sub.add_option("--trace", tc.trace_path,
                 "Write a Chrome/Perfetto trace (JSON): stream work and host ranges per device, pool bytes")
      ->check(non_empty());
  sub.add_option("--profile-steps", tc.profile_steps,
                 "A:B: CUDA profiler capture (cudaProfilerStart/Stop) around steps A..B, for nsys "
                 "--capture-range=cudaProfilerApi")
      ->check(non_empty());
}

void add_shape_flags(CLI::App& sub, RunFlags& f) {
  TrainConfig& tc = f.config;
  using zt_cli::non_empty;
  sub.add_option("--layers", tc.overrides.layers, "Override the preset's layer count")->check(zt_cli::whole(1));
  sub.add_option("--heads", tc.overrides.heads, "Override the preset's head count")->check(zt_cli::whole(1));
  sub.add_option("--embd", tc.overrides.embd, "Override the preset's width")->check(zt_cli::whole(1));
  sub.add_option("--seq-len", tc.overrides.seq_len, "Override the model's context length")->check(zt_cli::whole(1));
  sub.add_option("--train-seq-len", tc.train_seq_len, "Tokens per training sequence (default: the context)")
      ->check(zt_cli::whole(1));
  sub.add_option("--vocab", tc.overrides.vocab, "Override the vocabulary size")->check(zt_cli::whole(1));
  sub.add_option("--hidden", f.hidden, "MLP hidden sizes, e.g. 256,128");
  sub.add_flag("--quiet", tc.quiet, "No progress output");
  add_device_memory_option(sub, tc.device_memory);
  add_choice(sub, "--log-format", tc.log_format, Choices<LogFormat>{{"text", LogFormat::kText}, {"json", LogFormat::kJson}},
             "text (progress line, summary table) or json (the --metrics records on stdout)");
  sub.add_option("--plot", f.plot, "Write the loss curve (train, eval, entropy floor) as an SVG file")->check(non_empty());
}

void add_precision_flags(CLI::App& sub, TrainConfig& tc) {
  add_choice(sub, "--precision", tc.precision,
             named({Precision::kAuto, Precision::kFp32, Precision::kBf16, Precision::kFp16}, precision_name),
             "Parameters and gradients: fp32, bf16, fp16, or auto (bf16 on GPUs, fp32 on the CPU backend); "
             "master weights and moments stay fp32");
  sub.add_flag("--tf32", tc.tf32,
               "fp32 matrix products on TF32 tensor cores (inputs rounded to a 10-bit mantissa, fp32 accumulation), "
               "with --precision fp32 (auto is bf16 on GPUs); the CPU backend rounds the same way");
  add_parsed(sub, "--loss-scale", tc.loss_scale, parse_loss_scale,
             "dynamic, none, a fixed number, or auto (dynamic for fp16, none otherwise)")
      ->default_str("auto");
  sub.add_option("--initial-scale", tc.initial_scale, "Dynamic loss scaling: initial scale")->capture_default_str()
      ->check(zt_cli::number(0, true));
  sub.add_option("--scale-window", tc.scale_window, "Dynamic loss scaling: overflow-free steps before the scale doubles")
      ->capture_default_str()->check(zt_cli::whole(1));
  sub.add_option("--scale-hysteresis", tc.scale_hysteresis,
                 "Dynamic loss scaling: overflows tolerated (step skipped, scale kept) before the scale halves")
      ->capture_default_str()->check(zt_cli::whole(1));
  sub.add_option("--min-scale", tc.min_scale, "Dynamic loss scaling: the scale never goes below this; an overflow there is a collapse")
      ->capture_default_str()->check(zt_cli::number(0, true));
  sub.add_option("--max-scale", tc.max_scale, "Dynamic loss scaling: the scale never grows above this")
      ->capture_default_str()->check(zt_cli::number(0, true));
  sub.add_flag("--stochastic-rounding", tc.stochastic_rounding,
               "Round the 16-bit parameters stochastically from the fp32 master (seeded by --seed)");
  add_choice(sub, "--on-scale-collapse", tc.on_scale_collapse_bf16, Choices<bool>{{"stop", false}, {"bf16", true}},
             "fp16: when the loss scale collapses, stop (exit code 3) or continue in bf16");
}

void add_memory_flags(CLI::App& sub, TrainConfig& tc) {
  using zt_cli::non_empty;
  add_choice(sub, "--recompute", tc.recompute,
             named({Recompute::kNone, Recompute::kSelective, Recompute::kFull}, recompute_name),
             "Activation recomputation: none, selective (GELU and layernorm outputs) "
             "or full (each block re-runs its forward in the backward); the results do not change");
  add_choice(sub, "--cuda-graphs", tc.cuda_graphs,
             Choices<CudaGraphs>{{"auto", CudaGraphs::kAuto}, {"on", CudaGraphs::kOn}, {"off", CudaGraphs::kOff}},
             "Capture each device's micro-batch forward/backward once and replay it, piecewise around the ZeRO "
             "hooks: auto (CUDA devices, without tensor or pipeline parallelism or --trace), on (also simulated on CPU "
             "devices; refused when it cannot be), off");
  add_choice(sub, "--deterministic-attention", tc.deterministic_attention, Choices<bool>{{"on", true}, {"off", false}},
             "on: cuDNN's deterministic attention backward (bitwise reproducible; its workspace grows with T^2, "
             "which the plan counts); off: its faster non-deterministic one. The CPU backend is deterministic "
             "either way");
  add_choice(sub, "--offload", tc.offload_optimizer, Choices<bool>{{"none", false}, {"optimizer", true}},
             "optimizer: fp32 master weights and moments in pinned host memory, updated by a host AdamW "
             "after the backward; gradient shards stream to the host during it (none = on the devices)");
  sub.add_option("--offload-fraction", tc.offload_fraction,
                 "With --offload optimizer: the part of each device's optimizer shard kept on the host (0..1]")
      ->capture_default_str()->check(zt_cli::number(0, true))->check(CLI::Range(0.0f, 1.0f));
  sub.add_flag("--offload-delay-update", tc.offload_delay_update,
               "With --offload optimizer: run each step's host update during the next step's forward and "
               "backward, which use the parameters from before it (one step stale; DeepSpeed's delay_update). "
               "Changes the bits");
  sub.add_option("--tensor-parallel,--tp", tc.tensor_parallel,
                 "Tensor (model) parallelism: split every GPT layer over T devices (Megatron-LM's layout, "
                 "vocabulary-parallel loss); the devices form a (devices / T data) x (T tensor) mesh")
      ->capture_default_str()->check(zt_cli::whole(1));
  sub.add_flag("--sequence-parallel,!--no-sequence-parallel", tc.sequence_parallel,
               "With --tensor-parallel > 1: shard layernorm and residual activations along the sequence "
               "(all-gather / reduce-scatter instead of all-reduce); on by default");
  sub.add_option("--pipeline-parallel,--pp", tc.pipeline_parallel,
                 "Pipeline parallelism: split the GPT's layers into P stages on P device groups (the devices form "
                 "a (devices / P data) x (P pipeline) mesh); the step's micro-batches flow through the schedule")
      ->capture_default_str()->check(zt_cli::whole(1));
  add_choice(sub, "--pp-schedule", tc.pp_schedule,
             named({PipeSchedule::kGpipe, PipeSchedule::k1F1B, PipeSchedule::kInterleaved, PipeSchedule::kZbH1},
                   pipe_schedule_name),
             "With --pipeline-parallel > 1: gpipe, 1f1b, interleaved (with --virtual-stages) or zb-h1 "
             "(zero-bubble: backward split into input and weight gradients)");
  sub.add_option("--virtual-stages", tc.virtual_stages,
                 "With --pp-schedule interleaved: chunks of layers per device (the bubble shrinks by this factor)")
      ->capture_default_str()->check(zt_cli::whole(1));
  sub.add_option("--pp-layout", tc.pp_layout,
                 "With --pipeline-parallel: transformer blocks per (virtual) stage, e.g. 4,4,3,1 (default: balanced "
                 "by predicted time, embedding on the first stage and the head on the last)")
      ->check(non_empty());
}

void add_checkpoint_flags(CLI::App& sub, RunFlags& f) {
  TrainConfig& tc = f.config;
  using zt_cli::non_empty;
  sub.add_option("--init-from", tc.init_from, "Start from these weights (safetensors, GPT-2 tensor names) instead of a seeded init")
      ->check(non_empty());
  sub.add_option("--checkpoint-dir", tc.checkpoint_dir,
                 "Save sharded checkpoints here (every --save-every steps and at the end), atomically")
      ->check(non_empty());
  sub.add_option("--save-every", tc.save_every, "Save a checkpoint every N steps (0 = only at the end)")
      ->capture_default_str()->check(zt_cli::whole(0));
  sub.add_option("--keep", tc.keep, "Complete checkpoints to keep (older ones are pruned after a save; 0 = all)")
      ->capture_default_str()->check(zt_cli::whole(0));
  add_parsed(sub, "--resume", tc.resume, ResumeFrom::parse,
             "auto (the newest complete checkpoint in --checkpoint-dir, else start fresh) or a checkpoint "
             "directory; any device count and ZeRO stage")
      ->check(non_empty());
  sub.add_option("--snapshot-every", tc.snapshot_every,
                 "Keep a host-memory snapshot of every shard every N steps; a failed device is then dropped and "
                 "the run goes on from the snapshot on the others (0 = off)")
      ->capture_default_str()->check(zt_cli::whole(0));
  sub.add_option("--inject-fault", f.inject_faults,
                 "device=D,step=S[,kind=error|hang]: make device D (its position among the devices at that step) "
                 "fail at step S (testing recovery; may be given more than once)")
      ->check(non_empty());
  sub.add_option("--hang-timeout", tc.hang_timeout_s,
                 "Seconds without progress (no device op, sampled token or evaluation batch finishing) before the "
                 "devices count as hung")
      ->capture_default_str()->check(zt_cli::seconds());
  sub.add_option("--comm-timeout", tc.comm_timeout_s,
                 "Under mpirun: seconds a wait on another process may take before the run stops naming that rank")
      ->capture_default_str()->check(zt_cli::seconds());
  add_choice(sub, "--comm-topology", tc.comm_topology,
             Choices<CommTopology>{{"flat", CommTopology::kFlat}, {"hierarchical", CommTopology::kHierarchical}},
             "Under mpirun: flat (one ring over every device, bitwise equal to one process) or hierarchical "
             "(reduce inside each process first, across processes second: fewer, larger cross-process "
             "messages; equal to one process up to rounding); changes nothing in one process");
  add_choice(sub, "--comm", tc.comm, Choices<CommEngine>{{"ring", CommEngine::kRing}, {"nccl", CommEngine::kNccl}},
             "What runs the data-parallel collectives: ring (our ring over peer copies, any devices, bitwise "
             "reproducible) or nccl (NCCL on CUDA devices, one GPU per device; one process, or several under mpirun)");
  sub.add_option("--max-skipped-steps", tc.max_skipped_steps,
                 "Stop (exit code 3) after this many consecutive steps skipped for non-finite gradients or loss")
      ->capture_default_str()->check(zt_cli::whole(1));
}

}  // namespace

void add_run_flags(CLI::App& sub, RunFlags& f) {
  add_job_flags(sub, f.config);
  add_output_flags(sub, f.config);
  add_shape_flags(sub, f);
  add_precision_flags(sub, f.config);
  add_memory_flags(sub, f.config);
  add_checkpoint_flags(sub, f);
}

}  // namespace zt

#include "runtime/runtime.h"

namespace zt {


PlannedDevices planned_devices(const DeviceSpec& spec) {
  if (spec.kind == DeviceSpec::Kind::kCpu)
    return {spec.cpu_count ? spec.cpu_count : default_cpu_device_count(), Backend::kCpu};
  const CudaAvailability avail = cuda_availability();
  // Without a usable GPU "cuda" is refused here, with Runtime::create's sentence (before any shape
  // check counts devices), and "all" means simulated devices.
  if (!avail.usable) {
    require_usable_gpus(spec, avail);
    return {default_cpu_device_count(), Backend::kCpu};
  }
  return {spec.cuda_ordinals.empty() ? avail.device_count : static_cast<int>(spec.cuda_ordinals.size()),
          Backend::kCuda};
}

}  // namespace zt
