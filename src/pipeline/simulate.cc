// Discrete-event timing of a checked schedule on the send/recv model of check.h.
#include "pipeline/simulate.h"

#include <algorithm>
#include <limits>

#include "core/status.h"
#include "pipeline/check.h"

namespace zt {

PipelineTiming simulate_schedule(const Schedule& S, const ActionCosts& costs) {
  return simulate_schedule(
      S,
      [&costs](int, const Action& a) {
        return a.kind == ActionKind::kForward         ? costs.forward
               : a.kind == ActionKind::kBackwardInput ? costs.backward_input
               : a.kind == ActionKind::kBackwardWeight
                   ? costs.backward_weight
                   : costs.backward_input + costs.backward_weight;
      },
      costs.send);
}

PipelineTiming simulate_schedule(const Schedule& S, const std::function<double(int, const Action&)>& cost,
                                 double send_latency) {
  check_schedule(S);
  const int P = S.stages;
  // Arrival time of each send a->b, in posting order; taken[] counts the matched ones.
  std::vector<std::vector<double>> chan(size_t(P) * size_t(P));
  std::vector<size_t> taken(chan.size(), 0), pos(size_t(P), 0);
  std::vector<double> t(size_t(P), 0);
  PipelineTiming r;
  r.busy.assign(size_t(P), 0);
  r.first_start.assign(size_t(P), std::numeric_limits<double>::infinity());
  r.last_end.assign(size_t(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      const auto& list = S.actions[size_t(s)];
      for (size_t& k = pos[size_t(s)]; k < list.size(); ++k) {
        const Action& a = list[k];
        double& now = t[size_t(s)];
        if (a.kind == ActionKind::kSend) {
          chan[size_t(s * P + a.peer)].push_back(now + send_latency);
        } else if (a.kind == ActionKind::kRecv) {
          const size_t c = size_t(a.peer * P + s);
          if (taken[c] == chan[c].size()) break;  // the peer has not posted it yet
          now = std::max(now, chan[c][taken[c]++]);
        } else {
          const double d = cost(s, a);
          r.first_start[size_t(s)] = std::min(r.first_start[size_t(s)], now);
          now += d;
          r.busy[size_t(s)] += d;
          r.last_end[size_t(s)] = now;
        }
        progress = true;
      }
    }
  }
  for (int s = 0; s < P; ++s)
    ZT_CHECK(pos[size_t(s)] == S.actions[size_t(s)].size(), "stage ", s, " did not finish");
  const double begin = *std::min_element(r.first_start.begin(), r.first_start.end());
  const double end = *std::max_element(r.last_end.begin(), r.last_end.end());
  r.makespan = end - begin;
  double idle = 0;
  for (int s = 0; s < P; ++s) {
    r.first_start[size_t(s)] -= begin;
    r.last_end[size_t(s)] -= begin;
    r.idle.push_back(r.makespan - r.busy[size_t(s)]);
    idle += r.idle.back();
  }
  r.bubble_fraction = r.makespan > 0 ? idle / (P * r.makespan) : 0;
  r.peak_live = peak_live_activations(S, false);
  r.peak_weight_pending = peak_live_activations(S, true);
  return r;
}

double theoretical_bubble(PipeSchedule schedule, int stages, int micro_batches,
                          int virtual_stages) {
  const double P = stages, m = micro_batches, V = virtual_stages;
  ZT_REQUIRE(stages >= 1 && micro_batches >= 1 && virtual_stages >= 1, "pipeline: ", stages,
             " stages, ", micro_batches, " micro-batches and ", virtual_stages,
             " virtual stages: each must be at least 1");
  switch (schedule) {
    case PipeSchedule::kGpipe:
    case PipeSchedule::k1F1B:
      return (P - 1) / (m + P - 1);
    case PipeSchedule::kInterleaved:
      return (P - 1) / (V * m + P - 1);
    case PipeSchedule::kZbH1:
      return m >= P ? (P - 1) / (3 * m + P - 1) : (2 * P - 1 - m) / (2 * m + 2 * P - 1);
  }
  return 0;
}

std::vector<int> peak_live_activations(const Schedule& S, bool until_weight) {
  std::vector<int> peak;
  for (const auto& list : S.actions) {
    int live = 0, top = 0;
    for (const Action& a : list) {
      if (a.kind == ActionKind::kForward) top = std::max(top, ++live);
      const bool frees =
          a.kind == ActionKind::kBackward ||
          a.kind == (until_weight ? ActionKind::kBackwardWeight : ActionKind::kBackwardInput);
      if (frees) --live;
    }
    peak.push_back(top);
  }
  return peak;
}

}  // namespace zt
