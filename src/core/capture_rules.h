// What a stream capture refuses, in one table: CUDA's rules (each entry cites where CUDA states it
// and names the error CUDA returns) and ZeroTrain's own stricter ones, and the error both backends
// throw for them. Pure data and strings, no streams: the pool (memory/, below the runtime) reads
// it too; the calling thread's captures are memory/pool_stream.h's.
//
// Both backends check these rules before CUDA sees a call, so the CPU backend refuses exactly what
// the CUDA backend refuses and a refused call fails on a machine without a GPU. The calls no
// zt::Stream/Event/Device entry can make (cudaStreamGetDevice, the legacy stream) are kept out of
// the CUDA launchers by a source check over kernels/cuda (tests/runtime/test_stream_capture.cc):
// the first GPU run failed on a cudaStreamGetDevice there.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "core/status.h"

namespace zt {

enum class CaptureRule : int {
  // CUDA's rules.
  kStreamSynchronize,      // Stream::synchronize / synchronize_for of a capturing stream
  kStreamQuery,            // Stream::query of a capturing stream
  kDeviceSynchronize,      // Device::synchronize / synchronize_for while one of its streams captures
  kStreamGetDevice,        // asking CUDA for a capturing stream's device (no zt call does)
  kRawAllocation,          // the pool's raw allocator, on a thread with a capture in progress
  kRawFree,                // the pool handing a segment back, on a thread with a capture in progress
  kHostPinnedAllocation,   // Device::alloc_host_pinned on a thread with a capture in progress
  kEventQuery,             // Event::query / synchronize on a thread with a capture in progress
  kWaitOnUncapturedEvent,  // Stream::wait by a capturing stream on an event recorded outside it
  kEndOnOtherThread,       // end_capture on another thread than begin_capture's
  kUseAfterInvalidation,   // work submitted to a failed capture, and its end_capture
  kLegacyStream,           // the legacy stream / synchronous cudaMemcpy, cudaMemset
  kCapturedEvent,          // query / synchronize of an event recorded inside a capture
  // ZeroTrain's own rules: CUDA accepts these calls, we refuse them (see runtime/stream.h).
  kRecordInCapture,        // Stream::record on a capturing stream (captures are single-stream)
  kWaitInCapture,          // Stream::wait on a never-recorded event by a capturing stream
  kPoolForCapturingStream, // pool allocation for, or free of a block of, a capturing stream
  kLaunchIntoCapture,      // StreamGraph::launch on a capturing stream
  kCount,
};

struct CaptureRuleInfo {
  CaptureRule rule;
  const char* call;        // what ZeroTrain refuses
  const char* cuda_calls;  // the CUDA API functions the rule covers, space-separated
  // What CUDA returns for it; nullptr for ZeroTrain's own rules (CUDA accepts the call).
  const char* cuda_error;
  // The capture fails: the refused call throws, and end_capture() throws
  // cudaErrorStreamCaptureInvalidated with this entry's message; the stream is out of capture mode
  // and usable after it, and nothing captured before the failure runs (the guide's Invalidation).
  bool invalidates;
  // The source check fails when a CUDA launcher (kernels/cuda) calls one of
  // cuda_calls: launchers run inside captures, and no zt entry point stands between them and CUDA.
  bool launchers_must_not_call;
  const char* source;  // where the rule is stated
};

namespace capture_detail {
constexpr const char* kGuide = "CUDA Programming Guide, CUDA Graphs > Stream Capture > ";
}  // namespace capture_detail

// Indexed by CaptureRule. Sources: the CUDA 13 Programming Guide, section "Stream Capture"
// (4.2.2.1.2: "Prohibited and Unhandled Operations", "Cross-stream Dependencies and Events",
// "Invalidation"); the runtime API reference (cudaStreamBeginCapture's capture modes,
// cudaThreadExchangeStreamCaptureMode, the cudaError_t descriptions in driver_types.h); and what
// the first GPU run measured (../shared/gpu/2026-12-04).
inline constexpr CaptureRuleInfo kCaptureRules[] = {
    {CaptureRule::kStreamSynchronize, "synchronize() of a capturing stream",
     "cudaStreamSynchronize", "cudaErrorStreamCaptureUnsupported", true, true,
     "Prohibited and Unhandled Operations: \"It is invalid to synchronize or query the execution status of a "
     "stream which is being captured\""},
    {CaptureRule::kStreamQuery, "query() of a capturing stream", "cudaStreamQuery",
     "cudaErrorStreamCaptureUnsupported", true, true,
     "Prohibited and Unhandled Operations: \"It is invalid to synchronize or query the execution status of a "
     "stream which is being captured\""},
    {CaptureRule::kDeviceSynchronize, "synchronize() of a device while one of its streams is capturing",
     "cudaDeviceSynchronize", "cudaErrorStreamCaptureUnsupported", true, true,
     "Prohibited and Unhandled Operations: \"It is also invalid to query the execution status of or synchronize "
     "a broader handle which encompasses an active stream capture, such as a device or context handle\""},
    {CaptureRule::kStreamGetDevice, "asking CUDA for the device of a capturing stream", "cudaStreamGetDevice",
     "cudaErrorStreamCaptureUnsupported", true, true,
     "measured on CUDA 13.0 (H200, driver 580): cudaStreamGetDevice on a capturing stream returns "
     "cudaErrorStreamCaptureUnsupported and cudaStreamEndCapture then cudaErrorStreamCaptureInvalidated "
     "(../shared/gpu/2026-12-04/memcheck-graphs-auto-excerpt.txt); launchers read cuda::stream_ordinal instead"},
    {CaptureRule::kRawAllocation, "a new segment from the raw allocator on a thread with a capture in progress",
     "cudaMalloc cudaMallocHost cudaHostAlloc cudaMallocManaged cudaMallocPitch", "cudaErrorStreamCaptureUnsupported",
     true, true,
     "cudaStreamBeginCapture, cudaStreamCaptureModeThreadLocal (the mode both backends capture in): a thread "
     "with an ongoing capture \"is prohibited from potentially unsafe API calls\"; "
     "cudaThreadExchangeStreamCaptureMode names cudaMalloc as one (it is not enqueued to a stream, so a "
     "graph could not replay it)"},
    {CaptureRule::kRawFree, "handing a segment back to the raw allocator on a thread with a capture in progress",
     "cudaFree cudaFreeHost", "cudaErrorStreamCaptureUnsupported", true, true,
     "cudaStreamCaptureModeThreadLocal's \"potentially unsafe API calls\": cudaFree synchronizes the device "
     "implicitly, which includes the capturing stream"},
    {CaptureRule::kHostPinnedAllocation, "alloc_host_pinned() on a thread with a capture in progress",
     "cudaHostAlloc cudaMallocHost", "cudaErrorStreamCaptureUnsupported", true, true,
     "cudaStreamCaptureModeThreadLocal's \"potentially unsafe API calls\" (an allocation, as cudaMalloc)"},
    {CaptureRule::kEventQuery, "query() or synchronize() of an event on a thread with a capture in progress",
     "cudaEventQuery cudaEventSynchronize", "cudaErrorStreamCaptureUnsupported", true, true,
     "cudaStreamCaptureModeThreadLocal's \"potentially unsafe API calls\": cudaEventQuery is one (PyTorch had "
     "to move its NCCL watchdog's and its caching allocator's event queries out of the capturing mode, "
     "pytorch/pytorch#104555, #148594, #158352); cudaEventSynchronize blocks as a stream synchronization does"},
    {CaptureRule::kWaitOnUncapturedEvent, "wait() by a capturing stream on an event recorded outside the capture",
     "cudaStreamWaitEvent", "cudaErrorStreamCaptureIsolation", true, false,
     "Cross-stream Dependencies and Events / Prohibited and Unhandled Operations: \"It is invalid to wait on a "
     "non-captured event from a stream which is being captured without specifying the cudaEventWaitExternal "
     "flag\"; error 905: \"dependency created on uncaptured work in another stream\""},
    {CaptureRule::kEndOnOtherThread, "end_capture() on another thread than the one that began the capture",
     "cudaStreamEndCapture", "cudaErrorStreamCaptureWrongThread", false, false,
     "cudaStreamEndCapture / error 908: \"A stream capture sequence not initiated with the "
     "cudaStreamCaptureModeRelaxed argument to cudaStreamBeginCapture was passed to cudaStreamEndCapture in a "
     "different thread\" (the capture stays open for the thread that began it)"},
    {CaptureRule::kUseAfterInvalidation, "work submitted to, or end_capture() of, a stream whose capture failed",
     "cudaStreamEndCapture", "cudaErrorStreamCaptureInvalidated", false, false,
     "Invalidation: \"further use of any streams which are being captured ... is invalid and will return an "
     "error, until stream capture is ended with cudaStreamEndCapture(). This call will take the associated "
     "streams out of capture mode, but will also return an error value and a NULL graph\""},
    {CaptureRule::kLegacyStream, "the legacy stream or a synchronous copy/memset while a blocking stream captures",
     "cudaMemcpy cudaMemset cudaMemcpy2D cudaMemcpyToSymbol cudaMemcpyFromSymbol cudaStreamLegacy",
     "cudaErrorStreamCaptureImplicit", true, true,
     "Prohibited and Unhandled Operations: \"any attempted use of the legacy stream is invalid ... It is therefore "
     "also invalid to call synchronous APIs in this case\" (every zt stream is cudaStreamNonBlocking, so no zt "
     "call reaches this; launchers must not use the legacy stream at all)"},
    {CaptureRule::kCapturedEvent, "query() or synchronize() of an event recorded inside a capture",
     "cudaEventQuery cudaEventSynchronize", "cudaErrorCapturedEvent", true, false,
     "Prohibited and Unhandled Operations: \"It is invalid to synchronize or query the execution status of ... a "
     "captured event\"; unreachable through zt (record() inside a capture is refused, kRecordInCapture)"},
    {CaptureRule::kRecordInCapture, "record() of an event on a capturing stream", "", nullptr, true, false,
     "ZeroTrain: captures are single-stream (runtime/stream.h): a record inside a capture would fork another "
     "stream into it or be read by the host, and a captured record never completes for the host"},
    {CaptureRule::kWaitInCapture, "wait() by a capturing stream on an event never recorded", "", nullptr, true, false,
     "ZeroTrain: captures are single-stream (runtime/stream.h): the event orders the capture against another "
     "stream's work"},
    {CaptureRule::kPoolForCapturingStream, "a pool allocation for, or a free of a block of, a capturing stream", "",
     nullptr, true, false,
     "ZeroTrain: the graph bakes the address in while the pool would hand the memory out again "
     "(memory/caching_allocator.cc); a request the cache cannot serve would also be kRawAllocation"},
    {CaptureRule::kLaunchIntoCapture, "a graph launched on a capturing stream", "", nullptr, false, false,
     "ZeroTrain: graphs are not nested (CUDA would add a child-graph node)"},
};
static_assert(sizeof(kCaptureRules) / sizeof(kCaptureRules[0]) == static_cast<size_t>(CaptureRule::kCount),
              "one entry per CaptureRule");

constexpr const CaptureRuleInfo& capture_rule(CaptureRule r) { return kCaptureRules[static_cast<int>(r)]; }

// A refused call: zt::Error(kInvalidArgument) that also says which rule, and so which CUDA error.
class CaptureError : public Error {
 public:
  CaptureError(CaptureRule rule, std::string message)
      : Error(ErrorKind::kInvalidArgument, std::move(message)), rule_(rule) {}
  CaptureRule rule() const { return rule_; }
  // What CUDA returns for the call ("cudaErrorStreamCaptureUnsupported", ...), or "" for
  // ZeroTrain's own rules.
  std::string cuda_error() const {
    const char* e = capture_rule(rule_).cuda_error;
    return e ? e : "";
  }

 private:
  CaptureRule rule_;
};

// The sentence for a refused call: `where` names the object (device, stream), then the rule.
inline std::string capture_refusal(CaptureRule r, const std::string& where) {
  const CaptureRuleInfo& info = capture_rule(r);
  std::string msg = std::string(info.call) + " (" + where + ")";
  if (info.cuda_error) {
    msg += ": CUDA refuses it during stream capture with " + std::string(info.cuda_error) + " [" +
           capture_detail::kGuide + info.source + "]";
  } else {
    msg += ": refused during stream capture [" + std::string(info.source) + "]";
  }
  return msg;
}

// end_capture() of a capture that failed: CUDA's cudaErrorStreamCaptureInvalidated, with the first
// reason (a capture_refusal sentence).
[[noreturn]] inline void throw_invalidated_capture(const std::string& where, const std::string& first_reason) {
  throw CaptureError(CaptureRule::kUseAfterInvalidation,
                     "the capture of " + where + " failed (cudaStreamEndCapture returns "
                     "cudaErrorStreamCaptureInvalidated): " + first_reason);
}

}  // namespace zt
