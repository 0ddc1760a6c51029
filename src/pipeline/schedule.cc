// Generates the per-stage action lists of the pipeline schedules (see the design note in
// schedule.h): compute order first, then the send/recv around each F and backward.
#include "pipeline/schedule.h"

#include <algorithm>
#include <deque>

#include "core/status.h"

namespace zt {

const char* pipe_schedule_name(PipeSchedule schedule) {
  switch (schedule) {
    case PipeSchedule::kGpipe:
      return "gpipe";
    case PipeSchedule::k1F1B:
      return "1f1b";
    case PipeSchedule::kInterleaved:
      return "interleaved";
    case PipeSchedule::kZbH1:
      return "zb-h1";
  }
  return "?";
}

PipeSchedule parse_pipe_schedule(const std::string& name) {
  for (PipeSchedule s :
       {PipeSchedule::kGpipe, PipeSchedule::k1F1B, PipeSchedule::kInterleaved, PipeSchedule::kZbH1})
    if (name == pipe_schedule_name(s)) return s;
  ZT_THROW(ErrorKind::kInvalidArgument, "pipeline schedule '", name,
           "' is not one of gpipe, 1f1b, interleaved, zb-h1");
}

const char* action_kind_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackwardInput:
      return "B";
    case ActionKind::kBackwardWeight:
      return "W";
    case ActionKind::kBackward:
      return "BW";
    case ActionKind::kSend:
      return "send";
    case ActionKind::kRecv:
      return "recv";
  }
  return "?";
}

std::string describe(const Action& a) {
  std::string what = detail::concat("m", a.micro, " c", a.chunk);
  if (a.kind == ActionKind::kSend || a.kind == ActionKind::kRecv) {
    const char* payload = a.payload == Payload::kActivation ? "activation"
                          : a.payload == Payload::kGradient ? "gradient"
                                                            : "nothing";
    return detail::concat(action_kind_name(a.kind), " ", payload, " ", what,
                          a.kind == ActionKind::kSend ? " -> stage " : " <- stage ", a.peer);
  }
  return detail::concat(action_kind_name(a.kind), "(", what, ")");
}

namespace {

struct Compute {
  ActionKind kind;
  int micro;
  int chunk;
};

// Compute order of one stage, before communication is inserted.
std::vector<Compute> compute_order(PipeSchedule kind, int P, int m, int V, int s) {
  std::vector<Compute> o;
  const auto F = [&](int i, int c) { o.push_back({ActionKind::kForward, i, c}); };
  const auto BW = [&](int i, int c) { o.push_back({ActionKind::kBackward, i, c}); };
  switch (kind) {
    case PipeSchedule::kGpipe:
      for (int i = 0; i < m; ++i) F(i, 0);
      for (int i = 0; i < m; ++i) BW(i, 0);
      break;
    case PipeSchedule::k1F1B: {
      const int warm = std::min(P - 1 - s, m);
      for (int i = 0; i < warm; ++i) F(i, 0);
      for (int k = 0; k < m - warm; ++k) F(warm + k, 0), BW(k, 0);
      for (int k = m - warm; k < m; ++k) BW(k, 0);
      break;
    }
    case PipeSchedule::kInterleaved: {
      // Megatron's get_model_chunk_id / micro-batch numbering: the k-th forward of a stage runs
      // chunk (k mod PV) / P of micro-batch group k / PV; backwards visit the chunks in reverse.
      const int total = m * V;
      const auto micro = [&](int k) { return (k / (P * V)) * P + k % P; };
      const auto chunk = [&](int k, bool forward) {
        const int c = (k % (P * V)) / P;
        return forward ? c : V - 1 - c;
      };
      const int warm = std::min((P - 1 - s) * 2 + (V - 1) * P, total);
      for (int k = 0; k < warm; ++k) F(micro(k), chunk(k, true));
      for (int k = 0; k < total - warm; ++k)
        F(micro(warm + k), chunk(warm + k, true)), BW(micro(k), chunk(k, false));
      for (int k = total - warm; k < total; ++k) BW(micro(k), chunk(k, false));
      break;
    }
    case PipeSchedule::kZbH1: {
      const int warm = std::min(P - 1 - s, m);
      std::deque<int> pending;  // B done, W not yet
      int next_b = 0;
      const auto backward = [&] {
        o.push_back({ActionKind::kBackwardInput, next_b, 0});
        pending.push_back(next_b++);
        if (static_cast<int>(pending.size()) > s) {
          o.push_back({ActionKind::kBackwardWeight, pending.front(), 0});
          pending.pop_front();
        }
      };
      for (int i = 0; i < warm; ++i) F(i, 0);
      for (int k = 0; k < m - warm; ++k) F(warm + k, 0), backward();
      while (next_b < m) backward();
      for (int i : pending) o.push_back({ActionKind::kBackwardWeight, i, 0});
      break;
    }
  }
  return o;
}

}  // namespace

Schedule make_schedule(PipeSchedule schedule, int stages, int micro_batches, int virtual_stages) {
  const int P = stages, m = micro_batches, V = virtual_stages;
  ZT_REQUIRE(P >= 1, "pipeline: ", P, " stages given; a pipeline needs at least one stage");
  ZT_REQUIRE(m >= 1, "pipeline: ", m, " micro-batches given; a step needs at least one");
  ZT_REQUIRE(V >= 1, "pipeline: ", V, " virtual stages given; each stage needs at least one chunk");
  ZT_REQUIRE(V == 1 || schedule == PipeSchedule::kInterleaved, "pipeline: ", V,
             " virtual stages per device need the interleaved schedule, not ",
             pipe_schedule_name(schedule));
  ZT_REQUIRE(schedule != PipeSchedule::kInterleaved || m % P == 0,
             "pipeline: the interleaved schedule needs the micro-batches (", m,
             ") to be a multiple of the stages (", P, "); use ", (m / P + 1) * P,
             " micro-batches or another schedule");

  Schedule out;
  out.kind = schedule;
  out.stages = P;
  out.micro_batches = m;
  out.virtual_stages = V;
  out.actions.resize(static_cast<size_t>(P));
  const int last = P * V - 1;
  for (int s = 0; s < P; ++s) {
    std::vector<Action>& list = out.actions[static_cast<size_t>(s)];
    for (const Compute& c : compute_order(schedule, P, m, V, s)) {
      const int g = c.chunk * P + s;
      // Neighbouring virtual stages; no send/recv when they live on this stage (P = 1).
      const bool from_prev = g > 0 && P > 1, to_next = g < last && P > 1;
      const int prev = (g - 1 + P) % P, next = (g + 1) % P;
      const bool backward = c.kind == ActionKind::kBackward || c.kind == ActionKind::kBackwardInput;
      if (c.kind == ActionKind::kForward && from_prev)
        list.push_back({ActionKind::kRecv, c.micro, c.chunk, prev, Payload::kActivation});
      if (backward && to_next)
        list.push_back({ActionKind::kRecv, c.micro, c.chunk, next, Payload::kGradient});
      list.push_back({c.kind, c.micro, c.chunk, -1, Payload::kNone});
      if (c.kind == ActionKind::kForward && to_next)
        list.push_back({ActionKind::kSend, c.micro, c.chunk, next, Payload::kActivation});
      if (backward && from_prev)
        list.push_back({ActionKind::kSend, c.micro, c.chunk, prev, Payload::kGradient});
    }
  }
  return out;
}

std::string schedule_note(PipeSchedule schedule, int stages, int micro_batches) {
  if (micro_batches >= stages || stages <= 1 || schedule == PipeSchedule::kGpipe ||
      schedule == PipeSchedule::kInterleaved)
    return "";
  return detail::concat("pipeline: ", micro_batches, " micro-batches for ", stages, " stages: the ",
                        pipe_schedule_name(schedule),
                        " schedule cannot fill its warm-up and runs GPipe-like (the first stages ",
                        "run every forward before any backward), idling more; use at least ",
                        stages, " micro-batches for a real ", pipe_schedule_name(schedule),
                        " schedule");
}

}  // namespace zt
