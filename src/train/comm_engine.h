// --comm ring|nccl: the check that refuses what NCCL does not run before any device exists, and
// the ZeRO engine's data collectives over NCCL (comm/nccl_comm.h) for a run in one process.
#pragma once

#include <memory>
#include <vector>

#include "comm/nccl_comm.h"
#include "runtime/backend.h"
#include "runtime/device.h"
#include "train/trainer.h"
#include "zero/data_collectives.h"

namespace zt {

// Throws zt::Error(kInvalidArgument), one sentence, when cfg.comm is kNccl and the run cannot use
// it: a build without NCCL, CPU devices (`devices` of them), logical devices sharing a GPU,
// --comm-topology hierarchical, or a flag whose collectives or recovery are built on the ring only.
void check_comm_engine(const TrainConfig& cfg, Backend backend, int devices);

// One NCCL communicator over `local` (this process's CUDA devices) as the engine's
// ZeroOptions::processes: the whole data group, or with `clique` (several processes,
// Processes::connect_nccl) its ranks clique->first_rank.. of clique->world. Destroy it before the
// devices.
std::unique_ptr<DataCollectives> connect_nccl(const std::vector<Device*>& local, const NcclClique* clique = nullptr);

}  // namespace zt
