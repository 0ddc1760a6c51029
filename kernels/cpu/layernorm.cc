// CPU kernels for layernorm over the last dimension, forward and backward, and the fused residual
// add + layernorm forward (fp32 and the 16-bit activation dtypes).
#include <cmath>
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

// One row of layernorm_forward from x (already in its storage type T, read widened to fp32): the
// statistics in double over the row, the output rounded to T once. The fused residual kernel
// calls it on the residual row it has just stored, which is why the two give the same bits.
template <typename T>
void layernorm_row(T* o, float* mean, float* rstd, const T* x, const float* weight, const float* bias,
                   int64_t C, float eps) {
  const double m = detail::lane_sum(C, [x](int64_t i) { return double{to_float(x[i])}; }) / C;
  const double var = detail::lane_sum(C,
                                      [x, m](int64_t i) {
                                        const double d = to_float(x[i]) - m;
                                        return d * d;
                                      }) /
                     C;
  const float mf = static_cast<float>(m);
  const float sf = static_cast<float>(1.0 / std::sqrt(var + eps));
  for (int64_t i = 0; i < C; ++i) o[i] = from_float<T>((to_float(x[i]) - mf) * sf * weight[i] + bias[i]);
  *mean = mf;
  *rstd = sf;
}

template <typename T>
void residual_layernorm_typed(void* residual_out, void* ln_out, float* mean, float* rstd, const void* a,
                              const void* b, const float* weight, const float* bias, int64_t N, int64_t C,
                              float eps) {
  auto* res = static_cast<T*>(residual_out);
  auto* out = static_cast<T*>(ln_out);
  const auto* pa = static_cast<const T*>(a);
  const auto* pb = static_cast<const T*>(b);
  parallel_for(N, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* x = res + r * C;
      // add's expression per element (res may alias a or b: each element is read before written).
      for (int64_t i = 0; i < C; ++i) x[i] = from_float<T>(to_float(pa[r * C + i]) + to_float(pb[r * C + i]));
      layernorm_row(out + r * C, mean + r, rstd + r, static_cast<const T*>(x), weight, bias, C, eps);
    }
  });
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* in, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps) {
  parallel_for(N, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      layernorm_row(out + r * C, mean + r, rstd + r, in + r * C, weight, bias, C, eps);
  });
}

void residual_layernorm_forward(void* residual_out, void* ln_out, float* mean, float* rstd, const void* a,
                                const void* b, DType act, const float* weight, const float* bias, int64_t N,
                                int64_t C, float eps) {
  switch (act) {
    case DType::kF32:
      return residual_layernorm_typed<float>(residual_out, ln_out, mean, rstd, a, b, weight, bias, N, C, eps);
    case DType::kF16:
      return residual_layernorm_typed<Half>(residual_out, ln_out, mean, rstd, a, b, weight, bias, N, C, eps);
    case DType::kBF16:
      return residual_layernorm_typed<BFloat16>(residual_out, ln_out, mean, rstd, a, b, weight, bias, N, C, eps);
    case DType::kI32:
      break;
  }
  ZT_CHECK(false, "residual_layernorm_forward: unsupported activation dtype ", dtype_name(act));
}

void layernorm_backward(float* din, float* dweight, float* dbias, const float* dout,
                        const float* in, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C) {
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
        const float* x = in + r * C;
        const float* dy = dout + r * C;
        const float m = mean[r], s = rstd[r];
        const double dnorm_mean =
            detail::lane_sum(C, [=](int64_t i) { return double{weight[i]} * dy[i]; }) / C;
        const double dnorm_norm_mean =
            detail::lane_sum(
                C, [=](int64_t i) { return double{weight[i]} * dy[i] * ((x[i] - m) * s); }) /
            C;
        const float a = static_cast<float>(dnorm_mean);
        const float b = static_cast<float>(dnorm_norm_mean);
        float* dx = din + r * C;
        for (int64_t i = 0; i < C; ++i) {
          const float norm = (x[i] - m) * s;
          dx[i] += (weight[i] * dy[i] - a - norm * b) * s;
          pw[i] += double{norm} * dy[i];
          pb[i] += dy[i];
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

}  // namespace zt::cpu_kernels
