// Device: one logical device of the runtime (a simulated CPU device, or a GPU, or a slice of a
// GPU when several logical devices share one physical GPU). Owns its streams and its memory pool.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "runtime/backend.h"
#include "runtime/event.h"
#include "runtime/stream.h"

namespace zt {

class CachingAllocator;

enum class StreamPriority { kNormal, kHigh };

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

  virtual CachingAllocator& memory() = 0;
  virtual bool can_access_peer(const Device& other) const = 0;

  // Waits for every stream of the device; rethrows a sticky error.
  virtual void synchronize() = 0;
  // True once an operation on this device has failed; the device stays failed (sticky).
  virtual bool failed() const = 0;
};

}  // namespace zt
