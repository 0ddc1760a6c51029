// cast_kernel: f32/f16/bf16 conversion on the GPU through the ZT_HOST_DEVICE functions of
// src/core/dtype.h, so that GPU and CPU results agree bit for bit (tests compare all patterns);
// 128-bit loads and stores where both pointers are aligned.
#include "kernels/cuda/cast.h"

#include <algorithm>
#include <cstdint>

#include "core/status.h"
#include "kernels/cuda/kernel_utils.h"
#include "runtime/cuda/cuda_check.h"

namespace zt {
namespace {

constexpr int kCastBlockSize = 256;
// Enough blocks to fill an H100/H200 many times over; the grid-stride loop covers the rest.
constexpr size_t kCastMaxBlocks = 8192;

// kN elements per step: one 16-byte pack of the narrower type, one or two of the wider. With
// `vec` (both pointers 16-byte aligned) the steps move whole packs, then the tail goes element by
// element; each element is converted by the same expression on either path.
template <typename Dst, typename Src>
__global__ void cast_kernel(Dst* __restrict__ dst, const Src* __restrict__ src, size_t n, bool vec) {
  constexpr size_t kN = 16 / (sizeof(Dst) < sizeof(Src) ? sizeof(Dst) : sizeof(Src));
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vec) {
    using SrcPack = cuda_ops::detail::Pack<Src>;
    using DstPack = cuda_ops::detail::Pack<Dst>;
    const size_t steps = n / kN;
    for (size_t p = tid; p < steps; p += stride) {
      Src x[kN];
      Dst y[kN];
      for (size_t k = 0; k < kN; k += SrcPack::kN) {
        const SrcPack v = cuda_ops::detail::load_pack(src + p * kN + k);
        for (int e = 0; e < SrcPack::kN; ++e) x[k + e] = v.v[e];
      }
#pragma unroll
      for (size_t k = 0; k < kN; ++k) y[k] = from_float<Dst>(to_float(x[k]));
      for (size_t k = 0; k < kN; k += DstPack::kN) {
        DstPack v;
        for (int e = 0; e < DstPack::kN; ++e) v.v[e] = y[k + e];
        cuda_ops::detail::store_pack(dst + p * kN + k, v);
      }
    }
    done = steps * kN;
  }
  for (size_t i = done + tid; i < n; i += stride) dst[i] = from_float<Dst>(to_float(src[i]));
}

template <typename Dst, typename Src>
void launch_typed(cudaStream_t stream, void* dst, const void* src, size_t n) {
  constexpr size_t kN = 16 / (sizeof(Dst) < sizeof(Src) ? sizeof(Dst) : sizeof(Src));
  const bool vec = cuda_ops::detail::is_aligned16(dst) && cuda_ops::detail::is_aligned16(src);
  const size_t threads = vec ? (n + kN - 1) / kN : n;
  const size_t blocks = std::min<size_t>((threads + kCastBlockSize - 1) / kCastBlockSize, kCastMaxBlocks);
  cast_kernel<Dst, Src><<<static_cast<unsigned>(std::max<size_t>(blocks, 1)), kCastBlockSize, 0, stream>>>(
      static_cast<Dst*>(dst), static_cast<const Src*>(src), n, vec);
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
  // A launch must target the stream's own device (from the registry: no CUDA call in a capture).
  cuda::DeviceGuard guard(cuda::stream_ordinal(cuda_stream));
  switch (src_type) {
    case DType::kF32: return launch_from<float>(dst_type, cuda_stream, dst, src, n);
    case DType::kF16: return launch_from<Half>(dst_type, cuda_stream, dst, src, n);
    case DType::kBF16: return launch_from<BFloat16>(dst_type, cuda_stream, dst, src, n);
    default: break;
  }
  ZT_CHECK(false, "launch_cast: unknown source dtype ", static_cast<int>(src_type));
}

}  // namespace zt
