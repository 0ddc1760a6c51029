// The collectives a ZeRO engine's data parallelism needs, as per-rank calls, for an engine whose
// ranks are spread over several processes (ZeroOptions::processes): implemented by the MPI ring
// (train/processes.cc over comm/process_ring.h); one process uses its Communicator's groups directly.
#pragma once

#include "core/tensor.h"
#include "runtime/device.h"

namespace zt {

// Global ranks: world() of them, `local` (the engine's rank argument: this process's device index)
// being global_rank(local). Every call is a per-rank call over every global rank (tensor degree 1:
// the data group is the world): each local device's host thread calls with its own buffer, in the
// same order on every rank. The call either returns with the result in place and the device's comm
// stream idle (the MPI ring), or enqueues the collective on the device's comm stream after the
// producer's work and returns (NCCL, train/comm_engine.h); the engine orders every consumer after
// its comm stream either way, as after the in-process ring. The MPI ring's results are bitwise those
// of Communicator::reduce_scatter / all_gather / all_reduce on one process with world() devices
// (NCCL's only for all-gather and one rank). A lost or stalled peer throws zt::Error(kDevice) naming it.
class DataCollectives {
 public:
  virtual ~DataCollectives() = default;
  virtual int world() const = 0;
  virtual int global_rank(int local) const = 0;
  virtual void reduce_scatter(int local, TensorView full, Stream* producer) = 0;
  virtual void all_gather(int local, TensorView full, Stream* producer) = 0;
  virtual void all_reduce(int local, TensorView full, Stream* producer) = 0;
};

}  // namespace zt
