// Every op ZeroTrain's models and optimizers use, forward and backward. One function per op,
// `Stream&` first; each checks shapes/dtypes (zt::Error naming the op and the sizes), then runs
// asynchronously through the op table of the stream's backend (kernels/op_table.h): kernels/cpu/
// (OpenBLAS + parallel_for, enqueued on the CPU stream) or kernels/cuda/ (cuBLAS + our kernels,
// launched on the CUDA stream). A backend without a kernel gets a fallback or one clear refusal.
//
// Conventions (as llm.c):
//  - Row-major, contiguous. N = rows (B*T for sequence ops), C = channels.
//  - Backward ops ACCUMULATE (+=) into every gradient output (din, dweight, dbias, ...); callers
//    zero gradient buffers when a step starts. Forward outputs are overwritten.
//  - All floating tensors are fp32 for now (dtype checked); token ids/labels are int32.
//  - Every view lives on the stream's device (view.device == stream.device().index()); leading
//    dimensions are free where a row count N is meant ([B,T,C] is N = B*T rows of C).
//  - Ops with empty outputs (zero elements) launch nothing.
//  - Results never depend on the number of CPU threads or on how work is chunked: reductions
//    across rows (dbias, dweight of layernorm, norms) use a fixed blocking and order.
#pragma once

#include "core/tensor.h"
#include "runtime/stream.h"

namespace zt::ops {

// ---- elementwise / utility ------------------------------------------------
// x[:] = value
void fill(Stream& s, TensorView x, float value);
// x[:] *= alpha
void scale(Stream& s, TensorView x, float alpha);
// out = a + b (out may alias a or b)
void add(Stream& s, TensorView out, ConstTensorView a, ConstTensorView b);
// dst = src converted between f32/f16/bf16 (round to nearest even); same numel.
void cast(Stream& s, TensorView dst, ConstTensorView src);
// dst += src for f32/f16/bf16 (dst and src of one dtype, same numel): each element is widened
// to fp32, added, and rounded to the storage type once (round to nearest even). For f32 the bits
// equal add(dst, dst, src). The reduction step of the collectives (src/comm/).
void accumulate(Stream& s, TensorView dst, ConstTensorView src);

// ---- GPT-2 encoder: token + position embedding -----------------------------
// out[B,T,C] = wte[tokens[b,t], :] + wpe[t, :]; tokens [B,T] int32, wte [V,C], wpe [maxT,C], T <= maxT.
// Token ids outside [0, V) are a caller bug (data loaders validate); the CPU backend checks them.
void encoder_forward(Stream& s, TensorView out, ConstTensorView tokens, ConstTensorView wte,
                     ConstTensorView wpe);
// dwte[tokens[b,t]] += dout[b,t]; dwpe[t] += dout[b,t]
void encoder_backward(Stream& s, TensorView dwte, TensorView dwpe, ConstTensorView dout,
                      ConstTensorView tokens);

// ---- layernorm over the last dim ------------------------------------------------
// in/out [N,C]; weight/bias [C]; mean/rstd [N] are saved for backward. rstd = 1/sqrt(var + eps),
// var the biased (population) variance.
void layernorm_forward(Stream& s, TensorView out, TensorView mean, TensorView rstd,
                       ConstTensorView in, ConstTensorView weight, ConstTensorView bias, float eps);
void layernorm_backward(Stream& s, TensorView din, TensorView dweight, TensorView dbias,
                        ConstTensorView dout, ConstTensorView in, ConstTensorView weight,
                        ConstTensorView mean, ConstTensorView rstd);

// ---- matmul with bias: out[N,OC] = in[N,C] @ weight[OC,C]^T + bias[OC] -----------
// bias may be an empty view (data == nullptr): no bias. Matrix products use BLAS (CPU) / cuBLAS.
void matmul_forward(Stream& s, TensorView out, ConstTensorView in, ConstTensorView weight,
                    ConstTensorView bias);
// din[N,C] += dout @ weight (if given: the first layer of a model needs no din);
// dweight[OC,C] += dout^T @ in; dbias[OC] += sum_rows(dout) (if given)
void matmul_backward(Stream& s, TensorView din, TensorView dweight, TensorView dbias,
                     ConstTensorView dout, ConstTensorView in, ConstTensorView weight);

// ---- causal multi-head self-attention -------------------------------------------
// qkv [B,T,3C] (q, k, v each [B,T,C] interleaved as in GPT-2's c_attn), NH heads of size C/NH.
// preatt, att [B,NH,T,T]: scaled scores and masked softmax (entries above the diagonal are 0 in
// att, unspecified in preatt). out [B,T,C] = att @ v per head.
void attention_forward(Stream& s, TensorView out, TensorView preatt, TensorView att,
                       ConstTensorView qkv, int num_heads);
// dqkv += ...; dpreatt and datt [B,NH,T,T] are scratch (overwritten, contents unspecified after).
void attention_backward(Stream& s, TensorView dqkv, TensorView dpreatt, TensorView datt,
                        ConstTensorView dout, ConstTensorView qkv, ConstTensorView att,
                        int num_heads);

// ---- activations ----------------------------------------------------------------
// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
void gelu_forward(Stream& s, TensorView out, ConstTensorView in);
void gelu_backward(Stream& s, TensorView din, ConstTensorView in, ConstTensorView dout);
void relu_forward(Stream& s, TensorView out, ConstTensorView in);
void relu_backward(Stream& s, TensorView din, ConstTensorView in, ConstTensorView dout);

// ---- fused classifier: softmax + cross-entropy + dlogits in one pass per row ------------
// logits [N,V] (fp32) are overwritten IN PLACE with dlogits = (softmax(logits) - onehot(target))
// * dloss when compute_grad, else left unchanged; losses[N] = -log softmax(logits)[target]
// (nats). targets [N] int32 in [0, V); a target < 0 means "ignore": loss 0, gradient 0.
// dloss_scale (optional, one fp32 in device memory, read when the op runs): dlogits use
// dloss * *dloss_scale instead of dloss (dynamic loss scaling); losses are unaffected.
void classifier_forward_backward(Stream& s, TensorView logits, TensorView losses,
                                 ConstTensorView targets, float dloss, bool compute_grad,
                                 const float* dloss_scale = nullptr);

// ---- optimizers over flat fp32 buffers (one call covers a whole flat shard) ------------
struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay;
  int step;  // 1-based, for bias correction
};
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; mhat = m/(1-b1^t); vhat = v/(1-b2^t);
// p -= lr (mhat / (sqrt(vhat) + eps) + wd p). `grad_scale` multiplies g first (unscaling,
// clipping). All views [n] fp32.
void adamw_update(Stream& s, TensorView params, ConstTensorView grads, TensorView m, TensorView v,
                  const AdamWParams& hp, float grad_scale = 1.0f);
struct SgdParams {
  float lr, momentum, weight_decay;
  bool nesterov;
};
// g' = g*grad_scale + wd p; buf = momentum buf + g'; p -= lr (nesterov ? g' + momentum buf : buf)
void sgd_update(Stream& s, TensorView params, ConstTensorView grads, TensorView momentum_buf,
                const SgdParams& hp, float grad_scale = 1.0f);

// ---- reductions ------------------------------------------------------------------------
// out[0] (fp32, device memory) = sum(x^2), accumulated in a fixed order (deterministic).
void sum_squares(Stream& s, TensorView out, ConstTensorView x);

}  // namespace zt::ops
