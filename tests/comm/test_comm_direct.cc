// The collectives' direct path (peer reads and writes, one op per ring step) against the staged
// ring it replaces where devices reach each other's memory: the same bits for every collective,
// world size, dtype and edge size, the fallback when a backend has no accumulate_peer, buffers
// reused without host synchronisation (a missing event is a wrong value or a TSan report), and the
// accumulate_peer op itself (CPU, and CUDA when a GPU is at hand).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/comm_test_util.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "runtime/observer.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

using ::testing::HasSubstr;
using namespace commtest;  // NOLINT: the helpers are this file's vocabulary

constexpr size_t kSmallChunk = 64;  // bytes: the staged ring pipelines many chunks
constexpr DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

std::vector<std::vector<float>> random_inputs(DType t, int world, int64_t numel, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<std::vector<float>> x(static_cast<size_t>(world), std::vector<float>(static_cast<size_t>(numel)));
  for (auto& v : x)
    for (auto& e : v) e = round_to(t, dist(rng));
  return x;
}

// The ring's order for element i of shard s (communicator.h): start at rank s+1, each hop adds the
// local value to the incoming partial, rounded to the storage type once per hop.
float ring_sum(DType t, const std::vector<std::vector<float>>& x, int world, int s, int64_t i) {
  float acc = x[static_cast<size_t>((s + 1) % world)][static_cast<size_t>(i)];
  for (int m = 2; m <= world; ++m) acc = round_to(t, x[static_cast<size_t>((s + m) % world)][static_cast<size_t>(i)] + acc);
  return acc;
}

enum class Op { kReduceScatter, kAllGather, kAllReduce };

// Stream tasks by name while installed (which ops and copies a path launched).
class TaskCounts final : public TaskObserver {
 public:
  explicit TaskCounts(Runtime& rt) : rt_(rt) { rt_.set_observer(this); }
  ~TaskCounts() override { rt_.set_observer(nullptr); }
  void on_task(int, int, const char* name, Clock::time_point, Clock::time_point) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[name];
  }
  int operator[](const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_[name];
  }

 private:
  Runtime& rt_;
  std::mutex mu_;
  std::map<std::string, int> counts_;
};

struct Result {
  std::vector<std::vector<uint32_t>> bits;  // every rank's whole buffer
  size_t buffer_bytes = 0;
  int accumulate_peer = 0, accumulate = 0, copy_peer = 0;  // tasks launched
};

// Every rank's whole buffer after `op` on `path`, from inputs x (all-gather: each rank's own shard
// only, the rest NaN-poisoned so an unwritten element fails the compare).
Result run(Runtime& rt, int world, DType t, int64_t shard, CommPath path, Op op,
           const std::vector<std::vector<float>>& x, size_t chunk_bytes = kSmallChunk) {
  auto devs = first_devices(rt, world);
  Communicator comm(devs, chunk_bytes, path);
  RankBuffers b(devs, t, shard * world);
  if (op == Op::kAllGather) {
    b.poison();
    for (int r = 0; r < world; ++r)
      for (int64_t i = r * shard; i < (r + 1) * shard; ++i)
        store(t, b.data(r), i, x[static_cast<size_t>(r)][static_cast<size_t>(i)]);
  } else {
    b.fill([&](int r, int64_t i) { return x[static_cast<size_t>(r)][static_cast<size_t>(i)]; });
  }
  TaskCounts tasks(rt);
  switch (op) {
    case Op::kReduceScatter:
      comm.reduce_scatter(b.views, {});
      break;
    case Op::kAllGather:
      comm.all_gather(b.views, {});
      break;
    case Op::kAllReduce:
      comm.all_reduce(b.views, {});
      break;
  }
  rt.synchronize();
  Result out;
  out.buffer_bytes = comm.buffer_bytes(world - 1);
  out.accumulate_peer = tasks["accumulate_peer"];
  out.accumulate = tasks["accumulate"];
  out.copy_peer = tasks["copy_peer"];
  for (int r = 0; r < world; ++r) out.bits.push_back(b.bits(r));
  return out;
}

// Whole buffers, partial sums of the shards a rank does not own included: both paths add the same
// values in the same order into the same places.
TEST(CommDirect, SameBitsAsTheStagedRingForEveryCollective) {
  auto rt = Runtime::create_cpu(5);
  std::mt19937 rng(2024);
  for (int world : {2, 3, 5})
    for (DType t : kFloatTypes)
      for (int64_t shard : {int64_t{1}, int64_t{7}, int64_t{33}, int64_t{97}})
        for (Op op : {Op::kReduceScatter, Op::kAllGather, Op::kAllReduce}) {
          const std::string what = "world " + std::to_string(world) + " " + dtype_name(t) + " shard " +
                                   std::to_string(shard) + " op " + std::to_string(static_cast<int>(op));
          const auto x = random_inputs(t, world, shard * world, rng);
          const Result direct = run(*rt, world, t, shard, CommPath::kAuto, op, x);
          const Result staged = run(*rt, world, t, shard, CommPath::kStaged, op, x);
          ASSERT_EQ(direct.bits, staged.bits) << what;
          // One op per rank and ring step on the direct path; per chunk on the staged one.
          const int steps = world * (world - 1);
          const int chunks = static_cast<int>((shard * static_cast<int64_t>(dtype_size(t)) + kSmallChunk - 1) / kSmallChunk);
          const bool reduces = op != Op::kAllGather, gathers = op != Op::kReduceScatter;
          EXPECT_EQ(direct.accumulate_peer, reduces ? steps : 0) << what;
          EXPECT_EQ(direct.accumulate, 0) << what;
          EXPECT_EQ(direct.copy_peer, gathers ? steps : 0) << what;
          EXPECT_EQ(staged.accumulate_peer, 0) << what;
          EXPECT_EQ(staged.accumulate, reduces ? steps * chunks : 0) << what;
          EXPECT_EQ(staged.copy_peer, (reduces + gathers) * steps * chunks) << what;
          // Only the staged reductions hold receive buffers, as many as the plans count.
          const size_t planned = reduces ? Communicator::planned_buffer_bytes(world, kSmallChunk) : 0;
          EXPECT_EQ(direct.buffer_bytes, 0u) << what;
          EXPECT_EQ(staged.buffer_bytes, planned) << what;
          if (op != Op::kAllReduce) continue;
          for (int r = 0; r < world; ++r)
            for (int64_t i = 0; i < shard * world; ++i)
              ASSERT_EQ(direct.bits[static_cast<size_t>(r)][static_cast<size_t>(i)],
                        bits_of(t, ring_sum(t, x, world, static_cast<int>(i / shard), i)))
                  << what << " rank " << r << " element " << i;
        }
}

// A backend whose table lacks accumulate_peer reduces through the staged ring, with the same bits;
// all-gather still copies directly.
TEST(CommDirect, BackendWithoutPeerAccumulateStagesTheReduction) {
  auto rt = Runtime::create_cpu(3);
  OpTable table = cpu_op_table();
  table.accumulate_peer = nullptr;
  std::mt19937 rng(77);
  const int world = 3;
  const int64_t shard = 41;
  for (DType t : kFloatTypes) {
    const auto x = random_inputs(t, world, shard * world, rng);
    const Result direct = run(*rt, world, t, shard, CommPath::kAuto, Op::kAllReduce, x);
    Result fallback;
    {
      ScopedOpTable scoped(Backend::kCpu, &table);
      fallback = run(*rt, world, t, shard, CommPath::kAuto, Op::kAllReduce, x);
    }
    ASSERT_EQ(direct.bits, fallback.bits) << dtype_name(t);
    // What the memory plans ask: only the staged reduction allocates receive buffers.
    EXPECT_EQ(direct.buffer_bytes, 0u) << dtype_name(t);
    EXPECT_EQ(fallback.buffer_bytes, Communicator::planned_buffer_bytes(world, kSmallChunk)) << dtype_name(t);
    EXPECT_EQ(direct.accumulate_peer, world * (world - 1)) << dtype_name(t);
    EXPECT_EQ(fallback.accumulate_peer, 0) << dtype_name(t);
    EXPECT_GT(fallback.accumulate, 0) << dtype_name(t);
    // The gather half copies whole shards into the peers either way: one copy per rank and step.
    const int chunks = static_cast<int>((shard * static_cast<int64_t>(dtype_size(t)) + kSmallChunk - 1) / kSmallChunk);
    EXPECT_EQ(fallback.copy_peer, world * (world - 1) * (chunks + 1)) << dtype_name(t);
  }
}

// Communicator::reduces_directly, which the memory plans read: the CPU backend's devices always
// reduce directly, unless the ring is forced or the backend lacks the peer accumulate.
TEST(CommDirect, ReducesDirectlyTellsThePlansWhetherReceiveBuffersExist) {
  auto rt = Runtime::create_cpu(3);
  const auto devs = first_devices(*rt, 3);
  EXPECT_TRUE(Communicator::reduces_directly(devs));
  EXPECT_TRUE(Communicator::reduces_directly(first_devices(*rt, 1)));
  EXPECT_FALSE(Communicator::reduces_directly(devs, CommPath::kStaged));
  OpTable table = cpu_op_table();
  table.accumulate_peer = nullptr;
  ScopedOpTable scoped(Backend::kCpu, &table);
  EXPECT_FALSE(Communicator::reduces_directly(devs));
}

// The staged ring's chunking chosen by the probe (comm/communicator.h): only where reductions can
// stage, one of the choices, each of which holds the planned receive memory, nothing of the probe
// counted, and the bits of any other chunk size (here 128 KiB, none of the choices).
TEST(CommDirect, ProbeChoosesAChunkingThatChangesNeitherBitsNorMemory) {
  auto rt = Runtime::create_cpu(3);
  const auto devs = first_devices(*rt, 3);
  const Communicator direct(devs);
  EXPECT_FALSE(direct.probed());
  EXPECT_EQ(direct.chunk_bytes(), Communicator::kDefaultChunkBytes);
  EXPECT_EQ(direct.recv_slots(), Communicator::kRecvSlots);
  EXPECT_FALSE(Communicator(devs, Communicator::kDefaultChunkBytes, CommPath::kStaged).probed());
  const Communicator probed(devs, Communicator::kProbeChunk, CommPath::kStaged);
  EXPECT_TRUE(probed.probed());
  bool known = false;
  for (const auto& [chunk, slots] : Communicator::kProbeChoices)
    known = known || (chunk == probed.chunk_bytes() && slots == probed.recv_slots());
  EXPECT_TRUE(known) << probed.chunk_bytes() << " bytes x " << probed.recv_slots();
  EXPECT_EQ(probed.chunk_bytes() * static_cast<size_t>(probed.recv_slots()), Communicator::kRecvBudgetBytes);
  EXPECT_EQ(Communicator::planned_buffer_bytes(3, Communicator::kProbeChunk), Communicator::planned_buffer_bytes(3));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(probed.counters(r).bytes_sent, 0u);
    EXPECT_EQ(probed.counters(r).collectives, 0u);
    EXPECT_EQ(probed.buffer_bytes(r), 0u);
  }
  std::mt19937 rng(5);
  const int64_t shard = 100003;  // 391 KiB of fp32: several chunks at every choice
  for (DType t : {DType::kF32, DType::kBF16}) {
    const auto x = random_inputs(t, 3, shard * 3, rng);
    const Result a = run(*rt, 3, t, shard, CommPath::kStaged, Op::kAllReduce, x, Communicator::kProbeChunk);
    const Result b = run(*rt, 3, t, shard, CommPath::kStaged, Op::kAllReduce, x, Communicator::kDefaultChunkBytes / 8);
    ASSERT_EQ(a.bits, b.bits) << dtype_name(t);
    EXPECT_EQ(a.buffer_bytes, Communicator::planned_buffer_bytes(3, Communicator::kProbeChunk)) << dtype_name(t);
  }
}

// Many reduce-scatters and all-reduces on the same buffers, each preceded by the compute stream
// rewriting the whole buffer right after wait_done, with no host synchronisation in between: a
// rewrite that overtook the successor's read of the previous collective (or a read before the
// predecessor's step was done) shows as a wrong sum, and under ThreadSanitizer as a race.
TEST(CommDirect, BuffersRewrittenRightAfterWaitDoneWithoutHostSync) {
  auto rt = Runtime::create_cpu(4);
  for (int world : {2, 4}) {
    auto devs = first_devices(*rt, world);
    Communicator comm(devs, kSmallChunk);
    const int64_t shard = 1000;
    const int64_t numel = shard * world;
    RankBuffers b(devs, DType::kF32, numel);
    constexpr int kRounds = 12;
    std::vector<std::vector<std::vector<float>>> seen(
        kRounds, std::vector<std::vector<float>>(static_cast<size_t>(world), std::vector<float>(static_cast<size_t>(numel))));
    std::vector<Stream*> producers;
    for (Device* d : devs) producers.push_back(&d->compute());
    const auto value = [](int round, int r, int64_t i) { return static_cast<float>((round * 5 + r * 3 + i) % 11) - 5.0f; };
    for (int round = 0; round < kRounds; ++round) {
      for (int r = 0; r < world; ++r) {
        auto* data = static_cast<float*>(b.data(r));
        devs[static_cast<size_t>(r)]->compute().host_func([=] {
          for (int64_t i = 0; i < numel; ++i) data[i] = value(round, r, i);
        });
      }
      if (round % 2 == 0)
        comm.reduce_scatter(b.views, producers);
      else
        comm.all_reduce(b.views, producers);
      for (int r = 0; r < world; ++r) {
        Stream& c = devs[static_cast<size_t>(r)]->compute();
        comm.wait_done(r, c);
        const auto* data = static_cast<const float*>(b.data(r));
        float* out = seen[static_cast<size_t>(round)][static_cast<size_t>(r)].data();
        c.host_func([=] { std::memcpy(out, data, static_cast<size_t>(numel) * sizeof(float)); });
      }
    }
    rt->synchronize();
    for (int round = 0; round < kRounds; ++round)
      for (int r = 0; r < world; ++r) {
        const int64_t begin = round % 2 == 0 ? r * shard : 0;
        const int64_t end = round % 2 == 0 ? (r + 1) * shard : numel;
        for (int64_t i = begin; i < end; ++i) {
          float sum = 0;  // small integers: exact in any order
          for (int q = 0; q < world; ++q) sum += value(round, q, i);
          ASSERT_EQ(seen[static_cast<size_t>(round)][static_cast<size_t>(r)][static_cast<size_t>(i)], sum)
              << "world " << world << " round " << round << " rank " << r << " element " << i;
        }
      }
  }
}

// ---- the op ------------------------------------------------------------------------------------------

TEST(AccumulatePeer, ReadsAnotherDeviceWithAccumulatesBits) {
  auto rt = Runtime::create_cpu(2);
  Device& d0 = rt->device(0);
  Device& d1 = rt->device(1);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1000.0f, 1000.0f);
  const int64_t n = 70001;
  for (DType t : kFloatTypes) {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(t);
    DeviceBuffer dst(d0.memory(), bytes, d0.compute()), ref(d0.memory(), bytes, d0.compute());
    DeviceBuffer src(d1.memory(), bytes, d1.compute()), local(d0.memory(), bytes, d0.compute());
    for (int64_t i = 0; i < n; ++i) {
      store(t, dst.data(), i, dist(rng) * (i % 3 == 0 ? 1e-3f : 1.0f));
      store(t, src.data(), i, dist(rng));
    }
    std::memcpy(ref.data(), dst.data(), bytes);
    std::memcpy(local.data(), src.data(), bytes);
    ops::accumulate_peer(d0.comm(), TensorView{dst.data(), t, Shape{n}, 0}, ConstTensorView{src.data(), t, Shape{n}, 1});
    ops::accumulate(d0.comm(), TensorView{ref.data(), t, Shape{n}, 0}, ConstTensorView{local.data(), t, Shape{n}, 0});
    d0.comm().synchronize();
    ASSERT_EQ(std::memcmp(dst.data(), ref.data(), bytes), 0) << dtype_name(t);
  }
  DeviceBuffer a(d0.memory(), 64, d0.compute()), b(d1.memory(), 64, d1.compute());
  EXPECT_THAT(error_of([&] {
                ops::accumulate_peer(d0.comm(), TensorView{a.data(), DType::kBF16, Shape{8}, 0},
                                     ConstTensorView{b.data(), DType::kF16, Shape{8}, 1});
              }).message(),
              HasSubstr("accumulate_peer: src [8] is fp16 but must be bf16"));
  EXPECT_THAT(error_of([&] {
                ops::accumulate_peer(d0.comm(), TensorView{a.data(), DType::kF32, Shape{8}, 1},
                                     ConstTensorView{b.data(), DType::kF32, Shape{8}, 1});
              }).message(),
              HasSubstr("accumulate_peer: dst [8] is on device 1"));
}

// The CUDA kernel (128-bit loads where dst and src share alignment, element by element elsewhere)
// against the CPU loop's bits, at offsets that exercise the aligned body, the head and tail, and no
// common alignment. Two logical devices on GPU 0 (peer access within a GPU always holds).
TEST(AccumulatePeerOnGpu, MatchesTheCpuBitsAtEveryAlignment) {
  const CudaAvailability cuda = cuda_availability();
  if (!cuda.usable) GTEST_SKIP() << "no usable GPU: " << cuda.reason;
  auto gpu = Runtime::create(parse_device_spec("cuda:0x2"));
  Device& g0 = gpu->device(0);
  Device& g1 = gpu->device(1);
  ASSERT_TRUE(g0.can_access_peer(g1));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-70000.0f, 70000.0f);
  const int64_t n = 100003;
  for (DType t : kFloatTypes)
    for (int64_t dst_off : {0, 1, 3})
      for (int64_t src_off : {0, 1, 8}) {
        const int64_t len = n - 8;
        const size_t bytes = static_cast<size_t>(n) * dtype_size(t);
        std::vector<uint8_t> a(bytes), b(bytes), expect(bytes), got(bytes);
        for (int64_t i = 0; i < n; ++i) {
          store(t, a.data(), i, dist(rng) * (i % 5 == 0 ? 1e-4f : 1.0f));
          store(t, b.data(), i, dist(rng));
        }
        expect = a;
        for (int64_t i = 0; i < len; ++i)
          store(t, expect.data(), dst_off + i, load(t, a.data(), dst_off + i) + load(t, b.data(), src_off + i));
        DeviceBuffer ga(g0.memory(), bytes, g0.comm()), gb(g1.memory(), bytes, g1.comm());
        g0.comm().copy(ga.data(), a.data(), bytes);
        g1.comm().copy(gb.data(), b.data(), bytes);
        g1.comm().synchronize();
        const size_t es = dtype_size(t);
        ops::accumulate_peer(g0.comm(), TensorView{static_cast<char*>(ga.data()) + dst_off * es, t, Shape{len}, 0},
                             ConstTensorView{static_cast<char*>(gb.data()) + src_off * es, t, Shape{len}, 1});
        g0.comm().copy(got.data(), ga.data(), bytes);
        g0.comm().synchronize();
        ASSERT_EQ(got, expect) << dtype_name(t) << " dst offset " << dst_off << " src offset " << src_off;
      }
}

}  // namespace
}  // namespace zt
