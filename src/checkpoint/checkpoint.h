// Sharded checkpoints on disk: atomic save (CheckpointWriter), validated load with any-range reads
// for resharding (CheckpointReader), discovery and fallback for --resume (resolve_resume).
// Knows nothing of the ZeRO engine: it stores named flat arrays as ranges across files
// (see manifest.h for the data model and the integrity rules).
//
// Layout: ROOT/step-00000100/{manifest.json, rank-00000.bin, rank-00001.bin, ...}, ROOT/latest
// (one line: the name of the newest committed checkpoint directory), ROOT/.lock (flock'd by the
// one writer allowed at a time), ROOT/owner.json (the identity of the run that owns ROOT, see
// open_checkpoint_dir) and ROOT/.run.lock (flock'd by that run for its whole lifetime).
//
// Crash safety — the order of a save, each step durable before the next:
//  1. files are written into a staging directory ROOT/.tmp-step-N-<pid>-<k> under temporary names
//     (.rank-00000.bin.tmp), fsync'd and renamed (rank-00000.bin);
//  2. the manifest is written last the same way, then the staging directory is fsync'd;
//  3. the staging directory is renamed to ROOT/step-N (atomically exchanged with an existing
//     step-N, so a complete checkpoint is never destroyed before its replacement is complete), and
//     ROOT is fsync'd;
//  4. ROOT/latest is replaced atomically (temp + fsync + rename + fsync ROOT);
//  5. only then are older checkpoints pruned (renamed to ROOT/.trash-* first, then deleted) and
//     leftovers of interrupted saves removed.
// So a directory named step-N is always complete, `latest` never names an incomplete one, and a
// crash at any instant leaves every previously committed checkpoint loadable. Loading never
// deletes anything, and pruning deletes only checkpoints the owner lineage committed (the manifest
// records the owner's run id): a step-N without a manifest, or another run's, is left alone.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/manifest.h"
#include "checkpoint/storage_dtype.h"

namespace zt {

inline constexpr char kLatestFileName[] = "latest";
inline constexpr char kOwnerFileName[] = "owner.json";
inline constexpr char kRunLockFileName[] = ".run.lock";

// "step-00000100" (at least 8 digits); parse_step_dir is its inverse (nullopt for other names).
std::string format_step_dir(int64_t step);
std::optional<int64_t> parse_step_dir(std::string_view name);
// "rank-00003.bin"
std::string format_rank_file(int rank);

// One process's ranks of a snapshot, written by a survivor of a multi-process run that lost a
// process (train/checkpointer.h, write_partial): ROOT/partial-step-N-process-P with the rank files
// and kPartialFileName (their ranges and hashes, as a hand-over), never a manifest. Not a
// checkpoint: list_checkpoints never lists it, pruning never deletes it, --resume refuses it.
inline constexpr char kPartialFileName[] = "partial.json";
std::string partial_dir_name(int64_t step, int process);
// --resume auto after a lost process: when ROOT holds partial directories of one step newer than
// its newest complete checkpoint that together hold every rank's file (each process's own part
// and the replicas of the lost one's), adopts them into ROOT/step-N, committed as any checkpoint
// with the meta they recorded, then removes the partial directories up to that step. Returns the
// checkpoint's path, or nullopt when there is nothing complete to assemble (partials are then left
// alone). The caller holds the directory's lease.
std::optional<std::string> assemble_partials(const std::string& root, int keep);

struct CheckpointEntry {
  int64_t step = 0;
  std::string name;  // "step-00000100"
  std::string path;  // root + "/" + name
  bool has_manifest = false;  // a committed save always has one; its validity is not checked here
};

// Real directories (not symbolic links) named step-N directly under root, sorted by step
// ascending; empty when root does not exist.
std::vector<CheckpointEntry> list_checkpoints(const std::string& root);

// The checkpoint directory name ROOT/latest holds, if the file exists and holds a step-N name.
std::optional<std::string> read_latest(const std::string& root);

// One process's share of a checkpoint that several processes write together (mpirun; ROOT on a
// file system every process sees): files [first_file, first_file + count) are this process's. The
// lead (process 0) holds ROOT/.lock, adopts every other part's finished files (hand_over/adopt,
// carried between the processes by the caller) and commits; the others neither lock nor commit.
struct WriterPart {
  int first_file = 0;
  int count = 0;
  bool lead = true;
};

// Writes one checkpoint. Usage: declare every array, write every element of each exactly once
// (from any threads: calls for different files run concurrently, calls for one file serialise),
// then commit. Destroying a writer that did not commit discards everything it wrote (a part that
// handed over leaves its files to the lead).
// Only one committing writer per root may exist at a time (across processes too: ROOT/.lock).
class CheckpointWriter {
 public:
  // Creates root if needed and the staging directory with num_files empty files (with a part:
  // only the part's files; the lead adopts the others before commit).
  CheckpointWriter(std::string root, int64_t step, int num_files, std::optional<WriterPart> part = std::nullopt);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // shape is informational (kept in the manifest); when non-empty its product must be numel.
  void declare_array(const std::string& name, StorageDType dtype, uint64_t numel,
                     std::vector<int64_t> shape = {});
  // Appends elements [begin, begin + bytes / element size) of array `name` to file `file`.
  // Thread-safe; throws kInvalidArgument for an undeclared array, a range outside it or a size
  // that is not whole elements, kIo for a failed write.
  void write_range(int file, const std::string& name, uint64_t begin, const void* data, uint64_t bytes);
  // Optional: fsyncs and renames file `file` now (e.g. from the thread that wrote it, so fsyncs
  // overlap); commit does it for the files not finished. No writes to the file afterwards.
  void finish_file(int file);
  // Checks every declared array was written exactly once, then runs steps 1-5 above. keep > 0:
  // afterwards `keep` checkpoints remain, this one and the keep - 1 others with the highest steps;
  // keep == 0 keeps all. Returns the checkpoint's path (ROOT/step-N). meta must be an object.
  std::string commit(const nlohmann::json& meta, int keep);
  // A part that is not the lead: finishes its files (fsync, rename) and its staging directory and
  // returns what the lead's adopt() needs (the staging path and each file's name, size, hash and
  // ranges). No more writes; the files now belong to the lead.
  nlohmann::json hand_over();
  // The lead: moves another part's finished files (its hand_over()) into this checkpoint's staging
  // directory. Throws kInvalidArgument for a malformed part or a file index outside the checkpoint
  // or already present, kIo for a failed rename.
  void adopt(const nlohmann::json& part);

  const std::string& root() const;
  int64_t step() const;
  int num_files() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// ---- test hook: a failure at any point of the save protocol ---------------------------------

// The points of a save, in protocol order. kWrite is every write_range; kFsyncFile and kRenameFile
// run once per file; the others once per save.
enum class SavePoint { kStage, kWrite, kFsyncFile, kRenameFile, kManifest, kRenameDir, kFsyncRoot, kLatest, kPrune };
inline constexpr SavePoint kAllSavePoints[] = {SavePoint::kStage,      SavePoint::kWrite,     SavePoint::kFsyncFile,
                                               SavePoint::kRenameFile, SavePoint::kManifest,  SavePoint::kRenameDir,
                                               SavePoint::kFsyncRoot,  SavePoint::kLatest,    SavePoint::kPrune};
const char* save_point_name(SavePoint p);  // "fsync-file"
// Called just before the step it names (kFsyncRoot: after the rename, before the fsync), from
// whichever thread runs it, with the path it concerns. Whatever it throws is that step's failure
// and goes through the same handling as a real one (a kWrite throw marks the writer broken, a
// kPrune throw is swallowed like any prune failure). Must be thread-safe.
using SaveFaultHook = std::function<void(SavePoint point, const std::string& path)>;
// Tests only: installs the hook for every save in this process ({} removes it); returns the
// previous one. Set it while no save is running.
SaveFaultHook set_save_fault_hook(SaveFaultHook hook);

// ---- ownership of a checkpoint directory ------------------------------------------------------

// What makes two runs the same run: checkpoints of one must never be mixed with another's.
struct RunIdentity {
  nlohmann::json model = nlohmann::json::object();  // the shape, compared whole (train: run_identity())
  std::string model_description;                    // "gpt: 1 layers, 2 heads, ..." for messages
  uint64_t seed = 0;
  std::string data;
  std::string describe() const;  // "gpt: ..., seed 1, data synthetic"
  bool same_as(const RunIdentity& o) const { return model == o.model && seed == o.seed && data == o.data; }
};

// Held for the whole run (move it into the run's scope; destroying it releases the run lock).
class CheckpointDirLease {
 public:
  CheckpointDirLease(CheckpointDirLease&&) noexcept;
  CheckpointDirLease& operator=(CheckpointDirLease&&) noexcept;
  ~CheckpointDirLease();
  const std::string& root() const;
  const std::string& run_id() const;  // the owner lineage's id, recorded in owner.json and every manifest
  // Sentences to print once before training (directories left alone, a takeover); may be empty.
  const std::vector<std::string>& notes() const;

 private:
  struct State;
  friend CheckpointDirLease open_checkpoint_dir(const std::string&, const RunIdentity&, bool, int64_t);
  explicit CheckpointDirLease(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

// Call before step 1 for --checkpoint-dir. Refuses `/` and $HOME, creates dir if needed and checks
// it is a writable directory, takes ROOT/.run.lock for the lease's lifetime (a second concurrent
// run is refused; the lock file holds a lease — pid, host, start, renewed every 10 s — so that a
// killed run's stale lock is told from a live run on another host), then settles ownership: with
// no owner yet this run becomes the owner (owner.json written atomically, with a new run id) —
// only while the directory is empty: a non-empty directory without a valid owner record is never
// adopted; the owner itself (same identity) or a resumed run (resuming = --resume given) continues
// its lineage; another run is refused while the directory holds committed checkpoints. Finally
// every name a save may write (step-N for N <= last_step, any N when last_step is 0; latest,
// owner.json, config.toml) must be free or the lineage's own. Every refusal is kInvalidArgument
// with one sentence naming the fix, and leaves a directory that existed as it was (a lock file
// aside).
CheckpointDirLease open_checkpoint_dir(const std::string& dir, const RunIdentity& id, bool resuming,
                                       int64_t last_step = 0);

// A validated checkpoint, open for reading. Every check happens in open(): the manifest's schema
// and checksum, plain file names opened with O_NOFOLLOW, every file's size, and (with
// kFull) the xxHash64 of every file and every range. read() is then safe from any thread.
class CheckpointReader {
 public:
  enum class Verify { kFull, kSizesOnly };
  // Throws zt::Error (kInvalidArgument for a corrupt/truncated/unsafe checkpoint, kIo for a failed
  // read) with one sentence naming the checkpoint and the file.
  static CheckpointReader open(const std::string& dir, Verify verify = Verify::kFull);
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();

  const std::string& path() const;
  int64_t step() const;
  const nlohmann::json& meta() const;
  const Manifest& manifest() const;
  bool has_array(const std::string& name) const;
  // Throws kInvalidArgument naming the checkpoint when there is no such array.
  const ManifestArray& array(const std::string& name) const;
  // Copies elements [begin, begin + count) of the array into out (count * element size bytes),
  // assembled from whichever stored ranges cover them: any range, whatever the writer's split.
  void read(const std::string& name, uint64_t begin, uint64_t count, void* out) const;

 private:
  struct State;
  explicit CheckpointReader(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

struct ResolvedCheckpoint {
  std::string path;
  int64_t step = 0;
  CheckpointReader reader;  // already validated
};

// --resume, parsed once on the command line: a fresh run, `auto` (the newest complete checkpoint
// under --checkpoint-dir, else a fresh start) or the path of one checkpoint directory.
struct ResumeFrom {
  enum class Kind { kFresh, kNewest, kCheckpoint };
  Kind kind = Kind::kFresh;
  std::string path;  // kCheckpoint

  static ResumeFrom newest() { return {Kind::kNewest, {}}; }
  static ResumeFrom checkpoint(std::string dir) { return {Kind::kCheckpoint, std::move(dir)}; }
  // The flag's text: "auto" or a path; "" is kInvalidArgument.
  static ResumeFrom parse(const std::string& text);
  bool fresh() const { return kind == Kind::kFresh; }
  bool newest_in_dir() const { return kind == Kind::kNewest; }
  std::string text() const;  // as the flag would say it: "auto", the path, or "" (fresh)
};

// --resume. kNewest: `root` is the checkpoint root; returns the highest-step checkpoint that
// validates, adding to *notes (may be null) one sentence per newer checkpoint refused ("checkpoint
// step-00000200 is unusable: ...; falling back to step-00000100"). Returns nullopt when root has
// no checkpoint at all (a fresh start); throws kInvalidArgument when checkpoints exist but none
// validates (starting from scratch silently would discard the run). kCheckpoint: that checkpoint
// directory, opened and validated with no fallback (its errors are thrown). A path or root that
// is a file (such as ROOT/latest) is kInvalidArgument naming the fix; kFresh is kInvalidArgument.
std::optional<ResolvedCheckpoint> resolve_resume(const std::string& root, const ResumeFrom& from,
                                                 std::vector<std::string>* notes);

}  // namespace zt
