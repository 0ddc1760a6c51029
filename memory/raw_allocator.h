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

  // Tests only: byte (0..255) that fills every block allocate() returns from now on, -1 (the
  // default) none. A GPU pool's cudaMalloc'd segments hold whatever was there, but large host
  // blocks come from mmap as zero pages, so on the CPU backend a kernel reading memory nothing
  // wrote (a gradient accumulated into a buffer nobody zeroed) would silently read zeros; 0xff
  // makes that read a NaN in f32, f16 and bf16 (what compute-sanitizer's initcheck looks for on
  // a GPU). Process-wide; takes effect for blocks allocated after the call.
  static void set_fill_for_tests(int byte);

 private:
  size_t capacity_;
  std::atomic<size_t> in_use_{0};
  static std::atomic<int> fill_;
};

}  // namespace zt
