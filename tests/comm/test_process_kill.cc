// A process SIGKILLed in the middle of ring all-reduces (run only as its own ctest entry, under
// `mpirun --enable-recovery`, which keeps the survivors alive): every survivor must throw within
// the timeout with the sentence naming rank 0, and print it for ctest's pass/fail expressions.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "comm/comm_test_util.h"
#include "comm/mpi_test_env.h"
#include "comm/process_group.h"
#include "comm/process_ring.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

using namespace std::chrono_literals;

TEST(ProcessKill, SurvivorsNameTheKilledRankWithinTheTimeout) {
  if (!mpitest::kill_mode()) GTEST_SKIP() << "runs only as test_mpi_kill_* (--kill-test)";
  ProcessGroup group(1000ms);
  ASSERT_GE(group.size(), 2);
  const int local = mpitest::local_devices();
  auto rt = Runtime::create_cpu(local);
  // Tiny chunks: thousands of rounds per call, so the kill lands mid-collective.
  ProcessRing ring(group, commtest::first_devices(*rt, local), 16);
  commtest::RankBuffers buf(commtest::first_devices(*rt, local), DType::kF32, ring.world() * 2000);
  buf.fill([](int, int64_t e) { return static_cast<float>(e % 7); });
  if (group.rank() == 0) {
    std::thread([] {
      std::this_thread::sleep_for(300ms);
      ::raise(SIGKILL);
    }).detach();
  }
  double last_ok = 0;
  for (int call = 0;; ++call) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      ring.all_reduce(buf.views);
      last_ok = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_LT(call, 1000) << "rank 0 should have been killed long ago";
    } catch (const Error& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const bool names = e.message().find("rank 0 has died or stalled") != std::string::npos ||
                         e.message().find("from rank 0") != std::string::npos;
      std::printf("kill test: rank %d %s rank 0 after %.2f s in call %d (a healthy call took %.2f s): %s\n",
                  group.rank(), names ? "named" : "did NOT name", s, call, last_ok, e.message().c_str());
      std::fflush(stdout);
      EXPECT_TRUE(names) << e.message();
      EXPECT_LT(s, 1.0 + 0.2 + last_ok + 1.0) << "timeout 1 s, chain walk 0.2 s, the call's own work, 1 s of slack";
      break;
    }
  }
}

}  // namespace
}  // namespace zt
