// ProcessGroup across the processes of one mpirun: point-to-point and all-gather contents, size
// mismatches, and timeouts that name the silent rank within the deadline (one rank never sends).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/mpi_test_env.h"
#include "comm/process_group.h"
#include "core/philox.h"
#include "core/status.h"

namespace zt {
namespace {

using namespace std::chrono_literals;

// Philox bytes that depend on (sender, receiver, i): a message carrying the wrong data fails.
std::vector<uint32_t> payload(int from, int to, size_t n) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = philox_u32(18, static_cast<uint64_t>(from * 64 + to), i);
  return v;
}

TEST(ProcessGroup, RankAndSizeMatchTheLaunch) {
  ProcessGroup g(20s);
  EXPECT_EQ(g.rank(), mpitest::world().rank());
  EXPECT_EQ(g.size(), mpitest::world().size());
  const std::vector<int> ranks = g.all_gather(g.rank());
  for (int p = 0; p < g.size(); ++p) EXPECT_EQ(ranks[static_cast<size_t>(p)], p);
}

TEST(ProcessGroup, RingShiftCarriesEveryByte) {
  ProcessGroup g(20s);
  if (g.size() < 2) GTEST_SKIP() << "needs two processes";
  const int next = (g.rank() + 1) % g.size();
  const int prev = (g.rank() + g.size() - 1) % g.size();
  for (const size_t n : {size_t{0}, size_t{1}, size_t{1021}, size_t{1} << 18}) {
    const std::vector<uint32_t> out = payload(g.rank(), next, n);
    std::vector<uint32_t> in(n, 0xFFFFFFFFu);
    g.send_recv(next, out.data(), n * 4, prev, in.data(), n * 4, 3, "the shift test");
    EXPECT_EQ(in, payload(prev, g.rank(), n)) << n << " words";
  }
  // Blocking halves, ordered so that they cannot deadlock: even ranks send first.
  const std::vector<uint32_t> out = payload(g.rank(), next, 77);
  std::vector<uint32_t> in(77);
  if (g.rank() % 2 == 0) {
    g.send(next, out.data(), out.size() * 4, 4);
    g.recv(prev, in.data(), in.size() * 4, 4);
  } else {
    g.recv(prev, in.data(), in.size() * 4, 4);
    g.send(next, out.data(), out.size() * 4, 4);
  }
  EXPECT_EQ(in, payload(prev, g.rank(), 77));
}

TEST(ProcessGroup, AllGatherOrdersByRank) {
  ProcessGroup g(20s);
  struct Value {
    int32_t rank;
    uint64_t word;
  };
  const Value mine{g.rank(), philox_u32(5, 0, static_cast<uint64_t>(g.rank())) * 3ull};
  const std::vector<Value> all = g.all_gather(mine);
  ASSERT_EQ(static_cast<int>(all.size()), g.size());
  for (int p = 0; p < g.size(); ++p) {
    EXPECT_EQ(all[static_cast<size_t>(p)].rank, p);
    EXPECT_EQ(all[static_cast<size_t>(p)].word, philox_u32(5, 0, static_cast<uint64_t>(p)) * 3ull);
  }
  g.barrier();
}

TEST(ProcessGroup, SizeMismatchIsOneSentenceNamingTheSender) {
  ProcessGroup g(20s);
  if (g.size() < 2) GTEST_SKIP() << "needs two processes";
  if (g.rank() == 0) {
    const std::vector<char> out(24, 'x');
    g.send(1, out.data(), out.size(), 7);
  } else if (g.rank() == 1) {
    std::vector<char> in(16);
    try {
      g.recv(0, in.data(), in.size(), 7, "the mismatch test");
      ADD_FAILURE() << "a 24-byte message into a 16-byte receive must throw";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("rank 0"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("the mismatch test"), std::string::npos) << e.message();
      EXPECT_TRUE(g.broken());
    }
  }
  mpitest::world().barrier("the end of the mismatch test");
}

TEST(ProcessGroup, BadArgumentsAreRefused) {
  ProcessGroup g(20s);
  char b = 0;
  EXPECT_THROW(g.send(g.rank(), &b, 1, 0), Error);            // to oneself
  EXPECT_THROW(g.recv(g.size(), &b, 1, 0), Error);            // no such rank
  EXPECT_THROW(g.send((g.rank() + 1) % g.size(), &b, 1, ProcessGroup::kMaxTag + 1), Error);
  EXPECT_THROW(g.set_timeout(0ms), Error);
  EXPECT_FALSE(g.broken());
}

// Rank 0 never sends; rank 1 must give up after the timeout (not long after) with one sentence
// naming rank 0 and what it waited for, and its group is broken from then on.
TEST(ProcessGroup, SilentPeerTimesOutNamingIt) {
  ProcessGroup g(1000ms);
  if (g.size() < 2) GTEST_SKIP() << "needs two processes";
  if (g.rank() == 1) {
    std::vector<char> in(4096);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      g.recv(0, in.data(), in.size(), 9, "the gradient shard of step 12");
      ADD_FAILURE() << "a receive from a rank that never sends must time out";
    } catch (const Error& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_GE(s, 0.95);
      EXPECT_LT(s, 4.0) << "the timeout is 1 s";
      EXPECT_EQ(e.kind(), ErrorKind::kDevice);
      EXPECT_NE(e.message().find("rank 1 waited 1.0 s for rank 0 to send"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("the gradient shard of step 12"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("rank 0 has died or stalled"), std::string::npos) << e.message();
      EXPECT_EQ(e.message().find('\n'), std::string::npos) << "one sentence";
    }
    EXPECT_TRUE(g.broken());
    char b = 0;
    try {
      g.send(0, &b, 1, 0);
      ADD_FAILURE() << "a broken group must refuse further calls";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("broken"), std::string::npos) << e.message();
    }
  }
  mpitest::world().barrier("the end of the timeout test");
}

// A collective waits for every peer: the one that never arrives is named by everyone waiting.
TEST(ProcessGroup, AllGatherTimeoutNamesTheMissingRank) {
  ProcessGroup g(1000ms);
  if (g.size() < 2) GTEST_SKIP() << "needs two processes";
  if (g.rank() != 0) {
    try {
      (void)g.all_gather(g.rank(), "the step-7 loss");
      ADD_FAILURE() << "an all-gather without rank 0 must time out";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("for rank 0 to send"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("the step-7 loss"), std::string::npos) << e.message();
    }
  }
  mpitest::world().barrier("the end of the all-gather timeout test");
}

}  // namespace
}  // namespace zt
