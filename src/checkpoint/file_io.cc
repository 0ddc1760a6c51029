// File-system primitives of the checkpoint layer (see file_io.h).
#include "checkpoint/file_io.h"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "core/status.h"

namespace zt {

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
  if (fd >= 0 && ::close(fd) != 0)
    ZT_THROW(ErrorKind::kIo, what, ": closing the file failed (", errno_text(errno), ")");
}

std::string errno_text(int err) { return std::strerror(err); }

void write_all(int fd, const void* data, size_t bytes, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // Linux writes at most ~2 GiB per call; the loop covers the rest and short writes.
    const size_t chunk = bytes < (size_t{1} << 30) ? bytes : (size_t{1} << 30);
    const ssize_t n = ::write(fd, p, chunk);
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
    const size_t chunk = bytes < (size_t{1} << 30) ? bytes : (size_t{1} << 30);
    const ssize_t n = ::pread(fd, p, chunk, static_cast<off_t>(offset));
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

void atomic_write_file(const std::string& dir, const std::string& name, std::string_view bytes) {
  const std::string tmp = dir + "/." + name + ".tmp-" + std::to_string(::getpid());
  const std::string final_path = dir + "/" + name;
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd) ZT_THROW(ErrorKind::kIo, tmp, ": cannot create the file (", errno_text(errno), ")");
  try {
    write_all(fd.get(), bytes.data(), bytes.size(), tmp);
    fsync_fd(fd.get(), tmp);
    fd.close_checked(tmp);
    if (::rename(tmp.c_str(), final_path.c_str()) != 0)
      ZT_THROW(ErrorKind::kIo, final_path, ": cannot rename ", tmp, " into place (", errno_text(errno), ")");
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(dir);
}

UniqueFd open_regular_nofollow(int dir_fd, const std::string& name, const std::string& what,
                               uint64_t* size) {
  UniqueFd fd(::openat(dir_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP)
      ZT_THROW(ErrorKind::kInvalidArgument, what, ": is a symbolic link; checkpoint files must be "
               "regular files inside the checkpoint directory");
    if (err == ENOENT) ZT_THROW(ErrorKind::kInvalidArgument, what, ": the file is missing");
    ZT_THROW(ErrorKind::kIo, what, ": cannot open the file (", errno_text(err), ")");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    ZT_THROW(ErrorKind::kIo, what, ": cannot stat the file (", errno_text(errno), ")");
  if (!S_ISREG(st.st_mode))
    ZT_THROW(ErrorKind::kInvalidArgument, what, ": is not a regular file");
  // O_NONBLOCK only kept open() from blocking on a FIFO planted under the name; reads of regular
  // files ignore it, but clear it anyway.
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags >= 0) ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  if (size) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

bool is_plain_file_name(std::string_view name) {
  if (name.empty() || name.size() > 255 || name.front() == '.') return false;
  for (const char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '/' || c == '\\' || u < 0x20 || u == 0x7f) return false;
  }
  return true;
}

uint64_t xxh64(const void* data, size_t bytes) { return XXH64(data, bytes, 0); }

std::string hex64(uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i) {
    s[static_cast<size_t>(i)] = kDigits[v & 15];
    v >>= 4;
  }
  return s;
}

std::optional<uint64_t> parse_hex64(std::string_view s) {
  if (s.size() != 16) return std::nullopt;
  uint64_t v = 0;
  for (const char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return std::nullopt;  // the writer emits lower case only; anything else is corruption
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

}  // namespace zt
