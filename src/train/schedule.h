// Learning-rate schedules: linear warmup, then cosine / linear decay to min_lr, or constant.
#pragma once

namespace zt {

enum class LrSchedule { kCosine, kLinear, kConstant };

const char* lr_schedule_name(LrSchedule schedule);  // "cosine", "linear", "constant"

struct LrConfig {
  float lr = 1e-3f;
  float min_lr = 0.0f;
  int warmup_steps = 0;
  int total_steps = 1;
  LrSchedule schedule = LrSchedule::kCosine;
};

// LR for step `step` (0-based): step < warmup ramps lr*(step+1)/warmup; afterwards decays from lr
// at the end of warmup to min_lr at total_steps-1 (cosine or linear), or stays at lr.
float learning_rate(const LrConfig& c, int step);

}  // namespace zt
