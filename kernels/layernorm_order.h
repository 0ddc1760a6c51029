// The fixed fp32 summation order of layernorm_backward's dweight/dbias, a function of (N, C) only:
// the CPU kernel (the specification) and the CUDA kernel both follow it, so both give its bits on
// every thread count and every GPU. Host-only planning; the arithmetic lives in each kernel.
//
// The order, for every column c (dweight's terms norm * dout, each product rounded to fp32 before
// it is added, and dbias's terms dout):
//  1. Rows are cut into `blocks` runs of `rows_per_block`; inside a run, row r0 + i belongs to
//     "warp" i % warps. Each warp sums its rows' terms in increasing row order, from 0.0f.
//  2. A block's partial is warp 0's sum + warp 1's + ... + warp (warps - 1)'s, left to right (warps
//     without rows add their 0.0f too).
//  3. With one block, dweight[c] += that partial. Otherwise the partials are striped: stripe s
//     (0..kStripes-1) sums partials s, s + kStripes, ... from 0.0f in order; stripes combine by the
//     tree s += s + h for h = kStripes/2, ..., 1; dweight[c] += stripe 0.
#pragma once

#include <algorithm>
#include <cstdint>

namespace zt::detail {

struct LayernormBackwardOrder {
  // Rows per "warp" group and block; the CUDA kernel runs `warps` warps per block, `blocks` blocks.
  int warps = 1;
  int64_t rows_per_block = 1;
  int64_t blocks = 1;
  // The CUDA kernel keeps the warps' column sums in shared memory (else, with one warp per block,
  // in the block's partial row in global memory: the same sums).
  bool shared_sums = true;
  static constexpr int kStripes = 32;
  static constexpr int kMaxWarps = 8;
  // Shared memory for the warps' sums: warps x 2 x C (rounded up to 8) floats.
  static constexpr int64_t kSharedBytes = int64_t{48} << 10;
  // The partials (blocks x 2C floats) live in the CUDA stream's workspace, at least this large
  // (kernels/cuda/cublas_handle.h, kMinStreamWorkspace).
  static constexpr int64_t kScratchBytes = int64_t{4} << 20;
  // Enough warps to fill a large GPU with rows, fixed so that the order does not depend on it.
  static constexpr int64_t kTargetWarps = 2048;
};

inline LayernormBackwardOrder layernorm_backward_order(int64_t N, int64_t C) {
  using O = LayernormBackwardOrder;
  O o;
  const int64_t row_bytes = 2 * ((C + 7) / 8 * 8) * int64_t{sizeof(float)};
  const int64_t fit = O::kSharedBytes / row_bytes;
  o.shared_sums = fit >= 1;
  o.warps = static_cast<int>(std::clamp<int64_t>(fit, 1, O::kMaxWarps));
  const int64_t max_blocks = std::max<int64_t>(1, O::kScratchBytes / (2 * C * int64_t{sizeof(float)}));
  const int64_t want = std::min(max_blocks, (O::kTargetWarps + o.warps - 1) / o.warps);
  o.rows_per_block = std::max<int64_t>(1, (N + want - 1) / want);
  o.blocks = std::max<int64_t>(1, (N + o.rows_per_block - 1) / o.rows_per_block);
  return o;
}

}  // namespace zt::detail
