// CPU backend: stream/event semantics must be CUDA's. These tests run under ThreadSanitizer too:
// every cross-thread handoff below is ordered only by the runtime's events, so a runtime bug is
// either a wrong value here or a TSan report.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "core/status.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

using namespace std::chrono_literals;

// A gate a stream can be parked on, to make "work still pending" observable.
struct Gate {
  std::promise<void> promise;
  std::shared_future<void> future = promise.get_future().share();
  void block(Stream& s) {
    auto f = future;
    s.host_func([f] { f.wait(); });
  }
  void open() { promise.set_value(); }
};

TEST(CpuRuntime, CreatesRequestedDevicesWithTwoStreams) {
  auto rt = Runtime::create_cpu(3);
  ASSERT_EQ(rt->size(), 3);
  EXPECT_EQ(rt->backend(), Backend::kCpu);
  for (int i = 0; i < 3; ++i) {
    Device& d = rt->device(i);
    EXPECT_EQ(d.index(), i);
    EXPECT_EQ(d.name(), "cpu:" + std::to_string(i));
    EXPECT_NE(&d.compute(), &d.comm());
    EXPECT_EQ(&d.compute().device(), &d);
    EXPECT_TRUE(d.can_access_peer(rt->device((i + 1) % 3)));
  }
}

TEST(CpuRuntime, WorkRunsInSubmissionOrder) {
  auto rt = Runtime::create_cpu(1);
  Stream& s = rt->device(0).compute();
  std::vector<int> order;  // touched only by the stream's worker until synchronize()
  for (int i = 0; i < 5000; ++i) s.host_func([&order, i] { order.push_back(i); });
  s.synchronize();
  ASSERT_EQ(order.size(), 5000u);
  for (int i = 0; i < 5000; ++i) ASSERT_EQ(order[i], i);
}

TEST(CpuRuntime, ChainedCopiesSeeEachOther) {
  auto rt = Runtime::create_cpu(1);
  Stream& s = rt->device(0).compute();
  std::vector<uint8_t> a(1000), b(1000, 0), c(1000, 0);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 7 + 3);
  s.copy(b.data(), a.data(), a.size());
  s.copy(c.data(), b.data(), b.size());
  s.memset(a.data(), 0, 10);
  s.synchronize();
  for (size_t i = 0; i < c.size(); ++i) ASSERT_EQ(c[i], static_cast<uint8_t>(i * 7 + 3));
  for (size_t i = 0; i < 10; ++i) ASSERT_EQ(a[i], 0);
}

TEST(CpuRuntime, WorkIsAsynchronousToTheHost) {
  auto rt = Runtime::create_cpu(1);
  Stream& s = rt->device(0).compute();
  Gate gate;
  std::atomic<bool> ran{false};
  gate.block(s);
  s.host_func([&] { ran = true; });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(s.query());
  EXPECT_FALSE(ran.load());
  gate.open();
  s.synchronize();
  EXPECT_TRUE(s.query());
  EXPECT_TRUE(ran.load());
}

TEST(CpuRuntime, EventOrdersWorkAcrossStreams) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& producer = d.compute();
  Stream& consumer = d.comm();
  auto ev = d.create_event();
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    int value = 0;  // plain int: only the event orders the write before the read
    int seen = -1;
    const int delay_us = static_cast<int>(rng() % 200);
    producer.host_func([&value, trial, delay_us] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      value = trial + 1;
    });
    producer.record(*ev);
    consumer.wait(*ev);
    consumer.host_func([&] { seen = value; });
    consumer.synchronize();
    producer.synchronize();
    ASSERT_EQ(seen, trial + 1);
  }
}

TEST(CpuRuntime, EventQueryAndHostSynchronize) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  auto ev = d.create_event();
  EXPECT_TRUE(ev->query());  // never recorded
  Gate gate;
  gate.block(d.compute());
  d.compute().record(*ev);
  std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(ev->query());
  gate.open();
  ev->synchronize();
  EXPECT_TRUE(ev->query());
}

TEST(CpuRuntime, WaitCapturesTheRecordCurrentAtCallTime) {
  // CUDA semantics: a later re-record of the event does not change what an earlier wait waits for.
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s1 = d.compute();
  Stream& s2 = d.comm();
  Stream& s3 = d.create_stream();
  auto ev = d.create_event();
  Gate gate;
  gate.block(s1);
  s1.record(*ev);  // pending until the gate opens
  s2.wait(*ev);
  std::atomic<bool> s2_ran{false};
  s2.host_func([&] { s2_ran = true; });
  s3.record(*ev);  // completes immediately
  s3.synchronize();
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(s2_ran.load()) << "s2 must still wait for s1's record";
  gate.open();
  s2.synchronize();
  EXPECT_TRUE(s2_ran.load());
}

TEST(CpuRuntime, WaitOnNeverRecordedEventIsNoOp) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  auto ev = d.create_event();
  d.compute().wait(*ev);
  int x = 0;
  d.compute().host_func([&] { x = 1; });
  d.compute().synchronize();
  EXPECT_EQ(x, 1);
}

TEST(CpuRuntime, EventOrdersWorkAcrossDevices) {
  auto rt = Runtime::create_cpu(2);
  Device& d0 = rt->device(0);
  Device& d1 = rt->device(1);
  constexpr size_t kBytes = 1 << 20;
  auto* src = static_cast<uint8_t*>(d0.memory().allocate(kBytes, d0.compute(), "src"));
  auto* dst = static_cast<uint8_t*>(d1.memory().allocate(kBytes, d1.compute(), "dst"));
  auto produced = d0.create_event();
  auto copied = d0.create_event();
  // The rule: produce on compute, copy on the source device's comm stream, consumer waits.
  d0.compute().memset(src, 0x5a, kBytes);
  d0.compute().record(*produced);
  d0.comm().wait(*produced);
  d0.comm().copy_peer(d1, dst, src, kBytes);
  d0.comm().record(*copied);
  d1.compute().wait(*copied);
  size_t mismatches = kBytes;
  d1.compute().host_func([&] {
    mismatches = 0;
    for (size_t i = 0; i < kBytes; ++i) mismatches += dst[i] != 0x5a;
  });
  d1.compute().synchronize();
  EXPECT_EQ(mismatches, 0u);
  d0.memory().record_stream(src, d0.comm());
  d0.memory().free(src);
  d1.memory().free(dst);
}

class PeerCopy : public ::testing::TestWithParam<size_t> {};

TEST_P(PeerCopy, CopiesExactBytesBetweenDevices) {
  const size_t bytes = GetParam();
  auto rt = Runtime::create_cpu(2);
  Device& d0 = rt->device(0);
  Device& d1 = rt->device(1);
  auto* src = static_cast<uint8_t*>(d0.memory().allocate(bytes, d0.comm(), "src"));
  auto* dst = static_cast<uint8_t*>(d1.memory().allocate(bytes + 1, d1.compute(), "dst"));
  std::mt19937_64 rng(bytes);
  std::vector<uint8_t> expect(bytes);
  for (auto& b : expect) b = static_cast<uint8_t>(rng());
  std::memcpy(src, expect.data(), bytes);  // host writes before any stream work: no race
  std::memset(dst, 0xee, bytes + 1);
  d0.comm().copy_peer(d1, dst, src, bytes);
  d0.comm().synchronize();
  EXPECT_EQ(std::memcmp(dst, expect.data(), bytes), 0);
  EXPECT_EQ(dst[bytes], 0xee) << "copy wrote past its end";
  d0.memory().free(src);
  d1.memory().free(dst);
}

INSTANTIATE_TEST_SUITE_P(Sizes, PeerCopy,
                         ::testing::Values(size_t{1}, size_t{3}, size_t{255}, size_t{4097},
                                           size_t{(1 << 20) + 7}, size_t{(64u << 20) + 1}));

TEST(CpuRuntime, RingOfDevicesPassesATokenInOrder) {
  // N devices pass a counter around a ring many times; each hop is a peer copy ordered by events.
  constexpr int kDevices = 8;
  constexpr int kRounds = 50;
  auto rt = Runtime::create_cpu(kDevices);
  std::vector<int64_t*> buf(kDevices);
  std::vector<std::unique_ptr<Event>> ready(kDevices);
  for (int i = 0; i < kDevices; ++i) {
    Device& d = rt->device(i);
    buf[i] = static_cast<int64_t*>(d.memory().allocate(sizeof(int64_t), d.compute(), "token"));
    *buf[i] = 0;
    ready[i] = d.create_event();
  }
  Event* last = nullptr;
  for (int r = 0; r < kRounds; ++r) {
    for (int i = 0; i < kDevices; ++i) {
      Device& d = rt->device(i);
      Device& next = rt->device((i + 1) % kDevices);
      if (last) d.compute().wait(*last);
      int64_t* mine = buf[i];
      d.compute().host_func([mine] { *mine += 1; });
      d.compute().copy_peer(next, buf[(i + 1) % kDevices], mine, sizeof(int64_t));
      d.compute().record(*ready[i]);
      last = ready[i].get();
    }
  }
  rt->synchronize();
  EXPECT_EQ(*buf[0], int64_t{kDevices} * kRounds);
  for (int i = 0; i < kDevices; ++i) rt->device(i).memory().free(buf[i]);
}

TEST(CpuRuntime, ErrorInsideStreamWorkSurfacesAtSynchronize) {
  auto rt = Runtime::create_cpu(2);
  Device& d0 = rt->device(0);
  Device& d1 = rt->device(1);
  bool later_ran = false;
  d0.compute().host_func([] { throw std::runtime_error("simulated kernel fault"); });
  d0.compute().host_func([&] { later_ran = true; });  // skipped: the device has failed
  auto ev = d0.create_event();
  d0.compute().record(*ev);
  // Another device waiting on the failed device's event must not hang.
  d1.compute().wait(*ev);
  int d1_value = 0;
  d1.compute().host_func([&] { d1_value = 7; });
  d1.compute().synchronize();
  EXPECT_EQ(d1_value, 7);
  EXPECT_FALSE(d1.failed());

  try {
    d0.compute().synchronize();
    FAIL() << "synchronize must rethrow the stream error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDevice);
    EXPECT_NE(e.message().find("simulated kernel fault"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("cpu:0"), std::string::npos) << e.message();
  }
  EXPECT_TRUE(d0.failed());
  EXPECT_FALSE(later_ran);
  // Sticky: every later synchronization point reports it again, on every stream of the device.
  EXPECT_THROW(d0.comm().synchronize(), Error);
  EXPECT_THROW(d0.comm().query(), Error);
  EXPECT_THROW(d0.synchronize(), Error);
}

TEST(CpuRuntime, DeviceSynchronizeCoversCreatedStreams) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& extra = d.create_stream(StreamPriority::kHigh);
  EXPECT_GE(extra.id(), 2);
  std::atomic<int> done{0};
  extra.host_func([&] {
    std::this_thread::sleep_for(5ms);
    done = 1;
  });
  d.synchronize();
  EXPECT_EQ(done.load(), 1);
}

TEST(CpuRuntime, DestructionRunsQueuedWork) {
  std::atomic<int> count{0};
  {
    auto rt = Runtime::create_cpu(2);
    for (int i = 0; i < 100; ++i) rt->device(i % 2).compute().host_func([&] { ++count; });
  }
  EXPECT_EQ(count.load(), 100);
}

TEST(CpuRuntime, ManyStreamsManyDevicesStress) {
  // Random DAG of work over 4 devices x 3 streams; each op adds to a per-stream log that is only
  // ever touched in event order, and the final sum is checked exactly.
  constexpr int kDevices = 4, kOps = 3000;
  auto rt = Runtime::create_cpu(kDevices);
  std::vector<Stream*> streams;
  for (int i = 0; i < kDevices; ++i) {
    streams.push_back(&rt->device(i).compute());
    streams.push_back(&rt->device(i).comm());
    streams.push_back(&rt->device(i).create_stream());
  }
  std::vector<std::unique_ptr<Event>> events;
  for (auto* s : streams) events.push_back(s->device().create_event());
  int64_t shared_total = 0;  // every op touches it; all ops are serialized through the event chain
  std::mt19937 rng(7);
  int prev = -1;
  int64_t expect = 0;
  for (int op = 0; op < kOps; ++op) {
    const int si = static_cast<int>(rng() % streams.size());
    if (prev >= 0) streams[si]->wait(*events[prev]);
    streams[si]->host_func([&shared_total, op] { shared_total += op; });
    streams[si]->record(*events[si]);
    expect += op;
    prev = si;
  }
  rt->synchronize();
  EXPECT_EQ(shared_total, expect);
}

}  // namespace
}  // namespace zt
