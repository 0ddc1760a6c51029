// `zerotrain sweep`: the train flags (apps/run_flags.h) plus a search space; every trial's run is
// the base flags with the trial's values re-parsed through the same flag set, so each flag's own
// validator judges a swept value. Runs src/sweep/runner.h and prints the leaderboard.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "run_flags.h"

namespace zt {

class SweepCommand {
 public:
  explicit SweepCommand(CLI::App& app);
  bool parsed() const;
  // args: the command line after "sweep" (recorded in SWEEP_DIR/sweep.json). Returns the exit
  // code: 0 when the sweep is complete (failed trials included), 128 + signal when stopped.
  int run(const std::vector<std::string>& args);

 private:
  CLI::App* sub_;
  std::shared_ptr<RunFlags> f_;
  struct Options {
    std::vector<std::string> space;
    std::string space_file, scheduler = "none", sweep_dir;
    int trials = 0, devices_per_trial = 1, min_steps = 0, max_steps = 0;
    double eta = 3;
  };
  std::shared_ptr<Options> o_;
};

}  // namespace zt
