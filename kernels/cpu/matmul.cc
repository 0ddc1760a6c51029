// CPU kernels for matmul with bias: matrix products through detail::sgemm (OpenBLAS over fixed
// output tiles, in parallel), the bias gradient as fixed-order column sums; the bias alone
// (bias_forward/backward, for row-parallel layers that add it after a reduction) shares them.
// With TF32 (MathMode) the GEMM inputs are rounded copies: the rounding point tensor cores have.
// 16-bit inputs are widened exactly to fp32 copies, multiplied with fp32 accumulation, and a
// 16-bit output is rounded once from the fp32 result: cuBLASLt's points with CUBLAS_COMPUTE_32F.
#include <algorithm>
#include <type_traits>
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

// A GEMM operand as the product reads it: the fp32 original, a copy rounded to TF32 (tf32 and
// fp32 input), or a 16-bit input widened to fp32 (exact).
class GemmInput {
 public:
  GemmInput(const void* x, DType type, int64_t n, bool tf32) : data_(static_cast<const float*>(x)) {
    if (n == 0 || (type == DType::kF32 && !tf32)) return;
    rounded_.resize(static_cast<size_t>(n));
    float* dst = rounded_.data();
    if (type != DType::kF32) {
      cast(dst, DType::kF32, x, type, n);
    } else {
      const float* src = data_;
      parallel_for(n, detail::kElemGrain, [=](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) dst[i] = round_to_tf32(src[i]);
      });
    }
    data_ = dst;
  }
  const float* get() const { return data_; }

 private:
  const float* data_;
  std::vector<float> rounded_;
};

// An fp32 GEMM result bound for `dst` of `type`: dst itself when fp32, else a scratch (holding
// dst's widened values when `load`) rounded into dst by store().
class GemmOutput {
 public:
  GemmOutput(void* dst, DType type, int64_t n, bool load) : dst_(dst), type_(type) {
    if (type == DType::kF32) {
      data_ = static_cast<float*>(dst);
      return;
    }
    wide_.resize(static_cast<size_t>(n));
    data_ = wide_.data();
    if (load) cast(data_, DType::kF32, dst, type, n);
  }
  float* get() const { return data_; }
  void store(int64_t n) const {
    if (type_ != DType::kF32) cast(dst_, type_, data_, DType::kF32, n);
  }

 private:
  void* dst_;
  DType type_;
  float* data_ = nullptr;
  std::vector<float> wide_;
};

}  // namespace

void matmul_forward(void* out, const void* in, const void* weight, const void* bias, MatmulTypes t,
                    int64_t N, int64_t C, int64_t OC, bool tf32) {
  const GemmInput a(in, t.in, N * C, tf32), w(weight, t.in, OC * C, tf32);
  const GemmInput b(bias, t.bias, bias != nullptr ? OC : 0, false);
  const GemmOutput o(out, t.out, N * OC, false);
  // out[N,OC] = in[N,C] @ weight[OC,C]^T + bias
  detail::sgemm(false, true, N, OC, C, 1.0f, a.get(), C, w.get(), C, 0.0f, o.get(), OC, b.get());
  o.store(N * OC);
}

void matmul_backward(void* din, float* dweight, float* dbias, const void* dout, const void* in,
                     const void* weight, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool overwrite_din,
                     bool tf32) {
  const bool products = din != nullptr || dweight != nullptr;
  const GemmInput g(dout, t.in, products ? N * OC : 0, tf32);
  // din[N,C] += dout[N,OC] @ weight[OC,C] (= with overwrite_din)
  if (din != nullptr) {
    const GemmInput w(weight, t.in, OC * C, tf32);
    const GemmOutput d(din, t.out, N * C, !overwrite_din);
    detail::sgemm(false, false, N, C, OC, 1.0f, g.get(), OC, w.get(), C, overwrite_din ? 0.0f : 1.0f, d.get(), C);
    d.store(N * C);
  }
  // dweight[OC,C] += dout^T[OC,N] @ in[N,C]
  if (dweight != nullptr) {
    const GemmInput a(in, t.in, N * C, tf32);
    detail::sgemm(true, false, OC, C, N, 1.0f, g.get(), OC, a.get(), C, 1.0f, dweight, C);
  }
  // The bias gradient is a sum, not a product: it reads dout unrounded (widened when 16-bit).
  if (dbias != nullptr) {
    const GemmInput d(dout, t.in, t.in == DType::kF32 ? 0 : N * OC, false);
    add_column_sums(dbias, t.in == DType::kF32 ? static_cast<const float*>(dout) : d.get(), N, OC);
  }
}

// f32: matmul_forward then gelu_forward, the unfused kernels' bits. 16-bit: both outputs rounded
// from the one fp32 sum (cuBLASLt's GELU_AUX_BIAS epilogue).
void matmul_gelu_forward(void* out_gelu, void* pre_gelu, const void* in, const void* weight, const void* bias,
                         MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32) {
  const int64_t n = N * OC;
  if (t.out == DType::kF32) {
    matmul_forward(pre_gelu, in, weight, bias, t, N, C, OC, tf32);
    gelu_forward(static_cast<float*>(out_gelu), static_cast<const float*>(pre_gelu), n);
    return;
  }
  std::vector<float> acc(static_cast<size_t>(n));
  MatmulTypes wide = t;
  wide.out = DType::kF32;
  matmul_forward(acc.data(), in, weight, bias, wide, N, C, OC, tf32);
  cast(pre_gelu, t.out, acc.data(), DType::kF32, n);
  gelu_forward(acc.data(), acc.data(), n);
  cast(out_gelu, t.out, acc.data(), DType::kF32, n);
}

// dgrad = dout @ weight accumulated onto zeros, dpre = 0 + gelu'(pre) * dgrad (gelu_backward onto
// a zeroed buffer), dbias += the stored dpre's column sums (bias_backward's bits): for f32 the
// unfused ops' sequence, bit for bit.
void matmul_backward_dgelu(void* dpre, float* dbias, const void* dout, const void* weight, const void* pre_gelu,
                           MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32) {
  const int64_t n = N * C;
  MatmulTypes wide = t;
  wide.out = DType::kF32;
  std::vector<float> dgrad(static_cast<size_t>(n), 0.0f);
  matmul_backward(dgrad.data(), nullptr, nullptr, dout, nullptr, weight, wide, N, C, OC, false, tf32);
  const GemmInput pre(pre_gelu, t.out, n, false);
  const GemmOutput d(dpre, t.out, n, false);
  fill(d.get(), n, 0.0f);
  gelu_backward(d.get(), pre.get(), dgrad.data(), n);
  d.store(n);
  if (dbias != nullptr) bias_backward(dbias, dpre, t.out, N, C);
}

void bias_forward(void* x, const void* bias, DType act, DType wt, int64_t N, int64_t C) {
  zt::detail::dispatch_norm_types("bias_forward", act, wt, [=](auto* xs, auto* bs) {
    using S = std::remove_pointer_t<decltype(xs)>;
    using W = std::remove_pointer_t<decltype(bs)>;
    S* xt = static_cast<S*>(x);
    const W* b = static_cast<const W*>(bias);
    parallel_for(N, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        S* row = xt + r * C;
        for (int64_t c = 0; c < C; ++c) row[c] = from_float<S>(to_float(row[c]) + to_float(b[c]));
      }
    });
  });
}

// The same column sums as matmul_backward's dbias, over the same (widened) dout: the bits must
// match (ops.h).
void bias_backward(float* dbias, const void* dout, DType act, int64_t N, int64_t C) {
  const GemmInput d(dout, act, N * C, false);
  add_column_sums(dbias, d.get(), N, C);
}

}  // namespace zt::cpu_kernels
