// The one way ZeroTrain opens files: InputFile for every reader (regular files only, size fixed at
// open, pread bounded by it), OutputStream and AtomicFile for every writer (never replace anything
// but a regular file, every write/fsync/close checked), and write_stdout_line for JSON logs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zt {

// Error kinds used here (apps/zerotrain.cc maps them to exit codes):
//  - kInvalidArgument (exit 2): the path names the wrong thing: missing, a directory, a FIFO, a
//    device, a socket, a symbolic link where a written file should be. The user fixes the flag.
//  - kIo (exit 1): the file system failed us: a write, fsync or close failed (ENOSPC, EIO, EPIPE),
//    or an input file shrank while it was being read. Nothing wrong with the flag.

// Owns a POSIX file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);
  // close(2) with its result checked (a deferred write error surfaces here); throws kIo.
  void close_checked(const std::string& what);

 private:
  int fd_ = -1;
};

std::string errno_text(int err);

// `what` names the file in the message. write_all throws kIo on any failure (ENOSPC says so).
void write_all(int fd, const void* data, size_t bytes, const std::string& what);
// Throws kIo on a read error and kInvalidArgument when the file ends before `offset + bytes`.
void pread_exact(int fd, void* out, size_t bytes, uint64_t offset, const std::string& what);
void fsync_fd(int fd, const std::string& what);
void fsync_dir(const std::string& dir);

// "a FIFO (named pipe)", "a character device", ... for messages; st_mode from stat(2).
const char* file_type_name(unsigned st_mode);

// ---- reading --------------------------------------------------------------------------------

// An input file open for reading. Opening never blocks (O_NONBLOCK, so a FIFO cannot hang it)
// and refuses anything but a regular file with one sentence naming the file and what it is (a
// FIFO, /dev/zero or /dev/urandom would otherwise block or read until memory runs out). The size
// is taken once, at open; every read is a pread bounded by it, so a file that is truncated while
// open gives zt::Error(kIo), never SIGBUS (nothing is memory-mapped) and never a short buffer.
// Reads are thread-safe (pread has no shared file offset).
class InputFile {
 public:
  // `kind` names the role in messages: "token shard", "text file", "IDX file".
  static InputFile open(const std::string& path, const std::string& kind);
  // dir_fd-relative; with follow_links == false a symbolic link in the last component is refused
  // (checkpoint directories must not point outside themselves). `what` is the name in messages.
  static InputFile open_at(int dir_fd, const std::string& name, const std::string& what,
                           bool follow_links);
  InputFile(InputFile&&) noexcept = default;
  InputFile& operator=(InputFile&&) noexcept = default;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_.get(); }
  UniqueFd release_fd() { return std::move(fd_); }

  // Bytes [offset, offset + bytes); throws kInvalidArgument when the range lies beyond the size
  // at open (a caller's bad offset from a file's header) and kIo when the file has shrunk since.
  void read_at(uint64_t offset, void* out, size_t bytes) const;
  // The whole file as it was at open; throws kInvalidArgument when it exceeds max_bytes.
  std::vector<uint8_t> read_all(uint64_t max_bytes = UINT64_MAX) const;

 private:
  InputFile(UniqueFd fd, std::string path, std::string kind, uint64_t size)
      : fd_(std::move(fd)), path_(std::move(path)), kind_(std::move(kind)), size_(size) {}
  UniqueFd fd_;
  std::string path_;
  std::string kind_;
  uint64_t size_ = 0;
};

// ---- writing --------------------------------------------------------------------------------

// Fails early, before any work, with one sentence when `path` cannot become a written file: its
// directory is missing or not writable, or something other than a regular file is at the path
// (a directory, FIFO, device node, socket or symbolic link). Creates nothing. `what` names the
// role: "--metrics file". Throws kInvalidArgument.
void check_output_path(const std::string& path, const std::string& what);

// A file written as a stream (metrics JSON lines, traces): opened without blocking and without
// replacing or truncating anything but a regular file; every write goes straight to the file
// descriptor (no stdio buffer that could drop a failure) and throws kIo naming the file; close()
// fsyncs and checks. Destroyed without close(), the descriptor is closed unchecked (error paths).
class OutputStream {
 public:
  static OutputStream open(const std::string& path, const std::string& what);
  OutputStream(OutputStream&&) noexcept = default;
  OutputStream& operator=(OutputStream&&) noexcept = default;

  const std::string& path() const { return path_; }
  bool is_open() const { return static_cast<bool>(fd_); }
  void write(std::string_view bytes);
  void write_line(std::string_view line);  // line + '\n' in one write
  void close();                            // fsync + checked close; idempotent

 private:
  OutputStream(UniqueFd fd, std::string path, std::string what)
      : fd_(std::move(fd)), path_(std::move(path)), what_(std::move(what)) {}
  UniqueFd fd_;
  std::string path_;
  std::string what_;
};

// A file replaced atomically (export, plot, checkpoint files): written to a fresh temporary file
// beside `path`, which commit() fsyncs, closes, renames over `path` and makes durable by fsyncing
// the directory. A crash leaves the old file or the new one, never a mix. The target must be
// absent or a regular file, checked when the writer is made and again just before the rename (so
// `--out /dev/full` never turns the device node into a regular file). Destroyed uncommitted, the
// temporary file is removed.
class AtomicFile {
 public:
  AtomicFile(std::string path, std::string what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  const std::string& path() const { return path_; }
  void write(const void* data, size_t bytes);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  void commit();

 private:
  std::string path_;
  std::string what_;
  std::string dir_;
  std::string tmp_path_;
  UniqueFd fd_;
  bool committed_ = false;
};

// Replaces `path` with `bytes` through an AtomicFile.
void write_file_atomic(const std::string& path, std::string_view bytes, const std::string& what);

// A file that only grows (journals, JSON-lines logs read back on a rerun): opened without following
// a symbolic link and without blocking, refused with one sentence (kInvalidArgument) unless it is
// a regular file, created when missing. append() is one write(2) with O_APPEND followed by fsync,
// so a kill leaves every earlier append whole and at most the last one torn; truncate() cuts such
// a torn tail off before the next append (the caller owns the file, e.g. under a FileLock).
class AppendFile {
 public:
  static AppendFile open(const std::string& path, const std::string& what);
  AppendFile(AppendFile&&) noexcept = default;
  AppendFile& operator=(AppendFile&&) noexcept = default;

  const std::string& path() const { return path_; }
  void append(std::string_view bytes);
  void truncate(uint64_t size);
  void close();  // checked; idempotent

 private:
  AppendFile(UniqueFd fd, std::string path, std::string what)
      : fd_(std::move(fd)), path_(std::move(path)), what_(std::move(what)) {}
  UniqueFd fd_;
  std::string path_;
  std::string what_;
};

// AppendFile::open + append + close: one durable append to `path`.
void append_durable(const std::string& path, std::string_view bytes, const std::string& what);

// A small file read back whole: a regular file only (a FIFO, device or symbolic link in the last
// component is refused with one sentence, kInvalidArgument), at most max_bytes. nullopt when the
// file does not exist.
std::optional<std::string> read_small_file(const std::string& path, const std::string& what,
                                           uint64_t max_bytes = uint64_t{1} << 30);

// An exclusive advisory lock (flock) on the regular file `path`, held while the object lives
// (the kernel drops it when the process dies, SIGKILL included). The file is created when missing
// (never through a symbolic link) and holds the holder's process id for messages.
class FileLock {
 public:
  // nullopt when another process holds the lock; *holder (may be null) gets its process id text.
  // Throws kInvalidArgument when `path` is not a regular file or cannot be created (permissions).
  static std::optional<FileLock> try_acquire(const std::string& path, const std::string& what,
                                             std::string* holder);
  FileLock(FileLock&&) noexcept = default;
  FileLock& operator=(FileLock&&) noexcept = default;

 private:
  explicit FileLock(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;
};

// One line (plus '\n') to standard output, checked: stdio's buffer is flushed first (earlier text
// output stays in order), then the line is written with write(2). A closed pipe (EPIPE, with
// SIGPIPE held off for the call so the process is not killed) or a full disk (ENOSPC) throws
// zt::Error(kIo) "writing to standard output failed (...)".
void write_stdout_line(std::string_view line);

}  // namespace zt
