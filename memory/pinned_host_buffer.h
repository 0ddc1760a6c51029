// PinnedHostBuffer: owning handle to host memory for asynchronous device<->host copies (snapshots,
// checkpoints), page-locked on CUDA so the copies are DMA rather than staged through pageable pages.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>

#include "memory/raw_allocator.h"

namespace zt {

class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  // Takes `ptr` (from raw->allocate(bytes)); the allocator is shared so that a buffer may outlive
  // the device that handed it out (a snapshot kept across a recovery rebuild).
  PinnedHostBuffer(void* ptr, size_t bytes, std::shared_ptr<RawAllocator> raw, bool pinned)
      : ptr_(ptr), bytes_(bytes), raw_(std::move(raw)), pinned_(pinned) {}
  ~PinnedHostBuffer() { reset(); }
  PinnedHostBuffer(PinnedHostBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), raw_(std::move(o.raw_)),
        pinned_(o.pinned_) {}
  PinnedHostBuffer& operator=(PinnedHostBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      raw_ = std::move(o.raw_);
      pinned_ = o.pinned_;
    }
    return *this;
  }
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  // Page-locked (cudaHostAlloc); false for the CPU backend's aligned memory.
  bool pinned() const { return pinned_; }
  void reset() {
    if (ptr_ != nullptr && raw_) raw_->deallocate(ptr_, bytes_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  std::shared_ptr<RawAllocator> raw_;
  bool pinned_ = false;
};

}  // namespace zt
