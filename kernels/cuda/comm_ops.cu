// CUDA kernels of the collectives' direct path: accumulate_peer reads a peer GPU's partial sums over
// the link (peer access enabled) and adds them into local memory, one launch per ring step.
// 128-bit loads and stores where dst and src share their alignment; the per-element math is
// accumulate's (kernels/elementwise.h conversions), so the bits equal the staged path's.
#include <cstdint>
#include <cstring>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"

namespace zt::cuda_ops {
namespace {

using detail::grid_for;
using detail::kElementwiseBlock;

constexpr int kVectorBytes = 16;

template <typename T>
__device__ __forceinline__ void add_one(T* __restrict__ dst, const T* __restrict__ src, int64_t i) {
  dst[i] = from_float<T>(to_float(dst[i]) + to_float(src[i]));
}

// Elements [0, head) and [head + vectors * kPerVector, n) one by one; the vectors between with one
// 16-byte load from each side and one 16-byte store. head puts dst + head (and so src + head, the
// launcher checks they share alignment) on a 16-byte boundary.
template <typename T>
__global__ void accumulate_peer_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t n, int64_t head,
                                       int64_t vectors) {
  constexpr int kPerVector = kVectorBytes / static_cast<int>(sizeof(T));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto* dv = reinterpret_cast<uint4*>(dst + head);
  const auto* sv = reinterpret_cast<const uint4*>(src + head);
  for (int64_t v = first; v < vectors; v += stride) {
    uint4 a = dv[v];
    const uint4 b = sv[v];
    T x[kPerVector];
    T y[kPerVector];
    memcpy(x, &a, kVectorBytes);
    memcpy(y, &b, kVectorBytes);
#pragma unroll
    for (int e = 0; e < kPerVector; ++e) x[e] = from_float<T>(to_float(x[e]) + to_float(y[e]));
    memcpy(&a, x, kVectorBytes);
    dv[v] = a;
  }
  const int64_t tail = head + vectors * kPerVector;
  for (int64_t i = first; i < head + (n - tail); i += stride) add_one(dst, src, i < head ? i : tail + (i - head));
}

template <typename T>
void launch_accumulate_peer(cudaStream_t stream, void* dst_v, const void* src_v, int64_t n) {
  constexpr int64_t kPerVector = kVectorBytes / static_cast<int64_t>(sizeof(T));
  auto* dst = static_cast<T*>(dst_v);
  const auto* src = static_cast<const T*>(src_v);
  const auto dst_addr = reinterpret_cast<uintptr_t>(dst);
  const auto src_addr = reinterpret_cast<uintptr_t>(src);
  int64_t head = n;  // no common alignment: all of it element by element
  int64_t vectors = 0;
  if (dst_addr % kVectorBytes == src_addr % kVectorBytes && dst_addr % sizeof(T) == 0) {
    const int64_t to_boundary =
        static_cast<int64_t>((kVectorBytes - dst_addr % kVectorBytes) % kVectorBytes / sizeof(T));
    head = std::min(n, to_boundary);
    vectors = (n - head) / kPerVector;
  }
  const int64_t work = vectors + (n - vectors * kPerVector);
  accumulate_peer_kernel<T><<<grid_for(work), kElementwiseBlock, 0, stream>>>(dst, src, n, head, vectors);
}

}  // namespace

void accumulate_peer(void* stream, void* dst, const void* src, DType dtype, int64_t n) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  switch (dtype) {
    case DType::kF32:
      launch_accumulate_peer<float>(scope.stream(), dst, src, n);
      break;
    case DType::kF16:
      launch_accumulate_peer<Half>(scope.stream(), dst, src, n);
      break;
    case DType::kBF16:
      launch_accumulate_peer<BFloat16>(scope.stream(), dst, src, n);
      break;
    default:
      ZT_CHECK(false, "accumulate_peer: unsupported dtype ", dtype_name(dtype));
  }
  ZT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zt::cuda_ops
