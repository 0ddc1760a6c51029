// Collectives on simulated CPU devices: exact sums for every dtype, world size and edge size
// (1, primes, chunk +-1, large), the ring's reduction order bit for bit, determinism, per-rank
// calls from one thread per rank, byte accounting, producer/consumer ordering through events,
// validation messages; plus the accumulate op the ring reduces with, and shard_range. Every
// cross-thread handoff is ordered only by the runtime's events, so a missing wait is a wrong value
// here or a ThreadSanitizer report.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "sanitizer.h"
#include "comm/comm_test_util.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"
#include "zero/shard_plan.h"

namespace zt {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr bool kSanitized = test::kSanitized;

constexpr size_t kSmallChunk = 64;  // bytes: 16 fp32 or 32 16-bit elements per chunk
constexpr DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

using namespace commtest;  // NOLINT: the helpers are this file's vocabulary


// ---- exact results over every world size, dtype and edge size -------------------------------------

struct Case {
  int world;
  DType dtype;
  int64_t shard;
};

std::string describe(const Case& c) {
  return "world=" + std::to_string(c.world) + " dtype=" + dtype_name(c.dtype) +
         " shard=" + std::to_string(c.shard);
}

std::vector<int64_t> edge_shards(DType t) {
  const int64_t ce = static_cast<int64_t>(kSmallChunk / dtype_size(t));
  return {1, 7, 127, ce - 1, ce, ce + 1, 3 * ce + 1};
}

void check_reduce_scatter(Runtime& rt, const Case& c, size_t chunk) {
  auto devs = first_devices(rt, c.world);
  Communicator comm(devs, chunk);
  const int64_t numel = c.shard * c.world;
  RankBuffers b(devs, c.dtype, numel);
  b.fill(small_int);
  comm.reduce_scatter(b.views, {});
  rt.synchronize();
  for (int r = 0; r < c.world; ++r)
    for (int64_t i = r * c.shard; i < (r + 1) * c.shard; ++i)
      ASSERT_EQ(bits_at(c.dtype, b.data(r), i), bits_of(c.dtype, small_int_sum(c.world, i)))
          << describe(c) << " rank " << r << " element " << i;
}

void check_all_gather(Runtime& rt, const Case& c, size_t chunk) {
  auto devs = first_devices(rt, c.world);
  Communicator comm(devs, chunk);
  const int64_t numel = c.shard * c.world;
  RankBuffers b(devs, c.dtype, numel);
  b.poison();
  for (int r = 0; r < c.world; ++r)
    for (int64_t i = r * c.shard; i < (r + 1) * c.shard; ++i)
      store(c.dtype, b.data(r), i, small_int(r, i));
  comm.all_gather(b.views, {});
  rt.synchronize();
  for (int r = 0; r < c.world; ++r)
    for (int64_t i = 0; i < numel; ++i)
      ASSERT_EQ(bits_at(c.dtype, b.data(r), i),
                bits_of(c.dtype, small_int(static_cast<int>(i / c.shard), i)))
          << describe(c) << " rank " << r << " element " << i;
}

void check_all_reduce(Runtime& rt, const Case& c, size_t chunk) {
  auto devs = first_devices(rt, c.world);
  Communicator comm(devs, chunk);
  const int64_t numel = c.shard * c.world;
  RankBuffers b(devs, c.dtype, numel);
  b.fill(small_int);
  comm.all_reduce(b.views, {});
  rt.synchronize();
  for (int r = 0; r < c.world; ++r)
    for (int64_t i = 0; i < numel; ++i)
      ASSERT_EQ(bits_at(c.dtype, b.data(r), i), bits_of(c.dtype, small_int_sum(c.world, i)))
          << describe(c) << " rank " << r << " element " << i;
}

TEST(Communicator, ExactResultsForEveryWorldDtypeAndEdgeSize) {
  auto rt = Runtime::create_cpu(8);
  for (int world = 1; world <= 8; ++world)
    for (DType t : kFloatTypes)
      for (int64_t shard : edge_shards(t)) {
        const Case c{world, t, shard};
        ASSERT_NO_FATAL_FAILURE(check_reduce_scatter(*rt, c, kSmallChunk));
        ASSERT_NO_FATAL_FAILURE(check_all_gather(*rt, c, kSmallChunk));
        ASSERT_NO_FATAL_FAILURE(check_all_reduce(*rt, c, kSmallChunk));
      }
}

TEST(Communicator, TinyChunksOfOneElement) {
  auto rt = Runtime::create_cpu(3);
  for (DType t : kFloatTypes) {
    const Case c{3, t, 5};
    ASSERT_NO_FATAL_FAILURE(check_reduce_scatter(*rt, c, 1));
    ASSERT_NO_FATAL_FAILURE(check_all_gather(*rt, c, 1));
    ASSERT_NO_FATAL_FAILURE(check_all_reduce(*rt, c, 1));
  }
}

TEST(Communicator, LargeShardsWithTheDefaultChunk) {
  // 1M elements per shard at world 4 (16 MiB per rank in fp32): several 1 MiB chunks per step.
  const int64_t shard = kSanitized ? (int64_t{1} << 16) + 3 : (int64_t{1} << 20);
  auto rt = Runtime::create_cpu(4);
  for (DType t : {DType::kF32, DType::kBF16}) {
    const Case c{4, t, shard};
    ASSERT_NO_FATAL_FAILURE(check_all_reduce(*rt, c, size_t{1} << 20));
  }
  ASSERT_NO_FATAL_FAILURE(check_reduce_scatter(*rt, Case{4, DType::kF16, shard}, size_t{1} << 20));
  ASSERT_NO_FATAL_FAILURE(check_all_gather(*rt, Case{4, DType::kF16, shard}, size_t{1} << 20));
}

TEST(Communicator, ZeroElementsIsANoOp) {
  auto rt = Runtime::create_cpu(3);
  Communicator comm(first_devices(*rt, 3), kSmallChunk);
  std::vector<TensorView> empty(3, TensorView{nullptr, DType::kF32, Shape{0}, 0});
  for (int r = 0; r < 3; ++r) empty[r].device = r;
  comm.all_reduce(empty, {});
  comm.all_gather(empty, {});
  comm.reduce_scatter(empty, {});
  comm.broadcast(1, empty, {});
  rt->synchronize();
  EXPECT_EQ(comm.counters(0).bytes_sent, 0u);
  EXPECT_EQ(comm.counters(0).collectives, 4u);
}

// ---- broadcast ----------------------------------------------------------------------------------

TEST(Communicator, BroadcastFromEveryRoot) {
  auto rt = Runtime::create_cpu(8);
  for (int world = 1; world <= 8; ++world) {
    auto devs = first_devices(*rt, world);
    Communicator comm(devs, kSmallChunk);
    for (DType t : {DType::kF32, DType::kBF16, DType::kI32})
      for (int64_t numel : {int64_t{1}, int64_t{7}, int64_t{33}, int64_t{1001}})
        for (int root = 0; root < world; ++root) {
          RankBuffers b(devs, t, numel);
          b.poison();
          for (int64_t i = 0; i < numel; ++i) store(t, b.data(root), i, small_int(root, i));
          comm.broadcast(root, b.views, {});
          rt->synchronize();
          for (int r = 0; r < world; ++r)
            for (int64_t i = 0; i < numel; ++i)
              ASSERT_EQ(bits_at(t, b.data(r), i), bits_of(t, small_int(root, i)))
                  << "world " << world << " root " << root << " numel " << numel << " rank " << r
                  << " element " << i << " " << dtype_name(t);
        }
  }
}

// ---- reduction order and determinism --------------------------------------------------------------

// Random non-integer values, already representable in t.
float random_value(DType t, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  return round_to(t, dist(rng));
}

// The ring's order for element i of shard s: start at rank s+1, each hop adds the local value to
// the incoming partial, rounded to the storage type once per hop; the last hop is rank s.
float ring_sum(DType t, const std::vector<std::vector<float>>& x, int world, int s, int64_t i) {
  float acc = x[static_cast<size_t>((s + 1) % world)][static_cast<size_t>(i)];
  for (int m = 2; m <= world; ++m)
    acc = round_to(t, x[static_cast<size_t>((s + m) % world)][static_cast<size_t>(i)] + acc);
  return acc;
}

TEST(Communicator, RingOrderIsBitExactAndDeterministic) {
  auto rt = Runtime::create_cpu(8);
  std::mt19937 rng(1234);
  for (int world : {2, 3, 5, 8})
    for (DType t : kFloatTypes) {
      const int64_t shard = 97;
      const int64_t numel = shard * world;
      auto devs = first_devices(*rt, world);
      std::vector<std::vector<float>> x(static_cast<size_t>(world));
      for (auto& v : x) {
        v.resize(static_cast<size_t>(numel));
        for (auto& e : v) e = random_value(t, rng);
      }
      std::vector<uint32_t> expected(static_cast<size_t>(numel));
      for (int64_t i = 0; i < numel; ++i)
        expected[static_cast<size_t>(i)] =
            bits_of(t, ring_sum(t, x, world, static_cast<int>(i / shard), i));
      std::vector<uint32_t> first;
      // Chunk size changes the pipeline, never the order of additions of any element.
      for (size_t chunk : {kSmallChunk, size_t{6}, size_t{1} << 20, kSmallChunk}) {
        Communicator comm(devs, chunk);
        RankBuffers b(devs, t, numel);
        b.fill([&](int r, int64_t i) { return x[static_cast<size_t>(r)][static_cast<size_t>(i)]; });
        comm.all_reduce(b.views, {});
        rt->synchronize();
        for (int r = 0; r < world; ++r)
          ASSERT_EQ(b.bits(r), expected) << "world " << world << " " << dtype_name(t) << " rank "
                                         << r << " chunk " << chunk;
        if (first.empty()) first = b.bits(0);
        ASSERT_EQ(b.bits(0), first);
      }
    }
}

// ---- chains of collectives without host synchronisation ------------------------------------------

TEST(Communicator, BackToBackCollectivesReuseBuffersAndEventsSafely) {
  auto rt = Runtime::create_cpu(5);
  for (int world : {2, 3, 5}) {
    auto devs = first_devices(*rt, world);
    Communicator comm(devs, kSmallChunk);
    const int64_t shard = 41;
    const int64_t numel = shard * world;
    RankBuffers a(devs, DType::kF32, numel);
    RankBuffers b(devs, DType::kF32, numel);
    a.fill(small_int);
    b.fill([](int r, int64_t i) { return static_cast<float>(r + 1); });
    // a: all_reduce, then reduce_scatter + all_gather (= another all_reduce); b interleaved.
    comm.all_reduce(a.views, {});
    comm.all_reduce(b.views, {});
    comm.reduce_scatter(a.views, {});
    comm.broadcast(world - 1, b.views, {});
    comm.all_gather(a.views, {});
    comm.all_reduce(b.views, {});
    rt->synchronize();
    const float b_sum = static_cast<float>(world * (world + 1) / 2);
    for (int r = 0; r < world; ++r)
      for (int64_t i = 0; i < numel; ++i) {
        ASSERT_EQ(load(DType::kF32, a.data(r), i), world * small_int_sum(world, i))
            << "world " << world << " rank " << r << " element " << i;
        ASSERT_EQ(load(DType::kF32, b.data(r), i), world * b_sum);
      }
  }
}

// ---- byte accounting ------------------------------------------------------------------------------

TEST(Communicator, CountsRingBytesPerRank) {
  auto rt = Runtime::create_cpu(6);
  for (int world : {1, 2, 3, 6})
    for (DType t : {DType::kF32, DType::kBF16}) {
      auto devs = first_devices(*rt, world);
      Communicator comm(devs, kSmallChunk);
      const int64_t shard = 127;
      RankBuffers b(devs, t, shard * world);
      b.fill(small_int);
      const uint64_t shard_bytes = static_cast<uint64_t>(shard) * dtype_size(t);
      const uint64_t ring = static_cast<uint64_t>(world - 1) * shard_bytes;
      comm.reduce_scatter(b.views, {});
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(comm.counters(r).bytes_sent, ring);
        EXPECT_EQ(comm.counters(r).bytes_received, ring);
        EXPECT_EQ(comm.counters(r).collectives, 1u);
      }
      comm.all_gather(b.views, {});
      for (int r = 0; r < world; ++r) EXPECT_EQ(comm.counters(r).bytes_sent, 2 * ring);
      comm.reset_counters();
      comm.all_reduce(b.views, {});
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(comm.counters(r).bytes_sent, 2 * ring);
        EXPECT_EQ(comm.counters(r).bytes_received, 2 * ring);
        EXPECT_EQ(comm.counters(r).collectives, 1u);
      }
      comm.reset_counters();
      const int root = world / 2;
      comm.broadcast(root, b.views, {});
      const uint64_t all = static_cast<uint64_t>(shard * world) * dtype_size(t);
      for (int r = 0; r < world; ++r) {
        const bool last = world > 1 && r == (root + world - 1) % world;
        EXPECT_EQ(comm.counters(r).bytes_sent, world == 1 || last ? 0 : all) << r;
        EXPECT_EQ(comm.counters(r).bytes_received, r == root ? 0 : all) << r;
      }
      rt->synchronize();
    }
}

// ---- producers and consumers ----------------------------------------------------------------------

// Data written by a late host_func on the compute stream is what the collective reduces, and a
// consumer that waits with wait_done sees the result; nothing but events orders the threads.
TEST(Communicator, WaitsForProducersAndReleasesConsumers) {
  auto rt = Runtime::create_cpu(4);
  for (int world : {1, 2, 4}) {
    auto devs = first_devices(*rt, world);
    Communicator comm(devs, kSmallChunk);
    const int64_t shard = 37;
    const int64_t numel = shard * world;
    RankBuffers b(devs, DType::kF32, numel);
    b.poison();
    std::vector<Stream*> producers;
    for (int r = 0; r < world; ++r) {
      Stream& s = devs[r]->compute();
      float* p = static_cast<float*>(b.data(r));
      s.host_func([p, r, numel] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5 + 3 * r));
        for (int64_t i = 0; i < numel; ++i) p[i] = small_int(r, i);
      });
      producers.push_back(&s);
    }
    comm.all_reduce(b.views, producers);
    // Consumers on another stream of each device (and on rank 0's compute stream, cross-device).
    std::vector<std::vector<float>> seen(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      Stream& consumer = devs[r]->create_stream();
      comm.wait_done(r, consumer);
      const float* p = static_cast<const float*>(b.data(r));
      auto* out = &seen[static_cast<size_t>(r)];
      consumer.host_func([p, out, numel] { out->assign(p, p + numel); });
    }
    rt->synchronize();
    for (int r = 0; r < world; ++r)
      for (int64_t i = 0; i < numel; ++i)
        ASSERT_EQ(seen[static_cast<size_t>(r)][static_cast<size_t>(i)], small_int_sum(world, i))
            << "world " << world << " rank " << r << " element " << i;
  }
}

// A consumer that overwrites the buffer after wait_done must not race with the collective, and
// the next collective (with the consumer's stream as producer) must see the overwrite.
TEST(Communicator, ConsumerThenProducerAgain) {
  auto rt = Runtime::create_cpu(3);
  auto devs = first_devices(*rt, 3);
  Communicator comm(devs, kSmallChunk);
  const int64_t numel = 3 * 50;
  RankBuffers b(devs, DType::kF32, numel);
  b.fill(small_int);
  std::vector<Stream*> producers;
  for (Device* d : devs) producers.push_back(&d->compute());
  for (int iter = 0; iter < 4; ++iter) {
    comm.all_gather(b.views, producers);
    for (int r = 0; r < 3; ++r) {
      comm.wait_done(r, devs[r]->compute());
      float* p = static_cast<float*>(b.data(r));
      devs[r]->compute().host_func([p, numel, r] {
        std::this_thread::sleep_for(1ms);
        for (int64_t i = r * 50; i < (r + 1) * 50; ++i) p[i] += 1.0f;
      });
    }
  }
  comm.all_gather(b.views, producers);
  rt->synchronize();
  for (int r = 0; r < 3; ++r)
    for (int64_t i = 0; i < numel; ++i)
      ASSERT_EQ(load(DType::kF32, b.data(r), i), small_int(static_cast<int>(i / 50), i) + 4.0f);
}

// ---- per-rank calls -------------------------------------------------------------------------------

TEST(Communicator, PerRankCallsFromOneThreadPerRank) {
  auto rt = Runtime::create_cpu(8);
  for (int world : {1, 2, 3, 4, 8}) {
    auto devs = first_devices(*rt, world);
    Communicator comm(devs, kSmallChunk);
    const int64_t shard = 53;
    const int64_t numel = shard * world;
    const int iterations = kSanitized ? 4 : 12;
    RankBuffers b(devs, DType::kBF16, numel);
    std::vector<std::vector<float>> seen(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        Stream& compute = devs[r]->compute();
        void* p = b.data(r);
        for (int it = 0; it < iterations; ++it) {
          // Produce on the compute stream; reduce; consume on the compute stream.
          compute.host_func([p, r, it, numel] {
            for (int64_t i = 0; i < numel; ++i) store(DType::kBF16, p, i, small_int(r + it, i));
          });
          switch (it % 3) {
            case 0:
              comm.all_reduce(r, b.views[r], &compute);
              break;
            case 1:
              comm.reduce_scatter(r, b.views[r], &compute);
              comm.all_gather(r, b.views[r], nullptr);
              break;
            case 2:
              comm.reduce_scatter(r, b.views[r], &compute);
              break;
          }
          comm.wait_done(r, compute);
          auto* out = &seen[static_cast<size_t>(r)];
          compute.host_func([p, out, numel, r, it, world, shard] {
            const int64_t lo = it % 3 == 2 ? r * shard : 0;
            const int64_t hi = it % 3 == 2 ? (r + 1) * shard : numel;
            for (int64_t i = lo; i < hi; ++i) {
              float expect = 0;
              for (int q = 0; q < world; ++q) expect += small_int(q + it, i);
              out->push_back(load(DType::kBF16, p, i) - expect);
            }
          });
        }
        compute.synchronize();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < world; ++r) {
      ASSERT_FALSE(seen[static_cast<size_t>(r)].empty());
      for (float d : seen[static_cast<size_t>(r)]) ASSERT_EQ(d, 0.0f) << "world " << world;
    }
    const uint64_t ring = static_cast<uint64_t>(world - 1) * shard * 2;
    uint64_t expect_sent = 0;
    for (int it = 0; it < iterations; ++it) expect_sent += it % 3 == 2 ? ring : 2 * ring;
    for (int r = 0; r < world; ++r) EXPECT_EQ(comm.counters(r).bytes_sent, expect_sent);
  }
}

TEST(Communicator, PerRankMismatchThrowsOnEveryRank) {
  auto rt = Runtime::create_cpu(3);
  auto devs = first_devices(*rt, 3);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 3 * 8);
  b.fill(small_int);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      try {
        if (r == 1)
          comm.all_gather(r, b.views[r], nullptr);
        else
          comm.all_reduce(r, b.views[r], nullptr);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.message();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("collective mismatch at call #0"));
    EXPECT_THAT(e, HasSubstr("rank 1 called all_gather"));
    EXPECT_THAT(e, HasSubstr("same collectives in the same order"));
  }
  // Still usable afterwards.
  threads.clear();
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] { comm.all_reduce(r, b.views[r], nullptr); });
  for (auto& t : threads) t.join();
  rt->synchronize();
  for (int r = 0; r < 3; ++r)
    for (int64_t i = 0; i < 24; ++i)
      ASSERT_EQ(load(DType::kF32, b.data(r), i), small_int_sum(3, i));
}

TEST(Communicator, AbortReleasesRanksWaitingForAFailedRank) {
  // Rank 2 fails before its collective; ranks 0 and 1 are already waiting in the rendezvous. After
  // abort() they get an error naming the cause instead of waiting forever, and so does every
  // later call.
  auto rt = Runtime::create_cpu(3);
  auto devs = first_devices(*rt, 3);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 3 * 8);
  b.fill(small_int);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        comm.all_reduce(r, b.views[r], nullptr);
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kDevice);
        errors[static_cast<size_t>(r)] = e.message();
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let ranks 0 and 1 arrive
  EXPECT_FALSE(comm.aborted());
  comm.abort("rank 2 failed: simulated device fault");
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[static_cast<size_t>(r)], HasSubstr("abandoned"));
    EXPECT_THAT(errors[static_cast<size_t>(r)], HasSubstr("simulated device fault"));
  }
  EXPECT_TRUE(comm.aborted());
  try {
    comm.all_reduce(2, b.views[2], nullptr);
    FAIL() << "a call after abort() must throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("simulated device fault"));
  }
}

TEST(Communicator, PerRankNumelMismatchThrows) {
  auto rt = Runtime::create_cpu(2);
  auto devs = first_devices(*rt, 2);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 16);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      TensorView v = b.views[r];
      if (r == 1) v.shape = Shape{8};
      try {
        comm.reduce_scatter(r, v, nullptr);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.message();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors) EXPECT_THAT(e, HasSubstr("rank 1 called reduce_scatter(8 x fp32)"));
}

// ---- validation -----------------------------------------------------------------------------------

TEST(Communicator, RejectsBadArgumentsWithClearMessages) {
  auto rt = Runtime::create_cpu(3);
  auto devs = first_devices(*rt, 2);
  Communicator comm(devs, kSmallChunk);
  RankBuffers f32(devs, DType::kF32, 8);
  RankBuffers f16(devs, DType::kF16, 8);
  RankBuffers odd(devs, DType::kF32, 7);
  RankBuffers i32(devs, DType::kI32, 8);

  EXPECT_THAT(error_of([&] { comm.all_reduce({f32.views[0], f16.views[1]}, {}); }).message(),
              HasSubstr("all_reduce: rank 1 passes fp16 but rank 0 passes fp32"));
  EXPECT_THAT(error_of([&] { comm.reduce_scatter({f32.views[0], odd.views[1]}, {}); }).message(),
              HasSubstr("rank 1 passes 7 elements but rank 0 passes 8"));
  EXPECT_THAT(error_of([&] { comm.all_gather(odd.views, {}); }).message(),
              HasSubstr("7 elements per rank do not split into 2 equal shards"));
  EXPECT_THAT(error_of([&] { comm.all_reduce(i32.views, {}); }).message(),
              HasSubstr("buffers are int32 but must be fp32, fp16 or bf16"));
  EXPECT_THAT(error_of([&] { comm.all_reduce({f32.views[0]}, {}); }).message(),
              HasSubstr("got 1 buffers for a communicator of 2 ranks"));
  EXPECT_THAT(error_of([&] { comm.all_reduce({f32.views[1], f32.views[0]}, {}); }).message(),
              HasSubstr("the buffer of rank 0 is on device 1 but rank 0 is cpu:0"));
  EXPECT_THAT(error_of([&] { comm.all_reduce(f32.views, {&rt->device(1).compute(), nullptr}); })
                  .message(),
              HasSubstr("the producer stream of rank 0 runs on cpu:1"));
  EXPECT_THAT(error_of([&] { comm.broadcast(2, f32.views, {}); }).message(),
              HasSubstr("broadcast: root 2 is not a rank"));
  EXPECT_THAT(error_of([&] { comm.all_reduce(5, f32.views[0], nullptr); }).message(),
              HasSubstr("rank 5 is not a rank"));
  EXPECT_THAT(error_of([&] { Communicator c({&rt->device(0), &rt->device(0)}); }).message(),
              HasSubstr("is given twice"));
  EXPECT_THAT(error_of([&] { Communicator c({}); }).message(), HasSubstr("at least one device"));
  // chunk_bytes 0 is Communicator::kProbeChunk (chosen at creation; the default where reductions
  // are direct, as on these devices), not an error.
  EXPECT_EQ(Communicator(devs, 0).chunk_bytes(), Communicator::kDefaultChunkBytes);
  // Nothing was enqueued by the rejected calls.
  EXPECT_EQ(comm.counters(0).collectives, 0u);
}

// ---- the reduction op -------------------------------------------------------------------------------

TEST(Accumulate, RoundsOncePerAddThroughFp32) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1000.0f, 1000.0f);
  const int64_t n = 100003;
  for (DType t : kFloatTypes) {
    DeviceBuffer dst(d.memory(), n * dtype_size(t), d.compute());
    DeviceBuffer src(d.memory(), n * dtype_size(t), d.compute());
    std::vector<uint32_t> expect(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float a = dist(rng) * (i % 3 == 0 ? 1e-3f : 1.0f);
      const float b = dist(rng);
      store(t, dst.data(), i, a);
      store(t, src.data(), i, b);
      expect[static_cast<size_t>(i)] =
          bits_of(t, load(t, dst.data(), i) + load(t, src.data(), i));
    }
    ops::accumulate(d.compute(), TensorView{dst.data(), t, Shape{n}, 0},
                    ConstTensorView{src.data(), t, Shape{n}, 0});
    d.compute().synchronize();
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(bits_at(t, dst.data(), i), expect[static_cast<size_t>(i)])
          << dtype_name(t) << " element " << i;
  }
}

TEST(Accumulate, RejectsMixedTypes) {
  auto rt = Runtime::create_cpu(1);
  Device& d = rt->device(0);
  DeviceBuffer a(d.memory(), 64, d.compute());
  const Error e = error_of([&] {
    ops::accumulate(d.compute(), TensorView{a.data(), DType::kF16, Shape{8}, 0},
                    ConstTensorView{a.data(), DType::kF32, Shape{8}, 0});
  });
  EXPECT_THAT(e.message(), HasSubstr("accumulate: src [8] is fp32 but must be fp16"));
}

// ---- the CUDA backend (skips without a usable GPU; scripts/gpu-check.sh runs it) ---------------------

// Logical devices on GPU 0, buffers in device memory: the same bits as the ring reference (and so
// as the CPU backend), for every collective and dtype, with pipelining over many chunks.
TEST(CommOnGpu, SameBitsAsTheRingReference) {
  const CudaAvailability cuda = cuda_availability();
  if (!cuda.usable) GTEST_SKIP() << "no usable GPU: " << cuda.reason;
  auto rt = Runtime::create(parse_device_spec("cuda:0x4"));
  std::mt19937 rng(99);
  for (int world : {1, 2, 4})
    for (DType t : kFloatTypes)
      for (size_t chunk : {kSmallChunk, size_t{1} << 20}) {
        const int64_t shard = 1000;
        const int64_t numel = shard * world;
        const size_t bytes = static_cast<size_t>(numel) * dtype_size(t);
        const std::string what =
            "world " + std::to_string(world) + " " + dtype_name(t) + " chunk " + std::to_string(chunk);
        auto devs = first_devices(*rt, world);
        Communicator comm(devs, chunk);
        std::vector<std::vector<float>> x(static_cast<size_t>(world));
        std::vector<std::vector<uint8_t>> host(static_cast<size_t>(world), std::vector<uint8_t>(bytes));
        for (int r = 0; r < world; ++r) {
          x[r].resize(static_cast<size_t>(numel));
          for (int64_t i = 0; i < numel; ++i) {
            x[r][i] = random_value(t, rng);
            store(t, host[r].data(), i, x[r][i]);
          }
        }
        std::vector<DeviceBuffer> mem;
        std::vector<TensorView> views;
        std::vector<Stream*> producers;
        for (Device* d : devs) {
          mem.emplace_back(d->memory(), bytes, d->compute(), "test");
          views.push_back(TensorView{mem.back().data(), t, Shape{numel}, d->index()});
          producers.push_back(&d->compute());
        }
        auto upload = [&](const std::vector<std::vector<uint8_t>>& src) {
          for (int r = 0; r < world; ++r) devs[r]->compute().copy(mem[r].data(), src[r].data(), bytes);
        };
        auto download = [&] {
          std::vector<std::vector<uint8_t>> out(static_cast<size_t>(world), std::vector<uint8_t>(bytes));
          for (int r = 0; r < world; ++r) {
            comm.wait_done(r, devs[r]->compute());
            devs[r]->compute().copy(out[r].data(), mem[r].data(), bytes);
          }
          rt->synchronize();
          return out;
        };
        // all_reduce: the ring order, bit for bit, on every rank.
        upload(host);
        comm.all_reduce(views, producers);
        auto out = download();
        for (int r = 0; r < world; ++r)
          for (int64_t i = 0; i < numel; ++i)
            ASSERT_EQ(bits_at(t, out[r].data(), i),
                      bits_of(t, ring_sum(t, x, world, static_cast<int>(i / shard), i)))
                << what << " all_reduce rank " << r << " element " << i;
        // reduce_scatter then all_gather from fresh inputs: the same bits again.
        upload(host);
        comm.reduce_scatter(views, producers);
        comm.all_gather(views, {});
        auto out2 = download();
        for (int r = 0; r < world; ++r) ASSERT_EQ(out2[r], out[r]) << what << " rs+ag rank " << r;
        // broadcast from the last rank.
        upload(host);
        comm.broadcast(world - 1, views, producers);
        auto out3 = download();
        for (int r = 0; r < world; ++r) ASSERT_EQ(out3[r], host[world - 1]) << what << " broadcast";
        const uint64_t ring = static_cast<uint64_t>(world - 1) * shard * dtype_size(t);
        EXPECT_EQ(comm.counters(world - 1).bytes_sent, 4 * ring + (world > 1 ? bytes : 0)) << what;
      }
}

TEST(CommOnGpu, AccumulateMatchesTheCpuBits) {
  const CudaAvailability cuda = cuda_availability();
  if (!cuda.usable) GTEST_SKIP() << "no usable GPU: " << cuda.reason;
  auto gpu = Runtime::create(parse_device_spec("cuda:0"));
  auto cpu = Runtime::create_cpu(1);
  Device& g = gpu->device(0);
  Device& c = cpu->device(0);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-70000.0f, 70000.0f);
  const int64_t n = 300007;
  for (DType t : kFloatTypes) {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(t);
    std::vector<uint8_t> a(bytes), b(bytes), from_gpu(bytes);
    for (int64_t i = 0; i < n; ++i) {
      store(t, a.data(), i, dist(rng) * (i % 5 == 0 ? 1e-4f : 1.0f));
      store(t, b.data(), i, dist(rng));
    }
    DeviceBuffer ga(g.memory(), bytes, g.compute()), gb(g.memory(), bytes, g.compute());
    DeviceBuffer ca(c.memory(), bytes, c.compute()), cb(c.memory(), bytes, c.compute());
    g.compute().copy(ga.data(), a.data(), bytes);
    g.compute().copy(gb.data(), b.data(), bytes);
    std::memcpy(ca.data(), a.data(), bytes);
    std::memcpy(cb.data(), b.data(), bytes);
    ops::accumulate(g.compute(), TensorView{ga.data(), t, Shape{n}, g.index()},
                    ConstTensorView{gb.data(), t, Shape{n}, g.index()});
    ops::accumulate(c.compute(), TensorView{ca.data(), t, Shape{n}, c.index()},
                    ConstTensorView{cb.data(), t, Shape{n}, c.index()});
    g.compute().copy(from_gpu.data(), ga.data(), bytes);
    g.compute().synchronize();
    c.compute().synchronize();
    ASSERT_EQ(std::memcmp(from_gpu.data(), ca.data(), bytes), 0) << dtype_name(t);
  }
}

// ---- shard plan ---------------------------------------------------------------------------------------

TEST(ShardRange, PadsCoversAndBalancesForManySizes) {
  for (int world = 1; world <= 9; ++world)
    for (int64_t align : {int64_t{1}, int64_t{2}, int64_t{16}, int64_t{64}})
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{7}, int64_t{15}, int64_t{16},
                        int64_t{17}, int64_t{127}, int64_t{1000}, int64_t{4096}, int64_t{65537},
                        int64_t{1} << 33}) {
        const std::string what = "n=" + std::to_string(n) + " world=" + std::to_string(world) +
                                 " align=" + std::to_string(align);
        int64_t covered = 0;
        int64_t prev_end = 0;
        const ShardRange r0 = shard_range(n, 0, world, align);
        ASSERT_EQ(r0.padded_numel % (world * align), 0) << what;
        ASSERT_GE(r0.padded_numel, n) << what;
        ASSERT_LT(r0.padded_numel - n, world * align + (n == 0 ? 1 : 0)) << what;  // minimal padding
        for (int rank = 0; rank < world; ++rank) {
          const ShardRange r = shard_range(n, rank, world, align);
          ASSERT_EQ(r.padded_numel, r0.padded_numel) << what;
          ASSERT_EQ(r.shard_numel, r0.padded_numel / world) << what;  // every rank the same slots
          ASSERT_EQ(r.shard_numel % align, 0) << what;
          ASSERT_EQ(r.begin, rank * r.shard_numel) << what;
          ASSERT_GE(r.end, r.begin) << what;
          ASSERT_LE(r.size(), r.shard_numel) << what;
          // Disjoint and in order: real elements of rank r start where rank r-1's stopped, unless
          // rank r-1 ran out of real elements (then the rest is padding).
          if (r.size() > 0) {
            ASSERT_EQ(r.begin, prev_end) << what;
            prev_end = r.end;
          }
          covered += r.size();
          // Balanced: only the ranks holding the tail may own fewer real elements.
          if (r.end < n) {
            ASSERT_EQ(r.size(), r.shard_numel) << what;
          }
        }
        ASSERT_EQ(covered, n) << what;
        ASSERT_EQ(prev_end, n) << what;
      }
}

TEST(ShardRange, RejectsBadArguments) {
  EXPECT_THROW(shard_range(-1, 0, 2), Error);
  EXPECT_THROW(shard_range(10, 2, 2), Error);
  EXPECT_THROW(shard_range(10, 0, 0), Error);
  EXPECT_THROW(shard_range(10, 0, 2, 0), Error);
}

}  // namespace
}  // namespace zt
