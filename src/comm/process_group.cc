// ProcessGroup over MPI (see process_group.h for the contract): non-blocking MPI calls polled under
// one process-wide mutex, so that every wait has a deadline and a timeout can name the silent peer.
#include "comm/process_group.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <thread>

#include "core/format.h"
#include "core/status.h"

namespace zt {

namespace {

// Every MPI call of the process runs under this mutex (MPI_THREAD_SERIALIZED).
std::mutex& mpi_mutex() {
  static std::mutex mu;
  return mu;
}

bool g_initialized_here = false;  // guarded by mpi_mutex
bool g_finalized = false;         // guarded by mpi_mutex

// Tags above ProcessGroup::kMaxTag belong to the group's own barrier/all_gather.
constexpr int kAllGatherTag = ProcessGroup::kMaxTag + 1;
// A process that gives up on a group tells every peer why (its sentence), with this tag.
constexpr int kNoticeTag = ProcessGroup::kMaxTag + 2;
// A rank that timed out asks its silent peer whom that one waits for (an empty message), and a rank
// inside a wait answers (one int: the rank it waits for).
constexpr int kQueryTag = ProcessGroup::kMaxTag + 3;
constexpr int kAnswerTag = ProcessGroup::kMaxTag + 4;

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

MPI_Comm& as_comm(void*& p) { return *reinterpret_cast<MPI_Comm*>(&p); }
static_assert(sizeof(MPI_Comm) <= sizeof(void*), "MPI_Comm must fit in the header's void* slot");

// "1.5 s"
std::string seconds_text(std::chrono::milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

// Polls `done` until it returns true or `deadline` passes: spins briefly (a neighbour's message is
// usually microseconds away), then backs off to sleeps of up to 1 ms so that oversubscribed ranks
// on few cores leave the CPU to the processes they wait for.
template <typename Fn>
bool poll_until(std::chrono::steady_clock::time_point deadline, Fn&& done) {
  auto sleep = std::chrono::microseconds(10);
  for (int spins = 0;; ++spins) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return done();
    if (spins < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep);
      sleep = std::min<std::chrono::microseconds>(sleep * 2, std::chrono::milliseconds(1));
    }
  }
}

}  // namespace

void mpi_init() {
  std::lock_guard<std::mutex> lock(mpi_mutex());
  ZT_REQUIRE(!g_finalized, "MPI was already finalized in this process; it cannot be started again");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    ZT_REQUIRE(provided >= MPI_THREAD_SERIALIZED,
               "MPI was initialised by someone else without MPI_THREAD_SERIALIZED; ZeroTrain needs "
               "that thread level (see comm/process_group.h)");
    return;
  }
  int provided = MPI_THREAD_SINGLE;
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  if (rc != MPI_SUCCESS) ZT_THROW(ErrorKind::kDevice, "MPI_Init_thread failed: ", mpi_error_string(rc));
  g_initialized_here = true;
  ZT_REQUIRE(provided >= MPI_THREAD_SERIALIZED,
             "this MPI provides thread level ", provided,
             " but ZeroTrain needs MPI_THREAD_SERIALIZED; use an MPI built with thread support "
             "(Debian's OpenMPI has it)");
}

void mpi_finalize() {
  std::lock_guard<std::mutex> lock(mpi_mutex());
  if (!g_initialized_here || g_finalized) return;
  g_finalized = true;
  MPI_Finalize();
}

struct ProcessGroup::Op {
  MPI_Request request = MPI_REQUEST_NULL;
  int peer = 0;
  bool is_recv = false;
  size_t bytes = 0;  // of this message (a piece of a longer one)
  bool done = false;
};

ProcessGroup::ProcessGroup(std::chrono::milliseconds timeout) : timeout_(timeout) {
  ZT_REQUIRE(timeout.count() > 0, "ProcessGroup: the timeout must be positive (got ", timeout.count(), " ms)");
  mpi_init();
  MPI_Comm& comm = as_comm(comm_);
  comm = MPI_COMM_NULL;
  MPI_Request req = MPI_REQUEST_NULL;
  {
    std::lock_guard<std::mutex> lock(mpi_mutex());
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    const int rc = MPI_Comm_idup(MPI_COMM_WORLD, &comm, &req);
    if (rc != MPI_SUCCESS) ZT_THROW(ErrorKind::kDevice, "MPI_Comm_idup failed: ", mpi_error_string(rc));
  }
  const bool ok = poll_until(std::chrono::steady_clock::now() + timeout_, [&] {
    std::lock_guard<std::mutex> lock(mpi_mutex());
    int flag = 0;
    MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  });
  // Which process is missing is not knowable from a collective; the sentence says how many waited.
  if (!ok)
    ZT_THROW(ErrorKind::kDevice, "rank ", rank_, " waited ", seconds_text(timeout_), " for all ", size_,
             " processes to create a process group and not all of them came; a process has died, "
             "stalled, or was launched with a different program or -np");
  std::lock_guard<std::mutex> lock(mpi_mutex());
  // Errors come back as codes and become zt::Errors, instead of MPI aborting the job.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
}

ProcessGroup::~ProcessGroup() {
  std::lock_guard<std::mutex> lock(mpi_mutex());
  int finalized = 0;
  MPI_Finalized(&finalized);
  MPI_Comm& comm = as_comm(comm_);
  // A broken group may still have requests posted to a peer that is gone; freeing it then is not
  // safe to rely on, and the process is about to exit anyway.
  if (!finalized && comm != MPI_COMM_NULL && !broken()) MPI_Comm_free(&comm);
}

void ProcessGroup::set_timeout(std::chrono::milliseconds timeout) {
  ZT_REQUIRE(timeout.count() > 0, "ProcessGroup: the timeout must be positive (got ", timeout.count(), " ms)");
  timeout_ = timeout;
}

void ProcessGroup::check_usable(std::string_view what) const {
  if (broken())
    ZT_THROW(ErrorKind::kDevice, "rank ", rank_, " cannot start ", what, ": its process group is broken (",
             broken_reason_, ")");
}

void ProcessGroup::fail(std::string reason, bool notify) {
  broken_reason_ = reason;
  if (notify) post_notices();
  ZT_THROW(ErrorKind::kDevice, reason);
}

void ProcessGroup::post_notices() {
  std::lock_guard<std::mutex> lock(mpi_mutex());
  notice_ = broken_reason_;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    // Fire and forget: a notice is small (sent eagerly) and the peer may be gone; nothing waits.
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(notice_.data(), static_cast<int>(notice_.size()), MPI_BYTE, p, kNoticeTag, as_comm(comm_), &req) ==
        MPI_SUCCESS)
      MPI_Request_free(&req);
  }
}

void ProcessGroup::abort(std::string_view why) {
  if (broken()) return;
  broken_reason_ = std::string(why);
  post_notices();
}

bool ProcessGroup::take_notice(std::string& out) {
  // Called with the MPI mutex held.
  int flag = 0;
  MPI_Message msg;
  MPI_Status status;
  if (MPI_Improbe(MPI_ANY_SOURCE, kNoticeTag, as_comm(comm_), &flag, &msg, &status) != MPI_SUCCESS || !flag)
    return false;
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  std::string text(static_cast<size_t>(std::max(count, 0)), '\0');
  MPI_Mrecv(text.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE);  // already here: returns at once
  out = "rank " + std::to_string(rank_) + " stopped because rank " + std::to_string(status.MPI_SOURCE) +
        " gave up: " + text;
  return true;
}

void ProcessGroup::post_send(std::vector<Op>& ops, int peer, const void* data, size_t bytes, int tag) {
  std::lock_guard<std::mutex> lock(mpi_mutex());
  const char* p = static_cast<const char*>(data);
  size_t off = 0;
  do {  // a zero-byte message is still sent: the receiver waits for it
    const size_t n = std::min(kMaxMessageBytes, bytes - off);
    Op op{MPI_REQUEST_NULL, peer, false, n, false};
    const int rc = MPI_Isend(p + off, static_cast<int>(n), MPI_BYTE, peer, tag, as_comm(comm_), &op.request);
    if (rc != MPI_SUCCESS)
      ZT_THROW(ErrorKind::kDevice, "rank ", rank_, " could not send to rank ", peer, ": ", mpi_error_string(rc));
    ops.push_back(op);
    off += n;
  } while (off < bytes);
}

void ProcessGroup::post_recv(std::vector<Op>& ops, int peer, void* data, size_t bytes, int tag) {
  std::lock_guard<std::mutex> lock(mpi_mutex());
  char* p = static_cast<char*>(data);
  size_t off = 0;
  do {
    const size_t n = std::min(kMaxMessageBytes, bytes - off);
    Op op{MPI_REQUEST_NULL, peer, true, n, false};
    const int rc = MPI_Irecv(p + off, static_cast<int>(n), MPI_BYTE, peer, tag, as_comm(comm_), &op.request);
    if (rc != MPI_SUCCESS)
      ZT_THROW(ErrorKind::kDevice, "rank ", rank_, " could not receive from rank ", peer, ": ",
               mpi_error_string(rc));
    ops.push_back(op);
    off += n;
  } while (off < bytes);
}

// What one wait_all has learned so far, shared by its polls.
struct ProcessGroup::Wait {
  std::vector<Op>& ops;
  std::string_view what;
  std::string error;   // set under the lock; thrown outside it
  std::string notice;  // a peer gave up on the group: its sentence
  bool ops_done = false;
};

// Whom this rank waits for: a peer it waits to hear from before one that has not taken its message
// yet (-1: nobody).
int ProcessGroup::waiting_for(const std::vector<Op>& ops) {
  int send_peer = -1;
  for (const Op& op : ops) {
    if (op.done) continue;
    if (op.is_recv) return op.peer;
    if (send_peer < 0) send_peer = op.peer;
  }
  return send_peer;
}

bool ProcessGroup::poll_ops(Wait& w) {
  std::lock_guard<std::mutex> lock(mpi_mutex());
  if (take_notice(w.notice)) return true;
  answer_queries(waiting_for(w.ops));
  bool all = true;
  for (Op& op : w.ops) {
    if (op.done) continue;
    int flag = 0;
    MPI_Status status;
    const int rc = MPI_Test(&op.request, &flag, &status);
    if (rc != MPI_SUCCESS) {
      const int code = rc == MPI_ERR_IN_STATUS ? status.MPI_ERROR : rc;
      w.error = "rank " + std::to_string(rank_) + " failed to " + (op.is_recv ? "receive from" : "send to") +
                " rank " + std::to_string(op.peer) + " for " + std::string(w.what) + ": " + mpi_error_string(code);
      return true;
    }
    if (!flag) {
      all = false;
      continue;
    }
    op.done = true;
    if (op.is_recv) {
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      if (static_cast<size_t>(count) != op.bytes && w.error.empty())
        w.error = "rank " + std::to_string(op.peer) + " sent " + std::to_string(count) + " bytes for " +
                  std::string(w.what) + " but rank " + std::to_string(rank_) + " expected " +
                  std::to_string(op.bytes) + "; the processes disagree about the call sequence";
    }
  }
  w.ops_done = all;
  return all || !w.error.empty();
}

// Asks `suspect` whom it waits for, polling the wait's ops meanwhile: the rank it names (-1:
// nobody), or nullopt when it did not answer within `patience`.
std::optional<int> ProcessGroup::ask_whom_waited_for(Wait& w, int suspect, std::chrono::milliseconds patience) {
  int answer = -1;
  MPI_Request areq = MPI_REQUEST_NULL;
  {
    std::lock_guard<std::mutex> lock(mpi_mutex());
    MPI_Irecv(&answer, 1, MPI_INT, suspect, kAnswerTag, as_comm(comm_), &areq);
    MPI_Request qreq = MPI_REQUEST_NULL;
    if (MPI_Isend(nullptr, 0, MPI_BYTE, suspect, kQueryTag, as_comm(comm_), &qreq) == MPI_SUCCESS)
      MPI_Request_free(&qreq);
  }
  bool answered = false;
  poll_until(std::chrono::steady_clock::now() + patience, [&] {
    if (poll_ops(w)) return true;
    std::lock_guard<std::mutex> lock(mpi_mutex());
    int flag = 0;
    MPI_Test(&areq, &flag, MPI_STATUS_IGNORE);
    answered = flag != 0;
    return answered;
  });
  if (answered) return answer;
  std::lock_guard<std::mutex> lock(mpi_mutex());
  MPI_Cancel(&areq);
  MPI_Request_free(&areq);
  return std::nullopt;
}

// After a timeout, walks the chain of waits: asks the silent peer whom it waits for, then that
// rank, and so on; the first rank that does not answer (it is not inside a wait of this group:
// dead, stalled, or busy elsewhere) is the one to name, not the innocent ranks waiting between us
// and it. The sentence naming it; stops early when a poll ends the wait (w.ops_done, an error or a
// notice).
std::string ProcessGroup::blame_timeout(Wait& w) {
  const auto patience = std::clamp(timeout_ / 5, std::chrono::milliseconds(10), std::chrono::milliseconds(2000));
  const int first = waiting_for(w.ops);
  const Op* silent = nullptr;
  for (const Op& op : w.ops)
    if (!op.done && op.peer == first && (silent == nullptr || op.is_recv)) silent = &op;
  std::string blame = "rank " + std::to_string(rank_) + " waited " + seconds_text(timeout_) + " for rank " +
                      std::to_string(first) + (silent->is_recv ? " to send " : " to receive ") +
                      format_bytes(static_cast<double>(silent->bytes), 1) + " for " + std::string(w.what);
  std::vector<bool> visited(static_cast<size_t>(size_), false);
  visited[static_cast<size_t>(rank_)] = true;
  for (int suspect = first;;) {
    visited[static_cast<size_t>(suspect)] = true;
    const std::optional<int> answer = ask_whom_waited_for(w, suspect, patience);
    if (!w.notice.empty() || !w.error.empty() || w.ops_done) return blame;
    if (!answer)
      return blame +
             (suspect == first ? " and got no answer" : ", and rank " + std::to_string(suspect) + " does not answer") +
             std::string(": rank ") + std::to_string(suspect) +
             " has died or stalled (raise the communication timeout if it is only slow)";
    if (*answer < 0 || *answer >= size_ || visited[static_cast<size_t>(*answer)])
      return blame + "; rank " + std::to_string(suspect) + " waits for rank " + std::to_string(*answer) +
             " in turn: the processes wait for each other (they disagree about the call sequence, or one "
             "of them stalled inside it)";
    blame += (suspect == first ? "; it waits for rank " : ", which waits for rank ") + std::to_string(*answer);
    suspect = *answer;
  }
}

// Lets go of a failed wait's requests: cancelled receives complete locally (given a moment), sends
// stay posted (see the header's warning).
void ProcessGroup::release_ops(std::vector<Op>& ops) {
  std::lock_guard<std::mutex> lock(mpi_mutex());
  for (Op& op : ops) {
    if (op.done || op.request == MPI_REQUEST_NULL) continue;
    if (op.is_recv) {
      MPI_Cancel(&op.request);
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      int flag = 0;
      while (!flag && std::chrono::steady_clock::now() < until) MPI_Test(&op.request, &flag, MPI_STATUS_IGNORE);
      if (!flag) MPI_Request_free(&op.request);
    } else {
      MPI_Request_free(&op.request);
    }
  }
}

void ProcessGroup::wait_all(std::vector<Op>& ops, std::string_view what) {
  Wait w{ops, what, {}, {}, false};
  const bool finished = poll_until(std::chrono::steady_clock::now() + timeout_, [&] { return poll_ops(w); });
  if (finished && w.error.empty() && w.notice.empty()) return;
  const std::string blame = finished ? std::string() : blame_timeout(w);
  if (w.error.empty() && w.notice.empty() && w.ops_done) return;  // the silent peer was only slow
  release_ops(ops);
  if (!w.notice.empty()) fail(w.notice, /*notify=*/false);
  if (!w.error.empty()) fail(w.error, /*notify=*/true);
  fail(blame, /*notify=*/true);
}

void ProcessGroup::answer_queries(int waiting_for) {
  // Called with the MPI mutex held, from inside a wait.
  for (;;) {
    int flag = 0;
    MPI_Message msg;
    MPI_Status status;
    if (MPI_Improbe(MPI_ANY_SOURCE, kQueryTag, as_comm(comm_), &flag, &msg, &status) != MPI_SUCCESS || !flag) return;
    MPI_Mrecv(nullptr, 0, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
    answers_.push_back(waiting_for);  // MPI may read it after Isend returns: it lives with the group
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(&answers_.back(), 1, MPI_INT, status.MPI_SOURCE, kAnswerTag, as_comm(comm_), &req) == MPI_SUCCESS)
      MPI_Request_free(&req);
  }
}

void ProcessGroup::send(int peer, const void* data, size_t bytes, int tag, std::string_view what) {
  check_usable(what);
  ZT_REQUIRE(peer >= 0 && peer < size_ && peer != rank_, "ProcessGroup::send: peer ", peer,
             " is not another rank of ", size_, " processes (this is rank ", rank_, ")");
  ZT_REQUIRE(tag >= 0 && tag <= kMaxTag, "ProcessGroup::send: tag ", tag, " is outside 0..", kMaxTag);
  std::vector<Op> ops;
  post_send(ops, peer, data, bytes, tag);
  wait_all(ops, what);
}

void ProcessGroup::recv(int peer, void* data, size_t bytes, int tag, std::string_view what) {
  check_usable(what);
  ZT_REQUIRE(peer >= 0 && peer < size_ && peer != rank_, "ProcessGroup::recv: peer ", peer,
             " is not another rank of ", size_, " processes (this is rank ", rank_, ")");
  ZT_REQUIRE(tag >= 0 && tag <= kMaxTag, "ProcessGroup::recv: tag ", tag, " is outside 0..", kMaxTag);
  std::vector<Op> ops;
  post_recv(ops, peer, data, bytes, tag);
  wait_all(ops, what);
}

void ProcessGroup::send_recv(int send_to, const void* send_data, size_t send_bytes, int recv_from,
                             void* recv_data, size_t recv_bytes, int tag, std::string_view what) {
  check_usable(what);
  for (const int peer : {send_to, recv_from})
    ZT_REQUIRE(peer >= 0 && peer < size_ && peer != rank_, "ProcessGroup::send_recv: peer ", peer,
               " is not another rank of ", size_, " processes (this is rank ", rank_, ")");
  ZT_REQUIRE(tag >= 0 && tag <= kMaxTag, "ProcessGroup::send_recv: tag ", tag, " is outside 0..", kMaxTag);
  std::vector<Op> ops;
  post_recv(ops, recv_from, recv_data, recv_bytes, tag);
  post_send(ops, send_to, send_data, send_bytes, tag);
  wait_all(ops, what);
}

void ProcessGroup::barrier(std::string_view what) {
  const char token = 0;
  std::vector<char> all(static_cast<size_t>(size_));
  all_gather(&token, all.data(), 1, what);
}

void ProcessGroup::all_gather(const void* mine, void* all, size_t bytes, std::string_view what) {
  check_usable(what);
  const uint64_t call = collectives_++;
  char* out = static_cast<char*>(all);
  if (bytes > 0) std::memcpy(out + static_cast<size_t>(rank_) * bytes, mine, bytes);
  if (size_ == 1) return;
  std::vector<Op> ops;
  for (int p = 0; p < size_; ++p)
    if (p != rank_) post_recv(ops, p, out + static_cast<size_t>(p) * bytes, bytes, kAllGatherTag);
  for (int p = 0; p < size_; ++p)
    if (p != rank_) post_send(ops, p, mine, bytes, kAllGatherTag);
  wait_all(ops, std::string(what) + " (collective #" + std::to_string(call) + " of the process group)");
}

}  // namespace zt
