// Tests of the per-device caching pool: a randomized model check over several streams, the size,
// split and coalescing rules, stream-aware reuse, the OOM fallback chain and report, statistics,
// thread safety and DeviceBuffer.
#include <gtest/gtest.h>

#include "sanitizer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/capture_rules.h"
#include "core/status.h"
#include "memory/caching_allocator.h"
#include "memory/pool_stream.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
// Mirrors of the pool's rules (memory/caching_allocator.cc).
constexpr size_t kMinBlock = 512;
constexpr size_t kSmall = 1 * kMiB;

constexpr bool kSanitized = test::kSanitized;

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

// A raw allocator that fails on demand: a capacity (through HostRawAllocator) and a switch.
class FailingRawAllocator final : public RawAllocator {
 public:
  explicit FailingRawAllocator(size_t capacity) : inner_(capacity) {}
  void* allocate(size_t bytes) override {
    calls_.fetch_add(1);
    if (fail_.load()) return nullptr;
    return inner_.allocate(bytes);
  }
  void deallocate(void* ptr, size_t bytes) override { inner_.deallocate(ptr, bytes); }
  std::string name() const override { return "failing-host"; }
  void set_fail(bool fail) { fail_.store(fail); }
  size_t in_use() const { return inner_.in_use(); }
  int calls() const { return calls_.load(); }

 private:
  HostRawAllocator inner_;
  std::atomic<bool> fail_{false};
  std::atomic<int> calls_{0};
};

// Holds a stream's worker in a host function until opened; opens itself on destruction so a
// failing test never leaves a worker blocked forever.
class Gate {
 public:
  Gate() : future_(promise_.get_future().share()) {}
  ~Gate() { open(); }
  void block(Stream& s) {
    std::shared_future<void> f = future_;
    s.host_func([f] { f.wait(); });
  }
  void open() {
    if (!opened_.exchange(true)) promise_.set_value();
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_;
  std::atomic<bool> opened_{false};
};

struct PoolWithRaw {
  HostRawAllocator* raw;
  std::unique_ptr<CachingAllocator> pool;
};
PoolWithRaw make_pool(const std::string& name, size_t capacity = 0) {
  auto raw = std::make_unique<HostRawAllocator>(capacity);
  HostRawAllocator* r = raw.get();
  return {r, std::make_unique<CachingAllocator>(name, std::move(raw))};
}

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + bn && pb < pa + an;
}

// ---- (1) randomized model check ----------------------------------------------

// Live intervals [start, end); insert() reports whether the new one overlaps an existing one.
class IntervalSet {
 public:
  bool insert(uintptr_t a, uintptr_t b) {
    auto next = map_.lower_bound(a);
    if (next != map_.end() && next->first < b) return false;
    if (next != map_.begin() && std::prev(next)->second > a) return false;
    map_.emplace(a, b);
    return true;
  }
  void erase(uintptr_t a) { map_.erase(a); }

 private:
  std::map<uintptr_t, uintptr_t> map_;
};

size_t log_uniform(std::mt19937_64& rng, size_t lo, size_t hi) {
  std::uniform_real_distribution<double> u(std::log(static_cast<double>(lo)), std::log(static_cast<double>(hi)));
  return std::clamp(static_cast<size_t>(std::exp(u(rng))), lo, hi);
}

// 1 B .. 40 MiB, skewed small, with the edges of every rule mixed in.
size_t random_size(std::mt19937_64& rng) {
  static const size_t kEdges[] = {1,          511,          512,          513,          4099,
                                  kSmall - 1, kSmall,       kSmall + 1,   2 * kMiB,     2 * kMiB + 1,
                                  10 * kMiB - 1, 10 * kMiB, 10 * kMiB + 1, 20 * kMiB - 512, 20 * kMiB + 1};
  const double u = std::uniform_real_distribution<double>(0, 1)(rng);
  if (u < 0.10) return kEdges[rng() % std::size(kEdges)];
  if (u < 0.70) return log_uniform(rng, 1, 64 * kKiB);
  if (u < 0.93) return log_uniform(rng, 64 * kKiB, 2 * kMiB);
  return log_uniform(rng, 2 * kMiB, 40 * kMiB);
}

// Fills a block with its pattern (proves it is writable over the requested size) or checks it
// (a sample, for large blocks), counting mismatches.
void fill(void* p, size_t n, uint8_t v) { std::memset(p, v, n); }
void verify(const void* p, size_t n, uint8_t v, std::atomic<int>& errors) {
  const auto* b = static_cast<const uint8_t*>(p);
  const size_t stride = n <= 64 * kKiB ? 1 : 4093;
  for (size_t i = 0; i < n; i += stride) {
    if (b[i] != v) {
      errors.fetch_add(1);
      return;
    }
  }
  if (b[n - 1] != v) errors.fetch_add(1);
}

struct LiveBlock {
  void* ptr;
  size_t bytes;
  size_t block;
  Stream* stream;
  uint8_t pattern;
  std::vector<Stream*> users;  // other streams that used it (record_stream)
};

// Freed while other streams still had work on it: no allocation may overlap it until that work
// has run (`remaining` reaches 0 in the last host function on each user stream).
struct InFlight {
  uintptr_t start, end;
  std::shared_ptr<std::atomic<int>> remaining;
};

void random_ops(uint64_t seed, int ops) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto rt = Runtime::create_cpu(1);
  Device& dev = rt->device(0);
  std::vector<Stream*> streams = {&dev.compute(), &dev.comm(), &dev.create_stream()};
  auto [raw, pool] = make_pool("cpu:model");
  std::mt19937_64 rng(seed);
  std::atomic<int> errors{0};

  std::vector<LiveBlock> live;
  std::vector<InFlight> in_flight;
  IntervalSet intervals;
  std::vector<std::unique_ptr<Gate>> gates;  // closed gates, opened some ops later
  int gate_opens_at = -1;
  size_t model_allocated = 0, model_requested = 0;
  uint8_t next_pattern = 1;
  const size_t kMaxLive = 40;
  // On an early return (a failed ASSERT) queued work still uses the pool's memory and `errors`:
  // let it finish before they go away.
  struct Drain {
    std::vector<std::unique_ptr<Gate>>& gates;
    Device& dev;
    ~Drain() {
      for (auto& g : gates) g->open();
      dev.synchronize();
    }
  } drain{gates, dev};

  auto check_stats = [&] {
    const MemoryStats s = pool->stats();
    ASSERT_EQ(s.allocated_bytes, model_allocated);
    ASSERT_EQ(s.requested_bytes, model_requested);
    ASSERT_EQ(s.active_blocks, live.size());
    ASSERT_EQ(s.num_allocs - s.num_frees, live.size());
    ASSERT_GE(s.reserved_bytes, s.allocated_bytes);
    ASSERT_GE(s.peak_allocated_bytes, s.allocated_bytes);
    ASSERT_GE(s.peak_reserved_bytes, s.reserved_bytes);
    ASSERT_EQ(s.reserved_bytes, raw->in_use());
    ASSERT_EQ(s.num_raw_allocs - s.num_raw_frees, s.segments);
    ASSERT_LE(s.num_cache_hits, s.num_allocs);
  };

  for (int op = 0; op < ops; ++op) {
    if (op == gate_opens_at) {
      for (auto& g : gates) g->open();
      gates.clear();
    }
    // Now and then hold a stream's worker for a while, so frees recorded on it stay pending.
    if (gates.empty() && op % 150 == 0) {
      gates.push_back(std::make_unique<Gate>());
      gates.back()->block(*streams[rng() % streams.size()]);
      gate_opens_at = op + 40;
    }
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    if (live.empty() || (live.size() < kMaxLive && u < 0.5)) {
      const size_t bytes = random_size(rng);
      Stream& s = *streams[rng() % streams.size()];
      void* p = pool->allocate(bytes, s, "model");
      ASSERT_NE(p, nullptr);
      const size_t block = pool->block_size(p);
      ASSERT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
      ASSERT_GE(block, round_up(bytes, kMinBlock));
      ASSERT_EQ(block % kMinBlock, 0u);
      const auto start = reinterpret_cast<uintptr_t>(p);
      ASSERT_TRUE(intervals.insert(start, start + block)) << "live blocks overlap at op " << op;
      for (auto it = in_flight.begin(); it != in_flight.end();) {
        if (it->start < start + block && start < it->end) {
          ASSERT_EQ(it->remaining->load(std::memory_order_acquire), 0)
              << "memory reused while another stream still used it, op " << op;
          it = in_flight.erase(it);
        } else {
          ++it;
        }
      }
      const uint8_t pattern = next_pattern;
      next_pattern = static_cast<uint8_t>(next_pattern % 250 + 1);
      s.host_func([p, bytes, pattern] { fill(p, bytes, pattern); });
      live.push_back({p, bytes, block, &s, pattern, {}});
      model_allocated += block;
      model_requested += bytes;
    } else if (u < 0.62) {
      // Another stream reads the block after the allocation stream's work (event + wait).
      LiveBlock& b = live[rng() % live.size()];
      Stream& other = *streams[rng() % streams.size()];
      if (&other != b.stream) {
        auto ev = dev.create_event();
        b.stream->record(*ev);
        other.wait(*ev);
        const bool slow = rng() % 4 == 0;
        other.host_func([p = b.ptr, n = b.bytes, v = b.pattern, slow, &errors] {
          verify(p, n, v, errors);
          if (slow) std::this_thread::sleep_for(std::chrono::microseconds(200));
        });
        if (std::find(b.users.begin(), b.users.end(), &other) == b.users.end()) b.users.push_back(&other);
      }
      pool->record_stream(b.ptr, other);  // the allocation stream itself is a no-op
    } else {
      const size_t i = rng() % live.size();
      LiveBlock b = live[i];
      live[i] = live.back();
      live.pop_back();
      b.stream->host_func([p = b.ptr, n = b.bytes, v = b.pattern, &errors] { verify(p, n, v, errors); });
      if (!b.users.empty()) {
        auto remaining = std::make_shared<std::atomic<int>>(static_cast<int>(b.users.size()));
        for (Stream* u2 : b.users) {
          u2->host_func([remaining] { remaining->fetch_sub(1, std::memory_order_release); });
        }
        const auto start = reinterpret_cast<uintptr_t>(b.ptr);
        in_flight.push_back({start, start + b.block, remaining});
      }
      pool->free(b.ptr);
      intervals.erase(reinterpret_cast<uintptr_t>(b.ptr));
      model_allocated -= b.block;
      model_requested -= b.bytes;
    }
    // empty_cache synchronizes the streams of the segments it releases: only with no gate closed.
    if (gates.empty() && rng() % 200 == 0) pool->empty_cache();
    check_stats();
    if (::testing::Test::HasFatalFailure()) return;
  }

  for (auto& g : gates) g->open();
  for (LiveBlock& b : live) {
    b.stream->host_func([p = b.ptr, n = b.bytes, v = b.pattern, &errors] { verify(p, n, v, errors); });
    pool->free(b.ptr);
  }
  live.clear();
  model_allocated = model_requested = 0;
  dev.synchronize();
  pool->empty_cache();
  EXPECT_EQ(errors.load(), 0) << "a block's contents were overwritten while it was live";
  const MemoryStats s = pool->stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.requested_bytes, 0u);
  EXPECT_EQ(s.active_blocks, 0u);
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(s.segments, 0u);
  EXPECT_EQ(raw->in_use(), 0u);
  EXPECT_GT(s.num_cache_hits, s.num_raw_allocs) << "the cache should serve most requests";
}

TEST(CachingAllocatorRandom, ModelCheckOverThreeStreams) {
  const int ops = kSanitized ? 1200 : 4000;
  for (uint64_t seed : {1u, 20240607u}) {
    random_ops(seed, ops);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// ---- the pool's view of a stream (memory/pool_stream.h) ---------------------------------------
// The pool sits below the runtime and sees streams only as PoolStreams: it runs on streams that
// are not the runtime's, and the calls it makes are these, at these points.

class FakePoolEvent final : public PoolEvent {
 public:
  bool query() override { return done; }
  void synchronize() override { done = true; }
  bool done = false;
};

class FakePoolStream final : public PoolStream {
 public:
  explicit FakePoolStream(int id) : id_(id) {}
  int id() const override { return id_; }
  void synchronize() override { ++syncs; }
  std::shared_ptr<PoolEvent> record_new_event() override {
    if (failed) throw Error(ErrorKind::kDevice, "fake device failed: event creation refused");
    events.push_back(std::make_shared<FakePoolEvent>());
    return events.back();
  }
  bool capturing() const override { return capturing_now; }
  void invalidate_capture(const std::string& why) override { reasons.push_back(why); }

  int syncs = 0;
  std::vector<std::shared_ptr<FakePoolEvent>> events;
  bool capturing_now = false;
  bool failed = false;  // as a CUDA device after a sticky error: every event creation throws
  std::vector<std::string> reasons;

 private:
  int id_;
};

TEST(PoolStreamContract, EventsAtCrossStreamFreesSyncsAtReleaseRefusalsWhileCapturing) {
  auto [raw, pool] = make_pool("fake:0");
  FakePoolStream a(0), b(1);
  void* p = pool->allocate(1000, a, "x");
  pool->record_stream(p, b);
  pool->record_stream(p, a);  // the block's own stream: no event needed
  pool->free(p);
  ASSERT_EQ(b.events.size(), 1u);  // one event, recorded on the other stream at free()
  EXPECT_TRUE(a.events.empty());
  void* q = pool->allocate(1000, a, "y");  // p is pending on b's event: not handed out
  EXPECT_NE(q, p);
  b.events[0]->done = true;  // b's work completed: the next allocation polls and reuses p
  void* r = pool->allocate(1000, a, "z");
  EXPECT_EQ(r, p);
  pool->free(q);
  pool->free(r);
  EXPECT_EQ(a.syncs + b.syncs, 0);
  pool->empty_cache();  // releasing the segment synchronizes its stream first, and only it
  EXPECT_EQ(a.syncs, 1);
  EXPECT_EQ(b.syncs, 0);
  EXPECT_EQ(raw->in_use(), 0u);

  a.capturing_now = true;
  const std::string why = capture_refusal(CaptureRule::kPoolForCapturingStream,
                                          "the pool of fake:0 was asked for 64 bytes for 'w' on stream 0; "
                                          "allocate before the capture");
  try {
    (void)pool->allocate(64, a, "w");
    ADD_FAILURE() << "an allocation for a capturing stream was served";
  } catch (const CaptureError& e) {
    EXPECT_EQ(e.rule(), CaptureRule::kPoolForCapturingStream);
    EXPECT_EQ(e.message(), why);
  }
  EXPECT_EQ(a.reasons, std::vector<std::string>{why});  // the capture failed with the same reason
  EXPECT_EQ(pool->stats().num_allocs, 3u);
}

// A failed device (a sticky CUDA error) refuses every later call, event creation included. free()
// runs in destructors, so it must not throw then: the block stays out of reuse (no event says when
// the other stream is done with it) and goes back with its segment when the pool is destroyed.
TEST(PoolStreamContract, FreeOfABlockUsedByAFailedStreamDoesNotThrowAndIsNeverReused) {
  auto [raw, pool] = make_pool("fake:0");
  FakePoolStream a(0), b(1);
  void* p = pool->allocate(1000, a, "x");
  pool->record_stream(p, b);
  b.failed = true;
  EXPECT_NO_THROW(pool->free(p));
  EXPECT_TRUE(b.events.empty());
  EXPECT_EQ(pool->stats().allocated_bytes, 0u);
  void* q = pool->allocate(1000, a, "y");
  EXPECT_NE(q, p) << "a block another stream may still use was handed out again";
  pool->free(q);
  pool->empty_cache();  // the segment holding the pending block is not released while it may be in use
  EXPECT_GT(raw->in_use(), 0u);
}  // the pool's destruction returns it (release_all; ASan checks the blocks)

// ---- rules: rounding, pools, splitting ---------------------------------------

class CachingAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rt_ = Runtime::create_cpu(1);
    dev_ = &rt_->device(0);
  }
  Stream& s() { return dev_->compute(); }
  Stream& b() { return dev_->comm(); }

  std::unique_ptr<Runtime> rt_;  // declared first: pools in tests are destroyed before streams
  Device* dev_ = nullptr;
};

TEST_F(CachingAllocatorTest, RoundsToMinBlockSizeAndZeroIsNull) {
  auto [raw, pool] = make_pool("cpu:t");
  EXPECT_EQ(pool->allocate(0, s()), nullptr);
  for (size_t n : {size_t{1}, size_t{511}, size_t{512}, size_t{513}, size_t{4099}}) {
    void* p = pool->allocate(n, s());
    EXPECT_EQ(pool->block_size(p), round_up(n, kMinBlock)) << n;
    pool->free(p);
  }
  EXPECT_EQ(pool->stats().num_raw_allocs, 1u);
  EXPECT_EQ(pool->stats().reserved_bytes, 2 * kMiB);
}

TEST_F(CachingAllocatorTest, SmallAndLargePoolsAndSplitRules) {
  auto [raw, pool] = make_pool("cpu:t");
  // kSmallSize is small: a 2 MiB segment, split, the 1 MiB tail cached.
  void* a = pool->allocate(kSmall, s());
  EXPECT_EQ(pool->block_size(a), kSmall);
  EXPECT_EQ(pool->stats().reserved_bytes, 2 * kMiB);
  EXPECT_EQ(pool->largest_free_block(), kSmall);
  // One byte more is large: a 20 MiB segment, remainder (> 1 MiB) split off.
  void* b2 = pool->allocate(kSmall + 1, s());
  EXPECT_EQ(pool->block_size(b2), kSmall + kMinBlock);
  EXPECT_EQ(pool->stats().reserved_bytes, 22 * kMiB);
  EXPECT_EQ(pool->largest_free_block(), 20 * kMiB - kSmall - kMinBlock);
  // A large request never comes from the small pool's free 1 MiB tail, and the large tail that
  // would be left (<= 1 MiB) is not split off: the block is the whole rest of the segment.
  void* c = pool->allocate(20 * kMiB - kSmall - kMinBlock - 512 * kKiB, s());
  EXPECT_EQ(pool->block_size(c), 20 * kMiB - kSmall - kMinBlock);
  EXPECT_EQ(pool->stats().num_raw_allocs, 2u);
  // >= 10 MiB: the segment is the request rounded to 2 MiB; a large remainder would be split.
  void* d = pool->allocate(10 * kMiB + 1, s());
  EXPECT_EQ(pool->stats().reserved_bytes, 22 * kMiB + 12 * kMiB);
  EXPECT_EQ(pool->block_size(d), 10 * kMiB + kMinBlock);
  EXPECT_EQ(pool->largest_free_block(), 2 * kMiB - kMinBlock);
  void* e = pool->allocate(11 * kMiB + 1, s());
  EXPECT_EQ(pool->stats().reserved_bytes, 22 * kMiB + 24 * kMiB);
  EXPECT_EQ(pool->block_size(e), 12 * kMiB) << "a tail of at most kSmallSize stays in the block";
  for (void* p : {a, b2, c, d, e}) pool->free(p);
  EXPECT_EQ(pool->stats().allocated_bytes, 0u);
  pool->empty_cache();
  EXPECT_EQ(pool->stats().reserved_bytes, 0u);
  EXPECT_EQ(raw->in_use(), 0u);
}

// ---- (2) coalescing ---------------------------------------------------------

TEST_F(CachingAllocatorTest, FreedNeighboursCoalesceWithinASegment) {
  auto [raw, pool] = make_pool("cpu:t");
  const std::vector<size_t> sizes = {4 * kKiB, 8 * kKiB, 512, 64 * kKiB, 12 * kKiB, 1 * kKiB, 100 * kKiB};
  std::vector<char*> ptrs;
  size_t total = 0;
  for (size_t n : sizes) {
    ptrs.push_back(static_cast<char*>(pool->allocate(n, s(), "piece")));
    total += n;
  }
  for (size_t i = 1; i < ptrs.size(); ++i) ASSERT_EQ(ptrs[i], ptrs[i - 1] + sizes[i - 1]) << "not adjacent";
  // Fill the segment's remainder (small requests only), so only merging can produce a block of
  // `total` bytes.
  char* fence = static_cast<char*>(pool->allocate(kSmall, s(), "fence"));
  ASSERT_EQ(fence, ptrs[0] + total);
  char* fence2 = static_cast<char*>(pool->allocate(kSmall - total, s(), "fence"));
  ASSERT_EQ(fence2, fence + kSmall);
  EXPECT_EQ(pool->largest_free_block(), 0u);
  const uint64_t raw_allocs = pool->stats().num_raw_allocs;
  ASSERT_EQ(raw_allocs, 1u);

  for (size_t i : {3, 0, 6, 1, 5, 2, 4}) pool->free(ptrs[i]);
  EXPECT_EQ(pool->largest_free_block(), total);
  void* merged = pool->allocate(total, s(), "merged");
  EXPECT_EQ(merged, ptrs[0]);
  EXPECT_EQ(pool->stats().num_raw_allocs, raw_allocs);
  std::memset(merged, 1, total);

  // Freeing everything makes the segment whole again, so empty_cache can return it.
  pool->free(merged);
  pool->free(fence2);
  pool->free(fence);
  EXPECT_EQ(pool->largest_free_block(), 2 * kMiB);
  pool->empty_cache();
  EXPECT_EQ(pool->stats().segments, 0u);
  EXPECT_EQ(pool->stats().num_raw_frees, 1u);
}

TEST_F(CachingAllocatorTest, EmptyCacheKeepsSegmentsWithLiveBlocks) {
  auto [raw, pool] = make_pool("cpu:t");
  void* a = pool->allocate(1000, s());
  void* b2 = pool->allocate(1000, s());
  void* big = pool->allocate(12 * kMiB, s());
  pool->free(a);
  pool->free(big);
  pool->empty_cache();
  EXPECT_EQ(pool->stats().segments, 1u);
  EXPECT_EQ(pool->stats().reserved_bytes, 2 * kMiB);
  pool->free(b2);
}

// ---- (3)/(4) stream-aware reuse ------------------------------------------------

class CrossStream : public CachingAllocatorTest, public ::testing::WithParamInterface<size_t> {};

TEST_P(CrossStream, BlockUsedByAnotherStreamIsReusedOnlyAfterItsWork) {
  const size_t n = GetParam();
  auto [raw, pool] = make_pool("cpu:t");
  void* p = pool->allocate(n, s(), "shared");
  s().memset(p, 1, n);
  auto ev = dev_->create_event();
  s().record(*ev);

  Gate gate;
  // Even through a failed ASSERT, no queued work may outlive the pool's memory.
  struct Finish {
    Gate& gate;
    Device& dev;
    ~Finish() {
      gate.open();
      dev.synchronize();
    }
  } finish{gate, *dev_};
  gate.block(b());
  b().wait(*ev);
  b().memset(p, 2, n);  // B uses the block, after the gate opens
  pool->record_stream(p, b());
  pool->free(p);
  EXPECT_EQ(pool->stats().allocated_bytes, 0u);

  void* q = pool->allocate(n, s(), "other");
  ASSERT_NE(q, p);
  ASSERT_FALSE(overlaps(q, n, p, n));
  pool->empty_cache();  // must not release the pending block's segment
  s().memset(q, 3, n);

  gate.open();
  b().synchronize();
  const MemoryStats before = pool->stats();
  void* r = pool->allocate(n, s(), "again");
  EXPECT_EQ(r, p) << "after B's work completed the block is reusable on its stream";
  EXPECT_EQ(pool->stats().num_cache_hits, before.num_cache_hits + 1);
  EXPECT_EQ(pool->stats().num_raw_allocs, before.num_raw_allocs);
  EXPECT_EQ(static_cast<const uint8_t*>(r)[0], 2);  // B's write landed before the reuse
  pool->free(q);
  pool->free(r);
  dev_->synchronize();
}

INSTANTIATE_TEST_SUITE_P(SmallAndLarge, CrossStream, ::testing::Values(64 * kKiB, 12 * kMiB),
                         [](const auto& info) { return info.param < kSmall ? "Small" : "Large"; });

TEST_F(CachingAllocatorTest, SameStreamReuseIsImmediate) {
  auto [raw, pool] = make_pool("cpu:t");
  for (size_t n : {size_t{3000}, 5 * kMiB}) {
    void* p = pool->allocate(n, s());
    s().memset(p, 0, n);  // queued work: reuse on the same stream is still immediate (ordered)
    pool->free(p);
    const uint64_t hits = pool->stats().num_cache_hits;
    void* q = pool->allocate(n, s());
    EXPECT_EQ(q, p);
    EXPECT_EQ(pool->stats().num_cache_hits, hits + 1);
    // A request on another stream never gets the first stream's block.
    pool->free(q);
    void* r = pool->allocate(n, b());
    EXPECT_NE(r, p);
    pool->free(r);
  }
  // record_stream with the allocation stream itself does not delay reuse.
  void* p = pool->allocate(700, s());
  pool->record_stream(p, s());
  pool->free(p);
  EXPECT_EQ(pool->allocate(700, s()), p);
  pool->free(p);
  dev_->synchronize();
}

TEST_F(CachingAllocatorTest, InvalidPointers) {
  auto [raw, pool] = make_pool("cpu:t");
  pool->free(nullptr);
  pool->record_stream(nullptr, s());
  int x = 0;
  try {
    pool->free(&x);
    FAIL() << "free of an unknown pointer must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(e.message().find("cpu:t"), std::string::npos);
  }
  void* p = pool->allocate(100, s());
  EXPECT_THROW(pool->record_stream(static_cast<char*>(p) + 512, b()), Error);
  pool->free(p);
  try {
    pool->free(p);
    FAIL() << "double free must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  }
  EXPECT_THROW(pool->block_size(p), Error);
}

// ---- (5) out of memory ------------------------------------------------------

TEST_F(CachingAllocatorTest, OomReleasesCachedSegmentsAndRetries) {
  auto raw = std::make_unique<FailingRawAllocator>(24 * kMiB);
  FailingRawAllocator* r = raw.get();
  CachingAllocator pool("cpu:oom", std::move(raw));
  void* a = pool.allocate(16 * kMiB, s(), "a");
  s().memset(a, 0, 16 * kMiB);
  pool.free(a);  // cached: 16 MiB reserved, none allocated
  void* b2 = pool.allocate(20 * kMiB, s(), "b");  // 16 + 20 > 24 unless the cache is released
  ASSERT_NE(b2, nullptr);
  std::memset(b2, 1, 20 * kMiB);
  const MemoryStats st = pool.stats();
  EXPECT_EQ(st.num_raw_frees, 1u);
  EXPECT_EQ(st.reserved_bytes, 20 * kMiB);
  EXPECT_EQ(st.num_ooms, 0u);
  EXPECT_EQ(r->in_use(), 20 * kMiB);
  pool.free(b2);
}

TEST_F(CachingAllocatorTest, OomFallsBackToAnExactSizeSegment) {
  auto raw = std::make_unique<FailingRawAllocator>(12 * kMiB);
  CachingAllocator pool("cpu:oom", std::move(raw));
  void* a = pool.allocate(3 * kMiB, s(), "a");  // would be a 20 MiB segment; 4 MiB fits
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(pool.stats().reserved_bytes, 4 * kMiB);
  pool.free(a);
}

TEST_F(CachingAllocatorTest, OomWaitsForPendingCrossStreamFrees) {
  auto raw = std::make_unique<FailingRawAllocator>(24 * kMiB);
  CachingAllocator pool("cpu:oom", std::move(raw));
  Gate gate;
  gate.block(b());
  void* p = pool.allocate(16 * kMiB, s(), "p");
  pool.record_stream(p, b());
  pool.free(p);  // pending until B passes the gate
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate.open();
  });
  void* q = pool.allocate(16 * kMiB, s(), "q");  // no room for a second segment: waits for B
  opener.join();
  EXPECT_EQ(q, p);
  EXPECT_EQ(pool.stats().num_raw_allocs, 1u);
  EXPECT_EQ(pool.stats().num_ooms, 0u);
  pool.free(q);
}

TEST_F(CachingAllocatorTest, GenuineOomThrowsAReport) {
  auto raw = std::make_unique<FailingRawAllocator>(64 * kMiB);
  FailingRawAllocator* r = raw.get();
  CachingAllocator pool("cpu:3", std::move(raw));
  void* w = pool.allocate(20 * kMiB, s(), "weights");
  void* a1 = pool.allocate(12 * kMiB, s(), "activations");
  void* a2 = pool.allocate(12 * kMiB, s(), "activations");
  void* g = pool.allocate(100 * kKiB, s(), "grads");
  const size_t request = 30 * kMiB + 7;
  try {
    pool.allocate(request, s(), "huge");
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory);
    const std::string& m = e.message();
    EXPECT_NE(m.find("cpu:3"), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(request)), std::string::npos) << m;
    EXPECT_NE(m.find("weights"), std::string::npos) << m;
    EXPECT_NE(m.find("activations"), std::string::npos) << m;
    EXPECT_NE(m.find("grads"), std::string::npos) << m;
    EXPECT_NE(m.find("largest free"), std::string::npos) << m;
    EXPECT_NE(m.find("To fix"), std::string::npos) << m;
    // The biggest tag is named first.
    EXPECT_LT(m.find("activations"), m.find("weights")) << m;
  }
  EXPECT_EQ(pool.stats().num_ooms, 1u);

  // The pool stays usable; a switch makes even a small request fail.
  void* small = pool.allocate(1000, s(), "small");  // served from the cached tail of grads' segment
  EXPECT_NE(small, nullptr);
  r->set_fail(true);
  EXPECT_THROW(pool.allocate(20 * kMiB, s(), "x"), Error);
  EXPECT_THROW(pool.allocate(1000, b(), "x"), Error);  // b has no segment yet
  EXPECT_EQ(pool.stats().num_ooms, 3u);
  r->set_fail(false);
  void* ok = pool.allocate(1000, b(), "x");
  EXPECT_NE(ok, nullptr);
  for (void* p : {w, a1, a2, g, small, ok}) pool.free(p);
  pool.empty_cache();
  EXPECT_EQ(r->in_use(), 0u);
}

TEST_F(CachingAllocatorTest, ReportListsAtMostFiveTags) {
  CachingAllocator pool("cpu:0", std::make_unique<FailingRawAllocator>(4 * kMiB));
  static const char* kTags[] = {"t1", "t2", "t3", "t4", "t5", "t6", "t7"};
  std::vector<void*> ptrs;
  for (int i = 0; i < 7; ++i) ptrs.push_back(pool.allocate((i + 1) * 1000, s(), kTags[i]));
  try {
    pool.allocate(8 * kMiB, s(), "big");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.message().find("t1 "), std::string::npos) << e.message();
    EXPECT_EQ(e.message().find("t2 "), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("t7 "), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("t3 "), std::string::npos) << e.message();
  }
  for (void* p : ptrs) pool.free(p);
}

// ---- (6) statistics -----------------------------------------------------------

TEST_F(CachingAllocatorTest, ResetPeakStatsSetsPeaksToCurrent) {
  auto [raw, pool] = make_pool("cpu:t");
  void* big = pool->allocate(12 * kMiB, s());
  void* small = pool->allocate(4 * kKiB, s());
  pool->free(big);
  MemoryStats st = pool->stats();
  EXPECT_EQ(st.peak_allocated_bytes, 12 * kMiB + 4 * kKiB);
  EXPECT_EQ(st.allocated_bytes, 4 * kKiB);
  EXPECT_EQ(st.requested_bytes, 4 * kKiB);
  EXPECT_EQ(st.peak_reserved_bytes, 14 * kMiB);

  pool->reset_peak_stats();
  st = pool->stats();
  EXPECT_EQ(st.peak_allocated_bytes, st.allocated_bytes);
  EXPECT_EQ(st.peak_reserved_bytes, st.reserved_bytes);

  pool->empty_cache();
  pool->reset_peak_stats();
  st = pool->stats();
  EXPECT_EQ(st.reserved_bytes, 2 * kMiB);
  EXPECT_EQ(st.peak_reserved_bytes, 2 * kMiB);

  void* again = pool->allocate(1 * kMiB, s());  // fits the small segment's tail
  st = pool->stats();
  EXPECT_EQ(st.peak_allocated_bytes, 1 * kMiB + 4 * kKiB);
  EXPECT_EQ(st.peak_reserved_bytes, 2 * kMiB);
  EXPECT_EQ(st.num_allocs, 3u);
  EXPECT_EQ(st.num_frees, 1u);
  EXPECT_EQ(st.active_blocks, 2u);
  EXPECT_EQ(st.num_cache_hits, 1u);
  pool->free(small);
  pool->free(again);
}

// ---- thread safety -------------------------------------------------------------

TEST_F(CachingAllocatorTest, ConcurrentThreadsOnOwnStreams) {
  auto [raw, pool] = make_pool("cpu:t");
  const int kThreads = 4, kOps = kSanitized ? 800 : 3000;
  std::vector<Stream*> streams;
  for (int t = 0; t < kThreads; ++t) streams.push_back(&dev_->create_stream());
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t + 1);
      std::vector<std::pair<uint8_t*, size_t>> mine;
      for (int i = 0; i < kOps; ++i) {
        if (mine.size() < 16 && (mine.empty() || rng() % 2)) {
          const size_t n = rng() % 8 == 0 ? log_uniform(rng, kSmall, 12 * kMiB) : log_uniform(rng, 1, 256 * kKiB);
          auto* p = static_cast<uint8_t*>(pool->allocate(n, *streams[t], "thread"));
          p[0] = p[n - 1] = static_cast<uint8_t>(t);
          mine.emplace_back(p, n);
        } else {
          const size_t k = rng() % mine.size();
          auto [p, n] = mine[k];
          if (p[0] != t || p[n - 1] != t) bad.fetch_add(1);
          if (rng() % 4 == 0) pool->record_stream(p, *streams[(t + 1) % kThreads]);
          pool->free(p);
          mine[k] = mine.back();
          mine.pop_back();
        }
        if (i % 97 == 0) (void)pool->stats();
      }
      for (auto [p, n] : mine) pool->free(p);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  dev_->synchronize();
  pool->empty_cache();
  const MemoryStats st = pool->stats();
  EXPECT_EQ(st.active_blocks, 0u);
  EXPECT_EQ(st.allocated_bytes, 0u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(raw->in_use(), 0u);
}

// ---- (7) DeviceBuffer -----------------------------------------------------------

TEST_F(CachingAllocatorTest, DeviceBufferFreesOnDestructionAndMoves) {
  auto [raw, pool] = make_pool("cpu:t");
  {
    DeviceBuffer empty;
    EXPECT_EQ(empty.data(), nullptr);
    EXPECT_EQ(empty.size(), 0u);
    empty.reset();
    DeviceBuffer zero(*pool, 0, s());
    EXPECT_EQ(zero.data(), nullptr);
  }
  EXPECT_EQ(pool->stats().active_blocks, 0u);
  {
    DeviceBuffer a(*pool, 1000 * sizeof(float), s(), "a");
    ASSERT_NE(a.data(), nullptr);
    EXPECT_EQ(a.size(), 1000 * sizeof(float));
    EXPECT_EQ(a.as<float>(), static_cast<float*>(a.data()));
    a.as<float>()[999] = 1.5f;
    EXPECT_EQ(pool->stats().active_blocks, 1u);

    void* pa = a.data();
    DeviceBuffer b2(std::move(a));
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_EQ(a.size(), 0u);
    EXPECT_EQ(b2.data(), pa);
    EXPECT_EQ(b2.as<float>()[999], 1.5f);
    EXPECT_EQ(pool->stats().active_blocks, 1u);

    DeviceBuffer c(*pool, 5 * kMiB, s(), "c");
    EXPECT_EQ(pool->stats().active_blocks, 2u);
    c = std::move(b2);  // c's own block is freed
    EXPECT_EQ(pool->stats().active_blocks, 1u);
    EXPECT_EQ(c.data(), pa);
    EXPECT_EQ(b2.data(), nullptr);
    c = std::move(c);  // self-move keeps the buffer
    EXPECT_EQ(c.data(), pa);

    std::vector<DeviceBuffer> v;
    v.push_back(std::move(c));
    v.emplace_back(*pool, 64, s(), "v");
    EXPECT_EQ(pool->stats().active_blocks, 2u);
    v[1].reset();
    EXPECT_EQ(v[1].data(), nullptr);
    EXPECT_EQ(pool->stats().active_blocks, 1u);
  }
  const MemoryStats st = pool->stats();
  EXPECT_EQ(st.active_blocks, 0u);
  EXPECT_EQ(st.allocated_bytes, 0u);
  EXPECT_EQ(st.num_allocs, st.num_frees);
}

TEST_F(CachingAllocatorTest, DevicePoolWorksWithTheRuntime) {
  CachingAllocator& pool = dev_->memory();
  EXPECT_EQ(pool.device_name(), dev_->name());
  DeviceBuffer buf(pool, 4096, dev_->compute(), "runtime");
  dev_->compute().memset(buf.data(), 0x5a, 4096);
  dev_->compute().synchronize();
  EXPECT_EQ(buf.as<uint8_t>()[4095], 0x5a);
}

// A pool destroyed with blocks still pending on another stream waits for their events.
TEST_F(CachingAllocatorTest, DestructorWaitsForPendingEvents) {
  auto raw = std::make_unique<FailingRawAllocator>(0);
  Gate gate;
  std::thread opener;
  std::atomic<bool> memset_done{false};
  {
    CachingAllocator pool("cpu:t", std::move(raw));
    void* p = pool.allocate(4096, s());
    gate.block(b());
    b().memset(p, 0, 4096);
    b().host_func([&] { memset_done = true; });
    pool.record_stream(p, b());
    pool.free(p);
    (void)pool.allocate(100, s());  // a block still live at destruction is released too
    opener = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      gate.open();
    });
  }  // blocks until B passed the gate and its memset ran
  opener.join();
  // The destructor waited for the event recorded at free(), which follows the memset on B. (Not
  // b().query(): the stream counts a task done only after the event's marker returned.)
  EXPECT_TRUE(memset_done.load());
}

}  // namespace
}  // namespace zt
