// GPU copy bandwidth between logical devices: Stream::copy_peer by each route (device-to-device
// on one GPU, cudaMemcpyPeerAsync, staging through pinned host memory) and a plain on-device copy
// for reference. Uses GPUs 0 and 1 when there are two, else two logical devices on GPU 0.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "runtime/cuda/cuda_backend.h"

namespace {

// Copies queued per synchronize, so the figure is the streams' bandwidth, not the round trip.
constexpr int kBatch = 4;

// Created on first use and kept for the process (creating GPU contexts is slow); null when no
// usable GPU exists.
std::vector<std::unique_ptr<zt::Device>>* devices() {
  static auto* devs = [] {
    auto* v = new std::vector<std::unique_ptr<zt::Device>>();
    const zt::CudaAvailability a = zt::cuda::query_availability();
    if (a.usable) *v = zt::cuda::create_devices(a.device_count >= 2 ? std::vector<int>{0, 1}
                                                                     : std::vector<int>{0, 0});
    return v;
  }();
  return devs->empty() ? nullptr : devs;
}

void BM_CudaCopyPeer(benchmark::State& state, zt::cuda::PeerCopyPath path) {
  auto* devs = devices();
  if (devs == nullptr) {
    state.SkipWithError("no usable GPU");
    return;
  }
  zt::Device& src_dev = *(*devs)[0];
  zt::Device& dst_dev = *(*devs)[1];
  const size_t bytes = static_cast<size_t>(state.range(0));
  zt::Stream& s = src_dev.comm();
  zt::DeviceBuffer src(src_dev.memory(), bytes, s, "bench_src");
  zt::DeviceBuffer dst(dst_dev.memory(), bytes, dst_dev.compute(), "bench_dst");
  s.memset(src.data(), 1, bytes);
  zt::cuda::set_peer_copy_path(path);
  s.copy_peer(dst_dev, dst.data(), src.data(), bytes);  // warm-up (staging pool, peer mappings)
  s.synchronize();
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) s.copy_peer(dst_dev, dst.data(), src.data(), bytes);
    s.synchronize();
  }
  zt::cuda::set_peer_copy_path(zt::cuda::PeerCopyPath::kAuto);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kBatch *
                          static_cast<int64_t>(bytes));
  state.SetLabel(src_dev.name() + " -> " + dst_dev.name());
}

void BM_CudaCopyLocal(benchmark::State& state) {
  auto* devs = devices();
  if (devs == nullptr) {
    state.SkipWithError("no usable GPU");
    return;
  }
  zt::Device& dev = *(*devs)[0];
  const size_t bytes = static_cast<size_t>(state.range(0));
  zt::Stream& s = dev.compute();
  zt::DeviceBuffer src(dev.memory(), bytes, s, "bench_src");
  zt::DeviceBuffer dst(dev.memory(), bytes, s, "bench_dst");
  s.memset(src.data(), 1, bytes);
  s.synchronize();
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) s.copy(dst.data(), src.data(), bytes);
    s.synchronize();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kBatch *
                          static_cast<int64_t>(bytes));
  state.SetLabel(dev.name());
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int64_t mib : {1, 4, 16, 64, 256}) b->Arg(mib << 20);
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK_CAPTURE(BM_CudaCopyPeer, auto, zt::cuda::PeerCopyPath::kAuto)->Apply(sizes);
BENCHMARK_CAPTURE(BM_CudaCopyPeer, memcpy_peer, zt::cuda::PeerCopyPath::kPeer)->Apply(sizes);
BENCHMARK_CAPTURE(BM_CudaCopyPeer, staged, zt::cuda::PeerCopyPath::kStaged)->Apply(sizes);
BENCHMARK(BM_CudaCopyLocal)->Apply(sizes);

}  // namespace
