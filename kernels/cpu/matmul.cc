// CPU kernels for matmul with bias: matrix products through detail::sgemm (OpenBLAS over fixed
// output tiles, in parallel), the bias gradient as fixed-order column sums; the bias alone
// (bias_forward/backward, for row-parallel layers that add it after a reduction) shares them.
// With TF32 (MathMode) the GEMM inputs are rounded copies: the rounding point tensor cores have.
#include <algorithm>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"

namespace zt::cpu_kernels {

namespace {

// dbias columns per work item; each column sums all rows in order (double), thread-count free.
constexpr int64_t kBiasColumnBlock = 64;

// dst[c] += sum_r src[r, c] for src [N, C].
void add_column_sums(float* dst, const float* src, int64_t N, int64_t C) {
  const int64_t num_blocks = (C + kBiasColumnBlock - 1) / kBiasColumnBlock;
  parallel_for(num_blocks, 1, [=](int64_t blk0, int64_t blk1) {
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      const int64_t c0 = blk * kBiasColumnBlock;
      const int64_t width = std::min(kBiasColumnBlock, C - c0);
      double acc[kBiasColumnBlock] = {};
      for (int64_t r = 0; r < N; ++r) {
        const float* row = src + r * C + c0;
        for (int64_t j = 0; j < width; ++j) acc[j] += row[j];
      }
      for (int64_t j = 0; j < width; ++j) dst[c0 + j] += static_cast<float>(acc[j]);
    }
  });
}

// A GEMM operand as the product reads it: the original, or (tf32) a copy rounded to TF32.
class GemmInput {
 public:
  GemmInput(const float* x, int64_t n, bool tf32) : data_(x) {
    if (!tf32 || n == 0) return;
    rounded_.resize(static_cast<size_t>(n));
    float* dst = rounded_.data();
    parallel_for(n, detail::kElemGrain, [=](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) dst[i] = round_to_tf32(x[i]);
    });
    data_ = dst;
  }
  const float* get() const { return data_; }

 private:
  const float* data_;
  std::vector<float> rounded_;
};

}  // namespace

void matmul_forward(float* out, const float* in, const float* weight, const float* bias, int64_t N,
                    int64_t C, int64_t OC, bool tf32) {
  const GemmInput a(in, N * C, tf32), w(weight, OC * C, tf32);
  // out[N,OC] = in[N,C] @ weight[OC,C]^T + bias
  detail::sgemm(false, true, N, OC, C, 1.0f, a.get(), C, w.get(), C, 0.0f, out, OC, bias);
}

void matmul_backward(float* din, float* dweight, float* dbias, const float* dout, const float* in,
                     const float* weight, int64_t N, int64_t C, int64_t OC, bool tf32, bool overwrite_din) {
  const bool products = din != nullptr || dweight != nullptr;
  const GemmInput g(dout, products ? N * OC : 0, tf32);
  // din[N,C] += dout[N,OC] @ weight[OC,C] (= with overwrite_din)
  if (din != nullptr) {
    const GemmInput w(weight, OC * C, tf32);
    detail::sgemm(false, false, N, C, OC, 1.0f, g.get(), OC, w.get(), C, overwrite_din ? 0.0f : 1.0f, din, C);
  }
  // dweight[OC,C] += dout^T[OC,N] @ in[N,C]
  if (dweight != nullptr) {
    const GemmInput a(in, N * C, tf32);
    detail::sgemm(true, false, OC, C, N, 1.0f, g.get(), OC, a.get(), C, 1.0f, dweight, C);
  }
  // The bias gradient is a sum, not a product: it reads dout unrounded.
  if (dbias != nullptr) add_column_sums(dbias, dout, N, OC);
}

void bias_forward(float* x, const float* bias, int64_t N, int64_t C) {
  parallel_for(N, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = x + r * C;
      for (int64_t c = 0; c < C; ++c) row[c] += bias[c];
    }
  });
}

// The same column sums as matmul_backward's dbias: the bits must match (ops.h).
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t C) {
  add_column_sums(dbias, dout, N, C);
}

}  // namespace zt::cpu_kernels
