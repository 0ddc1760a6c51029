// Stream capture on the CPU backend (runtime/stream.h): work is recorded, not run; a launch
// enqueues it again in order with the arguments of the capture; the capture rules are CUDA's and
// each broken rule fails the capture with its reason, leaving the stream usable. Runs under
// ThreadSanitizer too (the concurrent test replays graphs on several devices and host threads).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/capture_rules.h"
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

// The refusal `call` throws: a CaptureError of `rule` naming CUDA's error ("" when nothing throws).
std::string refusal(const std::function<void()>& call, CaptureRule rule) {
  try {
    call();
  } catch (const CaptureError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(static_cast<int>(e.rule()), static_cast<int>(rule)) << e.message();
    const char* cuda = capture_rule(rule).cuda_error;
    EXPECT_EQ(e.cuda_error(), cuda ? cuda : "");
    if (cuda) {
      EXPECT_NE(e.message().find(cuda), std::string::npos) << e.message();
    }
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
  EXPECT_NE(refusal([&] { g->launch(s); }, CaptureRule::kLaunchIntoCapture), "") << "a graph launched into a capture";
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

// ---- the capture rules (core/capture_rules.h), one test per entry ------------------------------

// One entry of the table that a zt call on the CPU backend can break, and how.
struct RuleCase {
  CaptureRule rule;
  const char* name;
  bool throws;  // the refused call throws (record/wait fail the capture without throwing, as on CUDA)
  // Breaks the rule while `s`, the compute stream of `d`, captures; `ctx` holds the fixtures.
  std::function<void(Device& d, Stream& s, struct RuleContext& ctx)> call;
};
struct RuleContext {
  std::unique_ptr<Event> recorded, never_recorded;
  void* cached = nullptr;  // freed before the capture: a cached segment of the comm stream
};

class CaptureRuleTest : public ::testing::TestWithParam<RuleCase> {};

// Every entry that invalidates: the call is refused with CUDA's error, the capture fails with it,
// later work on the stream is refused (cudaErrorStreamCaptureInvalidated) until end_capture(),
// which throws cudaErrorStreamCaptureInvalidated with the first reason; then the stream is out of
// capture mode and usable, and nothing of the failed capture runs (the guide's Invalidation).
TEST_P(CaptureRuleTest, RefusedWithCudasErrorAndTheStreamIsUsableAfterEndCapture) {
  const RuleCase& c = GetParam();
  ASSERT_TRUE(capture_rule(c.rule).invalidates);
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  RuleContext ctx;
  ctx.recorded = d.create_event();
  ctx.never_recorded = d.create_event();
  d.comm().record(*ctx.recorded);
  ctx.cached = d.memory().allocate(4096, d.comm(), "cached before the capture");
  d.memory().free(ctx.cached);
  d.synchronize();

  std::atomic<int> ran{0};
  s.begin_capture();
  s.host_func([&] { ran += 1; });
  const std::string why = refusal([&] { c.call(d, s, ctx); }, c.rule);
  if (c.throws) {
    EXPECT_NE(why.find(capture_rule(c.rule).call), std::string::npos) << why;
  } else {
    EXPECT_EQ(why, "") << "the call should fail the capture without throwing";
  }
  EXPECT_TRUE(s.capturing()) << "only end_capture() leaves capture mode";
  const std::string later = refusal([&] { s.host_func([&] { ran += 100; }); }, CaptureRule::kUseAfterInvalidation);
  EXPECT_NE(later.find(capture_rule(c.rule).call), std::string::npos) << later;
  const std::string ended = refusal([&] { s.end_capture(); }, CaptureRule::kUseAfterInvalidation);
  EXPECT_NE(ended.find("cudaErrorStreamCaptureInvalidated"), std::string::npos) << ended;
  EXPECT_NE(ended.find(capture_rule(c.rule).call), std::string::npos) << ended;
  const char* cuda = capture_rule(c.rule).cuda_error;
  if (cuda) {
    EXPECT_NE(ended.find(cuda), std::string::npos) << ended;
  }
  EXPECT_FALSE(s.capturing());
  s.host_func([&] { ran += 10; });
  s.synchronize();
  EXPECT_EQ(ran.load(), 10) << "work of the failed capture ran, or the stream is unusable";
  // A new capture on the same stream works.
  s.begin_capture();
  s.host_func([&] { ran += 1000; });
  const std::unique_ptr<StreamGraph> g = s.end_capture();
  g->launch(s);
  s.synchronize();
  EXPECT_EQ(ran.load(), 1010);
}

const RuleCase kRuleCases[] = {
    {CaptureRule::kStreamSynchronize, "StreamSynchronize", true, [](Device&, Stream& s, RuleContext&) { s.synchronize(); }},
    {CaptureRule::kStreamSynchronize, "StreamSynchronizeFor", true,
     [](Device&, Stream& s, RuleContext&) { (void)s.synchronize_for(std::chrono::milliseconds(1)); }},
    {CaptureRule::kStreamQuery, "StreamQuery", true, [](Device&, Stream& s, RuleContext&) { (void)s.query(); }},
    {CaptureRule::kDeviceSynchronize, "DeviceSynchronize", true, [](Device& d, Stream&, RuleContext&) { d.synchronize(); }},
    {CaptureRule::kDeviceSynchronize, "DeviceSynchronizeFor", true,
     [](Device& d, Stream&, RuleContext&) { (void)d.synchronize_for(std::chrono::milliseconds(1)); }},
    // For another stream: the pool's own rule for the capturing stream does not apply.
    {CaptureRule::kRawAllocation, "RawAllocationForAnotherStream", true,
     [](Device& d, Stream&, RuleContext&) { d.memory().allocate(size_t{64} << 20, d.comm(), "needs a segment"); }},
    {CaptureRule::kRawFree, "RawFree", true, [](Device& d, Stream&, RuleContext&) { d.memory().empty_cache(); }},
    {CaptureRule::kHostPinnedAllocation, "HostPinnedAllocation", true,
     [](Device& d, Stream&, RuleContext&) { (void)d.alloc_host_pinned(64); }},
    {CaptureRule::kEventQuery, "EventQuery", true, [](Device&, Stream&, RuleContext& c) { (void)c.recorded->query(); }},
    {CaptureRule::kEventQuery, "EventSynchronize", true,
     [](Device&, Stream&, RuleContext& c) { c.recorded->synchronize(); }},
    {CaptureRule::kWaitOnUncapturedEvent, "WaitOnUncapturedEvent", false,
     [](Device&, Stream& s, RuleContext& c) { s.wait(*c.recorded); }},
    {CaptureRule::kRecordInCapture, "RecordInCapture", false,
     [](Device&, Stream& s, RuleContext& c) { s.record(*c.never_recorded); }},
    {CaptureRule::kWaitInCapture, "WaitOnNeverRecordedEvent", false,
     [](Device&, Stream& s, RuleContext& c) { s.wait(*c.never_recorded); }},
    {CaptureRule::kPoolForCapturingStream, "PoolAllocationForTheCapturingStream", true,
     [](Device& d, Stream& s, RuleContext&) { d.memory().allocate(1024, s, "inside the capture"); }},
};
INSTANTIATE_TEST_SUITE_P(Rules, CaptureRuleTest, ::testing::ValuesIn(kRuleCases),
                         [](const ::testing::TestParamInfo<RuleCase>& info) { return std::string(info.param.name); });

TEST(CaptureRules, TheTableHasOneEntryPerRuleInOrder) {
  for (int r = 0; r < static_cast<int>(CaptureRule::kCount); ++r) {
    const CaptureRuleInfo& info = capture_rule(static_cast<CaptureRule>(r));
    EXPECT_EQ(static_cast<int>(info.rule), r);
    EXPECT_NE(std::string(info.call), "");
    EXPECT_NE(std::string(info.source), "");
    // A CUDA rule names the CUDA calls it covers; ZeroTrain's own rules cover none.
    EXPECT_EQ(info.cuda_error != nullptr, std::string(info.cuda_calls) != "") << info.call;
  }
}

TEST(CaptureRules, FreeingABlockOfTheCapturingStreamFailsTheCapture) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  void* before = d.memory().allocate(4096, s, "before the capture");
  s.begin_capture();
  d.memory().free(before);  // freed (a destructor may do this) without a throw, but the capture is over
  const std::string ended = refusal([&] { s.end_capture(); }, CaptureRule::kUseAfterInvalidation);
  EXPECT_NE(ended.find("freed a block of 'before the capture'"), std::string::npos) << ended;
  EXPECT_EQ(d.memory().stats().active_blocks, 0u);
}

// The pool serves another stream from its cache on the capturing thread (CUDA calls nothing for
// that), without polling its pending events (cudaEventQuery would fail the capture).
TEST(CaptureRules, ThePoolServesOtherStreamsFromItsCacheDuringACapture) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  CachingAllocator& pool = d.memory();
  void* shared = pool.allocate(4096, d.comm(), "used by both streams");
  pool.record_stream(shared, s);
  void* cached = pool.allocate(4096, d.comm(), "cached");
  pool.free(cached);
  pool.free(shared);  // pending on an event of s
  d.synchronize();
  const uint64_t raw_before = pool.stats().num_raw_allocs;
  s.begin_capture();
  void* again = pool.allocate(4096, d.comm(), "from the cache");
  pool.free(again);
  EXPECT_NE(s.end_capture(), nullptr);
  EXPECT_EQ(pool.stats().num_raw_allocs, raw_before);
}

// Thread-local mode: the potentially unsafe calls are refused on the thread that captures only.
TEST(CaptureRules, OtherThreadsMayQueryEventsAndAllocateDuringACapture) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  auto e = d.create_event();
  d.comm().record(*e);
  s.begin_capture();
  std::thread other([&] {
    e->synchronize();
    EXPECT_TRUE(e->query());
    void* p = d.memory().allocate(size_t{64} << 20, d.comm(), "another thread");
    d.memory().free(p);
    (void)d.alloc_host_pinned(64);
  });
  other.join();
  EXPECT_NE(s.end_capture(), nullptr) << "another thread's calls failed the capture";
}

TEST(CaptureRules, EndCaptureOnAnotherThreadIsRefusedAndTheCaptureStaysOpen) {
  ASSERT_FALSE(capture_rule(CaptureRule::kEndOnOtherThread).invalidates);
  auto rt = Runtime::create_cpu(1);
  Stream& s = rt->device(0).compute();
  int ran = 0;
  s.begin_capture();
  s.host_func([&] { ++ran; });
  std::string why;
  std::thread other([&] { why = refusal([&] { s.end_capture(); }, CaptureRule::kEndOnOtherThread); });
  other.join();
  EXPECT_NE(why.find("cudaErrorStreamCaptureWrongThread"), std::string::npos) << why;
  EXPECT_TRUE(s.capturing());
  const std::unique_ptr<StreamGraph> g = s.end_capture();  // by the thread that began it
  EXPECT_EQ(g->size(), 1u);
  g->launch(s);
  s.synchronize();
  EXPECT_EQ(ran, 1);
}

// cudaErrorCapturedEvent needs an event recorded inside a capture; record() there is refused (our
// single-stream rule), so a zt event never becomes one: after the failed capture it is still
// never recorded, and querying it once the capture is over is allowed.
TEST(CaptureRules, NoEventIsEverACapturedEvent) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  Stream& s = d.compute();
  auto e = d.create_event();
  s.begin_capture();
  s.record(*e);
  EXPECT_NE(refusal([&] { s.end_capture(); }, CaptureRule::kUseAfterInvalidation), "");
  EXPECT_TRUE(e->query());
  d.comm().wait(*e);  // a no-op: never recorded
  d.synchronize();
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


// ---- the calls no zt entry point stands in front of: a source check of the CUDA launchers -------
// The CUDA launchers (kernels/cuda) run inside captures and call CUDA directly, so
// the CPU backend cannot refuse what they ask CUDA for: the first GPU run's capture failed on a
// cudaStreamGetDevice in LaunchScope that no CPU test could reach. Instead this scans their
// sources for every CUDA call the table says a launcher must not make (comments and string
// literals skipped); it runs without a GPU.

// `source` with comments and string/char literals blanked, newlines kept (lines still count).
std::string blank_comments_and_strings(const std::string& source) {
  std::string code = source;
  for (size_t i = 0; i < code.size(); ++i) {
    if (code.compare(i, 2, "//") == 0) {
      while (i < code.size() && code[i] != '\n') code[i++] = ' ';
    } else if (code.compare(i, 2, "/*") == 0) {
      const size_t end = std::min(code.find("*/", i + 2), code.size() - 2) + 2;
      for (; i < end; ++i)
        if (code[i] != '\n') code[i] = ' ';
      --i;
    } else if (code[i] == '"' || (code[i] == '\'' && i + 2 < code.size())) {
      const char quote = code[i];
      code[i++] = ' ';
      while (i < code.size() && code[i] != quote && code[i] != '\n') {
        if (code[i] == '\\' && i + 1 < code.size()) code[i++] = ' ';
        code[i++] = ' ';
      }
      if (i < code.size() && code[i] == quote) code[i] = ' ';
    }
  }
  return code;
}

bool ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// "name:line" for each call of a refused CUDA function in `source`.
std::vector<std::string> refused_calls_in(const std::string& source) {
  const std::string code = blank_comments_and_strings(source);
  const auto ident = ident_char;
  std::vector<std::string> found;
  for (const CaptureRuleInfo& info : kCaptureRules) {
    if (!info.launchers_must_not_call) continue;
    std::istringstream names(info.cuda_calls);
    for (std::string name; names >> name;) {
      for (size_t at = code.find(name); at != std::string::npos; at = code.find(name, at + 1)) {
        if ((at > 0 && ident(code[at - 1])) || (at + name.size() < code.size() && ident(code[at + name.size()])))
          continue;  // part of a longer name (cudaMemcpyAsync, cudaMallocAsync: legal in a capture)
        const auto line = 1 + std::count(code.begin(), code.begin() + static_cast<std::ptrdiff_t>(at), '\n');
        found.push_back(name + ":" + std::to_string(line));
      }
    }
  }
  return found;
}

TEST(CaptureRules, TheSourceCheckFindsARefusedCallAndSkipsCommentsAndStrings) {
  // The launcher of the first GPU run, and its legal neighbours.
  const std::string before = "  static int stream_device(cudaStream_t s) {\n    int ordinal = 0;\n"
                             "    ZT_CUDA_CHECK(cudaStreamGetDevice(s, &ordinal));\n";
  EXPECT_EQ(refused_calls_in(before), (std::vector<std::string>{"cudaStreamGetDevice:3"}));
  EXPECT_EQ(refused_calls_in("cudaMemcpy (a, b, n, k);\ncudaFree(p); cudaDeviceSynchronize();"),
            (std::vector<std::string>{"cudaDeviceSynchronize:2", "cudaFree:2", "cudaMemcpy:1"}));
  EXPECT_EQ(refused_calls_in("// not cudaStreamGetDevice(s)\n/* cudaMalloc(&p) */ x = \"cudaEventQuery(e)\";\n"
                             "cudaMemcpyAsync(a, b, n, k, s); cudaMallocAsync(&p, n, s); cudaStreamGetDevices(x);"),
            std::vector<std::string>{});
}

TEST(CaptureRules, NoCudaLauncherCallsWhatACaptureRefuses) {
  const std::filesystem::path root = ZT_SOURCE_DIR;  // tests/CMakeLists.txt
  std::vector<std::string> found;
  int files = 0;
  for (const char* dir : {"kernels/cuda"}) {
    ASSERT_TRUE(std::filesystem::is_directory(root / dir)) << (root / dir) << " not found: the check needs the sources";
    for (const auto& entry : std::filesystem::directory_iterator(root / dir)) {
      const std::string ext = entry.path().extension().string();
      if (ext != ".cu" && ext != ".cc" && ext != ".h" && ext != ".cuh") continue;
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      ++files;
      for (const std::string& f : refused_calls_in(text.str()))
        found.push_back(std::string(dir) + "/" + entry.path().filename().string() + ": " + f);
    }
  }
  EXPECT_GE(files, 10) << "the launchers were not found under " << root;
  EXPECT_TRUE(found.empty()) << "CUDA launchers call what CUDA refuses during stream capture (see "
                                "core/capture_rules.h; use cuda::stream_ordinal for a stream's GPU): "
                             << ::testing::PrintToString(found);
}


// ---- current-device discipline: a source check of the CUDA launchers ----------------------------
// CUDA launches a kernel, and cuBLAS/cuDNN act, on the calling thread's current device, and a kernel
// "will fail if it is issued to a stream that is not associated to the current device" (CUDA
// programming guide, Stream and Event Behavior). A launcher that forgets its LaunchScope works
// whenever the thread happens to be on the stream's GPU: always on a one-GPU machine, where every
// GPU run so far happened. So the launchers' sources are checked instead: every function of
// kernels/cuda that takes a stream as `void* stream` / `void* native` and launches work on it
// itself (a kernel, a cuBLAS/cuDNN call, a CUDA stream/event/graph/copy call, or the cast of the
// handle to a cudaStream_t for a helper) must open a LaunchScope or a DeviceGuard.

// "name:line" for each such function without a scope in `source`.
std::vector<std::string> unscoped_launchers_in(const std::string& source) {
  const std::string code = blank_comments_and_strings(source);
  const auto line_of = [&](size_t at) {
    return 1 + std::count(code.begin(), code.begin() + static_cast<std::ptrdiff_t>(at), '\n');
  };
  const auto skip_space = [&](size_t i) {
    while (i < code.size() && std::isspace(static_cast<unsigned char>(code[i]))) ++i;
    return i;
  };
  // Does `body` launch work itself?
  const auto launches = [](const std::string& body) {
    if (body.find("<<<") != std::string::npos || body.find("static_cast<cudaStream_t>") != std::string::npos)
      return true;
    for (size_t i = 0; i < body.size();) {
      if (!ident_char(body[i]) || (i > 0 && ident_char(body[i - 1]))) {
        ++i;
        continue;
      }
      size_t end = i;
      while (end < body.size() && ident_char(body[end])) ++end;
      const std::string name = body.substr(i, end - i);
      size_t next = end;
      while (next < body.size() && std::isspace(static_cast<unsigned char>(body[next]))) ++next;
      const bool call = next < body.size() && body[next] == '(';
      const bool member = i > 0 && (body[i - 1] == '.' || body[i - 1] == '>');
      if (call && (name.rfind("cublas", 0) == 0 || name.rfind("cudnn", 0) == 0 || name.rfind("cudaMemcpy", 0) == 0 ||
                   name.rfind("cudaMemset", 0) == 0 || name.rfind("cudaLaunch", 0) == 0 ||
                   name.rfind("cudaGraph", 0) == 0 || name.rfind("cudaEvent", 0) == 0 ||
                   name.rfind("cudaStream", 0) == 0 || (member && name == "execute")))
        return true;
      i = end;
    }
    return false;
  };
  std::vector<std::string> found;
  std::vector<size_t> seen;  // bodies already judged (a function taking both names)
  for (size_t at = code.find("void"); at != std::string::npos; at = code.find("void", at + 1)) {
    if ((at > 0 && ident_char(code[at - 1])) || ident_char(code[at + 4])) continue;
    size_t i = skip_space(at + 4);
    if (i >= code.size() || code[i] != '*') continue;
    i = skip_space(i + 1);
    if (code.compare(i, 6, "stream") != 0 && code.compare(i, 6, "native") != 0) continue;
    if (i + 6 >= code.size() || ident_char(code[i + 6])) continue;
    // The parameter list around it, then a body: a definition, not a declaration or a call.
    size_t open = at;
    for (int depth = 0; open-- > 0;) {
      if (code[open] == ')') ++depth;
      if (code[open] == '(' && depth-- == 0) break;
      if (code[open] == ';' || code[open] == '{' || code[open] == '}') {
        open = std::string::npos;
        break;
      }
    }
    if (open == std::string::npos) continue;
    size_t close = i;
    for (int depth = 0; close < code.size(); ++close) {
      if (code[close] == '(') ++depth;
      if (code[close] == ')' && depth-- == 0) break;
    }
    size_t brace = skip_space(close + 1);
    if (code.compare(brace, 5, "const") == 0) brace = skip_space(brace + 5);
    if (brace >= code.size() || code[brace] != '{' ||
        std::find(seen.begin(), seen.end(), brace) != seen.end())
      continue;
    seen.push_back(brace);
    size_t end = brace + 1;
    for (int depth = 1; end < code.size() && depth > 0; ++end) {
      if (code[end] == '{') ++depth;
      if (code[end] == '}') --depth;
    }
    const std::string body = code.substr(brace, end - brace);
    if (!launches(body) || body.find("LaunchScope") != std::string::npos ||
        body.find("DeviceGuard") != std::string::npos)
      continue;
    size_t name_end = open;
    while (name_end > 0 && std::isspace(static_cast<unsigned char>(code[name_end - 1]))) --name_end;
    size_t name_begin = name_end;
    while (name_begin > 0 && ident_char(code[name_begin - 1])) --name_begin;
    found.push_back(code.substr(name_begin, name_end - name_begin) + ":" + std::to_string(line_of(name_begin)));
  }
  return found;
}

TEST(DeviceDiscipline, TheSourceCheckFindsALauncherWithoutAScope) {
  const std::string launcher =
      "void scale(void* stream, float* x, int64_t n) {\n"
      "  scale_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(x, n);\n}\n"
      "void run(const Plan& plan, void* native) {\n  plan.graph->execute(h, pack, ws);\n}\n"
      "void gemm(void* stream) {\n  cublasSgemm(handle(stream), 1);\n}\n";
  EXPECT_EQ(unscoped_launchers_in(launcher), (std::vector<std::string>{"scale:1", "run:4", "gemm:7"}));
  // Scoped, a declaration, a helper that launches nothing itself, and a mention in a comment.
  EXPECT_EQ(unscoped_launchers_in("void scale(void* stream, float* x) {\n  detail::LaunchScope scope(stream);\n"
                                  "  k<<<1, 1, 0, scope.stream()>>>(x);\n}\nvoid decl(void* stream, int n);\n"
                                  "void adamw(void* stream, int n) { launch_update(stream, n); }\n"
                                  "// void f(void* stream) { k<<<1, 1>>>(); }\n"
                                  "void cudnn_run(Stream& s, void* native) {\n  const cuda::DeviceGuard g(d);\n"
                                  "  cudnnSetStream(h, static_cast<cudaStream_t>(native));\n}\n"),
            std::vector<std::string>{});
}

TEST(DeviceDiscipline, EveryCudaLauncherMakesItsStreamsGpuCurrent) {
  const std::filesystem::path root = ZT_SOURCE_DIR;  // tests/CMakeLists.txt
  const std::filesystem::path dir = root / "kernels/cuda";
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir << " not found: the check needs the sources";
  std::vector<std::string> found;
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string ext = entry.path().extension().string();
    if (ext != ".cu" && ext != ".cc") continue;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    ++files;
    for (const std::string& f : unscoped_launchers_in(text.str()))
      found.push_back("kernels/cuda/" + entry.path().filename().string() + ": " + f);
  }
  EXPECT_GE(files, 10) << "the launchers were not found under " << dir;
  EXPECT_TRUE(found.empty()) << "CUDA launchers enqueue work without making their stream's GPU current "
                                "(open a detail::LaunchScope, or a cuda::DeviceGuard for cuda::stream_ordinal): "
                             << ::testing::PrintToString(found);
}

}  // namespace
}  // namespace zt
