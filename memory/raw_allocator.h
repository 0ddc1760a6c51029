// Raw allocators: where a device pool gets its segments from (aligned host memory for simulated
// devices, cudaMalloc for GPUs, cudaHostAlloc for pinned staging buffers).
#pragma once

#include <atomic>
#include <cstddef>
#include <string>

namespace zt {

class RawAllocator {
 public:
  virtual ~RawAllocator() = default;
  // Returns nullptr when the memory is not available (never throws for that reason).
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  virtual std::string name() const = 0;
};

// Aligned host memory with an optional capacity, so a simulated device has a finite memory size
// and the pool's out-of-memory path is real on the CPU backend too.
class HostRawAllocator final : public RawAllocator {
 public:
  static constexpr size_t kAlignment = 256;  // as cudaMalloc guarantees
  explicit HostRawAllocator(size_t capacity_bytes = 0 /* 0 = unlimited */);
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) override;
  std::string name() const override { return "host"; }
  size_t in_use() const { return in_use_.load(); }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  std::atomic<size_t> in_use_{0};
};

}  // namespace zt
