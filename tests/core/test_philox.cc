// Philox4x32-10: known-answer vectors from the Random123 distribution, independence from how the
// index range is split across threads, and basic distribution checks.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/philox.h"

namespace zt {
namespace {

TEST(Philox, KnownAnswerVectors) {
  struct Kat {
    Philox4x32 ctr;
    uint32_t k0, k1;
    Philox4x32 expect;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, 0xffffffff, 0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 r = philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.v[i], k.expect.v[i]) << "word " << i;
  }
}

std::vector<float> fill_normals(uint64_t seed, uint64_t stream, size_t n, int threads) {
  std::vector<float> out(n);
  std::vector<std::thread> pool;
  const size_t chunk = (n + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t i = t * chunk; i < std::min(n, (t + 1) * chunk); ++i)
        out[i] = philox_normal(seed, stream, i);
    });
  }
  for (auto& th : pool) th.join();
  return out;
}

TEST(Philox, ValuesDoNotDependOnThreadCount) {
  const size_t n = 100'003;
  const auto one = fill_normals(42, 3, n, 1);
  for (int threads : {2, 3, 7}) {
    const auto many = fill_normals(42, 3, n, threads);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(float_as_bits(one[i]), float_as_bits(many[i])) << i;
  }
}

TEST(Philox, SeedsAndStreamsDiffer) {
  int same_seed = 0, same_stream = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    same_seed += philox_u32(1, 0, i) == philox_u32(2, 0, i);
    same_stream += philox_u32(1, 0, i) == philox_u32(1, 1, i);
  }
  EXPECT_LT(same_seed, 3);
  EXPECT_LT(same_stream, 3);
}

TEST(Philox, UniformAndNormalMoments) {
  const size_t n = 1'000'000;
  double su = 0, su2 = 0, sn = 0, sn2 = 0;
  float umin = 2, umax = -1;
  for (size_t i = 0; i < n; ++i) {
    const double u = philox_uniform(7, 1, i);
    umin = std::min(umin, static_cast<float>(u));
    umax = std::max(umax, static_cast<float>(u));
    su += u;
    su2 += u * u;
    const double z = philox_normal(7, 2, i);
    sn += z;
    sn2 += z * z;
  }
  EXPECT_GT(umin, 0.0f);  // (0, 1]: log() is safe
  EXPECT_LE(umax, 1.0f);
  EXPECT_NEAR(su / n, 0.5, 2e-3);
  EXPECT_NEAR(su2 / n - (su / n) * (su / n), 1.0 / 12, 1e-3);
  EXPECT_NEAR(sn / n, 0.0, 5e-3);
  EXPECT_NEAR(sn2 / n, 1.0, 5e-3);
}

}  // namespace
}  // namespace zt
