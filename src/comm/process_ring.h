// Ring collectives across processes: reduce-scatter, all-gather and all-reduce of device buffers
// over global ranks = process * L + local device index (L local devices per process, the same L in
// every process), bitwise equal to the in-process Communicator on one process with K*L devices.
//
// Same ring, same chunking, same per-element order as communicator.cc: step k, global rank g sends
// its chunk of shard (g-k-1) mod N (reduce-scatter; (g-k) mod N for all-gather) to g+1, which adds
// it into its own copy with ops::accumulate (16-bit types through fp32, rounded once per hop), so
// the sum of shard s starts at rank s+1 and travels s+2, ..., s. Chunks are chunk_bytes / element
// size elements, as the Communicator's. Hops between local devices are peer copies on the source's
// comm stream; the hop from a process's last device to the next process's first device stages
// through host memory (device -> host copy, ProcessGroup::send_recv with the group's timeout, host
// -> device copy).
//
// First version, simplicity over speed: every round (one step of one chunk) is synchronous. The
// host enqueues the round's copies and reductions on the local comm streams, exchanges the
// cross-process chunk over MPI, and synchronizes every local comm stream before the next round;
// nothing overlaps across rounds and a round costs at least one MPI round trip. A call returns once
// its results are in place: every local comm stream is idle, so any stream or the host may read
// them without waiting on an event.
//
// Calls are group calls: one host thread issues each collective for all local devices (vectors
// indexed by local device). Every process issues the same collectives (kind, dtype, numel) in the
// same order; a mismatch throws the same zt::Error on every process (each call starts with a small
// all-gather of its signature through the group); bad buffers throw before any message. A process
// that dies or stalls makes the others throw, within the group's timeout plus a fifth of it, a
// sentence naming that rank (not the innocent ranks waiting between); a process whose own device
// fails mid-collective aborts the group, so the others throw at once with its sentence
// (process_group.h, "Failure notices"). Either way the group is broken afterwards: the run is
// lost. The ring's data messages use tag kTag of the group; other traffic on it must use others.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/process_group.h"
#include "core/status.h"
#include "core/tensor.h"
#include "memory/caching_allocator.h"
#include "runtime/device.h"
#include "runtime/event.h"

namespace zt {

class ProcessRing {
 public:
  static constexpr int kTag = 1;

  // local_devices: this process's devices; local device i is global rank group.rank() * L + i.
  // Collective over the group (checks that every process passes the same L and chunk_bytes). The
  // group and the devices must outlive the ring.
  ProcessRing(ProcessGroup& group, std::vector<Device*> local_devices,
              size_t chunk_bytes = Communicator::kDefaultChunkBytes);
  ~ProcessRing();
  ProcessRing(const ProcessRing&) = delete;
  ProcessRing& operator=(const ProcessRing&) = delete;

  int world() const { return processes_ * local_size(); }  // N = K * L global ranks
  int local_size() const { return static_cast<int>(devices_.size()); }
  int processes() const { return processes_; }
  int global_rank(int local) const { return process_ * local_size() + local; }

  // The Communicator's world calls, over the global ranks: full[i] is local device i's buffer of
  // world() * shard elements (f32/f16/bf16, the same numel everywhere); producers[i] (or empty) is
  // the stream that wrote it. See Communicator::reduce_scatter / all_gather / all_reduce.
  void reduce_scatter(const std::vector<TensorView>& full, const std::vector<Stream*>& producers = {});
  void all_gather(const std::vector<TensorView>& full, const std::vector<Stream*>& producers = {});
  void all_reduce(const std::vector<TensorView>& full, const std::vector<Stream*>& producers = {});

  // Per-rank calls (one host thread per local device, as the trainer runs its ranks): every local
  // device's thread calls with its own buffer and producer; the last to arrive runs the group call
  // for all of them (its thread makes the MPI calls: MPI_THREAD_SERIALIZED) and every caller
  // returns once the collective completed, or throws the same error. The local threads must issue
  // the same calls in the same order (a local mismatch throws on each of them; nothing moved). A
  // thread calls again only after its previous call returned.
  void reduce_scatter(int local, TensorView full, Stream* producer);
  void all_gather(int local, TensorView full, Stream* producer);
  void all_reduce(int local, TensorView full, Stream* producer);
  // The hierarchical calls below, per rank (the same rendezvous).
  void hierarchical_reduce_scatter(int local, TensorView full, Stream* producer);
  void hierarchical_all_gather(int local, TensorView full, Stream* producer);
  void hierarchical_all_reduce(int local, TensorView full, Stream* producer);

  // Hierarchical variants: the same results up to rounding (another summation order, so not
  // bitwise equal to the calls above; all_gather moves bytes only and is bitwise equal), in two
  // phases. Reduce-scatter: inside the process first, a ring over the L local devices in which
  // device i ends with the process's partial sums of its shards {q*L + i : every process q};
  // across processes second, L rings of K processes (one per local index i, all L chunks of a
  // round in one MPI message), after which global rank p*L + i holds the sum of its shard: per
  // element, the process partials are summed in ring order p+1, ..., p (each partial itself
  // summed i+1, ..., i inside its process). All-gather: across processes first, inside second.
  // Bytes crossing processes per process and call: L * (K-1) * shard_bytes, against the flat
  // ring's (N-1) * shard_bytes = (L*K - 1) * shard_bytes: about the same total (each process
  // still exports everything but its own shards' worth), but spread over L parallel links of
  // (K-1) * shard_bytes each (1/L of the flat ring's one crossing link when K >> 1, and the
  // flat ring's N-1 serial cross-process steps become K-1). What this buys is fewer, larger
  // cross-process messages and per-link traffic, not fewer total bytes.
  void hierarchical_reduce_scatter(const std::vector<TensorView>& full, const std::vector<Stream*>& producers = {});
  void hierarchical_all_gather(const std::vector<TensorView>& full, const std::vector<Stream*>& producers = {});
  void hierarchical_all_reduce(const std::vector<TensorView>& full, const std::vector<Stream*>& producers = {});

  // Per local device, the same counts Communicator::counters gives the same global rank (every hop,
  // local or not, counted when enqueued; for the flat calls). The hierarchical calls count every
  // hop too, so sum over local devices of bytes_sent - bytes_sent_across() is what moved between
  // devices inside this process: (L-1) * K * shard_bytes per device and call in the first phase.
  CommCounters counters(int local) const { return counters_.at(static_cast<size_t>(local)); }
  // What this process sent to / received from other processes (the ring's data messages only): a
  // flat ring moves (N-1) * shard_bytes out of and into each process per reduce-scatter or
  // all-gather, the same as one device's traffic, whatever L is.
  uint64_t bytes_sent_across() const { return bytes_sent_across_; }
  uint64_t bytes_received_across() const { return bytes_received_across_; }
  void reset_counters();

 private:
  enum class Kind : uint8_t { kReduceScatter, kAllGather, kAllReduce, kHierReduceScatter, kHierAllGather, kHierAllReduce };
  struct Plan;
  Plan check(Kind kind, const std::vector<TensorView>& full, const std::vector<Stream*>& producers);
  void prologue(const std::vector<Stream*>& producers);
  // The rounds of one call; a local failure aborts the group (peers learn at once) and rethrows.
  void run(const Plan& p, const std::vector<TensorView>& full, const std::vector<Stream*>& producers, bool scatter,
           bool gather, bool hierarchical);
  void reduce_scatter_rounds(const Plan& p, const std::vector<TensorView>& full);
  void all_gather_rounds(const Plan& p, const std::vector<TensorView>& full);
  void hier_reduce_scatter_rounds(const Plan& p, const std::vector<TensorView>& full);
  void hier_all_gather_rounds(const Plan& p, const std::vector<TensorView>& full);
  void ensure_slots();
  // One round of a hierarchical cross-process phase: the L chunks staged in host_out_ go to the
  // next process in one message; the previous process's L chunks arrive in host_in_.
  void exchange_all_local(const Plan& p, size_t bytes, const char* step_name, int k, int64_t j);
  // Device (local L-1) -> host -> next process; previous process -> host -> `to` on local 0.
  void exchange(const Plan& p, size_t bytes, const char* step_name, int k, int64_t j, void* to);
  void synchronize_all();
  void rank_call(Kind kind, int local, TensorView full, Stream* producer);
  void group_call(Kind kind, const std::vector<TensorView>& full, const std::vector<Stream*>& producers);
  Stream& comm(int i) { return devices_[static_cast<size_t>(i)]->comm(); }

  ProcessGroup& group_;
  std::vector<Device*> devices_;
  size_t chunk_bytes_;
  int process_ = 0;
  int processes_ = 1;
  std::vector<std::unique_ptr<Event>> producer_events_;
  std::vector<std::unique_ptr<Event>> sent_;  // after each local peer copy a device issues
  std::vector<DeviceBuffer> slots_;           // one receive chunk per local device (lazy)
  std::vector<char> host_out_, host_in_;      // cross-process chunks staged in host memory (L slots)
  std::vector<CommCounters> counters_;
  uint64_t bytes_sent_across_ = 0;
  uint64_t bytes_received_across_ = 0;
  uint64_t calls_ = 0;

  // Per-rank rendezvous of the local threads.
  struct Arrival {
    bool arrived = false;
    Kind kind = Kind::kReduceScatter;
    TensorView full;
    Stream* producer = nullptr;
  };
  std::mutex rv_mu_;
  std::condition_variable rv_cv_;
  std::vector<Arrival> arrivals_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool generation_failed_ = false;  // of the generation that completed last
  ErrorKind error_kind_ = ErrorKind::kInternal;
  std::string error_message_;
};

}  // namespace zt
