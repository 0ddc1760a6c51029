// NCCL collectives over CUDA devices (--comm nccl): one NCCL communicator per device of a group,
// created together, running on each device's comm stream. This header includes no CUDA or NCCL
// header; nccl_comm.cc is built in every CUDA build that found NCCL, a stub elsewhere.
//
// Design notes:
//  - Per-rank calls follow NCCL's one-thread-per-rank model: each device's host thread calls with
//    its own buffer, every rank issuing the same collectives in the same order (as Communicator's
//    per-rank calls). A call enqueues on the device's comm stream, after the work submitted to its
//    producer so far, and returns without waiting: consumers order themselves after the comm
//    stream (record an event on it and wait), exactly as after Communicator's calls.
//  - Buffers follow Communicator's convention (a full buffer of world * shard elements, rank r's
//    shard at r * shard), in place; NCCL's in-place forms of reduce-scatter and all-gather are
//    exactly that layout, so no copy is added.
//  - Results are not bitwise those of the ring (NCCL picks its own summation order and protocol)
//    except for one rank and for all-gather, which only moves bytes.
//  - NCCL cannot put two ranks on one GPU: logical devices sharing a GPU (cuda:0x4) are refused.
//  - After a failed NCCL call, or with a comm stream still busy at destruction (a rank that threw
//    before its call leaves its peers' collectives waiting on their GPUs), the destructor aborts the
//    NCCL communicators (ncclCommAbort) instead of finalising them, which would wait forever.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "runtime/device.h"

namespace zt {

// Whether this binary was built with NCCL (a CUDA build that found nccl.h and libnccl).
bool nccl_built();
// The NCCL library's version as it reports itself at run time ("2.28.9"); "" without NCCL.
std::string nccl_version();

// The ranks of one NCCL clique across processes: `world` ranks in all, this process's devices being
// ranks first_rank .. first_rank + local - 1, `id` the ncclUniqueId bytes that the process owning
// rank 0 made with NcclComm::new_unique_id() and sent to every other process.
struct NcclClique {
  int world = 0;
  int first_rank = 0;
  std::vector<uint8_t> id;
};

class NcclComm {
 public:
  // One NCCL rank per device, all created in one group call. Without `clique` the devices are the
  // whole world (ranks 0..n-1). Throws zt::Error(kInvalidArgument) for a device that is not a CUDA
  // device or two devices on one GPU, zt::Error(kDevice) when NCCL fails, and, in a build without
  // NCCL, zt::Error(kInvalidArgument) saying so.
  explicit NcclComm(const std::vector<Device*>& devices, const NcclClique* clique = nullptr);
  // Finalises the NCCL communicators; the devices must outlive this and should be synchronized.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // A fresh ncclUniqueId's bytes, for NcclClique::id.
  static std::vector<uint8_t> new_unique_id();

  int world() const;       // ranks in the clique (every process's)
  int local_size() const;  // this process's devices
  int global_rank(int local) const;

  // Per-rank calls (see the header comment): `local` is the caller's index among the devices given
  // to the constructor; `full` lives on that device, f32/f16/bf16, world() * shard elements.
  // reduce_scatter: the sum over ranks of shard r lands in full[r*shard, (r+1)*shard) of rank r.
  void reduce_scatter(int local, TensorView full, Stream* producer);
  // all_gather: shard r of every rank's full buffer -> every rank's full buffer.
  void all_gather(int local, TensorView full, Stream* producer);
  // all_reduce: every rank's full buffer ends with the elementwise sum (any numel).
  void all_reduce(int local, TensorView full, Stream* producer);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt
