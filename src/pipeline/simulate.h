// Times a pipeline schedule with given per-action costs (no devices): per-stage busy and idle time,
// the makespan and the bubble fraction, next to the schedule's closed-form bubble; and the peak
// number of live activations per stage, for memory planning.
//
// Definitions (one step; "compute" = F, B, W and fused backward actions):
//  - makespan: from the first compute action's start on any stage to the last one's end on any
//    stage (the step's window, as the trace records it).
//  - bubble fraction = sum over stages of (makespan - busy_s) / (P * makespan): the share of the
//    stage-time in the step's window that is not compute.
//  - theoretical_bubble, for costs equal on every stage and no transfer latency:
//      gpipe, 1f1b:   (P-1) / (m + P-1)            (any F, B, W; "(P-1)/m" is idle / busy)
//      interleaved:   (P-1) / (V*m + P-1)          (any F, B, W per chunk)
//      zb-h1:         (P-1) / (3m + P-1)  for m >= P, (2P-1-m) / (2m + 2P-1) for m < P,
//                     with F = B = W ("(P-1)/(3m)" is idle / busy)
//    simulate_schedule with equal costs returns exactly these.
//  - live activations: forwards whose backward (B, or the fused backward) has not run, in chunk
//    units (a chunk is 1/V of the stage's blocks); 1F1B and ZB-H1 peak at P on the first stage
//    (P - s on stage s), GPipe at m. weight_pending also counts those whose W has not run
//    (what ZB-H1 keeps for W): P on every stage for ZB-H1 when m >= P, equal to live otherwise.
#pragma once

#include <functional>
#include <vector>

#include "pipeline/schedule.h"

namespace zt {

struct ActionCosts {
  double forward = 1;
  double backward_input = 1;   // B; a fused backward costs B + W
  double backward_weight = 1;  // W
  double send = 0;             // latency from a send being posted to its data at the receiver
};

struct PipelineTiming {
  std::vector<double> busy;         // compute time per stage
  std::vector<double> idle;         // makespan - busy, per stage
  std::vector<double> first_start;  // per stage, from the step's start
  std::vector<double> last_end;
  double makespan = 0;
  double bubble_fraction = 0;
  std::vector<int> peak_live;  // see peak_live_activations
  std::vector<int> peak_weight_pending;
};

// Checks the schedule (check_schedule; throws on a broken one), then times it.
PipelineTiming simulate_schedule(const Schedule& schedule, const ActionCosts& costs = {});
// The same with each compute action's own cost (e.g. the durations a run measured: replaying them
// tells the idle time the schedule's dependencies imply from what the runtime added).
PipelineTiming simulate_schedule(const Schedule& schedule, const std::function<double(int stage, const Action&)>& cost,
                                 double send_latency = 0);

double theoretical_bubble(PipeSchedule schedule, int stages, int micro_batches,
                          int virtual_stages = 1);

// From the lists' order alone (no timing): peak live activations per stage; with
// `until_weight`, counting a forward live until its W (or fused backward) has run.
std::vector<int> peak_live_activations(const Schedule& schedule, bool until_weight = false);

}  // namespace zt
