// HostRawAllocator: 256-byte aligned host memory with an optional capacity, the segment source of
// a simulated device's pool.
#include "memory/raw_allocator.h"

#include <cstdlib>
#include <cstring>

namespace zt {

std::atomic<int> HostRawAllocator::fill_{-1};

HostRawAllocator::HostRawAllocator(size_t capacity_bytes) : capacity_(capacity_bytes) {}

void HostRawAllocator::set_fill_for_tests(int byte) { fill_.store(byte >= 0 && byte <= 255 ? byte : -1); }

void* HostRawAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  // aligned_alloc requires a size that is a multiple of the alignment; the pool's segment sizes
  // always are, other callers get the rounding silently (deallocate rounds the same way).
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (rounded < bytes) return nullptr;  // overflow

  // Reserve the capacity first (compare-exchange) so concurrent callers never overshoot it.
  size_t used = in_use_.load(std::memory_order_relaxed);
  for (;;) {
    if (capacity_ != 0 && (rounded > capacity_ || used > capacity_ - rounded)) return nullptr;
    if (in_use_.compare_exchange_weak(used, used + rounded, std::memory_order_relaxed)) break;
  }
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    in_use_.fetch_sub(rounded, std::memory_order_relaxed);
  } else if (const int fill = fill_.load(std::memory_order_relaxed); fill >= 0) {
    std::memset(p, fill, rounded);
  }
  return p;
}

void HostRawAllocator::deallocate(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  std::free(ptr);
  in_use_.fetch_sub(rounded, std::memory_order_relaxed);
}

}  // namespace zt
