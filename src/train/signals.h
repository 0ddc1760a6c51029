// SIGINT/SIGTERM during training: the first signal asks the loop to stop after the current step
// (it saves a checkpoint when the run has a checkpoint directory and exits 128 + signal); a second
// one exits at once with that code (the atomic save protocol keeps every complete checkpoint).
// Several processes (mpirun): a signal to any one of them (or mpirun's to all) becomes one stop that
// every process agrees on at the next step boundary: the pending signal rides along the step's
// all-gather of losses and gradient norms (step.cc, StepStats::stop_signal).
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
