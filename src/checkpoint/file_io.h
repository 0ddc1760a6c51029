// File-system primitives of the checkpoint layer: descriptors that close themselves, complete
// writes/reads that turn every failure into zt::Error(kIo) naming the file, fsync of files and
// directories, atomic small-file replacement, overflow-checked size arithmetic, xxHash64 in hex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace zt {

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

// Sizes in files are uint64; every sum and product of them goes through these.
inline bool checked_add(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); }
inline bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

std::string errno_text(int err);

// `what` names the file in the message ("checkpoint /x/step-00000100: rank-00001.bin").
void write_all(int fd, const void* data, size_t bytes, const std::string& what);
void pread_exact(int fd, void* out, size_t bytes, uint64_t offset, const std::string& what);
void fsync_fd(int fd, const std::string& what);
void fsync_dir(const std::string& dir);

// Replaces dir/name atomically: writes dir/.name.tmp-<pid>, fsyncs it, renames it over name and
// fsyncs dir. A crash leaves either the old file or the new one, never a mix.
void atomic_write_file(const std::string& dir, const std::string& name, std::string_view bytes);

// Opens dir/name read-only without following a symbolic link in the last component; throws
// kInvalidArgument naming `what` when it is a link, missing or not a regular file.
UniqueFd open_regular_nofollow(int dir_fd, const std::string& name, const std::string& what,
                               uint64_t* size);

// A file name the checkpoint layer may open inside its own directory: non-empty, at most 255
// bytes, no '/', '\\', NUL or control characters, not starting with '.' (so never "." or "..").
bool is_plain_file_name(std::string_view name);

uint64_t xxh64(const void* data, size_t bytes);
std::string hex64(uint64_t v);  // 16 lower-case hex digits
std::optional<uint64_t> parse_hex64(std::string_view s);  // exactly 16 hex digits

}  // namespace zt
