// The per-rank gradient check and optimizer step of the ZeRO engine (zero/rank.h): the multi-tensor
// lists over the rank's shards, the fused unscale + overflow check, the update (with its offloaded
// host part) and the parameter all-gather.
#include <algorithm>
#include <cstring>
#include <utility>

#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "optimizers/optimizers.h"
#include "zero/engine_impl.h"

namespace zt {

// The resident buffers' multi-tensor lists (see opt_segs_), uploaded to the device.
void ZeroRank::build_segments(float weight_decay) {
  const ParamLayout& L = e_.model.layout();
  const DType W = e_.opt.working;
  const auto w = static_cast<int64_t>(dtype_size(W));
  // A rebuild: the previous lists' copies to the device may still be queued on the stream and
  // read these vectors.
  // The host updates read host_segs_ on the offload stream.
  if (!opt_segs_.empty() || !grad_segs_.empty()) compute_.synchronize(), sync_offload();
  opt_segs_.clear();
  grad_segs_.clear();
  for (auto& lists : host_segs_) lists.assign(blocks.size(), {});
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
        host_segs_[0][b].push_back(seg);
        if (blk.h_grad_alt.data()) {
          seg.grad = static_cast<const char*>(blk.h_grad_alt.data()) + (a - b0) * w;
          host_segs_[1][b].push_back(seg);
        }
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
  float* flags = scaler_->overflow_flag_device();
  optim::unscale_check(compute_, {grad_segs_, grad_segs_dev_.as<optim::GradSegment>()}, e_.opt.working,
                       scaler_->inv_scale_device(), device_out, 2 * static_cast<int>(blocks.size()), flags);
  // Every rank of the mesh (every tensor coordinate too) must skip together: sum the flags over
  // all ranks, on the devices.
  if (e_.opt.processes)
    e_.opt.processes->all_reduce(r_, f32(flags, e_.world(), idx()), &compute_);
  else
    e_.comm.all_reduce(r_, f32(flags, e_.world(), idx()), &compute_, "overflow flag");
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

  optim::StepScalars sc;
  sc.inv_loss_scale = scaler_->inv_scale_device();
  sc.found_inf = scaler_->found_inf_device();
  sc.clip = st.grad_scale;
  sc.rounding = e_.opt.rounding;
  sc.seed = e_.opt.seed;
  if (st.step_on_device) sc.update_count = scaler_->update_count_device();
  const optim::SegmentList<optim::OptimizerSegment> segs{opt_segs_, opt_segs_dev_.as<optim::OptimizerSegment>()};
  if (arena_) offload_step(st, sc);
  if (st.adamw)
    optim::adamw_multi(compute_, segs, W, W, optim::AdamWConfig{st.lr, st.beta1, st.beta2, st.eps, st.step}, sc);
  else
    optim::sgd_multi(compute_, segs, W, W, optim::SgdConfig{st.lr, st.momentum, false, st.step}, sc);
  scaler_->update();  // dynamic scaling
  if (arena_) offload_after_device_update();
  if (policy_.gathers_params_after_step()) {
    for (size_t b = 0; b < blocks.size(); ++b) {
      // Offload: each block's all-gather waits for its own offloaded part only.
      if (blocks[b].params_back) comm_.wait(*blocks[b].params_back);
      data_all_gather(typed(blocks[b].params.data(), W, blocks[b].shard.padded_numel, idx()), &compute_,
                       L.block(static_cast<int>(b)).name);
    }
  }
}

// Offload: the host part of the update (see the README's "Optimizer offload"), enqueued before the
// device update of the rest so that its scalar copies read the flag and scale before anything
// changes them. The host updates run on the offload stream, block by block in host_order_, each
// followed (without the delay) by its copy back and params_back: the device update of the rest,
// the all-gathers (stages 1-2) and the next step's gathers (stage 3) of the blocks already back go
// on meanwhile. Each block's update is the same per-element AdamW/SGD, on the same scalars, as one
// update over every block: the same bits. With the delay the step first copies back the last
// step's update (which the next forward then uses) and this step's update stays pending until the
// next step, its forward and backward run with the parameters from before it.
void ZeroRank::offload_step(const OptimizerStep& st, const optim::StepScalars& sc) {
  const DType W = e_.opt.working;
  // A gradient changed after its copy (poke_gradient) or a step with fewer micro-batches than
  // configured: copy what is not on the host yet (compute already waits for comm).
  for (auto& blk : blocks) {
    const int64_t nh = host_count(blk);
    if (nh > 0 && !blk.grad_on_host) {
      if (!e_.opt.offload_delay) compute_.wait(*blk.params_back);  // the last update read it
      compute_.copy(host_grad(blk), accumulator(blk), bytes_of(nh, W));
    }
    blk.grad_on_host = false;
  }
  // The last step's host update must be done before the scalars are overwritten; with the delay
  // this is where the devices wait for it (its exposed time starts here).
  const uint64_t u = ++updates_issued_;
  if (e_.opt.offload_delay && update_pending_)
    compute_.host_func([this, u] { note_update_due(u - 1, e_.now_us()); });
  compute_.wait(*offload_done_);
  float* hs = host_scalars_.as<float>();
  compute_.copy(hs, scaler_->found_inf_device(), sizeof(float));
  if (sc.inv_loss_scale) compute_.copy(hs + 1, sc.inv_loss_scale, sizeof(float));
  if (sc.clip) compute_.copy(hs + 2, sc.clip, sizeof(float));
  // The count before the device update (enqueued after this) adds to it; each block's host update
  // counts a copy of it.
  if (sc.update_count) compute_.copy(hs + 3, sc.update_count, sizeof(uint32_t));
  compute_.record(*scalars_ready_);
  optim::StepScalars hsc = sc;
  hsc.found_inf = hs;
  hsc.inv_loss_scale = sc.inv_loss_scale ? hs + 1 : nullptr;
  hsc.clip = sc.clip ? hs + 2 : nullptr;
  hsc.update_count = nullptr;  // per block, below
  const bool count = sc.update_count != nullptr;
  Stream& os = *offload_;
  os.wait(*scalars_ready_);
  if (e_.opt.offload_delay) {
    // The last step's update, pending since then: back to the device now that this step's forward
    // and backward, which used the parameters from before it, are done (scalars_ready_ follows them).
    for (int b : host_order_) {
      Block& blk = block(b);
      if (blk.off <= 0) continue;
      if (update_pending_) copy_back(blk, os);
      os.record(*blk.params_back);
    }
  }
  std::shared_ptr<SpanStart> start = e_.tracing ? e_.open_span(os, issued_++) : nullptr;
  const std::vector<std::vector<optim::OptimizerSegment>>& lists = host_segs_[grad_parity_];
  int last_block = -1;  // the update's last block: its end is the update's end
  for (int b : host_order_)
    if (block(b).off > 0) last_block = b;
  if (last_block < 0) os.host_func([this, u] { note_update_done(u, e_.now_us(), e_.now_us()); });
  for (int b : host_order_) {
    Block& blk = block(b);
    if (blk.off <= 0) continue;
    const std::vector<optim::OptimizerSegment>* segs = &lists[static_cast<size_t>(b)];
    const bool last = b == last_block;
    os.host_func([this, st, hsc, W, segs, hs, count, u, last, b] {
      OptionalNvtxRange range;
      if (ranges_enabled()) range.open(NvtxCategory::kOptimizer, "host optimizer " + block_name(b), idx());
      const double start_us = e_.now_us();
      optim::StepScalars bsc = hsc;
      uint32_t n = 0;  // the update count as the device update reads it (each block counts its own copy)
      if (count) std::memcpy(&n, hs + 3, sizeof n), bsc.update_count = &n;
      if (st.adamw)
        optim::adamw_host(*segs, W, W, optim::AdamWConfig{st.lr, st.beta1, st.beta2, st.eps, st.step}, bsc);
      else
        optim::sgd_host(*segs, W, W, optim::SgdConfig{st.lr, st.momentum, false, st.step}, bsc);
      note_update_done(u, start_us, last ? e_.now_us() : -1);
    });
    if (!e_.opt.offload_delay) {
      copy_back(blk, os);
      os.record(*blk.params_back);
    }
  }
  if (start) e_.close_span(os, start, TraceSpan::kHostOptimizer, r_, -1);
  os.record(*offload_done_);
  if (e_.opt.offload_delay) {
    update_pending_ = true;
    grad_parity_ ^= 1;  // the next step's gradients go to the other copy
  }
}

void ZeroRank::offload_after_device_update() {
  // Without the delay the step's device work ends here: what of the host update is left is exposed
  // (at stage 3 the next forward may start on the blocks already back, so it is an upper bound).
  if (e_.opt.offload_delay) return;
  const uint64_t u = updates_issued_;
  compute_.host_func([this, u] { note_update_due(u, e_.now_us()); });
}

void ZeroRank::copy_back(Block& blk, Stream& s) {
  const int64_t nh = host_count(blk);
  if (nh <= 0) return;
  const DType W = e_.opt.working;
  const void* src = e_.mixed() ? blk.h_work.data() : blk.h_master.data();
  s.copy(at(blk.params.data(), W, param_offset(blk)), src, bytes_of(nh, W));
}

// An update's span is its first block's start to its last block's end (the copies back between
// blocks included); the part of it after the compute stream needed it is exposed.
void ZeroRank::note_update_due(uint64_t u, double us) {
  std::lock_guard<std::mutex> lock(clock_mu_);
  clocks_[u].due_us = us;
  add_update_clock(u);
}

void ZeroRank::note_update_done(uint64_t u, double start_us, double end_us) {
  std::lock_guard<std::mutex> lock(clock_mu_);
  UpdateClock& c = clocks_[u];
  if (c.start_us < 0) c.start_us = start_us;
  if (end_us >= 0) c.end_us = end_us;
  add_update_clock(u);
}

void ZeroRank::add_update_clock(uint64_t u) {
  const auto it = clocks_.find(u);
  const UpdateClock& c = it->second;
  if (c.due_us < 0 || c.end_us < 0) return;  // the other half is still to come
  host_seconds_.total += std::max(0.0, c.end_us - c.start_us) * 1e-6;
  host_seconds_.exposed += std::max(0.0, c.end_us - std::max(c.due_us, c.start_us)) * 1e-6;
  clocks_.erase(it);
}

ZeroRank::HostUpdateSeconds ZeroRank::take_host_update_seconds() {
  std::lock_guard<std::mutex> lock(clock_mu_);
  return std::exchange(host_seconds_, HostUpdateSeconds{});
}

void ZeroRank::apply_pending_update() {
  // The host waits for the pending update here: that wait is its exposed part.
  note_update_due(updates_issued_, e_.now_us());
  sync_offload();
  record_comm_and_wait(compute_);
  for (auto& blk : blocks) copy_back(blk, compute_);
  update_pending_ = false;
}

void ZeroRank::settle_offload() {
  if (!update_pending_) return;
  apply_pending_update();
  if (policy_.gathers_params_after_step()) {
    const DType W = e_.opt.working;
    for (size_t b = 0; b < blocks.size(); ++b)
      data_all_gather(typed(blocks[b].params.data(), W, blocks[b].shard.padded_numel, idx()), &compute_,
                      block_name(static_cast<int>(b)));
  }
  record_comm_and_wait(compute_);
  compute_.synchronize();
}

void ZeroRank::refresh_host_working(Block& blk) {
  const int64_t nh = host_count(blk);
  if (!e_.mixed() || nh <= 0) return;
  compute_.copy(blk.h_work.data(), at(blk.params.data(), e_.opt.working, param_offset(blk)), bytes_of(nh, e_.opt.working));
}

}  // namespace zt
