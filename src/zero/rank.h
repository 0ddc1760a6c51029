// One rank of a ZeRO engine (zero/engine.h): the per-rank handle ZeroEngine::rank(r) hands out. It is
// what the model reads and writes (ParamAccess), runs the rank's step lifecycle, owns its loss scaler
// (zero/loss_scaler.h) and moves its state to and from the host (checkpoints, tests, recovery).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "core/dtype.h"
#include "core/nvtx.h"
#include "memory/caching_allocator.h"
#include "memory/host_arena.h"
#include "model/model.h"
#include "optimizers/optimizers.h"
#include "runtime/host_staging.h"
#include "zero/loss_scaler.h"
#include "zero/options.h"
#include "zero/policy.h"
#include "zero/shard_plan.h"
#include "zero/visit_plan.h"

namespace zt {

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

struct EngineImpl;
struct SpanStart;

// One rank's half of the engine: its device, streams, blocks, events and loss scaler, and every
// per-rank operation. Every method runs on that rank's host thread (or with its device idle); all
// ranks call the same methods in the same order (collectives rendezvous inside the Communicator).
class ZeroRank final : public ParamAccess {
 public:
  // One block's buffers on this rank.
  struct Block {
    ShardRange shard;
    int64_t numel = 0;
    BlockBufferBytes sizes;  // what each buffer below takes (block_buffer_bytes)
    DeviceBuffer params, full_grad_bucket, grad_shard_accum, master, m, v;
    DeviceBuffer gathered, compute, compute_grad;
    std::unique_ptr<Event> gathered_ready;
    // Recorded on comm after the block's gradient bucket was reduce-scattered (stages 2-3): compute
    // waits for it before the plan hands the bucket's arena range to another buffer.
    std::unique_ptr<Event> reduced;
    // Offload: the first `off` elements of the rank's shard keep master and moments on the host
    // (h_master, h_m, h_v); h_grad receives their final gradient, h_work (mixed precision) their new
    // working parameters, which equal the device's once copied back (an overflowed step copies
    // them back unchanged). The device's master/m/v hold shard elements [off, shard_numel).
    // Delayed update: h_grad_alt takes the gradient of every other step (grad_parity_).
    int64_t off = 0;
    HostBuffer h_master, h_m, h_v, h_grad, h_work, h_grad_alt;
    bool grad_on_host = false;  // this step's copy into the host gradient is enqueued
    // Offload: recorded on the offload stream once the block's new offloaded parameters are back on
    // the device (and, without the delay, once its host update stopped reading the host gradient).
    // The parameter all-gather (stages 1-2), the next step's gathers (stage 3) and the next copy
    // into h_grad wait for it, block by block.
    std::unique_ptr<Event> params_back;

    DeviceBuffer& buffer(BufferRole role) {
      switch (role) {
        case BufferRole::kParams: return params;
        case BufferRole::kFullGradBucket: return full_grad_bucket;
        case BufferRole::kGradShardAccum: return grad_shard_accum;
        case BufferRole::kMaster: return master;
        case BufferRole::kMomentM: return m;
        case BufferRole::kMomentV: return v;
        case BufferRole::kGathered: return gathered;
        case BufferRole::kComputeParams: return compute;
        case BufferRole::kComputeGrad: return compute_grad;
      }
      ZT_THROW(ErrorKind::kInternal, "unknown buffer role");
    }
    const DeviceBuffer& buffer(BufferRole role) const { return const_cast<Block*>(this)->buffer(role); }
  };

  ZeroRank(EngineImpl& e, int r, Device& d);
  ~ZeroRank() override;

  // ParamAccess: what the model reads and writes.
  int device_index() const override { return d_.index(); }
  float* params(int b) override;
  float* grads(int b) override;
  DType param_dtype() const override;
  void* param_data(int b) override;
  // A pipeline stage's step has no per-micro-batch visit order: its buffers live the whole step.
  void before_forward(int b) override;
  void before_backward(int b) override;
  void after_backward(int b) override;

  // ---- step lifecycle ----
  // Before forward. forward_only: an evaluation or sampling forward (no backward follows).
  void begin_micro_batch(int micro, bool forward_only = false);
  void end_micro_batch();  // after backward (reductions enqueued) or the forward-only pass
  // One fused pass over this rank's gradient shard (after the step's micro-batches): the squared
  // L2 norm of the unscaled gradient of every block, written to device floats out[0..num_blocks)
  // on the compute stream (the trainer adds ranks and blocks in a fixed order, optim::clip_factor);
  // out[num_blocks + b] holds the part of block b in a tensor-parallel model's replicated tail
  // (zero otherwise; counted from one rank per tensor group), so out has 2 * num_blocks floats; and
  // the non-finite flag, summed over all ranks by an all-reduce into scaler().found_inf_device().
  void check_gradients(float* device_out);
  // Optimizer update of this rank's shard (skipped, writing nothing, when the combined flag is
  // set), the loss-scale update (dynamic scaling), then the parameter all-gather (stages 1, 2).
  void optimizer_step(const OptimizerStep& st);
  // Pipeline mode: before the stage's first action of a step (allocates and zeroes the step's
  // gradient buckets; mixed precision with an fp32 model: the fp32 compute copies of the
  // parameters), or with forward_only before an evaluation's forwards (the compute copies only).
  void begin_pipeline_step(bool forward_only = false);
  // Pipeline mode: after the stage's last action of the step. For each block, in layout order:
  // before_reduce(block, its step gradient in fp32, full padded length) may change it (the tied
  // embedding's sum across the first and last stage), then the gradient is rounded to the working
  // dtype (mixed precision) and reduce-scattered over the data group; then check_gradients.
  using GradientHook = std::function<void(int block, TensorView grad)>;
  void reduce_pipeline_gradients(const GradientHook& before_reduce = {});
  // The loss scale and the overflow flags.
  LossScaler& scaler() { return *scaler_; }

  // ---- state I/O: checkpoints, tests and recovery (host memory; synchronize the rank's device;
  // not the hot path; zero/engine_state.cc) ----
  // Loads the full parameters of every block from host memory (this rank keeps what its stage
  // keeps) and zeroes optimizer state. Blocks: one host vector per block, layout numel each.
  void load_parameters(const std::vector<std::vector<float>>& host);
  // This rank's optimizer moments of block b over its shard's real elements (m, then v).
  std::vector<float> moments_to_host(int b);
  // The elements [begin, end) of block b whose optimizer state this rank saves: its shard's real
  // elements at every stage (stage 0 keeps everything on every rank, but each saves its shard).
  // Shards are over the rank's data group (its data index of data_size()).
  ShardRange shard_of(int b) const;
  // The elements of block b whose optimizer state this rank keeps ([0, numel) at stage 0, else its shard).
  std::pair<int64_t, int64_t> state_range(int b) const;
  // Copies the fp32 master weights, moments (v: AdamW only; may be null for SGD) and working
  // parameters (raw working-dtype bits; null to skip) over shard_of(b).
  void state_to_host(int b, float* master, float* m, float* v, void* working);
  // Loads block b: master over the whole block [0, numel); m, v over state_range(b); working: the
  // whole block's working parameters as raw working-dtype bits, or null to derive them from the
  // master (round to nearest). Clears gradients. Host buffers may go on return.
  void load_state(int b, const float* master_full, const float* m, const float* v, const void* working_full);
  // Tests: writes `value` (converted to the working dtype) into element `offset` of the accumulated
  // gradient shard of block b, on the compute stream, before check_gradients.
  void poke_gradient(int b, int64_t offset, float value);
  ModelStateBytes model_state_bytes() const;
  // Offload: the peak of the host arena's bytes (0 without offload).
  size_t host_peak_bytes() const { return arena_ ? arena_->peak() : 0; }
  // Pinned host bytes the state export and import hold (runtime/host_staging.h): 0 until the
  // first state_to_host or load_state, HostStaging::planned_pinned_bytes() after.
  size_t host_staging_bytes() const { return staging_.pinned_bytes(); }
  // Offload: host-clock seconds of the host updates finished since the last call (each from its
  // first block's start to its last block's end, the copies back between blocks included) and of
  // that the part the devices could not hide: how long each ran on after the compute stream
  // reached the point that needs it (without the delay: the end of the step's device update; with
  // it: the next step's update, which waits for it). An upper bound at stage 3, where the next
  // forward may start before the last block is back. 0 without offload.
  struct HostUpdateSeconds {
    double total = 0, exposed = 0;
  };
  HostUpdateSeconds take_host_update_seconds();
  // Delayed update: the last step's host update is done and its parameters are on every device
  // (stages 1-2: all-gathered). A collective of the data group: every rank calls it, on its own
  // thread. No-op without a pending update. state_to_host calls it; ZeroEngine's exports settle
  // every rank from one thread.
  void settle_offload();

 private:
  friend class ZeroEngine;
  friend struct EngineImpl;
  // Switches this rank's resident working buffers to o.working (set_working_dtype, first half).
  void reallocate_working(const ZeroOptions& o);
  HostStaging& staging() { return staging_; }
  // This rank's accumulated gradient shard of block b, widened to fp32 on the host.
  std::vector<float> gradient_shard_to_host(int b);
  // The data group's collectives: the in-process ring, or the ranks of every process
  // (ZeroOptions::processes: the MPI ring's calls return finished, NCCL's are enqueued on comm_, so
  // every consumer waits on comm_ as after the in-process ring).
  void data_reduce_scatter(TensorView full, Stream* producer, std::string_view tag);
  void data_all_gather(TensorView full, Stream* producer, std::string_view tag);
  // Compute waits for everything enqueued on comm so far.
  void record_comm_and_wait(Stream& consumer) {
    comm_.record(*comm_done_);
    consumer.wait(*comm_done_);
  }

  Block& block(int b) { return blocks.at(static_cast<size_t>(b)); }
  Device& device() { return d_; }
  Stream& compute_stream() { return compute_; }

  // Offload: this rank's host arena; declared first so that it outlives the blocks' host buffers.
  std::unique_ptr<HostArena> arena_;
  std::vector<Block> blocks;
  // The loss-scale state and the overflow flags, built after the blocks (the allocation order of
  // the memory plan's resident list).
  std::optional<LossScaler> scaler_;
  // The transient arena (VisitPlan): every buffer a micro-batch's plan allocates lies in it; from
  // the first micro-batch on, kept for the engine's lifetime (the addresses must not change). Null
  // for a pipeline stage's engine.
  DeviceBuffer transients_;

  int idx() const { return d_.index(); }
  const std::string& block_name(int b) const;
  void visit(int b, bool backward);
  const VisitStep& next_step(VisitStep::Kind kind, int b);
  void allocate(Block& blk, BufferRole role, size_t bytes, Stream& s, const char* label);
  // A transient buffer at its offset in the arena (op: the plan's allocation).
  void place(Block& blk, const BufferOp& op);
  void allocate_transient(const BufferOp& op, const VisitStep& step);
  void free_transient(const BufferOp& op);
  void gather(const BufferOp& op, bool prefetch);
  void reduce_gradient(int b, bool rounded_in_place = false);
  void* accumulator(Block& blk);
  void build_segments(float weight_decay);
  // Offload: elements of block's real shard whose state is on the host, and where the device's
  // parameters of the shard start.
  int64_t host_count(const Block& blk) const { return std::min(blk.off, std::max<int64_t>(blk.shard.size(), 0)); }
  int64_t param_offset(const Block& blk) const { return policy_.shard_params ? 0 : blk.shard.begin; }
  // Offload: the host gradient copy this step fills (h_grad, or with the delay every other step h_grad_alt).
  void* host_grad(Block& blk) { return (grad_parity_ ? blk.h_grad_alt : blk.h_grad).data(); }
  // Offload: h_work := the device's working parameters of the offloaded elements (after a load).
  void refresh_host_working(Block& blk);
  // Offload: the host part of the step, enqueued before the device update (offload_step), and
  // what follows the device update (offload_after_device_update: the time point the host update
  // is due).
  void offload_step(const OptimizerStep& st, const optim::StepScalars& sc);
  void offload_after_device_update();
  // Offload: copies block blk's offloaded parameters (h_work, or the fp32 master) to the device on s.
  void copy_back(Block& blk, Stream& s);
  // Delayed update: waits for the pending host update (its exposed part) and copies its
  // parameters back on the compute stream; the all-gather of stages 1-2 is the caller's.
  void apply_pending_update();
  // Offload: the host stream is idle (host buffers may be read or written on this thread).
  void sync_offload() {
    if (offload_) offload_->synchronize();
  }
  // Offload timing (host clock, us): update u's compute stream reached the point that needs it;
  // one of its blocks ran from start_us (end_us: the update's end, for its last block; else -1).
  // Both halves together add to the take_host_update_seconds sums (add_update_clock, under clock_mu_).
  void note_update_due(uint64_t u, double us);
  void note_update_done(uint64_t u, double start_us, double end_us);
  void add_update_clock(uint64_t u);
  void close_compute_span();
  void open_compute_span(int b, bool backward);

  EngineImpl& e_;
  const ShardingPolicy& policy_;
  int r_;
  CommGroup data_;  // the ranks sharing this rank's tensor coordinate; shards are over them
  int data_index_;  // this rank's position in data_ (what the rank is in a tensor == 1 engine)
  Device& d_;
  Stream& compute_;
  Stream& comm_;
  std::unique_ptr<Event> comm_done_, compute_done_;
  // Pinned buffers of this rank's state export and import (snapshots, checkpoint saves, restores);
  // after d_, which it is built from.
  HostStaging staging_{d_};
  // Multi-tensor lists of this rank's optimizer segments and gradient shards (host and device
  // copies), built on first use from the resident buffers; rebuilt when those change.
  std::vector<optim::OptimizerSegment> opt_segs_;
  std::vector<optim::GradSegment> grad_segs_;
  DeviceBuffer opt_segs_dev_, grad_segs_dev_;
  float segs_weight_decay_ = -1;
  // Offload: the host update's lists (host memory), per block, reading h_grad ([0]) or
  // h_grad_alt ([1], delayed update only), and scalars; the blocks in the order the host updates
  // them (the order the next forward first needs them).
  std::vector<std::vector<optim::OptimizerSegment>> host_segs_[2];
  std::vector<int> host_order_;
  HostBuffer host_scalars_;  // [0] combined overflow flag, [1] inverse loss scale, [2] clip factor, [3] update count
  // Offload: the stream the host updates and their copies back run on (apart from compute, so the
  // device keeps working meanwhile); scalars_ready_ (compute: the scalars are in host_scalars_) and
  // offload_done_ (offload: the step's host updates are done, host_scalars_ is free again).
  Stream* offload_ = nullptr;
  std::unique_ptr<Event> scalars_ready_, offload_done_;
  int grad_parity_ = 0;          // delayed update: which host gradient copy this step fills
  bool update_pending_ = false;  // delayed update: a host update whose parameters are not yet back
  uint64_t updates_issued_ = 0;  // host updates enqueued (their numbers for the timing)
  // Offload timing (note_update_due / note_update_done; stream callbacks and this rank's thread).
  struct UpdateClock {
    double due_us = -1, start_us = -1, end_us = -1;
  };
  std::mutex clock_mu_;
  std::map<uint64_t, UpdateClock> clocks_;
  HostUpdateSeconds host_seconds_;
  // The micro-batch being issued: its plan and the next step of it.
  int micro_ = 0;
  const VisitPlan* plan_ = nullptr;
  size_t step_ = 0;
  OptionalNvtxRange block_range_;  // forward/backward range of the block being issued
  // Tracing: the compute span open since the last visit, and the spans this thread opened.
  std::shared_ptr<SpanStart> span_start_;
  TraceSpan::Kind span_kind_ = TraceSpan::kForward;
  int span_block_ = 0;
  uint64_t issued_ = 0;
};

}  // namespace zt
