// Multi-process runs (`mpirun -np K zerotrain train ...`): detecting the launcher, MPI's world of
// processes, and the ZeRO engine's data-group collectives over every process's devices.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/device.h"
#include "train/trainer.h"
#include "zero/data_collectives.h"

namespace zt {

class CheckpointTeam;
struct HostSnapshot;

// The number of processes the launcher started, from its environment: OMPI_COMM_WORLD_SIZE
// (OpenMPI's mpirun), else PMI_SIZE (MPICH/Hydra, Slurm's PMI-2), else PMIX_SIZE, else, when
// PMIX_RANK says a PMIx server started us (srun --mpi=pmix), SLURM_STEP_NUM_TASKS or SLURM_NTASKS;
// 1 when none is set (a plain launch). Read before MPI is initialised, so a plain launch never
// touches MPI.
int launched_processes();

// Refuses (zt::Error kInvalidArgument, one sentence) what a multi-process run does not build:
// pipeline parallelism, optimizer offload, sweeps, samples during training, --trace, fault
// injection and --on-scale-collapse bf16. (Checkpoints, --resume and --snapshot-every work:
// train/checkpointer.h.)
void refuse_under_processes(const TrainConfig& cfg);

// --comm nccl over processes: refuses (zt::Error kInvalidArgument, one sentence) two devices of
// `seats` (per process: its host name, then its device names) that name one GPU of one host,
// which NCCL would refuse at init ("Duplicate GPU detected", same host and PCI bus id). A CUDA
// device's name ends with its GPU's PCI address (runtime/cuda/cuda_device.cc): the GPU is that
// where a name has one (CUDA_VISIBLE_DEVICES renumbers the GPUs of each process), else the name.
void refuse_shared_nccl_gpus(const std::vector<std::vector<std::string>>& seats);

// This process's place among the K processes of the launch. Global ranks: process p's local device
// i is rank p * L + i (every process drives the same number L of devices), the order one process
// driving all K * L devices would give them, so results are bitwise those of that process. A plain
// launch is K = 1 (Processes::alone): every exchange between processes is then the identity, so the
// trainer runs one code path for one process and for many.
class Processes {
 public:
  // The processes of this launch: under mpirun/srun (launched_processes() > 1) MPI's world, after
  // refuse_under_processes(cfg), every wait on another process giving up after cfg.comm_timeout_s
  // with one sentence naming the rank that did not answer (zt::Error kInvalidArgument in a build
  // without MPI); else alone().
  static std::unique_ptr<Processes> join(const TrainConfig& cfg);
  // This process alone (K = 1): rank 0 of 1, all_gather returns its input, no MPI.
  static Processes& alone();

  virtual ~Processes() = default;
  virtual int rank() const = 0;  // this process, 0..size()-1
  virtual int size() const = 0;
  // The engine's data-group collectives over this process's devices and every other process's
  // (collective: every process calls with the same devices count, tensor degree and topology);
  // null for one process (the in-process Communicator carries the data group). Destroy it before
  // the devices. tensor > 1 (dividing local.size()): the tensor axis lives inside the process, the
  // data groups span processes, one ring per tensor coordinate (see DataCollectives).
  // hierarchical (--comm-topology hierarchical): the data groups reduce inside each process first
  // and across second (ProcessRing's hierarchical calls), equal to one process up to rounding, not
  // bitwise.
  virtual std::unique_ptr<DataCollectives> connect(const std::vector<Device*>& local, int tensor = 1,
                                                   bool hierarchical = false) = 0;
  // --comm nccl: one NCCL clique over every process's devices (global rank p * L + i), its unique
  // id made by process 0 and sent over MPI (one process: a communicator over `local`). Refuses
  // (kInvalidArgument, on every process alike) two processes driving the same GPU of one host.
  // Collective.
  virtual std::unique_ptr<DataCollectives> connect_nccl(const std::vector<Device*>& local) = 0;
  // Every process's values, concatenated in process order (every process sends as many).
  virtual std::vector<double> all_gather(const std::vector<double>& mine, std::string_view what) = 0;
  // The team that writes a checkpoint together (train/state_io.h), over a process group of its
  // own; null for one process (it writes alone). Collective: every process calls it.
  virtual std::unique_ptr<CheckpointTeam> checkpoint_team() = 0;
  // Marks `snap`, taken on this process's `local` ranks, as this process's part of every
  // process's ranks (HostSnapshot::first_rank, world_ranks); one process: it holds every rank.
  virtual void own_part(HostSnapshot& snap, int local) const = 0;
  // What a run over these processes changes in `cfg`, and a note for each change and for each
  // flag that does nothing here (printed with the run's header).
  virtual std::vector<std::string> settle(TrainConfig& cfg) const = 0;
  // The header's words for where the mesh's ranks live: "" in one process, else " over K processes".
  virtual std::string span() const = 0;
  // MPI_Finalize: only after a run that ended well on every process (it waits for all of them).
  virtual void finalize() = 0;
};

}  // namespace zt
