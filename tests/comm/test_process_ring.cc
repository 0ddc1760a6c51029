// The cross-process ring against the in-process Communicator: each process runs its L local ranks
// through ProcessRing and, on its own, all K*L ranks through a Communicator on a cpu:K*L runtime,
// on the same Philox inputs; every byte of its local ranks' buffers must be equal (every dtype,
// shards that are not multiples of the chunk, chunks of a few elements), and so must the counters.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "comm/comm_test_util.h"
#include "comm/communicator.h"
#include "comm/mpi_test_env.h"
#include "comm/process_group.h"
#include "comm/process_ring.h"
#include "core/philox.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

using namespace std::chrono_literals;
using commtest::RankBuffers;

enum class Op { kReduceScatter, kAllGather, kAllReduce };
const char* op_name(Op op) {
  return op == Op::kReduceScatter ? "reduce_scatter" : op == Op::kAllGather ? "all_gather" : "all_reduce";
}

// Input of global rank g: Philox normals; for an all-gather only the rank's own shard matters, the
// rest is NaN so that an element the ring fails to write cannot match the reference.
float input(Op op, int g, int64_t i, int64_t shard, uint64_t seed) {
  if (op == Op::kAllGather && i / shard != g) return std::nanf("");
  return philox_normal(seed, static_cast<uint64_t>(g), static_cast<uint64_t>(i));
}

struct Case {
  Op op;
  DType dtype;
  int64_t shard;       // elements per rank's shard
  size_t chunk_bytes;  // the ring's pipeline granularity (both implementations)
};

std::string case_name(const Case& c) {
  return std::string(op_name(c.op)) + " " + dtype_name(c.dtype) + " shard " + std::to_string(c.shard) + " chunk " +
         std::to_string(c.chunk_bytes) + " B";
}

class ProcessRingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    group = std::make_unique<ProcessGroup>(30s);
    local = mpitest::local_devices();
    world = group->size() * local;
    local_rt = Runtime::create_cpu(local);
    ref_rt = Runtime::create_cpu(world);
  }

  // Runs `c` both ways and compares every local rank's whole buffer bit for bit (a reduce-scatter's
  // partial sums outside the owned shard included: they follow the same order too).
  void check(const Case& c, uint64_t seed) {
    SCOPED_TRACE(case_name(c));
    const int64_t numel = c.shard * world;
    ProcessRing ring(*group, commtest::first_devices(*local_rt, local), c.chunk_bytes);
    Communicator ref(commtest::first_devices(*ref_rt, world), c.chunk_bytes);
    RankBuffers mine(commtest::first_devices(*local_rt, local), c.dtype, numel);
    RankBuffers all(commtest::first_devices(*ref_rt, world), c.dtype, numel);
    const int first = ring.global_rank(0);
    mine.fill([&](int i, int64_t e) { return input(c.op, first + i, e, c.shard, seed); });
    all.fill([&](int g, int64_t e) { return input(c.op, g, e, c.shard, seed); });

    std::vector<Stream*> producers;
    for (int i = 0; i < local; ++i) producers.push_back(&local_rt->device(i).compute());
    switch (c.op) {
      case Op::kReduceScatter:
        ring.reduce_scatter(mine.views, producers);
        ref.reduce_scatter(all.views, {});
        break;
      case Op::kAllGather:
        ring.all_gather(mine.views, producers);
        ref.all_gather(all.views, {});
        break;
      case Op::kAllReduce:
        ring.all_reduce(mine.views, producers);
        ref.all_reduce(all.views, {});
        break;
    }
    ref_rt->synchronize();  // the ring's call returns with its results in place

    for (int i = 0; i < local; ++i) {
      const int g = first + i;
      const std::vector<uint32_t> got = mine.bits(i), want = all.bits(g);
      int64_t bad = 0, first_bad = -1;
      for (int64_t e = 0; e < numel; ++e)
        if (got[static_cast<size_t>(e)] != want[static_cast<size_t>(e)] && bad++ == 0) first_bad = e;
      EXPECT_EQ(bad, 0) << "global rank " << g << ": " << bad << " of " << numel << " elements differ, first at "
                        << first_bad;
      // The reference did sum: the owned shard of a reduction is close to the float64 sum.
      if (c.op != Op::kAllGather && c.dtype == DType::kF32) {
        for (int64_t e = g * c.shard; e < (g + 1) * c.shard; ++e) {
          double sum = 0;
          for (int r = 0; r < world; ++r) sum += input(c.op, r, e, c.shard, seed);
          EXPECT_NEAR(commtest::load(c.dtype, mine.data(i), e), sum, 1e-5 * world * 4) << "element " << e;
        }
      }
      const CommCounters a = ring.counters(i), b = ref.counters(g);
      EXPECT_EQ(a.bytes_sent, b.bytes_sent) << "global rank " << g;
      EXPECT_EQ(a.bytes_received, b.bytes_received) << "global rank " << g;
      EXPECT_EQ(a.collectives, b.collectives) << "global rank " << g;
    }
    // What crosses processes: one shard per step leaves and enters each process, whatever L is.
    const uint64_t passes = c.op == Op::kAllReduce ? 2 : 1;
    const uint64_t across = group->size() > 1
                                ? passes * static_cast<uint64_t>(world - 1) * static_cast<uint64_t>(c.shard) *
                                      dtype_size(c.dtype)
                                : 0;
    EXPECT_EQ(ring.bytes_sent_across(), across);
    EXPECT_EQ(ring.bytes_received_across(), across);
  }

  std::unique_ptr<ProcessGroup> group;
  int local = 1;
  int world = 1;
  std::unique_ptr<Runtime> local_rt, ref_rt;
};

TEST_F(ProcessRingTest, BitwiseEqualToTheInProcessRingEveryDtype) {
  uint64_t seed = 1800;
  for (const Op op : {Op::kReduceScatter, Op::kAllGather, Op::kAllReduce})
    for (const DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      // Tiny chunks (2-4 elements: many chunks, a ragged last one), a prime shard, one element.
      check({op, t, 37, 8}, ++seed);
      check({op, t, 1, 8}, ++seed);
      // The default chunk: one chunk per shard.
      check({op, t, 301, Communicator::kDefaultChunkBytes}, ++seed);
    }
}

TEST_F(ProcessRingTest, ChunkOfOneElementAndUnevenChunks) {
  check({Op::kAllReduce, DType::kF32, 13, 4}, 77);   // one element per chunk
  check({Op::kAllReduce, DType::kBF16, 13, 6}, 78);  // 3 elements per chunk: 13 = 4*3 + 1
  check({Op::kReduceScatter, DType::kF16, 0, 8}, 79);  // nothing to move
}

TEST_F(ProcessRingTest, SuccessiveCollectivesKeepMatching) {
  // One ring, many calls of different kinds and sizes: the signature check and the messages of
  // one call never leak into the next.
  ProcessRing ring(*group, commtest::first_devices(*local_rt, local), 16);
  Communicator ref(commtest::first_devices(*ref_rt, world), 16);
  for (int call = 0; call < 6; ++call) {
    const int64_t numel = world * (5 + call);
    const DType t = call % 2 ? DType::kBF16 : DType::kF32;
    RankBuffers mine(commtest::first_devices(*local_rt, local), t, numel);
    RankBuffers all(commtest::first_devices(*ref_rt, world), t, numel);
    mine.fill([&](int i, int64_t e) { return philox_normal(call, ring.global_rank(i), e); });
    all.fill([&](int g, int64_t e) { return philox_normal(call, g, e); });
    ring.all_reduce(mine.views);
    ref.all_reduce(all.views, {});
    ref_rt->synchronize();
    for (int i = 0; i < local; ++i) EXPECT_EQ(mine.bits(i), all.bits(ring.global_rank(i))) << "call " << call;
  }
}

// The trainer's way: one host thread per local device, each calling with its own buffer; the bits
// equal the in-process Communicator's, call after call, and a local mismatch throws on every thread.
TEST_F(ProcessRingTest, PerRankCallsFromOneThreadPerDevice) {
  ProcessRing ring(*group, commtest::first_devices(*local_rt, local), 24);
  Communicator ref(commtest::first_devices(*ref_rt, world), 24);
  const int64_t numel = world * 29;
  RankBuffers mine(commtest::first_devices(*local_rt, local), DType::kBF16, numel);
  RankBuffers all(commtest::first_devices(*ref_rt, world), DType::kBF16, numel);
  mine.fill([&](int i, int64_t e) { return philox_normal(1877, ring.global_rank(i), e); });
  all.fill([&](int g, int64_t e) { return philox_normal(1877, g, e); });
  std::vector<std::thread> threads;
  for (int i = 0; i < local; ++i)
    threads.emplace_back([&, i] {
      Stream* producer = &local_rt->device(i).compute();
      ring.reduce_scatter(i, mine.views[static_cast<size_t>(i)], producer);
      ring.all_gather(i, mine.views[static_cast<size_t>(i)], producer);
      ring.all_reduce(i, mine.views[static_cast<size_t>(i)], producer);
    });
  for (auto& t : threads) t.join();
  ref.reduce_scatter(all.views, {});
  ref.all_gather(all.views, {});
  ref.all_reduce(all.views, {});
  ref_rt->synchronize();
  for (int i = 0; i < local; ++i) EXPECT_EQ(mine.bits(i), all.bits(ring.global_rank(i))) << "local " << i;
  EXPECT_EQ(ring.counters(0).collectives, 3u);

  if (local < 2) return;
  // Local device 0 asks for an all-gather, the others for a reduce-scatter: all of them throw,
  // before any message (so the other processes, doing the same, stay in step).
  std::vector<std::string> errors(static_cast<size_t>(local));
  threads.clear();
  for (int i = 0; i < local; ++i)
    threads.emplace_back([&, i] {
      try {
        if (i == 0)
          ring.all_gather(i, mine.views[0], nullptr);
        else
          ring.reduce_scatter(i, mine.views[static_cast<size_t>(i)], nullptr);
      } catch (const Error& e) {
        errors[static_cast<size_t>(i)] = e.message();
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_NE(e.find("collective mismatch inside process"), std::string::npos) << e;
  mpitest::world().barrier("the end of the per-rank test");
}

// Tensor parallelism across processes (train/processes.cc): T rings, ring t over the local devices
// {t, t + T, ...} on its own ProcessGroup, driven at once by one thread per device. Each ring's
// global index p * L / T + i / T is the data coordinate of global rank p * L + i, so its bits must
// equal the in-process Communicator's group {t, t + T, ...} of cpu:K*L, and the rings' messages
// must never match each other's.
TEST_F(ProcessRingTest, OneRingPerTensorCoordinateOnItsOwnGroupRunsAtOnce) {
  const int T = 2;
  if (local % T != 0) GTEST_SKIP() << "needs an even number of local devices";
  std::vector<std::unique_ptr<ProcessGroup>> groups;
  std::vector<std::unique_ptr<ProcessRing>> rings;
  for (int t = 0; t < T; ++t) {
    std::vector<Device*> members;
    for (int i = t; i < local; i += T) members.push_back(&local_rt->device(i));
    groups.push_back(std::make_unique<ProcessGroup>(30s));
    rings.push_back(std::make_unique<ProcessRing>(*groups.back(), members, 16));
  }
  const int data = world / T;
  const int64_t numel = data * 23;
  Communicator ref(commtest::first_devices(*ref_rt, world), 16);
  RankBuffers mine(commtest::first_devices(*local_rt, local), DType::kBF16, numel);
  RankBuffers all(commtest::first_devices(*ref_rt, world), DType::kBF16, numel);
  const int first = group->rank() * local;
  mine.fill([&](int i, int64_t e) { return philox_normal(1818, static_cast<uint64_t>(first + i), e); });
  all.fill([&](int g, int64_t e) { return philox_normal(1818, static_cast<uint64_t>(g), e); });
  std::vector<std::thread> threads;
  for (int i = 0; i < local; ++i)
    threads.emplace_back([&, i] {
      ProcessRing& ring = *rings[static_cast<size_t>(i % T)];
      ASSERT_EQ(ring.global_rank(i / T), first / T + i / T);  // the data coordinate
      Stream* producer = &local_rt->device(i).compute();
      const TensorView v = mine.views[static_cast<size_t>(i)];
      ring.reduce_scatter(i / T, v, producer);
      ring.all_gather(i / T, v, producer);
      ring.all_reduce(i / T, v, producer);
    });
  for (auto& t : threads) t.join();
  for (int t = 0; t < T; ++t) {
    std::vector<int> members;
    std::vector<TensorView> views;
    for (int d = 0; d < data; ++d) {
      members.push_back(d * T + t);
      views.push_back(all.views[static_cast<size_t>(d * T + t)]);
    }
    const CommGroup g = ref.group(members);
    g.reduce_scatter(views, {});
    g.all_gather(views, {});
    g.all_reduce(views, {});
  }
  ref_rt->synchronize();
  for (int i = 0; i < local; ++i) EXPECT_EQ(mine.bits(i), all.bits(first + i)) << "local " << i;
  // The two coordinates' rings summed different ranks.
  EXPECT_NE(mine.bits(0), mine.bits(1));
  mpitest::world().barrier("the end of the per-coordinate rings test");
}

TEST_F(ProcessRingTest, MismatchedCallsThrowOnEveryProcess) {
  if (group->size() < 2) GTEST_SKIP() << "needs two processes";
  ProcessRing ring(*group, commtest::first_devices(*local_rt, local), 64);
  RankBuffers mine(commtest::first_devices(*local_rt, local), DType::kF32, world * 4);
  mine.fill([](int, int64_t e) { return static_cast<float>(e); });
  try {
    if (group->rank() == 0)
      ring.all_gather(mine.views);
    else
      ring.reduce_scatter(mine.views);
    ADD_FAILURE() << "mismatched collectives must throw";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("collective mismatch at call #0: process 0 called all_gather"), std::string::npos)
        << e.message();
  }
  // The ring stays usable: the mismatch was found before any data moved.
  RankBuffers all(commtest::first_devices(*ref_rt, world), DType::kF32, world * 4);
  all.fill([](int, int64_t e) { return static_cast<float>(e); });
  ring.all_reduce(mine.views);
  Communicator ref(commtest::first_devices(*ref_rt, world), 64);
  ref.all_reduce(all.views, {});
  ref_rt->synchronize();
  for (int i = 0; i < local; ++i) EXPECT_EQ(mine.bits(i), all.bits(ring.global_rank(i)));
}

TEST_F(ProcessRingTest, BadBuffersAreRefusedBeforeAnyMessage) {
  ProcessRing ring(*group, commtest::first_devices(*local_rt, local), 64);
  RankBuffers odd(commtest::first_devices(*local_rt, local), DType::kF32, world * 4 + 1);
  EXPECT_THROW(ring.all_reduce(odd.views), Error);  // not a multiple of the world size
  RankBuffers ints(commtest::first_devices(*local_rt, local), DType::kI32, world * 4);
  EXPECT_THROW(ring.all_reduce(ints.views), Error);
  EXPECT_THROW(ring.all_reduce({}), Error);
  mpitest::world().barrier("the end of the bad-buffer test");
}

// The hierarchical variants against float64 sums (another summation order, so within rounding, not
// bitwise), the all-gather bitwise against the flat ring (it only moves bytes), every local rank of
// an all-reduce holding the same bits, and the bytes that crossed processes against the closed form.
TEST_F(ProcessRingTest, HierarchicalEqualsTheFlatRingWithinRounding) {
  const int procs = group->size();
  uint64_t seed = 1850;
  for (const DType t : {DType::kF32, DType::kBF16, DType::kF16})
    for (const int64_t shard : {int64_t{37}, int64_t{300}})
      for (const Op op : {Op::kReduceScatter, Op::kAllGather, Op::kAllReduce}) {
        ++seed;
        const size_t chunk = shard == 37 ? 8 : Communicator::kDefaultChunkBytes;
        SCOPED_TRACE(std::string("hierarchical ") + case_name({op, t, shard, chunk}));
        const int64_t numel = shard * world;
        ProcessRing ring(*group, commtest::first_devices(*local_rt, local), chunk);
        RankBuffers flat(commtest::first_devices(*local_rt, local), t, numel);
        RankBuffers hier(commtest::first_devices(*local_rt, local), t, numel);
        const auto in = [&](int i, int64_t e) { return input(op, ring.global_rank(i), e, shard, seed); };
        flat.fill(in);
        hier.fill(in);
        switch (op) {
          case Op::kReduceScatter:
            ring.reduce_scatter(flat.views);
            ring.reset_counters();
            ring.hierarchical_reduce_scatter(hier.views);
            break;
          case Op::kAllGather:
            ring.all_gather(flat.views);
            ring.reset_counters();
            ring.hierarchical_all_gather(hier.views);
            break;
          case Op::kAllReduce:
            ring.all_reduce(flat.views);
            ring.reset_counters();
            ring.hierarchical_all_reduce(hier.views);
            break;
        }
        // Each of the N-1 hops rounds a partial once (16-bit types to 8 or 11 significant bits).
        const double eps = t == DType::kF32 ? 1.2e-7 : t == DType::kBF16 ? 7.9e-3 : 9.8e-4;
        for (int i = 0; i < local; ++i) {
          const int g = ring.global_rank(i);
          if (op == Op::kAllGather) {
            EXPECT_EQ(hier.bits(i), flat.bits(i)) << "global rank " << g;
            continue;
          }
          if (op == Op::kAllReduce) {
            EXPECT_EQ(hier.bits(i), hier.bits(0)) << "local ranks disagree";
          }
          const int64_t begin = op == Op::kAllReduce ? 0 : g * shard;
          const int64_t end = op == Op::kAllReduce ? numel : (g + 1) * shard;
          for (int64_t e = begin; e < end; ++e) {
            double sum = 0, sum_abs = 0;
            for (int r = 0; r < world; ++r) {
              const double x = commtest::round_to(t, input(op, r, e, shard, seed));
              sum += x;
              sum_abs += std::fabs(x);
            }
            const double tol = 2 * world * eps * sum_abs + 1e-30;
            ASSERT_NEAR(commtest::load(t, hier.data(i), e), sum, tol) << "global rank " << g << " element " << e;
            ASSERT_NEAR(commtest::load(t, flat.data(i), e), sum, tol) << "global rank " << g << " element " << e;
          }
        }
        const uint64_t passes = op == Op::kAllReduce ? 2 : 1;
        const uint64_t shard_bytes = static_cast<uint64_t>(shard) * dtype_size(t);
        EXPECT_EQ(ring.bytes_sent_across(), passes * static_cast<uint64_t>(local * (procs - 1)) * shard_bytes);
        EXPECT_EQ(ring.bytes_received_across(), ring.bytes_sent_across());
      }
}

// The trainer's way for --comm-topology hierarchical: one host thread per local device calling the
// per-rank hierarchical forms gives the bits of the group calls (same order), and the bytes that
// stayed inside the process (every device's sent bytes less what crossed) follow the closed form
// L * (L-1) * K * shard_bytes per reduce-scatter or all-gather, across L * (K-1) * shard_bytes.
TEST_F(ProcessRingTest, PerRankHierarchicalCallsEqualTheGroupCalls) {
  const int procs = group->size();
  const int64_t shard = 41;
  const int64_t numel = world * shard;
  ProcessRing per_rank(*group, commtest::first_devices(*local_rt, local), 24);
  ProcessRing grouped(*group, commtest::first_devices(*local_rt, local), 24);
  RankBuffers a(commtest::first_devices(*local_rt, local), DType::kF32, numel);
  RankBuffers b(commtest::first_devices(*local_rt, local), DType::kF32, numel);
  const auto in = [&](int i, int64_t e) { return philox_normal(1899, per_rank.global_rank(i), e); };
  a.fill(in);
  b.fill(in);
  std::vector<std::thread> threads;
  for (int i = 0; i < local; ++i)
    threads.emplace_back([&, i] {
      Stream* producer = &local_rt->device(i).compute();
      per_rank.hierarchical_reduce_scatter(i, a.views[static_cast<size_t>(i)], producer);
      per_rank.hierarchical_all_gather(i, a.views[static_cast<size_t>(i)], producer);
      per_rank.hierarchical_all_reduce(i, a.views[static_cast<size_t>(i)], producer);
    });
  for (auto& t : threads) t.join();
  grouped.hierarchical_reduce_scatter(b.views);
  grouped.hierarchical_all_gather(b.views);
  grouped.hierarchical_all_reduce(b.views);
  for (int i = 0; i < local; ++i) EXPECT_EQ(a.bits(i), b.bits(i)) << "local " << i;
  // Four passes: the reduce-scatter, the all-gather and the all-reduce's two.
  const uint64_t shard_bytes = static_cast<uint64_t>(shard) * 4;
  uint64_t sent = 0;
  for (int i = 0; i < local; ++i) sent += per_rank.counters(i).bytes_sent;
  EXPECT_EQ(per_rank.bytes_sent_across(), 4 * static_cast<uint64_t>(local * (procs - 1)) * shard_bytes);
  EXPECT_EQ(sent - per_rank.bytes_sent_across(), 4 * static_cast<uint64_t>(local * (local - 1) * procs) * shard_bytes);
  EXPECT_EQ(per_rank.counters(0).collectives, 3u);
  mpitest::world().barrier("the end of the per-rank hierarchical test");
}

// Process 0 never joins the collective: every other process throws within the timeout with the
// sentence naming rank 0.
TEST_F(ProcessRingTest, ProcessThatNeverArrivesIsNamedWithinTheTimeout) {
  if (group->size() < 2) GTEST_SKIP() << "needs two processes";
  group->set_timeout(1000ms);
  ProcessRing ring(*group, commtest::first_devices(*local_rt, local), 64);
  RankBuffers mine(commtest::first_devices(*local_rt, local), DType::kF32, world * 8);
  mine.fill([](int, int64_t e) { return static_cast<float>(e); });
  if (group->rank() != 0) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      ring.all_reduce(mine.views);
      ADD_FAILURE() << "an all-reduce without process 0 must time out";
    } catch (const Error& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_LT(s, 4.0) << "the timeout is 1 s";
      EXPECT_NE(e.message().find("waited 1.0 s for rank 0 to send"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("all_reduce #0"), std::string::npos) << e.message();
    }
  }
  mpitest::world().barrier("the end of the ring timeout test");
}


// Process 0 stalls mid-collective (its device 0 hangs after the collective started; a watchdog
// thread abandons the device 2.5 s later): every other process throws within about the timeout
// with a sentence naming rank 0, the ranks downstream by walking the chain of waits (or through a
// peer's notice), never an innocent rank between; process 0 then fails with its device error.
TEST_F(ProcessRingTest, StalledProcessIsNamedByEveryOther) {
  if (group->size() < 2) GTEST_SKIP() << "needs two processes";
  group->set_timeout(1000ms);
  ProcessRing ring(*group, commtest::first_devices(*local_rt, local), 64);
  RankBuffers mine(commtest::first_devices(*local_rt, local), DType::kF32, world * 40);
  mine.fill([](int, int64_t e) { return static_cast<float>(e); });
  std::thread watchdog;
  if (group->rank() == 0) {
    local_rt->device(0).inject_fault(FaultKind::kHang);
    watchdog = std::thread([this] {
      std::this_thread::sleep_for(2500ms);
      local_rt->device(0).abandon("the test's watchdog gave up on it");
    });
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ring.all_reduce(mine.views);
    ADD_FAILURE() << "an all-reduce with a stalled process must throw";
  } catch (const Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(e.kind(), ErrorKind::kDevice);
    if (group->rank() == 0) {
      EXPECT_NE(e.message().find("cpu:0"), std::string::npos) << e.message();
    } else {
      EXPECT_LT(s, 2.4) << "the timeout is 1 s (plus 0.2 s to walk the chain of waits); got: " << e.message();
      // Whoever it waited for directly, every process names rank 0 and no innocent rank between.
      EXPECT_NE(e.message().find("rank 0 has died or stalled"), std::string::npos) << e.message();
      for (int r = 1; r < group->size(); ++r)
        EXPECT_EQ(e.message().find("rank " + std::to_string(r) + " has died"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("all_reduce #0 step"), std::string::npos) << "mid-ring: " << e.message();
    }
  }
  if (watchdog.joinable()) watchdog.join();
  EXPECT_TRUE(group->broken());
  mpitest::world().barrier("the end of the stall test");
}

}  // namespace
}  // namespace zt
