// cuBLAS handles for the op launchers: one per stream, created on first use, bound to its stream
// and given its own workspace from the device pool, so that concurrent streams never share handle
// state; the stream's cuBLASLt handle and algorithm cache live beside it and share the workspace.
// Includes cublas_v2.h and cublasLt.h, so only kernels/cuda/*.cu may include it.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>

#include "core/status.h"

namespace zt::cuda_ops::detail {

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                     int line);

// The handle for `stream`, a stream of a CUDA device of this process, called with the stream's GPU
// current (see LaunchScope). Thread-safe. Configured once: stream, pointer mode host, default math
// (true fp32, no TF32) without reduced-precision reductions, a private workspace of
// Device::gemm_workspace_bytes() taken from the device's pool (counted by the memory plan). Handle
// and workspace live as long as the stream (a runtime/cuda StreamResource): the device destroys
// them with its streams, before its pool.
//
// Invariant: work on one stream is issued by one host thread at a time (stream order needs that
// anyway), so the handle is never used concurrently.
cublasHandle_t cublas_handle(cudaStream_t stream);
// The workspace of cublas_handle(stream) (made on first use): `*bytes` (>= kMinStreamWorkspace)
// bytes that our own kernels on `stream` may use as scratch between library calls, since stream
// order puts them after the previous GEMM and before the next (e.g. the column sums' partials).
constexpr size_t kMinStreamWorkspace = size_t{4} << 20;
void* stream_workspace(cudaStream_t stream, size_t* bytes);

// What cuBLASLt needs on a stream (kernels/cuda/lt_matmul.cu). The workspace is the cuBLAS handle's
// (one pool block per stream, counted by the memory plan): work on one stream runs in order, so
// cuBLAS and cuBLASLt calls never use it at once. `lt` is nullptr when the environment says
// ZT_CUBLASLT=off (read when the stream's handles are made): every GEMM then takes the plain
// cuBLAS path, which is how tests compare the two.
// lt_algos: the heuristic's answer per problem (lt_matmul.cu builds the key: shape, transposes,
// leading dimensions, dtypes, epilogue, math mode, pointer alignments); `usable` false records a
// refusal, so a refused shape is not asked again either. Same threading rule as the handle.
struct LtAlgo {
  bool usable = false;
  cublasLtMatmulAlgo_t algo{};
};
using LtKey = std::array<int64_t, 24>;
// bias_scratch: the last kLtBiasScratchBytes of the same pool block, where cuBLASLt's bias-gradient
// epilogues write before the sum is added into the caller's gradient; `workspace_bytes` (what
// cuBLASLt may use) stops before it. Carved once, so a GEMM allocates nothing per call (a stream
// capture refuses pool allocations, runtime/stream.h).
constexpr size_t kLtBiasScratchBytes = 256 << 10;
struct GemmContext {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::map<LtKey, LtAlgo>* lt_algos = nullptr;
  float* bias_scratch = nullptr;
  size_t bias_scratch_bytes = 0;
};
static_assert(kMinStreamWorkspace >= 2 * kLtBiasScratchBytes, "the bias scratch is the workspace's tail");
GemmContext gemm_context(cudaStream_t stream);

// v as one of cuBLAS's int dimensions; zt::Error(kInternal) where it does not fit.
int cublas_int(int64_t v, const char* what);
// Column-major, fp32: C_i[m,n] = alpha op(A_i) op(B_i) + beta C_i for i < batch, X_i = X + i *
// stride_x; compute type CUBLAS_COMPUTE_32F (true fp32), or _FAST_TF32 with tf32 (tensor cores,
// inputs rounded to TF32). beta 0 never reads C.
void gemm_strided_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
                          int64_t k, float alpha, const float* A, int64_t lda, int64_t stride_a, const float* B,
                          int64_t ldb, int64_t stride_b, float beta, float* C, int64_t ldc, int64_t stride_c,
                          int64_t batch, bool tf32 = false);

}  // namespace zt::cuda_ops::detail

#define ZT_CUBLAS_CHECK(call)                                                                \
  do {                                                                                       \
    const cublasStatus_t zt_cublas_status_ = (call);                                         \
    if (zt_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                             \
      ::zt::cuda_ops::detail::throw_cublas_error(zt_cublas_status_, #call, __FILE__, __LINE__); \
  } while (0)
