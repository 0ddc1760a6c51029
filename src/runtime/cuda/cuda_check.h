// ZT_CUDA_CHECK and the device guard: the two helpers every CUDA call site uses. Includes
// cuda_runtime.h, so only src/runtime/cuda/*.cc and kernels/cuda/*.cu may include this header.
#pragma once

#include <cuda.h>  // CUresult/CUdevice for the driver entry points below (no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

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
namespace detail {

// Whether GPU `ordinal`'s primary context is active in this process (some thread has used the GPU).
// Asked through the driver entry point that the runtime hands out, so nothing links libcuda; true
// when the driver cannot say (the guards then restore as they always did). An active context stays
// active (ZeroTrain never calls cudaDeviceReset), so the answer is remembered: after the first
// switches the guards ask the driver nothing, inside stream captures included.
inline bool primary_context_active(int ordinal) {
  static std::atomic<uint64_t> known_active{0};
  const uint64_t bit = ordinal >= 0 && ordinal < 64 ? uint64_t{1} << ordinal : 0;
  if (bit != 0 && (known_active.load(std::memory_order_relaxed) & bit) != 0) return true;
  struct Entry {
    PFN_cuDeviceGet_v2000 device_get = nullptr;
    PFN_cuDevicePrimaryCtxGetState_v7000 get_state = nullptr;
  };
  static const Entry entry = [] {
    Entry e;
    void* get = nullptr;
    void* state = nullptr;
    cudaDriverEntryPointQueryResult found_get{}, found_state{};
    if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &get, 12000, cudaEnableDefault, &found_get) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &state, 12000, cudaEnableDefault,
                                         &found_state) == cudaSuccess &&
        found_get == cudaDriverEntryPointSuccess && found_state == cudaDriverEntryPointSuccess) {
      e.device_get = reinterpret_cast<PFN_cuDeviceGet_v2000>(get);
      e.get_state = reinterpret_cast<PFN_cuDevicePrimaryCtxGetState_v7000>(state);
    } else {
      (void)cudaGetLastError();
    }
    return e;
  }();
  if (entry.device_get == nullptr || entry.get_state == nullptr) return true;
  CUdevice device = 0;
  unsigned int flags = 0;
  int active = 0;
  if (entry.device_get(&device, ordinal) != CUDA_SUCCESS || entry.get_state(device, &flags, &active) != CUDA_SUCCESS)
    return true;
  if (active != 0) known_active.fetch_or(bit, std::memory_order_relaxed);
  return active != 0;
}

}  // namespace detail

// Makes `ordinal` the calling thread's current device for the guard's lifetime and restores the
// previous one afterwards. CUDA binds streams, events, allocations and kernel launches to the
// current device, so every device-bound call runs under one of these.
//
// Except where the previous device's primary context is not active: a thread's current device is
// GPU 0 until something sets it, and since CUDA 12 cudaSetDevice initializes the primary context
// of the device it selects ("This function will also immediately initialize the runtime state on
// the primary context"), so restoring that default would create a context on GPU 0, with its
// hundreds of MiB of GPU memory, in a run that never selected GPU 0 (--devices cuda:1, or cuda:4,5,6,7
// beside another job on 0-3; a GPU in exclusive-process mode held by another process refuses it).
// The thread then stays on `ordinal`; nothing in ZeroTrain depends on a thread's current device
// outside a guard. (PyTorch's MaybeSetDevice/ExchangeDevice exist for the same reason.)
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) : ordinal_(ordinal) {
    ZT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != ordinal_) {
      restore_ = detail::primary_context_active(previous_);
      ZT_CUDA_CHECK(cudaSetDevice(ordinal_));
    }
  }
  ~DeviceGuard() {
    // Never throws: a failure to switch back leaves the thread on ordinal_, which later guards
    // correct anyway.
    if (restore_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int ordinal_;
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace zt::cuda
