// ZeRO stages 0-3 over per-block flat buffers. See engine.h for the memory each stage keeps and
// why every stage computes the same bits.
//
// Invariants:
//  - Collectives are issued from after_backward / before_* hooks and optimizer_step in the same
//    order on every rank (the model's block order), so the per-rank rendezvous always pairs up.
//  - Gradients and parameters travel on the rank's data group only (the world group when
//    tensor == 1, so nothing changes then); the overflow flag's all-reduce is the one world-group
//    collective, issued by every rank at the same point of the step.
//  - Everything a collective reads was written on the compute stream; the Communicator makes the
//    comm stream wait for it (producer = compute). Everything compute reads that comm wrote is
//    guarded by an event recorded on the comm stream right after the collective was enqueued.
//  - Transient buffers (gradient buckets, stage 3 gathered blocks, mixed-precision fp32 copies) are
//    placed and released only by executing the micro-batch's VisitPlan (zero/visit_plan.h), the
//    list the memory plan walks, at the offsets the plan assigned them in the rank's one transient
//    arena (allocated from the pool at its first micro-batch): the same addresses every micro-batch of a
//    run, so CUDA graphs of the work between the hooks replay (train/graph_step.h). The plan
//    reuses a range only where stream order already protects it, and for a reduce-scattered
//    bucket where compute waits for the bucket's `reduced` event (see VisitPlan). A pipeline
#include "zero/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>

#include "comm/mesh.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "memory/host_arena.h"
#include "runtime/host_staging.h"
#include "optimizers/optimizers.h"
#include "zero/engine_impl.h"

namespace zt {

// ---------------------------------------------------------------------------------------------
// ZeroRank: construction, the model's hooks and the micro-batch lifecycle.

void ZeroRank::data_reduce_scatter(TensorView full, Stream* producer, std::string_view tag) {
  if (e_.opt.processes)
    e_.opt.processes->reduce_scatter(r_, full, producer);
  else
    data_.reduce_scatter(r_, full, producer, tag);
}

void ZeroRank::data_all_gather(TensorView full, Stream* producer, std::string_view tag) {
  if (e_.opt.processes)
    e_.opt.processes->all_gather(r_, full, producer);
  else
    data_.all_gather(r_, full, producer, tag);
}

ZeroRank::ZeroRank(EngineImpl& e, int r, Device& d)
    : e_(e),
      policy_(e.policy),
      r_(r),
      data_(e.opt.processes ? CommGroup{} : e.comm.group(e.mesh.data_group(r))),
      data_index_(e.mesh.index(MeshAxis::kData, e.global_rank(r))),
      d_(d),
      compute_(d.compute()),
      comm_(d.comm()) {
  comm_done_ = d.create_event();
  compute_done_ = d.create_event();
  if (e_.opt.offload) {
    arena_ = std::make_unique<HostArena>(e_.opt.host_memory ? e_.opt.host_memory() : nullptr);
    host_scalars_ = HostBuffer(*arena_, kOffloadScalarBytes, "the offloaded step's scalars");
    offload_ = &d.create_stream();
    scalars_ready_ = d.create_event();
    offload_done_ = d.create_event();
    // The host updates, block by block, in the order the next forward first needs the blocks (at
    // stage 3 its gather of block k waits for block k only).
    std::vector<bool> seen(static_cast<size_t>(e_.model.layout().num_blocks()), false);
    for (int b : e_.model.forward_order())
      if (!seen.at(static_cast<size_t>(b))) seen[static_cast<size_t>(b)] = true, host_order_.push_back(b);
    for (size_t b = 0; b < seen.size(); ++b)
      if (!seen[b]) host_order_.push_back(static_cast<int>(b));
  }
  const ParamLayout& L = e_.model.layout();
  const size_t w = dtype_size(e_.opt.working);
  for (int b = 0; b < L.num_blocks(); ++b) {
    Block blk;
    blk.numel = L.block(b).numel;
    blk.shard = shard_range(blk.numel, data_index_, e_.data_size());
    blk.sizes = e_.block_sizes(blk.numel, e_.opt);
    for (const ResidentBuffer& rb : resident_buffers(blk.sizes, policy_))
      allocate(blk, rb.role, rb.bytes, compute_, buffer_role_label(rb.role));
    blk.off = blk.sizes.offloaded;
    if (blk.off > 0) {
      // The same bytes as BlockBufferBytes::host (the plan counts them from there).
      const size_t k = static_cast<size_t>(blk.off);
      blk.h_master = HostBuffer(*arena_, k * 4, "offloaded master weights");
      blk.h_m = HostBuffer(*arena_, k * 4, "offloaded moments");
      if (!e_.opt.sgd) blk.h_v = HostBuffer(*arena_, k * 4, "offloaded moments");
      blk.h_grad = HostBuffer(*arena_, k * w, "offloaded gradients");
      if (e_.mixed()) blk.h_work = HostBuffer(*arena_, k * w, "offloaded working parameters");
      if (e_.opt.offload_delay) blk.h_grad_alt = HostBuffer(*arena_, k * w, "offloaded gradients");
      blk.params_back = d.create_event();
    }
    blk.gathered_ready = d.create_event();
    blk.reduced = d.create_event();
    blocks.push_back(std::move(blk));
  }
  scaler_.emplace(d, compute_, e_.world(), e_.opt);
}

ZeroRank::~ZeroRank() = default;

void ZeroRank::allocate(Block& blk, BufferRole role, size_t bytes, Stream& s, const char* label) {
  DeviceBuffer& buf = blk.buffer(role);
  ZT_CHECK(!buf.data(), "block buffer ", buffer_role_label(role), " allocated twice");
  buf = DeviceBuffer(d_.memory(), bytes, s, label);
}

void ZeroRank::place(Block& blk, const BufferOp& op) {
  DeviceBuffer& buf = blk.buffer(op.role);
  ZT_CHECK(!buf.data(), "block buffer ", buffer_role_label(op.role), " placed twice");
  ZT_CHECK(op.offset + op.bytes <= transients_.size(), "the visit plan places ", buffer_role_label(op.role),
           " outside the transient arena");
  buf = DeviceBuffer::borrow(static_cast<char*>(transients_.data()) + op.offset, op.bytes);
}

const std::string& ZeroRank::block_name(int b) const { return e_.model.layout().block(b).name; }

float* ZeroRank::params(int b) {
  Block& blk = block(b);
  if (e_.mixed()) {
    ZT_CHECK(e_.widen(), "fp32 parameters of block ", b, " asked by a model that computes in ",
             dtype_name(e_.model.activation_dtype()), " (param_data holds them)");
    ZT_CHECK(blk.compute.data(), "block ", b, " used outside its visit");
    return blk.compute.as<float>();
  }
  return static_cast<float*>(param_data(b));
}

DType ZeroRank::param_dtype() const { return e_.widen() ? DType::kF32 : e_.opt.working; }

void* ZeroRank::param_data(int b) {
  Block& blk = block(b);
  if (e_.widen()) return params(b);
  // The working buffers as they are: fp32, or 16-bit for a model that computes in 16 bits.
  if (policy_.shard_params) {
    ZT_CHECK(blk.gathered.data(), "block ", b, " used before it was gathered");
    return blk.gathered.data();
  }
  return blk.params.data();
}

float* ZeroRank::grads(int b) {
  Block& blk = block(b);
  DeviceBuffer& g = e_.mixed() ? blk.compute_grad : blk.full_grad_bucket;
  ZT_CHECK(g.data(), "gradient of block ", b, " used outside its backward");
  return g.as<float>();
}

// The plan's next step must be this hook: the model visits blocks in its declared order.
const VisitStep& ZeroRank::next_step(VisitStep::Kind kind, int b) {
  static const char* const kNames[] = {"forward", "backward", "after_backward"};
  ZT_CHECK(plan_ && step_ < plan_->steps.size() && plan_->steps[step_].kind == kind && plan_->steps[step_].block == b,
           "block ", b, " ", kNames[kind], " visited out of the model's declared order at step ", step_);
  return plan_->steps[step_++];
}

// One before_forward/before_backward call: executes the step's frees and allocations (stage 3:
// the gather of this block and the prefetch of the next; mixed precision: the fp32 copies).
void ZeroRank::visit(int b, bool backward) {
  const VisitStep& st = next_step(backward ? VisitStep::kBackward : VisitStep::kForward, b);
  // Host range "forward h.3" from this hook to the next: the issuing of the block's work
  // (and, at stage 3, its gather and the next block's prefetch).
  block_range_.close();
  if (ranges_enabled())
    block_range_.open(backward ? NvtxCategory::kBackward : NvtxCategory::kForward,
                      (backward ? "backward " : "forward ") + block_name(b), idx());
  bool ready = !policy_.shard_params;  // compute waits for this block's gather before using it
  for (uint32_t i = 0; i < st.num_ops; ++i) {
    const BufferOp& op = plan_->ops[st.first_op + i];
    if (!op.alloc) {
      free_transient(op);
      continue;
    }
    if (op.role != BufferRole::kGathered && !ready) compute_.wait(*block(b).gathered_ready), ready = true;
    allocate_transient(op, st);
  }
  if (!ready) compute_.wait(*block(b).gathered_ready);
  open_compute_span(b, backward);
}

void ZeroRank::allocate_transient(const BufferOp& op, const VisitStep& st) {
  Block& blk = block(op.block);
  const int64_t n = blk.shard.padded_numel;
  switch (op.role) {
    case BufferRole::kGathered:
      gather(op, /*prefetch=*/op.block != st.block);
      return;
    case BufferRole::kComputeParams: {
      // The block runs in fp32 on its 16-bit parameters, widened exactly.
      place(blk, op);
      void* src = policy_.shard_params ? blk.gathered.data() : blk.params.data();
      ops::cast(compute_, f32(blk.compute.as<float>(), n, idx()), typed(src, e_.opt.working, n, idx()));
      return;
    }
    case BufferRole::kComputeGrad:
      place(blk, op);
      ops::fill(compute_, f32(blk.compute_grad.as<float>(), n, idx()), 0.0f);
      return;
    case BufferRole::kFullGradBucket:
      place(blk, op);
      // In fp32 the model accumulates into it; in mixed precision the rounded gradient fills it.
      if (st.kind == VisitStep::kBackward) ops::fill(compute_, f32(blk.full_grad_bucket.as<float>(), n, idx()), 0.0f);
      return;
    default:
      ZT_THROW(ErrorKind::kInternal, "visit plan allocates resident buffer ", buffer_role_label(op.role));
  }
}

void ZeroRank::free_transient(const BufferOp& op) {
  Block& blk = block(op.block);
  DeviceBuffer& buf = blk.buffer(op.role);
  ZT_CHECK(buf.data(), "visit plan frees ", buffer_role_label(op.role), " of block ", op.block, ", which is not live");
  // The plan may hand the range to a buffer compute writes next; a bucket is freed after its
  // reduce-scatter, which comm may still run (VisitPlan). Everything else was last used by
  // compute, or is reused by a gather that waits for compute.
  if (op.role == BufferRole::kFullGradBucket) compute_.wait(*blk.reduced);
  buf.reset();
}

// Stage 3: gather a block's parameters on the comm stream.
void ZeroRank::gather(const BufferOp& op, bool prefetch) {
  const int b = op.block;
  Block& blk = block(b);
  OptionalNvtxRange range;
  if (ranges_enabled()) range.open(NvtxCategory::kGather, (prefetch ? "prefetch " : "gather ") + block_name(b), idx());
  place(blk, op);
  // The shard was last written by the optimizer on the compute stream, and its offloaded part by
  // the offload stream (this block's copy back only: the rest of the host update may still run).
  compute_.record(*compute_done_);
  comm_.wait(*compute_done_);
  if (blk.params_back) comm_.wait(*blk.params_back);
  std::shared_ptr<SpanStart> start = e_.tracing ? e_.open_span(comm_, issued_++) : nullptr;
  const DType W = e_.opt.working;
  comm_.copy(at(blk.gathered.data(), W, blk.shard.begin), blk.params.data(), bytes_of(blk.shard.shard_numel, W));
  data_all_gather(typed(blk.gathered.data(), W, blk.shard.padded_numel, idx()), nullptr, block_name(b));
  if (start) e_.close_span(comm_, start, TraceSpan::kGather, r_, b);
  comm_.record(*blk.gathered_ready);
}

// Every gradient of block b is issued: round it into the bucket (mixed precision), reduce-scatter
// the bucket and fold this rank's shard into the step's accumulator, freeing what the step says.
void ZeroRank::before_forward(int b) {
  if (!e_.opt.pipeline) visit(b, false);
}

void ZeroRank::before_backward(int b) {
  if (!e_.opt.pipeline) visit(b, true);
}

void ZeroRank::after_backward(int b) {
  if (e_.opt.pipeline) return;  // reduce_pipeline_gradients reduces once per step
  const VisitStep& st = next_step(VisitStep::kAfterBackward, b);
  close_compute_span();
  const BufferOp* ops_begin = plan_->ops.data() + st.first_op;
  const BufferOp* ops_end = ops_begin + st.num_ops;
  for (const BufferOp* op = ops_begin; op != ops_end; ++op)
    if (op->alloc) allocate_transient(*op, st);
  Block& blk = block(b);
  // Stages 2-3 over one data rank (one GPU), first micro-batch, in-process: the reduce-scatter moves
  // nothing and the shard is the whole bucket, so the rounded gradient goes straight into the
  // resident accumulator instead of into the bucket and then copied there on the comm stream (for
  // GPT-2 124M in bf16 249 MB a step, the last block's copy exposed before check_gradients). The
  // same values land in the same place: the same bits.
  const bool direct = e_.mixed() && micro_ == 0 && policy_.shard_grads && e_.data_size() == 1 && !e_.opt.processes;
  if (e_.mixed()) {
    // The fp32 gradient is rounded once into the working dtype, which is what is reduced.
    ops::cast(compute_, typed(direct ? accumulator(blk) : blk.full_grad_bucket.data(), e_.opt.working,
                              blk.shard.padded_numel, idx()),
              f32(blk.compute_grad.as<float>(), blk.shard.padded_numel, idx()));
  }
  for (const BufferOp* op = ops_begin; op != ops_end; ++op)
    if (!op->alloc && op->role == BufferRole::kComputeGrad) free_transient(*op);
  reduce_gradient(b, direct);
  if (policy_.shard_grads) comm_.record(*blk.reduced);
  for (const BufferOp* op = ops_begin; op != ops_end; ++op)
    if (!op->alloc && op->role != BufferRole::kComputeGrad) free_transient(*op);
  block_range_.close();  // the backward range covers issuing this block's reduce-scatter
}

// rounded_in_place: after_backward already wrote this micro-batch's gradient into the accumulator
// (one data rank); the reduce-scatter, a no-op then, still orders the comm stream after it.
void ZeroRank::reduce_gradient(int b, bool rounded_in_place) {
  Block& blk = block(b);
  const DType W = e_.opt.working;
  void* full = blk.full_grad_bucket.data();
  const TensorView full_view = typed(full, W, blk.shard.padded_numel, idx());
  std::shared_ptr<SpanStart> rs_start;
  if (e_.tracing) {
    // Wait for the gradients here (not inside the collective) so the span starts when the
    // reduce-scatter can really start.
    compute_.record(*compute_done_);
    comm_.wait(*compute_done_);
    rs_start = e_.open_span(comm_, issued_++);
    data_reduce_scatter(full_view, nullptr, block_name(b));
  } else {
    data_reduce_scatter(full_view, &compute_, block_name(b));
  }
  // This rank's reduced shard now sits at full + begin; fold it into the step's accumulator.
  const int64_t n = blk.shard.shard_numel;
  const TensorView region = typed(at(full, W, blk.shard.begin), W, n, idx());
  void* acc = accumulator(blk);
  if (acc != region.data && !rounded_in_place) {
    if (micro_ == 0)
      comm_.copy(acc, region.data, bytes_of(n, W));
    else
      ops::accumulate(comm_, typed(acc, W, n, idx()), region);
  }
  if (rs_start) e_.close_span(comm_, rs_start, TraceSpan::kReduceScatter, r_, b);
  // Offload: the step's gradient of this block is final; its offloaded part goes to the host
  // now, overlapping the rest of the backward (the host update waits for comm).
  // Without the delay the last step's host update of this block read h_grad until params_back;
  // with it, this step fills the other copy, whose reader (the update before last) finished before
  // the last step's update was enqueued (offload_step: compute waits for offload_done_).
  const int64_t nh = host_count(blk);
  if (nh > 0 && micro_ == e_.opt.micro_batches - 1) {
    if (!e_.opt.offload_delay) comm_.wait(*blk.params_back);
    comm_.copy(host_grad(blk), acc, bytes_of(nh, W));
    blk.grad_on_host = true;
  }
}

// Where this rank's reduced gradient shard of the step lives (GradAccumulation).
void* ZeroRank::accumulator(Block& blk) {
  if (policy_.shard_grads || policy_.separate_accumulator(e_.opt.micro_batches)) return blk.grad_shard_accum.data();
  return at(blk.full_grad_bucket.data(), e_.opt.working, blk.shard.begin);
}

// Compute spans: from a block's visit to the next visit (or its after_backward).
void ZeroRank::close_compute_span() {
  if (span_start_) e_.close_span(compute_, span_start_, span_kind_, r_, span_block_);
  span_start_.reset();
}

void ZeroRank::open_compute_span(int b, bool backward) {
  close_compute_span();
  if (!e_.tracing) return;
  span_start_ = e_.open_span(compute_, issued_++);
  span_kind_ = backward ? TraceSpan::kBackward : TraceSpan::kForward;
  span_block_ = b;
}

void ZeroRank::begin_micro_batch(int micro, bool forward_only) {
  if (!transients_.data() && e_.arena_bytes > 0) {
    // At the first micro-batch, not with the engine: loading the parameters stages them through
    // the pool first, as the memory plan expects (its phases hold the arena, the load does not).
    transients_ = DeviceBuffer(d_.memory(), e_.arena_bytes, compute_, "transient arena");
    d_.memory().record_stream(transients_.data(), comm_);  // gathers and reductions use it too
  }
  micro_ = micro;
  plan_ = forward_only ? &e_.forward_plan : &e_.train_plan;
  step_ = 0;
  // Compute may overwrite what the last collectives read (the resident gradient bucket) and
  // reads what they wrote (parameters after the all-gather) only after they are done.
  record_comm_and_wait(compute_);
  if (!policy_.shard_grads && !forward_only && !e_.mixed())
    for (auto& blk : blocks)
      ops::fill(compute_, f32(blk.full_grad_bucket.as<float>(), blk.shard.padded_numel, idx()), 0.0f);
}

void ZeroRank::begin_pipeline_step(bool forward_only) {
  ZT_CHECK(e_.opt.pipeline, "begin_pipeline_step on an engine that is not a pipeline stage's");
  micro_ = 0;
  // Compute overwrites the buckets the last reductions read and reads the parameters the last
  // all-gather wrote only after they are done.
  record_comm_and_wait(compute_);
  const DType W = e_.opt.working;
  for (auto& blk : blocks) {
    const int64_t n = blk.shard.padded_numel;
    if (e_.widen()) {
      // An evaluation's copies stay until the next step's reduction frees them: refreshed here.
      // A 16-bit model reads the working parameters as they are (param_data): no copies.
      if (!blk.compute.data())
        allocate(blk, BufferRole::kComputeParams, blk.sizes[BufferRole::kComputeParams], compute_, "compute parameters");
      ops::cast(compute_, f32(blk.compute.as<float>(), n, idx()), typed(blk.params.data(), W, n, idx()));
    }
    if (forward_only) continue;
    if (!blk.full_grad_bucket.data())
      allocate(blk, BufferRole::kFullGradBucket, blk.sizes[BufferRole::kFullGradBucket], compute_, "gradient bucket");
    if (e_.mixed()) {
      allocate(blk, BufferRole::kComputeGrad, blk.sizes[BufferRole::kComputeGrad], compute_, "gradient bucket");
      ops::fill(compute_, f32(blk.compute_grad.as<float>(), n, idx()), 0.0f);
    } else {
      ops::fill(compute_, f32(blk.full_grad_bucket.as<float>(), n, idx()), 0.0f);
    }
  }
}

void ZeroRank::reduce_pipeline_gradients(const GradientHook& before_reduce) {
  ZT_CHECK(e_.opt.pipeline, "reduce_pipeline_gradients on an engine that is not a pipeline stage's");
  const DType W = e_.opt.working;
  for (size_t i = 0; i < blocks.size(); ++i) {
    Block& blk = blocks[i];
    const int b = static_cast<int>(i);
    const int64_t n = blk.shard.padded_numel;
    float* grad = e_.mixed() ? blk.compute_grad.as<float>() : blk.full_grad_bucket.as<float>();
    if (before_reduce) before_reduce(b, f32(grad, n, idx()));
    if (e_.mixed()) {
      ops::cast(compute_, typed(blk.full_grad_bucket.data(), W, n, idx()), f32(grad, n, idx()));
      blk.compute.reset();  // last read by the step's compute, on compute_
      blk.compute_grad.reset();
    }
    reduce_gradient(b);
    if (policy_.shard_grads) {
      d_.memory().record_stream(blk.full_grad_bucket.data(), comm_);
      blk.full_grad_bucket.reset();
    }
  }
}

void ZeroRank::end_micro_batch() {
  close_compute_span();
  block_range_.close();
  // What the last visits kept (stage 3 gathered blocks, fp32 compute copies, buckets still in
  // reduction) goes now: the next micro-batch's compute waits for comm first (begin_micro_batch).
  for (auto& blk : blocks) {
    blk.gathered.reset();
    blk.compute.reset();
    if (!e_.opt.pipeline && policy_.shard_grads) blk.full_grad_bucket.reset();
  }
  const size_t done = step_, expect = plan_ ? plan_->steps.size() : 0;
  plan_ = nullptr;
  ZT_CHECK(done == expect, "the model made ", done, " block visits, its declared order has ", expect);
}

// ---------------------------------------------------------------------------------------------
// ZeroEngine: the ranks' handles; what spans ranks.

ZeroEngine::ZeroEngine(const Model& model, std::vector<Device*> devices, Communicator& comm, const ZeroOptions& opt)
    : impl_(std::make_unique<EngineImpl>(model, std::move(devices), comm, opt)) {}

ZeroEngine::~ZeroEngine() {
  for (Device* d : impl_->devices) {
    try {
      d->synchronize();
    } catch (const Error&) {
    }
  }
}

int ZeroEngine::world() const { return impl_->world(); }
int ZeroEngine::data_size() const { return impl_->data_size(); }
int ZeroEngine::tensor_size() const { return impl_->tensor_size(); }
const ShardingPolicy& ZeroEngine::policy() const { return impl_->policy; }
ZeroRank& ZeroEngine::rank(int r) { return impl_->rank(r); }
DType ZeroEngine::working_dtype() const { return impl_->opt.working; }

size_t ZeroEngine::transient_arena_bytes() const { return impl_->arena_bytes; }

void ZeroEngine::set_tracing(bool on) { impl_->tracing = on; }

std::vector<TraceSpan> ZeroEngine::take_trace() {
  for (Device* d : impl_->devices) d->synchronize();
  std::lock_guard<std::mutex> lock(impl_->trace_mu);
  return std::move(impl_->spans);
}

}  // namespace zt
