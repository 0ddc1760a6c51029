// Event: a marker in a stream's work, with CUDA semantics.
//  - Stream::record(e) captures "all work submitted to that stream so far"; recording again
//    re-targets the event (later waits see only the newest record).
//  - Stream::wait(e) makes *later* work on the waiting stream wait for the record that was current
//    when wait() was called; waiting on a never-recorded event is a no-op.
#pragma once

namespace zt {

class Event {
 public:
  virtual ~Event() = default;
  // True when the captured work has completed (or the event was never recorded). Never blocks.
  virtual bool query() = 0;
  // Blocks the host until the captured work has completed.
  virtual void synchronize() = 0;
};

}  // namespace zt
