// CUDA kernels of the multi-tensor optimizer ops. One launch covers a whole list: the grid has one
// block per kMultiTensorChunk chunk of all segments, and a block finds its segment by binary
// search over a chunk prefix table that a one-block CUB scan computes from the device copy of the
// list (into a pool workspace), so the host never uploads anything per step. unscale_check sums
// per chunk (CUB block reduction, double), then per segment, then per output in list order: fixed
// trees sized by the problem, no floating-point atomics, so the norms are run-to-run
// deterministic and the same on every GPU.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/kernel_utils.h"
#include "kernels/cuda/multi_tensor.h"
#include "kernels/elementwise.h"
#include "kernels/multi_tensor_elem.h"

namespace zt::optim::cuda_kernels {
namespace {

constexpr int kBlock = 256;  // threads per chunk block: 64 elements per thread per chunk
constexpr int kUpdateBatch = 4;  // elements a thread of an update loads before it stores any

// ---- chunk prefix table ------------------------------------------------------------------------
// prefix[s] = first chunk of segment s, prefix[num_segs] = total chunks. One block: tiles of
// kBlock segments, each an inclusive CUB scan plus the running total of the earlier tiles.
template <typename Segment>
__global__ void __launch_bounds__(kBlock)
    chunk_prefix_kernel(const Segment* __restrict__ segs, int64_t num_segs,
                        int64_t* __restrict__ prefix) {
  using BlockScan = cub::BlockScan<int64_t, kBlock>;
  __shared__ typename BlockScan::TempStorage temp;
  if (threadIdx.x == 0) prefix[0] = 0;
  int64_t carry = 0;
  for (int64_t base = 0; base < num_segs; base += kBlock) {
    const int64_t s = base + threadIdx.x;
    const int64_t count = s < num_segs ? multi_tensor_chunks(segs[s].n) : 0;
    int64_t inclusive = 0, tile_total = 0;
    BlockScan(temp).InclusiveSum(count, inclusive, tile_total);
    if (s < num_segs) prefix[s + 1] = carry + inclusive;
    carry += tile_total;
    __syncthreads();  // temp is reused by the next tile
  }
}

// The segment holding chunk c: the last s with prefix[s] <= c (empty segments are skipped since
// their prefix equals the next one's). Every thread of a block searches the same addresses.
__device__ __forceinline__ int64_t find_segment(const int64_t* __restrict__ prefix,
                                                int64_t num_segs, int64_t c) {
  int64_t lo = 0, hi = num_segs;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (prefix[mid] <= c) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// ---- AdamW / SGD -------------------------------------------------------------------------------

struct SgdArgs {
  float lr, momentum;
  bool nesterov;
};

template <typename P, typename G, bool kAdamW, bool kStochastic>
__global__ void __launch_bounds__(kBlock)
    multi_update_kernel(const OptimizerSegment* __restrict__ segs,
                        const int64_t* __restrict__ prefix, int64_t num_segs, AdamWArgs adam,
                        SgdArgs sgd, StepScalars sc, uint64_t config_step) {
  if (sc.found_inf != nullptr && *sc.found_inf != 0.0f) return;  // skipped step: write nothing
  // The step from the device counter (count_update_kernel adds 1 after this kernel): the bias
  // corrections with the host's function, so the bits are the host's.
  const uint64_t step = sc.update_count != nullptr ? uint64_t{*sc.update_count} + 1 : config_step;
  if (kAdamW && sc.update_count != nullptr) {
    adam.bias_correction1 = adamw_bias_correction(adam.beta1, step);
    adam.bias_correction2 = adamw_bias_correction(adam.beta2, step);
  }
  const float grad_scale =
      (sc.inv_loss_scale != nullptr ? *sc.inv_loss_scale : 1.0f) * (sc.clip != nullptr ? *sc.clip : 1.0f);
  const int64_t c = blockIdx.x;
  const int64_t s = find_segment(prefix, num_segs, c);
  const OptimizerSegment seg = segs[s];
  const int64_t begin = (c - prefix[s]) * kMultiTensorChunk;
  const int64_t end = min(seg.n, begin + kMultiTensorChunk);
  P* __restrict__ param = static_cast<P*>(seg.param);
  const G* __restrict__ grad = static_cast<const G*>(seg.grad);
  float* __restrict__ master = seg.master;
  float* __restrict__ m = seg.m;
  float* __restrict__ v = seg.v;
  // The fp32 working copy that is the master itself is not written a second time.
  const bool write_param = !std::is_same_v<P, float> || seg.param != static_cast<void*>(seg.master);
  // kUpdateBatch elements per thread and round, all loaded before any is stored: the segment's
  // pointers may alias as far as the compiler knows, so it would not move a load above an earlier
  // store, leaving one element's ~14 bytes in flight per thread (~2.7 TB/s on an H200 measured).
  // Each element is still updated by the same expression: the bits do not depend on the batching.
  for (int64_t i0 = begin + threadIdx.x; i0 < end; i0 += int64_t{kBlock} * kUpdateBatch) {
    float p[kUpdateBatch] = {}, mi[kUpdateBatch] = {}, vi[kUpdateBatch] = {}, g[kUpdateBatch] = {};
#pragma unroll
    for (int u = 0; u < kUpdateBatch; ++u) {
      const int64_t i = i0 + int64_t{u} * kBlock;
      if (i < end) {
        p[u] = master[i];
        mi[u] = m[i];
        if constexpr (kAdamW) vi[u] = v[i];
        g[u] = to_float(grad[i]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUpdateBatch; ++u) {
      const int64_t i = i0 + int64_t{u} * kBlock;
      if (i >= end) continue;
      if constexpr (kAdamW) {
        adamw_elem(p[u], g[u], mi[u], vi[u], adam.lr, adam.beta1, adam.beta2, adam.eps, seg.weight_decay,
                   adam.bias_correction1, adam.bias_correction2, grad_scale);
        v[i] = vi[u];
      } else {
        sgd_elem(p[u], g[u], mi[u], sgd.lr, sgd.momentum, seg.weight_decay, sgd.nesterov, grad_scale);
      }
      master[i] = p[u];
      m[i] = mi[u];
      if (write_param)
        param[i] = working_from_master<P, kStochastic>(p[u], sc.seed, step, seg.rng_offset + static_cast<uint64_t>(i));
    }
  }
}

// The update counter (StepScalars::update_count): one thread, after the update kernel read it.
__global__ void count_update_kernel(uint32_t* __restrict__ count, const float* __restrict__ found_inf) {
  if (found_inf == nullptr || *found_inf == 0.0f) ++*count;
}

template <bool kAdamW, bool kStochastic, typename P, typename G>
void launch_update_typed(cudaStream_t stream, const OptimizerSegment* segs, const int64_t* prefix,
                         int64_t num_segs, int64_t total_chunks, const AdamWArgs& adam,
                         const SgdArgs& sgd, const StepScalars& sc, uint64_t step) {
  multi_update_kernel<P, G, kAdamW, kStochastic>
      <<<static_cast<unsigned>(total_chunks), kBlock, 0, stream>>>(segs, prefix, num_segs, adam,
                                                                   sgd, sc, step);
}

template <bool kAdamW, bool kStochastic, typename P>
void launch_update_grad(DType grad_dtype, cudaStream_t stream, const OptimizerSegment* segs,
                        const int64_t* prefix, int64_t num_segs, int64_t total_chunks,
                        const AdamWArgs& adam, const SgdArgs& sgd, const StepScalars& sc,
                        uint64_t step) {
  switch (grad_dtype) {
    case DType::kF32:
      return launch_update_typed<kAdamW, kStochastic, P, float>(stream, segs, prefix, num_segs,
                                                                total_chunks, adam, sgd, sc, step);
    case DType::kF16:
      return launch_update_typed<kAdamW, kStochastic, P, Half>(stream, segs, prefix, num_segs,
                                                               total_chunks, adam, sgd, sc, step);
    case DType::kBF16:
      return launch_update_typed<kAdamW, kStochastic, P, BFloat16>(
          stream, segs, prefix, num_segs, total_chunks, adam, sgd, sc, step);
    case DType::kI32:
      break;
  }
  ZT_CHECK(false, "multi-tensor optimizer: unsupported gradient dtype ", dtype_name(grad_dtype));
}

template <bool kAdamW, bool kStochastic>
void launch_update_param(DType param_dtype, DType grad_dtype, cudaStream_t stream,
                         const OptimizerSegment* segs, const int64_t* prefix, int64_t num_segs,
                         int64_t total_chunks, const AdamWArgs& adam, const SgdArgs& sgd,
                         const StepScalars& sc, uint64_t step) {
  switch (param_dtype) {
    case DType::kF32:
      return launch_update_grad<kAdamW, kStochastic, float>(
          grad_dtype, stream, segs, prefix, num_segs, total_chunks, adam, sgd, sc, step);
    case DType::kF16:
      return launch_update_grad<kAdamW, kStochastic, Half>(
          grad_dtype, stream, segs, prefix, num_segs, total_chunks, adam, sgd, sc, step);
    case DType::kBF16:
      return launch_update_grad<kAdamW, kStochastic, BFloat16>(
          grad_dtype, stream, segs, prefix, num_segs, total_chunks, adam, sgd, sc, step);
    case DType::kI32:
      break;
  }
  ZT_CHECK(false, "multi-tensor optimizer: unsupported param dtype ", dtype_name(param_dtype));
}

template <bool kAdamW>
void launch_update(const char* op, void* stream, const OptimizerSegment* segs, int64_t num_segs,
                   int64_t total_chunks, DType param_dtype, DType grad_dtype, const AdamWArgs& adam,
                   const SgdArgs& sgd, const StepScalars& sc, uint64_t step, void* workspace,
                   size_t workspace_bytes) {
  ZT_CHECK((num_segs > 0 && total_chunks > 0 && total_chunks <= INT32_MAX) ||
               (total_chunks == 0 && sc.update_count != nullptr),
           op, ": ", num_segs, " segments, ", total_chunks, " chunks");
  cuda_ops::detail::LaunchScope scope(stream);
  if (total_chunks == 0) {  // nothing to update, only the update to count
    count_update_kernel<<<1, 1, 0, scope.stream()>>>(sc.update_count, sc.found_inf);
    ZT_CUDA_CHECK(cudaGetLastError());
    return;
  }
  ZT_CHECK(workspace != nullptr && workspace_bytes >= update_workspace_bytes(num_segs), op,
           ": workspace of ", workspace_bytes, " bytes, need ", update_workspace_bytes(num_segs));
  auto* prefix = static_cast<int64_t*>(workspace);
  chunk_prefix_kernel<<<1, kBlock, 0, scope.stream()>>>(segs, num_segs, prefix);
  ZT_CUDA_CHECK(cudaGetLastError());
  if (sc.rounding == Rounding::kStochastic) {
    launch_update_param<kAdamW, true>(param_dtype, grad_dtype, scope.stream(), segs, prefix,
                                      num_segs, total_chunks, adam, sgd, sc, step);
  } else {
    launch_update_param<kAdamW, false>(param_dtype, grad_dtype, scope.stream(), segs, prefix,
                                       num_segs, total_chunks, adam, sgd, sc, step);
  }
  ZT_CUDA_CHECK(cudaGetLastError());
  if (sc.update_count != nullptr) {
    count_update_kernel<<<1, 1, 0, scope.stream()>>>(sc.update_count, sc.found_inf);
    ZT_CUDA_CHECK(cudaGetLastError());
  }
}

// ---- unscale_check -----------------------------------------------------------------------------

using BlockReduce = cub::BlockReduce<double, kBlock>;

// partial[c] = sum over chunk c of (g * inv)^2, in double.
template <typename G>
__global__ void __launch_bounds__(kBlock)
    chunk_sum_squares_kernel(const GradSegment* __restrict__ segs,
                             const int64_t* __restrict__ prefix, int64_t num_segs,
                             const float* __restrict__ inv_loss_scale,
                             double* __restrict__ partial) {
  __shared__ typename BlockReduce::TempStorage temp;
  const float inv = inv_loss_scale != nullptr ? *inv_loss_scale : 1.0f;
  const int64_t c = blockIdx.x;
  const int64_t s = find_segment(prefix, num_segs, c);
  const GradSegment seg = segs[s];
  const int64_t begin = (c - prefix[s]) * kMultiTensorChunk;
  const int64_t end = min(seg.n, begin + kMultiTensorChunk);
  const G* __restrict__ grad = static_cast<const G*>(seg.grad);
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlock) {
    const double u = to_float(grad[i]) * inv;
    acc += u * u;
  }
  const double total = BlockReduce(temp).Sum(acc);
  if (threadIdx.x == 0) partial[c] = total;
}

// seg_sum[s] = sum of segment s's chunk partials (one block per segment).
__global__ void __launch_bounds__(kBlock)
    segment_sum_kernel(const int64_t* __restrict__ prefix, const double* __restrict__ partial,
                       double* __restrict__ seg_sum) {
  __shared__ typename BlockReduce::TempStorage temp;
  const int64_t s = blockIdx.x;
  double acc = 0.0;
  for (int64_t c = prefix[s] + threadIdx.x; c < prefix[s + 1]; c += kBlock) acc += partial[c];
  const double total = BlockReduce(temp).Sum(acc);
  if (threadIdx.x == 0) seg_sum[s] = total;
}

// One block: norms_out[k] = sum of seg_sum[s] over s with out == k, in list order (thread k
// adds them sequentially, the list staged through shared memory tile by tile); found_inf = 1 when
// a segment sum is non-finite (a finite gradient's square is below 2^256, so a double sum of them
// is finite: the sum is non-finite iff an element was).
__global__ void __launch_bounds__(kBlock)
    norms_kernel(const GradSegment* __restrict__ segs, const double* __restrict__ seg_sum,
                 int64_t num_segs, float* __restrict__ norms_out, int num_out,
                 float* __restrict__ found_inf) {
  __shared__ int tile_out[kBlock];
  __shared__ double tile_sum[kBlock];
  for (int64_t k0 = 0; k0 < num_out; k0 += kBlock) {
    const int64_t k = k0 + threadIdx.x;
    double acc = 0.0;
    for (int64_t base = 0; base < num_segs; base += kBlock) {
      const int64_t count = min(static_cast<int64_t>(kBlock), num_segs - base);
      __syncthreads();  // the previous tile is no longer read
      if (threadIdx.x < count) {
        tile_out[threadIdx.x] = segs[base + threadIdx.x].out;
        tile_sum[threadIdx.x] = seg_sum[base + threadIdx.x];
      }
      __syncthreads();
      if (k < num_out)
        for (int64_t j = 0; j < count; ++j)
          if (tile_out[j] == k) acc += tile_sum[j];
    }
    if (k < num_out) norms_out[k] = static_cast<float>(acc);
  }
  int non_finite = 0;
  for (int64_t s = threadIdx.x; s < num_segs; s += kBlock) non_finite |= !isfinite(seg_sum[s]);
  non_finite = __syncthreads_or(non_finite);
  if (threadIdx.x == 0 && found_inf != nullptr) *found_inf = non_finite ? 1.0f : 0.0f;
}

__global__ void loss_scale_kernel(LossScaleState* state, const float* found_inf,
                                  LossScaleConfig c) {
  LossScaleState st = *state;
  loss_scale_transition_elem(st, *found_inf != 0.0f, c);
  *state = st;
}

__global__ void clip_factor_kernel(const float* parts, const float* include, int ranks, int row, float max_norm,
                                   double* out, float* clip, float* found_inf) {
  clip_factor_elem(parts, include, ranks, row, max_norm, out, clip, found_inf);
}

}  // namespace

size_t update_workspace_bytes(int64_t num_segs) {
  return static_cast<size_t>(num_segs + 1) * sizeof(int64_t);
}

void adamw_multi(void* stream, const OptimizerSegment* segs, int64_t num_segs, int64_t total_chunks,
                 DType param_dtype, DType grad_dtype, const AdamWArgs& a, const StepScalars& sc,
                 uint64_t step, void* workspace, size_t workspace_bytes) {
  launch_update<true>("adamw_multi", stream, segs, num_segs, total_chunks, param_dtype, grad_dtype,
                      a, SgdArgs{}, sc, step, workspace, workspace_bytes);
}

void sgd_multi(void* stream, const OptimizerSegment* segs, int64_t num_segs, int64_t total_chunks,
               DType param_dtype, DType grad_dtype, const SgdConfig& hp, const StepScalars& sc,
               void* workspace, size_t workspace_bytes) {
  launch_update<false>("sgd_multi", stream, segs, num_segs, total_chunks, param_dtype, grad_dtype,
                       AdamWArgs{}, SgdArgs{hp.lr, hp.momentum, hp.nesterov}, sc,
                       static_cast<uint64_t>(hp.step), workspace, workspace_bytes);
}

size_t unscale_check_workspace_bytes(int64_t num_segs, int64_t total_chunks) {
  if (num_segs == 0) return 0;
  return static_cast<size_t>(num_segs + 1) * sizeof(int64_t) +  // prefix
         static_cast<size_t>(total_chunks) * sizeof(double) +   // chunk partials
         static_cast<size_t>(num_segs) * sizeof(double);        // segment sums
}

void unscale_check(void* stream, const GradSegment* segs, int64_t num_segs, int64_t total_chunks,
                   DType grad_dtype, const float* inv_loss_scale, float* norms_out, int num_out,
                   float* found_inf, void* workspace, size_t workspace_bytes) {
  ZT_CHECK(total_chunks <= INT32_MAX && num_segs <= INT32_MAX, "unscale_check: ", num_segs,
           " segments, ", total_chunks, " chunks");
  ZT_CHECK(workspace_bytes >= unscale_check_workspace_bytes(num_segs, total_chunks) &&
               (num_segs == 0 || workspace != nullptr),
           "unscale_check: workspace of ", workspace_bytes, " bytes, need ",
           unscale_check_workspace_bytes(num_segs, total_chunks));
  cuda_ops::detail::LaunchScope scope(stream);
  auto* prefix = static_cast<int64_t*>(workspace);
  double* partial = num_segs ? reinterpret_cast<double*>(prefix + num_segs + 1) : nullptr;
  double* seg_sum = num_segs ? partial + total_chunks : nullptr;
  if (num_segs > 0) {
    chunk_prefix_kernel<<<1, kBlock, 0, scope.stream()>>>(segs, num_segs, prefix);
    ZT_CUDA_CHECK(cudaGetLastError());
    if (total_chunks > 0) {
      const unsigned grid = static_cast<unsigned>(total_chunks);
      switch (grad_dtype) {
        case DType::kF32:
          chunk_sum_squares_kernel<float><<<grid, kBlock, 0, scope.stream()>>>(
              segs, prefix, num_segs, inv_loss_scale, partial);
          break;
        case DType::kF16:
          chunk_sum_squares_kernel<Half><<<grid, kBlock, 0, scope.stream()>>>(
              segs, prefix, num_segs, inv_loss_scale, partial);
          break;
        case DType::kBF16:
          chunk_sum_squares_kernel<BFloat16><<<grid, kBlock, 0, scope.stream()>>>(
              segs, prefix, num_segs, inv_loss_scale, partial);
          break;
        case DType::kI32:
          ZT_CHECK(false, "unscale_check: unsupported gradient dtype ", dtype_name(grad_dtype));
      }
      ZT_CUDA_CHECK(cudaGetLastError());
    }
    segment_sum_kernel<<<static_cast<unsigned>(num_segs), kBlock, 0, scope.stream()>>>(
        prefix, partial, seg_sum);
    ZT_CUDA_CHECK(cudaGetLastError());
  }
  norms_kernel<<<1, kBlock, 0, scope.stream()>>>(segs, seg_sum, num_segs, norms_out, num_out,
                                                 found_inf);
  ZT_CUDA_CHECK(cudaGetLastError());
}

void loss_scale_update(void* stream, LossScaleState* state, const float* found_inf,
                       const LossScaleConfig& c) {
  cuda_ops::detail::LaunchScope scope(stream);
  loss_scale_kernel<<<1, 1, 0, scope.stream()>>>(state, found_inf, c);
  ZT_CUDA_CHECK(cudaGetLastError());
}

void clip_factor(void* stream, const float* parts, const float* include, int ranks, int row, float max_norm,
                 double* out, float* clip, float* found_inf) {
  cuda_ops::detail::LaunchScope scope(stream);
  clip_factor_kernel<<<1, 1, 0, scope.stream()>>>(parts, include, ranks, row, max_norm, out, clip, found_inf);
  ZT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zt::optim::cuda_kernels
