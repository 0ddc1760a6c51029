// One optimizer step on every rank: forward/backward over the step's micro-batches, the gradient
// check (norm partials and the all-reduced non-finite flag), one host synchronisation to read
// them, then the update (skipped together on every rank when anything was not finite).
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
};

// Runs step `step` (0-based). `updates`: updates made so far (AdamW's bias correction counts them).
StepStats train_step(World& world, const RunContext& run, int step, float lr, int64_t updates,
                     StepPhaseTimer& timer);

}  // namespace zt
