// `zerotrain plan`: the memory plan of a training run (train/plan.h) as a per-device table and a
// verdict. It accepts every `train` flag (apps/run_flags.h); those that do not change memory are
// accepted and ignored, and --data is never opened. `plan --largest` prints, instead, the largest
// GPT-2-shape model that fits per ZeRO stage, recompute and offload (train/plan.h: plan_largest).
#pragma once

#include <CLI/CLI.hpp>
#include <memory>

#include "run_flags.h"

namespace zt {

class PlanCommand {
 public:
  explicit PlanCommand(CLI::App& app);
  bool parsed() const;
  int run();  // prints the plan; 0 whether or not it fits (train is what refuses)

 private:
  CLI::App* sub_;
  std::shared_ptr<RunFlags> f_;
  bool largest_ = false;
};

}  // namespace zt
