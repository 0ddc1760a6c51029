// Deadlock-freedom and completeness check of a pipeline schedule, run before any step: a schedule
// that could hang or skip a micro-batch is a bug reported at start as one sentence, not a hang.
//
// The check executes every stage's list on a model of the communication of schedule.h: a send is
// posted and its stage goes on; the k-th recv at b from a takes the k-th send a->b and blocks until
// that send has been posted. It fails, naming the stage, the action index and the action, on:
//  - a deadlock (every unfinished stage blocked in a recv): the first stuck stage, what it waits
//  for
//    and what that peer is doing;
//  - a recv matched to a send of another micro-batch, chunk or payload (pairs posted in different
//    orders), a send/recv to a stage that does not hold the neighbouring virtual stage, a send that
//    is never received;
//  - an F before its activation was received, a backward before its F or before its gradient was
//    received, a W before its B, data sent before it was computed;
//  - a (micro-batch, chunk) of a stage without exactly one F and one B and one W (split schedules)
//    or one fused backward.
#pragma once

#include <string>

#include "pipeline/schedule.h"

namespace zt {

// How a send behaves. kPostedSends is what the schedules are written for (PyTorch's pipelining
// posts isend and waits on the send handles at the end of the step; NCCL isend does not block the
// host). kRendezvous is a send that blocks its stage until the peer's matching recv has been
// posted (the Communicator's per-rank send() today): the plain schedules deadlock under it (1F1B
// as soon as m > 1 and P > 1: stage s sends an activation while stage s+1 sends a gradient), so a
// runtime that wires them must post sends without waiting for the peer, or pair them as send_recv.
enum class CommModel { kPostedSends, kRendezvous };

// The first problem found, as one sentence; "" when the schedule is sound.
std::string find_schedule_error(const Schedule& schedule,
                                CommModel model = CommModel::kPostedSends);

// Throws zt::Error (kInternal: a generated schedule that fails is a bug) with that sentence,
// prefixed with the schedule's name and shape.
void check_schedule(const Schedule& schedule, CommModel model = CommModel::kPostedSends);

}  // namespace zt
