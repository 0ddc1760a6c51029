// Pipeline-parallel schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1) as one ordered
// list of actions per pipeline stage (device), generated ahead of time from (schedule, P, m, V) so
// that check.h can prove them deadlock-free and simulate.h can time them before any run.
//
// Design note:
//  - Stage s of P holds V model chunks (virtual stages); chunk c of stage s is virtual stage
//    g = c*P + s (Megatron's interleaving), so activations flow s -> s+1 within a chunk and from
//    stage P-1 chunk c to stage 0 chunk c+1. V = 1 for every schedule but kInterleaved.
//  - Every F of a virtual stage other than the first is preceded by a kRecv of its activation and
//    every F but the last virtual stage's is followed by a kSend; gradients flow the other way
//    (recv before B / fused backward, send after). When the neighbouring virtual stage lives on
//    the same device (P = 1 with V > 1) there is no send/recv: the hand-off is local.
//  - Communication semantics the lists are written for (and check.h verifies): a send is posted
//    and the sender goes on (an isend on a comm stream); a recv blocks its stage until the matching
//    send has been posted. The k-th send a->b matches the k-th recv at b from a. (Sends that wait
//    for their recv deadlock 1F1B; see CommModel in check.h.)
//  - Orders: GPipe = all forwards, then all backwards (reverse order). 1F1B = P-1-s warm-up
//    forwards, steady one-forward-one-backward, cool-down backwards (PyTorch Schedule1F1B /
//    Megatron). Interleaved = Megatron's interleaved 1F1B (Narayanan et al. 2021): warm-up
//    (P-1-s)*2 + (V-1)*P forwards, micro-batches taken in groups of P per chunk; needs m % P == 0.
//    ZB-H1 (Qi et al. 2023, the H1 schedule of their Figure 3): 1F1B's warm-up and order of F and
//    B, with the backward split into B (input gradient, on the critical path) and W (weight
//    gradient); stage s defers its first s W's (a W runs after a B once more than s are pending),
//    which fills the cool-down waits of 1F1B, and drains the rest at the end. Live activations
//    (F whose B has not run) peak at P - s on stage s as in 1F1B; F whose W has not run peak at P
//    on every stage (1F1B's peak on the first stage). With F = B = W and m >= P the makespan is
//    3m + P - 1 (1F1B: 3(m + P - 1)).
//  - m < P: GPipe, 1F1B and ZB-H1 run; 1F1B's and ZB-H1's warm-up is capped at m, so they become
//    GPipe-like (the first stages run every forward before any backward) and `schedule_note`
//    returns a sentence saying so for the run to print. Interleaved refuses (m % P != 0) with one
//    sentence. Nothing hangs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zt {

enum class PipeSchedule : uint8_t { kGpipe, k1F1B, kInterleaved, kZbH1 };

// "gpipe", "1f1b", "interleaved", "zb-h1".
const char* pipe_schedule_name(PipeSchedule schedule);
// Inverse of pipe_schedule_name; any other text: one zt::Error sentence listing the valid names.
PipeSchedule parse_pipe_schedule(const std::string& name);

enum class ActionKind : uint8_t {
  kForward,         // F
  kBackwardInput,   // B: gradient with respect to the chunk's input (what the previous stage needs)
  kBackwardWeight,  // W: gradient with respect to the chunk's weights
  kBackward,        // B and W fused, for the schedules that do not split the backward
  kSend,
  kRecv,
};
const char* action_kind_name(ActionKind kind);  // "F", "B", "W", "BW", "send", "recv"

enum class Payload : uint8_t { kNone, kActivation, kGradient };

struct Action {
  ActionKind kind = ActionKind::kForward;
  int micro = 0;  // micro-batch index
  int chunk = 0;  // model chunk on this stage (0..V-1); for send/recv the chunk on *this* stage
                  // that produced (send) or will consume (recv) the data
  int peer = -1;  // the other stage of a send/recv; -1 for compute
  Payload payload = Payload::kNone;  // what a send/recv carries
  bool operator==(const Action&) const = default;
};

// "F(m3,c0)", "send activation m3 c0 -> stage 2", "recv gradient m3 c1 <- stage 2"
std::string describe(const Action& a);

struct Schedule {
  PipeSchedule kind = PipeSchedule::k1F1B;
  int stages = 1;                            // P
  int micro_batches = 1;                     // m
  int virtual_stages = 1;                    // V (chunks per stage)
  std::vector<std::vector<Action>> actions;  // one ordered list per stage

  bool splits_backward() const { return kind == PipeSchedule::kZbH1; }
  // Virtual stage of a stage's chunk; virtual stage g lives on stage g % P as chunk g / P.
  int virtual_stage(int stage, int chunk) const { return chunk * stages + stage; }
};

// Builds the per-stage lists. P >= 1, m >= 1, V >= 1 (V > 1 only for kInterleaved; interleaved
// needs m % P == 0); a violation is one zt::Error sentence naming the numbers.
Schedule make_schedule(PipeSchedule schedule, int stages, int micro_batches,
                       int virtual_stages = 1);

// A sentence for the run to print when the schedule degrades (m < P: GPipe-like), else "".
std::string schedule_note(PipeSchedule schedule, int stages, int micro_batches);

}  // namespace zt
