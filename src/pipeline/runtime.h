// Runs one step of a pipeline schedule (schedule.h) on devices: each stage's host thread walks its
// action list, enqueuing compute on its device's compute stream and activations and gradients as
// posted sends on the comm streams (Communicator::isend / recv), never waiting for a stream, so
// the host only blocks where the schedule's receives block (which check_schedule proved cannot
// deadlock). Compute spans are recorded when the stream reaches them, for the measured bubble.
//
// Design note:
//  - The runtime orders, the stage computes: StageWork is the seam (a GPT stage in
//    model_stage.h, a timed synthetic stage in the tests), so the schedules' timing and the
//    models' numerics are tested apart and together.
//  - Buffers belong to the StageWork (a GPT stage reuses workspaces across micro-batches, so its
//    receives may have to follow its compute: receive_after); sends are waited for (wait_send) at
//    the end of the stage's list, so no send buffer is overwritten before its copy ran. When the
//    neighbouring virtual stage lives on the same device (P = 1 with V > 1) the hand-off is a copy
//    on the compute stream.
//  - Measured bubble: the definitions of simulate.h (makespan from the first compute span's
//    start to the last one's end over all stages; bubble = sum of idle / (P * makespan)).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "pipeline/schedule.h"
#include "runtime/event.h"
#include "runtime/stream.h"

namespace zt {

class Communicator;

// What one stage computes. Every call enqueues on stream() and returns.
class StageWork {
 public:
  virtual ~StageWork() = default;
  virtual Stream& stream() = 0;
  virtual void forward(int chunk, int micro) = 0;
  virtual void backward(int chunk, int micro) = 0;  // input and weight gradients together
  virtual void backward_input(int chunk, int micro) = 0;
  virtual void backward_weight(int chunk, int micro) = 0;
  // The buffers transfers read (out) and write (in); a send's buffer and the matching receive's
  // have the same dtype and numel. Valid for the whole step.
  virtual TensorView activation_out(int chunk, int micro) = 0;
  virtual TensorView activation_in(int chunk, int micro) = 0;
  virtual TensorView gradient_out(int chunk, int micro) = 0;
  virtual TensorView gradient_in(int chunk, int micro) = 0;
  // What a receive into (chunk, micro)'s buffer must follow: a buffer that served an earlier
  // micro-batch of this step is written only after the event recorded on stream() when that use
  // ended (nullptr: the buffer is fresh this step; the runtime orders the step's receives after
  // the previous step). An event, not the stream: waiting for all the compute the host has run
  // ahead to enqueue would put every transfer on the critical path.
  virtual const Event* receive_after(int chunk, int micro) { return nullptr; }
};

// One compute action as its stream ran it (steady clock, microseconds from any fixed origin).
struct StageSpan {
  int stage = 0;
  ActionKind kind = ActionKind::kForward;
  int micro = 0, chunk = 0;
  double start_us = 0, end_us = 0;
};

// Times a stage's compute spans with timing events on its stream instead of host functions: on
// CUDA a host function stalls its stream until CUDA's callback thread has run it (two per action),
// and the logical devices of one GPU share that thread. One per stage, reused step after step.
class SpanTimer {
 public:
  // run_pipeline_stage: span `span`'s start or end is when `s` reaches this point.
  void mark(Stream& s, size_t span, bool end);
  // After `s` ran every mark (e.g. after synchronizing it): writes the marked spans' times into
  // `spans` (steady-clock microseconds, the trace's clock), through one anchor event
  // whose host time is read when it completes on the idle stream.
  void resolve(Stream& s, std::vector<StageSpan>& spans);
  // Forgets marks never resolved (a step that failed part-way), before reusing cleared spans.
  void discard() { marks_.clear(); }

 private:
  struct Mark {
    size_t span;
    bool end;
  };
  std::vector<std::unique_ptr<Event>> events_;  // marks_[k] recorded events_[k]
  std::vector<Mark> marks_;
  std::unique_ptr<Event> anchor_;
};

struct StageRunOptions {
  // Compute spans are appended here, one vector per stage, and timed by `timer` (required with
  // spans): timer->resolve writes their times after the stream's synchronisation.
  std::vector<StageSpan>* spans = nullptr;
  SpanTimer* timer = nullptr;
  // Tests: called before each action with the streams that action uses, to inject delays.
  std::function<void(const Action&, Stream& compute, Stream& comm)> before_action;
};

// Stage `stage`'s list of `schedule`, on communicator rank ranks[stage] (the comm's rank drives
// work.stream()'s device). Call from one host thread per stage, all stages concurrently; returns
// once everything is enqueued and the stage's sends have been received (the streams still run).
void run_pipeline_stage(const Schedule& schedule, int stage, Communicator& comm, const std::vector<int>& ranks,
                        StageWork& work, const StageRunOptions& options = {});

struct PipelineBubble {
  double makespan_us = 0;
  std::vector<double> busy_us;  // per stage
  double fraction = 0;          // sum over stages of idle / (P * makespan)
};
PipelineBubble measure_bubble(const std::vector<StageSpan>& spans, int stages);

}  // namespace zt
