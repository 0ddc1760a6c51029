// cast_kernel: f32/f16/bf16 conversion on the GPU through the ZT_HOST_DEVICE functions of
// src/core/dtype.h, so that GPU and CPU results agree bit for bit (tests compare all patterns).
#include "kernels/cuda/cast.h"

#include <algorithm>
#include <cstdint>

#include "core/status.h"
#include "runtime/cuda/cuda_check.h"

namespace zt {
namespace {

constexpr int kCastBlockSize = 256;
// Enough blocks to fill an H100/H200 many times over; the grid-stride loop covers the rest.
constexpr size_t kCastMaxBlocks = 8192;

template <typename Dst, typename Src>
__global__ void cast_kernel(Dst* __restrict__ dst, const Src* __restrict__ src, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = from_float<Dst>(to_float(src[i]));
  }
}

template <typename Dst, typename Src>
void launch_typed(cudaStream_t stream, void* dst, const void* src, size_t n) {
  const size_t blocks =
      std::min<size_t>((n + kCastBlockSize - 1) / kCastBlockSize, kCastMaxBlocks);
  cast_kernel<Dst, Src><<<static_cast<unsigned>(blocks), kCastBlockSize, 0, stream>>>(
      static_cast<Dst*>(dst), static_cast<const Src*>(src), n);
  ZT_CUDA_CHECK(cudaGetLastError());
}

template <typename Src>
void launch_from(DType dst_type, cudaStream_t stream, void* dst, const void* src, size_t n) {
  switch (dst_type) {
    case DType::kF32: return launch_typed<float, Src>(stream, dst, src, n);
    case DType::kF16: return launch_typed<Half, Src>(stream, dst, src, n);
    case DType::kBF16: return launch_typed<BFloat16, Src>(stream, dst, src, n);
    default: break;
  }
  ZT_CHECK(false, "launch_cast: unknown destination dtype ", static_cast<int>(dst_type));
}

}  // namespace

void launch_cast(Stream& stream, void* dst, DType dst_type, const void* src, DType src_type,
                 size_t n) {
  ZT_CHECK(stream.backend() == Backend::kCuda, "launch_cast needs a CUDA stream");
  if (n == 0) return;
  if (dst_type == src_type) {
    if (dst != src) stream.copy(dst, src, n * dtype_size(dst_type));
    return;
  }
  const auto is_float = [](DType t) {
    return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16;
  };
  ZT_CHECK(is_float(dst_type) && is_float(src_type), "launch_cast converts between f32, f16 and ",
           "bf16 only; asked for ", dtype_name(src_type), " -> ", dtype_name(dst_type));
  auto cuda_stream = static_cast<cudaStream_t>(stream.native_handle());
  // A launch must target the stream's own device.
  int ordinal = 0;
  ZT_CUDA_CHECK(cudaStreamGetDevice(cuda_stream, &ordinal));
  cuda::DeviceGuard guard(ordinal);
  switch (src_type) {
    case DType::kF32: return launch_from<float>(dst_type, cuda_stream, dst, src, n);
    case DType::kF16: return launch_from<Half>(dst_type, cuda_stream, dst, src, n);
    case DType::kBF16: return launch_from<BFloat16>(dst_type, cuda_stream, dst, src, n);
    default: break;
  }
  ZT_CHECK(false, "launch_cast: unknown source dtype ", static_cast<int>(src_type));
}

}  // namespace zt
