// The runtime: parses a device selection (--devices), creates the logical devices of one backend,
// and falls back from CUDA to the CPU backend when no usable GPU exists ("all" only).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/device.h"

namespace zt {

// A parsed --devices value. Grammar (parsed only by parse_device_spec):
//   all                 every GPU, or the default simulated CPU devices when there is none
//   cpu | cpu:N         N simulated devices (default: $ZT_CPU_DEVICES, else 2); 1 <= N <= 64
//   cuda                every GPU
//   cuda:LIST           LIST = ITEM[,ITEM...], ITEM = ORDINAL or ORDINALxCOUNT; e.g. cuda:0,1,3
//                       or cuda:0x4 (four logical devices on GPU 0). An ordinal appears once.
struct DeviceSpec {
  enum class Kind { kAll, kCpu, kCuda };
  Kind kind = Kind::kAll;
  int cpu_count = 0;             // kCpu: 0 = default
  std::vector<int> cuda_ordinals;  // kCuda: physical ordinal of each logical device; empty = every GPU
  std::string text;              // as given, for messages
};

DeviceSpec parse_device_spec(std::string_view text);
// $ZT_CPU_DEVICES if set (validated), else 2.
int default_cpu_device_count();

struct CpuDeviceOptions {
  size_t memory_bytes = 0;  // capacity of each simulated device's pool; 0 = unlimited
};

// What the CUDA runtime reports; `usable` false carries a one-line reason.
struct CudaAvailability {
  bool compiled = false;  // built with the CUDA backend
  bool usable = false;
  int device_count = 0;
  std::string reason;
};
CudaAvailability cuda_availability();
// Throws Runtime::create's one sentence when spec names GPUs ("cuda", "cuda:0x4") and avail says
// none is usable here ("all" falls back to simulated devices instead). The CLI's shape checks call
// it first, so a run that names a GPU on a machine without one is told that, not something about
// the simulated devices' count.
void require_usable_gpus(const DeviceSpec& spec, const CudaAvailability& avail);

// Start/stop the CUDA profiler's capture (cudaProfilerStart/Stop; nsys --capture-range=
// cudaProfilerApi records only between them). No-ops in a build without CUDA; failures (no
// driver, no profiler attached) are ignored. Call only when the CUDA backend is in use.
void profiler_start();
void profiler_stop();

class Runtime {
 public:
  // `observer` (may be null) sees every device's stream work (Device::set_task_observer); it must
  // outlive the runtime, or be replaced with set_observer() first.
  static std::unique_ptr<Runtime> create(const DeviceSpec& spec, const CpuDeviceOptions& cpu = {},
                                         TaskObserver* observer = nullptr);
  // Exactly the CPU backend with n devices (tests).
  static std::unique_ptr<Runtime> create_cpu(int n, const CpuDeviceOptions& cpu = {},
                                             TaskObserver* observer = nullptr);
  ~Runtime();

  // Installs `observer` (nullptr: none) on every device. Call while no work is in flight (the
  // previous observer may still be called for work submitted before).
  void set_observer(TaskObserver* observer);
  TaskObserver* observer() const { return observer_; }

  int size() const { return static_cast<int>(devices_.size()); }
  Device& device(int i) { return *devices_.at(static_cast<size_t>(i)); }
  Backend backend() const { return backend_; }
  // Non-empty when "all" was asked for but no usable GPU exists: the one line saying why.
  const std::string& fallback_note() const { return fallback_note_; }
  void synchronize();

 private:
  Runtime() = default;
  Backend backend_ = Backend::kCpu;
  std::vector<std::unique_ptr<Device>> devices_;
  std::string fallback_note_;
  TaskObserver* observer_ = nullptr;
};

}  // namespace zt
