// Chunked, double-buffered device <-> host copies through pinned buffers (see host_staging.h).
#include "runtime/host_staging.h"

#include <algorithm>
#include <cstring>

#include "core/status.h"

namespace zt {

HostStaging::HostStaging(Device& device, size_t chunk_bytes) : device_(device), chunk_(chunk_bytes) {
  ZT_REQUIRE(chunk_ > 0, "HostStaging: the chunk size must be positive");
}

HostStaging::~HostStaging() {
  // The device may still read a buffer (the tail of the last to_device); a failed device's events
  // have completed as failed, and its error was reported where the copy was made.
  for (auto& e : done_) {
    if (!e) continue;
    try {
      e->synchronize();
    } catch (...) {
    }
  }
}

void HostStaging::ensure_buffers() {
  if (buf_[0].data() != nullptr) return;
  for (int q = 0; q < kBuffers; ++q) {
    buf_[q] = device_.alloc_host_pinned(chunk_);
    done_[q] = device_.create_event();
  }
}

size_t HostStaging::pinned_bytes() const {
  size_t n = 0;
  for (const auto& b : buf_) n += b.size();
  return n;
}

void HostStaging::to_host(Stream& s, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  ZT_CHECK(&s.device() == &device_, "HostStaging: a stream of ", s.device().name(), " for ", device_.name(), "'s buffers");
  ensure_buffers();
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  const size_t chunks = (bytes + chunk_ - 1) / chunk_;
  // Chunk i goes into buffer i % kBuffers; the host drains chunk i-1 while the device fills chunk i
  // (buffer i % kBuffers was drained one iteration earlier, before its refill was enqueued).
  auto drain = [&](size_t i) {
    const size_t q = i % kBuffers, off = i * chunk_, n = std::min(chunk_, bytes - off);
    done_[q]->synchronize();
    std::memcpy(out + off, buf_[q].data(), n);
  };
  for (size_t i = 0; i < chunks; ++i) {
    const size_t q = i % kBuffers, off = i * chunk_, n = std::min(chunk_, bytes - off);
    s.copy(buf_[q].data(), in + off, n);
    s.record(*done_[q]);
    if (i > 0) drain(i - 1);
  }
  drain(chunks - 1);
}

void HostStaging::to_device(Stream& s, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  ZT_CHECK(&s.device() == &device_, "HostStaging: a stream of ", s.device().name(), " for ", device_.name(), "'s buffers");
  ensure_buffers();
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  for (size_t off = 0, i = 0; off < bytes; off += chunk_, ++i) {
    const size_t q = i % kBuffers, n = std::min(chunk_, bytes - off);
    done_[q]->synchronize();  // the device finished reading this buffer's previous chunk
    std::memcpy(buf_[q].data(), in + off, n);
    s.copy(out + off, buf_[q].data(), n);
    s.record(*done_[q]);
  }
}

}  // namespace zt
