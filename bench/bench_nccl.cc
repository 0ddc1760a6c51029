// Our ring collectives (zt::Communicator over peer copies) against NCCL on the same GPUs: every GPU
// as one rank (cuda:0,1,...), fp32 buffers of 1-256 MiB per rank, in place, one collective per
// synchronize. NCCL is the reference here and nowhere else (it cannot put two ranks on one GPU,
// so with fewer than 2 GPUs every benchmark is skipped). Convention as nccl-tests: algbw = buffer
// bytes per rank / time; busbw = algbw * 2(N-1)/N for all_reduce, (N-1)/N for reduce_scatter and
// all_gather. bytes_per_second (SetBytesProcessed) is busbw; busbw and algbw counters beside it.
// The NCCL rows make the in-place calls that --comm nccl makes (comm/nccl_comm.h), from one thread
// as one group call here, from one thread per rank in training; so they are that path's ceiling.
#include <benchmark/benchmark.h>
#include <nccl.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

#define ZT_NCCL_CHECK(call)                                                            \
  do {                                                                                 \
    const ncclResult_t zt_nccl_res_ = (call);                                          \
    if (zt_nccl_res_ != ncclSuccess)                                                   \
      ZT_THROW(::zt::ErrorKind::kDevice, "NCCL call " #call " failed: ",               \
               ncclGetErrorString(zt_nccl_res_));                                      \
  } while (0)

namespace {

enum class Collective { kReduceScatter, kAllGather, kAllReduce };
enum class Impl { kZt, kNccl };

// Every GPU as one rank, our communicator and NCCL's over them; created on first use and kept for
// the process (contexts and NCCL communicators are slow to create, and tearing them down from
// static destructors races the CUDA runtime's own teardown).
struct World {
  std::unique_ptr<zt::Runtime> rt;
  std::vector<zt::Device*> devices;
  std::unique_ptr<zt::Communicator> comm;
  std::vector<ncclComm_t> nccl;
  std::string skip;  // non-empty: why every benchmark is skipped
};

World& world() {
  static World* w = [] {
    auto* w = new World();
    try {
      const zt::CudaAvailability a = zt::cuda_availability();
      if (!a.usable || a.device_count < 2) {
        w->skip = "NCCL reference needs 2 or more GPUs (found " +
                  std::to_string(a.usable ? a.device_count : 0) +
                  (a.usable ? std::string(")") : "; " + a.reason + ")");
        return w;
      }
      w->rt = zt::Runtime::create(zt::parse_device_spec("cuda"));  // one logical device per GPU
      std::vector<int> ordinals;
      for (int r = 0; r < w->rt->size(); ++r) {
        w->devices.push_back(&w->rt->device(r));
        ordinals.push_back(r);  // "cuda" maps logical device r onto GPU r
      }
      w->comm = std::make_unique<zt::Communicator>(w->devices);
      w->nccl.resize(ordinals.size());
      ZT_NCCL_CHECK(ncclCommInitAll(w->nccl.data(), static_cast<int>(ordinals.size()),
                                    ordinals.data()));
    } catch (const std::exception& e) {
      w->skip = std::string("setup failed: ") + e.what();
    }
    return w;
  }();
  return *w;
}

// One NCCL collective for every rank (a group call from this one thread), in place with our
// buffer convention: rank r's shard is full[r][r*shard .. (r+1)*shard).
void nccl_collective(World& w, Collective kind, const std::vector<zt::TensorView>& full) {
  const size_t world_size = full.size();
  ZT_NCCL_CHECK(ncclGroupStart());
  for (size_t r = 0; r < world_size; ++r) {
    auto* data = static_cast<float*>(full[r].data);
    const size_t numel = static_cast<size_t>(full[r].numel());
    const size_t shard = numel / world_size;
    auto stream = static_cast<cudaStream_t>(w.devices[r]->comm().native_handle());
    switch (kind) {
      case Collective::kReduceScatter:
        ZT_NCCL_CHECK(ncclReduceScatter(data, data + r * shard, shard, ncclFloat, ncclSum,
                                        w.nccl[r], stream));
        break;
      case Collective::kAllGather:
        ZT_NCCL_CHECK(ncclAllGather(data + r * shard, data, shard, ncclFloat, w.nccl[r], stream));
        break;
      case Collective::kAllReduce:
        ZT_NCCL_CHECK(ncclAllReduce(data, data, numel, ncclFloat, ncclSum, w.nccl[r], stream));
        break;
    }
  }
  ZT_NCCL_CHECK(ncclGroupEnd());
}

void zt_collective(World& w, Collective kind, const std::vector<zt::TensorView>& full) {
  switch (kind) {
    case Collective::kReduceScatter:
      w.comm->reduce_scatter(full, {});
      break;
    case Collective::kAllGather:
      w.comm->all_gather(full, {});
      break;
    case Collective::kAllReduce:
      w.comm->all_reduce(full, {});
      break;
  }
}

// One collective over fp32 buffers of range(0) bytes per rank, synchronized every iteration (so
// the time includes the pipeline's fill and drain, as nccl-tests' does).
void BM_Collective(benchmark::State& state, Collective kind, Impl impl) {
  World& w = world();
  if (!w.skip.empty()) {
    state.SkipWithError(w.skip.c_str());
    return;
  }
  const int world_size = static_cast<int>(w.devices.size());
  const size_t bytes = static_cast<size_t>(state.range(0));
  const int64_t numel = static_cast<int64_t>(bytes / sizeof(float)) / world_size * world_size;
  std::vector<zt::DeviceBuffer> mem;
  std::vector<zt::TensorView> views;
  mem.reserve(w.devices.size());
  for (zt::Device* d : w.devices) {
    mem.emplace_back(d->memory(), static_cast<size_t>(numel) * sizeof(float), d->comm(), "bench");
    d->comm().memset(mem.back().data(), 0, mem.back().size());
    views.push_back(
        zt::TensorView{mem.back().data(), zt::DType::kF32, zt::Shape{numel}, d->index()});
  }
  auto run = [&] {
    if (impl == Impl::kZt)
      zt_collective(w, kind, views);
    else
      nccl_collective(w, kind, views);
    w.rt->synchronize();
  };
  try {
    run();  // receive buffers allocated, NCCL's connections set up
    for (auto _ : state) run();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const double data = static_cast<double>(numel) * sizeof(float);
  const double factor =
      (kind == Collective::kAllReduce ? 2.0 : 1.0) * (world_size - 1) / world_size;
  const double iterations = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(data * factor * iterations));
  state.counters["busbw"] = benchmark::Counter(data * factor * iterations,
                                               benchmark::Counter::kIsRate,
                                               benchmark::Counter::OneK::kIs1024);
  state.counters["algbw"] = benchmark::Counter(data * iterations, benchmark::Counter::kIsRate,
                                               benchmark::Counter::OneK::kIs1024);
  state.counters["ranks"] = world_size;
  state.SetLabel(impl == Impl::kZt ? "zt ring" : "nccl " + std::to_string(NCCL_MAJOR) + "." +
                                                     std::to_string(NCCL_MINOR));
}

constexpr int64_t kMiB = int64_t{1} << 20;

// Per collective and size, ours then NCCL's, so the two rows sit side by side.
const int kRegistered = [] {
  const std::pair<const char*, Collective> collectives[] = {
      {"reduce_scatter", Collective::kReduceScatter},
      {"all_gather", Collective::kAllGather},
      {"all_reduce", Collective::kAllReduce}};
  for (const auto& [name, kind] : collectives)
    for (int64_t bytes : {1 * kMiB, 4 * kMiB, 16 * kMiB, 64 * kMiB, 256 * kMiB})
      for (Impl impl : {Impl::kZt, Impl::kNccl}) {
        const std::string full =
            std::string("BM_Collective/") + name + (impl == Impl::kZt ? "/zt" : "/nccl");
        benchmark::RegisterBenchmark(full.c_str(), BM_Collective, kind, impl)
            ->ArgName("bytes")
            ->Arg(bytes)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
  return 0;
}();

}  // namespace
