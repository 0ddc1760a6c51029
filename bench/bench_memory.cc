// Allocation latency of the caching pool against std::malloc and the raw host allocator, for
// sizes from 256 B to 256 MiB: one allocate + free pair per item (reported as items/s).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>

#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace {

// Sizes: 256 B, 4 KiB, 64 KiB, 1 MiB, 16 MiB, 256 MiB.
void sizes(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(16)->Range(256, 256 << 20);
}

zt::Runtime& runtime() {
  static std::unique_ptr<zt::Runtime> rt = zt::Runtime::create_cpu(1);
  return *rt;
}

void BM_PoolAllocFree(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  zt::Stream& stream = runtime().device(0).compute();
  zt::CachingAllocator pool("cpu:bench", std::make_unique<zt::HostRawAllocator>());
  pool.free(pool.allocate(bytes, stream));  // warm the cache: the steady state is what a step sees
  for (auto _ : state) {
    void* p = pool.allocate(bytes, stream, "bench");
    benchmark::DoNotOptimize(p);
    pool.free(p);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["raw_allocs"] = static_cast<double>(pool.stats().num_raw_allocs);
}

void BM_PoolAllocFreeTwoLive(benchmark::State& state) {
  // A second live block makes each free coalesce with a free neighbour (split + merge per item).
  const auto bytes = static_cast<size_t>(state.range(0));
  zt::Stream& stream = runtime().device(0).compute();
  zt::CachingAllocator pool("cpu:bench", std::make_unique<zt::HostRawAllocator>());
  void* keep = pool.allocate(bytes, stream);
  for (auto _ : state) {
    void* p = pool.allocate(bytes, stream, "bench");
    benchmark::DoNotOptimize(p);
    pool.free(p);
  }
  pool.free(keep);
  state.SetItemsProcessed(state.iterations());
}

void BM_Malloc(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(bytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_HostRawAllocator(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  zt::HostRawAllocator raw;
  for (auto _ : state) {
    void* p = raw.allocate(bytes);
    benchmark::DoNotOptimize(p);
    raw.deallocate(p, bytes);
  }
  state.SetItemsProcessed(state.iterations());
}

BENCHMARK(BM_PoolAllocFree)->Apply(sizes);
BENCHMARK(BM_PoolAllocFreeTwoLive)->Apply(sizes);
BENCHMARK(BM_Malloc)->Apply(sizes);
BENCHMARK(BM_HostRawAllocator)->Apply(sizes);

}  // namespace
