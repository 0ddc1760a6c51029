// The launch's processes: the launcher's environment, one process alone, and K > 1 over MPI's world
// ProcessGroup with the engine's collectives over ProcessRing (see processes.h). Without MPI in
// the build, K > 1 is refused.
#include "train/processes.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>

#include "comm/nccl_comm.h"
#include "core/status.h"
#include "train/comm_engine.h"
#include "train/state_io.h"

#if ZT_WITH_MPI
#include "comm/process_group.h"
#include "comm/process_ring.h"
#endif

namespace zt {

int launched_processes() {
  auto read = [](const char* name) {
    const char* v = std::getenv(name);
    return v && *v ? std::atoi(v) : 0;
  };
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
    if (read(name) >= 1) return read(name);
  // Slurm's PMIx plugin (srun --mpi=pmix) exports PMIX_RANK but not always a size; the step's task
  // count is Slurm's own. Only under a PMIx server (PMIX_RANK set): a plain srun without PMI starts
  // singletons that could not talk to each other.
  if (std::getenv("PMIX_RANK"))
    for (const char* name : {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"})
      if (read(name) >= 1) return read(name);
  return 1;
}

void refuse_under_processes(const TrainConfig& cfg) {
  const char* what = cfg.pipeline_parallel > 1                        ? "--pipeline-parallel"
                     : cfg.offload_optimizer                          ? "--offload optimizer"
                     : cfg.on_eval || !cfg.eval_steps.empty()         ? "a sweep"
                     : cfg.sample_every > 0                           ? "--sample-every"
                     : !cfg.trace_path.empty()                        ? "--trace"
                     : !cfg.inject_faults.empty()                     ? "--inject-fault"
                     : cfg.on_scale_collapse_bf16                     ? "--on-scale-collapse bf16"
                                                                      : nullptr;
  ZT_REQUIRE(!what, what, " is not supported when zerotrain runs as ", launched_processes(),
             " processes (mpirun/srun): a multi-process run is data and tensor parallelism, ZeRO stages 0-3");
}

void refuse_shared_nccl_gpus(const std::vector<std::vector<std::string>>& seats) {
  const auto gpu_of = [](const std::string& name) {
    const size_t at = name.find(", PCI ");
    return at == std::string::npos ? name : name.substr(at + 2, name.find(')', at) - at - 2);
  };
  struct Use {
    const std::string *host, *device;
    std::string gpu;
    size_t process;
  };
  std::vector<Use> used;
  for (size_t p = 0; p < seats.size(); ++p) {
    for (size_t i = 1; i < seats[p].size(); ++i) {
      const std::string& host = seats[p][0];
      const std::string& device = seats[p][i];
      const std::string gpu = gpu_of(device);
      for (const Use& u : used)
        ZT_REQUIRE(*u.host != host || u.gpu != gpu, "--comm nccl: processes ", u.process, " and ", p,
                   " both drive one GPU (", *u.device, " and ", device, ") on host ", host,
                   " (NCCL needs one rank per GPU); give each process its own GPUs, e.g. one process per node with "
                   "--devices all");
      used.push_back(Use{&host, &device, gpu, p});
    }
  }
}

#if ZT_WITH_MPI

namespace {

// The engine's data-group calls on the cross-process ring (its per-rank calls; the ring's flat
// order is the in-process Communicator's, so the bits are too; the hierarchical order is not).
class RingCollectives final : public DataCollectives {
 public:
  RingCollectives(ProcessGroup& group, std::vector<Device*> local, bool hierarchical)
      : ring_(group, std::move(local)), hierarchical_(hierarchical) {}
  int world() const override { return ring_.world(); }
  int global_rank(int local) const override { return ring_.global_rank(local); }
  void reduce_scatter(int local, TensorView full, Stream* producer) override {
    hierarchical_ ? ring_.hierarchical_reduce_scatter(local, full, producer) : ring_.reduce_scatter(local, full, producer);
  }
  void all_gather(int local, TensorView full, Stream* producer) override {
    hierarchical_ ? ring_.hierarchical_all_gather(local, full, producer) : ring_.all_gather(local, full, producer);
  }
  void all_reduce(int local, TensorView full, Stream* producer) override {
    hierarchical_ ? ring_.hierarchical_all_reduce(local, full, producer) : ring_.all_reduce(local, full, producer);
  }
  uint64_t bytes_sent(int local) const override { return ring_.counters(local).bytes_sent; }
  uint64_t bytes_sent_across() const override { return ring_.bytes_sent_across(); }

 private:
  ProcessRing ring_;
  bool hierarchical_;
};

// Tensor degree T > 1: the tensor axis inside the process, the data groups across processes. Local
// device i (global rank p * L + i) has tensor coordinate i % T; its data group is every process's
// devices of that coordinate, which ring t runs over: local devices {t, t + T, ...}, ring index
// p * (L / T) + i / T, which is the global rank's data coordinate, so the ring's order is the
// one-process data group's. Each ring has its own ProcessGroup (its own MPI communicator): the T
// rings run at once from different threads, and their messages must not match each other's. The
// overflow flag's all_reduce is over every rank: a ring over all local devices on the world group.
class TensorDataCollectives final : public DataCollectives {
 public:
  // The world ring carries only the overflow flags (one float per rank's shard): a chunk that
  // small is one chunk per shard, as the Communicator's default chunk is, so the bits are the
  // same, and it spares every device a second 1 MiB receive slot.
  static constexpr size_t kWorldChunkBytes = 4096;

  TensorDataCollectives(ProcessGroup& world_group, const std::vector<Device*>& local, int tensor, bool hierarchical)
      : tensor_(tensor), hierarchical_(hierarchical), world_(world_group, local, kWorldChunkBytes) {
    const int L = static_cast<int>(local.size());
    ZT_REQUIRE(tensor > 0 && L % tensor == 0, "--tensor-parallel ", tensor, " does not divide the ", L,
               " devices of each process (the tensor axis lives inside a process)");
    for (int t = 0; t < tensor; ++t) {  // the same order in every process: group construction is collective
      std::vector<Device*> members;
      for (int i = t; i < L; i += tensor) members.push_back(local[static_cast<size_t>(i)]);
      groups_.push_back(std::make_unique<ProcessGroup>(world_group.timeout()));
      rings_.push_back(std::make_unique<ProcessRing>(*groups_.back(), std::move(members)));
    }
  }
  int world() const override { return world_.world(); }
  int global_rank(int local) const override { return world_.global_rank(local); }
  int tensor_degree() const override { return tensor_; }
  void reduce_scatter(int local, TensorView full, Stream* producer) override {
    ProcessRing& ring = data_ring(local);
    hierarchical_ ? ring.hierarchical_reduce_scatter(local / tensor_, full, producer)
                  : ring.reduce_scatter(local / tensor_, full, producer);
  }
  void all_gather(int local, TensorView full, Stream* producer) override {
    ProcessRing& ring = data_ring(local);
    hierarchical_ ? ring.hierarchical_all_gather(local / tensor_, full, producer)
                  : ring.all_gather(local / tensor_, full, producer);
  }
  void all_reduce(int local, TensorView full, Stream* producer) override {
    ZT_CHECK(static_cast<size_t>(full.numel() / world()) * dtype_size(full.dtype) <= kWorldChunkBytes,
             "the cross-process world all_reduce is sized for the overflow flags, not ", full.numel(), " elements");
    world_.all_reduce(local, full, producer);
  }
  uint64_t bytes_sent(int local) const override {
    return rings_.at(static_cast<size_t>(local % tensor_))->counters(local / tensor_).bytes_sent +
           world_.counters(local).bytes_sent;
  }
  uint64_t bytes_sent_across() const override {
    uint64_t n = world_.bytes_sent_across();
    for (const auto& r : rings_) n += r->bytes_sent_across();
    return n;
  }

 private:
  ProcessRing& data_ring(int local) { return *rings_.at(static_cast<size_t>(local % tensor_)); }

  int tensor_;
  bool hierarchical_;
  ProcessRing world_;
  // Declared after their groups: each ring is destroyed before its group.
  std::vector<std::unique_ptr<ProcessGroup>> groups_;
  std::vector<std::unique_ptr<ProcessRing>> rings_;
};

}  // namespace

namespace {

// write_checkpoint's team over a process group of its own (MPI_COMM_WORLD duplicated): texts are
// sent as a length, then the bytes.
class ProcessTeam final : public CheckpointTeam {
 public:
  explicit ProcessTeam(std::chrono::milliseconds timeout) : group_(timeout) {}
  ~ProcessTeam() override {
    // Leaving while a peer may be gone (an error unwinds the run): a broken group is not freed,
    // since freeing it could wait for that peer.
    if (std::uncaught_exceptions() > 0) group_.abort("the run is ending with an error");
  }
  int process() const override { return group_.rank(); }
  std::vector<std::string> gather(const std::string& mine) override {
    if (group_.rank() != 0) {
      send_text(0, mine, kGatherTag);
      return {};
    }
    std::vector<std::string> all(static_cast<size_t>(group_.size()));
    all[0] = mine;
    for (int p = 1; p < group_.size(); ++p) all[static_cast<size_t>(p)] = recv_text(p, kGatherTag);
    return all;
  }
  std::string broadcast(const std::string& from_lead) override {
    if (group_.rank() != 0) return recv_text(0, kBroadcastTag);
    for (int p = 1; p < group_.size(); ++p) send_text(p, from_lead, kBroadcastTag);
    return from_lead;
  }
  std::vector<uint8_t> shift(const std::vector<uint8_t>& mine) override {
    const int K = group_.size(), next = (group_.rank() + 1) % K, prev = (group_.rank() + K - 1) % K;
    const uint64_t n = mine.size();
    uint64_t m = 0;
    group_.send_recv(next, &n, sizeof n, prev, &m, sizeof m, kShiftTag, "the replicated snapshot's size");
    std::vector<uint8_t> theirs(m);
    // Several messages when large (kMaxMessageBytes each); send_recv posts both halves first.
    for (uint64_t off = 0; off < std::max(n, m); off += ProcessGroup::kMaxMessageBytes) {
      const uint64_t sn = off < n ? std::min<uint64_t>(n - off, ProcessGroup::kMaxMessageBytes) : 0;
      const uint64_t rn = off < m ? std::min<uint64_t>(m - off, ProcessGroup::kMaxMessageBytes) : 0;
      if (sn > 0 && rn > 0)
        group_.send_recv(next, mine.data() + off, sn, prev, theirs.data() + off, rn, kShiftTag + 1,
                         "the replicated snapshot");
      else if (sn > 0)
        group_.send(next, mine.data() + off, sn, kShiftTag + 1, "the replicated snapshot");
      else
        group_.recv(prev, theirs.data() + off, rn, kShiftTag + 1, "the replicated snapshot");
    }
    return theirs;
  }

 private:
  static constexpr int kGatherTag = 1, kBroadcastTag = 3, kShiftTag = 5;  // the length; the bytes are tag + 1
  void send_text(int peer, const std::string& text, int tag) {
    const uint64_t n = text.size();
    group_.send(peer, &n, sizeof n, tag, "a checkpoint message's size");
    if (n > 0) group_.send(peer, text.data(), n, tag + 1, "a checkpoint message");
  }
  std::string recv_text(int peer, int tag) {
    uint64_t n = 0;
    group_.recv(peer, &n, sizeof n, tag, "the checkpoint's barrier (a process's part of the save)");
    std::string text(n, '\0');
    if (n > 0) group_.recv(peer, text.data(), n, tag + 1, "a checkpoint message");
    return text;
  }
  ProcessGroup group_;
};

// K > 1 processes over MPI's world group.
class MpiProcesses final : public Processes {
 public:
  explicit MpiProcesses(std::chrono::milliseconds timeout)
      : timeout_(timeout), group_(std::in_place, (mpi_init(), timeout)) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  std::unique_ptr<DataCollectives> connect(const std::vector<Device*>& local, int tensor, bool hierarchical) override;
  std::unique_ptr<DataCollectives> connect_nccl(const std::vector<Device*>& local) override;
  std::vector<double> all_gather(const std::vector<double>& mine, std::string_view what) override;
  std::unique_ptr<CheckpointTeam> checkpoint_team() override { return std::make_unique<ProcessTeam>(timeout_); }
  void own_part(HostSnapshot& snap, int local) const override {
    // The engine's world is every process's ranks; this process took its own (global ranks
    // p * L + i, in take_snapshot's slots 0..L-1).
    snap.shards.resize(static_cast<size_t>(local));
    snap.first_rank = rank() * local;
    snap.world_ranks = size() * local;
  }
  std::vector<std::string> settle(TrainConfig& cfg) const override {
    if (cfg.sample_tokens == 0) return {};
    // The sample's forward runs on one rank, which at stage 3 needs every process's gathers.
    cfg.sample_tokens = 0;
    return {"no final sample when running as several processes"};
  }
  std::string span() const override { return " over " + std::to_string(size()) + " processes"; }
  void finalize() override;

 private:
  std::chrono::milliseconds timeout_;
  std::optional<ProcessGroup> group_;  // reset by finalize, before MPI_Finalize
};

std::unique_ptr<DataCollectives> MpiProcesses::connect(const std::vector<Device*>& local, int tensor,
                                                       bool hierarchical) {
  if (tensor > 1) return std::make_unique<TensorDataCollectives>(*group_, local, tensor, hierarchical);
  return std::make_unique<RingCollectives>(*group_, local, hierarchical);
}

std::unique_ptr<DataCollectives> MpiProcesses::connect_nccl(const std::vector<Device*>& local) {
  // Every process's host and device names, so that two processes on one host driving one GPU are
  // refused here in one sentence rather than by NCCL's init (a duplicate-GPU error or a hang).
  constexpr size_t kSeat = 4096;  // a host name and 16 device names
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::string mine = std::string(host) + "\n";
  for (const Device* d : local) mine += d->name() + "\n";
  mine.resize(kSeat - 1, '\0');
  std::vector<char> all(kSeat * static_cast<size_t>(size()));
  std::vector<char> seat(mine.begin(), mine.end());
  seat.push_back('\0');
  group_->all_gather(seat.data(), all.data(), kSeat, "the NCCL clique's device list");
  std::vector<std::vector<std::string>> seats;
  for (int p = 0; p < size(); ++p) {
    const std::string list(all.data() + static_cast<size_t>(p) * kSeat);
    std::vector<std::string>& seat_p = seats.emplace_back();
    for (size_t at = 0, end; at < list.size() && (end = list.find('\n', at)) != std::string::npos; at = end + 1)
      seat_p.push_back(list.substr(at, end - at));
  }
  refuse_shared_nccl_gpus(seats);
  NcclClique clique;
  clique.world = size() * static_cast<int>(local.size());
  clique.first_rank = rank() * static_cast<int>(local.size());
  std::vector<uint8_t> id = rank() == 0 ? NcclComm::new_unique_id() : std::vector<uint8_t>{};
  const uint64_t id_bytes = group_->all_gather(uint64_t{id.size()}, "the NCCL id's size")[0];
  ZT_REQUIRE(id_bytes > 0, "process 0 could not make an NCCL unique id");
  id.resize(id_bytes);
  std::vector<uint8_t> ids(id_bytes * static_cast<size_t>(size()));
  group_->all_gather(id.data(), ids.data(), id_bytes, "the NCCL unique id");
  clique.id.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(id_bytes));  // process 0's
  return zt::connect_nccl(local, &clique);
}

std::vector<double> MpiProcesses::all_gather(const std::vector<double>& mine, std::string_view what) {
  std::vector<double> all(mine.size() * static_cast<size_t>(size()));
  group_->all_gather(mine.data(), all.data(), mine.size() * sizeof(double), what);
  return all;
}

void MpiProcesses::finalize() {
  group_.reset();
  mpi_finalize();
}

std::unique_ptr<Processes> join_mpi(std::chrono::milliseconds timeout) { return std::make_unique<MpiProcesses>(timeout); }

}  // namespace

#else

namespace {

std::unique_ptr<Processes> join_mpi(std::chrono::milliseconds) {
  throw Error(ErrorKind::kInvalidArgument, "this zerotrain was built without MPI, so it cannot run as " +
                                     std::to_string(launched_processes()) +
                                     " processes; install libopenmpi-dev (scripts/setup) and rebuild");
}

}  // namespace

#endif

namespace {

// K = 1: every exchange between processes is the identity.
class OneProcess final : public Processes {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::unique_ptr<DataCollectives> connect(const std::vector<Device*>&, int, bool) override { return nullptr; }
  std::unique_ptr<DataCollectives> connect_nccl(const std::vector<Device*>& local) override {
    return zt::connect_nccl(local);
  }
  std::vector<double> all_gather(const std::vector<double>& mine, std::string_view) override { return mine; }
  std::unique_ptr<CheckpointTeam> checkpoint_team() override { return nullptr; }
  void own_part(HostSnapshot&, int) const override {}
  std::vector<std::string> settle(TrainConfig& cfg) const override {
    if (cfg.comm_topology != CommTopology::kHierarchical) return {};
    return {"--comm-topology hierarchical changes nothing in one process (every collective stays inside it); it "
            "applies under mpirun/srun"};
  }
  std::string span() const override { return ""; }
  void finalize() override {}
};

}  // namespace

Processes& Processes::alone() {
  static OneProcess one;
  return one;
}

std::unique_ptr<Processes> Processes::join(const TrainConfig& cfg) {
  if (launched_processes() == 1) return std::make_unique<OneProcess>();
  refuse_under_processes(cfg);
  return join_mpi(std::chrono::milliseconds(static_cast<int64_t>(cfg.comm_timeout_s * 1000)));
}

}  // namespace zt
