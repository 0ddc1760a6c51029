// SIGINT/SIGTERM during training: the first signal asks the loop to stop after the current step
// (it saves a checkpoint when the run has a checkpoint directory and exits 128 + signal); a second
// one exits at once with that code (the atomic save protocol keeps every complete checkpoint).
// Several processes (mpirun): a signal to any one of them (or mpirun's to all) becomes one stop that
// every process agrees on at the next step boundary (agreed_stop_signal).
#pragma once

namespace zt {

class Processes;

class StopSignals {
 public:
  StopSignals();   // installs the handlers for this object's lifetime
  ~StopSignals();  // restores the previous ones
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The first signal received (SIGINT or SIGTERM), 0 if none.
  static int pending();
};

// The stop to make at this step boundary: StopSignals::pending(), or with several processes the
// largest signal any of them received (SIGTERM over SIGINT), learnt by one tiny all-gather, so that
// every process stops after the same step and writes its part of the same stop checkpoint instead
// of waiting --comm-timeout for a process that left. Collective: every process calls it at the
// same step boundaries.
int agreed_stop_signal(Processes* processes);

}  // namespace zt
