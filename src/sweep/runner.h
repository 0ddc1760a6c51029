// The sweep runner: runs a list of trials (each a fully validated TrainConfig) concurrently on
// disjoint subsets of a device pool, with ASHA early stopping at rungs, one shared dataset, and a
// sweep directory that makes a rerun of the same command continue where a killed one stopped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/backend.h"
#include "sweep/journal.h"
#include "sweep/space.h"
#include "train/trainer.h"

namespace zt::sweep {

struct SweepSpec {
  std::string dir;      // SWEEP_DIR (created if missing)
  std::string command;  // the sweep's flags as given, recorded in sweep.json for people
  // What makes a rerun the same sweep (journal.h make_identity: the resolved flag values and every
  // trial's values); null: made from `command` and the trials (tests).
  nlohmann::json identity;
  std::vector<TrialValues> trials;
  // configs[i]: trial i's run, every flag applied and validated; devices, checkpoint_dir,
  // metrics_path, resume, quiet, steps and the hooks are set by the runner.
  std::vector<TrainConfig> configs;
  int devices = 1;  // the pool (--devices of the sweep)
  Backend backend = Backend::kCpu;
  std::vector<int> cuda_ordinals;  // kCuda: physical ordinal of each pool device
  int devices_per_trial = 1;
  bool asha = false;
  double eta = 3;
  int min_steps = 1;
  int max_steps = 1;  // every trial's --steps (its LR schedule), stopped or not
  bool live = true;   // print the live table (one line per change) to stdout
  // ASHA: trials start in an order shuffled by this seed (a grid lists its values sorted, and
  // sorted arrival is ASHA's worst case: every newcomer beats the rung so far and is promoted).
  uint64_t order_seed = 0;
};

struct SweepResult {
  std::vector<TrialOutcome> trials;  // by id
  int64_t steps_trained = 0;         // over every trial (by this and earlier runs of the sweep)
  int signal = 0;                    // SIGINT/SIGTERM stopped the sweep (unfinished trials resume on a rerun)
};

// Runs (or continues) the sweep. Throws zt::Error(kInvalidArgument) with one sentence, before any
// trial starts, when SWEEP_DIR is not this sweep's: another sweep's (another identity), a
// non-empty directory that is no sweep, / or $HOME, in use by a running sweep, or damaged.
SweepResult run_sweep(const SweepSpec& spec);

// A trial's --devices for the pool positions `devs`: "cpu:K" on the CPU backend (K fresh simulated
// devices), else the pool's GPUs at those positions, e.g. "cuda:1,3" or "cuda:0x2".
std::string subset_spec(const SweepSpec& spec, const std::vector<int>& devs);

// The trials that ran sorted by best validation loss (failed and unfit ones last), as a text table.
std::string format_leaderboard(const SweepResult& result);
// " lr=0.001 embd=128"
std::string format_values(const std::vector<std::pair<std::string, std::string>>& values);

// The SVG of every trial's validation curve: the best highlighted, stopped ones faded.
std::string sweep_curves_svg(const SweepResult& result, const std::string& title);
void write_sweep_svg(const std::string& path, const SweepResult& result, const std::string& title);

}  // namespace zt::sweep
