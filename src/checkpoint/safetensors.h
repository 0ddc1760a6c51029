// safetensors files (https://github.com/huggingface/safetensors): consolidated weights for
// `zerotrain export` and `--init-from`. Layout: an 8-byte little-endian header length N, N bytes of
// JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"k": "v"}}, then the data section; offsets are relative to its start.
//
// Everything read is validated before any tensor is used, with overflow-checked arithmetic:
// N <= 100 MB and 8 + N <= file size; the header is a JSON object starting with '{' with no
// duplicate names; "__metadata__" (optional) maps strings to strings; each dtype is known; shape
// dimensions are non-negative and product * element size == end - begin; offsets lie in the data
// section, and the tensors tile it exactly (no overlaps, no holes, nothing after the last).
// Files are opened through core/files.h's InputFile (regular files only; a FIFO cannot block) and
// read with pread, never mapped, so a file truncated while open is zt::Error(kIo), not SIGBUS.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/storage_dtype.h"

namespace zt {

inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

struct SafetensorsEntry {
  std::string name;
  StorageDType dtype = StorageDType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data section
  uint64_t end = 0;
  uint64_t numel() const;
  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  uint64_t data_offset = 0;  // where the data section starts in the file: 8 + N
  uint64_t data_bytes = 0;
  std::vector<SafetensorsEntry> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  const SafetensorsEntry* find(std::string_view name) const;  // nullptr when absent
};

// Validates the header of a file of `file_size` bytes whose first bytes are `prefix` (at least the
// 8 + N header bytes; the whole file does too). `where` (the path) starts every message; failures
// are zt::Error(kInvalidArgument).
SafetensorsHeader parse_safetensors_header(std::span<const uint8_t> prefix, uint64_t file_size,
                                           const std::string& where);
// The whole file in memory.
inline SafetensorsHeader parse_safetensors(std::span<const uint8_t> file, const std::string& where) {
  return parse_safetensors_header(file, file.size(), where);
}

// Streams a safetensors file: the tensors' specs first, then their bytes in the same order (in any
// number of write() calls), then commit(). Atomic through core/files.h's AtomicFile: written to a
// temporary name beside `path`, fsync'd, renamed, directory fsync'd; destroyed uncommitted, the
// temporary file is removed. A target that is not a regular file (a device node such as
// /dev/full, a FIFO, a directory, a symbolic link) is refused (kInvalidArgument) and left as it is.
class SafetensorsWriter {
 public:
  struct Spec {
    std::string name;
    StorageDType dtype = StorageDType::kF32;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(std::string path, std::vector<Spec> tensors, const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void write(const void* data, uint64_t bytes);
  void commit();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

struct SafetensorsTensor {
  std::string name;
  StorageDType dtype = StorageDType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  uint64_t bytes = 0;  // must equal product(shape) * element size
};

// All tensors at once (in this order in the data section).
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A validated safetensors file open for reading.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const;
  const SafetensorsHeader& header() const;
  const std::vector<SafetensorsEntry>& tensors() const { return header().tensors; }
  const std::map<std::string, std::string>& metadata() const { return header().metadata; }
  const SafetensorsEntry* find(std::string_view name) const { return header().find(name); }
  // Throws kInvalidArgument naming the file when there is no such tensor.
  const SafetensorsEntry& at(std::string_view name) const;
  // Bytes [offset, offset + bytes) of a tensor's data (a rank's slice of it, or all of it).
  void read(const SafetensorsEntry& tensor, uint64_t offset, uint64_t bytes, void* out) const;
  std::vector<uint8_t> read(std::string_view name) const;

 private:
  struct State;
  explicit SafetensorsFile(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

}  // namespace zt
