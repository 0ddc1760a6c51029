// CUDA backend behaviour on a real GPU: stream order, events across streams and devices, peer
// copies between logical devices (all three routes), memset, host functions and their errors,
// the pool, and the cast kernel bit for bit against the host conversions. Every test skips itself
// when no usable GPU exists (CI); scripts/gpu-check.sh runs them on a GPU machine.
#include <gtest/gtest.h>

#if ZT_WITH_CUDA

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "kernels/cuda/cast.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/observer.h"

namespace zt {
namespace {

#define ZT_SKIP_WITHOUT_GPU()                                                     \
  do {                                                                            \
    const CudaAvailability zt_availability_ = cuda::query_availability();          \
    if (!zt_availability_.usable) GTEST_SKIP() << zt_availability_.reason;         \
  } while (0)

constexpr size_t kMiB = size_t{1} << 20;

// Pinned host memory, so that device-to-host copies are truly asynchronous and a host function
// observing their result proves ordering.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes)
      : raw_(cuda::make_pinned_host_raw_allocator()), bytes_(bytes), ptr_(raw_->allocate(bytes)) {
    if (ptr_ == nullptr) throw std::runtime_error("cannot allocate pinned host memory");
  }
  ~PinnedBuffer() { raw_->deallocate(ptr_, bytes_); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }

 private:
  std::unique_ptr<RawAllocator> raw_;
  size_t bytes_;
  void* ptr_;
};

// Restores the automatic peer-copy route when a test that forces one ends.
class PeerCopyPathScope {
 public:
  explicit PeerCopyPathScope(cuda::PeerCopyPath path) { cuda::set_peer_copy_path(path); }
  ~PeerCopyPathScope() { cuda::set_peer_copy_path(cuda::PeerCopyPath::kAuto); }
};

std::mt19937_64 make_rng() {
  const uint64_t seed = std::random_device{}();
  std::printf("random seed: %llu\n", static_cast<unsigned long long>(seed));
  return std::mt19937_64(seed);
}

std::vector<uint8_t> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

// Index of the first byte where a and b differ, or -1.
long long first_difference(const uint8_t* a, const uint8_t* b, size_t n) {
  if (std::memcmp(a, b, n) == 0) return -1;
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<long long>(i);
  return -1;
}

long long first_not(const uint8_t* a, uint8_t value, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (a[i] != value) return static_cast<long long>(i);
  return -1;
}

std::unique_ptr<Device> one_device() { return std::move(cuda::create_devices({0}).at(0)); }

TEST(CudaRuntime, CreatesLogicalDevicesSharingOneGpu) {
  ZT_SKIP_WITHOUT_GPU();
  auto devices = cuda::create_devices({0, 0, 0, 0});
  ASSERT_EQ(devices.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    Device& d = *devices[static_cast<size_t>(i)];
    EXPECT_EQ(d.index(), i);
    EXPECT_EQ(d.backend(), Backend::kCuda);
    EXPECT_EQ(d.name().rfind("cuda:0 (", 0), 0u) << d.name();
    EXPECT_NE(d.name().find("[logical " + std::to_string(i) + " of 4 on GPU 0]"),
              std::string::npos)
        << d.name();
    EXPECT_GT(d.total_memory(), 0u);
    EXPECT_EQ(d.compute().id(), 0);
    EXPECT_EQ(d.comm().id(), 1);
    EXPECT_NE(d.compute().native_handle(), nullptr);
    EXPECT_NE(d.compute().native_handle(), d.comm().native_handle());
    EXPECT_EQ(&d.compute().device(), &d);
    EXPECT_FALSE(d.failed());
    for (auto& other : devices) EXPECT_TRUE(d.can_access_peer(*other));
  }
  // A logical device's share of the GPU.
  auto single = one_device();
  EXPECT_EQ(single->name().find("[logical"), std::string::npos) << single->name();
  EXPECT_EQ(devices[0]->total_memory(), single->total_memory() / 4);
  Stream& extra = single->create_stream(StreamPriority::kHigh);
  EXPECT_EQ(extra.id(), 2);
  extra.synchronize();
}

TEST(CudaRuntime, RejectsAMissingOrdinal) {
  ZT_SKIP_WITHOUT_GPU();
  const int count = cuda::query_availability().device_count;
  try {
    cuda::create_devices({count});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("GPU " + std::to_string(count)), std::string::npos) << e.message();
  }
}

TEST(CudaRuntime, StreamExecutesInOrder) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  Stream& s = dev->compute();
  const size_t n = 64 * kMiB;
  DeviceBuffer a(dev->memory(), n, s), b(dev->memory(), n, s), c(dev->memory(), n, s);
  // Each later memset overwrites `a`, so b and c see the right value only if every operation
  // finished before the next began.
  s.memset(a.data(), 0x11, n);
  s.copy(b.data(), a.data(), n);
  s.memset(a.data(), 0x22, n);
  s.copy(c.data(), a.data(), n);
  s.memset(a.data(), 0x33, n);
  PinnedBuffer ha(n), hb(n), hc(n);
  s.copy(ha.data(), a.data(), n);
  s.copy(hb.data(), b.data(), n);
  s.copy(hc.data(), c.data(), n);
  s.synchronize();
  EXPECT_TRUE(s.query());
  EXPECT_EQ(first_not(hb.data(), 0x11, n), -1);
  EXPECT_EQ(first_not(hc.data(), 0x22, n), -1);
  EXPECT_EQ(first_not(ha.data(), 0x33, n), -1);
}

TEST(CudaRuntime, EventOrdersWorkAcrossStreams) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  Stream& producer = dev->compute();
  Stream& consumer = dev->comm();
  const size_t n = 64 * kMiB;
  DeviceBuffer a(dev->memory(), n, producer), b(dev->memory(), n, consumer);
  consumer.memset(b.data(), 0, n);
  consumer.synchronize();

  // The producer is held back on the host, so without the wait the consumer would copy first.
  producer.host_func([] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); });
  producer.memset(a.data(), 0x5a, n);
  auto ready = dev->create_event();
  producer.record(*ready);
  EXPECT_FALSE(ready->query());
  consumer.wait(*ready);
  consumer.copy(b.data(), a.data(), n);
  PinnedBuffer hb(n);
  consumer.copy(hb.data(), b.data(), n);
  consumer.synchronize();
  EXPECT_TRUE(ready->query());
  EXPECT_EQ(first_not(hb.data(), 0x5a, n), -1);

  // A never-recorded event completes at once and waiting on it is a no-op.
  auto fresh = dev->create_event();
  EXPECT_TRUE(fresh->query());
  fresh->synchronize();
  consumer.wait(*fresh);
  consumer.synchronize();

  // Re-recording re-targets the event: synchronize waits for the newest record.
  producer.host_func([] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); });
  producer.record(*ready);
  ready->synchronize();
  EXPECT_TRUE(producer.query());
}

TEST(CudaRuntime, EventOrdersWorkAcrossLogicalDevices) {
  ZT_SKIP_WITHOUT_GPU();
  auto devices = cuda::create_devices({0, 0});
  Device& d0 = *devices[0];
  Device& d1 = *devices[1];
  const size_t n = 32 * kMiB;
  DeviceBuffer a(d0.memory(), n, d0.compute()), b(d1.memory(), n, d1.compute());
  d1.compute().memset(b.data(), 0, n);
  d1.compute().synchronize();

  d0.compute().host_func([] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); });
  d0.compute().memset(a.data(), 0x6b, n);
  auto ready = d0.create_event();
  d0.compute().record(*ready);
  d1.comm().wait(*ready);  // an event of another device
  d1.comm().copy(b.data(), a.data(), n);
  PinnedBuffer hb(n);
  d1.comm().copy(hb.data(), b.data(), n);
  d1.comm().synchronize();
  EXPECT_EQ(first_not(hb.data(), 0x6b, n), -1);
}

// Copies `size` bytes from device i to device j at odd offsets, following the peer-copy rule
// (copy on the source's comm stream, record, consumer waits), and checks the bytes around the
// destination range were not touched.
void check_peer_copy(Device& src_dev, Device& dst_dev, void* src_buf, void* dst_buf, size_t size,
                     const std::vector<uint8_t>& pattern, std::vector<uint8_t>& out) {
  constexpr size_t kSrcOffset = 1;
  constexpr size_t kDstOffset = 3;
  constexpr size_t kSlack = 8;
  constexpr uint8_t kPoison = 0xee;
  auto* src = static_cast<uint8_t*>(src_buf);
  auto* dst = static_cast<uint8_t*>(dst_buf);

  src_dev.compute().copy(src + kSrcOffset, pattern.data(), size);
  dst_dev.compute().memset(dst, kPoison, size + kSlack);
  auto src_ready = src_dev.create_event();
  auto dst_ready = dst_dev.create_event();
  src_dev.compute().record(*src_ready);
  dst_dev.compute().record(*dst_ready);
  src_dev.comm().wait(*src_ready);
  src_dev.comm().wait(*dst_ready);
  src_dev.comm().copy_peer(dst_dev, dst + kDstOffset, src + kSrcOffset, size);
  auto done = src_dev.create_event();
  src_dev.comm().record(*done);
  dst_dev.compute().wait(*done);
  out.assign(size + kSlack, 0);
  dst_dev.compute().copy(out.data(), dst, size + kSlack);
  dst_dev.compute().synchronize();

  const std::string where = src_dev.name() + " -> " + dst_dev.name() + ", " +
                            std::to_string(size) + " bytes";
  EXPECT_EQ(first_difference(out.data() + kDstOffset, pattern.data(), size), -1) << where;
  EXPECT_EQ(first_not(out.data(), kPoison, kDstOffset), -1) << where;
  EXPECT_EQ(first_not(out.data() + kDstOffset + size, kPoison, kSlack - kDstOffset), -1) << where;
}

void run_peer_copies(cuda::PeerCopyPath path) {
  PeerCopyPathScope scope(path);
  auto devices = cuda::create_devices({0, 0, 0, 0});
  const std::vector<size_t> sizes = {1, 3, 4097, 1000003, 64 * kMiB + 1};
  const size_t max_size = sizes.back() + 8;
  std::vector<DeviceBuffer> src, dst;
  for (auto& d : devices) {
    src.emplace_back(d->memory(), max_size, d->compute(), "test src");
    dst.emplace_back(d->memory(), max_size, d->compute(), "test dst");
  }
  auto rng = make_rng();
  std::vector<uint8_t> out;
  for (size_t size : sizes) {
    const std::vector<uint8_t> pattern = random_bytes(rng, size);
    for (size_t i = 0; i < devices.size(); ++i) {
      for (size_t j = 0; j < devices.size(); ++j) {
        if (i == j) continue;
        check_peer_copy(*devices[i], *devices[j], src[i].data(), dst[j].data(), size, pattern,
                        out);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
  for (auto& d : devices) {
    d->synchronize();
    EXPECT_FALSE(d->failed());
  }
}

TEST(CudaRuntime, PeerCopiesBetweenLogicalDevices) {
  ZT_SKIP_WITHOUT_GPU();
  run_peer_copies(cuda::PeerCopyPath::kAuto);
}

TEST(CudaRuntime, PeerCopiesThroughCudaMemcpyPeer) {
  ZT_SKIP_WITHOUT_GPU();
  run_peer_copies(cuda::PeerCopyPath::kPeer);
}

TEST(CudaRuntime, PeerCopiesStagedThroughPinnedMemory) {
  ZT_SKIP_WITHOUT_GPU();
  run_peer_copies(cuda::PeerCopyPath::kStaged);
}

TEST(CudaRuntime, MemsetWritesExactlyItsRange) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  Stream& s = dev->compute();
  const size_t n = 2 * kMiB;
  DeviceBuffer buf(dev->memory(), n, s);
  std::vector<uint8_t> out(n);
  struct Range {
    size_t offset, bytes;
  };
  for (Range r : {Range{0, 1}, Range{1, 3}, Range{7, 4097}, Range{13, 1000003}, Range{0, n},
                  Range{5, 0}}) {
    s.memset(buf.data(), 0x11, n);
    s.memset(buf.as<uint8_t>() + r.offset, 0xab, r.bytes);
    s.copy(out.data(), buf.data(), n);
    s.synchronize();
    const std::string where = "offset " + std::to_string(r.offset) + ", bytes " +
                              std::to_string(r.bytes);
    EXPECT_EQ(first_not(out.data(), 0x11, r.offset), -1) << where;
    EXPECT_EQ(first_not(out.data() + r.offset, 0xab, r.bytes), -1) << where;
    EXPECT_EQ(first_not(out.data() + r.offset + r.bytes, 0x11, n - r.offset - r.bytes), -1)
        << where;
  }
}

TEST(CudaRuntime, HostFunctionsRunInStreamOrder) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  Stream& s = dev->compute();
  const size_t n = 4 * kMiB;
  constexpr int kRounds = 64;
  DeviceBuffer buf(dev->memory(), n, s);
  PinnedBuffer host(n);
  std::vector<int> seen;  // written only by host functions, which one stream runs one at a time
  std::vector<int> first_byte, last_byte;
  for (int i = 0; i < kRounds; ++i) {
    s.memset(buf.data(), i, n);
    s.copy(host.data(), buf.data(), n);
    // Must see the copy just before it, and nothing after it.
    s.host_func([&, i] {
      seen.push_back(i);
      first_byte.push_back(host.data()[0]);
      last_byte.push_back(host.data()[n - 1]);
    });
  }
  s.synchronize();
  ASSERT_EQ(seen.size(), static_cast<size_t>(kRounds));
  for (int i = 0; i < kRounds; ++i) {
    EXPECT_EQ(seen[static_cast<size_t>(i)], i);
    EXPECT_EQ(first_byte[static_cast<size_t>(i)], i);
    EXPECT_EQ(last_byte[static_cast<size_t>(i)], i);
  }
  EXPECT_FALSE(dev->failed());
}

TEST(CudaRuntime, HostFunctionErrorSurfacesAtSynchronize) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  Stream& s = dev->compute();
  bool later_ran = false;
  s.host_func([] { throw std::runtime_error("boom from a host function"); });
  s.host_func([&] { later_ran = true; });
  try {
    s.synchronize();
    FAIL() << "synchronize() did not report the host function's exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDevice);
    EXPECT_NE(e.message().find("boom from a host function"), std::string::npos) << e.message();
  }
  EXPECT_TRUE(later_ran);
  EXPECT_TRUE(dev->failed());
  EXPECT_THROW(s.synchronize(), Error);  // sticky
  EXPECT_THROW(s.query(), Error);
  EXPECT_THROW(dev->synchronize(), Error);
  EXPECT_NO_THROW(dev->comm().synchronize());  // other streams are unaffected
}

TEST(CudaRuntime, PoolAllocatesOnTheGpu) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  Stream& s = dev->compute();
  CachingAllocator& pool = dev->memory();
  const size_t n = 3 * kMiB + 5;
  void* p = pool.allocate(n, s, "test");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(cuda::pointer_device(p), 0);
  std::vector<uint8_t> host(n);
  EXPECT_EQ(cuda::pointer_device(host.data()), -1);
  EXPECT_GE(pool.stats().reserved_bytes, n);
  EXPECT_GE(pool.block_size(p), n);
  s.memset(p, 0x7c, n);
  s.copy(host.data(), p, n);
  s.synchronize();
  EXPECT_EQ(first_not(host.data(), 0x7c, n), -1);
  pool.free(p);
  // Freed on its stream: the same stream gets the cached block back.
  const uint64_t hits = pool.stats().num_cache_hits;
  void* q = pool.allocate(n, s, "test");
  EXPECT_EQ(pool.stats().num_cache_hits, hits + 1);
  EXPECT_EQ(cuda::pointer_device(q), 0);
  pool.free(q);
  s.synchronize();
  pool.empty_cache();
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
}

// The cuBLAS workspace is a pool block of gemm_workspace_bytes(), taken once per stream at its
// first GEMM (what the memory plan counts), and the GEMM still computes the right product.
TEST(CudaRuntime, GemmWorkspaceComesFromThePoolOncePerStream) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  const size_t ws = dev->gemm_workspace_bytes();
  EXPECT_TRUE(ws == 4 * kMiB || ws == 32 * kMiB) << ws;
  CachingAllocator& pool = dev->memory();
  constexpr int64_t N = 3, C = 5, OC = 7;
  std::vector<float> in(N * C), w(OC * C), out(N * OC, NAN);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 7) - 3.0f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 5) * 0.5f - 1.0f;
  auto run = [&](Stream& s) {
    auto* d_in = static_cast<float*>(pool.allocate(in.size() * 4, s, "test"));
    auto* d_w = static_cast<float*>(pool.allocate(w.size() * 4, s, "test"));
    auto* d_out = static_cast<float*>(pool.allocate(out.size() * 4, s, "test"));
    s.copy(d_in, in.data(), in.size() * 4);
    s.copy(d_w, w.data(), w.size() * 4);
    s.synchronize();
    const size_t before = pool.stats().allocated_bytes;
    // The plain cuBLAS path (cuBLASLt, lt_matmul.cu, shares the same per-stream workspace).
    cuda_ops::matmul_forward(s.native_handle(), d_out, d_in, d_w, nullptr, MatmulTypes{}, N, C, OC, false, nullptr);
    s.copy(out.data(), d_out, out.size() * 4);
    s.synchronize();
    const size_t grew = pool.stats().allocated_bytes - before;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) {
        double ref = 0;
        for (int64_t c = 0; c < C; ++c) ref += double{in[n * C + c]} * w[o * C + c];
        EXPECT_EQ(out[n * OC + o], static_cast<float>(ref)) << n << "," << o;  // small integers/halves: exact
      }
    for (void* p : {static_cast<void*>(d_in), static_cast<void*>(d_w), static_cast<void*>(d_out)}) pool.free(p);
    return grew;
  };
  EXPECT_EQ(run(dev->compute()), pool_rounded_size(ws));
  EXPECT_EQ(run(dev->compute()), 0u);  // sized once per stream
  Stream& other = dev->create_stream();
  EXPECT_EQ(run(other), pool_rounded_size(ws));
  EXPECT_GE(pool.stats().reserved_bytes, 2 * ws);
}

// Device::alloc_host_pinned on CUDA: page-locked memory that an async device-to-host copy fills.
TEST(CudaRuntime, HostCopyBuffersArePinned) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  const size_t n = 3 * kMiB + 11;
  PinnedHostBuffer buf = dev->alloc_host_pinned(n);
  ASSERT_NE(buf.data(), nullptr);
  EXPECT_TRUE(buf.pinned());
  EXPECT_EQ(cuda::pointer_device(buf.data()), -1);
  Stream& s = dev->compute();
  void* p = dev->memory().allocate(n, s, "test");
  s.memset(p, 0x3c, n);
  s.copy(buf.data(), p, n);
  s.synchronize();
  EXPECT_EQ(first_not(static_cast<const uint8_t*>(buf.data()), 0x3c, n), -1);
  dev->memory().free(p);
  dev.reset();
  buf.reset();  // after its device: the allocator is shared, not the device's
}

TEST(CudaRuntime, SharedGpuPoolIsCappedAtItsShare) {
  ZT_SKIP_WITHOUT_GPU();
  auto devices = cuda::create_devices({0, 0, 0, 0});
  Device& d = *devices[1];
  const size_t too_much = d.total_memory() + 1024 * kMiB;
  try {
    d.memory().allocate(too_much, d.compute(), "too much");
    FAIL() << "expected out of memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory) << e.what();
  }
  EXPECT_GE(d.memory().stats().num_ooms, 1u);
}

// ---- cast kernel ------------------------------------------------------------------------------

// Runs launch_cast on the GPU from host data and returns the destination bytes; the destination
// is NaN-poisoned first so that unwritten elements fail.
template <typename Out, typename In>
std::vector<Out> gpu_cast(Device& dev, const std::vector<In>& in, DType out_type, DType in_type) {
  Stream& s = dev.compute();
  const size_t n = in.size();
  DeviceBuffer src(dev.memory(), n * sizeof(In), s), dst(dev.memory(), n * sizeof(Out), s);
  s.copy(src.data(), in.data(), n * sizeof(In));
  s.memset(dst.data(), 0xff, n * sizeof(Out));
  launch_cast(s, dst.data(), out_type, src.data(), in_type, n);
  std::vector<Out> out(n);
  s.copy(out.data(), dst.data(), n * sizeof(Out));
  s.synchronize();
  return out;
}

std::vector<uint16_t> all_16bit_patterns() {
  std::vector<uint16_t> v(65536);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(i);
  return v;
}

std::vector<uint32_t> float_bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

TEST(CudaCast, AllHalfPatternsRoundTripBitExact) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  const std::vector<uint16_t> patterns = all_16bit_patterns();
  const std::vector<float> widened = gpu_cast<float>(*dev, patterns, DType::kF32, DType::kF16);
  const std::vector<uint16_t> narrowed = gpu_cast<uint16_t>(*dev, widened, DType::kF16, DType::kF32);
  const std::vector<uint16_t> as_bf16 = gpu_cast<uint16_t>(*dev, patterns, DType::kBF16, DType::kF16);
  int failures = 0;
  for (size_t i = 0; i < patterns.size() && failures < 10; ++i) {
    const float expect = half_bits_to_float(patterns[i]);
    if (float_as_bits(widened[i]) != float_as_bits(expect) ||
        narrowed[i] != float_to_half_bits(expect) || as_bf16[i] != float_to_bf16_bits(expect)) {
      ++failures;
      ADD_FAILURE() << std::hex << "half 0x" << patterns[i] << ": gpu f32 0x"
                    << float_as_bits(widened[i]) << " host 0x" << float_as_bits(expect)
                    << "; back 0x" << narrowed[i] << " host 0x" << float_to_half_bits(expect)
                    << "; bf16 0x" << as_bf16[i] << " host 0x" << float_to_bf16_bits(expect);
    }
  }
}

TEST(CudaCast, AllBf16PatternsRoundTripBitExact) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  const std::vector<uint16_t> patterns = all_16bit_patterns();
  const std::vector<float> widened = gpu_cast<float>(*dev, patterns, DType::kF32, DType::kBF16);
  const std::vector<uint16_t> narrowed =
      gpu_cast<uint16_t>(*dev, widened, DType::kBF16, DType::kF32);
  const std::vector<uint16_t> as_half = gpu_cast<uint16_t>(*dev, patterns, DType::kF16, DType::kBF16);
  int failures = 0;
  for (size_t i = 0; i < patterns.size() && failures < 10; ++i) {
    const float expect = bf16_bits_to_float(patterns[i]);
    if (float_as_bits(widened[i]) != float_as_bits(expect) ||
        narrowed[i] != float_to_bf16_bits(expect) || as_half[i] != float_to_half_bits(expect)) {
      ++failures;
      ADD_FAILURE() << std::hex << "bf16 0x" << patterns[i] << ": gpu f32 0x"
                    << float_as_bits(widened[i]) << " host 0x" << float_as_bits(expect)
                    << "; back 0x" << narrowed[i] << " host 0x" << float_to_bf16_bits(expect)
                    << "; half 0x" << as_half[i] << " host 0x" << float_to_half_bits(expect);
    }
  }
}

TEST(CudaCast, RandomFloatsNarrowBitExact) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  auto rng = make_rng();
  // ~1M values, an odd count so the grid-stride tail is exercised: half are arbitrary bit
  // patterns (NaNs, infinities, subnormals), half span the f16 range and its edges.
  const size_t n = (size_t{1} << 20) + 3;
  std::vector<float> values;
  values.reserve(n);
  for (float edge : {0.0f, -0.0f, 65504.0f, 65519.996f, 65520.0f, -65520.0f, 5.9604645e-8f,
                     2.9802322e-8f, 2.9802326e-8f, 6.1035156e-5f, 6.1035152e-5f,
                     std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                     std::numeric_limits<float>::denorm_min(), std::nanf("")}) {
    values.push_back(edge);
  }
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 18);
  while (values.size() < n / 2) values.push_back(bits_as_float(static_cast<uint32_t>(rng())));
  while (values.size() < n) values.push_back(std::ldexp(mantissa(rng), exponent(rng)));

  const std::vector<uint16_t> half = gpu_cast<uint16_t>(*dev, values, DType::kF16, DType::kF32);
  const std::vector<uint16_t> bf16 = gpu_cast<uint16_t>(*dev, values, DType::kBF16, DType::kF32);
  int failures = 0;
  for (size_t i = 0; i < n && failures < 10; ++i) {
    if (half[i] != float_to_half_bits(values[i]) || bf16[i] != float_to_bf16_bits(values[i])) {
      ++failures;
      ADD_FAILURE() << std::hex << "f32 0x" << float_as_bits(values[i]) << ": gpu half 0x"
                    << half[i] << " host 0x" << float_to_half_bits(values[i]) << "; gpu bf16 0x"
                    << bf16[i] << " host 0x" << float_to_bf16_bits(values[i]);
    }
  }
}

TEST(CudaCast, SameTypeCopiesAndEmptyIsANoOp) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  auto rng = make_rng();
  std::vector<float> values(4099);
  for (float& v : values) v = std::ldexp(static_cast<float>(rng() % 1000) - 500.0f, -3);
  const std::vector<float> out = gpu_cast<float>(*dev, values, DType::kF32, DType::kF32);
  EXPECT_EQ(float_bits(out), float_bits(values));
  launch_cast(dev->compute(), nullptr, DType::kF16, nullptr, DType::kF32, 0);
  dev->compute().synchronize();
}

// ---- fault injection (the wrapper's; the CUDA context itself stays healthy) --------------------

TEST(CudaFault, InjectedErrorFailsEverySynchronizationPoint) {
  ZT_SKIP_WITHOUT_GPU();
  auto dev = one_device();
  dev->compute().synchronize();
  dev->inject_fault(FaultKind::kError);
  EXPECT_TRUE(dev->failed());
  EXPECT_FALSE(dev->hang_injected());
  try {
    dev->synchronize();
    FAIL() << "synchronize() did not report the injected fault";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDevice);
    EXPECT_NE(e.message().find("injected fault"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("cuda:0"), std::string::npos) << e.message();
  }
  EXPECT_THROW(dev->comm().synchronize(), Error);
  EXPECT_THROW(dev->compute().query(), Error);
  EXPECT_THROW(dev->synchronize_for(std::chrono::seconds(10)), Error);
}

// A failed device's synchronize_for reports the failure once its queued work has drained (World's
// destructor frees what that work uses after it returns), and its later host functions are
// skipped (their captures may be gone by the time a recovery's teardown lets them run).
TEST(CudaFault, FailedDeviceDrainsBeforeReportingAndSkipsHostFunctions) {
  ZT_SKIP_WITHOUT_GPU();
  using namespace std::chrono_literals;
  auto dev = one_device();
  std::atomic<bool> started{false}, release{false}, later_ran{false};
  dev->compute().host_func([&] {
    started = true;
    while (!release) std::this_thread::sleep_for(1ms);
  });
  auto done = dev->create_event();
  dev->compute().record(*done);
  while (!started) std::this_thread::sleep_for(1ms);  // running: not skipped by the fault below
  dev->inject_fault(FaultKind::kError);
  dev->compute().host_func([&] { later_ran = true; });
  std::thread releaser([&] {
    std::this_thread::sleep_for(50ms);
    release = true;
  });
  EXPECT_THROW(dev->synchronize_for(std::chrono::seconds(30)), Error);
  EXPECT_TRUE(done->query()) << "synchronize_for reported the failure before the queued work drained";
  releaser.join();
  EXPECT_THROW(dev->compute().synchronize(), Error);
  EXPECT_FALSE(later_ran.load()) << "a host function of a failed device ran";
}

TEST(CudaFault, InjectedHangBlocksUntilAbandoned) {
  ZT_SKIP_WITHOUT_GPU();
  using namespace std::chrono_literals;
  auto devices = cuda::create_devices({0, 0});
  Device& d0 = *devices[0];
  Device& d1 = *devices[1];
  const size_t n = kMiB;
  auto a = std::make_unique<DeviceBuffer>(d0.memory(), n, d0.compute());
  auto b = std::make_unique<DeviceBuffer>(d1.memory(), n, d1.compute());
  d1.compute().synchronize();
  d0.compute().synchronize();

  d0.inject_fault(FaultKind::kHang);
  EXPECT_TRUE(d0.hang_injected());
  std::atomic<bool> hung_ran{false};
  d0.compute().host_func([&] { hung_ran = true; });  // released by abandon(): skipped
  d0.compute().memset(a->data(), 0x5a, n);
  auto after_hang = d0.create_event();
  d0.compute().record(*after_hang);
  d1.compute().wait(*after_hang);
  d1.compute().copy(b->data(), a->data(), n);

  EXPECT_FALSE(d0.synchronize_for(0ms));
  EXPECT_FALSE(d0.compute().synchronize_for(50ms));
  EXPECT_FALSE(d1.compute().synchronize_for(50ms));
  EXPECT_FALSE(after_hang->query());
  EXPECT_FALSE(d0.failed());

  // abandon() and teardown must finish; a deadlock aborts instead of hanging the check.
  auto done = std::async(std::launch::async, [&] {
    d0.abandon("watchdog");
    EXPECT_TRUE(d0.failed());
    EXPECT_FALSE(d0.hang_injected());
    try {
      d0.synchronize();
      ADD_FAILURE() << "synchronize() of an abandoned device did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kDevice);
      EXPECT_NE(e.message().find("watchdog"), std::string::npos) << e.message();
    }
    after_hang->synchronize();  // released: the queued work ran
    EXPECT_FALSE(hung_ran.load()) << "a host function of the abandoned device ran";
    d1.compute().synchronize();
    EXPECT_FALSE(d1.failed());
    a.reset();
    b.reset();
    after_hang.reset();
    devices.clear();
  });
  if (done.wait_for(60s) != std::future_status::ready) {
    std::fprintf(stderr, "DEADLOCK: abandon() of a hung CUDA device did not finish within 60 s\n");
    std::abort();
  }
  done.get();
}

TEST(CudaFault, DestroyingAHungDeviceDoesNotDeadlock) {
  ZT_SKIP_WITHOUT_GPU();
  auto devices = cuda::create_devices({0});
  devices[0]->inject_fault(FaultKind::kHang);
  Stream& extra = devices[0]->create_stream();  // created after the fault: parked too
  EXPECT_FALSE(extra.synchronize_for(std::chrono::milliseconds(20)));
  auto done = std::async(std::launch::async, [&] { devices.clear(); });
  if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "DEADLOCK: destroying a hung CUDA device did not finish within 60 s\n");
    std::abort();
  }
}

// The task observer: every op and copy is bracketed by an event pair and reported, in stream
// order and on the host clock, once the stream is synchronized.
class NamedTasks final : public TaskObserver {
 public:
  struct Task {
    int device, stream;
    std::string name;
    Clock::time_point start, end;
  };
  void on_task(int device, int stream, const char* name, Clock::time_point start, Clock::time_point end) override {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(Task{device, stream, name, start, end});
  }
  std::vector<Task> tasks() {
    std::lock_guard<std::mutex> lock(mu_);
    return tasks_;
  }

 private:
  std::mutex mu_;
  std::vector<Task> tasks_;
};

TEST(CudaObserver, ReportsOpsAndCopiesInStreamOrderAfterSynchronize) {
  ZT_SKIP_WITHOUT_GPU();
  NamedTasks log;
  auto rt = Runtime::create(parse_device_spec("cuda:0x2"), {}, &log);
  Device& d = rt->device(1);
  Stream& s = d.comm();
  constexpr int64_t n = 1 << 20;
  void* buf = d.memory().allocate(n * sizeof(float), s, "observer test");
  PinnedBuffer host(n * sizeof(float));
  const auto before = std::chrono::steady_clock::now();
  s.memset(buf, 0, n * sizeof(float));
  ops::fill(s, TensorView{buf, DType::kF32, Shape{n}, d.index()}, 2.0f);
  s.copy(host.data(), buf, n * sizeof(float));
  s.synchronize();
  const auto after = std::chrono::steady_clock::now();
  float first = 0;
  std::memcpy(&first, host.data(), sizeof(first));
  EXPECT_EQ(first, 2.0f);
  const auto tasks = log.tasks();
  ASSERT_EQ(tasks.size(), 3u);
  const char* names[] = {"memset", "fill", "copy"};
  for (size_t i = 0; i < tasks.size(); ++i) {
    EXPECT_EQ(tasks[i].name, names[i]);
    EXPECT_EQ(tasks[i].device, 1);
    EXPECT_EQ(tasks[i].stream, 1);
    EXPECT_LE(tasks[i].start, tasks[i].end);
    // The anchor's host time is read just after the GPU reached it: allow that latency.
    EXPECT_LE(before - std::chrono::milliseconds(1), tasks[i].start);
    EXPECT_LE(tasks[i].end, after + std::chrono::milliseconds(1));
    if (i > 0) {
      EXPECT_LE(tasks[i - 1].end, tasks[i].start + std::chrono::microseconds(1));
    }
  }
  // Without an observer nothing is recorded.
  rt->set_observer(nullptr);
  s.memset(buf, 0, n * sizeof(float));
  s.synchronize();
  EXPECT_EQ(log.tasks().size(), 3u);
  d.memory().free(buf);
}

}  // namespace
}  // namespace zt

#else  // !ZT_WITH_CUDA

TEST(CudaRuntime, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend (ZT_CUDA=OFF)"; }

#endif
