// Ring collectives over peer copies (see communicator.h for the contract). The host builds the
// whole schedule of a collective at once, for every rank, under one lock; nothing here waits for
// device work.
//
// Design notes:
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
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "core/format.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "kernels/ops.h"
#include "memory/caching_allocator.h"

namespace zt {

enum class Communicator::Kind : uint8_t { kReduceScatter, kAllGather, kAllReduce };

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

// A validated call: sizes shared by every rank.
struct Plan {
  int world = 0;
  DType dtype = DType::kF32;
  size_t esize = 0;
  int64_t numel = 0;  // per rank
  int64_t shard = 0;  // numel / world
};

}  // namespace

struct Communicator::Impl {
  struct Rank {
    std::unique_ptr<Event> producer;  // recorded on the caller's producer stream
    std::unique_ptr<Event> ready;     // comm stream reached the collective: peers may write here
    std::unique_ptr<Event> sent;      // after each peer copy this rank issues
    std::unique_ptr<Event> done;      // after the last collective touching this rank
    std::array<std::unique_ptr<Event>, kRecvSlots> slot_free;  // reduction consumed slot q
    std::array<DeviceBuffer, kRecvSlots> slots;                // receive buffers (lazy)
    CommCounters counters;
  };

  // One rank's arguments in the per-rank rendezvous.
  struct Arrival {
    bool arrived = false;
    Kind kind = Kind::kReduceScatter;
    TensorView full;
    Stream* producer = nullptr;
  };

  struct Builder;  // enqueues schedules (defined below)

  std::vector<Rank> ranks;
  size_t slot_bytes = 0;
  uint64_t round = 0;  // ring rounds so far; picks the receive slot (round % kRecvSlots)

  // Guards schedule building (all events, slots, round) and counters.
  mutable std::mutex enqueue_mu;

  // Rendezvous of the per-rank calls: generation g completes when every rank has arrived.
  std::mutex rv_mu;
  std::condition_variable rv_cv;
  uint64_t generation = 0;
  int arrived = 0;
  std::vector<Arrival> arrivals;
  StoredError generation_error;  // of the generation that completed last
  bool aborted = false;          // guarded by rv_mu
  std::string abort_reason;      // guarded by rv_mu
};

// ---- construction ----------------------------------------------------------------------------

Communicator::Communicator(std::vector<Device*> devices, size_t chunk_bytes)
    : devices_(std::move(devices)), chunk_bytes_(chunk_bytes), impl_(std::make_unique<Impl>()) {
  ZT_REQUIRE(!devices_.empty(), "Communicator: needs at least one device");
  ZT_REQUIRE(chunk_bytes_ > 0, "Communicator: chunk_bytes must be positive");
  const int n = world();
  for (int r = 0; r < n; ++r) {
    ZT_REQUIRE(devices_[r] != nullptr, "Communicator: device of rank ", r, " is null");
    for (int q = 0; q < r; ++q)
      ZT_REQUIRE(devices_[q] != devices_[r], "Communicator: ", devices_[r]->name(),
                 " is given twice (ranks ", q, " and ", r, "); every rank needs its own device");
    ZT_REQUIRE(devices_[r]->backend() == devices_[0]->backend(), "Communicator: ",
               devices_[0]->name(), " and ", devices_[r]->name(), " use different backends");
  }
  // Peer access is not required: copy_peer stages through host memory where GPUs lack it.

  // A chunk holds at least one element of any type.
  impl_->slot_bytes = slot_bytes_for(chunk_bytes_);
  impl_->ranks.resize(static_cast<size_t>(n));
  impl_->arrivals.resize(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    Impl::Rank& rk = impl_->ranks[r];
    Device& d = *devices_[r];
    rk.producer = d.create_event();
    rk.ready = d.create_event();
    rk.sent = d.create_event();
    rk.done = d.create_event();
    for (auto& e : rk.slot_free) e = d.create_event();
  }
}

// Receive buffers are freed into their pool, tied to the comm stream they were allocated on. Every
// peer write into one is followed, on that stream, by a wait for it and the reduction that reads
// it, so reuse of the memory on that stream is ordered after all of it (no host wait needed).
Communicator::~Communicator() = default;

// ---- schedule building (called with enqueue_mu held) -----------------------------------------

namespace {

// Validates a group call's buffers; returns the plan. `divisible`: numel must split into
// world equal shards.
Plan check_buffers(const char* op, const std::vector<Device*>& devices,
                   const std::vector<TensorView>& bufs, const std::vector<Stream*>& producers,
                   bool divisible, bool floats_only) {
  const int n = static_cast<int>(devices.size());
  ZT_REQUIRE(static_cast<int>(bufs.size()) == n, op, ": got ", bufs.size(),
             " buffers for a communicator of ", n, " ranks (one per rank, indexed by rank)");
  ZT_REQUIRE(producers.empty() || static_cast<int>(producers.size()) == n, op, ": got ",
             producers.size(), " producer streams for ", n, " ranks (one per rank, or none)");
  Plan p;
  p.world = n;
  p.dtype = bufs[0].dtype;
  p.esize = dtype_size(p.dtype);
  p.numel = bufs[0].numel();
  ZT_REQUIRE(!floats_only || is_float_type(p.dtype), op, ": buffers are ", dtype_name(p.dtype),
             " but must be fp32, fp16 or bf16");
  for (int r = 0; r < n; ++r) {
    const TensorView& b = bufs[r];
    ZT_REQUIRE(b.dtype == p.dtype, op, ": rank ", r, " passes ", dtype_name(b.dtype),
               " but rank 0 passes ", dtype_name(p.dtype), " (every rank needs the same dtype)");
    ZT_REQUIRE(b.numel() == p.numel, op, ": rank ", r, " passes ", b.numel(),
               " elements but rank 0 passes ", p.numel, " (every rank needs the same numel)");
    ZT_REQUIRE(b.data != nullptr || b.numel() == 0, op, ": the buffer of rank ", r,
               " has no data");
    ZT_REQUIRE(b.numel() == 0 || b.device == devices[r]->index(), op, ": the buffer of rank ", r,
               " is on device ", b.device, " but rank ", r, " is ", devices[r]->name(),
               " (index ", devices[r]->index(), ")");
    Stream* prod = producers.empty() ? nullptr : producers[r];
    ZT_REQUIRE(prod == nullptr || &prod->device() == devices[r], op, ": the producer stream of rank ",
               r, " runs on ", prod ? prod->device().name() : "", " but rank ", r, " is ",
               devices[r]->name(), " (pass a stream of the rank's own device)");
  }
  if (divisible) {
    ZT_REQUIRE(p.numel % n == 0, op, ": ", p.numel, " elements per rank do not split into ", n,
               " equal shards; pad the buffer to a multiple of the world size (zero/shard_plan.h)");
    p.shard = p.numel / n;
  }
  return p;
}

}  // namespace

// Enqueues the schedules; every member runs with enqueue_mu held.
struct Communicator::Impl::Builder {
  std::vector<Device*>& devices;
  Communicator::Impl& impl;
  size_t chunk_bytes;

  int world() const { return static_cast<int>(devices.size()); }
  Stream& comm(int r) { return devices[r]->comm(); }
  Communicator::Impl::Rank& rank(int r) { return impl.ranks[r]; }
  int next(int r) const { return (r + 1) % world(); }
  int prev(int r) const { return (r + world() - 1) % world(); }

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
      ++rank(r).counters.collectives;
    }
  }

  void ensure_slots() {
    for (int r = 0; r < world(); ++r) {
      auto& rk = rank(r);
      for (int q = 0; q < Communicator::kRecvSlots; ++q) {
        if (rk.slots[q].data() != nullptr) continue;
        rk.slots[q] = DeviceBuffer(devices[r]->memory(), impl.slot_bytes, comm(r), "comm_recv");
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
        const int q = static_cast<int>(impl.round % Communicator::kRecvSlots);
        ++impl.round;
        for (int r = 0; r < n; ++r) {
          const int dst = next(r);
          const int s = ((r - k - 1) % n + n) % n;
          comm(r).wait(*rank(dst).slot_free[q]);
          comm(r).copy_peer(*devices[dst], rank(dst).slots[q].data(),
                            byte_ptr(full[r]) + static_cast<size_t>(s * p.shard + off) * p.esize,
                            bytes);
          comm(r).record(*rank(r).sent);
          rank(r).counters.bytes_sent += bytes;
          rank(dst).counters.bytes_received += bytes;
        }
        for (int r = 0; r < n; ++r) {
          const int src = prev(r);
          const int s = ((src - k - 1) % n + n) % n;
          const int dev = devices[r]->index();
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
          comm(r).copy_peer(*devices[dst], byte_ptr(full[dst]) + at, byte_ptr(full[r]) + at, bytes);
          comm(r).record(*rank(r).sent);
          rank(r).counters.bytes_sent += bytes;
          rank(dst).counters.bytes_received += bytes;
        }
      }
    }
  }

  // A chain root, root+1, ..., root-1; chunk-major so that chunk j+1 leaves root while chunk j is
  // one hop further.
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
        comm(from).copy_peer(*devices[to], byte_ptr(bufs[to]) + off, byte_ptr(bufs[from]) + off,
                             bytes);
        comm(from).record(*rank(from).sent);
        rank(from).counters.bytes_sent += bytes;
        rank(to).counters.bytes_received += bytes;
      }
    }
  }
};

// ---- group calls -----------------------------------------------------------------------------

void Communicator::reduce_scatter(const std::vector<TensorView>& full,
                                  const std::vector<Stream*>& producers) {
  const Plan p = check_buffers("reduce_scatter", devices_, full, producers, true, true);
  const GroupRange range("reduce_scatter", p.numel * static_cast<int64_t>(p.esize));
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  Impl::Builder b{devices_, *impl_, chunk_bytes_};
  b.prologue(producers, /*peers_write=*/false);
  b.reduce_scatter(p, full);
  b.epilogue(/*received=*/false);
}

void Communicator::all_gather(const std::vector<TensorView>& full,
                              const std::vector<Stream*>& producers) {
  const Plan p = check_buffers("all_gather", devices_, full, producers, true, true);
  const GroupRange range("all_gather", p.numel * static_cast<int64_t>(p.esize));
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  Impl::Builder b{devices_, *impl_, chunk_bytes_};
  const bool moves = world() > 1 && p.shard > 0;
  b.prologue(producers, moves);
  b.all_gather(p, full);
  b.epilogue(moves);
}

void Communicator::all_reduce(const std::vector<TensorView>& full,
                              const std::vector<Stream*>& producers) {
  const Plan p = check_buffers("all_reduce", devices_, full, producers, true, true);
  const GroupRange range("all_reduce", p.numel * static_cast<int64_t>(p.esize));
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  Impl::Builder b{devices_, *impl_, chunk_bytes_};
  const bool moves = world() > 1 && p.shard > 0;
  b.prologue(producers, /*peers_write=*/false);
  b.reduce_scatter(p, full);
  // Peers overwrite the partial sums of the other shards only after each rank's reduction.
  if (moves)
    for (int r = 0; r < world(); ++r) b.comm(r).record(*impl_->ranks[r].ready);
  b.all_gather(p, full);
  b.epilogue(moves);
}

void Communicator::broadcast(int root, const std::vector<TensorView>& bufs,
                             const std::vector<Stream*>& producers) {
  ZT_REQUIRE(root >= 0 && root < world(), "broadcast: root ", root, " is not a rank of a ",
             world(), "-rank communicator");
  const Plan p = check_buffers("broadcast", devices_, bufs, producers, false, false);
  const size_t nbytes = static_cast<size_t>(p.numel) * p.esize;
  const GroupRange range("broadcast", static_cast<int64_t>(nbytes));
  std::lock_guard<std::mutex> lock(impl_->enqueue_mu);
  Impl::Builder b{devices_, *impl_, chunk_bytes_};
  const bool moves = world() > 1 && nbytes > 0;
  b.prologue(producers, moves);
  b.broadcast(root, nbytes, bufs);
  // Every rank but root waits for its predecessor's last copy; root received nothing.
  for (int r = 0; r < world(); ++r) {
    if (moves && r != root) b.comm(r).wait(*impl_->ranks[b.prev(r)].sent);
    b.comm(r).record(*impl_->ranks[r].done);
    ++impl_->ranks[r].counters.collectives;
  }
}

// ---- per-rank calls --------------------------------------------------------------------------

void Communicator::reduce_scatter(int rank, TensorView full, Stream* producer, std::string_view tag) {
  rank_call(rank, Kind::kReduceScatter, full, producer, tag);
}

void Communicator::all_gather(int rank, TensorView full, Stream* producer, std::string_view tag) {
  rank_call(rank, Kind::kAllGather, full, producer, tag);
}

void Communicator::all_reduce(int rank, TensorView full, Stream* producer, std::string_view tag) {
  rank_call(rank, Kind::kAllReduce, full, producer, tag);
}

void Communicator::rank_call(int rank, Kind kind, TensorView full, Stream* producer, std::string_view tag) {
  const int n = world();
  const uint8_t kind_id = static_cast<uint8_t>(kind);
  ZT_REQUIRE(rank >= 0 && rank < n, kind_name(kind_id), ": rank ", rank,
             " is not a rank of a ", n, "-rank communicator");
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
  Impl::Arrival& mine = im.arrivals[rank];
  ZT_REQUIRE(!mine.arrived, kind_name(kind_id), ": rank ", rank,
             " called while its previous collective (call #", im.generation,
             ") still waits for the other ranks; use one host thread per rank");
  mine = Impl::Arrival{true, kind, full, producer};
  const uint64_t my_generation = im.generation;
  if (++im.arrived < n) {
    im.rv_cv.wait(lock, [&] { return im.generation != my_generation || im.aborted; });
    if (im.generation == my_generation) {  // aborted while waiting for the other ranks
      mine = Impl::Arrival{};
      --im.arrived;
      ZT_THROW(ErrorKind::kDevice, kind_name(kind_id), " on rank ", rank, " abandoned: ", im.abort_reason);
    }
    if (im.generation_error.set) im.generation_error.raise();
    return;
  }

  // The last rank to arrive: check that the calls match, then enqueue for everybody.
  StoredError error;
  try {
    const Impl::Arrival& first = im.arrivals[0];
    for (int r = 1; r < n; ++r) {
      const Impl::Arrival& a = im.arrivals[r];
      ZT_REQUIRE(a.kind == first.kind && a.full.numel() == first.full.numel() &&
                     a.full.dtype == first.full.dtype,
                 "collective mismatch at call #", my_generation, ": rank 0 called ",
                 kind_name(static_cast<uint8_t>(first.kind)), "(", first.full.numel(), " x ",
                 dtype_name(first.full.dtype), ") but rank ", r, " called ",
                 kind_name(static_cast<uint8_t>(a.kind)), "(", a.full.numel(), " x ",
                 dtype_name(a.full.dtype),
                 "); every rank must issue the same collectives in the same order");
    }
    std::vector<TensorView> bufs(static_cast<size_t>(n));
    std::vector<Stream*> producers(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      bufs[r] = im.arrivals[r].full;
      producers[r] = im.arrivals[r].producer;
    }
    switch (first.kind) {
      case Kind::kReduceScatter:
        reduce_scatter(bufs, producers);
        break;
      case Kind::kAllGather:
        all_gather(bufs, producers);
        break;
      case Kind::kAllReduce:
        all_reduce(bufs, producers);
        break;
    }
  } catch (...) {
    error.capture(std::current_exception());
  }
  for (auto& a : im.arrivals) a = Impl::Arrival{};
  im.arrived = 0;
  im.generation_error = error;
  ++im.generation;
  lock.unlock();
  im.rv_cv.notify_all();
  if (error.set) error.raise();
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

size_t Communicator::planned_buffer_bytes(int world, size_t chunk_bytes) {
  return world > 1 ? static_cast<size_t>(kRecvSlots) * slot_bytes_for(chunk_bytes) : 0;
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
