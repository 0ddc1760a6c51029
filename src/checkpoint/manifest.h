// The checkpoint manifest (manifest.json): what a checkpoint holds and where. Named flat arrays
// (e.g. "h.3/master", dtype f32, numel N) are stored as ranges [begin, begin + count) of elements,
// each a contiguous run of bytes at an offset in one of the checkpoint's files (one per writer
// rank). A reader may ask for any range of an array; it is assembled from the stored ranges that
// cover it, which is how N devices' shards are read back by M devices.
//
// Integrity: the manifest carries an xxHash64 of every file and of every range, and one of its own
// text (the 16 hex digits at a fixed position near the start cover every byte after them), so any
// changed byte of any file of a checkpoint is detected. Invariants parse_manifest/validate_manifest
// enforce (anything else is a corrupt manifest):
//  - format "zerotrain-checkpoint", version 1 (other versions are refused by name);
//  - file names are plain names inside the checkpoint directory (is_plain_file_name), unique;
//  - every array's ranges tile [0, numel) exactly: no gap, no overlap, no empty range;
//  - bytes = count * element size, offset + bytes <= the file's size, all overflow-checked;
//  - the ranges stored in a file tile its bytes [0, size) exactly (no unaccounted bytes).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/storage_dtype.h"

namespace zt {

inline constexpr char kCheckpointFormat[] = "zerotrain-checkpoint";
inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr char kManifestFileName[] = "manifest.json";
// A manifest lists arrays and ranges, never data: 64 MiB is far beyond any real one.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;
// The manifest's own structure is 4 levels deep; the rest is for the trainer's meta.
inline constexpr int kMaxManifestJsonDepth = 64;

struct ManifestFile {
  std::string name;  // plain name inside the checkpoint directory: "rank-00001.bin"
  uint64_t size = 0;
  uint64_t xxh64 = 0;  // of the whole file
};

struct ManifestRange {
  uint32_t file = 0;   // index into Manifest::files
  uint64_t begin = 0;  // first element of the array held here
  uint64_t count = 0;  // elements (>= 1)
  uint64_t offset = 0;  // byte offset in the file
  uint64_t bytes = 0;   // count * element size
  uint64_t xxh64 = 0;   // of these bytes
};

struct ManifestArray {
  std::string name;
  StorageDType dtype = StorageDType::kF32;
  uint64_t numel = 0;
  std::vector<int64_t> shape;  // informational; when non-empty its product is numel
  std::vector<ManifestRange> ranges;  // sorted by begin after parsing/validation
};

struct Manifest {
  int64_t step = 0;
  nlohmann::json meta = nlohmann::json::object();  // the trainer's: model, precision, stage, ...
  std::vector<ManifestFile> files;
  std::vector<ManifestArray> arrays;
};

// Checks the invariants above (sorting each array's ranges by begin); throws
// zt::Error(kInvalidArgument) with one sentence starting with `where`.
void validate_manifest(Manifest& manifest, const std::string& where);

// The manifest's text, checksum included (validates first).
std::string serialize_manifest(Manifest manifest);

// Parses and validates manifest text. `where` starts every message ("checkpoint DIR:
// manifest.json"). verify_checksum=false skips only the text checksum (fuzzing, tests that craft
// manifests by hand); every other rule still applies.
Manifest parse_manifest(std::string_view text, const std::string& where, bool verify_checksum = true);

}  // namespace zt
