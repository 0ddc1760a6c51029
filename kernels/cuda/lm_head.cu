// CUDA LM head over a padded vocabulary: the logits GEMM writes V columns into rows of ld >= V
// (ldc = ld), and its backward reads them with lda = ld; the padding is never touched.
#include <climits>
#include <cstdint>

#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"

namespace zt::cuda_ops {
namespace {

int to_int(int64_t v, const char* what) {
  ZT_CHECK(v >= 0 && v <= INT_MAX, "cuBLAS dimension ", what, " = ", v, " does not fit in int");
  return static_cast<int>(v);
}

// Column-major C[m,n] = alpha op(A) op(B) + beta C in fp32 (TF32 tensor cores when tf32), as
// blas_ops.cu's matmuls compute theirs, so ld == V gives matmul_forward/backward's results.
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
          const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
          bool tf32) {
  const float alpha = 1.0f;
  ZT_CUBLAS_CHECK(cublasGemmEx(h, ta, tb, to_int(m, "m"), to_int(n, "n"), to_int(k, "k"), &alpha, A, CUDA_R_32F,
                               to_int(lda, "lda"), B, CUDA_R_32F, to_int(ldb, "ldb"), &beta, C, CUDA_R_32F,
                               to_int(ldc, "ldc"), tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void lm_head_forward(void* stream, float* logits, const float* in, const float* wte, int64_t N, int64_t C,
                     int64_t V, int64_t ld, bool tf32) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  // logits^T[V,N] (column stride ld) = wte[V,C] (= (wte^T stored)^T) * in^T[C,N]
  gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, V, N, C, wte, C, in, C, 0.0f, logits, ld, tf32);
}

void lm_head_backward(void* stream, float* din, float* dwte, const float* dlogits, const float* in,
                      const float* wte, int64_t N, int64_t C, int64_t V, int64_t ld, bool tf32) {
  detail::LaunchScope scope(stream);
  cublasHandle_t h = detail::cublas_handle(scope.stream());
  // din^T[C,N] += wte^T[C,V] * dlogits^T[V,N]
  if (din != nullptr) gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, C, N, V, wte, C, dlogits, ld, 1.0f, din, C, tf32);
  // dwte^T[C,V] += in^T[C,N] * dlogits[N,V]
  if (dwte != nullptr) gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, C, V, N, in, C, dlogits, ld, 1.0f, dwte, C, tf32);
}

}  // namespace zt::cuda_ops
