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

// wte/dwte hold the vocabulary rows [begin, begin + wte.size() / C); other tokens contribute 0.
// An empty wpe/dwpe: no position term.
void encoder_forward_ref(DSpan out, ISpan tokens, CDSpan wte, CDSpan wpe, int64_t B, int64_t T,
                         int64_t C, int64_t begin = 0);
void encoder_backward_ref(DSpan dwte, DSpan dwpe, CDSpan dout, ISpan tokens, int64_t B, int64_t T,
                          int64_t C, int64_t begin = 0);
// x[r] += wpe[(row0 + r) % T] for x [R, C]; dwpe[(row0 + r) % T] += dx[r].
void position_forward_ref(DSpan x, CDSpan wpe, int64_t R, int64_t C, int64_t row0, int64_t T);
void position_backward_ref(DSpan dwpe, CDSpan dx, int64_t R, int64_t C, int64_t row0, int64_t T);
// x[N, C] += bias; dbias += column sums of dout [N, C].
void bias_forward_ref(DSpan x, CDSpan bias, int64_t N, int64_t C);
void bias_backward_ref(DSpan dbias, CDSpan dout, int64_t N, int64_t C);

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

// Vocabulary-parallel cross-entropy over a shard logits [N, V] holding ids [begin, begin + V).
void row_max_ref(DSpan out, CDSpan logits, int64_t N, int64_t V);
// out [2N]: sums of exp(logits - max) and the target's logit when the shard holds it (else 0); both
// 0 for ignored rows.
void vocab_partials_ref(DSpan out, CDSpan logits, CDSpan max, ISpan targets, int64_t N, int64_t V,
                        int64_t begin);
// losses = log(sumexp) + max - target_logit; dlogits (overwritten) = (exp(logits - max) / sumexp -
// onehot) * dloss; 0 for ignored rows.
void vocab_loss_grad_ref(DSpan losses, DSpan dlogits, CDSpan logits, CDSpan max, CDSpan sumexp,
                         CDSpan target_logit, ISpan targets, int64_t N, int64_t V, int64_t begin,
                         double dloss);
// out[j] = sum (or max) over k of in[k * out.size() + j].
void reduce_slices_ref(DSpan out, CDSpan in, bool take_max);

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
