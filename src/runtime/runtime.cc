// Runtime creation: one backend per process run, CUDA when asked for (or "all" with a GPU),
// the simulated CPU devices otherwise.
#include "runtime/runtime.h"

#include <atomic>
#include <memory>

#include "core/capture_rules.h"
#include "core/status.h"
#include "memory/pool_stream.h"
#include "runtime/cpu/cpu_device.h"
#if ZT_WITH_CUDA
#include "runtime/cuda/cuda_backend.h"
#endif

namespace zt {

CudaAvailability cuda_availability() {
#if ZT_WITH_CUDA
  return cuda::query_availability();
#else
  CudaAvailability a;
  a.reason = "this build has no CUDA backend (configured with ZT_CUDA=OFF, or CMake found no nvcc: with the CUDA "
             "toolkit at /usr/local/cuda or nvcc on the PATH, configure again, e.g. cmake --preset release)";
  return a;
#endif
}

void profiler_start() {
#if ZT_WITH_CUDA
  cuda::profiler_start();
#endif
}

void profiler_stop() {
#if ZT_WITH_CUDA
  cuda::profiler_stop();
#endif
}

void Device::inject_fault(FaultKind kind) {
  ZT_THROW(ErrorKind::kInvalidArgument, name(), " cannot inject a fault (", fault_kind_name(kind),
           "): its backend does not support fault injection");
}

void Device::abandon(const std::string& /*why*/) {}

PinnedHostBuffer Device::alloc_host_pinned(size_t bytes) {
  if (bytes == 0) return {};
  // As the CUDA backend's cudaHostAlloc, refused on a thread with a capture in progress.
  if (this_thread_captures()) [[unlikely]]
    refuse_on_capturing_thread(CaptureRule::kHostPinnedAllocation, name() + ", " + std::to_string(bytes) + " bytes");
  // Shared by every CPU device's buffers; a buffer keeps it alive past the runtime.
  static const std::shared_ptr<RawAllocator> host = std::make_shared<HostRawAllocator>();
  void* p = host->allocate(bytes);
  if (p == nullptr)
    ZT_THROW(ErrorKind::kOutOfMemory, name(), ": the host could not provide ", bytes,
             " bytes for a device-to-host copy buffer; free host memory or copy in smaller pieces");
  return PinnedHostBuffer(p, bytes, host, /*pinned=*/false);
}

void Runtime::set_observer(TaskObserver* observer) {
  observer_ = observer;
  for (auto& d : devices_) d->set_task_observer(observer);
}

std::unique_ptr<Runtime> Runtime::create_cpu(int n, const CpuDeviceOptions& cpu, TaskObserver* observer) {
  ZT_REQUIRE(n >= 1, "the CPU backend needs at least one device, got ", n);
  std::unique_ptr<Runtime> rt(new Runtime());
  rt->backend_ = Backend::kCpu;
  for (int i = 0; i < n; ++i) rt->devices_.push_back(std::make_unique<cpu::CpuDevice>(i, cpu.memory_bytes));
  rt->set_observer(observer);
  return rt;
}

void require_usable_gpus(const DeviceSpec& spec, const CudaAvailability& avail) {
  ZT_REQUIRE(avail.usable || spec.kind != DeviceSpec::Kind::kCuda, "--devices ", spec.text,
             " asks for GPUs, but no usable GPU was found (", avail.reason,
             "); use --devices cpu:N for simulated devices");
}

std::unique_ptr<Runtime> Runtime::create(const DeviceSpec& spec, const CpuDeviceOptions& cpu, TaskObserver* observer) {
  switch (spec.kind) {
    case DeviceSpec::Kind::kCpu:
      return create_cpu(spec.cpu_count ? spec.cpu_count : default_cpu_device_count(), cpu, observer);
    case DeviceSpec::Kind::kAll:
    case DeviceSpec::Kind::kCuda: {
      const CudaAvailability avail = cuda_availability();
      if (!avail.usable) {
        require_usable_gpus(spec, avail);
        const int n = default_cpu_device_count();
        auto rt = create_cpu(n, cpu, observer);
        rt->fallback_note_ = "no usable GPU (" + avail.reason + "); using " + std::to_string(n) +
                             " simulated CPU devices";
        return rt;
      }
#if ZT_WITH_CUDA
      std::vector<int> ordinals = spec.cuda_ordinals;
      if (ordinals.empty())
        for (int i = 0; i < avail.device_count; ++i) ordinals.push_back(i);
      for (int o : ordinals)
        ZT_REQUIRE(o < avail.device_count, "--devices ", spec.text, " names GPU ", o, ", but this machine has ",
                   avail.device_count, " GPU", avail.device_count == 1 ? "" : "s", " (0..",
                   avail.device_count - 1, ")");
      std::unique_ptr<Runtime> rt(new Runtime());
      rt->backend_ = Backend::kCuda;
      rt->devices_ = cuda::create_devices(ordinals);
      rt->set_observer(observer);
      return rt;
#endif
    }
  }
  ZT_THROW(ErrorKind::kInternal, "unhandled device selection ", spec.text);
}

Runtime::~Runtime() {
  // A device hung on purpose would block the drain below forever (and every device waiting on
  // its events with it): give up on it first.
  for (auto& d : devices_) {
    if (d->hang_injected()) d->abandon("the runtime was destroyed while the device hung (injected fault)");
  }
  // Drain every device before any is destroyed: a stream may wait on another device's event.
  for (auto& d : devices_) {
    try {
      d->synchronize();
    } catch (const Error&) {
      // A failed device was already reported to whoever synchronized it; teardown goes on.
    }
  }
  devices_.clear();
}

void Runtime::synchronize() {
  for (auto& d : devices_) d->synchronize();
}

}  // namespace zt
