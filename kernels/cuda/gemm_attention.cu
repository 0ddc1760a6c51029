// fp32 causal attention through cuBLAS (kernels/ops.h flash_attention_* contract; #28 item 7): the
// products on tensor cores (TF32 when the device's MathMode says so, --tf32) or as true fp32 GEMMs,
// instead of the tiled kernel's CUDA-core dot products. Per batch row b and group of heads
// (ops::gemm_attention_heads_per_chunk: the group's [heads, T, T] fp32 scores fit
// ops::kGemmAttentionChunkBytes):
//   forward:  S = scale Q K^T (one strided-batched GEMM over the group's heads, full T x T), a row
//             kernel: P = causal softmax of S in place (zero above the diagonal) and lse; O = P V.
//   backward: S again; dP = dO V^T; a row kernel: D = rowsum(dO * O), P = exp(S - lse) (zero above
//             the diagonal), dS = P (dP - D), in place; dV = P^T dO, dQ = scale dS K, dK = scale
//             dS^T Q (beta 1 accumulates into dqkv, beta 0 overwrites without reading it).
// Twice the causal half's FLOPs (the GEMMs run the full square), at tensor-core speed. The score
// buffers are the stream's attention block (attention_block.h, ops::flash_attention_library_bytes
// for f32): taken by available() at the shape's first call (eager, before any capture), so a
// launch allocates nothing. Deterministic: cuBLAS is bit-reproducible on one stream and workspace,
// the row kernels sum in a fixed order. lse is the tiled kernels' and cuDNN's (log-sum-exp of the
// scaled scores), so a forward of one path and a backward of another pair up.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <tuple>

#include "core/status.h"
#include "kernels/cuda/attention_block.h"
#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"

namespace zt::cuda_ops {
namespace {

using detail::gemm_strided_batched;
using detail::kWarpSize;

// Below this T a declined shape costs little on the tiled kernel: no line about it.
constexpr int64_t kAnnounceFallbackFromT = 256;

// The backward's row kernel over one chunk: S [rows, T] (scaled scores) becomes P = exp(S - lse)
// (0 above the diagonal) and dP [rows, T] becomes dS = P (dP - D), D = sum_c dout[i, c] out[i, c]
// over the row's head (double). out, dout: the chunk's first head in [T, C]-strided rows.
__global__ void softmax_backward_rows_kernel(float* __restrict__ S, float* __restrict__ dP,
                                             const float* __restrict__ lse, const float* __restrict__ out,
                                             const float* __restrict__ dout, int64_t rows, int64_t T, int64_t C,
                                             int64_t hs) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * detail::kWarpRowsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * detail::kWarpRowsPerBlock + threadIdx.x / kWarpSize; r < rows;
       r += warps) {
    const int64_t h = r / T, i = r % T;
    const float* o = out + i * C + h * hs;
    const float* dy = dout + i * C + h * hs;
    double d = 0.0;
    for (int64_t c = lane; c < hs; c += kWarpSize) d += static_cast<double>(dy[c]) * o[c];
    const float D = static_cast<float>(detail::warp_sum(d));
    const float L = lse[r];
    float* p = S + r * T;
    float* g = dP + r * T;
    for (int64_t j = lane; j < T; j += kWarpSize) {
      const float pj = j <= i ? exp_elem(p[j] - L) : 0.0f;
      const float dpj = g[j];
      p[j] = pj;
      g[j] = pj * (dpj - D);
    }
  }
}

struct Dims {
  int64_t B, T, C, NH, hs, group;  // group: heads per chunk
  float scale;
  size_t scores;  // bytes of one chunk's score buffer, rounded up to 256 (the second starts there)
};

Dims dims(int64_t B, int64_t T, int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  return {B, T, C, NH, hs, ops::gemm_attention_heads_per_chunk(T, NH),
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs))),
          static_cast<size_t>(ops::gemm_attention_workspace(T, NH).forward)};
}

// Calls f(b, h0, nh) for every chunk: batch row b, heads [h0, h0 + nh).
template <typename F>
void for_each_chunk(const Dims& d, F&& f) {
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h0 = 0; h0 < d.NH; h0 += d.group) f(b, h0, std::min(d.group, d.NH - h0));
}

// Shapes (GPU, B, T, C, NH) whose block the pool could not give: declined for the run.
struct Declined {
  std::mutex mu;
  std::set<std::tuple<int, int64_t, int64_t, int64_t, int64_t>> shapes;
  bool announced = false;
};
Declined& declined() {
  static Declined* d = new Declined;  // leaked: used until the process ends
  return *d;
}

}  // namespace

bool gemm_attention_available(Stream& s, void* native, int64_t B, int64_t T, int64_t C, int64_t NH) {
  const auto key = std::make_tuple(cuda::stream_ordinal(native), B, T, C, NH);
  Declined& dc = declined();
  {
    const std::lock_guard<std::mutex> lock(dc.mu);
    if (dc.shapes.count(key) != 0) return false;
  }
  const size_t bytes = ops::flash_attention_library_bytes(B, T, C, DType::kF32, ops::gemm_attention_workspace(T, NH));
  try {
    detail::attention_block(s, native, bytes);
    return true;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kOutOfMemory) throw;
  }
  const std::lock_guard<std::mutex> lock(dc.mu);
  dc.shapes.insert(key);
  if (T >= kAnnounceFallbackFromT && !dc.announced) {
    dc.announced = true;
    std::fprintf(stderr,
                 "attention: the fp32 GEMM attention's score buffers (%zu bytes) do not fit in the pool at B=%lld "
                 "T=%lld heads=%lld; the tiled kernel runs instead (CUDA cores, no tensor cores)\n",
                 bytes, static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(NH));
  }
  return false;
}

void gemm_attention_forward(Stream& s, void* native, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                            int64_t C, int64_t NH, bool tf32) {
  const Dims d = dims(B, T, C, NH);
  detail::LaunchScope scope(native);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  auto* S = static_cast<float*>(detail::attention_block(s, native, 2 * d.scores));
  const int64_t C3 = 3 * C, TT = T * T;
  for_each_chunk(d, [&](int64_t b, int64_t h0, int64_t nh) {
    const float* q = qkv + b * T * C3 + h0 * d.hs;
    const float* k = q + C;
    const float* v = q + 2 * C;
    // S^T[T2, T] = scale K[T2, hs] Q^T[hs, T] per head (row-major S[T, T2] read column-major)
    gemm_strided_batched(h, CUBLAS_OP_T, CUBLAS_OP_N, T, T, d.hs, d.scale, k, C3, d.hs, q, C3, d.hs, 0.0f, S, T, TT,
                         nh, tf32);
    causal_softmax(scope.stream(), S, S, lse + (b * NH + h0) * T, nh * T, T);  // P in place, and lse
    // out^T[hs, T] = V^T[hs, T2] P^T[T2, T]
    gemm_strided_batched(h, CUBLAS_OP_N, CUBLAS_OP_N, d.hs, T, T, 1.0f, v, C3, d.hs, S, T, TT, 0.0f,
                         out + b * T * C + h0 * d.hs, C, d.hs, nh, tf32);
  });
}

void gemm_attention_backward(Stream& s, void* native, float* dqkv, const float* dout, const float* qkv,
                             const float* out, const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                             bool tf32, bool accumulate) {
  const Dims d = dims(B, T, C, NH);
  detail::LaunchScope scope(native);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  auto* block = static_cast<char*>(detail::attention_block(s, native, 2 * d.scores));
  auto* P = reinterpret_cast<float*>(block);
  auto* G = reinterpret_cast<float*>(block + d.scores);  // dP, then dS
  const int64_t C3 = 3 * C, TT = T * T;
  const float beta = accumulate ? 1.0f : 0.0f;
  for_each_chunk(d, [&](int64_t b, int64_t h0, int64_t nh) {
    const float* q = qkv + b * T * C3 + h0 * d.hs;
    const float* k = q + C;
    const float* v = q + 2 * C;
    const float* dy = dout + b * T * C + h0 * d.hs;
    float* dq = dqkv + b * T * C3 + h0 * d.hs;
    float* dk = dq + C;
    float* dv = dq + 2 * C;
    gemm_strided_batched(h, CUBLAS_OP_T, CUBLAS_OP_N, T, T, d.hs, d.scale, k, C3, d.hs, q, C3, d.hs, 0.0f, P, T, TT,
                         nh, tf32);
    // dP^T[T2, T] = V[T2, hs] dout^T[hs, T]
    gemm_strided_batched(h, CUBLAS_OP_T, CUBLAS_OP_N, T, T, d.hs, 1.0f, v, C3, d.hs, dy, C, d.hs, 0.0f, G, T, TT, nh,
                         tf32);
    softmax_backward_rows_kernel<<<detail::warp_row_grid(nh * T), detail::kWarpRowBlock, 0, scope.stream()>>>(
        P, G, lse + (b * NH + h0) * T, out + b * T * C + h0 * d.hs, dy, nh * T, T, C, d.hs);
    ZT_CUDA_CHECK(cudaGetLastError());
    // dV^T[hs, T2] = dout^T[hs, T] P[T, T2]
    gemm_strided_batched(h, CUBLAS_OP_N, CUBLAS_OP_T, d.hs, T, T, 1.0f, dy, C, d.hs, P, T, TT, beta, dv, C3, d.hs, nh,
                         tf32);
    // dQ^T[hs, T] = scale K^T[hs, T2] dS^T[T2, T]
    gemm_strided_batched(h, CUBLAS_OP_N, CUBLAS_OP_N, d.hs, T, T, d.scale, k, C3, d.hs, G, T, TT, beta, dq, C3, d.hs,
                         nh, tf32);
    // dK^T[hs, T2] = scale Q^T[hs, T] dS[T, T2]
    gemm_strided_batched(h, CUBLAS_OP_N, CUBLAS_OP_T, d.hs, T, T, d.scale, q, C3, d.hs, G, T, TT, beta, dk, C3, d.hs,
                         nh, tf32);
  });
}

}  // namespace zt::cuda_ops
