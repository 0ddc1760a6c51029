// CUDA layernorm (forward/backward) and the fused residual add + layernorm, the fused softmax +
// cross-entropy classifier and its vocabulary-parallel form (row_max, vocab_partials,
// vocab_loss_grad; fp32 or 16-bit logits): one warp (layernorm, 128-bit accesses where aligned) or
// one block (classifier) per row, sums accumulated in double like the CPU kernels (the classifiers'
// exps on the special-function unit: classifier_exp) and combined in a fixed order. The
// bias gradient is a two-stage column sum, layernorm's dweight/dbias fp32 sums in the order of
// kernels/layernorm_order.h (the CPU kernel's bits): no float atomics anywhere, so every result is
// run-to-run deterministic and the same on every GPU.
#include <cub/block/block_reduce.cuh>
#include <cuda/std/functional>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"
#include "kernels/layernorm_order.h"
#include "kernels/storage_types.h"

namespace zt::cuda_ops {
namespace {

using detail::kColumnSumRows;
using detail::kWarpSize;

// One warp per row: the rows of a block are independent, so any block size that is a multiple of
// 32 works; 256 gives 8 rows per block.
constexpr int kRowBlock = 256;
constexpr int kRowsPerBlock = kRowBlock / kWarpSize;

unsigned row_grid(int64_t rows) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1, detail::kMaxGridBlocks));
}

// ---- layernorm forward and the fused residual add + layernorm: one warp per row -----------------
// A lane owns the 16-byte chunks lane, lane + 32, ... of its row (Pack<T>::kN elements each, the
// last one possibly short) and sums them in double, chunk by chunk, element by element; the warp
// combines the lanes with warp_sum. This order is fixed by C alone: `vec` (every streamed row
// 16-byte aligned, C a multiple of kN) only decides whether a chunk moves as one 128-bit access,
// so aligned and unaligned calls, fused and unfused, give the same bits. Statistics are fp32
// (double sums); outputs are rounded to T once.

// The kN parameters (weight or bias of W) of a chunk, widened: 16-byte packs when `wvec` (the
// pointer 16-byte aligned, C a multiple of kN), else one by one (0 past `count`). The same values
// either way. Element by element a warp issues kN loads per chunk, each touching every 128-byte
// line of the warp's chunks (lanes 16 or 32 bytes apart): a pack per lane is one load (two for fp32
// parameters) over the same lines, so the L1 passes over them once instead of kN times.
template <typename W, int kN>
__device__ __forceinline__ void load_params(float (&w)[kN], const W* p, int64_t c0, int count, bool wvec) {
  constexpr int kW = detail::Pack<W>::kN;
  static_assert(kN % kW == 0, "a chunk of activations holds whole packs of parameters");
  if (wvec) {
#pragma unroll
    for (int k = 0; k < kN; k += kW) {
      const detail::Pack<W> v = detail::load_pack(p + c0 + k);
#pragma unroll
      for (int e = 0; e < kW; ++e) w[k + e] = to_float(v.v[e]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) w[k] = k < count ? to_float(p[c0 + k]) : 0.0f;
  }
}

// A chunk of a row of T: load_params with T's own pack (`vec` for every streamed row).
template <typename T>
__device__ __forceinline__ void load_chunk(float (&x)[detail::Pack<T>::kN], const T* p, int64_t c0, int count,
                                           bool vec) {
  load_params<T>(x, p, c0, count, vec);
}
template <typename T>
__device__ __forceinline__ void store_chunk(T* p, const float (&x)[detail::Pack<T>::kN], int64_t c0, int count,
                                            bool vec) {
  if (vec) {
    detail::Pack<T> v;
#pragma unroll
    for (int k = 0; k < detail::Pack<T>::kN; ++k) v.v[k] = from_float<T>(x[k]);
    detail::store_pack(p + c0, v);
  } else {
#pragma unroll
    for (int k = 0; k < detail::Pack<T>::kN; ++k)
      if (k < count) p[c0 + k] = from_float<T>(x[k]);
  }
}

// A lane's chunks in its order: kSlots > 0 keeps them in registers (v[i] for the i-th chunk, rows of
// up to kSlots * 32 chunks), so the row is read from memory once; kSlots 0 reuses one slot and later
// passes read the row again (from cache). The launch takes the fewest slots that hold the row,
// kFewLaneChunks (C <= 512 in fp32, 1024 in 16 bits: GPT-2's 768 needs 3) or kCachedLaneChunks
// (1024, 2048): the registers of unused slots are allocated all the same, and 8 slots (~120
// registers) leave 16 warps per SM to hide the row's load latency, 4 slots (~76) 24.
constexpr int kFewLaneChunks = 4;
constexpr int kCachedLaneChunks = 8;
template <int kSlots, int kN, typename F>
__device__ __forceinline__ void for_lane_chunks(float (&v)[kSlots > 0 ? kSlots : 1][kN], int lane, int64_t chunks,
                                                F&& f) {
  if constexpr (kSlots > 0) {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const int64_t j = lane + int64_t{i} * kWarpSize;
      if (j < chunks) f(v[i], j);
    }
  } else {
    for (int64_t j = lane; j < chunks; j += kWarpSize) f(v[0], j);
  }
}

// kResidual: residual = round_T(a + b) is written first (a, b and residual may alias: each element
// is read by the lane that writes it) and normalised; else the rows of `a` are. out aliases nothing.
// weight and bias of W (fp32 or T) are widened where they are read.
template <typename T, typename W, bool kResidual, int kSlots>
__global__ void layernorm_rows_kernel(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                      T* residual, const T* a, const T* b, const W* __restrict__ weight,
                                      const W* __restrict__ bias, int64_t N, int64_t C, float eps, bool vec,
                                      bool wvec) {
  constexpr int kN = detail::Pack<T>::kN;
  constexpr bool kCached = kSlots > 0;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  const int64_t chunks = (C + kN - 1) / kN;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
       row < N; row += warps_total) {
    const T* x = kResidual ? residual + row * C : a + row * C;
    (void)x;  // unread when every pass finds the row in registers
    float v[kCached ? kSlots : 1][kN];
    auto count_of = [C](int64_t c0) { return static_cast<int>(C - c0 < kN ? C - c0 : kN); };
    double s = 0.0;
    for_lane_chunks<kSlots>(v, lane, chunks, [&](float(&e)[kN], int64_t j) {
      const int64_t c0 = j * kN;
      const int count = count_of(c0);
      if constexpr (kResidual) {
        float u[kN];
        load_chunk<T>(e, a + row * C, c0, count, vec);
        load_chunk<T>(u, b + row * C, c0, count, vec);
        // add's expression, then the value as stored (the statistics read the rounded residual).
#pragma unroll
        for (int k = 0; k < kN; ++k) e[k] = to_float(from_float<T>(e[k] + u[k]));
        store_chunk<T>(residual + row * C, e, c0, count, vec);
      } else {
        load_chunk<T>(e, x, c0, count, vec);
      }
#pragma unroll
      for (int k = 0; k < kN; ++k)
        if (k < count) s += e[k];
    });
    const double md = detail::warp_sum(s) / static_cast<double>(C);
    // Two passes (mean, then squared deviations): no cancellation for rows with a large mean.
    double q = 0.0;
    for_lane_chunks<kSlots>(v, lane, chunks, [&](float(&e)[kN], int64_t j) {
      const int64_t c0 = j * kN;
      const int count = count_of(c0);
      if constexpr (!kCached) load_chunk<T>(e, x, c0, count, vec);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const double d = e[k] - md;
        if (k < count) q += d * d;
      }
    });
    const double var = detail::warp_sum(q) / static_cast<double>(C);
    const float m = static_cast<float>(md);
    const float r = static_cast<float>(1.0 / sqrt(var + eps));
    T* y = out + row * C;
    for_lane_chunks<kSlots>(v, lane, chunks, [&](float(&e)[kN], int64_t j) {
      const int64_t c0 = j * kN;
      const int count = count_of(c0);
      if constexpr (!kCached) load_chunk<T>(e, x, c0, count, vec);
      float wv[kN], bv[kN];
      load_params<W>(wv, weight, c0, count, wvec);
      load_params<W>(bv, bias, c0, count, wvec);
      // The roundings written out, as the kernel compiled before the parameters moved as packs:
      // nvcc contracts `* w + b` only inside one basic block, so the fp32/bf16 parameters' plain
      // widening gave one FMA and the branchy fp16 widening of `b` a product and a sum.
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        if (k >= count) continue;
        if constexpr (std::is_same_v<W, Half>) {
          e[k] = __fadd_rn(__fmul_rn((e[k] - m) * r, wv[k]), bv[k]);
        } else {
          e[k] = __fmaf_rn((e[k] - m) * r, wv[k], bv[k]);
        }
      }
      store_chunk<T>(y, e, c0, count, vec);
    });
    if (lane == 0) {
      if (mean != nullptr) mean[row] = m;
      if (rstd != nullptr) rstd[row] = r;
    }
  }
}

// Launches the row kernel, registers-cached when the row fits (the same bits either way: the
// chunks' order does not depend on the slots).
template <typename T, typename W, bool kResidual>
void launch_layernorm_rows(cudaStream_t stream, T* out, float* mean, float* rstd, T* residual, const T* a,
                           const T* b, const W* weight, const W* bias, int64_t N, int64_t C, float eps,
                           bool vec) {
  const int64_t chunks = (C + detail::Pack<T>::kN - 1) / detail::Pack<T>::kN;
  const bool wvec = C % detail::Pack<T>::kN == 0 && detail::is_aligned16(weight) && detail::is_aligned16(bias);
  auto launch = [&](auto kernel) {
    kernel<<<row_grid(N), kRowBlock, 0, stream>>>(out, mean, rstd, residual, a, b, weight, bias, N, C, eps, vec, wvec);
  };
  if (chunks <= int64_t{kFewLaneChunks} * kWarpSize) {
    launch(layernorm_rows_kernel<T, W, kResidual, kFewLaneChunks>);
  } else if (chunks <= int64_t{kCachedLaneChunks} * kWarpSize) {
    launch(layernorm_rows_kernel<T, W, kResidual, kCachedLaneChunks>);
  } else {
    launch(layernorm_rows_kernel<T, W, kResidual, 0>);
  }
  ZT_CUDA_CHECK(cudaGetLastError());
}

// ---- layernorm backward: din and the partials of dweight/dbias in one kernel ---------------------
// din[row] += rstd (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = weight * dout, with
// din, dout, in of T and weight of W widened where read; a 16-bit din is rounded once. One warp per
// row: a lane owns the chunks lane, lane + 32, ... of kN elements (128-bit accesses when `vec`), the
// row's two sums in double (warp_sum; the chunking, not `vec`, fixes their order), then din.
// dweight/dbias follow kernels/layernorm_order.h: the block's rows go to its warps round robin,
// each warp sums its rows' terms into its own fp32 column sums (shared memory; kShared false: one
// warp per block, the sums in the block's partial row in global memory), and the block adds its
// warps' sums in warp order into its partial (or, as the only block, into dweight/dbias).
// Shared sums are stored chunk-major (element k of chunk j at k * chunks + j), so the 32 lanes of a
// warp touch 32 consecutive floats: no bank conflicts.
// kCached: the lane's chunks (at most kBwdCachedLaneChunks) stay in registers between the passes.
constexpr int kBwdCachedLaneChunks = 4;
// f(slot, j) over the lane's chunks j in order; slot is a constant after unrolling (kCached), so
// the cached values stay in registers.
template <bool kCached, typename F>
__device__ __forceinline__ void for_bwd_chunks(int lane, int64_t chunks, F&& f) {
  if constexpr (kCached) {
#pragma unroll
    for (int i = 0; i < kBwdCachedLaneChunks; ++i) {
      const int64_t j = lane + int64_t{i} * kWarpSize;
      if (j < chunks) f(i, j);
    }
  } else {
    for (int64_t j = lane; j < chunks; j += kWarpSize) f(0, j);
  }
}

template <typename T, typename W, bool kCached, bool kShared>
__global__ void __launch_bounds__(zt::detail::LayernormBackwardOrder::kMaxWarps * kWarpSize)
    layernorm_backward_kernel(T* __restrict__ din, float* __restrict__ partials, float* __restrict__ dweight,
                              float* __restrict__ dbias, const T* __restrict__ dout, const T* __restrict__ in,
                              const W* __restrict__ weight, const float* __restrict__ mean,
                              const float* __restrict__ rstd, int64_t N, int64_t C, int64_t rows_per_block,
                              bool single_block, bool vec, bool wvec) {
  constexpr int kN = detail::Pack<T>::kN;
  extern __shared__ float shared_sums[];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const int64_t chunks = (C + kN - 1) / kN;
  const int64_t half = kShared ? chunks * kN : C;  // one of the two column sums, padded
  float* sums = kShared ? shared_sums + int64_t{warp} * 2 * half : partials + int64_t{blockIdx.x} * 2 * C;
  auto at = [chunks](int64_t j, int k) { return kShared ? k * chunks + j : j * kN + k; };
  for (int64_t i = lane; i < 2 * half; i += kWarpSize) sums[i] = 0.0f;
  __syncwarp();

  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(N, r0 + rows_per_block);
  auto count_of = [C](int64_t c0) { return static_cast<int>(C - c0 < kN ? C - c0 : kN); };
  constexpr int kSlots = kCached ? kBwdCachedLaneChunks : 1;
  for (int64_t row = r0 + warp; row < r1; row += warps) {
    const T* x = in + row * C;
    const T* dy = dout + row * C;
    const float m = mean[row];
    const float r = rstd[row];
    float xs[kSlots][kN], ds[kSlots][kN];
    double sum_dnorm = 0.0, sum_dnorm_norm = 0.0;
    for_bwd_chunks<kCached>(lane, chunks, [&](int slot, int64_t j) {
      const int64_t c0 = j * kN;
      const int count = count_of(c0);
      float(&xv)[kN] = xs[slot];
      float(&dv)[kN] = ds[slot];
      load_chunk<T>(xv, x, c0, count, vec);
      load_chunk<T>(dv, dy, c0, count, vec);
      float wv[kN];
      load_params<W>(wv, weight, c0, count, wvec);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        if (k < count) {
          const float norm = (xv[k] - m) * r;
          const double dnorm = double{wv[k]} * dv[k];
          sum_dnorm += dnorm;
          sum_dnorm_norm += dnorm * norm;
          // The product rounded, then added: no FMA, the CPU kernel's bits.
          sums[at(j, k)] = __fadd_rn(sums[at(j, k)], __fmul_rn(norm, dv[k]));
          sums[half + at(j, k)] = __fadd_rn(sums[half + at(j, k)], dv[k]);
        }
      }
    });
    const float dnorm_mean = static_cast<float>(detail::warp_sum(sum_dnorm) / static_cast<double>(C));
    const float dnorm_norm_mean = static_cast<float>(detail::warp_sum(sum_dnorm_norm) / static_cast<double>(C));
    T* dx = din + row * C;
    for_bwd_chunks<kCached>(lane, chunks, [&](int slot, int64_t j) {
      const int64_t c0 = j * kN;
      const int count = count_of(c0);
      float(&xv)[kN] = xs[slot];
      float(&dv)[kN] = ds[slot];
      if constexpr (!kCached) {
        load_chunk<T>(xv, x, c0, count, vec);
        load_chunk<T>(dv, dy, c0, count, vec);
      }
      float g[kN], wv[kN];
      load_chunk<T>(g, dx, c0, count, vec);
      load_params<W>(wv, weight, c0, count, wvec);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        if (k < count) {
          const float norm = (xv[k] - m) * r;
          const float dnorm = wv[k] * dv[k];
          // The term rounded, then added (__fadd_rn: nvcc would fuse g + term * r into an FMA), as
          // the CPU kernel: din += gives the bits of din from zero followed by add.
          g[k] = __fadd_rn(g[k], (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r);
        }
      }
      store_chunk<T>(dx, g, c0, count, vec);
    });
  }

  // The block's partial: its warps' sums in warp order.
  if constexpr (kShared) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i < 2 * half; i += blockDim.x) {
      const int64_t h = i / half, rem = i - h * half;
      const int64_t c = (rem % chunks) * kN + rem / chunks;  // rem = k * chunks + j
      if (c >= C) continue;
      float p = shared_sums[i];
      for (int w = 1; w < warps; ++w) p = __fadd_rn(p, shared_sums[int64_t{w} * 2 * half + i]);
      if (single_block) {
        float* out = h == 0 ? dweight : dbias;
        out[c] = __fadd_rn(out[c], p);
      } else {
        partials[int64_t{blockIdx.x} * 2 * C + h * C + c] = p;
      }
    }
  } else if (single_block) {
    __syncwarp();  // the lanes' sums, written by other lanes, are read below
    for (int64_t c = lane; c < C; c += kWarpSize) {
      dweight[c] = __fadd_rn(dweight[c], sums[c]);
      dbias[c] = __fadd_rn(dbias[c], sums[C + c]);
    }
  }
}

// dweight/dbias += the blocks' partials [blocks][2C], striped and tree-combined as
// kernels/layernorm_order.h says: block (32 columns, kStripes stripes).
constexpr int kLnStripes = zt::detail::LayernormBackwardOrder::kStripes;
__global__ void __launch_bounds__(kWarpSize * kLnStripes)
    layernorm_backward_finish_kernel(float* __restrict__ dweight, float* __restrict__ dbias,
                                     const float* __restrict__ partials, int64_t C, int64_t blocks) {
  __shared__ float tile[kLnStripes][kWarpSize + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kWarpSize + threadIdx.x;
  float acc = 0.0f;
  if (col < 2 * C)
    for (int64_t k = threadIdx.y; k < blocks; k += kLnStripes) acc = __fadd_rn(acc, partials[k * 2 * C + col]);
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  for (int h = kLnStripes / 2; h > 0; h /= 2) {
    if (threadIdx.y < h) tile[threadIdx.y][threadIdx.x] = __fadd_rn(tile[threadIdx.y][threadIdx.x], tile[threadIdx.y + h][threadIdx.x]);
    __syncthreads();
  }
  if (threadIdx.y != 0 || col >= 2 * C) return;
  float* out = col < C ? dweight + col : dbias + (col - C);
  *out = __fadd_rn(*out, tile[0][threadIdx.x]);
}

template <typename T, typename W>
void launch_layernorm_backward(cudaStream_t stream, T* din, float* dweight, float* dbias, const T* dout, const T* in,
                               const W* weight, const float* mean, const float* rstd, int64_t N, int64_t C) {
  static_assert(zt::detail::LayernormBackwardOrder::kScratchBytes <= static_cast<int64_t>(detail::kMinStreamWorkspace),
                "the partials must fit every stream's workspace");
  constexpr int kN = detail::Pack<T>::kN;
  const zt::detail::LayernormBackwardOrder o = zt::detail::layernorm_backward_order(N, C);
  const bool single = o.blocks == 1;
  float* partials = nullptr;
  if (!single || !o.shared_sums) {
    size_t bytes = 0;
    partials = static_cast<float*>(detail::stream_workspace(stream, &bytes));
    ZT_CHECK(static_cast<size_t>(o.blocks * 2 * C) * sizeof(float) <= bytes, "layernorm_backward: ", o.blocks,
             " partials of ", C, " columns exceed the stream workspace of ", bytes, " bytes");
  }
  const int64_t chunks = (C + kN - 1) / kN;
  const bool vec = C % kN == 0 && detail::is_aligned16(din) && detail::is_aligned16(dout) && detail::is_aligned16(in);
  const bool wvec = C % kN == 0 && detail::is_aligned16(weight);
  const bool cached = chunks <= int64_t{kBwdCachedLaneChunks} * kWarpSize;
  const size_t shared = o.shared_sums ? static_cast<size_t>(o.warps) * 2 * chunks * kN * sizeof(float) : 0;
  const dim3 grid(static_cast<unsigned>(o.blocks)), block(static_cast<unsigned>(o.warps * kWarpSize));
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, shared, stream>>>(din, partials, dweight, dbias, dout, in, weight, mean, rstd, N, C,
                                            o.rows_per_block, single, vec, wvec);
  };
  if (o.shared_sums) {
    if (cached) launch(layernorm_backward_kernel<T, W, true, true>);
    else launch(layernorm_backward_kernel<T, W, false, true>);
  } else {
    launch(layernorm_backward_kernel<T, W, false, false>);
  }
  ZT_CUDA_CHECK(cudaGetLastError());
  if (!single) {
    const dim3 fgrid(static_cast<unsigned>((2 * C + kWarpSize - 1) / kWarpSize)), fblock(kWarpSize, kLnStripes);
    layernorm_backward_finish_kernel<<<fgrid, fblock, 0, stream>>>(dweight, dbias, partials, C, o.blocks);
    ZT_CUDA_CHECK(cudaGetLastError());
  }
}

// ---- column sums in two stages: the bias gradient -----------------------------------------------
// Stage 1: block (32, kColumnSumRows) covers 32 columns of one chunk of rows; each thread sums its
// row stripe of the chunk in row order, the stripes combine by detail::column_tree_sum. Stage 2:
// one thread per column adds the chunk partials in chunk order. The chunking depends only on
// (N, C), never on the GPU. With one chunk stage 1 adds into the gradient directly (the
// single-stage kernel's bits).
constexpr int64_t kColumnChunkRows = 256;  // rows per chunk at least: 32 stripes of 8 rows
constexpr int64_t kMaxColumnChunks = 64;   // x ceil(C/32) blocks: 1536 blocks at C = 768

struct ColumnChunks {
  int64_t count, rows;
};
// C columns, partials in double: they must fit the stream's workspace.
ColumnChunks column_chunks(int64_t N, int64_t C) {
  const int64_t fit = static_cast<int64_t>(detail::kMinStreamWorkspace / sizeof(double)) / C;
  const int64_t want = std::clamp<int64_t>((N + kColumnChunkRows - 1) / kColumnChunkRows, 1,
                                           std::max<int64_t>(1, std::min(kMaxColumnChunks, fit)));
  const int64_t rows = (N + want - 1) / want;
  return {N == 0 ? 1 : (N + rows - 1) / rows, std::max<int64_t>(rows, 1)};
}

// dbias += sum over rows of dout (T, widened where read). partials: [chunks][C] doubles.
template <typename T>
__global__ void __launch_bounds__(kWarpSize * kColumnSumRows)
    column_partials_kernel(float* __restrict__ dbias, double* __restrict__ partials, const T* __restrict__ dout,
                           int64_t N, int64_t C, int64_t chunk_rows) {
  __shared__ detail::ColumnTile tile;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kWarpSize + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = min(N, r0 + chunk_rows);
  double acc = 0.0;
  if (col < C)
    for (int64_t row = r0 + threadIdx.y; row < r1; row += kColumnSumRows) acc += to_float(dout[row * C + col]);
  const double total = detail::column_tree_sum(acc, tile);
  if (threadIdx.y != 0 || col >= C) return;
  if (gridDim.y == 1) {
    dbias[col] += static_cast<float>(total);
  } else {
    partials[blockIdx.y * C + col] = total;
  }
}

__global__ void column_finish_kernel(float* __restrict__ dbias, const double* __restrict__ partials, int64_t C,
                                     int64_t chunks) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < C; col += stride) {
    const double* p = partials + col;
    double total = p[0];
    for (int64_t k = 1; k < chunks; ++k) total += p[k * C];
    dbias[col] += static_cast<float>(total);
  }
}

template <typename T>
void launch_column_sums(cudaStream_t stream, float* dbias, const T* dout, int64_t N, int64_t C) {
  if (C == 0 || dbias == nullptr) return;
  const ColumnChunks ch = column_chunks(N, C);
  double* partials = nullptr;
  if (ch.count > 1) {
    size_t bytes = 0;
    partials = static_cast<double*>(detail::stream_workspace(stream, &bytes));
    ZT_CHECK(static_cast<size_t>(ch.count * C) * sizeof(double) <= bytes, "column sums: ", ch.count, " chunks of ",
             C, " columns exceed the stream workspace of ", bytes, " bytes");
  }
  const dim3 grid(static_cast<unsigned>((C + kWarpSize - 1) / kWarpSize), static_cast<unsigned>(ch.count));
  column_partials_kernel<T><<<grid, dim3(kWarpSize, kColumnSumRows), 0, stream>>>(dbias, partials, dout, N, C,
                                                                                   ch.rows);
  ZT_CUDA_CHECK(cudaGetLastError());
  if (ch.count > 1) {
    column_finish_kernel<<<detail::grid_for(C), detail::kElementwiseBlock, 0, stream>>>(dbias, partials, C, ch.count);
    ZT_CUDA_CHECK(cudaGetLastError());
  }
}

// One block per row of logits [N,V]: max, sum of exp, loss, then dlogits in place.
constexpr int kClassifierBlock = 512;

// A row's max / sum of exp over the block, with cub::BlockReduce (a fixed combination order for a
// fixed block size, so run-to-run deterministic; no test compares these bits with the CPU backend,
// whose sequential double sum is another order anyway), broadcast to every thread. The
// vocabulary-parallel kernels share it. Call from every thread of a kClassifierBlock block.
template <typename T>
struct RowReduce {
  typename cub::BlockReduce<T, kClassifierBlock>::TempStorage temp;
  T result;
};
// fmaxf, not cuda::maximum: a NaN logit is skipped exactly as the CPU backend's std::fmax does.
struct FMax {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
template <typename T, typename Op>
__device__ __forceinline__ T row_reduce(T v, Op op, RowReduce<T>& shared) {
  const T r = cub::BlockReduce<T, kClassifierBlock>(shared.temp).Reduce(v, op);
  if (threadIdx.x == 0) shared.result = r;
  // Also orders this call's reads of `temp` (thread 0, inside Reduce) before the next call's writes.
  __syncthreads();
  return shared.result;
}
__device__ __forceinline__ float row_max_all(float v, RowReduce<float>& shared) {
  return row_reduce(v, FMax{}, shared);
}
__device__ __forceinline__ double row_sum_all(double v, RowReduce<double>& shared) {
  return row_reduce(v, ::cuda::std::plus<double>{}, shared);
}

// ---- fused classifier: online softmax statistics (llm.c's fused classifier) -------------------
// exp(x) for the classifier's x <= 0 (a logit minus its row's max): the special-function unit's
// ex2.approx of x·log2(e) (__expf: a multiply and MUFU.EX2, plus a compare and a rescale for
// subnormal results, where exp_elem's polynomial takes ~18 instructions; llm.c's fast-math build
// runs the same exp, flushing subnormals besides). With exp_elem the classifier was bound by
// instructions, not bytes (two exps per logit: 2.34 ms for 3.3 GB at GPT-2 124M, B 16, T 1024 on
// an H200 on 2026-12-04, 1.4 TB/s; ~33 G instructions at ~33 T/s). Relative error: ex2.approx's
// 2 ulp (PTX ISA) plus |x|·7.3e-8 from rounding x·log2(e) and the constant, i.e. about 2e-6 at
// |x| = 25 and < 7e-6 down to exp(-87) (below, exp_elem gives 0 and this a subnormal: less than
// 2^-126 apart); exp(0) is exactly 1 (the online rescale and the one-column rows rely on it), -inf
// gives +0, NaN stays NaN. The vocabulary-parallel kernels below use it too, so that they keep the
// classifier's arithmetic (test_tp_ops compares the two at 1e-6). These bits are CUDA's own: the
// CPU backend's classifier (exp_elem, a lane-blocked double sum) was never bit-equal to this
// kernel's block reduction, and now differs in the exp too; the tests hold both to float64 within
// the element-wise bounds (kTolElem's 1e-5 relative against about 2e-6 where |x| <= 25).
__device__ __forceinline__ float classifier_exp(float x) { return __expf(x); }

// A running max and the sum of exp relative to it, per thread and then per block: one read of the
// row gives both (the two-pass form reads it twice before the gradient pass reads it again).
struct MaxSum {
  float max;
  double sum;
};
__device__ __forceinline__ MaxSum max_sum_combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0};  // both empty: -inf - -inf would be NaN
  return {m, a.sum * double{classifier_exp(a.max - m)} + b.sum * double{classifier_exp(b.max - m)}};
}
struct MaxSumOp {
  __device__ __forceinline__ MaxSum operator()(MaxSum a, MaxSum b) const { return max_sum_combine(a, b); }
};

// 16 bytes of logits: 4 fp32 or 8 bf16/f16, for 128-bit loads and stores.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));
  T v[kN];
};

// Folds k logits (already fp32) into a thread's running statistics: one rescale per pack.
template <int K>
__device__ __forceinline__ void fold(MaxSum& acc, const float (&x)[K]) {
  float m = acc.max;
#pragma unroll
  for (int j = 0; j < K; ++j) m = fmaxf(m, x[j]);
  if (m == -INFINITY) return;  // nothing but -inf so far (or NaN only): exp(-inf - -inf) is NaN
  double s = acc.sum * double{classifier_exp(acc.max - m)};
#pragma unroll
  for (int j = 0; j < K; ++j) s += classifier_exp(x[j] - m);
  acc = {m, s};
}

// One block per row of logits [N, ld] (T = float, zt::BFloat16, zt::Half), V real columns: the
// statistics in one sweep, the loss, then (compute_grad) dlogits written in place in T, 0 for the
// padding [V, ld). Rows whose start is 16-byte aligned (every row when ld * sizeof(T) is a multiple
// of 16 and the buffer is aligned) use 128-bit loads and stores.
template <typename T>
__global__ void __launch_bounds__(kClassifierBlock)
    classifier_kernel(T* __restrict__ logits, float* __restrict__ losses,
                      const int32_t* __restrict__ targets, int64_t N, int64_t ld, int64_t V,
                      float dloss_arg, bool compute_grad, const float* __restrict__ dloss_scale) {
  constexpr int kPack = Pack<T>::kN;
  __shared__ RowReduce<MaxSum> stats_shared;
  // Dynamic loss scaling: the scale lives in device memory and is read when the kernel runs.
  const float dloss = dloss_scale != nullptr ? dloss_arg * *dloss_scale : dloss_arg;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    T* x = logits + row * ld;
    const int32_t target = targets[row];
    const bool ignored = target < 0;
    const bool valid = !ignored && target < V;
    const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
    // Vector part [0, vend) (packs wholly inside the real columns), scalar tail [vend, V).
    const int64_t vend = vec ? V / kPack * kPack : 0;
    // Read before the reduction: its __syncthreads orders it before any in-place write below.
    const float target_logit = valid ? to_float(x[target]) : 0.0f;
    MaxSum acc{-INFINITY, 0.0};
    for (int64_t i = threadIdx.x * int64_t{kPack}; i < vend; i += int64_t{blockDim.x} * kPack) {
      const Pack<T> p = *reinterpret_cast<const Pack<T>*>(x + i);
      float f[kPack];
#pragma unroll
      for (int j = 0; j < kPack; ++j) f[j] = to_float(p.v[j]);
      fold(acc, f);
    }
    for (int64_t i = vend + threadIdx.x; i < V; i += blockDim.x) {
      const float f[1] = {to_float(x[i])};
      fold(acc, f);
    }
    const MaxSum st = row_reduce(acc, MaxSumOp{}, stats_shared);
    const float m = st.max;
    const double s = st.sum;
    if (threadIdx.x == 0) {
      // A target >= V is a caller bug (the CPU backend throws): flag the row's loss as NaN.
      losses[row] = ignored ? 0.0f
                            : (valid ? static_cast<float>(log(s) - (double{target_logit} - m))
                                     : NAN);
    }
    if (compute_grad) {
      const float inv = static_cast<float>(1.0 / s);
      auto grad = [&](int64_t i, float xi) -> float {
        if (ignored || i >= V) return 0.0f;
        const float p = classifier_exp(xi - m) * inv;
        return (p - (i == target ? 1.0f : 0.0f)) * dloss;
      };
      // Packs may run into the padding here (written 0): every full pack inside the row. The
      // padding [V, ld) is written, never read, as on the CPU backend: lm_head_forward leaves it
      // as it was, possibly never written (compute-sanitizer's initcheck would report the read);
      // grad() gives 0 there whatever it is passed.
      const int64_t gend = vec ? ld / kPack * kPack : 0;
      for (int64_t i = threadIdx.x * int64_t{kPack}; i < gend; i += int64_t{blockDim.x} * kPack) {
        Pack<T> p;
        if (i + kPack <= V) {
          p = *reinterpret_cast<const Pack<T>*>(x + i);
        } else {
#pragma unroll
          for (int j = 0; j < kPack; ++j) p.v[j] = i + j < V ? x[i + j] : from_float<T>(0.0f);
        }
#pragma unroll
        for (int j = 0; j < kPack; ++j) p.v[j] = from_float<T>(grad(i + j, to_float(p.v[j])));
        *reinterpret_cast<Pack<T>*>(x + i) = p;
      }
      for (int64_t i = gend + threadIdx.x; i < ld; i += blockDim.x)
        x[i] = from_float<T>(grad(i, i < V ? to_float(x[i]) : 0.0f));
    }
    __syncthreads();  // every thread has read the broadcast results before the next row writes them
  }
}

// ---- vocabulary-parallel cross-entropy: one block per row, as the classifier ------------------
// Logits of T (float, BFloat16, Half), widened exactly where read; statistics fp32/double.
template <typename T>
__global__ void __launch_bounds__(kClassifierBlock)
    row_max_kernel(float* __restrict__ out, const T* __restrict__ logits, int64_t N, int64_t V, int64_t real) {
  __shared__ RowReduce<float> max_shared;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const T* x = logits + row * V;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < real; i += blockDim.x) m = fmaxf(m, to_float(x[i]));
    m = row_max_all(m, max_shared);
    if (threadIdx.x == 0) out[row] = m;
    __syncthreads();  // thread 0 has read the broadcast before the next row writes it
  }
}

// out[row] = sum exp(x - max) (double, rounded to fp32), out[N + row] = the target's logit when this
// shard holds it; both 0 for ignored rows, NaN sum for a target >= total (a caller bug the CPU
// backend throws for).
template <typename T>
__global__ void __launch_bounds__(kClassifierBlock)
    vocab_partials_kernel(float* __restrict__ out, const T* __restrict__ logits,
                          const float* __restrict__ max, const int32_t* __restrict__ targets,
                          int64_t N, int64_t V, int64_t begin, int64_t total) {
  __shared__ RowReduce<double> sum_shared;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const int32_t target = targets[row];
    if (target < 0) {  // uniform over the block: no thread reaches the row_sum_all below
      if (threadIdx.x == 0) {
        out[row] = 0.0f;
        out[N + row] = 0.0f;
      }
      continue;
    }
    const T* x = logits + row * V;
    const float m = max[row];
    const int64_t avail = total - begin, real = avail < 0 ? 0 : avail < V ? avail : V;  // padding takes no part
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < real; i += blockDim.x) s += classifier_exp(to_float(x[i]) - m);
    s = row_sum_all(s, sum_shared);
    if (threadIdx.x == 0) {
      const int64_t local = target - begin;
      out[row] = target < total ? static_cast<float>(s) : NAN;
      out[N + row] = local >= 0 && local < V ? to_float(x[local]) : 0.0f;
    }
    __syncthreads();  // thread 0 has read the broadcast before the next row writes it
  }
}

// losses and (compute_grad) dlogits in place, with the classifier's arithmetic: each gradient is
// computed in fp32 from the widened logit and rounded to T once.
template <typename T>
__global__ void __launch_bounds__(kClassifierBlock)
    vocab_loss_grad_kernel(T* __restrict__ logits, float* __restrict__ losses,
                           const float* __restrict__ max, const float* __restrict__ sumexp,
                           const float* __restrict__ target_logit,
                           const int32_t* __restrict__ targets, int64_t N, int64_t V, int64_t begin,
                           int64_t total, float dloss_arg, bool compute_grad,
                           const float* __restrict__ dloss_scale) {
  const float dloss = dloss_scale != nullptr ? dloss_arg * *dloss_scale : dloss_arg;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    T* x = logits + row * V;
    const int32_t target = targets[row];
    const bool ignored = target < 0;
    const double sum = sumexp[row];
    const float m = max[row];
    if (threadIdx.x == 0) {
      losses[row] = ignored          ? 0.0f
                    : target < total ? static_cast<float>(log(sum) - (double{target_logit[row]} - m))
                                     : NAN;
    }
    if (!compute_grad) continue;
    const float inv = static_cast<float>(1.0 / sum);
    const int64_t local = target - begin;
    const int64_t avail = total - begin, real = avail < 0 ? 0 : avail < V ? avail : V;  // padding: gradient 0
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      // The padding [real, V) is written, never read (it may never have been written).
      const float xi = i < real ? to_float(x[i]) : 0.0f;
      const float p = classifier_exp(xi - m) * inv;
      x[i] = from_float<T>(ignored || i >= real ? 0.0f : (p - (i == local ? 1.0f : 0.0f)) * dloss);
    }
  }
}

unsigned row_blocks(int64_t N) { return static_cast<unsigned>(std::min<int64_t>(N, 65535)); }

}  // namespace

using zt::detail::dispatch_norm_types;  // kernels/storage_types.h
using zt::detail::with_storage_type;

void row_max(void* stream, float* out, const void* logits, DType dtype, int64_t N, int64_t V, int64_t v_begin,
             int64_t v_total) {
  detail::LaunchScope scope(stream);
  const int64_t real = std::min(V, std::max(int64_t{0}, v_total - v_begin));
  with_storage_type(dtype, "row_max", [&](auto tag) {
    using T = decltype(tag);
    row_max_kernel<T><<<row_blocks(N), kClassifierBlock, 0, scope.stream()>>>(out, static_cast<const T*>(logits),
                                                                              N, V, real);
  });
  ZT_CUDA_CHECK(cudaGetLastError());
}

void vocab_partials(void* stream, float* out, const void* logits, DType dtype, const float* max,
                    const int32_t* targets, int64_t N, int64_t V, int64_t v_begin, int64_t v_total) {
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "vocab_partials", [&](auto tag) {
    using T = decltype(tag);
    vocab_partials_kernel<T><<<row_blocks(N), kClassifierBlock, 0, scope.stream()>>>(
        out, static_cast<const T*>(logits), max, targets, N, V, v_begin, v_total);
  });
  ZT_CUDA_CHECK(cudaGetLastError());
}

void vocab_loss_grad(void* stream, void* logits, DType dtype, float* losses, const float* max,
                     const float* sumexp, const float* target_logit, const int32_t* targets,
                     int64_t N, int64_t V, int64_t v_begin, int64_t v_total, float dloss,
                     bool compute_grad, const float* dloss_scale) {
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "vocab_loss_grad", [&](auto tag) {
    using T = decltype(tag);
    vocab_loss_grad_kernel<T><<<row_blocks(N), kClassifierBlock, 0, scope.stream()>>>(
        static_cast<T*>(logits), losses, max, sumexp, target_logit, targets, N, V, v_begin, v_total, dloss,
        compute_grad, dloss_scale);
  });
  ZT_CUDA_CHECK(cudaGetLastError());
}

void layernorm_forward(void* stream, void* out, float* mean, float* rstd, const void* in, DType act,
                       const void* weight, const void* bias, DType wt, int64_t N, int64_t C, float eps) {
  detail::LaunchScope scope(stream);
  dispatch_norm_types("layernorm_forward", act, wt, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_pointer_t<decltype(w)>;
    const bool vec = C % detail::Pack<T>::kN == 0 && detail::is_aligned16(out) && detail::is_aligned16(in);
    launch_layernorm_rows<T, W, false>(scope.stream(), static_cast<T*>(out), mean, rstd, nullptr,
                                       static_cast<const T*>(in), nullptr, static_cast<const W*>(weight),
                                       static_cast<const W*>(bias), N, C, eps, vec);
  });
}

void residual_layernorm_forward(void* stream, void* residual_out, void* ln_out, float* mean, float* rstd,
                                const void* a, const void* b, DType act, const void* weight, const void* bias,
                                DType wt, int64_t N, int64_t C, float eps) {
  detail::LaunchScope scope(stream);
  dispatch_norm_types("residual_layernorm_forward", act, wt, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_pointer_t<decltype(w)>;
    const bool vec = C % detail::Pack<T>::kN == 0 && detail::is_aligned16(residual_out) &&
                     detail::is_aligned16(ln_out) && detail::is_aligned16(a) && detail::is_aligned16(b);
    launch_layernorm_rows<T, W, true>(scope.stream(), static_cast<T*>(ln_out), mean, rstd,
                                      static_cast<T*>(residual_out), static_cast<const T*>(a),
                                      static_cast<const T*>(b), static_cast<const W*>(weight),
                                      static_cast<const W*>(bias), N, C, eps, vec);
  });
}

void layernorm_backward(void* stream, void* din, float* dweight, float* dbias, const void* dout, const void* in,
                        DType act, const void* weight, DType wt, const float* mean, const float* rstd, int64_t N,
                        int64_t C) {
  detail::LaunchScope scope(stream);
  dispatch_norm_types("layernorm_backward", act, wt, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_pointer_t<decltype(w)>;
    launch_layernorm_backward<T, W>(scope.stream(), static_cast<T*>(din), dweight, dbias, static_cast<const T*>(dout),
                                    static_cast<const T*>(in), static_cast<const W*>(weight), mean, rstd, N, C);
  });
}

void classifier_forward_backward(void* stream, void* logits, DType dtype, float* losses,
                                 const int32_t* targets, int64_t N, int64_t ld, int64_t V, float dloss,
                                 bool compute_grad, const float* dloss_scale) {
  detail::LaunchScope scope(stream);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, 65535));
  auto launch = [&](auto* typed) {
    classifier_kernel<<<blocks, kClassifierBlock, 0, scope.stream()>>>(typed, losses, targets, N, ld, V, dloss,
                                                                       compute_grad, dloss_scale);
  };
  switch (dtype) {
    case DType::kF32:
      launch(static_cast<float*>(logits));
      break;
    case DType::kBF16:
      launch(static_cast<BFloat16*>(logits));
      break;
    case DType::kF16:
      launch(static_cast<Half*>(logits));
      break;
    default:
      ZT_THROW(ErrorKind::kInvalidArgument, "classifier_forward_backward: logits of ", dtype_name(dtype),
               " (f32, bf16 or f16 only)");
  }
  ZT_CUDA_CHECK(cudaGetLastError());
}

namespace detail {
void add_column_sums(cudaStream_t stream, float* dbias, const float* dout, int64_t N, int64_t C) {
  launch_column_sums<float>(stream, dbias, dout, N, C);
}
void add_column_sums(cudaStream_t stream, float* dbias, const Half* dout, int64_t N, int64_t C) {
  launch_column_sums<Half>(stream, dbias, dout, N, C);
}
void add_column_sums(cudaStream_t stream, float* dbias, const BFloat16* dout, int64_t N, int64_t C) {
  launch_column_sums<BFloat16>(stream, dbias, dout, N, C);
}
}  // namespace detail

}  // namespace zt::cuda_ops
