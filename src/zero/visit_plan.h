// The one description of what the ZeRO engine allocates and frees: per block, the resident buffers
// (in allocation order), and per micro-batch, the model's declared visit order as a list of steps,
// each with the transient buffers it allocates and frees. The engine's hooks execute these lists
// and the memory plan walks the same lists counting bytes, so the two cannot drift apart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "zero/policy.h"

namespace zt {

// A buffer of one block on one rank, named by what it holds.
enum class BufferRole : uint8_t {
  kParams,          // working dtype; full (padded) block, or the rank's shard when shard_params
  kFullGradBucket,  // working dtype, full (padded) block: what is reduce-scattered (resident unless shard_grads)
  kGradShardAccum,  // working dtype, the rank's shard: the step's reduced gradient (see GradAccumulation)
  kMaster,          // fp32 master weights (mixed precision), full or the rank's shard
  kMomentM,         // fp32 first moment
  kMomentV,         // fp32 second moment (AdamW)
  kGathered,        // stage 3: full working parameters while the block (or the next) is in use
  kComputeParams,   // mixed precision, fp32 model: fp32 copy of the block's parameters while it runs
  kComputeGrad,     // mixed precision: fp32 gradient during the block's backward
};
constexpr int kNumBufferRoles = 9;

// The pool label a role's allocations carry (memory summaries group by it).
const char* buffer_role_label(BufferRole role);

// What each buffer of one block takes on one rank (bytes; 0 = never allocated). Equal on every
// rank (shards are padded).
struct BlockBufferBytes {
  size_t role[kNumBufferRoles] = {};
  // Optimizer offload: elements of the rank's shard whose master and moments live on the host (the
  // device's kMaster/kMomentM/kMomentV cover the rest), and the host bytes they take (master,
  // moments, and host copies of their gradient and, mixed precision, working parameters).
  int64_t offloaded = 0;
  size_t host = 0;
  size_t& operator[](BufferRole r) { return role[static_cast<int>(r)]; }
  size_t operator[](BufferRole r) const { return role[static_cast<int>(r)]; }
};

struct ZeroOptions;
// The ranks each block is sharded over: a data group of world / opt.tensor devices (one tensor
// coordinate's ranks). Throws kInvalidArgument with one sentence when opt.tensor does not divide
// world.
int data_parallel_size(int world, const ZeroOptions& opt);
// world: the number of devices; the shards are over data_parallel_size(world, opt) of them.
// activations: the model's activation dtype (Model::activation_dtype); a model computing in 16 bits
// reads the working parameters as they are, so it has no kComputeParams.
BlockBufferBytes block_buffer_bytes(int64_t numel, int world, const ZeroOptions& opt,
                                    DType activations = DType::kF32);
// Whether a mixed-precision engine widens each block's parameters into an fp32 copy
// (kComputeParams) for a model of this activation dtype: only for a model computing in fp32.
inline bool widens_params(DType working, DType activations) {
  return working != DType::kF32 && activations == DType::kF32;
}
// Offload: the first floor(offload_fraction * shard_numel) elements of every rank's padded shard
// (0 without offload). Throws kInvalidArgument with one sentence for stage 0 or a fraction
// outside (0, 1].
int64_t offloaded_elements(int64_t shard_numel, const ZeroOptions& opt);
// Host bytes a rank's arena holds besides the blocks' (the overflow flag, inverse loss scale,
// clip factor and update count the host update reads).
inline constexpr size_t kOffloadScalarBytes = 4 * sizeof(float);
// Device bytes of a rank's loss-scale buffer: the LossScaleState, then the update counter
// (uint32, OptimizerStep::step_on_device) and 4 bytes of padding.
inline constexpr size_t kScalerBytes = 6 * sizeof(float) + 2 * sizeof(uint32_t);

// The resident buffers of a block, in the order the engine allocates them.
struct ResidentBuffer {
  BufferRole role;
  size_t bytes;
};
std::vector<ResidentBuffer> resident_buffers(const BlockBufferBytes& sizes, const ShardingPolicy& policy);

// One transient allocation or free.
struct BufferOp {
  bool alloc;  // else free
  BufferRole role;
  int block;
  size_t bytes;
  // An allocation: where the buffer lies in the rank's transient arena (see VisitPlan).
  size_t offset = 0;
};

// One hook call of a micro-batch, with the buffer operations the engine performs in it.
struct VisitStep {
  enum Kind : uint8_t { kForward, kBackward, kAfterBackward };
  Kind kind;
  int block;
  uint32_t first_op = 0, num_ops = 0;  // into VisitPlan::ops
};

// The transient arena: every allocation of a plan gets a fixed offset in one per-rank block of
// arena_bytes, so a buffer's address is a function of the plan alone (a captured CUDA graph of the
// work between two hooks sees the same addresses every micro-batch; train/graph_step.h). Offsets
// are assigned as compilers assign buffers: a buffer lives from its allocation to its free (or the
// end of the micro-batch), buffers whose lifetimes overlap get disjoint pool-rounded ranges, the
// largest placed first, each in the smallest gap that fits it. A range is so reused in host issue
// order, which is stream order for every reuse the engine performs:
//  - by the compute stream after compute (in order), or after a stage-3 gather (compute waited for
//    the gather's event before reading the block, and frees it only later);
//  - by a gather on the comm stream: each gather makes comm wait for everything compute was given;
//  - by compute after a gradient bucket the comm stream reduce-scattered: the one cross-stream
//    case. The plan frees such a bucket not at its after_backward but at the start of the second
//    backward visit after it (kBucketReuseLag), where the engine makes compute wait for the event
//    recorded after the bucket's reduction: comm has one block's backward to finish it before
//    compute may stall. Buckets the micro-batch's last visits leave live are released by
//    end_micro_batch; the next micro-batch's compute waits for comm before any work.
struct VisitPlan {
  std::vector<VisitStep> steps;
  std::vector<BufferOp> ops;
  size_t arena_bytes = 0;  // the end of the highest range any allocation takes
  size_t work = 0;  // loop iterations spent building it (tests: linear in the visits)
};
// Backward visits between a reduce-scattered bucket's after_backward and the visit that frees it.
inline constexpr int kBucketReuseLag = 2;

// The steps of one micro-batch from the model's declared visit order: forward then backward
// (forward_only: the forward alone, as evaluation and sampling run it). A block visited again later
// in the forward (a tied embedding) stays gathered until then; a block's after_backward directly
// follows its last backward visit. Stage 3 prefetches the next visit's block. mixed: 16-bit working
// parameters (fp32 compute gradients); widen: fp32 compute copies of the parameters too
// (widens_params). Assigns every allocation its arena offset (see VisitPlan).
VisitPlan make_visit_plan(const std::vector<int>& forward_order, const std::vector<int>& backward_order,
                          const std::vector<BlockBufferBytes>& sizes, const ShardingPolicy& policy, bool mixed,
                          bool widen, bool forward_only);

// The transient buffers live at once at the plan's peak of pool bytes (each rounded as the pool
// rounds it), from walking the steps' operations in order: what separate pool blocks would take at
// most, the lower bound of the plan's arena_bytes.
struct TransientPeak {
  std::vector<BufferOp> live;  // the allocations live at the peak
  size_t pool_bytes = 0;
  size_t work = 0;  // loop iterations spent (tests: linear in the operations)
};
TransientPeak transient_peak(const VisitPlan& plan, int num_blocks);

// ---- the engine's memory plan: the resident buffers and the visit plans above, counted --------
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
  ModelStateBytes state;         // their sum by kind: what ZeroRank::model_state_bytes reports
  // Transient buffers live at once at the peak (pool blocks, pool_rounded_size) of a training
  // micro-batch and of a forward-only pass (evaluation, sampling): the rank's transient arena,
  // which both share (a pipeline stage's engine: its step's buffers, from the pool).
  std::vector<PlannedBuffer> train_peak, forward_peak;
  size_t host = 0;  // offload: the rank's host-arena bytes (what ZeroRank::host_peak_bytes reports)
  size_t work = 0;  // loop iterations the plan took (tests check it is linear in the layers)
};

// The model-state kind a resident buffer counts as (null: a transient role).
size_t* state_slot(ModelStateBytes& m, BufferRole role);

class Model;
// What an engine of this model on `world` devices allocates per rank: the resident buffers
// (resident_buffers) and the transient arena the visit plans the engine's hooks execute
// (make_visit_plan) are laid out in. Linear in the model's visits.
EngineMemoryPlan plan_engine_memory(const Model& model, int world, const ZeroOptions& opt);

}  // namespace zt
