// The collectives a ZeRO engine's data parallelism needs, as per-rank calls, for an engine whose
// ranks are spread over several processes (ZeroOptions::processes): implemented by the MPI ring
// (train/processes.cc over comm/process_ring.h); one process uses its Communicator's groups directly.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "runtime/device.h"

namespace zt {

// Global ranks: world() of them, `local` (the engine's rank argument: this process's device index)
// being global_rank(local); the tensor axis lives inside a process (tensor_degree() T divides every
// process's device count), so global rank g has tensor coordinate g % T and data coordinate g / T,
// as the engine's mesh numbers them. Every call is a per-rank call: each local device's host thread
// calls with its own buffer, in the same order on every rank. The call either returns with the
// result in place and the device's comm stream idle (the MPI ring), or enqueues the collective on
// the device's comm stream after the producer's work and returns (NCCL, train/comm_engine.h); the
// engine orders every consumer after its comm stream either way, as after the in-process ring.
// reduce_scatter and all_gather run over the caller's data group (the global ranks of its tensor
// coordinate, by data coordinate; with T = 1 the world), all_reduce over every global rank; the MPI
// ring's results are bitwise those of the data group's CommGroup calls and Communicator::all_reduce
// on one process with world() devices (flat topology), or equal up to rounding (hierarchical:
// inside each process first); NCCL's only for all-gather and one rank. A lost or stalled peer
// throws zt::Error(kDevice) naming it.
class DataCollectives {
 public:
  virtual ~DataCollectives() = default;
  virtual int world() const = 0;
  virtual int global_rank(int local) const = 0;
  virtual int tensor_degree() const { return 1; }
  virtual void reduce_scatter(int local, TensorView full, Stream* producer) = 0;
  virtual void all_gather(int local, TensorView full, Stream* producer) = 0;
  virtual void all_reduce(int local, TensorView full, Stream* producer) = 0;
  // Traffic so far, for the run's summary: bytes local device `local` sent (every hop, inside the
  // process or not) and bytes this process sent to other processes.
  virtual uint64_t bytes_sent(int /*local*/) const { return 0; }
  virtual uint64_t bytes_sent_across() const { return 0; }
};

}  // namespace zt
