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
#include "kernels/layernorm_order.h"

namespace zt::cpu_kernels {

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
// dweight/dbias: fp32 sums in the order of kernels/layernorm_order.h (the CUDA kernel's), each
// block of rows summed by one work item, so the bits do not depend on the thread count.
template <typename T, typename W>
void layernorm_backward_typed(void* din_v, float* dweight, float* dbias, const void* dout_v, const void* in_v,
                              const void* weight_v, const float* mean, const float* rstd, int64_t N, int64_t C) {
  auto* din = static_cast<T*>(din_v);
  const auto* dout = static_cast<const T*>(dout_v);
  const auto* in = static_cast<const T*>(in_v);
  const auto* weight = static_cast<const W*>(weight_v);
  const zt::detail::LayernormBackwardOrder order = zt::detail::layernorm_backward_order(N, C);
  const int warps = order.warps;
  // partial[blk] = {dweight partial [C], dbias partial [C]}
  std::vector<float> partial(static_cast<size_t>(order.blocks * 2 * C));
  float* partial_data = partial.data();
  parallel_for(order.blocks, 1, [=](int64_t blk0, int64_t blk1) {
    std::vector<float> sums(static_cast<size_t>(warps * 2 * C));  // [warp] = {dweight [C], dbias [C]}
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      std::fill(sums.begin(), sums.end(), 0.0f);
      const int64_t row_begin = blk * order.rows_per_block;
      const int64_t row_end = std::min(N, row_begin + order.rows_per_block);
      for (int64_t r = row_begin; r < row_end; ++r) {
        float* sw = sums.data() + ((r - row_begin) % warps) * 2 * C;
        float* sb = sw + C;
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
          // The product rounded to fp32, then added (no FMA: the CUDA kernel's __fmul_rn).
          const float term = norm * dyi;
          sw[i] += term;
          sb[i] += dyi;
        }
      }
      // The block's partial: the warps' sums left to right.
      float* p = partial_data + blk * 2 * C;
      std::copy(sums.begin(), sums.begin() + 2 * C, p);
      for (int w = 1; w < warps; ++w) {
        const float* sw = sums.data() + w * 2 * C;
        for (int64_t i = 0; i < 2 * C; ++i) p[i] += sw[i];
      }
    }
  });
  if (order.blocks == 1) {
    for (int64_t i = 0; i < C; ++i) {
      dweight[i] += partial_data[i];
      dbias[i] += partial_data[C + i];
    }
    return;
  }
  // Stripes of partials, then a fixed tree over the stripes (the CUDA finish kernel's order).
  constexpr int kStripes = zt::detail::LayernormBackwardOrder::kStripes;
  const int64_t blocks = order.blocks;
  parallel_for(2 * C, 64, [=](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float stripe[kStripes];
      for (int st = 0; st < kStripes; ++st) {
        float acc = 0.0f;
        for (int64_t k = st; k < blocks; k += kStripes) acc += partial_data[k * 2 * C + c];
        stripe[st] = acc;
      }
      for (int h = kStripes / 2; h > 0; h /= 2)
        for (int st = 0; st < h; ++st) stripe[st] += stripe[st + h];
      float* out = c < C ? dweight + c : dbias + (c - C);
      *out += stripe[0];
    }
  });
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
