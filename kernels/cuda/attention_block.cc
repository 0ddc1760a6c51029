// The per-stream attention block (attention_block.h): a cuda::StreamResource holding one pool block.
#include "kernels/cuda/attention_block.h"

#include <memory>

#include "memory/caching_allocator.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace zt::cuda_ops::detail {
namespace {

class AttentionBlock final : public cuda::StreamResource {
 public:
  explicit AttentionBlock(Stream& stream) : pool_(stream.device().memory()) {}
  // Runs with the stream drained (StreamResource's contract): nothing uses the block any more.
  ~AttentionBlock() override { release(); }
  AttentionBlock(const AttentionBlock&) = delete;
  AttentionBlock& operator=(const AttentionBlock&) = delete;

  void* reserve(Stream& s, size_t bytes) {
    if (bytes <= bytes_) return block_;
    release();
    block_ = pool_.allocate(bytes, s, "attention workspace");
    bytes_ = bytes;
    return block_;
  }

 private:
  void release() noexcept {
    if (block_ != nullptr) {
      try {
        pool_.free(block_);
      } catch (...) {  // a failed device's pool: its memory goes with the pool anyway
      }
    }
    block_ = nullptr;
    bytes_ = 0;
  }

  CachingAllocator& pool_;
  void* block_ = nullptr;
  size_t bytes_ = 0;
};

std::unique_ptr<cuda::StreamResource> make_block(Stream& stream) { return std::make_unique<AttentionBlock>(stream); }

}  // namespace

void* attention_block(Stream& s, void* native, size_t bytes) {
  auto& r = static_cast<AttentionBlock&>(cuda::stream_resource(native, cuda::kAttentionResource, &make_block));
  return r.reserve(s, bytes);
}

}  // namespace zt::cuda_ops::detail
