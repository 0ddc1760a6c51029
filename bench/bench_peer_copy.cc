// Peer-copy bandwidth between two simulated CPU devices against plain memcpy of the same bytes
// (the physical limit on one host). The difference is the runtime's queueing and wake-up cost.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace {

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

// One copy_peer + synchronize per iteration: includes the host round trip.
void BM_CpuPeerCopySync(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  auto rt = zt::Runtime::create_cpu(2);
  zt::Device& d0 = rt->device(0);
  zt::Device& d1 = rt->device(1);
  zt::DeviceBuffer src(d0.memory(), bytes, d0.comm(), "bench_src");
  zt::DeviceBuffer dst(d1.memory(), bytes, d1.compute(), "bench_dst");
  std::memset(src.data(), 1, bytes);
  std::memset(dst.data(), 0, bytes);  // fault the pages in before timing, as memcpy's vectors are
  for (auto _ : state) {
    d0.comm().copy_peer(d1, dst.data(), src.data(), bytes);
    d0.comm().synchronize();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

// 16 queued copies per synchronize: the steady-state bandwidth of a stream of copies.
void BM_CpuPeerCopyQueued(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  constexpr int kBatch = 16;
  auto rt = zt::Runtime::create_cpu(2);
  zt::Device& d0 = rt->device(0);
  zt::Device& d1 = rt->device(1);
  zt::DeviceBuffer src(d0.memory(), bytes, d0.comm(), "bench_src");
  zt::DeviceBuffer dst(d1.memory(), bytes, d1.compute(), "bench_dst");
  std::memset(src.data(), 1, bytes);
  std::memset(dst.data(), 0, bytes);
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) d0.comm().copy_peer(d1, dst.data(), src.data(), bytes);
    d0.comm().synchronize();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kBatch * static_cast<int64_t>(bytes));
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int64_t s : {int64_t{4} << 10, int64_t{64} << 10, int64_t{1} << 20, int64_t{16} << 20,
                    int64_t{256} << 20})
    b->Arg(s);
}

BENCHMARK(BM_Memcpy)->Apply(sizes)->UseRealTime();
BENCHMARK(BM_CpuPeerCopySync)->Apply(sizes)->UseRealTime();
BENCHMARK(BM_CpuPeerCopyQueued)->Apply(sizes)->UseRealTime();

}  // namespace
