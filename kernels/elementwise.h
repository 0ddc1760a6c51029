// Per-element math shared by the CPU loops (kernels/cpu/) and the CUDA kernels (kernels/cuda/):
// exp, GELU, ReLU, AdamW and SGD updates. One definition, so both backends compute the same formula
// (results may still differ in the last bits where nvcc contracts a*b+c into an FMA).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/host_device.h"

namespace zt {

// exp(x) for x <= 88 (larger x saturate at exp(88)), within 2 ulp; underflows to 0 below
// -87.3; NaN propagates. Cephes' expf polynomial, written branch-free and without float->int
// conversions so that CPU loops over it vectorise (libm's expf does not) and NaN is not UB.
ZT_HOST_DEVICE ZT_FORCEINLINE float exp_elem(float x) {
  constexpr float kMax = 88.0f, kMin = -87.33654475f;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // Two unconditional selects (not nested), so compilers if-convert them into vector blends.
  float xc = x > kMax ? kMax : x;
  xc = xc < kMin ? kMin : xc;
  const float shifted = xc * kLog2e + kRound;  // low mantissa bits hold n = round(x log2 e)
  const float n = shifted - kRound;
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const uint32_t n_bits = float_as_bits(shifted) - float_as_bits(kRound);  // n mod 2^32
  const float two_n = bits_as_float((n_bits + 127u) << 23);
  return x < kMin ? 0.0f : y * two_n;
}

// sqrt(2/pi), the GELU tanh-approximation constant (GPT-2, llm.c).
constexpr float kGeluScaling = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). Evaluated as
// x * sigmoid(2u) (the same function: 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u))), which has no
// cancellation where tanh(u) -> -1 and vectorises through exp_elem.
ZT_HOST_DEVICE ZT_FORCEINLINE float gelu_forward_elem(float x) {
  const float u = kGeluScaling * (x + kGeluCubic * x * x * x);
  return x / (1.0f + exp_elem(-2.0f * u));
}

// d gelu(x) / dx = 0.5 (1 + tanh u) + 0.5 x sech^2(u) u'(x), with 0.5 (1 + tanh u) = s and
// sech^2(u) = 4 s (1 - s), s = sigmoid(2u), 1 - s = e s, e = exp(-2u).
ZT_HOST_DEVICE ZT_FORCEINLINE float gelu_grad_elem(float x) {
  const float u = kGeluScaling * (x + kGeluCubic * x * x * x);
  const float e = exp_elem(-2.0f * u);
  const float s = 1.0f / (1.0f + e);
  const float du = kGeluScaling * (1.0f + 3.0f * kGeluCubic * x * x);
  return s + 2.0f * x * s * (e * s) * du;
}

// NaN propagates (a NaN activation should surface, not vanish into a 0).
ZT_HOST_DEVICE ZT_FORCEINLINE float relu_forward_elem(float x) { return x < 0.0f ? 0.0f : x; }
ZT_HOST_DEVICE ZT_FORCEINLINE float relu_grad_elem(float x, float dout) {
  return x > 0.0f ? dout : 0.0f;
}

// a * b rounded to float before any addition uses it. The optimizer updates below promise the
// host's bits on the device (optimizer offload runs the host loop, built with -ffp-contract=off,
// in place of the CUDA kernel: optimizers/optimizers.h), but nvcc contracts a * b + c into one FMA
// by default (--fmad=true); __fmul_rn is never contracted. Divisions and sqrtf are IEEE-rounded
// on both (nvcc's default -prec-div/-prec-sqrt), so with every product rounded the bits agree.
ZT_HOST_DEVICE ZT_FORCEINLINE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// One AdamW step for one element, as llm.c: p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p), the
// decoupled decay of torch.optim.AdamW. bias_correction{1,2} = 1 - beta^step. Every product that
// is added goes through mul_rn: the host's bits on the GPU too.
ZT_HOST_DEVICE ZT_FORCEINLINE void adamw_elem(float& p, float g, float& m, float& v, float lr,
                                              float beta1, float beta2, float eps,
                                              float weight_decay, float bias_correction1,
                                              float bias_correction2, float grad_scale) {
  g *= grad_scale;
  m = mul_rn(beta1, m) + mul_rn(1.0f - beta1, g);
  v = mul_rn(beta2, v) + mul_rn((1.0f - beta2) * g, g);
  const float m_hat = m / bias_correction1;
  const float v_hat = v / bias_correction2;
  p -= mul_rn(lr, m_hat / (sqrtf(v_hat) + eps) + mul_rn(weight_decay, p));
}

// One SGD step for one element: g' = g*grad_scale + wd p; buf = momentum buf + g';
// p -= lr (nesterov ? g' + momentum buf : buf). Products through mul_rn, as adamw_elem.
ZT_HOST_DEVICE ZT_FORCEINLINE void sgd_elem(float& p, float g, float& buf, float lr, float momentum,
                                            float weight_decay, bool nesterov, float grad_scale) {
  const float gp = mul_rn(g, grad_scale) + mul_rn(weight_decay, p);
  buf = mul_rn(momentum, buf) + gp;
  p -= mul_rn(lr, nesterov ? gp + mul_rn(momentum, buf) : buf);
}

// 1 - beta^step in double, rounded once to float. beta^step by binary exponentiation (only
// double multiplications, each correctly rounded on the host and on CUDA, never contracted into
// an FMA), so the host and a kernel that reads the step from device memory (the optimizers' update
// counter, optim::StepScalars::update_count) compute the same bits. The float result equals the
// earlier float(1 - std::pow(double(beta), step)) for beta 0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999
// and 0.9999 at every step up to 2,000,000 (test_optimizers checks the common betas).
ZT_HOST_DEVICE ZT_FORCEINLINE float adamw_bias_correction(float beta, uint64_t step) {
  double power = 1.0, base = static_cast<double>(beta);
  for (; step != 0; step >>= 1) {
    if ((step & 1u) != 0) power *= base;
    base *= base;
  }
  return static_cast<float>(1.0 - power);
}

}  // namespace zt
