// One pipeline step on devices (see runtime.h).
#include "pipeline/runtime.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "comm/communicator.h"
#include "core/nvtx.h"
#include "core/status.h"
#include "runtime/device.h"

namespace zt {

namespace {

double clock_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool is_compute(ActionKind k) { return k != ActionKind::kSend && k != ActionKind::kRecv; }

TensorView transfer_buffer(StageWork& w, const Action& a) {
  const bool send = a.kind == ActionKind::kSend;
  if (a.payload == Payload::kActivation) return send ? w.activation_out(a.chunk, a.micro) : w.activation_in(a.chunk, a.micro);
  return send ? w.gradient_out(a.chunk, a.micro) : w.gradient_in(a.chunk, a.micro);
}

void copy_local(Stream& s, TensorView to, TensorView from) {
  ZT_CHECK(to.dtype == from.dtype && to.numel() == from.numel(), "pipeline hand-off of ", from.numel(), " to ",
           to.numel(), " elements");
  s.copy(to.data, from.data, static_cast<size_t>(from.numel()) * dtype_size(from.dtype));
}

}  // namespace

void run_pipeline_stage(const Schedule& sched, int stage, Communicator& comm, const std::vector<int>& ranks,
                        StageWork& work, const StageRunOptions& opt) {
  const int P = sched.stages, V = sched.virtual_stages;
  ZT_CHECK(stage >= 0 && stage < P && static_cast<int>(ranks.size()) == P, "pipeline stage ", stage, " of ", P,
           " with ", ranks.size(), " ranks");
  const int rank = ranks[static_cast<size_t>(stage)];
  Stream& s = work.stream();
  Stream& comm_stream = comm.device(rank).comm();
  // A receive into a buffer fresh this step follows the previous step's use of it: the comm stream
  // waits for that once, here. (A receive that waited for the compute stream's work so far would
  // hold every later copy on this comm stream behind the compute the host has run ahead to
  // enqueue; receives into reused buffers wait for an event, see StageWork::receive_after.)
  const std::unique_ptr<Event> step_start = s.device().create_event();
  s.record(*step_start);
  comm_stream.wait(*step_start);
  std::vector<uint64_t> sends;
  const auto& actions = sched.actions[static_cast<size_t>(stage)];
  size_t next_span = 0;
  if (opt.spans != nullptr) {
    ZT_CHECK(opt.timer != nullptr, "run_pipeline_stage: compute spans are timed by a SpanTimer");
    next_span = opt.spans->size();
    opt.spans->resize(next_span + static_cast<size_t>(std::count_if(actions.begin(), actions.end(),
                                                                     [](const Action& a) { return is_compute(a.kind); })));
  }
  for (const Action& a : actions) {
    if (opt.before_action) opt.before_action(a, s, comm_stream);
    switch (a.kind) {
      case ActionKind::kSend:
        sends.push_back(comm.isend(rank, ranks[static_cast<size_t>(a.peer)], transfer_buffer(work, a), &s));
        continue;
      case ActionKind::kRecv:
        if (const Event* free = work.receive_after(a.chunk, a.micro)) comm_stream.wait(*free);
        comm.recv(rank, ranks[static_cast<size_t>(a.peer)], transfer_buffer(work, a), nullptr);
        comm.wait_done(rank, s);
        continue;
      default:
        break;
    }
    // A neighbouring virtual stage on this device (P = 1): no transfer, a copy.
    const int g = sched.virtual_stage(stage, a.chunk);
    if (P == 1 && a.kind == ActionKind::kForward && g > 0)
      copy_local(s, work.activation_in(a.chunk, a.micro), work.activation_out(a.chunk - 1, a.micro));
    if (P == 1 && (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) && g < P * V - 1)
      copy_local(s, work.gradient_in(a.chunk, a.micro), work.gradient_out(a.chunk + 1, a.micro));
    const size_t span = next_span++;
    if (opt.spans != nullptr) {
      (*opt.spans)[span] = StageSpan{stage, a.kind, a.micro, a.chunk, 0, 0};
      opt.timer->mark(s, span, false);
    }
    {
      const NvtxRange range(a.kind == ActionKind::kForward ? NvtxCategory::kForward : NvtxCategory::kBackward,
                            describe(a), s.device().index());
      switch (a.kind) {
        case ActionKind::kForward: work.forward(a.chunk, a.micro); break;
        case ActionKind::kBackward: work.backward(a.chunk, a.micro); break;
        case ActionKind::kBackwardInput: work.backward_input(a.chunk, a.micro); break;
        case ActionKind::kBackwardWeight: work.backward_weight(a.chunk, a.micro); break;
        default: break;
      }
    }
    if (opt.spans != nullptr) opt.timer->mark(s, span, true);
  }
  for (uint64_t t : sends) comm.wait_send(rank, t, s);
}

void SpanTimer::mark(Stream& s, size_t span, bool end) {
  const size_t k = marks_.size();
  if (k == events_.size()) events_.push_back(s.device().create_timing_event());
  s.record(*events_[k]);
  marks_.push_back(Mark{span, end});
}

void SpanTimer::resolve(Stream& s, std::vector<StageSpan>& spans) {
  if (marks_.empty()) return;
  if (!anchor_) anchor_ = s.device().create_timing_event();
  s.record(*anchor_);
  anchor_->synchronize();
  const double now = clock_us();
  for (size_t k = 0; k < marks_.size(); ++k) {
    const Mark& m = marks_[k];
    ZT_CHECK(m.span < spans.size(), "span ", m.span, " of ", spans.size(), " marked");
    // Unknown (a failed device's events): a span of no length at the anchor.
    const std::optional<double> ago = anchor_->seconds_since(*events_[k]);
    (m.end ? spans[m.span].end_us : spans[m.span].start_us) = ago ? now - *ago * 1e6 : now;
  }
  marks_.clear();
}

PipelineBubble measure_bubble(const std::vector<StageSpan>& spans, int stages) {
  PipelineBubble b;
  b.busy_us.assign(static_cast<size_t>(stages), 0.0);
  if (spans.empty()) return b;
  double first = spans.front().start_us, last = spans.front().end_us;
  for (const StageSpan& sp : spans) {
    ZT_CHECK(sp.stage >= 0 && sp.stage < stages, "span of stage ", sp.stage, " in a ", stages, "-stage pipeline");
    first = std::min(first, sp.start_us), last = std::max(last, sp.end_us);
    b.busy_us[static_cast<size_t>(sp.stage)] += sp.end_us - sp.start_us;
  }
  b.makespan_us = last - first;
  if (b.makespan_us <= 0) return b;
  double idle = 0;
  for (double busy : b.busy_us) idle += b.makespan_us - busy;
  b.fraction = idle / (stages * b.makespan_us);
  return b;
}

}  // namespace zt
