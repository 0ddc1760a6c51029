// What the caching pool needs of a stream and of an event, and which streams the calling thread is
// capturing: the runtime's Stream and Event (runtime/stream.h, event.h) implement these, so the
// pool, a layer below the runtime that owns one per device, never includes runtime/.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/capture_rules.h"

namespace zt {

// An event as the pool waits on it (runtime/event.h states the semantics).
class PoolEvent {
 public:
  virtual ~PoolEvent() = default;
  // True once the recorded work has completed. Never blocks.
  virtual bool query() = 0;
  // Blocks the host until the recorded work has completed.
  virtual void synchronize() = 0;
};

// A stream as the pool sees it: an identity its blocks are tied to (the address), and the few
// calls of runtime/stream.h that the pool makes. The pool only ever holds zt::Streams; these are
// the same virtual calls it made on Stream before, plus record_new_event (a cross-stream free).
class PoolStream {
 public:
  virtual ~PoolStream() = default;
  // Small integer, unique among the device's streams (named in OOM reports and refusals).
  virtual int id() const = 0;
  // Blocks until all submitted work is done (before a segment goes back to the raw allocator).
  virtual void synchronize() = 0;
  // A new event of this stream's device, recorded on this stream now.
  virtual std::shared_ptr<PoolEvent> record_new_event() = 0;
  // True while the stream is capturing a graph; callable from any thread.
  virtual bool capturing() const = 0;
  // Fails the capture in progress with `why` (the first reason wins); no-op when not capturing.
  virtual void invalidate_capture(const std::string& why) = 0;
};

// ---- the calling thread's captures (cudaStreamCaptureModeThreadLocal) --------------------------
// Both backends begin every capture in thread-local mode: the "potentially unsafe" calls (raw
// allocations and frees, event queries) are refused on the thread that began a capture still in
// progress, for any stream, and allowed on every other thread. Header-only and inline: the pool
// asks this_thread_captures() on every allocation.
namespace capture_detail {
inline thread_local std::vector<PoolStream*> t_captures;
}  // namespace capture_detail

// Called by the backends' begin_capture()/end_capture() on the capturing thread.
inline void note_capture_begun(PoolStream* s) { capture_detail::t_captures.push_back(s); }
inline void note_capture_ended(PoolStream* s) {
  auto& v = capture_detail::t_captures;
  v.erase(std::remove(v.begin(), v.end(), s), v.end());
}
inline bool this_thread_captures() { return !capture_detail::t_captures.empty(); }

// Refuses a potentially unsafe call on a thread with captures in progress: each of them fails
// with the reason (CUDA invalidates the thread's captures), then throws it.
[[noreturn]] inline void refuse_on_capturing_thread(CaptureRule r, const std::string& where) {
  const std::vector<PoolStream*> captures = capture_detail::t_captures;
  std::string msg = capture_refusal(r, where);
  for (PoolStream* s : captures) s->invalidate_capture(msg);
  throw CaptureError(r, std::move(msg));
}

}  // namespace zt
