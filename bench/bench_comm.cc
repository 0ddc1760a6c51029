// Bus bandwidth of the ring collectives on 2 and 4 simulated CPU devices, 1-64 MiB per rank,
// against memcpy of the same bytes, and against what the simulated links can carry at once (every
// device's comm stream copying a link's bytes, (N-1)/N of the buffer, at the same time: the
// simulated devices share the host's memory bandwidth, so this is the ceiling of busbw here). Convention as nccl-tests: algbw = buffer bytes per rank / time;
// busbw = algbw * 2(N-1)/N for all_reduce and (N-1)/N for reduce_scatter / all_gather, the
// bandwidth each link would need, so it compares directly with a copy's bandwidth.
// bytes_per_second (SetBytesProcessed) is busbw; the algbw counter is beside it.
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace {

enum Collective : int { kReduceScatter = 0, kAllGather = 1, kAllReduce = 2 };

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

// Every device's comm stream copies (N-1)/N of range(1) bytes (what one ring link carries in a
// reduce-scatter or all-gather) at the same time; bytes_per_second is per link, like busbw.
void BM_ConcurrentCopies(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const size_t bytes = static_cast<size_t>(state.range(1)) / static_cast<size_t>(world) * static_cast<size_t>(world - 1);
  auto rt = zt::Runtime::create_cpu(world);
  std::vector<zt::DeviceBuffer> src, dst;
  for (int r = 0; r < world; ++r) {
    zt::Device& d = rt->device(r);
    src.emplace_back(d.memory(), bytes, d.comm(), "bench");
    dst.emplace_back(d.memory(), bytes, d.comm(), "bench");
    std::memset(src.back().data(), 1, bytes);
    std::memset(dst.back().data(), 0, bytes);
  }
  auto run = [&] {
    for (int r = 0; r < world; ++r) rt->device(r).comm().copy(dst[r].data(), src[r].data(), bytes);
    rt->synchronize();
  };
  run();
  for (auto _ : state) run();
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

// One collective over fp32 buffers of range(1) bytes per rank on range(0) devices, synchronized
// every iteration (so the time includes the pipeline's fill and drain, as nccl-tests' does).
void BM_Collective(benchmark::State& state, Collective kind) {
  const int world = static_cast<int>(state.range(0));
  const size_t bytes = static_cast<size_t>(state.range(1));
  auto rt = zt::Runtime::create_cpu(world);
  std::vector<zt::Device*> devices;
  for (int r = 0; r < world; ++r) devices.push_back(&rt->device(r));
  zt::Communicator comm(devices);
  const int64_t numel = static_cast<int64_t>(bytes / sizeof(float)) / world * world;
  std::vector<zt::DeviceBuffer> mem;
  std::vector<zt::TensorView> views;
  for (zt::Device* d : devices) {
    mem.emplace_back(d->memory(), static_cast<size_t>(numel) * sizeof(float), d->comm(), "bench");
    std::memset(mem.back().data(), 0, mem.back().size());  // fault the pages in before timing
    views.push_back(zt::TensorView{mem.back().data(), zt::DType::kF32, zt::Shape{numel}, d->index()});
  }
  auto run = [&] {
    switch (kind) {
      case kReduceScatter:
        comm.reduce_scatter(views, {});
        break;
      case kAllGather:
        comm.all_gather(views, {});
        break;
      case kAllReduce:
        comm.all_reduce(views, {});
        break;
    }
    rt->synchronize();
  };
  run();  // receive buffers allocated, caches warm
  for (auto _ : state) run();
  const double data = static_cast<double>(numel) * sizeof(float);
  const double factor = (kind == kAllReduce ? 2.0 : 1.0) * (world - 1) / world;
  state.SetBytesProcessed(static_cast<int64_t>(data * factor * static_cast<double>(state.iterations())));
  state.counters["algbw"] = benchmark::Counter(data * static_cast<double>(state.iterations()),
                                               benchmark::Counter::kIsRate,
                                               benchmark::Counter::OneK::kIs1024);
  state.counters["busbw_factor"] = factor;
}

constexpr int64_t kMiB = int64_t{1} << 20;

void collective_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"devices", "bytes"});
  for (int64_t world : {2, 4})
    for (int64_t bytes : {1 * kMiB, 4 * kMiB, 16 * kMiB, 64 * kMiB}) b->Args({world, bytes});
}

void memcpy_args(benchmark::internal::Benchmark* b) {
  for (int64_t bytes : {1 * kMiB, 4 * kMiB, 16 * kMiB, 64 * kMiB}) b->Arg(bytes);
}

BENCHMARK(BM_Memcpy)->Apply(memcpy_args)->UseRealTime();
BENCHMARK(BM_ConcurrentCopies)->Apply(collective_args)->UseRealTime();
BENCHMARK_CAPTURE(BM_Collective, reduce_scatter, kReduceScatter)->Apply(collective_args)->UseRealTime();
BENCHMARK_CAPTURE(BM_Collective, all_gather, kAllGather)->Apply(collective_args)->UseRealTime();
BENCHMARK_CAPTURE(BM_Collective, all_reduce, kAllReduce)->Apply(collective_args)->UseRealTime();

}  // namespace
