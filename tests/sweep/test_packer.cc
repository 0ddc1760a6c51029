// DevicePacker (src/sweep/packer.h): disjoint device subsets, lowest free first, freed devices
// reused, misuse refused; a random acquire/release walk against a direct free-set reference.
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "core/status.h"
#include "sweep/packer.h"
#include "test_util.h"

namespace zt::sweep {
namespace {

using Devices = std::vector<int>;

std::optional<ErrorKind> release_error(DevicePacker& p, const Devices& d) {
  try {
    p.release(d);
  } catch (const Error& e) {
    return e.kind();
  }
  return std::nullopt;
}

TEST(DevicePacker, LowestFreeFirstAndFreedDevicesReused) {
  DevicePacker p(8);
  EXPECT_EQ(p.devices(), 8);
  EXPECT_EQ(p.free_count(), 8);
  EXPECT_EQ(p.acquire(2), Devices({0, 1}));
  EXPECT_EQ(p.acquire(3), Devices({2, 3, 4}));
  EXPECT_EQ(p.free_count(), 3);
  EXPECT_EQ(p.acquire(4), std::nullopt);  // 3 free
  EXPECT_EQ(p.free_count(), 3);           // a refused request takes nothing
  p.release({0, 1});
  EXPECT_TRUE(p.is_free(0));
  EXPECT_FALSE(p.is_free(2));
  EXPECT_EQ(p.acquire(4), Devices({0, 1, 5, 6}));  // the freed pair first, then the lowest others
  EXPECT_EQ(p.acquire(1), Devices({7}));
  EXPECT_EQ(p.acquire(1), std::nullopt);
  p.release({3, 2, 4});  // any order
  EXPECT_EQ(p.acquire(1), Devices({2}));
  EXPECT_EQ(p.free_count(), 2);
}

TEST(DevicePacker, EightOneDeviceTrialsOrFourTwoDeviceTrials) {
  DevicePacker one(8);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(one.acquire(1), Devices({i}));
  EXPECT_EQ(one.acquire(1), std::nullopt);
  DevicePacker two(8);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(two.acquire(2), Devices({2 * i, 2 * i + 1}));
  EXPECT_EQ(two.acquire(2), std::nullopt);
  EXPECT_EQ(two.free_count(), 0);
}

TEST(DevicePacker, MovedStateKeepsItsHoldings) {
  DevicePacker a(4);
  a.acquire(2);
  DevicePacker b = std::move(a);
  EXPECT_EQ(b.free_count(), 2);
  EXPECT_EQ(b.acquire(2), Devices({2, 3}));
  DevicePacker c(1);
  c = std::move(b);
  EXPECT_EQ(c.devices(), 4);
  EXPECT_EQ(c.free_count(), 0);
  c.release({0, 1, 2, 3});
  EXPECT_EQ(c.free_count(), 4);
}

TEST(DevicePacker, MisuseIsRefusedAndChangesNothing) {
  DevicePacker p(4);
  const Devices held = *p.acquire(2);  // {0, 1}
  EXPECT_EQ(release_error(p, {2}), ErrorKind::kInternal);      // free, not held
  EXPECT_EQ(release_error(p, {4}), ErrorKind::kInternal);      // no such device
  EXPECT_EQ(release_error(p, {-1}), ErrorKind::kInternal);
  EXPECT_EQ(release_error(p, {0, 0}), ErrorKind::kInternal);   // named twice
  EXPECT_EQ(release_error(p, {0, 3}), ErrorKind::kInternal);   // one good, one not: nothing freed
  EXPECT_EQ(p.free_count(), 2);
  EXPECT_FALSE(p.is_free(0));
  p.release(held);
  EXPECT_EQ(release_error(p, held), ErrorKind::kInternal);     // released twice
  EXPECT_EQ(p.free_count(), 4);
  for (const int k : {0, -1, 5}) {
    try {
      p.acquire(k);
      ADD_FAILURE() << "acquire(" << k << ") was granted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(e.message().find("--devices-per-trial"), std::string::npos) << e.message();
    }
  }
  EXPECT_THROW(DevicePacker(0), Error);
}

// Mixed trial sizes arriving and finishing at random: every grant is the k lowest free devices
// of a directly kept free set, no device is ever in two holdings, and nullopt comes exactly when
// fewer than k are free.
TEST(DevicePacker, RandomWalkMatchesAFreeSet) {
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    const int n = 3 + static_cast<int>(seed % 6);
    DevicePacker p(n);
    std::set<int> free;
    for (int d = 0; d < n; ++d) free.insert(d);
    std::vector<Devices> holdings;
    test_util::Rng rng(seed);
    const auto op = rng.ints(2000, 0, 2), size = rng.ints(2000, 1, n + 1), pick = rng.ints(2000, 0, 1 << 30);
    for (size_t i = 0; i < op.size(); ++i) {
      if (op[i] == 0 || holdings.empty()) {
        const int k = size[i];
        const auto got = p.acquire(k);
        if (static_cast<int>(free.size()) < k) {
          EXPECT_EQ(got, std::nullopt);
        } else {
          const Devices want(free.begin(), std::next(free.begin(), k));
          ASSERT_EQ(got, want);
          for (const int d : want) free.erase(d);
          holdings.push_back(want);
        }
      } else {
        const size_t j = static_cast<size_t>(pick[i]) % holdings.size();
        p.release(holdings[j]);
        free.insert(holdings[j].begin(), holdings[j].end());
        holdings.erase(holdings.begin() + static_cast<std::ptrdiff_t>(j));
      }
      ASSERT_EQ(p.free_count(), static_cast<int>(free.size()));
      std::vector<int> owners(static_cast<size_t>(n), 0);
      for (const Devices& h : holdings)
        for (const int d : h) ASSERT_EQ(++owners[static_cast<size_t>(d)], 1) << "device " << d << " held twice";
    }
  }
}

// Trials finish on their own threads: concurrent acquire/release never hands one device to two.
TEST(DevicePacker, ConcurrentUseKeepsSubsetsDisjoint) {
  constexpr int kDevices = 6;
  DevicePacker p(kDevices);
  std::vector<std::atomic<int>> owner(kDevices);
  for (auto& o : owner) o = -1;
  std::atomic<bool> clash{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        const auto got = p.acquire(1 + (i + t) % 3);
        if (!got) continue;
        for (const int d : *got) {
          int expected = -1;
          if (!owner[static_cast<size_t>(d)].compare_exchange_strong(expected, t)) clash = true;
        }
        for (const int d : *got) owner[static_cast<size_t>(d)] = -1;
        p.release(*got);
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_FALSE(clash);
  EXPECT_EQ(p.free_count(), kDevices);
}

}  // namespace
}  // namespace zt::sweep
