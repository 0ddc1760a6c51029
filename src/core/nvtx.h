// Named host ranges (NVTX): what nsys shows on each host thread's timeline, and what tests and the
// --trace timeline see through an injectable RangeSink. One host thread drives each device, so
// ranges nest per thread; a range must be popped on the thread that pushed it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace zt {

// Every range has a category; each category has its own colour in nsys.
enum class NvtxCategory : uint8_t {
  kStep,
  kForward,
  kBackward,
  kOptimizer,
  kCollective,
  kGather,
  kLossScale,
  kCheckpoint,
  kData,
  kTensorParallel,  // a tensor-parallel model's collectives (their own track in --trace)
};
inline constexpr int kNvtxCategoryCount = 10;

const char* nvtx_category_name(NvtxCategory c);
uint32_t nvtx_category_color(NvtxCategory c);  // ARGB, distinct per category

// Receives every range push/pop of every thread (in addition to NVTX). Implementations must be
// thread-safe: push/pop arrive concurrently from every device's host thread, each thread's calls
// nested (a pop closes that thread's latest push). device: the device index, -1 for none.
class RangeSink {
 public:
  virtual ~RangeSink() = default;
  virtual void push(NvtxCategory category, std::string_view name, int device) = 0;
  virtual void pop() = 0;
};

// The process-wide sink (none by default). Returns the previous one, so that a sink can forward
// to it. Install before the threads that push ranges start, remove after they are joined.
RangeSink* set_range_sink(RangeSink* sink);
RangeSink* range_sink();

// True when a range goes anywhere (an NVTX build, or a sink is installed): callers that format a
// name (sizes, block names) check it first so that ranges cost nothing when nobody listens.
bool ranges_enabled();

// RAII range: pushes on construction, pops on destruction, on the constructing thread.
// NVTX: name prefixed with the device ("[dev 1] forward h.3"), payload = device index.
class NvtxRange {
 public:
  NvtxRange(NvtxCategory category, std::string_view name, int device = -1);
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  RangeSink* sink_ = nullptr;  // the sink the push went to (pops go to the same one)
  bool nvtx_ = false;
};

// A range opened and closed at points that are not one C++ scope (a block's forward runs from its
// before_forward hook to the next hook). Same-thread rule as NvtxRange.
class OptionalNvtxRange {
 public:
  void open(NvtxCategory category, std::string_view name, int device = -1) {
    range_.reset();
    range_.emplace(category, name, device);
  }
  void close() { range_.reset(); }
  bool is_open() const { return range_.has_value(); }

 private:
  std::optional<NvtxRange> range_;
};

}  // namespace zt
