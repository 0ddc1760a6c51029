// The pool block an attention library path keeps per stream: cuDNN's SDPA workspace and staging
// dqkv (cudnn_attention.cc), or the fp32 GEMM attention's score buffers (gemm_attention.cu). One
// block per stream whichever path uses it (a stream runs one activation dtype in a run), so the
// memory plan counts one ops::flash_attention_library_bytes per compute stream.
// Includes no CUDA header.
#pragma once

#include <cstddef>

namespace zt {
class Stream;
}

namespace zt::cuda_ops::detail {

// At least `bytes` bytes of the block of `s` (a stream of a CUDA device; `native` its
// cudaStream_t) for work on `s`. Made from the device pool on first use and kept until the stream
// is destroyed (a cuda::StreamResource); a larger request frees the old block (stream-ordered:
// work already issued keeps using it) and takes one of `bytes`, so later calls of the same or a
// smaller shape allocate nothing and a captured graph can replay them. Throws the pool's
// zt::Error(kOutOfMemory) when it cannot (the old block is gone then). Work on one stream is
// issued by one host thread at a time (runtime/stream.h), which is all the locking it needs.
void* attention_block(Stream& s, void* native, size_t bytes);

}  // namespace zt::cuda_ops::detail
