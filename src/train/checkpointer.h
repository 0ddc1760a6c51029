// Checkpoints and host snapshots of a run: what the trainer records besides the engine's arrays
// (the meta), periodic saves written in the background, and the host snapshots that in-process
// recovery restarts from.
//
// Several processes (mpirun): every process writes its own ranks' files of each checkpoint; the
// commit (manifest, `latest`, pruning) is process 0's, after every process has handed its finished
// files over (write_checkpoint's team: a barrier with --comm-timeout, over a process group of its
// own, so that the background save's messages never mix with the training's collectives). The
// directory's lease (run lock, owner) is process 0's alone, taken on behalf of the launch: the
// others never touch .run.lock, .lock or owner.json, and learn process 0's verdict on the directory
// before training.
//
// Lifetime rule: the background writer's completion callback runs on the trainer's thread (in
// save/poll/wait) and touches only this object and the Logger, which outlives it; the saver is the
// last member, so it is joined before anything else here is destroyed — also when an error unwinds
// the run while a save is in flight — and the directory's lease is released after it.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/logger.h"
#include "train/state_io.h"
#include "train/world.h"

namespace zt {

// Everything a checkpoint needs beyond the engine's arrays: model shape, run shape, sampler
// position, counters, LR schedule, loss-scale state and the tensor table.
nlohmann::json checkpoint_meta(World& world, const RunContext& run, const TrainCounters& counters,
                               const std::string& precision, ZeroOptions::Scaling scaling);

// Copies every rank's shard to the host, with meta.
HostSnapshot snapshot_world(World& world, const RunContext& run, const TrainCounters& counters,
                            const std::string& precision, ZeroOptions::Scaling scaling);

class Checkpointer {
 public:
  // Does nothing when the run has no --checkpoint-dir. Else takes the directory for the run's
  // lifetime (checkpoint/checkpoint.h open_checkpoint_dir: a writable directory, a run-wide lock,
  // and an owner: another run's directory is refused) and prints its notes.
  Checkpointer(const RunContext& run, Logger& log);
  ~Checkpointer();
  bool enabled() const { return saver_ != nullptr; }
  // Writes TrainConfig::run_config to DIR/config.toml (atomically), once every check of the run
  // has passed (resume included), so that a refused run leaves the directory as it was.
  void write_run_config();
  // Writes and commits a snapshot just taken (training stalled stall_s for its device-to-host
  // copy) in the background; a failure of the previous background save is rethrown here.
  // shared: snap is the step's recovery snapshot (--snapshot-every), which the save reads in place
  // rather than copying the devices' state to the host a second time.
  void save(std::shared_ptr<const HostSnapshot> snap, double stall_s, bool shared = false);
  // Writes synchronously (a conversion, or a stop on a signal); returns the checkpoint's path.
  std::string save_now(const HostSnapshot& snap);
  // Collects a save that finished (its message and metrics record), without blocking.
  void poll();
  // Waits for the save in flight; rethrows its failure.
  void wait();
  // Lines to print about saves that completed since the last call.
  std::vector<std::string> take_messages();
  std::vector<std::string> paths();
  // Several processes lost one: writes this process's ranks of `snap` (the newest host snapshot)
  // as ROOT/partial-step-N-process-P, and the previous process's ranks of the same step that
  // replicate() received as ROOT/partial-step-N-process-Q-held-by-P: parts that --resume refuses
  // one by one, and that --resume auto assembles into step-N when together they hold every rank
  // (assemble_partials). Returns what it wrote ("" without --checkpoint-dir). A save in flight is
  // abandoned.
  std::string write_partial(const HostSnapshot& snap, int process);
  // Several processes with --snapshot-every and --checkpoint-dir: sends this process's snapshot
  // to the next process (p + 1 mod K) and keeps the previous one's in host memory (Gemini-style
  // replication), so that the survivors of one lost process hold every rank of the snapshot.
  // Waits for a save in flight first (the exchange uses the checkpoints' process group).
  void replicate(const HostSnapshot& snap);

 private:
  const RunContext& run_;
  Logger& log_;
  std::optional<CheckpointDirLease> lease_;
  std::unique_ptr<CheckpointTeam> team_;  // several processes; outlives the saver (declared before it)
  std::optional<HostSnapshot> held_;       // the previous process's snapshot (replicate)
  std::optional<std::string> assembled_;   // --resume auto: a checkpoint assembled from partial directories
  int held_from_ = -1;
  std::mutex mu_;
  std::vector<std::string> messages_, paths_;
  std::unique_ptr<BackgroundSaver> saver_;  // last member: see the lifetime rule above
};

}  // namespace zt
