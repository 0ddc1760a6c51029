// Collectives on groups (disjoint, non-contiguous, concurrent; group calls and one thread per rank)
// and point-to-point send/recv (ring shifts, pairwise exchanges, event ordering, abort), compared
// exactly with host references on simulated CPU devices.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_test_util.h"
#include "comm/communicator.h"
#include "comm/mesh.h"
#include "core/status.h"
#include "runtime/runtime.h"
#include "sanitizer.h"

namespace zt {
namespace {

using namespace commtest;  // NOLINT: the helpers are this file's vocabulary
using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr size_t kSmallChunk = 64;
constexpr bool kSanitized = test::kSanitized;

std::string text(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += std::to_string(x) + " ";
  return s;
}

// Value of element i on communicator rank r before a collective (distinct per rank and call).
float value(int rank, int64_t i, int salt) { return small_int(rank + 3 * salt, i); }

// Sum over the members, in member order (exact: small integers).
float member_sum(const std::vector<int>& members, int64_t i, int salt) {
  float s = 0;
  for (int r : members) s += value(r, i, salt);
  return s;
}

enum class Op { kReduceScatter, kAllGather, kAllReduce, kBroadcast };
constexpr Op kOps[] = {Op::kReduceScatter, Op::kAllGather, Op::kAllReduce, Op::kBroadcast};
const char* op_name(Op op) {
  return op == Op::kReduceScatter ? "reduce_scatter"
         : op == Op::kAllGather   ? "all_gather"
         : op == Op::kAllReduce   ? "all_reduce"
                                  : "broadcast";
}

// What position i of `members` holds at element e after `op` (broadcast root: the last member).
// For reduce_scatter only the own shard is defined (other elements hold partial sums).
bool expected_at(Op op, const std::vector<int>& members, int pos, int64_t e, int64_t shard, int salt,
                 float* out) {
  const int n = static_cast<int>(members.size());
  const int owner = static_cast<int>(e / shard);
  switch (op) {
    case Op::kReduceScatter:
      if (owner != pos) return false;
      *out = member_sum(members, e, salt);
      return true;
    case Op::kAllGather:
      *out = value(members[static_cast<size_t>(owner)], e, salt);
      return true;
    case Op::kAllReduce:
      *out = member_sum(members, e, salt);
      return true;
    case Op::kBroadcast:
      *out = value(members[static_cast<size_t>(n - 1)], e, salt);
      return true;
  }
  return false;
}

// Inputs of `op` on every member: all_gather starts from the own shard only (the rest poisoned, so
// an element the ring does not write fails the compare).
void fill_input(Op op, RankBuffers& b, const std::vector<int>& members, int64_t shard, int salt) {
  const int64_t numel = shard * static_cast<int64_t>(members.size());
  for (size_t pos = 0; pos < members.size(); ++pos) {
    const int r = members[pos];
    for (int64_t e = 0; e < numel; ++e) {
      const bool keep = op == Op::kBroadcast ? pos + 1 == members.size()
                        : op == Op::kAllGather ? e / shard == static_cast<int64_t>(pos)
                                               : true;
      if (keep)
        store(b.dtype, b.data(r), e, value(r, e, salt));
      else
        std::memset(static_cast<char*>(b.data(r)) + e * dtype_size(b.dtype), 0xFF, dtype_size(b.dtype));
    }
  }
}

void run_group_op(Op op, const CommGroup& g, const std::vector<TensorView>& views) {
  switch (op) {
    case Op::kReduceScatter:
      return g.reduce_scatter(views, {});
    case Op::kAllGather:
      return g.all_gather(views, {});
    case Op::kAllReduce:
      return g.all_reduce(views, {});
    case Op::kBroadcast:
      return g.broadcast(g.ranks().back(), views, {});
  }
}

// Every collective, on every group of a partition at once (one host thread per group), for each
// dtype; ranks outside every group keep their bits.
void check_partition(Runtime& rt, int world, const std::vector<std::vector<int>>& partition) {
  auto devs = first_devices(rt, world);
  Communicator comm(devs, kSmallChunk);
  const int64_t shard = 37;  // several 16-element chunks, and a partial one
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16})
    for (Op op : kOps) {
      const int salt = static_cast<int>(op) + 1;
      int64_t numel = shard;
      for (const auto& m : partition) numel = std::max<int64_t>(numel, shard * static_cast<int64_t>(m.size()));
      // Each group uses its own numel = shard * size; buffers are sized for the largest.
      RankBuffers b(devs, t, numel);
      b.fill([](int r, int64_t i) { return value(r, i, 99); });
      for (const auto& m : partition) fill_input(op, b, m, shard, salt);
      std::vector<std::vector<uint32_t>> before(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) before[static_cast<size_t>(r)] = b.bits(r);
      std::vector<CommGroup> groups;
      std::vector<std::vector<TensorView>> views;
      for (const auto& m : partition) {
        groups.push_back(comm.group(m));
        const int64_t n = shard * static_cast<int64_t>(m.size());
        std::vector<TensorView> v;
        for (int r : m) v.push_back(TensorView{b.data(r), t, Shape{n}, devs[r]->index()});
        views.push_back(v);
      }
      std::vector<std::thread> threads;
      for (size_t k = 0; k < partition.size(); ++k)
        threads.emplace_back([&, k] { run_group_op(op, groups[k], views[k]); });
      for (auto& th : threads) th.join();
      rt.synchronize();
      std::vector<char> member(static_cast<size_t>(world), 0);
      for (size_t k = 0; k < partition.size(); ++k) {
        const auto& m = partition[k];
        const int64_t n = shard * static_cast<int64_t>(m.size());
        for (size_t pos = 0; pos < m.size(); ++pos) {
          const int r = m[pos];
          member[static_cast<size_t>(r)] = 1;
          for (int64_t e = 0; e < n; ++e) {
            float want = 0;
            if (!expected_at(op, m, static_cast<int>(pos), e, shard, salt, &want)) continue;
            ASSERT_EQ(bits_at(t, b.data(r), e), bits_of(t, want))
                << op_name(op) << " " << dtype_name(t) << " world " << world << " group "
                << groups[k].name() << " rank " << r << " element " << e;
          }
          // Beyond the group's numel nothing is written.
          for (int64_t e = n; e < numel; ++e)
            ASSERT_EQ(bits_at(t, b.data(r), e), before[static_cast<size_t>(r)][static_cast<size_t>(e)]);
        }
      }
      for (int r = 0; r < world; ++r) {
        if (!member[static_cast<size_t>(r)]) {
          ASSERT_EQ(b.bits(r), before[static_cast<size_t>(r)]) << "rank " << r << " is in no group";
        }
      }
    }
}

TEST(CommGroups, EveryCollectiveOnDisjointAndNonContiguousGroupsAtOnce) {
  auto rt = Runtime::create_cpu(8);
  const std::vector<std::pair<int, std::vector<std::vector<int>>>> cases = {
      {2, {{0}, {1}}},
      {2, {{1, 0}}},
      {3, {{0, 2}}},
      {3, {{2, 0, 1}}},
      {4, {{0, 1}, {2, 3}}},
      {4, {{0, 2}, {1, 3}}},
      {4, {{3, 0, 2}}},
      {8, {{0, 1, 2, 3}, {4, 5, 6, 7}}},
      {8, {{0, 2, 4, 6}, {1, 3, 5, 7}}},
      {8, {{7, 1, 4}, {0, 6}, {2, 3, 5}}},
      {8, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
  };
  for (const auto& [world, partition] : cases) {
    SCOPED_TRACE("world " + std::to_string(world));
    ASSERT_NO_FATAL_FAILURE(check_partition(*rt, world, partition));
  }
}

// The ring's order inside a group: shard s (owned by position s) starts at position s+1 and each
// hop adds the local value into the incoming partial, rounded once per hop.
TEST(CommGroups, RingOrderInsideAGroupIsBitExact) {
  auto rt = Runtime::create_cpu(8);
  auto devs = first_devices(*rt, 8);
  Communicator comm(devs, kSmallChunk);
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  for (const std::vector<int>& members : {std::vector<int>{6, 1, 3}, std::vector<int>{5, 2, 7, 0, 4}})
    for (DType t : {DType::kF32, DType::kBF16}) {
      const int n = static_cast<int>(members.size());
      const int64_t shard = 53;
      const int64_t numel = shard * n;
      RankBuffers b(devs, t, numel);
      std::vector<std::vector<float>> x(8, std::vector<float>(static_cast<size_t>(numel)));
      for (auto& v : x)
        for (auto& e : v) e = round_to(t, dist(rng));
      b.fill([&](int r, int64_t i) { return x[static_cast<size_t>(r)][static_cast<size_t>(i)]; });
      std::vector<TensorView> views;
      for (int r : members) views.push_back(b.views[static_cast<size_t>(r)]);
      comm.group(members).all_reduce(views, {});
      rt->synchronize();
      for (int64_t i = 0; i < numel; ++i) {
        const int s = static_cast<int>(i / shard);
        float acc = x[static_cast<size_t>(members[static_cast<size_t>((s + 1) % n)])][static_cast<size_t>(i)];
        for (int m = 2; m <= n; ++m)
          acc = round_to(t, x[static_cast<size_t>(members[static_cast<size_t>((s + m) % n)])][static_cast<size_t>(i)] + acc);
        for (int r : members)
          ASSERT_EQ(bits_at(t, b.data(r), i), bits_of(t, acc))
              << "group " << text(members) << dtype_name(t) << " rank " << r << " element " << i;
      }
    }
}

// One host thread per rank on a 2 x 2 x 2 mesh: tensor all-reduce (groups of 2 at once), data
// reduce-scatter + all-gather, pipeline broadcast, world all-reduce, interleaved per iteration
// with producers and consumers on the compute stream. The host reference applies the same sums.
TEST(CommGroups, PerRankCallsOnConcurrentMeshGroupsFromThreads) {
  auto rt = Runtime::create_cpu(8);
  for (const MeshShape shape : {MeshShape{.data = 2, .tensor = 2}, MeshShape{.data = 2, .tensor = 2, .pipeline = 2},
                                MeshShape{.data = 1, .tensor = 4}, MeshShape{.data = 3, .tensor = 1}}) {
    const int world = shape.data * shape.tensor * shape.pipeline;
    const Mesh mesh(shape, world);
    SCOPED_TRACE(mesh.describe());
    auto devs = first_devices(*rt, world);
    Communicator comm(devs, kSmallChunk);
    const int64_t numel = 24 * 7;  // divisible by every group size here (1, 2, 3, 4)
    const int iterations = kSanitized ? 2 : 6;
    RankBuffers b(devs, DType::kF32, numel);
    std::vector<std::vector<float>> seen(static_cast<size_t>(world));

    // Host reference: the same steps on host vectors.
    std::vector<std::vector<float>> expect(static_cast<size_t>(world));
    {
      std::vector<std::vector<float>> x(static_cast<size_t>(world), std::vector<float>(static_cast<size_t>(numel)));
      for (int it = 0; it < iterations; ++it) {
        for (int r = 0; r < world; ++r)
          for (int64_t i = 0; i < numel; ++i) x[static_cast<size_t>(r)][static_cast<size_t>(i)] = value(r, i, it);
        const auto sum_over = [&](MeshAxis axis) {
          auto y = x;
          for (int r = 0; r < world; ++r)
            for (int64_t i = 0; i < numel; ++i) {
              float s = 0;
              for (int q : mesh.group(axis, r)) s += x[static_cast<size_t>(q)][static_cast<size_t>(i)];
              y[static_cast<size_t>(r)][static_cast<size_t>(i)] = s;
            }
          x = y;
        };
        sum_over(MeshAxis::kTensor);
        sum_over(MeshAxis::kData);  // reduce-scatter + all-gather = all-reduce
        {
          auto y = x;
          for (int r = 0; r < world; ++r) y[static_cast<size_t>(r)] = x[static_cast<size_t>(mesh.pipeline_group(r)[0])];
          x = y;
        }
        for (int r = 0; r < world; ++r)
          for (float v : x[static_cast<size_t>(r)]) expect[static_cast<size_t>(r)].push_back(v);
      }
    }

    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        Stream& compute = devs[r]->compute();
        void* p = b.data(r);
        const CommGroup tensor = comm.group(mesh.tensor_group(r));
        const CommGroup data = comm.group(mesh.data_group(r));
        const CommGroup pipeline = comm.group(mesh.pipeline_group(r));
        for (int it = 0; it < iterations; ++it) {
          compute.host_func([p, r, it, numel] {
            for (int64_t i = 0; i < numel; ++i) store(DType::kF32, p, i, value(r, i, it));
          });
          tensor.all_reduce(r, b.views[static_cast<size_t>(r)], &compute, "tp");
          data.reduce_scatter(r, b.views[static_cast<size_t>(r)], nullptr, "dp");
          data.all_gather(r, b.views[static_cast<size_t>(r)], nullptr);
          pipeline.broadcast(r, pipeline.ranks()[0], b.views[static_cast<size_t>(r)], nullptr);
          comm.wait_done(r, compute);
          auto* out = &seen[static_cast<size_t>(r)];
          compute.host_func([p, out, numel] {
            for (int64_t i = 0; i < numel; ++i) out->push_back(load(DType::kF32, p, i));
          });
        }
        compute.synchronize();
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < world; ++r) ASSERT_EQ(seen[static_cast<size_t>(r)], expect[static_cast<size_t>(r)]) << "rank " << r;

    // Counters: per group and summed per rank.
    const uint64_t bytes = static_cast<uint64_t>(numel) * 4;
    for (int r = 0; r < world; ++r) {
      const auto t = static_cast<uint64_t>(shape.tensor), d = static_cast<uint64_t>(shape.data);
      const uint64_t tp = 2 * (t - 1) * (bytes / t) * iterations;
      const uint64_t dp = 2 * (d - 1) * (bytes / d) * iterations;
      EXPECT_EQ(comm.group(mesh.tensor_group(r)).counters(r).bytes_sent, tp) << r;
      EXPECT_EQ(comm.group(mesh.data_group(r)).counters(r).bytes_received, dp) << r;
      // Groups are identified by their member list: where the tensor group of a rank is also its
      // data or pipeline group (axes of size 1: {r}), those collectives count there too.
      const auto tg = mesh.tensor_group(r);
      const uint64_t on_tg = 1 + (mesh.data_group(r) == tg ? 2 : 0) + (mesh.pipeline_group(r) == tg ? 1 : 0);
      EXPECT_EQ(comm.group(tg).counters(r).collectives, on_tg * iterations) << r;
      EXPECT_EQ(comm.counters(r).collectives, static_cast<uint64_t>(4 * iterations));
      const bool last_stage = mesh.pipeline_next(r) < 0;
      const uint64_t pp_sent = shape.pipeline > 1 && !last_stage ? bytes * iterations : 0;
      EXPECT_EQ(comm.counters(r).bytes_sent, tp + dp + pp_sent) << r;
    }
  }
}

// ---- point-to-point ---------------------------------------------------------------------------

// Every rank sends its buffer to r+shift and receives from r-shift, from one thread per rank, with
// the data produced late on the compute stream and read there after wait_done.
TEST(SendRecv, RingShiftsFromOneThreadPerRank) {
  auto rt = Runtime::create_cpu(8);
  for (int world : {2, 3, 4, 8})
    for (DType t : {DType::kF32, DType::kBF16, DType::kI32})
      for (int shift : {1, world - 1, world / 2}) {
        if (shift % world == 0) continue;
        auto devs = first_devices(*rt, world);
        Communicator comm(devs, kSmallChunk);
        const int64_t numel = 1001;
        const int iterations = kSanitized ? 2 : 4;
        RankBuffers send(devs, t, numel);
        RankBuffers recv(devs, t, numel);
        std::vector<std::vector<uint32_t>> seen(static_cast<size_t>(world));
        std::vector<std::thread> threads;
        for (int r = 0; r < world; ++r)
          threads.emplace_back([&, r] {
            Stream& compute = devs[r]->compute();
            void* s = send.data(r);
            void* d = recv.data(r);
            for (int it = 0; it < iterations; ++it) {
              compute.host_func([=] {
                std::this_thread::sleep_for(1ms);
                for (int64_t i = 0; i < numel; ++i) store(t, s, i, value(r, i, it));
                std::memset(d, 0xFF, static_cast<size_t>(numel) * dtype_size(t));
              });
              comm.send_recv(r, (r + shift) % world, send.views[static_cast<size_t>(r)],
                             (r - shift + world) % world, recv.views[static_cast<size_t>(r)], &compute);
              comm.wait_done(r, compute);
              auto* out = &seen[static_cast<size_t>(r)];
              compute.host_func([=] {
                for (int64_t i = 0; i < numel; ++i) out->push_back(bits_at(t, d, i));
              });
            }
            compute.synchronize();
          });
        for (auto& th : threads) th.join();
        for (int r = 0; r < world; ++r) {
          const int from = (r - shift + world) % world;
          std::vector<uint32_t> want;
          for (int it = 0; it < iterations; ++it)
            for (int64_t i = 0; i < numel; ++i) want.push_back(bits_of(t, value(from, i, it)));
          ASSERT_EQ(seen[static_cast<size_t>(r)], want)
              << "world " << world << " shift " << shift << " " << dtype_name(t) << " rank " << r;
          const uint64_t bytes = static_cast<uint64_t>(numel) * dtype_size(t) * iterations;
          EXPECT_EQ(comm.counters(r).bytes_sent, bytes);
          EXPECT_EQ(comm.counters(r).bytes_received, bytes);
          EXPECT_EQ(comm.counters(r).transfers, 2u * iterations);
          EXPECT_EQ(comm.counters(r).collectives, 0u);
        }
      }
}

// Pairs swap buffers: send_recv with the same peer, and separate blocking send/recv in opposite
// orders on the two sides (even: send then recv; odd: recv then send).
TEST(SendRecv, PairwiseExchanges) {
  auto rt = Runtime::create_cpu(8);
  for (int world : {2, 3, 4, 8})
    for (bool separate : {false, true}) {
      auto devs = first_devices(*rt, world);
      Communicator comm(devs, kSmallChunk);
      const int64_t numel = 333;
      RankBuffers send(devs, DType::kF32, numel);
      RankBuffers recv(devs, DType::kF32, numel);
      send.fill([](int r, int64_t i) { return value(r, i, 5); });
      recv.poison();
      // Partner r <-> world-1-r; the middle rank of an odd world has none.
      const auto partner = [world](int r) { return world - 1 - r; };
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        if (partner(r) == r) continue;
        threads.emplace_back([&, r] {
          const int p = partner(r);
          const TensorView s = send.views[static_cast<size_t>(r)];
          const TensorView d = recv.views[static_cast<size_t>(r)];
          if (!separate) {
            comm.send_recv(r, p, s, p, d, nullptr);
          } else if (r < p) {
            comm.send(r, p, s, nullptr);
            comm.recv(r, p, d, nullptr);
          } else {
            comm.recv(r, p, d, nullptr);
            comm.send(r, p, s, nullptr);
          }
        });
      }
      for (auto& th : threads) th.join();
      rt->synchronize();
      for (int r = 0; r < world; ++r) {
        if (partner(r) == r) {
          for (int64_t i = 0; i < numel; ++i) ASSERT_EQ(bits_at(DType::kF32, recv.data(r), i), 0xFFFFFFFFu);
          continue;
        }
        for (int64_t i = 0; i < numel; ++i)
          ASSERT_EQ(load(DType::kF32, recv.data(r), i), value(partner(r), i, 5))
              << "world " << world << " separate " << separate << " rank " << r << " element " << i;
      }
    }
}

// Host-issued transfers: a ring shift over a non-contiguous subset, and one rank fanning out.
TEST(SendRecv, HostIssuedTransfers) {
  auto rt = Runtime::create_cpu(8);
  auto devs = first_devices(*rt, 8);
  Communicator comm(devs, kSmallChunk);
  const int64_t numel = 77;
  RankBuffers send(devs, DType::kBF16, numel);
  RankBuffers recv(devs, DType::kBF16, numel);
  send.fill([](int r, int64_t i) { return value(r, i, 7); });
  recv.poison();
  const std::vector<int> ring = {6, 1, 3, 4};
  std::vector<Transfer> ts;
  for (size_t k = 0; k < ring.size(); ++k) {
    const int src = ring[k], dst = ring[(k + 1) % ring.size()];
    ts.push_back(Transfer{src, dst, send.views[static_cast<size_t>(src)], recv.views[static_cast<size_t>(dst)]});
  }
  comm.transfer(ts, {});
  rt->synchronize();
  for (size_t k = 0; k < ring.size(); ++k) {
    const int src = ring[k], dst = ring[(k + 1) % ring.size()];
    for (int64_t i = 0; i < numel; ++i)
      ASSERT_EQ(bits_at(DType::kBF16, recv.data(dst), i), bits_of(DType::kBF16, value(src, i, 7))) << dst;
  }
  for (int r : {0, 2, 5, 7})
    for (int64_t i = 0; i < numel; ++i) ASSERT_EQ(bits_at(DType::kBF16, recv.data(r), i), 0xFFFFu);
  // Fan-out from rank 0 into the others' send buffers.
  ts.clear();
  for (int r = 1; r < 8; ++r) ts.push_back(Transfer{0, r, send.views[0], send.views[static_cast<size_t>(r)]});
  comm.transfer(ts, {});
  rt->synchronize();
  for (int r = 0; r < 8; ++r)
    for (int64_t i = 0; i < numel; ++i)
      ASSERT_EQ(bits_at(DType::kBF16, send.data(r), i), bits_of(DType::kBF16, value(0, i, 7)));
  EXPECT_EQ(comm.counters(0).transfers, 7u);
  EXPECT_EQ(comm.counters(0).bytes_sent, 7u * numel * 2);
}

// The copy runs after the sender's producer (a slow write on another stream) and before the
// receiver's consumer, and does not overwrite the receive buffer while the receiver's producer
// stream still reads it. Without the waits the receiver sees poison, or its reader sees new data.
TEST(SendRecv, OrderedAfterProducersAndBeforeConsumersByEventsOnly) {
  auto rt = Runtime::create_cpu(4);
  auto devs = first_devices(*rt, 4);
  Communicator comm(devs, kSmallChunk);
  const int64_t numel = 4096;
  for (int iter = 0; iter < (kSanitized ? 2 : 5); ++iter) {
    RankBuffers send(devs, DType::kF32, numel);
    RankBuffers recv(devs, DType::kF32, numel);
    send.poison();
    recv.fill([](int, int64_t i) { return static_cast<float>(-i); });
    float* src = static_cast<float*>(send.data(1));
    float* dst = static_cast<float*>(recv.data(2));
    // The sender's data appears late, on a side stream of device 1.
    Stream& producer = devs[1]->create_stream();
    producer.host_func([src, numel] {
      std::this_thread::sleep_for(20ms);
      for (int64_t i = 0; i < numel; ++i) src[i] = static_cast<float>(3 * i + 1);
    });
    // The receiver still reads its old contents, slowly, on its compute stream.
    std::vector<float> old_seen;
    Stream& reader = devs[2]->compute();
    reader.host_func([dst, numel, &old_seen] {
      std::this_thread::sleep_for(20ms);
      old_seen.assign(dst, dst + numel);
    });
    std::thread sender([&] { comm.send(1, 2, send.views[1], &producer); });
    std::thread receiver([&] { comm.recv(2, 1, recv.views[2], &reader); });
    sender.join();
    receiver.join();
    Stream& consumer = devs[2]->create_stream();
    comm.wait_done(2, consumer);
    std::vector<float> new_seen;
    consumer.host_func([dst, numel, &new_seen] { new_seen.assign(dst, dst + numel); });
    // The sender may overwrite its buffer once its own stream waited for the copy.
    Stream& rewriter = devs[1]->compute();
    comm.wait_done(1, rewriter);
    rewriter.host_func([src, numel] { std::fill(src, src + numel, 0.0f); });
    rt->synchronize();
    for (int64_t i = 0; i < numel; ++i) {
      ASSERT_EQ(old_seen[static_cast<size_t>(i)], static_cast<float>(-i)) << "overwritten early at " << i;
      ASSERT_EQ(new_seen[static_cast<size_t>(i)], static_cast<float>(3 * i + 1)) << "copied before produced at " << i;
    }
  }
}

TEST(SendRecv, MismatchThrowsOnBothSidesAndTheCommunicatorStaysUsable) {
  auto rt = Runtime::create_cpu(2);
  auto devs = first_devices(*rt, 2);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 8);
  b.fill([](int r, int64_t i) { return value(r, i, 1); });
  std::vector<std::string> errors(2);
  std::thread a([&] {
    try {
      comm.send(0, 1, b.views[0], nullptr);
    } catch (const Error& e) {
      errors[0] = e.message();
    }
  });
  std::thread c([&] {
    TensorView v = b.views[1];
    v.shape = Shape{7};
    try {
      comm.recv(1, 0, v, nullptr);
    } catch (const Error& e) {
      errors[1] = e.message();
    }
  });
  a.join();
  c.join();
  for (const auto& e : errors) EXPECT_THAT(e, HasSubstr("rank 0 sends 8 x fp32 but rank 1 receives 7 x fp32"));
  std::thread a2([&] { comm.send(0, 1, b.views[0], nullptr); });
  std::thread c2([&] { comm.recv(1, 0, b.views[1], nullptr); });
  a2.join();
  c2.join();
  rt->synchronize();
  for (int64_t i = 0; i < 8; ++i) ASSERT_EQ(load(DType::kF32, b.data(1), i), value(0, i, 1));
}

// abort() releases waiters of every group and of point-to-point calls at once.
TEST(CommGroups, AbortReleasesEveryGroupAndPeerWaiter) {
  auto rt = Runtime::create_cpu(4);
  auto devs = first_devices(*rt, 4);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 8);
  std::vector<std::string> errors(4);
  std::vector<std::thread> threads;
  const auto guarded = [&](int r, const std::function<void()>& fn) {
    threads.emplace_back([&, r, fn] {
      try {
        fn();
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kDevice);
        errors[static_cast<size_t>(r)] = e.message();
      }
    });
  };
  // Rank 0 waits in group {0,1} (rank 1 never comes), rank 2 in group {2,3,1}, rank 3 for a send
  // from rank 1.
  guarded(0, [&] { comm.group({0, 1}).all_reduce(0, b.views[0], nullptr); });
  guarded(2, [&] { comm.group({2, 3, 1}).all_gather(2, TensorView{b.data(2), DType::kF32, Shape{6}, 2}, nullptr); });
  guarded(3, [&] { comm.recv(3, 1, b.views[3], nullptr); });
  std::this_thread::sleep_for(30ms);
  comm.abort("rank 1 failed");
  for (auto& t : threads) t.join();
  for (int r : {0, 2, 3}) {
    EXPECT_THAT(errors[static_cast<size_t>(r)], HasSubstr("abandoned"));
    EXPECT_THAT(errors[static_cast<size_t>(r)], HasSubstr("rank 1 failed"));
  }
  EXPECT_EQ(error_of([&] { comm.send(1, 3, b.views[1], nullptr); }).kind(), ErrorKind::kDevice);
  EXPECT_EQ(error_of([&] { comm.group({0, 1}).all_reduce(1, b.views[1], nullptr); }).kind(), ErrorKind::kDevice);
}

TEST(CommGroups, MismatchInsideAGroupNamesTheGroup) {
  auto rt = Runtime::create_cpu(4);
  auto devs = first_devices(*rt, 4);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 8);
  std::vector<std::string> errors(4);
  std::vector<std::thread> threads;
  for (int r : {1, 3})
    threads.emplace_back([&, r] {
      try {
        if (r == 1)
          comm.group({3, 1}).all_reduce(r, b.views[static_cast<size_t>(r)], nullptr);
        else
          comm.group({3, 1}).broadcast(r, 3, b.views[static_cast<size_t>(r)], nullptr);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.message();
      }
    });
  for (auto& t : threads) t.join();
  for (int r : {1, 3}) {
    EXPECT_THAT(errors[static_cast<size_t>(r)], HasSubstr("collective mismatch at call #0 of group {3,1}"));
    EXPECT_THAT(errors[static_cast<size_t>(r)], HasSubstr("rank 3 called broadcast(root 3, 8 x fp32) but rank 1 called all_reduce(8 x fp32)"));
  }
}

TEST(CommGroups, RejectsBadArgumentsWithClearMessages) {
  auto rt = Runtime::create_cpu(4);
  auto devs = first_devices(*rt, 4);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 8);
  EXPECT_THAT(error_of([&] { comm.group({}); }).message(), HasSubstr("a group needs at least one rank"));
  EXPECT_THAT(error_of([&] { comm.group({0, 4}); }).message(),
              HasSubstr("rank 4 of {0,4} is not a rank of a 4-rank communicator"));
  EXPECT_THAT(error_of([&] { comm.group({1, 2, 1}); }).message(), HasSubstr("rank 1 appears twice in {1,2,1}"));
  const CommGroup g = comm.group({2, 0});
  EXPECT_EQ(g.size(), 2);
  EXPECT_EQ(g.index_of(0), 1);
  EXPECT_EQ(g.index_of(1), -1);
  EXPECT_EQ(g.name(), "{2,0}");
  EXPECT_EQ(comm.group({2, 0}).name(), g.name());
  EXPECT_EQ(comm.world_group().ranks(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_THAT(error_of([&] { g.all_reduce(1, b.views[1], nullptr); }).message(),
              HasSubstr("all_reduce: rank 1 is not a member of group {2,0}"));
  EXPECT_THAT(error_of([&] { g.all_reduce({b.views[2]}, {}); }).message(),
              HasSubstr("got 1 buffers for group {2,0} of 2 ranks"));
  EXPECT_THAT(error_of([&] { g.all_reduce({b.views[0], b.views[2]}, {}); }).message(),
              HasSubstr("the buffer of rank 2 is on device 0 but rank 2 is cpu:2"));
  EXPECT_THAT(error_of([&] { g.broadcast(1, {b.views[2], b.views[0]}, {}); }).message(),
              HasSubstr("broadcast: root 1 is not a member of group {2,0}"));
  EXPECT_THAT(error_of([&] { g.reduce_scatter({TensorView{b.data(2), DType::kF32, Shape{7}, 2},
                                               TensorView{b.data(0), DType::kF32, Shape{7}, 0}}, {}); })
                  .message(),
              HasSubstr("7 elements per rank do not split into 2 equal shards; pad the buffer to a multiple of the group size"));
  EXPECT_THAT(error_of([&] { comm.send(1, 1, b.views[1], nullptr); }).message(),
              HasSubstr("send: rank 1 cannot send to itself"));
  EXPECT_THAT(error_of([&] { comm.recv(1, 9, b.views[1], nullptr); }).message(),
              HasSubstr("recv: peer 9 of rank 1 is not a rank of a 4-rank communicator"));
  EXPECT_THAT(error_of([&] { comm.send(1, 2, b.views[0], nullptr); }).message(),
              HasSubstr("send: the buffer of rank 1 is not on cpu:1"));
  EXPECT_THAT(error_of([&] { comm.transfer({Transfer{0, 1, b.views[0], TensorView{b.data(1), DType::kF32, Shape{4}, 1}}}, {}); })
                  .message(),
              HasSubstr("transfer: rank 0 sends 8 x fp32 but rank 1 receives 4 x fp32"));
  EXPECT_THAT(error_of([&] { CommGroup().size(); }).message(), HasSubstr("an empty handle"));
  // Nothing was enqueued by the rejected calls.
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(comm.counters(r).collectives, 0u);
    EXPECT_EQ(comm.counters(r).transfers, 0u);
  }
}

}  // namespace
}  // namespace zt
