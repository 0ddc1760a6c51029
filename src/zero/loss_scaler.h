// One rank's loss scale and overflow flags, in device memory: the ops that need them (the backward's
// loss gradient, unscale_check, the optimizer, the dynamic update) read them when they run, so
// neither skipping an overflowed step nor changing the scale needs the host (see zero/engine.h).
#pragma once

#include <cstdint>

#include "memory/caching_allocator.h"
#include "optimizers/optimizers.h"
#include "runtime/device.h"
#include "zero/options.h"

namespace zt {

class LossScaler {
 public:
  // world: the ranks whose overflow flags are summed (flags hold `world` floats). opt is the
  // engine's, read at every call (a switch of the working dtype drops scaling).
  LossScaler(Device& d, Stream& compute, int world, const ZeroOptions& opt);

  // Device float: the loss scale the next backward multiplies the loss by (nullptr: no scaling).
  const float* scale_device() const;
  // Device float: the inverse scale the gradients are unscaled by (nullptr: no scaling).
  const float* inv_scale_device() const;
  // Device float: > 0 when some rank's gradient held inf/NaN in the last check_gradients.
  const float* found_inf_device() const { return flags_.as<float>(); }
  // The same flag, writable: for an op that decides on the device, after check_gradients and
  // before optimizer_step, that the step is skipped (optim::clip_factor), as mark_overflow does.
  float* overflow_flag_device() { return flags_.as<float>(); }
  // Sets the combined overflow flag (after check_gradients, before optimizer_step): the host saw a
  // non-finite loss, so the step is skipped like an overflowed one.
  void mark_overflow();
  // The loss-scale state (synchronizes the compute stream). Without scaling: scale 1.
  optim::LossScaleState state();
  // The same state in device memory, for a copy batched with other reads (no extra sync).
  const optim::LossScaleState* state_device() const { return state_.as<optim::LossScaleState>(); }
  void set_state(const optim::LossScaleState& st);
  // The rank's device count of updates made (OptimizerStep::step_on_device; 0 when the engine is
  // built): set from the host's count on resume and after a recovery; read (synchronizes) by tests.
  void set_update_count(int64_t updates);
  int64_t update_count();
  uint32_t* update_count_device();  // after the LossScaleState in the state buffer (kScalerBytes)

  // Dynamic scaling: the scale's transition after the step's update (reads the combined flag).
  void update();
  // Back to the initial scale (or 1 without scaling) with cleared flags; keeps the update count.
  void reset();

 private:
  Stream& compute_;
  int world_, device_;
  const ZeroOptions& opt_;
  DeviceBuffer state_, flags_;
};

}  // namespace zt
