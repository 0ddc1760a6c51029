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
// Per-rank memory (fp32, Psi parameters, N ranks; padding to N*16 elements per block aside):
//   stage 0: params 4Psi + grads 4Psi + moments 8Psi            = 16Psi
//   stage 1: params 4Psi + grads 4Psi + moments 8Psi/N          = 8Psi + 8Psi/N
//   stage 2: params 4Psi + grad shard 4Psi/N + moments 8Psi/N   = 4Psi + 12Psi/N  (+ one block's
//            gradient bucket while its backward runs)
//   stage 3: param shard 4Psi/N + grad shard + moments          = 16Psi/N (+ gathered blocks in
//            flight: the current and the prefetched one, and the tied embedding during forward)
//   With gradient accumulation (more than one micro-batch per step), stages 0 and 1 add a 4Psi/N
//   gradient-shard accumulator.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "zero/shard_plan.h"

namespace zt {

struct ZeroOptions {
  int stage = 2;
  bool sgd = false;  // SGD keeps one moment buffer, AdamW two
  int micro_batches = 1;  // per step (gradient accumulation)
};

struct OptimizerStep {
  bool adamw = true;
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0, momentum = 0.9f;
  int step = 1;           // 1-based
  float grad_scale = 1;   // clipping factor
};

// Bytes a rank holds resident, by kind (the ZeRO "model states").
struct ModelStateBytes {
  size_t params = 0, grads = 0, optimizer = 0;
  size_t total() const { return params + grads + optimizer; }
};

// The buffers the engine allocates for one block on one rank (bytes; 0 = not allocated). The
// constructor allocates exactly these, and memory plans (train/plan.h) are computed from them, so
// prediction and allocation cannot drift apart. Equal on every rank (shards are padded).
struct BlockBufferBytes {
  size_t params = 0, grads = 0, acc = 0, m = 0, v = 0;  // resident for the engine's lifetime
  size_t bucket = 0;    // stages 2-3: full gradient of the running micro-batch, during the block's backward
  size_t gathered = 0;  // stage 3: full parameters, while the block (or the prefetched next) is in use
};

// One transient buffer live at the engine's transient peak.
struct PlannedBuffer {
  size_t bytes = 0;
  bool comm_stream = false;  // allocated for the comm stream (stage-3 gathers), else compute
};

// Per-rank memory of an engine, predicted without devices.
struct EngineMemoryPlan {
  std::vector<size_t> resident;  // every resident buffer, in allocation order (bytes)
  ModelStateBytes state;         // their sum by kind: what model_state_bytes(r) reports
  // Transient buffers live at once at the peak (pool blocks, pool_rounded_size) of a training
  // micro-batch and of a forward-only pass (evaluation, sampling).
  std::vector<PlannedBuffer> train_peak, forward_peak;
};

// One interval of work on a device stream, timed on the host when the stream reached it (CPU
// backend: exact; CUDA: when the host callback ran). Used to show overlap; see set_tracing().
struct TraceSpan {
  enum Kind { kForward, kBackward, kReduceScatter, kGather };
  Kind kind;
  int rank, block;
  double start_us, end_us;
};

class ZeroEngine {
 public:
  ZeroEngine(const Model& model, std::vector<Device*> devices, Communicator& comm, const ZeroOptions& opt);
  ~ZeroEngine();

  int world() const;
  int stage() const;
  // Loads the full parameters of every block from host memory (each rank keeps what its stage
  // keeps) and zeroes optimizer state. Blocks: one host vector per block, layout numel each.
  void load_parameters(int rank, const std::vector<std::vector<float>>& host_blocks);
  // The full parameters of block b, assembled on the host from the ranks that hold them (any
  // stage); synchronizes every device. For tests, checkpoints and exports, not the hot path.
  std::vector<float> block_to_host(int block);
  // This rank's optimizer moments of block b over its shard's real elements (m, then v).
  std::vector<float> moments_to_host(int rank, int block);

  // What the model reads and writes on rank r (valid on r's thread).
  ParamAccess& access(int rank);

  // Step lifecycle, per rank:
  // Before forward. forward_only: an evaluation or sampling forward (no backward follows).
  void begin_micro_batch(int rank, int micro_index, bool forward_only = false);
  void end_micro_batch(int rank);  // after backward (reductions enqueued) or the forward-only pass
  // Squared L2 norm of this rank's gradient shard of every block, written to device floats
  // out[0..num_blocks) on the compute stream (the host adds ranks and blocks in fixed order).
  void gradient_norm_partials(int rank, float* device_out);
  // Optimizer update of this rank's shard, then the parameter all-gather (stages 1, 2).
  void optimizer_step(int rank, const OptimizerStep& s);

  ModelStateBytes model_state_bytes(int rank) const;

  // What one block's buffers take on one rank of `world`.
  static BlockBufferBytes block_buffer_bytes(int64_t numel, int world, const ZeroOptions& opt);
  // What an engine of this model on `world` ranks allocates per rank: resident buffers, and the
  // transient ones live at the peak, from walking the model's declared visit order exactly as the
  // engine's hooks do (assumes, as GPT and MLP do, that a block's after_backward follows its last
  // backward visit before the next visit).
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
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt
