// The one file opener for readers and the checked writers (see files.h for the rules).
#include "core/files.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"

namespace zt {

namespace {

// Linux transfers at most ~2 GiB per call; loops cover the rest and short transfers.
constexpr size_t kMaxChunk = size_t{1} << 30;

std::string shown_name(const std::string& what, const std::string& path) {
  return what.empty() ? path : what + " '" + path + "'";
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

void clear_nonblock(int fd) {
  // O_NONBLOCK only kept open() from blocking on a FIFO; regular files ignore it, clear it anyway.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

[[noreturn]] void refuse_output_type(const std::string& name, unsigned mode) {
  ZT_THROW(ErrorKind::kInvalidArgument, name, " is ", file_type_name(mode),
           ", not a regular file; ZeroTrain only creates or replaces regular files, so pass "
           "another path");
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

void UniqueFd::close_checked(const std::string& what) {
  const int fd = release();
  // No retry on EINTR: Linux has released the descriptor already.
  if (fd >= 0 && ::close(fd) != 0)
    ZT_THROW(ErrorKind::kIo, what, ": closing the file failed (", errno_text(errno), ")");
}

std::string errno_text(int err) { return std::strerror(err); }

const char* file_type_name(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO (named pipe)";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
    default: return "not a regular file";
  }
}

void write_all(int fd, const void* data, size_t bytes, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes < kMaxChunk ? bytes : kMaxChunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ZT_THROW(ErrorKind::kIo, what, ": writing failed (", errno_text(err), ")",
               err == ENOSPC ? "; free some space or choose another directory" : "");
    }
    if (n == 0) ZT_THROW(ErrorKind::kIo, what, ": writing failed (the file system accepted 0 bytes)");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void pread_exact(int fd, void* out, size_t bytes, uint64_t offset, const std::string& what) {
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes < kMaxChunk ? bytes : kMaxChunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      ZT_THROW(ErrorKind::kIo, what, ": reading failed (", errno_text(errno), ")");
    }
    if (n == 0)
      ZT_THROW(ErrorKind::kInvalidArgument, what, ": the file ends at byte ", offset,
               " although more data was expected there (it was truncated)");
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void fsync_fd(int fd, const std::string& what) {
  while (::fsync(fd) != 0) {
    if (errno == EINTR) continue;
    ZT_THROW(ErrorKind::kIo, what, ": fsync failed (", errno_text(errno), ")");
  }
}

void fsync_dir(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) ZT_THROW(ErrorKind::kIo, dir, ": cannot open the directory to fsync it (", errno_text(errno), ")");
  fsync_fd(fd.get(), dir);
}

// ---- reading --------------------------------------------------------------------------------

InputFile InputFile::open(const std::string& path, const std::string& kind) {
  InputFile f = open_at(AT_FDCWD, path, path, true);
  f.kind_ = kind;
  return f;
}

InputFile InputFile::open_at(int dir_fd, const std::string& name, const std::string& what, bool follow_links) {
  ZT_REQUIRE(!name.empty(), "an input file path is empty; pass the path of a file");
  const int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY | (follow_links ? 0 : O_NOFOLLOW);
  UniqueFd fd(::openat(dir_fd, name.c_str(), flags));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP && !follow_links)
      ZT_THROW(ErrorKind::kInvalidArgument, what, ": is a symbolic link; it must be a regular file "
               "inside its directory");
    if (err == ENOENT)
      ZT_THROW(ErrorKind::kInvalidArgument, what, ": the file is missing (", errno_text(err), "); check the path");
    if (err == EACCES)
      ZT_THROW(ErrorKind::kInvalidArgument, what, ": cannot open the file (", errno_text(err),
               "); check its permissions");
    ZT_THROW(ErrorKind::kIo, what, ": cannot open the file (", errno_text(err), ")");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    ZT_THROW(ErrorKind::kIo, what, ": cannot stat the file (", errno_text(errno), ")");
  if (!S_ISREG(st.st_mode))
    ZT_THROW(ErrorKind::kInvalidArgument, what, ": is ", file_type_name(st.st_mode),
             ", not a regular file; only regular files are read (a pipe or device has no fixed size)");
  clear_nonblock(fd.get());
  return InputFile(std::move(fd), what, "file", static_cast<uint64_t>(st.st_size));
}

void InputFile::read_at(uint64_t offset, void* out, size_t bytes) const {
  uint64_t end = 0;
  if (__builtin_add_overflow(offset, uint64_t{bytes}, &end) || end > size_)
    ZT_THROW(ErrorKind::kInvalidArgument, path_, ": bytes [", offset, ", ", offset + bytes,
             ") lie beyond the end of the ", size_, "-byte ", kind_);
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_.get(), p, bytes < kMaxChunk ? bytes : kMaxChunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      ZT_THROW(ErrorKind::kIo, path_, ": reading the ", kind_, " failed (", errno_text(errno), ")");
    }
    if (n == 0)
      ZT_THROW(ErrorKind::kIo, path_, ": the ", kind_, " now ends at byte ", offset, " but had ", size_,
               " bytes when it was opened; it was truncated or rewritten while in use, so restore it "
               "and rerun");
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

std::vector<uint8_t> InputFile::read_all(uint64_t max_bytes) const {
  ZT_REQUIRE(size_ <= max_bytes, path_, ": the ", kind_, " is ", size_, " bytes, more than the ", max_bytes,
             "-byte limit for it");
  std::vector<uint8_t> bytes(static_cast<size_t>(size_));
  read_at(0, bytes.data(), bytes.size());
  return bytes;
}

// ---- writing --------------------------------------------------------------------------------

void check_output_path(const std::string& path, const std::string& what) {
  const std::string name = shown_name(what, path);
  ZT_REQUIRE(!path.empty(), (what.empty() ? std::string("an output file") : what), " path is empty");
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) refuse_output_type(name, st.st_mode);
    ZT_REQUIRE(::access(path.c_str(), W_OK) == 0, name, " exists and is not writable (",
               errno_text(errno), "); check its permissions or pass another path");
    return;
  }
  if (errno != ENOENT)
    ZT_THROW(ErrorKind::kInvalidArgument, name, ": cannot check the path (", errno_text(errno), ")");
  ZT_REQUIRE(!base_of(path).empty(), name, " names a directory; pass a file path");
  const std::string dir = dir_of(path);
  struct stat dst {};
  ZT_REQUIRE(::stat(dir.c_str(), &dst) == 0 && S_ISDIR(dst.st_mode), name, ": the folder '", dir,
             "' does not exist; create it first");
  ZT_REQUIRE(::access(dir.c_str(), W_OK | X_OK) == 0, name, ": the folder '", dir,
             "' is not writable; check its permissions or pass another path");
}

OutputStream OutputStream::open(const std::string& path, const std::string& what) {
  check_output_path(path, what);
  const std::string name = shown_name(what, path);
  // No O_TRUNC: the type is checked on the open descriptor first, and only a regular file is
  // emptied. O_NOFOLLOW and O_NONBLOCK close the races with a link or FIFO planted meanwhile.
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY, 0644));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP) refuse_output_type(name, S_IFLNK);
    if (err == ENXIO) refuse_output_type(name, S_IFIFO);  // a FIFO without a reader
    ZT_THROW(ErrorKind::kIo, name, ": cannot create the file (", errno_text(err), ")");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) ZT_THROW(ErrorKind::kIo, name, ": cannot stat the file (", errno_text(errno), ")");
  if (!S_ISREG(st.st_mode)) refuse_output_type(name, st.st_mode);
  if (::ftruncate(fd.get(), 0) != 0)
    ZT_THROW(ErrorKind::kIo, name, ": cannot truncate the file (", errno_text(errno), ")");
  clear_nonblock(fd.get());
  return OutputStream(std::move(fd), path, what);
}

void OutputStream::write(std::string_view bytes) {
  ZT_CHECK(fd_, "write to a closed OutputStream ", path_);
  write_all(fd_.get(), bytes.data(), bytes.size(), shown_name(what_, path_));
}

void OutputStream::write_line(std::string_view line) {
  std::string buf;
  buf.reserve(line.size() + 1);
  buf.append(line);
  buf.push_back('\n');
  write(buf);
}

void OutputStream::close() {
  if (!fd_) return;
  const std::string name = shown_name(what_, path_);
  try {
    fsync_fd(fd_.get(), name);
  } catch (...) {
    fd_.reset();
    throw;
  }
  fd_.close_checked(name);
}

AtomicFile::AtomicFile(std::string path, std::string what) : path_(std::move(path)), what_(std::move(what)) {
  check_output_path(path_, what_);
  static std::atomic<uint64_t> counter{0};
  dir_ = dir_of(path_);
  tmp_path_ = dir_ + "/." + base_of(path_) + ".tmp-" + std::to_string(::getpid()) + "-" +
              std::to_string(counter.fetch_add(1));
  fd_.reset(::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd_)
    ZT_THROW(ErrorKind::kIo, shown_name(what_, path_), ": cannot create the temporary file ", tmp_path_, " (",
             errno_text(errno), ")");
}

AtomicFile::~AtomicFile() {
  if (!committed_) {
    fd_.reset();
    ::unlink(tmp_path_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t bytes) {
  ZT_CHECK(!committed_ && fd_, "write to a committed AtomicFile ", path_);
  write_all(fd_.get(), data, bytes, shown_name(what_, path_));
}

void AtomicFile::commit() {
  ZT_CHECK(!committed_ && fd_, "AtomicFile ", path_, " committed twice");
  const std::string name = shown_name(what_, path_);
  fsync_fd(fd_.get(), name);
  fd_.close_checked(name);
  // rename(2) replaces whatever is at the path; look again right before it. (A node planted in the
  // instant between this check and the rename is not caught; nothing portable closes that gap.)
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) refuse_output_type(name, st.st_mode);
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0)
    ZT_THROW(ErrorKind::kIo, name, ": cannot rename ", tmp_path_, " into place (", errno_text(errno), ")");
  committed_ = true;
  fsync_dir(dir_);
}

void write_file_atomic(const std::string& path, std::string_view bytes, const std::string& what) {
  AtomicFile f(path, what);
  f.write(bytes);
  f.commit();
}

AppendFile AppendFile::open(const std::string& path, const std::string& what) {
  const std::string name = shown_name(what, path);
  ZT_REQUIRE(!path.empty(), (what.empty() ? std::string("an output file") : what), " path is empty");
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY,
                     0644));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP) refuse_output_type(name, S_IFLNK);
    if (err == ENXIO) refuse_output_type(name, S_IFIFO);  // a FIFO without a reader
    if (err == EISDIR) refuse_output_type(name, S_IFDIR);
    if (err == EACCES || err == EROFS || err == ENOENT || err == ENOTDIR)
      ZT_THROW(ErrorKind::kInvalidArgument, name, ": cannot open the file for appending (", errno_text(err),
               "); check the path and its permissions");
    ZT_THROW(ErrorKind::kIo, name, ": cannot open the file for appending (", errno_text(err), ")");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) ZT_THROW(ErrorKind::kIo, name, ": cannot stat the file (", errno_text(errno), ")");
  if (!S_ISREG(st.st_mode)) refuse_output_type(name, st.st_mode);
  clear_nonblock(fd.get());
  return AppendFile(std::move(fd), path, what);
}

void AppendFile::append(std::string_view bytes) {
  ZT_CHECK(fd_, "append to a closed AppendFile ", path_);
  const std::string name = shown_name(what_, path_);
  write_all(fd_.get(), bytes.data(), bytes.size(), name);
  fsync_fd(fd_.get(), name);
}

void AppendFile::truncate(uint64_t size) {
  ZT_CHECK(fd_, "truncate of a closed AppendFile ", path_);
  const std::string name = shown_name(what_, path_);
  if (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0)
    ZT_THROW(ErrorKind::kIo, name, ": cannot truncate the file (", errno_text(errno), ")");
  fsync_fd(fd_.get(), name);
}

void AppendFile::close() {
  if (fd_) fd_.close_checked(shown_name(what_, path_));
}

void append_durable(const std::string& path, std::string_view bytes, const std::string& what) {
  AppendFile f = AppendFile::open(path, what);
  f.append(bytes);
  f.close();
}

std::optional<std::string> read_small_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return std::nullopt;
    ZT_THROW(ErrorKind::kInvalidArgument, shown_name(what, path), ": cannot check the file (", errno_text(errno), ")");
  }
  const InputFile f = InputFile::open_at(AT_FDCWD, path, shown_name(what, path), false);
  const std::vector<uint8_t> bytes = f.read_all(max_bytes);
  return std::string(bytes.begin(), bytes.end());
}

std::optional<FileLock> FileLock::try_acquire(const std::string& path, const std::string& what, std::string* holder) {
  const std::string name = shown_name(what, path);
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY, 0644));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP) refuse_output_type(name, S_IFLNK);
    if (err == ENXIO) refuse_output_type(name, S_IFIFO);
    if (err == EISDIR) refuse_output_type(name, S_IFDIR);
    ZT_THROW(err == EACCES || err == EROFS || err == EPERM ? ErrorKind::kInvalidArgument : ErrorKind::kIo, name,
             ": cannot create the lock file (", errno_text(err), "); choose a directory this user can write");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) ZT_THROW(ErrorKind::kIo, name, ": cannot stat the file (", errno_text(errno), ")");
  if (!S_ISREG(st.st_mode)) refuse_output_type(name, st.st_mode);
  while (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) ZT_THROW(ErrorKind::kIo, name, ": cannot lock (", errno_text(errno), ")");
    if (holder) {
      char buf[32] = {};
      const ssize_t n = ::pread(fd.get(), buf, sizeof(buf) - 1, 0);
      std::string h = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
      while (!h.empty() && (h.back() == '\n' || h.back() == ' ')) h.pop_back();
      *holder = h;
    }
    return std::nullopt;
  }
  // Our pid, for the message the next one gets (best effort: the lock is what matters).
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd.get(), 0) == 0) {
    [[maybe_unused]] const ssize_t w = ::pwrite(fd.get(), pid.data(), pid.size(), 0);
  }
  return FileLock(std::move(fd));
}

void write_stdout_line(std::string_view line) {
  std::string buf;
  buf.reserve(line.size() + 1);
  buf.append(line);
  buf.push_back('\n');
  // Hold SIGPIPE off for this thread so a closed reader gives EPIPE (an error we report) instead of
  // killing the process; a SIGPIPE this call raised is consumed before the mask is restored.
  sigset_t pipe_set, old_set, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
  sigemptyset(&pending);
  sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
  int err = 0;
  if (std::fflush(stdout) != 0) err = errno != 0 ? errno : EIO;
  const char* p = buf.data();
  size_t left = buf.size();
  while (err == 0 && left > 0) {
    const ssize_t n = ::write(STDOUT_FILENO, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
    } else if (n == 0) {
      err = EIO;
    } else {
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  if (err == EPIPE && !was_pending) {
    const timespec zero{0, 0};
    while (sigtimedwait(&pipe_set, nullptr, &zero) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_set, nullptr);
  if (err != 0)
    ZT_THROW(ErrorKind::kIo, "writing to standard output failed (", errno_text(err), ")",
             err == EPIPE ? "; the program reading it has exited" : "",
             err == ENOSPC ? "; free some space or write the log elsewhere" : "");
}

}  // namespace zt
