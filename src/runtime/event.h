// Event: a marker in a stream's work, with CUDA semantics.
//  - Stream::record(e) captures "all work submitted to that stream so far"; recording again
//    re-targets the event (later waits see only the newest record).
//  - Stream::wait(e) makes *later* work on the waiting stream wait for the record that was current
//    when wait() was called; waiting on a never-recorded event is a no-op.
#pragma once

#include <optional>

#include "memory/pool_stream.h"

namespace zt {

// A PoolEvent (memory/pool_stream.h): the pool waits on events through that interface.
class Event : public PoolEvent {
 public:
  // True when the captured work has completed (or the event was never recorded). Never blocks.
  bool query() override = 0;
  // Blocks the host until the captured work has completed.
  void synchronize() override = 0;
  // Seconds from the completion of `start`'s record to this event's (device time, negative if
  // this one completed first). Never blocks: nullopt unless both were recorded, have completed,
  // live on one device and come from Device::create_timing_event().
  virtual std::optional<double> seconds_since(const Event& start) const {
    (void)start;
    return std::nullopt;
  }
};

}  // namespace zt
