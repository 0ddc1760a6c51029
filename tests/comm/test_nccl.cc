// NcclComm (comm/nccl_comm.h) against the in-process ring: one rank on one GPU gives the ring's
// bits for every collective and dtype; with 2+ GPUs, small integers (exact in every order) give
// the ring's bits too. Built in every configuration; the GPU tests skip without a usable GPU or a
// build without NCCL (scripts/gpu-check.sh runs them), the refusals run everywhere.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/nccl_comm.h"
#include "comm_test_util.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace zt {
namespace {

using commtest::bits_at;
using commtest::error_of;
using commtest::store;

constexpr DType kTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

#define ZT_SKIP_WITHOUT_NCCL_GPU(min_gpus)                                                            \
  do {                                                                                                \
    if (!nccl_built()) GTEST_SKIP() << "built without NCCL";                                          \
    const CudaAvailability zt_cuda_ = cuda_availability();                                           \
    if (!zt_cuda_.usable) GTEST_SKIP() << "no usable GPU: " << zt_cuda_.reason;                      \
    if (zt_cuda_.device_count < (min_gpus)) GTEST_SKIP() << "needs " << (min_gpus) << " GPUs";        \
  } while (0)

enum class Op { kReduceScatter, kAllGather, kAllReduce };
const char* op_name(Op op) {
  return op == Op::kReduceScatter ? "reduce_scatter" : op == Op::kAllGather ? "all_gather" : "all_reduce";
}

// One buffer per device, filled from host bytes on the compute stream (the producer).
struct Buffers {
  std::vector<DeviceBuffer> mem;
  std::vector<TensorView> views;
  Buffers(const std::vector<Device*>& devs, DType t, int64_t numel) {
    for (Device* d : devs) {
      mem.emplace_back(d->memory(), static_cast<size_t>(numel) * dtype_size(t), d->compute(), "test");
      views.push_back(TensorView{mem.back().data(), t, Shape{numel}, d->index()});
    }
  }
  void upload(const std::vector<Device*>& devs, const std::vector<std::vector<uint8_t>>& host) {
    for (size_t r = 0; r < devs.size(); ++r) devs[r]->compute().copy(mem[r].data(), host[r].data(), host[r].size());
  }
  // After the collective: the compute stream waits for the comm stream, then copies out.
  std::vector<std::vector<uint8_t>> download(const std::vector<Device*>& devs) {
    std::vector<std::vector<uint8_t>> out(devs.size());
    for (size_t r = 0; r < devs.size(); ++r) {
      auto done = devs[r]->create_event();
      devs[r]->comm().record(*done);
      devs[r]->compute().wait(*done);
      out[r].resize(mem[r].size());
      devs[r]->compute().copy(out[r].data(), mem[r].data(), mem[r].size());
      devs[r]->compute().synchronize();
    }
    return out;
  }
};

// Every rank's result of `op` under NCCL (one host thread per rank, NCCL's per-rank model) and
// under the ring's group call, from the same inputs.
void nccl_and_ring(const std::vector<Device*>& devs, Op op, DType t, int64_t numel,
                   const std::vector<std::vector<uint8_t>>& host, std::vector<std::vector<uint8_t>>& nccl_out,
                   std::vector<std::vector<uint8_t>>& ring_out) {
  const int world = static_cast<int>(devs.size());
  {
    NcclComm nccl(devs);
    ASSERT_EQ(nccl.world(), world);
    Buffers b(devs, t, numel);
    b.upload(devs, host);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        Stream* producer = &devs[static_cast<size_t>(r)]->compute();
        if (op == Op::kReduceScatter) nccl.reduce_scatter(r, b.views[static_cast<size_t>(r)], producer);
        if (op == Op::kAllGather) nccl.all_gather(r, b.views[static_cast<size_t>(r)], producer);
        if (op == Op::kAllReduce) nccl.all_reduce(r, b.views[static_cast<size_t>(r)], producer);
      });
    for (auto& th : threads) th.join();
    nccl_out = b.download(devs);
  }
  Communicator ring(devs);
  Buffers b(devs, t, numel);
  b.upload(devs, host);
  std::vector<Stream*> producers;
  for (Device* d : devs) producers.push_back(&d->compute());
  if (op == Op::kReduceScatter) ring.reduce_scatter(b.views, producers);
  if (op == Op::kAllGather) ring.all_gather(b.views, producers);
  if (op == Op::kAllReduce) ring.all_reduce(b.views, producers);
  ring_out = b.download(devs);
}

// The bytes NCCL owns after `op` on rank r: the rank's shard after reduce_scatter (the rest holds
// implementation-defined partial sums in the ring), everything otherwise.
void expect_same_result(Op op, DType t, int64_t numel, int world, const std::vector<std::vector<uint8_t>>& nccl,
                        const std::vector<std::vector<uint8_t>>& ring, const std::string& what) {
  const int64_t shard = numel / world;
  for (int r = 0; r < world; ++r) {
    const int64_t begin = op == Op::kReduceScatter ? r * shard : 0;
    const int64_t end = op == Op::kReduceScatter ? begin + shard : numel;
    for (int64_t i = begin; i < end; ++i)
      ASSERT_EQ(bits_at(t, nccl[static_cast<size_t>(r)].data(), i), bits_at(t, ring[static_cast<size_t>(r)].data(), i))
          << what << " " << op_name(op) << " rank " << r << " element " << i;
  }
}

// One rank on one GPU: every collective leaves the buffer as the ring does, bit for bit, for
// random values in every dtype (an all-reduce of odd length too), and the results follow the
// producer's writes (the upload on the compute stream).
TEST(NcclOnGpu, OneRankGivesTheRingsBits) {
  ZT_SKIP_WITHOUT_NCCL_GPU(1);
  auto rt = Runtime::create(parse_device_spec("cuda:0"));
  const std::vector<Device*> devs = {&rt->device(0)};
  std::mt19937 rng(18);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  for (DType t : kTypes)
    for (Op op : {Op::kReduceScatter, Op::kAllGather, Op::kAllReduce})
      for (int64_t numel : {int64_t{1}, int64_t{1009}, int64_t{1} << 20}) {
        std::vector<std::vector<uint8_t>> host(1, std::vector<uint8_t>(static_cast<size_t>(numel) * dtype_size(t)));
        for (int64_t i = 0; i < numel; ++i) store(t, host[0].data(), i, dist(rng));
        std::vector<std::vector<uint8_t>> nccl, ring;
        nccl_and_ring(devs, op, t, numel, host, nccl, ring);
        const std::string what = std::string(dtype_name(t)) + " numel " + std::to_string(numel);
        expect_same_result(op, t, numel, 1, nccl, ring, what);
        ASSERT_EQ(nccl[0], host[0]) << what << " " << op_name(op) << ": one rank must leave its input unchanged";
      }
}

// Every GPU as one rank (2+ GPUs): small integers sum exactly in any order, so NCCL's summation
// order cannot change a bit and its results must be the ring's, on every rank, in every dtype.
TEST(NcclOnGpu, EveryGpuAsARankGivesTheRingsBitsForExactSums) {
  ZT_SKIP_WITHOUT_NCCL_GPU(2);
  auto rt = Runtime::create(parse_device_spec("cuda"));  // one logical device per GPU
  std::vector<Device*> devs;
  for (int r = 0; r < rt->size() && r < 8; ++r) devs.push_back(&rt->device(r));
  const int world = static_cast<int>(devs.size());
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-8, 8);
  for (DType t : kTypes)
    for (Op op : {Op::kReduceScatter, Op::kAllGather, Op::kAllReduce})
      for (int64_t shard : {int64_t{1}, int64_t{257}, int64_t{65536}}) {
        const int64_t numel = shard * world;
        std::vector<std::vector<uint8_t>> host(static_cast<size_t>(world),
                                               std::vector<uint8_t>(static_cast<size_t>(numel) * dtype_size(t)));
        for (auto& h : host)
          for (int64_t i = 0; i < numel; ++i) store(t, h.data(), i, static_cast<float>(small(rng)));
        std::vector<std::vector<uint8_t>> nccl, ring;
        nccl_and_ring(devs, op, t, numel, host, nccl, ring);
        expect_same_result(op, t, numel, world, nccl, ring,
                           std::string(dtype_name(t)) + " shard " + std::to_string(shard) + " world " +
                               std::to_string(world));
      }
}

TEST(NcclOnGpu, TwoRanksOnOneGpuAreRefused) {
  ZT_SKIP_WITHOUT_NCCL_GPU(1);
  auto rt = Runtime::create(parse_device_spec("cuda:0x2"));
  const Error e = error_of([&] { NcclComm nccl({&rt->device(0), &rt->device(1)}); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("share GPU 0"), std::string::npos) << e.message();
}

// Everywhere (CI): simulated devices are refused with one sentence, by the build without NCCL
// as by the build with it.
TEST(Nccl, SimulatedDevicesAreRefused) {
  auto rt = Runtime::create_cpu(2);
  const Error e = error_of([&] { NcclComm nccl({&rt->device(0), &rt->device(1)}); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  const std::string expect = nccl_built() ? "--comm nccl needs CUDA devices" : "--comm nccl needs a CUDA build with NCCL";
  EXPECT_NE(e.message().find(expect), std::string::npos) << e.message();
  EXPECT_EQ(nccl_version().empty(), !nccl_built());
}

}  // namespace
}  // namespace zt
