// Float64 references for every op of kernels/ops.h, written plainly (loops as in the formulas) so
// that they are obviously right; the op tests compare both backends against them, and finite
// differences of the forward references check the backward references. Tests only.
//
// Same layouts and conventions as ops.h: row-major, backward references ACCUMULATE (+=) into
// their gradient outputs, forward references overwrite. An empty span means "absent" where the
// op takes an optional view (matmul bias, din, dbias).
#pragma once

#include <cstdint>
#include <span>

namespace zt::ref {

using DSpan = std::span<double>;
using CDSpan = std::span<const double>;
using ISpan = std::span<const int32_t>;

void encoder_forward_ref(DSpan out, ISpan tokens, CDSpan wte, CDSpan wpe, int64_t B, int64_t T,
                         int64_t C);
void encoder_backward_ref(DSpan dwte, DSpan dwpe, CDSpan dout, ISpan tokens, int64_t B, int64_t T,
                          int64_t C);

void layernorm_forward_ref(DSpan out, DSpan mean, DSpan rstd, CDSpan in, CDSpan weight, CDSpan bias,
                           int64_t N, int64_t C, double eps);
void layernorm_backward_ref(DSpan din, DSpan dweight, DSpan dbias, CDSpan dout, CDSpan in,
                            CDSpan weight, CDSpan mean, CDSpan rstd, int64_t N, int64_t C);

void matmul_forward_ref(DSpan out, CDSpan in, CDSpan weight, CDSpan bias, int64_t N, int64_t C,
                        int64_t OC);
void matmul_backward_ref(DSpan din, DSpan dweight, DSpan dbias, CDSpan dout, CDSpan in,
                         CDSpan weight, int64_t N, int64_t C, int64_t OC);

// preatt entries above the diagonal are left untouched; att gets 0 there.
void attention_forward_ref(DSpan out, DSpan preatt, DSpan att, CDSpan qkv, int64_t B, int64_t T,
                           int64_t C, int64_t NH);
void attention_backward_ref(DSpan dqkv, CDSpan dout, CDSpan qkv, CDSpan att, int64_t B, int64_t T,
                            int64_t C, int64_t NH);

// GELU with the real tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward_ref(DSpan out, CDSpan in);
void gelu_backward_ref(DSpan din, CDSpan in, CDSpan dout);
void relu_forward_ref(DSpan out, CDSpan in);
void relu_backward_ref(DSpan din, CDSpan in, CDSpan dout);

// losses[r] = logsumexp(logits[r]) - logits[r, target]; dlogits[r] = (softmax - onehot) * dloss
// (overwritten; 0 rows and 0 loss where target < 0).
void classifier_ref(DSpan losses, DSpan dlogits, CDSpan logits, ISpan targets, int64_t N, int64_t V,
                    double dloss);

struct AdamWRef {
  double lr, beta1, beta2, eps, weight_decay;
  int step;
};
void adamw_ref(DSpan params, CDSpan grads, DSpan m, DSpan v, const AdamWRef& hp, double grad_scale);
struct SgdRef {
  double lr, momentum, weight_decay;
  bool nesterov;
};
void sgd_ref(DSpan params, CDSpan grads, DSpan momentum_buf, const SgdRef& hp, double grad_scale);

double sum_squares_ref(CDSpan x);

}  // namespace zt::ref
