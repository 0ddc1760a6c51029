// File-system primitives of the checkpoint layer (see file_io.h), on core/files.h.
#include "checkpoint/file_io.h"

#include <xxhash.h>

#include "core/status.h"

namespace zt {

void atomic_write_file(const std::string& dir, const std::string& name, std::string_view bytes) {
  write_file_atomic(dir + "/" + name, bytes, "");
}

UniqueFd open_regular_nofollow(int dir_fd, const std::string& name, const std::string& what,
                               uint64_t* size) {
  InputFile f = InputFile::open_at(dir_fd, name, what, /*follow_links=*/false);
  if (size) *size = f.size();
  return f.release_fd();
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
