// cuBLAS handles for the op launchers: one per stream, created on first use, bound to its stream
// and given its own workspace from the device pool, so that concurrent streams never share handle
// state. Includes cublas_v2.h, so only kernels/cuda/*.cu may include it.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/status.h"

namespace zt::cuda_ops::detail {

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                     int line);

// The handle for `stream`, a stream of a CUDA device of this process, called with the stream's GPU
// current (see LaunchScope). Thread-safe. Configured once: stream, pointer mode host, default math
// (true fp32, no TF32), a private workspace of Device::gemm_workspace_bytes() taken from the
// device's pool (counted by the memory plan). Handle and workspace live as long as the stream
// (a runtime/cuda StreamResource): the device destroys them with its streams, before its pool.
//
// Invariant: work on one stream is issued by one host thread at a time (stream order needs that
// anyway), so the handle is never used concurrently.
cublasHandle_t cublas_handle(cudaStream_t stream);
// The workspace of cublas_handle(stream) (made on first use): `*bytes` (>= kMinStreamWorkspace)
// bytes that our own kernels on `stream` may use as scratch between library calls, since stream
// order puts them after the previous GEMM and before the next (e.g. the column sums' partials).
constexpr size_t kMinStreamWorkspace = size_t{4} << 20;
void* stream_workspace(cudaStream_t stream, size_t* bytes);

}  // namespace zt::cuda_ops::detail

#define ZT_CUBLAS_CHECK(call)                                                                \
  do {                                                                                       \
    const cublasStatus_t zt_cublas_status_ = (call);                                         \
    if (zt_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                             \
      ::zt::cuda_ops::detail::throw_cublas_error(zt_cublas_status_, #call, __FILE__, __LINE__); \
  } while (0)
