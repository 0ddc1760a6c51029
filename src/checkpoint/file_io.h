// File-system primitives of the checkpoint layer on top of core/files.h (UniqueFd, write_all,
// pread_exact, fsync_fd, fsync_dir come from there): atomic small-file replacement, opening files
// inside a checkpoint directory, overflow-checked size arithmetic, xxHash64 in hex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/files.h"

namespace zt {

// Sizes in files are uint64; every sum and product of them goes through these.
inline bool checked_add(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); }
inline bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Replaces dir/name atomically through core's AtomicFile: writes dir/.name.tmp-<pid>-<k>, fsyncs
// it, renames it over name (refused when name is not a regular file) and fsyncs dir. A crash
// leaves either the old file or the new one, never a mix.
void atomic_write_file(const std::string& dir, const std::string& name, std::string_view bytes);

// Opens dir/name read-only through core's InputFile (never blocks, regular files only) without
// following a symbolic link in the last component; throws kInvalidArgument naming `what` when it
// is a link, missing or not a regular file.
UniqueFd open_regular_nofollow(int dir_fd, const std::string& name, const std::string& what,
                               uint64_t* size);

// A file name the checkpoint layer may open inside its own directory: non-empty, at most 255
// bytes, no '/', '\\', NUL or control characters, not starting with '.' (so never "." or "..").
bool is_plain_file_name(std::string_view name);

uint64_t xxh64(const void* data, size_t bytes);
std::string hex64(uint64_t v);  // 16 lower-case hex digits
std::optional<uint64_t> parse_hex64(std::string_view s);  // exactly 16 hex digits

}  // namespace zt
