// Ring collectives over peer copies (see communicator.h for the contract). The host builds the
// whole schedule of a collective at once, for every rank, under one lock; nothing here waits for
// device work.
//
// Direct path (every pair of a group's devices can access each other's memory: always on the CPU
// backend, on CUDA where peer access is enabled; and the backend has accumulate_peer):
//  - Reduce-scatter step k is ONE op per rank: rank r waits on `stepped` of r-1 (recorded after
//    r-1's step k-1, so r-1's partial of shard (r-k-2) mod N is complete) and adds that shard of
//    r-1's buffer, read in place, into its own (ops::accumulate_peer). No receive buffer, no copy,
//    no chunking: every rank works on a different shard in the same step, so all links are busy
//    at once, and chunks would only add launches and waits (bench/README.md).
//  - No read/write overlap: at step k rank r writes shard (r-k-2) of its own buffer while r+1
//    reads shard (r-k-1) of it; rank r writes each shard but r-1 exactly once, at the step before
//    r+1 reads it, so after r+1's read nothing writes that shard again within the collective.
//    Writes after it (a following all-gather, the caller's next use) are ordered behind r+1's
//    last read: r's comm stream waits on r+1's final `stepped` before it records `ready`/`done`.
//  - All-gather: rank r copies its own shard straight into every peer's buffer, step k to rank
//    r+k+1 (each rank receives from one rank per step), each copy after the peer's `ready`; the
//    receiver's comm stream then waits on every sender's `sent`. Copies only: the bits are those
//    of the ring.
//  - The summation order of every element is the ring's below, so both paths give the same bits;
//    CommPath::kStaged forces the ring below (tests compare the two).
//
// Staged ring (no peer access, or CommPath::kStaged):
//  - A collective is a sequence of rounds. In a ring round every rank copies one chunk to its
//    successor (on its own comm stream), and, for a reduction, every rank then adds the chunk it
//    received into its own buffer (on its comm stream). Rounds are enqueued step-major (all
//    chunks of step 0, then of step 1, ...), so on each link the copy of chunk j+1 (sender's
//    stream) runs while the receiver reduces chunk j (receiver's stream).
//  - Events are re-recorded, never allocated per round. That is safe because of the host order
//    of enqueueing: within a round all copies (each followed by a record of the sender's `sent`
//    event) are enqueued before all waits on `sent`, and the next record of `sent` belongs to a
//    later round. A wait always captures the record current when it is enqueued (CUDA
//    semantics), and every wait refers to a record enqueued earlier, so the waits form no cycle.
//  - Receive buffer q of rank r is refilled by r-1 only after waiting on slot_free[q] of rank r,
//    recorded by r after the reduction that consumed it (or, for the first use, after whatever
//    the comm stream held when the buffer was allocated).
//  - A rank's own buffer is written by a peer (all-gather, broadcast) only after the peer waited
//    on the rank's `ready` event, recorded on the rank's comm stream once that stream has waited
//    for the producer: so a peer never overwrites data the rank is still reading or writing.
//  - At the end every rank's comm stream waits for the last copy into its buffers (its
//    predecessor's `sent`), then records `done`; wait_done() makes consumers wait on `done`.
//  - Reduction order per element is fixed by the ring: the sum of shard s starts at rank s+1 and
//    travels s+2, ..., s; each hop adds the incoming partial into the local value (16-bit types
//    through fp32, rounded once per hop by ops::accumulate). Timing never changes the bits.
#include "comm/communicator.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "core/format.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"

namespace zt {

enum class Communicator::Kind : uint8_t { kReduceScatter, kAllGather, kAllReduce, kBroadcast };

namespace {

// A receive buffer holds one chunk, and at least one element of any type.
size_t slot_bytes_for(size_t chunk_bytes) { return std::max<size_t>(chunk_bytes, sizeof(float)); }

const char* kind_name(uint8_t k) {
  switch (k) {
    case 0:
      return "reduce_scatter";
    case 1:
      return "all_gather";
    case 2:
      return "all_reduce";
    case 3:
      return "broadcast";
    default:
      return "?";
  }
}

// "reduce_scatter h.3 1.2 MiB": kind, the caller's tag, bytes per rank.
std::string collective_label(const char* kind, std::string_view tag, int64_t bytes) {
  std::string s = kind;
  if (!tag.empty()) s.append(" ").append(tag);
  return s + " " + format_bytes(static_cast<double>(bytes), 1);
}

// Group calls open their own range unless they run inside a per-rank call (which has one).
thread_local int t_rank_call_depth = 0;
struct InRankCall {
  InRankCall() { ++t_rank_call_depth; }
  ~InRankCall() { --t_rank_call_depth; }
};
struct GroupRange {
  GroupRange(const char* kind, int64_t bytes) {
    if (t_rank_call_depth == 0 && ranges_enabled()) range.emplace(NvtxCategory::kCollective, collective_label(kind, {}, bytes));
  }
  std::optional<NvtxRange> range;
};

bool is_float_type(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

char* byte_ptr(const TensorView& v) { return static_cast<char*>(v.data); }

// An error of one rendezvous generation, rethrown as a fresh zt::Error on every rank's thread.
struct StoredError {
  bool set = false;
  ErrorKind kind = ErrorKind::kInternal;
  std::string message;
  const char* file = nullptr;
  int line = 0;

  void capture(std::exception_ptr e) {
    set = true;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      kind = err.kind();
      message = err.message();
      file = err.file();
      line = err.line();
    } catch (const std::exception& err) {
      kind = ErrorKind::kInternal;
      message = err.what();
    } catch (...) {
      kind = ErrorKind::kInternal;
      message = "unknown exception";
    }
  }
  [[noreturn]] void raise() const { throw Error(kind, message, file, line); }
};

// A validated call: sizes shared by every member.
struct Plan {
  int world = 0;  // members
  DType dtype = DType::kF32;
  size_t esize = 0;
  int64_t numel = 0;  // per member
  int64_t shard = 0;  // numel / world
};

// One validated copy, in bytes.
struct Copy {
  int src = 0;
  int dst = 0;
  const char* from = nullptr;
  char* to = nullptr;
  size_t bytes = 0;
  Stream* src_producer = nullptr;
  Stream* dst_producer = nullptr;
  // Posted sends: the copy runs on the source's link stream to dst (Impl::link), which waits for
  // this record (taken at post time) instead of recording src_producer, and `src_copied` is
  // recorded after the copy.
  const Event* src_posted = nullptr;
  Event* src_copied = nullptr;
};

std::string ranks_name(const std::vector<int>& ranks) {
  std::string s = "{";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(ranks[i]);
  }
  return s + "}";
}

}  // namespace

namespace detail {

// A group's members and per-rank rendezvous. members and name are immutable; the rendezvous
// fields are guarded by Impl::rv_mu, counters by Impl::enqueue_mu.
struct CommGroupState {
  // One member's arguments in the per-rank rendezvous.
  struct Arrival {
    bool arrived = false;
    uint8_t kind = 0;
    int root = 0;
    TensorView full;
    Stream* producer = nullptr;
  };

  std::vector<int> members;
  std::string name;
  bool is_world = false;
  bool peer_access = false;  // every member can read and write every other member's memory
  std::vector<CommCounters> counters;  // by position

  uint64_t generation = 0;  // per-rank rendezvous: generation g completes when every member arrived
  int arrived = 0;
  std::vector<Arrival> arrivals;  // by position
  StoredError generation_error;   // of the generation that completed last

  int index_of(int rank) const {
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i] == rank) return static_cast<int>(i);
    return -1;
  }
  // "a communicator of 4 ranks" / "group {0,2} of 2 ranks": what a buffer vector must match.
  std::string vector_owner() const {
    return is_world ? "a communicator of " + std::to_string(members.size()) + " ranks"
                    : "group " + name + " of " + std::to_string(members.size()) + " ranks";
  }
};

}  // namespace detail

using detail::CommGroupState;

// One half of a per-rank point-to-point copy, owned by the calling thread's stack while it waits,
// or, for a posted send (ticket > 0), by Impl::posted until wait_send or destruction.
struct Communicator::P2POp {
  P2POp(bool is_send_, int src_, int dst_, TensorView buf_, Stream* producer_)
      : is_send(is_send_), src(src_), dst(dst_), buf(buf_), producer(producer_) {}
  bool is_send = false;
  int src = 0;
  int dst = 0;
  TensorView buf;  // the send buffer (read only) or the receive buffer
  Stream* producer = nullptr;
  bool done = false;  // guarded by rv_mu
  StoredError error;
  // Posted sends only: one event, recorded on the producer (or the comm stream) at post time,
  // then after the copy on the link stream (whose wait has captured the first record by then).
  uint64_t ticket = 0;
  std::unique_ptr<Event> event;
  bool copy_recorded = false;  // guarded by rv_mu
};

struct Communicator::Impl {
  struct Rank {
    std::unique_ptr<Event> producer;  // recorded on the caller's producer stream
    std::unique_ptr<Event> ready;     // comm stream reached the collective: peers may write here
    std::unique_ptr<Event> sent;      // after each peer copy this rank issues
    std::unique_ptr<Event> done;      // after the last collective touching this rank
    std::unique_ptr<Event> stepped;   // direct reduce-scatter: after this rank's latest step
    std::array<std::unique_ptr<Event>, kMaxRecvSlots> slot_free;  // reduction consumed slot q
    std::array<DeviceBuffer, kMaxRecvSlots> slots;                // receive buffers (lazy; recv_slots used)
    CommCounters counters;
  };

  struct Builder;  // enqueues schedules (defined below)
  void enqueue_copies(const std::vector<Device*>& devices, const std::vector<Copy>& copies);

  // Posted sends from src to dst run on a stream of their own on src (made at the first one, with
  // enqueue_mu held), not on src's comm stream: a posted copy waits for the sender's compute, and on
  // the comm stream it would hold back everything queued after it there (the receive marks other
  // ranks' copies wait for, collectives), serialising a pipeline's stages. One stream per
  // (src, dst) keeps each link's copies in posting order, which is the order they are matched in.
  std::map<std::pair<int, int>, Stream*> links;
  Stream& link(const std::vector<Device*>& devices, int src, int dst) {
    Stream*& s = links[std::make_pair(src, dst)];
    if (s == nullptr) s = &devices[static_cast<size_t>(src)]->create_stream();
    return *s;
  }

  std::vector<Rank> ranks;
  size_t slot_bytes = 0;
  int recv_slots = kRecvSlots;  // receive buffers per rank the staged ring uses
  uint64_t round = 0;  // ring rounds so far; picks the receive slot (round % recv_slots)

  // Guards schedule building (all events, slots, round) and counters (of ranks and groups).
  mutable std::mutex enqueue_mu;

  // Groups by member list; the states never move (CommGroup points at them).
  std::mutex groups_mu;
  std::map<std::vector<int>, std::unique_ptr<CommGroupState>> groups;
  CommGroupState* world = nullptr;

  // Rendezvous of every group and of the point-to-point calls; one condition variable, so that
  // abort() releases every waiter at once. Lock order: rv_mu, then enqueue_mu.
  std::mutex rv_mu;
  std::condition_variable rv_cv;
  // Unmatched point-to-point halves per (src, dst), oldest first.
  std::map<std::pair<int, int>, std::deque<P2POp*>> pending_sends;
  std::map<std::pair<int, int>, std::deque<P2POp*>> pending_recvs;
  bool aborted = false;          // guarded by rv_mu
  std::string abort_reason;      // guarded by rv_mu

  // Posted sends of one rank, guarded by rv_mu. `completed` lists matched sends without error
  // that nobody waited for yet, oldest first: beyond kMaxUnwaitedSends the oldest is forgotten.
  struct Posted {
    uint64_t next_ticket = 1;
    std::map<uint64_t, std::unique_ptr<P2POp>> live;
    std::deque<uint64_t> completed;
    std::vector<std::unique_ptr<Event>> free_events;  // reused: one cudaEventCreate per peak send
  };
  std::vector<Posted> posted;  // by rank
  void forget(int rank, uint64_t ticket);
};

// ---- construction ----------------------------------------------------------------------------

Communicator::Communicator(std::vector<Device*> devices, size_t chunk_bytes, CommPath path)
    : devices_(std::move(devices)), chunk_bytes_(chunk_bytes), path_(path), impl_(std::make_unique<Impl>()) {
  ZT_REQUIRE(!devices_.empty(), "Communicator: needs at least one device");
  const int n = world();
  for (int r = 0; r < n; ++r) {
    ZT_REQUIRE(devices_[r] != nullptr, "Communicator: device of rank ", r, " is null");
    for (int q = 0; q < r; ++q)
      ZT_REQUIRE(devices_[q] != devices_[r], "Communicator: ", devices_[r]->name(),
                 " is given twice (ranks ", q, " and ", r, "); every rank needs its own device");
    ZT_REQUIRE(devices_[r]->backend() == devices_[0]->backend(), "Communicator: ",
               devices_[0]->name(), " and ", devices_[r]->name(), " use different backends");
  }
  // Peer access is not required: copy_peer stages through host memory where GPUs lack it, and
  // groups without it in every direction take the staged ring (CommGroupState::peer_access).

  // The probe runs only where a reduction can take the staged path: elsewhere it would time a path
  // no collective of this communicator takes.
  const bool probe = chunk_bytes_ == kProbeChunk && n > 1 && !reduces_directly(devices_, path_);
  if (chunk_bytes_ == kProbeChunk) chunk_bytes_ = kDefaultChunkBytes;
  // A chunk holds at least one element of any type.
  impl_->slot_bytes = slot_bytes_for(chunk_bytes_);
  impl_->ranks.resize(static_cast<size_t>(n));
  impl_->posted = std::vector<Impl::Posted>(static_cast<size_t>(n));  // not movable: no resize
  for (int r = 0; r < n; ++r) {
    Impl::Rank& rk = impl_->ranks[r];
    Device& d = *devices_[r];
    rk.producer = d.create_event();
    rk.ready = d.create_event();
    rk.sent = d.create_event();
    rk.done = d.create_event();
    rk.stepped = d.create_event();
    for (auto& e : rk.slot_free) e = d.create_event();
  }
  std::vector<int> all(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) all[static_cast<size_t>(r)] = r;
  impl_->world = group(all).state_;
  impl_->world->is_world = true;
  if (probe) probe_chunking();
}

// Receive buffers are freed into their pool, tied to the comm stream they were allocated on. Every
// peer write into one is followed, on that stream, by a wait for it and the reduction that reads
// it, so reuse of the memory on that stream is ordered after all of it (no host wait needed).
Communicator::~Communicator() = default;

CommGroup Communicator::group(std::vector<int> ranks) {
  ZT_REQUIRE(!ranks.empty(), "Communicator::group: a group needs at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i) {
    ZT_REQUIRE(ranks[i] >= 0 && ranks[i] < world(), "Communicator::group: rank ", ranks[i],
               " of ", ranks_name(ranks), " is not a rank of a ", world(), "-rank communicator");
    for (size_t j = 0; j < i; ++j)
      ZT_REQUIRE(ranks[j] != ranks[i], "Communicator::group: rank ", ranks[i], " appears twice in ",
                 ranks_name(ranks), "; every member must be a different rank");
  }
  std::lock_guard<std::mutex> lock(impl_->groups_mu);
  auto& slot = impl_->groups[ranks];
  if (!slot) {
    auto g = std::make_unique<CommGroupState>();
    g->name = ranks_name(ranks);
    g->counters.resize(ranks.size());
    g->arrivals.resize(ranks.size());
    g->peer_access = true;
    for (int a : ranks)
      for (int b : ranks)
        if (a != b && !devices_[static_cast<size_t>(a)]->can_access_peer(*devices_[static_cast<size_t>(b)]))
          g->peer_access = false;
    g->members = std::move(ranks);
    slot = std::move(g);
  }
  return CommGroup(this, slot.get());
}

CommGroup Communicator::world_group() { return CommGroup(this, impl_->world); }

// ---- schedule building (called with enqueue_mu held) -----------------------------------------

namespace {

// Validates a group call's buffers; returns the plan. `divisible`: numel must split into as many
// equal shards as the group has members. Messages name communicator ranks.
Plan check_buffers(const char* op, const std::vector<Device*>& devices, const CommGroupState& g,
                   const std::vector<TensorView>& bufs, const std::vector<Stream*>& producers,
                   bool divisible, bool floats_only) {
  const int n = static_cast<int>(g.members.size());
  ZT_REQUIRE(static_cast<int>(bufs.size()) == n, op, ": got ", bufs.size(), " buffers for ",
             g.vector_owner(), " (one per rank, indexed by ", g.is_world ? "rank" : "position", ")");
  ZT_REQUIRE(producers.empty() || static_cast<int>(producers.size()) == n, op, ": got ",
             producers.size(), " producer streams for ", n, " ranks (one per rank, or none)");
  Plan p;
  p.world = n;
  p.dtype = bufs[0].dtype;
  p.esize = dtype_size(p.dtype);
  p.numel = bufs[0].numel();
  const int first = g.members[0];
  ZT_REQUIRE(!floats_only || is_float_type(p.dtype), op, ": buffers are ", dtype_name(p.dtype),
             " but must be fp32, fp16 or bf16");
  for (int i = 0; i < n; ++i) {
    const int r = g.members[static_cast<size_t>(i)];
    const Device& dev = *devices[static_cast<size_t>(r)];
    const TensorView& b = bufs[static_cast<size_t>(i)];
    ZT_REQUIRE(b.dtype == p.dtype, op, ": rank ", r, " passes ", dtype_name(b.dtype), " but rank ",
               first, " passes ", dtype_name(p.dtype), " (every rank needs the same dtype)");
    ZT_REQUIRE(b.numel() == p.numel, op, ": rank ", r, " passes ", b.numel(),
               " elements but rank ", first, " passes ", p.numel,
               " (every rank needs the same numel)");
    ZT_REQUIRE(b.data != nullptr || b.numel() == 0, op, ": the buffer of rank ", r,
               " has no data");
    ZT_REQUIRE(b.numel() == 0 || b.device == dev.index(), op, ": the buffer of rank ", r,
               " is on device ", b.device, " but rank ", r, " is ", dev.name(), " (index ",
               dev.index(), ")");
    Stream* prod = producers.empty() ? nullptr : producers[static_cast<size_t>(i)];
    ZT_REQUIRE(prod == nullptr || &prod->device() == &dev, op, ": the producer stream of rank ",
               r, " runs on ", prod ? prod->device().name() : "", " but rank ", r, " is ",
               dev.name(), " (pass a stream of the rank's own device)");
  }
  if (divisible) {
    ZT_REQUIRE(p.numel % n == 0, op, ": ", p.numel, " elements per rank do not split into ", n,
               " equal shards; pad the buffer to a multiple of the ",
               g.is_world ? "world size" : "group size", " (zero/shard_plan.h)");
    p.shard = p.numel / n;
  }
  return p;
}

}  // namespace

// Enqueues the schedules of one group; every member runs with enqueue_mu held. Indices i are
// positions in the group; members[i] is the communicator rank.
struct Communicator::Impl::Builder {
  const std::vector<Device*>& devices;
  Communicator::Impl& impl;
  CommGroupState& group;
  size_t chunk_bytes;

  int world() const { return static_cast<int>(group.members.size()); }
  Device& device(int i) { return *devices[static_cast<size_t>(group.members[static_cast<size_t>(i)])]; }
  Stream& comm(int i) { return device(i).comm(); }
  Communicator::Impl::Rank& rank(int i) { return impl.ranks[static_cast<size_t>(group.members[static_cast<size_t>(i)])]; }
  int next(int i) const { return (i + 1) % world(); }
  int prev(int i) const { return (i + world() - 1) % world(); }
  void count_copy(int from, int to, size_t bytes) {
    rank(from).counters.bytes_sent += bytes;
    rank(to).counters.bytes_received += bytes;
    group.counters[static_cast<size_t>(from)].bytes_sent += bytes;
    group.counters[static_cast<size_t>(to)].bytes_received += bytes;
  }
  void count_collective(int i) {
    ++rank(i).counters.collectives;
    ++group.counters[static_cast<size_t>(i)].collectives;
  }

  // Each comm stream waits for its producer, then marks the point peers may write after.
  void prologue(const std::vector<Stream*>& producers, bool peers_write) {
    for (int r = 0; r < world(); ++r) {
      Stream* prod = producers.empty() ? nullptr : producers[r];
      if (prod != nullptr && prod != &comm(r)) {
        prod->record(*rank(r).producer);
        comm(r).wait(*rank(r).producer);
      }
      if (peers_write) comm(r).record(*rank(r).ready);
    }
  }

  // After the rounds: each rank's comm stream covers the last copy into its memory, then `done`.
  void epilogue(bool received) {
    for (int r = 0; r < world(); ++r) {
      if (received) comm(r).wait(*rank(prev(r)).sent);
      comm(r).record(*rank(r).done);
      count_collective(r);
    }
  }

  void ensure_slots() {
    for (int r = 0; r < world(); ++r) {
      auto& rk = rank(r);
      for (int q = 0; q < impl.recv_slots; ++q) {
        if (rk.slots[q].data() != nullptr) continue;
        rk.slots[q] = DeviceBuffer(device(r).memory(), impl.slot_bytes, comm(r), "comm_recv");
        // The pool may hand out memory that earlier work on this comm stream still uses; the
        // first peer write waits for that work.
        comm(r).record(*rk.slot_free[q]);
      }
    }
  }

  int64_t chunk_elems(const Plan& p) const {
    return std::max<int64_t>(1, static_cast<int64_t>(chunk_bytes / p.esize));
  }

  // Step k: rank r sends its partial of shard (r-k-1) mod N to r+1, which adds it into its own.
  void reduce_scatter(const Plan& p, const std::vector<TensorView>& full) {
    const int n = world();
    if (n == 1 || p.shard == 0) return;
    ensure_slots();
    const int64_t ce = chunk_elems(p);
    const int64_t chunks = (p.shard + ce - 1) / ce;
    for (int k = 0; k < n - 1; ++k) {
      for (int64_t j = 0; j < chunks; ++j) {
        const int64_t off = j * ce;
        const int64_t len = std::min(ce, p.shard - off);
        const size_t bytes = static_cast<size_t>(len) * p.esize;
        const int q = static_cast<int>(impl.round % static_cast<uint64_t>(impl.recv_slots));
        ++impl.round;
        for (int r = 0; r < n; ++r) {
          const int dst = next(r);
          const int s = ((r - k - 1) % n + n) % n;
          comm(r).wait(*rank(dst).slot_free[q]);
          comm(r).copy_peer(device(dst), rank(dst).slots[q].data(),
                            byte_ptr(full[r]) + static_cast<size_t>(s * p.shard + off) * p.esize,
                            bytes);
          comm(r).record(*rank(r).sent);
          count_copy(r, dst, bytes);
        }
        for (int r = 0; r < n; ++r) {
          const int src = prev(r);
          const int s = ((src - k - 1) % n + n) % n;
          const int dev = device(r).index();
          TensorView own{byte_ptr(full[r]) + static_cast<size_t>(s * p.shard + off) * p.esize,
                         p.dtype, Shape{len}, dev};
          ConstTensorView incoming{rank(r).slots[q].data(), p.dtype, Shape{len}, dev};
          comm(r).wait(*rank(src).sent);
          ops::accumulate(comm(r), own, incoming);
          comm(r).record(*rank(r).slot_free[q]);
        }
      }
    }
  }

  // Direct path (notes at the top): step k, rank r adds shard (r-k-2) mod N of r-1's buffer, read
  // in place, into its own. Ends with every rank's comm stream after its successor's last read of
  // its buffer, so whatever the stream does next may overwrite it.
  void reduce_scatter_direct(const Plan& p, const std::vector<TensorView>& full) {
    const int n = world();
    if (n == 1 || p.shard == 0) return;
    const size_t bytes = static_cast<size_t>(p.shard) * p.esize;
    for (int k = 0; k < n - 1; ++k) {
      // All records of the step before any wait on them (notes at the top); at k = 0 the record
      // follows the prologue's wait for the producer.
      for (int r = 0; r < n; ++r) comm(r).record(*rank(r).stepped);
      for (int r = 0; r < n; ++r) {
        const int src = prev(r);
        const int s = ((src - k - 1) % n + n) % n;
        const size_t at = static_cast<size_t>(s) * bytes;
        comm(r).wait(*rank(src).stepped);
        ops::accumulate_peer(comm(r), TensorView{byte_ptr(full[r]) + at, p.dtype, Shape{p.shard}, device(r).index()},
                             ConstTensorView{byte_ptr(full[src]) + at, p.dtype, Shape{p.shard}, device(src).index()});
        count_copy(src, r, bytes);
      }
    }
    for (int r = 0; r < n; ++r) comm(r).record(*rank(r).stepped);
    for (int r = 0; r < n; ++r) comm(r).wait(*rank(next(r)).stepped);
  }

  // Direct path: rank r copies its shard into rank r+k+1's buffer at step k, after that rank's
  // `ready`; one copy per step. epilogue_direct() orders each receiver after all its senders.
  void all_gather_direct(const Plan& p, const std::vector<TensorView>& full) {
    const int n = world();
    if (n == 1 || p.shard == 0) return;
    const size_t bytes = static_cast<size_t>(p.shard) * p.esize;
    for (int r = 0; r < n; ++r) {
      const size_t at = static_cast<size_t>(r) * bytes;
      for (int k = 0; k < n - 1; ++k) {
        const int dst = (r + k + 1) % n;
        comm(r).wait(*rank(dst).ready);
        comm(r).copy_peer(device(dst), byte_ptr(full[dst]) + at, byte_ptr(full[r]) + at, bytes);
        count_copy(r, dst, bytes);
      }
      comm(r).record(*rank(r).sent);
    }
  }

  // After all_gather_direct: each rank's comm stream covers every copy into its buffer, then `done`.
  void epilogue_direct(bool received) {
    for (int r = 0; r < world(); ++r) {
      if (received)
        for (int q = 0; q < world(); ++q)
          if (q != r) comm(r).wait(*rank(q).sent);
      comm(r).record(*rank(r).done);
      count_collective(r);
    }
  }

  // Step k: rank r forwards shard (r-k) mod N to r+1, straight into r+1's buffer.
  void all_gather(const Plan& p, const std::vector<TensorView>& full) {
    const int n = world();
    if (n == 1 || p.shard == 0) return;
    const int64_t ce = chunk_elems(p);
    const int64_t chunks = (p.shard + ce - 1) / ce;
    for (int k = 0; k < n - 1; ++k) {
      for (int64_t j = 0; j < chunks; ++j) {
        const int64_t off = j * ce;
        const int64_t len = std::min(ce, p.shard - off);
        const size_t bytes = static_cast<size_t>(len) * p.esize;
        // All waits of the round before any record of `sent` (see the notes at the top). From
        // step 1 on, the chunk being forwarded arrived from r-1: its latest `sent` covers it.
        for (int r = 0; r < n; ++r) {
          if (k == 0 && j == 0) comm(r).wait(*rank(next(r)).ready);
          if (k > 0) comm(r).wait(*rank(prev(r)).sent);
        }
        for (int r = 0; r < n; ++r) {
          const int dst = next(r);
          const int s = ((r - k) % n + n) % n;
          const size_t at = static_cast<size_t>(s * p.shard + off) * p.esize;
          comm(r).copy_peer(device(dst), byte_ptr(full[dst]) + at, byte_ptr(full[r]) + at, bytes);
          comm(r).record(*rank(r).sent);
          count_copy(r, dst, bytes);
        }
      }
    }
  }

  // A chain root, root+1, ..., root-1 (positions); chunk-major so that chunk j+1 leaves root while
  // chunk j is one hop further.
  void broadcast(int root, size_t nbytes, const std::vector<TensorView>& bufs) {
    const int n = world();
    if (n == 1 || nbytes == 0) return;
    const size_t cb = chunk_bytes;
    const size_t chunks = (nbytes + cb - 1) / cb;
    for (size_t j = 0; j < chunks; ++j) {
      const size_t off = j * cb;
      const size_t bytes = std::min(cb, nbytes - off);
      for (int h = 0; h < n - 1; ++h) {
        const int from = (root + h) % n;
        const int to = next(from);
        if (j == 0) comm(from).wait(*rank(to).ready);
        if (h > 0) comm(from).wait(*rank(prev(from)).sent);
        comm(from).copy_peer(device(to), byte_ptr(bufs[to]) + off, byte_ptr(bufs[from]) + off,
                             bytes);
        comm(from).record(*rank(from).sent);
        count_copy(from, to, bytes);
      }
    }
  }
};

// ---- group calls -----------------------------------------------------------------------------

void Communicator::group_call(CommGroupState& g, Kind kind, int root, const std::vector<TensorView>& bufs,
                              const std::vector<Stream*>& producers) {
  const char* op = kind_name(static_cast<uint8_t>(kind));
  int root_pos = 0;
  if (kind == Kind::kBroadcast) {
    root_pos = g.index_of(root);
    if (g.is_world)
      ZT_REQUIRE(root_pos >= 0, "broadcast: root ", root, " is not a rank of a ", world(),
                 "-rank communicator");
    else
      ZT_REQUIRE(root_pos >= 0, "broadcast: root ", root, " is not a member of group ", g.name);
  }
  const bool reduces = kind != Kind::kBroadcast;
  const Plan p = check_buffers(op, devices_, g, bufs, producers, reduces, reduces);
  const size_t nbytes = static_cast<size_t>(p.numel) * p.esize;
  const GroupRange range(op, static_cast<int64_t>(nbytes));
  // The direct path where every member reaches every other's memory (and, for reductions, the
  // backend reads a peer's memory in its accumulate); the staged ring otherwise.
  const bool direct_copy = path_ == CommPath::kAuto && g.peer_access;
  const OpTable* table = op_table(devices_[static_cast<size_t>(g.members[0])]->backend());
  const bool direct_reduce =
      reduces && direct_copy && table != nullptr && table->supports(OpId::kAccumulatePeer, {p.dtype});
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  Impl::Builder b{devices_, *impl_, g, chunk_bytes_};
  const int n = b.world();
  const auto reduce = [&] {
    if (direct_reduce)
      b.reduce_scatter_direct(p, bufs);
    else
      b.reduce_scatter(p, bufs);
  };
  const auto gather = [&](bool moves) {
    if (direct_copy) {
      b.all_gather_direct(p, bufs);
      b.epilogue_direct(moves);
    } else {
      b.all_gather(p, bufs);
      b.epilogue(moves);
    }
  };
  switch (kind) {
    case Kind::kReduceScatter:
      b.prologue(producers, /*peers_write=*/false);
      reduce();
      b.epilogue(/*received=*/false);
      break;
    case Kind::kAllGather: {
      const bool moves = n > 1 && p.shard > 0;
      b.prologue(producers, moves);
      gather(moves);
      break;
    }
    case Kind::kAllReduce: {
      const bool moves = n > 1 && p.shard > 0;
      b.prologue(producers, /*peers_write=*/false);
      reduce();
      // Peers overwrite the partial sums of the other shards only after each rank's reduction
      // (and, on the direct path, after its successor's last read of them).
      if (moves)
        for (int i = 0; i < n; ++i) b.comm(i).record(*b.rank(i).ready);
      gather(moves);
      break;
    }
    case Kind::kBroadcast: {
      const bool moves = n > 1 && nbytes > 0;
      b.prologue(producers, moves);
      b.broadcast(root_pos, nbytes, bufs);
      // Every member but root waits for its predecessor's last copy; root received nothing.
      for (int i = 0; i < n; ++i) {
        if (moves && i != root_pos) b.comm(i).wait(*b.rank(b.prev(i)).sent);
        b.comm(i).record(*b.rank(i).done);
        b.count_collective(i);
      }
      break;
    }
  }
}

void Communicator::reduce_scatter(const std::vector<TensorView>& full,
                                  const std::vector<Stream*>& producers) {
  group_call(*impl_->world, Kind::kReduceScatter, 0, full, producers);
}

void Communicator::all_gather(const std::vector<TensorView>& full,
                              const std::vector<Stream*>& producers) {
  group_call(*impl_->world, Kind::kAllGather, 0, full, producers);
}

void Communicator::all_reduce(const std::vector<TensorView>& full,
                              const std::vector<Stream*>& producers) {
  group_call(*impl_->world, Kind::kAllReduce, 0, full, producers);
}

void Communicator::broadcast(int root, const std::vector<TensorView>& bufs,
                             const std::vector<Stream*>& producers) {
  group_call(*impl_->world, Kind::kBroadcast, root, bufs, producers);
}

// ---- per-rank calls --------------------------------------------------------------------------

void Communicator::reduce_scatter(int rank, TensorView full, Stream* producer, std::string_view tag) {
  rank_call(*impl_->world, rank, Kind::kReduceScatter, 0, full, producer, tag);
}

void Communicator::all_gather(int rank, TensorView full, Stream* producer, std::string_view tag) {
  rank_call(*impl_->world, rank, Kind::kAllGather, 0, full, producer, tag);
}

void Communicator::all_reduce(int rank, TensorView full, Stream* producer, std::string_view tag) {
  rank_call(*impl_->world, rank, Kind::kAllReduce, 0, full, producer, tag);
}

void Communicator::rank_call(CommGroupState& g, int rank, Kind kind, int root, TensorView full,
                             Stream* producer, std::string_view tag) {
  const int n = static_cast<int>(g.members.size());
  const uint8_t kind_id = static_cast<uint8_t>(kind);
  ZT_REQUIRE(rank >= 0 && rank < world(), kind_name(kind_id), ": rank ", rank,
             " is not a rank of a ", world(), "-rank communicator");
  const int pos = g.index_of(rank);
  ZT_REQUIRE(pos >= 0, kind_name(kind_id), ": rank ", rank, " is not a member of group ", g.name);
  // The range covers the rendezvous too: time a rank spends waiting for the others shows here.
  std::optional<NvtxRange> range;
  if (ranges_enabled())
    range.emplace(NvtxCategory::kCollective,
                  collective_label(kind_name(kind_id), tag, full.numel() * static_cast<int64_t>(dtype_size(full.dtype))),
                  devices_[rank]->index());
  const InRankCall in_rank_call;
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lock(im.rv_mu);
  if (im.aborted)
    ZT_THROW(ErrorKind::kDevice, kind_name(kind_id), " on rank ", rank, " abandoned: ", im.abort_reason);
  CommGroupState::Arrival& mine = g.arrivals[static_cast<size_t>(pos)];
  ZT_REQUIRE(!mine.arrived, kind_name(kind_id), ": rank ", rank,
             " called while its previous collective (call #", g.generation,
             g.is_world ? "" : " of group " + g.name,
             ") still waits for the other ranks; use one host thread per rank");
  mine = CommGroupState::Arrival{true, kind_id, root, full, producer};
  const uint64_t my_generation = g.generation;
  if (++g.arrived < n) {
    im.rv_cv.wait(lock, [&] { return g.generation != my_generation || im.aborted; });
    if (g.generation == my_generation) {  // aborted while waiting for the other ranks
      mine = CommGroupState::Arrival{};
      --g.arrived;
      ZT_THROW(ErrorKind::kDevice, kind_name(kind_id), " on rank ", rank, " abandoned: ", im.abort_reason);
    }
    if (g.generation_error.set) g.generation_error.raise();
    return;
  }

  // The last member to arrive: check that the calls match, then enqueue for everybody.
  StoredError error;
  try {
    const CommGroupState::Arrival& first = g.arrivals[0];
    const auto call = [](const CommGroupState::Arrival& a) {
      std::string s = std::string(kind_name(a.kind)) + "(";
      if (a.kind == static_cast<uint8_t>(Kind::kBroadcast)) s += "root " + std::to_string(a.root) + ", ";
      return s + std::to_string(a.full.numel()) + " x " + dtype_name(a.full.dtype) + ")";
    };
    for (int i = 1; i < n; ++i) {
      const CommGroupState::Arrival& a = g.arrivals[static_cast<size_t>(i)];
      ZT_REQUIRE(a.kind == first.kind && a.root == first.root &&
                     a.full.numel() == first.full.numel() && a.full.dtype == first.full.dtype,
                 "collective mismatch at call #", my_generation,
                 g.is_world ? "" : " of group " + g.name, ": rank ", g.members[0], " called ",
                 call(first), " but rank ", g.members[static_cast<size_t>(i)], " called ", call(a),
                 "; every rank must issue the same collectives in the same order");
    }
    std::vector<TensorView> bufs(static_cast<size_t>(n));
    std::vector<Stream*> producers(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      bufs[static_cast<size_t>(i)] = g.arrivals[static_cast<size_t>(i)].full;
      producers[static_cast<size_t>(i)] = g.arrivals[static_cast<size_t>(i)].producer;
    }
    group_call(g, static_cast<Kind>(first.kind), first.root, bufs, producers);
  } catch (...) {
    error.capture(std::current_exception());
  }
  for (auto& a : g.arrivals) a = CommGroupState::Arrival{};
  g.arrived = 0;
  g.generation_error = error;
  ++g.generation;
  lock.unlock();
  im.rv_cv.notify_all();
  if (error.set) error.raise();
}

// ---- point-to-point --------------------------------------------------------------------------

namespace {

void check_transfer(const char* op, const std::vector<Device*>& devices, int src, const ConstTensorView& from,
                    int dst, const TensorView& to) {
  const int n = static_cast<int>(devices.size());
  ZT_REQUIRE(src >= 0 && src < n, op, ": rank ", src, " is not a rank of a ", n, "-rank communicator");
  ZT_REQUIRE(dst >= 0 && dst < n, op, ": rank ", dst, " is not a rank of a ", n, "-rank communicator");
  ZT_REQUIRE(src != dst, op, ": rank ", src, " cannot send to itself (use a copy on its own stream)");
  ZT_REQUIRE(from.dtype == to.dtype && from.numel() == to.numel(), op, ": rank ", src, " sends ",
             from.numel(), " x ", dtype_name(from.dtype), " but rank ", dst, " receives ", to.numel(),
             " x ", dtype_name(to.dtype), " (both sides need the same dtype and numel)");
  ZT_REQUIRE(from.numel() == 0 || (from.data != nullptr && from.device == devices[src]->index()),
             op, ": the send buffer of rank ", src, " is not on ", devices[src]->name());
  ZT_REQUIRE(to.numel() == 0 || (to.data != nullptr && to.device == devices[dst]->index()), op,
             ": the receive buffer of rank ", dst, " is not on ", devices[dst]->name());
}

void check_producer(const char* op, const std::vector<Device*>& devices, int rank, Stream* prod) {
  ZT_REQUIRE(prod == nullptr || &prod->device() == devices[rank], op, ": the producer stream of rank ",
             rank, " runs on ", prod ? prod->device().name() : "", " but rank ", rank, " is ",
             devices[rank]->name(), " (pass a stream of the rank's own device)");
}

}  // namespace

void Communicator::transfer(const std::vector<Transfer>& transfers, const std::vector<Stream*>& producers) {
  ZT_REQUIRE(producers.empty() || static_cast<int>(producers.size()) == world(), "transfer: got ",
             producers.size(), " producer streams for ", world(), " ranks (one per rank, or none)");
  for (int r = 0; r < static_cast<int>(producers.size()); ++r) check_producer("transfer", devices_, r, producers[r]);
  std::vector<Copy> copies;
  for (const Transfer& t : transfers) {
    check_transfer("transfer", devices_, t.src, t.from, t.dst, t.to);
    Copy c{t.src, t.dst, static_cast<const char*>(t.from.data), static_cast<char*>(t.to.data),
           static_cast<size_t>(t.from.numel()) * dtype_size(t.from.dtype),
           producers.empty() ? nullptr : producers[t.src], producers.empty() ? nullptr : producers[t.dst]};
    copies.push_back(c);
  }
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  impl_->enqueue_copies(devices_, copies);
}

// Enqueues copies by the peer-copy rule (see the notes at the top of the header), with enqueue_mu
// held. All records of `ready` before any copy, all copies before the receivers' waits on `sent`:
// so every wait captures a record enqueued before it (no cycle), and a later record of the same
// event only covers more work of the same stream.
void Communicator::Impl::enqueue_copies(const std::vector<Device*>& devices, const std::vector<Copy>& copies) {
  std::vector<char> involved(devices.size(), 0);
  const auto after_producer = [&](int r, Stream* prod) {
    Stream& comm = devices[r]->comm();
    if (prod != nullptr && prod != &comm) {
      prod->record(*ranks[r].producer);
      comm.wait(*ranks[r].producer);
    }
  };
  const auto source_stream = [&](const Copy& c) -> Stream& {
    return c.src_copied != nullptr ? link(devices, c.src, c.dst) : devices[c.src]->comm();
  };
  for (const Copy& c : copies) {
    if (c.src_posted != nullptr)
      source_stream(c).wait(*c.src_posted);
    else
      after_producer(c.src, c.src_producer);
    after_producer(c.dst, c.dst_producer);
    devices[c.dst]->comm().record(*ranks[c.dst].ready);
    involved[c.dst] = 1;
    if (c.src_copied == nullptr) involved[c.src] = 1;  // a posted send's side is its link stream
  }
  for (const Copy& c : copies) {
    Stream& comm = source_stream(c);
    if (c.bytes > 0) {
      comm.wait(*ranks[c.dst].ready);
      comm.copy_peer(*devices[c.dst], c.to, c.from, c.bytes);
      comm.record(*ranks[c.src].sent);
      if (c.src_copied != nullptr) comm.record(*c.src_copied);
    }
    ranks[c.src].counters.bytes_sent += c.bytes;
    ranks[c.dst].counters.bytes_received += c.bytes;
    ++ranks[c.src].counters.transfers;
    ++ranks[c.dst].counters.transfers;
  }
  for (const Copy& c : copies)
    if (c.bytes > 0) devices[c.dst]->comm().wait(*ranks[c.src].sent);
  for (size_t r = 0; r < devices.size(); ++r)
    if (involved[r]) devices[r]->comm().record(*ranks[r].done);
}

void Communicator::send(int rank, int peer, ConstTensorView buf, Stream* producer) {
  P2POp op{true, rank, peer, TensorView{const_cast<void*>(buf.data), buf.dtype, buf.shape, buf.device}, producer};
  p2p_call(rank, &op, 1);
}

void Communicator::recv(int rank, int peer, TensorView buf, Stream* producer) {
  P2POp op{false, peer, rank, buf, producer};
  p2p_call(rank, &op, 1);
}

void Communicator::send_recv(int rank, int send_to, ConstTensorView send_buf, int recv_from,
                             TensorView recv_buf, Stream* producer) {
  P2POp ops[2] = {
      P2POp{true, rank, send_to, TensorView{const_cast<void*>(send_buf.data), send_buf.dtype, send_buf.shape, send_buf.device}, producer},
      P2POp{false, recv_from, rank, recv_buf, producer}};
  p2p_call(rank, ops, 2);
}

void Communicator::p2p_call(int rank, P2POp* ops, int count) {
  const int n = world();
  for (int k = 0; k < count; ++k) {
    const P2POp& op = ops[k];
    const char* name = op.is_send ? "send" : "recv";
    ZT_REQUIRE(rank >= 0 && rank < n, name, ": rank ", rank, " is not a rank of a ", n, "-rank communicator");
    const int peer = op.is_send ? op.dst : op.src;
    ZT_REQUIRE(peer >= 0 && peer < n, name, ": peer ", peer, " of rank ", rank, " is not a rank of a ", n,
               "-rank communicator");
    ZT_REQUIRE(peer != rank, name, ": rank ", rank, " cannot ", op.is_send ? "send to" : "receive from",
               " itself (use a copy on its own stream)");
    ZT_REQUIRE(op.buf.numel() == 0 || (op.buf.data != nullptr && op.buf.device == devices_[rank]->index()),
               name, ": the buffer of rank ", rank, " is not on ", devices_[rank]->name());
    check_producer(name, devices_, rank, op.producer);
  }
  std::optional<NvtxRange> range;
  if (ranges_enabled())
    range.emplace(NvtxCategory::kCollective,
                  collective_label(count == 2 ? "send_recv" : ops[0].is_send ? "send" : "recv", {},
                                   ops[0].buf.numel() * static_cast<int64_t>(dtype_size(ops[0].buf.dtype))),
                  devices_[rank]->index());
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lock(im.rv_mu);
  if (im.aborted)
    ZT_THROW(ErrorKind::kDevice, ops[0].is_send ? "send" : "recv", " on rank ", rank, " abandoned: ", im.abort_reason);
  for (int k = 0; k < count; ++k) {
    P2POp* op = &ops[k];
    const auto key = std::make_pair(op->src, op->dst);
    auto& others = op->is_send ? im.pending_recvs[key] : im.pending_sends[key];
    if (others.empty()) {
      (op->is_send ? im.pending_sends[key] : im.pending_recvs[key]).push_back(op);
      continue;
    }
    P2POp* other = others.front();
    others.pop_front();
    if (op->is_send)
      match(op, other);
    else
      match(other, op);
  }
  im.rv_cv.notify_all();
  const auto all_done = [&] {
    for (int k = 0; k < count; ++k)
      if (!ops[k].done) return false;
    return true;
  };
  im.rv_cv.wait(lock, [&] { return all_done() || im.aborted; });
  if (!all_done()) {  // aborted: withdraw what no peer matched, so nobody matches it later
    for (int k = 0; k < count; ++k) {
      if (ops[k].done) continue;
      const auto key = std::make_pair(ops[k].src, ops[k].dst);
      auto& q = ops[k].is_send ? im.pending_sends[key] : im.pending_recvs[key];
      q.erase(std::remove(q.begin(), q.end(), &ops[k]), q.end());
    }
    ZT_THROW(ErrorKind::kDevice, ops[0].is_send ? "send" : "recv", " on rank ", rank, " abandoned: ", im.abort_reason);
  }
  for (int k = 0; k < count; ++k)
    if (ops[k].error.set) ops[k].error.raise();
}

// Enqueues a matched pair's copy, with rv_mu held; errors go to both halves.
void Communicator::match(P2POp* s, P2POp* r) {
  Impl& im = *impl_;
  StoredError error;
  try {
    check_transfer("send/recv", devices_, s->src, s->buf, r->dst, r->buf);
    Copy c{s->src, r->dst, static_cast<const char*>(s->buf.data), static_cast<char*>(r->buf.data),
           static_cast<size_t>(s->buf.numel()) * dtype_size(s->buf.dtype), s->producer, r->producer};
    if (s->ticket != 0) {
      c.src_producer = nullptr;
      c.src_posted = s->event.get();
      c.src_copied = s->event.get();
    }
    std::lock_guard<std::mutex> enqueue_lock(im.enqueue_mu);
    im.enqueue_copies(devices_, {c});
    s->copy_recorded = s->ticket != 0 && c.bytes > 0;
  } catch (...) {
    error.capture(std::current_exception());
  }
  s->error = r->error = error;
  s->done = r->done = true;
  if (s->ticket != 0 && !error.set) {
    Impl::Posted& p = im.posted[static_cast<size_t>(s->src)];
    p.completed.push_back(s->ticket);
    if (p.completed.size() > kMaxUnwaitedSends) im.forget(s->src, p.completed.front());
  }
}

// Drops a posted send's record (after wait_send, or when too many were never waited for).
void Communicator::Impl::forget(int rank, uint64_t ticket) {
  Posted& p = posted[static_cast<size_t>(rank)];
  const auto it = p.live.find(ticket);
  if (it == p.live.end()) return;
  const auto c = std::find(p.completed.begin(), p.completed.end(), ticket);
  if (c != p.completed.end()) p.completed.erase(c);
  p.free_events.push_back(std::move(it->second->event));
  p.live.erase(it);
}

uint64_t Communicator::isend(int rank, int peer, ConstTensorView buf, Stream* producer) {
  const int n = world();
  ZT_REQUIRE(rank >= 0 && rank < n, "isend: rank ", rank, " is not a rank of a ", n, "-rank communicator");
  ZT_REQUIRE(peer >= 0 && peer < n, "isend: peer ", peer, " of rank ", rank, " is not a rank of a ", n,
             "-rank communicator");
  ZT_REQUIRE(peer != rank, "isend: rank ", rank, " cannot send to itself (use a copy on its own stream)");
  ZT_REQUIRE(buf.numel() == 0 || (buf.data != nullptr && buf.device == devices_[rank]->index()),
             "isend: the buffer of rank ", rank, " is not on ", devices_[rank]->name());
  check_producer("isend", devices_, rank, producer);
  std::optional<NvtxRange> range;
  if (ranges_enabled())
    range.emplace(NvtxCategory::kCollective,
                  collective_label("isend", {}, buf.numel() * static_cast<int64_t>(dtype_size(buf.dtype))),
                  devices_[rank]->index());
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lock(im.rv_mu);
  if (im.aborted) ZT_THROW(ErrorKind::kDevice, "isend on rank ", rank, " abandoned: ", im.abort_reason);
  Impl::Posted& p = im.posted[static_cast<size_t>(rank)];
  auto op = std::make_unique<P2POp>(true, rank, peer,
                                    TensorView{const_cast<void*>(buf.data), buf.dtype, buf.shape, buf.device},
                                    nullptr);
  op->ticket = p.next_ticket++;
  if (p.free_events.empty()) {
    op->event = devices_[rank]->create_event();
  } else {
    op->event = std::move(p.free_events.back());
    p.free_events.pop_back();
  }
  // The copy is enqueued on the link stream later; the record of what it must follow is taken
  // now: at match time the producer may hold later work (even work that waits for this copy).
  {
    std::lock_guard<std::mutex> enqueue_lock(im.enqueue_mu);  // other threads enqueue on comm
    (producer != nullptr ? *producer : devices_[rank]->comm()).record(*op->event);
  }
  P2POp* raw = op.get();
  const uint64_t ticket = raw->ticket;
  p.live.emplace(ticket, std::move(op));
  auto& recvs = im.pending_recvs[std::make_pair(rank, peer)];
  if (recvs.empty()) {
    im.pending_sends[std::make_pair(rank, peer)].push_back(raw);
    return ticket;
  }
  P2POp* r = recvs.front();
  recvs.pop_front();
  match(raw, r);
  lock.unlock();
  im.rv_cv.notify_all();
  return ticket;
}

void Communicator::wait_send(int rank, uint64_t ticket, Stream& consumer) {
  ZT_REQUIRE(rank >= 0 && rank < world(), "wait_send: rank ", rank, " is not a rank of a ", world(),
             "-rank communicator");
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lock(im.rv_mu);
  Impl::Posted& p = im.posted[static_cast<size_t>(rank)];
  ZT_REQUIRE(ticket >= 1 && ticket < p.next_ticket, "wait_send: ", ticket, " is not a ticket of rank ", rank,
             " (isend returns them; rank ", rank, " posted ", p.next_ticket - 1, " sends)");
  const auto it = p.live.find(ticket);
  if (it == p.live.end()) {
    // Waited for already, or forgotten: the rank's newest copy record covers that copy too.
    std::lock_guard<std::mutex> enqueue_lock(im.enqueue_mu);
    consumer.wait(*im.ranks[static_cast<size_t>(rank)].sent);
    return;
  }
  P2POp* op = it->second.get();
  im.rv_cv.wait(lock, [&] { return op->done || im.aborted; });
  if (!op->done)
    ZT_THROW(ErrorKind::kDevice, "wait_send on rank ", rank, " (isend to rank ", op->dst, ") abandoned: ",
             im.abort_reason);
  if (op->error.set) {
    const StoredError error = op->error;
    im.forget(rank, ticket);
    error.raise();
  }
  if (op->copy_recorded) {
    std::lock_guard<std::mutex> enqueue_lock(im.enqueue_mu);
    consumer.wait(*op->event);
  }
  im.forget(rank, ticket);
}

void Communicator::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(impl_->rv_mu);
    if (!impl_->aborted) impl_->abort_reason = why;
    impl_->aborted = true;
  }
  impl_->rv_cv.notify_all();
}

bool Communicator::aborted() const {
  std::lock_guard<std::mutex> lock(impl_->rv_mu);
  return impl_->aborted;
}

// ---- groups ----------------------------------------------------------------------------------

const detail::CommGroupState& CommGroup::state() const {
  ZT_REQUIRE(state_ != nullptr, "CommGroup: an empty handle (get groups from Communicator::group)");
  return *state_;
}
int CommGroup::size() const { return static_cast<int>(state().members.size()); }
const std::vector<int>& CommGroup::ranks() const { return state().members; }
int CommGroup::index_of(int rank) const { return state().index_of(rank); }
const std::string& CommGroup::name() const { return state().name; }

void CommGroup::reduce_scatter(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const {
  state();
  comm_->group_call(*state_, Communicator::Kind::kReduceScatter, 0, full, producers);
}
void CommGroup::all_gather(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const {
  state();
  comm_->group_call(*state_, Communicator::Kind::kAllGather, 0, full, producers);
}
void CommGroup::all_reduce(const std::vector<TensorView>& full, const std::vector<Stream*>& producers) const {
  state();
  comm_->group_call(*state_, Communicator::Kind::kAllReduce, 0, full, producers);
}
void CommGroup::broadcast(int root, const std::vector<TensorView>& bufs, const std::vector<Stream*>& producers) const {
  state();
  comm_->group_call(*state_, Communicator::Kind::kBroadcast, root, bufs, producers);
}
void CommGroup::reduce_scatter(int rank, TensorView full, Stream* producer, std::string_view tag) const {
  state();
  comm_->rank_call(*state_, rank, Communicator::Kind::kReduceScatter, 0, full, producer, tag);
}
void CommGroup::all_gather(int rank, TensorView full, Stream* producer, std::string_view tag) const {
  state();
  comm_->rank_call(*state_, rank, Communicator::Kind::kAllGather, 0, full, producer, tag);
}
void CommGroup::all_reduce(int rank, TensorView full, Stream* producer, std::string_view tag) const {
  state();
  comm_->rank_call(*state_, rank, Communicator::Kind::kAllReduce, 0, full, producer, tag);
}
void CommGroup::broadcast(int rank, int root, TensorView buf, Stream* producer, std::string_view tag) const {
  state();
  comm_->rank_call(*state_, rank, Communicator::Kind::kBroadcast, root, buf, producer, tag);
}

CommCounters CommGroup::counters(int rank) const {
  const int pos = state().index_of(rank);
  ZT_REQUIRE(pos >= 0, "counters: rank ", rank, " is not a member of group ", state_->name);
  std::lock_guard<std::mutex> lock(comm_->impl_->enqueue_mu);
  return state_->counters[static_cast<size_t>(pos)];
}

// ---- completion and accounting ---------------------------------------------------------------

void Communicator::wait_done(int rank, Stream& consumer) {
  ZT_REQUIRE(rank >= 0 && rank < world(), "wait_done: rank ", rank, " is not a rank of a ",
             world(), "-rank communicator");
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  consumer.wait(*impl_->ranks[rank].done);
}

CommCounters Communicator::counters(int rank) const {
  ZT_REQUIRE(rank >= 0 && rank < world(), "counters: rank ", rank, " is not a rank of a ",
             world(), "-rank communicator");
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  return impl_->ranks[rank].counters;
}

bool Communicator::reduces_directly(const std::vector<Device*>& devices, CommPath path) {
  if (path != CommPath::kAuto || devices.empty()) return false;
  const OpTable* table = op_table(devices[0]->backend());
  if (table == nullptr) return false;
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16})
    if (!table->supports(OpId::kAccumulatePeer, {t})) return false;
  for (const Device* a : devices)
    for (const Device* b : devices)
      if (a != b && !a->can_access_peer(*b)) return false;
  return true;
}

size_t Communicator::planned_buffer_bytes(int world, size_t chunk_bytes) {
  if (chunk_bytes == kProbeChunk) return world > 1 ? kRecvBudgetBytes : 0;  // every choice holds the budget
  return world > 1 ? static_cast<size_t>(kRecvSlots) * slot_bytes_for(chunk_bytes) : 0;
}

int Communicator::recv_slots() const {
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  return impl_->recv_slots;
}

// Times one staged reduce-scatter per choice (after an untimed one that allocates its slots) on
// the world, over fp32 buffers of world x kProbeShardBytes per rank, host clock from the enqueue
// to every comm stream's end; keeps the fastest, a smaller chunk only when 5% faster. Nothing of
// it is observable afterwards but the choice: slots and buffers are freed, counters zeroed.
void Communicator::probe_chunking() {
  const int n = world();
  Plan p;
  p.world = n;
  p.dtype = DType::kF32;
  p.esize = sizeof(float);
  p.shard = static_cast<int64_t>(kProbeShardBytes / sizeof(float));
  p.numel = p.shard * n;
  std::vector<DeviceBuffer> bufs;
  std::vector<TensorView> views;
  for (int r = 0; r < n; ++r) {
    Device& d = *devices_[static_cast<size_t>(r)];
    bufs.emplace_back(d.memory(), static_cast<size_t>(p.numel) * p.esize, d.comm(), "comm_probe");
    d.comm().memset(bufs.back().data(), 0, bufs.back().size());
    views.push_back(TensorView{bufs.back().data(), p.dtype, Shape{p.numel}, d.index()});
  }
  auto free_slots = [&] {
    for (auto& rk : impl_->ranks)
      for (auto& slot : rk.slots) slot = DeviceBuffer{};
  };
  auto run = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
      Impl::Builder b{devices_, *impl_, *impl_->world, chunk_bytes_};
      b.prologue({}, /*peers_write=*/false);
      b.reduce_scatter(p, views);
      b.epilogue(/*received=*/false);
    }
    for (Device* d : devices_) d->comm().synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double best = 0;
  std::pair<size_t, int> chosen = kProbeChoices[0];
  for (const auto& choice : kProbeChoices) {
    free_slots();
    chunk_bytes_ = choice.first;
    impl_->slot_bytes = slot_bytes_for(chunk_bytes_);
    impl_->recv_slots = choice.second;
    run();  // allocates this choice's slots and warms the links
    const double t = run();
    if (best == 0 || t < 0.95 * best) best = t, chosen = choice;
  }
  free_slots();
  chunk_bytes_ = chosen.first;
  impl_->slot_bytes = slot_bytes_for(chunk_bytes_);
  impl_->recv_slots = chosen.second;
  impl_->round = 0;
  reset_counters();
  for (auto& g : impl_->groups) std::fill(g.second->counters.begin(), g.second->counters.end(), CommCounters{});
  probed_ = true;
}

size_t Communicator::buffer_bytes(int rank) const {
  ZT_REQUIRE(rank >= 0 && rank < world(), "buffer_bytes: rank ", rank, " is not a rank of a ", world(),
             "-rank communicator");
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  size_t n = 0;
  for (const auto& slot : impl_->ranks[rank].slots) n += slot.size();
  return n;
}

void Communicator::reset_counters() {
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  for (auto& r : impl_->ranks) r.counters = CommCounters{};
}

}  // namespace zt
