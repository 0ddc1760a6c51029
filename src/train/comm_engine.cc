// --comm: the pre-device check and the NCCL data collectives (see comm_engine.h).
#include "train/comm_engine.h"

#include <set>
#include <string>

#include "comm/nccl_comm.h"
#include "core/status.h"
#include "runtime/runtime.h"

namespace zt {

void check_comm_engine(const TrainConfig& cfg, Backend backend, int devices) {
  if (cfg.comm != CommEngine::kNccl) return;
  const DeviceSpec spec = parse_device_spec(cfg.devices);
  if (backend != Backend::kCuda) {
    // An explicit CUDA selection without a usable GPU: Runtime::create refuses it in its own words.
    if (spec.kind == DeviceSpec::Kind::kCuda) return;
    const std::string uses = cfg.devices.rfind("cpu", 0) == 0
                                 ? cfg.devices
                                 : "cpu:" + std::to_string(devices) + " (--devices " + cfg.devices + " without a usable GPU)";
    ZT_THROW(ErrorKind::kInvalidArgument, "--comm nccl needs CUDA devices; this run uses ", uses);
  }
  ZT_REQUIRE(nccl_built(), "--comm nccl needs a CUDA build with NCCL; this zerotrain was built without it (use --comm ring)");
  const std::set<int> gpus(spec.cuda_ordinals.begin(), spec.cuda_ordinals.end());
  ZT_REQUIRE(gpus.size() == spec.cuda_ordinals.size(), "--comm nccl needs one GPU per device (NCCL cannot put two ranks "
             "on one GPU); --devices ", cfg.devices, " shares a GPU, so use --comm ring with it");
  ZT_REQUIRE(cfg.comm_topology == CommTopology::kFlat, "--comm nccl picks its own algorithms inside and across "
             "nodes; --comm-topology hierarchical applies to --comm ring");
  const char* ring_only = cfg.tensor_parallel > 1     ? "--tensor-parallel"
                          : cfg.pipeline_parallel > 1 ? "--pipeline-parallel"
                          : cfg.offload_optimizer     ? "--offload optimizer"
                          : cfg.snapshot_every > 0    ? "--snapshot-every"
                          : !cfg.inject_faults.empty() ? "--inject-fault"
                                                      : nullptr;
  ZT_REQUIRE(!ring_only, "--comm nccl runs the data-parallel collectives only and ", ring_only,
             " is built on the ring, so use --comm ring with it");
}

namespace {

// The engine's per-rank data-group calls, enqueued on the comm streams (the engine orders every
// consumer after its comm stream, as after the in-process ring).
class NcclDataCollectives final : public DataCollectives {
 public:
  NcclDataCollectives(const std::vector<Device*>& local, const NcclClique* clique) : comm_(local, clique) {}
  int world() const override { return comm_.world(); }
  int global_rank(int local) const override { return comm_.global_rank(local); }
  void reduce_scatter(int local, TensorView full, Stream* producer) override {
    comm_.reduce_scatter(local, full, producer);
  }
  void all_gather(int local, TensorView full, Stream* producer) override { comm_.all_gather(local, full, producer); }
  void all_reduce(int local, TensorView full, Stream* producer) override { comm_.all_reduce(local, full, producer); }

 private:
  NcclComm comm_;
};

}  // namespace

std::unique_ptr<DataCollectives> connect_nccl(const std::vector<Device*>& local, const NcclClique* clique) {
  return std::make_unique<NcclDataCollectives>(local, clique);
}

}  // namespace zt
