// One training step on every rank (see step.h).
#include "train/step.h"

#include <algorithm>
#include <cmath>

#include "core/nvtx.h"

namespace zt {

namespace {

// Forward/backward of every micro-batch of the step on rank r, then its gradient check.
void rank_step(World& world, const RunContext& run, int step, int r, float dloss, StepPhaseTimer& timer) {
  RankState& R = world.rank(r);
  Device& d = world.device(r);
  Stream& s = d.compute();
  ZeroEngine& engine = world.engine();
  const int accum = world.split().accum;
  const NvtxRange rank_range(NvtxCategory::kStep, "step " + std::to_string(step + 1), d.index());
  R.loss_sum = 0;
  for (int m = 0; m < accum; ++m) {
    const HostBatch& hb = [&]() -> const HostBatch& {
      const NvtxRange data_range(NvtxCategory::kData, "data", d.index());
      return R.prefetch->get(static_cast<int64_t>(step) * accum + m);
    }();
    world.upload(r, hb);
    R.batch.loss_scale = engine.loss_scale_device(r);
    engine.begin_micro_batch(r, m);
    world.model().forward(s, engine.access(r), *R.ws, R.batch, dloss, true);
    world.model().backward(s, engine.access(r), *R.ws, R.batch);
    engine.end_micro_batch(r);
    R.loss_sum += world.read_losses(r);  // synchronizes: hb may be recycled by the prefetcher after this
  }
  timer.rank_compute_done(r);
  timer.rank_recompute(r, R.ws->take_recompute_seconds());  // read_losses synchronized the stream
  for (const GradientFault& f : run.cfg.gradient_faults)
    if (f.step == step + 1 && f.rank == r) engine.poke_gradient(r, f.block, f.offset, f.value);
  engine.check_gradients(r, R.norms.as<float>());
  s.copy(R.norm_host.data(), R.norms.data(), R.norm_host.size() * 4);
  s.copy(&R.found_inf, engine.found_inf_device(r), sizeof(float));
  s.copy(&R.scale, engine.loss_scale_state_device(r), sizeof R.scale);  // the scale this step's backward used
  s.synchronize();
}

}  // namespace

StepStats train_step(World& world, const RunContext& run, int step, float lr, int64_t updates, StepPhaseTimer& timer) {
  const TrainConfig& cfg = run.cfg;
  const int N = world.size();
  ZeroEngine& engine = world.engine();
  // Every real position weighs the same in the step's objective, however the rows are split.
  const double positions = static_cast<double>(world.split().batch) * run.T;
  const float dloss = 1.0f / static_cast<float>(static_cast<int64_t>(world.split().batch) * run.T);
  timer.begin_step();
  world.for_ranks([&](int r) { rank_step(world, run, step, r, dloss, timer); });
  timer.gradients_ready();

  StepStats st;
  st.lr = lr;
  // Global loss and gradient norm, summed in a fixed order (rank, then block). With tensor
  // parallelism every rank of a tensor group holds the same losses and the same replicated
  // parameters' gradients: those are counted once, from the group's first rank.
  double loss_sum = 0, sq = 0;
  for (int r = 0; r < N; ++r) {
    const bool lead = world.tensor_lead(r);
    if (lead) loss_sum += world.rank(r).loss_sum;
    // [0, B): each block's split part; [B, 2B): its replicated tail (ZeroEngine::check_gradients).
    const auto& norms = world.rank(r).norm_host;
    for (size_t b = 0; b < norms.size(); ++b)
      if (lead || b < norms.size() / 2) sq += norms[b];
  }
  st.grad_norm = std::sqrt(sq);
  st.loss = loss_sum / positions;
  st.loss_scale = world.rank(0).scale.scale;
  // Skip the update when some gradient (or the loss itself) is not finite: every rank read the
  // same combined flag on its device; a non-finite loss with finite gradients is flagged here.
  st.skipped = world.rank(0).found_inf > 0;
  if (!st.skipped && !std::isfinite(st.loss)) {
    st.skipped = true;
    world.for_ranks([&](int r) { engine.mark_overflow(r); });
  }
  OptimizerStep os;
  os.adamw = cfg.optimizer == OptimizerKind::kAdamW;
  os.lr = lr;
  os.beta1 = cfg.beta1;
  os.beta2 = cfg.beta2;
  os.eps = cfg.adam_eps;
  os.weight_decay = cfg.weight_decay;
  os.momentum = cfg.momentum;
  os.step = static_cast<int>(updates) + 1;  // a skipped step makes no update
  os.grad_scale = !st.skipped && cfg.grad_clip > 0 && st.grad_norm > cfg.grad_clip
                      ? static_cast<float>(cfg.grad_clip / st.grad_norm)
                      : 1.0f;
  timer.optimizer_begin();
  // The sync makes the optimizer's time measurable (train/report.h); it changes no result.
  world.for_ranks([&](int r) {
    const NvtxRange rank_range(NvtxCategory::kStep, "step " + std::to_string(step + 1), world.device(r).index());
    engine.optimizer_step(r, os);
    world.device(r).compute().synchronize();
  });
  timer.optimizer_done();
  if (cfg.offload_optimizer) {
    double host = 0;
    for (int r = 0; r < N; ++r) host = std::max(host, engine.host_update_seconds(r));
    timer.add_host_optimizer(host);
  }
  return st;
}

}  // namespace zt
