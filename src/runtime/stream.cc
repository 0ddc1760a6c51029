// Stream's default capture entries: a backend that cannot capture says so in one sentence.
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

}  // namespace zt
