// Pool blocks a stream keeps for the work issued on it, grown on demand and freed with the stream,
// so that a launch after the first allocates nothing and a captured graph can replay it (a capture
// refuses pool allocations, runtime/stream.h):
//  - the attention block: cuDNN's SDPA workspace and staging dqkv (cudnn_attention.cc), or the fp32
//    GEMM attention's score buffers (gemm_attention.cu); one block whichever path uses it (a stream
//    runs one activation dtype in a run), so the memory plan counts one
//    ops::flash_attention_library_bytes per compute stream;
//  - the matmul scratch: the plain matmul path's fp32 GEMM result before the epilogue rounds it to
//    16 bits, where cuBLASLt refuses a 16-bit matmul (kernels/cuda/op_table.cc). Not in the plan's
//    totals (a run whose GEMMs cuBLASLt serves never takes it); the printed plan names its bound
//    (train/plan.cc plain_matmul_scratch_bound: 192 MiB per device for GPT-2 124M at B 16, T 1024).
// Includes no CUDA header.
#pragma once

#include <cstddef>

namespace zt {
class Stream;
}

namespace zt::cuda_ops::detail {

enum class StreamBlock { kAttention, kMatmulScratch };

// At least `bytes` bytes of `s`'s block `which` (s a stream of a CUDA device; `native` its
// cudaStream_t) for work on `s`. Made from the device pool on first use and kept until the stream
// is destroyed (a cuda::StreamResource); a larger request frees the old block (stream-ordered:
// work already issued keeps using it; counted by ops::stream_block_generation, so that captured
// graphs holding its address are captured again) and takes one of `bytes`, so later calls of the
// same or a smaller size allocate nothing. Throws the pool's zt::Error(kOutOfMemory) when it cannot
// (the old block is gone then). Work on one stream is issued by one host thread at a time
// (runtime/stream.h), which is all the locking it needs.
void* stream_block(Stream& s, void* native, StreamBlock which, size_t bytes);

}  // namespace zt::cuda_ops::detail
