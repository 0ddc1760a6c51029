// Helpers shared by the op kernels in kernels/cuda/*.cu: the launch scope (current device = the
// stream's GPU), grid sizing for grid-stride loops, 128-bit packs, and deterministic warp and
// column reductions.
// Includes cuda_runtime.h, so only kernels/cuda/*.cu may include it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "core/status.h"
#include "runtime/cuda/cuda_backend.h"
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
// GPU, which need not be the calling thread's current device. The GPU comes from the runtime's
// stream registry, not from cudaStreamGetDevice, which CUDA refuses while the stream captures a
// graph (core/capture_rules.h; a source check keeps such calls out of kernels/cuda).
class LaunchScope {
 public:
  explicit LaunchScope(void* stream)
      : stream_(static_cast<cudaStream_t>(stream)), ordinal_(cuda::stream_ordinal(stream)), guard_(ordinal_) {}
  cudaStream_t stream() const { return stream_; }
  int device() const { return ordinal_; }

 private:
  cudaStream_t stream_;
  int ordinal_;
  cuda::DeviceGuard guard_;
};

// Row kernels with one warp per row (softmax rows): kWarpRowBlock threads, enough blocks for every
// row up to kMaxGridBlocks (a grid-stride loop over rows covers the rest).
constexpr int kWarpRowBlock = 256;
constexpr int kWarpRowsPerBlock = kWarpRowBlock / kWarpSize;
inline unsigned warp_row_grid(int64_t rows) {
  return static_cast<unsigned>(std::clamp<int64_t>((rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock, 1, kMaxGridBlocks));
}

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

// ---- 128-bit loads and stores -----------------------------------------------------------------
// 16 bytes of T (4 floats, 8 bf16/fp16): one ld/st.global.v4 when the address is 16-byte aligned.
// Kernels take the vector path only when every pointer they stream is aligned (is_aligned16) and
// handle the remaining elements one by one, computing each element with the same expression as
// the scalar path: the bits never depend on which path ran.
constexpr int kPackBytes = 16;
template <typename T>
struct alignas(kPackBytes) Pack {
  static constexpr int kN = kPackBytes / static_cast<int>(sizeof(T));
  T v[kN];
};
template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  Pack<T> out;
  memcpy(&out, &raw, kPackBytes);
  return out;
}
template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& v) {
  uint4 raw;
  memcpy(&raw, &v, kPackBytes);
  *reinterpret_cast<uint4*>(p) = raw;
}
inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % kPackBytes == 0; }

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

// The bias gradient, dbias[c] += sum over rows of dout[N, C] (matmul_backward's dbias and
// bias_backward: one implementation, so both give the same bits), in two stages so that the grid
// fills the GPU: stage 1 sums fixed chunks of rows per 32-column block into double partials,
// stage 2 adds the partials of each column in chunk order. The chunking depends only on (N, C),
// so the bits are the same on every GPU; the partials live in the stream's cuBLAS workspace
// (stream-ordered between GEMMs, already counted by the memory plan), so nothing is allocated.
void add_column_sums(cudaStream_t stream, float* dbias, const float* dout, int64_t N, int64_t C);
// The same two stages over a 16-bit dout, widened where it is read (the sums stay double).
void add_column_sums(cudaStream_t stream, float* dbias, const Half* dout, int64_t N, int64_t C);
void add_column_sums(cudaStream_t stream, float* dbias, const BFloat16* dout, int64_t N, int64_t C);


}  // namespace zt::cuda_ops::detail
