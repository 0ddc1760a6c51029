// Ring collectives over peer copies (see communicator.h for the contract): the schedules, the
// group and per-rank calls, and the probe that picks the staged ring's chunking. The host builds the
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
#include "comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "comm/communicator_impl.h"

namespace zt {

namespace {

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

}  // namespace

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
      reduces && direct_copy && table != nullptr && table->has_entry(OpId::kAccumulatePeer);
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

}  // namespace zt
