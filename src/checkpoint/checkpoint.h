// Sharded checkpoints on disk: atomic save (CheckpointWriter), validated load with any-range reads
// for resharding (CheckpointReader), discovery and fallback for --resume (resolve_resume).
// Knows nothing of the ZeRO engine: it stores named flat arrays as ranges across files
// (see manifest.h for the data model and the integrity rules).
//
// Layout: ROOT/step-00000100/{manifest.json, rank-00000.bin, rank-00001.bin, ...}, ROOT/latest
// (one line: the name of the newest committed checkpoint directory), ROOT/.lock (flock'd by the
// one writer allowed at a time).
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
// deletes anything.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/manifest.h"
#include "checkpoint/storage_dtype.h"

namespace zt {

inline constexpr char kLatestFileName[] = "latest";

// "step-00000100" (at least 8 digits); parse_step_dir is its inverse (nullopt for other names).
std::string format_step_dir(int64_t step);
std::optional<int64_t> parse_step_dir(std::string_view name);
// "rank-00003.bin"
std::string format_rank_file(int rank);

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

// Writes one checkpoint. Usage: declare every array, write every element of each exactly once
// (from any threads: calls for different files run concurrently, calls for one file serialise),
// then commit. Destroying a writer that did not commit discards everything it wrote.
// Only one writer per root may exist at a time (across processes too: ROOT/.lock).
class CheckpointWriter {
 public:
  // Creates root if needed and the staging directory with num_files empty files.
  CheckpointWriter(std::string root, int64_t step, int num_files);
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

  const std::string& root() const;
  int64_t step() const;
  int num_files() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

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

// --resume. spec "auto": `root` is the checkpoint root; returns the highest-step checkpoint that
// validates, adding to *notes (may be null) one sentence per newer checkpoint refused ("checkpoint
// step-00000200 is unusable: ...; falling back to step-00000100"). Returns nullopt when root has
// no checkpoint at all (a fresh start); throws kInvalidArgument when checkpoints exist but none
// validates (starting from scratch silently would discard the run). Any other spec is the path
// of one checkpoint directory, opened and validated with no fallback (its errors are thrown).
std::optional<ResolvedCheckpoint> resolve_resume(const std::string& root, const std::string& spec,
                                                 std::vector<std::string>* notes);

}  // namespace zt
