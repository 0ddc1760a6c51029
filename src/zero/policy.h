// What a ZeRO stage shards and where gradients accumulate, as one named value computed once from
// the stage: the engine and the memory plan consult these names instead of comparing stages.
#pragma once

#include "core/status.h"

namespace zt {

// Where a rank's reduced gradient shard of the step is summed over micro-batches.
enum class GradAccumulation {
  // Stages 0-1: the model writes a resident full-size gradient bucket; the reduced shard lands in
  // that bucket's own region (one micro-batch) or is folded into a separate shard accumulator.
  kFullBucketRegion,
  // Stages 2-3: the model writes a transient full bucket during the block's backward; the reduced
  // shard is folded into a resident shard accumulator and the bucket is freed.
  kShardAccumulator,
};

struct ShardingPolicy {
  bool shard_params = false;     // stage 3: each rank keeps 1/N of the parameters, gathers per visit
  bool shard_grads = false;      // stages 2-3: only the gradient shard is resident
  bool shard_optimizer = false;  // stages 1-3: master weights and moments over the rank's shard
  GradAccumulation where = GradAccumulation::kFullBucketRegion;

  // Stages 0-1 with more than one micro-batch per step keep a separate shard accumulator.
  bool separate_accumulator(int micro_batches) const {
    return where == GradAccumulation::kFullBucketRegion && micro_batches > 1;
  }
  // After the update each rank holds only its shard of the parameters it keeps in full: all-gather.
  bool gathers_params_after_step() const { return shard_optimizer && !shard_params; }
  // Without sharded optimizer state every rank updates everything: all-gather the reduced gradient.
  bool gathers_grads_before_step() const { return !shard_optimizer; }
};

inline ShardingPolicy policy_for_stage(int stage) {
  ZT_REQUIRE(stage >= 0 && stage <= 3, "--zero-stage must be 0, 1, 2 or 3, got ", stage);
  ShardingPolicy p;
  p.shard_optimizer = stage >= 1;
  p.shard_grads = stage >= 2;
  p.shard_params = stage >= 3;
  p.where = p.shard_grads ? GradAccumulation::kShardAccumulator : GradAccumulation::kFullBucketRegion;
  return p;
}

}  // namespace zt
