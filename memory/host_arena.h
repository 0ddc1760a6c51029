// The host arena of optimizer offload: where one rank's offloaded fp32 master shard, moments and
// gradient/parameter staging live (pinned memory on CUDA, plain aligned memory on the CPU backend),
// apart from the device pool, so --device-memory caps only device bytes. Counts bytes and a peak.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "core/status.h"
#include "memory/raw_allocator.h"

namespace zt {

class HostArena {
 public:
  // raw: where the bytes come from (nullptr: unlimited aligned host memory).
  explicit HostArena(std::unique_ptr<RawAllocator> raw = nullptr)
      : raw_(raw ? std::move(raw) : std::make_unique<HostRawAllocator>()) {}
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Zero-filled memory (the padding of offloaded shards must stay +0, as on the device); bytes as
  // requested are counted, not the allocator's rounding, so the plan can predict them exactly.
  void* allocate(size_t bytes, const char* what) {
    if (bytes == 0) return nullptr;
    void* p = raw_->allocate(bytes);
    if (p == nullptr)
      ZT_THROW(ErrorKind::kOutOfMemory, "host memory (", raw_->name(), ") could not provide ", bytes, " bytes for ",
               what, "; lower --offload-fraction or free host memory");
    std::memset(p, 0, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void deallocate(void* p, size_t bytes) {
    if (p == nullptr) return;
    raw_->deallocate(p, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    in_use_ -= bytes;
  }
  size_t in_use() const {
    std::lock_guard<std::mutex> lock(mu_);
    return in_use_;
  }
  size_t peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }

 private:
  std::unique_ptr<RawAllocator> raw_;
  mutable std::mutex mu_;
  size_t in_use_ = 0, peak_ = 0;
};

// One allocation of a HostArena, freed when it goes.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(HostArena& arena, size_t bytes, const char* what)
      : arena_(&arena), ptr_(arena.allocate(bytes, what)), bytes_(ptr_ ? bytes : 0) {}
  ~HostBuffer() { reset(); }
  HostBuffer(HostBuffer&& o) noexcept { *this = std::move(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      arena_ = std::exchange(o.arena_, nullptr);
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return bytes_; }
  void reset() {
    if (arena_ && ptr_) arena_->deallocate(ptr_, bytes_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  HostArena* arena_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace zt
