// NcclComm (see nccl_comm.h): NCCL communicators on the CUDA devices' comm streams, or, in a build
// without NCCL, a stub whose constructor refuses with one sentence. With NCCL this is the one file
// outside runtime/cuda and kernels/cuda that includes CUDA headers (nccl.h needs cuda_runtime.h).
#include "comm/nccl_comm.h"

#include <atomic>
#include <cstring>
#include <string>
#include <utility>

#include "core/status.h"

#if ZT_WITH_NCCL
#include <nccl.h>

#include "runtime/cuda/cuda_check.h"
#endif

namespace zt {

#if ZT_WITH_NCCL

bool nccl_built() { return true; }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    default:
      ZT_THROW(ErrorKind::kInvalidArgument, "NCCL collectives take f32, f16 or bf16 buffers, not ", dtype_name(t));
  }
}

}  // namespace

struct NcclComm::Impl {
  struct Rank {
    Device* device = nullptr;
    int ordinal = -1;  // the physical GPU
    ncclComm_t comm = nullptr;
    std::unique_ptr<Event> ready;  // the producer's work so far, for the comm stream to wait on
  };
  std::vector<Rank> ranks;
  int world = 0;
  int first_rank = 0;
  std::atomic<bool> failed{false};  // set by any rank's thread

  // Throws zt::Error(kDevice) naming the call and NCCL's words, and marks the communicator failed.
  void check(ncclResult_t res, const char* call, ncclComm_t comm, int local) {
    if (res == ncclSuccess) [[likely]]
      return;
    failed = true;
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    ZT_THROW(ErrorKind::kDevice, "NCCL call ", call, " failed on rank ", first_rank + local, " (device ",
             ranks[static_cast<size_t>(local)].device->name(), "): ", ncclGetErrorString(res),
             last && *last ? std::string(" (") + last + ")" : std::string());
  }

  // The rank's comm stream after the producer's work so far, as the cudaStream_t NCCL takes.
  cudaStream_t stream_after(int local, Stream* producer) {
    ZT_REQUIRE(local >= 0 && local < static_cast<int>(ranks.size()), "NCCL rank ", local, " is not one of the ",
               ranks.size(), " local devices");
    Rank& r = ranks[static_cast<size_t>(local)];
    Stream& s = r.device->comm();
    if (producer && producer != &s) {
      producer->record(*r.ready);
      s.wait(*r.ready);
    }
    return static_cast<cudaStream_t>(s.native_handle());
  }

  void require_buffer(int local, const TensorView& full, bool sharded) const {
    const Rank& r = ranks[static_cast<size_t>(local)];
    ZT_REQUIRE(full.device == r.device->index(), "an NCCL collective of rank ", first_rank + local,
               " got a buffer of device ", full.device, ", not of its device ", r.device->index());
    ZT_REQUIRE(!sharded || full.numel() % world == 0, "an NCCL reduce-scatter or all-gather needs a multiple of the ",
               world, " ranks in elements (got ", full.numel(), "); pad the buffer");
  }

  // What an in-place reduce-scatter or all-gather of rank `local` needs: its stream (after the
  // producer), its communicator, the shard's elements and where its own shard starts in `full`.
  struct ShardCall {
    cudaStream_t stream;
    ncclComm_t comm;
    size_t shard;
    char* mine;
  };
  ShardCall shard_call(int local, const TensorView& full, Stream* producer) {
    const cudaStream_t s = stream_after(local, producer);
    require_buffer(local, full, true);
    const size_t shard = static_cast<size_t>(full.numel() / world);
    char* mine = static_cast<char*>(full.data) + static_cast<size_t>(first_rank + local) * shard * dtype_size(full.dtype);
    return {s, ranks[static_cast<size_t>(local)].comm, shard, mine};
  }
};

#define ZT_NCCL_CALL(impl, local, comm, call) (impl).check((call), #call, (comm), (local))

NcclComm::NcclComm(const std::vector<Device*>& devices, const NcclClique* clique) : impl_(std::make_unique<Impl>()) {
  ZT_REQUIRE(!devices.empty(), "an NCCL communicator needs at least one device");
  Impl& m = *impl_;
  for (Device* d : devices) {
    ZT_REQUIRE(d->backend() == Backend::kCuda, "--comm nccl needs CUDA devices; ", d->name(), " is not one");
    Impl::Rank r;
    r.device = d;
    ZT_CUDA_CHECK(cudaStreamGetDevice(static_cast<cudaStream_t>(d->comm().native_handle()), &r.ordinal));
    for (const Impl::Rank& other : m.ranks)
      ZT_REQUIRE(other.ordinal != r.ordinal, "--comm nccl needs one GPU per device (NCCL cannot put two ranks on one "
                 "GPU); devices ", other.device->name(), " and ", d->name(), " share GPU ", r.ordinal);
    r.ready = d->create_event();
    m.ranks.push_back(std::move(r));
  }
  const int local = static_cast<int>(m.ranks.size());
  ncclUniqueId id;
  if (clique) {
    ZT_REQUIRE(clique->id.size() == sizeof(id), "an NCCL unique id has ", sizeof(id), " bytes, not ", clique->id.size());
    ZT_REQUIRE(clique->first_rank >= 0 && clique->first_rank + local <= clique->world, "ranks ", clique->first_rank,
               "..", clique->first_rank + local - 1, " do not fit an NCCL clique of ", clique->world);
    std::memcpy(&id, clique->id.data(), sizeof(id));
    m.world = clique->world;
    m.first_rank = clique->first_rank;
  } else {
    ZT_NCCL_CALL(m, 0, nullptr, ncclGetUniqueId(&id));
    m.world = local;
  }
  // Every local rank in one group call (NCCL's rule for one thread initialising several ranks).
  ZT_NCCL_CALL(m, 0, nullptr, ncclGroupStart());
  ncclResult_t init = ncclSuccess;
  for (int i = 0; i < local && init == ncclSuccess; ++i) {
    const cuda::DeviceGuard guard(m.ranks[static_cast<size_t>(i)].ordinal);  // InitRank binds the current GPU
    init = ncclCommInitRank(&m.ranks[static_cast<size_t>(i)].comm, m.world, id, m.first_rank + i);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (init != ncclSuccess || end != ncclSuccess) {
    // The destructor does not run for a constructor that throws: abort what was created here.
    for (Impl::Rank& r : m.ranks)
      if (r.comm) {
        (void)ncclCommAbort(r.comm);
        r.comm = nullptr;
      }
    ZT_NCCL_CALL(m, 0, nullptr, init != ncclSuccess ? init : end);
  }
}

NcclComm::~NcclComm() {
  // Never throws. After a failure (an NCCL error, or a rank that threw before making its call, so
  // that a peer's collective still waits on its GPU: a comm stream not idle) a peer may never
  // arrive, and finalising (which waits for outstanding work) would wait forever: abort then.
  // NCCL selects each communicator's GPU itself, so no device guard is needed here.
  bool abort = impl_->failed;
  for (Impl::Rank& r : impl_->ranks) {
    try {
      abort = abort || !r.device->comm().query();
    } catch (...) {
      abort = true;  // a failed device
    }
  }
  if (abort) {
    for (Impl::Rank& r : impl_->ranks)
      if (r.comm) (void)ncclCommAbort(r.comm);
    return;
  }
  // Finalising waits for every rank of the clique to finalise too: this thread's ranks in one group
  // call (NCCL's own example), or the first would wait for the others forever; then free them.
  if (ncclGroupStart() == ncclSuccess) {
    for (Impl::Rank& r : impl_->ranks)
      if (r.comm) (void)ncclCommFinalize(r.comm);
    (void)ncclGroupEnd();
  }
  for (Impl::Rank& r : impl_->ranks)
    if (r.comm) (void)ncclCommDestroy(r.comm);
}

std::vector<uint8_t> NcclComm::new_unique_id() {
  ncclUniqueId id;
  const ncclResult_t res = ncclGetUniqueId(&id);
  if (res != ncclSuccess) ZT_THROW(ErrorKind::kDevice, "ncclGetUniqueId failed: ", ncclGetErrorString(res));
  std::vector<uint8_t> out(sizeof(id));
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

int NcclComm::world() const { return impl_->world; }
int NcclComm::local_size() const { return static_cast<int>(impl_->ranks.size()); }
int NcclComm::global_rank(int local) const { return impl_->first_rank + local; }

void NcclComm::reduce_scatter(int local, TensorView full, Stream* producer) {
  Impl& m = *impl_;
  const Impl::ShardCall k = m.shard_call(local, full, producer);
  if (k.shard == 0) return;
  ZT_NCCL_CALL(m, local, k.comm,
               ncclReduceScatter(full.data, k.mine, k.shard, nccl_type(full.dtype), ncclSum, k.comm, k.stream));
}

void NcclComm::all_gather(int local, TensorView full, Stream* producer) {
  Impl& m = *impl_;
  const Impl::ShardCall k = m.shard_call(local, full, producer);
  if (k.shard == 0) return;
  ZT_NCCL_CALL(m, local, k.comm, ncclAllGather(k.mine, full.data, k.shard, nccl_type(full.dtype), k.comm, k.stream));
}

void NcclComm::all_reduce(int local, TensorView full, Stream* producer) {
  Impl& m = *impl_;
  const cudaStream_t s = m.stream_after(local, producer);
  m.require_buffer(local, full, false);
  if (full.numel() == 0) return;
  const ncclComm_t c = m.ranks[static_cast<size_t>(local)].comm;
  ZT_NCCL_CALL(m, local, c,
               ncclAllReduce(full.data, full.data, static_cast<size_t>(full.numel()), nccl_type(full.dtype), ncclSum,
                             c, s));
}

#else  // !ZT_WITH_NCCL

bool nccl_built() { return false; }
std::string nccl_version() { return ""; }

struct NcclComm::Impl {};

NcclComm::NcclComm(const std::vector<Device*>&, const NcclClique*) {
  ZT_THROW(ErrorKind::kInvalidArgument,
           "--comm nccl needs a CUDA build with NCCL; this zerotrain was built without it (use --comm ring)");
}
NcclComm::~NcclComm() = default;
std::vector<uint8_t> NcclComm::new_unique_id() {
  ZT_THROW(ErrorKind::kInvalidArgument, "this zerotrain was built without NCCL");
}
int NcclComm::world() const { return 0; }
int NcclComm::local_size() const { return 0; }
int NcclComm::global_rank(int local) const { return local; }
void NcclComm::reduce_scatter(int, TensorView, Stream*) { ZT_THROW(ErrorKind::kInternal, "no NCCL in this build"); }
void NcclComm::all_gather(int, TensorView, Stream*) { ZT_THROW(ErrorKind::kInternal, "no NCCL in this build"); }
void NcclComm::all_reduce(int, TensorView, Stream*) { ZT_THROW(ErrorKind::kInternal, "no NCCL in this build"); }

#endif

}  // namespace zt
