// cuBLAS handles for the op launchers: one per (GPU, stream), created on first use, bound to its
// stream and given its own workspace, so that concurrent streams never share handle state.
// Includes cublas_v2.h, so only kernels/cuda/*.cu may include it.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/status.h"

namespace zt::cuda_ops::detail {

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                     int line);

// The handle for `stream` on GPU `ordinal` (the caller's current device, see LaunchScope).
// Thread-safe. Handles live until the process exits (never destroyed: destroying them during
// static destruction would race the CUDA runtime's own teardown). A handle is configured once:
// stream, pointer mode host, default math (true fp32, no TF32), a private workspace.
//
// Invariant: work on one stream is issued by one host thread at a time (stream order needs that
// anyway), so the handle is never used concurrently. A destroyed stream's handle is reused by a
// new stream that CUDA happens to give the same address on the same GPU: the handle stores only
// that address, so it then drives the new stream, which is correct.
cublasHandle_t cublas_handle(cudaStream_t stream, int ordinal);

}  // namespace zt::cuda_ops::detail

#define ZT_CUBLAS_CHECK(call)                                                                \
  do {                                                                                       \
    const cublasStatus_t zt_cublas_status_ = (call);                                         \
    if (zt_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                             \
      ::zt::cuda_ops::detail::throw_cublas_error(zt_cublas_status_, #call, __FILE__, __LINE__); \
  } while (0)
