// Atomic sharded checkpoint save, validated load, --resume resolution (see checkpoint.h for the
// on-disk protocol and why each step is ordered as it is).
#include "checkpoint/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <mutex>
#include <optional>
#include <thread>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "checkpoint/file_io.h"
#include "core/status.h"

namespace zt {
namespace {

namespace fs = std::filesystem;

constexpr char kStagingPrefix[] = ".tmp-";
constexpr char kTrashPrefix[] = ".trash-";
constexpr char kLockFileName[] = ".lock";
constexpr int kMaxFiles = 1 << 16;
constexpr size_t kVerifyChunk = size_t{4} << 20;

struct XxhStateDeleter {
  void operator()(XXH64_state_t* s) const { XXH64_freeState(s); }
};
using XxhState = std::unique_ptr<XXH64_state_t, XxhStateDeleter>;

XxhState new_xxh_state() {
  XxhState s(XXH64_createState());
  if (!s) throw std::bad_alloc();
  XXH64_reset(s.get(), 0);
  return s;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// The test hook (set_save_fault_hook); the flag keeps the common no-hook path free of the mutex.
std::mutex g_hook_mu;
SaveFaultHook g_hook;
std::atomic<bool> g_hook_set{false};

void fault_point(SavePoint p, const std::string& path) {
  if (!g_hook_set.load(std::memory_order_acquire)) return;
  SaveFaultHook hook;
  {
    std::lock_guard<std::mutex> lock(g_hook_mu);
    hook = g_hook;
  }
  if (hook) hook(p, path);
}

// The owner record (owner.json): {"format", "version", "run_id", "identity", "adopted"}.
constexpr char kOwnerFormat[] = "zerotrain-checkpoint-owner";
constexpr uint64_t kMaxOwnerBytes = uint64_t{1} << 20;

struct OwnerRecord {
  std::string run_id;
  RunIdentity identity;
  std::vector<std::string> adopted;  // step directories committed before owner records, taken over
};

nlohmann::json identity_json(const RunIdentity& id) {
  return {{"model", id.model}, {"model_description", id.model_description}, {"seed", id.seed}, {"data", id.data}};
}

// Runs fn(i) for i in [0, n) on up to `threads` threads; rethrows the exception of the lowest i
// that failed, so messages do not depend on scheduling.
template <typename F>
void parallel_each(size_t n, size_t threads, F&& fn) {
  std::vector<std::exception_ptr> errors(n);
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < n; i = next++) {
      try {
        fn(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  threads = std::max<size_t>(1, std::min(threads, n));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

size_t io_threads() { return std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8); }

// Moves a directory out of the way atomically (so no half-deleted directory ever carries a
// step-N name), then deletes it. Best effort: a failure leaves a .trash-* entry for the next save.
void trash_dir(const std::string& root, const std::string& name) {
  static std::atomic<uint64_t> counter{0};
  const std::string trash = root + "/" + kTrashPrefix + name + "-" + std::to_string(::getpid()) + "-" +
                            std::to_string(counter++);
  if (::rename((root + "/" + name).c_str(), trash.c_str()) != 0) return;
  std::error_code ec;
  fs::remove_all(trash, ec);
}

std::string read_small_file(int dir_fd, const std::string& name, uint64_t limit, const std::string& what) {
  uint64_t size = 0;
  UniqueFd fd = open_regular_nofollow(dir_fd, name, what, &size);
  if (size > limit)
    ZT_THROW(ErrorKind::kInvalidArgument, what, ": the file is ", size, " bytes, more than the ", limit,
             " it may have; the checkpoint is corrupt");
  std::string text(size, '\0');
  pread_exact(fd.get(), text.data(), text.size(), 0, what);
  return text;
}

// Reads ROOT/owner.json: nullopt when there is none; kInvalidArgument when it is damaged.
std::optional<OwnerRecord> read_owner(const std::string& root) {
  UniqueFd dir(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir) return std::nullopt;
  struct stat st {};
  if (::fstatat(dir.get(), kOwnerFileName, &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT) return std::nullopt;
  const std::string what = root + "/" + kOwnerFileName;
  const std::string text = read_small_file(dir.get(), kOwnerFileName, kMaxOwnerBytes, what);
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.at("format").get<std::string>() != kOwnerFormat || j.at("version").get<int>() != 1)
      throw std::runtime_error("unknown format or version");
    OwnerRecord rec;
    rec.run_id = j.at("run_id").get<std::string>();
    const nlohmann::json& id = j.at("identity");
    rec.identity.model = id.at("model");
    rec.identity.model_description = id.at("model_description").get<std::string>();
    rec.identity.seed = id.at("seed").get<uint64_t>();
    rec.identity.data = id.at("data").get<std::string>();
    rec.adopted = j.value("adopted", std::vector<std::string>{});
    if (rec.run_id.empty()) throw std::runtime_error("empty run id");
    return rec;
  } catch (const std::exception& e) {
    ZT_THROW(ErrorKind::kInvalidArgument, what, " is not a valid owner record (", e.what(),
             "), so whose checkpoints ", root, " holds cannot be told; choose another --checkpoint-dir (to continue "
             "a run of yours from there, resume one of its checkpoints into a new directory: --resume ", root,
             "/step-N --checkpoint-dir NEW)");
  }
}

void write_owner(const std::string& root, const OwnerRecord& rec) {
  const nlohmann::json j = {{"format", kOwnerFormat}, {"version", 1}, {"run_id", rec.run_id},
                            {"identity", identity_json(rec.identity)}, {"adopted", rec.adopted}};
  atomic_write_file(root, kOwnerFileName, j.dump(1) + "\n");
}

// The run id a committed checkpoint's manifest records ("" when none or unreadable).
std::string checkpoint_owner(const std::string& dir) {
  try {
    UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!d) return {};
    const std::string what = dir + "/" + kManifestFileName;
    const Manifest m = parse_manifest(read_small_file(d.get(), kManifestFileName, kMaxManifestBytes, what), what);
    return m.meta.value("checkpoint_owner", std::string());
  } catch (const std::exception&) {
    return {};
  }
}

std::string new_run_id() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                     static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return hex64(v ^ (static_cast<uint64_t>(::getpid()) << 48));
}

}  // namespace

const char* save_point_name(SavePoint p) {
  switch (p) {
    case SavePoint::kStage: return "stage";
    case SavePoint::kWrite: return "write";
    case SavePoint::kFsyncFile: return "fsync-file";
    case SavePoint::kRenameFile: return "rename-file";
    case SavePoint::kManifest: return "manifest";
    case SavePoint::kRenameDir: return "rename-dir";
    case SavePoint::kFsyncRoot: return "fsync-root";
    case SavePoint::kLatest: return "latest";
    case SavePoint::kPrune: return "prune";
  }
  return "?";
}

SaveFaultHook set_save_fault_hook(SaveFaultHook hook) {
  std::lock_guard<std::mutex> lock(g_hook_mu);
  SaveFaultHook previous = std::move(g_hook);
  g_hook = std::move(hook);
  g_hook_set.store(static_cast<bool>(g_hook), std::memory_order_release);
  return previous;
}

// ---- names and discovery ---------------------------------------------------------------------

std::string format_step_dir(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> parse_step_dir(std::string_view name) {
  if (!starts_with(name, "step-")) return std::nullopt;
  const std::string_view digits = name.substr(5);
  if (digits.empty() || digits.size() > 18) return std::nullopt;
  int64_t v = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  // Only the canonical spelling: step-100 and step-00000100 must not both name step 100.
  if (format_step_dir(v) != name) return std::nullopt;
  return v;
}

std::string partial_dir_name(int64_t step, int process) {
  return "partial-" + format_step_dir(step) + "-process-" + std::to_string(process);
}

std::string format_rank_file(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d.bin", rank);
  return buf;
}

std::vector<CheckpointEntry> list_checkpoints(const std::string& root) {
  std::vector<CheckpointEntry> out;
  DIR* d = ::opendir(root.c_str());
  if (!d) {
    if (errno == ENOENT) return out;
    ZT_THROW(ErrorKind::kIo, root, ": cannot list the checkpoint directory (", errno_text(errno), ")");
  }
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const std::optional<int64_t> step = parse_step_dir(name);
    if (!step) continue;
    const std::string path = root + "/" + name;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    struct stat mst {};
    const bool has_manifest =
        ::lstat((path + "/" + kManifestFileName).c_str(), &mst) == 0 && S_ISREG(mst.st_mode);
    out.push_back(CheckpointEntry{*step, name, path, has_manifest});
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return out;
}

std::optional<std::string> read_latest(const std::string& root) {
  UniqueFd dir(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir) return std::nullopt;
  std::string text;
  try {
    text = read_small_file(dir.get(), kLatestFileName, 4096, root + "/" + kLatestFileName);
  } catch (const Error&) {
    return std::nullopt;
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  if (!parse_step_dir(text)) return std::nullopt;
  return text;
}

// ---- writer ----------------------------------------------------------------------------------

namespace {

struct WriterFile {
  std::mutex mu;
  UniqueFd fd;
  std::string tmp_name;    // ".rank-00000.bin.tmp"
  std::string final_name;  // "rank-00000.bin"
  uint64_t size = 0;
  XxhState hash;
  bool finished = false;
  std::optional<uint64_t> digest;  // an adopted file's hash (its writer hashed it in another process)
  // (array name, range); ManifestRange::file is filled at commit.
  std::vector<std::pair<std::string, ManifestRange>> ranges;
};

struct ArrayDecl {
  StorageDType dtype;
  uint64_t numel;
  std::vector<int64_t> shape;
};

}  // namespace

struct CheckpointWriter::State {
  std::string root;
  int64_t step = 0;
  std::string name;          // step-N
  std::string staging_path;  // root/.tmp-step-N-<pid>-<k>
  bool staging_exists = false;
  UniqueFd lock;
  std::mutex arrays_mu;
  std::map<std::string, ArrayDecl> arrays;
  std::vector<std::string> array_order;
  std::vector<std::unique_ptr<WriterFile>> files;
  std::atomic<bool> broken{false};  // a write failed part-way: the files are not what was asked
  bool committed = false;
  bool lead = true;          // commits (a WriterPart that is not the lead only hands over)
  bool handed_over = false;  // the staging directory's files belong to the lead now
  // From ROOT/owner.json when ROOT has an owner: stamped into the manifest, and what prune may
  // delete (checkpoints stamped with it, or adopted by it).
  std::string owner_run_id;
  std::set<std::string> adopted;

  std::string what(const WriterFile& f) const { return "checkpoint " + root + "/" + name + ": " + f.final_name; }

  // File `file`, which this writer holds (its own, or adopted by the lead).
  WriterFile& file_at(int file) {
    ZT_REQUIRE(file >= 0 && file < static_cast<int>(files.size()), "checkpoint file index ", file, " is outside [0, ",
               files.size(), ")");
    ZT_REQUIRE(files[static_cast<size_t>(file)] != nullptr, "checkpoint file ", format_rank_file(file),
               " belongs to another process's part of ", name);
    return *files[static_cast<size_t>(file)];
  }

  void finish(WriterFile& f) {
    std::lock_guard<std::mutex> lock(f.mu);
    if (f.finished) return;
    const std::string from = staging_path + "/" + f.tmp_name;
    const std::string to = staging_path + "/" + f.final_name;
    fault_point(SavePoint::kFsyncFile, from);
    fsync_fd(f.fd.get(), what(f));
    f.fd.close_checked(what(f));
    fault_point(SavePoint::kRenameFile, to);
    if (::rename(from.c_str(), to.c_str()) != 0)
      ZT_THROW(ErrorKind::kIo, what(f), ": cannot rename the finished file into place (", errno_text(errno), ")");
    f.finished = true;
  }

  void discard_staging() {
    if (!staging_exists) return;
    std::error_code ec;
    fs::remove_all(staging_path, ec);
    staging_exists = false;
  }
};

CheckpointWriter::CheckpointWriter(std::string root, int64_t step, int num_files, std::optional<WriterPart> part)
    : s_(std::make_unique<State>()) {
  ZT_REQUIRE(!root.empty(), "the checkpoint directory name is empty");
  ZT_REQUIRE(step >= 0, "checkpoint step must be non-negative (got ", step, ")");
  ZT_REQUIRE(num_files >= 1 && num_files <= kMaxFiles, "a checkpoint has 1 to ", kMaxFiles, " files (got ", num_files, ")");
  const WriterPart mine = part.value_or(WriterPart{0, num_files, true});
  ZT_REQUIRE(mine.first_file >= 0 && mine.count >= 0 && mine.first_file + mine.count <= num_files,
             "checkpoint part [", mine.first_file, ", +", mine.count, ") lies outside its ", num_files, " files");
  s_->lead = mine.lead;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  s_->root = root;
  s_->step = step;
  s_->name = format_step_dir(step);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) {
    // A path through a file, or one we may not create: the user's mistake, not the disk's.
    const ErrorKind kind = ec == std::errc::not_a_directory || ec == std::errc::file_exists ||
                                   ec == std::errc::permission_denied || ec == std::errc::read_only_file_system
                               ? ErrorKind::kInvalidArgument
                               : ErrorKind::kIo;
    ZT_THROW(kind, root, ": cannot create the checkpoint directory (", ec.message(), ")");
  }
  if (!fs::is_directory(root, ec))
    ZT_THROW(ErrorKind::kInvalidArgument, root, ": exists and is not a directory, so checkpoints cannot be saved there");

  const std::string lock_path = root + "/" + kLockFileName;
  // The lead's lock covers the whole save: the other parts only write into their own staging
  // directories, which nothing but the lead's commit (after every hand-over) touches.
  if (s_->lead) s_->lock.reset(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (s_->lead && !s_->lock) ZT_THROW(ErrorKind::kIo, lock_path, ": cannot create the lock file (", errno_text(errno), ")");
  while (s_->lead && ::flock(s_->lock.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno == EWOULDBLOCK)
      ZT_THROW(ErrorKind::kInvalidArgument, root, ": another checkpoint save (in this or another process) "
               "holds ", lock_path, "; only one run may save into a checkpoint directory at a time");
    ZT_THROW(ErrorKind::kIo, lock_path, ": cannot lock (", errno_text(errno), ")");
  }

  // Under the lock: the owner cannot change during this save.
  if (const std::optional<OwnerRecord> owner = s_->lead ? read_owner(root) : std::nullopt) {
    s_->owner_run_id = owner->run_id;
    s_->adopted.insert(owner->adopted.begin(), owner->adopted.end());
  }
  fault_point(SavePoint::kStage, root);

  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    s_->staging_path = root + "/" + kStagingPrefix + s_->name + "-" + std::to_string(::getpid()) + "-" +
                       std::to_string(counter++);
    if (::mkdir(s_->staging_path.c_str(), 0755) == 0) break;
    if (errno != EEXIST || attempt > 100)
      ZT_THROW(ErrorKind::kIo, s_->staging_path, ": cannot create the staging directory (", errno_text(errno), ")");
  }
  s_->staging_exists = true;
  try {
    s_->files.resize(static_cast<size_t>(num_files));
    for (int r = mine.first_file; r < mine.first_file + mine.count; ++r) {
      auto f = std::make_unique<WriterFile>();
      f->final_name = format_rank_file(r);
      f->tmp_name = "." + f->final_name + ".tmp";
      const std::string path = s_->staging_path + "/" + f->tmp_name;
      f->fd.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644));
      if (!f->fd) ZT_THROW(ErrorKind::kIo, path, ": cannot create the checkpoint file (", errno_text(errno), ")");
      f->hash = new_xxh_state();
      s_->files[static_cast<size_t>(r)] = std::move(f);
    }
  } catch (...) {
    s_->files.clear();
    s_->discard_staging();
    throw;
  }
}

CheckpointWriter::~CheckpointWriter() {
  if (!s_) return;
  for (auto& f : s_->files)
    if (f) f->fd.reset();
  if (!s_->committed && !s_->handed_over) s_->discard_staging();
}

const std::string& CheckpointWriter::root() const { return s_->root; }
int64_t CheckpointWriter::step() const { return s_->step; }
int CheckpointWriter::num_files() const { return static_cast<int>(s_->files.size()); }

void CheckpointWriter::declare_array(const std::string& name, StorageDType dtype, uint64_t numel,
                                     std::vector<int64_t> shape) {
  ZT_REQUIRE(!name.empty() && name.size() <= 4096, "checkpoint array names must have 1 to 4096 bytes");
  uint64_t bytes;
  ZT_REQUIRE(checked_mul(numel, storage_dtype_size(dtype), &bytes) &&
                 bytes <= static_cast<uint64_t>(INT64_MAX),
             "checkpoint array '", name, "': ", numel, " elements are too many");
  if (!shape.empty()) {
    uint64_t product = 1;
    for (const int64_t d : shape)
      ZT_REQUIRE(d >= 0 && checked_mul(product, static_cast<uint64_t>(d), &product),
                 "checkpoint array '", name, "': the shape has a negative or overflowing dimension");
    ZT_REQUIRE(product == numel, "checkpoint array '", name, "': the shape holds ", product,
               " elements but numel is ", numel);
  }
  std::lock_guard<std::mutex> lock(s_->arrays_mu);
  ZT_REQUIRE(!s_->committed, "checkpoint ", s_->name, " is already committed");
  const bool inserted = s_->arrays.emplace(name, ArrayDecl{dtype, numel, std::move(shape)}).second;
  ZT_REQUIRE(inserted, "checkpoint array '", name, "' is declared twice");
  s_->array_order.push_back(name);
}

void CheckpointWriter::write_range(int file, const std::string& name, uint64_t begin, const void* data,
                                   uint64_t bytes) {
  WriterFile& f = s_->file_at(file);
  StorageDType dtype;
  uint64_t numel;
  {
    std::lock_guard<std::mutex> lock(s_->arrays_mu);
    const auto it = s_->arrays.find(name);
    ZT_REQUIRE(it != s_->arrays.end(), "checkpoint array '", name, "' was not declared before writing");
    dtype = it->second.dtype;
    numel = it->second.numel;
  }
  const uint64_t elem = storage_dtype_size(dtype);
  ZT_REQUIRE(bytes % elem == 0, "checkpoint array '", name, "': ", bytes, " bytes are not whole ",
             storage_dtype_name(dtype), " elements");
  const uint64_t count = bytes / elem;
  uint64_t end;
  ZT_REQUIRE(checked_add(begin, count, &end) && end <= numel, "checkpoint array '", name, "': elements [",
             begin, ", +", count, ") lie outside its ", numel, " elements");
  if (count == 0) return;
  ZT_REQUIRE(data != nullptr, "checkpoint array '", name, "': null data pointer");
  const uint64_t range_hash = xxh64(data, bytes);

  std::lock_guard<std::mutex> lock(f.mu);
  ZT_REQUIRE(!f.finished, "checkpoint file ", f.final_name, " is already finished; no more writes to it");
  try {
    fault_point(SavePoint::kWrite, s_->staging_path + "/" + f.tmp_name);
    write_all(f.fd.get(), data, bytes, s_->what(f));
  } catch (...) {
    s_->broken = true;
    throw;
  }
  XXH64_update(f.hash.get(), data, bytes);
  f.ranges.emplace_back(name, ManifestRange{static_cast<uint32_t>(file), begin, count, f.size, bytes, range_hash});
  f.size += bytes;
}

void CheckpointWriter::finish_file(int file) {
  s_->finish(s_->file_at(file));
}

nlohmann::json CheckpointWriter::hand_over() {
  State& s = *s_;
  ZT_REQUIRE(!s.lead && !s.handed_over, "checkpoint ", s.name, ": only a part that is not the lead hands over, once");
  ZT_REQUIRE(!s.broken, "checkpoint ", s.root, "/", s.name, " cannot be handed over: a write to one of its files failed");
  nlohmann::json files = nlohmann::json::array();
  for (size_t i = 0; i < s.files.size(); ++i) {
    if (!s.files[i]) continue;
    WriterFile& f = *s.files[i];
    s.finish(f);
    nlohmann::json ranges = nlohmann::json::array();
    for (const auto& [array, r] : f.ranges) ranges.push_back({array, r.begin, r.count, r.offset, r.bytes, r.xxh64});
    files.push_back({{"index", i}, {"name", f.final_name}, {"size", f.size}, {"xxh64", XXH64_digest(f.hash.get())},
                     {"ranges", std::move(ranges)}});
  }
  fsync_dir(s.staging_path);
  s.handed_over = true;
  nlohmann::json arrays = nlohmann::json::array();
  for (const std::string& name : s.array_order) {
    const ArrayDecl& d = s.arrays.at(name);
    arrays.push_back({name, static_cast<int>(d.dtype), d.numel, d.shape});
  }
  return {{"staging", s.staging_path}, {"files", std::move(files)}, {"arrays", std::move(arrays)}};
}

std::optional<std::string> assemble_partials(const std::string& root, int keep) {
  // step -> (directory, its partial.json)
  std::map<int64_t, std::vector<std::pair<std::string, nlohmann::json>>> parts;
  if (DIR* d = ::opendir(root.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (!starts_with(n, "partial-step-")) continue;
      const size_t end = n.find("-process-");
      const std::optional<int64_t> step = end == std::string::npos ? std::nullopt : parse_step_dir(n.substr(8, end - 8));
      if (!step) continue;
      std::ifstream in(root + "/" + n + "/" + kPartialFileName);
      const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
      if (!j.is_discarded() && j.contains("partial") && j.contains("arrays")) parts[*step].emplace_back(root + "/" + n, j);
    }
    ::closedir(d);
  }
  if (parts.empty()) return std::nullopt;
  int64_t newest = -1;
  for (const CheckpointEntry& e : list_checkpoints(root))
    if (e.has_manifest) newest = std::max(newest, e.step);
  auto& [step, found] = *parts.rbegin();
  if (step <= newest) return std::nullopt;
  const int ranks = found.front().second["partial"]["ranks"].get<int>();
  std::set<size_t> held;
  for (const auto& [dir, j] : found)
    for (const nlohmann::json& f : j["files"]) held.insert(f["index"].get<size_t>());
  if (held.size() != static_cast<size_t>(ranks) || *held.rbegin() + 1 != static_cast<size_t>(ranks)) return std::nullopt;
  CheckpointWriter writer(root, step, ranks, WriterPart{0, 0, true});
  for (const nlohmann::json& a : found.front().second["arrays"])
    writer.declare_array(a[0].get<std::string>(), static_cast<StorageDType>(a[1].get<int>()), a[2].get<uint64_t>(),
                         a[3].get<std::vector<int64_t>>());
  std::set<size_t> adopted;
  for (auto& [dir, j] : found) {
    nlohmann::json part = {{"staging", dir}, {"files", nlohmann::json::array()}};
    for (const nlohmann::json& f : j["files"])  // a rank both its process and a replica hold: once
      if (adopted.insert(f["index"].get<size_t>()).second) part["files"].push_back(f);
    writer.adopt(part);
  }
  nlohmann::json meta = found.front().second["partial"]["meta"];
  meta.erase("checkpoint_owner");
  const std::string path = writer.commit(meta, keep);
  for (const auto& [s, list] : parts)
    if (s <= step)
      for (const auto& [dir, j] : list) {
        std::error_code ec;
        fs::remove_all(dir, ec);
      }
  return path;
}

void CheckpointWriter::adopt(const nlohmann::json& part) {
  State& s = *s_;
  ZT_REQUIRE(s.lead && !s.committed, "checkpoint ", s.name, ": only the lead adopts parts, before its commit");
  try {
    const std::string from_dir = part.at("staging").get<std::string>();
    for (const nlohmann::json& jf : part.at("files")) {
      const size_t i = jf.at("index").get<size_t>();
      ZT_REQUIRE(i < s.files.size() && !s.files[i], "checkpoint ", s.name, ": a part hands over file ", i,
                 ", which is outside the checkpoint or already present");
      auto f = std::make_unique<WriterFile>();
      f->final_name = format_rank_file(static_cast<int>(i));
      ZT_REQUIRE(jf.at("name").get<std::string>() == f->final_name, "checkpoint ", s.name, ": a part names file ", i, " '",
                 jf.at("name").get<std::string>(), "'");
      f->size = jf.at("size").get<uint64_t>();
      f->digest = jf.at("xxh64").get<uint64_t>();
      f->finished = true;
      for (const nlohmann::json& r : jf.at("ranges"))
        f->ranges.emplace_back(r.at(0).get<std::string>(),
                               ManifestRange{static_cast<uint32_t>(i), r.at(1).get<uint64_t>(), r.at(2).get<uint64_t>(),
                                             r.at(3).get<uint64_t>(), r.at(4).get<uint64_t>(), r.at(5).get<uint64_t>()});
      const std::string from = from_dir + "/" + f->final_name, to = s.staging_path + "/" + f->final_name;
      if (::rename(from.c_str(), to.c_str()) != 0)
        ZT_THROW(ErrorKind::kIo, "checkpoint ", s.root, "/", s.name, ": cannot move ", from,
                 " into place (", errno_text(errno), "); every process must see the same checkpoint directory");
      s.files[i] = std::move(f);
    }
  } catch (const nlohmann::json::exception& e) {
    ZT_THROW(ErrorKind::kInvalidArgument, "checkpoint ", s.name, ": a part's hand-over is malformed (", e.what(), ")");
  }
}

namespace {
// Step 5: removes checkpoints beyond `keep` (never `current`) and leftovers of interrupted saves
// (.tmp-*, .trash-*, .latest.tmp-*, .owner.json.tmp-*). With an owner (owner_run_id non-empty) only
// the owner lineage's checkpoints count and are deleted; a step directory without a manifest is
// never deleted (no save of ours leaves one). The caller holds the root's lock, so no other save is
// in progress.
void prune(const std::string& root, int64_t current, int keep, const std::string& owner_run_id,
           const std::set<std::string>& adopted);
}  // namespace

std::string CheckpointWriter::commit(const nlohmann::json& meta, int keep) {
  State& s = *s_;
  ZT_REQUIRE(!s.committed, "checkpoint ", s.name, " is already committed");
  ZT_REQUIRE(s.lead, "checkpoint ", s.name, ": only the lead part commits");
  ZT_REQUIRE(!s.broken, "checkpoint ", s.root, "/", s.name, " cannot be committed: a write to one of its files failed");
  for (size_t i = 0; i < s.files.size(); ++i)
    ZT_REQUIRE(s.files[i] != nullptr, "checkpoint ", s.name, ": file ", format_rank_file(static_cast<int>(i)),
               " was never handed over by its process");
  ZT_REQUIRE(meta.is_object(), "checkpoint metadata must be a JSON object");
  ZT_REQUIRE(keep >= 0, "--keep must be >= 0 (0 keeps every checkpoint), got ", keep);

  // Every array written exactly once: checked before anything becomes visible.
  std::map<std::string, std::vector<ManifestRange>> ranges;
  for (const auto& f : s.files)
    for (const auto& [name, r] : f->ranges) ranges[name].push_back(r);
  Manifest m;
  m.step = s.step;
  m.meta = meta;
  if (!s.owner_run_id.empty()) m.meta["checkpoint_owner"] = s.owner_run_id;
  for (const std::string& name : s.array_order) {
    const ArrayDecl& decl = s.arrays.at(name);
    std::vector<ManifestRange>& rs = ranges[name];
    std::sort(rs.begin(), rs.end(), [](const ManifestRange& a, const ManifestRange& b) { return a.begin < b.begin; });
    uint64_t next = 0;
    for (const ManifestRange& r : rs) {
      ZT_REQUIRE(r.begin >= next, "checkpoint ", s.name, ": elements [", r.begin, ", ", next,
                 ") of array '", name, "' were written twice");
      ZT_REQUIRE(r.begin == next, "checkpoint ", s.name, ": elements [", next, ", ", r.begin,
                 ") of array '", name, "' were never written");
      next = r.begin + r.count;
    }
    ZT_REQUIRE(next == decl.numel, "checkpoint ", s.name, ": elements [", next, ", ", decl.numel,
               ") of array '", name, "' were never written");
    m.arrays.push_back(ManifestArray{name, decl.dtype, decl.numel, decl.shape, std::move(rs)});
  }

  // 1. files: fsync + rename (concurrently; fsync is the slow part).
  parallel_each(s.files.size(), io_threads(), [&](size_t i) { s.finish(*s.files[i]); });
  for (const auto& f : s.files)
    m.files.push_back(ManifestFile{f->final_name, f->size, f->digest ? *f->digest : XXH64_digest(f->hash.get())});

  // 2. the manifest last, then the staging directory (atomic_write_file fsyncs it).
  fault_point(SavePoint::kManifest, s.staging_path + "/" + kManifestFileName);
  atomic_write_file(s.staging_path, kManifestFileName, serialize_manifest(std::move(m)));

  // 3. into place: never destroying a complete step-N before this one is complete.
  const std::string final_path = s.root + "/" + s.name;
  fault_point(SavePoint::kRenameDir, final_path);
  if (::rename(s.staging_path.c_str(), final_path.c_str()) == 0) {
    s.staging_exists = false;
  } else if (errno == ENOTEMPTY || errno == EEXIST) {
    // step-N exists (an earlier run saved this step): swap atomically; the old one lands at the
    // staging path and is deleted below.
    if (::renameat2(AT_FDCWD, s.staging_path.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) != 0) {
      if (errno != EINVAL && errno != ENOSYS)
        ZT_THROW(ErrorKind::kIo, final_path, ": cannot replace the existing checkpoint (", errno_text(errno), ")");
      // No RENAME_EXCHANGE on this file system: move the old one aside first. In between, the
      // older checkpoints remain complete, so resume still finds one.
      const std::string aside = s.root + "/" + kTrashPrefix + s.name + "-" + std::to_string(::getpid()) + "-old";
      if (::rename(final_path.c_str(), aside.c_str()) != 0)
        ZT_THROW(ErrorKind::kIo, final_path, ": cannot move the existing checkpoint aside (", errno_text(errno), ")");
      if (::rename(s.staging_path.c_str(), final_path.c_str()) != 0)
        ZT_THROW(ErrorKind::kIo, final_path, ": cannot rename the new checkpoint into place (", errno_text(errno), ")");
      s.staging_exists = false;
    }
    // After the exchange staging_path holds the old checkpoint: discard_staging deletes it.
  } else {
    ZT_THROW(ErrorKind::kIo, final_path, ": cannot rename the new checkpoint into place (", errno_text(errno), ")");
  }
  fault_point(SavePoint::kFsyncRoot, s.root);
  fsync_dir(s.root);
  s.committed = true;

  // 4. latest.
  fault_point(SavePoint::kLatest, s.root + "/" + kLatestFileName);
  atomic_write_file(s.root, kLatestFileName, s.name + "\n");

  // 5. prune and clean up (best effort: the checkpoint is complete whatever happens here, so a
  // failure only leaves more on disk for the next save to remove).
  s.discard_staging();
  try {
    fault_point(SavePoint::kPrune, s.root);
    prune(s.root, s.step, keep, s.owner_run_id, s.adopted);
  } catch (const std::exception&) {
  }
  s.lock.reset();
  return final_path;
}

namespace {

void prune(const std::string& root, int64_t current, int keep, const std::string& owner_run_id,
           const std::set<std::string>& adopted) {
  std::vector<CheckpointEntry> entries = list_checkpoints(root);
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.step > b.step; });
  int kept = 0;
  for (const CheckpointEntry& e : entries) {
    // No save of ours leaves a step-N without a manifest (it appears by rename, complete), so such
    // a directory is someone else's: never deleted (open_checkpoint_dir mentions it).
    if (e.step == current || !e.has_manifest || keep == 0) continue;
    if (!owner_run_id.empty() && !adopted.count(e.name) && checkpoint_owner(e.path) != owner_run_id) continue;
    if (++kept >= keep) trash_dir(root, e.name);
  }
  if (DIR* d = ::opendir(root.c_str())) {
    std::vector<std::string> leftovers;
    while (const dirent* e = ::readdir(d)) {
      const std::string_view n = e->d_name;
      if (starts_with(n, kStagingPrefix) || starts_with(n, kTrashPrefix) || starts_with(n, ".latest.tmp-") ||
          starts_with(n, ".owner.json.tmp-"))
        leftovers.emplace_back(n);
    }
    ::closedir(d);
    for (const std::string& n : leftovers) {
      std::error_code ec;
      fs::remove_all(root + "/" + n, ec);
    }
  }
}

}  // namespace

// ---- reader ----------------------------------------------------------------------------------

struct CheckpointReader::State {
  std::string path;
  std::string where;  // "checkpoint PATH"
  Manifest manifest;
  std::vector<UniqueFd> fds;
  std::map<std::string, size_t, std::less<>> array_index;
};

CheckpointReader::CheckpointReader(std::unique_ptr<State> s) : s_(std::move(s)) {}
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;
CheckpointReader::~CheckpointReader() = default;

CheckpointReader CheckpointReader::open(const std::string& dir, Verify verify) {
  auto s = std::make_unique<State>();
  s->path = dir;
  s->where = "checkpoint " + dir;
  UniqueFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir_fd) {
    const int err = errno;
    if (err == ENOENT) ZT_THROW(ErrorKind::kInvalidArgument, s->where, " does not exist");
    if (err == ENOTDIR) ZT_THROW(ErrorKind::kInvalidArgument, s->where, " is not a directory");
    ZT_THROW(ErrorKind::kIo, s->where, ": cannot open the directory (", errno_text(err), ")");
  }
  struct stat mst {};
  if (::fstatat(dir_fd.get(), kManifestFileName, &mst, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT)
    ZT_THROW(ErrorKind::kInvalidArgument, s->where, " has no ", kManifestFileName,
             ", so it is incomplete (an interrupted save) or not a checkpoint");
  const std::string manifest_what = s->where + ": " + kManifestFileName;
  const std::string text = read_small_file(dir_fd.get(), kManifestFileName, kMaxManifestBytes, manifest_what);
  s->manifest = parse_manifest(text, manifest_what);
  const Manifest& m = s->manifest;

  for (const ManifestFile& f : m.files) {
    const std::string what = s->where + ": " + f.name;
    uint64_t size = 0;
    s->fds.push_back(open_regular_nofollow(dir_fd.get(), f.name, what, &size));
    if (size != f.size)
      ZT_THROW(ErrorKind::kInvalidArgument, what, ": the file is ", size, " bytes, but the manifest records ",
               f.size, size < f.size ? " (it was truncated)" : " (it has extra bytes)", "; the checkpoint is corrupt");
  }
  for (size_t a = 0; a < m.arrays.size(); ++a) s->array_index.emplace(m.arrays[a].name, a);

  if (verify == Verify::kFull) {
    // Per file: its ranges in offset order tile it exactly (validate_manifest), so one sequential
    // pass hashes the file and each range.
    std::vector<std::vector<std::pair<const ManifestArray*, const ManifestRange*>>> by_file(m.files.size());
    for (const ManifestArray& a : m.arrays)
      for (const ManifestRange& r : a.ranges) by_file[r.file].emplace_back(&a, &r);
    parallel_each(m.files.size(), io_threads(), [&](size_t fi) {
      auto& list = by_file[fi];
      std::sort(list.begin(), list.end(), [](const auto& x, const auto& y) { return x.second->offset < y.second->offset; });
      const ManifestFile& f = m.files[fi];
      const std::string what = s->where + ": " + f.name;
      std::vector<char> buf(std::min<uint64_t>(kVerifyChunk, std::max<uint64_t>(f.size, 1)));
      XxhState file_hash = new_xxh_state();
      XxhState range_hash = new_xxh_state();
      std::string bad_range;
      for (const auto& [array, range] : list) {
        XXH64_reset(range_hash.get(), 0);
        for (uint64_t done = 0; done < range->bytes;) {
          const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), range->bytes - done));
          pread_exact(s->fds[fi].get(), buf.data(), n, range->offset + done, what);
          XXH64_update(file_hash.get(), buf.data(), n);
          XXH64_update(range_hash.get(), buf.data(), n);
          done += n;
        }
        if (bad_range.empty() && XXH64_digest(range_hash.get()) != range->xxh64)
          bad_range = "; the damage is in array '" + array->name + "' elements [" + std::to_string(range->begin) +
                      ", +" + std::to_string(range->count) + ") at byte " + std::to_string(range->offset);
      }
      const uint64_t digest = XXH64_digest(file_hash.get());
      if (digest != f.xxh64 || !bad_range.empty())
        ZT_THROW(ErrorKind::kInvalidArgument, what, ": checksum mismatch (xxHash64 ", hex64(digest),
                 ", the manifest records ", hex64(f.xxh64), ")", bad_range, "; the checkpoint is corrupt");
    });
  }
  return CheckpointReader(std::move(s));
}

const std::string& CheckpointReader::path() const { return s_->path; }
int64_t CheckpointReader::step() const { return s_->manifest.step; }
const nlohmann::json& CheckpointReader::meta() const { return s_->manifest.meta; }
const Manifest& CheckpointReader::manifest() const { return s_->manifest; }
bool CheckpointReader::has_array(const std::string& name) const { return s_->array_index.count(name) != 0; }

const ManifestArray& CheckpointReader::array(const std::string& name) const {
  const auto it = s_->array_index.find(name);
  ZT_REQUIRE(it != s_->array_index.end(), s_->where, " has no array '", name, "'");
  return s_->manifest.arrays[it->second];
}

void CheckpointReader::read(const std::string& name, uint64_t begin, uint64_t count, void* out) const {
  const ManifestArray& a = array(name);
  uint64_t end;
  ZT_REQUIRE(checked_add(begin, count, &end) && end <= a.numel, s_->where, ": array '", name, "' has ", a.numel,
             " elements; cannot read [", begin, ", +", count, ")");
  if (count == 0) return;
  const uint64_t elem = storage_dtype_size(a.dtype);
  // The first range that can hold `begin`: the last one starting at or before it.
  auto it = std::upper_bound(a.ranges.begin(), a.ranges.end(), begin,
                             [](uint64_t b, const ManifestRange& r) { return b < r.begin; });
  ZT_CHECK(it != a.ranges.begin(), "validated ranges start at 0");
  --it;
  char* dst = static_cast<char*>(out);
  for (uint64_t pos = begin; pos < end; ++it) {
    ZT_CHECK(it != a.ranges.end() && it->begin <= pos, "validated ranges tile the array");
    const uint64_t hi = std::min(end, it->begin + it->count);
    const uint64_t n = (hi - pos) * elem;
    pread_exact(s_->fds[it->file].get(), dst + (pos - begin) * elem, n, it->offset + (pos - it->begin) * elem,
                s_->where + ": " + s_->manifest.files[it->file].name);
    pos = hi;
  }
}

// ---- ownership ---------------------------------------------------------------------------------

std::string RunIdentity::describe() const {
  return (model_description.empty() ? model.dump() : model_description) + ", seed " + std::to_string(seed) +
         ", data " + data;
}

namespace {

// The lease: who holds ROOT/.run.lock, written into it as one fixed-width JSON line (rewritten in
// place, never truncated while held, so a reader on another host never sees an empty file) and
// renewed every kLeaseRenewSeconds. The flock decides between runs of one host; between hosts that
// share ROOT over a file system without working flock, a lease renewed within kLeaseStaleSeconds
// is taken as live. A clean release empties the file; content found under a free lock is a stale
// lease (a killed run's).
constexpr int kLeaseRenewSeconds = 10;
constexpr int kLeaseStaleSeconds = 60;
constexpr size_t kLeaseBytes = 255;

struct LeaseInfo {
  int64_t pid = 0;
  std::string host;
  int64_t started = 0;  // seconds since the epoch
  int64_t renewed = 0;
};

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

std::string lease_text(const LeaseInfo& l) {
  std::string t = nlohmann::json{{"pid", l.pid}, {"host", l.host}, {"started", l.started}, {"renewed", l.renewed}}.dump();
  if (t.size() < kLeaseBytes) t.append(kLeaseBytes - t.size(), ' ');
  return t + "\n";
}

// nullopt for an empty file (released) or an unreadable one; the format before leases (a pid
// alone) reads as a lease of this host with unknown times.
std::optional<LeaseInfo> parse_lease(const std::string& text) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.is_number_integer()) return LeaseInfo{j.get<int64_t>(), host_name(), 0, 0};
    return LeaseInfo{j.at("pid").get<int64_t>(), j.at("host").get<std::string>(), j.at("started").get<int64_t>(),
                     j.at("renewed").get<int64_t>()};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::string read_lease_text(int fd) {
  char buf[1024] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

std::string describe_lease(const LeaseInfo& l) {
  std::string d = "process " + std::to_string(l.pid) + " on " + l.host;
  if (l.started > 0) d += ", started " + std::to_string(std::max<int64_t>(0, unix_now() - l.started)) + " s ago";
  if (l.renewed > 0) d += ", lease renewed " + std::to_string(std::max<int64_t>(0, unix_now() - l.renewed)) + " s ago";
  return d;
}

}  // namespace

struct CheckpointDirLease::State {
  std::string root;
  std::string run_id;
  std::vector<std::string> notes;
  UniqueFd lock;  // flock'd on ROOT/.run.lock while the lease lives
  LeaseInfo lease;
  // The renewal thread (started once the lease is ours) and what stops it.
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::thread renewer;

  // Takes ROOT/.run.lock and writes this run's lease into it (refusing a live holder).
  void take_lock();
  void write_lease() {
    lease.renewed = unix_now();
    const std::string t = lease_text(lease);
    [[maybe_unused]] const ssize_t w = ::pwrite(lock.get(), t.data(), t.size(), 0);  // best effort: the flock rules
  }
  void start_renewing() {
    renewer = std::thread([this] {
      std::unique_lock<std::mutex> l(mu);
      while (!cv.wait_for(l, std::chrono::seconds(kLeaseRenewSeconds), [this] { return stopping; })) write_lease();
    });
  }
  ~State() {
    if (renewer.joinable()) {
      {
        std::lock_guard<std::mutex> l(mu);
        stopping = true;
      }
      cv.notify_all();
      renewer.join();
    }
    // Released cleanly (also a refusal after the lease was written): an empty lease, so that the
    // next run knows no one was killed holding it. A lease that is not ours is never touched.
    if (lock && lease.pid != 0 && ::ftruncate(lock.get(), 0) != 0) {
    }
  }
};

CheckpointDirLease::CheckpointDirLease(std::unique_ptr<State> s) : s_(std::move(s)) {}
CheckpointDirLease::CheckpointDirLease(CheckpointDirLease&&) noexcept = default;
CheckpointDirLease& CheckpointDirLease::operator=(CheckpointDirLease&&) noexcept = default;
CheckpointDirLease::~CheckpointDirLease() = default;
const std::string& CheckpointDirLease::root() const { return s_->root; }
const std::string& CheckpointDirLease::run_id() const { return s_->run_id; }
const std::vector<std::string>& CheckpointDirLease::notes() const { return s_->notes; }

namespace {

bool is_permission_errno(int err) { return err == EACCES || err == EPERM || err == EROFS; }

// "ROOT/latest is a file": the usual mistake is passing the latest pointer instead of its directory.
[[noreturn]] void throw_not_a_directory(const std::string& dir, const char* flag) {
  const fs::path p(dir);
  if (p.filename() == kLatestFileName)
    ZT_THROW(ErrorKind::kInvalidArgument, flag, " ", dir, " is the 'latest' pointer file of a checkpoint directory, "
             "not a directory; pass ", flag, " ", p.parent_path().string().empty() ? "." : p.parent_path().string(),
             " instead");
  ZT_THROW(ErrorKind::kInvalidArgument, flag, " ", dir, " is a file, not a directory; choose a directory");
}

// Names a run's own bookkeeping may leave in ROOT before owner.json exists (a run killed between
// taking the lock and writing the owner record, an interrupted save): a directory holding nothing
// else is empty for ownership.
bool is_bookkeeping_name(std::string_view n) {
  return n == kRunLockFileName || n == kLockFileName || starts_with(n, ".probe-") || starts_with(n, kStagingPrefix) ||
         starts_with(n, kTrashPrefix) || starts_with(n, ".latest.tmp-") || starts_with(n, ".owner.json.tmp-");
}

// The entries of ROOT other than bookkeeping (empty when ROOT does not exist).
std::vector<std::string> foreign_entries(const std::string& root) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(root.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string_view n = e->d_name;
      if (n != "." && n != ".." && !is_bookkeeping_name(n)) out.emplace_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string canonical_or_empty(const std::string& p) {
  std::error_code ec;
  const fs::path c = fs::weakly_canonical(p, ec);
  return ec ? std::string() : c.string();
}

// `/` and the home directory are never a run's own directory: checkpoints would land among the
// user's files (and a later --keep prune or takeover would reason about all of them).
void refuse_shared_roots(const std::string& root) {
  const std::string c = canonical_or_empty(root);
  if (c == "/")
    ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " is the file system's root; checkpoints need "
             "a directory of their own, such as --checkpoint-dir ./checkpoints");
  const char* home = std::getenv("HOME");
  if (home && *home && !c.empty() && c == canonical_or_empty(home))
    ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " is the home directory; checkpoints need a "
             "directory of their own, such as --checkpoint-dir ", root, "/checkpoints");
}

// A directory without an owner record is the run's only while it is empty: never adopted, whatever
// it holds (checkpoints whose owner.json was lost included; a resume into a new directory keeps them).
void refuse_unowned(const std::string& root, const std::vector<std::string>& foreign) {
  if (foreign.empty()) return;
  std::string names;
  for (size_t i = 0; i < foreign.size() && i < 3; ++i) names += (i ? ", " : "") + foreign[i];
  if (foreign.size() > 3) names += ", ...";
  ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " is not empty (", names, ") and has no owner record (",
           kOwnerFileName, "), so it is not this run's to write into; choose a new or empty --checkpoint-dir (to "
           "continue a run whose owner record was lost, resume one of its checkpoints into a new directory: --resume ",
           root, "/step-N --checkpoint-dir NEW)");
}

// ROOT as given (trailing slashes dropped): an existing directory this run may use, or created.
std::string prepare_root(const std::string& dir_in) {
  ZT_REQUIRE(!dir_in.empty(), "--checkpoint-dir is empty; name a directory");
  std::string root = dir_in;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  refuse_shared_roots(root);
  struct stat st {};
  if (::stat(root.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) throw_not_a_directory(root, "--checkpoint-dir");
    // Before the lock file is created: a refused directory is left exactly as it was. (Checked
    // again under the lock, where it decides.)
    if (::access((root + "/" + kOwnerFileName).c_str(), F_OK) != 0 && errno == ENOENT)
      refuse_unowned(root, foreign_entries(root));
    else
      read_owner(root);  // a damaged record is refused here too
    return root;
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) {
    if (ec == std::errc::not_a_directory || ec == std::errc::file_exists)
      ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " cannot be created: part of its path is a "
               "file, not a directory; choose another --checkpoint-dir");
    ZT_THROW(is_permission_errno(ec.value()) ? ErrorKind::kInvalidArgument : ErrorKind::kIo, "--checkpoint-dir ",
             root, " cannot be created (", ec.message(), "); choose a directory this user can write");
  }
  return root;
}

// The lock file may have existed, so creating a file is the real test of writability; as root,
// only a read-only file system says no, as it would at the first save.
void probe_writable(const std::string& root) {
  const std::string probe = root + "/.probe-" + std::to_string(::getpid());
  UniqueFd fd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd) {
    const int err = errno;
    ZT_THROW(is_permission_errno(err) ? ErrorKind::kInvalidArgument : ErrorKind::kIo, "--checkpoint-dir ", root,
             " is not writable (", errno_text(err), "); choose a directory this user can write");
  }
  fd.reset();
  ::unlink(probe.c_str());
}

// The owner record ROOT will have for this run (`committed`: ROOT's checkpoints with a manifest);
// `write`: it differs from owner.json. A takeover adds a sentence to `notes`.
OwnerRecord settle_owner(const std::string& root, const RunIdentity& id, bool resuming,
                         const std::vector<std::string>& committed, std::vector<std::string>& notes, bool& write) {
  const std::optional<OwnerRecord> owner = read_owner(root);
  write = true;
  if (!owner) {
    refuse_unowned(root, foreign_entries(root));
    return OwnerRecord{new_run_id(), id, {}};
  }
  if (owner->identity.same_as(id)) {
    write = false;
    return *owner;
  }
  if (resuming) {
    // A resume continues the lineage with another seed or data, never another model. Refused
    // here, before owner.json is rewritten: the checkpoint load would refuse it only afterwards.
    ZT_REQUIRE(owner->identity.model == id.model || committed.empty(), "--checkpoint-dir ", root, " holds ",
               committed.size(), " checkpoint(s) of another model (", owner->identity.model_description,
               "; this run: ", id.model_description,
               "); resume with the same model flags, or start a fresh run in another --checkpoint-dir");
    OwnerRecord rec = *owner;  // the same lineage, continued with another seed or data
    rec.identity = id;
    return rec;
  }
  if (!committed.empty())
    ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " holds ", committed.size(),
             " checkpoint(s) of another run (run ", owner->run_id, ": ", owner->identity.describe(),
             "; this run: ", id.describe(), "); continue that run with --resume auto, or choose another "
             "--checkpoint-dir");
  notes.push_back("checkpoint directory " + root + " was used by run " + owner->run_id + " (" +
                  owner->identity.describe() + "), which left no checkpoint; this run takes it over");
  return OwnerRecord{new_run_id(), id, {}};
}

// Every name a save of this run may write must be free or the lineage's own: a save replaces an
// existing step-N whole, so a user's folder (or another run's checkpoint) there would be lost.
// Step names beyond the run's last step are never written: left alone, and named once in `notes`.
void refuse_occupied_names(const std::string& root, const OwnerRecord& rec, const std::vector<std::string>& committed,
                           int64_t last_step, std::vector<std::string>& notes) {
  const std::set<std::string> adopted(rec.adopted.begin(), rec.adopted.end());
  std::vector<std::string> outside;
  for (const std::string& n : foreign_entries(root)) {
    const std::optional<int64_t> step = parse_step_dir(n);
    if (step) {
      const std::string path = root + "/" + n;
      struct stat est {};
      const bool dir = ::lstat(path.c_str(), &est) == 0 && S_ISDIR(est.st_mode);
      const bool ours = dir && (adopted.count(n) || (!rec.run_id.empty() && checkpoint_owner(path) == rec.run_id));
      if (ours) continue;
      if (last_step > 0 && *step > last_step) {
        outside.push_back(n);
        continue;
      }
      const bool has_manifest = dir && std::find(committed.begin(), committed.end(), n) != committed.end();
      ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " holds ", n, ", ",
               !dir ? std::string("which is not a directory")
               : has_manifest ? std::string("a checkpoint of another run")
                              : "which has no " + std::string(kManifestFileName) + " (not a checkpoint of this run)",
               ", and this run would write its step-", *step, " checkpoint there; move it out of the directory or "
               "choose another --checkpoint-dir");
    } else if (n == kLatestFileName || n == kOwnerFileName || n == "config.toml") {
      struct stat est {};
      if (::lstat((root + "/" + n).c_str(), &est) == 0 && !S_ISREG(est.st_mode))
        ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " holds ", n, ", which is not a regular file, "
                 "and this run would replace it; move it out of the directory or choose another --checkpoint-dir");
    }
  }
  if (outside.empty()) return;
  std::string names;
  for (const std::string& n : outside) names += (names.empty() ? "" : ", ") + n;
  notes.push_back("checkpoint directory " + root + ": " + names + (outside.size() == 1 ? " is" : " are") +
                  " not this run's and beyond its last step; left alone");
}

}  // namespace

void CheckpointDirLease::State::take_lock() {
  const std::string lock_path = root + "/" + kRunLockFileName;
  lock.reset(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!lock) {
    const int err = errno;
    ZT_THROW(is_permission_errno(err) ? ErrorKind::kInvalidArgument : ErrorKind::kIo, "--checkpoint-dir ", root,
             " is not writable (", lock_path, ": ", errno_text(err), "); choose a directory this user can write");
  }
  while (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno == EWOULDBLOCK) {
      const std::optional<LeaseInfo> holder = parse_lease(read_lease_text(lock.get()));
      ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " is in use by another running training run",
               holder ? " (" + describe_lease(*holder) + ")" : std::string(),
               "; wait for it to finish or choose another --checkpoint-dir");
    }
    ZT_THROW(ErrorKind::kIo, lock_path, ": cannot lock (", errno_text(errno), ")");
  }
  // The lock is free here. A lease left in the file is a run that did not release it: on this host
  // it is dead (its flock would hold), on another host it may be alive on a file system whose locks
  // do not reach across hosts, so a recently renewed one is refused.
  const std::string me = host_name();
  if (const std::optional<LeaseInfo> old = parse_lease(read_lease_text(lock.get()))) {
    const int64_t age = unix_now() - old->renewed;
    if (old->host != me && old->renewed > 0 && age < kLeaseStaleSeconds)
      ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", root, " is in use by a training run on another host (",
               describe_lease(*old), "); wait for it to finish (its lease goes stale ", kLeaseStaleSeconds,
               " s after its last renewal) or choose another --checkpoint-dir");
    notes.push_back("checkpoint directory " + root + ": a run that held it (" + describe_lease(*old) +
                    ") ended without releasing it (killed or crashed); its stale lease is taken over");
  }
  lease = LeaseInfo{static_cast<int64_t>(::getpid()), me, unix_now(), 0};
  write_lease();
}

CheckpointDirLease open_checkpoint_dir(const std::string& dir_in, const RunIdentity& id, bool resuming,
                                       int64_t last_step) {
  auto s = std::make_unique<CheckpointDirLease::State>();
  s->root = prepare_root(dir_in);
  s->take_lock();  // first: everything below reads and writes ROOT as its only user
  probe_writable(s->root);
  std::vector<std::string> committed;
  for (const CheckpointEntry& e : list_checkpoints(s->root))
    if (e.has_manifest) committed.push_back(e.name);
  bool write = true;
  const OwnerRecord rec = settle_owner(s->root, id, resuming, committed, s->notes, write);
  refuse_occupied_names(s->root, rec, committed, last_step, s->notes);
  if (write) {
    try {
      write_owner(s->root, rec);
    } catch (const Error& e) {
      ZT_THROW(ErrorKind::kInvalidArgument, "--checkpoint-dir ", s->root, " is not writable (", e.message(),
               "); choose a directory this user can write");
    }
  }
  s->run_id = rec.run_id;
  s->start_renewing();
  return CheckpointDirLease(std::move(s));
}

// ---- resume ----------------------------------------------------------------------------------

ResumeFrom ResumeFrom::parse(const std::string& text) {
  ZT_REQUIRE(!text.empty(), "--resume needs 'auto' or the path of a checkpoint directory");
  return text == "auto" ? newest() : checkpoint(text);
}

std::string ResumeFrom::text() const {
  switch (kind) {
    case Kind::kFresh: return "";
    case Kind::kNewest: return "auto";
    case Kind::kCheckpoint: return path;
  }
  return "";
}

std::optional<ResolvedCheckpoint> resolve_resume(const std::string& root, const ResumeFrom& from,
                                                 std::vector<std::string>* notes) {
  ZT_REQUIRE(!from.fresh(), "--resume needs 'auto' or the path of a checkpoint directory");
  if (from.kind == ResumeFrom::Kind::kCheckpoint) {
    const std::string& spec = from.path;
    struct stat st {};
    if (::stat(spec.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
      const fs::path p(spec);
      if (p.filename() == kLatestFileName) {
        const std::string parent = p.parent_path().empty() ? "." : p.parent_path().string();
        const std::optional<std::string> names = read_latest(parent);
        ZT_THROW(ErrorKind::kInvalidArgument, "--resume ", spec, " is the 'latest' pointer file, not a checkpoint "
                 "directory; use --resume ", names ? parent + "/" + *names : std::string("auto"),
                 names ? std::string() : " --checkpoint-dir " + parent,
                 names ? " (the checkpoint it names) or --resume auto --checkpoint-dir " + parent : std::string());
      }
      ZT_THROW(ErrorKind::kInvalidArgument, "--resume ", spec, " is a file, not a checkpoint directory; pass a "
               "step-N directory, or --resume auto with --checkpoint-dir");
    }
    const std::string manifest = spec + "/" + kManifestFileName;
    const std::string partial = spec + "/" + kPartialFileName;
    if (::lstat(manifest.c_str(), &st) != 0 && ::lstat(partial.c_str(), &st) == 0)
      ZT_THROW(ErrorKind::kInvalidArgument, "--resume ", spec, " is one process's part of a snapshot, written when "
               "another process of its launch was lost: it lacks that process's shards, so no run can resume from it; "
               "resume from the newest complete checkpoint instead (--resume auto with --checkpoint-dir)");
    if (::lstat(manifest.c_str(), &st) != 0 && !list_checkpoints(spec).empty())
      ZT_THROW(ErrorKind::kInvalidArgument, spec, " holds checkpoints but is not one; pass one of its step-N "
               "directories to --resume, or use --resume auto with --checkpoint-dir ", spec);
    CheckpointReader reader = CheckpointReader::open(spec);
    const int64_t step = reader.step();
    return ResolvedCheckpoint{spec, step, std::move(reader)};
  }

  struct stat rst {};
  if (::stat(root.c_str(), &rst) == 0 && !S_ISDIR(rst.st_mode)) throw_not_a_directory(root, "--checkpoint-dir");
  std::vector<CheckpointEntry> entries = list_checkpoints(root);
  std::reverse(entries.begin(), entries.end());  // newest first
  std::vector<std::pair<std::string, std::string>> refused;  // (name, reason)
  for (CheckpointEntry& e : entries) {
    try {
      CheckpointReader reader = CheckpointReader::open(e.path);
      if (reader.step() != e.step)
        ZT_THROW(ErrorKind::kInvalidArgument, "checkpoint ", e.path, ": its manifest says step ", reader.step(),
                 ", not the step its directory name says");
      if (notes) {
        for (const auto& [name, reason] : refused)
          notes->push_back("checkpoint " + name + " is unusable: " + reason + "; falling back to " + e.name);
      }
      return ResolvedCheckpoint{e.path, e.step, std::move(reader)};
    } catch (const Error& err) {
      refused.emplace_back(e.name, err.message());
    }
  }
  if (refused.empty()) return std::nullopt;
  std::string reasons;
  for (const auto& [name, reason] : refused) reasons += (reasons.empty() ? "" : " | ") + reason;
  ZT_THROW(ErrorKind::kInvalidArgument, root, " holds ", refused.size(),
           " checkpoint(s) and none is usable (", reasons,
           "); restore them, resume from a copy with --resume PATH, or remove them to start from scratch");
}

}  // namespace zt
