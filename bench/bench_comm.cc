// Bus bandwidth of the ring collectives (reduce-scatter, all-gather, all-reduce) on any devices
// (`--devices SPEC`, as zerotrain's: cpu:4, cuda:0x4, cuda:0,1; default: 2 and 4 simulated CPU
// devices), 1-64 MiB per rank (and 256 MiB on GPUs), against a device copy of the same bytes
// measured in the same run, and against every device's comm stream copying a ring link's bytes at
// once (the ceiling where devices share one memory: simulated devices, logical devices of one GPU).
// Convention as nccl-tests: algbw = buffer bytes per rank / time; busbw = algbw * 2(N-1)/N for
// all_reduce and (N-1)/N for reduce_scatter / all_gather, the bandwidth each link would need, so
// it compares directly with a copy's bandwidth. bytes_per_second (SetBytesProcessed) is busbw; the
// algbw counter is beside it. After the table: busbw / device copy per collective and size.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace {

enum Collective : int { kReduceScatter = 0, kAllGather = 1, kAllReduce = 2 };
const char* const kCollectiveNames[] = {"reduce_scatter", "all_gather", "all_reduce"};

constexpr int64_t kMiB = int64_t{1} << 20;

// One runtime per device spec, created on first use and kept for the process (GPU contexts are
// slow to create; a runtime owns its devices, so every benchmark of a spec shares them).
zt::Runtime& runtime(const std::string& spec) {
  static auto* runtimes = new std::map<std::string, std::unique_ptr<zt::Runtime>>();
  auto& rt = (*runtimes)[spec];
  if (!rt) rt = zt::Runtime::create(zt::parse_device_spec(spec));
  return *rt;
}

// Bytes per device, filled through the stream (host memset cannot reach a GPU's memory).
std::vector<zt::DeviceBuffer> buffers(zt::Runtime& rt, size_t bytes, int value) {
  std::vector<zt::DeviceBuffer> v;
  for (int r = 0; r < rt.size(); ++r) {
    zt::Device& d = rt.device(r);
    v.emplace_back(d.memory(), bytes, d.comm(), "bench");
    d.comm().memset(v.back().data(), value, bytes);  // fault the pages in before timing
  }
  rt.synchronize();
  return v;
}

// A copy of `bytes` inside device 0 on its comm stream, synchronized every iteration like the
// collectives: the reference a ring link's busbw is compared with.
void BM_DeviceCopy(benchmark::State& state, const std::string& spec) {
  zt::Runtime& rt = runtime(spec);
  const size_t bytes = static_cast<size_t>(state.range(0));
  zt::Device& d = rt.device(0);
  zt::DeviceBuffer src(d.memory(), bytes, d.comm(), "bench"), dst(d.memory(), bytes, d.comm(), "bench");
  d.comm().memset(src.data(), 1, bytes);
  d.comm().memset(dst.data(), 0, bytes);
  auto run = [&] {
    d.comm().copy(dst.data(), src.data(), bytes);
    d.comm().synchronize();
  };
  run();
  for (auto _ : state) run();
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  state.SetLabel(d.name());
}

// Every device's comm stream copies (N-1)/N of range(0) bytes (what one ring link carries in a
// reduce-scatter or all-gather) at the same time; bytes_per_second is per link, like busbw.
void BM_ConcurrentCopies(benchmark::State& state, const std::string& spec) {
  zt::Runtime& rt = runtime(spec);
  const int world = rt.size();
  const size_t bytes =
      static_cast<size_t>(state.range(0)) / static_cast<size_t>(world) * static_cast<size_t>(std::max(world - 1, 1));
  std::vector<zt::DeviceBuffer> src = buffers(rt, bytes, 1), dst = buffers(rt, bytes, 0);
  auto run = [&] {
    for (int r = 0; r < world; ++r) rt.device(r).comm().copy(dst[r].data(), src[r].data(), bytes);
    rt.synchronize();
  };
  run();
  for (auto _ : state) run();
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

// One collective over fp32 buffers of range(0) bytes per rank on the spec's devices, synchronized
// every iteration (so the time includes the pipeline's fill and drain, as nccl-tests' does).
void BM_Collective(benchmark::State& state, const std::string& spec, Collective kind) {
  zt::Runtime& rt = runtime(spec);
  const int world = rt.size();
  if (world < 2) {
    state.SkipWithError("a collective needs 2 or more devices");
    return;
  }
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<zt::Device*> devices;
  for (int r = 0; r < world; ++r) devices.push_back(&rt.device(r));
  zt::Communicator comm(devices);
  const int64_t numel = static_cast<int64_t>(bytes / sizeof(float)) / world * world;
  std::vector<zt::DeviceBuffer> mem = buffers(rt, static_cast<size_t>(numel) * sizeof(float), 0);
  std::vector<zt::TensorView> views;
  for (int r = 0; r < world; ++r)
    views.push_back(zt::TensorView{mem[r].data(), zt::DType::kF32, zt::Shape{numel}, devices[r]->index()});
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
    rt.synchronize();
  };
  run();  // receive buffers allocated, caches warm
  for (auto _ : state) run();
  const double data = static_cast<double>(numel) * sizeof(float);
  const double factor = (kind == kAllReduce ? 2.0 : 1.0) * (world - 1) / world;
  state.SetBytesProcessed(static_cast<int64_t>(data * factor * static_cast<double>(state.iterations())));
  state.counters["algbw"] = benchmark::Counter(data * static_cast<double>(state.iterations()),
                                               benchmark::Counter::kIsRate, benchmark::Counter::OneK::kIs1024);
  state.counters["busbw_factor"] = factor;
}

// The console table, and each run's bytes/s kept for the ratios printed after it.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      auto it = r.counters.find("bytes_per_second");
      if (r.run_type == Run::RT_Iteration && !r.error_occurred && it != r.counters.end())
        rates.emplace_back(r.run_name.function_name + "/" + r.run_name.args, it->second.value);
    }
  }
  double rate(const std::string& name) const {
    for (const auto& [n, r] : rates)
      if (n == name) return r;
    return 0;
  }
  std::vector<std::pair<std::string, double>> rates;  // "<kind>/<spec>/bytes:N" -> bytes/s, in run order
};

// "--devices SPEC" / "--devices=SPEC" (may repeat), removed from argv before Google Benchmark sees it.
std::vector<std::string> take_devices(int* argc, char** argv) {
  std::vector<std::string> specs;
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string a = argv[i];
    if (a == "--devices" && i + 1 < *argc) {
      specs.push_back(argv[++i]);
    } else if (a.rfind("--devices=", 0) == 0) {
      specs.push_back(a.substr(10));
    } else if (a == "--devices") {
      std::fprintf(stderr, "bench_comm: --devices needs a device spec, e.g. --devices cuda:0x4 or --devices cpu:4\n");
      std::exit(2);
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  return specs;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> specs = take_devices(&argc, argv);
  if (specs.empty()) specs = {"cpu:2", "cpu:4"};
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  for (const std::string& spec : specs) {
    try {
      runtime(spec);
    } catch (const zt::Error& e) {
      std::fprintf(stderr, "bench_comm: --devices %s: %s\n", spec.c_str(), e.message().c_str());
      return 2;
    }
    std::vector<int64_t> sizes{1 * kMiB, 4 * kMiB, 16 * kMiB, 64 * kMiB};
    if (runtime(spec).backend() == zt::Backend::kCuda) sizes.push_back(256 * kMiB);
    auto apply = [&](benchmark::internal::Benchmark* b) {
      b->ArgName("bytes")->UseRealTime();
      for (int64_t s : sizes) b->Arg(s);
    };
    apply(benchmark::RegisterBenchmark(("device_copy/" + spec).c_str(), BM_DeviceCopy, spec));
    apply(benchmark::RegisterBenchmark(("concurrent_copies/" + spec).c_str(), BM_ConcurrentCopies, spec));
    for (Collective c : {kReduceScatter, kAllGather, kAllReduce})
      apply(benchmark::RegisterBenchmark((std::string(kCollectiveNames[c]) + "/" + spec).c_str(), BM_Collective,
                                         spec, c));
  }
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  // busbw against the device copy of the same bytes (the target: >= 0.7 at >= 16 MiB).
  std::printf("\nbusbw / device copy (same bytes, same run):\n");
  for (const auto& [name, rate] : reporter.rates) {
    const size_t slash = name.find('/');
    const std::string kind = name.substr(0, slash);
    if (kind == "device_copy" || kind == "concurrent_copies") continue;
    const double copy = reporter.rate("device_copy" + name.substr(slash));
    if (copy <= 0) continue;
    std::printf("  %-48s busbw %8.2f GB/s  copy %8.2f GB/s  ratio %.2f\n", name.c_str(), rate / 1e9, copy / 1e9,
                rate / copy);
  }
  benchmark::Shutdown();
  return 0;
}
