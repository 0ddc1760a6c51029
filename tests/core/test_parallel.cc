// parallel_for: covers every index exactly once, for awkward sizes, from concurrent callers, and
// rethrows exceptions on the caller.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/parallel.h"

namespace zt {
namespace {

TEST(Parallel, EveryIndexExactlyOnce) {
  for (int64_t n : {0, 1, 2, 7, 63, 64, 65, 1000, 100003}) {
    for (int64_t grain : {1, 3, 64, 100000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      parallel_for(n, grain, [&](int64_t b, int64_t e) {
        ASSERT_LE(0, b);
        ASSERT_LE(b, e);
        ASSERT_LE(e, n);
        for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << n << " " << grain;
    }
  }
}

TEST(Parallel, ConcurrentCallersAndNesting) {
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int rep = 0; rep < 20; ++rep)
        parallel_for(100, 1, [&](int64_t b, int64_t e) {
          parallel_for(e - b, 1, [&](int64_t bb, int64_t ee) { total += ee - bb; });
        });
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 20 * 100);
}

TEST(Parallel, RethrowsOnCaller) {
  EXPECT_THROW(parallel_for(1000, 1,
                            [](int64_t b, int64_t e) {
                              if (b <= 500 && 500 < e) throw std::runtime_error("chunk failed");
                            }),
               std::runtime_error);
}

}  // namespace
}  // namespace zt
