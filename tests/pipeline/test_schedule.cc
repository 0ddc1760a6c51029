// Pipeline schedules (pipeline/schedule.h), their deadlock check (check.h) and simulator
// (simulate.h): every schedule over a grid of shapes is sound and complete, mutated schedules are
// caught with the right sentence, and simulated bubbles with equal costs equal the closed forms.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/status.h"
#include "pipeline/check.h"
#include "pipeline/schedule.h"
#include "pipeline/simulate.h"

namespace zt {
namespace {

const PipeSchedule kAll[] = {PipeSchedule::kGpipe, PipeSchedule::k1F1B, PipeSchedule::kInterleaved,
                             PipeSchedule::kZbH1};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

TEST(PipeSchedule, NamesRoundTripAndBadNamesListTheValidOnes) {
  for (PipeSchedule s : kAll) EXPECT_EQ(parse_pipe_schedule(pipe_schedule_name(s)), s);
  try {
    parse_pipe_schedule("zb-v");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(e.message(),
              "pipeline schedule 'zb-v' is not one of gpipe, 1f1b, interleaved, zb-h1");
  }
}

// The shapes each schedule is built for: V = 1 except interleaved (V in {1, 2, 3}, m % P == 0).
std::vector<std::tuple<PipeSchedule, int, int, int>> grid() {
  std::vector<std::tuple<PipeSchedule, int, int, int>> out;
  for (PipeSchedule s : kAll)
    for (int P : {1, 2, 3, 4, 8})
      for (int m = 1; m <= 16; ++m)
        for (int V = 1; V <= 3; ++V) {
          if (s == PipeSchedule::kInterleaved ? m % P != 0 : V != 1) continue;
          out.emplace_back(s, P, m, V);
        }
  return out;
}

// Independent of check.cc: counts and orders straight from the lists, plus the send/recv framing.
TEST(PipeSchedule, EveryShapeIsDeadlockFreeAndRunsOneFBWPerMicroBatchInOrder) {
  for (auto [kind, P, m, V] : grid()) {
    SCOPED_TRACE(::testing::Message()
                 << pipe_schedule_name(kind) << " P=" << P << " m=" << m << " V=" << V);
    const Schedule S = make_schedule(kind, P, m, V);
    ASSERT_EQ(find_schedule_error(S), "");
    ASSERT_EQ(int(S.actions.size()), P);
    const int last = P * V - 1;
    for (int s = 0; s < P; ++s) {
      const auto& L = S.actions[size_t(s)];
      // Position of each kind of compute per (micro, chunk); -1 = absent; count checked too.
      std::map<std::tuple<int, int, ActionKind>, std::vector<int>> at;
      for (int k = 0; k < int(L.size()); ++k) {
        const Action& a = L[size_t(k)];
        if (a.kind == ActionKind::kSend || a.kind == ActionKind::kRecv) continue;
        at[{a.micro, a.chunk, a.kind}].push_back(k);
        const int g = a.chunk * P + s;
        const bool fwd = a.kind == ActionKind::kForward;
        const bool bwd = a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput;
        // recv before / send after, for the neighbour that lives on another stage.
        const bool needs_in = P > 1 && (fwd ? g > 0 : bwd && g < last);
        const bool needs_out = P > 1 && (fwd ? g < last : bwd && g > 0);
        if (needs_in) {
          ASSERT_GT(k, 0);
          const Action& r = L[size_t(k - 1)];
          EXPECT_EQ(r.kind, ActionKind::kRecv);
          EXPECT_EQ(r.payload, fwd ? Payload::kActivation : Payload::kGradient);
          EXPECT_EQ(r.micro, a.micro);
          EXPECT_EQ(r.peer, fwd ? (g - 1) % P : (g + 1) % P);
        }
        if (needs_out) {
          ASSERT_LT(k + 1, int(L.size()));
          const Action& t = L[size_t(k + 1)];
          EXPECT_EQ(t.kind, ActionKind::kSend);
          EXPECT_EQ(t.payload, fwd ? Payload::kActivation : Payload::kGradient);
          EXPECT_EQ(t.micro, a.micro);
        }
      }
      for (int i = 0; i < m; ++i)
        for (int c = 0; c < V; ++c) {
          const auto pos = [&](ActionKind k) {
            auto it = at.find({i, c, k});
            return it == at.end() ? std::vector<int>{} : it->second;
          };
          const auto f = pos(ActionKind::kForward);
          ASSERT_EQ(f.size(), 1u);
          if (kind == PipeSchedule::kZbH1) {
            const auto b = pos(ActionKind::kBackwardInput), w = pos(ActionKind::kBackwardWeight);
            ASSERT_EQ(b.size(), 1u);
            ASSERT_EQ(w.size(), 1u);
            EXPECT_LT(f[0], b[0]);
            EXPECT_LT(b[0], w[0]);
            EXPECT_TRUE(pos(ActionKind::kBackward).empty());
          } else {
            const auto bw = pos(ActionKind::kBackward);
            ASSERT_EQ(bw.size(), 1u);
            EXPECT_LT(f[0], bw[0]);
          }
        }
    }
  }
}

TEST(PipeSchedule, ShapesTheScheduleCannotRunAreOneSentence) {
  EXPECT_EQ(
      error_of([] { make_schedule(PipeSchedule::kInterleaved, 4, 6, 2); }),
      "pipeline: the interleaved schedule needs the micro-batches (6) to be a multiple of the "
      "stages (4); use 8 micro-batches or another schedule");
  EXPECT_EQ(error_of([] { make_schedule(PipeSchedule::k1F1B, 4, 8, 2); }),
            "pipeline: 2 virtual stages per device need the interleaved schedule, not 1f1b");
  EXPECT_EQ(error_of([] { make_schedule(PipeSchedule::kGpipe, 0, 8); }),
            "pipeline: 0 stages given; a pipeline needs at least one stage");
  EXPECT_EQ(error_of([] { make_schedule(PipeSchedule::kGpipe, 2, 0); }),
            "pipeline: 0 micro-batches given; a step needs at least one");
}

// m < P: 1F1B and ZB-H1 run GPipe-like (warm-up capped at m) with a note; nothing hangs.
TEST(PipeSchedule, FewerMicroBatchesThanStagesRunsGpipeLikeWithANote) {
  for (PipeSchedule kind : {PipeSchedule::k1F1B, PipeSchedule::kZbH1}) {
    const Schedule S = make_schedule(kind, 4, 2);
    EXPECT_EQ(find_schedule_error(S), "");
    // Stage 0 runs both forwards before any backward.
    std::vector<ActionKind> compute;
    for (const Action& a : S.actions[0])
      if (a.kind != ActionKind::kSend && a.kind != ActionKind::kRecv) compute.push_back(a.kind);
    EXPECT_EQ(compute[0], ActionKind::kForward);
    EXPECT_EQ(compute[1], ActionKind::kForward);
    EXPECT_EQ(
        schedule_note(kind, 4, 2),
        std::string("pipeline: 2 micro-batches for 4 stages: the ") + pipe_schedule_name(kind) +
            " schedule cannot fill its warm-up and runs GPipe-like (the first stages run every "
            "forward before any backward), idling more; use at least 4 micro-batches for a real " +
            pipe_schedule_name(kind) + " schedule");
  }
  EXPECT_EQ(schedule_note(PipeSchedule::k1F1B, 4, 4), "");
  EXPECT_EQ(schedule_note(PipeSchedule::kGpipe, 4, 2), "");
}

// ---- mutated schedules --------------------------------------------------------------------------

size_t find_action(const std::vector<Action>& L, ActionKind kind, Payload payload, int micro) {
  for (size_t k = 0; k < L.size(); ++k)
    if (L[k].kind == kind && L[k].payload == payload && L[k].micro == micro) return k;
  ADD_FAILURE() << "action not found";
  return 0;
}

TEST(PipeScheduleCheck, SwappedSendAndRecvIsADeadlockNamingTheStuckStage) {
  Schedule S = make_schedule(PipeSchedule::k1F1B, 4, 8);
  auto& L = S.actions[2];  // recv A0, F0, send A0, recv A1, F1, send A1, recv G0, ...
  const size_t send = find_action(L, ActionKind::kSend, Payload::kActivation, 0);
  const size_t recv = find_action(L, ActionKind::kRecv, Payload::kGradient, 0);
  std::swap(L[send], L[recv]);
  EXPECT_EQ(
      find_schedule_error(S),
      "deadlock: stage 2 action 2 (recv gradient m0 c0 <- stage 3) waits for a send from stage 3, "
      "but stage 3 is itself stuck at action 0 (recv activation m0 c0 <- stage 2)");
  try {
    check_schedule(S);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_EQ(e.message().rfind("pipeline schedule 1f1b (P=4, m=8, V=1): deadlock: stage 2", 0),
              0u);
  }
}

TEST(PipeScheduleCheck, InterleavedCrossChunkDeadlockIsFound) {
  // Stage 0 waits for chunk 1's activation (from stage P-1) before sending chunk 0's first one.
  Schedule S = make_schedule(PipeSchedule::kInterleaved, 2, 2, 2);
  auto& L = S.actions[0];
  const size_t send = find_action(L, ActionKind::kSend, Payload::kActivation, 0);
  size_t recv = 0;
  while (!(L[recv].kind == ActionKind::kRecv && L[recv].chunk == 1)) ++recv;
  std::swap(L[send], L[recv]);
  EXPECT_EQ(find_schedule_error(S),
            "deadlock: stage 0 action 1 (recv activation m0 c1 <- stage 1) waits for a send from "
            "stage 1, but stage 1 is itself stuck at action 0 (recv activation m0 c0 <- stage 0)");
}

TEST(PipeScheduleCheck, MissingSendLeavesTheReceiverWaitingOnAFinishedStage) {
  Schedule S = make_schedule(PipeSchedule::k1F1B, 2, 2);
  auto& last = S.actions[1];
  last.erase(last.begin() + long(find_action(last, ActionKind::kSend, Payload::kGradient, 1)));
  const size_t recv = find_action(S.actions[0], ActionKind::kRecv, Payload::kGradient, 1);
  EXPECT_EQ(find_schedule_error(S), "deadlock: stage 0 action " + std::to_string(recv) +
                                        " (recv gradient m1 c0 <- stage 1) waits for a send from "
                                        "stage 1, but stage 1 has finished its list without "
                                        "posting it");
}

// Why the lists assume posted sends: with sends that wait for their recv, 1F1B deadlocks in its
// steady state (stage 0 sends activation 1 while stage 1 sends gradient 0); GPipe does not.
TEST(PipeScheduleCheck, RendezvousSendsDeadlockOneFOneBButNotGpipe) {
  EXPECT_EQ(find_schedule_error(make_schedule(PipeSchedule::k1F1B, 2, 4), CommModel::kRendezvous),
            "deadlock: stage 0 action 3 (send activation m1 c0 -> stage 1) waits for a recv on "
            "stage 1, but stage 1 is itself stuck at action 3 (send gradient m0 c0 -> stage 0)");
  for (int P = 2; P <= 4; ++P)
    for (int m = 2; m <= 8; ++m)
      EXPECT_EQ(
          find_schedule_error(make_schedule(PipeSchedule::k1F1B, P, m), CommModel::kRendezvous)
              .rfind("deadlock: ", 0),
          0u)
          << "P=" << P << " m=" << m;
  EXPECT_EQ(find_schedule_error(make_schedule(PipeSchedule::kGpipe, 4, 8), CommModel::kRendezvous),
            "");
  EXPECT_EQ(find_schedule_error(make_schedule(PipeSchedule::k1F1B, 4, 1), CommModel::kRendezvous),
            "");
}

TEST(PipeScheduleCheck, MissingRecvIsAForwardWithoutItsActivation) {
  Schedule S = make_schedule(PipeSchedule::k1F1B, 4, 8);
  auto& L = S.actions[1];
  const size_t recv = find_action(L, ActionKind::kRecv, Payload::kActivation, 3);
  L.erase(L.begin() + long(recv));
  EXPECT_EQ(find_schedule_error(S), "stage 1 action " + std::to_string(recv) +
                                        " (F(m3 c0)) runs before its activation was received");
}

TEST(PipeScheduleCheck, BackwardBeforeForwardIsCaught) {
  Schedule S = make_schedule(PipeSchedule::k1F1B, 2, 4);
  auto& L = S.actions[1];  // recv A0, F0, BW0, send G0, ...
  ASSERT_EQ(L[1].kind, ActionKind::kForward);
  ASSERT_EQ(L[2].kind, ActionKind::kBackward);
  std::swap(L[1], L[2]);
  EXPECT_EQ(find_schedule_error(S), "stage 1 action 1 (BW(m0 c0)) runs before its forward");
}

TEST(PipeScheduleCheck, SendsPostedInAnotherOrderThanTheRecvsAreCaught) {
  Schedule S = make_schedule(PipeSchedule::kGpipe, 2, 4);
  auto& L = S.actions[0];  // F0, send A0, F1, send A1, ...
  std::swap(L[0], L[2]);
  std::swap(L[1], L[3]);
  EXPECT_EQ(find_schedule_error(S),
            "stage 1 action 0 (recv activation m0 c0 <- stage 0) is matched with stage 0's send at "
            "action 1 (send activation m1 c0 -> stage 1): stages 0 and 1 post their transfers in "
            "different orders");
}

TEST(PipeScheduleCheck, WeightGradientBeforeItsInputGradientAndMissingWAreCaught) {
  Schedule S = make_schedule(PipeSchedule::kZbH1, 4, 8);
  {
    Schedule T = S;
    auto& L = T.actions[0];
    const size_t b = find_action(L, ActionKind::kBackwardInput, Payload::kNone, 0);
    const size_t w = find_action(L, ActionKind::kBackwardWeight, Payload::kNone, 0);
    std::swap(L[b], L[w]);
    EXPECT_EQ(find_schedule_error(T),
              "stage 0 action " + std::to_string(b) +
                  " (W(m0 c0)) runs before its input-gradient backward (B)");
  }
  auto& L = S.actions[3];
  L.erase(L.begin() + long(find_action(L, ActionKind::kBackwardWeight, Payload::kNone, 5)));
  EXPECT_EQ(find_schedule_error(S), "stage 3 never runs W of micro-batch 5 chunk 0");
}

TEST(PipeScheduleCheck, ASendNobodyReceivesIsCaught) {
  Schedule S = make_schedule(PipeSchedule::k1F1B, 2, 2);
  S.actions[0].push_back({ActionKind::kSend, 1, 0, 1, Payload::kActivation});
  const std::string e = find_schedule_error(S);
  EXPECT_EQ(e, "stage 0 action " + std::to_string(S.actions[0].size() - 1) +
                   " (send activation m1 c0 -> stage 1) is never received by stage 1");
}

// ---- simulation ---------------------------------------------------------------------------------

TEST(PipeSimulate, EqualCostBubbleEqualsTheClosedForm) {
  const ActionCosts unit{};  // F = B = W = 1
  const ActionCosts uneven{.forward = 1, .backward_input = 2, .backward_weight = 0.5};
  for (auto [kind, P, m, V] : grid()) {
    SCOPED_TRACE(::testing::Message()
                 << pipe_schedule_name(kind) << " P=" << P << " m=" << m << " V=" << V);
    const Schedule S = make_schedule(kind, P, m, V);
    const double theory = theoretical_bubble(kind, P, m, V);
    const PipelineTiming t = simulate_schedule(S, unit);
    EXPECT_NEAR(t.bubble_fraction, theory, 1e-12);
    if (kind != PipeSchedule::kZbH1) {  // the ZB-H1 closed form assumes F = B = W
      EXPECT_NEAR(simulate_schedule(S, uneven).bubble_fraction, theory, 1e-12);
    }
    // Busy time is the work itself: m*V (F + B + W) on every stage.
    for (double b : t.busy) EXPECT_DOUBLE_EQ(b, 3.0 * m * V);
  }
}

TEST(PipeSimulate, ZeroBubbleBeatsOneFOneBAtEightMicroBatchesFourStages) {
  const double zb = simulate_schedule(make_schedule(PipeSchedule::kZbH1, 4, 8)).bubble_fraction;
  const double ofob = simulate_schedule(make_schedule(PipeSchedule::k1F1B, 4, 8)).bubble_fraction;
  EXPECT_LT(zb, ofob);
  EXPECT_DOUBLE_EQ(ofob, 3.0 / 11.0);  // (P-1)/(m+P-1)
  EXPECT_DOUBLE_EQ(zb, 3.0 / 27.0);    // (P-1)/(3m+P-1): idle/busy = (P-1)/(3m)
  const double inter =
      simulate_schedule(make_schedule(PipeSchedule::kInterleaved, 4, 8, 2)).bubble_fraction;
  EXPECT_DOUBLE_EQ(inter, 3.0 / 19.0);  // (P-1)/(Vm+P-1)
}

TEST(PipeSimulate, TransferLatencyDelaysTheReceiver) {
  // P = 2, m = 1: F, transfer, F + BW, transfer, BW on the first stage.
  const ActionCosts c{.forward = 1, .backward_input = 2, .backward_weight = 1, .send = 0.25};
  const PipelineTiming t = simulate_schedule(make_schedule(PipeSchedule::k1F1B, 2, 1), c);
  EXPECT_DOUBLE_EQ(t.makespan, 1 + 0.25 + 1 + 3 + 0.25 + 3);
  EXPECT_DOUBLE_EQ(t.first_start[1], 1.25);
  EXPECT_DOUBLE_EQ(t.last_end[1], 5.25);
}

TEST(PipeSimulate, PeakLiveActivations) {
  for (int P : {2, 4, 8})
    for (int m : {1, 3, 8, 16}) {
      const auto gp = peak_live_activations(make_schedule(PipeSchedule::kGpipe, P, m));
      const auto of = peak_live_activations(make_schedule(PipeSchedule::k1F1B, P, m));
      const Schedule zb = make_schedule(PipeSchedule::kZbH1, P, m);
      const auto zl = peak_live_activations(zb), zw = peak_live_activations(zb, true);
      for (int s = 0; s < P; ++s) {
        EXPECT_EQ(gp[size_t(s)], m);
        EXPECT_EQ(of[size_t(s)], std::min(P - s, m));
        EXPECT_EQ(zl[size_t(s)], std::min(P - s, m));
        if (m >= P) {
          EXPECT_EQ(zw[size_t(s)], P);  // W keeps its inputs: 1F1B's first-stage peak
        }
      }
    }
  // Interleaved: the first stage holds (P-1)*2 + (V-1)*P + 1 chunks' activations (Megatron
  // warm-up).
  EXPECT_EQ(peak_live_activations(make_schedule(PipeSchedule::kInterleaved, 4, 8, 2))[0], 11);
}

TEST(PipeSimulate, TheoreticalBubbleClosedForms) {
  EXPECT_DOUBLE_EQ(theoretical_bubble(PipeSchedule::k1F1B, 4, 8), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(theoretical_bubble(PipeSchedule::kGpipe, 1, 8), 0.0);
  EXPECT_DOUBLE_EQ(theoretical_bubble(PipeSchedule::kInterleaved, 4, 8, 3), 3.0 / 27.0);
  EXPECT_DOUBLE_EQ(theoretical_bubble(PipeSchedule::kZbH1, 4, 2), 5.0 / 11.0);
}

}  // namespace
}  // namespace zt
