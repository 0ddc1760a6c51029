// ZeRO stages 0-3 over per-block flat buffers. See engine.h for the memory each stage keeps and
// why every stage computes the same bits.
//
// Invariants:
//  - Collectives are issued from after_backward / before_* hooks and optimizer_step in the same
//    order on every rank (the model's block order), so the per-rank rendezvous always pairs up.
//  - Everything a collective reads was written on the compute stream; the Communicator makes the
//    comm stream wait for it (producer = compute). Everything compute reads that comm wrote is
//    guarded by an event recorded on the comm stream right after the collective was enqueued.
//  - Transient buffers (stage 2/3 gradient buckets, stage 3 gathered blocks) are freed with
//    record_stream on every stream that touched them, so the pool never hands them out early.
#include "zero/engine.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>
#include <mutex>

#include "core/nvtx.h"
#include "optimizers/optimizers.h"
#include "core/status.h"
#include "kernels/ops.h"

namespace zt {

namespace {

TensorView f32(float* p, int64_t n, int device) { return TensorView{p, DType::kF32, Shape{n}, device}; }
TensorView typed(void* p, DType t, int64_t n, int device) { return TensorView{p, t, Shape{n}, device}; }
// Element i of a buffer of dtype t.
void* at(void* base, DType t, int64_t i) { return static_cast<char*>(base) + i * static_cast<int64_t>(dtype_size(t)); }

struct Visit {
  int block;
  bool backward;
  bool keep;  // stage 3: keep the gathered block after this visit (used again in this forward)
};

// Visit schedule: forward then backward; a block seen again later in the forward (a tied
// embedding) stays gathered until then, and the forward's last block is the backward's first.
std::vector<Visit> make_schedule(const Model& model, size_t* forward_visits) {
  std::vector<Visit> schedule;
  const auto fwd = model.forward_order(), bwd = model.backward_order();
  for (size_t i = 0; i < fwd.size(); ++i) {
    bool keep = std::find(fwd.begin() + static_cast<long>(i) + 1, fwd.end(), fwd[i]) != fwd.end();
    schedule.push_back({fwd[i], false, keep});
  }
  *forward_visits = schedule.size();
  for (int b : bwd) schedule.push_back({b, true, false});
  return schedule;
}

}  // namespace

struct ZeroEngine::Impl {
  struct Block {
    ShardRange shard;
    int64_t numel = 0;
    BlockBufferBytes sizes;  // what each buffer below takes (block_buffer_bytes)
    DeviceBuffer params;    // working dtype; stages 0-2: full (padded); stage 3: this rank's shard
    DeviceBuffer grads;     // working dtype; stages 0-1: full (padded) gradient bucket; stages 2-3: shard accumulator
    DeviceBuffer acc;       // working dtype; stages 0-1 with accumulation: shard accumulator
    DeviceBuffer master;    // mixed precision: fp32 master, stage 0 full (padded), else shard
    DeviceBuffer m, v;      // fp32; stage 0: full (padded); stages 1-3: shard
    DeviceBuffer bucket;    // stages 2-3: transient full gradient of the running micro-batch
    DeviceBuffer gathered;  // stage 3: transient full parameters
    DeviceBuffer compute;   // mixed precision: transient fp32 parameters of the running block
    DeviceBuffer compute_grad;  // mixed precision: transient fp32 gradient during the block's backward
    std::unique_ptr<Event> gathered_ready;
  };

  class Rank final : public ParamAccess {
   public:
    Rank(Impl& e, int r, Device& d) : e_(e), r_(r), d_(d) {}
    int device_index() const override { return d_.index(); }
    float* params(int b) override {
      Block& blk = block(b);
      if (e_.mixed()) {
        ZT_CHECK(blk.compute.data(), "block ", b, " used outside its visit");
        return blk.compute.as<float>();
      }
      if (e_.opt.stage == 3) {
        ZT_CHECK(blk.gathered.data(), "block ", b, " used before it was gathered");
        return blk.gathered.as<float>();
      }
      return blk.params.as<float>();
    }
    float* grads(int b) override {
      Block& blk = block(b);
      if (e_.mixed()) {
        ZT_CHECK(blk.compute_grad.data(), "gradient of block ", b, " used outside its backward");
        return blk.compute_grad.as<float>();
      }
      if (e_.opt.stage >= 2) {
        ZT_CHECK(blk.bucket.data(), "gradient of block ", b, " used outside its backward");
        return blk.bucket.as<float>();
      }
      return blk.grads.as<float>();
    }
    void before_forward(int b) override { visit(b, false); }
    void before_backward(int b) override {
      visit(b, true);
      Block& blk = block(b);
      if (e_.mixed()) {
        if (!blk.compute_grad.data()) {
          blk.compute_grad = DeviceBuffer(d_.memory(), blk.sizes.compute_grad, d_.compute(), "gradient bucket");
          ops::fill(d_.compute(), f32(blk.compute_grad.as<float>(), blk.shard.padded_numel, idx()), 0.0f);
        }
      } else if (e_.opt.stage >= 2 && !blk.bucket.data()) {
        blk.bucket = DeviceBuffer(d_.memory(), blk.sizes.bucket, d_.compute(), "gradient bucket");
        ops::fill(d_.compute(), f32(blk.bucket.as<float>(), blk.shard.padded_numel, idx()), 0.0f);
      }
    }
    void after_backward(int b) override {
      Block& blk = block(b);
      Stream& comm = d_.comm();
      const DType W = e_.opt.working;
      close_compute_span();
      if (e_.mixed() && e_.opt.stage >= 2)
        blk.bucket = DeviceBuffer(d_.memory(), blk.sizes.bucket, d_.compute(), "gradient bucket");
      void* full = e_.opt.stage >= 2 ? blk.bucket.data() : blk.grads.data();
      if (e_.mixed()) {
        // The fp32 gradient is rounded once into the working dtype, which is what is reduced.
        ops::cast(d_.compute(), typed(full, W, blk.shard.padded_numel, idx()),
                  f32(blk.compute_grad.as<float>(), blk.shard.padded_numel, idx()));
        d_.memory().record_stream(blk.compute_grad.data(), d_.compute());
        blk.compute_grad.reset();
      }
      const TensorView full_view = typed(full, W, blk.shard.padded_numel, idx());
      std::shared_ptr<double> rs_start;
      if (e_.tracing) {
        // Wait for the gradients here (not inside the collective) so the span starts when the
        // reduce-scatter can really start.
        d_.compute().record(*compute_done_);
        comm.wait(*compute_done_);
        rs_start = e_.open_span(comm);
        e_.comm.reduce_scatter(r_, full_view, nullptr, block_name(b));
      } else {
        e_.comm.reduce_scatter(r_, full_view, &d_.compute(), block_name(b));
      }
      // This rank's reduced shard now sits at full + begin; fold it into the step's accumulator.
      const int64_t n = blk.shard.shard_numel;
      const TensorView region = typed(at(full, W, blk.shard.begin), W, n, idx());
      void* acc = accumulator(blk);
      if (acc != region.data) {
        if (micro_ == 0)
          comm.copy(acc, region.data, bytes(n, W));
        else
          ops::accumulate(comm, typed(acc, W, n, idx()), region);
      }
      if (rs_start) e_.close_span(comm, rs_start, TraceSpan::kReduceScatter, r_, b);
      if (e_.opt.stage >= 2) {
        d_.memory().record_stream(blk.bucket.data(), comm);
        blk.bucket.reset();
      }
      block_range_.close();  // the backward range covers issuing this block's reduce-scatter
    }

    const std::string& block_name(int b) const { return e_.model.layout().block(b).name; }

    // Compute spans: from a block's visit to the next visit (or its after_backward).
    void close_compute_span() {
      if (span_start_) e_.close_span(d_.compute(), span_start_, span_kind_, r_, span_block_);
      span_start_.reset();
    }
    void open_compute_span(int b, bool backward) {
      close_compute_span();
      if (!e_.tracing) return;
      span_start_ = e_.open_span(d_.compute());
      span_kind_ = backward ? TraceSpan::kBackward : TraceSpan::kForward;
      span_block_ = b;
    }

    // Where this rank's reduced gradient shard of the step lives.
    void* accumulator(Block& blk) {
      if (e_.opt.stage >= 2) return blk.grads.data();
      if (e_.opt.micro_batches > 1) return blk.acc.data();
      return at(blk.grads.data(), e_.opt.working, blk.shard.begin);
    }

    void begin_micro(int micro, bool forward_only) {
      micro_ = micro;
      pos_ = 0;
      forward_only_ = forward_only;
      // Compute may overwrite what the last collectives read (the stage 0/1 gradient bucket) and
      // reads what they wrote (parameters after the all-gather) only after they are done.
      record_comm_and_wait(d_.compute());
      if (e_.opt.stage <= 1 && !forward_only && !e_.mixed())
        for (auto& blk : blocks) ops::fill(d_.compute(), f32(blk.grads.as<float>(), blk.shard.padded_numel, idx()), 0.0f);
    }

    void end_micro() {
      close_compute_span();
      block_range_.close();
      for (int b = 0; b < static_cast<int>(blocks.size()); ++b) release(b);
      const size_t expect = forward_only_ ? e_.forward_visits : e_.schedule.size();
      ZT_CHECK(pos_ == static_cast<int>(expect), "the model visited ", pos_, " blocks, its declared order has ", expect);
    }

    void record_comm_and_wait(Stream& consumer) {
      d_.comm().record(*comm_done_);
      consumer.wait(*comm_done_);
    }

    Block& block(int b) { return blocks.at(static_cast<size_t>(b)); }
    int idx() const { return d_.index(); }
    static size_t bytes(int64_t n, DType t = DType::kF32) { return static_cast<size_t>(n) * dtype_size(t); }

    // Stage 3: gather block b (if not in flight already) on the comm stream.
    void gather(int b, bool prefetch = false) {
      Block& blk = block(b);
      if (blk.gathered.data()) return;
      OptionalNvtxRange range;
      if (ranges_enabled()) range.open(NvtxCategory::kGather, (prefetch ? "prefetch " : "gather ") + block_name(b), idx());
      Stream& comm = d_.comm();
      blk.gathered = DeviceBuffer(d_.memory(), blk.sizes.gathered, comm, "gathered parameters");
      // The shard was last written by the optimizer on the compute stream.
      d_.compute().record(*compute_done_);
      comm.wait(*compute_done_);
      std::shared_ptr<double> start = e_.tracing ? e_.open_span(comm) : nullptr;
      const DType W = e_.opt.working;
      comm.copy(at(blk.gathered.data(), W, blk.shard.begin), blk.params.data(), bytes(blk.shard.shard_numel, W));
      e_.comm.all_gather(r_, typed(blk.gathered.data(), W, blk.shard.padded_numel, idx()), nullptr, block_name(b));
      if (start) e_.close_span(comm, start, TraceSpan::kGather, r_, b);
      comm.record(*blk.gathered_ready);
      d_.memory().record_stream(blk.gathered.data(), d_.compute());
    }
    void release(int b) {
      Block& blk = block(b);
      if (blk.gathered.data()) blk.gathered.reset();
      if (blk.compute.data()) blk.compute.reset();
    }

    // One before_forward/before_backward call: position pos_ of the model's declared order.
    void visit(int b, bool backward) {
      const auto& S = e_.schedule;
      ZT_CHECK(pos_ < static_cast<int>(S.size()) && S[pos_].block == b && S[pos_].backward == backward,
               "block ", b, (backward ? " backward" : " forward"), " visited out of the model's declared order at position ", pos_);
      // Host range "forward h.3" from this hook to the next: the issuing of the block's work
      // (and, at stage 3, its gather and the next block's prefetch).
      block_range_.close();
      if (ranges_enabled())
        block_range_.open(backward ? NvtxCategory::kBackward : NvtxCategory::kForward,
                          (backward ? "backward " : "forward ") + block_name(b), idx());
      if (pos_ > 0 && S[pos_ - 1].block != b && !S[pos_ - 1].keep) release(S[pos_ - 1].block);
      if (e_.opt.stage == 3) {
        gather(b);
        d_.compute().wait(*block(b).gathered_ready);
        const int limit = static_cast<int>(forward_only_ ? e_.forward_visits : S.size());
        if (pos_ + 1 < limit) gather(S[pos_ + 1].block, /*prefetch=*/true);
      }
      Block& blk = block(b);
      if (e_.mixed() && !blk.compute.data()) {
        // The block runs in fp32 on its 16-bit parameters, widened exactly.
        blk.compute = DeviceBuffer(d_.memory(), blk.sizes.compute, d_.compute(), "compute parameters");
        void* src = e_.opt.stage == 3 ? blk.gathered.data() : blk.params.data();
        ops::cast(d_.compute(), f32(blk.compute.as<float>(), blk.shard.padded_numel, idx()),
                  typed(src, e_.opt.working, blk.shard.padded_numel, idx()));
      }
      open_compute_span(b, backward);
      ++pos_;
    }

    std::vector<Block> blocks;
    std::unique_ptr<Event> comm_done_, compute_done_;
    // Loss scaling and overflow detection (device memory): the scaler state, and `world` flag
    // floats all-reduced across ranks (element 0 carries this rank's flag, the rest stay 0).
    DeviceBuffer scaler, flags;
    // Multi-tensor lists of this rank's optimizer segments and gradient shards (host and device
    // copies), built on first use from the resident buffers; rebuilt when those change.
    std::vector<optim::OptimizerSegment> opt_segs;
    std::vector<optim::GradSegment> grad_segs;
    DeviceBuffer opt_segs_dev, grad_segs_dev;
    float segs_weight_decay = -1;

   private:
    Impl& e_;
    int r_;
    Device& d_;
    int micro_ = 0, pos_ = 0;
    bool forward_only_ = false;
    std::shared_ptr<double> span_start_;
    OptionalNvtxRange block_range_;  // forward/backward range of the block being issued
    TraceSpan::Kind span_kind_ = TraceSpan::kForward;
    int span_block_ = 0;
  };


  Impl(const Model& m, std::vector<Device*> devs, Communicator& c, const ZeroOptions& o)
      : model(m), devices(std::move(devs)), comm(c), opt(o) {
    ZT_REQUIRE(opt.stage >= 0 && opt.stage <= 3, "--zero-stage must be 0, 1, 2 or 3, got ", opt.stage);
    ZT_CHECK(comm.world() == static_cast<int>(devices.size()), "communicator and engine disagree on the world size");
    schedule = make_schedule(model, &forward_visits);

    const ParamLayout& L = model.layout();
    const int N = static_cast<int>(devices.size());
    for (int r = 0; r < N; ++r) {
      Device& d = *devices[static_cast<size_t>(r)];
      auto rank = std::make_unique<Rank>(*this, r, d);
      rank->comm_done_ = d.create_event();
      rank->compute_done_ = d.create_event();
      Stream& s = d.compute();
      for (int b = 0; b < L.num_blocks(); ++b) {
        Block blk;
        blk.numel = L.block(b).numel;
        blk.shard = shard_range(blk.numel, r, N);
        const BlockBufferBytes sz = blk.sizes = block_buffer_bytes(blk.numel, N, opt);
        blk.params = DeviceBuffer(d.memory(), sz.params, s, "parameters");
        blk.grads = DeviceBuffer(d.memory(), sz.grads, s, "gradients");
        if (sz.acc) blk.acc = DeviceBuffer(d.memory(), sz.acc, s, "gradients");
        if (sz.master) blk.master = DeviceBuffer(d.memory(), sz.master, s, "optimizer state");
        blk.m = DeviceBuffer(d.memory(), sz.m, s, "optimizer state");
        if (sz.v) blk.v = DeviceBuffer(d.memory(), sz.v, s, "optimizer state");
        blk.gathered_ready = d.create_event();
        rank->blocks.push_back(std::move(blk));
      }
      rank->scaler = DeviceBuffer(d.memory(), sizeof(optim::LossScaleState), s, "loss scale");
      rank->flags = DeviceBuffer(d.memory(), static_cast<size_t>(N) * sizeof(float), s, "loss scale");
      reset_scaler(*rank, d);
      ranks.push_back(std::move(rank));
    }
  }

  bool mixed() const { return opt.working != DType::kF32; }

  void reset_scaler(Rank& R, Device& d) {
    const bool none = opt.scaling == ZeroOptions::Scaling::kNone;
    const optim::LossScaleState st = optim::initial_loss_scale_state(none ? 1.0f : opt.initial_scale,
                                                                     none ? optim::LossScaleConfig{} : opt.scale_config);
    Stream& s = d.compute();
    s.copy(R.scaler.data(), &st, sizeof st);
    ops::fill(s, f32(R.flags.as<float>(), world(), d.index()), 0.0f);
    s.synchronize();  // st lives on this stack frame
  }
  int world() const { return static_cast<int>(devices.size()); }

  // The resident buffers' multi-tensor lists (see Rank::opt_segs), uploaded to the device.
  void build_segments(Rank& R, Device& d, float weight_decay) {
    const ParamLayout& L = model.layout();
    const DType W = opt.working;
    // A rebuild: the previous lists' copies to the device may still be queued on the stream and
    // read these vectors.
    if (!R.opt_segs.empty() || !R.grad_segs.empty()) d.compute().synchronize();
    R.opt_segs.clear();
    R.grad_segs.clear();
    int64_t global = 0;  // element index of the block's first element in the whole model
    for (size_t b = 0; b < R.blocks.size(); ++b) {
      auto& blk = R.blocks[b];
      R.grad_segs.push_back({R.accumulator(blk), blk.shard.size(), static_cast<int>(b)});
      // Stage 0 updates whole tensors; the others the intersection of each tensor with the shard.
      // Bases are pointers to element 0 of the block (shard buffers are offset by -begin).
      const int64_t lo = opt.stage == 0 ? 0 : blk.shard.begin;
      const int64_t hi = opt.stage == 0 ? blk.numel : blk.shard.end;
      const int64_t shard_off = opt.stage == 0 ? 0 : blk.shard.begin;
      char* p_base = static_cast<char*>(blk.params.data()) - (opt.stage == 3 ? blk.shard.begin * static_cast<int64_t>(dtype_size(W)) : 0);
      const char* g_base = opt.stage == 0 ? static_cast<char*>(blk.grads.data())
                                          : static_cast<char*>(R.accumulator(blk)) - blk.shard.begin * static_cast<int64_t>(dtype_size(W));
      float* master_base = mixed() ? blk.master.as<float>() - shard_off : reinterpret_cast<float*>(p_base);
      float* m_base = blk.m.as<float>() - shard_off;
      float* v_base = blk.v.data() ? blk.v.as<float>() - shard_off : nullptr;
      for (const ParamTensor& t : L.block(static_cast<int>(b)).tensors) {
        const int64_t a = std::max(lo, t.offset), e = std::min(hi, t.offset + t.numel);
        if (a >= e) continue;
        optim::OptimizerSegment seg;
        seg.param = p_base + a * static_cast<int64_t>(dtype_size(W));
        seg.grad = g_base + a * static_cast<int64_t>(dtype_size(W));
        seg.master = master_base + a;
        seg.m = m_base + a;
        seg.v = v_base ? v_base + a : nullptr;
        seg.n = e - a;
        seg.weight_decay = t.weight_decay ? weight_decay : 0.0f;
        seg.rng_offset = static_cast<uint64_t>(global + a);
        R.opt_segs.push_back(seg);
      }
      global += blk.numel;
    }
    Stream& s = d.compute();
    const size_t ob = std::max<size_t>(1, R.opt_segs.size()) * sizeof(optim::OptimizerSegment);
    const size_t gb = std::max<size_t>(1, R.grad_segs.size()) * sizeof(optim::GradSegment);
    if (R.opt_segs_dev.size() != ob) R.opt_segs_dev = DeviceBuffer(d.memory(), ob, s, "optimizer lists");
    if (R.grad_segs_dev.size() != gb) R.grad_segs_dev = DeviceBuffer(d.memory(), gb, s, "optimizer lists");
    // The host vectors stay alive (members) until the copies ran.
    s.copy(R.opt_segs_dev.data(), R.opt_segs.data(), R.opt_segs.size() * sizeof(optim::OptimizerSegment));
    s.copy(R.grad_segs_dev.data(), R.grad_segs.data(), R.grad_segs.size() * sizeof(optim::GradSegment));
    R.segs_weight_decay = weight_decay;
  }


  // ---- tracing ----
  bool tracing = false;
  std::mutex trace_mu;
  std::vector<TraceSpan> spans;
  const std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double now_us() const {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  // Opens a span when `s` reaches this point; the returned slot is closed by close_span.
  std::shared_ptr<double> open_span(Stream& s) {
    auto start = std::make_shared<double>(0);
    s.host_func([this, start] { *start = now_us(); });
    return start;
  }
  void close_span(Stream& s, std::shared_ptr<double> start, TraceSpan::Kind kind, int rank, int block) {
    s.host_func([this, start, kind, rank, block] {
      const double end = now_us();
      std::lock_guard<std::mutex> lock(trace_mu);
      spans.push_back(TraceSpan{kind, rank, block, *start, end});
    });
  }

  const Model& model;
  std::vector<Device*> devices;
  Communicator& comm;
  ZeroOptions opt;
  std::vector<Visit> schedule;
  size_t forward_visits = 0;
  std::vector<std::unique_ptr<Rank>> ranks;
};

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

int ZeroEngine::world() const { return static_cast<int>(impl_->devices.size()); }
int ZeroEngine::stage() const { return impl_->opt.stage; }
ParamAccess& ZeroEngine::access(int rank) { return *impl_->ranks.at(static_cast<size_t>(rank)); }

void ZeroEngine::load_parameters(int rank, const std::vector<std::vector<float>>& host) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  Stream& s = d.compute();
  const int idx = d.index();
  const int stage = impl_->opt.stage;
  const DType W = impl_->opt.working;
  const auto zero = [&](DeviceBuffer& b, DType t) {
    (void)t;
    if (b.data()) s.memset(b.data(), 0, b.size());  // +0 in every dtype
  };
  for (size_t b = 0; b < R.blocks.size(); ++b) {
    auto& blk = R.blocks[b];
    ZT_CHECK(static_cast<int64_t>(host[b].size()) == blk.numel, "block ", b, " has ", host[b].size(), " values, expected ",
             blk.numel);
    // fp32 values of what this rank keeps: the whole (padded) block, or its shard (stage 3; and
    // the master of stages 1-3).
    const int64_t lo = blk.shard.begin, n = blk.shard.size();
    DeviceBuffer full(d.memory(), static_cast<size_t>(blk.shard.padded_numel) * 4, s, "load staging");
    ops::fill(s, f32(full.as<float>(), blk.shard.padded_numel, idx), 0.0f);
    s.copy(full.data(), host[b].data(), host[b].size() * 4);
    const int64_t sn = blk.shard.shard_numel;
    if (stage == 3) {
      ops::cast(s, typed(blk.params.data(), W, sn, idx), f32(full.as<float>() + lo, sn, idx));
    } else {
      ops::cast(s, typed(blk.params.data(), W, blk.shard.padded_numel, idx), f32(full.as<float>(), blk.shard.padded_numel, idx));
    }
    if (blk.master.data()) {
      if (stage == 0)
        s.copy(blk.master.data(), full.data(), blk.master.size());
      else
        s.copy(blk.master.data(), full.as<float>() + lo, static_cast<size_t>(sn) * 4);
    }
    (void)n;
    d.memory().record_stream(full.data(), s);
    zero(blk.grads, W);
    zero(blk.acc, W);
    zero(blk.m, DType::kF32);
    zero(blk.v, DType::kF32);
  }
  impl_->reset_scaler(R, d);  // synchronizes: the host vectors may go away
}

namespace {
// Copies n floats of device memory at src to the host (synchronizes the stream).
void to_host(Stream& s, float* dst, const void* src, int64_t n) {
  if (n <= 0) return;
  s.copy(dst, src, static_cast<size_t>(n) * 4);
  s.synchronize();
}
}  // namespace

std::vector<float> ZeroEngine::block_to_host(int block) {
  for (Device* d : impl_->devices) d->synchronize();
  const DType W = impl_->opt.working;
  auto& R0 = *impl_->ranks[0];
  const auto& b0 = R0.blocks.at(static_cast<size_t>(block));
  std::vector<float> out(static_cast<size_t>(b0.numel));
  // Widen the working dtype on each device into a staging buffer, then copy.
  auto fetch = [&](size_t r, const DeviceBuffer& src, int64_t n, float* dst) {
    if (n <= 0) return;
    Device& d = *impl_->devices[r];
    Stream& s = d.compute();
    DeviceBuffer tmp(d.memory(), static_cast<size_t>(n) * 4, s, "host staging");
    ops::cast(s, f32(tmp.as<float>(), n, d.index()), typed(src.data(), W, n, d.index()));
    to_host(s, dst, tmp.data(), n);
  };
  if (impl_->opt.stage != 3) {
    fetch(0, b0.params, b0.numel, out.data());
    return out;
  }
  for (size_t r = 0; r < impl_->ranks.size(); ++r) {
    const auto& blk = impl_->ranks[r]->blocks[static_cast<size_t>(block)];
    fetch(r, blk.params, blk.shard.size(), out.data() + blk.shard.begin);
  }
  return out;
}

std::vector<float> ZeroEngine::master_to_host(int block) {
  if (!impl_->mixed()) return block_to_host(block);
  for (Device* d : impl_->devices) d->synchronize();
  const auto& b0 = impl_->ranks[0]->blocks.at(static_cast<size_t>(block));
  std::vector<float> out(static_cast<size_t>(b0.numel));
  if (impl_->opt.stage == 0) {
    to_host(impl_->devices[0]->compute(), out.data(), b0.master.data(), b0.numel);
    return out;
  }
  for (size_t r = 0; r < impl_->ranks.size(); ++r) {
    const auto& blk = impl_->ranks[r]->blocks[static_cast<size_t>(block)];
    to_host(impl_->devices[r]->compute(), out.data() + blk.shard.begin, blk.master.data(), blk.shard.size());
  }
  return out;
}

std::vector<float> ZeroEngine::moments_to_host(int rank, int block) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  auto& blk = R.blocks.at(static_cast<size_t>(block));
  Stream& s = impl_->devices[static_cast<size_t>(rank)]->compute();
  impl_->devices[static_cast<size_t>(rank)]->synchronize();
  const int64_t n = blk.shard.size();
  const int64_t off = impl_->opt.stage == 0 ? blk.shard.begin : 0;
  std::vector<float> out(static_cast<size_t>(n) * (blk.v.data() ? 2 : 1));
  to_host(s, out.data(), blk.m.as<float>() + off, n);
  if (blk.v.data()) to_host(s, out.data() + n, blk.v.as<float>() + off, n);
  return out;
}

void ZeroEngine::begin_micro_batch(int rank, int micro_index, bool forward_only) {
  impl_->ranks.at(static_cast<size_t>(rank))->begin_micro(micro_index, forward_only);
}

void ZeroEngine::end_micro_batch(int rank) { impl_->ranks.at(static_cast<size_t>(rank))->end_micro(); }

const float* ZeroEngine::loss_scale_device(int rank) const {
  if (impl_->opt.scaling == ZeroOptions::Scaling::kNone) return nullptr;
  return &impl_->ranks.at(static_cast<size_t>(rank))->scaler.as<optim::LossScaleState>()->scale;
}

const float* ZeroEngine::found_inf_device(int rank) const {
  return impl_->ranks.at(static_cast<size_t>(rank))->flags.as<float>();
}

const optim::LossScaleState* ZeroEngine::loss_scale_state_device(int rank) const {
  return impl_->ranks.at(static_cast<size_t>(rank))->scaler.as<optim::LossScaleState>();
}

optim::LossScaleState ZeroEngine::loss_scale_state(int rank) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Stream& s = impl_->devices[static_cast<size_t>(rank)]->compute();
  optim::LossScaleState st{};
  s.copy(&st, R.scaler.data(), sizeof st);
  s.synchronize();
  return st;
}

DType ZeroEngine::working_dtype() const { return impl_->opt.working; }

void ZeroEngine::check_gradients(int rank, float* device_out) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  Stream& s = d.compute();
  const NvtxRange range(NvtxCategory::kLossScale, "unscale + overflow check", d.index());
  R.record_comm_and_wait(s);  // the reductions and accumulations ran on the comm stream
  if (R.segs_weight_decay < 0) impl_->build_segments(R, d, 0.0f);
  const float* inv = impl_->opt.scaling == ZeroOptions::Scaling::kNone
                         ? nullptr
                         : &R.scaler.as<optim::LossScaleState>()->inv_scale;
  optim::unscale_check(s, {R.grad_segs, R.grad_segs_dev.as<optim::GradSegment>()}, impl_->opt.working, inv,
                       device_out, static_cast<int>(R.blocks.size()), R.flags.as<float>());
  // Every rank must skip together: sum the flags over ranks, on the devices.
  impl_->comm.all_reduce(rank, f32(R.flags.as<float>(), impl_->world(), d.index()), &s, "overflow flag");
  R.record_comm_and_wait(s);
}

ShardRange ZeroEngine::shard_of(int rank, int block) const {
  return impl_->ranks.at(static_cast<size_t>(rank))->blocks.at(static_cast<size_t>(block)).shard;
}

std::pair<int64_t, int64_t> ZeroEngine::state_range(int rank, int block) const {
  const ShardRange sh = shard_of(rank, block);
  if (impl_->opt.stage == 0) return {0, impl_->ranks[0]->blocks.at(static_cast<size_t>(block)).numel};
  return {sh.begin, sh.end};
}

void ZeroEngine::state_to_host(int rank, int block, float* master, float* m, float* v, void* working) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  Stream& s = d.compute();
  R.record_comm_and_wait(s);
  const auto& blk = R.blocks.at(static_cast<size_t>(block));
  const DType W = impl_->opt.working;
  const int stage = impl_->opt.stage;
  const int64_t n = blk.shard.size();
  if (n == 0) return;
  const int64_t off = stage == 0 ? blk.shard.begin : 0;  // in the state buffers
  const int64_t poff = stage == 3 ? 0 : blk.shard.begin;  // in the parameter buffer
  const size_t fb = static_cast<size_t>(n) * 4;
  if (impl_->mixed())
    s.copy(master, blk.master.as<float>() + off, fb);
  else
    s.copy(master, blk.params.as<float>() + poff, fb);
  s.copy(m, blk.m.as<float>() + off, fb);
  if (v && blk.v.data()) s.copy(v, blk.v.as<float>() + off, fb);
  if (working && impl_->mixed()) s.copy(working, at(blk.params.data(), W, poff), static_cast<size_t>(n) * dtype_size(W));
  s.synchronize();
}

void ZeroEngine::load_state(int rank, int block, const float* master_full, const float* m, const float* v,
                            const void* working_full) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  Stream& s = d.compute();
  const int idx = d.index();
  R.record_comm_and_wait(s);
  auto& blk = R.blocks.at(static_cast<size_t>(block));
  const DType W = impl_->opt.working;
  const int stage = impl_->opt.stage;
  const size_t w = dtype_size(W);
  const auto [lo, hi] = state_range(rank, block);
  const int64_t n = hi - lo;
  // Padding stays zero.
  const auto zero = [&](DeviceBuffer& b, DType t) {
    (void)t;
    if (b.data()) s.memset(b.data(), 0, b.size());  // +0 in every dtype
  };
  zero(blk.params, W);
  zero(blk.master, DType::kF32);
  zero(blk.m, DType::kF32);
  zero(blk.v, DType::kF32);
  zero(blk.grads, W);
  zero(blk.acc, W);
  // Parameters: the whole block (stages 0-2) or the shard (stage 3).
  const int64_t plo = stage == 3 ? blk.shard.begin : 0, phi = stage == 3 ? blk.shard.end : blk.numel;
  if (phi > plo) {
    if (working_full && impl_->mixed()) {
      s.copy(blk.params.data(), static_cast<const char*>(working_full) + plo * static_cast<int64_t>(w),
             static_cast<size_t>(phi - plo) * w);
    } else if (!impl_->mixed()) {
      s.copy(blk.params.data(), master_full + plo, static_cast<size_t>(phi - plo) * 4);
    } else {
      DeviceBuffer tmp(d.memory(), static_cast<size_t>(phi - plo) * 4, s, "load staging");
      s.copy(tmp.data(), master_full + plo, static_cast<size_t>(phi - plo) * 4);
      ops::cast(s, typed(blk.params.data(), W, phi - plo, idx), f32(tmp.as<float>(), phi - plo, idx));
      d.memory().record_stream(tmp.data(), s);
    }
  }
  if (n > 0) {
    if (impl_->mixed()) s.copy(blk.master.data(), master_full + lo, static_cast<size_t>(n) * 4);
    s.copy(blk.m.data(), m, static_cast<size_t>(n) * 4);
    if (blk.v.data()) {
      ZT_CHECK(v != nullptr, "load_state: AdamW needs the second moment");
      s.copy(blk.v.data(), v, static_cast<size_t>(n) * 4);
    }
  }
  s.synchronize();
}

void ZeroEngine::set_loss_scale_state(int rank, const optim::LossScaleState& st) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Stream& s = impl_->devices[static_cast<size_t>(rank)]->compute();
  s.copy(R.scaler.data(), &st, sizeof st);
  s.synchronize();
}

void ZeroEngine::mark_overflow(int rank) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  ops::fill(d.compute(), f32(R.flags.as<float>(), 1, d.index()), 1.0f);
}

void ZeroEngine::poke_gradient(int rank, int block, int64_t offset, float value) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  Stream& s = d.compute();
  auto& blk = R.blocks.at(static_cast<size_t>(block));
  ZT_CHECK(offset >= 0 && offset < blk.shard.size(), "poke_gradient: offset ", offset, " outside the shard");
  R.record_comm_and_wait(s);
  const DType W = impl_->opt.working;
  uint32_t bits = 0;
  if (W == DType::kF32) std::memcpy(&bits, &value, 4);
  else if (W == DType::kBF16) bits = float_to_bf16_bits(value);
  else bits = float_to_half_bits(value);
  s.copy(at(R.accumulator(blk), W, offset), &bits, dtype_size(W));  // little-endian: the low bytes
  s.synchronize();  // `bits` lives on this frame
}

std::string ZeroEngine::first_nonfinite_gradient() {
  const ParamLayout& L = impl_->model.layout();
  const DType W = impl_->opt.working;
  std::string first;
  int64_t first_key = -1;  // (block, tensor) order
  for (size_t r = 0; r < impl_->ranks.size(); ++r) {
    auto& R = *impl_->ranks[r];
    Device& d = *impl_->devices[r];
    Stream& s = d.compute();
    R.record_comm_and_wait(s);
    for (size_t b = 0; b < R.blocks.size(); ++b) {
      auto& blk = R.blocks[b];
      const int64_t n = blk.shard.size();
      if (n == 0) continue;
      std::vector<float> g(static_cast<size_t>(n));
      DeviceBuffer tmp(d.memory(), static_cast<size_t>(n) * 4, s, "host staging");
      ops::cast(s, f32(tmp.as<float>(), n, d.index()), typed(R.accumulator(blk), W, n, d.index()));
      to_host(s, g.data(), tmp.data(), n);
      const auto& tensors = L.block(static_cast<int>(b)).tensors;
      for (size_t t = 0; t < tensors.size(); ++t) {
        const int64_t key = static_cast<int64_t>(b) * 100000 + static_cast<int64_t>(t);
        if (first_key >= 0 && key >= first_key) break;
        const int64_t a = std::max(blk.shard.begin, tensors[t].offset);
        const int64_t e = std::min(blk.shard.end, tensors[t].offset + tensors[t].numel);
        for (int64_t i = a; i < e; ++i)
          if (!std::isfinite(g[static_cast<size_t>(i - blk.shard.begin)])) {
            first_key = key;
            first = tensors[t].name;
            break;
          }
      }
    }
  }
  return first;
}

void ZeroEngine::optimizer_step(int rank, const OptimizerStep& st) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  Stream& s = d.compute();
  const int idx = d.index();
  const int stage = impl_->opt.stage;
  const DType W = impl_->opt.working;
  const ParamLayout& L = impl_->model.layout();
  const NvtxRange range(NvtxCategory::kOptimizer, "optimizer", idx);
  R.record_comm_and_wait(s);

  if (stage == 0) {
    // Plain data parallelism: finish the all-reduce (reduce-scatter + all-gather) so that every
    // rank holds the full reduced gradient, then every rank updates everything.
    for (size_t b = 0; b < R.blocks.size(); ++b) {
      auto& blk = R.blocks[b];
      void* acc = R.accumulator(blk);
      void* region = at(blk.grads.data(), W, blk.shard.begin);
      if (acc != region) s.copy(region, acc, static_cast<size_t>(blk.shard.shard_numel) * dtype_size(W));
      impl_->comm.all_gather(rank, typed(blk.grads.data(), W, blk.shard.padded_numel, idx), &s,
                             impl_->model.layout().block(static_cast<int>(b)).name);
    }
    R.record_comm_and_wait(s);
  }
  if (R.segs_weight_decay != st.weight_decay) impl_->build_segments(R, d, st.weight_decay);

  const bool scaled = impl_->opt.scaling != ZeroOptions::Scaling::kNone;
  auto* scaler = R.scaler.as<optim::LossScaleState>();
  optim::StepScalars sc;
  sc.inv_loss_scale = scaled ? &scaler->inv_scale : nullptr;
  sc.found_inf = R.flags.as<float>();
  sc.clip = st.grad_scale;
  sc.rounding = impl_->opt.rounding;
  sc.seed = impl_->opt.seed;
  const optim::SegmentList<optim::OptimizerSegment> segs{R.opt_segs, R.opt_segs_dev.as<optim::OptimizerSegment>()};
  if (st.adamw)
    optim::adamw_multi(s, segs, W, W, optim::AdamWConfig{st.lr, st.beta1, st.beta2, st.eps, st.step}, sc);
  else
    optim::sgd_multi(s, segs, W, W, optim::SgdConfig{st.lr, st.momentum, false, st.step}, sc);
  if (impl_->opt.scaling == ZeroOptions::Scaling::kDynamic) {
    const NvtxRange scale_range(NvtxCategory::kLossScale, "loss scale update", idx);
    optim::loss_scale_update(s, scaler, R.flags.as<float>(), impl_->opt.scale_config);
  }
  if (stage == 1 || stage == 2) {
    for (size_t b = 0; b < R.blocks.size(); ++b)
      impl_->comm.all_gather(rank, typed(R.blocks[b].params.data(), W, R.blocks[b].shard.padded_numel, idx), &s,
                             L.block(static_cast<int>(b)).name);
  }
}

void ZeroEngine::set_working_dtype(DType working) {
  ZT_REQUIRE(impl_->mixed() && (working == DType::kBF16 || working == DType::kF16),
             "switching the working dtype needs fp32 master weights (mixed precision on both sides)");
  const int stage = impl_->opt.stage;
  const int N = impl_->world();
  for (Device* d : impl_->devices) d->synchronize();
  ZeroOptions o = impl_->opt;
  o.working = working;
  for (int r = 0; r < N; ++r) {
    auto& R = *impl_->ranks[static_cast<size_t>(r)];
    Device& d = *impl_->devices[static_cast<size_t>(r)];
    Stream& s = d.compute();
    const int idx = d.index();
    for (auto& blk : R.blocks) {
      const BlockBufferBytes sz = blk.sizes = block_buffer_bytes(blk.numel, N, o);
      blk.params = DeviceBuffer(d.memory(), sz.params, s, "parameters");
      blk.grads = DeviceBuffer(d.memory(), sz.grads, s, "gradients");
      if (sz.acc) blk.acc = DeviceBuffer(d.memory(), sz.acc, s, "gradients");
      s.memset(blk.grads.data(), 0, sz.grads);
      if (sz.acc) s.memset(blk.acc.data(), 0, sz.acc);
      // The new parameters are the master rounded to the new dtype (stages 1-2: this rank's shard,
      // then the all-gather below).
      const int64_t n = stage == 0 ? blk.shard.padded_numel : blk.shard.shard_numel;
      void* dst = stage == 1 || stage == 2 ? at(blk.params.data(), working, blk.shard.begin) : blk.params.data();
      ops::cast(s, typed(dst, working, n, idx), f32(blk.master.as<float>(), n, idx));
    }
    R.segs_weight_decay = -1;  // buffers moved: rebuild the multi-tensor lists
  }
  impl_->opt.working = working;
  impl_->opt.scaling = ZeroOptions::Scaling::kNone;
  if (stage == 1 || stage == 2) {
    for (size_t b = 0; b < impl_->ranks[0]->blocks.size(); ++b) {
      std::vector<TensorView> full;
      std::vector<Stream*> producers;
      for (int r = 0; r < N; ++r) {
        auto& blk = impl_->ranks[static_cast<size_t>(r)]->blocks[b];
        Device& d = *impl_->devices[static_cast<size_t>(r)];
        full.push_back(typed(blk.params.data(), working, blk.shard.padded_numel, d.index()));
        producers.push_back(&d.compute());
      }
      impl_->comm.all_gather(full, producers);
    }
  }
  for (int r = 0; r < N; ++r) {
    Device& d = *impl_->devices[static_cast<size_t>(r)];
    impl_->comm.wait_done(r, d.compute());
    impl_->reset_scaler(*impl_->ranks[static_cast<size_t>(r)], d);
  }
}

BlockBufferBytes ZeroEngine::block_buffer_bytes(int64_t numel, int world, const ZeroOptions& opt) {
  const ShardRange sh = shard_range(numel, 0, world);
  const int64_t full = sh.padded_numel, shard = sh.shard_numel;
  const size_t w = dtype_size(opt.working);
  const bool mixed = opt.working != DType::kF32;
  const auto F = [](int64_t n) { return static_cast<size_t>(n) * sizeof(float); };
  const auto Wb = [w](int64_t n) { return static_cast<size_t>(n) * w; };
  BlockBufferBytes b;
  b.params = Wb(opt.stage == 3 ? shard : full);
  b.grads = Wb(opt.stage >= 2 ? shard : full);
  b.acc = opt.stage <= 1 && opt.micro_batches > 1 ? Wb(shard) : 0;
  const int64_t state = opt.stage == 0 ? full : shard;
  b.master = mixed ? F(state) : 0;
  b.m = F(state);
  b.v = opt.sgd ? 0 : F(state);
  b.bucket = opt.stage >= 2 ? Wb(full) : 0;
  b.gathered = opt.stage == 3 ? Wb(full) : 0;
  b.compute = mixed ? F(full) : 0;
  b.compute_grad = mixed ? F(full) : 0;
  return b;
}

EngineMemoryPlan ZeroEngine::plan_memory(const Model& model, int world, const ZeroOptions& opt) {
  ZT_REQUIRE(opt.stage >= 0 && opt.stage <= 3, "--zero-stage must be 0, 1, 2 or 3, got ", opt.stage);
  const ParamLayout& L = model.layout();
  EngineMemoryPlan plan;
  std::vector<BlockBufferBytes> sizes;
  for (int b = 0; b < L.num_blocks(); ++b) {
    const BlockBufferBytes sz = block_buffer_bytes(L.block(b).numel, world, opt);
    sizes.push_back(sz);
    for (size_t n : {sz.params, sz.grads, sz.acc, sz.master, sz.m, sz.v})
      if (n) plan.resident.push_back(n);
    plan.state.params += sz.params;
    plan.state.grads += sz.grads + sz.acc;
    plan.state.optimizer += sz.master + sz.m + sz.v;
  }
  // Per rank: the loss-scale state, the overflow flags, and the multi-tensor lists (the longest
  // rank's optimizer list: at most one segment per tensor plus one per shard boundary).
  size_t opt_segs = 0;
  for (int r = 0; r < world; ++r) {
    size_t n = 0;
    for (int b = 0; b < L.num_blocks(); ++b) {
      const ShardRange sh = shard_range(L.block(b).numel, r, world);
      const int64_t lo = opt.stage == 0 ? 0 : sh.begin, hi = opt.stage == 0 ? L.block(b).numel : sh.end;
      for (const ParamTensor& t : L.block(b).tensors) n += std::max(lo, t.offset) < std::min(hi, t.offset + t.numel);
    }
    opt_segs = std::max(opt_segs, n);
  }
  plan.resident.push_back(sizeof(optim::LossScaleState));
  plan.resident.push_back(static_cast<size_t>(world) * sizeof(float));
  plan.resident.push_back(std::max<size_t>(1, opt_segs) * sizeof(optim::OptimizerSegment));
  plan.resident.push_back(static_cast<size_t>(std::max(1, L.num_blocks())) * sizeof(optim::GradSegment));
  // Walk the hooks of one micro-batch as Rank::visit / before_backward / after_backward /
  // end_micro do, keeping the live set with the most pool bytes.
  size_t forward_visits = 0;
  const std::vector<Visit> S = make_schedule(model, &forward_visits);
  auto walk = [&](bool forward_only) {
    std::vector<int> gathered, buckets, computes;
    int bucket16 = -1;  // mixed precision, stages 2-3: the block whose 16-bit bucket is being filled
    std::vector<PlannedBuffer> best;
    size_t best_bytes = 0;
    const bool mixed = opt.working != DType::kF32;
    auto note = [&] {
      std::vector<PlannedBuffer> live;
      size_t total = 0;
      for (int b : gathered) live.push_back({sizes[static_cast<size_t>(b)].gathered, true});
      for (int b : computes) live.push_back({sizes[static_cast<size_t>(b)].compute, false});
      // Mixed precision: the fp32 gradient of a block in backward (the 16-bit bucket of stages 2-3
      // replaces it at after_backward, when both are briefly live).
      for (int b : buckets) {
        if (mixed) live.push_back({sizes[static_cast<size_t>(b)].compute_grad, false});
        else live.push_back({sizes[static_cast<size_t>(b)].bucket, false});
      }
      if (bucket16 >= 0) live.push_back({sizes[static_cast<size_t>(bucket16)].bucket, false});
      for (const auto& p : live) total += pool_rounded_size(p.bytes);
      if (total > best_bytes) best_bytes = total, best = std::move(live);
    };
    auto has = [](const std::vector<int>& v, int b) { return std::find(v.begin(), v.end(), b) != v.end(); };
    auto drop = [](std::vector<int>& v, int b) { v.erase(std::remove(v.begin(), v.end(), b), v.end()); };
    const size_t limit = forward_only ? forward_visits : S.size();
    for (size_t pos = 0; pos < limit; ++pos) {
      const int b = S[pos].block;
      if (pos > 0 && S[pos - 1].block != b && !S[pos - 1].keep) drop(gathered, S[pos - 1].block), drop(computes, S[pos - 1].block);
      if (opt.stage == 3) {
        if (!has(gathered, b)) gathered.push_back(b), note();
        if (pos + 1 < limit && !has(gathered, S[pos + 1].block)) gathered.push_back(S[pos + 1].block), note();
      }
      if (mixed && !has(computes, b)) computes.push_back(b), note();
      if (S[pos].backward && (opt.stage >= 2 || mixed)) {
        if (!has(buckets, b)) buckets.push_back(b), note();
        bool last = true;
        for (size_t q = pos + 1; q < S.size(); ++q) last = last && S[q].block != b;
        if (last) {  // after_backward
          if (mixed && opt.stage >= 2) {
            // The 16-bit bucket is allocated while the fp32 gradient is still live.
            bucket16 = b;
            note();
            bucket16 = -1;
          }
          drop(buckets, b);
        }
      }
    }
    return best;
  };
  plan.train_peak = walk(false);
  plan.forward_peak = walk(true);
  return plan;
}

ModelStateBytes ZeroEngine::planned_model_state_bytes(const Model& model, int world, const ZeroOptions& opt) {
  return plan_memory(model, world, opt).state;
}

ModelStateBytes ZeroEngine::model_state_bytes(int rank) const {
  const auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  ModelStateBytes m;
  for (const auto& blk : R.blocks) {
    m.params += blk.params.size();
    m.grads += blk.grads.size() + blk.acc.size();
    m.optimizer += blk.master.size() + blk.m.size() + blk.v.size();
  }
  return m;
}

}  // namespace zt

namespace zt {

void ZeroEngine::set_tracing(bool on) { impl_->tracing = on; }

std::chrono::steady_clock::time_point ZeroEngine::trace_origin() const { return impl_->t0; }

std::vector<TraceSpan> ZeroEngine::take_trace() {
  for (Device* d : impl_->devices) d->synchronize();
  std::lock_guard<std::mutex> lock(impl_->trace_mu);
  return std::move(impl_->spans);
}

}  // namespace zt
