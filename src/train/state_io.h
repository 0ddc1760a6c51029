// The trainer's model and optimizer state outside the devices: host snapshots of every rank's
// shard (for --snapshot-every recovery and as the first half of a checkpoint save), checkpoint
// writing from a snapshot (in the background), and restoring an engine of any world size and
// ZeRO stage from a checkpoint or a snapshot (resharding: each rank reads exactly the elements
// it keeps, from whichever stored ranges cover them).
//
// Arrays, per parameter block (ParamLayout block name): "<block>/master" (fp32 master weights),
// "<block>/m" and "<block>/v" (AdamW moments; SGD has only m), and with 16-bit precision
// "<block>/working" (the bf16/f16 parameters, so that stochastic rounding resumes bit for bit).
// Every rank stores its shard's real elements of each, so the files tile each array exactly.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "model/model.h"
#include "zero/engine.h"

namespace zt {

// One rank's state of one block, over [begin, begin + master.size()).
struct HostShard {
  int64_t begin = 0;
  std::vector<float> master, m, v;
  std::vector<uint8_t> working;  // raw working-dtype bits (16-bit precision only)
};

struct HostSnapshot {
  int64_t step = 0;                         // steps completed when it was taken
  DType working = DType::kF32;
  bool adamw = true;
  std::vector<std::string> block_names;
  std::vector<int64_t> block_numel;
  std::vector<std::vector<HostShard>> shards;  // [rank][block]
  nlohmann::json meta;                       // the trainer's state (see train/trainer.cc)
  // Several processes: shards holds this process's ranks only, global ranks first_rank onwards of
  // world_ranks in all; one process: 0 and 0 (shards holds every rank).
  int first_rank = 0;
  int world_ranks = 0;
  size_t bytes() const;
};

// Copies every rank's shard to the host; for_ranks runs fn(rank) on each rank's thread.
HostSnapshot take_snapshot(ZeroEngine& engine, const Model& model, bool adamw, int64_t step,
                           const std::function<void(const std::function<void(int)>&)>& for_ranks);

// Where restore() reads arrays from: a checkpoint on disk or a snapshot in memory.
class StateSource {
 public:
  virtual ~StateSource() = default;
  virtual bool has(const std::string& array) const = 0;
  virtual StorageDType dtype(const std::string& array) const = 0;
  virtual uint64_t numel(const std::string& array) const = 0;
  // Elements [begin, begin + count) into out (count * element size bytes).
  virtual void read(const std::string& array, uint64_t begin, uint64_t count, void* out) const = 0;
  virtual std::string describe() const = 0;  // "checkpoint /runs/a/step-00000100"
  // The trainer's meta saved with the state (an empty object when none).
  virtual const nlohmann::json& meta() const = 0;
};
std::unique_ptr<StateSource> source_of(const CheckpointReader& reader);
std::unique_ptr<StateSource> source_of(const HostSnapshot& snapshot);

// Checks that the source holds this model's state: the model shape its meta records (layers,
// heads, embd, seq_len, vocab, hidden, ... — a head count changes no array size), every block's
// arrays with the right sizes, the optimizer's moments; throws kInvalidArgument with one sentence
// naming what differs (both shapes for a shape mismatch).
void check_source_matches(const StateSource& src, const Model& model, bool adamw);

// The identity that owns a checkpoint directory (checkpoint.h, open_checkpoint_dir): the model
// shape (the keys the trainer's meta["model"] uses), the seed and the data.
RunIdentity run_identity(const ModelConfig& mc, uint64_t seed, const std::string& data);
// Loads rank's part of every block from src (any world size, stage or tensor degree may have
// written it: the arrays are always the logical, one-device blocks).
void restore_rank(ZeroEngine& engine, const Model& model, const StateSource& src, int rank);
// The whole model's parameters in the logical (one-device) layout, one vector per logical block:
// the fp32 masters (master) or the working parameters widened to fp32. Synchronizes every device.
std::vector<std::vector<float>> logical_parameters(ZeroEngine& engine, const Model& model, bool master);

// A snapshot's shards and shape as bytes and back (no meta): what replication sends.
std::vector<uint8_t> serialize_shards(const HostSnapshot& snap);
HostSnapshot deserialize_shards(const std::vector<uint8_t>& bytes);

// Declares the snapshot's arrays in writer and writes its ranks' files (first_rank onwards), each
// file finished; the caller commits (or, as a part, hands over).
void write_snapshot_files(const HostSnapshot& snap, CheckpointWriter& writer);

// One process's ranks of a snapshot as ROOT/<name>, a partial directory (checkpoint.h,
// kPartialFileName): the rank files and their hand-over with the snapshot's step, rank count and
// meta, renamed into place (replacing an older one of that name). Returns its path.
std::string write_snapshot_part(const HostSnapshot& snap, const std::string& root, const std::string& name);

// The processes of a multi-process run writing one checkpoint together (train/checkpointer.cc
// implements it over MPI, with the run's --comm-timeout on every wait). Process 0 is the lead.
class CheckpointTeam {
 public:
  virtual ~CheckpointTeam() = default;
  virtual int process() const = 0;
  // Every process's text, in process order, on process 0 (an empty vector on the others).
  virtual std::vector<std::string> gather(const std::string& mine) = 0;
  // Process 0's text on every process (the others pass anything).
  virtual std::string broadcast(const std::string& from_lead) = 0;
  // Sends `mine` to process p + 1 and returns what process p - 1 sent (mod the process count).
  virtual std::vector<uint8_t> shift(const std::vector<uint8_t>& mine) = 0;
};

// Writes a snapshot as a checkpoint (one file per rank that took it, written concurrently), then
// commits with meta. Returns the checkpoint's path. With a team (several processes, every one
// calling with its own ranks' snapshot): each process writes its ranks' files; process 0 commits
// after every process has handed its finished files over (the barrier), and every process returns
// the path, or throws kIo naming the process whose part failed: all of them succeed or fail together.
std::string write_checkpoint(const HostSnapshot& snap, const std::string& root, int keep,
                             CheckpointTeam* team = nullptr);

// Saves in the background, one save at a time. Safe by construction: the saving thread touches
// only what the saver owns (the snapshot, which it co-owns and only reads: a snapshot is never
// changed once taken, so the trainer may share its recovery snapshot with a save; and copies of
// root and keep) and the team
// (several processes: the owner keeps it alive longer than the saver, and no other thread uses it
// while a save is in flight; the commit's barrier then runs on the saving thread), and the
// destructor joins it, so nothing the thread uses can go away under it, whatever the owner's
// declaration order or however its scope ends (an exception included).
//
// Callback contract: on_done(path, seconds) runs on the OWNER's thread, inside the save(), poll()
// or wait() that finds the save committed — never on the saving thread and never from the
// destructor. So it may use anything that is alive at those calls (objects declared after the
// saver included) without locking against the saving thread; a save whose result is not
// collected before the saver is destroyed (the run is failing) has its callback dropped.
// Failures: an error of the background save is rethrown by the next save(), poll() or wait()
// (save() then does not start the new one); the destructor swallows it.
// All members are for one owner thread.
class BackgroundSaver {
 public:
  using OnDone = std::function<void(const std::string& path, double seconds)>;
  BackgroundSaver(std::string root, int keep, CheckpointTeam* team = nullptr);
  ~BackgroundSaver();
  BackgroundSaver(const BackgroundSaver&) = delete;
  BackgroundSaver& operator=(const BackgroundSaver&) = delete;

  // Finishes the previous save (as wait()), then writes and commits snap on a new thread. The
  // snapshot's memory goes back when the write ends (or later, with its other owners' share).
  void save(std::shared_ptr<const HostSnapshot> snap, OnDone on_done);
  void save(HostSnapshot snap, OnDone on_done) {
    save(std::make_shared<const HostSnapshot>(std::move(snap)), std::move(on_done));
  }
  // Non-blocking: when the save in flight has finished, collects it (runs its on_done, or rethrows
  // its failure). Returns true when no save is in flight afterwards.
  bool poll();
  // Blocks until the save in flight has finished, then collects it as poll() does.
  void wait();

 private:
  std::string root_;
  int keep_;
  CheckpointTeam* team_;
  struct Job;
  std::unique_ptr<Job> job_;
  void collect();  // joins job_ (finished or not), then on_done or rethrow
};

}  // namespace zt
