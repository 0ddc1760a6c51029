// HostStaging: device <-> host copies (snapshots, checkpoint saves and restores) through a device's
// pinned host buffers, reused for every copy: the DMA engine moves page-locked memory at link speed,
// where a copy to pageable memory is bounced through the driver's own small staging buffers.
#pragma once

#include <array>
#include <cstddef>
#include <memory>

#include "memory/pinned_host_buffer.h"
#include "runtime/device.h"

namespace zt {

// Two chunk buffers alternate: while the host copies chunk i between the caller's memory and one
// buffer, the device copies chunk i+1 into (or out of) the other. The buffers are allocated at the
// first copy (Device::alloc_host_pinned) and kept until destruction, so a run holds
// planned_pinned_bytes() per device from its first snapshot, save or restore on, however many follow.
// One owner thread; the device must outlive the object's last copy (destruction waits for the
// device's last read of a buffer and swallows a failed device's error).
class HostStaging {
 public:
  static constexpr size_t kChunkBytes = size_t{4} << 20;
  static constexpr int kBuffers = 2;
  explicit HostStaging(Device& device, size_t chunk_bytes = kChunkBytes);
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Device memory `src` -> host memory `dst` (any host memory), after the work already submitted
  // to `s` (a stream of the device); returns when dst holds the bytes. Throws the device's error.
  void to_host(Stream& s, void* dst, const void* src, size_t bytes);
  // Host memory `src` -> device memory `dst`, ordered on `s` (later work on s sees the bytes);
  // returns once src may be reused or freed (the device may still be copying from the staging
  // buffers: the next copy or the destructor waits for that).
  void to_device(Stream& s, void* dst, const void* src, size_t bytes);

  // Pinned host bytes held now: 0 before the first copy, planned_pinned_bytes() after.
  size_t pinned_bytes() const;
  // What one HostStaging holds once it has copied (memory plans count it per device).
  static size_t planned_pinned_bytes(size_t chunk_bytes = kChunkBytes) { return kBuffers * chunk_bytes; }

 private:
  void ensure_buffers();
  Device& device_;
  size_t chunk_;
  std::array<PinnedHostBuffer, kBuffers> buf_;
  std::array<std::unique_ptr<Event>, kBuffers> done_;  // the device's last use of buffer q
};

}  // namespace zt
