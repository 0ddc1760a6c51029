// DevicePacker: a free list of device indices; lowest-numbered first keeps the packing the same
// from run to run (a trial's devices do not depend on timing beyond which trials hold which).
#include "sweep/packer.h"

#include "core/status.h"

namespace zt::sweep {

DevicePacker::DevicePacker(int devices) {
  ZT_CHECK(devices >= 1, "a sweep needs at least one device, got ", devices);
  held_.assign(static_cast<size_t>(devices), false);
  free_ = devices;
}

DevicePacker::DevicePacker(DevicePacker&& other) noexcept {
  std::lock_guard<std::mutex> lock(other.mu_);
  held_ = std::move(other.held_);
  free_ = other.free_;
  other.free_ = 0;
}

DevicePacker& DevicePacker::operator=(DevicePacker&& other) noexcept {
  if (this == &other) return *this;
  std::scoped_lock lock(mu_, other.mu_);
  held_ = std::move(other.held_);
  free_ = other.free_;
  other.free_ = 0;
  return *this;
}

std::optional<std::vector<int>> DevicePacker::acquire(int k) {
  std::lock_guard<std::mutex> lock(mu_);
  const int n = static_cast<int>(held_.size());
  ZT_REQUIRE(k >= 1 && k <= n, "A trial needs ", k, k == 1 ? " device" : " devices", " but the sweep has ", n,
             "; give --devices-per-trial between 1 and ", n, ".");
  if (free_ < k) return std::nullopt;
  std::vector<int> got;
  got.reserve(static_cast<size_t>(k));
  for (int d = 0; d < n && static_cast<int>(got.size()) < k; ++d)
    if (!held_[static_cast<size_t>(d)]) got.push_back(d);
  for (const int d : got) held_[static_cast<size_t>(d)] = true;
  free_ -= k;
  return got;
}

void DevicePacker::release(const std::vector<int>& devices) {
  std::lock_guard<std::mutex> lock(mu_);
  const int n = static_cast<int>(held_.size());
  std::vector<bool> named(held_.size(), false);
  for (const int d : devices) {
    ZT_CHECK(d >= 0 && d < n, "release of device ", d, ", outside 0..", n - 1);
    ZT_CHECK(held_[static_cast<size_t>(d)], "release of device ", d, ", which is not held");
    ZT_CHECK(!named[static_cast<size_t>(d)], "release names device ", d, " twice");
    named[static_cast<size_t>(d)] = true;
  }
  for (const int d : devices) held_[static_cast<size_t>(d)] = false;
  free_ += static_cast<int>(devices.size());
}

int DevicePacker::free_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_;
}

bool DevicePacker::is_free(int device) const {
  std::lock_guard<std::mutex> lock(mu_);
  ZT_CHECK(device >= 0 && device < static_cast<int>(held_.size()), "device ", device, " out of range");
  return !held_[static_cast<size_t>(device)];
}

}  // namespace zt::sweep
