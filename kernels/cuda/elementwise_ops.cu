// CUDA elementwise ops (fill, scale, add, accumulate, GELU, ReLU), the GPT-2 encoder's forward
// (optionally over one vocabulary shard; its backward is encoder_backward.cu) and the position
// embedding alone, the optimizer updates, sum_squares
// and reduce_slices. Per-element math comes from kernels/elementwise.h, shared with the CPU
// loops; the streaming maps move 128 bits per access where their pointers are aligned. fill, add,
// GELU, ReLU, the encoder and the position embedding are templated on the activations' storage
// type (float, Half, BFloat16):
// widened with to_float, computed as in fp32, rounded once with from_float (core/dtype.h).
// Grid-stride loops throughout; every reduction has a fixed order (run-to-run deterministic,
// and independent of the GPU model).
#include <cub/block/block_reduce.cuh>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/kernel_utils.h"
#include "kernels/elementwise.h"
#include "kernels/storage_types.h"

namespace zt::cuda_ops {
namespace {

using detail::grid_for;
using detail::kElementwiseBlock;

#define ZT_GRID_STRIDE_LOOP(i, n)                                                             \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);      \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---- elementwise maps with 128-bit accesses ------------------------------------------------
// An Op defines one element (operator()(i)) and one pack of kN elements starting at i (pack(i)),
// both with the same per-element expression, so the bits never depend on the path. The vector
// path runs when every pointer the op streams is 16-byte aligned (launch_map's `vec`): packs
// first, then the n % kN tail one element at a time; otherwise every element one at a time.
template <typename Op>
__global__ void map_kernel(Op op, int64_t n, bool vec) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vec) {
    const int64_t packs = n / Op::kN;
    for (int64_t p = tid; p < packs; p += stride) op.pack(p * Op::kN);
    done = packs * Op::kN;
  }
  for (int64_t i = done + tid; i < n; i += stride) op(i);
}

template <typename Op>
void launch_map(cudaStream_t stream, const Op& op, int64_t n, std::initializer_list<const void*> streamed) {
  bool vec = true;
  for (const void* p : streamed) vec = vec && detail::is_aligned16(p);
  map_kernel<<<grid_for(vec ? (n + Op::kN - 1) / Op::kN : n), kElementwiseBlock, 0, stream>>>(op, n, vec);
  ZT_CUDA_CHECK(cudaGetLastError());
}

using FPack = detail::Pack<float>;
using detail::load_pack;
using detail::store_pack;

using zt::detail::with_storage_type;  // kernels/storage_types.h

// value: already rounded to T on the host (once).
template <typename T>
struct FillOp {
  T* x;
  T value;
  static constexpr int kN = detail::Pack<T>::kN;
  __device__ void operator()(int64_t i) const { x[i] = value; }
  __device__ void pack(int64_t i) const {
    detail::Pack<T> v;
#pragma unroll
    for (int k = 0; k < kN; ++k) v.v[k] = value;
    store_pack(x + i, v);
  }
};

struct ScaleOp {
  float* x;
  float alpha;
  static constexpr int kN = FPack::kN;
  __device__ void operator()(int64_t i) const { x[i] *= alpha; }
  __device__ void pack(int64_t i) const {
    FPack v = load_pack(x + i);
#pragma unroll
    for (int k = 0; k < kN; ++k) v.v[k] *= alpha;
    store_pack(x + i, v);
  }
};

// out may alias a and/or b (each element is read before it is written): no __restrict__.
template <typename T>
struct AddOp {
  T* out;
  const T* a;
  const T* b;
  static constexpr int kN = detail::Pack<T>::kN;
  __device__ static T elem(T x, T y) { return from_float<T>(to_float(x) + to_float(y)); }
  __device__ void operator()(int64_t i) const { out[i] = elem(a[i], b[i]); }
  __device__ void pack(int64_t i) const {
    const detail::Pack<T> va = load_pack(a + i), vb = load_pack(b + i);
    detail::Pack<T> o;
#pragma unroll
    for (int k = 0; k < kN; ++k) o.v[k] = elem(va.v[k], vb.v[k]);
    store_pack(out + i, o);
  }
};

// dst += src through fp32, rounded once to the storage type (the conversions of core/dtype.h,
// bit-identical to the CPU loop). 8 elements per pack in 16 bits.
template <typename T>
struct AccumulateOp {
  T* dst;
  const T* src;
  static constexpr int kN = detail::Pack<T>::kN;
  __device__ void operator()(int64_t i) const { dst[i] = from_float<T>(to_float(dst[i]) + to_float(src[i])); }
  __device__ void pack(int64_t i) const {
    detail::Pack<T> d = load_pack(dst + i);
    const detail::Pack<T> v = load_pack(src + i);
#pragma unroll
    for (int k = 0; k < kN; ++k) d.v[k] = from_float<T>(to_float(d.v[k]) + to_float(v.v[k]));
    store_pack(dst + i, d);
  }
};

// out may alias in.
template <typename T>
struct GeluForwardOp {
  T* out;
  const T* in;
  static constexpr int kN = detail::Pack<T>::kN;
  __device__ static T elem(T x) { return from_float<T>(gelu_forward_elem(to_float(x))); }
  __device__ void operator()(int64_t i) const { out[i] = elem(in[i]); }
  __device__ void pack(int64_t i) const {
    const detail::Pack<T> x = load_pack(in + i);
    detail::Pack<T> y;
#pragma unroll
    for (int k = 0; k < kN; ++k) y.v[k] = elem(x.v[k]);
    store_pack(out + i, y);
  }
};

// din += gelu'(in) * dout in fp32; a 16-bit din is read, added to and rounded once.
template <typename T>
struct GeluBackwardOp {
  T* din;
  const T* in;
  const T* dout;
  static constexpr int kN = detail::Pack<T>::kN;
  __device__ static T elem(T d, T x, T g) {
    return from_float<T>(to_float(d) + gelu_grad_elem(to_float(x)) * to_float(g));
  }
  __device__ void operator()(int64_t i) const { din[i] = elem(din[i], in[i], dout[i]); }
  __device__ void pack(int64_t i) const {
    detail::Pack<T> d = load_pack(din + i);
    const detail::Pack<T> x = load_pack(in + i), g = load_pack(dout + i);
#pragma unroll
    for (int k = 0; k < kN; ++k) d.v[k] = elem(d.v[k], x.v[k], g.v[k]);
    store_pack(din + i, d);
  }
};

// out may alias in. ReLU of a widened value is that value or 0: exact in every dtype.
template <typename T>
struct ReluForwardOp {
  T* out;
  const T* in;
  static constexpr int kN = detail::Pack<T>::kN;
  __device__ static T elem(T x) { return from_float<T>(relu_forward_elem(to_float(x))); }
  __device__ void operator()(int64_t i) const { out[i] = elem(in[i]); }
  __device__ void pack(int64_t i) const {
    const detail::Pack<T> x = load_pack(in + i);
    detail::Pack<T> y;
#pragma unroll
    for (int k = 0; k < kN; ++k) y.v[k] = elem(x.v[k]);
    store_pack(out + i, y);
  }
};

// din += relu'(in) * dout in fp32; a 16-bit din is read, added to and rounded once.
template <typename T>
struct ReluBackwardOp {
  T* din;
  const T* in;
  const T* dout;
  static constexpr int kN = detail::Pack<T>::kN;
  __device__ static T elem(T d, T x, T g) {
    return from_float<T>(to_float(d) + relu_grad_elem(to_float(x), to_float(g)));
  }
  __device__ void operator()(int64_t i) const { din[i] = elem(din[i], in[i], dout[i]); }
  __device__ void pack(int64_t i) const {
    detail::Pack<T> d = load_pack(din + i);
    const detail::Pack<T> x = load_pack(in + i), g = load_pack(dout + i);
#pragma unroll
    for (int k = 0; k < kN; ++k) d.v[k] = elem(d.v[k], x.v[k], g.v[k]);
    store_pack(din + i, d);
  }
};

// ---- encoder ---------------------------------------------------------------------------------
// A token id outside [0, total) is a caller bug; rather than read out of bounds, its row becomes
// NaN so that the loss shows it. Tokens of other shards (outside [begin, begin + V)) contribute
// nothing but the position term. wpe may be nullptr. S: the activations' storage type.
template <typename S>
__global__ void encoder_forward_kernel(S* __restrict__ out, const int32_t* __restrict__ tokens,
                                       const S* __restrict__ wte, const S* __restrict__ wpe, int64_t B,
                                       int64_t T, int64_t C, int64_t V, int64_t begin, int64_t total) {
  const int64_t n = B * T * C;
  ZT_GRID_STRIDE_LOOP(i, n) {
    const int64_t bt = i / C;
    const int64_t c = i - bt * C;
    const int64_t t = bt % T;
    const int32_t tok = tokens[bt];
    const int64_t local = tok - begin;
    // The same expressions as the CPU kernel, so that signed zeros match too.
    const bool here = local >= 0 && local < V;
    float v;
    if (wpe != nullptr) {
      const float p = to_float(wpe[t * C + c]);
      v = here ? to_float(wte[local * C + c]) + p : 0.0f + p;
    } else {
      v = here ? to_float(wte[local * C + c]) : 0.0f;
    }
    out[i] = from_float<S>((tok >= 0 && tok < total) ? v : NAN);
  }
}

// x[r, c] += wpe[(row0 + r) % T, c] for x [R, C] of S, wpe of W (float or S): the widened sum,
// rounded to S once.
template <typename S, typename W>
__global__ void position_forward_kernel(S* __restrict__ x, const W* __restrict__ wpe, int64_t R, int64_t C,
                                        int64_t row0, int64_t T) {
  const int64_t n = R * C;
  ZT_GRID_STRIDE_LOOP(i, n) {
    const int64_t r = i / C;
    const int64_t c = i - r * C;
    x[i] = from_float<S>(to_float(x[i]) + to_float(wpe[((row0 + r) % T) * C + c]));
  }
}

// dwpe[p, c] += dx[r, c] over the rows r with (row0 + r) % T == p, in increasing r: one thread per
// (p, c), float adds of the widened dx in the CPU kernel's order (the same bits).
template <typename S>
__global__ void position_backward_kernel(float* __restrict__ dwpe, const S* __restrict__ dx, int64_t R, int64_t C,
                                         int64_t row0, int64_t T) {
  const int64_t n = T * C;
  ZT_GRID_STRIDE_LOOP(i, n) {
    const int64_t p = i / C;
    const int64_t c = i - p * C;
    const int64_t first = ((p - row0 % T) % T + T) % T;  // the first row r >= 0 at position p
    float acc = dwpe[i];
    for (int64_t r = first; r < R; r += T) acc += to_float(dx[r * C + c]);
    dwpe[i] = acc;
  }
}

// out[j] = in[0, j] (+ or max) in[1, j] ... in[S-1, j], slices in index order.
__global__ void reduce_slices_kernel(float* __restrict__ out, const float* __restrict__ in,
                                     int64_t S, int64_t n, bool take_max) {
  ZT_GRID_STRIDE_LOOP(j, n) {
    float acc = in[j];
    for (int64_t k = 1; k < S; ++k) {
      const float v = in[k * n + j];
      acc = take_max ? (v > acc ? v : acc) : acc + v;
    }
    out[j] = acc;
  }
}

// ---- optimizers ----------------------------------------------------------------------------
__global__ void adamw_kernel(float* __restrict__ params, const float* __restrict__ grads,
                             float* __restrict__ m, float* __restrict__ v, int64_t n, float lr,
                             float beta1, float beta2, float eps, float weight_decay,
                             float bias_correction1, float bias_correction2, float grad_scale) {
  ZT_GRID_STRIDE_LOOP(i, n) {
    float p = params[i];
    float mi = m[i];
    float vi = v[i];
    adamw_elem(p, grads[i], mi, vi, lr, beta1, beta2, eps, weight_decay, bias_correction1,
               bias_correction2, grad_scale);
    params[i] = p;
    m[i] = mi;
    v[i] = vi;
  }
}

__global__ void sgd_kernel(float* __restrict__ params, const float* __restrict__ grads,
                           float* __restrict__ momentum_buf, int64_t n, float lr, float momentum,
                           float weight_decay, bool nesterov, float grad_scale) {
  ZT_GRID_STRIDE_LOOP(i, n) {
    float p = params[i];
    float buf = momentum_buf[i];
    sgd_elem(p, grads[i], buf, lr, momentum, weight_decay, nesterov, grad_scale);
    params[i] = p;
    momentum_buf[i] = buf;
  }
}

// ---- sum_squares -------------------------------------------------------------------------------
// Two passes in double: a grid whose size depends only on n writes one partial per block into the
// workspace, then one block adds the partials. The grid is not sized from the SM count (as
// cub::DeviceReduce does), so the order, and the bits, are the same on every GPU.
constexpr int kSumSquaresThreads = 256;
constexpr int64_t kSumSquaresPerBlock = int64_t{kSumSquaresThreads} * 16;
constexpr int64_t kSumSquaresMaxPartials = 1024;

int64_t sum_squares_partials(int64_t n) {
  return std::clamp<int64_t>((n + kSumSquaresPerBlock - 1) / kSumSquaresPerBlock, 1,
                             kSumSquaresMaxPartials);
}

// kSquare: sum of squares (gradient norms); else the plain sum (the step's losses, ops::sum).
template <bool kSquare>
__global__ void sum_squares_partial_kernel(double* __restrict__ partials,
                                           const float* __restrict__ x, int64_t n) {
  using BlockReduce = cub::BlockReduce<double, kSumSquaresThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  double acc = 0.0;
  ZT_GRID_STRIDE_LOOP(i, n) {
    const double xi = x[i];
    acc += kSquare ? xi * xi : xi;
  }
  const double total = BlockReduce(temp).Sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void sum_squares_final_kernel(float* __restrict__ out,
                                         const double* __restrict__ partials, int64_t count) {
  using BlockReduce = cub::BlockReduce<double, kSumSquaresThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kSumSquaresThreads) acc += partials[i];
  const double total = BlockReduce(temp).Sum(acc);
  if (threadIdx.x == 0) out[0] = static_cast<float>(total);
}

}  // namespace

// ---- elementwise / utility ---------------------------------------------------------------------
void fill(void* stream, void* x, DType dtype, int64_t n, float value) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "fill", [&](auto tag) {
    using T = decltype(tag);
    launch_map(scope.stream(), FillOp<T>{static_cast<T*>(x), from_float<T>(value)}, n, {x});
  });
}

void scale(void* stream, float* x, int64_t n, float alpha) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  launch_map(scope.stream(), ScaleOp{x, alpha}, n, {x});
}

void add(void* stream, void* out, const void* a, const void* b, DType dtype, int64_t n) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "add", [&](auto tag) {
    using T = decltype(tag);
    launch_map(scope.stream(), AddOp<T>{static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b)},
               n, {out, a, b});
  });
}

void accumulate(void* stream, void* dst, const void* src, DType dtype, int64_t n) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  switch (dtype) {
    case DType::kF32:
      return launch_map(scope.stream(), AccumulateOp<float>{static_cast<float*>(dst), static_cast<const float*>(src)},
                        n, {dst, src});
    case DType::kF16:
      return launch_map(scope.stream(), AccumulateOp<Half>{static_cast<Half*>(dst), static_cast<const Half*>(src)}, n,
                        {dst, src});
    case DType::kBF16:
      return launch_map(scope.stream(),
                        AccumulateOp<BFloat16>{static_cast<BFloat16*>(dst), static_cast<const BFloat16*>(src)}, n,
                        {dst, src});
    default:
      break;
  }
  ZT_CHECK(false, "accumulate: unsupported dtype ", dtype_name(dtype));
}

// ---- encoder -------------------------------------------------------------------------------------
void encoder_forward(void* stream, void* out, const int32_t* tokens, const void* wte, const void* wpe,
                     DType dtype, int64_t B, int64_t T, int64_t C, int64_t V, int64_t v_begin,
                     int64_t v_total) {
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "encoder_forward", [&](auto tag) {
    using S = decltype(tag);
    encoder_forward_kernel<S><<<grid_for(B * T * C), kElementwiseBlock, 0, scope.stream()>>>(
        static_cast<S*>(out), tokens, static_cast<const S*>(wte), static_cast<const S*>(wpe), B, T, C, V, v_begin,
        v_total);
  });
  ZT_CUDA_CHECK(cudaGetLastError());
}

void position_forward(void* stream, void* x, const void* wpe, DType act, DType wt, int64_t R, int64_t C,
                      int64_t row0, int64_t T) {
  detail::LaunchScope scope(stream);
  zt::detail::dispatch_norm_types("position_forward", act, wt, [&](auto* s, auto* w) {
    using S = std::remove_pointer_t<decltype(s)>;
    using W = std::remove_pointer_t<decltype(w)>;
    position_forward_kernel<S, W><<<grid_for(R * C), kElementwiseBlock, 0, scope.stream()>>>(
        static_cast<S*>(x), static_cast<const W*>(wpe), R, C, row0, T);
  });
  ZT_CUDA_CHECK(cudaGetLastError());
}

void position_backward(void* stream, float* dwpe, const void* dx, DType act, int64_t R, int64_t C, int64_t row0,
                       int64_t T) {
  detail::LaunchScope scope(stream);
  with_storage_type(act, "position_backward", [&](auto tag) {
    using S = decltype(tag);
    position_backward_kernel<S><<<grid_for(T * C), kElementwiseBlock, 0, scope.stream()>>>(
        dwpe, static_cast<const S*>(dx), R, C, row0, T);
  });
  ZT_CUDA_CHECK(cudaGetLastError());
}

void reduce_slices(void* stream, float* out, const float* in, int64_t S, int64_t n, bool take_max) {
  detail::LaunchScope scope(stream);
  reduce_slices_kernel<<<grid_for(n), kElementwiseBlock, 0, scope.stream()>>>(out, in, S, n,
                                                                              take_max);
  ZT_CUDA_CHECK(cudaGetLastError());
}

// ---- activations -----------------------------------------------------------------------------------
void gelu_forward(void* stream, void* out, const void* in, DType dtype, int64_t n) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "gelu_forward", [&](auto tag) {
    using T = decltype(tag);
    launch_map(scope.stream(), GeluForwardOp<T>{static_cast<T*>(out), static_cast<const T*>(in)}, n, {out, in});
  });
}

void gelu_backward(void* stream, void* din, const void* in, const void* dout, DType dtype, int64_t n) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "gelu_backward", [&](auto tag) {
    using T = decltype(tag);
    launch_map(scope.stream(),
               GeluBackwardOp<T>{static_cast<T*>(din), static_cast<const T*>(in), static_cast<const T*>(dout)}, n,
               {din, in, dout});
  });
}

void relu_forward(void* stream, void* out, const void* in, DType dtype, int64_t n) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "relu_forward", [&](auto tag) {
    using T = decltype(tag);
    launch_map(scope.stream(), ReluForwardOp<T>{static_cast<T*>(out), static_cast<const T*>(in)}, n, {out, in});
  });
}

void relu_backward(void* stream, void* din, const void* in, const void* dout, DType dtype, int64_t n) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  with_storage_type(dtype, "relu_backward", [&](auto tag) {
    using T = decltype(tag);
    launch_map(scope.stream(),
               ReluBackwardOp<T>{static_cast<T*>(din), static_cast<const T*>(in), static_cast<const T*>(dout)}, n,
               {din, in, dout});
  });
}

// ---- optimizers --------------------------------------------------------------------------------------
void adamw_update(void* stream, float* params, const float* grads, float* m, float* v, int64_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float bias_correction1, float bias_correction2, float grad_scale) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  adamw_kernel<<<grid_for(n), kElementwiseBlock, 0, scope.stream()>>>(
      params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay, bias_correction1,
      bias_correction2, grad_scale);
  ZT_CUDA_CHECK(cudaGetLastError());
}

void sgd_update(void* stream, float* params, const float* grads, float* momentum_buf, int64_t n,
                float lr, float momentum, float weight_decay, bool nesterov, float grad_scale) {
  if (n == 0) return;
  detail::LaunchScope scope(stream);
  sgd_kernel<<<grid_for(n), kElementwiseBlock, 0, scope.stream()>>>(
      params, grads, momentum_buf, n, lr, momentum, weight_decay, nesterov, grad_scale);
  ZT_CUDA_CHECK(cudaGetLastError());
}

// ---- reductions ------------------------------------------------------------------------------------
size_t sum_squares_workspace_bytes(int64_t n) {
  return n == 0 ? 0 : static_cast<size_t>(sum_squares_partials(n)) * sizeof(double);
}

namespace {

template <bool kSquare>
void launch_sum(const char* op, void* stream, float* out, const float* x, int64_t n, void* workspace,
                size_t workspace_bytes) {
  detail::LaunchScope scope(stream);
  if (n == 0) {
    ZT_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), scope.stream()));
    return;
  }
  const int64_t partials = sum_squares_partials(n);
  ZT_CHECK(workspace != nullptr && workspace_bytes >= sum_squares_workspace_bytes(n), op,
           ": workspace of ", workspace_bytes, " bytes, need ", sum_squares_workspace_bytes(n),
           " for n=", n);
  ZT_CHECK(reinterpret_cast<uintptr_t>(workspace) % alignof(double) == 0, op,
           ": workspace not aligned for double");
  auto* partial = static_cast<double*>(workspace);
  sum_squares_partial_kernel<kSquare><<<static_cast<unsigned>(partials), kSumSquaresThreads, 0,
                                        scope.stream()>>>(partial, x, n);
  ZT_CUDA_CHECK(cudaGetLastError());
  sum_squares_final_kernel<<<1, kSumSquaresThreads, 0, scope.stream()>>>(out, partial, partials);
  ZT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void sum_squares(void* stream, float* out, const float* x, int64_t n, void* workspace,
                 size_t workspace_bytes) {
  launch_sum<true>("sum_squares", stream, out, x, n, workspace, workspace_bytes);
}

void sum(void* stream, float* out, const float* x, int64_t n, void* workspace, size_t workspace_bytes) {
  launch_sum<false>("sum", stream, out, x, n, workspace, workspace_bytes);
}

}  // namespace zt::cuda_ops
