// `zerotrain plan`: resolves the run exactly as `train` does (train/run_shape.h: devices, batch
// split, sequence length, precision) and prints train/plan.h's per-device prediction and verdict.
// --data is not opened: the plan depends on the model and the batch shape, not on the tokens
// (only the name is checked, e.g. fashion-mnist with a GPT model is refused as train refuses it).
#include "plan_command.h"

#include <cstdio>
#include <string>

#include "core/status.h"
#include "model/config.h"
#include "runtime/runtime.h"
#include "train/plan.h"
#include "train/run_shape.h"
#include "train/trainer.h"

namespace zt {

PlanCommand::PlanCommand(CLI::App& app) : f_(std::make_shared<RunFlags>()) {
  sub_ = app.add_subcommand("plan", "Predict per-device memory of a training run and whether it fits "
                                    "(accepts every train flag)");
  add_run_flags(*sub_, *f_);
}

bool PlanCommand::parsed() const { return sub_->parsed(); }

int PlanCommand::run() {
  const TrainConfig tc = f_->to_config();
  const ModelConfig mc = make_model_config(tc.model, tc.overrides);
  auto rt = Runtime::create(parse_device_spec(tc.devices), CpuDeviceOptions{tc.device_memory});
  const RunShape shape = resolve_run_shape(tc, mc, rt->size(), rt->backend());
  MemoryPlan plan = plan_run(mc, *rt, shape.plan);
  if (tc.device_memory) {  // also states (overrides) the memory of real GPUs
    PlanInputs in = plan.inputs;
    in.device_memory.assign(static_cast<size_t>(rt->size()), tc.device_memory);
    plan = plan_memory(mc, in);
  }
  std::printf("devices: %s (%s backend)\n", tc.devices.c_str(), backend_name(rt->backend()));
  if (!rt->fallback_note().empty()) std::printf("note: %s\n", rt->fallback_note().c_str());
  std::printf("%s", format_plan(mc, plan).c_str());
  return 0;
}

}  // namespace zt
