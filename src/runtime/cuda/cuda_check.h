// ZT_CUDA_CHECK and the device guard: the two helpers every CUDA call site uses. Includes
// cuda_runtime.h, so only src/runtime/cuda/*.cc and kernels/cuda/*.cu may include this header.
#pragma once

#include <cuda_runtime.h>

#include "core/status.h"

namespace zt::cuda::detail {

// Throws zt::Error(kDevice) naming the call, the current device and CUDA's own words. Clears the
// runtime's last-error slot first, so a non-sticky error is not reported a second time by the
// cudaGetLastError() that follows a later kernel launch.
[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file,
                                          int line) {
  (void)cudaGetLastError();
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    device = -1;
    (void)cudaGetLastError();
  }
  ::zt::detail::throw_error(
      ::zt::ErrorKind::kDevice, file, line,
      ::zt::detail::concat("CUDA call ", call, " failed on GPU ", device, ": ",
                           cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

}  // namespace zt::cuda::detail

#define ZT_CUDA_CHECK(call)                                                          \
  do {                                                                               \
    const cudaError_t zt_cuda_err_ = (call);                                         \
    if (zt_cuda_err_ != cudaSuccess) [[unlikely]]                                    \
      ::zt::cuda::detail::throw_cuda_error(zt_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

namespace zt::cuda {

// Makes `ordinal` the calling thread's current device for the guard's lifetime and restores the
// previous one afterwards. CUDA binds streams, events, allocations and kernel launches to the
// current device, so every device-bound call runs under one of these.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) : ordinal_(ordinal) {
    ZT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != ordinal_) ZT_CUDA_CHECK(cudaSetDevice(ordinal_));
  }
  ~DeviceGuard() {
    // Never throws: a failure to switch back leaves the thread on ordinal_, which later guards
    // correct anyway.
    if (previous_ != ordinal_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int ordinal_;
  int previous_ = 0;
};

}  // namespace zt::cuda
