// The per-stream blocks of stream_blocks.h: each a cuda::StreamResource holding one pool block.
#include "kernels/cuda/stream_blocks.h"

#include <memory>

#include "kernels/ops.h"
#include "memory/caching_allocator.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace zt::cuda_ops::detail {
namespace {

class Block final : public cuda::StreamResource {
 public:
  Block(Stream& stream, const char* tag) : pool_(stream.device().memory()), tag_(tag) {}
  // Runs with the stream drained (StreamResource's contract): nothing uses the block any more.
  ~Block() override { release(); }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  void* reserve(Stream& s, size_t bytes) {
    if (bytes <= bytes_) return block_;
    if (block_ != nullptr) ops::note_stream_block_replaced();  // graphs holding the old address recapture
    release();
    block_ = pool_.allocate(bytes, s, tag_);
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
  const char* tag_;
  void* block_ = nullptr;
  size_t bytes_ = 0;
};

std::unique_ptr<cuda::StreamResource> make_attention(Stream& stream) {
  return std::make_unique<Block>(stream, "attention workspace");
}
std::unique_ptr<cuda::StreamResource> make_matmul_scratch(Stream& stream) {
  return std::make_unique<Block>(stream, "matmul scratch");
}

}  // namespace

void* stream_block(Stream& s, void* native, StreamBlock which, size_t bytes) {
  const bool attention = which == StreamBlock::kAttention;
  auto& r = static_cast<Block&>(cuda::stream_resource(native,
                                                      attention ? cuda::kAttentionResource : cuda::kMatmulScratchResource,
                                                      attention ? &make_attention : &make_matmul_scratch));
  return r.reserve(s, bytes);
}

}  // namespace zt::cuda_ops::detail
