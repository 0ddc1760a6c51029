// Learning-rate schedules.
#include "train/schedule.h"

#include <cmath>

#include "core/status.h"

namespace zt {

LrSchedule parse_lr_schedule(const std::string& name) {
  if (name == "cosine") return LrSchedule::kCosine;
  if (name == "linear") return LrSchedule::kLinear;
  if (name == "constant") return LrSchedule::kConstant;
  ZT_THROW(ErrorKind::kInvalidArgument, "unknown --lr-schedule '", name, "'; choose cosine, linear or constant");
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
