// The run flags every run-shaped subcommand shares (train, plan, and later sweep): one
// definition of each flag, its help text and its validator, bound to a TrainConfig.
#pragma once

#include <CLI/CLI.hpp>
#include <cstddef>
#include <string>

#include "runtime/backend.h"
#include "train/trainer.h"

namespace zt {

// What the flags write: the TrainConfig (every enumerated flag parsed into it as it is read), plus
// the values that become lists after parsing (to_config()) and the app's --plot.
struct RunFlags {
  TrainConfig config;
  std::string hidden, plot;
  std::vector<std::string> inject_faults;  // --inject-fault, may repeat

  // The TrainConfig with --hidden and --inject-fault converted. Throws zt::Error(kInvalidArgument)
  // for a bad --hidden or --inject-fault.
  TrainConfig to_config() const;
};

// Adds every run flag to `sub` (train's full set: plan accepts the same line and ignores the
// flags that do not change memory).
void add_run_flags(CLI::App& sub, RunFlags& flags);

// Adds --device-memory SIZE (16GiB, 512MiB) to `sub`, written to `bytes` when parsed; a bad size
// is a CLI validation error (exit code 2).
void add_device_memory_option(CLI::App& sub, size_t& bytes);

// "256,128" -> {256, 128}; throws zt::Error(kInvalidArgument) naming --hidden.
std::vector<int> parse_hidden(const std::string& hidden);

}  // namespace zt

namespace zt {

struct DeviceSpec;
// The device count and backend `--devices` will give, without creating the devices (the same
// rule as Runtime::create: "all" falls back to the default simulated CPU devices without a GPU).
struct PlannedDevices {
  int count = 1;
  Backend backend = Backend::kCpu;
};
PlannedDevices planned_devices(const DeviceSpec& spec);

}  // namespace zt
