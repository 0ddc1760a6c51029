// The ZeRO engine (Rajbhandari et al., 2020): one model, N devices, each holding only its shard
// of optimizer state (stage 1), gradients (stage 2) and parameters (stage 3); stage 0 is plain
// data parallelism. Every stage computes the same bits: gradients of every micro-batch are
// reduce-scattered with the same ring (stage 0's all-reduce is that reduce-scatter followed by
// an all-gather), accumulated per shard in the same order, clipped with a norm summed over the
// same shards in the same order, and updated by the same per-element AdamW/SGD.
//
// Threading: one host thread per rank drives that rank's forward/backward (through access(r)) and
// calls the per-rank methods below; collectives rendezvous inside the Communicator. All ranks
// call the same methods in the same order.
//
// What is sharded is named once per engine (ShardingPolicy, zero/policy.h), and what each hook
// allocates and frees is a list built from the model's declared visit order (zero/visit_plan.h)
// that the hooks execute and the memory plan walks. The hooks check that the model follows its
// declared order, with each block's after_backward right after its last backward visit (as GPT and
// MLP do); anything else is an internal error, not a silent drift from the plan.
//
// Per-rank memory (fp32, Psi parameters, N ranks; padding to N*16 elements per block aside):
//   stage 0: params 4Psi + grads 4Psi + moments 8Psi            = 16Psi
//   stage 1: params 4Psi + grads 4Psi + moments 8Psi/N          = 8Psi + 8Psi/N
//   stage 2: params 4Psi + grad shard 4Psi/N + moments 8Psi/N   = 4Psi + 12Psi/N  (+ one block's
//            gradient bucket while its backward runs)
//   stage 3: param shard 4Psi/N + grad shard + moments          = 16Psi/N (+ gathered blocks in
//            flight: the current and the prefetched one, and the tied embedding during forward)
//   With gradient accumulation (more than one micro-batch per step), stages 0 and 1 add a 4Psi/N
//   gradient-shard accumulator.
//
// Mixed precision (ZeroOptions::working = bf16 or f16): parameters and gradients are held,
// communicated and accumulated in the 16-bit type; each rank's optimizer shard keeps fp32 master
// weights and moments (stage 0: all of them), and the fused update re-derives the 16-bit copy from
// the master. Per rank: stage 0 2Psi + 2Psi + 12Psi; stage 1 2Psi + 2Psi + 12Psi/N; stage 2 2Psi +
// 14Psi/N; stage 3 16Psi/N (ZeRO's K = 12). A model that computes in 16 bits
// (Model::activation_dtype bf16/f16: the GPT and its pipeline stages without tensor parallelism)
// reads the 16-bit parameters as they are (ParamAccess::param_data: the resident buffer, or the
// gathered one at stage 3); a model that computes in fp32 (MLP, tensor-parallel GPT) gets a block's 16-bit parameters
// widened into a transient fp32 copy (BufferRole::kComputeParams) while the block runs. Either
// way the block's fp32 gradient (scaled by the loss scale) is rounded once into the 16-bit buffer
// that is reduced.
//
// Loss scaling and overflow: after the reductions, one fused pass per rank (optim::unscale_check)
// computes the unscaled squared norms and a non-finite flag of its gradient shard; the flags are
// summed across ranks with an all-reduce on the devices, and the optimizer and the dynamic scale
// update read that flag and the scale from device memory: every rank skips an overflowed step
// together, and nothing about it needs the host.
//
// Tensor parallelism (ZeroOptions::tensor = T > 1): the N devices form the mesh
// {data = N / T, tensor = T} (comm/mesh.h; tensor varies fastest), and the model each rank is given
// is its tensor rank's local model: the same layout everywhere, different values per tensor
// coordinate. Each tensor coordinate's D = N / T ranks (its data group) are one ZeRO engine of D
// ranks: every shard, reduce-scatter and all-gather above is over the data group, with the rank's
// data index in the place of its rank, so a tensor coordinate computes the bits a D-device engine
// computes on its blocks. Only the overflow flag is summed over all N ranks, so that the whole
// mesh skips an overflowed step together.
//
// Pipeline stages (ZeroOptions::pipeline): an engine per pipeline stage, over the data ranks of
// that stage, with the stage's model. A pipeline schedule interleaves forwards and backwards of
// different micro-batches and chunks, so there is no per-micro-batch visit order to follow: the
// hooks do nothing, the parameters stay resident (stages 0-2 keep them whole), and each block's
// gradient accumulates over the whole step in a full buffer (fp32; mixed precision: the fp32
// compute gradient, and for an fp32 model fp32 compute copies of the parameters made once per
// step; a 16-bit model reads the resident 16-bit parameters), allocated by
// begin_pipeline_step and reduce-scattered once by reduce_pipeline_gradients after the stage's
// last backward, as DeepSpeed's pipeline engine does. So stage 2 saves no gradient memory during
// the step (it frees the buckets after the reduction); stage 3 would gather every block again for
// every micro-batch of every chunk and is refused. Every ZeRO stage reduces the same buckets with
// the same ring, so stages 0-2 stay bitwise equal.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/dtype.h"
#include "optimizers/optimizers.h"
#include "memory/caching_allocator.h"
#include "memory/raw_allocator.h"
#include "model/model.h"
#include "zero/data_collectives.h"
#include "zero/policy.h"
#include "zero/shard_plan.h"
#include "zero/visit_plan.h"

namespace zt {

struct ZeroOptions {
  int stage = 2;
  // Tensor-parallel degree T (must divide the devices): ZeRO shards over data groups of N / T ranks.
  int tensor = 1;
  bool sgd = false;  // SGD keeps one moment buffer, AdamW two
  int micro_batches = 1;  // per step (gradient accumulation)
  // Parameters and gradients for compute and communication: f32, bf16 or f16.
  DType working = DType::kF32;
  // Loss scaling: none (scale 1), fixed (initial_scale, never changes) or dynamic (scale_config).
  enum class Scaling { kNone, kFixed, kDynamic };
  Scaling scaling = Scaling::kNone;
  float initial_scale = 1.0f;
  optim::LossScaleConfig scale_config;
  optim::Rounding rounding = optim::Rounding::kNearest;  // of the 16-bit parameters
  uint64_t seed = 0;                                     // stochastic rounding stream
  // Optimizer offload (ZeRO-Offload; stages 1-3): per block, the first offloaded_elements() of
  // each rank's (padded) optimizer shard keep their fp32 master and moments in a host arena; see
  // "Optimizer offload" above. offload_fraction in (0, 1].
  bool offload = false;
  float offload_fraction = 1.0f;
  // Where the host arena's bytes come from (pinned memory on CUDA); null: aligned host memory.
  std::function<std::unique_ptr<RawAllocator>()> host_memory;
  // A pipeline stage's engine (see "Pipeline stages" above): stages 0-2, no offload,
  // micro_batches 1 (the step's micro-batches are the schedule's, reduced once).
  bool pipeline = false;
  // Multi-process runs (train/processes.h), or NCCL in one process (--comm nccl,
  // train/comm_engine.h, where world() is the local device count): null otherwise. The engine's
  // devices are this process's, local rank i is global rank processes->global_rank(i) of
  // processes->world(); blocks are sharded over the global data ranks, and every data-group
  // collective and the overflow flag's all-reduce go through it. world() and data_size() count
  // global ranks; the rank arguments of every call stay local. The tensor degree is
  // processes->tensor_degree() (the tensor axis inside each process), no pipeline, no offload; the
  // host-side helpers that assemble blocks (block_to_host, master_to_host, first_nonfinite_gradient,
  // set_working_dtype) are refused when the global ranks span processes.
  DataCollectives* processes = nullptr;
};

struct OptimizerStep {
  bool adamw = true;
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0, momentum = 0.9f;
  int step = 1;           // 1-based
  // The step from the rank's device update counter instead (update_count + 1, see
  // set_update_count), which the update increments unless the step is skipped: the host needs no
  // earlier step's skip decision to enqueue this one. `step` is then not used.
  bool step_on_device = false;
  // Device float of the rank's device: the clipping factor (applied after unscaling), read when the
  // update runs (optim::clip_factor writes it; nullptr = 1). One pointer per rank: set it per call.
  const float* grad_scale = nullptr;
};

// Bytes a rank holds resident, by kind (the ZeRO "model states").
struct ModelStateBytes {
  size_t params = 0, grads = 0, optimizer = 0;
  size_t total() const { return params + grads + optimizer; }
};

// One transient buffer live at the engine's transient peak.
struct PlannedBuffer {
  size_t bytes = 0;
  bool comm_stream = false;  // allocated for the comm stream (stage-3 gathers), else compute
  // The rank's transient arena (VisitPlan): one block allocated at the first micro-batch and
  // never freed, so it leaves no freed segments for other transients to split.
  bool arena = false;
};

// Per-rank memory of an engine, predicted without devices.
struct EngineMemoryPlan {
  std::vector<size_t> resident;  // every resident buffer, in allocation order (bytes)
  ModelStateBytes state;         // their sum by kind: what model_state_bytes(r) reports
  // Transient buffers live at once at the peak (pool blocks, pool_rounded_size) of a training
  // micro-batch and of a forward-only pass (evaluation, sampling): the rank's transient arena,
  // which both share (a pipeline stage's engine: its step's buffers, from the pool).
  std::vector<PlannedBuffer> train_peak, forward_peak;
  size_t host = 0;  // offload: the rank's host-arena bytes (what host_peak_bytes(r) reports)
  size_t work = 0;  // loop iterations the plan took (tests check it is linear in the layers)
};

// One interval of work on a device stream, timed on the host when the stream reached it (CPU
// backend: exact; CUDA: when the host callback ran). Used to show overlap; see set_tracing().
struct TraceSpan {
  enum Kind { kForward, kBackward, kReduceScatter, kGather, kHostOptimizer };
  Kind kind;
  int rank, block;
  double start_us, end_us;
  // Order, not time: `issued` counts the spans this rank's host thread opened before this one (a
  // collective's span is opened when it is enqueued, so it waits only for compute work issued
  // earlier); start_seq/end_seq number, over all streams, the moments streams reached the span's
  // start and end.
  uint64_t issued = 0, start_seq = 0, end_seq = 0;
};

class ZeroRank;

class ZeroEngine {
 public:
  ZeroEngine(const Model& model, std::vector<Device*> devices, Communicator& comm, const ZeroOptions& opt);
  ~ZeroEngine();

  int world() const;        // N: every device of the engine
  int data_size() const;    // D = N / tensor: the ranks each block is sharded over
  int tensor_size() const;  // T
  int stage() const;
  // What this engine's stage shards, computed once from it.
  const ShardingPolicy& policy() const;
  // Loads the full parameters of every block from host memory (each rank keeps what its stage
  // keeps) and zeroes optimizer state. Blocks: one host vector per block, layout numel each.
  void load_parameters(int rank, const std::vector<std::vector<float>>& host_blocks);
  // The full parameters of block b of tensor coordinate `tensor`, assembled on the host from that
  // coordinate's ranks that hold them (any stage); synchronizes every device. For tests,
  // checkpoints and exports, not the hot path.
  std::vector<float> block_to_host(int block, int tensor = 0);
  // This rank's optimizer moments of block b over its shard's real elements (m, then v).
  std::vector<float> moments_to_host(int rank, int block);

  // What the model reads and writes on rank r (valid on r's thread).
  ParamAccess& access(int rank);

  // Step lifecycle, per rank:
  // Before forward. forward_only: an evaluation or sampling forward (no backward follows).
  void begin_micro_batch(int rank, int micro_index, bool forward_only = false);
  void end_micro_batch(int rank);  // after backward (reductions enqueued) or the forward-only pass
  // One fused pass over this rank's gradient shard (after the step's micro-batches): the squared
  // L2 norm of the unscaled gradient of every block, written to device floats out[0..num_blocks)
  // on the compute stream (the trainer adds ranks and blocks in a fixed order, optim::clip_factor);
  // out[num_blocks + b] holds the part of block b in a tensor-parallel model's replicated tail
  // (zero otherwise; counted from one rank per tensor group), so out has 2 * num_blocks floats; and
  // the non-finite flag, summed over all ranks by an all-reduce into found_inf_device(rank).
  void check_gradients(int rank, float* device_out);
  // Optimizer update of this rank's shard (skipped, writing nothing, when the combined flag is
  // set), the loss-scale update (dynamic scaling), then the parameter all-gather (stages 1, 2).
  void optimizer_step(int rank, const OptimizerStep& s);

  // Pipeline mode: before the stage's first action of a step (allocates and zeroes the step's
  // gradient buckets; mixed precision with an fp32 model: the fp32 compute copies of the
  // parameters), or with forward_only before an evaluation's forwards (the compute copies only).
  void begin_pipeline_step(int rank, bool forward_only = false);
  // Pipeline mode: after the stage's last action of the step. For each block, in layout order:
  // before_reduce(block, its step gradient in fp32, full padded length) may change it (the tied
  // embedding's sum across the first and last stage), then the gradient is rounded to the working
  // dtype (mixed precision) and reduce-scattered over the data group; then check_gradients.
  using GradientHook = std::function<void(int block, TensorView grad)>;
  void reduce_pipeline_gradients(int rank, const GradientHook& before_reduce = {});

  // Sets this rank's combined overflow flag (after check_gradients, before optimizer_step): the
  // host saw a non-finite loss, so the step is skipped like an overflowed one.
  void mark_overflow(int rank);
  // Device float: the loss scale the next backward multiplies the loss by (nullptr: no scaling).
  const float* loss_scale_device(int rank) const;
  // Device float: > 0 when some rank's gradient held inf/NaN in the last check_gradients.
  const float* found_inf_device(int rank) const;
  // The same flag, writable: for an op that decides on the device, after check_gradients and
  // before optimizer_step, that the step is skipped (optim::clip_factor), as mark_overflow does.
  float* overflow_flag_device(int rank);
  // The loss-scale state (synchronizes rank's compute stream). Without scaling: scale 1.
  optim::LossScaleState loss_scale_state(int rank);
  // The same state in device memory, for a copy batched with other reads (no extra sync).
  const optim::LossScaleState* loss_scale_state_device(int rank) const;
  // Switches parameters and gradients to another working dtype, keeping the fp32 master weights
  // and moments (--on-scale-collapse bf16): the new parameters are derived from the master.
  // Called once, from one thread, between steps (group collectives). Drops loss scaling (scale 1).
  void set_working_dtype(DType working);
  DType working_dtype() const;
  // Diagnostics after an overflow (synchronizes every device; not the hot path): "h.3.mlp.c_fc.weight"
  // — the first tensor, in layout order, whose accumulated gradient holds inf/NaN on some rank (of
  // any tensor coordinate); empty if none does.
  std::string first_nonfinite_gradient();
  // Tests: writes `value` (converted to the working dtype) into element `offset` of rank's
  // accumulated gradient shard of `block`, on the compute stream, before check_gradients.
  void poke_gradient(int rank, int block, int64_t offset, float value);

  // ---- checkpoints and recovery (host memory; synchronize the rank's device; not the hot path) ----
  // The elements [begin, end) of block b whose optimizer state rank r saves: its shard's real
  // elements at every stage (stage 0 keeps everything on every rank, but each saves its shard).
  // Shards are over r's data group (its data index of data_size()).
  ShardRange shard_of(int rank, int block) const;
  // The elements of block b whose optimizer state rank r keeps ([0, numel) at stage 0, else its shard).
  std::pair<int64_t, int64_t> state_range(int rank, int block) const;
  // Copies rank's fp32 master weights, moments (v: AdamW only; may be null for SGD) and working
  // parameters (raw working-dtype bits; null to skip) over shard_of(rank, block).
  void state_to_host(int rank, int block, float* master, float* m, float* v, void* working);
  // Loads block b on rank: master over the whole block [0, numel); m, v over state_range(rank, b);
  // working: the whole block's working parameters as raw working-dtype bits, or null to derive
  // them from the master (round to nearest). Clears gradients. Host buffers may go on return.
  void load_state(int rank, int block, const float* master_full, const float* m, const float* v,
                  const void* working_full);
  void set_loss_scale_state(int rank, const optim::LossScaleState& st);
  // The rank's device count of updates made (OptimizerStep::step_on_device; 0 when the engine is
  // built): set from the host's count on resume and after a recovery; read (synchronizes) by tests.
  void set_update_count(int rank, int64_t updates);
  int64_t update_count(int rank);

  // The fp32 master weights of block b of tensor coordinate `tensor` over the whole block, assembled
  // from that coordinate's ranks' shards (equals block_to_host in fp32). Synchronizes every device.
  std::vector<float> master_to_host(int block, int tensor = 0);

  ModelStateBytes model_state_bytes(int rank) const;
  // Bytes of each rank's transient arena (VisitPlan; 0 when nothing is transient, and for a
  // pipeline stage's engine, whose step buffers come from the pool).
  size_t transient_arena_bytes() const;
  // Offload: the peak of rank's host-arena bytes (0 without offload).
  size_t host_peak_bytes(int rank) const;
  // Pinned host bytes rank's state export and import hold (runtime/host_staging.h): 0 until the
  // first state_to_host or load_state, HostStaging::planned_pinned_bytes() after.
  size_t host_staging_bytes(int rank) const;
  // Offload: host-clock seconds the last optimizer_step's host update took on rank (the time the
  // rank's compute stream waited for it); 0 without offload.
  double host_update_seconds(int rank) const;

  // What one block's buffers take on one rank of `world` devices (zt::block_buffer_bytes; sharded
  // over world / opt.tensor of them, as in the three calls below), for a model computing in
  // `activations`.
  static BlockBufferBytes block_buffer_bytes(int64_t numel, int world, const ZeroOptions& opt,
                                             DType activations = DType::kF32);
  // What an engine of this model on `world` devices allocates per rank: the resident buffers
  // (resident_buffers) and the transient arena the visit plans the engine's hooks execute
  // (make_visit_plan) are laid out in. Linear in the model's visits.
  static EngineMemoryPlan plan_memory(const Model& model, int world, const ZeroOptions& opt);
  static ModelStateBytes planned_model_state_bytes(const Model& model, int world, const ZeroOptions& opt);

  // Records compute spans (forward/backward of each block) and comm spans (reduce-scatter of each
  // gradient bucket, stage-3 gathers) as the streams reach them. Off by default (host callbacks
  // cost a little).
  void set_tracing(bool on);
  std::vector<TraceSpan> take_trace();
  // The host clock instant TraceSpan times count from (to merge spans into a wider timeline).
  std::chrono::steady_clock::time_point trace_origin() const;

 private:
  friend class ZeroRank;  // one rank's buffers, streams and per-rank work (engine.cc)
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt
