// CUDA matmul's plain path (the fallback of lt_matmul.cu's cuBLASLt path; fp32 or 16-bit inputs,
// fp32 accumulation), the bias alone, and causal self-attention (kernels/ops.h semantics): cuBLAS
// GEMMs with CUBLAS_COMPUTE_32F (matmul on TF32 tensor cores when the device's MathMode says so)
// plus small kernels for the bias/GELU epilogues, the column sums of dbias and the causal softmax
// (exp_elem of kernels/elementwise.h, sums in double, as the CPU kernels). Everything is
// deterministic: cuBLAS GEMMs are bit-reproducible for a fixed handle/workspace, and our
// reductions run in a fixed order.
//
// Row-major <-> cuBLAS: a row-major [R, K] matrix with row stride ld is, read column-major, the
// [K, R] matrix X^T with leading dimension ld. So the row-major product Y = A @ B is computed as
// the column-major Y^T = B^T A^T, i.e. with the operands swapped.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"
#include "kernels/gemm_attention_plan.h"
#include "kernels/storage_types.h"

namespace zt::cuda_ops {
namespace {

using detail::cublas_int;
using detail::kWarpSize;
using detail::gemm_strided_batched;

cudaDataType_t cuda_type(DType t) {
  return t == DType::kF16 ? CUDA_R_16F : t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
}

// Column-major C[m,n] = alpha op(A) op(B) + beta C with fp32 accumulation: A, B of type `ab`
// (fp32 or 16-bit), C of type `c`; tf32 (fp32 inputs only): inputs rounded to TF32 on tensor
// cores. The compute type is per call, so the handle's math mode stays at its default
// (cublas_handle.h).
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
          int64_t k, float alpha, const void* A, int64_t lda, const void* B, int64_t ldb,
          float beta, void* C, int64_t ldc, bool tf32 = false, DType ab = DType::kF32, DType c = DType::kF32) {
  const bool fast = tf32 && ab == DType::kF32;
  ZT_CUBLAS_CHECK(cublasGemmEx(h, ta, tb, cublas_int(m, "m"), cublas_int(n, "n"), cublas_int(k, "k"), &alpha,
                               A, cuda_type(ab), cublas_int(lda, "lda"), B, cuda_type(ab),
                               cublas_int(ldb, "ldb"), &beta, C, cuda_type(c), cublas_int(ldc, "ldc"),
                               fast ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
}

// ---- matmul helpers -----------------------------------------------------------------------
// out[N,OC] += bias[OC] (broadcast over rows), out of S, bias of W (float or S): the widened sum
// rounded to S once (fp32: the plain +=).
template <typename S, typename W>
__global__ void add_bias_kernel(S* __restrict__ out, const W* __restrict__ bias, int64_t N, int64_t OC) {
  const int64_t total = N * OC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    out[i] = from_float<S>(to_float(out[i]) + to_float(bias[i % OC]));
  }
}

// The forward epilogue on an fp32 GEMM result acc [N,OC]: v = acc + bias[col]; pre = round(v);
// with kGelu also out = round(gelu(v)) (both from the one fp32 value, as cuBLASLt's epilogue).
// acc may alias pre (fp32 output): each element is read before it is written, by one thread.
template <typename TOut, typename TBias, bool kGelu>
__global__ void forward_epilogue_kernel(TOut* pre, TOut* out, const float* acc, const TBias* bias, int64_t N,
                                        int64_t OC) {
  const int64_t total = N * OC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    float v = acc[i];
    if (bias != nullptr) v += to_float(bias[i % OC]);
    pre[i] = from_float<TOut>(v);
    if constexpr (kGelu) out[i] = from_float<TOut>(gelu_forward_elem(v));
  }
}

template <bool kGelu, typename TOut>
void launch_forward_epilogue(cudaStream_t stream, TOut* pre, TOut* out, const float* acc, const void* bias,
                             DType bias_type, int64_t N, int64_t OC) {
  const unsigned grid = detail::grid_for(N * OC);
  if (bias_type == DType::kF32 || bias == nullptr) {
    forward_epilogue_kernel<TOut, float, kGelu><<<grid, detail::kElementwiseBlock, 0, stream>>>(
        pre, out, acc, static_cast<const float*>(bias), N, OC);
  } else if (bias_type == DType::kBF16) {
    forward_epilogue_kernel<TOut, BFloat16, kGelu><<<grid, detail::kElementwiseBlock, 0, stream>>>(
        pre, out, acc, static_cast<const BFloat16*>(bias), N, OC);
  } else {
    forward_epilogue_kernel<TOut, Half, kGelu><<<grid, detail::kElementwiseBlock, 0, stream>>>(
        pre, out, acc, static_cast<const Half*>(bias), N, OC);
  }
  ZT_CUDA_CHECK(cudaGetLastError());
}

template <bool kGelu>
void forward_epilogue(cudaStream_t stream, void* pre, void* out, const float* acc, const void* bias, MatmulTypes t,
                      int64_t N, int64_t OC) {
  if (t.out == DType::kF32) {
    launch_forward_epilogue<kGelu>(stream, static_cast<float*>(pre), static_cast<float*>(out), acc, bias, t.bias, N, OC);
  } else if (t.out == DType::kBF16) {
    launch_forward_epilogue<kGelu>(stream, static_cast<BFloat16*>(pre), static_cast<BFloat16*>(out), acc, bias, t.bias,
                                   N, OC);
  } else {
    launch_forward_epilogue<kGelu>(stream, static_cast<Half*>(pre), static_cast<Half*>(out), acc, bias, t.bias, N, OC);
  }
}

// dgelu on the fp32 product g [N*C]: dpre = round(gelu'(pre) * g). dpre may alias g (fp32).
template <typename T>
__global__ void dgelu_kernel(T* dpre, const float* g, const T* pre, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dpre[i] = from_float<T>(gelu_grad_elem(to_float(pre[i])) * g[i]);
}

template <typename T>
void launch_dgelu(cudaStream_t stream, void* dpre, const float* g, const void* pre, int64_t n) {
  dgelu_kernel<T><<<detail::grid_for(n), detail::kElementwiseBlock, 0, stream>>>(static_cast<T*>(dpre), g,
                                                                                 static_cast<const T*>(pre), n);
  ZT_CUDA_CHECK(cudaGetLastError());
}

// ---- attention helpers ------------------------------------------------------------------------
// One warp per row r of [rows, T] scores (t = r % T): att[r, t2] = exp(preatt - m) / l over
// t2 <= t (m the row's maximum, l the sum in double), 0 for t < t2 < the end of t's row block
// (cuda_ops.h causal_softmax); lse[r] = m + log l unless lse is null. att may be preatt (in place:
// each lane reads its elements before it writes them).
__global__ void causal_softmax_forward_kernel(float* att, const float* preatt, float* lse, int64_t rows, int64_t T,
                                              int64_t row_block) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * detail::kWarpRowsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * detail::kWarpRowsPerBlock + threadIdx.x / kWarpSize;
       r < rows; r += warps_total) {
    const int64_t t = r % T;
    const float* x = preatt + r * T;
    float* y = att + r * T;
    float m = -INFINITY;
    for (int64_t j = lane; j <= t; j += kWarpSize) m = fmaxf(m, x[j]);
    m = detail::warp_max(m);
    double s = 0.0;
    for (int64_t j = lane; j <= t; j += kWarpSize) s += exp_elem(x[j] - m);
    s = detail::warp_sum(s);
    const float inv = static_cast<float>(1.0 / s);
    const int64_t width = gemm_attention::row_width(t, T, row_block);  // the columns the row's GEMMs use
    for (int64_t j = lane; j < width; j += kWarpSize) y[j] = j <= t ? exp_elem(x[j] - m) * inv : 0.0f;
    if (lse != nullptr && lane == 0) lse[r] = m + logf(static_cast<float>(s));
  }
}

// Softmax backward per row: dpreatt[j] = att[j] (datt[j] - sum_{k<=t} att[k] datt[k]) for j <= t,
// 0 above the diagonal (datt there is unused garbage from the full GEMM).
__global__ void causal_softmax_backward_kernel(float* __restrict__ dpreatt,
                                               const float* __restrict__ att,
                                               const float* __restrict__ datt, int64_t rows,
                                               int64_t T) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * detail::kWarpRowsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * detail::kWarpRowsPerBlock + threadIdx.x / kWarpSize;
       r < rows; r += warps_total) {
    const int64_t t = r % T;
    const float* a = att + r * T;
    const float* da = datt + r * T;
    float* dp = dpreatt + r * T;
    double dot = 0.0;
    for (int64_t j = lane; j <= t; j += kWarpSize) dot += double{a[j]} * da[j];
    const float s = static_cast<float>(detail::warp_sum(dot));
    for (int64_t j = lane; j < T; j += kWarpSize) dp[j] = j <= t ? a[j] * (da[j] - s) : 0.0f;
  }
}

}  // namespace

void causal_softmax(void* stream, float* att, const float* preatt, float* lse, int64_t rows, int64_t T,
                    int64_t row_block) {
  detail::LaunchScope scope(stream);
  causal_softmax_forward_kernel<<<detail::warp_row_grid(rows), detail::kWarpRowBlock, 0, scope.stream()>>>(
      att, preatt, lse, rows, T, row_block);
  ZT_CUDA_CHECK(cudaGetLastError());
}

// ---- matmul: the plain path ---------------------------------------------------------------
size_t matmul_forward_scratch_bytes(MatmulTypes t, int64_t N, int64_t OC) {
  return t.out == DType::kF32 ? 0 : static_cast<size_t>(N * OC) * sizeof(float);
}

void matmul_forward(void* stream, void* out, const void* in, const void* weight, const void* bias, MatmulTypes t,
                    int64_t N, int64_t C, int64_t OC, bool tf32, void* scratch) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  float* acc = t.out == DType::kF32 ? static_cast<float*>(out) : static_cast<float*>(scratch);
  // out^T[OC,N] = W[OC,C] (= (W^T stored)^T) * in^T[C,N]
  gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, 1.0f, weight, C, in, C, 0.0f, acc, OC, tf32, t.in);
  if (t.out == DType::kF32 && t.bias == DType::kF32) {
    if (bias != nullptr) {
      add_bias_kernel<float, float><<<detail::grid_for(N * OC), detail::kElementwiseBlock, 0, scope.stream()>>>(
          static_cast<float*>(out), static_cast<const float*>(bias), N, OC);
      ZT_CUDA_CHECK(cudaGetLastError());
    }
    return;
  }
  forward_epilogue<false>(scope.stream(), out, nullptr, acc, bias, t, N, OC);
}

void matmul_backward(void* stream, void* din, float* dweight, float* dbias, const void* dout, const void* in,
                     const void* weight, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool overwrite_din,
                     bool tf32) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  if (din != nullptr) {
    // din^T[C,N] += W^T[C,OC] * dout^T[OC,N] (a 16-bit din: C read, added in fp32, rounded once;
    // overwrite_din: beta 0, din = the product rounded once)
    gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, 1.0f, weight, C, dout, OC, overwrite_din ? 0.0f : 1.0f, din, C, tf32,
         t.in, t.out);
  }
  if (dweight != nullptr) {
    // dweight^T[C,OC] += in^T[C,N] * dout[N,OC]
    gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, 1.0f, in, C, dout, OC, 1.0f, dweight, C, tf32, t.in);
  }
  // The two-stage column sums (bias_backward's, same bits), a 16-bit dout widened where read.
  if (dbias != nullptr) bias_backward(stream, dbias, dout, t.in, N, OC);
}

size_t matmul_gelu_forward_scratch_bytes(MatmulTypes t, int64_t N, int64_t OC) {
  return matmul_forward_scratch_bytes(t, N, OC);
}

void matmul_gelu_forward(void* stream, void* out_gelu, void* pre_gelu, const void* in, const void* weight,
                         const void* bias, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32, void* scratch) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  float* acc = t.out == DType::kF32 ? static_cast<float*>(pre_gelu) : static_cast<float*>(scratch);
  gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, 1.0f, weight, C, in, C, 0.0f, acc, OC, tf32, t.in);
  forward_epilogue<true>(scope.stream(), pre_gelu, out_gelu, acc, bias, t, N, OC);
}

size_t matmul_backward_dgelu_scratch_bytes(MatmulTypes t, int64_t N, int64_t C) {
  return matmul_forward_scratch_bytes(t, N, C);
}

void matmul_backward_dgelu(void* stream, void* dpre, float* dbias, const void* dout, const void* weight,
                           const void* pre_gelu, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32,
                           void* scratch) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  float* g = t.out == DType::kF32 ? static_cast<float*>(dpre) : static_cast<float*>(scratch);
  // g^T[C,N] = W^T[C,OC] * dout^T[OC,N]
  gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, 1.0f, weight, C, dout, OC, 0.0f, g, C, tf32, t.in);
  const int64_t n = N * C;
  if (t.out == DType::kF32) {
    launch_dgelu<float>(scope.stream(), dpre, g, pre_gelu, n);
  } else if (t.out == DType::kBF16) {
    launch_dgelu<BFloat16>(scope.stream(), dpre, g, pre_gelu, n);
  } else {
    launch_dgelu<Half>(scope.stream(), dpre, g, pre_gelu, n);
  }
  // The bias gradient: the stored dpre's column sums (ops.h), bias_backward's bits.
  if (dbias != nullptr) bias_backward(stream, dbias, dpre, t.out, N, C);
}

// ---- LM head over a padded vocabulary: V columns of logits rows of ld >= V elements (ldc = ld),
// read back with lda = ld; the padding is never touched. logits, dlogits, in, wte and din of `act`
// (16-bit: fp32 accumulation, each 16-bit output rounded once, din += read and rounded once, as
// matmul's plain path); dwte fp32. ld == V: matmul_forward/backward's plain GEMMs.
void lm_head_forward(void* stream, void* logits, const void* in, const void* wte, DType act, int64_t N, int64_t C,
                     int64_t V, int64_t ld, bool tf32) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  // logits^T[V,N] (column stride ld) = wte[V,C] (= (wte^T stored)^T) * in^T[C,N]
  gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, V, N, C, 1.0f, wte, C, in, C, 0.0f, logits, ld, tf32, act, act);
}

void lm_head_backward(void* stream, void* din, float* dwte, const void* dlogits, const void* in, const void* wte,
                      DType act, int64_t N, int64_t C, int64_t V, int64_t ld, bool tf32) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  // din^T[C,N] += wte^T[C,V] * dlogits^T[V,N]
  if (din != nullptr)
    gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, C, N, V, 1.0f, wte, C, dlogits, ld, 1.0f, din, C, tf32, act, act);
  // dwte^T[C,V] += in^T[C,N] * dlogits[N,V]
  if (dwte != nullptr)
    gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, C, V, N, 1.0f, in, C, dlogits, ld, 1.0f, dwte, C, tf32, act, DType::kF32);
}

// ---- bias alone (row-parallel layers add it after the reduction) ----------------------------
void bias_forward(void* stream, void* x, const void* bias, DType act, DType wt, int64_t N, int64_t C) {
  detail::LaunchScope scope(stream);
  zt::detail::dispatch_norm_types("bias_forward", act, wt, [&](auto* s, auto* w) {
    using S = std::remove_pointer_t<decltype(s)>;
    using W = std::remove_pointer_t<decltype(w)>;
    add_bias_kernel<S, W><<<detail::grid_for(N * C), detail::kElementwiseBlock, 0, scope.stream()>>>(
        static_cast<S*>(x), static_cast<const W*>(bias), N, C);
  });
  ZT_CUDA_CHECK(cudaGetLastError());
}

// matmul_backward's dbias reduction (detail::add_column_sums): the same bits (ops.h).
void bias_backward(void* stream, float* dbias, const void* dout, DType act, int64_t N, int64_t C) {
  detail::LaunchScope scope(stream);
  zt::detail::with_storage_type(act, "bias_backward", [&](auto tag) {
    using T = decltype(tag);
    detail::add_column_sums(scope.stream(), dbias, static_cast<const T*>(dout), N, C);
  });
}

// ---- attention ------------------------------------------------------------------------------
// Per batch element b, the NH heads form one strided batch: head h of q/k/v starts at column
// h*hs of a row of qkv (row stride 3C), so consecutive heads are hs floats apart. Batch elements
// are T*3C apart, which is not a multiple of the head stride, hence one batched GEMM per b.
void attention_forward(void* stream, float* out, float* preatt, float* att, const float* qkv,
                       int64_t B, int64_t T, int64_t C, int64_t NH) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  const int64_t hs = C / NH;
  const int64_t C3 = 3 * C;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  for (int64_t b = 0; b < B; ++b) {
    const float* q = qkv + b * T * C3;
    const float* k = q + C;
    float* pre = preatt + b * NH * T * T;
    // preatt^T[T2,T] = scale * K[T2,hs] * Q^T[hs,T]  (full T x T; the softmax masks it)
    gemm_strided_batched(h, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, scale, k, C3, hs, q, C3, hs, 0.0f,
                         pre, T, T * T, NH);
  }
  const int64_t rows = B * NH * T;
  causal_softmax(scope.stream(), att, preatt, nullptr, rows, T, T);
  for (int64_t b = 0; b < B; ++b) {
    const float* v = qkv + b * T * C3 + 2 * C;
    const float* a = att + b * NH * T * T;
    float* o = out + b * T * C;
    // out^T[hs,T] = V^T[hs,T2] * att^T[T2,T]
    gemm_strided_batched(h, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, v, C3, hs, a, T, T * T, 0.0f,
                         o, C, hs, NH);
  }
}

void attention_backward(void* stream, float* dqkv, float* dpreatt, float* datt, const float* dout,
                        const float* qkv, const float* att, int64_t B, int64_t T, int64_t C,
                        int64_t NH) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  const int64_t hs = C / NH;
  const int64_t C3 = 3 * C;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  for (int64_t b = 0; b < B; ++b) {
    const float* v = qkv + b * T * C3 + 2 * C;
    const float* a = att + b * NH * T * T;
    const float* dout_b = dout + b * T * C;
    float* dv = dqkv + b * T * C3 + 2 * C;
    float* da = datt + b * NH * T * T;
    // datt = dout @ V^T:  datt^T[T2,T] = V[T2,hs] * dout^T[hs,T]
    gemm_strided_batched(h, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 1.0f, v, C3, hs, dout_b, C, hs,
                         0.0f, da, T, T * T, NH);
    // dV += att^T @ dout:  dV^T[hs,T2] += dout^T[hs,T] * att[T,T2]
    gemm_strided_batched(h, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, dout_b, C, hs, a, T, T * T,
                         1.0f, dv, C3, hs, NH);
  }
  const int64_t rows = B * NH * T;
  causal_softmax_backward_kernel<<<detail::warp_row_grid(rows), detail::kWarpRowBlock, 0, scope.stream()>>>(
      dpreatt, att, datt, rows, T);
  ZT_CUDA_CHECK(cudaGetLastError());
  for (int64_t b = 0; b < B; ++b) {
    const float* q = qkv + b * T * C3;
    const float* k = q + C;
    const float* dp = dpreatt + b * NH * T * T;
    float* dq = dqkv + b * T * C3;
    float* dk = dq + C;
    // preatt = scale * Q K^T, so dQ += scale * dpreatt @ K:  dQ^T[hs,T] += K^T[hs,T2] dpreatt^T[T2,T]
    gemm_strided_batched(h, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, scale, k, C3, hs, dp, T, T * T,
                         1.0f, dq, C3, hs, NH);
    // dK += scale * dpreatt^T @ Q:  dK^T[hs,T2] += Q^T[hs,T] * dpreatt[T,T2]
    gemm_strided_batched(h, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, scale, q, C3, hs, dp, T, T * T,
                         1.0f, dk, C3, hs, NH);
  }
}

}  // namespace zt::cuda_ops
