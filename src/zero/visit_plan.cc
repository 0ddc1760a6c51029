// Builds the engine's allocation description (resident buffers per block, transient operations
// per visit) and walks it for the memory plan. Everything here is linear in the visits: per-block
// flags replace searches of the visit order and of the live set.
#include "zero/visit_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "core/status.h"
#include "memory/caching_allocator.h"
#include "model/model.h"
#include "optimizers/optimizers.h"
#include "zero/options.h"
#include "zero/shard_plan.h"

namespace zt {

const char* buffer_role_label(BufferRole role) {
  switch (role) {
    case BufferRole::kParams: return "parameters";
    case BufferRole::kFullGradBucket: return "gradients";
    case BufferRole::kGradShardAccum: return "gradients";
    case BufferRole::kMaster:
    case BufferRole::kMomentM:
    case BufferRole::kMomentV: return "optimizer state";
    case BufferRole::kGathered: return "gathered parameters";
    case BufferRole::kComputeParams: return "compute parameters";
    case BufferRole::kComputeGrad: return "gradient bucket";
  }
  return "?";
}

int data_parallel_size(int world, const ZeroOptions& opt) {
  const int t = opt.tensor;
  if (t >= 1 && world >= 1 && world % t == 0) return world / t;
  // The divisor of `world` closest to t (the smaller one on a tie).
  int nearest = 1;
  for (int d = 1; d <= world; ++d)
    if (world % d == 0 && std::abs(d - t) < std::abs(nearest - t)) nearest = d;
  ZT_THROW(ErrorKind::kInvalidArgument, "a tensor-parallel degree of ", t, " does not divide the ", world,
           " devices; use a divisor of ", world, " (nearest: ", nearest, ")");
}

BlockBufferBytes block_buffer_bytes(int64_t numel, int world, const ZeroOptions& opt, DType activations) {
  const ShardingPolicy p = policy_for_stage(opt.stage);
  const ShardRange sh = shard_range(numel, 0, data_parallel_size(world, opt));
  const int64_t full = sh.padded_numel, shard = sh.shard_numel;
  const size_t w = dtype_size(opt.working);
  const bool mixed = opt.working != DType::kF32;
  const auto F = [](int64_t n) { return static_cast<size_t>(n) * sizeof(float); };
  const auto Wb = [w](int64_t n) { return static_cast<size_t>(n) * w; };
  const int64_t state = p.shard_optimizer ? shard : full;
  BlockBufferBytes b;
  b.offloaded = offloaded_elements(shard, opt);
  const int64_t k = b.offloaded;
  // Delayed update: a second gradient copy, which the next step's backward fills while the host
  // update reads the first.
  b.host = F(k) * (opt.sgd ? 2 : 3) + Wb(k) * ((mixed ? 2 : 1) + (opt.offload_delay ? 1 : 0));
  b[BufferRole::kParams] = Wb(p.shard_params ? shard : full);
  b[BufferRole::kFullGradBucket] = Wb(full);
  b[BufferRole::kGradShardAccum] = p.shard_grads || p.separate_accumulator(opt.micro_batches) ? Wb(shard) : 0;
  b[BufferRole::kMaster] = mixed ? F(state - k) : 0;
  b[BufferRole::kMomentM] = F(state - k);
  b[BufferRole::kMomentV] = opt.sgd ? 0 : F(state - k);
  b[BufferRole::kGathered] = p.shard_params ? Wb(full) : 0;
  b[BufferRole::kComputeParams] = widens_params(opt.working, activations) ? F(full) : 0;
  b[BufferRole::kComputeGrad] = mixed ? F(full) : 0;
  return b;
}

int64_t offloaded_elements(int64_t shard_numel, const ZeroOptions& opt) {
  if (!opt.offload) return 0;
  ZT_REQUIRE(opt.stage >= 1, "--offload optimizer needs --zero-stage 1, 2 or 3: at stage 0 every device keeps the "
             "whole optimizer state, which offload would copy to the host once per device");
  ZT_REQUIRE(opt.offload_fraction > 0.0f && opt.offload_fraction <= 1.0f, "--offload-fraction must be in (0, 1], got ",
             opt.offload_fraction);
  const auto k = static_cast<int64_t>(static_cast<double>(opt.offload_fraction) * static_cast<double>(shard_numel));
  return std::min(k, shard_numel);
}

std::vector<ResidentBuffer> resident_buffers(const BlockBufferBytes& sz, const ShardingPolicy& p) {
  std::vector<ResidentBuffer> out;
  out.push_back({BufferRole::kParams, sz[BufferRole::kParams]});
  if (!p.shard_grads) out.push_back({BufferRole::kFullGradBucket, sz[BufferRole::kFullGradBucket]});
  for (BufferRole r : {BufferRole::kGradShardAccum, BufferRole::kMaster, BufferRole::kMomentM, BufferRole::kMomentV})
    if (sz[r]) out.push_back({r, sz[r]});
  return out;
}

namespace {

// Tracks which transient buffers are live while the steps are generated (the engine's state at
// the same point of the micro-batch: everything is released at its end).
class StepBuilder {
 public:
  StepBuilder(VisitPlan& plan, const std::vector<BlockBufferBytes>& sizes)
      : plan_(plan), sizes_(sizes), live_(sizes.size() * kNumBufferRoles, 0) {}
  bool live(BufferRole r, int b) const { return live_[slot(r, b)] != 0; }
  void alloc(BufferRole r, int b) {
    live_[slot(r, b)] = 1;
    plan_.ops.push_back({true, r, b, sizes_[static_cast<size_t>(b)][r]});
  }
  void alloc_once(BufferRole r, int b) {
    if (!live(r, b)) alloc(r, b);
  }
  void free_if_live(BufferRole r, int b) {
    if (!live(r, b)) return;
    live_[slot(r, b)] = 0;
    plan_.ops.push_back({false, r, b, sizes_[static_cast<size_t>(b)][r]});
  }
  void begin(VisitStep::Kind kind, int b) {
    VisitStep s{kind, b};
    s.first_op = static_cast<uint32_t>(plan_.ops.size());
    plan_.steps.push_back(s);
  }
  void end() { plan_.steps.back().num_ops = static_cast<uint32_t>(plan_.ops.size()) - plan_.steps.back().first_op; }

 private:
  static size_t slot(BufferRole r, int b) { return static_cast<size_t>(b) * kNumBufferRoles + static_cast<size_t>(r); }
  VisitPlan& plan_;
  const std::vector<BlockBufferBytes>& sizes_;
  std::vector<uint8_t> live_;
};

struct Visit {
  int block;
  bool backward;
  bool keep;           // stays gathered after this visit (the forward visits the block again)
  bool last_backward;  // the block's last backward visit: its after_backward follows
};

// Forward then backward; a block seen again later in the forward (a tied embedding) stays
// gathered until then, and the forward's last block is the backward's first.
std::vector<Visit> make_visits(const std::vector<int>& fwd, const std::vector<int>& bwd, size_t num_blocks,
                               size_t* work) {
  std::vector<Visit> v(fwd.size() + bwd.size());
  std::vector<uint8_t> seen(num_blocks, 0);
  for (size_t i = fwd.size(); i-- > 0;) {
    const auto b = static_cast<size_t>(fwd[i]);
    ZT_CHECK(b < num_blocks, "the model's forward order names block ", fwd[i], " of ", num_blocks);
    v[i] = {fwd[i], false, seen[b] != 0, false};
    seen[b] = 1;
  }
  seen.assign(num_blocks, 0);
  for (size_t i = bwd.size(); i-- > 0;) {
    const auto b = static_cast<size_t>(bwd[i]);
    ZT_CHECK(b < num_blocks, "the model's backward order names block ", bwd[i], " of ", num_blocks);
    v[fwd.size() + i] = {bwd[i], true, false, seen[b] == 0};
    seen[b] = 1;
  }
  *work += 2 * num_blocks + v.size();
  return v;
}

}  // namespace

namespace {

// Assigns each allocation its arena offset (see VisitPlan), as compilers' buffer assignment does
// (TFLite's greedy by size): the largest buffers first, each at the smallest gap between the
// already placed buffers whose lifetimes overlap its own that fits it (else above them). Placing
// in plan order instead fragments: GPT's tied embedding, gathered again at the backward's end,
// finds its first range split by the layers' buffers. The overlapping pairs are found by walking
// the operations: a buffer overlaps exactly the buffers live when it is allocated and those
// allocated while it is live. The live set is a few buffers (a block's transients, the prefetched
// block, the buckets in reduction, the tied embedding's), so the pairs, and the work, stay linear
// in the visits (plus sorting the buffers by size).
void place_in_arena(VisitPlan& plan) {
  struct Buffer {
    size_t op, size;
    size_t begin = 0;
    bool placed = false;
    std::vector<uint32_t> overlaps;
  };
  std::vector<Buffer> bufs;
  std::vector<std::pair<size_t, uint32_t>> live;  // (block * kNumBufferRoles + role, buffer)
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const BufferOp& op = plan.ops[i];
    const size_t slot = static_cast<size_t>(op.block) * kNumBufferRoles + static_cast<size_t>(op.role);
    const size_t r = pool_rounded_size(op.bytes);
    plan.work += 1 + live.size();
    if (r == 0) continue;
    if (!op.alloc) {
      std::erase_if(live, [&](const std::pair<size_t, uint32_t>& x) { return x.first == slot; });
      continue;
    }
    const auto id = static_cast<uint32_t>(bufs.size());
    bufs.push_back(Buffer{i, r, 0, false, {}});
    for (const auto& [s, other] : live) {
      bufs[id].overlaps.push_back(other);
      bufs[other].overlaps.push_back(id);
    }
    live.emplace_back(slot, id);
  }
  std::vector<uint32_t> order(bufs.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return bufs[a].size > bufs[b].size; });
  plan.work += order.size() * (1 + static_cast<size_t>(std::log2(static_cast<double>(order.size()) + 1)));
  std::vector<std::pair<size_t, size_t>> taken;  // the placed overlapping buffers' ranges
  for (uint32_t id : order) {
    Buffer& b = bufs[id];
    taken.clear();
    for (uint32_t o : b.overlaps)
      if (bufs[o].placed) taken.emplace_back(bufs[o].begin, bufs[o].begin + bufs[o].size);
    std::sort(taken.begin(), taken.end());
    plan.work += 1 + b.overlaps.size();
    size_t at = 0, best = SIZE_MAX, below = 0;
    for (const auto& [lo, hi] : taken) {
      if (lo >= below && lo - below >= b.size && lo - below < best) best = lo - below, at = below;
      below = std::max(below, hi);
    }
    if (best == SIZE_MAX) at = below;
    b.begin = at;
    b.placed = true;
    plan.ops[b.op].offset = at;
    plan.arena_bytes = std::max(plan.arena_bytes, at + b.size);
  }
}

}  // namespace

VisitPlan make_visit_plan(const std::vector<int>& fwd, const std::vector<int>& bwd,
                          const std::vector<BlockBufferBytes>& sizes, const ShardingPolicy& p, bool mixed,
                          bool widen, bool forward_only) {
  ZT_CHECK(mixed || !widen, "fp32 compute copies of fp32 working parameters");
  VisitPlan plan;
  const std::vector<Visit> S = make_visits(fwd, bwd, sizes.size(), &plan.work);
  const size_t limit = forward_only ? fwd.size() : S.size();
  StepBuilder sb(plan, sizes);
  // Reduce-scattered buckets not yet freed, with the backward visits left until they are (see
  // VisitPlan: the comm stream may still read them).
  std::vector<std::pair<int, int>> reducing;
  for (size_t pos = 0; pos < limit; ++pos) {
    const Visit& v = S[pos];
    const int b = v.block;
    sb.begin(v.backward ? VisitStep::kBackward : VisitStep::kForward, b);
    if (v.backward) {
      for (auto& [block, left] : reducing)
        if (--left == 0) sb.free_if_live(BufferRole::kFullGradBucket, block);
      std::erase_if(reducing, [](const std::pair<int, int>& r) { return r.second == 0; });
    }
    if (pos > 0 && S[pos - 1].block != b && !S[pos - 1].keep) {
      sb.free_if_live(BufferRole::kGathered, S[pos - 1].block);
      sb.free_if_live(BufferRole::kComputeParams, S[pos - 1].block);
    }
    if (p.shard_params) {
      sb.alloc_once(BufferRole::kGathered, b);
      if (pos + 1 < limit) sb.alloc_once(BufferRole::kGathered, S[pos + 1].block);  // the prefetch
    }
    if (widen) sb.alloc_once(BufferRole::kComputeParams, b);
    if (v.backward && mixed) sb.alloc_once(BufferRole::kComputeGrad, b);
    if (v.backward && !mixed && p.shard_grads) sb.alloc_once(BufferRole::kFullGradBucket, b);
    sb.end();
    if (v.last_backward) {
      // The fp32 gradient is rounded into a 16-bit bucket allocated while it is still live; the
      // transient bucket goes once its reduce-scatter is enqueued.
      sb.begin(VisitStep::kAfterBackward, b);
      if (mixed && p.shard_grads) sb.alloc(BufferRole::kFullGradBucket, b);
      if (mixed) sb.free_if_live(BufferRole::kComputeGrad, b);
      if (p.shard_grads) reducing.emplace_back(b, kBucketReuseLag);
      sb.end();
    }
  }
  plan.work += limit;
  place_in_arena(plan);
  return plan;
}

TransientPeak transient_peak(const VisitPlan& plan, int num_blocks) {
  TransientPeak out;
  // First pass: the running total and the operation after which it peaks; second pass: replay up
  // to there to name the live buffers (no live-set copy per new maximum).
  size_t total = 0, peak_at = 0;
  bool any = false;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const BufferOp& op = plan.ops[i];
    const size_t r = pool_rounded_size(op.bytes);
    if (!op.alloc) {
      total -= r;
      continue;
    }
    total += r;
    if (!any || total > out.pool_bytes) out.pool_bytes = total, peak_at = i, any = true;
  }
  out.work += plan.ops.size();
  if (!any) return out;
  std::vector<int64_t> where(static_cast<size_t>(num_blocks) * kNumBufferRoles, -1);
  for (size_t i = 0; i <= peak_at; ++i) {
    const BufferOp& op = plan.ops[i];
    where[static_cast<size_t>(op.block) * kNumBufferRoles + static_cast<size_t>(op.role)] =
        op.alloc ? static_cast<int64_t>(i) : -1;
  }
  for (int64_t i : where)
    if (i >= 0) out.live.push_back(plan.ops[static_cast<size_t>(i)]);
  out.work += peak_at + 1 + where.size();
  return out;
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

EngineMemoryPlan plan_engine_memory(const Model& model, int world, const ZeroOptions& opt) {
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
  size_t arena = 0;  // as EngineImpl::make_plans sizes it
  for (bool forward_only : {false, true}) {
    const VisitPlan vp = make_visit_plan(fwd, bwd, sizes, p, mixed, widen, forward_only);
    arena = std::max(arena, vp.arena_bytes);
    plan.work += vp.work;
  }
  if (arena > 0) plan.train_peak = plan.forward_peak = {PlannedBuffer{arena, false, true}};
  return plan;
}

}  // namespace zt
