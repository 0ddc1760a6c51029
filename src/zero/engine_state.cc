// State I/O of the ZeRO engine: a rank's state to and from the host (checkpoints, tests, recovery),
// the blocks assembled across ranks, the switch of the working dtype. Not the hot path.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/status.h"
#include "kernels/ops.h"
#include "zero/engine_impl.h"

namespace zt {

// ---------------------------------------------------------------------------------------------
// ZeroRank: host transfers (checkpoints, tests, recovery; not the hot path).

void ZeroRank::load_parameters(const std::vector<std::vector<float>>& host) {
  const DType W = e_.opt.working;
  Stream& s = compute_;
  if (arena_) s.synchronize(), sync_offload();  // the host buffers are written below, on this thread
  update_pending_ = false;                        // every parameter is replaced
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
  scaler_->reset();  // synchronizes: the host vectors may go away
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
  settle_offload();  // the delayed update's parameters belong to the state saved with its moments
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
    sync_offload();
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
    sync_offload();
    update_pending_ = false;  // its result is replaced
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

ShardRange ZeroRank::shard_of(int b) const { return blocks.at(static_cast<size_t>(b)).shard; }

std::pair<int64_t, int64_t> ZeroRank::state_range(int b) const {
  const ShardRange sh = shard_of(b);
  if (!policy_.shard_optimizer) return {0, blocks.at(static_cast<size_t>(b)).numel};
  return {sh.begin, sh.end};
}

// ---------------------------------------------------------------------------------------------
// ZeroEngine: blocks assembled across ranks, the working dtype.

// Delayed update: ZeroRank::settle_offload for every rank from one thread (the all-gathers of
// stages 1-2 as group calls, as in set_working_dtype).
void EngineImpl::settle_offload() {
  EngineImpl& impl = *this;
  bool pending = false;
  for (auto& R : impl.ranks) pending = pending || R->update_pending_;
  if (!pending) return;
  for (auto& R : impl.ranks)
    if (R->update_pending_) R->apply_pending_update();
  if (impl.policy.gathers_params_after_step()) {
    const DType W = impl.opt.working;
    const std::vector<std::vector<int>> groups = impl.mesh.groups(MeshAxis::kData);
    for (size_t b = 0; b < impl.rank(0).blocks.size(); ++b)
      for (const std::vector<int>& members : groups) {
        std::vector<TensorView> full;
        std::vector<Stream*> producers;
        for (int r : members) {
          ZeroRank& R = impl.rank(r);
          const ZeroRank::Block& blk = R.blocks[b];
          full.push_back(typed(blk.params.data(), W, blk.shard.padded_numel, R.device().index()));
          producers.push_back(&R.compute_stream());
        }
        impl.comm.group(members).all_gather(full, producers);
      }
  }
  for (int r = 0; r < impl.local_size(); ++r) impl.comm.wait_done(r, impl.rank(r).compute_stream());
  for (Device* d : impl.devices) d->synchronize();
}

std::vector<float> ZeroEngine::block_to_host(int block, int tensor) {
  impl_->require_one_process("block_to_host");
  impl_->settle_offload();
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
  impl_->settle_offload();
  if (!impl_->mixed()) return block_to_host(block, tensor);
  const std::vector<int> ranks = impl_->tensor_ranks(tensor);
  for (Device* d : impl_->devices) d->synchronize();
  const ZeroRank::Block& b0 = impl_->rank(ranks[0]).block(block);
  std::vector<float> out(static_cast<size_t>(b0.numel));
  if (!impl_->policy.shard_optimizer) {
    to_host(impl_->rank(ranks[0]).staging(), impl_->rank(ranks[0]).compute_stream(), out.data(), b0.master.data(), b0.numel);
    return out;
  }
  for (int r : ranks) {
    const ZeroRank::Block& blk = impl_->rank(r).block(block);
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
  impl_->settle_offload();
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
          const ZeroRank::Block& blk = R.blocks[b];
          full.push_back(typed(blk.params.data(), working, blk.shard.padded_numel, R.device().index()));
          producers.push_back(&R.compute_stream());
        }
        impl_->comm.group(members).all_gather(full, producers);
      }
    }
  }
  for (int r = 0; r < N; ++r) {
    impl_->comm.wait_done(r, impl_->rank(r).compute_stream());
    impl_->rank(r).scaler_->reset();
  }
}

}  // namespace zt
