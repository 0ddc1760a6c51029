// Helpers shared by the op kernels in kernels/cuda/*.cu: the launch scope (current device = the
// stream's GPU), grid sizing for grid-stride loops, and deterministic warp/block reductions.
// Includes cuda_runtime.h, so only kernels/cuda/*.cu may include it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/status.h"
#include "runtime/cuda/cuda_check.h"

namespace zt::cuda_ops::detail {

constexpr int kWarpSize = 32;
// Grid-stride kernels: enough blocks to fill an H100/H200 many times over; the loop covers the rest.
constexpr int kElementwiseBlock = 256;
constexpr int64_t kMaxGridBlocks = 8192;

inline unsigned grid_for(int64_t n, int block = kElementwiseBlock,
                         int64_t max_blocks = kMaxGridBlocks) {
  const int64_t blocks = (n + block - 1) / block;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, max_blocks));
}

// Every launcher starts with one of these: kernels and cuBLAS calls must target the stream's own
// GPU, which need not be the calling thread's current device.
class LaunchScope {
 public:
  explicit LaunchScope(void* stream)
      : stream_(static_cast<cudaStream_t>(stream)), ordinal_(stream_device(stream_)),
        guard_(ordinal_) {}
  cudaStream_t stream() const { return stream_; }
  int device() const { return ordinal_; }

 private:
  static int stream_device(cudaStream_t s) {
    int ordinal = 0;
    ZT_CUDA_CHECK(cudaStreamGetDevice(s, &ordinal));
    return ordinal;
  }
  cudaStream_t stream_;
  int ordinal_;
  cuda::DeviceGuard guard_;
};

// ---- reductions in a fixed order (run-to-run deterministic) ----------------------------------
// Butterfly over the 32 lanes: every lane gets the result, combined in the same order each run.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide sum/max; every thread gets the result. `scratch` is shared memory of >= 32 T;
// blockDim.x must be a multiple of 32 (and at most 1024). Contains __syncthreads: call from all
// threads of the block.
template <bool kMax, typename T>
__device__ __forceinline__ T block_reduce(T v, T* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  if constexpr (kMax) {
    v = warp_max(v);
  } else {
    v = warp_sum(v);
  }
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if constexpr (kMax) {
    return warp_max(lane < num_warps ? scratch[lane] : -INFINITY);
  } else {
    return warp_sum(lane < num_warps ? scratch[lane] : T(0));
  }
}
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  return block_reduce<false>(v, scratch);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce<true>(v, scratch);
}

// Column sums over rows (dbias of matmul, dweight/dbias of layernorm), in double like the CPU
// kernels: a block covers 32 columns (threadIdx.x) with kColumnSumRows row stripes (threadIdx.y);
// each thread sums its stripe in row order, then the stripes are combined by a fixed tree. The
// order depends only on N, never on the GPU, so results are deterministic without atomics.
constexpr int kColumnSumRows = 32;
using ColumnTile = double[kColumnSumRows][kWarpSize + 1];
// Tree-reduces `acc` over threadIdx.y; returns the total in threads with threadIdx.y == 0.
// `tile` is shared memory. Ends with __syncthreads, so the tile may be reused at once.
__device__ __forceinline__ double column_tree_sum(double acc, ColumnTile& tile) {
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  for (int stride = kColumnSumRows / 2; stride > 0; stride /= 2) {
    if (threadIdx.y < stride) tile[threadIdx.y][threadIdx.x] += tile[threadIdx.y + stride][threadIdx.x];
    __syncthreads();
  }
  const double total = tile[0][threadIdx.x];
  __syncthreads();
  return total;
}

}  // namespace zt::cuda_ops::detail
