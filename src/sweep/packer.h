// Which devices each concurrently running trial of a sweep owns: disjoint subsets of the process's
// devices, handed out lowest-numbered first and returned when the trial ends.
#pragma once

#include <mutex>
#include <optional>
#include <vector>

namespace zt::sweep {

// src/sweep/packer.h — disjoint device subsets for concurrently running trials. Thread-safe.
class DevicePacker {
 public:
  explicit DevicePacker(int devices);  // devices >= 1 (kInternal otherwise)
  DevicePacker(DevicePacker&& other) noexcept;  // movable (a fresh mutex guards the moved state)
  DevicePacker& operator=(DevicePacker&& other) noexcept;
  // The lowest-numbered free devices, k of them, or nullopt when fewer than k are free.
  // Ascending. Throws kInvalidArgument (one sentence) when k < 1 or k > devices: such a request
  // could never be granted.
  std::optional<std::vector<int>> acquire(int k);
  // throws kInternal on a device not held (or named twice, or out of range); nothing is released then.
  void release(const std::vector<int>& devices);
  int free_count() const;

  int devices() const { return static_cast<int>(held_.size()); }
  bool is_free(int device) const;

 private:
  mutable std::mutex mu_;
  std::vector<bool> held_;
  int free_ = 0;
};

}  // namespace zt::sweep
