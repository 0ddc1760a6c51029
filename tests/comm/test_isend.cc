// Posted sends (Communicator::isend / wait_send): the 1F1B exchange of make_schedule run with real
// data on 2 and 4 ranks, buffer reuse after wait_send, the producer record taken at post time,
// abort, the k-th-send-matches-k-th-recv rule with mixed send/isend, errors and unwaited sends.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_test_util.h"
#include "comm/communicator.h"
#include "core/status.h"
#include "pipeline/check.h"
#include "pipeline/schedule.h"
#include "runtime/runtime.h"
#include "sanitizer.h"

namespace zt {
namespace {

using namespace commtest;  // NOLINT: the helpers are this file's vocabulary
using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr size_t kSmallChunk = 64;

TensorView view_of(const RankBuffers& b, int r) { return b.views[static_cast<size_t>(r)]; }
float* floats(const RankBuffers& b, int r) { return static_cast<float*>(b.data(r)); }

// ---- 1F1B with real data ------------------------------------------------------------------------
//
// Stage s's forward adds s+1 to its input; its backward adds its saved input to the incoming
// gradient (the last stage seeds the gradient with its input). Inputs x = step*1e5 + micro*1e3 + i
// are integers, so every value is exact in fp32 and the closed forms below are the reference:
//   input of stage t:   in_t = x + t(t+1)/2
//   gradient out of s:  G_{P-1} = 2 in_{P-1},  G_s = G_{s+1} + in_s.

double pipe_x(int step, int micro, int64_t i) { return step * 100000.0 + micro * 1000.0 + static_cast<double>(i); }
double pipe_in(int t, int step, int micro, int64_t i) { return pipe_x(step, micro, i) + t * (t + 1) / 2.0; }
double pipe_grad(int s, int stages, int step, int micro, int64_t i) {
  double g = 2 * pipe_in(stages - 1, step, micro, i);
  for (int t = stages - 2; t >= s; --t) g += pipe_in(t, step, micro, i);
  return g;
}

// What one stage checked, written only by its compute stream's work (read after synchronize).
struct StageLog {
  int64_t checks = 0;  // received buffers compared against the closed form
  std::string first_error;
  void expect(const float* got, int64_t numel, const std::function<double(int64_t)>& want, const std::string& what) {
    ++checks;
    if (!first_error.empty()) return;
    for (int64_t i = 0; i < numel; ++i)
      if (static_cast<double>(got[i]) != want(i)) {
        first_error = what + " element " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", want " +
                      std::to_string(want(i));
        return;
      }
  }
};

void run_1f1b(int P, int m) {
  SCOPED_TRACE("P " + std::to_string(P) + " m " + std::to_string(m));
  const Schedule sched = make_schedule(PipeSchedule::k1F1B, P, m);
  // The reason for isend: under sends that wait for their recv this schedule deadlocks (once m > 1),
  // so that variant is not run here.
  if (m > 1) {
    EXPECT_THAT(find_schedule_error(sched, CommModel::kRendezvous), HasSubstr("deadlock"));
  }
  ASSERT_EQ(find_schedule_error(sched, CommModel::kPostedSends), "");

  auto rt = Runtime::create_cpu(P);
  auto devs = first_devices(*rt, P);
  Communicator comm(devs, kSmallChunk);
  const int64_t numel = 257;
  const int steps = 2;  // the second step rewrites every send buffer: wait_send must cover the first
  // Per micro-batch, on every stage: input (received or made), output (sent), gradient received,
  // gradient sent.
  std::vector<RankBuffers> in, out, gin, gout;
  for (int j = 0; j < m; ++j) {
    in.emplace_back(devs, DType::kF32, numel);
    out.emplace_back(devs, DType::kF32, numel);
    gin.emplace_back(devs, DType::kF32, numel);
    gout.emplace_back(devs, DType::kF32, numel);
  }
  std::vector<StageLog> logs(static_cast<size_t>(P));
  std::vector<std::thread> threads;
  for (int s = 0; s < P; ++s)
    threads.emplace_back([&, s] {
      Stream& compute = devs[s]->compute();
      StageLog* log = &logs[static_cast<size_t>(s)];
      const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
      for (int step = 0; step < steps; ++step) {
        std::vector<uint64_t> tickets;
        for (const Action& a : sched.actions[static_cast<size_t>(s)]) {
          const int j = a.micro;
          float* x_in = floats(in[j], s);
          float* x_out = floats(out[j], s);
          float* g_in = floats(gin[j], s);
          float* g_out = floats(gout[j], s);
          // Uneven stage speeds, so that sends queue up and copies land while the peer computes.
          if ((s + j + step) % 3 == 0) compute.host_func([] { std::this_thread::sleep_for(200us); });
          switch (a.kind) {
            case ActionKind::kRecv: {
              const bool act = a.payload == Payload::kActivation;
              float* dst = act ? x_in : g_in;
              compute.host_func([dst, bytes] { std::memset(dst, 0xFF, bytes); });  // NaN: unwritten fails
              comm.recv(s, a.peer, view_of(act ? in[j] : gin[j], s), &compute);
              break;
            }
            case ActionKind::kSend:
              tickets.push_back(comm.isend(s, a.peer, view_of(a.payload == Payload::kActivation ? out[j] : gout[j], s),
                                           &compute));
              break;
            case ActionKind::kForward:
              comm.wait_done(s, compute);
              compute.host_func([=] {
                if (s == 0)
                  for (int64_t i = 0; i < numel; ++i) x_in[i] = static_cast<float>(pipe_x(step, j, i));
                else
                  log->expect(x_in, numel, [&](int64_t i) { return pipe_in(s, step, j, i); },
                              "stage " + std::to_string(s) + " step " + std::to_string(step) + " activation m" +
                                  std::to_string(j));
                for (int64_t i = 0; i < numel; ++i) x_out[i] = x_in[i] + static_cast<float>(s + 1);
              });
              break;
            case ActionKind::kBackward:
              comm.wait_done(s, compute);
              compute.host_func([=] {
                const float* g = x_in;  // the last stage seeds the gradient with its input
                if (s < P - 1) {
                  log->expect(g_in, numel, [&](int64_t i) { return pipe_grad(s + 1, P, step, j, i); },
                              "stage " + std::to_string(s) + " step " + std::to_string(step) + " gradient m" +
                                  std::to_string(j));
                  g = g_in;
                }
                for (int64_t i = 0; i < numel; ++i) g_out[i] = g[i] + x_in[i];
                if (s == 0)
                  log->expect(g_out, numel, [&](int64_t i) { return pipe_grad(0, P, step, j, i); },
                              "stage 0 step " + std::to_string(step) + " input gradient m" + std::to_string(j));
              });
              break;
            default:
              ADD_FAILURE() << "1F1B has no " << describe(a);
          }
        }
        // Before the next step rewrites the send buffers.
        for (uint64_t t : tickets) comm.wait_send(s, t, compute);
      }
      compute.synchronize();
    });
  for (auto& t : threads) t.join();
  rt->synchronize();

  for (int s = 0; s < P; ++s) {
    const auto& list = sched.actions[static_cast<size_t>(s)];
    int64_t sends = 0, recvs = 0;
    for (const Action& a : list) {
      sends += a.kind == ActionKind::kSend;
      recvs += a.kind == ActionKind::kRecv;
    }
    const StageLog& log = logs[static_cast<size_t>(s)];
    EXPECT_EQ(log.first_error, "") << "stage " << s;
    EXPECT_EQ(log.checks, steps * (recvs + (s == 0 ? m : 0))) << "stage " << s;
    const CommCounters c = comm.counters(s);
    EXPECT_EQ(c.bytes_sent, static_cast<uint64_t>(steps * sends * numel * 4)) << "stage " << s;
    EXPECT_EQ(c.bytes_received, static_cast<uint64_t>(steps * recvs * numel * 4)) << "stage " << s;
    EXPECT_EQ(c.transfers, static_cast<uint64_t>(steps * (sends + recvs))) << "stage " << s;
  }
}

TEST(Isend, OneFOneBOnTwoStages) { run_1f1b(2, 4); }
TEST(Isend, OneFOneBOnFourStages) {
  run_1f1b(4, 8);
  run_1f1b(4, 3);  // fewer micro-batches than stages: GPipe-like
}

// ---- buffer reuse and the producer record ------------------------------------------------------

// The receiver's comm stream is slow (a sleep), so the copy runs long after isend returned; the
// sender overwrites its buffer right after wait_send. The receiver must see the old values.
TEST(Isend, SenderReusesItsBufferAfterWaitSendWhileTheReceiverIsSlow) {
  auto rt = Runtime::create_cpu(2);
  auto devs = first_devices(*rt, 2);
  Communicator comm(devs, kSmallChunk);
  const int64_t numel = 4096;
  for (bool recv_first : {false, true}) {
    RankBuffers src(devs, DType::kF32, numel);
    RankBuffers dst(devs, DType::kF32, numel);
    dst.poison();
    float* s = floats(src, 0);
    float* d = floats(dst, 1);
    devs[1]->comm().host_func([] { std::this_thread::sleep_for(30ms); });
    std::promise<void> recv_posted;
    std::vector<float> seen;
    std::thread receiver([&] {
      Stream& compute = devs[1]->compute();
      if (recv_first) recv_posted.set_value();  // (approximately: the recv follows at once)
      comm.recv(1, 0, view_of(dst, 1), &compute);
      comm.wait_done(1, compute);
      compute.host_func([&seen, d, numel] { seen.assign(d, d + numel); });
    });
    std::thread sender([&] {
      if (recv_first) {
        recv_posted.get_future().wait();
        std::this_thread::sleep_for(5ms);
      }
      Stream& compute = devs[0]->compute();
      compute.host_func([s, numel] {
        for (int64_t i = 0; i < numel; ++i) s[i] = static_cast<float>(3 * i + 1);
      });
      const uint64_t t = comm.isend(0, 1, view_of(src, 0), &compute);
      comm.wait_send(0, t, compute);
      compute.host_func([s, numel] { std::fill(s, s + numel, -1.0f); });
    });
    sender.join();
    receiver.join();
    rt->synchronize();
    ASSERT_EQ(seen.size(), static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i)
      ASSERT_EQ(seen[static_cast<size_t>(i)], static_cast<float>(3 * i + 1)) << "recv_first " << recv_first << " at " << i;
  }
}

// The copy reads what the producer held when isend was called, not what it holds at the match:
// the producer's next work blocks until the receiver has consumed the data, so a record taken at
// match time would wait for the copy's own consumer (the wait below would time out).
TEST(Isend, TheCopyWaitsForTheProducerAsOfThePostOnly) {
  auto rt = Runtime::create_cpu(2);
  auto devs = first_devices(*rt, 2);
  Communicator comm(devs, kSmallChunk);
  const int64_t numel = 1000;
  RankBuffers src(devs, DType::kF32, numel);
  RankBuffers dst(devs, DType::kF32, numel);
  src.poison();
  dst.poison();
  float* s = floats(src, 0);
  float* d = floats(dst, 1);
  std::promise<void> consumed;
  std::shared_future<void> consumed_f = consumed.get_future().share();
  std::promise<void> producer_blocked;
  std::atomic<bool> timed_out{false};
  std::vector<float> seen;
  std::thread sender([&] {
    Stream& compute = devs[0]->compute();
    compute.host_func([s, numel] {
      std::this_thread::sleep_for(10ms);
      for (int64_t i = 0; i < numel; ++i) s[i] = static_cast<float>(7 * i - 3);
    });
    const uint64_t t = comm.isend(0, 1, view_of(src, 0), &compute);
    compute.host_func([&timed_out, consumed_f] {
      if (consumed_f.wait_for(10s) != std::future_status::ready) timed_out = true;
    });
    producer_blocked.set_value();
    comm.wait_send(0, t, compute);
  });
  std::thread receiver([&] {
    producer_blocked.get_future().wait();  // the match happens after the blocking work was enqueued
    Stream& compute = devs[1]->compute();
    comm.recv(1, 0, view_of(dst, 1), &compute);
    comm.wait_done(1, compute);
    compute.host_func([&seen, &consumed, d, numel] {
      seen.assign(d, d + numel);
      consumed.set_value();
    });
  });
  sender.join();
  receiver.join();
  rt->synchronize();
  EXPECT_FALSE(timed_out.load());
  ASSERT_EQ(seen.size(), static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) ASSERT_EQ(seen[static_cast<size_t>(i)], static_cast<float>(7 * i - 3)) << i;
}

// ---- matching order, abort, errors, unwaited sends ----------------------------------------------

// Rank 0 sends five messages to rank 1 with isend and blocking send mixed, and rank 2 two posted
// ones; rank 1 receives them (from 2 in between). The k-th send a->b fills the k-th recv at b from
// a, whether the receiver comes early or late.
TEST(Isend, KthSendOfEitherKindMatchesKthRecv) {
  auto rt = Runtime::create_cpu(3);
  auto devs = first_devices(*rt, 3);
  const int64_t numel = 129;
  const auto val = [](int from, int k, int64_t i) { return static_cast<float>(from * 10000 + k * 1000 + i); };
  for (bool receiver_late : {false, true}) {
    Communicator comm(devs, kSmallChunk);
    const bool posted0[5] = {true, false, true, true, false};
    std::vector<RankBuffers> msgs, recvd;
    for (int k = 0; k < 7; ++k) {
      msgs.emplace_back(devs, DType::kF32, numel);
      recvd.emplace_back(devs, DType::kF32, numel);
      recvd.back().poison();
    }
    for (int k = 0; k < 5; ++k) msgs[k].fill([&](int, int64_t i) { return val(0, k, i); });
    for (int k = 5; k < 7; ++k) msgs[k].fill([&](int, int64_t i) { return val(2, k - 5, i); });
    std::thread r0([&] {
      std::vector<uint64_t> tickets;
      for (int k = 0; k < 5; ++k) {
        if (posted0[k])
          tickets.push_back(comm.isend(0, 1, view_of(msgs[k], 0), nullptr));
        else
          comm.send(0, 1, view_of(msgs[k], 0), nullptr);
      }
      for (uint64_t t : tickets) comm.wait_send(0, t, devs[0]->compute());
    });
    std::thread r2([&] {
      const uint64_t a = comm.isend(2, 1, view_of(msgs[5], 2), nullptr);
      const uint64_t b = comm.isend(2, 1, view_of(msgs[6], 2), nullptr);
      comm.wait_send(2, b, devs[2]->compute());
      comm.wait_send(2, a, devs[2]->compute());
    });
    std::thread r1([&] {
      if (receiver_late) std::this_thread::sleep_for(20ms);
      const int from[7] = {0, 2, 0, 0, 2, 0, 0};
      int k0 = 0, k2 = 5;
      for (int f : from) {
        const int k = f == 0 ? k0++ : k2++;
        comm.recv(1, f, view_of(recvd[k], 1), nullptr);
      }
    });
    r0.join();
    r1.join();
    r2.join();
    rt->synchronize();
    for (int k = 0; k < 7; ++k) {
      const int from = k < 5 ? 0 : 2;
      const int kk = k < 5 ? k : k - 5;
      for (int64_t i = 0; i < numel; ++i)
        ASSERT_EQ(load(DType::kF32, recvd[k].data(1), i), val(from, kk, i))
            << "late " << receiver_late << " message " << kk << " from " << from << " at " << i;
    }
    EXPECT_EQ(comm.counters(0).transfers, 5u);
    EXPECT_EQ(comm.counters(0).bytes_sent, 5u * numel * 4);
    EXPECT_EQ(comm.counters(2).transfers, 2u);
    EXPECT_EQ(comm.counters(1).transfers, 7u);
    EXPECT_EQ(comm.counters(1).bytes_received, 7u * numel * 4);
  }
}

// abort() releases a recv waiting for a send and a wait_send waiting for a recv; a send matched
// before the abort can still be waited for; later isends throw.
TEST(Isend, AbortReleasesABlockedRecvAndABlockedWaitSend) {
  auto rt = Runtime::create_cpu(4);
  auto devs = first_devices(*rt, 4);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 8);
  b.fill([](int r, int64_t i) { return static_cast<float>(r * 100 + i); });
  // Matched before the abort.
  const uint64_t matched = comm.isend(3, 2, view_of(b, 3), nullptr);
  comm.recv(2, 3, view_of(b, 2), nullptr);
  std::vector<std::string> errors(2);
  std::vector<ErrorKind> kinds(2, ErrorKind::kInternal);
  std::thread receiver([&] {
    try {
      comm.recv(1, 0, view_of(b, 1), nullptr);  // rank 0 never sends
    } catch (const Error& e) {
      errors[0] = e.message();
      kinds[0] = e.kind();
    }
  });
  std::atomic<bool> issued{false};  // the isend itself must precede the abort (a loaded machine)
  std::thread sender([&] {
    const uint64_t t = comm.isend(2, 3, view_of(b, 2), &devs[2]->compute());  // rank 3 never receives
    issued = true;
    try {
      comm.wait_send(2, t, devs[2]->compute());
    } catch (const Error& e) {
      errors[1] = e.message();
      kinds[1] = e.kind();
    }
  });
  while (!issued) std::this_thread::yield();
  std::this_thread::sleep_for(30ms);
  comm.abort("rank 0 failed");
  receiver.join();
  sender.join();
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(kinds[static_cast<size_t>(k)], ErrorKind::kDevice);
    EXPECT_THAT(errors[static_cast<size_t>(k)], HasSubstr("abandoned: rank 0 failed"));
  }
  EXPECT_THAT(errors[1], HasSubstr("wait_send on rank 2 (isend to rank 3)"));
  comm.wait_send(3, matched, devs[3]->compute());
  const Error late = error_of([&] { comm.isend(1, 2, view_of(b, 1), nullptr); });
  EXPECT_EQ(late.kind(), ErrorKind::kDevice);
  EXPECT_THAT(late.message(), HasSubstr("isend on rank 1 abandoned: rank 0 failed"));
  rt->synchronize();
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(load(DType::kF32, b.data(2), i), static_cast<float>(300 + i));
}

TEST(Isend, ErrorsOnBothSidesAndBadArguments) {
  auto rt = Runtime::create_cpu(3);
  auto devs = first_devices(*rt, 3);
  Communicator comm(devs, kSmallChunk);
  RankBuffers b(devs, DType::kF32, 8);
  b.fill([](int r, int64_t i) { return static_cast<float>(r * 100 + i); });
  // numel mismatch: the receiver throws at once, the sender at wait_send; the pair is consumed.
  const uint64_t t = comm.isend(0, 1, view_of(b, 0), nullptr);
  TensorView short_view = view_of(b, 1);
  short_view.shape = Shape{7};
  const std::string want = "rank 0 sends 8 x fp32 but rank 1 receives 7 x fp32";
  EXPECT_THAT(error_of([&] { comm.recv(1, 0, short_view, nullptr); }).message(), HasSubstr(want));
  EXPECT_THAT(error_of([&] { comm.wait_send(0, t, devs[0]->compute()); }).message(), HasSubstr(want));
  // dtype mismatch, the recv posted first (matched inside isend, on the sender's thread).
  std::string recv_error;
  std::thread receiver([&] {
    TensorView as_int = view_of(b, 1);
    as_int.dtype = DType::kI32;
    try {
      comm.recv(1, 0, as_int, nullptr);
    } catch (const Error& e) {
      recv_error = e.message();
    }
  });
  std::this_thread::sleep_for(10ms);
  const uint64_t t2 = comm.isend(0, 1, view_of(b, 0), nullptr);
  receiver.join();
  EXPECT_THAT(recv_error, HasSubstr("rank 0 sends 8 x fp32 but rank 1 receives 8 x int32"));
  EXPECT_THAT(error_of([&] { comm.wait_send(0, t2, devs[0]->compute()); }).message(),
              HasSubstr("rank 0 sends 8 x fp32 but rank 1 receives 8 x int32"));
  // Arguments checked at the post.
  EXPECT_THAT(error_of([&] { comm.isend(1, 1, view_of(b, 1), nullptr); }).message(),
              HasSubstr("isend: rank 1 cannot send to itself"));
  EXPECT_THAT(error_of([&] { comm.isend(1, 3, view_of(b, 1), nullptr); }).message(),
              HasSubstr("isend: peer 3 of rank 1 is not a rank of a 3-rank communicator"));
  EXPECT_THAT(error_of([&] { comm.isend(1, 2, view_of(b, 0), nullptr); }).message(),
              HasSubstr("isend: the buffer of rank 1 is not on cpu:1"));
  EXPECT_THAT(error_of([&] { comm.isend(1, 2, view_of(b, 1), &devs[2]->compute()); }).message(),
              HasSubstr("isend: the producer stream of rank 1 runs on cpu:2"));
  EXPECT_THAT(error_of([&] { comm.wait_send(1, 1, devs[1]->compute()); }).message(),
              HasSubstr("wait_send: 1 is not a ticket of rank 1"));
  EXPECT_THAT(error_of([&] { comm.wait_send(0, 99, devs[0]->compute()); }).message(),
              HasSubstr("wait_send: 99 is not a ticket of rank 0"));
  // Nothing was counted for the failed pairs, and the communicator still works.
  EXPECT_EQ(comm.counters(0).transfers, 0u);
  const uint64_t t3 = comm.isend(0, 1, view_of(b, 0), nullptr);
  comm.recv(1, 0, view_of(b, 1), nullptr);
  comm.wait_send(0, t3, devs[0]->compute());
  rt->synchronize();
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(load(DType::kF32, b.data(1), i), static_cast<float>(i));
  EXPECT_EQ(comm.counters(0).transfers, 1u);
  EXPECT_EQ(comm.counters(1).bytes_received, 32u);
}

// A sender that never calls wait_send: beyond kMaxUnwaitedSends the oldest are forgotten, and a
// late wait_send on one still orders its consumer after that copy (here: after every copy). A
// communicator destroyed with posted sends that were never matched neither hangs nor copies.
TEST(Isend, UnwaitedAndUnmatchedSends) {
  auto rt = Runtime::create_cpu(2);
  auto devs = first_devices(*rt, 2);
  const int64_t numel = 64;
  RankBuffers src(devs, DType::kF32, numel);
  RankBuffers dst(devs, DType::kF32, numel);
  src.fill([](int, int64_t i) { return static_cast<float>(i + 1); });
  dst.poison();
  {
    Communicator comm(devs, kSmallChunk);
    const int n = static_cast<int>(Communicator::kMaxUnwaitedSends) + 20;
    uint64_t first = 0;
    devs[1]->comm().host_func([] { std::this_thread::sleep_for(20ms); });  // copies run late
    for (int k = 0; k < n; ++k) {
      const uint64_t t = comm.isend(0, 1, view_of(src, 0), nullptr);
      if (k == 0) first = t;
      comm.recv(1, 0, view_of(dst, 1), nullptr);
    }
    Stream& compute = devs[0]->compute();
    comm.wait_send(0, first, compute);  // forgotten: waits for the newest copy
    float* s = floats(src, 0);
    compute.host_func([s, numel] { std::fill(s, s + numel, -5.0f); });
    rt->synchronize();
    for (int64_t i = 0; i < numel; ++i) ASSERT_EQ(load(DType::kF32, dst.data(1), i), static_cast<float>(i + 1)) << i;
    EXPECT_EQ(comm.counters(0).transfers, static_cast<uint64_t>(n));
    // Never matched: dropped with the communicator (which must not wait for their peer).
    for (int k = 0; k < 3; ++k) comm.isend(1, 0, view_of(dst, 1), &devs[1]->compute());
  }
  rt->synchronize();
}

// A forgotten ticket's wait covers its own link's copy, not only the rank's newest copy: rank 0's
// first send (to rank 1) is held behind a gate on its producer while more than kMaxUnwaitedSends
// sends to rank 2 run on another link and make it forgotten. A wait on the rank's newest copy
// (link 0->2) would let the consumer overwrite the buffer before the held copy read it.
TEST(Isend, ForgottenTicketWaitsForItsOwnLink) {
  auto rt = Runtime::create_cpu(3);
  auto devs = first_devices(*rt, 3);
  const int64_t numel = 64;
  RankBuffers src(devs, DType::kF32, numel);
  RankBuffers dst(devs, DType::kF32, numel);
  src.fill([](int, int64_t i) { return static_cast<float>(i + 1); });
  dst.poison();
  Communicator comm(devs, kSmallChunk);
  Stream& held = devs[0]->create_stream();
  std::promise<void> open;
  std::shared_future<void> open_f = open.get_future().share();
  held.host_func([open_f] { open_f.wait(); });
  const uint64_t first = comm.isend(0, 1, view_of(src, 0), &held);
  comm.recv(1, 0, view_of(dst, 1), nullptr);
  for (size_t k = 0; k <= Communicator::kMaxUnwaitedSends; ++k) {
    comm.isend(0, 2, view_of(src, 0), nullptr);
    comm.recv(2, 0, view_of(dst, 2), nullptr);
  }
  Stream& compute = devs[0]->compute();
  comm.wait_send(0, first, compute);
  float* s = floats(src, 0);
  compute.host_func([s, numel] { std::fill(s, s + numel, -5.0f); });
  std::this_thread::sleep_for(20ms);  // a consumer ordered wrongly has overwritten the buffer by now
  open.set_value();
  rt->synchronize();
  for (int64_t i = 0; i < numel; ++i) ASSERT_EQ(load(DType::kF32, dst.data(1), i), static_cast<float>(i + 1)) << i;
}

}  // namespace
}  // namespace zt
