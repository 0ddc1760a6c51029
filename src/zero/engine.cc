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
//    stage's engine has no per-micro-batch plan: its step buffers come from the pool.
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

namespace zt {

namespace {

TensorView f32(float* p, int64_t n, int device) { return TensorView{p, DType::kF32, Shape{n}, device}; }
TensorView typed(void* p, DType t, int64_t n, int device) { return TensorView{p, t, Shape{n}, device}; }
// Element i of a buffer of dtype t.
void* at(void* base, DType t, int64_t i) { return static_cast<char*>(base) + i * static_cast<int64_t>(dtype_size(t)); }
size_t bytes_of(int64_t n, DType t = DType::kF32) { return static_cast<size_t>(n) * dtype_size(t); }

// Copies n floats of device memory at src to the host through the rank's pinned staging, after
// the stream's work; returns when dst holds them.
void to_host(HostStaging& staging, Stream& s, float* dst, const void* src, int64_t n) {
  if (n <= 0) return;
  staging.to_host(s, dst, src, static_cast<size_t>(n) * 4);
}

// The model-state kind a resident buffer counts as.
size_t* state_slot(ModelStateBytes& m, BufferRole role) {
  switch (role) {
    case BufferRole::kParams: return &m.params;
    case BufferRole::kFullGradBucket:
    case BufferRole::kGradShardAccum: return &m.grads;
    case BufferRole::kMaster:
    case BufferRole::kMomentM:
    case BufferRole::kMomentV: return &m.optimizer;
    default: return nullptr;  // transient
  }
}

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
  // working parameters, which always equal the device's (an overflowed step copies them back
  // unchanged). The device's master/m/v hold shard elements [off, shard_numel).
  int64_t off = 0;
  HostBuffer h_master, h_m, h_v, h_grad, h_work;
  bool grad_on_host = false;  // this step's copy into h_grad is enqueued

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

// Where and when a traced span started (filled in by a stream callback).
struct SpanStart {
  double us = 0;
  uint64_t seq = 0, issued = 0;
};

}  // namespace

// One rank's half of the engine: its device, streams, blocks, events and loss-scale state, and
// every per-rank operation (called on that rank's host thread, or with its device idle).
class ZeroRank final : public ParamAccess {
 public:
  ZeroRank(ZeroEngine::Impl& e, int r, Device& d);

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

  void begin_micro(int micro, bool forward_only);
  void begin_pipeline_step(bool forward_only);
  void reduce_pipeline_gradients(const ZeroEngine::GradientHook& before_reduce);
  void end_micro();
  void check_gradients(float* device_out);
  void optimizer_step(const OptimizerStep& st);
  void load_parameters(const std::vector<std::vector<float>>& host);
  std::vector<float> moments_to_host(int b);
  void state_to_host(int b, float* master, float* m, float* v, void* working);
  void load_state(int b, const float* master_full, const float* m, const float* v, const void* working_full);
  void poke_gradient(int b, int64_t offset, float value);
  // Switches this rank's resident working buffers to o.working (set_working_dtype, first half).
  void reallocate_working(const ZeroOptions& o);
  void reset_scaler();
  void set_loss_scale_state(const optim::LossScaleState& st);
  uint32_t* update_count_device();  // after the LossScaleState in `scaler` (kScalerBytes)
  void set_update_count(int64_t updates);
  int64_t update_count();
  optim::LossScaleState loss_scale_state();
  void mark_overflow() { ops::fill(compute_, f32(flags.as<float>(), 1, idx()), 1.0f); }
  ModelStateBytes model_state_bytes() const;
  size_t host_peak_bytes() const { return arena_ ? arena_->peak() : 0; }
  size_t host_staging_bytes() const { return staging_.pinned_bytes(); }
  HostStaging& staging() { return staging_; }
  double host_update_seconds() const { return host_seconds_.load(); }
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
  DeviceBuffer scaler, flags;  // see Impl::reset_scaler
  // The transient arena (VisitPlan): every buffer a micro-batch's plan allocates lies in it; from
  // the first micro-batch on, kept for the engine's lifetime (the addresses must not change). Null
  // for a pipeline stage's engine.
  DeviceBuffer transients_;

 private:
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
  void reduce_gradient(int b);
  void* accumulator(Block& blk);
  void build_segments(float weight_decay);
  // Offload: elements of block's real shard whose state is on the host, and where the device's
  // parameters of the shard start.
  int64_t host_count(const Block& blk) const { return std::min(blk.off, std::max<int64_t>(blk.shard.size(), 0)); }
  int64_t param_offset(const Block& blk) const { return policy_.shard_params ? 0 : blk.shard.begin; }
  // Offload: h_work := the device's working parameters of the offloaded elements (after a load).
  void refresh_host_working(Block& blk);
  void offload_step(const OptimizerStep& st, const optim::StepScalars& sc);
  void close_compute_span();
  void open_compute_span(int b, bool backward);

  ZeroEngine::Impl& e_;
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
  // Offload: the host update's list (host memory) and scalars.
  std::vector<optim::OptimizerSegment> host_segs_;
  HostBuffer host_scalars_;  // [0] combined overflow flag, [1] inverse loss scale, [2] clip factor, [3] update count
  std::atomic<double> host_seconds_{0.0};
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
  friend struct ZeroEngine::Impl;
};

struct ZeroEngine::Impl {
  Impl(const Model& m, std::vector<Device*> devs, Communicator& c, const ZeroOptions& o)
      : model(m),
        devices(std::move(devs)),
        comm(c),
        opt(o),
        policy(policy_for_stage(o.stage)),
        mesh(MeshShape{.data = data_parallel_size(engine_world(devices.size(), o), o), .tensor = o.tensor},
             engine_world(devices.size(), o)) {
    ZT_CHECK(comm.world() == static_cast<int>(devices.size()), "communicator and engine disagree on the world size");
    ZT_CHECK(!o.processes || (!o.pipeline && !o.offload),
             "an engine over several processes runs data and tensor parallelism only (no pipeline or offload)");
    ZT_CHECK(!o.processes || o.processes->tensor_degree() == o.tensor, "the engine's tensor degree ", o.tensor,
             " is not its cross-process collectives' ", o.processes ? o.processes->tensor_degree() : 0);
    ZT_CHECK(!o.pipeline || (o.stage <= 2 && !o.offload && o.micro_batches == 1),
             "a pipeline stage's engine runs ZeRO stages 0-2 without offload, reducing once per step");
    ZT_REQUIRE(m.activation_dtype() == DType::kF32 || dtype_size(o.working) == dtype_size(m.activation_dtype()),
               "a model computing in ", dtype_name(m.activation_dtype()), " needs 16-bit working parameters, not ",
               dtype_name(o.working), "; use --precision bf16 or fp16, or an fp32 model");
    const ParamLayout& L = model.layout();
    std::vector<BlockBufferBytes> sizes;
    for (int b = 0; b < L.num_blocks(); ++b) sizes.push_back(block_sizes(L.block(b).numel, opt));
    make_plans(sizes);
    for (int r = 0; r < local_size(); ++r)
      ranks.push_back(std::make_unique<ZeroRank>(*this, r, *devices[static_cast<size_t>(r)]));
  }

  void make_plans(const std::vector<BlockBufferBytes>& sizes) {
    const auto fwd = model.forward_order(), bwd = model.backward_order();
    train_plan = make_visit_plan(fwd, bwd, sizes, policy, mixed(), widen(), false);
    forward_plan = make_visit_plan(fwd, bwd, sizes, policy, mixed(), widen(), true);
    // Training and forward-only micro-batches share it (each begins after the other's work).
    arena_bytes = opt.pipeline ? 0 : std::max(train_plan.arena_bytes, forward_plan.arena_bytes);
  }

  bool mixed() const { return opt.working != DType::kF32; }
  // Mixed precision for a model computing in fp32: blocks run on fp32 copies (kComputeParams).
  bool widen() const { return widens_params(opt.working, model.activation_dtype()); }
  BlockBufferBytes block_sizes(int64_t numel, const ZeroOptions& o) const {
    return zt::block_buffer_bytes(numel, world(), o, model.activation_dtype());
  }
  // Global ranks (every process's; this process's devices alone without opt.processes).
  static int engine_world(size_t local, const ZeroOptions& o) {
    return o.processes ? o.processes->world() : static_cast<int>(local);
  }
  int world() const { return engine_world(devices.size(), opt); }
  int local_size() const { return static_cast<int>(devices.size()); }
  int global_rank(int local) const { return opt.processes ? opt.processes->global_rank(local) : local; }
  void require_one_process(const char* what) const {
    ZT_REQUIRE(!opt.processes || opt.processes->world() == local_size(), what,
               " needs every rank in this process; it is not built for a run over several processes");
  }
  int data_size() const { return mesh.size(MeshAxis::kData); }
  int tensor_size() const { return mesh.size(MeshAxis::kTensor); }
  ZeroRank& rank(int r) { return *ranks.at(static_cast<size_t>(r)); }
  // The ranks of tensor coordinate t, by data index.
  std::vector<int> tensor_ranks(int t) const {
    ZT_REQUIRE(t >= 0 && t < tensor_size(), "tensor coordinate ", t, " is outside the engine's tensor degree of ",
               tensor_size());
    return mesh.data_group(mesh.rank_at(MeshCoord{.data = 0, .tensor = t}));
  }

  // ---- tracing ----
  bool tracing = false;
  std::mutex trace_mu;
  std::vector<TraceSpan> spans;
  std::atomic<uint64_t> trace_seq{0};
  const std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double now_us() const {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  // Opens a span when `s` reaches this point; close_span records it when `s` reaches that point.
  std::shared_ptr<SpanStart> open_span(Stream& s, uint64_t issued) {
    auto start = std::make_shared<SpanStart>();
    start->issued = issued;
    s.host_func([this, start] {
      start->us = now_us();
      start->seq = ++trace_seq;
    });
    return start;
  }
  void close_span(Stream& s, std::shared_ptr<SpanStart> start, TraceSpan::Kind kind, int rank, int block) {
    s.host_func([this, start, kind, rank, block] {
      const double end = now_us();
      const uint64_t end_seq = ++trace_seq;
      std::lock_guard<std::mutex> lock(trace_mu);
      spans.push_back(TraceSpan{kind, rank, block, start->us, end, start->issued, start->seq, end_seq});
    });
  }

  const Model& model;
  std::vector<Device*> devices;
  Communicator& comm;
  ZeroOptions opt;
  const ShardingPolicy policy;
  const Mesh mesh;  // {data = N / tensor, tensor}
  VisitPlan train_plan, forward_plan;  // what each micro-batch's hooks allocate and free
  size_t arena_bytes = 0;              // each rank's transient arena
  std::vector<std::unique_ptr<ZeroRank>> ranks;
};


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

ZeroRank::ZeroRank(ZeroEngine::Impl& e, int r, Device& d)
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
    }
    blk.gathered_ready = d.create_event();
    blk.reduced = d.create_event();
    blocks.push_back(std::move(blk));
  }
  static_assert(kScalerBytes >= sizeof(optim::LossScaleState) + sizeof(uint32_t));
  scaler = DeviceBuffer(d.memory(), kScalerBytes, compute_, "loss scale");
  flags = DeviceBuffer(d.memory(), static_cast<size_t>(e_.world()) * sizeof(float), compute_, "loss scale");
  set_update_count(0);  // reset_scaler keeps it: a switch of the working dtype goes on counting
  reset_scaler();
}

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
  // The shard was last written by the optimizer on the compute stream.
  compute_.record(*compute_done_);
  comm_.wait(*compute_done_);
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
  if (e_.mixed()) {
    // The fp32 gradient is rounded once into the working dtype, which is what is reduced.
    ops::cast(compute_, typed(blk.full_grad_bucket.data(), e_.opt.working, blk.shard.padded_numel, idx()),
              f32(blk.compute_grad.as<float>(), blk.shard.padded_numel, idx()));
  }
  for (const BufferOp* op = ops_begin; op != ops_end; ++op)
    if (!op->alloc && op->role == BufferRole::kComputeGrad) free_transient(*op);
  reduce_gradient(b);
  if (policy_.shard_grads) comm_.record(*blk.reduced);
  for (const BufferOp* op = ops_begin; op != ops_end; ++op)
    if (!op->alloc && op->role != BufferRole::kComputeGrad) free_transient(*op);
  block_range_.close();  // the backward range covers issuing this block's reduce-scatter
}

void ZeroRank::reduce_gradient(int b) {
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
  if (acc != region.data) {
    if (micro_ == 0)
      comm_.copy(acc, region.data, bytes_of(n, W));
    else
      ops::accumulate(comm_, typed(acc, W, n, idx()), region);
  }
  if (rs_start) e_.close_span(comm_, rs_start, TraceSpan::kReduceScatter, r_, b);
  // Offload: the step's gradient of this block is final; its offloaded part goes to the host
  // now, overlapping the rest of the backward (the host update waits for comm).
  const int64_t nh = host_count(blk);
  if (nh > 0 && micro_ == e_.opt.micro_batches - 1) {
    comm_.copy(blk.h_grad.data(), acc, bytes_of(nh, W));
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

void ZeroRank::begin_micro(int micro, bool forward_only) {
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

void ZeroRank::reduce_pipeline_gradients(const ZeroEngine::GradientHook& before_reduce) {
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

void ZeroRank::end_micro() {
  close_compute_span();
  block_range_.close();
  // What the last visits kept (stage 3 gathered blocks, fp32 compute copies, buckets still in
  // reduction) goes now: the next micro-batch's compute waits for comm first (begin_micro).
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
// ZeroRank: gradient check, optimizer step, loss scale.

void ZeroRank::reset_scaler() {
  const bool none = e_.opt.scaling == ZeroOptions::Scaling::kNone;
  const optim::LossScaleState st = optim::initial_loss_scale_state(none ? 1.0f : e_.opt.initial_scale,
                                                                   none ? optim::LossScaleConfig{} : e_.opt.scale_config);
  compute_.copy(scaler.data(), &st, sizeof st);
  ops::fill(compute_, f32(flags.as<float>(), e_.world(), idx()), 0.0f);
  compute_.synchronize();  // st lives on this stack frame
}

uint32_t* ZeroRank::update_count_device() {
  return reinterpret_cast<uint32_t*>(static_cast<char*>(scaler.data()) + sizeof(optim::LossScaleState));
}

void ZeroRank::set_update_count(int64_t updates) {
  ZT_REQUIRE(updates >= 0 && updates < int64_t{UINT32_MAX}, "the update count ", updates, " is out of range");
  const auto n = static_cast<uint32_t>(updates);
  compute_.copy(update_count_device(), &n, sizeof n);
  compute_.synchronize();  // n lives on this stack frame
}

int64_t ZeroRank::update_count() {
  uint32_t n = 0;
  compute_.copy(&n, update_count_device(), sizeof n);
  compute_.synchronize();
  return n;
}

void ZeroRank::set_loss_scale_state(const optim::LossScaleState& st) {
  compute_.copy(scaler.data(), &st, sizeof st);
  compute_.synchronize();
}

optim::LossScaleState ZeroRank::loss_scale_state() {
  optim::LossScaleState st{};
  compute_.copy(&st, scaler.data(), sizeof st);
  compute_.synchronize();
  return st;
}

// The resident buffers' multi-tensor lists (see opt_segs_), uploaded to the device.
void ZeroRank::build_segments(float weight_decay) {
  const ParamLayout& L = e_.model.layout();
  const DType W = e_.opt.working;
  const auto w = static_cast<int64_t>(dtype_size(W));
  // A rebuild: the previous lists' copies to the device may still be queued on the stream and
  // read these vectors.
  if (!opt_segs_.empty() || !grad_segs_.empty()) compute_.synchronize();
  opt_segs_.clear();
  grad_segs_.clear();
  host_segs_.clear();
  int64_t global = 0;  // element index of the block's first element in the whole model
  for (size_t b = 0; b < blocks.size(); ++b) {
    auto& blk = blocks[b];
    // The norm of a tensor-parallel block's replicated tail (model/tensor_split.h) goes to
    // out[B + b], apart from the rest, so the host counts it once per tensor group (a map of
    // degree 1, the one-device GPT's padded vocabulary, has no group: one partial per block).
    const TensorMap* map = e_.model.tensor_map();
    const bool split_tail = map != nullptr && map->degree > 1;
    const int64_t split_at = std::clamp(split_tail ? map->replicated_from(static_cast<int>(b)) : blk.shard.end,
                                        blk.shard.begin, blk.shard.end);
    grad_segs_.push_back({accumulator(blk), split_at - blk.shard.begin, static_cast<int>(b)});
    if (split_at < blk.shard.end)
      grad_segs_.push_back({static_cast<char*>(accumulator(blk)) + (split_at - blk.shard.begin) * w,
                            blk.shard.end - split_at, static_cast<int>(blocks.size() + b)});
    // Unsharded optimizer state updates whole tensors; sharded, the intersection of each tensor
    // with the shard. Bases are pointers to element 0 of the block (shard buffers are offset by -begin).
    const bool whole = !policy_.shard_optimizer;
    // Offload: the device updates shard elements [off, ...), the host [0, off) (blk.off is 0 when
    // the state is whole: stage 0 does not offload).
    const int64_t lo = (whole ? 0 : blk.shard.begin) + blk.off, hi = whole ? blk.numel : blk.shard.end;
    const int64_t shard_off = (whole ? 0 : blk.shard.begin) + blk.off;
    char* p_base = static_cast<char*>(blk.params.data()) - (policy_.shard_params ? blk.shard.begin * w : 0);
    const char* g_base = whole ? static_cast<char*>(blk.full_grad_bucket.data())
                               : static_cast<char*>(accumulator(blk)) - blk.shard.begin * w;
    // A buffer the whole shard offloaded away is null: no device segment uses it.
    const auto base = [shard_off](const DeviceBuffer& buf) { return buf.data() ? buf.as<float>() - shard_off : nullptr; };
    float* master_base = e_.mixed() ? base(blk.master) : reinterpret_cast<float*>(p_base);
    float* m_base = base(blk.m);
    float* v_base = e_.opt.sgd ? nullptr : base(blk.v);
    for (const ParamTensor& t : L.block(static_cast<int>(b)).tensors) {
      const int64_t a = std::max(lo, t.offset), e = std::min(hi, t.offset + t.numel);
      if (a >= e) continue;
      optim::OptimizerSegment seg;
      seg.param = p_base + a * w;
      seg.grad = g_base + a * w;
      seg.master = master_base + a;
      seg.m = m_base + a;
      seg.v = v_base ? v_base + a : nullptr;
      seg.n = e - a;
      seg.weight_decay = t.weight_decay ? weight_decay : 0.0f;
      seg.rng_offset = static_cast<uint64_t>(global + a);
      opt_segs_.push_back(seg);
    }
    if (blk.off > 0) {
      const int64_t hlo = blk.shard.begin, hhi = std::min(blk.shard.begin + blk.off, blk.shard.end);
      const int64_t b0 = blk.shard.begin;
      float* h_master = blk.h_master.as<float>() - b0;
      char* h_param = e_.mixed() ? static_cast<char*>(blk.h_work.data()) - b0 * w : reinterpret_cast<char*>(h_master);
      for (const ParamTensor& t : L.block(static_cast<int>(b)).tensors) {
        const int64_t a = std::max(hlo, t.offset), e = std::min(hhi, t.offset + t.numel);
        if (a >= e) continue;
        optim::OptimizerSegment seg;
        seg.param = h_param + a * w;
        seg.grad = static_cast<const char*>(blk.h_grad.data()) + (a - b0) * w;
        seg.master = h_master + a;
        seg.m = blk.h_m.as<float>() - b0 + a;
        seg.v = blk.h_v.data() ? blk.h_v.as<float>() - b0 + a : nullptr;
        seg.n = e - a;
        seg.weight_decay = t.weight_decay ? weight_decay : 0.0f;
        seg.rng_offset = static_cast<uint64_t>(global + a);
        host_segs_.push_back(seg);
      }
    }
    global += blk.numel;
  }
  const size_t ob = std::max<size_t>(1, opt_segs_.size()) * sizeof(optim::OptimizerSegment);
  const size_t gb = std::max<size_t>(1, grad_segs_.size()) * sizeof(optim::GradSegment);
  if (opt_segs_dev_.size() != ob) opt_segs_dev_ = DeviceBuffer(d_.memory(), ob, compute_, "optimizer lists");
  if (grad_segs_dev_.size() != gb) grad_segs_dev_ = DeviceBuffer(d_.memory(), gb, compute_, "optimizer lists");
  // The host vectors stay alive (members) until the copies ran.
  compute_.copy(opt_segs_dev_.data(), opt_segs_.data(), opt_segs_.size() * sizeof(optim::OptimizerSegment));
  compute_.copy(grad_segs_dev_.data(), grad_segs_.data(), grad_segs_.size() * sizeof(optim::GradSegment));
  segs_weight_decay_ = weight_decay;
}

void ZeroRank::check_gradients(float* device_out) {
  const NvtxRange range(NvtxCategory::kLossScale, "unscale + overflow check", idx());
  record_comm_and_wait(compute_);  // the reductions and accumulations ran on the comm stream
  if (segs_weight_decay_ < 0) build_segments(0.0f);
  const float* inv =
      e_.opt.scaling == ZeroOptions::Scaling::kNone ? nullptr : &scaler.as<optim::LossScaleState>()->inv_scale;
  optim::unscale_check(compute_, {grad_segs_, grad_segs_dev_.as<optim::GradSegment>()}, e_.opt.working, inv,
                       device_out, 2 * static_cast<int>(blocks.size()), flags.as<float>());
  // Every rank of the mesh (every tensor coordinate too) must skip together: sum the flags over
  // all ranks, on the devices.
  if (e_.opt.processes)
    e_.opt.processes->all_reduce(r_, f32(flags.as<float>(), e_.world(), idx()), &compute_);
  else
    e_.comm.all_reduce(r_, f32(flags.as<float>(), e_.world(), idx()), &compute_, "overflow flag");
  record_comm_and_wait(compute_);
}

void ZeroRank::optimizer_step(const OptimizerStep& st) {
  const DType W = e_.opt.working;
  const ParamLayout& L = e_.model.layout();
  const NvtxRange range(NvtxCategory::kOptimizer, "optimizer", idx());
  record_comm_and_wait(compute_);
  if (policy_.gathers_grads_before_step()) {
    // Plain data parallelism: finish the all-reduce (reduce-scatter + all-gather) so that every
    // rank holds the full reduced gradient, then every rank updates everything.
    for (size_t b = 0; b < blocks.size(); ++b) {
      auto& blk = blocks[b];
      void* acc = accumulator(blk);
      void* region = at(blk.full_grad_bucket.data(), W, blk.shard.begin);
      if (acc != region) compute_.copy(region, acc, bytes_of(blk.shard.shard_numel, W));
      data_all_gather(typed(blk.full_grad_bucket.data(), W, blk.shard.padded_numel, idx()), &compute_,
                       L.block(static_cast<int>(b)).name);
    }
    record_comm_and_wait(compute_);
  }
  if (segs_weight_decay_ != st.weight_decay) build_segments(st.weight_decay);

  const bool scaled = e_.opt.scaling != ZeroOptions::Scaling::kNone;
  auto* sc_state = scaler.as<optim::LossScaleState>();
  optim::StepScalars sc;
  sc.inv_loss_scale = scaled ? &sc_state->inv_scale : nullptr;
  sc.found_inf = flags.as<float>();
  sc.clip = st.grad_scale;
  sc.rounding = e_.opt.rounding;
  sc.seed = e_.opt.seed;
  if (st.step_on_device) sc.update_count = update_count_device();
  const optim::SegmentList<optim::OptimizerSegment> segs{opt_segs_, opt_segs_dev_.as<optim::OptimizerSegment>()};
  if (arena_) offload_step(st, sc);
  if (st.adamw)
    optim::adamw_multi(compute_, segs, W, W, optim::AdamWConfig{st.lr, st.beta1, st.beta2, st.eps, st.step}, sc);
  else
    optim::sgd_multi(compute_, segs, W, W, optim::SgdConfig{st.lr, st.momentum, false, st.step}, sc);
  if (e_.opt.scaling == ZeroOptions::Scaling::kDynamic) {
    const NvtxRange scale_range(NvtxCategory::kLossScale, "loss scale update", idx());
    optim::loss_scale_update(compute_, sc_state, flags.as<float>(), e_.opt.scale_config);
  }
  if (policy_.gathers_params_after_step()) {
    for (size_t b = 0; b < blocks.size(); ++b)
      data_all_gather(typed(blocks[b].params.data(), W, blocks[b].shard.padded_numel, idx()), &compute_,
                       L.block(static_cast<int>(b)).name);
  }
}

// Offload: the host part of the update (see engine.h). Enqueued before the device update of the
// rest so that its scalar copies read the flag and scale before anything changes them.
void ZeroRank::offload_step(const OptimizerStep& st, const optim::StepScalars& sc) {
  const DType W = e_.opt.working;
  // A gradient changed after its copy (poke_gradient) or a step with fewer micro-batches than
  // configured: copy what is not on the host yet (compute already waits for comm).
  for (auto& blk : blocks) {
    const int64_t nh = host_count(blk);
    if (nh > 0 && !blk.grad_on_host) compute_.copy(blk.h_grad.data(), accumulator(blk), bytes_of(nh, W));
    blk.grad_on_host = false;
  }
  float* hs = host_scalars_.as<float>();
  compute_.copy(hs, flags.data(), sizeof(float));
  if (sc.inv_loss_scale) compute_.copy(hs + 1, sc.inv_loss_scale, sizeof(float));
  if (sc.clip) compute_.copy(hs + 2, sc.clip, sizeof(float));
  // The count before the device update (enqueued after this) adds to it; the host update counts its copy.
  if (sc.update_count) compute_.copy(hs + 3, sc.update_count, sizeof(uint32_t));
  optim::StepScalars hsc = sc;
  hsc.found_inf = hs;
  hsc.inv_loss_scale = sc.inv_loss_scale ? hs + 1 : nullptr;
  hsc.clip = sc.clip ? hs + 2 : nullptr;
  hsc.update_count = sc.update_count ? reinterpret_cast<uint32_t*>(hs + 3) : nullptr;
  std::shared_ptr<SpanStart> start = e_.tracing ? e_.open_span(compute_, issued_++) : nullptr;
  // The compute stream waits for this function: its duration is the optimizer time the device
  // cannot hide (the clip factor and the flag exist only after the whole backward).
  compute_.host_func([this, st, hsc, W] {
    const NvtxRange range(NvtxCategory::kOptimizer, "host optimizer", idx());
    const auto t0 = std::chrono::steady_clock::now();
    if (st.adamw)
      optim::adamw_host(host_segs_, W, W, optim::AdamWConfig{st.lr, st.beta1, st.beta2, st.eps, st.step}, hsc);
    else
      optim::sgd_host(host_segs_, W, W, optim::SgdConfig{st.lr, st.momentum, false, st.step}, hsc);
    host_seconds_.store(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  });
  if (start) e_.close_span(compute_, start, TraceSpan::kHostOptimizer, r_, -1);
  for (auto& blk : blocks) {
    const int64_t nh = host_count(blk);
    if (nh <= 0) continue;
    const void* src = e_.mixed() ? blk.h_work.data() : blk.h_master.data();
    compute_.copy(at(blk.params.data(), W, param_offset(blk)), src, bytes_of(nh, W));
  }
}

void ZeroRank::refresh_host_working(Block& blk) {
  const int64_t nh = host_count(blk);
  if (!e_.mixed() || nh <= 0) return;
  compute_.copy(blk.h_work.data(), at(blk.params.data(), e_.opt.working, param_offset(blk)), bytes_of(nh, e_.opt.working));
}

// ---------------------------------------------------------------------------------------------
// ZeroRank: host transfers (checkpoints, tests, recovery; not the hot path).

void ZeroRank::load_parameters(const std::vector<std::vector<float>>& host) {
  const DType W = e_.opt.working;
  Stream& s = compute_;
  if (arena_) s.synchronize();  // the host buffers are written below, on this thread
  for (size_t b = 0; b < blocks.size(); ++b) {
    auto& blk = blocks[b];
    ZT_CHECK(static_cast<int64_t>(host[b].size()) == blk.numel, "block ", b, " has ", host[b].size(),
             " values, expected ", blk.numel);
    // fp32 values of what this rank keeps: the whole (padded) block, or its shard (sharded
    // parameters; and the master of sharded optimizer state).
    const int64_t lo = blk.shard.begin, sn = blk.shard.shard_numel, pn = blk.shard.padded_numel;
    DeviceBuffer full(d_.memory(), bytes_of(pn), s, "load staging");
    ops::fill(s, f32(full.as<float>(), pn, idx()), 0.0f);
    s.copy(full.data(), host[b].data(), host[b].size() * 4);
    if (policy_.shard_params)
      ops::cast(s, typed(blk.params.data(), W, sn, idx()), f32(full.as<float>() + lo, sn, idx()));
    else
      ops::cast(s, typed(blk.params.data(), W, pn, idx()), f32(full.as<float>(), pn, idx()));
    if (blk.master.data()) {
      if (!policy_.shard_optimizer)
        s.copy(blk.master.data(), full.data(), blk.master.size());
      else
        s.copy(blk.master.data(), full.as<float>() + lo + blk.off, bytes_of(sn - blk.off));
    }
    d_.memory().record_stream(full.data(), s);
    for (DeviceBuffer* z : {&blk.full_grad_bucket, &blk.grad_shard_accum, &blk.m, &blk.v})
      if (z->data()) s.memset(z->data(), 0, z->size());  // +0 in every dtype
    if (blk.off > 0) {
      for (HostBuffer* z : {&blk.h_master, &blk.h_m, &blk.h_v, &blk.h_grad, &blk.h_work})
        if (z->data()) std::memset(z->data(), 0, z->size());
      std::memcpy(blk.h_master.data(), host[b].data() + lo, bytes_of(host_count(blk)));
      refresh_host_working(blk);
    }
  }
  reset_scaler();  // synchronizes: the host vectors may go away
}

std::vector<float> ZeroRank::moments_to_host(int b) {
  Block& blk = block(b);
  d_.synchronize();
  const int64_t n = blk.shard.size();
  const int64_t off = policy_.shard_optimizer ? 0 : blk.shard.begin;
  const bool adamw = !e_.opt.sgd;
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(n, 0)) * (adamw ? 2 : 1));
  const int64_t nh = host_count(blk);  // offloaded: [0, nh) on the host, the rest on the device
  if (nh > 0) {
    std::memcpy(out.data(), blk.h_m.data(), bytes_of(nh));
    if (adamw) std::memcpy(out.data() + n, blk.h_v.data(), bytes_of(nh));
  }
  to_host(staging_, compute_, out.data() + nh, blk.m.as<float>() + off, n - nh);
  if (adamw) to_host(staging_, compute_, out.data() + n + nh, blk.v.as<float>() + off, n - nh);
  return out;
}

void ZeroRank::state_to_host(int b, float* master, float* m, float* v, void* working) {
  record_comm_and_wait(compute_);
  Block& blk = block(b);
  const DType W = e_.opt.working;
  const int64_t n = blk.shard.size();
  if (n == 0) return;
  const int64_t off = policy_.shard_optimizer ? 0 : blk.shard.begin;  // in the state buffers
  const int64_t poff = policy_.shard_params ? 0 : blk.shard.begin;    // in the parameter buffer
  // Offloaded: shard elements [0, nh) are on the host (after the stream's last host update).
  const int64_t nh = host_count(blk);
  if (nh > 0) {
    compute_.synchronize();
    std::memcpy(master, blk.h_master.data(), bytes_of(nh));
    std::memcpy(m, blk.h_m.data(), bytes_of(nh));
    if (v && blk.h_v.data()) std::memcpy(v, blk.h_v.data(), bytes_of(nh));
  }
  const size_t fb = bytes_of(n - nh);
  if (fb > 0) {
    if (e_.mixed())
      staging_.to_host(compute_, master + nh, blk.master.as<float>() + off, fb);
    else
      staging_.to_host(compute_, master + nh, blk.params.as<float>() + poff + nh, fb);
    staging_.to_host(compute_, m + nh, blk.m.as<float>() + off, fb);
    if (v && !e_.opt.sgd) staging_.to_host(compute_, v + nh, blk.v.as<float>() + off, fb);
  }
  if (working && e_.mixed()) staging_.to_host(compute_, working, at(blk.params.data(), W, poff), bytes_of(n, W));
  compute_.synchronize();
}

void ZeroRank::load_state(int b, const float* master_full, const float* m, const float* v, const void* working_full) {
  Stream& s = compute_;
  record_comm_and_wait(s);
  Block& blk = block(b);
  const DType W = e_.opt.working;
  const auto w = static_cast<int64_t>(dtype_size(W));
  const int64_t lo = policy_.shard_optimizer ? blk.shard.begin : 0;
  const int64_t n = (policy_.shard_optimizer ? blk.shard.end : blk.numel) - lo;
  // Padding stays zero (+0 in every dtype).
  for (DeviceBuffer* z : {&blk.params, &blk.master, &blk.m, &blk.v, &blk.full_grad_bucket, &blk.grad_shard_accum})
    if (z->data()) s.memset(z->data(), 0, z->size());
  // Parameters: the whole block, or the shard when parameters are sharded.
  const int64_t plo = policy_.shard_params ? blk.shard.begin : 0, phi = policy_.shard_params ? blk.shard.end : blk.numel;
  if (phi > plo) {
    if (working_full && e_.mixed()) {
      staging_.to_device(s, blk.params.data(), static_cast<const char*>(working_full) + plo * w,
                         static_cast<size_t>((phi - plo) * w));
    } else if (!e_.mixed()) {
      staging_.to_device(s, blk.params.data(), master_full + plo, bytes_of(phi - plo));
    } else {
      DeviceBuffer tmp(d_.memory(), bytes_of(phi - plo), s, "load staging");
      staging_.to_device(s, tmp.data(), master_full + plo, bytes_of(phi - plo));
      ops::cast(s, typed(blk.params.data(), W, phi - plo, idx()), f32(tmp.as<float>(), phi - plo, idx()));
      d_.memory().record_stream(tmp.data(), s);
    }
  }
  ZT_CHECK(e_.opt.sgd || n <= 0 || v != nullptr, "load_state: AdamW needs the second moment");
  // Offloaded: state elements [0, nh) go to the host buffers, the rest to the device.
  const int64_t nh = std::min(host_count(blk), std::max<int64_t>(n, 0));
  if (blk.off > 0) {
    s.synchronize();  // the last host update has finished with the host buffers
    for (HostBuffer* z : {&blk.h_master, &blk.h_m, &blk.h_v, &blk.h_grad, &blk.h_work})
      if (z->data()) std::memset(z->data(), 0, z->size());
    if (nh > 0) {  // (a rank may hold no real element of a small block)
      std::memcpy(blk.h_master.data(), master_full + lo, bytes_of(nh));
      std::memcpy(blk.h_m.data(), m, bytes_of(nh));
      if (!e_.opt.sgd) std::memcpy(blk.h_v.data(), v, bytes_of(nh));
    }
  }
  if (n > nh) {
    if (e_.mixed()) staging_.to_device(s, blk.master.data(), master_full + lo + nh, bytes_of(n - nh));
    staging_.to_device(s, blk.m.data(), m + nh, bytes_of(n - nh));
    if (!e_.opt.sgd) staging_.to_device(s, blk.v.data(), v + nh, bytes_of(n - nh));
  }
  refresh_host_working(blk);
  s.synchronize();
}

void ZeroRank::poke_gradient(int b, int64_t offset, float value) {
  Block& blk = block(b);
  ZT_CHECK(offset >= 0 && offset < blk.shard.size(), "poke_gradient: offset ", offset, " outside the shard");
  record_comm_and_wait(compute_);
  const DType W = e_.opt.working;
  uint32_t bits = 0;
  if (W == DType::kF32) std::memcpy(&bits, &value, 4);
  else if (W == DType::kBF16) bits = float_to_bf16_bits(value);
  else bits = float_to_half_bits(value);
  compute_.copy(at(accumulator(blk), W, offset), &bits, dtype_size(W));  // little-endian: the low bytes
  blk.grad_on_host = false;  // offload: copy the changed gradient again
  compute_.synchronize();  // `bits` lives on this frame
}

std::vector<float> ZeroRank::gradient_shard_to_host(int b) {
  Block& blk = block(b);
  const int64_t n = blk.shard.size();
  std::vector<float> g(static_cast<size_t>(std::max<int64_t>(n, 0)));
  if (n == 0) return g;
  DeviceBuffer tmp(d_.memory(), bytes_of(n), compute_, "host staging");
  ops::cast(compute_, f32(tmp.as<float>(), n, idx()), typed(accumulator(blk), e_.opt.working, n, idx()));
  to_host(staging_, compute_, g.data(), tmp.data(), n);
  return g;
}

void ZeroRank::reallocate_working(const ZeroOptions& o) {
  const DType working = o.working;
  for (auto& blk : blocks) {
    blk.sizes = e_.block_sizes(blk.numel, o);
    // The working-dtype resident buffers, in the constructor's order.
    for (const ResidentBuffer& rb : resident_buffers(blk.sizes, policy_)) {
      if (rb.role != BufferRole::kParams && rb.role != BufferRole::kFullGradBucket && rb.role != BufferRole::kGradShardAccum)
        continue;
      blk.buffer(rb.role).reset();
      allocate(blk, rb.role, rb.bytes, compute_, buffer_role_label(rb.role));
    }
    for (DeviceBuffer* z : {&blk.full_grad_bucket, &blk.grad_shard_accum})
      if (z->data()) compute_.memset(z->data(), 0, z->size());
    // The new parameters are the master rounded to the new dtype (parameters kept in full with
    // sharded optimizer state: this rank's shard, then the all-gather in set_working_dtype).
    const int64_t n = policy_.shard_optimizer ? blk.shard.shard_numel : blk.shard.padded_numel;
    void* dst = policy_.gathers_params_after_step() ? at(blk.params.data(), working, blk.shard.begin) : blk.params.data();
    // Offloaded: the first `off` elements' master is on the host.
    if (blk.off > 0) {
      DeviceBuffer tmp(d_.memory(), bytes_of(blk.off), compute_, "load staging");
      compute_.copy(tmp.data(), blk.h_master.data(), bytes_of(blk.off));
      ops::cast(compute_, typed(dst, working, blk.off, idx()), f32(tmp.as<float>(), blk.off, idx()));
    }
    if (n > blk.off)
      ops::cast(compute_, typed(at(dst, working, blk.off), working, n - blk.off, idx()),
                f32(blk.master.as<float>(), n - blk.off, idx()));
    refresh_host_working(blk);
  }
  segs_weight_decay_ = -1;  // buffers moved: rebuild the multi-tensor lists
}

ModelStateBytes ZeroRank::model_state_bytes() const {
  ModelStateBytes m;
  for (const auto& blk : blocks)
    for (const ResidentBuffer& rb : resident_buffers(blk.sizes, policy_))
      *state_slot(m, rb.role) += blk.buffer(rb.role).size();
  return m;
}

// ---------------------------------------------------------------------------------------------
// ZeroEngine: per-rank calls go to that rank's ZeroRank; the rest spans ranks.

ZeroEngine::ZeroEngine(const Model& model, std::vector<Device*> devices, Communicator& comm, const ZeroOptions& opt)
    : impl_(std::make_unique<Impl>(model, std::move(devices), comm, opt)) {}

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
int ZeroEngine::stage() const { return impl_->opt.stage; }
const ShardingPolicy& ZeroEngine::policy() const { return impl_->policy; }
ParamAccess& ZeroEngine::access(int rank) { return impl_->rank(rank); }
DType ZeroEngine::working_dtype() const { return impl_->opt.working; }

void ZeroEngine::load_parameters(int rank, const std::vector<std::vector<float>>& host) {
  impl_->rank(rank).load_parameters(host);
}
std::vector<float> ZeroEngine::moments_to_host(int rank, int block) { return impl_->rank(rank).moments_to_host(block); }
void ZeroEngine::begin_micro_batch(int rank, int micro_index, bool forward_only) {
  impl_->rank(rank).begin_micro(micro_index, forward_only);
}
void ZeroEngine::end_micro_batch(int rank) { impl_->rank(rank).end_micro(); }
void ZeroEngine::begin_pipeline_step(int rank, bool forward_only) {
  ZT_CHECK(impl_->opt.pipeline, "begin_pipeline_step on an engine that is not a pipeline stage's");
  impl_->rank(rank).begin_pipeline_step(forward_only);
}
void ZeroEngine::reduce_pipeline_gradients(int rank, const GradientHook& before_reduce) {
  ZT_CHECK(impl_->opt.pipeline, "reduce_pipeline_gradients on an engine that is not a pipeline stage's");
  impl_->rank(rank).reduce_pipeline_gradients(before_reduce);
}
void ZeroEngine::check_gradients(int rank, float* device_out) { impl_->rank(rank).check_gradients(device_out); }
void ZeroEngine::optimizer_step(int rank, const OptimizerStep& s) { impl_->rank(rank).optimizer_step(s); }
void ZeroEngine::mark_overflow(int rank) { impl_->rank(rank).mark_overflow(); }
void ZeroEngine::poke_gradient(int rank, int block, int64_t offset, float value) {
  impl_->rank(rank).poke_gradient(block, offset, value);
}
void ZeroEngine::set_loss_scale_state(int rank, const optim::LossScaleState& st) {
  impl_->rank(rank).set_loss_scale_state(st);
}
optim::LossScaleState ZeroEngine::loss_scale_state(int rank) { return impl_->rank(rank).loss_scale_state(); }
void ZeroEngine::set_update_count(int rank, int64_t updates) { impl_->rank(rank).set_update_count(updates); }
int64_t ZeroEngine::update_count(int rank) { return impl_->rank(rank).update_count(); }
ModelStateBytes ZeroEngine::model_state_bytes(int rank) const { return impl_->rank(rank).model_state_bytes(); }
size_t ZeroEngine::host_peak_bytes(int rank) const { return impl_->rank(rank).host_peak_bytes(); }
size_t ZeroEngine::host_staging_bytes(int rank) const { return impl_->rank(rank).host_staging_bytes(); }
double ZeroEngine::host_update_seconds(int rank) const { return impl_->rank(rank).host_update_seconds(); }
void ZeroEngine::state_to_host(int rank, int block, float* master, float* m, float* v, void* working) {
  impl_->rank(rank).state_to_host(block, master, m, v, working);
}
void ZeroEngine::load_state(int rank, int block, const float* master_full, const float* m, const float* v,
                            const void* working_full) {
  impl_->rank(rank).load_state(block, master_full, m, v, working_full);
}

const float* ZeroEngine::loss_scale_device(int rank) const {
  if (impl_->opt.scaling == ZeroOptions::Scaling::kNone) return nullptr;
  return &impl_->rank(rank).scaler.as<optim::LossScaleState>()->scale;
}
const float* ZeroEngine::found_inf_device(int rank) const { return impl_->rank(rank).flags.as<float>(); }
float* ZeroEngine::overflow_flag_device(int rank) { return impl_->rank(rank).flags.as<float>(); }
const optim::LossScaleState* ZeroEngine::loss_scale_state_device(int rank) const {
  return impl_->rank(rank).scaler.as<optim::LossScaleState>();
}

ShardRange ZeroEngine::shard_of(int rank, int block) const { return impl_->rank(rank).block(block).shard; }

std::pair<int64_t, int64_t> ZeroEngine::state_range(int rank, int block) const {
  const ShardRange sh = shard_of(rank, block);
  if (!impl_->policy.shard_optimizer) return {0, impl_->rank(0).block(block).numel};
  return {sh.begin, sh.end};
}

std::vector<float> ZeroEngine::block_to_host(int block, int tensor) {
  impl_->require_one_process("block_to_host");
  const std::vector<int> ranks = impl_->tensor_ranks(tensor);
  for (Device* d : impl_->devices) d->synchronize();
  const DType W = impl_->opt.working;
  std::vector<float> out(static_cast<size_t>(impl_->rank(0).block(block).numel));
  // Widen the working dtype on each device into a staging buffer, then copy.
  auto fetch = [&](int r, int64_t n, int64_t at_out) {
    if (n <= 0) return;
    ZeroRank& R = impl_->rank(r);
    Stream& s = R.compute_stream();
    const int idx = R.device().index();
    DeviceBuffer tmp(R.device().memory(), bytes_of(n), s, "host staging");
    ops::cast(s, f32(tmp.as<float>(), n, idx), typed(R.block(block).params.data(), W, n, idx));
    to_host(R.staging(), s, out.data() + at_out, tmp.data(), n);
  };
  if (!impl_->policy.shard_params) {
    fetch(ranks[0], static_cast<int64_t>(out.size()), 0);
    return out;
  }
  for (int r : ranks) {
    const ShardRange& sh = impl_->rank(r).block(block).shard;
    fetch(r, sh.size(), sh.begin);
  }
  return out;
}

std::vector<float> ZeroEngine::master_to_host(int block, int tensor) {
  impl_->require_one_process("master_to_host");
  if (!impl_->mixed()) return block_to_host(block, tensor);
  const std::vector<int> ranks = impl_->tensor_ranks(tensor);
  for (Device* d : impl_->devices) d->synchronize();
  const Block& b0 = impl_->rank(ranks[0]).block(block);
  std::vector<float> out(static_cast<size_t>(b0.numel));
  if (!impl_->policy.shard_optimizer) {
    to_host(impl_->rank(ranks[0]).staging(), impl_->rank(ranks[0]).compute_stream(), out.data(), b0.master.data(), b0.numel);
    return out;
  }
  for (int r : ranks) {
    const Block& blk = impl_->rank(r).block(block);
    const int64_t n = blk.shard.size(), nh = std::min(blk.off, std::max<int64_t>(n, 0));  // offloaded: [0, nh) on the host
    if (nh > 0) std::memcpy(out.data() + blk.shard.begin, blk.h_master.data(), bytes_of(nh));
    to_host(impl_->rank(r).staging(), impl_->rank(r).compute_stream(), out.data() + blk.shard.begin + nh, blk.master.data(),
            n - nh);
  }
  return out;
}

std::string ZeroEngine::first_nonfinite_gradient() {
  impl_->require_one_process("naming the first non-finite gradient");
  const ParamLayout& L = impl_->model.layout();
  std::string first;
  int64_t first_key = -1;  // (block, tensor) order
  for (int r = 0; r < world(); ++r) {
    ZeroRank& R = impl_->rank(r);
    R.record_comm_and_wait(R.compute_stream());
    for (int b = 0; b < static_cast<int>(R.blocks.size()); ++b) {
      const ShardRange sh = R.block(b).shard;
      if (sh.size() == 0) continue;
      const std::vector<float> g = R.gradient_shard_to_host(b);
      const auto& tensors = L.block(b).tensors;
      for (size_t t = 0; t < tensors.size(); ++t) {
        const int64_t key = static_cast<int64_t>(b) * 100000 + static_cast<int64_t>(t);
        if (first_key >= 0 && key >= first_key) break;
        const int64_t a = std::max(sh.begin, tensors[t].offset);
        const int64_t e = std::min(sh.end, tensors[t].offset + tensors[t].numel);
        for (int64_t i = a; i < e; ++i)
          if (!std::isfinite(g[static_cast<size_t>(i - sh.begin)])) {
            first_key = key;
            first = tensors[t].name;
            break;
          }
      }
    }
  }
  return first;
}

void ZeroEngine::set_working_dtype(DType working) {
  impl_->require_one_process("switching the working dtype");
  ZT_REQUIRE(impl_->mixed() && (working == DType::kBF16 || working == DType::kF16),
             "switching the working dtype needs fp32 master weights (mixed precision on both sides)");
  const int N = world();
  for (Device* d : impl_->devices) d->synchronize();
  ZeroOptions o = impl_->opt;
  o.working = working;
  for (int r = 0; r < N; ++r) impl_->rank(r).reallocate_working(o);
  impl_->opt.working = working;
  impl_->opt.scaling = ZeroOptions::Scaling::kNone;
  if (impl_->policy.gathers_params_after_step()) {
    const std::vector<std::vector<int>> groups = impl_->mesh.groups(MeshAxis::kData);
    for (size_t b = 0; b < impl_->rank(0).blocks.size(); ++b) {
      for (const std::vector<int>& members : groups) {
        std::vector<TensorView> full;  // indexed by position in the data group
        std::vector<Stream*> producers;
        for (int r : members) {
          ZeroRank& R = impl_->rank(r);
          const Block& blk = R.blocks[b];
          full.push_back(typed(blk.params.data(), working, blk.shard.padded_numel, R.device().index()));
          producers.push_back(&R.compute_stream());
        }
        impl_->comm.group(members).all_gather(full, producers);
      }
    }
  }
  for (int r = 0; r < N; ++r) {
    impl_->comm.wait_done(r, impl_->rank(r).compute_stream());
    impl_->rank(r).reset_scaler();
  }
}

BlockBufferBytes ZeroEngine::block_buffer_bytes(int64_t numel, int world, const ZeroOptions& opt, DType activations) {
  return zt::block_buffer_bytes(numel, world, opt, activations);
}

namespace {

// The longest rank's optimizer list (one segment per tensor piece in the rank's state range), so
// the plan sizes the device copy of the lists as build_segments does. A tensor spans a contiguous
// run of ranks' shards: counted with a difference array over ranks, O(tensors + world).
size_t planned_optimizer_segments(const ParamLayout& L, int world, const ShardingPolicy& p, size_t* work) {
  // `world`: the ranks the blocks are sharded over (the data group).
  std::vector<int64_t> diff(static_cast<size_t>(world) + 1, 0);
  for (int b = 0; b < L.num_blocks(); ++b) {
    const int64_t shard = shard_range(L.block(b).numel, 0, world).shard_numel;
    for (const ParamTensor& t : L.block(b).tensors) {
      if (t.numel <= 0) continue;
      const int64_t first = p.shard_optimizer ? t.offset / shard : 0;
      const int64_t last = p.shard_optimizer ? (t.offset + t.numel - 1) / shard : world - 1;
      ++diff[static_cast<size_t>(first)];
      --diff[static_cast<size_t>(last) + 1];
    }
    *work += 1 + L.block(b).tensors.size();
  }
  int64_t most = 0, run = 0;
  for (int r = 0; r < world; ++r) most = std::max(most, run += diff[static_cast<size_t>(r)]);
  *work += static_cast<size_t>(world);
  return static_cast<size_t>(most);
}

}  // namespace

EngineMemoryPlan ZeroEngine::plan_memory(const Model& model, int world, const ZeroOptions& opt) {
  const ShardingPolicy p = policy_for_stage(opt.stage);
  const ParamLayout& L = model.layout();
  EngineMemoryPlan plan;
  std::vector<BlockBufferBytes> sizes;
  for (int b = 0; b < L.num_blocks(); ++b) {
    sizes.push_back(zt::block_buffer_bytes(L.block(b).numel, world, opt, model.activation_dtype()));
    for (const ResidentBuffer& rb : resident_buffers(sizes.back(), p)) {
      plan.resident.push_back(rb.bytes);
      *state_slot(plan.state, rb.role) += rb.bytes;
    }
    plan.host += sizes.back().host;
  }
  if (opt.offload) plan.host += kOffloadScalarBytes;
  plan.work += static_cast<size_t>(L.num_blocks());
  // Per rank: the loss-scale state, the overflow flags, and the multi-tensor lists.
  const size_t opt_segs = planned_optimizer_segments(L, data_parallel_size(world, opt), p, &plan.work);
  plan.resident.push_back(kScalerBytes);
  plan.resident.push_back(static_cast<size_t>(world) * sizeof(float));
  plan.resident.push_back(std::max<size_t>(1, opt_segs) * sizeof(optim::OptimizerSegment));
  plan.resident.push_back(static_cast<size_t>(std::max(1, L.num_blocks())) * sizeof(optim::GradSegment));
  // The transient peaks: the very lists the hooks execute for a training micro-batch and for a
  // forward-only pass.
  const bool mixed = opt.working != DType::kF32, widen = widens_params(opt.working, model.activation_dtype());
  if (opt.pipeline) {
    // A pipeline stage's step (begin_pipeline_step): per block, in layout order, the fp32 compute
    // copy (mixed, fp32 model), the full gradient bucket when not resident (stage 2), the fp32
    // compute gradient (mixed), all live until the step's reduction; an evaluation's forwards hold
    // the copies only.
    for (const BlockBufferBytes& sz : sizes) {
      if (widen) plan.train_peak.push_back({sz[BufferRole::kComputeParams], false});
      if (p.shard_grads) plan.train_peak.push_back({sz[BufferRole::kFullGradBucket], false});
      if (mixed) plan.train_peak.push_back({sz[BufferRole::kComputeGrad], false});
      if (widen) plan.forward_peak.push_back({sz[BufferRole::kComputeParams], false});
    }
    plan.work += sizes.size();
    return plan;
  }
  const auto fwd = model.forward_order(), bwd = model.backward_order();
  size_t arena = 0;  // as Impl::make_plans sizes it
  for (bool forward_only : {false, true}) {
    const VisitPlan vp = make_visit_plan(fwd, bwd, sizes, p, mixed, widen, forward_only);
    arena = std::max(arena, vp.arena_bytes);
    plan.work += vp.work;
  }
  if (arena > 0) plan.train_peak = plan.forward_peak = {PlannedBuffer{arena, false, true}};
  return plan;
}

ModelStateBytes ZeroEngine::planned_model_state_bytes(const Model& model, int world, const ZeroOptions& opt) {
  return plan_memory(model, world, opt).state;
}

size_t ZeroEngine::transient_arena_bytes() const { return impl_->arena_bytes; }

void ZeroEngine::set_tracing(bool on) { impl_->tracing = on; }

std::chrono::steady_clock::time_point ZeroEngine::trace_origin() const { return impl_->t0; }

std::vector<TraceSpan> ZeroEngine::take_trace() {
  for (Device* d : impl_->devices) d->synchronize();
  std::lock_guard<std::mutex> lock(impl_->trace_mu);
  return std::move(impl_->spans);
}

}  // namespace zt
