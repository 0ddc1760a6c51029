// The options of a ZeRO engine (zero/engine.h): its stage, tensor degree, optimizer, working dtype,
// loss scaling, offload, pipeline and process setup. Plain values, shared by the engine and the
// memory plan (zero/visit_plan.h), which needs no devices.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "core/dtype.h"
#include "memory/raw_allocator.h"
#include "optimizers/optimizers.h"
#include "zero/data_collectives.h"

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
  // --offload-delay-update (DeepSpeed's delay_update, ZeRO-Offload's delayed parameter update):
  // the host update of step k's gradients runs during step k+1's forward and backward, which use
  // the offloaded elements' parameters from before it (one step stale). Changes the bits; needs
  // offload. A state export (checkpoint, snapshot, block_to_host) applies the pending update first.
  bool offload_delay = false;
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

}  // namespace zt
