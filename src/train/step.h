// One optimizer step on every rank: forward/backward over the step's micro-batches (their losses
// summed on the device), the gradient check (norm partials and the all-reduced non-finite flag),
// the global norm, skip decision and clip factor on the device (optim::clip_factor over every
// rank's all-gathered scalars), then the update, enqueued without a host synchronisation; AdamW's
// step count is the devices' own update counter (OptimizerStep::step_on_device). The step's
// scalars land in pinned memory (one buffer per step slot, kStepSlots) by an event recorded
// before the update; the host reads them later (read_step), one step late: the trainer enqueues
// step k + 1 and then reads step k, whose work is complete or finishing while the devices run
// step k + 1. Pipeline stages and several processes keep one host synchronisation per rank before
// the update (the host sums their losses or partials): their scalars are known when
// enqueue_step returns, and the trainer reads them at once.
//
// What may be decided one step late (train/trainer.cc, Trainer::must_flush): the logs and
// metrics of step k (same values, same order), the skip count, the host's update count (the
// devices count for themselves) and the consecutive-skip limit (the step enqueued meanwhile is
// dropped with the error). What forces the trainer to read step k before step k + 1 is enqueued
// (a flush): the last step; an evaluation, sample, snapshot or checkpoint after step k; a pending
// stop signal; an --inject-fault due at step k + 1; pipeline stages and several processes (their
// scalars are read already); and every step of a run whose loss is scaled (fp16) or that pokes
// gradients (tests): a skipped step's diagnosis (first_nonfinite_gradient) reads its gradients,
// which the next step overwrites, and a collapse of the loss scale switches the next step to bf16.
// A run that reads late and meets a skipped step logs it without naming its first non-finite
// tensor (the step after it overwrote the gradients) and flushes every step from there.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optimizers/optimizers.h"
#include "train/report.h"
#include "train/world.h"

namespace zt {

struct StepStats {
  double loss = 0;       // mean training loss per real position (NaN/inf when not finite)
  double grad_norm = 0;  // global norm of the unscaled gradient, before clipping
  float lr = 0;
  float loss_scale = 1;  // the scale this step's backward used
  optim::LossScaleState scale_state{};  // rank 0's whole loss-scale state before the step's update
  bool skipped = false;  // the update was skipped (non-finite gradient or loss)
  bool graphs = false;   // some rank ran a micro-batch of this step from a captured graph
  std::string note;      // --cuda-graphs auto: why a rank gave graphs up (once per rank)
  int stop_signal = 0;   // the strongest stop signal any process held when the step's sums were
                         // gathered (signals.h), so every process sees the same (one process: its
                         // own when the step was read)
};

// A step enqueued and not yet read.
struct PendingStep {
  int step = -1;           // 0-based
  int slot = 0;            // step % kStepSlots: its pinned scalars and timing events
  bool on_device = false;  // its scalars come from the devices (else `stats` holds them already)
  double positions = 0;    // real positions of the step (the loss's divisor)
  StepStats stats;         // lr; the host path's scalars
};

// Enqueues step `step` (0-based) on every rank and returns without waiting for it (the host path:
// after its one synchronisation per rank). `updates`: updates made so far as the host knows them
// (the devices' counters decide the bias correction). At most kStepSlots - 1 earlier steps may be
// unread when this is called (the trainer keeps one).
PendingStep enqueue_step(World& world, const RunContext& run, int step, float lr, int64_t updates,
                         StepPhaseTimer& timer);
// Waits for the pending step's scalars and its update (work enqueued before any later step) and
// returns its stats; gives its phases and update time to the timer. A device error of the step
// is thrown here.
StepStats read_step(World& world, const PendingStep& p, StepPhaseTimer& timer);

}  // namespace zt
