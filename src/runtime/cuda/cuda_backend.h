// Entry points of the CUDA backend that the rest of the runtime may call. This header includes
// no CUDA header; only src/runtime/cuda/*.cc and kernels/cuda/*.cu do.
#pragma once

#include <cstddef>
#include <array>
#include <memory>
#include <vector>

#include "memory/raw_allocator.h"
#include "runtime/device.h"
#include "runtime/runtime.h"

namespace zt::cuda {

// Queries the driver/runtime without failing: no GPU, no driver, too old a driver -> usable=false.
CudaAvailability query_availability();

// cudaProfilerStart / cudaProfilerStop; errors are ignored (the profiler is optional).
void profiler_start();
void profiler_stop();

// One logical device per entry of `ordinals` (repeats allowed: logical devices sharing a GPU).
// Enables peer access between distinct physical GPUs where cudaDeviceCanAccessPeer allows.
std::vector<std::unique_ptr<Device>> create_devices(const std::vector<int>& ordinals);

// The CUDA side of one launch of the op table, around the launcher call: the checked downcast of
// `s` to a CUDA stream (another backend's stream is a zt::Error(kInternal) naming `name` and the
// stream's device) and, while the device has a TaskObserver, a pair of timing events around the
// work enqueued in this scope, reported as task `name` (a string literal) once resolved (see
// cuda_device.cc). Nested scopes on one host thread report only the outermost.
class TaskSpan {
 public:
  TaskSpan(Stream& s, const char* name);
  ~TaskSpan();
  TaskSpan(const TaskSpan&) = delete;
  TaskSpan& operator=(const TaskSpan&) = delete;
  void* native() const;  // the cudaStream_t

 private:
  void* stream_ = nullptr;  // the CudaStream
  bool open_ = false;
};

// The GPU ordinal of the stream whose cudaStream_t is `native` (a stream of a live CUDA device),
// from the registry its device filled when it created the stream: no CUDA call, so launchers may
// ask it inside a stream capture (CUDA refuses cudaStreamGetDevice on a capturing stream,
// core/capture_rules.h). A cudaStream_t of no CUDA device of this process is zt::Error(kInternal).
int stream_ordinal(void* native);
// Whether that stream is capturing (Stream::capturing, from the same registry: no CUDA call).
bool stream_capturing(void* native);

// A library's per-stream state (the cuBLAS handle with its workspace from the device pool, the
// blocks of kernels/cuda/stream_blocks.h): made on first use, destroyed with its stream, before the device's
// pool (it may hold pool memory), with the stream drained first, so its destructor may free pool
// blocks and destroy library handles.
class StreamResource {
 public:
  virtual ~StreamResource() = default;
};
enum StreamResourceSlot : int { kCublasResource = 0, kAttentionResource, kMatmulScratchResource, kNumStreamResources };
using StreamResourceFactory = std::unique_ptr<StreamResource> (*)(Stream& stream);
// The resource in `slot` of the stream whose cudaStream_t is `native` (a stream of a live CUDA
// device), made by make(stream) the first time. Thread-safe; one resource per (stream, slot). A
// cudaStream_t of no CUDA device of this process is zt::Error(kInternal).
StreamResource& stream_resource(void* native, StreamResourceSlot slot, StreamResourceFactory make);

// cudaMalloc/cudaFree on GPU `ordinal`; allocate() returns nullptr when the GPU is out of memory
// or when `capacity_bytes` (0 = unlimited) would be exceeded.
std::unique_ptr<RawAllocator> make_device_raw_allocator(int ordinal, size_t capacity_bytes = 0);
// Page-locked host memory (cudaHostAlloc, portable to every GPU); for staging and async copies.
// `ordinal` >= 0: allocated and freed with that GPU current (a GPU of the run), so that a thread
// that has used no GPU yet does not make the runtime initialize GPU 0's context.
std::unique_ptr<RawAllocator> make_pinned_host_raw_allocator(int ordinal = -1);

// The GPU ordinal whose memory `ptr` points into, or -1 for host memory (pinned or not).
int pointer_device(const void* ptr);

// How Stream::copy_peer moves bytes between two logical devices. kAuto picks per pair: a
// device-to-device copy when both live on one GPU, cudaMemcpyPeerAsync when peer access is
// enabled, else staging through pinned host memory. Tests and benchmarks force the other paths
// so that all three run even on a machine with one GPU. Process-wide.
enum class PeerCopyPath { kAuto, kPeer, kStaged };
void set_peer_copy_path(PeerCopyPath path);
PeerCopyPath peer_copy_path();

}  // namespace zt::cuda
