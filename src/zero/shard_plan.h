// Shard plan: pure, value-typed arithmetic that slices a flat buffer of n elements across
// `world` ranks. Sizes that do not divide are padded, never rejected: the padded length is a
// multiple of world * align, every rank owns the same number of slots, and slots past n are
// padding (zero, never part of a tensor).
#pragma once

#include <cstdint>

namespace zt {

struct ShardRange {
  int64_t padded_numel = 0;  // world * shard_numel >= n
  int64_t shard_numel = 0;   // slots per rank (a multiple of align)
  int64_t begin = 0;         // first slot of this rank: rank * shard_numel
  int64_t end = 0;           // one past this rank's last REAL element: min(begin + shard_numel, n), >= begin
  int64_t size() const { return end - begin; }  // real elements owned (may be 0 for tiny n)
};

// align: slots per rank are a multiple of this (elements); keeps every shard start aligned for
// vector loads and for 16-bit types. Requires n >= 0, world >= 1, align >= 1.
ShardRange shard_range(int64_t n, int rank, int world, int64_t align = 16);

}  // namespace zt
