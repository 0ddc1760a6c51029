// NvtxRange: NVTX push/pop (header-only nvtx3 from the CUDA toolkit, when built with ZT_WITH_NVTX)
// plus the injectable RangeSink. No CUDA runtime call is made here.
#include "core/nvtx.h"

#include <atomic>
#include <mutex>

#if ZT_WITH_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace zt {

namespace {
std::atomic<RangeSink*> g_sink{nullptr};
}  // namespace

const char* nvtx_category_name(NvtxCategory c) {
  switch (c) {
    case NvtxCategory::kStep: return "step";
    case NvtxCategory::kForward: return "forward";
    case NvtxCategory::kBackward: return "backward";
    case NvtxCategory::kOptimizer: return "optimizer";
    case NvtxCategory::kCollective: return "collective";
    case NvtxCategory::kGather: return "gather";
    case NvtxCategory::kLossScale: return "loss-scale";
    case NvtxCategory::kCheckpoint: return "checkpoint";
    case NvtxCategory::kData: return "data";
    case NvtxCategory::kTensorParallel: return "tensor-parallel";
  }
  return "?";
}

uint32_t nvtx_category_color(NvtxCategory c) {
  switch (c) {
    case NvtxCategory::kStep: return 0xFF9E9E9E;        // grey
    case NvtxCategory::kForward: return 0xFF2E7D32;     // green
    case NvtxCategory::kBackward: return 0xFF1565C0;    // blue
    case NvtxCategory::kOptimizer: return 0xFF6A1B9A;   // purple
    case NvtxCategory::kCollective: return 0xFFE65100;  // orange
    case NvtxCategory::kGather: return 0xFFF9A825;      // yellow
    case NvtxCategory::kLossScale: return 0xFFC62828;   // red
    case NvtxCategory::kCheckpoint: return 0xFF00838F;  // teal
    case NvtxCategory::kData: return 0xFF6D4C41;        // brown
    case NvtxCategory::kTensorParallel: return 0xFFAD1457;  // magenta
  }
  return 0xFF000000;
}

RangeSink* set_range_sink(RangeSink* sink) { return g_sink.exchange(sink, std::memory_order_acq_rel); }
RangeSink* range_sink() { return g_sink.load(std::memory_order_acquire); }

bool ranges_enabled() {
#if ZT_WITH_NVTX
  return true;
#else
  return range_sink() != nullptr;
#endif
}

NvtxRange::NvtxRange(NvtxCategory category, std::string_view name, int device) {
#if ZT_WITH_NVTX
  // nsys lists ranges by category name; NVTX category ids are the enum values + 1 (0 = none).
  static std::once_flag named;
  std::call_once(named, [] {
    for (int c = 0; c < kNvtxCategoryCount; ++c)
      nvtxNameCategoryA(static_cast<uint32_t>(c) + 1, nvtx_category_name(static_cast<NvtxCategory>(c)));
  });
  std::string label;
  if (device >= 0) label = "[dev " + std::to_string(device) + "] ";
  label.append(name);
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.category = static_cast<uint32_t>(category) + 1;
  a.colorType = NVTX_COLOR_ARGB;
  a.color = nvtx_category_color(category);
  a.payloadType = NVTX_PAYLOAD_TYPE_INT32;
  a.payload.iValue = device;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = label.c_str();
  nvtxRangePushEx(&a);
  nvtx_ = true;
#endif
  sink_ = range_sink();
  if (sink_) sink_->push(category, name, device);
}

NvtxRange::~NvtxRange() {
  if (sink_) sink_->pop();
#if ZT_WITH_NVTX
  if (nvtx_) nvtxRangePop();
#endif
}

}  // namespace zt
