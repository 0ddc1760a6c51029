// The tolerance policy of tests/README.md as functions: per-element error bounds, derived from the
// output type and the reduction length, for results of vendor libraries (cuBLAS, cuBLASLt, cuDNN)
// against float64 references, and the check that applies them. ZeroTrain's own kernels keep their
// bitwise and tight checks; these bounds hold for any implementation with the stated rounding points.
//
// Model (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3): a dot product of n terms
// summed in a precision with unit roundoff u, in any order, is within gamma_n(u) * sum |a_k b_k| of
// the exact one. 16-bit products are exact in fp32; the library accumulates in fp32 but, on tensor
// cores, truncates (Fasi, Higham, Mikaitis, Pranesh 2021), so u_acc = 2^-23 rather than 2^-24. On
// top of that the stored result is rounded to the output type, and the library may round once more
// at a point of its own (the product before the bias or the beta*C term, the GELU_AUX pre-activation,
// softmax probabilities, dS): kVendorRoundings roundings of the output type, each relative to the
// magnitude that passed through it (sum |a_k b_k| + |bias| + |C|, which bounds every partial result).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <vector>

#include "core/dtype.h"

namespace zt::tolerance {

using DVec = std::vector<double>;

// Unit roundoff of a stored type: half the spacing of [1, 2). A value rounded once to t is within
// u * |x| of x (normal range).
constexpr double unit_roundoff(DType t) {
  return t == DType::kBF16 ? 0x1p-8 : t == DType::kF16 ? 0x1p-11 : 0x1p-24;
}
// Half the subnormal spacing: below the normal range the rounding error is absolute, at most this.
constexpr double underflow(DType t) {
  return t == DType::kBF16 ? 0x1p-134 : t == DType::kF16 ? 0x1p-25 : 0x1p-150;
}
// fp32 accumulation as tensor cores do it (truncating): twice round-to-nearest's 2^-24.
constexpr double kAccRoundoff = 0x1p-23;
// Roundings of the output type a vendor result may carry: ours (the store) plus one of its own.
constexpr int kVendorRoundings = 2;
// Error budget of the library's evaluation of tanh inside GELU / dGELU, absolute: cuBLASLt does
// not document how it evaluates the epilogue; PTX's tanh.approx.f32 is documented to about 2^-11,
// and we allow twice that.
constexpr double kTanhError = 0x1p-10;
// max |gelu'(x)| of the tanh approximation (1.1290 near x = 2.4): how far an error in the
// pre-activation can move GELU's output.
constexpr double kGeluLipschitz = 1.13;
// exp (ex2.approx after a scale by log2 e) and the scale of the scores, in units of u_acc.
constexpr double kExpRoundoffs = 8;

// Higham's gamma_n = n u / (1 - n u).
inline double gamma(int64_t n, double u) {
  const double nu = static_cast<double>(n) * u;
  return nu < 1 ? nu / (1 - nu) : INFINITY;
}

// A dot product of `terms` terms (K products, plus 1 for a bias, plus 1 for an accumulated C) whose
// float64 terms' absolute values sum to `magnitude`, accumulated in fp32 and stored as `out`.
inline double dot_bound(DType out, int64_t terms, double magnitude, int roundings = kVendorRoundings) {
  const double g = gamma(terms, kAccRoundoff);
  return g * magnitude + roundings * unit_roundoff(out) * (1 + g) * magnitude + roundings * underflow(out);
}
inline DVec dot_bounds(DType out, int64_t terms, const DVec& magnitude, int roundings = kVendorRoundings) {
  DVec b(magnitude.size());
  for (size_t i = 0; i < b.size(); ++i) b[i] = dot_bound(out, terms, magnitude[i], roundings);
  return b;
}

// A value known to within `bound` before it is stored: `roundings` roundings of `out` (magnitude
// |value| + bound) on top.
inline double stored(DType out, double value, double bound, int roundings = kVendorRoundings) {
  return bound + roundings * (unit_roundoff(out) * (std::fabs(value) + bound) + underflow(out));
}

inline DVec abs_of(const DVec& v) {
  DVec a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

// ---- the check ---------------------------------------------------------------------------------

// Every |got[i] - ref[i]| <= bound[i]; NaN fails. The message names the worst ratio and the first
// offenders.
template <typename F>
::testing::AssertionResult within(const std::vector<F>& got, const DVec& ref, const DVec& bound) {
  if (got.size() != ref.size() || ref.size() != bound.size())
    return ::testing::AssertionFailure() << "sizes " << got.size() << ", " << ref.size() << ", " << bound.size();
  size_t bad = 0;
  double worst = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(err <= bound[i])) {  // NaN fails
      if (bad < 5) msg << "\n  [" << i << "] got " << got[i] << " want " << ref[i] << " (err " << err << " > " << bound[i] << ")";
      ++bad;
    }
    if (bound[i] > 0 && err / bound[i] > worst) worst = err / bound[i];
  }
  if (bad == 0) return ::testing::AssertionSuccess() << "worst err/bound " << worst;
  return ::testing::AssertionFailure() << bad << " of " << got.size()
                                       << " elements beyond the derived bound (tests/tolerance.h; worst err/bound "
                                       << worst << ")" << msg.str();
}

// ---- the matmul family (row-major, kernels/ops.h's shapes) --------------------------------------

// out[N, OC] = in[N, C] @ weight[OC, C]^T (+ bias[OC]).
inline DVec matmul_forward_bound(DType out, const DVec& in, const DVec& weight, const DVec& bias, int64_t N, int64_t C,
                                 int64_t OC) {
  DVec b(static_cast<size_t>(N * OC));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double m = bias.empty() ? 0.0 : std::fabs(bias[o]);
      for (int64_t c = 0; c < C; ++c) m += std::fabs(in[n * C + c] * weight[o * C + c]);
      b[n * OC + o] = dot_bound(out, C + (bias.empty() ? 0 : 1), m);
    }
  return b;
}

// matmul_backward's results: din[N, C] += dout @ weight (stored as din_t), dweight[OC, C] +=
// dout^T @ in and dbias[OC] += column sums of dout (fp32). Empty din0/dw0/db0: overwritten (0).
struct MatmulBackwardBounds {
  DVec din, dweight, dbias;
};
inline MatmulBackwardBounds matmul_backward_bounds(DType din_t, const DVec& dout, const DVec& in, const DVec& weight,
                                                   const DVec& din0, const DVec& dw0, const DVec& db0, int64_t N,
                                                   int64_t C, int64_t OC) {
  MatmulBackwardBounds r{DVec(N * C), DVec(OC * C), DVec(OC)};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      double m = din0.empty() ? 0.0 : std::fabs(din0[n * C + c]);
      for (int64_t o = 0; o < OC; ++o) m += std::fabs(dout[n * OC + o] * weight[o * C + c]);
      r.din[n * C + c] = dot_bound(din_t, OC + 1, m);
    }
  for (int64_t o = 0; o < OC; ++o) {
    for (int64_t c = 0; c < C; ++c) {
      double m = dw0.empty() ? 0.0 : std::fabs(dw0[o * C + c]);
      for (int64_t n = 0; n < N; ++n) m += std::fabs(dout[n * OC + o] * in[n * C + c]);
      r.dweight[o * C + c] = dot_bound(DType::kF32, N + 1, m);
    }
    double m = db0.empty() ? 0.0 : std::fabs(db0[o]);
    for (int64_t n = 0; n < N; ++n) m += std::fabs(dout[n * OC + o]);
    r.dbias[o] = dot_bound(DType::kF32, N + 1, m);
  }
  return r;
}

// The GELU (tanh form) and its derivative as functions of t = tanh(u): how far an error dt in the
// library's tanh moves them. gelu = 0.5 x (1 + t); gelu' = 0.5 (1 + t) + 0.5 x (1 - t^2) u'(x).
inline double gelu_tanh_sensitivity(double x) { return 0.5 * std::fabs(x); }
inline double gelu_grad_tanh_sensitivity(double x) {
  const double du = 0.7978845608028654 * (1 + 3 * 0.044715 * x * x);
  return 0.5 + std::fabs(x) * du;  // |d gelu'/dt| = |0.5 - x t u'| with |t| <= 1
}
inline double gelu_grad(double x) {
  const double c = 0.7978845608028654, u = c * (x + 0.044715 * x * x * x), t = std::tanh(u);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
}

// matmul_gelu_forward: pre = in @ W^T (+ b), out = gelu(pre), both of type t. GELU is evaluated on
// the library's pre-activation (before or after its rounding: the pre bound covers both).
struct GeluForwardBounds {
  DVec pre, out;
};
inline GeluForwardBounds matmul_gelu_forward_bounds(DType t, const DVec& in, const DVec& weight, const DVec& bias,
                                                    const DVec& r_pre, const DVec& r_out, int64_t N, int64_t C,
                                                    int64_t OC) {
  GeluForwardBounds r{matmul_forward_bound(t, in, weight, bias, N, C, OC), DVec(N * OC)};
  for (size_t i = 0; i < r.out.size(); ++i) {
    const double from_pre = kGeluLipschitz * r.pre[i];
    const double eval = gelu_tanh_sensitivity(std::fabs(r_pre[i]) + r.pre[i]) * kTanhError;
    r.out[i] = stored(t, r_out[i], from_pre + eval);
  }
  return r;
}

// matmul_backward_dgelu: dgrad = dout[N, OC] @ W[OC, C] (K = OC, rounded to t where the library
// does), dpre = gelu'(pre) * dgrad stored as t; dbias[C] += column sums of the stored dpre (fp32). pre is an
// input (exact); r_dgrad is the float64 dout @ W.
struct DgeluBounds {
  DVec dpre, dbias;
};
inline DgeluBounds matmul_backward_dgelu_bounds(DType t, const DVec& dout, const DVec& weight, const DVec& pre,
                                               const DVec& r_dgrad, const DVec& db0, int64_t N, int64_t C,
                                               int64_t OC) {
  DgeluBounds r{DVec(N * C), DVec(C)};
  DVec dpre_mag(N * C);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      double m = 0;
      for (int64_t o = 0; o < OC; ++o) m += std::fabs(dout[n * OC + o] * weight[o * C + c]);
      const size_t i = static_cast<size_t>(n * C + c);
      const double bg = dot_bound(t, OC, m), x = pre[i], g = gelu_grad(x);
      const double e = std::fabs(g) * bg + gelu_grad_tanh_sensitivity(x) * kTanhError * (std::fabs(r_dgrad[i]) + bg);
      r.dpre[i] = stored(t, g * r_dgrad[i], e);
      dpre_mag[i] = std::fabs(g * r_dgrad[i]) + r.dpre[i];
    }
  for (int64_t c = 0; c < C; ++c) {
    double e = 0, m = db0.empty() ? 0.0 : std::fabs(db0[c]);
    for (int64_t n = 0; n < N; ++n) e += r.dpre[n * C + c], m += dpre_mag[n * C + c];
    r.dbias[c] = e + dot_bound(DType::kF32, N + 1, m);
  }
  return r;
}

// ---- causal attention (qkv [B, T, 3C], heads of hs = C / NH, scale 1 / sqrt(hs)) ---------------

// The flash-attention algorithm (cuDNN's SDPA, our tiled kernels, the fp32 GEMM attention): scores
// s = scale q.k in fp32 (hs terms), P = exp(s - m) / l in fp32, P rounded to the input type t
// before P @ V, O rounded to t; backward recomputes P from the saved lse, dP = dO.v and D = dO.o
// (o the stored output, hs terms each), dS = P (dP - D) rounded to t before dQ = scale dS K and
// dK = scale dS^T Q, dV = P^T dO.
// A score error e_j moves P_j by at most a factor exp(2 max e) (the max and the sum shift with it).
// Bounds are on the gradient alone (overwrite); accumulate() adds a += onto old values.
// u_in: the GEMMs' inputs rounded to a narrower type first (TF32: 2^-11; 0: none, fp32 or 16-bit
// inputs as stored): each product a b then carries a relative error of 2 u_in + u_in^2 besides the
// fp32 accumulation (the fp32 GEMM attention under --tf32; its row kernels stay fp32).
constexpr double kTf32Roundoff = 0x1p-11;
struct AttentionBounds {
  DVec out, dqkv;       // before the stores' roundings
  DVec out_mag, dqkv_mag;  // magnitudes through each element (for the stores)
};
inline AttentionBounds attention_bounds(DType t, const DVec& qkv, const DVec& dout, const DVec& out, int64_t B,
                                        int64_t T, int64_t C, int64_t NH, double u_in = 0) {
  const int64_t hs = C / NH, ld = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs)), ut = unit_roundoff(t), ft = underflow(t);
  const double w = 2 * u_in + u_in * u_in;  // per product, from the rounded GEMM inputs
  const double g_hs = gamma(hs, kAccRoundoff) + w, g_t = gamma(T + 1, kAccRoundoff);
  const double g_tp = g_t + w;  // a GEMM over T terms (P @ V, dS @ K, dS^T @ Q, P^T @ dO)
  AttentionBounds r{DVec(B * T * C, 0.0), DVec(B * T * ld, 0.0), DVec(B * T * C, 0.0), DVec(B * T * ld, 0.0)};
  DVec s(T), e(T), p(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t tq = 0; tq < T; ++tq) {
        const double* q = &qkv[(b * T + tq) * ld + h * hs];
        const double* dy = &dout[(b * T + tq) * C + h * hs];
        const double* y = &out[(b * T + tq) * C + h * hs];
        double mx = -INFINITY, emax = 0, sum = 0;
        for (int64_t j = 0; j <= tq; ++j) {
          const double* k = &qkv[(b * T + j) * ld + C + h * hs];
          double dot = 0, mag = 0;
          for (int64_t i = 0; i < hs; ++i) dot += q[i] * k[i], mag += std::fabs(q[i] * k[i]);
          s[j] = dot * scale;
          e[j] = g_hs * scale * mag + kExpRoundoffs * kAccRoundoff * std::fabs(s[j]);
          mx = std::max(mx, s[j]);
          emax = std::max(emax, e[j]);
        }
        for (int64_t j = 0; j <= tq; ++j) sum += (p[j] = std::exp(s[j] - mx));
        const double lse = mx + std::log(sum);
        // Relative error of each recomputed P: the scores, exp, the sum l, and (backward) lse.
        const double rho = std::expm1(2 * emax) + kExpRoundoffs * kAccRoundoff + g_t + 2 * kAccRoundoff * std::fabs(lse);
        double D = 0, gD = 0;
        for (int64_t i = 0; i < hs; ++i) D += dy[i] * y[i], gD += std::fabs(dy[i] * y[i]);
        gD *= g_hs - w;  // D is a row kernel's fp32 (or finer) sum, not a GEMM
        double* bo = &r.out[(b * T + tq) * C + h * hs];
        double* mo = &r.out_mag[(b * T + tq) * C + h * hs];
        for (int64_t j = 0; j <= tq; ++j) {
          const double P = p[j] / sum;
          const double* k = &qkv[(b * T + j) * ld + C + h * hs];
          const double* v = &qkv[(b * T + j) * ld + 2 * C + h * hs];
          // forward: o_i = sum_j P_j v_ji with P rounded to t
          const double eP = P * (rho + ut) + ft;  // |P used - P|
          for (int64_t i = 0; i < hs; ++i) {
            bo[i] += eP * std::fabs(v[i]) + g_tp * P * std::fabs(v[i]);
            mo[i] += P * std::fabs(v[i]);
          }
          // backward
          double dp = 0, f = 0;
          for (int64_t i = 0; i < hs; ++i) dp += dy[i] * v[i], f += std::fabs(dy[i] * v[i]);
          f *= g_hs;
          const double mag_ds = P * (std::fabs(dp - D) + f + gD);
          const double e_ds = P * ((rho + ut) * std::fabs(dp - D) + (1 + ut) * (f + gD)) + ft;
          double* bq = &r.dqkv[(b * T + tq) * ld + h * hs];
          double* bk = &r.dqkv[(b * T + j) * ld + C + h * hs];
          double* bv = &r.dqkv[(b * T + j) * ld + 2 * C + h * hs];
          double* mq = &r.dqkv_mag[(b * T + tq) * ld + h * hs];
          double* mk = &r.dqkv_mag[(b * T + j) * ld + C + h * hs];
          double* mv = &r.dqkv_mag[(b * T + j) * ld + 2 * C + h * hs];
          for (int64_t i = 0; i < hs; ++i) {
            bq[i] += scale * (e_ds + g_tp * mag_ds) * std::fabs(k[i]);
            bk[i] += scale * (e_ds + g_tp * mag_ds) * std::fabs(q[i]);
            bv[i] += (eP + g_tp * P) * std::fabs(dy[i]);
            mq[i] += scale * mag_ds * std::fabs(k[i]);
            mk[i] += scale * mag_ds * std::fabs(q[i]);
            mv[i] += P * std::fabs(dy[i]);
          }
        }
      }
  return r;
}

// The stored result of a computation known to within `bound` (magnitude `mag` through it), plus an
// accumulated old value `old` (empty: overwrite), rounded to t by the library and/or our store.
inline DVec stored_bounds(DType t, const DVec& bound, const DVec& mag, const DVec& old = {}) {
  DVec r(bound.size());
  for (size_t i = 0; i < r.size(); ++i) {
    const double m = mag[i] + (old.empty() ? 0.0 : std::fabs(old[i]));
    r[i] = stored(t, m, bound[i] + gamma(2, kAccRoundoff) * m);
  }
  return r;
}

}  // namespace zt::tolerance
