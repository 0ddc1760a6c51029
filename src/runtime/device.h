// Device: one logical device of the runtime (a simulated CPU device, or a GPU, or a slice of a
// GPU when several logical devices share one physical GPU). Owns its streams and its memory pool.
//
// Fault tolerance: a test or the trainer can make one device fail on purpose (inject_fault), in
// the two ways a real GPU fails, and the process can give up on a device (abandon) so that every
// thread blocked on it, host threads, its own stream workers and other devices' streams waiting
// on its events, is released and the device can be destroyed. Failures surface as
// zt::Error(kDevice) at the synchronization points (synchronize, synchronize_for, query).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "memory/pinned_host_buffer.h"
#include "runtime/backend.h"
#include "runtime/event.h"
#include "runtime/observer.h"
#include "runtime/stream.h"

namespace zt {

class CachingAllocator;

enum class StreamPriority { kNormal, kHigh };

// How a device's ops may round, as torch's allow_tf32: a property of the device, not an argument
// of every op. Set it while no op that should see the change is being enqueued (the trainer sets
// it once, before the first step); each op reads it when it is enqueued.
struct MathMode {
  // fp32 matrix products (matmul_forward/backward) round both GEMM inputs to TF32 (10-bit
  // mantissa, round to nearest even) and accumulate in fp32: tensor cores on CUDA
  // (CUBLAS_COMPUTE_32F_FAST_TF32), the same rounding point before OpenBLAS on the CPU backend.
  // On CUDA the fp32 attention's GEMMs (kernels/cuda/gemm_attention.cu) take TF32 too; the CPU
  // backend's attention stays fp32.
  bool tf32 = false;
  // --deterministic-attention: a library's fused attention backward (cuDNN's SDPA on CUDA) uses its
  // deterministic algorithm, bitwise reproducible run to run, at the price of a larger workspace
  // (kernels/ops.h cudnn_attention_workspace_formula). Off: its faster non-deterministic one (fp32
  // atomics in dQ). ZeroTrain's own kernels are deterministic either way.
  bool deterministic_attention = true;
  // 16-bit matrix products must have every dimension a multiple of 8 and every operand 16-byte
  // aligned (kernels/ops.h "GEMM tiles"): the shapes on which cuBLASLt runs tensor-core tiles with
  // 16-byte loads. The ops refuse any other with one sentence naming the op and the shape, on every
  // backend, so CI (no GPU) fails where a GPU would silently take a slow path.
  bool gemm_tiles = false;
};

enum class FaultKind {
  kError,  // the device reports an error, as a GPU with a sticky error (Xid) does
  kHang,   // the device stops answering: its work does not complete until abandon()
};
inline const char* fault_kind_name(FaultKind kind) { return kind == FaultKind::kError ? "error" : "hang"; }

class Device {
 public:
  virtual ~Device() = default;

  virtual int index() const = 0;  // logical index within the runtime: 0..N-1
  virtual Backend backend() const = 0;
  // "cpu:1", "cuda:0 (NVIDIA H200)"; logical devices sharing a GPU say so.
  virtual std::string name() const = 0;
  virtual size_t total_memory() const = 0;  // bytes the pool may reserve

  virtual Stream& compute() = 0;
  virtual Stream& comm() = 0;  // collectives run here, overlapping compute
  // A further stream, owned by the device and valid for its lifetime.
  virtual Stream& create_stream(StreamPriority priority = StreamPriority::kNormal) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  // An event that can also time work (Event::seconds_since), e.g. the optimizer's span of a step
  // without a host synchronisation; on CUDA slightly dearer to record. Default: create_event().
  virtual std::unique_ptr<Event> create_timing_event() { return create_event(); }

  virtual CachingAllocator& memory() = 0;
  virtual bool can_access_peer(const Device& other) const = 0;

  // Bytes of GEMM-library workspace (cuBLAS) that each stream running matrix products takes from
  // this device's pool, once, at its first product, and hands back when the stream is destroyed.
  // The memory plan counts it (train/plan.h); the CUDA launchers size the workspace from it.
  // 0 on the CPU backend (OpenBLAS needs none from the pool).
  virtual size_t gemm_workspace_bytes() const { return 0; }

  // Host memory for this device's asynchronous device<->host copies (snapshot and checkpoint
  // staging): page-locked (cudaHostAlloc) on CUDA, so a copy is DMA without a pageable bounce;
  // 256-byte aligned host memory on the CPU backend. Not zero-filled. The buffer may outlive the
  // device. Throws zt::Error(kOutOfMemory) when the host cannot provide `bytes`; 0 bytes gives an
  // empty buffer.
  virtual PinnedHostBuffer alloc_host_pinned(size_t bytes);

  // Waits for every stream of the device; rethrows a sticky error.
  virtual void synchronize() = 0;
  // synchronize() that gives up after `timeout` (a watchdog's building block): false when work
  // is still pending then (nothing is cancelled); rethrows a sticky error like synchronize().
  virtual bool synchronize_for(std::chrono::milliseconds timeout) = 0;
  // True once an operation on this device has failed; the device stays failed (sticky).
  virtual bool failed() const = 0;

  MathMode math_mode() const {
    return MathMode{tf32_.load(std::memory_order_relaxed), deterministic_attention_.load(std::memory_order_relaxed),
                    gemm_tiles_.load(std::memory_order_relaxed)};
  }
  void set_math_mode(const MathMode& mode) {
    tf32_.store(mode.tf32, std::memory_order_relaxed);
    deterministic_attention_.store(mode.deterministic_attention, std::memory_order_relaxed);
    gemm_tiles_.store(mode.gemm_tiles, std::memory_order_relaxed);
  }

  // Where this device reports its stream work (nullptr: nowhere; then tracing costs one atomic
  // load per task). Runtime::set_observer sets it on every device; call it while the device is
  // idle, and keep the observer alive until it is replaced or the device is destroyed.
  virtual void set_task_observer(TaskObserver* observer) = 0;

  // ---- fault injection and abandonment ---------------------------------------------------------
  // From now on the device fails; callable from any thread.
  //  kError: the next operation on any stream of the device fails, and the device is failed as by
  //    a real error (sticky; later operations are skipped): synchronize() throws zt::Error(kDevice)
  //    naming the device and "injected fault". Work completed before is unaffected. On the CPU
  //    backend the error surfaces at the next operation to start or the next synchronization
  //    point, whichever comes first (failed() turns true then); on CUDA failed() is true at once.
  //  kHang: the device stops answering. Its next (non-control) operation on any stream blocks and
  //    does not complete, events recorded after it never complete, synchronize() blocks
  //    (synchronize_for() times out) — until abandon(). Streams of other devices that wait on such
  //    an event are stuck as well, as on a GPU.
  // Default: throws zt::Error(kInvalidArgument) (the backend cannot inject faults).
  virtual void inject_fault(FaultKind kind);
  // True after inject_fault(kHang) until abandon(). The Runtime's destructor abandons such a
  // device, so that tearing down a runtime with a hung device cannot deadlock.
  virtual bool hang_injected() const { return false; }
  // The process gives up on the device (a watchdog declared it hung, or recovery drops it). The
  // device becomes failed with `why` (unless it failed before: the first error stays), every
  // blocked or queued operation of it is released and fails, and every synchronize() on it throws
  // zt::Error(kDevice) instead of blocking, so its host threads and stream workers can be joined
  // and the device destroyed. Events recorded on it complete (as failed), so streams of *other*
  // devices waiting on them proceed: those devices are not failed, but the data they waited for
  // is garbage — the caller must discard every state the abandoned device contributed to (the
  // trainer rebuilds it from a checkpoint). Idempotent; callable from any thread. What abandon()
  // cannot release: user code blocked inside a host function, and (CUDA) a host thread blocked
  // inside the CUDA runtime on a GPU that is truly stuck.
  // Default: nothing to release (the backend cannot inject faults).
  virtual void abandon(const std::string& why);

 private:
  std::atomic<bool> tf32_{false};
  std::atomic<bool> deterministic_attention_{true};
  std::atomic<bool> gemm_tiles_{false};
};

}  // namespace zt
