// CPU backend: stream/event semantics must be CUDA's. These tests run under ThreadSanitizer too:
// every cross-thread handoff below is ordered only by the runtime's events, so a runtime bug is
// either a wrong value here or a TSan report.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "memory/caching_allocator.h"
#include "runtime/cpu/cpu_device.h"
#include "runtime/observer.h"
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

// Timing events (the step's phases, train/step.cc): the span between two completed records covers
// the work between them; unknown (never blocking) before both have completed; and the stream and
// device synchronisations are what cpu::host_synchronizations() counts, event waits not.
TEST(CpuRuntime, TimingEventsMeasureTheWorkBetweenThem) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  auto start = d.create_timing_event(), end = d.create_timing_event();
  EXPECT_EQ(end->seconds_since(*start), std::nullopt);  // never recorded
  Gate gate;
  gate.block(s);
  s.record(*start);
  s.host_func([] { std::this_thread::sleep_for(30ms); });
  s.record(*end);
  EXPECT_EQ(end->seconds_since(*start), std::nullopt);  // recorded, not complete
  gate.open();
  const uint64_t syncs = cpu::host_synchronizations();
  end->synchronize();
  EXPECT_EQ(cpu::host_synchronizations(), syncs);
  const std::optional<double> span = end->seconds_since(*start), back = start->seconds_since(*end);
  ASSERT_TRUE(span && back);
  EXPECT_GE(*span, 0.029);
  EXPECT_LT(*span, 5.0);
  EXPECT_DOUBLE_EQ(*back, -*span);
  s.synchronize();
  d.synchronize();
  EXPECT_EQ(cpu::host_synchronizations(), syncs + 2);
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

// ---- fault injection and abandonment --------------------------------------------------------

// Runs `fn` on another thread and fails loudly if it has not finished within `limit`: a deadlock
// must fail the test, not hang CI. (The stuck thread cannot be joined, so the process aborts.)
void within(std::chrono::seconds limit, const char* what, std::function<void()> fn) {
  auto done = std::async(std::launch::async, std::move(fn));
  if (done.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "DEADLOCK: %s did not finish within %lld s\n", what,
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::abort();
  }
  done.get();  // rethrows what fn threw
}

constexpr auto kDeadlockLimit = std::chrono::seconds(60);  // generous: TSan is slow
constexpr auto kStuck = 50ms;  // long enough to show that work is blocked, not just slow

// Runs `fn`, which must throw zt::Error(kDevice); returns its message ("" when it did not throw).
template <typename Fn>
std::string device_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDevice) << e.message();
    return e.message();
  }
  ADD_FAILURE() << "expected zt::Error(kDevice)";
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(CpuFault, InjectedErrorFailsTheNextOperationOnly) {
  auto rt = Runtime::create_cpu(2);
  Device& d0 = rt->device(0);
  Device& d1 = rt->device(1);
  constexpr size_t kBytes = 4096;
  auto* buf = static_cast<uint8_t*>(d0.memory().allocate(kBytes, d0.compute(), "buf"));
  int before = 0;
  d0.compute().memset(buf, 0x11, kBytes);
  d0.compute().host_func([&] { before = 1; });
  d0.compute().synchronize();

  d0.inject_fault(FaultKind::kError);
  EXPECT_FALSE(d0.hang_injected());
  bool later_ran = false;
  d0.compute().memset(buf, 0x22, kBytes);  // the next operation: fails instead of running
  d0.compute().host_func([&] { later_ran = true; });  // skipped: the device has failed
  const std::string msg = device_error_of([&] { d0.compute().synchronize(); });
  EXPECT_TRUE(contains(msg, "cpu:0")) << msg;
  EXPECT_TRUE(contains(msg, "injected fault")) << msg;
  EXPECT_TRUE(d0.failed());
  EXPECT_FALSE(later_ran);
  // Work completed before the fault is unaffected.
  EXPECT_EQ(before, 1);
  size_t changed = 0;
  for (size_t i = 0; i < kBytes; ++i) changed += buf[i] != 0x11;
  EXPECT_EQ(changed, 0u);
  // Sticky, on every stream and every synchronization point of the device.
  EXPECT_TRUE(contains(device_error_of([&] { d0.comm().synchronize(); }), "injected fault"));
  EXPECT_TRUE(contains(device_error_of([&] { d0.synchronize(); }), "injected fault"));
  EXPECT_TRUE(contains(device_error_of([&] { d0.synchronize_for(1s); }), "injected fault"));
  EXPECT_TRUE(contains(device_error_of([&] { d0.comm().query(); }), "injected fault"));

  // Another device keeps working, also when it waits on an event of the failed device.
  auto ev = d0.create_event();
  d0.comm().record(*ev);
  d1.compute().wait(*ev);
  std::vector<uint8_t> host(kBytes, 0);
  auto* other = static_cast<uint8_t*>(d1.memory().allocate(kBytes, d1.compute(), "other"));
  d1.compute().memset(other, 0x33, kBytes);
  d1.compute().copy(host.data(), other, kBytes);
  EXPECT_TRUE(d1.synchronize_for(kDeadlockLimit));
  EXPECT_FALSE(d1.failed());
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(host[i], 0x33);
  d0.memory().free(buf);
  d1.memory().free(other);
}

TEST(CpuFault, InjectedErrorSurfacesAtSynchronizeWithoutFurtherWork) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  d.synchronize();
  d.inject_fault(FaultKind::kError);
  const std::string msg = device_error_of([&] { d.synchronize(); });
  EXPECT_TRUE(contains(msg, "cpu:0") && contains(msg, "injected fault")) << msg;
  EXPECT_TRUE(d.failed());
}

TEST(CpuFault, ConcurrentOperationsOnAllStreamsOfAFailingDevice) {
  // The fault races with work on three streams (TSan checks the fault word and the message).
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream* streams[] = {&d.compute(), &d.comm(), &d.create_stream()};
  std::atomic<int> ran{0};
  for (int i = 0; i < 300; ++i) streams[i % 3]->host_func([&] { ran.fetch_add(1); });
  d.inject_fault(FaultKind::kError);
  for (int i = 0; i < 300; ++i) streams[i % 3]->host_func([&] { ran.fetch_add(1); });
  EXPECT_TRUE(contains(device_error_of([&] { d.synchronize(); }), "injected fault"));
  EXPECT_LE(ran.load(), 300) << "operations submitted after the fault must not run";
}

TEST(CpuFault, SynchronizeForReportsCompletionAndTimeout) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Gate gate;
  gate.block(d.comm());
  EXPECT_FALSE(d.comm().synchronize_for(10ms));
  EXPECT_FALSE(d.synchronize_for(10ms));
  EXPECT_TRUE(d.compute().synchronize_for(0ms));  // idle
  gate.open();
  EXPECT_TRUE(d.comm().synchronize_for(kDeadlockLimit));
  EXPECT_TRUE(d.synchronize_for(kDeadlockLimit));
}

TEST(CpuFault, InjectedHangBlocksUntilAbandoned) {
  auto rt = Runtime::create_cpu(3);  // cpu:2 is a bystander
  Device& d0 = rt->device(0);
  Device& d1 = rt->device(1);
  Device& d2 = rt->device(2);
  std::atomic<int> before{0};
  d0.compute().host_func([&] { before = 1; });
  d0.compute().synchronize();

  d0.inject_fault(FaultKind::kHang);
  EXPECT_TRUE(d0.hang_injected());
  std::atomic<bool> hung_ran{false};
  d0.compute().host_func([&] { hung_ran = true; });  // the GPU stops answering here
  auto after_hang = d0.create_event();
  d0.compute().record(*after_hang);
  std::atomic<bool> comm_ran{false};
  d0.comm().host_func([&] { comm_ran = true; });  // every stream of the device hangs
  // A peer-copy consumer on another device waits for the hung device's marker.
  d1.compute().wait(*after_hang);
  std::atomic<bool> consumer_ran{false};
  d1.compute().host_func([&] { consumer_ran = true; });
  // A host thread blocked in synchronize() on the hung device.
  auto blocked_sync = std::async(std::launch::async, [&] { return device_error_of([&] { d0.synchronize(); }); });

  EXPECT_FALSE(d0.compute().synchronize_for(kStuck));
  EXPECT_FALSE(d0.comm().synchronize_for(1ms));
  EXPECT_FALSE(d0.synchronize_for(1ms));
  EXPECT_FALSE(d1.compute().synchronize_for(kStuck));
  EXPECT_EQ(blocked_sync.wait_for(1ms), std::future_status::timeout);
  EXPECT_FALSE(after_hang->query());
  EXPECT_FALSE(hung_ran.load());
  EXPECT_FALSE(comm_ran.load());
  EXPECT_FALSE(consumer_ran.load());
  EXPECT_FALSE(d0.failed()) << "a hung device does not report an error by itself";
  EXPECT_FALSE(d1.failed());
  // Other devices, and streams of the waiting device that do not wait, keep working.
  std::atomic<bool> bystander_ran{false};
  d2.compute().host_func([&] { bystander_ran = true; });
  EXPECT_TRUE(d2.synchronize_for(kDeadlockLimit));
  EXPECT_TRUE(bystander_ran.load());
  d1.comm().host_func([] {});
  EXPECT_TRUE(d1.comm().synchronize_for(kDeadlockLimit));

  within(kDeadlockLimit, "abandon() and teardown", [&] {
    d0.abandon("watchdog: no progress for 50 ms");
    EXPECT_FALSE(d0.hang_injected());
    EXPECT_TRUE(d0.failed());
    const std::string blocked_msg = blocked_sync.get();
    EXPECT_TRUE(contains(blocked_msg, "cpu:0")) << blocked_msg;
    EXPECT_TRUE(contains(blocked_msg, "watchdog: no progress")) << blocked_msg;
    const std::string msg = device_error_of([&] { d0.compute().synchronize(); });
    EXPECT_TRUE(contains(msg, "cpu:0") && contains(msg, "abandoned") && contains(msg, "watchdog")) << msg;
    EXPECT_TRUE(contains(device_error_of([&] { d0.synchronize_for(kDeadlockLimit); }), "abandoned"));
    after_hang->synchronize();  // the event completes (as failed): its waiters wake
    EXPECT_TRUE(after_hang->query());
    // The consumer on the other device proceeds; that device is not failed (the data it waited
    // for is garbage: the caller discards it).
    d1.compute().synchronize();
    EXPECT_TRUE(consumer_ran.load());
    EXPECT_FALSE(d1.failed());
    EXPECT_FALSE(hung_ran.load()) << "operations of an abandoned device are released as failed";
    EXPECT_FALSE(comm_ran.load());
    // Work after abandonment is skipped at once, never blocked.
    d0.compute().host_func([&] { hung_ran = true; });
    EXPECT_THROW(d0.compute().synchronize(), Error);
    EXPECT_FALSE(hung_ran.load());
    d0.abandon("twice");  // idempotent; the first reason stays
    EXPECT_TRUE(contains(device_error_of([&] { d0.synchronize(); }), "watchdog"));
    after_hang.reset();
    rt.reset();  // joins every stream worker
  });
  EXPECT_EQ(before.load(), 1);
}

TEST(CpuFault, AbandonReleasesTheDevicesOwnWaitsOnAnotherHungDevice) {
  // cpu:1 waits on a marker of hung cpu:0; recovery drops cpu:1 first, then cpu:0.
  auto rt = Runtime::create_cpu(2);
  Device& d0 = rt->device(0);
  Device& d1 = rt->device(1);
  d0.inject_fault(FaultKind::kHang);
  d0.compute().host_func([] {});
  auto ev = d0.create_event();
  d0.compute().record(*ev);
  d1.comm().wait(*ev);
  std::atomic<bool> d1_ran{false};
  d1.comm().host_func([&] { d1_ran = true; });
  auto d1_ev = d1.create_event();
  d1.comm().record(*d1_ev);
  EXPECT_FALSE(d1.synchronize_for(kStuck));

  within(kDeadlockLimit, "abandoning the waiting device", [&] {
    d1.abandon("dropped by recovery");
    EXPECT_TRUE(contains(device_error_of([&] { d1.synchronize(); }), "dropped by recovery"));
    EXPECT_FALSE(d1_ran.load());
    d1_ev->synchronize();
    EXPECT_FALSE(d0.synchronize_for(1ms)) << "cpu:0 is still hung";
    EXPECT_FALSE(d0.failed());
    d0.abandon("hung");
    EXPECT_THROW(d0.synchronize(), Error);
    ev.reset();
    d1_ev.reset();
    rt.reset();
  });
}

TEST(CpuFault, DestroyingTheRuntimeWithAHungDeviceDoesNotDeadlock) {
  auto rt = Runtime::create_cpu(2);
  Device& d0 = rt->device(0);
  Device& d1 = rt->device(1);
  d0.inject_fault(FaultKind::kHang);
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) d0.compute().host_func([&] { ran.fetch_add(1); });
  auto ev = d0.create_event();
  d0.compute().record(*ev);
  d1.compute().wait(*ev);
  d1.compute().host_func([&] { ran.fetch_add(100); });
  Stream& extra = d0.create_stream();  // created after the fault: hangs too
  extra.host_func([&] { ran.fetch_add(1000); });
  EXPECT_FALSE(extra.synchronize_for(kStuck));
  within(kDeadlockLimit, "Runtime destruction with a hung device", [&] { rt.reset(); });
  EXPECT_EQ(ran.load(), 100) << "only the other device's consumer runs";
}

TEST(CpuFault, AbandonWithoutInjectionReleasesWaitsAndSkipsQueuedWork) {
  // A watchdog may give up on a device that is merely stuck behind work: queued work is dropped.
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Gate gate;
  gate.block(d.compute());
  std::atomic<bool> queued_ran{false};
  d.compute().host_func([&] { queued_ran = true; });
  within(kDeadlockLimit, "abandon() behind a gate", [&] {
    d.abandon("too slow");
    gate.open();  // user code inside a host function is not interrupted; it must return itself
    EXPECT_TRUE(contains(device_error_of([&] { d.synchronize(); }), "too slow"));
    EXPECT_FALSE(queued_ran.load());
    EXPECT_FALSE(d.hang_injected());
  });
}

// ---- task observer ------------------------------------------------------------------------------

// Records what a runtime reports.
class TaskLog final : public TaskObserver {
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
  // (device, stream, name) of each task in report order.
  std::vector<std::string> keys() {
    std::vector<std::string> k;
    for (const Task& t : tasks()) k.push_back(std::to_string(t.device) + "/" + std::to_string(t.stream) + " " + t.name);
    return k;
  }

 private:
  std::mutex mu_;
  std::vector<Task> tasks_;
};

TEST(TaskObserver, IsPerRuntimeAndSeesEachTaskButNoEventRecordOrWait) {
  TaskLog log_a, log_b;
  auto a = Runtime::create_cpu(2, {}, &log_a);
  auto b = Runtime::create_cpu(1, {}, &log_b);
  auto plain = Runtime::create_cpu(1);
  EXPECT_EQ(a->observer(), &log_a);
  EXPECT_EQ(plain->observer(), nullptr);

  std::vector<char> host(64, 1), dev_mem(64);
  Device& d0 = a->device(0);
  Device& d1 = a->device(1);
  auto e = d0.create_event();
  const auto before = std::chrono::steady_clock::now();
  d0.compute().memset(dev_mem.data(), 7, 64);
  d0.compute().record(*e);
  d1.comm().wait(*e);
  d1.comm().copy(host.data(), dev_mem.data(), 64);
  d1.comm().host_func([] {});
  b->device(0).compute().host_func([] {});
  plain->device(0).compute().host_func([] {});
  a->synchronize();
  b->synchronize();
  plain->synchronize();
  const auto after = std::chrono::steady_clock::now();

  EXPECT_EQ(log_a.keys(), (std::vector<std::string>{"0/0 memset", "1/1 copy", "1/1 host_func"}));
  EXPECT_EQ(log_b.keys(), (std::vector<std::string>{"0/0 host_func"}));
  EXPECT_EQ(host[0], 7);
  const auto tasks = log_a.tasks();
  for (const auto& t : tasks) {
    EXPECT_LE(before, t.start);
    EXPECT_LE(t.start, t.end);
    EXPECT_LE(t.end, after);
  }
  // The copy waited for the memset (the event): their slices are ordered.
  EXPECT_LE(tasks[0].end, tasks[1].start);
}

TEST(TaskObserver, ReplacingItWaitsForQueuedWorkAndThenReportsElsewhere) {
  TaskLog first, second;
  auto rt = Runtime::create_cpu(1, {}, &first);
  Stream& s = rt->device(0).compute();
  s.host_func([] { std::this_thread::sleep_for(20ms); });
  rt->set_observer(&second);
  // Queued before the switch, so reported to the first observer, before set_observer returned.
  EXPECT_EQ(first.keys(), (std::vector<std::string>{"0/0 host_func"}));
  s.host_func([] {});
  rt->set_observer(nullptr);
  s.host_func([] {});
  s.synchronize();
  EXPECT_EQ(first.keys().size(), 1u);
  EXPECT_EQ(second.keys(), (std::vector<std::string>{"0/0 host_func"}));
}

// A stream of no backend this process has: what a bug that mixes backends would hand a kernel.
class ForeignStream final : public Stream {
 public:
  explicit ForeignStream(Device& d) : d_(d) {}
  Device& device() override { return d_; }
  Backend backend() const override { return Backend::kCuda; }
  int id() const override { return 0; }
  void record(Event&) override {}
  void wait(const Event&) override {}
  void synchronize() override {}
  bool synchronize_for(std::chrono::milliseconds) override { return true; }
  bool query() override { return true; }
  void copy(void*, const void*, size_t) override {}
  void copy_peer(Device&, void*, const void*, size_t) override {}
  void memset(void*, int, size_t) override {}
  void host_func(std::function<void()>) override {}
  void* native_handle() override { return nullptr; }

 private:
  Device& d_;
};

// Device::alloc_host_pinned on the CPU backend: aligned, writable host memory that a device's
// stream copies into and out of, owned by a movable buffer that may outlive the runtime.
TEST(CpuRuntime, HostCopyBuffersRoundTripThroughADeviceAndOutliveTheRuntime) {
  auto rt = Runtime::create_cpu(2);
  Device& dev = rt->device(1);
  EXPECT_EQ(dev.gemm_workspace_bytes(), 0u);  // OpenBLAS takes nothing from the pool
  EXPECT_EQ(dev.alloc_host_pinned(0).data(), nullptr);
  for (size_t n : {size_t{1}, size_t{255}, size_t{257}, size_t{1} << 20, size_t{3} * 1000 * 1000 + 7}) {
    PinnedHostBuffer src = dev.alloc_host_pinned(n);
    PinnedHostBuffer dst = dev.alloc_host_pinned(n);
    ASSERT_NE(src.data(), nullptr);
    EXPECT_EQ(src.size(), n);
    EXPECT_FALSE(src.pinned());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(src.data()) % 256, 0u) << n;
    auto* bytes = static_cast<uint8_t*>(src.data());
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i * 131 + n);
    void* device_copy = dev.memory().allocate(n, dev.compute(), "test");
    dev.compute().copy(device_copy, src.data(), n);
    std::memset(dst.data(), 0xee, n);
    dev.compute().copy(dst.data(), device_copy, n);
    dev.compute().synchronize();
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), n), 0) << n;
    dev.memory().free(device_copy);
  }
  PinnedHostBuffer kept = dev.alloc_host_pinned(4096);
  PinnedHostBuffer moved = std::move(kept);
  EXPECT_EQ(kept.data(), nullptr);
  EXPECT_EQ(kept.size(), 0u);
  rt.reset();
  std::memset(moved.data(), 0x5a, moved.size());  // still valid (ASan checks) after the runtime is gone
  EXPECT_EQ(static_cast<uint8_t*>(moved.data())[4095], 0x5a);
}

TEST(TaskObserver, CpuEnqueueChecksTheStreamsBackend) {
  auto rt = Runtime::create_cpu(1);
  ForeignStream foreign(rt->device(0));
  bool ran = false;
  try {
    cpu::enqueue(foreign, [&] { ran = true; }, "fill");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(e.message().find("fill was launched through the CPU backend on a stream of cpu:0"), std::string::npos)
        << e.message();
  }
  cpu::enqueue(rt->device(0).compute(), [&] { ran = true; }, "fill");
  rt->synchronize();
  EXPECT_TRUE(ran);
}

}  // namespace
}  // namespace zt
