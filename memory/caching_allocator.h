// Per-device caching allocator (stream-aware), in the manner of PyTorch's CUDACachingAllocator.
// The rules are stated at the top of caching_allocator.cc. It sees streams as PoolStreams
// (memory/pool_stream.h), which the runtime's Stream is, and includes nothing of runtime/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "memory/raw_allocator.h"

namespace zt {

class PoolStream;

struct MemoryStats {
  size_t allocated_bytes = 0;       // bytes in blocks handed out (rounded sizes)
  size_t reserved_bytes = 0;        // bytes in segments obtained from the raw allocator
  size_t peak_allocated_bytes = 0;
  size_t peak_reserved_bytes = 0;
  size_t requested_bytes = 0;       // bytes the callers asked for (unrounded)
  uint64_t num_allocs = 0;          // allocate() calls that succeeded
  uint64_t num_frees = 0;
  uint64_t num_raw_allocs = 0;      // segments obtained from the raw allocator
  uint64_t num_raw_frees = 0;
  uint64_t num_cache_hits = 0;      // allocations served from cached memory
  uint64_t num_ooms = 0;
  size_t active_blocks = 0;
  size_t segments = 0;
};

// The pool's size rules as pure functions, for memory plans (train/plan.h) that must predict what
// the pool will hold: the block a request of `bytes` occupies (0 for 0 bytes, which allocate()
// answers with nullptr), whether that block comes from the small pool (packed into segments of
// pool_small_segment_bytes()), and the segment the pool reserves for a large block when memory is
// tight (the request rounded up to the large-pool granularity; see the fallback chain in the .cc).
size_t pool_rounded_size(size_t bytes);
bool pool_is_small(size_t rounded_bytes);
size_t pool_small_segment_bytes();
size_t pool_large_segment_bytes(size_t rounded_bytes);

class CachingAllocator {
 public:
  CachingAllocator(std::string device_name, std::unique_ptr<RawAllocator> raw);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Returns memory usable by work on `stream` (and, after record_stream, other streams).
  // bytes == 0 returns nullptr. Throws zt::Error(kOutOfMemory) with a report when it cannot.
  // `tag` must be a string literal or otherwise outlive the allocation (used in OOM reports).
  void* allocate(size_t bytes, PoolStream& stream, const char* tag = "untagged");
  // Frees a block; reusable on its allocation stream immediately, by other streams only after
  // the work of every stream passed to record_stream() has completed. Does not throw for a failed
  // device: a stream whose event cannot be recorded keeps the block out of reuse until the pool goes.
  void free(void* ptr);
  // Marks the block as in use by `stream` (record_stream semantics).
  void record_stream(void* ptr, PoolStream& stream);

  // Releases every cached segment that holds no live block back to the raw allocator.
  void empty_cache();
  MemoryStats stats() const;
  void reset_peak_stats();
  // Rounded size of a live block.
  size_t block_size(void* ptr) const;
  // Largest free block currently cached (bytes).
  size_t largest_free_block() const;
  const std::string& device_name() const { return device_name_; }
  RawAllocator& raw() { return *raw_; }

 private:
  struct Impl;
  std::string device_name_;
  std::unique_ptr<RawAllocator> raw_;
  std::unique_ptr<Impl> impl_;
};

// Owning handle to pool memory; frees on destruction (on the allocation stream's terms). A
// borrow()ed one views memory another buffer owns and frees nothing.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(CachingAllocator& pool, size_t bytes, PoolStream& stream, const char* tag = "buffer");
  // A view of `bytes` at `p`, memory another buffer owns (an arena's range): reset forgets it.
  static DeviceBuffer borrow(void* p, size_t bytes);
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return bytes_; }
  void reset();

 private:
  CachingAllocator* pool_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace zt
