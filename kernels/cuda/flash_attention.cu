// CUDA fallback for the tiled causal attention ops (kernels/ops.h flash_attention_*): plain
// one-thread-per-row kernels over shared-memory tiles of K/V (forward, dQ) or Q/dO (dK/dV), an
// online softmax, only the causal half visited, no atomics (each output row has one owner).
// Templated on the activations' storage type E (float, Half, BFloat16): fp32 math, lse and D,
// each output element rounded to E once. The checked fallback of the fused (cuDNN) attention.
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"

namespace zt::cuda_ops {

namespace {

// Rows (threads) per block and rows per shared tile. Per-thread row copies live in local arrays
// of kMaxHeadSize (GPT-2: 64), so larger heads are refused by the launchers.
constexpr int kRowsPerBlock = 64;
constexpr int kTileRows = 32;
constexpr int kMaxHeadSize = 128;

struct FlashDims {
  int64_t T, C, hs;
  float scale;
};

// Copies rows [r0, r0 + kTileRows) (clipped to T; missing rows zero) of a strided [T, hs] head
// slice into a shared [kTileRows][kMaxHeadSize] tile.
template <typename E>
__device__ void load_tile(float (*tile)[kMaxHeadSize], const E* src, int64_t ld, int64_t r0,
                          const FlashDims& d) {
  for (int64_t idx = threadIdx.x; idx < kTileRows * d.hs; idx += blockDim.x) {
    const int64_t r = idx / d.hs, c = idx % d.hs;
    tile[r][c] = r0 + r < d.T ? to_float(src[(r0 + r) * ld + c]) : 0.0f;
  }
}

// grid (query blocks, NH, B). out row i = sum_j softmax_j(scale q_i . k_j) v_j over j <= i.
template <typename E>
__global__ void flash_forward_kernel(E* out, float* lse, const E* qkv, FlashDims d) {
  __shared__ float ks[kTileRows][kMaxHeadSize];
  __shared__ float vs[kTileRows][kMaxHeadSize];
  const int64_t b = blockIdx.z, h = blockIdx.y, NH = gridDim.y, ld = 3 * d.C;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock, i = i0 + threadIdx.x;
  const bool active = i < d.T;
  const E* base = qkv + b * d.T * ld + h * d.hs;
  float q[kMaxHeadSize], acc[kMaxHeadSize];
  for (int64_t c = 0; c < d.hs; ++c) {
    q[c] = active ? to_float(base[i * ld + c]) : 0.0f;
    acc[c] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int64_t last = min(d.T, i0 + kRowsPerBlock);  // keys [0, last) serve this block
  for (int64_t j0 = 0; j0 < last; j0 += kTileRows) {
    __syncthreads();  // the previous tile is no longer read
    load_tile(ks, base + d.C, ld, j0, d);
    load_tile(vs, base + 2 * d.C, ld, j0, d);
    __syncthreads();
    const int64_t visible = active ? min(static_cast<int64_t>(kTileRows), i - j0 + 1) : 0;
    if (visible <= 0) continue;
    float s[kTileRows];
    float mx = m;
    for (int64_t r = 0; r < visible; ++r) {
      float dot = 0.0f;
      for (int64_t c = 0; c < d.hs; ++c) dot += q[c] * ks[r][c];
      s[r] = dot * d.scale;
      mx = fmaxf(mx, s[r]);
    }
    const float corr = exp_elem(m - mx);  // ~0 on the first tile (m = -inf)
    l *= corr;
    for (int64_t c = 0; c < d.hs; ++c) acc[c] *= corr;
    for (int64_t r = 0; r < visible; ++r) {
      const float p = exp_elem(s[r] - mx);
      l += p;
      for (int64_t c = 0; c < d.hs; ++c) acc[c] += p * vs[r][c];
    }
    m = mx;
  }
  if (!active) return;
  const float inv = 1.0f / l;
  E* o = out + (b * d.T + i) * d.C + h * d.hs;
  for (int64_t c = 0; c < d.hs; ++c) o[c] = from_float<E>(acc[c] * inv);
  lse[(b * NH + h) * d.T + i] = m + logf(l);
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

// grid (key blocks, NH, B); thread = key row j: dk_j, dv_j over queries i >= j.
template <typename E>
__global__ void flash_backward_kv_kernel(E* dqkv, const E* dout, const E* qkv, const float* lse,
                                         const float* D, FlashDims d, bool accumulate) {
  __shared__ float qs[kTileRows][kMaxHeadSize];
  __shared__ float dos[kTileRows][kMaxHeadSize];
  __shared__ float lse_s[kTileRows], D_s[kTileRows];
  const int64_t b = blockIdx.z, h = blockIdx.y, NH = gridDim.y, ld = 3 * d.C;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock, j = j0 + threadIdx.x;
  const bool active = j < d.T;
  const E* base = qkv + b * d.T * ld + h * d.hs;
  const E* dout_base = dout + b * d.T * d.C + h * d.hs;
  const float* lse_row = lse + (b * NH + h) * d.T;
  const float* D_row = D + (b * NH + h) * d.T;
  float k[kMaxHeadSize], v[kMaxHeadSize], dk[kMaxHeadSize], dv[kMaxHeadSize];
  for (int64_t c = 0; c < d.hs; ++c) {
    k[c] = active ? to_float(base[j * ld + d.C + c]) : 0.0f;
    v[c] = active ? to_float(base[j * ld + 2 * d.C + c]) : 0.0f;
    dk[c] = dv[c] = 0.0f;
  }
  for (int64_t i0 = j0; i0 < d.T; i0 += kTileRows) {
    __syncthreads();
    load_tile(qs, base, ld, i0, d);
    load_tile(dos, dout_base, d.C, i0, d);
    for (int64_t r = threadIdx.x; r < kTileRows; r += blockDim.x) {
      lse_s[r] = i0 + r < d.T ? lse_row[i0 + r] : 0.0f;
      D_s[r] = i0 + r < d.T ? D_row[i0 + r] : 0.0f;
    }
    __syncthreads();
    if (!active) continue;
    for (int64_t r = 0; r < kTileRows && i0 + r < d.T; ++r) {
      if (i0 + r < j) continue;  // causal: query i sees keys j <= i
      float s = 0.0f, dp = 0.0f;
      for (int64_t c = 0; c < d.hs; ++c) {
        s += qs[r][c] * k[c];
        dp += dos[r][c] * v[c];
      }
      const float p = exp_elem(s * d.scale - lse_s[r]);
      const float ds = p * (dp - D_s[r]) * d.scale;
      for (int64_t c = 0; c < d.hs; ++c) {
        dv[c] += p * dos[r][c];
        dk[c] += ds * qs[r][c];
      }
    }
  }
  if (!active) return;
  E* row = dqkv + (b * d.T + j) * ld + h * d.hs;
  for (int64_t c = 0; c < d.hs; ++c) {
    E& rk = row[d.C + c];
    E& rv = row[2 * d.C + c];
    rk = from_float<E>(accumulate ? to_float(rk) + dk[c] : dk[c]);
    rv = from_float<E>(accumulate ? to_float(rv) + dv[c] : dv[c]);
  }
}

// grid (query blocks, NH, B); thread = query row i: dq_i over keys j <= i.
template <typename E>
__global__ void flash_backward_q_kernel(E* dqkv, const E* dout, const E* qkv, const float* lse,
                                        const float* D, FlashDims d, bool accumulate) {
  __shared__ float ks[kTileRows][kMaxHeadSize];
  __shared__ float vs[kTileRows][kMaxHeadSize];
  const int64_t b = blockIdx.z, h = blockIdx.y, NH = gridDim.y, ld = 3 * d.C;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock, i = i0 + threadIdx.x;
  const bool active = i < d.T;
  const E* base = qkv + b * d.T * ld + h * d.hs;
  float q[kMaxHeadSize], dy[kMaxHeadSize], dq[kMaxHeadSize];
  for (int64_t c = 0; c < d.hs; ++c) {
    q[c] = active ? to_float(base[i * ld + c]) : 0.0f;
    dy[c] = active ? to_float(dout[(b * d.T + i) * d.C + h * d.hs + c]) : 0.0f;
    dq[c] = 0.0f;
  }
  const float lse_i = active ? lse[(b * NH + h) * d.T + i] : 0.0f;
  const float D_i = active ? D[(b * NH + h) * d.T + i] : 0.0f;
  const int64_t last = min(d.T, i0 + kRowsPerBlock);
  for (int64_t j0 = 0; j0 < last; j0 += kTileRows) {
    __syncthreads();
    load_tile(ks, base + d.C, ld, j0, d);
    load_tile(vs, base + 2 * d.C, ld, j0, d);
    __syncthreads();
    if (!active) continue;
    for (int64_t r = 0; r < kTileRows && j0 + r <= i; ++r) {
      float s = 0.0f, dp = 0.0f;
      for (int64_t c = 0; c < d.hs; ++c) {
        s += q[c] * ks[r][c];
        dp += dy[c] * vs[r][c];
      }
      const float p = exp_elem(s * d.scale - lse_i);
      const float ds = p * (dp - D_i) * d.scale;
      for (int64_t c = 0; c < d.hs; ++c) dq[c] += ds * ks[r][c];
    }
  }
  if (!active) return;
  E* row = dqkv + (b * d.T + i) * ld + h * d.hs;
  for (int64_t c = 0; c < d.hs; ++c) row[c] = from_float<E>(accumulate ? to_float(row[c]) + dq[c] : dq[c]);
}

FlashDims flash_dims(int64_t T, int64_t C, int64_t NH, const char* op) {
  const int64_t hs = C / NH;
  ZT_REQUIRE(hs <= kMaxHeadSize, op, ": the CUDA tiled attention takes head sizes up to ",
             kMaxHeadSize, ", not ", hs);
  return {T, C, hs, static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)))};
}

dim3 flash_grid(int64_t B, int64_t T, int64_t NH) {
  return dim3(static_cast<unsigned>((T + kRowsPerBlock - 1) / kRowsPerBlock),
              static_cast<unsigned>(NH), static_cast<unsigned>(B));
}

template <typename E>
void launch_flash_forward(cudaStream_t stream, void* out, float* lse, const void* qkv, int64_t B,
                          const FlashDims& d, int64_t NH) {
  flash_forward_kernel<E><<<flash_grid(B, d.T, NH), kRowsPerBlock, 0, stream>>>(
      static_cast<E*>(out), lse, static_cast<const E*>(qkv), d);
  ZT_CUDA_CHECK(cudaGetLastError());
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
  flash_backward_kv_kernel<E><<<flash_grid(B, d.T, NH), kRowsPerBlock, 0, stream>>>(
      dx, dy, x, lse, scratch, d, accumulate);
  ZT_CUDA_CHECK(cudaGetLastError());
  flash_backward_q_kernel<E><<<flash_grid(B, d.T, NH), kRowsPerBlock, 0, stream>>>(
      dx, dy, x, lse, scratch, d, accumulate);
  ZT_CUDA_CHECK(cudaGetLastError());
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
