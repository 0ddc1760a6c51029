// CPU kernels for layernorm over the last dimension, forward and backward, and the fused residual
// add + layernorm forward: fp32 or 16-bit activations, fp32 or activation-dtype weight and bias,
// 16-bit values widened exactly, computed as fp32 is, and each 16-bit output rounded once.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"

namespace zt::cpu_kernels {

namespace {

// dweight/dbias are summed over fixed blocks of rows (partials in double), and the partials are
// added in block order: one pass over the inputs, and the same bits for any thread count.
constexpr int64_t kLayernormRowBlock = 64;

}  // namespace

namespace {

using zt::detail::dispatch_norm_types;  // kernels/storage_types.h


// One row of layernorm_forward from x (already in its storage type T, read widened to fp32): the
// statistics in double over the row, the output rounded to T once; weight and bias of W widened.
// The fused residual kernel calls it on the residual row it has just stored, which is why the two
// give the same bits.
template <typename T, typename W>
void layernorm_row(T* o, float* mean, float* rstd, const T* x, const W* weight, const W* bias, int64_t C,
                   float eps) {
  const double m = detail::lane_sum(C, [x](int64_t i) { return double{to_float(x[i])}; }) / C;
  const double var = detail::lane_sum(C,
                                      [x, m](int64_t i) {
                                        const double d = to_float(x[i]) - m;
                                        return d * d;
                                      }) /
                     C;
  const float mf = static_cast<float>(m);
  const float sf = static_cast<float>(1.0 / std::sqrt(var + eps));
  for (int64_t i = 0; i < C; ++i)
    o[i] = from_float<T>((to_float(x[i]) - mf) * sf * to_float(weight[i]) + to_float(bias[i]));
  *mean = mf;
  *rstd = sf;
}

template <typename T, typename W>
void layernorm_forward_typed(void* out, float* mean, float* rstd, const void* in, const void* weight,
                             const void* bias, int64_t N, int64_t C, float eps) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(in);
  const auto* w = static_cast<const W*>(weight);
  const auto* b = static_cast<const W*>(bias);
  parallel_for(N, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) layernorm_row(o + r * C, mean + r, rstd + r, x + r * C, w, b, C, eps);
  });
}

template <typename T, typename W>
void residual_layernorm_typed(void* residual_out, void* ln_out, float* mean, float* rstd, const void* a,
                              const void* b, const void* weight, const void* bias, int64_t N, int64_t C,
                              float eps) {
  auto* res = static_cast<T*>(residual_out);
  auto* out = static_cast<T*>(ln_out);
  const auto* pa = static_cast<const T*>(a);
  const auto* pb = static_cast<const T*>(b);
  const auto* w = static_cast<const W*>(weight);
  const auto* bi = static_cast<const W*>(bias);
  parallel_for(N, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* x = res + r * C;
      // add's expression per element (res may alias a or b: each element is read before written).
      for (int64_t i = 0; i < C; ++i) x[i] = from_float<T>(to_float(pa[r * C + i]) + to_float(pb[r * C + i]));
      layernorm_row(out + r * C, mean + r, rstd + r, static_cast<const T*>(x), w, bi, C, eps);
    }
  });
}

// din of T: read, the fp32 term added, rounded once (fp32: din += term, the same bits).
template <typename T, typename W>
void layernorm_backward_typed(void* din_v, float* dweight, float* dbias, const void* dout_v, const void* in_v,
                              const void* weight_v, const float* mean, const float* rstd, int64_t N, int64_t C) {
  auto* din = static_cast<T*>(din_v);
  const auto* dout = static_cast<const T*>(dout_v);
  const auto* in = static_cast<const T*>(in_v);
  const auto* weight = static_cast<const W*>(weight_v);
  const int64_t num_blocks = (N + kLayernormRowBlock - 1) / kLayernormRowBlock;
  // partial[blk] = {dweight partial [C], dbias partial [C]}
  std::vector<double> partial(static_cast<size_t>(num_blocks * 2 * C));
  double* partial_data = partial.data();
  parallel_for(num_blocks, 1, [=](int64_t blk0, int64_t blk1) {
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      double* pw = partial_data + blk * 2 * C;
      double* pb = pw + C;
      const int64_t row_end = std::min(N, (blk + 1) * kLayernormRowBlock);
      for (int64_t r = blk * kLayernormRowBlock; r < row_end; ++r) {
        const T* x = in + r * C;
        const T* dy = dout + r * C;
        const float m = mean[r], s = rstd[r];
        const double dnorm_mean =
            detail::lane_sum(C, [=](int64_t i) { return double{to_float(weight[i])} * to_float(dy[i]); }) / C;
        const double dnorm_norm_mean =
            detail::lane_sum(C,
                             [=](int64_t i) {
                               return double{to_float(weight[i])} * to_float(dy[i]) * ((to_float(x[i]) - m) * s);
                             }) /
            C;
        const float a = static_cast<float>(dnorm_mean);
        const float b = static_cast<float>(dnorm_norm_mean);
        T* dx = din + r * C;
        for (int64_t i = 0; i < C; ++i) {
          const float dyi = to_float(dy[i]);
          const float norm = (to_float(x[i]) - m) * s;
          dx[i] = from_float<T>(to_float(dx[i]) + (to_float(weight[i]) * dyi - a - norm * b) * s);
          pw[i] += double{norm} * dyi;
          pb[i] += dyi;
        }
      }
    }
  });
  // Block partials are combined in block order, in double; the float gradient is rounded once.
  for (int64_t blk = 1; blk < num_blocks; ++blk) {
    const double* pw = partial_data + blk * 2 * C;
    for (int64_t i = 0; i < 2 * C; ++i) partial_data[i] += pw[i];
  }
  for (int64_t i = 0; i < C; ++i) {
    dweight[i] += static_cast<float>(partial_data[i]);
    dbias[i] += static_cast<float>(partial_data[C + i]);
  }
}

}  // namespace

void layernorm_forward(void* out, float* mean, float* rstd, const void* in, DType act, const void* weight,
                       const void* bias, DType wt, int64_t N, int64_t C, float eps) {
  dispatch_norm_types("layernorm_forward", act, wt, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_pointer_t<decltype(w)>;
    layernorm_forward_typed<T, W>(out, mean, rstd, in, weight, bias, N, C, eps);
  });
}

void residual_layernorm_forward(void* residual_out, void* ln_out, float* mean, float* rstd, const void* a,
                                const void* b, DType act, const void* weight, const void* bias, DType wt,
                                int64_t N, int64_t C, float eps) {
  dispatch_norm_types("residual_layernorm_forward", act, wt, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_pointer_t<decltype(w)>;
    residual_layernorm_typed<T, W>(residual_out, ln_out, mean, rstd, a, b, weight, bias, N, C, eps);
  });
}

void layernorm_backward(void* din, float* dweight, float* dbias, const void* dout, const void* in, DType act,
                        const void* weight, DType wt, const float* mean, const float* rstd, int64_t N,
                        int64_t C) {
  dispatch_norm_types("layernorm_backward", act, wt, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_pointer_t<decltype(w)>;
    layernorm_backward_typed<T, W>(din, dweight, dbias, dout, in, weight, mean, rstd, N, C);
  });
}

}  // namespace zt::cpu_kernels
