// `zerotrain plan`: the memory plan of a training run (train/plan.h) as a per-device table and a
// verdict, from the same model/batch/stage/device flags as `train`; and train's --device-memory.
#pragma once

#include <CLI/CLI.hpp>
#include <cstddef>
#include <memory>

namespace zt {

class PlanCommand {
 public:
  explicit PlanCommand(CLI::App& app);
  bool parsed() const;
  int run();  // prints the plan; 0 whether or not it fits (train is what refuses)

 private:
  struct Flags;
  CLI::App* sub_;
  std::shared_ptr<Flags> f_;
};

// Adds --device-memory SIZE (16GiB, 512MiB) to `sub`, written to `bytes` when parsed; a bad size
// is a CLI validation error (exit code 2).
void add_device_memory_option(CLI::App& sub, size_t& bytes);

}  // namespace zt
