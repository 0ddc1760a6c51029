// CUDA kernel of decode_attention (kernels/ops.h): the newest positions' queries attending over a
// KV cache qkv [S, 3C], for generation. One block per (head, query row), fp32 math; kept simple
// (a decode step is a few small launches per layer) rather than fast, and not yet run on a GPU.
#include <cub/block/block_reduce.cuh>
#include <cuda/functional>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"
#include "kernels/storage_types.h"

namespace zt::cuda_ops {
namespace {

using zt::detail::with_storage_type;  // kernels/storage_types.h

constexpr int kDecodeBlock = 128;
// Scores live in dynamic shared memory: S floats (32 KiB at most), which with the reductions' static
// storage stays within the default 48 KiB per block.
constexpr int64_t kMaxDecodeKeys = ops::kCudaMaxDecodeKeys;  // the generator checks it up front

// Block (h, i): query row t = S - n + i, head h. The scores of keys 0..t in shared memory, their
// max and the sum of exponentials by block reductions (fixed order: deterministic), then each
// thread sums p_j v_j over j for its output columns in key order and rounds once.
template <typename T>
__global__ void decode_attention_kernel(T* out, const T* qkv, int64_t n, int64_t S, int64_t C, int64_t NH,
                                        float scale) {
  using Reduce = cub::BlockReduce<float, kDecodeBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float shared_max, shared_sum;
  extern __shared__ float scores[];
  const int64_t h = blockIdx.x, i = blockIdx.y, t = S - n + i, hs = C / NH, ld = 3 * C;
  const T* q = qkv + t * ld + h * hs;
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) {
    const T* k = qkv + j * ld + C + h * hs;
    float dot = 0.0f;
    for (int64_t d = 0; d < hs; ++d) dot += to_float(q[d]) * to_float(k[d]);
    scores[j] = dot * scale;
    local_max = fmaxf(local_max, scores[j]);
  }
  const float block_max = Reduce(tmp).Reduce(local_max, ::cuda::maximum<float>{});
  if (threadIdx.x == 0) shared_max = block_max;
  __syncthreads();
  float local_sum = 0.0f;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) local_sum += scores[j] = exp_elem(scores[j] - shared_max);
  const float block_sum = Reduce(tmp).Sum(local_sum);
  if (threadIdx.x == 0) shared_sum = block_sum;
  __syncthreads();  // every score is final and the sum is published
  const float inv = 1.0f / shared_sum;
  for (int64_t d = threadIdx.x; d < hs; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j <= t; ++j) acc += scores[j] * to_float(qkv[j * ld + 2 * C + h * hs + d]);
    out[i * C + h * hs + d] = from_float<T>(acc * inv);
  }
}

}  // namespace

void decode_attention(void* stream, void* out, const void* qkv, int64_t n, int64_t S, int64_t C, int64_t NH,
                      DType dtype) {
  if (n == 0) return;
  ZT_REQUIRE(S <= kMaxDecodeKeys, "decode_attention: a cache of ", S, " positions is above the CUDA kernel's ",
             kMaxDecodeKeys, " (its scores sit in shared memory)");
  detail::LaunchScope scope(stream);
  const float scale = 1.0f / std::sqrt(static_cast<float>(C / NH));
  const dim3 grid(static_cast<unsigned>(NH), static_cast<unsigned>(n));
  const size_t shared = static_cast<size_t>(S) * sizeof(float);
  with_storage_type(dtype, "decode_attention", [&](auto tag) {
    using T = decltype(tag);
    decode_attention_kernel<T><<<grid, kDecodeBlock, shared, scope.stream()>>>(
        static_cast<T*>(out), static_cast<const T*>(qkv), n, S, C, NH, scale);
  });
  ZT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zt::cuda_ops
