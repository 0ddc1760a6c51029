// Multi-process runs: the launcher's environment, the world ProcessGroup and the engine's
// collectives over ProcessRing (see processes.h). Without MPI in the build, only the refusal.
#include "train/processes.h"

#include <cstdlib>
#include <string>

#include "core/status.h"

#if ZT_WITH_MPI
#include "comm/process_group.h"
#include "comm/process_ring.h"
#endif

namespace zt {

int launched_processes() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* v = std::getenv(name);
    if (v && *v) {
      const int n = std::atoi(v);
      if (n >= 1) return n;
    }
  }
  return 1;
}

void refuse_under_processes(const TrainConfig& cfg) {
  const char* what = cfg.tensor_parallel > 1                          ? "--tensor-parallel"
                     : cfg.pipeline_parallel > 1                      ? "--pipeline-parallel"
                     : cfg.offload_optimizer                          ? "--offload optimizer"
                     : cfg.on_eval || !cfg.eval_steps.empty()         ? "a sweep"
                     : cfg.sample_every > 0                           ? "--sample-every"
                     : !cfg.trace_path.empty()                        ? "--trace"
                     : !cfg.inject_faults.empty()                     ? "--inject-fault"
                     : cfg.on_scale_collapse_bf16                     ? "--on-scale-collapse bf16"
                                                                      : nullptr;
  ZT_REQUIRE(!what, what, " is not supported when zerotrain runs as ", launched_processes(),
             " processes (mpirun/srun): a multi-process run is data parallelism only, ZeRO stages 0-3");
}

#if ZT_WITH_MPI

namespace {

// The engine's data-group calls on the cross-process ring (its per-rank calls; the ring's flat
// order is the in-process Communicator's, so the bits are too).
class RingCollectives final : public DataCollectives {
 public:
  RingCollectives(ProcessGroup& group, std::vector<Device*> local) : ring_(group, std::move(local)) {}
  int world() const override { return ring_.world(); }
  int global_rank(int local) const override { return ring_.global_rank(local); }
  void reduce_scatter(int local, TensorView full, Stream* producer) override {
    ring_.reduce_scatter(local, full, producer);
  }
  void all_gather(int local, TensorView full, Stream* producer) override { ring_.all_gather(local, full, producer); }
  void all_reduce(int local, TensorView full, Stream* producer) override { ring_.all_reduce(local, full, producer); }

 private:
  ProcessRing ring_;
};

}  // namespace

struct Processes::Impl {
  explicit Impl(std::chrono::milliseconds timeout) : group((mpi_init(), timeout)) {}
  ProcessGroup group;
};

Processes::Processes(std::chrono::milliseconds timeout) : impl_(std::make_unique<Impl>(timeout)) {}
Processes::~Processes() = default;
int Processes::rank() const { return impl_->group.rank(); }
int Processes::size() const { return impl_->group.size(); }

std::unique_ptr<DataCollectives> Processes::connect(const std::vector<Device*>& local) {
  return std::make_unique<RingCollectives>(impl_->group, local);
}

std::vector<double> Processes::all_gather(const std::vector<double>& mine, std::string_view what) {
  std::vector<double> all(mine.size() * static_cast<size_t>(size()));
  impl_->group.all_gather(mine.data(), all.data(), mine.size() * sizeof(double), what);
  return all;
}

void Processes::finalize() {
  impl_.reset();
  mpi_finalize();
}

#else

struct Processes::Impl {};

Processes::Processes(std::chrono::milliseconds) {
  throw Error(ErrorKind::kInvalidArgument, "this zerotrain was built without MPI, so it cannot run as " +
                                     std::to_string(launched_processes()) +
                                     " processes; install libopenmpi-dev (scripts/setup) and rebuild");
}
Processes::~Processes() = default;
int Processes::rank() const { return 0; }
int Processes::size() const { return 1; }
std::unique_ptr<DataCollectives> Processes::connect(const std::vector<Device*>&) { return nullptr; }
std::vector<double> Processes::all_gather(const std::vector<double>& mine, std::string_view) { return mine; }
void Processes::finalize() {}

#endif

}  // namespace zt
