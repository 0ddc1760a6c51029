// Collectives across the runtime's devices over peer copies: ring reduce-scatter, all-gather,
// all-reduce (= reduce-scatter + all-gather) and broadcast, chunked and pipelined, enqueued on
// each device's comm stream and ordered against other streams with events only (no host
// synchronisation). The reduction order of every element is fixed by the ring, never by timing,
// so results are bit-reproducible run to run.
//
// Buffer convention (ZeRO's flat shards): a "full" buffer on every rank holds world * shard_numel
// elements (callers pad; see zero/shard_plan.h); rank r owns elements [r*shard_numel, (r+1)*shard_numel).
//
// Two ways to call:
//  - group calls (one host thread issues the collective for all ranks: vectors indexed by rank);
//  - per-rank calls (one host thread per device, as the trainer runs): every rank calls with its
//    own buffers; the call returns once the collective has been enqueued for all ranks (a host
//    rendezvous of microseconds, not a wait for the data).
//
// Rules for per-rank calls (as NCCL's): every rank issues the same collectives, with the same
// kind, dtype and numel, in the same order. Call #g of rank r is matched with call #g of every
// other rank; a mismatch throws the same zt::Error on every rank (the communicator stays usable).
// A rank that never makes its call leaves the others blocked in the rendezvous. The last rank to
// arrive enqueues the whole schedule for every rank, recording on each rank's producer stream, so
// no rank's thread may enqueue work on its producer stream while it is inside a call (it cannot:
// it is blocked in the call). Group and per-rank calls may be mixed; each collective is enqueued
// whole, under one lock, in the order the calls complete.
//
// Memory: reduce-scatter (and so all-reduce) receives into kRecvSlots buffers of chunk_bytes per
// rank, from that rank's pool on its comm stream, allocated at the first reduction and kept for
// the communicator's lifetime (2 MiB per rank at the default chunk). All-gather and broadcast copy
// straight into the destination buffers. Devices must outlive the communicator.
//
// Ordering: the host only enqueues. Peer copies follow the runtime's rule (copy on the source's
// comm stream, record an event, the consumer waits on it); a rank's buffer is written by a peer
// only after that rank's comm stream reached the collective (so after its producer's work), and a
// receive buffer is refilled only after an event shows the reduction consumed it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "runtime/device.h"
#include "runtime/event.h"

namespace zt {

struct CommCounters {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t collectives = 0;
};

class Communicator {
 public:
  // Ranks are the given devices in order. chunk_bytes: pipeline granularity of the ring.
  static constexpr size_t kDefaultChunkBytes = size_t{1} << 20;
  explicit Communicator(std::vector<Device*> devices, size_t chunk_bytes = kDefaultChunkBytes);
  ~Communicator();

  int world() const { return static_cast<int>(devices_.size()); }
  Device& device(int rank) { return *devices_[static_cast<size_t>(rank)]; }

  // ---- group calls ----------------------------------------------------------------------------
  // Before the collective, each rank's comm stream waits for everything submitted so far to
  // `producers[r]` (pass the compute stream that wrote the data; nullptr = comm stream only).
  // After it, callers make consumers wait with wait_done(rank, stream).
  //
  // reduce_scatter: full[r] (world*shard elements, f32/f16/bf16) -> the sum over ranks of shard r
  // lands in full[r][r*shard .. (r+1)*shard) (in place; other parts of full[r] hold partial sums
  // afterwards). 16-bit types are accumulated in fp32 and rounded once per hop.
  void reduce_scatter(const std::vector<TensorView>& full, const std::vector<Stream*>& producers);
  // all_gather: shard r of full[r] (in place) -> every rank's full buffer holds all shards.
  void all_gather(const std::vector<TensorView>& full, const std::vector<Stream*>& producers);
  // all_reduce: every full[r] ends with the elementwise sum (reduce_scatter + all_gather, so the
  // bits equal what ZeRO's sharded path computes).
  void all_reduce(const std::vector<TensorView>& full, const std::vector<Stream*>& producers);
  // broadcast: bufs[root] -> every bufs[r] (any numel, no padding needed).
  void broadcast(int root, const std::vector<TensorView>& bufs, const std::vector<Stream*>& producers);

  // ---- per-rank calls (one host thread per rank; all ranks must call, in the same order) ------
  // tag: names the collective in profiles (NVTX range "reduce_scatter h.3 1.2 MiB"), e.g. the
  // block or bucket it serves.
  void reduce_scatter(int rank, TensorView full, Stream* producer, std::string_view tag = {});
  void all_gather(int rank, TensorView full, Stream* producer, std::string_view tag = {});
  void all_reduce(int rank, TensorView full, Stream* producer, std::string_view tag = {});

  // Abandons the communicator after a rank failed: ranks waiting in a per-rank rendezvous, and every
  // later collective, throw zt::Error(kDevice) naming `why` instead of waiting for a rank that will
  // never arrive. Work already enqueued is not undone. Safe to call from any thread, repeatedly.
  void abort(const std::string& why);
  bool aborted() const;

  // Makes `consumer` wait for the last collective enqueued on `rank`'s comm stream.
  void wait_done(int rank, Stream& consumer);

  // Bytes this rank's comm stream sent / received by peer copy, counted when enqueued (so they are
  // deterministic): a ring reduce-scatter or all-gather sends and receives (world-1)*shard_bytes
  // per rank, an all-reduce twice that; in a broadcast every rank but the last in the chain from
  // root sends the buffer once, every rank but root receives it once.
  CommCounters counters(int rank) const;
  void reset_counters();
  // Bytes of the rank's pool held as receive buffers (allocated at the first reduction).
  size_t buffer_bytes(int rank) const;
  // What buffer_bytes() will be per rank once a world-rank communicator has reduced something
  // (each receive buffer is one allocation of the returned size / kRecvSlots; memory plans).
  static size_t planned_buffer_bytes(int world, size_t chunk_bytes = kDefaultChunkBytes);

  // Receive buffers per rank for the ring reduction (double buffering: the copy of chunk j+1
  // lands in one while chunk j is reduced from the other).
  static constexpr int kRecvSlots = 2;

 private:
  struct Impl;  // events, receive buffers, rendezvous and counters (communicator.cc)
  enum class Kind : uint8_t;
  void rank_call(int rank, Kind kind, TensorView full, Stream* producer, std::string_view tag);

  std::vector<Device*> devices_;
  size_t chunk_bytes_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt
