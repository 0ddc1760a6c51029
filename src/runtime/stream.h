// Stream: an in-order queue of work on one device, asynchronous to the host (CUDA semantics).
// Every operation returns at once; its effects are visible to the host after synchronize() or
// an event, and to other streams after they wait() on an event recorded after it.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>

#include "runtime/backend.h"

namespace zt {

class Device;
class Event;

class Stream {
 public:
  virtual ~Stream() = default;

  virtual Device& device() = 0;
  virtual Backend backend() const = 0;
  // Small integer, unique among this device's streams (0 = compute, 1 = comm).
  virtual int id() const = 0;

  virtual void record(Event& event) = 0;
  virtual void wait(const Event& event) = 0;
  // Blocks until all submitted work is done. A failure inside that work (a sticky device error)
  // is rethrown here as zt::Error(kDevice).
  virtual void synchronize() = 0;
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
};

}  // namespace zt
