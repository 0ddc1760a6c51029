// Stream's default capture entries (a backend that cannot capture says so in one sentence) and
// the event the pool records for a cross-stream free.
#include "runtime/stream.h"

#include "core/status.h"
#include "runtime/device.h"

namespace zt {

void Stream::begin_capture() {
  ZT_THROW(ErrorKind::kInvalidArgument, "stream ", id(), " of ", device().name(),
           " cannot be captured into a graph: its backend has no stream capture");
}

std::unique_ptr<StreamGraph> Stream::end_capture() {
  ZT_THROW(ErrorKind::kInvalidArgument, "stream ", id(), " of ", device().name(), " is not capturing");
}

std::shared_ptr<PoolEvent> Stream::record_new_event() {
  std::shared_ptr<Event> e = device().create_event();
  record(*e);
  return e;
}

}  // namespace zt
