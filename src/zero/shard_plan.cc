// Shard plan arithmetic.
#include "zero/shard_plan.h"

#include <algorithm>

#include "core/status.h"

namespace zt {

ShardRange shard_range(int64_t n, int rank, int world, int64_t align) {
  ZT_CHECK(n >= 0 && world >= 1 && align >= 1 && rank >= 0 && rank < world, "shard_range(n=", n,
           ", rank=", rank, ", world=", world, ", align=", align, ")");
  ShardRange r;
  const int64_t unit = static_cast<int64_t>(world) * align;
  r.padded_numel = std::max<int64_t>(unit, (n + unit - 1) / unit * unit);
  r.shard_numel = r.padded_numel / world;
  r.begin = rank * r.shard_numel;
  r.end = std::max(r.begin, std::min(r.begin + r.shard_numel, n));
  return r;
}

}  // namespace zt
