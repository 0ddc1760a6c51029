// HostStaging (runtime/host_staging.h), the pinned chunked copies of snapshots and checkpoints: exact
// bytes both ways at edge sizes around the chunk, ordering after and before the stream's own work,
// the pinned bytes it holds (what `zerotrain plan` counts), on the CPU backend and on a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/status.h"
#include "memory/caching_allocator.h"
#include "runtime/host_staging.h"
#include "runtime/runtime.h"

#if ZT_WITH_CUDA
#include "runtime/cuda/cuda_backend.h"
#endif

namespace zt {
namespace {

struct Backed {
  std::unique_ptr<Runtime> cpu;
  std::unique_ptr<Device> gpu;
  Device& device() { return gpu ? *gpu : cpu->device(0); }
};

// The device of `b`, or a skip reason.
bool make_device(Backend b, Backed* out, std::string* why) {
  if (b == Backend::kCpu) {
    out->cpu = Runtime::create_cpu(1);
    return true;
  }
#if ZT_WITH_CUDA
  const CudaAvailability a = cuda::query_availability();
  if (!a.usable) return *why = a.reason, false;
  out->gpu = std::move(cuda::create_devices({0}).at(0));
  return true;
#else
  *why = "built without the CUDA backend (ZT_CUDA=OFF)";
  return false;
#endif
}

class HostStagingTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    std::string why;
    if (!make_device(GetParam(), &backed_, &why)) GTEST_SKIP() << why;
  }
  Device& dev() { return backed_.device(); }
  Backed backed_;
};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Sizes around the chunk: none, one byte, a chunk ± 1, exactly two (both buffers), and an odd
// count of chunks with a tail, at a small chunk so each case is many chunks.
TEST_P(HostStagingTest, RoundTripsEveryByteAtEdgeSizes) {
  constexpr size_t kChunk = 4096 + 64;
  HostStaging staging(dev(), kChunk);
  EXPECT_EQ(staging.pinned_bytes(), 0u);
  Stream& s = dev().compute();
  for (size_t n : {size_t{0}, size_t{1}, kChunk - 1, kChunk, kChunk + 1, 2 * kChunk, 7 * kChunk + 333}) {
    SCOPED_TRACE(n);
    const std::vector<uint8_t> in = random_bytes(n, static_cast<uint32_t>(n) + 1);
    void* d = dev().memory().allocate(n + 1, s, "staging test");
    staging.to_device(s, d, in.data(), n);
    std::vector<uint8_t> out(n + 1, 0xa5);  // one byte past the end stays untouched
    staging.to_host(s, out.data(), d, n);
    if (n > 0) {  // memcmp of an empty vector's null data is UB
      EXPECT_EQ(std::memcmp(out.data(), in.data(), n), 0);
    }
    EXPECT_EQ(out[n], 0xa5);
    dev().memory().free(d);
  }
  EXPECT_EQ(staging.pinned_bytes(), HostStaging::planned_pinned_bytes(kChunk));
}

// to_host copies what the stream's earlier work wrote (a memset enqueued just before); to_device's
// bytes are what the stream's later work reads, and the caller's buffer may be reused at once.
TEST_P(HostStagingTest, OrderedAfterAndBeforeTheStreamsWork) {
  constexpr size_t kChunk = 1000;
  const size_t n = 5 * kChunk + 17;
  HostStaging staging(dev(), kChunk);
  Stream& s = dev().compute();
  void* a = dev().memory().allocate(n, s, "staging test");
  void* b = dev().memory().allocate(n, s, "staging test");
  s.memset(a, 0x5c, n);
  std::vector<uint8_t> out(n, 0);
  staging.to_host(s, out.data(), a, n);
  EXPECT_EQ(out, std::vector<uint8_t>(n, 0x5c));
  std::vector<uint8_t> in = random_bytes(n, 9);
  const std::vector<uint8_t> expect = in;
  staging.to_device(s, a, in.data(), n);
  std::fill(in.begin(), in.end(), 0);  // reused at once: the device must not read it any more
  s.copy(b, a, n);                      // later work on the stream sees the staged bytes
  staging.to_host(s, out.data(), b, n);
  EXPECT_EQ(out, expect);
  dev().memory().free(a);
  dev().memory().free(b);
}

TEST_P(HostStagingTest, UsesTheDevicesPinnedBuffersAndRefusesAnotherDevicesStream) {
  HostStaging staging(dev());
  std::vector<uint8_t> out(16);
  Stream& s = dev().compute();
  void* d = dev().memory().allocate(16, s, "staging test");
  s.memset(d, 1, 16);
  staging.to_host(s, out.data(), d, 16);
  EXPECT_EQ(staging.pinned_bytes(), 2 * HostStaging::kChunkBytes);
  auto other = Runtime::create_cpu(1);
  EXPECT_THROW(staging.to_host(other->device(0).compute(), out.data(), d, 16), Error);
  dev().memory().free(d);
}

INSTANTIATE_TEST_SUITE_P(Backends, HostStagingTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

}  // namespace
}  // namespace zt
