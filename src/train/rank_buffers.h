// The trainer's own buffers on each rank (batches, norm partials, step scalars), described once:
// World allocates each from this description and the memory plan (train/plan.cc) counts the same
// entries, so the plan cannot drift from what a run holds. The model's workspaces and the ZeRO
// engine's buffers have their own descriptions (Model::workspace_bytes, plan_engine_memory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace zt {

class Model;

// Floats after the gradient-norm partials in RankState::norms: the step's loss sum, a micro-batch's.
constexpr int kLossSlots = 2;
// RankState::step_out: the global norm, loss sum and skip decision (doubles), then the clip factor
// (a float in a double's slot); step_host: step_out's doubles, then the loss-scale state.
constexpr size_t kStepOutBytes = 4 * sizeof(double);
constexpr size_t kStepHostBytes = 3 * sizeof(double) + 6 * sizeof(float);
// Steps in flight on a rank at most: the one enqueued and the one read one step late (step.h).
constexpr int kStepSlots = 2;

// The run's shape as far as these buffers depend on it.
struct RankBufferShape {
  bool gpt = true;
  int micro_batch = 1;     // B: rows of one micro-batch
  int seq_len = 1;         // T: tokens per row (1 for images)
  int input_dim = 0;       // features per image row (MLP)
  int ranks = 1;           // the ranks whose step-scalar rows each rank gathers (its world's devices)
  int data_ranks = 1;      // the data ranks a ZeRO engine pads a shard over (the tied gradient's)
  int micro_batches = 1;   // held at once: 1, or every micro-batch of the step on a pipeline stage
  bool pipeline = false;
};

// One buffer: `count` allocations of `bytes` each, tagged `tag` in the pool (device buffers on the
// rank's compute stream) or pinned host memory.
struct RankBuffer {
  const char* tag = "";
  size_t bytes = 0;
  DType dtype = DType::kF32;  // of the views over it (the step scalars mix doubles and floats)
  int count = 1;
  bool pinned_host = false;
  size_t total() const { return bytes * static_cast<size_t>(count); }
};

struct RankBuffers {
  RankBuffer inputs, targets;  // one micro-batch's rows (per micro-batch on a pipeline stage)
  RankBuffer tied_scratch;     // pipeline, first and last stage: the partner's embedding gradient (count 0 elsewhere)
  RankBuffer norms;            // 2 * blocks gradient-norm partials, then kLossSlots loss sums
  RankBuffer step_rows, step_include, step_out;  // the step's scalars (train/step.cc)
  RankBuffer step_host;        // pinned, one per step slot
  // Every entry, in World's allocation order.
  std::vector<const RankBuffer*> all() const {
    return {&inputs, &targets, &tied_scratch, &norms, &step_rows, &step_include, &step_out, &step_host};
  }
};

// The buffers of a rank running `model` (its pipeline stage's model on a pipeline).
RankBuffers rank_buffers(const RankBufferShape& shape, const Model& model);

}  // namespace zt
