// CUDA backend: logical devices over real GPUs (streams, events, memory pools, peer copies), and
// the availability probe that lets a binary on a machine without GPU or driver say why.
//
// Design notes:
//  - Several logical devices may share one physical GPU (--devices cuda:0x4). Each gets its own
//    streams and its own pool; they share the GPU's memory, so each pool is capped at its share
//    (total_memory()), which keeps out-of-memory behaviour per logical device predictable.
//  - CUDA binds streams, events, allocations and launches to the current device: every
//    device-bound call runs under a DeviceGuard for the physical ordinal.
//  - Host functions (cudaLaunchHostFunc) run on a CUDA-owned thread and must not call CUDA. An
//    exception thrown inside one is recorded on its stream; the stream's next synchronize() or
//    query() rethrows it as zt::Error(kDevice), and keeps doing so (sticky, like a CUDA error).
//  - copy_peer takes one of three routes: same GPU -> device-to-device cudaMemcpyAsync; peer
//    access enabled -> cudaMemcpyPeerAsync; otherwise through pinned host staging memory, both
//    legs on the source stream. The staging block is freed right after the copies are enqueued:
//    only stream work touches it, so the pool's stream rules (reuse on the same stream at once,
//    on other streams only after an event) make reuse safe.
//  - Library state per stream (the cuBLAS handle and its workspace, a block of the device pool sized
//    by gemm_workspace_bytes()) hangs off the CudaStream as a StreamResource, found from the
//    launchers' cudaStream_t through a registry; the device destroys it after draining its streams
//    and before its pool, so a recovery rebuild returns the workspaces instead of leaking them.
//  - Destructors never throw: after a sticky CUDA error, or while the static runtime unloads at
//    exit, every call fails, and a failed device must still be destroyable.
//  - Injected faults live in this wrapper, never in the CUDA context (a real sticky error would
//    poison every logical device sharing the GPU, and the process could not recover). kError marks
//    the device failed: every synchronization point of every stream of it throws (synchronize_for
//    only once the streams drained, as synchronize(): a caller tearing down after the failure, as
//    World's destructor, relies on the queue being empty); the GPU itself is fine and kernels and
//    copies enqueued later still run. kHang enqueues on every stream of the device a host function
//    that blocks until abandon() (a HangGate): the streams really stop answering, and so do events
//    recorded after it and other streams waiting on those. After abandon(), the streams run the
//    kernels and copies queued behind the gate (for real: the data is garbage, the device being
//    failed), and synchronize()/query() of the device throw at once without calling CUDA, so that
//    a host thread is never blocked by a truly stuck GPU it has given up on.
//  - Host functions of a failed device (injected error, abandonment, an earlier host function's
//    exception, a CUDA error) are skipped, as CUDA skips cudaLaunchHostFunc work after a sticky
//    context error and as the CPU backend skips every later operation: a recovery frees what their
//    captures point to (the offloaded optimizer's rank, a workspace) without waiting for an
//    abandoned device, whose released work then runs while the owners are being destroyed.
//  - CUDA may run the host functions of one context on a single thread: a parked HangGate can
//    delay host functions of other logical devices sharing the GPU until abandon().
//  - Task observer (runtime/observer.h): while a device has one, every op launched through the op
//    table (TaskSpan) and every copy, memset and host function is bracketed by a pair of timing
//    events recorded on its stream. A stream's spans are resolved in submission order when it is
//    next synchronized (or queried idle): the GPU times are cudaEventElapsedTime from an anchor
//    event of the stream whose host time was read right after cudaEventSynchronize returned on
//    it, so host times are exact up to that latency (microseconds). The anchor is renewed after a
//    second, while the stream is idle, so float milliseconds never lose precision. Nested spans
//    (a cast that is a copy) report only the outermost.
//  - Stream capture (runtime/stream.h, core/capture_rules.h): the rules, CUDA's and ours, are
//    checked before CUDA sees a call, from one table shared with the CPU backend, so the reason
//    and the CUDA error it names are the same on both; a CUDA error inside a capture fails the
//    capture, not the device (nothing ran). Launchers find their stream's GPU through the
//    registry (stream_ordinal), never by asking CUDA: cudaStreamGetDevice is refused on a
//    capturing stream (what kept the first GPU run from capturing). Host functions captured into a
//    graph are owned by the graph (every replay runs them), and no observer span is recorded
//    while a stream captures (its events would never complete for the host).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include <cuda_profiler_api.h>

#include "core/capture_rules.h"
#include "memory/caching_allocator.h"
#include "memory/pool_stream.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/gemm_workspace.h"

namespace zt::cuda {
namespace {

// The oldest GPU the kernels are built for, as major * 10 + minor: the lowest of ZT_CUDA_ARCHS
// (src/CMakeLists.txt), sm_80 by default, sm_90 in the `gpu` preset.
#ifndef ZT_CUDA_MIN_ARCH
#define ZT_CUDA_MIN_ARCH 80
#endif
constexpr int kMinComputeCapability = ZT_CUDA_MIN_ARCH;

// Chunk size of a staged peer copy: one pinned block of at most this size is reused by every
// chunk (safe: both legs of every chunk are ordered on one stream).
constexpr size_t kStagingChunkBytes = size_t{16} << 20;

std::atomic<PeerCopyPath> g_peer_copy_path{PeerCopyPath::kAuto};

// Peer access is process-wide state of the primary contexts; remember which directions are on.
// Never destroyed, so it is usable from destructors that run during static destruction.
class PeerTable {
 public:
  bool enabled(int from, int to) {
    std::lock_guard<std::mutex> lock(mu_);
    return enabled_.count({from, to}) != 0;
  }
  void mark(int from, int to) {
    std::lock_guard<std::mutex> lock(mu_);
    enabled_.insert({from, to});
  }

 private:
  std::mutex mu_;
  std::set<std::pair<int, int>> enabled_;
};
PeerTable& peer_table() {
  static PeerTable* table = new PeerTable();
  return *table;
}

// DeviceGuard for destructors and deallocation paths: switches when it can, never throws.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (previous_ == ordinal) return;
    // As DeviceGuard: never switch back to a GPU whose context restoring would create.
    const bool restore = detail::primary_context_active(previous_);
    if (cudaSetDevice(ordinal) == cudaSuccess) {
      switched_ = restore;
    } else {
      (void)cudaGetLastError();
    }
  }
  ~QuietDeviceGuard() {
    if (switched_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Ignores an error from a cleanup call (see the design notes), clearing it so it is not
// reported by an unrelated later check.
void ignore_error(cudaError_t err) {
  if (err != cudaSuccess) (void)cudaGetLastError();
}

// What an injected hang parks the streams of a device on; released by abandon() (or destruction).
class HangGate {
 public:
  void block() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return released_; });
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
};

void CUDART_CB run_hang_gate(void* user_data) {
  // Runs on CUDA's host-function thread; calls no CUDA.
  std::unique_ptr<std::shared_ptr<HangGate>> gate(static_cast<std::shared_ptr<HangGate>*>(user_data));
  (*gate)->block();
}

// Polling interval bounds of synchronize_for: short first (a stream about to finish), then
// backing off so that a watchdog waiting seconds costs little CPU.
constexpr auto kPollMin = std::chrono::microseconds(50);
constexpr auto kPollMax = std::chrono::milliseconds(2);

std::string version_text(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// ---- raw allocators ---------------------------------------------------------------------------

class CudaRawAllocator final : public RawAllocator {
 public:
  CudaRawAllocator(int ordinal, size_t capacity_bytes)
      : ordinal_(ordinal), capacity_(capacity_bytes) {}

  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    // Reserve against the capacity first so concurrent allocations cannot overshoot it.
    size_t used = in_use_.load();
    do {
      if (capacity_ != 0 && (bytes > capacity_ || used > capacity_ - bytes)) return nullptr;
    } while (!in_use_.compare_exchange_weak(used, used + bytes));

    void* ptr = nullptr;
    cudaError_t err = cudaSuccess;
    try {
      DeviceGuard guard(ordinal_);
      err = cudaMalloc(&ptr, bytes);
    } catch (...) {
      in_use_ -= bytes;
      throw;
    }
    if (err == cudaSuccess) return ptr;
    in_use_ -= bytes;
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // out of memory is not sticky; the pool's fallback chain decides
      return nullptr;
    }
    detail::throw_cuda_error(err, "cudaMalloc(&ptr, bytes)", __FILE__, __LINE__, ordinal_);
  }

  void deallocate(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    QuietDeviceGuard guard(ordinal_);
    ignore_error(cudaFree(ptr));
    in_use_ -= bytes;
  }

  std::string name() const override { return "cudaMalloc on GPU " + std::to_string(ordinal_); }

 private:
  int ordinal_;
  size_t capacity_;
  std::atomic<size_t> in_use_{0};
};

class PinnedHostRawAllocator final : public RawAllocator {
 public:
  explicit PinnedHostRawAllocator(int ordinal) : ordinal_(ordinal) {}
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* ptr = nullptr;
    // Made under a GPU of the run: on a thread that has not used one yet, the runtime would
    // otherwise initialize the context of GPU 0, which the run may not have selected.
    std::optional<DeviceGuard> guard;
    if (ordinal_ >= 0) guard.emplace(ordinal_);
    // Portable: the staging memory of one GPU's pool may be used by copies on any GPU.
    const cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (err == cudaSuccess) return ptr;
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    detail::throw_cuda_error(err, "cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable)", __FILE__,
                             __LINE__);
  }
  void deallocate(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    std::optional<QuietDeviceGuard> guard;
    if (ordinal_ >= 0) guard.emplace(ordinal_);
    ignore_error(cudaFreeHost(ptr));
  }
  std::string name() const override { return "cudaHostAlloc (pinned host)"; }

 private:
  int ordinal_;  // -1: the calling thread's current device
};

// The pinned allocator of GPU `ordinal` (one per GPU for the process; cudaHostAlloc's memory is
// portable to every GPU): its cudaHostAlloc and cudaFreeHost run with that GPU current.
std::shared_ptr<RawAllocator> pinned_allocator(int ordinal) {
  static std::mutex mu;
  static std::map<int, std::shared_ptr<RawAllocator>> by_gpu;
  const std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<RawAllocator>& a = by_gpu[ordinal];
  if (!a) a = std::make_shared<PinnedHostRawAllocator>(ordinal);
  return a;
}

// ---- events -----------------------------------------------------------------------------------

class CudaEvent final : public Event {
 public:
  // timing: created without cudaEventDisableTiming, for seconds_since (dearer to record).
  explicit CudaEvent(int ordinal, bool timing = false) : ordinal_(ordinal), timing_(timing) { create(); }
  ~CudaEvent() override {
    if (event_ != nullptr) ignore_error(cudaEventDestroy(event_));
  }

  bool query() override {
    if (this_thread_captures()) [[unlikely]]
      refuse_on_capturing_thread(CaptureRule::kEventQuery, "a CUDA event of GPU " + std::to_string(ordinal_));
    std::lock_guard<std::mutex> lock(mu_);
    // The event's own GPU current, and its errors named after it: a host thread's current GPU is
    // whichever it last switched to, and may be another one (or one lost to a sticky error).
    DeviceGuard guard(ordinal_);
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not ready" is an answer, not an error
      return false;
    }
    ZT_CUDA_CHECK_ON(err, ordinal_);
    return true;
  }

  void synchronize() override {
    if (this_thread_captures()) [[unlikely]]
      refuse_on_capturing_thread(CaptureRule::kEventQuery, "a CUDA event of GPU " + std::to_string(ordinal_));
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard guard(ordinal_);  // as query()
    ZT_CUDA_CHECK_ON(cudaEventSynchronize(event_), ordinal_);
  }

  // Recorded at least once (a wait on it inside a capture is then a wait on a non-captured event).
  bool recorded() const {
    std::lock_guard<std::mutex> lock(mu_);
    return recorded_;
  }

  std::optional<double> seconds_since(const Event& start) const override {
    const auto* other = dynamic_cast<const CudaEvent*>(&start);
    if (other == nullptr || other == this || !timing_ || !other->timing_) return std::nullopt;
    std::scoped_lock lock(mu_, other->mu_);
    if (ordinal_ != other->ordinal_) return std::nullopt;
    float ms = 0;
    // Not recorded or not complete yet: an answer ("unknown"), not an error.
    if (cudaEventElapsedTime(&ms, other->event_, event_) != cudaSuccess) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    return static_cast<double>(ms) * 1e-3;
  }

  // Called with `ordinal` current. An event is bound to the device it was created on; recording
  // it on another GPU's stream re-creates it there (any wait already enqueued keeps the old one,
  // and cudaEventDestroy defers the release until the old record completes).
  void record_on(cudaStream_t stream, int ordinal) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ordinal != ordinal_) {
      ignore_error(cudaEventDestroy(event_));
      event_ = nullptr;
      ordinal_ = ordinal;
      create();
    }
    ZT_CUDA_CHECK_ON(cudaEventRecord(event_, stream), ordinal);
    recorded_ = true;
  }

  void wait_on(cudaStream_t stream) const {
    std::lock_guard<std::mutex> lock(mu_);
    // Waiting on a never-recorded event is a no-op in CUDA too.
    ZT_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  }

 private:
  void create() {
    DeviceGuard guard(ordinal_);
    ZT_CUDA_CHECK_ON(cudaEventCreateWithFlags(&event_, timing_ ? cudaEventDefault : cudaEventDisableTiming), ordinal_);
  }

  mutable std::mutex mu_;
  int ordinal_;
  bool timing_ = false;
  bool recorded_ = false;  // guarded by mu_
  cudaEvent_t event_ = nullptr;
};

class CudaDevice;
class CudaStream;

struct HostFuncPayload {
  std::function<void()> fn;
  CudaStream* stream;
};

// ---- streams ----------------------------------------------------------------------------------

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDevice& device, int id, int priority);
  ~CudaStream() override;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  Device& device() override;
  Backend backend() const override { return Backend::kCuda; }
  int id() const override { return id_; }

  void record(Event& event) override;
  void wait(const Event& event) override;
  void synchronize() override;
  bool synchronize_for(std::chrono::milliseconds timeout) override;
  bool query() override;

  void copy(void* dst, const void* src, size_t bytes) override;
  void copy_peer(Device& dst_device, void* dst, const void* src, size_t bytes) override;
  void memset(void* dst, int value, size_t bytes) override;
  void host_func(std::function<void()> fn) override;

  void* native_handle() override { return stream_; }
  void begin_capture() override;
  std::unique_ptr<StreamGraph> end_capture() override;
  bool capturing() const override { return capturing_.load(std::memory_order_acquire); }
  void invalidate_capture(const std::string& why) override;
  // Work submitted to a failed capture: CUDA returns cudaErrorStreamCaptureInvalidated for it
  // (the CPU backend throws the same); called before every enqueue.
  void refuse_if_invalidated();

  int ordinal() const { return ordinal_; }
  std::string where() const;  // "cuda:0 (...) stream 1", for refusals

  // Called from CUDA's host-function thread.
  void record_host_failure(const std::string& what);
  // Called from CUDA's host-function thread: the device failed, host functions are skipped.
  bool skips_host_functions() const;
  // Polls until the stream is idle (true) or `deadline` passes (false), then reports like
  // synchronize(): a failed device's error is thrown once its queued work has drained.
  bool synchronize_until(std::chrono::steady_clock::time_point deadline);
  // The two halves of synchronize_until: drain_until polls without reporting the device's failure
  // (it throws only for an abandoned device, a capture or a CUDA error); report() rethrows it.
  bool drain_until(std::chrono::steady_clock::time_point deadline);
  void report();
  // Enqueues a host function that blocks the stream until `gate` is released (injected hang).
  void park_on(const std::shared_ptr<HangGate>& gate);

  // Observer spans (see the design notes). begin_span returns whether a span was opened (the
  // device has an observer and no span is open on this thread); end_span closes it.
  bool begin_span(const char* name) noexcept;
  void end_span() noexcept;
  // Reports the completed spans in order; with `reanchor`, renews an old anchor (stream idle).
  void flush_spans(bool reanchor) noexcept;

  StreamResource& resource(StreamResourceSlot slot, StreamResourceFactory make);
  // Destroys the library resources (the stream must be drained); idempotent, never throws.
  void release_resources() noexcept;

 private:
  struct Span {
    const char* name;
    cudaEvent_t start, end;
  };
  cudaEvent_t take_timing_event() noexcept;  // nullptr when CUDA refuses one
  void release_events() noexcept;
  void check(cudaError_t err, const char* call, int line);
  void rethrow_host_failure();
  // cudaStreamQuery without reporting the device's failure (see drain_until).
  bool idle();
  void copy_staged(void* dst, const void* src, size_t bytes);
  // Fails the capture and throws the refusal (a call CUDA refuses during capture).
  [[noreturn]] void refuse_in_capture(CaptureRule rule);

  CudaDevice& device_;
  int id_;
  int ordinal_;
  cudaStream_t stream_ = nullptr;
  std::mutex failure_mu_;
  std::string host_failure_;  // first exception from a host function; empty = none

  std::mutex span_mu_;
  std::deque<Span> spans_;              // guarded by span_mu_: enqueued, not yet reported
  std::vector<cudaEvent_t> free_events_;  // guarded by span_mu_: timing events to reuse
  cudaEvent_t anchor_ = nullptr;        // guarded by span_mu_
  std::chrono::steady_clock::time_point anchor_time_;  // guarded by span_mu_
  std::mutex flush_mu_;                 // one reporter at a time keeps each stream's order

  std::mutex resources_mu_;
  std::array<std::unique_ptr<StreamResource>, kNumStreamResources> resources_;  // guarded by resources_mu_

  // Stream capture: our own rules (single stream, the pool) are checked before CUDA sees a call;
  // host functions captured into a graph are owned by it (a replay runs them again).
  std::atomic<bool> capturing_{false};
  std::mutex capture_mu_;
  std::string capture_error_;  // guarded by capture_mu_: the first reason the capture failed
  std::thread::id capture_thread_;  // guarded by capture_mu_: the thread that began the capture
  std::vector<std::shared_ptr<HostFuncPayload>> capture_payloads_;  // guarded by capture_mu_
};

// cudaStream_t -> its CudaStream, for the launchers (which see only the native handle) to reach
// the stream's resources. Never destroyed (streams may unregister during static destruction).
class StreamRegistry {
 public:
  void add(cudaStream_t native, CudaStream* s) {
    std::lock_guard<std::mutex> lock(mu_);
    streams_[native] = s;
  }
  void remove(cudaStream_t native) {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.erase(native);
  }
  CudaStream* find(cudaStream_t native) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(native);
    return it == streams_.end() ? nullptr : it->second;
  }

 private:
  std::mutex mu_;
  std::map<cudaStream_t, CudaStream*> streams_;
};
StreamRegistry& stream_registry() {
  static StreamRegistry* registry = new StreamRegistry();
  return *registry;
}

// Depth of TaskSpans on this host thread: only the outermost records events.
thread_local int t_span_depth = 0;

// Brackets one internal stream operation for the observer.
class InternalSpan {
 public:
  InternalSpan(CudaStream& s, const char* name) : s_(s), open_(s.begin_span(name)) {}
  ~InternalSpan() {
    if (open_) s_.end_span();
  }
  InternalSpan(const InternalSpan&) = delete;
  InternalSpan& operator=(const InternalSpan&) = delete;

 private:
  CudaStream& s_;
  bool open_;
};

// Inside CudaStream and CudaDevice: a failed call also marks the device failed (sticky).
#define ZT_CUDA_STREAM_CHECK(call) check((call), #call, __LINE__)

// A host function inside a graph: the graph owns the payload (every replay runs it again).
void CUDART_CB run_captured_host_func(void* user_data) {
  auto* payload = static_cast<HostFuncPayload*>(user_data);
  if (payload->stream->skips_host_functions()) return;
  try {
    payload->fn();
  } catch (const std::exception& e) {
    payload->stream->record_host_failure(e.what());
  } catch (...) {
    payload->stream->record_host_failure("unknown exception");
  }
}

void CUDART_CB run_host_func(void* user_data) {
  // The payload, and so fn's captures, die on CUDA's thread: captures must not call CUDA either.
  std::unique_ptr<HostFuncPayload> payload(static_cast<HostFuncPayload*>(user_data));
  if (payload->stream->skips_host_functions()) return;
  try {
    payload->fn();
  } catch (const std::exception& e) {
    payload->stream->record_host_failure(e.what());
  } catch (...) {
    payload->stream->record_host_failure("unknown exception");
  }
}

// ---- devices ----------------------------------------------------------------------------------

struct GpuInfo {
  std::string name;
  size_t total_memory = 0;
  int priority_normal = 0;  // cudaDeviceGetStreamPriorityRange: numerically lower = higher
  int priority_high = 0;
  int share_count = 0;  // logical devices on this GPU
  int major = 0;        // compute capability
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int index, int ordinal, int slot, const GpuInfo& gpu)
      : index_(index), ordinal_(ordinal), slot_(slot), gpu_(gpu) {
    name_ = "cuda:" + std::to_string(ordinal_) + " (" + gpu_.name + ")";
    if (gpu_.share_count > 1) {
      name_ += " [logical " + std::to_string(slot_) + " of " + std::to_string(gpu_.share_count) +
               " on GPU " + std::to_string(ordinal_) + "]";
    }
    total_memory_ = gpu_.total_memory / static_cast<size_t>(std::max(gpu_.share_count, 1));
    streams_.push_back(std::make_unique<CudaStream>(*this, 0, gpu_.priority_normal));
    streams_.push_back(std::make_unique<CudaStream>(*this, 1, gpu_.priority_high));
    compute_ = streams_[0].get();
    comm_ = streams_[1].get();
    // A GPU of its own: let cudaMalloc say when it is full. Shared: cap at this device's share.
    const size_t capacity = gpu_.share_count > 1 ? total_memory_ : 0;
    pool_ = std::make_unique<CachingAllocator>(name_, make_device_raw_allocator(ordinal_, capacity));
  }

  ~CudaDevice() override {
    // A stream parked on an injected hang would never drain (see Runtime::~Runtime).
    if (hang_injected()) abandon("the device was destroyed while it hung (injected fault)");
    // Drain every stream before the pools hand their segments back; errors are not reported
    // here (see the design notes). Pools go before streams: they may hold events on them.
    for (auto& s : streams_) {
      QuietDeviceGuard guard(ordinal_);
      ignore_error(cudaStreamSynchronize(static_cast<cudaStream_t>(s->native_handle())));
    }
    // Library workspaces are pool blocks: back to the pool before it goes.
    for (auto& s : streams_) s->release_resources();
    staging_.reset();
    pool_.reset();
  }

  int index() const override { return index_; }
  Backend backend() const override { return Backend::kCuda; }
  std::string name() const override { return name_; }
  size_t total_memory() const override { return total_memory_; }

  Stream& compute() override { return *compute_; }
  Stream& comm() override { return *comm_; }

  Stream& create_stream(StreamPriority priority) override {
    // fault_mu_ first (as inject_fault): a stream created on a hung device is parked too.
    std::lock_guard<std::mutex> fault_lock(fault_mu_);
    std::lock_guard<std::mutex> lock(streams_mu_);
    const int id = static_cast<int>(streams_.size());
    const int p = priority == StreamPriority::kHigh ? gpu_.priority_high : gpu_.priority_normal;
    streams_.push_back(std::make_unique<CudaStream>(*this, id, p));
    if (hang_gate_) streams_.back()->park_on(hang_gate_);
    return *streams_.back();
  }

  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(ordinal_); }
  std::unique_ptr<Event> create_timing_event() override { return std::make_unique<CudaEvent>(ordinal_, true); }

  CachingAllocator& memory() override { return *pool_; }

  // cuBLAS's recommended workspace: 32 MiB on Hopper and newer, 4 MiB before. One per stream keeps
  // GEMMs on different streams from sharing one (cuBLAS's reproducibility rule).
  size_t gemm_workspace_bytes() const override { return recommended_gemm_workspace_bytes(gpu_.major); }

  PinnedHostBuffer alloc_host_pinned(size_t bytes) override {
    if (bytes == 0) return {};
    if (this_thread_captures()) [[unlikely]]
      refuse_on_capturing_thread(CaptureRule::kHostPinnedAllocation, name_ + ", " + std::to_string(bytes) + " bytes");
    // One allocator for the process (cudaHostAlloc is portable to every GPU); buffers share it.
    // Allocated and freed under this GPU (pinned_allocator): a thread's current GPU may be one the
    // run never selected, or one lost to a sticky error (every call in its context fails).
    const std::shared_ptr<RawAllocator> pinned = pinned_allocator(ordinal_);
    void* p = pinned->allocate(bytes);
    if (p == nullptr)
      ZT_THROW(ErrorKind::kOutOfMemory, name_, ": cudaHostAlloc could not pin ", bytes,
               " bytes of host memory for a device-to-host copy buffer; free host memory or copy in smaller pieces");
    return PinnedHostBuffer(p, bytes, pinned, /*pinned=*/true);
  }

  bool can_access_peer(const Device& other) const override {
    const auto* peer = dynamic_cast<const CudaDevice*>(&other);
    if (peer == nullptr) return false;
    if (peer->ordinal_ == ordinal_) return true;
    // Access that is possible but was not enabled (the 8-peer limit) does not count: kernels
    // reading the peer's memory (the collectives' direct path) would fault.
    return peer_table().enabled(ordinal_, peer->ordinal_);
  }

  void synchronize() override {
    std::vector<CudaStream*> streams;
    {
      std::lock_guard<std::mutex> lock(streams_mu_);
      for (auto& s : streams_) streams.push_back(s.get());
    }
    // Drain all of them even when one fails; report the first failure.
    std::exception_ptr first;
    for (CudaStream* s : streams) {
      try {
        s->synchronize();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  // A sticky CUDA error on any logical device of this GPU fails them all (cuda_check.h LostGpus):
  // they share the GPU's one context, which CUDA does not let the process use again.
  bool failed() const override { return failed_.load() || detail::lost_gpus().lost(ordinal_); }

  void set_task_observer(TaskObserver* observer) override {
    // Report what the previous observer is owed first (quietly: a failed device reports nothing).
    if (!hang_injected() && !abandoned()) {
      std::vector<CudaStream*> streams;
      {
        std::lock_guard<std::mutex> lock(streams_mu_);
        for (auto& s : streams_) streams.push_back(s.get());
      }
      for (CudaStream* s : streams) {
        QuietDeviceGuard guard(ordinal_);
        if (cudaStreamSynchronize(static_cast<cudaStream_t>(s->native_handle())) == cudaSuccess)
          s->flush_spans(/*reanchor=*/false);
        else
          (void)cudaGetLastError();
      }
    }
    observer_.store(observer, std::memory_order_release);
  }
  TaskObserver* task_observer() const { return observer_.load(std::memory_order_acquire); }

  bool synchronize_for(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<CudaStream*> streams;
    {
      std::lock_guard<std::mutex> lock(streams_mu_);
      for (auto& s : streams_) streams.push_back(s.get());
    }
    // Every stream drains before a failure is reported (as synchronize() and the CPU backend).
    for (CudaStream* s : streams) {
      if (!s->drain_until(deadline)) return false;
    }
    for (CudaStream* s : streams) s->report();
    return true;
  }

  void inject_fault(FaultKind kind) override {
    if (kind == FaultKind::kError) {
      set_fault("operation on " + name_ + " failed: injected fault (FaultKind::kError)");
      return;
    }
    std::lock_guard<std::mutex> fault_lock(fault_mu_);
    if (abandoned_.load() || hang_gate_) return;
    auto gate = std::make_shared<HangGate>();
    std::lock_guard<std::mutex> streams_lock(streams_mu_);
    try {
      for (auto& s : streams_) s->park_on(gate);
    } catch (...) {
      gate->release();  // a CUDA failure: unpark the streams already parked, set no hang
      throw;
    }
    hang_gate_ = std::move(gate);
  }

  bool hang_injected() const override {
    std::lock_guard<std::mutex> lock(fault_mu_);
    return hang_gate_ != nullptr;
  }

  void abandon(const std::string& why) override {
    set_fault(name_ + " was abandoned: " + why);
    std::shared_ptr<HangGate> gate;
    {
      std::lock_guard<std::mutex> lock(fault_mu_);
      abandoned_.store(true);
      gate = std::move(hang_gate_);
    }
    if (gate) gate->release();
  }

  int ordinal() const { return ordinal_; }
  void mark_failed() { failed_.store(true); }
  bool abandoned() const { return abandoned_.load(std::memory_order_acquire); }
  // Throws the injected fault / abandonment, if any, as zt::Error(kDevice).
  void throw_if_faulted() const {
    if (!faulted_.load(std::memory_order_acquire)) [[likely]]
      return;
    std::string message;
    {
      std::lock_guard<std::mutex> lock(fault_mu_);
      message = fault_message_;
    }
    ZT_THROW(ErrorKind::kDevice, message);
  }

  // Pinned host memory for staged peer copies; created on first use (most setups never stage).
  CachingAllocator& staging_pool() {
    std::call_once(staging_once_, [this] {
      staging_ = std::make_unique<CachingAllocator>(name_ + " pinned staging",
                                                    make_pinned_host_raw_allocator(ordinal_));
    });
    return *staging_;
  }

 private:
  int index_;
  int ordinal_;
  int slot_;  // position among the logical devices on this GPU
  GpuInfo gpu_;
  std::string name_;
  size_t total_memory_ = 0;
  std::atomic<bool> failed_{false};

  // Injected faults (see the design notes). Lock order: fault_mu_, then streams_mu_.
  void set_fault(const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(fault_mu_);
      if (fault_message_.empty()) fault_message_ = message;  // the first fault wins
    }
    faulted_.store(true, std::memory_order_release);
    failed_.store(true);
  }
  mutable std::mutex fault_mu_;
  std::string fault_message_;          // guarded by fault_mu_
  std::shared_ptr<HangGate> hang_gate_;  // guarded by fault_mu_; set while an injected hang holds
  std::atomic<bool> faulted_{false};   // fault_message_ is set
  std::atomic<bool> abandoned_{false};
  std::atomic<TaskObserver*> observer_{nullptr};

  // Declared before the pools so that they are destroyed after them.
  std::mutex streams_mu_;
  std::vector<std::unique_ptr<CudaStream>> streams_;  // 0 compute, 1 comm, then create_stream()
  CudaStream* compute_ = nullptr;
  CudaStream* comm_ = nullptr;

  std::unique_ptr<CachingAllocator> pool_;
  std::once_flag staging_once_;
  std::unique_ptr<CachingAllocator> staging_;
};

// ---- stream implementation --------------------------------------------------------------------

CudaStream::CudaStream(CudaDevice& device, int id, int priority)
    : device_(device), id_(id), ordinal_(device.ordinal()) {
  DeviceGuard guard(ordinal_);
  // Non-blocking: no implicit synchronisation with the legacy default stream.
  ZT_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority));
  stream_registry().add(stream_, this);
}

CudaStream::~CudaStream() {
  note_capture_ended(this);  // a capture left open on this thread (the stream is going away)
  if (stream_ == nullptr) return;
  stream_registry().remove(stream_);
  QuietDeviceGuard guard(ordinal_);
  // Host functions still queued refer to this object: let them finish first.
  ignore_error(cudaStreamSynchronize(stream_));
  release_resources();
  release_events();  // unreported spans are dropped: the observer may be gone already
  ignore_error(cudaStreamDestroy(stream_));
}

cudaEvent_t CudaStream::take_timing_event() noexcept {
  {
    std::lock_guard<std::mutex> lock(span_mu_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  if (cudaEventCreate(&e) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return e;
}

bool CudaStream::begin_span(const char* name) noexcept {
  // A capture holds no timing events: they would be read by the host, which a captured record
  // never completes for.
  if (device_.task_observer() == nullptr || capturing()) return false;
  if (t_span_depth > 0) {
    ++t_span_depth;
    return true;
  }
  QuietDeviceGuard guard(ordinal_);
  {
    std::lock_guard<std::mutex> lock(span_mu_);
    if (anchor_ == nullptr) {
      // The first span: an anchor that the stream has reached, read against the host clock.
      if (cudaEventCreate(&anchor_) != cudaSuccess || cudaEventRecord(anchor_, stream_) != cudaSuccess ||
          cudaEventSynchronize(anchor_) != cudaSuccess) {
        (void)cudaGetLastError();
        if (anchor_ != nullptr) ignore_error(cudaEventDestroy(anchor_));
        anchor_ = nullptr;
        return false;
      }
      anchor_time_ = std::chrono::steady_clock::now();
    }
  }
  cudaEvent_t start = take_timing_event();
  if (start == nullptr || cudaEventRecord(start, stream_) != cudaSuccess) {
    (void)cudaGetLastError();
    if (start != nullptr) {
      std::lock_guard<std::mutex> lock(span_mu_);
      free_events_.push_back(start);
    }
    return false;
  }
  ++t_span_depth;
  std::lock_guard<std::mutex> lock(span_mu_);
  spans_.push_back(Span{name, start, nullptr});
  return true;
}

void CudaStream::end_span() noexcept {
  if (--t_span_depth > 0) return;
  QuietDeviceGuard guard(ordinal_);
  cudaEvent_t end = take_timing_event();
  const bool recorded = end != nullptr && cudaEventRecord(end, stream_) == cudaSuccess;
  if (!recorded) (void)cudaGetLastError();
  std::lock_guard<std::mutex> lock(span_mu_);
  // This thread's span is the newest one without an end: work on one stream is launched by one
  // host thread at a time (launches from several threads would interleave on the GPU anyway).
  for (auto it = spans_.rbegin(); it != spans_.rend(); ++it) {
    if (it->end == nullptr) {
      if (recorded) {
        it->end = end;
      } else {
        free_events_.push_back(it->start);
        if (end != nullptr) free_events_.push_back(end);
        spans_.erase(std::next(it).base());
      }
      return;
    }
  }
  if (end != nullptr) free_events_.push_back(end);
}

void CudaStream::flush_spans(bool reanchor) noexcept {
  std::lock_guard<std::mutex> flush_lock(flush_mu_);
  TaskObserver* observer = device_.task_observer();
  QuietDeviceGuard guard(ordinal_);
  for (;;) {
    Span span;
    cudaEvent_t anchor;
    std::chrono::steady_clock::time_point anchor_time;
    {
      std::lock_guard<std::mutex> lock(span_mu_);
      if (spans_.empty() || spans_.front().end == nullptr) break;
      span = spans_.front();
      anchor = anchor_;
      anchor_time = anchor_time_;
    }
    if (cudaEventQuery(span.end) != cudaSuccess) {
      (void)cudaGetLastError();  // not reached yet (or failed): report later, or never
      break;
    }
    float start_ms = 0, end_ms = 0;
    const bool timed = cudaEventElapsedTime(&start_ms, anchor, span.start) == cudaSuccess &&
                       cudaEventElapsedTime(&end_ms, anchor, span.end) == cudaSuccess;
    if (!timed) (void)cudaGetLastError();
    {
      std::lock_guard<std::mutex> lock(span_mu_);
      spans_.pop_front();
      free_events_.push_back(span.start);
      free_events_.push_back(span.end);
    }
    if (timed && observer != nullptr) {
      const auto at = [&](float ms) {
        return anchor_time + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double, std::milli>(ms));
      };
      try {
        observer->on_task(device_.index(), id_, span.name, at(start_ms), at(end_ms));
      } catch (...) {
        // An observer that throws loses its slice; the stream's work is unaffected.
      }
    }
  }
  if (!reanchor) return;
  std::lock_guard<std::mutex> lock(span_mu_);
  if (anchor_ == nullptr || !spans_.empty() ||
      std::chrono::steady_clock::now() - anchor_time_ < std::chrono::seconds(1))
    return;
  if (cudaEventRecord(anchor_, stream_) == cudaSuccess && cudaEventSynchronize(anchor_) == cudaSuccess)
    anchor_time_ = std::chrono::steady_clock::now();
  else
    (void)cudaGetLastError();
}

void CudaStream::release_events() noexcept {
  std::lock_guard<std::mutex> lock(span_mu_);
  for (const Span& span : spans_) {
    ignore_error(cudaEventDestroy(span.start));
    if (span.end != nullptr) ignore_error(cudaEventDestroy(span.end));
  }
  spans_.clear();
  for (cudaEvent_t e : free_events_) ignore_error(cudaEventDestroy(e));
  free_events_.clear();
  if (anchor_ != nullptr) ignore_error(cudaEventDestroy(anchor_));
  anchor_ = nullptr;
}

Device& CudaStream::device() { return device_; }

StreamResource& CudaStream::resource(StreamResourceSlot slot, StreamResourceFactory make) {
  std::lock_guard<std::mutex> lock(resources_mu_);
  auto& r = resources_[static_cast<size_t>(slot)];
  if (!r) {
    // Library handles bind to the current device (cublasCreate, cublasLtCreate): the stream's GPU,
    // whatever GPU the calling thread was on.
    DeviceGuard guard(ordinal_);
    r = make(*this);
  }
  ZT_CHECK(r != nullptr, "the factory of stream resource ", static_cast<int>(slot), " returned nothing");
  return *r;
}

void CudaStream::release_resources() noexcept {
  std::array<std::unique_ptr<StreamResource>, kNumStreamResources> gone;
  {
    std::lock_guard<std::mutex> lock(resources_mu_);
    gone.swap(resources_);
  }
  QuietDeviceGuard guard(ordinal_);
  for (auto& r : gone) r.reset();  // resource destructors must not throw (see cuda_backend.h)
}

void CudaStream::check(cudaError_t err, const char* call, int line) {
  if (err == cudaSuccess) [[likely]]
    return;
  if (capturing() && !detail::is_sticky_error(err)) {
    // CUDA refused a call of the capture (or had invalidated it): nothing ran, so the device is
    // fine; the capture fails with the reason and the stream is usable after end_capture(). A
    // sticky error is not the capture's: earlier work faulted the GPU, which is lost (below).
    (void)cudaGetLastError();
    const std::string why = std::string(call) + " failed inside the capture (" + cudaGetErrorName(err) + ": " +
                            cudaGetErrorString(err) + ")";
    invalidate_capture(why);
    ZT_THROW(ErrorKind::kInvalidArgument, why, " on ", device_.name(), " stream ", id_);
  }
  device_.mark_failed();
  detail::throw_cuda_error(err, call, __FILE__, line, ordinal_);
}

bool CudaStream::skips_host_functions() const { return device_.failed(); }

void CudaStream::record_host_failure(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (host_failure_.empty()) host_failure_ = what.empty() ? "exception without a message" : what;
  }
  device_.mark_failed();
}

void CudaStream::rethrow_host_failure() {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (!host_failure_.empty()) {
    ZT_THROW(ErrorKind::kDevice, "a host function on ", device_.name(), " stream ", id_,
             " failed: ", host_failure_);
  }
}

void CudaStream::record(Event& event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
  ZT_CHECK(cuda_event != nullptr, "a CUDA stream can only record an event of a CUDA device");
  if (capturing()) {
    invalidate_capture(capture_refusal(CaptureRule::kRecordInCapture, where()));
    return;
  }
  DeviceGuard guard(ordinal_);
  try {
    cuda_event->record_on(stream_, ordinal_);
  } catch (...) {
    device_.mark_failed();
    throw;
  }
}

void CudaStream::wait(const Event& event) {
  const auto* cuda_event = dynamic_cast<const CudaEvent*>(&event);
  ZT_CHECK(cuda_event != nullptr, "a CUDA stream can only wait on an event of a CUDA device");
  if (capturing()) {
    // Checked before CUDA sees it (as on the CPU backend): a recorded event is a non-captured
    // one (records inside a capture are refused), which CUDA refuses to wait on.
    invalidate_capture(capture_refusal(
        cuda_event->recorded() ? CaptureRule::kWaitOnUncapturedEvent : CaptureRule::kWaitInCapture, where()));
    return;
  }
  DeviceGuard guard(ordinal_);
  try {
    cuda_event->wait_on(stream_);
  } catch (...) {
    device_.mark_failed();
    throw;
  }
}

void CudaStream::synchronize() {
  if (capturing()) refuse_in_capture(CaptureRule::kStreamSynchronize);
  // Never block on a device given up on: its GPU may be truly stuck.
  if (device_.abandoned()) device_.throw_if_faulted();
  {
    DeviceGuard guard(ordinal_);
    ZT_CUDA_STREAM_CHECK(cudaStreamSynchronize(stream_));
  }
  report();
}

bool CudaStream::synchronize_for(std::chrono::milliseconds timeout) {
  if (capturing()) refuse_in_capture(CaptureRule::kStreamSynchronize);
  return synchronize_until(std::chrono::steady_clock::now() + timeout);
}

bool CudaStream::synchronize_until(std::chrono::steady_clock::time_point deadline) {
  if (!drain_until(deadline)) return false;
  report();
  return true;
}

bool CudaStream::drain_until(std::chrono::steady_clock::time_point deadline) {
  std::chrono::steady_clock::duration pause = kPollMin;
  while (!idle()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(std::min(pause, deadline - now));
    pause = std::min<std::chrono::steady_clock::duration>(pause * 2, kPollMax);
  }
  return true;
}

void CudaStream::report() {
  flush_spans(/*reanchor=*/true);
  rethrow_host_failure();
  device_.throw_if_faulted();
}

void CudaStream::park_on(const std::shared_ptr<HangGate>& gate) {
  auto payload = std::make_unique<std::shared_ptr<HangGate>>(gate);
  DeviceGuard guard(ordinal_);
  ZT_CUDA_STREAM_CHECK(cudaLaunchHostFunc(stream_, run_hang_gate, payload.get()));
  payload.release();  // owned by run_hang_gate from now on
}

bool CudaStream::idle() {
  if (capturing()) refuse_in_capture(CaptureRule::kStreamQuery);
  if (device_.abandoned()) device_.throw_if_faulted();
  DeviceGuard guard(ordinal_);
  const cudaError_t err = cudaStreamQuery(stream_);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  ZT_CUDA_STREAM_CHECK(err);
  return true;
}

bool CudaStream::query() {
  if (idle()) {
    report();
    return true;
  }
  rethrow_host_failure();
  device_.throw_if_faulted();
  return false;
}

void CudaStream::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  refuse_if_invalidated();
  InternalSpan span(*this, "copy");
  DeviceGuard guard(ordinal_);
  ZT_CUDA_STREAM_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
}

void CudaStream::copy_peer(Device& dst_device, void* dst, const void* src, size_t bytes) {
  auto* peer = dynamic_cast<CudaDevice*>(&dst_device);
  ZT_CHECK(peer != nullptr, "copy_peer from ", device_.name(), " to ", dst_device.name(),
           ": the destination is not a CUDA device");
  if (bytes == 0) return;
  refuse_if_invalidated();
  const int dst_ordinal = peer->ordinal();
  InternalSpan span(*this, "copy_peer");

  PeerCopyPath path = g_peer_copy_path.load(std::memory_order_relaxed);
  if (path == PeerCopyPath::kAuto && dst_ordinal == ordinal_) {
    DeviceGuard guard(ordinal_);
    ZT_CUDA_STREAM_CHECK(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  if (path == PeerCopyPath::kAuto) {
    path = peer_table().enabled(ordinal_, dst_ordinal) ? PeerCopyPath::kPeer : PeerCopyPath::kStaged;
  }
  if (path == PeerCopyPath::kPeer) {
    DeviceGuard guard(ordinal_);
    ZT_CUDA_STREAM_CHECK(cudaMemcpyPeerAsync(dst, dst_ordinal, src, ordinal_, bytes, stream_));
    return;
  }
  copy_staged(dst, src, bytes);
}

void CudaStream::copy_staged(void* dst, const void* src, size_t bytes) {
  CachingAllocator& staging = device_.staging_pool();
  const size_t chunk = std::min(bytes, kStagingChunkBytes);
  DeviceGuard guard(ordinal_);  // before the staging block's cudaHostAlloc (see alloc_host_pinned)
  auto* host = static_cast<unsigned char*>(staging.allocate(chunk, *this, "peer-copy staging"));
  try {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    for (size_t offset = 0; offset < bytes; offset += chunk) {
      const size_t n = std::min(chunk, bytes - offset);
      // cudaMemcpyDefault: with unified addressing the runtime finds each pointer's device, so
      // the second leg may target another GPU's memory from this stream.
      ZT_CUDA_STREAM_CHECK(cudaMemcpyAsync(host, s + offset, n, cudaMemcpyDefault, stream_));
      ZT_CUDA_STREAM_CHECK(cudaMemcpyAsync(d + offset, host, n, cudaMemcpyDefault, stream_));
    }
  } catch (...) {
    staging.free(host);
    throw;
  }
  staging.free(host);
}

void CudaStream::memset(void* dst, int value, size_t bytes) {
  if (bytes == 0) return;
  refuse_if_invalidated();
  InternalSpan span(*this, "memset");
  DeviceGuard guard(ordinal_);
  ZT_CUDA_STREAM_CHECK(cudaMemsetAsync(dst, value, bytes, stream_));
}

void CudaStream::host_func(std::function<void()> fn) {
  ZT_CHECK(static_cast<bool>(fn), "host_func needs a callable");
  refuse_if_invalidated();
  if (capturing()) {
    auto payload = std::make_shared<HostFuncPayload>(HostFuncPayload{std::move(fn), this});
    {
      std::lock_guard<std::mutex> lock(capture_mu_);
      capture_payloads_.push_back(payload);
    }
    DeviceGuard guard(ordinal_);
    ZT_CUDA_STREAM_CHECK(cudaLaunchHostFunc(stream_, run_captured_host_func, payload.get()));
    return;
  }
  auto payload = std::make_unique<HostFuncPayload>(HostFuncPayload{std::move(fn), this});
  InternalSpan span(*this, "host_func");
  DeviceGuard guard(ordinal_);
  ZT_CUDA_STREAM_CHECK(cudaLaunchHostFunc(stream_, run_host_func, payload.get()));
  payload.release();  // owned by run_host_func from now on
}

// ---- stream capture ---------------------------------------------------------------------------

class CudaGraph final : public StreamGraph {
 public:
  CudaGraph(int ordinal, const Device& device, cudaGraph_t graph, cudaGraphExec_t exec, size_t nodes,
            std::vector<std::shared_ptr<HostFuncPayload>> payloads)
      : ordinal_(ordinal), device_(device), graph_(graph), exec_(exec), nodes_(nodes), payloads_(std::move(payloads)) {}
  ~CudaGraph() override {
    QuietDeviceGuard guard(ordinal_);
    // The graph's host functions may still be queued by a launch: the payloads must outlive them
    // (a stream already destroyed has drained).
    if (!payloads_.empty() && last_stream_ != nullptr && stream_registry().find(last_stream_) != nullptr)
      ignore_error(cudaStreamSynchronize(last_stream_));
    if (exec_ != nullptr) ignore_error(cudaGraphExecDestroy(exec_));
    if (graph_ != nullptr) ignore_error(cudaGraphDestroy(graph_));
  }
  void launch(Stream& s) override {
    auto* cs = s.backend() == Backend::kCuda ? dynamic_cast<CudaStream*>(&s) : nullptr;
    ZT_CHECK(cs != nullptr && &s.device() == &device_, "a graph captured on ", device_.name(),
             " was launched on a stream of ", s.device().name());
    if (cs->capturing())
      throw CaptureError(CaptureRule::kLaunchIntoCapture,
                         capture_refusal(CaptureRule::kLaunchIntoCapture, "a graph of " + device_.name()));
    if (exec_ == nullptr) return;  // an empty capture
    DeviceGuard guard(ordinal_);
    last_stream_ = static_cast<cudaStream_t>(cs->native_handle());
    ZT_CUDA_CHECK(cudaGraphLaunch(exec_, last_stream_));
  }
  size_t size() const override { return nodes_; }

 private:
  int ordinal_;
  const Device& device_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  size_t nodes_;
  std::vector<std::shared_ptr<HostFuncPayload>> payloads_;
  cudaStream_t last_stream_ = nullptr;
};

void CudaStream::begin_capture() {
  std::lock_guard<std::mutex> lock(capture_mu_);
  ZT_REQUIRE(!capturing_.load(std::memory_order_relaxed), "stream ", id_, " of ", device_.name(),
             " is capturing already: end that capture first");
  DeviceGuard guard(ordinal_);
  // Thread-local mode: only this thread's unsafe calls (cudaMalloc, synchronisations) break the
  // capture; other host threads drive other devices meanwhile.
  ZT_CUDA_STREAM_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  capture_error_.clear();
  capture_payloads_.clear();
  capture_thread_ = std::this_thread::get_id();
  capturing_.store(true, std::memory_order_release);
  note_capture_begun(this);
}

std::unique_ptr<StreamGraph> CudaStream::end_capture() {
  std::string error;
  std::vector<std::shared_ptr<HostFuncPayload>> payloads;
  {
    std::lock_guard<std::mutex> lock(capture_mu_);
    ZT_REQUIRE(capturing_.load(std::memory_order_relaxed), "stream ", id_, " of ", device_.name(), " is not capturing");
    // Refused before CUDA sees it (cudaErrorStreamCaptureWrongThread): the capture stays open for
    // the thread that began it.
    if (capture_thread_ != std::this_thread::get_id())
      throw CaptureError(CaptureRule::kEndOnOtherThread, capture_refusal(CaptureRule::kEndOnOtherThread, where()));
    capturing_.store(false, std::memory_order_release);
    error.swap(capture_error_);
    payloads.swap(capture_payloads_);
  }
  note_capture_ended(this);
  DeviceGuard guard(ordinal_);
  cudaGraph_t graph = nullptr;
  // Ends the capture whatever happened inside, so the stream is usable again.
  const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  if (detail::is_sticky_error(end)) {
    device_.mark_failed();  // earlier work faulted the GPU: not a capture error
    detail::throw_cuda_error(end, "cudaStreamEndCapture(stream_, &graph)", __FILE__, __LINE__, ordinal_);
  }
  if (end != cudaSuccess || error.empty() == false) {
    (void)cudaGetLastError();  // capture errors are not sticky: clear them
    if (graph != nullptr) ignore_error(cudaGraphDestroy(graph));
    throw_invalidated_capture(where(), !error.empty() ? error
                                                      : std::string("CUDA refused a call inside it (") +
                                                            cudaGetErrorName(end) + ": " + cudaGetErrorString(end) + ")");
  }
  size_t nodes = 0;
  cudaError_t err = cudaGraphGetNodes(graph, nullptr, &nodes);
  if (err == cudaSuccess && nodes == 0) {
    // Nothing was captured (a stretch between two hooks with no work): a launch does nothing.
    ignore_error(cudaGraphDestroy(graph));
    return std::make_unique<CudaGraph>(ordinal_, static_cast<const Device&>(device_), nullptr, nullptr, 0,
                                       std::move(payloads));
  }
  cudaGraphExec_t exec = nullptr;
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    ignore_error(cudaGraphDestroy(graph));
    ZT_THROW(ErrorKind::kInvalidArgument, "the graph captured on ", device_.name(), " stream ", id_,
             " could not be instantiated: ", cudaGetErrorString(err));
  }
  return std::make_unique<CudaGraph>(ordinal_, static_cast<const Device&>(device_), graph, exec, nodes, std::move(payloads));
}

void CudaStream::invalidate_capture(const std::string& why) {
  std::lock_guard<std::mutex> lock(capture_mu_);
  if (capturing_.load(std::memory_order_relaxed) && capture_error_.empty()) capture_error_ = why;
}

void CudaStream::refuse_in_capture(CaptureRule rule) {
  std::string why = capture_refusal(rule, where());
  invalidate_capture(why);
  throw CaptureError(rule, std::move(why));
}

void CudaStream::refuse_if_invalidated() {
  if (!capturing()) [[likely]]
    return;
  std::string failed;
  {
    std::lock_guard<std::mutex> lock(capture_mu_);
    if (capturing_.load(std::memory_order_relaxed)) failed = capture_error_;
  }
  if (!failed.empty())
    throw CaptureError(CaptureRule::kUseAfterInvalidation, capture_refusal(CaptureRule::kUseAfterInvalidation, where()) +
                                                               "; the capture failed first because: " + failed);
}

std::string CudaStream::where() const { return device_.name() + " stream " + std::to_string(id_); }

#undef ZT_CUDA_STREAM_CHECK

}  // namespace

// ---- public entry points ----------------------------------------------------------------------

namespace {
CudaStream& as_cuda_stream(Stream& s, const char* what) {
  auto* cs = s.backend() == Backend::kCuda ? dynamic_cast<CudaStream*>(&s) : nullptr;
  ZT_CHECK(cs != nullptr, what, " was launched through the CUDA backend on a stream of ", s.device().name(),
           ", which is not a CUDA stream");
  return *cs;
}
}  // namespace

TaskSpan::TaskSpan(Stream& s, const char* name) {
  CudaStream& cs = as_cuda_stream(s, name);
  cs.refuse_if_invalidated();
  stream_ = &cs;
  open_ = cs.begin_span(name);
}

TaskSpan::~TaskSpan() {
  if (open_) static_cast<CudaStream*>(stream_)->end_span();
}

void* TaskSpan::native() const { return static_cast<CudaStream*>(stream_)->native_handle(); }

int stream_ordinal(void* native) {
  CudaStream* s = stream_registry().find(static_cast<cudaStream_t>(native));
  ZT_CHECK(s != nullptr, "a CUDA launcher ran on a stream that no CUDA device of this process owns");
  return s->ordinal();
}

bool stream_capturing(void* native) {
  CudaStream* s = stream_registry().find(static_cast<cudaStream_t>(native));
  ZT_CHECK(s != nullptr, "a CUDA launcher ran on a stream that no CUDA device of this process owns");
  return s->capturing();
}

StreamResource& stream_resource(void* native, StreamResourceSlot slot, StreamResourceFactory make) {
  CudaStream* s = stream_registry().find(static_cast<cudaStream_t>(native));
  ZT_CHECK(s != nullptr, "a CUDA launcher ran on a stream that no CUDA device of this process owns");
  return s->resource(slot, make);
}

void profiler_start() { ignore_error(cudaProfilerStart()); }
void profiler_stop() { ignore_error(cudaProfilerStop()); }

CudaAvailability query_availability() {
  CudaAvailability result;
  result.compiled = true;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    int driver = 0;
    int runtime = 0;
    ignore_error(cudaDriverGetVersion(&driver));
    ignore_error(cudaRuntimeGetVersion(&runtime));
    std::string versions = "; driver: " +
                           (driver == 0 ? std::string("none") : "CUDA " + version_text(driver)) +
                           ", runtime: CUDA " + version_text(runtime);
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    if (visible != nullptr) versions += ", CUDA_VISIBLE_DEVICES=\"" + std::string(visible) + "\"";
    // The callers say "no usable GPU (<reason>)"; the reason says what CUDA said and what to do.
    result.reason = std::string("cudaGetDeviceCount failed with ") + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")" + versions;
    if (err == cudaErrorInsufficientDriver)
      result.reason += "; this build's CUDA " + version_text(runtime) +
                       " runtime needs a newer NVIDIA driver: update the driver, or build with the toolkit "
                       "your driver supports";
    return result;
  }
  if (count <= 0) {
    result.reason = "the CUDA runtime reports no device";
    return result;
  }
  result.usable = true;
  result.device_count = count;
  return result;
}

std::vector<std::unique_ptr<Device>> create_devices(const std::vector<int>& requested) {
  const CudaAvailability availability = query_availability();
  if (!availability.usable) ZT_THROW(ErrorKind::kDevice, availability.reason);
  const int count = availability.device_count;

  std::vector<int> ordinals = requested;
  if (ordinals.empty()) {
    for (int i = 0; i < count; ++i) ordinals.push_back(i);
  }
  std::map<int, GpuInfo> gpus;
  for (int ordinal : ordinals) {
    ZT_REQUIRE(ordinal >= 0 && ordinal < count, "the device selection names GPU ", ordinal,
               " but this machine has ", count, " visible GPU(s) (ordinals 0..", count - 1,
               "); pick an existing ordinal or check CUDA_VISIBLE_DEVICES");
    ++gpus[ordinal].share_count;
    if (detail::lost_gpus().lost(ordinal))
      ZT_THROW(ErrorKind::kDevice, "GPU ", ordinal, " cannot be used again in this process: ",
               detail::lost_gpus().why(ordinal), "; relaunch the process (with --resume auto from a checkpoint)");
  }

  for (auto& [ordinal, gpu] : gpus) {
    DeviceGuard guard(ordinal);
    cudaDeviceProp prop{};
    ZT_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
    // Checked here, per GPU: on a machine whose GPUs differ (a display GPU beside the compute ones,
    // which --devices all picks up) an older one would otherwise fail at its first kernel with
    // cudaErrorNoKernelImageForDevice (PTX cannot be compiled for a GPU older than its target).
    // A GPU of 8.0 or newer that this build leaves out (the `gpu` preset's 90 on an A100) runs after
    // a rebuild; older ones are below the project's floor (built and checked for 8.0 and 9.0 only;
    // cuDNN's fused attention, which the 16-bit runs rely on, needs 8.0 too).
    const int cc = prop.major * 10 + prop.minor;
    ZT_REQUIRE(cc >= kMinComputeCapability, "GPU ", ordinal, " (", prop.name, ") has compute capability ",
               prop.major, ".", prop.minor, ", and this build's CUDA kernels need ", kMinComputeCapability / 10, ".",
               kMinComputeCapability % 10, " or newer (ZT_CUDA_ARCHS); leave it out with --devices cuda:<ordinals of "
               "newer GPUs>",
               cc >= 80 ? std::string(", or rebuild with ") + std::to_string(cc) +
                              " in ZT_CUDA_ARCHS (the release preset's 80;90 runs every GPU of 8.0 or newer)"
                        : std::string());
    gpu.major = prop.major;
    gpu.name = std::string(prop.name) + ", compute capability " + std::to_string(prop.major) + "." +
               std::to_string(prop.minor) + ", " + std::to_string(prop.multiProcessorCount) + " SMs";
    // The PCI address names the physical GPU whatever CUDA_VISIBLE_DEVICES renumbered: processes
    // on one host compare device names to find two driving one GPU (train/processes.cc, before
    // NCCL's own duplicate check on host and bus id), and "cuda:0" is another GPU in each process
    // that a launcher gave its own GPU (srun --gpus-per-task=1).
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), ordinal) == cudaSuccess)
      gpu.name += ", PCI " + std::string(bus);
    else
      (void)cudaGetLastError();
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    ZT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    gpu.total_memory = total_bytes;
    int least = 0;
    int greatest = 0;
    ZT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    gpu.priority_normal = least;
    gpu.priority_high = greatest;
  }

  // Peer access between distinct GPUs, both directions, where the hardware allows it.
  for (const auto& [from, from_gpu] : gpus) {
    for (const auto& [to, to_gpu] : gpus) {
      if (from == to || peer_table().enabled(from, to)) continue;
      int can = 0;
      ZT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
      if (!can) continue;
      DeviceGuard guard(from);
      const cudaError_t err = cudaDeviceEnablePeerAccess(to, 0);
      if (err == cudaErrorTooManyPeers || err == cudaErrorPeerAccessUnsupported) {
        // A hardware limit (8 peers), or a pair the platform reports but cannot map (some
        // virtualized and PCIe-switch topologies): copies to `to` go staged, as without P2P.
        (void)cudaGetLastError();
        continue;
      }
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        ZT_CUDA_CHECK(err);
      }
      peer_table().mark(from, to);
    }
  }

  std::vector<std::unique_ptr<Device>> devices;
  std::map<int, int> next_slot;
  for (size_t i = 0; i < ordinals.size(); ++i) {
    const int ordinal = ordinals[i];
    devices.push_back(std::make_unique<CudaDevice>(static_cast<int>(i), ordinal,
                                                   next_slot[ordinal]++, gpus.at(ordinal)));
  }
  return devices;
}

std::unique_ptr<RawAllocator> make_device_raw_allocator(int ordinal, size_t capacity_bytes) {
  return std::make_unique<CudaRawAllocator>(ordinal, capacity_bytes);
}

std::unique_ptr<RawAllocator> make_pinned_host_raw_allocator(int ordinal) {
  return std::make_unique<PinnedHostRawAllocator>(ordinal);
}

int pointer_device(const void* ptr) {
  if (ptr == nullptr) return -1;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) {
    return attributes.device;
  }
  return -1;
}

void set_peer_copy_path(PeerCopyPath path) { g_peer_copy_path.store(path); }
PeerCopyPath peer_copy_path() { return g_peer_copy_path.load(); }

}  // namespace zt::cuda
