// The ZeRO engine (Rajbhandari et al., 2020): one model, N devices, each holding only its shard
// of optimizer state (stage 1), gradients (stage 2) and parameters (stage 3); stage 0 is plain
// data parallelism. Every stage computes the same bits: gradients of every micro-batch are
// reduce-scattered with the same ring (stage 0's all-reduce is that reduce-scatter followed by
// an all-gather), accumulated per shard in the same order, clipped with a norm summed over the
// same shards in the same order, and updated by the same per-element AdamW/SGD.
//
// Threading: one host thread per rank drives that rank's forward/backward and calls the methods
// of its handle, rank(r) (zero/rank.h); collectives rendezvous inside the Communicator. All ranks
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
//
// The files: this class (the engine over every rank; engine.cc), the per-rank handle (rank.h; its
// hooks and micro-batch lifecycle in engine.cc, its gradient check and optimizer step in
// rank_step.cc, its state I/O in engine_state.cc), the loss scaler (loss_scaler.h), the options
// (options.h), and the plan of what is allocated when, which the memory plan walks without devices
// (visit_plan.h, plan_engine_memory).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/dtype.h"
#include "model/model.h"
#include "zero/options.h"
#include "zero/policy.h"
#include "zero/rank.h"
#include "zero/visit_plan.h"

namespace zt {

struct EngineImpl;

class ZeroEngine {
 public:
  ZeroEngine(const Model& model, std::vector<Device*> devices, Communicator& comm, const ZeroOptions& opt);
  ~ZeroEngine();

  int world() const;        // N: every device of the engine
  int data_size() const;    // D = N / tensor: the ranks each block is sharded over
  int tensor_size() const;  // T
  // What this engine's stage shards, computed once from it.
  const ShardingPolicy& policy() const;
  DType working_dtype() const;
  // Rank r's handle (local rank): what the model reads and writes on r, its step, its loss scaler
  // and its state I/O (valid on r's thread).
  ZeroRank& rank(int r);

  // ---- state across ranks (synchronize every device; tests, checkpoints and exports, not the hot
  // path; engine_state.cc) ----
  // The full parameters of block b of tensor coordinate `tensor`, assembled on the host from that
  // coordinate's ranks that hold them (any stage).
  std::vector<float> block_to_host(int block, int tensor = 0);
  // The fp32 master weights of block b of tensor coordinate `tensor` over the whole block, assembled
  // from that coordinate's ranks' shards (equals block_to_host in fp32).
  std::vector<float> master_to_host(int block, int tensor = 0);
  // Diagnostics after an overflow: "h.3.mlp.c_fc.weight" — the first tensor, in layout order, whose
  // accumulated gradient holds inf/NaN on some rank (of any tensor coordinate); empty if none does.
  std::string first_nonfinite_gradient();
  // Switches parameters and gradients to another working dtype, keeping the fp32 master weights
  // and moments (--on-scale-collapse bf16): the new parameters are derived from the master.
  // Called once, from one thread, between steps (group collectives). Drops loss scaling (scale 1).
  void set_working_dtype(DType working);

  // Bytes of each rank's transient arena (VisitPlan; 0 when nothing is transient, and for a
  // pipeline stage's engine, whose step buffers come from the pool).
  size_t transient_arena_bytes() const;
  // Records compute spans (forward/backward of each block) and comm spans (reduce-scatter of each
  // gradient bucket, stage-3 gathers) as the streams reach them. Off by default (host callbacks
  // cost a little).
  void set_tracing(bool on);
  std::vector<TraceSpan> take_trace();

 private:
  std::unique_ptr<EngineImpl> impl_;
};

}  // namespace zt
