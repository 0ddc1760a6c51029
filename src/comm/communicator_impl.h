// The communicator's internals shared by its source files (comm/communicator.cc, collectives.cc,
// p2p.cc, failure.cc, buffers.cc): the per-rank events and receive buffers, the groups' rendezvous
// state, the posted sends. Not for use outside src/comm.
#pragma once

#include <algorithm>
#include <array>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/format.h"
#include "core/status.h"
#include "memory/caching_allocator.h"

namespace zt {

enum class Communicator::Kind : uint8_t { kReduceScatter, kAllGather, kAllReduce, kBroadcast };

namespace {

// A receive buffer holds one chunk, and at least one element of any type.
inline size_t slot_bytes_for(size_t chunk_bytes) { return std::max<size_t>(chunk_bytes, sizeof(float)); }

// "reduce_scatter h.3 1.2 MiB": kind, the caller's tag, bytes per rank.
inline std::string collective_label(const char* kind, std::string_view tag, int64_t bytes) {
  std::string s = kind;
  if (!tag.empty()) s.append(" ").append(tag);
  return s + " " + format_bytes(static_cast<double>(bytes), 1);
}

}  // namespace

namespace detail {

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
using detail::Copy;
using detail::Plan;
using detail::StoredError;

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
  // `copied` is recorded on the link after each of its copies: the link runs them in order, so its
  // newest record covers every copy the link ran before (what a wait_send on a forgotten ticket
  // needs; the rank's `sent` does not: its newest record may be on another link or the comm stream).
  struct Link {
    Stream* stream = nullptr;
    std::unique_ptr<Event> copied;
  };
  std::map<std::pair<int, int>, Link> links;
  Link& link_of(const std::vector<Device*>& devices, int src, int dst) {
    Link& l = links[std::make_pair(src, dst)];
    if (l.stream == nullptr) {
      Device& d = *devices[static_cast<size_t>(src)];
      l.stream = &d.create_stream();
      l.copied = d.create_event();
    }
    return l;
  }
  Stream& link(const std::vector<Device*>& devices, int src, int dst) { return *link_of(devices, src, dst).stream; }

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

}  // namespace zt
