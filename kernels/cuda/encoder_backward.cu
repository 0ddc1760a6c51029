// CUDA backward of the GPT-2 encoder (token + position embedding; optionally one vocabulary shard):
// a deterministic bucketed scatter-add for dwte (positions sorted by token id with CUB's radix sort,
// each bucket summed in position order) and a fixed-order batch sum for dwpe. No float atomics.
//
// Bits (the CPU backend's, kernels/cpu/encoder.cc, is the specification): every dwte[v, c] is
// dwte[v, c] + dout[p0, c] + dout[p1, c] + ... in fp32, left to right, over the positions
// p0 < p1 < ... holding token begin + v; every dwpe[t, c] is dwpe[t, c] + dout[0, t, c] +
// dout[1, t, c] + ... likewise. dout is widened exactly (16 bits), so the result is the sequential
// loop's, on every GPU and for every launch shape.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>

#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/storage_types.h"

namespace zt::cuda_ops {
namespace {

using detail::Pack;

// A thread's kN consecutive channels [c0, c0 + count) of one row: one 128-bit access when `vec`
// (row pointers 16-byte aligned, C a multiple of kN), else element by element. The same values
// either way; elements past `count` read as 0 and are never stored.
template <typename S, int kN>
__device__ __forceinline__ void load_widened(float (&x)[kN], const S* p, int count, bool vec) {
  if constexpr (kN == Pack<S>::kN) {
    if (vec) {
      const Pack<S> v = detail::load_pack(p);
#pragma unroll
      for (int k = 0; k < kN; ++k) x[k] = to_float(v.v[k]);
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < kN; ++k) x[k] = k < count ? to_float(p[k]) : 0.0f;
}
// kN fp32 values of dwte/dwpe (kN a multiple of 4 when vec: float4 accesses).
template <int kN>
__device__ __forceinline__ void load_f32(float (&x)[kN], const float* p, int count, bool vec) {
  if (vec) {
#pragma unroll
    for (int k = 0; k < kN; k += 4) {
      const float4 v = *reinterpret_cast<const float4*>(p + k);
      x[k] = v.x, x[k + 1] = v.y, x[k + 2] = v.z, x[k + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) x[k] = k < count ? p[k] : 0.0f;
  }
}
template <int kN>
__device__ __forceinline__ void store_f32(float* p, const float (&x)[kN], int count, bool vec) {
  if (vec) {
#pragma unroll
    for (int k = 0; k < kN; k += 4) *reinterpret_cast<float4*>(p + k) = make_float4(x[k], x[k + 1], x[k + 2], x[k + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k)
      if (k < count) p[k] = x[k];
  }
}

// ---- dwpe: one thread per (t, chunk of kN channels), batch rows in increasing b ----------------
template <typename S>
__global__ void encoder_backward_wpe_kernel(float* __restrict__ dwpe, const S* __restrict__ dout, int64_t B,
                                            int64_t T, int64_t C, bool vec) {
  constexpr int kN = Pack<S>::kN;
  const int64_t chunks = (C + kN - 1) / kN;
  const int64_t n = T * chunks;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks;
    const int64_t c0 = (i - t * chunks) * kN;
    const int count = static_cast<int>(min(static_cast<int64_t>(kN), C - c0));
    float acc[kN];
    load_f32<kN>(acc, dwpe + t * C + c0, count, vec);
    for (int64_t b = 0; b < B; ++b) {
      float d[kN];
      load_widened<S, kN>(d, dout + (b * T + t) * C + c0, count, vec);
#pragma unroll
      for (int k = 0; k < kN; ++k) acc[k] += d[k];
    }
    store_f32<kN>(dwpe + t * C + c0, acc, count, vec);
  }
}

// ---- dwte: bucketed by token id ------------------------------------------------------------------
// keys[i] = the shard's row of position i's token, or V (another shard's token: no bucket);
// positions[i] = i. Sorted stably by key, each bucket lists its positions in increasing order.
__global__ void encoder_bucket_keys_kernel(uint32_t* __restrict__ keys, int32_t* __restrict__ positions,
                                           const int32_t* __restrict__ tokens, int64_t BT, int64_t V,
                                           int64_t begin) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < BT;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t local = tokens[i] - begin;
    keys[i] = static_cast<uint32_t>(local >= 0 && local < V ? local : V);
    positions[i] = static_cast<int32_t>(i);
  }
}

// Rows of dout loaded ahead of their (sequential) additions: kBucketBatch independent 128-bit loads
// in flight per thread hide the memory latency of a long bucket without changing the order.
constexpr int kBucketBatch = 8;
constexpr int kBucketBlock = 128;  // threads per block at most: chunks of kN channels

// Block (i, y): if sorted entry i starts a bucket (its key differs from entry i - 1 and names a row
// of this shard), each thread sums its chunk of channels over the bucket's positions in order,
// starting from dwte's value, and stores it once. Other blocks return at once. Buckets own distinct
// rows, threads distinct channels: no two threads write one element.
template <typename S>
__global__ void __launch_bounds__(kBucketBlock)
    encoder_backward_wte_kernel(float* __restrict__ dwte, const S* __restrict__ dout,
                                const uint32_t* __restrict__ keys, const int32_t* __restrict__ positions,
                                int64_t BT, int64_t C, int64_t V, bool vec) {
  constexpr int kN = Pack<S>::kN;
  const int64_t i = blockIdx.x;
  const uint32_t key = keys[i];
  if (key >= V || (i > 0 && keys[i - 1] == key)) return;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kN;
  if (c0 >= C) return;
  const int count = static_cast<int>(min(static_cast<int64_t>(kN), C - c0));
  float* row = dwte + static_cast<int64_t>(key) * C + c0;
  float acc[kN];
  load_f32<kN>(acc, row, count, vec);
  for (int64_t j = i; j < BT; j += kBucketBatch) {
    // The batch's keys and positions first (broadcast reads), then its rows of dout: the loads of
    // one batch are independent of each other.
    uint32_t k_of[kBucketBatch];
    int32_t p_of[kBucketBatch];
#pragma unroll
    for (int u = 0; u < kBucketBatch; ++u) {
      const bool in = j + u < BT;
      k_of[u] = in ? keys[j + u] : UINT32_MAX;
      p_of[u] = in ? positions[j + u] : 0;
    }
    // A bucket is contiguous: the first entry with another key ends it.
    int valid = 0;
#pragma unroll
    for (int u = 0; u < kBucketBatch; ++u)
      if (valid == u && k_of[u] == key) ++valid;
    float d[kBucketBatch][kN];
#pragma unroll
    for (int u = 0; u < kBucketBatch; ++u)
      if (u < valid) load_widened<S, kN>(d[u], dout + static_cast<int64_t>(p_of[u]) * C + c0, count, vec);
#pragma unroll
    for (int u = 0; u < kBucketBatch; ++u)
      if (u < valid)
#pragma unroll
        for (int k = 0; k < kN; ++k) acc[k] += d[u][k];
    if (valid < kBucketBatch) break;
  }
  store_f32<kN>(row, acc, count, vec);
}

// The fallback when the sort's buffers do not fit the stream's workspace (B*T beyond ~200k
// positions with the 4 MiB minimum): thread (chunk, c) owns the rows [v0, v1) of channel c and
// scans every position in order. Slower (every thread reads every token id), the same bits.
constexpr int kScanBlock = 128;
constexpr int kScanTokenTile = 2048;
constexpr int64_t kScanTargetBlocks = 1024;

template <typename S>
__global__ void encoder_backward_wte_scan_kernel(float* __restrict__ dwte, const S* __restrict__ dout,
                                                 const int32_t* __restrict__ tokens, int64_t BT, int64_t C,
                                                 int64_t V, int64_t begin, int64_t rows_per_chunk) {
  __shared__ int32_t tile[kScanTokenTile];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kScanBlock + threadIdx.x;
  const int64_t v0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t v1 = min(V, v0 + rows_per_chunk);
  for (int64_t base = 0; base < BT; base += kScanTokenTile) {
    const int64_t count = min(static_cast<int64_t>(kScanTokenTile), BT - base);
    __syncthreads();  // the previous tile is no longer read
    for (int64_t j = threadIdx.x; j < count; j += kScanBlock) tile[j] = tokens[base + j];
    __syncthreads();
    if (c >= C) continue;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t tok = tile[j] - begin;  // the shard's row; other shards' tokens miss [v0, v1)
      if (tok >= v0 && tok < v1) dwte[tok * C + c] += to_float(dout[(base + j) * C + c]);
    }
  }
}

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Bits a key needs: values 0..V (V = "no bucket").
int key_bits(int64_t V) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= V) ++bits;
  return bits;
}

template <typename S>
void launch_wte(cudaStream_t stream, float* dwte, const S* dout, const int32_t* tokens, int64_t BT, int64_t C,
                int64_t V, int64_t begin) {
  constexpr int kN = Pack<S>::kN;
  // Workspace layout: keys in/out, positions in/out, then CUB's temporary storage.
  const size_t list = align_up(static_cast<size_t>(BT) * sizeof(uint32_t));
  const int end_bit = key_bits(V);
  size_t cub_bytes = 0;
  // CUB counts items in int: B*T may reach 2^31 (train/run_shape.h), which only the scan takes.
  if (BT <= INT32_MAX)
    ZT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), static_cast<int>(BT), 0, end_bit,
                                                stream));
  size_t ws_bytes = 0;
  char* ws = static_cast<char*>(detail::stream_workspace(stream, &ws_bytes));
  if (BT > INT32_MAX || 4 * list + align_up(cub_bytes) > ws_bytes) {
    // Slower than the bucketed kernel (every thread reads every token id; not yet measured): said
    // once per process, so that a slow embedding backward in a trace has its cause in the log.
    static std::atomic<bool> announced{false};
    if (!announced.exchange(true))
      std::fprintf(stderr,
                   "note: encoder_backward: the bucket sort of %lld tokens needs %zu bytes, more than the stream's "
                   "cuBLAS workspace of %zu; the embedding gradient takes the slower scan kernel (same bits; a "
                   "smaller micro-batch x sequence avoids it)\n",
                   static_cast<long long>(BT), 4 * list + align_up(cub_bytes), ws_bytes);
    const int64_t channel_blocks = (C + kScanBlock - 1) / kScanBlock;
    const int64_t chunks =
        std::clamp<int64_t>((kScanTargetBlocks + channel_blocks - 1) / channel_blocks, 1, std::min<int64_t>(V, 65535));
    const int64_t rows_per_chunk = (V + chunks - 1) / chunks;
    const dim3 grid(static_cast<unsigned>(channel_blocks), static_cast<unsigned>((V + rows_per_chunk - 1) / rows_per_chunk));
    encoder_backward_wte_scan_kernel<S><<<grid, kScanBlock, 0, stream>>>(dwte, dout, tokens, BT, C, V, begin,
                                                                        rows_per_chunk);
    ZT_CUDA_CHECK(cudaGetLastError());
    return;
  }
  auto* keys_in = reinterpret_cast<uint32_t*>(ws);
  auto* keys_out = reinterpret_cast<uint32_t*>(ws + list);
  auto* pos_in = reinterpret_cast<int32_t*>(ws + 2 * list);
  auto* pos_out = reinterpret_cast<int32_t*>(ws + 3 * list);
  void* cub_temp = ws + 4 * list;
  encoder_bucket_keys_kernel<<<detail::grid_for(BT), detail::kElementwiseBlock, 0, stream>>>(keys_in, pos_in, tokens,
                                                                                              BT, V, begin);
  ZT_CUDA_CHECK(cudaGetLastError());
  // Radix sort is stable: equal keys keep their positions' increasing order.
  ZT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, cub_bytes, keys_in, keys_out, pos_in, pos_out,
                                                static_cast<int>(BT), 0, end_bit, stream));
  const bool vec = C % kN == 0 && detail::is_aligned16(dout) && detail::is_aligned16(dwte);
  const int64_t chunks = (C + kN - 1) / kN;
  const int block = static_cast<int>(std::min<int64_t>(kBucketBlock, (chunks + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(BT), static_cast<unsigned>((chunks + block - 1) / block));
  encoder_backward_wte_kernel<S><<<grid, block, 0, stream>>>(dwte, dout, keys_out, pos_out, BT, C, V, vec);
  ZT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void encoder_backward(void* stream, float* dwte, float* dwpe, const void* dout, DType dtype,
                      const int32_t* tokens, int64_t B, int64_t T, int64_t C, int64_t V,
                      int64_t v_begin, int64_t /*v_total*/) {
  detail::LaunchScope scope(stream);
  zt::detail::with_storage_type(dtype, "encoder_backward", [&](auto tag) {
    using S = decltype(tag);
    const auto* d = static_cast<const S*>(dout);
    if (dwpe != nullptr) {
      constexpr int kN = Pack<S>::kN;
      const bool vec = C % kN == 0 && detail::is_aligned16(dout) && detail::is_aligned16(dwpe);
      encoder_backward_wpe_kernel<S><<<detail::grid_for(T * ((C + kN - 1) / kN)), detail::kElementwiseBlock, 0,
                                       scope.stream()>>>(dwpe, d, B, T, C, vec);
      ZT_CUDA_CHECK(cudaGetLastError());
    }
    if (dwte != nullptr && V > 0) launch_wte<S>(scope.stream(), dwte, d, tokens, B * T, C, V, v_begin);
  });
}

}  // namespace zt::cuda_ops
