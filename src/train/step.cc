// One training step on every rank (see step.h).
#include "train/step.h"

#include <algorithm>
#include <cmath>

#include "core/nvtx.h"
#include "kernels/ops.h"
#include "train/graph_step.h"
#include "train/processes.h"

namespace zt {

namespace {

// Forward/backward of every micro-batch of the step on rank r, then its gradient check. The host
// does not wait inside: each micro-batch's loss is summed on the device (ops::sum) into the step's
// loss, and one synchronisation at the end reads it with the gradient-norm partials, the overflow
// flag and the loss scale. The phases of the step are timed by events on the compute stream.
// With --cuda-graphs the forward and backward go through the rank's MicroBatchGraph (captured
// after a warm-up micro-batch, then replayed); the upload, the engine's begin/end hooks and the
// loss sum stay eager around it, as do the engine's per-block hooks (graph_step.h).
void rank_step(World& world, const RunContext& run, int step, int r, float dloss, StepPhaseTimer& timer) {
  RankState& R = world.rank(r);
  Device& d = world.device(r);
  Stream& s = d.compute();
  ZeroEngine& engine = world.engine();
  const int accum = world.split().accum;
  const NvtxRange rank_range(NvtxCategory::kStep, "step " + std::to_string(step + 1), d.index());
  if (!R.graph && use_cuda_graphs(run.cfg, d.backend(), run.working))
    R.graph = std::make_shared<MicroBatchGraph>(run.cfg.cuda_graphs == CudaGraphs::kOn);
  float* const norms = R.norms.as<float>();
  const int64_t partials = static_cast<int64_t>(R.norm_host.size()) - 1;  // the loss sum follows them
  const TensorView step_loss{norms + partials, DType::kF32, Shape{1}, d.index()};
  const TensorView micro_loss{norms + partials + 1, DType::kF32, Shape{1}, d.index()};
  const ConstTensorView losses{R.ws->losses().data, DType::kF32, Shape{static_cast<int64_t>(R.losses.size())},
                               d.index()};
  s.record(*R.step_begin);
  for (int m = 0; m < accum; ++m) {
    HostBatch& staged = R.staged[static_cast<size_t>(m)];
    {
      const NvtxRange data_range(NvtxCategory::kData, "data", d.index());
      staged = R.prefetch->get(static_cast<int64_t>(step) * accum + m);  // reuses staged's capacity
    }
    world.upload(r, staged);
    R.batch.loss_scale = engine.loss_scale_device(r);
    engine.begin_micro_batch(r, m);
    if (R.graph) {
      R.graph->run(world.model(), s, engine.access(r), *R.ws, R.batch, dloss);
    } else {
      world.model().forward(s, engine.access(r), *R.ws, R.batch, dloss, true);
      world.model().backward(s, engine.access(r), *R.ws, R.batch);
    }
    engine.end_micro_batch(r);
    ops::sum(s, m == 0 ? step_loss : micro_loss, losses);
    if (m > 0) ops::add(s, step_loss, step_loss, micro_loss);
  }
  s.record(*R.compute_done);
  for (const GradientFault& f : run.cfg.gradient_faults)
    if (f.step == step + 1 && f.rank == r) engine.poke_gradient(r, f.block, f.offset, f.value);
  engine.check_gradients(r, norms);
  s.copy(R.norm_host.data(), norms, R.norm_host.size() * 4);  // the partials, then the step's loss sum
  s.copy(&R.found_inf, engine.found_inf_device(r), sizeof(float));
  s.copy(&R.scale, engine.loss_scale_state_device(r), sizeof R.scale);  // the scale this step's backward used
  s.record(*R.grads_ready);
  s.synchronize();  // the step's one host synchronisation on this rank
  R.loss_sum = R.norm_host.back();
  timer.rank_phases(r, R.compute_done->seconds_since(*R.step_begin), R.grads_ready->seconds_since(*R.compute_done));
  timer.rank_recompute(r, R.ws->take_recompute_seconds());
  // The previous step's update ran on this stream before step_begin: its events are complete.
  if (R.opt_pending)
    timer.rank_optimizer(r, R.opt_end->seconds_since(*R.opt_begin), engine.host_update_seconds(r));
  R.opt_pending = false;
}

// Rank r's step as a pipeline stage: its data rank's micro-batches uploaded and handed to the
// stage's runner, the stage's list of the schedule enqueued (receives block the host thread until
// the neighbour posted the send, nothing else waits), then the stage's gradients reduced once over
// its data ranks — the embeddings' and the head copy's summed first between the first and the last
// stage (Megatron's tied-embedding all-reduce) — and checked; one synchronisation reads it all.
void pipeline_rank_step(World& world, const RunContext& run, int step, int r, float dloss, StepPhaseTimer& timer) {
  RankState& R = world.rank(r);
  Device& d = world.device(r);
  Stream& s = d.compute();
  PipelineParts& pp = world.pipeline();
  const auto ri = static_cast<size_t>(r);
  const int stage = world.stage_of(r), P = world.mesh().shape().pipeline, local = world.engine_rank(r);
  ZeroEngine& engine = world.engine_of(r);
  ModelStageWork& work = *pp.work[ri];
  const int accum = world.split().accum;
  const NvtxRange rank_range(NvtxCategory::kStep, "step " + std::to_string(step + 1), d.index());
  s.record(*R.step_begin);
  for (int m = 0; m < accum; ++m) {
    HostBatch& staged = R.staged[static_cast<size_t>(m)];
    {
      const NvtxRange data_range(NvtxCategory::kData, "data", d.index());
      staged = R.prefetch->get(static_cast<int64_t>(step) * accum + m);
    }
    s.copy(pp.inputs[ri][static_cast<size_t>(m)].data(), staged.tokens.data(), staged.tokens.size() * 4);
    s.copy(pp.targets[ri][static_cast<size_t>(m)].data(), staged.targets.data(), staged.targets.size() * 4);
    Batch& batch = pp.batches[ri][static_cast<size_t>(m)];
    batch.loss_scale = engine.loss_scale_device(local);  // the head stage's loss gradient reads it
    work.set_batch(m, batch, dloss);
  }
  engine.begin_pipeline_step(local);
  std::vector<StageSpan>& spans = pp.spans[ri];
  spans.clear();
  StageRunOptions opt;
  if (world.mesh().index(MeshAxis::kData, r) == 0 || pp.all_spans) opt.spans = &spans;
  run_pipeline_stage(pp.schedule, stage, world.comm(), world.mesh().pipeline_group(r), work, opt);
  s.record(*R.compute_done);
  const int tied = (stage == 0 || stage == P - 1) ? tied_embedding_block(world.model_of(r)) : -1;
  const MeshCoord me = world.mesh().coord(r);  // the partner: same data and tensor coordinates
  const int partner = world.mesh().rank_at({.data = me.data, .tensor = me.tensor, .pipeline = stage == 0 ? P - 1 : 0});
  engine.reduce_pipeline_gradients(local, [&](int b, TensorView g) {
    if (b != tied) return;
    // Both ends compute own + other: the same bits (addition commutes), so both copies stay equal.
    const TensorView other{pp.tied_scratch[ri].data(), DType::kF32, g.shape, d.index()};
    world.comm().send_recv(r, partner, g, partner, other, &s);
    world.comm().wait_done(r, s);
    ops::add(s, g, g, other);
  });
  float* const norms = R.norms.as<float>();
  engine.check_gradients(local, norms);
  s.copy(R.norm_host.data(), norms, (R.norm_host.size() - 1) * 4);
  s.copy(&R.found_inf, engine.found_inf_device(local), sizeof(float));
  s.copy(&R.scale, engine.loss_scale_state_device(local), sizeof R.scale);
  s.record(*R.grads_ready);
  s.synchronize();  // the step's one host synchronisation on this rank
  R.loss_sum = work.loss_sum();  // the head stage's; 0 elsewhere
  if (stage == P - 1 && P > 1 && tied >= 0) {
    // The head's copy of the embeddings holds the same summed gradient as the first stage's: count it once.
    const size_t nb = (R.norm_host.size() - 1) / 2;
    R.norm_host[static_cast<size_t>(tied)] = R.norm_host[nb + static_cast<size_t>(tied)] = 0;
  }
  timer.rank_phases(r, R.compute_done->seconds_since(*R.step_begin), R.grads_ready->seconds_since(*R.compute_done));
  if (R.opt_pending) timer.rank_optimizer(r, R.opt_end->seconds_since(*R.opt_begin), 0);
  R.opt_pending = false;
}

}  // namespace

void settle_step_timing(World& world, StepPhaseTimer& timer) {
  for (int r = 0; r < world.size(); ++r) {
    RankState& R = world.rank(r);
    if (!R.opt_pending) continue;
    R.opt_end->synchronize();
    timer.rank_optimizer(r, R.opt_end->seconds_since(*R.opt_begin),
                         world.engine_of(r).host_update_seconds(world.engine_rank(r)));
    R.opt_pending = false;
  }
}

StepStats train_step(World& world, const RunContext& run, int step, float lr, int64_t updates, StepPhaseTimer& timer) {
  const TrainConfig& cfg = run.cfg;
  const int N = world.size();
  // Every real position weighs the same in the step's objective, however the rows are split.
  const double positions = static_cast<double>(world.split().batch) * run.T;
  const float dloss = 1.0f / static_cast<float>(static_cast<int64_t>(world.split().batch) * run.T);
  timer.begin_step();
  world.for_ranks([&](int r) {
    if (world.pipelined())
      pipeline_rank_step(world, run, step, r, dloss, timer);
    else
      rank_step(world, run, step, r, dloss, timer);
  });
  if (world.pipelined()) {
    // The measured bubble of data rank 0's stages (their compute spans, complete after the sync).
    PipelineParts& pp = world.pipeline();
    std::vector<StageSpan> all;  // data rank 0's stages
    for (int r = 0; r < N; ++r)
      if (world.mesh().index(MeshAxis::kData, r) == 0)
        all.insert(all.end(), pp.spans[static_cast<size_t>(r)].begin(), pp.spans[static_cast<size_t>(r)].end());
    pp.bubble_sum += measure_bubble(all, world.mesh().shape().pipeline).fraction;
    ++pp.bubble_steps;
  }

  StepStats st;
  st.lr = lr;
  for (int r = 0; r < N; ++r)
    if (const auto& g = world.rank(r).graph) {
      st.graphs = st.graphs || g->replays() > 0;
      if (std::string n = g->take_note(); !n.empty() && st.note.empty()) st.note = std::move(n);
    }
  // Global loss and gradient norm, summed in a fixed order (rank, then block). With tensor
  // parallelism every rank of a tensor group holds the same losses and the same replicated
  // parameters' gradients: those are counted once, from the group's first rank.
  double loss_sum = 0, sq = 0;
  if (run.processes) {
    // Several processes: every global rank's partials and loss sum, in rank order, summed in the
    // order one process driving every device sums them. Global rank g is local rank g % N of its
    // process, with the same tensor coordinate (the tensor axis lives inside a process).
    std::vector<double> mine;
    for (int r = 0; r < N; ++r) mine.insert(mine.end(), world.rank(r).norm_host.begin(), world.rank(r).norm_host.end());
    const std::vector<double> all = run.processes->all_gather(mine, "the step's losses and gradient norms");
    const size_t per_rank = world.rank(0).norm_host.size(), partials = per_rank - 1;
    for (size_t g = 0; g < all.size() / per_rank; ++g) {
      const double* norms = all.data() + g * per_rank;
      const int r = static_cast<int>(g % static_cast<size_t>(N));
      const bool lead = world.tensor_lead(r);
      if (world.loss_lead(r)) loss_sum += norms[partials];
      for (size_t b = 0; b < partials; ++b)
        if (lead || b < partials / 2) sq += norms[b];
    }
  }
  for (int r = 0; r < N && !run.processes; ++r) {
    const bool lead = world.tensor_lead(r);
    if (world.loss_lead(r)) loss_sum += world.rank(r).loss_sum;
    // [0, B): each block's split part; [B, 2B): its replicated tail (ZeroEngine::check_gradients);
    // then the loss sum.
    const auto& norms = world.rank(r).norm_host;
    const size_t partials = norms.size() - 1;
    for (size_t b = 0; b < partials; ++b)
      if (lead || b < partials / 2) sq += norms[b];
  }
  st.grad_norm = std::sqrt(sq);
  st.loss = loss_sum / positions;
  st.loss_scale = world.rank(0).scale.scale;
  // Skip the update when some gradient (or the loss itself) is not finite: every rank read the
  // same combined flag on its device; a non-finite loss with finite gradients is flagged here.
  // Pipeline stages are separate engines: any stage's flag skips the step on all of them.
  bool flagged_everywhere = true;
  for (int r = 0; r < N; ++r) {
    st.skipped = st.skipped || world.rank(r).found_inf > 0;
    flagged_everywhere = flagged_everywhere && world.rank(r).found_inf > 0;
  }
  if (!st.skipped && !std::isfinite(st.loss)) st.skipped = true, flagged_everywhere = false;
  if (st.skipped && !flagged_everywhere)
    world.for_ranks([&](int r) { world.engine_of(r).mark_overflow(world.engine_rank(r)); });
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
  // No wait: the update's time comes from its events, read after the next synchronisation
  // (the next step's, or settle_step_timing after the last step).
  world.for_ranks([&](int r) {
    const NvtxRange rank_range(NvtxCategory::kStep, "step " + std::to_string(step + 1), world.device(r).index());
    RankState& R = world.rank(r);
    Stream& s = world.device(r).compute();
    s.record(*R.opt_begin);
    world.engine_of(r).optimizer_step(world.engine_rank(r), os);
    s.record(*R.opt_end);
    R.opt_pending = true;
  });
  timer.optimizer_done();
  return st;
}

}  // namespace zt
