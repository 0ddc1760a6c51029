// Flags that do nothing in a run's combination (--pp-schedule without --pipeline-parallel,
// --offload-fraction without --offload optimizer, ...): given, they are refused with the flag that
// would make them count; `train --print-config` leaves them out of the file it writes.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "train/run_shape.h"

namespace zt {

struct InapplicableFlag {
  std::string flag;   // long name without dashes: "pp-schedule"
  std::string needs;  // what would make it count: "--pipeline-parallel 2 or more"
};

// The run flags (apps/run_flags.h) that have no effect on a run of this resolved shape.
std::vector<InapplicableFlag> inapplicable_run_flags(const RunContext& shape, const ModelConfig& mc);

// Throws zt::Error(kInvalidArgument) naming the first flag of `flags` that `sub` was given
// (on the command line or by --config).
void refuse_given(const CLI::App& sub, const std::vector<InapplicableFlag>& flags);

}  // namespace zt
