// Tensor parallelism's bookkeeping (Megatron-LM layout): how each tensor of a tensor rank's local
// parameter blocks maps onto the logical (unsharded, one-device) tensors. Checkpoints, exports,
// initialisation and final parameters all speak the logical layout; only the running model and the
// ZeRO engine see local blocks. Pure host arithmetic: no devices.
//
// Splits (T = the tensor degree, t = the rank's coordinate on the tensor axis):
//  - kReplicated: every tensor rank holds the whole tensor (layernorms, row-parallel biases,
//    position embeddings); its gradient is summed over the tensor group, so the copies stay equal.
//  - kRows: rank t holds rows [t R'/T, (t+1) R'/T) of a logical [R, ...] tensor padded to R' >= R
//    rows (column-parallel weights and biases; the vocabulary-parallel embedding, whose padding
//    rows beyond R map nowhere).
//  - kCols: rank t holds columns [t W/T, (t+1) W/T) of every row of a logical [R, W] tensor
//    (row-parallel weights).
//  - kQkvRows: a logical [3C, ...] tensor of three stacked parts (GPT-2's q, k, v): rank t holds
//    rows [t C/T, (t+1) C/T) of each part, stacked the same way, so its heads stay whole.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/layout.h"

namespace zt {

enum class TensorSplit : uint8_t { kReplicated, kRows, kCols, kQkvRows };

// Where one local tensor comes from.
struct LogicalPlace {
  int block = 0;   // logical block
  int tensor = 0;  // index in that block's tensors
  TensorSplit split = TensorSplit::kReplicated;
};

// A tensor-parallel model's map: places[b][i] for local block b, local tensor i.
struct TensorMap {
  int degree = 1;
  const ParamLayout* logical = nullptr;
  const ParamLayout* local = nullptr;
  std::vector<std::vector<LogicalPlace>> places;

  // Local blocks keep their replicated tensors last: the offset where block b's replicated run
  // starts (its numel when the last tensor is split). The gradient norm of [replicated_from, numel)
  // is counted once per tensor group, and that region's gradients are summed over the group.
  int64_t replicated_from(int block) const;
  // Calls fn(logical_block, logical_offset, local_offset, count) for every maximal run of
  // consecutive local elements in [begin, end) of local block `block` on tensor rank t that map to
  // consecutive logical elements, in local order. Alignment padding between tensors maps nowhere
  // and is skipped.
  void for_each_run(int t, int block, int64_t begin, int64_t end,
                    const std::function<void(int, int64_t, int64_t, int64_t)>& fn) const;
  // Local block b of rank t from whole logical blocks (logical_blocks[lb] holds lb's flat buffer);
  // padding is zero.
  std::vector<float> local_block(int t, int block, const std::vector<const float*>& logical_blocks) const;
};

}  // namespace zt
