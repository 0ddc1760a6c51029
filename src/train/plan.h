// Memory plan ("will it fit?"): what a training run holds per device, predicted before any device
// memory is touched, from the same functions the engine, model, communicator and pool use to size
// their allocations; the verdict against each device's memory and, when it does not fit, the
// cheapest change that does. `zerotrain plan` prints it; `train` refuses a run it rejects.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "model/config.h"
#include "pipeline/schedule.h"
#include "train/rank_buffers.h"

namespace zt {

struct PlanInputs {
  int devices = 1;
  std::vector<size_t> device_memory;  // bytes each device's pool may reserve (one entry per device, or one for all)
  int zero_stage = 2;
  int micro_batch = 1;     // per device (B)
  int seq_len = 1;         // tokens per training sequence (T); 1 for the MLP
  bool sgd = false;        // optimizer: SGD (one moment) or AdamW (two)
  int micro_batches = 1;   // per step (gradient accumulation)
  bool sampling = false;   // GPT: a 1 x T sampling workspace is allocated (end-of-run sample)
  int max_devices = 0;     // devices that exist (for the "more devices" suggestion); 0 = devices
  DType working = DType::kF32;  // parameters and gradients (--precision); masters and moments are fp32
  Recompute recompute = Recompute::kNone;  // what the activations keep (--recompute)
  bool offload = false;          // --offload optimizer: masters and moments in host memory
  float offload_fraction = 1.0f; // of each rank's optimizer shard
  bool offload_delay = false;    // --offload-delay-update: a second host copy of the offloaded gradients
  int tensor = 1;                // --tensor-parallel: devices = data x tensor
  bool sequence_parallel = true;
  // --pipeline-parallel P: devices = data x pipeline; each device holds its stage's blocks, the
  // workspaces its schedule keeps live and one batch buffer per micro-batch (micro_batches = m).
  int pipeline = 1;
  PipeSchedule pp_schedule = PipeSchedule::k1F1B;
  int virtual_stages = 1;
  std::string pp_layout;  // "" = the balanced split
  // Device::gemm_workspace_bytes() of the devices: the GEMM library's workspace, a pool block each
  // device's compute stream (the stream every matrix product runs on) holds from its first GEMM
  // (cuBLAS on CUDA; 0 on the CPU backend).
  size_t gemm_workspace = 0;
  // The devices run a GPT's attention through a library (CUDA: cuDNN for 16-bit activations, the
  // cuBLAS GEMM attention for fp32; false on the CPU backend): its compute stream then holds one
  // pool block of ops::flash_attention_library_bytes for the run's (B, T) from its first attention
  // on (kernels/ops.h). plan_run sets it from the backend.
  bool attention_library = false;
  // --deterministic-attention: the library's backward algorithm (the deterministic one's workspace
  // is far larger: kernels/ops.h cudnn_attention_workspace_formula).
  bool deterministic_attention = true;
  // What the devices' 16-bit library asks for at a shape (B, T, C, NH, dtype, deterministic): plan_run
  // on CUDA asks cuDNN itself (ops::fused_attention_workspace, which also builds the graphs the run
  // then uses); empty: the formula (ops::cudnn_attention_workspace_formula), all a plan without a
  // GPU has. nullopt from it: no library path on these devices.
  std::function<std::optional<ops::AttentionWorkspace>(int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                                                       bool deterministic)>
      attention_workspace;
  // Some device cannot access another's memory (or the backend lacks a peer accumulate): the
  // ring's reductions stage through receive buffers (comm/communicator.h), which the plan then
  // counts. False: every reduction takes the direct path and allocates none (the CPU backend;
  // CUDA with peer access among all GPUs). plan_run sets it from the devices
  // (Communicator::reduces_directly).
  bool staged_comm = false;
};

// Bytes per device, by kind (requested sizes; the pool's rounding is `pool_overhead`).
struct DevicePlan {
  int stage = 0;  // the device's pipeline stage (0 without pipeline parallelism)
  size_t params = 0, grads = 0, optimizer = 0;
  size_t activations = 0;  // workspace(B, T) (+ the sampling workspace)
  size_t comm = 0;         // ring receive buffers (0 when every reduction is direct: !staged_comm)
  size_t transient = 0;    // peak live stage 2/3 gradient buckets and stage 3 gathered blocks
  size_t batch = 0;        // inputs, targets, per-block norm partials
  size_t library = 0;      // GEMM library workspace (PlanInputs::gemm_workspace)
  size_t attention = 0;    // attention library block (PlanInputs::attention_library): workspace + staging
  size_t attention_workspace = 0;  // the library's workspace in it (the larger of its two directions)
  bool attention_measured = false; // attention_workspace is what the library asked for (else the formula)
  size_t pool_overhead = 0;  // reserved minus requested: block rounding and segment granularity
  size_t peak_allocated = 0;  // predicted pool peak in blocks (MemoryStats::peak_allocated_bytes)
  size_t total = 0;        // predicted peak reserved bytes: what must fit in the device's memory
  size_t memory = 0;       // the device's memory
  size_t host = 0;         // pinned host bytes this device's offloaded optimizer state takes
  // Pinned host bytes of this device's snapshot and checkpoint copies (runtime/host_staging.h),
  // held from the first snapshot, save or restore on; not in `total` (host memory).
  size_t host_staging = 0;
  bool fits() const { return total <= memory; }
};

// The cheapest change that fits, with the run it describes (every field, changed or not).
struct PlanSuggestion {
  // kCombined: more than one lever (ZeRO stage, recompute, offload, micro-batch, devices) changed.
  enum Kind { kNone, kZeroStage, kMicroBatch, kDevices, kCombined, kNothing, kRecompute, kOffload };
  Kind kind = kNone;
  int zero_stage = 0, micro_batch = 0, micro_batches = 0, devices = 0;
  Recompute recompute = Recompute::kNone;
  bool offload = false;
  float offload_fraction = 1.0f;
  std::string text;  // "use --recompute selective (predicted 1.20 GiB per device)"
};

struct MemoryPlan {
  PlanInputs inputs;
  std::vector<DevicePlan> per_device;
  bool fits = true;
  PlanSuggestion suggestion;  // when !fits
  // Loop iterations the plan took, over every configuration searched for the fix (tests check it
  // grows linearly with the layers).
  size_t work = 0;
  // One sentence: why it does not fit and what to change (empty when it fits).
  std::string verdict() const;
};

// Throws zt::Error(kInvalidArgument) for inconsistent inputs (stage, sizes, device count).
// When `in` does not fit, the suggestion is the first of these that fits, in the order a user
// should try them (the cost each adds to a step, not its saving): a higher ZeRO stage; selective,
// then full recompute; optimizer offload (recompute first: it adds compute, offload adds a host
// optimizer step and host-device copies); two or more of those together; a smaller micro-batch
// with more accumulation; more devices; and the micro-batch or the devices together with the
// levers before them.
MemoryPlan plan_memory(const ModelConfig& model, const PlanInputs& in);
// The plan of `in` alone (no search for a fix).
MemoryPlan plan_memory_only(const ModelConfig& model, const PlanInputs& in);

// The cheapest-fix search of plan_memory over any plan function (plan_memory passes the real
// plan; tests pass synthetic ones to check the order). `work` accumulates the plans' work.
PlanSuggestion cheapest_fix(const PlanInputs& in, const std::function<MemoryPlan(const PlanInputs&)>& plan_of,
                            size_t* work);

// `zerotrain plan --largest`: per combination of ZeRO stage, recompute and offload, the largest
// member of a family (model/config.h: gpt2_shape_family) that fits the devices of `in`, found by
// binary search (the family's memory is monotone). The next member up does not fit.
struct LargestRow {
  int zero_stage = 0;
  Recompute recompute = Recompute::kNone;
  bool offload = false;
  int index = -1;  // into the family; -1: not even the smallest fits
  DevicePlan peak; // of the largest that fits (the device with the highest total); else of the smallest
};
struct LargestTable {
  PlanInputs inputs;  // the run's batch, sequence, precision and devices (the levers vary per row)
  std::vector<ModelConfig> family;
  std::vector<LargestRow> rows;  // stage 0-3 x recompute none/selective/full x offload none/optimizer
  size_t plans = 0;   // plans computed (about rows x log2(family) for the binary searches)
  size_t work = 0;    // their work (MemoryPlan::work)
};
// The index of the largest member of `family` whose plan under `in` fits, or -1. Binary search:
// what it returns fits and the next member does not (or it is the last).
int largest_fitting(const std::vector<ModelConfig>& family, const PlanInputs& in, size_t* plans = nullptr,
                    size_t* work = nullptr);
// allowed (optional): whether a run may use a row's stage, recompute and offload (the caller asks
// the run's own rules, so that no row lists what `plan` and `train` refuse, e.g. ZeRO-3 or
// offload with --pipeline-parallel); rows it refuses are left out.
LargestTable plan_largest(const std::vector<ModelConfig>& family, const PlanInputs& in,
                          const std::function<bool(const PlanInputs&)>& allowed = {});
// The table a person reads: stage, recompute, offload, largest model (layers x width), parameters,
// device peak, host bytes; then how to read it.
std::string format_largest(const LargestTable& table);
// "1.56 B", "354.8 M", "45.7 K"
std::string format_parameter_count(int64_t n);

// The run shape the trainer's per-rank buffers (train/rank_buffers.h) depend on, from the plan's
// inputs: the plan counts rank_buffers(plan_rank_buffer_shape(mc, in), the rank's model), which is
// what World allocates.
RankBufferShape plan_rank_buffer_shape(const ModelConfig& model, const PlanInputs& in);

// Host bytes of one snapshot of the whole model's state (train/state_io.h HostSnapshot: fp32
// masters and moments, and the 16-bit parameters in a 16-bit run), pageable memory outside every
// pool: --snapshot-every keeps one (two while the next replaces it) and a checkpoint save holds
// one until its background write ends (none extra when it shares the recovery snapshot of its step).
size_t snapshot_host_bytes(const ModelConfig& model, const PlanInputs& in);

// Human-readable table: one row per device, then the verdict.
std::string format_plan(const ModelConfig& model, const MemoryPlan& plan);
// "1.50 GiB"
std::string format_plan_bytes(size_t bytes);
// Parses "16GiB", "512MiB", "2GB", "1.5GiB", "1048576"; throws kInvalidArgument naming `flag`.
size_t parse_memory_size(const std::string& text, const std::string& flag = "--device-memory");

// Throws zt::Error(kInvalidArgument) with plan.verdict() when the plan does not fit.
void require_fits(const MemoryPlan& plan);

class Runtime;
// The plan of a resolved training run on rt's devices (their total_memory()); train() calls it
// before allocating anything and refuses a run that does not fit.
MemoryPlan plan_run(const ModelConfig& model, Runtime& rt, const PlanInputs& in_without_devices);
// The memory of each logical device of `ordinals` (one GPU ordinal per device, repeats: logical
// devices sharing a GPU, as --devices cuda:0x2 gives) on GPUs of `gpu_memory` bytes: a GPU's memory
// divided among the logical devices on it, as the CUDA backend caps their pools (Device::total_memory).
std::vector<size_t> logical_device_memory(const std::vector<int>& ordinals, size_t gpu_memory);
// The plan of the CUDA devices `ordinals` this machine does not have (`zerotrain plan --devices
// cuda:... --device-memory SIZE` without a usable GPU) on GPUs of `gpu_memory` bytes each
// (logical_device_memory per device): assumed Hopper or newer (cuBLAS's 32 MiB workspace), built
// with cuDNN (its attention workspace by formula: nothing to ask) and with every reduction direct
// (logical devices of one GPU, or GPUs with peer access).
MemoryPlan plan_absent_gpus(const ModelConfig& model, const PlanInputs& in_without_devices,
                            const std::vector<int>& ordinals, size_t gpu_memory);
// Devices that could be used for the "more devices" suggestion on rt's backend.
int available_devices(Runtime& rt);

}  // namespace zt
