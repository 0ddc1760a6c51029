// TaskObserver: what a Runtime reports about the work its streams run (the --trace timeline, test
// counters). Installed per Runtime (Runtime::create(..., observer) or Runtime::set_observer) and
// implemented by both backends: the CPU backend reports every stream task as its worker runs it;
// the CUDA backend brackets every op and copy with an event pair and reports it once resolved.
#pragma once

#include <chrono>

namespace zt {

class TaskObserver {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~TaskObserver() = default;
  // One finished piece of stream work: `device` is the logical device index, `stream` the
  // stream's id (0 compute, 1 comm), `name` a string literal naming the op or copy, start/end on
  // the host's steady clock. Event records and waits are not reported. Called from backend
  // threads (CPU: the stream's worker, right after the task; CUDA: the host thread that
  // synchronizes, after the GPU finished the work), so it must be thread-safe.
  virtual void on_task(int device, int stream, const char* name, Clock::time_point start,
                       Clock::time_point end) = 0;
};

}  // namespace zt
