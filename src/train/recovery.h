// In-process recovery from a lost device: which devices survive a failure, as the spec of the next
// World (the trainer rebuilds on it from the newest host snapshot).
#pragma once

#include <optional>
#include <string>

#include "train/world.h"

namespace zt {

struct Survivors {
  DeviceSpec spec;       // the devices left, in their order
  std::string lost;      // names of the failed devices, e.g. "cpu:1, cpu:3"
  std::string dropped;   // healthy devices dropped with a failed tensor-group peer (--tensor-parallel)
  int count = 0;
};

// The world's failed devices dropped from `current` (the spec the world was built from);
// nullopt when no device failed (the error was something else) or every one did.
std::optional<Survivors> surviving_devices(World& world, const DeviceSpec& current);

}  // namespace zt
