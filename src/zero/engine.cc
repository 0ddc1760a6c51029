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
#include <chrono>
#include <cstring>
#include <mutex>

#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"

namespace zt {

namespace {

TensorView f32(float* p, int64_t n, int device) { return TensorView{p, DType::kF32, Shape{n}, device}; }

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
    DeviceBuffer params;    // stages 0-2: full (padded); stage 3: this rank's shard
    DeviceBuffer grads;     // stages 0-1: full (padded) gradient bucket; stages 2-3: shard accumulator
    DeviceBuffer acc;       // stages 0-1 with accumulation: shard accumulator
    DeviceBuffer m, v;      // stage 0: full (padded); stages 1-3: shard
    DeviceBuffer bucket;    // stages 2-3: transient full gradient of the running micro-batch
    DeviceBuffer gathered;  // stage 3: transient full parameters
    std::unique_ptr<Event> gathered_ready;
  };

  class Rank final : public ParamAccess {
   public:
    Rank(Impl& e, int r, Device& d) : e_(e), r_(r), d_(d) {}
    int device_index() const override { return d_.index(); }
    float* params(int b) override {
      Block& blk = block(b);
      if (e_.opt.stage == 3) {
        ZT_CHECK(blk.gathered.data(), "block ", b, " used before it was gathered");
        return blk.gathered.as<float>();
      }
      return blk.params.as<float>();
    }
    float* grads(int b) override {
      Block& blk = block(b);
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
      if (e_.opt.stage >= 2 && !blk.bucket.data()) {
        blk.bucket = DeviceBuffer(d_.memory(), blk.sizes.bucket, d_.compute(), "gradient bucket");
        ops::fill(d_.compute(), f32(blk.bucket.as<float>(), blk.shard.padded_numel, idx()), 0.0f);
      }
    }
    void after_backward(int b) override {
      Block& blk = block(b);
      Stream& comm = d_.comm();
      close_compute_span();
      float* full = e_.opt.stage >= 2 ? blk.bucket.as<float>() : blk.grads.as<float>();
      std::shared_ptr<double> rs_start;
      if (e_.tracing) {
        // Wait for the gradients here (not inside the collective) so the span starts when the
        // reduce-scatter can really start.
        d_.compute().record(*compute_done_);
        comm.wait(*compute_done_);
        rs_start = e_.open_span(comm);
        e_.comm.reduce_scatter(r_, f32(full, blk.shard.padded_numel, idx()), nullptr, block_name(b));
      } else {
        e_.comm.reduce_scatter(r_, f32(full, blk.shard.padded_numel, idx()), &d_.compute(), block_name(b));
      }
      // This rank's reduced shard now sits at full + begin; fold it into the step's accumulator.
      const int64_t n = blk.shard.shard_numel;
      const TensorView region = f32(full + blk.shard.begin, n, idx());
      float* acc = accumulator(blk);
      if (acc != region.data) {
        if (micro_ == 0)
          comm.copy(acc, region.data, bytes(n));
        else
          ops::add(comm, f32(acc, n, idx()), f32(acc, n, idx()), region);
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
    float* accumulator(Block& blk) {
      if (e_.opt.stage >= 2) return blk.grads.as<float>();
      if (e_.opt.micro_batches > 1) return blk.acc.as<float>();
      return blk.grads.as<float>() + blk.shard.begin;
    }

    void begin_micro(int micro, bool forward_only) {
      micro_ = micro;
      pos_ = 0;
      forward_only_ = forward_only;
      // Compute may overwrite what the last collectives read (the stage 0/1 gradient bucket) and
      // reads what they wrote (parameters after the all-gather) only after they are done.
      record_comm_and_wait(d_.compute());
      if (e_.opt.stage <= 1 && !forward_only)
        for (auto& blk : blocks) ops::fill(d_.compute(), f32(blk.grads.as<float>(), blk.shard.padded_numel, idx()), 0.0f);
    }

    void end_micro() {
      close_compute_span();
      block_range_.close();
      if (e_.opt.stage == 3)
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
    static size_t bytes(int64_t n) { return static_cast<size_t>(n) * sizeof(float); }

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
      comm.copy(blk.gathered.as<float>() + blk.shard.begin, blk.params.data(), bytes(blk.shard.shard_numel));
      e_.comm.all_gather(r_, f32(blk.gathered.as<float>(), blk.shard.padded_numel, idx()), nullptr, block_name(b));
      if (start) e_.close_span(comm, start, TraceSpan::kGather, r_, b);
      comm.record(*blk.gathered_ready);
      d_.memory().record_stream(blk.gathered.data(), d_.compute());
    }
    void release(int b) {
      Block& blk = block(b);
      if (blk.gathered.data()) blk.gathered.reset();
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
      if (e_.opt.stage == 3) {
        if (pos_ > 0 && S[pos_ - 1].block != b && !S[pos_ - 1].keep) release(S[pos_ - 1].block);
        gather(b);
        d_.compute().wait(*block(b).gathered_ready);
        const int limit = static_cast<int>(forward_only_ ? e_.forward_visits : S.size());
        if (pos_ + 1 < limit) gather(S[pos_ + 1].block, /*prefetch=*/true);
      }
      open_compute_span(b, backward);
      ++pos_;
    }

    std::vector<Block> blocks;
    std::unique_ptr<Event> comm_done_, compute_done_;

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
        blk.m = DeviceBuffer(d.memory(), sz.m, s, "optimizer state");
        if (sz.v) blk.v = DeviceBuffer(d.memory(), sz.v, s, "optimizer state");
        blk.gathered_ready = d.create_event();
        rank->blocks.push_back(std::move(blk));
      }
      ranks.push_back(std::move(rank));
    }
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
  for (size_t b = 0; b < R.blocks.size(); ++b) {
    auto& blk = R.blocks[b];
    ZT_CHECK(static_cast<int64_t>(host[b].size()) == blk.numel, "block ", b, " has ", host[b].size(), " values, expected ",
             blk.numel);
    const int64_t pn = blk.params.size() / sizeof(float);
    ops::fill(s, f32(blk.params.as<float>(), pn, idx), 0.0f);
    if (impl_->opt.stage == 3) {
      if (blk.shard.size() > 0)
        s.copy(blk.params.data(), host[b].data() + blk.shard.begin, static_cast<size_t>(blk.shard.size()) * 4);
    } else {
      s.copy(blk.params.data(), host[b].data(), host[b].size() * 4);
    }
    ops::fill(s, f32(blk.grads.as<float>(), static_cast<int64_t>(blk.grads.size() / 4), idx), 0.0f);
    if (blk.acc.data()) ops::fill(s, f32(blk.acc.as<float>(), static_cast<int64_t>(blk.acc.size() / 4), idx), 0.0f);
    ops::fill(s, f32(blk.m.as<float>(), static_cast<int64_t>(blk.m.size() / 4), idx), 0.0f);
    if (blk.v.data()) ops::fill(s, f32(blk.v.as<float>(), static_cast<int64_t>(blk.v.size() / 4), idx), 0.0f);
  }
  s.synchronize();  // the host vectors may go away
}

std::vector<float> ZeroEngine::block_to_host(int block) {
  for (Device* d : impl_->devices) d->synchronize();
  auto& R0 = *impl_->ranks[0];
  const auto& b0 = R0.blocks.at(static_cast<size_t>(block));
  std::vector<float> out(static_cast<size_t>(b0.numel));
  if (impl_->opt.stage != 3) {
    impl_->devices[0]->compute().copy(out.data(), b0.params.data(), out.size() * 4);
    impl_->devices[0]->compute().synchronize();
    return out;
  }
  for (size_t r = 0; r < impl_->ranks.size(); ++r) {
    const auto& blk = impl_->ranks[r]->blocks[static_cast<size_t>(block)];
    if (blk.shard.size() == 0) continue;
    Stream& s = impl_->devices[r]->compute();
    s.copy(out.data() + blk.shard.begin, blk.params.data(), static_cast<size_t>(blk.shard.size()) * 4);
    s.synchronize();
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
  if (n == 0) return out;
  s.copy(out.data(), blk.m.as<float>() + off, static_cast<size_t>(n) * 4);
  if (blk.v.data()) s.copy(out.data() + n, blk.v.as<float>() + off, static_cast<size_t>(n) * 4);
  s.synchronize();
  return out;
}

void ZeroEngine::begin_micro_batch(int rank, int micro_index, bool forward_only) {
  impl_->ranks.at(static_cast<size_t>(rank))->begin_micro(micro_index, forward_only);
}

void ZeroEngine::end_micro_batch(int rank) { impl_->ranks.at(static_cast<size_t>(rank))->end_micro(); }

void ZeroEngine::gradient_norm_partials(int rank, float* device_out) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  Stream& s = d.compute();
  R.record_comm_and_wait(s);  // the reductions and accumulations ran on the comm stream
  for (size_t b = 0; b < R.blocks.size(); ++b) {
    auto& blk = R.blocks[b];
    ops::sum_squares(s, TensorView{device_out + b, DType::kF32, Shape{1}, d.index()},
                     f32(R.accumulator(blk), blk.shard.size(), d.index()));
  }
}

void ZeroEngine::optimizer_step(int rank, const OptimizerStep& st) {
  auto& R = *impl_->ranks.at(static_cast<size_t>(rank));
  Device& d = *impl_->devices[static_cast<size_t>(rank)];
  Stream& s = d.compute();
  const int idx = d.index();
  const int stage = impl_->opt.stage;
  const ParamLayout& L = impl_->model.layout();
  const NvtxRange range(NvtxCategory::kOptimizer, "optimizer", idx);
  R.record_comm_and_wait(s);

  if (stage == 0) {
    // Plain data parallelism: finish the all-reduce (reduce-scatter + all-gather) so that every
    // rank holds the full reduced gradient, then every rank updates everything.
    for (size_t b = 0; b < R.blocks.size(); ++b) {
      auto& blk = R.blocks[b];
      float* acc = R.accumulator(blk);
      float* region = blk.grads.as<float>() + blk.shard.begin;
      if (acc != region) s.copy(region, acc, static_cast<size_t>(blk.shard.shard_numel) * 4);
      impl_->comm.all_gather(rank, f32(blk.grads.as<float>(), blk.shard.padded_numel, idx), &s,
                             impl_->model.layout().block(static_cast<int>(b)).name);
    }
    R.record_comm_and_wait(s);
  }

  for (size_t b = 0; b < R.blocks.size(); ++b) {
    auto& blk = R.blocks[b];
    // Stage 0 updates whole tensors; the others the intersection of each tensor with the shard.
    const int64_t lo = stage == 0 ? 0 : blk.shard.begin;
    const int64_t hi = stage == 0 ? blk.numel : blk.shard.end;
    float* p_base = stage == 3 ? blk.params.as<float>() - blk.shard.begin : blk.params.as<float>();
    float* g_base = stage == 0 ? blk.grads.as<float>() : R.accumulator(blk) - blk.shard.begin;
    float* m_base = stage == 0 ? blk.m.as<float>() : blk.m.as<float>() - blk.shard.begin;
    float* v_base = blk.v.data() ? (stage == 0 ? blk.v.as<float>() : blk.v.as<float>() - blk.shard.begin) : nullptr;
    for (const ParamTensor& t : L.block(static_cast<int>(b)).tensors) {
      const int64_t a = std::max(lo, t.offset), e = std::min(hi, t.offset + t.numel);
      if (a >= e) continue;
      const float wd = t.weight_decay ? st.weight_decay : 0.0f;
      const int64_t n = e - a;
      if (st.adamw) {
        ops::adamw_update(s, f32(p_base + a, n, idx), f32(g_base + a, n, idx), f32(m_base + a, n, idx),
                          f32(v_base + a, n, idx), ops::AdamWParams{st.lr, st.beta1, st.beta2, st.eps, wd, st.step},
                          st.grad_scale);
      } else {
        ops::sgd_update(s, f32(p_base + a, n, idx), f32(g_base + a, n, idx), f32(m_base + a, n, idx),
                        ops::SgdParams{st.lr, st.momentum, wd, false}, st.grad_scale);
      }
    }
  }
  if (stage == 1 || stage == 2) {
    for (size_t b = 0; b < R.blocks.size(); ++b)
      impl_->comm.all_gather(rank, f32(R.blocks[b].params.as<float>(), R.blocks[b].shard.padded_numel, idx), &s,
                             L.block(static_cast<int>(b)).name);
  }
}

BlockBufferBytes ZeroEngine::block_buffer_bytes(int64_t numel, int world, const ZeroOptions& opt) {
  const ShardRange sh = shard_range(numel, 0, world);
  const int64_t full = sh.padded_numel, shard = sh.shard_numel;
  const auto B = [](int64_t n) { return static_cast<size_t>(n) * sizeof(float); };
  BlockBufferBytes b;
  b.params = B(opt.stage == 3 ? shard : full);
  b.grads = B(opt.stage >= 2 ? shard : full);
  b.acc = opt.stage <= 1 && opt.micro_batches > 1 ? B(shard) : 0;
  const int64_t mom = opt.stage == 0 ? full : shard;
  b.m = B(mom);
  b.v = opt.sgd ? 0 : B(mom);
  b.bucket = opt.stage >= 2 ? B(full) : 0;
  b.gathered = opt.stage == 3 ? B(full) : 0;
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
    for (size_t n : {sz.params, sz.grads, sz.acc, sz.m, sz.v})
      if (n) plan.resident.push_back(n);
    plan.state.params += sz.params;
    plan.state.grads += sz.grads + sz.acc;
    plan.state.optimizer += sz.m + sz.v;
  }
  // Walk the hooks of one micro-batch as Rank::visit / before_backward / after_backward /
  // end_micro do, keeping the live set with the most pool bytes.
  size_t forward_visits = 0;
  const std::vector<Visit> S = make_schedule(model, &forward_visits);
  auto walk = [&](bool forward_only) {
    std::vector<int> gathered, buckets;
    std::vector<PlannedBuffer> best;
    size_t best_bytes = 0;
    auto note = [&] {
      std::vector<PlannedBuffer> live;
      size_t total = 0;
      for (int b : gathered) live.push_back({sizes[static_cast<size_t>(b)].gathered, true});
      for (int b : buckets) live.push_back({sizes[static_cast<size_t>(b)].bucket, false});
      for (const auto& p : live) total += pool_rounded_size(p.bytes);
      if (total > best_bytes) best_bytes = total, best = std::move(live);
    };
    auto has = [](const std::vector<int>& v, int b) { return std::find(v.begin(), v.end(), b) != v.end(); };
    auto drop = [](std::vector<int>& v, int b) { v.erase(std::remove(v.begin(), v.end(), b), v.end()); };
    const size_t limit = forward_only ? forward_visits : S.size();
    for (size_t pos = 0; pos < limit; ++pos) {
      const int b = S[pos].block;
      if (opt.stage == 3) {
        if (pos > 0 && S[pos - 1].block != b && !S[pos - 1].keep) drop(gathered, S[pos - 1].block);
        if (!has(gathered, b)) gathered.push_back(b), note();
        if (pos + 1 < limit && !has(gathered, S[pos + 1].block)) gathered.push_back(S[pos + 1].block), note();
      }
      if (S[pos].backward && opt.stage >= 2) {
        if (!has(buckets, b)) buckets.push_back(b), note();
        bool last = true;
        for (size_t q = pos + 1; q < S.size(); ++q) last = last && S[q].block != b;
        if (last) drop(buckets, b);  // after_backward
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
    m.optimizer += blk.m.size() + blk.v.size();
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
