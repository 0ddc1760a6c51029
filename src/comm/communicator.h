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
// Rules for per-rank calls (as NCCL's): every rank of a group issues the same collectives on it,
// with the same kind, dtype and numel, in the same order. Call #g of rank r on a group is matched
// with call #g of every other member; a mismatch throws the same zt::Error on every rank (the communicator stays usable).
// A rank that never makes its call leaves the others blocked in the rendezvous. The last rank to
// arrive enqueues the whole schedule for every rank, recording on each rank's producer stream, so
// no rank's thread may enqueue work on its producer stream while it is inside a call (it cannot:
// it is blocked in the call). Group and per-rank calls may be mixed; each collective is enqueued
// whole, under one lock, in the order the calls complete.
//
// Paths: where every member of a group can access every other member's memory (always on the CPU
// backend, one address space; on CUDA where peer access is enabled) a reduce-scatter step is one
// op per rank that reads the predecessor's partial in place and adds it into the rank's own
// buffer (ops::accumulate_peer), and an all-gather copies each rank's whole shard straight into
// every peer's buffer. Elsewhere (or with CommPath::kStaged) the ring copies chunk_bytes chunks
// into receive buffers and adds them from there. Both paths give the same bits.
//
// Chunking of the staged ring: at an explicit chunk size, kRecvSlots receive buffers of chunk_bytes.
// By default (kProbeChunk) a communicator whose reductions can stage (!reduces_directly) times a
// staged reduce-scatter of kProbeShardBytes per rank at each of kProbeChoices (1 MiB x 2, 512 KiB x
// 4, 256 KiB x 8 slots: the same kRecvBudgetBytes) when it is created, and keeps the fastest (a
// smaller chunk only when at least 5% faster); the others keep 1 MiB x 2. The choice changes the
// speed only: the ring's summation order, and so every bit, is the same at any chunk size and slot
// count, and the receive memory is kRecvBudgetBytes whichever wins. The probe's traffic is not
// counted (counters start at zero after it) and its buffers go back to the pools before the
// constructor returns.
//
// Memory: the staged reduce-scatter (and so all-reduce) receives into recv_slots() buffers of
// chunk_bytes() per rank, from that rank's pool on its comm stream, allocated at the first staged
// reduction and kept for the communicator's lifetime (2 MiB per rank at the default chunk). The
// direct path needs none and allocates none, so a communicator whose every reduction is direct
// (reduces_directly: the CPU backend always, CUDA where all its GPUs have peer access) holds no
// receive buffers; memory plans ask reduces_directly to know which. All-gather and broadcast copy
// straight into the destination buffers. Devices must outlive the communicator.
//
// Ordering: the host only enqueues. Peer copies follow the runtime's rule (copy on the source's
// comm stream, record an event, the consumer waits on it); a rank's buffer is written by a peer
// only after that rank's comm stream reached the collective (so after its producer's work), and a
// receive buffer is refilled only after an event shows the reduction consumed it.
//
// Groups: every collective also runs on a CommGroup, an ordered subset of the ranks (the world is
// the group of all ranks; the calls above are the world group's). Inside a group, "position i"
// plays the part the rank plays in the world: it owns shard i, and group calls take vectors
// indexed by position. Everything else names communicator ranks (per-rank callers, broadcast
// roots, counters, messages). Each group has its own rendezvous, so disjoint groups run their
// per-rank collectives concurrently from different threads; a rank takes part in one call at a
// time (its thread is blocked in it). Schedules of all groups are enqueued under one lock; the
// per-rank events and receive buffers are shared by all groups, which is safe because a
// collective is enqueued whole and every wait captures a record enqueued before it.
//
// Point-to-point: send/recv/send_recv (per rank) and transfer (host-issued) copy a buffer from
// one rank to another by the peer-copy rule: the receiver's comm stream marks when its buffer
// may be written, the sender's comm stream waits for that and copies, the receiver's comm stream
// waits for the copy. Both sides then use wait_done() before touching the buffers again. The
// k-th send from a to b, of either kind (send or isend), matches the k-th recv at b from a.
//
// Posted sends (isend + wait_send), what pipeline schedules need (pipeline/check.h, CommModel
// kPostedSends: under blocking sends 1F1B deadlocks): isend records an event on the producer
// stream at once (the copy reads what was submitted to it before the call, nothing later), queues
// the send and returns a ticket without waiting for the peer. The matching recv (which blocks its
// host thread until the send was posted) enqueues the copy by the same peer-copy rule, from the
// receiver's thread; so does an isend that finds the recv already waiting. The copy of a posted
// send runs on a stream of the source device kept for that (source, destination) link, not on its
// comm stream, so that a copy waiting for the sender's compute holds back nothing else (receive
// marks, collectives) queued on the comm stream. The receiver's consumers use wait_done() as after
// any recv. On the sender, wait_done() covers only sends already matched; wait_send(ticket,
// consumer) blocks until the send was matched and makes `consumer` wait for that copy's read of
// the buffer (its own event, not the rank's later comm work), after which the sender may
// overwrite or free it. Tickets are per rank. A sender may skip wait_send when the buffer stays
// untouched until a later synchronisation; the communicator then forgets the oldest of more than
// kMaxUnwaitedSends matched sends of a rank, and a late wait_send on a forgotten ticket waits for
// the newest copy on each of the rank's links instead (a superset: a link runs its copies in order).
// Errors: bad arguments throw from isend; a mismatch found at the match throws on the receiver
// at once and on the sender at wait_send (not at all if it never waits; the pair is consumed
// either way). abort() makes a wait_send on an unmatched send throw
// (a matched one still orders its consumer). Destroying the communicator drops posted sends that
// were never matched (no copy runs for them) and waits for nothing: a matched copy still reads
// its buffer on the device until it ran.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "runtime/device.h"
#include "runtime/event.h"

namespace zt {

struct CommCounters {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t collectives = 0;
  uint64_t transfers = 0;  // point-to-point sends and receives this rank took part in
};

class Communicator;
namespace detail {
struct CommGroupState;
}

// A handle to an ordered subset of a communicator's ranks (cheap to copy; valid while the
// communicator lives). Obtain it with Communicator::group(); the same ranks in the same order
// always give the same group, so every rank's thread may ask for it on its own.
class CommGroup {
 public:
  CommGroup() = default;

  int size() const;
  // Communicator ranks, in group order.
  const std::vector<int>& ranks() const;
  // Position of communicator rank `rank` in the group, -1 when it is not a member.
  int index_of(int rank) const;
  bool contains(int rank) const { return index_of(rank) >= 0; }
  // "{0,2}"
  const std::string& name() const;

  // Group calls (one host thread for every member): vectors indexed by position; the same
  // contracts as Communicator's world calls, with `world` read as the group's size. broadcast's
  // root is a communicator rank that is a member.
  void reduce_scatter(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const;
  void all_gather(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const;
  void all_reduce(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const;
  void broadcast(int root, const std::vector<TensorView>& bufs, const std::vector<Stream*>& producers) const;

  // Per-rank calls: `rank` is the caller's communicator rank, a member. Every member calls, in
  // the same order per group; consumers wait with Communicator::wait_done(rank, stream).
  void reduce_scatter(int rank, TensorView full, Stream* producer, std::string_view tag = {}) const;
  void all_gather(int rank, TensorView full, Stream* producer, std::string_view tag = {}) const;
  void all_reduce(int rank, TensorView full, Stream* producer, std::string_view tag = {}) const;
  void broadcast(int rank, int root, TensorView buf, Stream* producer, std::string_view tag = {}) const;

  // This group's share of Communicator::counters(rank) (collectives run on this group only).
  CommCounters counters(int rank) const;

 private:
  friend class Communicator;
  CommGroup(Communicator* comm, detail::CommGroupState* state) : comm_(comm), state_(state) {}
  const detail::CommGroupState& state() const;

  Communicator* comm_ = nullptr;
  detail::CommGroupState* state_ = nullptr;
};

// One host-issued point-to-point copy: `from` on rank src -> `to` on rank dst (same dtype, numel).
struct Transfer {
  int src = 0;
  int dst = 0;
  ConstTensorView from;
  TensorView to;
};

// kAuto: the direct path wherever the devices allow it (see the header comment); kStaged: always
// the staged ring (the fallback, e.g. to compare the two).
enum class CommPath : uint8_t { kAuto, kStaged };

class Communicator {
 public:
  // Ranks are the given devices in order. chunk_bytes: pipeline granularity of the staged ring
  // (and of broadcast), with kRecvSlots receive buffers; kProbeChunk: chosen by the probe (header
  // comment) where reductions can stage, else kDefaultChunkBytes.
  static constexpr size_t kDefaultChunkBytes = size_t{1} << 20;
  static constexpr size_t kProbeChunk = 0;
  explicit Communicator(std::vector<Device*> devices, size_t chunk_bytes = kProbeChunk,
                        CommPath path = CommPath::kAuto);
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

  // ---- groups -----------------------------------------------------------------------------------
  // The group of `ranks` (communicator ranks, in the order that defines positions: distinct, at
  // least one). Thread-safe; the same list returns the same group (shared rendezvous and counters).
  CommGroup group(std::vector<int> ranks);
  // The group of all ranks, 0..world-1; the world calls of this class are its calls.
  CommGroup world_group();

  // ---- point-to-point ---------------------------------------------------------------------------
  // Per-rank: `rank` is the caller. The call returns once its copies are enqueued, which needs the
  // peer's matching call (it blocks until then; abort() releases it). producer: the stream that
  // last wrote the send buffer / last used the receive buffer (nullptr = comm stream only). After
  // it, wait_done(rank, stream) orders a consumer after the copy (receiver) or a writer of the
  // send buffer after the read (sender). send_recv posts both halves before waiting, so ring
  // shifts and pairwise exchanges (everybody sends and receives) cannot deadlock; a rank sending
  // to and receiving from the same peer may use it too.
  void send(int rank, int peer, ConstTensorView buf, Stream* producer);
  void recv(int rank, int peer, TensorView buf, Stream* producer);
  void send_recv(int rank, int send_to, ConstTensorView send_buf, int recv_from, TensorView recv_buf,
                 Stream* producer);
  // Posted send (see the header comment): returns at once with a ticket for wait_send. The copy
  // reads `buf` after the work submitted to `producer` before this call (nullptr = the comm
  // stream's work only). Bad arguments throw here; an aborted communicator throws kDevice.
  uint64_t isend(int rank, int peer, ConstTensorView buf, Stream* producer);
  // Blocks until ticket's send was matched and its copy enqueued, then makes `consumer` wait for
  // the copy's read of the send buffer. Throws the match's error (dtype/numel mismatch) once, or
  // kDevice when the communicator was aborted before the send was matched.
  void wait_send(int rank, uint64_t ticket, Stream& consumer);
  // Matched sends per rank kept for wait_send (see the header comment); bounds the memory of
  // senders that never wait.
  static constexpr size_t kMaxUnwaitedSends = 256;
  // Host-issued: enqueues every copy of `transfers` at once; producers indexed by communicator
  // rank (or empty), as for the group calls; consumers use wait_done on both sides.
  void transfer(const std::vector<Transfer>& transfers, const std::vector<Stream*>& producers);

  // ---- per-rank calls (one host thread per rank; all ranks must call, in the same order) ------
  // tag: names the collective in profiles (NVTX range "reduce_scatter h.3 1.2 MiB"), e.g. the
  // block or bucket it serves.
  void reduce_scatter(int rank, TensorView full, Stream* producer, std::string_view tag = {});
  void all_gather(int rank, TensorView full, Stream* producer, std::string_view tag = {});
  void all_reduce(int rank, TensorView full, Stream* producer, std::string_view tag = {});

  // Abandons the communicator after a rank failed: ranks waiting in a per-rank rendezvous (of any
  // group, or for a send/recv peer, or in wait_send for an unmatched isend), and every later per-rank call, throw zt::Error(kDevice) naming `why` instead of waiting for a rank that will
  // never arrive. Work already enqueued is not undone. Safe to call from any thread, repeatedly.
  void abort(const std::string& why);
  bool aborted() const;

  // Makes `consumer` wait for the last collective or transfer (of any group) enqueued on `rank`'s
  // comm stream.
  void wait_done(int rank, Stream& consumer);

  // Bytes this rank's comm stream sent / received by peer copy, counted when enqueued (so they are
  // deterministic): a ring reduce-scatter or all-gather sends and receives (world-1)*shard_bytes
  // per rank, an all-reduce twice that (world = the group's size for a group's collective); a
  // transfer counts its bytes on both sides and one transfer each; in a broadcast every rank but the last in the chain from
  // root sends the buffer once, every rank but root receives it once.
  CommCounters counters(int rank) const;
  void reset_counters();
  // Bytes of the rank's pool held as receive buffers (allocated at the first staged reduction; 0
  // while every reduction took the direct path).
  size_t buffer_bytes(int rank) const;
  // What buffer_bytes() will be per rank once a world-rank communicator has reduced something on
  // the staged path (each receive buffer is one allocation of the returned size / kRecvSlots;
  // memory plans count it unless reduces_directly()).
  static size_t planned_buffer_bytes(int world, size_t chunk_bytes = kDefaultChunkBytes);
  // True when every reduction of a communicator over `devices` with `path` takes the direct path
  // in every group, so it never allocates receive buffers: path kAuto, every device can access
  // every other's memory, and the backend has accumulate_peer for fp32, fp16 and bf16.
  static bool reduces_directly(const std::vector<Device*>& devices, CommPath path = CommPath::kAuto);

  // Receive buffers per rank for the ring reduction at an explicit or the default chunk size
  // (double buffering: the copy of chunk j+1 lands in one while chunk j is reduced from the other).
  static constexpr int kRecvSlots = 2;
  // The probe's choices (chunk bytes, slots), largest chunk first; each holds kRecvBudgetBytes.
  static constexpr size_t kRecvBudgetBytes = kRecvSlots * kDefaultChunkBytes;
  static constexpr std::pair<size_t, int> kProbeChoices[] = {
      {kDefaultChunkBytes, kRecvSlots}, {kDefaultChunkBytes / 2, 2 * kRecvSlots}, {kDefaultChunkBytes / 4, 4 * kRecvSlots}};
  static constexpr int kMaxRecvSlots = 4 * kRecvSlots;
  // Per rank and timed choice: the probe reduce-scatters world x kProbeShardBytes.
  static constexpr size_t kProbeShardBytes = size_t{4} << 20;
  // The staged ring's chunk size and receive slots (after the probe, when it ran); whether it ran.
  size_t chunk_bytes() const { return chunk_bytes_; }
  int recv_slots() const;
  bool probed() const { return probed_; }

 private:
  friend class CommGroup;
  struct Impl;  // events, receive buffers, groups, rendezvous and counters (communicator_impl.h)
  enum class Kind : uint8_t;
  struct P2POp;
  void group_call(detail::CommGroupState& g, Kind kind, int root, const std::vector<TensorView>& bufs,
                  const std::vector<Stream*>& producers);
  void rank_call(detail::CommGroupState& g, int rank, Kind kind, int root, TensorView full,
                 Stream* producer, std::string_view tag);
  void p2p_call(int rank, P2POp* ops, int count);
  void match(P2POp* send, P2POp* recv);
  void probe_chunking();

  std::vector<Device*> devices_;
  size_t chunk_bytes_;
  CommPath path_;
  bool probed_ = false;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt
