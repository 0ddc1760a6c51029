// One training step on every rank (see step.h).
#include "train/step.h"

#include <algorithm>
#include <cmath>

#include "core/nvtx.h"
#include "kernels/ops.h"
#include "train/graph_step.h"
#include "train/processes.h"
#include "train/signals.h"

namespace zt {

namespace {

static_assert(kStepHostBytes == 3 * sizeof(double) + sizeof(optim::LossScaleState));

// The include mask of the step's rows (optim::clip_factor), uploaded at the rank's first step:
// which entries count, as the host sums them (host_step_scalars) — a tensor group's replicated
// tails ([B, 2B)) and its loss from the group's first rank only.
void upload_step_include(World& world, int r) {
  RankState& R = world.rank(r);
  if (!R.step_include_host.empty()) return;
  const int N = world.size();
  const size_t row = R.norm_host.size() + 1, partials = row - 2;
  R.step_include_host.assign(static_cast<size_t>(N) * row, 0.0f);
  for (int g = 0; g < N; ++g) {
    float* in = R.step_include_host.data() + static_cast<size_t>(g) * row;
    for (size_t b = 0; b < partials; ++b) in[b] = world.tensor_lead(g) || b < partials / 2 ? 1.0f : 0.0f;
    in[partials] = world.loss_lead(g) ? 1.0f : 0.0f;
    in[partials + 1] = 1.0f;
  }
  world.device(r).compute().copy(R.step_include.data(), R.step_include_host.data(), R.step_include_host.size() * 4);
}

float* clip_device(RankState& R) { return reinterpret_cast<float*>(R.step_out.as<double>() + 3); }

// Rank r's share of the step's global scalars, all on the device: its row into the gathered rows,
// the all-gather over every rank, optim::clip_factor (which also marks a non-finite loss as an
// overflow), then an asynchronous copy of the result and the loss-scale state into pinned host
// memory (the step slot's), marked by its grads_ready. The host reads them later (read_step).
void device_step_scalars(World& world, const RunContext& run, int r, int slot) {
  RankState& R = world.rank(r);
  Device& d = world.device(r);
  Stream& s = d.compute();
  ZeroEngine& engine = world.engine();
  // Clipping is the optimizer's (its factor is all this computes besides what the host reads).
  const NvtxRange range(NvtxCategory::kOptimizer, "global norm + clip factor", d.index());
  upload_step_include(world, r);
  const int N = world.size();
  const size_t row = R.norm_host.size() + 1;
  float* rows = R.step_rows.as<float>();
  float* mine = rows + static_cast<size_t>(r) * row;
  s.copy(mine, R.norms.data(), (row - 1) * 4);  // the partials, then the step's loss sum
  s.copy(mine + row - 1, engine.rank(r).scaler().found_inf_device(), sizeof(float));
  const uint64_t sent = world.comm().counters(r).bytes_sent;
  world.comm().all_gather(r, TensorView{rows, DType::kF32, Shape{static_cast<int64_t>(N * row)}, d.index()}, &s,
                          "step scalars");
  R.scalar_bytes += world.comm().counters(r).bytes_sent - sent;  // counted when enqueued, before the return
  world.comm().wait_done(r, s);
  optim::clip_factor(s, rows, R.step_include.as<float>(), N, static_cast<int>(row), run.cfg.grad_clip,
                     R.step_out.as<double>(), clip_device(R), engine.rank(r).scaler().overflow_flag_device());
  auto* host = static_cast<char*>(R.step_host[static_cast<size_t>(slot)].data());
  s.copy(host, R.step_out.data(), 3 * sizeof(double));
  s.copy(host + 3 * sizeof(double), engine.rank(r).scaler().state_device(), sizeof(optim::LossScaleState));
  s.record(*R.events[static_cast<size_t>(slot)].grads_ready);
}

// After the step's update completed (opt_end of its slot): its phases and its update's time.
void read_rank_timing(World& world, int r, int slot, StepPhaseTimer& timer) {
  RankState& R = world.rank(r);
  const RankState::StepEvents& ev = R.events[static_cast<size_t>(slot)];
  timer.rank_phases(r, ev.compute_done->seconds_since(*ev.step_begin), ev.grads_ready->seconds_since(*ev.compute_done));
  timer.rank_recompute(r, world.stages().take_recompute_seconds(r));
  const ZeroRank::HostUpdateSeconds host = world.engine_of(r).rank(world.engine_rank(r)).take_host_update_seconds();
  timer.rank_optimizer(r, ev.opt_end->seconds_since(*ev.opt_begin), host.total, host.exposed);
}

}  // namespace

// One stage: forward/backward of every micro-batch of the step on rank r, then its gradient check
// and its share of the step's scalars (device_step_scalars). The host does not wait: each
// micro-batch's loss is summed on the device (ops::sum) into the step's loss, which the scalars
// carry. The phases of the step are timed by events on the compute stream.
// With --cuda-graphs the forward and backward go through the rank's MicroBatchGraph (captured
// after a warm-up micro-batch, then replayed); the upload, the engine's begin/end hooks and the
// loss sum stay eager around it, as do the engine's per-block hooks (graph_step.h).
void OneStage::rank_step(World& world, const RunContext& run, int step, int r, float dloss) {
  RankState& R = world.rank(r);
  Workspace& ws = *ws_[static_cast<size_t>(r)];
  Batch& batch = R.batches[0];
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
  const ConstTensorView losses{ws.losses().data, DType::kF32, Shape{static_cast<int64_t>(R.losses.size())},
                               d.index()};
  const int slot = step % kStepSlots;
  const RankState::StepEvents& ev = R.events[static_cast<size_t>(slot)];
  s.record(*ev.step_begin);
  for (int m = 0; m < accum; ++m) {
    const HostBatch* hb = nullptr;  // valid until the next get()
    {
      const NvtxRange data_range(NvtxCategory::kData, "data", d.index());
      hb = &R.prefetch->get(static_cast<int64_t>(step) * accum + m);
    }
    world.upload(r, *hb, 0, slot * accum + m);  // through the step's pinned slot (RankState::staged)
    batch.loss_scale = engine.rank(r).scaler().scale_device();
    engine.rank(r).begin_micro_batch(m);
    if (R.graph) {
      R.graph->run(world.model(), s, engine.rank(r), ws, batch, dloss);
    } else {
      world.model().forward(s, engine.rank(r), ws, batch, dloss, true);
      world.model().backward(s, engine.rank(r), ws, batch);
    }
    engine.rank(r).end_micro_batch();
    ops::sum(s, m == 0 ? step_loss : micro_loss, losses);
    if (m > 0) ops::add(s, step_loss, step_loss, micro_loss);
  }
  s.record(*ev.compute_done);
  for (const GradientFault& f : run.cfg.test.gradient_faults)
    if (f.step == step + 1 && f.rank == r) engine.rank(r).poke_gradient(f.block, f.offset, f.value);
  engine.rank(r).check_gradients(norms);
  if (world.host_scalars()) {
    // Several processes or pipeline stages: the host sums every process's partials (enqueue_step) and sends the clip
    // factor back; this rank's scalars are read with one synchronisation.
    s.copy(R.norm_host.data(), norms, R.norm_host.size() * 4);  // the partials, then the step's loss sum
    s.copy(&R.found_inf, engine.rank(r).scaler().found_inf_device(), sizeof(float));
    s.copy(&R.scale, engine.rank(r).scaler().state_device(), sizeof R.scale);  // the scale this step's backward used
    s.record(*ev.grads_ready);
    s.synchronize();  // the step's one host synchronisation on this rank
    R.loss_sum = R.norm_host.back();
    return;
  }
  device_step_scalars(world, run, r, slot);
}

// Rank r's step as a pipeline stage: its data rank's micro-batches uploaded and handed to the
// stage's runner, the stage's list of the schedule enqueued (receives block the host thread until
// the neighbour posted the send, nothing else waits), then the stage's gradients reduced once over
// its data ranks — the embeddings' and the head copy's summed first between the first and the last
// stage (Megatron's tied-embedding all-reduce) — and checked; one synchronisation reads it all.
void PipelineStages::rank_step(World& world, const RunContext& run, int step, int r, float dloss) {
  RankState& R = world.rank(r);
  Device& d = world.device(r);
  Stream& s = d.compute();
  const auto ri = static_cast<size_t>(r);
  const int stage = world.stage_of(r), P = world.mesh().shape().pipeline, local = world.engine_rank(r);
  ZeroEngine& engine = world.engine_of(r);
  ModelStageWork& work = *work_[ri];
  const int accum = world.split().accum;
  const NvtxRange rank_range(NvtxCategory::kStep, "step " + std::to_string(step + 1), d.index());
  const int slot = step % kStepSlots;
  const RankState::StepEvents& ev = R.events[static_cast<size_t>(slot)];
  s.record(*ev.step_begin);
  for (int m = 0; m < accum; ++m) {
    const HostBatch* hb = nullptr;
    {
      const NvtxRange data_range(NvtxCategory::kData, "data", d.index());
      hb = &R.prefetch->get(static_cast<int64_t>(step) * accum + m);
    }
    world.upload(r, *hb, m, slot * accum + m);
    Batch& batch = R.batches[static_cast<size_t>(m)];
    batch.loss_scale = engine.rank(local).scaler().scale_device();  // the head stage's loss gradient reads it
    work.set_batch(m, batch, dloss);
  }
  engine.rank(local).begin_pipeline_step();
  std::vector<StageSpan>& spans = spans_[ri];
  spans.clear();
  span_timers_[ri].discard();
  StageRunOptions opt;
  if (world.mesh().index(MeshAxis::kData, r) == 0 || all_spans_) opt.spans = &spans, opt.timer = &span_timers_[ri];
  run_pipeline_stage(schedule_, stage, world.comm(), world.mesh().pipeline_group(r), work, opt);
  s.record(*ev.compute_done);
  const int tied = (stage == 0 || stage == P - 1) ? tied_embedding_block(world.model_of(r)) : -1;
  const MeshCoord me = world.mesh().coord(r);  // the partner: same data and tensor coordinates
  const int partner = world.mesh().rank_at({.data = me.data, .tensor = me.tensor, .pipeline = stage == 0 ? P - 1 : 0});
  engine.rank(local).reduce_pipeline_gradients([&](int b, TensorView g) {
    if (b != tied) return;
    // Both ends compute own + other: the same bits (addition commutes), so both copies stay equal.
    const TensorView other{R.tied_scratch.data(), DType::kF32, g.shape, d.index()};
    world.comm().send_recv(r, partner, g, partner, other, &s);
    world.comm().wait_done(r, s);
    ops::add(s, g, g, other);
  });
  float* const norms = R.norms.as<float>();
  engine.rank(local).check_gradients(norms);
  s.copy(R.norm_host.data(), norms, (R.norm_host.size() - 1) * 4);
  s.copy(&R.found_inf, engine.rank(local).scaler().found_inf_device(), sizeof(float));
  s.copy(&R.scale, engine.rank(local).scaler().state_device(), sizeof R.scale);
  s.record(*ev.grads_ready);
  s.synchronize();  // the step's one host synchronisation on this rank
  span_timers_[ri].resolve(s, spans);  // the stream is idle: its anchor's host time is now
  R.loss_sum = work.loss_sum();  // the head stage's; 0 elsewhere
  if (stage == P - 1 && P > 1 && tied >= 0) {
    // The head's copy of the embeddings holds the same summed gradient as the first stage's: count it once.
    const size_t nb = (R.norm_host.size() - 1) / 2;
    R.norm_host[static_cast<size_t>(tied)] = R.norm_host[nb + static_cast<size_t>(tied)] = 0;
  }
}

// The measured bubble of data rank 0's stages (their compute spans, complete after every rank's
// synchronisation), added to the run's.
void PipelineStages::after_step(World& world) {
  std::vector<StageSpan> all;  // data rank 0's stages
  for (int r = 0; r < world.size(); ++r)
    if (world.mesh().index(MeshAxis::kData, r) == 0)
      all.insert(all.end(), spans_[static_cast<size_t>(r)].begin(), spans_[static_cast<size_t>(r)].end());
  bubble_sum_ += measure_bubble(all, world.mesh().shape().pipeline).fraction;
  ++bubble_steps_;
}

namespace {

// The host path of the step's scalars (several processes, pipeline stages), after every rank's
// synchronisation: the global loss and gradient norm summed in a fixed order (rank, then block),
// the skip decision (a non-finite loss marks an overflow on every rank) and the clip factor into
// RankState::clip_host. optim::clip_factor computes the same bits on the device (device_step_scalars).
void host_step_scalars(World& world, const RunContext& run, double positions, StepStats& st) {
  const TrainConfig& cfg = run.cfg;
  const int N = world.size();
  // Global loss and gradient norm, summed in a fixed order (rank, then block). With tensor
  // parallelism every rank of a tensor group holds the same losses and the same replicated
  // parameters' gradients: those are counted once, from the group's first rank.
  double loss_sum = 0, sq = 0;
  // Every global rank's row (every process's), in rank order, summed in the order one process
  // driving every device sums them. Global rank g is local rank g % N of its process, with the
  // same tensor coordinate (the tensor axis lives inside a process). A row: [0, B) each block's
  // split part, [B, 2B) its replicated tail (ZeroRank::check_gradients; B is the rank's stage's),
  // then the rank's loss sum. The process's pending stop signal rides along (one agreed stop, no
  // extra exchange).
  std::vector<double> mine;
  std::vector<size_t> row_at;
  for (int r = 0; r < N; ++r) {
    const RankState& R = world.rank(r);
    row_at.push_back(mine.size());
    mine.insert(mine.end(), R.norm_host.begin(), R.norm_host.end() - 1);
    mine.push_back(R.loss_sum);
  }
  mine.push_back(StopSignals::pending());
  const std::vector<double> all = run.processes->all_gather(mine, "the step's losses and gradient norms");
  const size_t per_process = mine.size();
  for (size_t p = 0; p < all.size() / per_process; ++p) {
    const double* theirs = all.data() + p * per_process;
    st.stop_signal = std::max(st.stop_signal, static_cast<int>(theirs[per_process - 1]));
    for (int r = 0; r < N; ++r) {
      const double* norms = theirs + row_at[static_cast<size_t>(r)];
      const size_t partials = world.rank(r).norm_host.size() - 1;
      const bool lead = world.tensor_lead(r);
      if (world.loss_lead(r)) loss_sum += norms[partials];
      for (size_t b = 0; b < partials; ++b)
        if (lead || b < partials / 2) sq += norms[b];
    }
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
    world.for_ranks([&](int r) { world.engine_of(r).rank(world.engine_rank(r)).scaler().mark_overflow(); });
  const float clip = !st.skipped && cfg.grad_clip > 0 && st.grad_norm > cfg.grad_clip
                         ? static_cast<float>(cfg.grad_clip / st.grad_norm)
                         : 1.0f;
  for (int r = 0; r < N; ++r) world.rank(r).clip_host = clip;
}

}  // namespace

PendingStep enqueue_step(World& world, const RunContext& run, int step, float lr, int64_t updates,
                         StepPhaseTimer& timer) {
  const TrainConfig& cfg = run.cfg;
  // Every real position weighs the same in the step's objective, however the rows are split.
  const double positions = static_cast<double>(world.split().batch) * run.T;
  const float dloss = 1.0f / static_cast<float>(static_cast<int64_t>(world.split().batch) * run.T);
  PendingStep p;
  p.step = step;
  p.slot = step % kStepSlots;
  // One process without pipeline stages: the global norm, the skip decision and the clip factor
  // are computed on the devices (device_step_scalars) and the host reads them when the step is
  // read. Pipeline stages (the head's losses are summed on the host) and several processes (the
  // partials travel through the host) keep the host sum and one synchronisation per rank before
  // the update: their scalars are known when this returns.
  p.on_device = !world.host_scalars();
  world.for_ranks([&](int r) { world.stages().rank_step(world, run, step, r, dloss); });
  world.stages().after_step(world);

  StepStats& st = p.stats;
  st.lr = lr;
  if (!p.on_device) host_step_scalars(world, run, positions, st);
  OptimizerStep os;
  os.adamw = cfg.optimizer == OptimizerKind::kAdamW;
  os.lr = lr;
  os.beta1 = cfg.beta1;
  os.beta2 = cfg.beta2;
  os.eps = cfg.adam_eps;
  os.weight_decay = cfg.weight_decay;
  os.momentum = cfg.momentum;
  // AdamW's step is the rank's device update counter + 1 (a skipped step makes no update, and the
  // update itself counts it): the host's count, one step late, only keeps the op's validation honest.
  os.step = static_cast<int>(updates) + 1;
  os.step_on_device = true;
  timer.optimizer_begin();
  // No wait: the update's time comes from its events, read with the step (read_step).
  world.for_ranks([&](int r) {
    const NvtxRange rank_range(NvtxCategory::kStep, "step " + std::to_string(step + 1), world.device(r).index());
    RankState& R = world.rank(r);
    Stream& s = world.device(r).compute();
    const RankState::StepEvents& ev = R.events[static_cast<size_t>(p.slot)];
    if (!p.on_device) s.copy(clip_device(R), &R.clip_host, sizeof(float));
    s.record(*ev.opt_begin);
    OptimizerStep mine = os;
    mine.grad_scale = clip_device(R);
    world.engine_of(r).rank(world.engine_rank(r)).optimizer_step(mine);
    s.record(*ev.opt_end);
  });
  timer.optimizer_done();
  p.positions = positions;
  return p;
}

StepStats read_step(World& world, const PendingStep& p, StepPhaseTimer& timer) {
  StepStats st = p.stats;
  // The step's scalars are complete at grads_ready, its update's time at opt_end: work enqueued
  // before any later step, which the devices keep running meanwhile.
  world.for_ranks([&](int r) {
    RankState& R = world.rank(r);
    const RankState::StepEvents& ev = R.events[static_cast<size_t>(p.slot)];
    ev.grads_ready->synchronize();
    (void)world.device(r).compute().query();  // a device error of the step surfaces here (and names it)
    ev.opt_end->synchronize();
    read_rank_timing(world, r, p.slot, timer);
  });
  if (p.on_device) {
    const auto* host = static_cast<const char*>(world.rank(0).step_host[static_cast<size_t>(p.slot)].data());
    double out[3];
    std::memcpy(out, host, sizeof out);
    optim::LossScaleState scale{};
    std::memcpy(&scale, host + sizeof out, sizeof scale);
    st.grad_norm = out[0];
    st.loss = out[1] / p.positions;
    st.skipped = out[2] != 0.0;
    st.loss_scale = scale.scale;
    st.scale_state = scale;
    st.stop_signal = StopSignals::pending();  // one process: its own (the host path gathers every process's)
  } else {
    st.scale_state = world.rank(0).scale;
  }
  for (int r = 0; r < world.size(); ++r)
    if (const auto& g = world.rank(r).graph) {
      st.graphs = st.graphs || g->replays() > 0;
      if (std::string n = g->take_note(); !n.empty() && st.note.empty()) st.note = std::move(n);
    }
  return st;
}

}  // namespace zt
