// One optimizer step on every rank: forward/backward over the step's micro-batches (their losses
// summed on the device), the gradient check (norm partials and the all-reduced non-finite flag),
// the global norm, skip decision and clip factor on the device (optim::clip_factor over every
// rank's all-gathered scalars), then the update, enqueued without a host synchronisation: the host
// reads the step's scalars from pinned memory by an event recorded before the update, which keeps
// running; its time is read from events. Pipeline stages and several processes keep one host
// synchronisation per rank before the update (the host sums their losses or partials).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/report.h"
#include "train/world.h"

namespace zt {

struct StepStats {
  double loss = 0;       // mean training loss per real position (NaN/inf when not finite)
  double grad_norm = 0;  // global norm of the unscaled gradient, before clipping
  float lr = 0;
  float loss_scale = 1;  // the scale this step's backward used
  bool skipped = false;  // the update was skipped (non-finite gradient or loss)
  bool graphs = false;   // some rank ran a micro-batch of this step from a captured graph
  std::string note;      // --cuda-graphs auto: why a rank gave graphs up (once per rank)
};

// Runs step `step` (0-based). `updates`: updates made so far (AdamW's bias correction counts them).
StepStats train_step(World& world, const RunContext& run, int step, float lr, int64_t updates,
                     StepPhaseTimer& timer);
// Waits for the last train_step's update and gives its time to the timer (the next train_step
// would): after the last step, before its end_step.
void settle_step_timing(World& world, StepPhaseTimer& timer);

}  // namespace zt
