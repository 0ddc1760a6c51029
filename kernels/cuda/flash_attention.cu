// CUDA fallback for the tiled causal attention ops (kernels/ops.h flash_attention_*): a group of
// four lanes per row over shared-memory tiles of K/V (forward, dQ) or Q/dO (dK/dV), rows held in
// registers, an online softmax, only the causal half visited, no atomics (each output row has one
// owner).
// Templated on the activations' storage type E (float, Half, BFloat16): fp32 math, lse and D,
// each output element rounded to E once. The checked fallback of the fused (cuDNN) attention.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"

namespace zt::cuda_ops {

namespace {

// A group of kGroup consecutive lanes owns one row (query or key): each lane holds a quarter of
// the row's columns in registers, as float4 chunks interleaved across the group (lane g owns
// chunks g, g + kGroup, ...) so that the group's shared-memory reads are contiguous and the other
// groups of the warp read the same addresses (broadcast). Head sizes are a template bucket (64 or
// 128; smaller heads use 64 with zero-padded columns; two buckets keep the build short), so the
// per-lane arrays have compile-time sizes and stay in registers (src/CMakeLists.txt makes ptxas
// fail on local memory here). Dot products: each lane's partial sum over its columns in order,
// then a butterfly over the group (IEEE addition commutes: every lane of the group gets the same bits).
constexpr int kGroup = 4;
constexpr int kThreads = 128;
constexpr int kRowsPerBlock = kThreads / kGroup;  // 32
constexpr int kTileRows = 32;                      // key (or query) rows per shared tile
constexpr int kMaxHeadSize = 128;
// The run-shape check (ops::require_cuda_attention_shape) refuses larger heads before a run starts.
static_assert(kMaxHeadSize == ops::kCudaMaxHeadSize, "the largest head bucket is the limit the run-shape check uses");

struct FlashDims {
  int64_t T, C, hs;
  float scale;
};

template <int HS>
struct Lanes {
  static constexpr int kChunks = HS / 4 / kGroup;  // float4 chunks per lane
  static_assert(kChunks >= 1 && HS % (4 * kGroup) == 0);
};

__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = kGroup / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  acc += a.x * b.x;
  acc += a.y * b.y;
  acc += a.z * b.z;
  acc += a.w * b.w;
  return acc;
}

__device__ __forceinline__ void axpy4(float4& y, float a, const float4& x) {
  y.x += a * x.x;
  y.y += a * x.y;
  y.z += a * x.z;
  y.w += a * x.w;
}

__device__ __forceinline__ void scale4(float4& y, float a) {
  y.x *= a;
  y.y *= a;
  y.z *= a;
  y.w *= a;
}

// Lane g's chunk k of a [HS]-float shared row.
template <int HS>
__device__ __forceinline__ const float4& chunk(const float* row, int g, int k) {
  return reinterpret_cast<const float4*>(row)[g + kGroup * k];
}

// Loads lane g's chunks of one row of length hs (columns >= hs and rows that do not exist: zero).
template <int HS, typename E>
__device__ void load_row(float4 (&dst)[Lanes<HS>::kChunks], const E* row, bool exists, int g, int64_t hs) {
#pragma unroll
  for (int k = 0; k < Lanes<HS>::kChunks; ++k) {
    const int64_t c = 4 * (g + kGroup * k);
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = exists && c + e < hs ? to_float(row[c + e]) : 0.0f;
    dst[k] = make_float4(v[0], v[1], v[2], v[3]);
  }
}

template <int HS, typename E>
__device__ void store_row(E* row, const float4 (&src)[Lanes<HS>::kChunks], float mul, bool accumulate, int g,
                          int64_t hs) {
#pragma unroll
  for (int k = 0; k < Lanes<HS>::kChunks; ++k) {
    const int64_t c = 4 * (g + kGroup * k);
    const float v[4] = {src[k].x * mul, src[k].y * mul, src[k].z * mul, src[k].w * mul};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (c + e < hs) row[c + e] = from_float<E>(accumulate ? to_float(row[c + e]) + v[e] : v[e]);
  }
}

// Copies rows [r0, r0 + kTileRows) (missing rows and columns >= hs zero) of a strided [T, hs]
// head slice into a shared [kTileRows][HS] tile.
template <int HS, typename E>
__device__ void load_tile(float (*tile)[HS], const E* src, int64_t ld, int64_t r0, const FlashDims& d) {
  for (int idx = threadIdx.x; idx < kTileRows * HS; idx += blockDim.x) {
    const int r = idx / HS, c = idx % HS;
    tile[r][c] = r0 + r < d.T && c < d.hs ? to_float(src[(r0 + r) * ld + c]) : 0.0f;
  }
}

// grid (query blocks, NH, B). out row i = sum_j softmax_j(scale q_i . k_j) v_j over j <= i.
// Every lane runs every loop iteration (masked, not skipped), so the group shuffles never diverge.
template <typename E, int HS>
__global__ void __launch_bounds__(kThreads) flash_forward_kernel(E* out, float* lse, const E* qkv, FlashDims d) {
  constexpr int K = Lanes<HS>::kChunks;
  __shared__ __align__(16) float ks[kTileRows][HS];
  __shared__ __align__(16) float vs[kTileRows][HS];
  const int64_t b = blockIdx.z, h = blockIdx.y, NH = gridDim.y, ld = 3 * d.C;
  const int g = threadIdx.x % kGroup;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock, i = i0 + threadIdx.x / kGroup;
  const bool active = i < d.T;
  const E* base = qkv + b * d.T * ld + h * d.hs;
  float4 q[K], acc[K];
  load_row<HS>(q, base + i * ld, active, g, d.hs);
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float m = -INFINITY, l = 0.0f;
  const int64_t last = min(d.T, i0 + kRowsPerBlock);  // keys [0, last) serve this block
  for (int64_t j0 = 0; j0 < last; j0 += kTileRows) {
    __syncthreads();  // the previous tile is no longer read
    load_tile<HS>(ks, base + d.C, ld, j0, d);
    load_tile<HS>(vs, base + 2 * d.C, ld, j0, d);
    __syncthreads();
    float s[kTileRows];
    float mx = m;
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      float part = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) part = dot4(q[k], chunk<HS>(ks[r], g, k), part);
      const float dot = group_sum(part);
      s[r] = active && j0 + r <= i ? dot * d.scale : -INFINITY;
      mx = fmaxf(mx, s[r]);
    }
    if (mx == -INFINITY) continue;          // no visible key in this tile (a row past T)
    const float corr = exp_elem(m - mx);  // 0 on the first tile (m = -inf)
    l *= corr;
#pragma unroll
    for (int k = 0; k < K; ++k) scale4(acc[k], corr);
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      const float p = exp_elem(s[r] - mx);  // 0 for masked keys (s = -inf)
      l += p;
#pragma unroll
      for (int k = 0; k < K; ++k) axpy4(acc[k], p, chunk<HS>(vs[r], g, k));
    }
    m = mx;
  }
  if (!active) return;
  store_row<HS>(out + (b * d.T + i) * d.C + h * d.hs, acc, 1.0f / l, false, g, d.hs);
  if (g == 0) lse[(b * NH + h) * d.T + i] = m + logf(l);
}

// D[b, h, t] = sum_c dout * out over head h of row (b, t); one thread per (b, t, h).
template <typename E>
__global__ void flash_rowdot_kernel(float* D, const E* dout, const E* out, int64_t B,
                                    int64_t NH, FlashDims d) {
  const int64_t n = B * d.T * NH;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t h = idx % NH, bt = idx / NH, b = bt / d.T, t = bt % d.T;
    const E* dy = dout + bt * d.C + h * d.hs;
    const E* y = out + bt * d.C + h * d.hs;
    double acc = 0.0;
    for (int64_t c = 0; c < d.hs; ++c) acc += static_cast<double>(to_float(dy[c])) * to_float(y[c]);
    D[(b * NH + h) * d.T + t] = static_cast<float>(acc);
  }
}

// grid (key blocks, NH, B); a lane group = key row j: dk_j, dv_j over queries i >= j.
template <typename E, int HS>
__global__ void __launch_bounds__(kThreads) flash_backward_kv_kernel(E* dqkv, const E* dout, const E* qkv,
                                                                      const float* lse, const float* D,
                                                                      FlashDims d, bool accumulate) {
  constexpr int K = Lanes<HS>::kChunks;
  __shared__ __align__(16) float qs[kTileRows][HS];
  __shared__ __align__(16) float dos[kTileRows][HS];
  __shared__ float lse_s[kTileRows], D_s[kTileRows];
  const int64_t b = blockIdx.z, h = blockIdx.y, NH = gridDim.y, ld = 3 * d.C;
  const int g = threadIdx.x % kGroup;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock, j = j0 + threadIdx.x / kGroup;
  const bool active = j < d.T;
  const E* base = qkv + b * d.T * ld + h * d.hs;
  const E* dout_base = dout + b * d.T * d.C + h * d.hs;
  const float* lse_row = lse + (b * NH + h) * d.T;
  const float* D_row = D + (b * NH + h) * d.T;
  float4 k_[K], v_[K], dk[K], dv[K];
  load_row<HS>(k_, base + j * ld + d.C, active, g, d.hs);
  load_row<HS>(v_, base + j * ld + 2 * d.C, active, g, d.hs);
#pragma unroll
  for (int k = 0; k < K; ++k) dk[k] = dv[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int64_t i0 = j0; i0 < d.T; i0 += kTileRows) {
    __syncthreads();
    load_tile<HS>(qs, base, ld, i0, d);
    load_tile<HS>(dos, dout_base, d.C, i0, d);
    for (int r = threadIdx.x; r < kTileRows; r += blockDim.x) {
      lse_s[r] = i0 + r < d.T ? lse_row[i0 + r] : 0.0f;
      D_s[r] = i0 + r < d.T ? D_row[i0 + r] : 0.0f;
    }
    __syncthreads();
#pragma unroll(HS >= 128 ? 2 : 4)  // four rows' dot products would not fit the registers at 128
    for (int r = 0; r < kTileRows; ++r) {
      float ps = 0.0f, pdp = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        ps = dot4(chunk<HS>(qs[r], g, k), k_[k], ps);
        pdp = dot4(chunk<HS>(dos[r], g, k), v_[k], pdp);
      }
      const float s = group_sum(ps), dp = group_sum(pdp);
      const bool visible = active && i0 + r < d.T && i0 + r >= j;  // causal: query i sees keys j <= i
      const float p = visible ? exp_elem(s * d.scale - lse_s[r]) : 0.0f;
      const float ds = p * (dp - D_s[r]) * d.scale;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        axpy4(dv[k], p, chunk<HS>(dos[r], g, k));
        axpy4(dk[k], ds, chunk<HS>(qs[r], g, k));
      }
    }
  }
  if (!active) return;
  E* row = dqkv + (b * d.T + j) * ld + h * d.hs;
  store_row<HS>(row + d.C, dk, 1.0f, accumulate, g, d.hs);
  store_row<HS>(row + 2 * d.C, dv, 1.0f, accumulate, g, d.hs);
}

// grid (query blocks, NH, B); a lane group = query row i: dq_i over keys j <= i.
template <typename E, int HS>
__global__ void __launch_bounds__(kThreads) flash_backward_q_kernel(E* dqkv, const E* dout, const E* qkv,
                                                                     const float* lse, const float* D,
                                                                     FlashDims d, bool accumulate) {
  constexpr int K = Lanes<HS>::kChunks;
  __shared__ __align__(16) float ks[kTileRows][HS];
  __shared__ __align__(16) float vs[kTileRows][HS];
  const int64_t b = blockIdx.z, h = blockIdx.y, NH = gridDim.y, ld = 3 * d.C;
  const int g = threadIdx.x % kGroup;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock, i = i0 + threadIdx.x / kGroup;
  const bool active = i < d.T;
  const E* base = qkv + b * d.T * ld + h * d.hs;
  float4 q[K], dy[K], dq[K];
  load_row<HS>(q, base + i * ld, active, g, d.hs);
  load_row<HS>(dy, dout + (b * d.T + i) * d.C + h * d.hs, active, g, d.hs);
#pragma unroll
  for (int k = 0; k < K; ++k) dq[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float lse_i = active ? lse[(b * NH + h) * d.T + i] : 0.0f;
  const float D_i = active ? D[(b * NH + h) * d.T + i] : 0.0f;
  const int64_t last = min(d.T, i0 + kRowsPerBlock);
  for (int64_t j0 = 0; j0 < last; j0 += kTileRows) {
    __syncthreads();
    load_tile<HS>(ks, base + d.C, ld, j0, d);
    load_tile<HS>(vs, base + 2 * d.C, ld, j0, d);
    __syncthreads();
#pragma unroll 4
    for (int r = 0; r < kTileRows; ++r) {
      float ps = 0.0f, pdp = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        ps = dot4(q[k], chunk<HS>(ks[r], g, k), ps);
        pdp = dot4(dy[k], chunk<HS>(vs[r], g, k), pdp);
      }
      const float s = group_sum(ps), dp = group_sum(pdp);
      const bool visible = active && j0 + r <= i;
      const float p = visible ? exp_elem(s * d.scale - lse_i) : 0.0f;
      const float ds = p * (dp - D_i) * d.scale;
#pragma unroll
      for (int k = 0; k < K; ++k) axpy4(dq[k], ds, chunk<HS>(ks[r], g, k));
    }
  }
  if (!active) return;
  store_row<HS>(dqkv + (b * d.T + i) * ld + h * d.hs, dq, 1.0f, accumulate, g, d.hs);
}

FlashDims flash_dims(int64_t T, int64_t C, int64_t NH, const char* op) {
  const int64_t hs = C / NH;
  ZT_REQUIRE(hs <= kMaxHeadSize, op, ": the CUDA tiled attention takes head sizes up to ",
             kMaxHeadSize, ", not ", hs);
  ZT_REQUIRE(NH <= ops::kCudaMaxGridHeads, op, ": the CUDA tiled attention takes up to ", ops::kCudaMaxGridHeads,
             " heads (grid y), not ", NH);
  return {T, C, hs, static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)))};
}

dim3 flash_grid(int64_t B, int64_t T, int64_t NH) {
  return dim3(static_cast<unsigned>((T + kRowsPerBlock - 1) / kRowsPerBlock),
              static_cast<unsigned>(NH), static_cast<unsigned>(B));
}

// The batch rows go to grid z, which CUDA caps at 65535 (the heads, grid y, are held to it by
// ops::require_cuda_attention_shape): a larger micro-batch (short sequences, T <= 32768) runs in
// slices of at most kMaxGridZ rows, f(b0, rows) each; every kernel indexes relative to its slice.
constexpr int64_t kMaxGridZ = 65535;
template <typename F>
void for_batch_slices(int64_t B, F&& f) {
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridZ) f(b0, std::min(kMaxGridZ, B - b0));
}

// Calls f with the head-size bucket as a compile-time constant.
template <typename F>
void with_head_bucket(int64_t hs, F&& f) {
  if (hs <= 64) return f(std::integral_constant<int, 64>{});
  return f(std::integral_constant<int, 128>{});
}

template <typename E>
void launch_flash_forward(cudaStream_t stream, void* out, float* lse, const void* qkv, int64_t B,
                          const FlashDims& d, int64_t NH) {
  for_batch_slices(B, [&](int64_t b0, int64_t rows) {
    with_head_bucket(d.hs, [&](auto hs) {
      flash_forward_kernel<E, decltype(hs)::value><<<flash_grid(rows, d.T, NH), kThreads, 0, stream>>>(
          static_cast<E*>(out) + b0 * d.T * d.C, lse + b0 * NH * d.T, static_cast<const E*>(qkv) + b0 * d.T * 3 * d.C,
          d);
    });
    ZT_CUDA_CHECK(cudaGetLastError());
  });
}

template <typename E>
void launch_flash_backward(cudaStream_t stream, void* dqkv, const void* dout, const void* qkv,
                           const void* out, const float* lse, float* scratch, int64_t B,
                           const FlashDims& d, int64_t NH, bool accumulate) {
  auto* dx = static_cast<E*>(dqkv);
  const auto* dy = static_cast<const E*>(dout);
  const auto* x = static_cast<const E*>(qkv);
  flash_rowdot_kernel<E><<<detail::grid_for(B * d.T * NH), detail::kElementwiseBlock, 0, stream>>>(
      scratch, dy, static_cast<const E*>(out), B, NH, d);
  ZT_CUDA_CHECK(cudaGetLastError());
  // dk/dv and dq touch disjoint columns of dqkv; both only read D, so stream order suffices.
  for_batch_slices(B, [&](int64_t b0, int64_t rows) {
    E* dx_b = dx + b0 * d.T * 3 * d.C;
    const E* dy_b = dy + b0 * d.T * d.C;
    const E* x_b = x + b0 * d.T * 3 * d.C;
    const float* lse_b = lse + b0 * NH * d.T;
    const float* D_b = scratch + b0 * NH * d.T;
    with_head_bucket(d.hs, [&](auto hs) {
      constexpr int HS = decltype(hs)::value;
      flash_backward_kv_kernel<E, HS><<<flash_grid(rows, d.T, NH), kThreads, 0, stream>>>(dx_b, dy_b, x_b, lse_b, D_b,
                                                                                          d, accumulate);
      ZT_CUDA_CHECK(cudaGetLastError());
      flash_backward_q_kernel<E, HS><<<flash_grid(rows, d.T, NH), kThreads, 0, stream>>>(dx_b, dy_b, x_b, lse_b, D_b,
                                                                                         d, accumulate);
    });
    ZT_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace

void flash_attention_forward(void* stream, void* out, float* lse, const void* qkv, int64_t B,
                             int64_t T, int64_t C, int64_t NH, DType dtype) {
  const FlashDims d = flash_dims(T, C, NH, "flash_attention_forward");
  detail::LaunchScope scope(stream);
  switch (dtype) {
    case DType::kF32:
      return launch_flash_forward<float>(scope.stream(), out, lse, qkv, B, d, NH);
    case DType::kF16:
      return launch_flash_forward<Half>(scope.stream(), out, lse, qkv, B, d, NH);
    case DType::kBF16:
      return launch_flash_forward<BFloat16>(scope.stream(), out, lse, qkv, B, d, NH);
    default:
      break;
  }
  ZT_CHECK(false, "flash_attention_forward: unsupported dtype ", dtype_name(dtype));
}

void flash_attention_backward(void* stream, void* dqkv, const void* dout, const void* qkv,
                              const void* out, const float* lse, float* scratch, int64_t B,
                              int64_t T, int64_t C, int64_t NH, DType dtype, bool accumulate) {
  const FlashDims d = flash_dims(T, C, NH, "flash_attention_backward");
  detail::LaunchScope scope(stream);
  switch (dtype) {
    case DType::kF32:
      return launch_flash_backward<float>(scope.stream(), dqkv, dout, qkv, out, lse, scratch, B, d, NH,
                                          accumulate);
    case DType::kF16:
      return launch_flash_backward<Half>(scope.stream(), dqkv, dout, qkv, out, lse, scratch, B, d, NH,
                                         accumulate);
    case DType::kBF16:
      return launch_flash_backward<BFloat16>(scope.stream(), dqkv, dout, qkv, out, lse, scratch, B, d,
                                             NH, accumulate);
    default:
      break;
  }
  ZT_CHECK(false, "flash_attention_backward: unsupported dtype ", dtype_name(dtype));
}

}  // namespace zt::cuda_ops
