// The cross-process ring under mpirun (bench/process_ring.sh runs the shapes side by side): flat and
// hierarchical all-reduce of fp32 buffers, 1-16 MiB per rank, on K processes x L simulated devices;
// with one process, the in-process Communicator on the same devices as the baseline. Bytes/s is
// nccl-tests' bus bandwidth (algbw * 2(N-1)/N); across_B is what left this process per call.
// Usage: mpirun -np K bench_process_ring --local-devices L [benchmark flags]; rank 0 reports.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/process_group.h"
#include "comm/process_ring.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace {

// Every process must run the same number of collectives: fixed iterations, no adaptive timing.
constexpr int kIterations = 8;

enum class Algo { kFlat, kHierarchical, kInProcess };

struct Buffers {
  std::vector<zt::DeviceBuffer> mem;
  std::vector<zt::TensorView> views;
  Buffers(const std::vector<zt::Device*>& devices, int64_t numel) {
    for (zt::Device* d : devices) {
      mem.emplace_back(d->memory(), static_cast<size_t>(numel) * sizeof(float), d->comm(), "bench");
      std::memset(mem.back().data(), 0, mem.back().size());  // fault the pages in before timing
      views.push_back(zt::TensorView{mem.back().data(), zt::DType::kF32, zt::Shape{numel}, d->index()});
    }
  }
};

void run_all_reduce(benchmark::State& state, zt::ProcessGroup& group, int local, Algo algo, size_t bytes) {
  auto rt = zt::Runtime::create_cpu(local);
  std::vector<zt::Device*> devices;
  for (int i = 0; i < local; ++i) devices.push_back(&rt->device(i));
  const int world = group.size() * local;
  const int64_t numel = static_cast<int64_t>(bytes / sizeof(float)) / world * world;
  Buffers buf(devices, numel);
  zt::ProcessRing ring(group, devices);
  std::unique_ptr<zt::Communicator> comm;
  if (algo == Algo::kInProcess) comm = std::make_unique<zt::Communicator>(devices);
  group.barrier("the benchmark's start");
  for (auto _ : state) {
    switch (algo) {
      case Algo::kFlat:
        ring.all_reduce(buf.views);
        break;
      case Algo::kHierarchical:
        ring.hierarchical_all_reduce(buf.views);
        break;
      case Algo::kInProcess:
        comm->all_reduce(buf.views, {});
        rt->synchronize();
        break;
    }
  }
  const double algbw_bytes = static_cast<double>(numel) * sizeof(float);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * algbw_bytes * 2.0 * (world - 1) / world));
  state.counters["across_B"] = static_cast<double>(ring.bytes_sent_across()) / static_cast<double>(state.iterations());
  state.counters["world"] = world;
}

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  int local = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--local-devices") == 0 && i + 1 < argc) {
      local = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "bench_process_ring: unknown argument '%s'\n", argv[i]);
      return 2;
    }
  }
  if (local < 1) return 2;
  int rc = 0;
  {
    zt::ProcessGroup group(std::chrono::seconds(120));
    const std::string shape = std::to_string(group.size()) + "x" + std::to_string(local);
    for (const size_t mib : {1, 4, 16}) {
      const size_t bytes = mib << 20;
      char size[32];  // "/4MiB" (snprintf: GCC 12 warns falsely on the string concatenation)
      std::snprintf(size, sizeof size, "/%zuMiB", mib);
      benchmark::RegisterBenchmark(("BM_ProcessRing_flat/" + shape + size).c_str(),
                                   [&group, local, bytes](benchmark::State& s) {
                                     run_all_reduce(s, group, local, Algo::kFlat, bytes);
                                   })
          ->Iterations(kIterations)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("BM_ProcessRing_hierarchical/" + shape + size).c_str(),
                                   [&group, local, bytes](benchmark::State& s) {
                                     run_all_reduce(s, group, local, Algo::kHierarchical, bytes);
                                   })
          ->Iterations(kIterations)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
      if (group.size() == 1)
        benchmark::RegisterBenchmark(("BM_Communicator/" + shape + size).c_str(),
                                     [&group, local, bytes](benchmark::State& s) {
                                       run_all_reduce(s, group, local, Algo::kInProcess, bytes);
                                     })
            ->Iterations(kIterations)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
    }
    if (group.rank() == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      NullReporter quiet;
      benchmark::RunSpecifiedBenchmarks(&quiet);
    }
    group.barrier("the benchmark's end");
  }
  benchmark::Shutdown();
  zt::mpi_finalize();
  return rc;
}
