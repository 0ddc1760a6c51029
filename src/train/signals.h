// SIGINT/SIGTERM during training: the first signal asks the loop to stop after the current step
// (it saves a checkpoint when the run has a checkpoint directory and exits 128 + signal); a second
// one exits at once with that code (the atomic save protocol keeps every complete checkpoint).
#pragma once

namespace zt {

class StopSignals {
 public:
  StopSignals();   // installs the handlers for this object's lifetime
  ~StopSignals();  // restores the previous ones
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The first signal received (SIGINT or SIGTERM), 0 if none.
  static int pending();
};

}  // namespace zt
