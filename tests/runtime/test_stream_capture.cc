// Stream capture on the CPU backend (runtime/stream.h): work is recorded, not run; a launch
// enqueues it again in order with the arguments of the capture; the capture rules are CUDA's and
// each broken rule fails the capture with its reason, leaving the stream usable. Runs under
// ThreadSanitizer too (the concurrent test replays graphs on several devices and host threads).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

// The reason a failed capture gives at end_capture() (empty when it did not fail).
std::string end_capture_error(Stream& s) {
  try {
    s.end_capture();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.message();
  }
  return "";
}

TEST(StreamCapture, RecordsInsteadOfRunningAndReplaysInOrder) {
  auto rt = Runtime::create_cpu(1);
  Stream& s = rt->device(0).compute();
  std::vector<int> src{1, 2, 3, 4}, dst(4, 0), order;
  std::atomic<int> calls{0};
  s.begin_capture();
  EXPECT_TRUE(s.capturing());
  s.memset(dst.data(), 0, dst.size() * sizeof(int));
  s.copy(dst.data(), src.data(), 2 * sizeof(int));
  s.host_func([&] {
    order.push_back(dst[0] + dst[1]);  // sees the copy before it
    calls.fetch_add(1);
  });
  const std::unique_ptr<StreamGraph> g = s.end_capture();
  EXPECT_FALSE(s.capturing());
  EXPECT_EQ(g->size(), 3u);
  s.synchronize();
  EXPECT_EQ(calls.load(), 0) << "a capture ran its work";
  EXPECT_EQ(dst, (std::vector<int>{0, 0, 0, 0}));
  g->launch(s);
  s.synchronize();
  src[0] = 10;  // the graph holds the address, not the value
  g->launch(s);
  s.synchronize();
  EXPECT_EQ(calls.load(), 2);
  EXPECT_EQ(order, (std::vector<int>{3, 12}));
  EXPECT_EQ(dst, (std::vector<int>{10, 2, 0, 0}));
}

TEST(StreamCapture, LaunchesOnAnotherStreamOfTheSameDeviceOnly) {
  auto rt = Runtime::create_cpu(2);
  Stream& s = rt->device(0).compute();
  int x = 0;
  s.begin_capture();
  s.host_func([&] { ++x; });
  const std::unique_ptr<StreamGraph> g = s.end_capture();
  g->launch(rt->device(0).comm());
  rt->device(0).synchronize();
  EXPECT_EQ(x, 1);
  EXPECT_THROW(g->launch(rt->device(1).compute()), Error);
  s.begin_capture();
  EXPECT_THROW(g->launch(s), Error) << "a graph launched into a capture";
  EXPECT_EQ(end_capture_error(s), "");  // the refused launch did not break the capture
}

TEST(StreamCapture, BeginTwiceOrEndWithoutBeginIsRefused) {
  auto rt = Runtime::create_cpu(1);
  Stream& s = rt->device(0).compute();
  EXPECT_THROW(s.end_capture(), Error);
  s.begin_capture();
  EXPECT_THROW(s.begin_capture(), Error);
  EXPECT_EQ(end_capture_error(s), "");
}

TEST(StreamCapture, SynchronizeOrQueryInsideFailsTheCapture) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  const std::vector<std::pair<std::string, std::function<void()>>> calls = {
      {"synchronize() of a capturing stream", [&] { s.synchronize(); }},
      {"query() of a capturing stream", [&] { (void)s.query(); }},
      {"synchronize_for() of a capturing stream", [&] { (void)s.synchronize_for(std::chrono::milliseconds(1)); }},
      {"synchronize() of cpu:0 while its stream 0 is capturing", [&] { d.synchronize(); }},
  };
  for (const auto& [why, call] : calls) {
    int ran = 0;
    s.begin_capture();
    s.host_func([&] { ++ran; });
    EXPECT_THROW(call(), Error) << why;
    const std::string error = end_capture_error(s);
    EXPECT_NE(error.find(why), std::string::npos) << error;
    // Usable afterwards, and nothing of the failed capture runs.
    s.host_func([&] { ran += 10; });
    s.synchronize();
    EXPECT_EQ(ran, 10) << why;
  }
}

TEST(StreamCapture, PoolAllocationOrFreeInsideFailsTheCapture) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  CachingAllocator& pool = d.memory();
  void* before = pool.allocate(4096, s, "before the capture");
  s.begin_capture();
  try {
    pool.allocate(1024, s, "inside the capture");
    ADD_FAILURE() << "the pool allocated for a capturing stream";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  }
  std::string error = end_capture_error(s);
  EXPECT_NE(error.find("'inside the capture'"), std::string::npos) << error;
  EXPECT_NE(error.find("allocate before the capture"), std::string::npos) << error;

  s.begin_capture();
  pool.free(before);  // freed (a destructor may do this), but the capture is over
  error = end_capture_error(s);
  EXPECT_NE(error.find("freed a block of 'before the capture'"), std::string::npos) << error;

  // Another stream's allocations are not the capture's business.
  s.begin_capture();
  void* other = pool.allocate(1024, d.comm(), "comm");
  pool.free(other);
  EXPECT_EQ(end_capture_error(s), "");
  EXPECT_EQ(pool.stats().active_blocks, 0u);
}

TEST(StreamCapture, AnotherStreamThroughAnEventFailsTheCapture) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  auto e = d.create_event();
  // Fork: an event recorded inside, for another stream to wait on.
  s.begin_capture();
  s.record(*e);
  d.comm().wait(*e);
  std::string error = end_capture_error(s);
  EXPECT_NE(error.find("record() of an event on a capturing stream"), std::string::npos) << error;
  EXPECT_NE(error.find("single-stream"), std::string::npos) << error;
  // Join: waiting on an event another stream recorded outside the capture.
  d.comm().record(*e);
  s.begin_capture();
  s.wait(*e);
  error = end_capture_error(s);
  EXPECT_NE(error.find("wait() on an event by a capturing stream"), std::string::npos) << error;
  d.synchronize();
  EXPECT_TRUE(e->query());
}

TEST(StreamCapture, ConcurrentReplaysOnSeveralDevicesAreOrderedByEvents) {
  // Each device's graph doubles its own buffer, then (eagerly) copies it to the next device,
  // which waits for it: ThreadSanitizer sees every handoff ordered by events only.
  constexpr int kDevices = 3, kRounds = 20, kN = 64;
  auto rt = Runtime::create_cpu(kDevices);
  std::vector<std::vector<float>> buf(kDevices, std::vector<float>(kN)), in(kDevices, std::vector<float>(kN, 0));
  std::vector<std::unique_ptr<StreamGraph>> graphs(kDevices);
  std::vector<std::unique_ptr<Event>> done;
  for (int i = 0; i < kDevices; ++i) {
    for (int k = 0; k < kN; ++k) buf[i][static_cast<size_t>(k)] = static_cast<float>(i + k);
    done.push_back(rt->device(i).create_event());
    Stream& s = rt->device(i).compute();
    float* b = buf[i].data();
    const float* x = in[i].data();
    s.begin_capture();
    s.host_func([b, x] {
      for (int k = 0; k < kN; ++k) b[k] = 2 * b[k] + x[k];
    });
    graphs[i] = s.end_capture();
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kDevices; ++i)
    threads.emplace_back([&, i] {
      Stream& s = rt->device(i).compute();
      for (int r = 0; r < kRounds; ++r) graphs[i]->launch(s);
      s.record(*done[i]);
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kDevices; ++i) {
    const int next = (i + 1) % kDevices;
    rt->device(i).compute().wait(*done[next]);  // in[i] is read by graph i: only after its rounds
    rt->device(i).compute().copy(in[i].data(), buf[next].data(), kN * sizeof(float));
  }
  for (int i = 0; i < kDevices; ++i) rt->device(i).synchronize();
  for (int i = 0; i < kDevices; ++i) {
    const int next = (i + 1) % kDevices;
    for (int k = 0; k < kN; ++k) {
      const float want = static_cast<float>(next + k) * static_cast<float>(1 << kRounds);
      ASSERT_EQ(buf[i][static_cast<size_t>(k)], static_cast<float>(i + k) * static_cast<float>(1 << kRounds));
      ASSERT_EQ(in[i][static_cast<size_t>(k)], want);
    }
  }
}

}  // namespace
}  // namespace zt
