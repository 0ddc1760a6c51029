// Learning-rate schedules.
#include "train/schedule.h"

#include <cmath>


namespace zt {

const char* lr_schedule_name(LrSchedule schedule) {
  switch (schedule) {
    case LrSchedule::kCosine: return "cosine";
    case LrSchedule::kLinear: return "linear";
    case LrSchedule::kConstant: return "constant";
  }
  return "?";
}

float learning_rate(const LrConfig& c, int step) {
  if (step < c.warmup_steps) return c.lr * static_cast<float>(step + 1) / static_cast<float>(c.warmup_steps);
  if (c.schedule == LrSchedule::kConstant) return c.lr;
  const int decay_steps = c.total_steps - 1 - c.warmup_steps;
  if (decay_steps <= 0) return c.lr;
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) / decay_steps);
  double coeff;
  if (c.schedule == LrSchedule::kCosine)
    coeff = 0.5 * (1.0 + std::cos(M_PI * progress));
  else
    coeff = 1.0 - progress;
  return static_cast<float>(c.min_lr + coeff * (c.lr - c.min_lr));
}

}  // namespace zt
