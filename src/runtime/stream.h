// Stream: an in-order queue of work on one device, asynchronous to the host (CUDA semantics).
// Every operation returns at once; its effects are visible to the host after synchronize() or
// an event, and to other streams after they wait() on an event recorded after it.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "memory/pool_stream.h"
#include "runtime/backend.h"

namespace zt {

class Device;
class Event;
class Stream;

// Stream capture (CUDA graphs). Between begin_capture() and end_capture() a stream records the
// work submitted to it instead of running it; end_capture() returns that work as a StreamGraph,
// whose launch() enqueues all of it again, in order, as one unit. Arguments are captured by value
// when the work is submitted (CUDA bakes kernel parameters into the graph): a replay reads and
// writes the same addresses with the same scalars, so whatever those addresses hold must stay
// allocated, and the same, for as long as the graph may be launched.
//
// The rules are CUDA's (cudaStreamCaptureModeThreadLocal) plus a few stricter ones of ours, on
// both backends, from one table with the CUDA error each gives (core/capture_rules.h):
//  - no synchronize(), synchronize_for() or query() of a capturing stream, and no
//    Device::synchronize() of its device;
//  - on the thread that began a capture still in progress, for any stream or device: no new
//    memory from a raw allocator (the pool serves other streams from its cache only), no pool
//    segment released, no alloc_host_pinned(), no Event::query() or synchronize(); other threads
//    are unaffected (thread-local mode). end_capture() must come from that thread too;
//  - no pool allocation for, and no pool free of a block of, a capturing stream (the address would
//    be baked into the graph while the pool hands the memory out again): CachingAllocator refuses;
//  - only single-stream captures: record() and wait() on a capturing stream fail the capture. CUDA
//    could fork another stream into the capture through an event (and join it back); we do not,
//    because every event our callers use either orders work against another stream (a fork or a
//    join we would have to track) or is read by the host (which a captured record never
//    completes). A wait on an event recorded before the capture CUDA refuses as well
//    (cudaErrorStreamCaptureIsolation). Work that must talk to another stream stays outside the
//    capture: capture the pieces between such points (see train/graph_step.h);
//  - copies, memsets, host functions and kernels are captured.
// A violation fails the capture: the call that broke a rule throws CaptureError (a
// zt::Error(kInvalidArgument) naming the rule and CUDA's error) or, for record/wait and a pool
// free, fails it silently; from then on work submitted to the stream throws (CUDA's
// cudaErrorStreamCaptureInvalidated), and end_capture() throws it with the first reason; the
// stream is then out of capture mode and usable again, with nothing of the failed capture run.
class StreamGraph {
 public:
  virtual ~StreamGraph() = default;
  // Enqueues the captured work on `s`, which must be a stream of the device it was captured on
  // (not necessarily the same stream). Returns at once, like any stream operation.
  virtual void launch(Stream& s) = 0;
  // Operations captured (kernels, copies, memsets, host functions).
  virtual size_t size() const = 0;
};

// A PoolStream (memory/pool_stream.h): the pool, a layer below, ties its blocks to streams and
// makes the few calls it needs through that interface.
class Stream : public PoolStream {
 public:
  virtual Device& device() = 0;
  virtual Backend backend() const = 0;
  // Small integer, unique among this device's streams (0 = compute, 1 = comm).
  int id() const override = 0;

  virtual void record(Event& event) = 0;
  virtual void wait(const Event& event) = 0;
  // Blocks until all submitted work is done. A failure inside that work (a sticky device error)
  // is rethrown here as zt::Error(kDevice).
  void synchronize() override = 0;
  // synchronize() that gives up after `timeout` (a watchdog's building block): false when work
  // is still pending then (nothing is cancelled); rethrows a sticky device error like synchronize().
  virtual bool synchronize_for(std::chrono::milliseconds timeout) = 0;
  // True when all submitted work is done; rethrows a sticky device error like synchronize().
  virtual bool query() = 0;

  // Copies within this device or between host memory and this device.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Peer copy from this stream's device to `dst_device`, ordered on this stream. The rule for
  // callers: copy on the source device's stream, record an event, make the consumer wait on it.
  virtual void copy_peer(Device& dst_device, void* dst, const void* src, size_t bytes) = 0;
  virtual void memset(void* dst, int value, size_t bytes) = 0;
  // Runs fn on a host thread once all earlier work on this stream is done; later work waits
  // for it (cudaLaunchHostFunc). fn must not synchronize this stream. An exception thrown by fn
  // becomes a sticky device error.
  virtual void host_func(std::function<void()> fn) = 0;

  // cudaStream_t for the CUDA backend, nullptr for the CPU backend.
  virtual void* native_handle() = 0;

  // Stream capture (see StreamGraph above). begin_capture() throws zt::Error(kInvalidArgument)
  // when the stream is capturing already or the backend cannot capture.
  virtual void begin_capture();
  virtual std::unique_ptr<StreamGraph> end_capture();
  // True between begin_capture() and end_capture(); callable from any thread (the pool asks).
  bool capturing() const override { return false; }
  // Fails the capture in progress with `why` (the first reason wins); no-op when not capturing.
  void invalidate_capture(const std::string& why) override { (void)why; }

  // For the pool's cross-stream frees: device().create_event(), recorded here (so on a capturing
  // stream it fails the capture as record() does).
  std::shared_ptr<PoolEvent> record_new_event() final;
};

}  // namespace zt
