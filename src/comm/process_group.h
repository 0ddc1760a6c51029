// Processes that talk over MPI (mpirun/srun launch them): bootstrap, world rank and size, host-memory
// point-to-point, barrier and all-gather of small values, every wait bounded by a timeout. The
// transport under the cross-process ring (process_ring.h); nothing here knows about devices.
//
// Threads: MPI is initialised with MPI_THREAD_SERIALIZED and every MPI call of the process is made
// under one process-wide mutex. FUNNELED (main thread only) would not do: the trainer runs one
// host thread per device, and whichever thread completes a collective's local rendezvous issues
// its MPI calls. MULTIPLE is not needed, since no two MPI calls ever run at once, and is the
// level implementations support least well. One ProcessGroup is used by one thread at a time.
//
// Timeouts (no MPI call may block forever): every operation is posted non-blocking (MPI_Isend,
// MPI_Irecv, MPI_Comm_idup) and polled with MPI_Test until it completes or the group's timeout
// passes; then the call throws zt::Error(kDevice) with one sentence naming the rank that did not
// answer and what was awaited. The group is then broken: its unfinished receives are cancelled
// and every later call on it throws at once. MPI cannot take a posted send back: a send still
// unmatched then may yet read its buffer if the peer wakes up, so after a timeout the caller must
// treat the run as lost (flush what it can and exit), not reuse the memory for new data.
//
// Failure notices: a process whose group breaks (a timeout, an MPI error, or abort() after a local
// failure) sends its sentence to every peer, and every wait also polls for such notices, so a
// failure spreads in milliseconds and every process names the same culprit: a peer that receives
// one throws "rank 2 stopped because rank 1 gave up: rank 1 waited 1.0 s for rank 0 to send ...".
// A wait that times out does not blame its silent peer at once: in a ring every rank downstream
// of a stalled one is waiting too, each for an innocent neighbour. It walks the chain of waits
// instead: it asks the silent peer whom it waits for (every rank inside a wait of the group
// answers such queries), then that rank, and so on; the first rank that does not answer within a
// fifth of the timeout (at most 2 s) is the one named: "rank 3 waited 1.0 s for rank 2 to send 32 B
// for all_reduce #0 step 0 chunk 2; it waits for rank 1, which waits for rank 0, and rank 0 does
// not answer: rank 0 has died or stalled (...)". A cycle (ranks waiting for each other) is named
// as such. So every process names the same rank, within the timeout plus a fifth of it. Other groups (each is its own MPI communicator, a
// duplicate of MPI_COMM_WORLD) are unaffected. What cannot be bounded: MPI_Init_thread itself, and
// mpi_finalize() (OpenMPI synchronises with every process there); a process whose group broke
// should exit without finalizing (mpirun then reports it and stops the others).
//
// barrier and all_gather are built from point-to-point messages to every peer, not from MPI's
// collectives, so that a timeout can say which rank did not answer (O(size^2) tiny messages: fine
// for the tens of processes this serves). Every process issues the same sequence of them.
// Point-to-point: the k-th send from a to b with tag t matches the k-th recv at b from a with tag t
// (MPI's non-overtaking rule); tags 0..kMaxTag are the caller's, those above are the group's own.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace zt {

// MPI's lifetime in this process. Every ProcessGroup initialises MPI on first use; call
// mpi_finalize() once at the end, after every group is destroyed and only if all processes are
// still alive (it synchronises with them). Idempotent.
void mpi_init();
void mpi_finalize();

class ProcessGroup {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};
  static constexpr int kMaxTag = 16383;
  // Messages longer than this are sent as several MPI messages (MPI counts are ints).
  static constexpr size_t kMaxMessageBytes = size_t{1} << 30;

  // All processes of the launch (MPI_COMM_WORLD, duplicated: a group's traffic never matches
  // another group's). Collective: every process constructs its groups in the same order.
  explicit ProcessGroup(std::chrono::milliseconds timeout = kDefaultTimeout);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds timeout);
  // True once a wait timed out, MPI reported an error, a peer gave up or abort() was called: every
  // later call throws.
  bool broken() const { return !broken_reason_.empty(); }
  // This process gives up on the group (e.g. a local device failed mid-collective): the group
  // breaks and every peer is told `why` (best effort, never blocks), so that peers waiting on this
  // process throw at once with that sentence instead of after their timeout. No-op when broken.
  void abort(std::string_view why);

  // Host memory to / from `peer` (another rank; sending to oneself is refused). `what` names the
  // wait in a timeout's sentence ("reduce_scatter #3 step 1 chunk 0"). A recv must expect exactly
  // the bytes that were sent.
  void send(int peer, const void* data, size_t bytes, int tag, std::string_view what = "a message");
  void recv(int peer, void* data, size_t bytes, int tag, std::string_view what = "a message");
  // Both halves posted before either is waited for: ring shifts and pairwise exchanges cannot
  // deadlock (send_to and recv_from may be the same peer).
  void send_recv(int send_to, const void* send_data, size_t send_bytes, int recv_from, void* recv_data,
                 size_t recv_bytes, int tag, std::string_view what = "a message");

  void barrier(std::string_view what = "barrier");
  // `bytes` bytes from every process, concatenated by rank into `all` (size() * bytes).
  void all_gather(const void* mine, void* all, size_t bytes, std::string_view what = "all_gather");
  template <typename T>
  std::vector<T> all_gather(const T& value, std::string_view what = "all_gather") {
    static_assert(std::is_trivially_copyable_v<T>, "all_gather sends raw bytes");
    std::vector<T> out(static_cast<size_t>(size_));
    all_gather(&value, out.data(), sizeof(T), what);
    return out;
  }

 private:
  struct Op;  // one posted MPI request: its peer, direction and size (process_group.cc)
  void check_usable(std::string_view what) const;
  void post_send(std::vector<Op>& ops, int peer, const void* data, size_t bytes, int tag);
  void post_recv(std::vector<Op>& ops, int peer, void* data, size_t bytes, int tag);
  // Polls until every op completed; past the timeout breaks the group and throws.
  void wait_all(std::vector<Op>& ops, std::string_view what);
  struct Wait;  // wait_all's state and its steps (process_group.cc)
  static int waiting_for(const std::vector<Op>& ops);
  bool poll_ops(Wait& w);
  std::optional<int> ask_whom_waited_for(Wait& w, int suspect, std::chrono::milliseconds patience);
  std::string blame_timeout(Wait& w);
  static void release_ops(std::vector<Op>& ops);
  // Breaks the group and throws `reason`; notify: tell every peer first (not when the reason is
  // itself a peer's notice).
  [[noreturn]] void fail(std::string reason, bool notify);
  void post_notices();
  // A peer's notice, if one arrived (MPI mutex held): `out` becomes this rank's sentence.
  bool take_notice(std::string& out);
  // Answers every pending "whom do you wait for?" query (MPI mutex held).
  void answer_queries(int waiting_for);

  void* comm_ = nullptr;  // MPI_Comm (an int or a pointer depending on the MPI): kept out of the header
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_;
  std::string broken_reason_;
  std::string notice_;  // the sentence sent to peers; lives as long as the group (MPI may still send it)
  std::deque<int> answers_;  // answers to queries, likewise (a deque: push_back never moves them)
  uint64_t collectives_ = 0;  // barrier/all_gather calls so far (named in messages)
};

}  // namespace zt
