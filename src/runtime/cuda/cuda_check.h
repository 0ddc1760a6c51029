// ZT_CUDA_CHECK and the device guard: the two helpers every CUDA call site uses. Includes
// cuda_runtime.h, so only src/runtime/cuda/*.cc and kernels/cuda/*.cu may include this header.
#pragma once

#include <cuda.h>  // CUresult/CUdevice for the driver entry points below (no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "core/status.h"

namespace zt::cuda::detail {

// CUDA's sticky errors: driver_types.h says of each "This leaves the process in an inconsistent
// state and any further CUDA work will return the same error. To continue using CUDA, the process
// must be terminated and relaunched" (cudaErrorAssert: "The device cannot be used again"). The
// error lives in the GPU's primary context, which every logical device on that GPU shares
// (--devices cuda:0x2), so the GPU is lost, not one logical device. Out of memory, launch
// configuration and argument errors are not sticky: the call failed, the context is fine.
inline bool is_sticky_error(cudaError_t err) noexcept {
  switch (err) {
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
#if CUDART_VERSION >= 12080
    case cudaErrorTensorMemoryLeak:
#endif
      return true;
    default:
      return false;
  }
}

// The GPUs of this process that reported a sticky error, with the first one's words. Process-wide
// and never destroyed (destructors during static destruction ask it): every logical device on a
// lost GPU reports failed() (so recovery drops them all), and no new device is created on it.
class LostGpus {
 public:
  void mark(int ordinal, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    lost_.emplace(ordinal, why);  // the first error stays
    any_.store(true, std::memory_order_release);
  }
  bool lost(int ordinal) const {
    if (!any_.load(std::memory_order_acquire)) [[likely]]
      return false;
    std::lock_guard<std::mutex> lock(mu_);
    return lost_.count(ordinal) != 0;
  }
  std::string why(int ordinal) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = lost_.find(ordinal);
    return it == lost_.end() ? std::string() : it->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<int, std::string> lost_;
  std::atomic<bool> any_{false};
};
inline LostGpus& lost_gpus() {
  static LostGpus* gpus = new LostGpus();
  return *gpus;
}

// Throws zt::Error(kDevice) naming the call, the GPU (`ordinal`, or the current device when -1)
// and CUDA's own words; a sticky error also marks the GPU lost and says so. Clears the runtime's
// last-error slot first, so a non-sticky error is not reported a second time by the
// cudaGetLastError() that follows a later kernel launch.
[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file,
                                          int line, int ordinal = -1) {
  (void)cudaGetLastError();
  int device = ordinal;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    device = -1;
    (void)cudaGetLastError();
  }
  std::string message = ::zt::detail::concat("CUDA call ", call, " failed on GPU ", device, ": ",
                                             cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  if (is_sticky_error(err) && device >= 0) {
    lost_gpus().mark(device, message);
    message += ::zt::detail::concat("; the error is sticky: CUDA cannot use GPU ", device,
                                    " again in this process, so every logical device on it is lost");
  }
  ::zt::detail::throw_error(::zt::ErrorKind::kDevice, file, line, message);
}

}  // namespace zt::cuda::detail

#define ZT_CUDA_CHECK(call)                                                          \
  do {                                                                               \
    const cudaError_t zt_cuda_err_ = (call);                                         \
    if (zt_cuda_err_ != cudaSuccess) [[unlikely]]                                    \
      ::zt::cuda::detail::throw_cuda_error(zt_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

// ZT_CUDA_CHECK for a call about GPU `ordinal` that may run while another GPU is current (events,
// a device switch): the error names, and a sticky one marks, that GPU.
#define ZT_CUDA_CHECK_ON(call, ordinal)                                                         \
  do {                                                                                          \
    const cudaError_t zt_cuda_err_ = (call);                                                    \
    if (zt_cuda_err_ != cudaSuccess) [[unlikely]]                                               \
      ::zt::cuda::detail::throw_cuda_error(zt_cuda_err_, #call, __FILE__, __LINE__, (ordinal)); \
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
      ZT_CUDA_CHECK_ON(cudaSetDevice(ordinal_), ordinal_);
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
