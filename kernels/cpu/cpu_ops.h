// Synchronous raw-pointer CPU kernels behind kernels/ops.h; ops.cc enqueues them on a CPU stream.
// Arguments mirror kernels/cuda/cuda_ops.h (minus the stream); semantics are those of ops.h.
// Matrix products go through OpenBLAS (cblas_sgemm), loops through zt::parallel_for. Every
// result is independent of the thread count: work is split over rows/columns/heads whose
// results do not interact, and cross-row reductions use a fixed blocking and order.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/matmul_types.h"

namespace zt::cpu_kernels {

// ---- elementwise / utility -------------------------------------------------------------
// The activation-dtype ops (fill, add, encoder_forward/backward, gelu_forward/backward) take
// `dtype` (f32, f16, bf16) for the pointers ops.h names as activations: 16-bit values widened,
// computed as the fp32 loop computes, each output rounded once. The float overloads are the fp32
// loops themselves (the other CPU kernels call them).
void fill(float* x, int64_t n, float value);
void fill(void* x, DType dtype, int64_t n, float value);
void scale(float* x, int64_t n, float alpha);
void add(void* out, const void* a, const void* b, DType dtype, int64_t n);  // out may alias a/b
// f32/f16/bf16 conversion with the round-to-nearest-even functions of core/dtype.h.
void cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n);
// dst[i] = round(float(dst[i]) + float(src[i])) for f32/f16/bf16 (f32: exactly add(dst, dst, src)).
void accumulate(void* dst, const void* src, DType dtype, int64_t n);

// ---- encoder ----------------------------------------------------------------------------
// wte/dwte hold the V vocabulary rows [v_begin, v_begin + V) of v_total; tokens of other rows
// contribute nothing to them. wpe/dwpe may be nullptr (no position term). Throws zt::Error when a
// token id is outside [0, v_total).
// out, wte, wpe, dout of `dtype`.
void encoder_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, DType dtype,
                     int64_t B, int64_t T, int64_t C, int64_t V, int64_t v_begin, int64_t v_total);
void encoder_backward(float* dwte, float* dwpe, const void* dout, DType dtype, const int32_t* tokens,
                      int64_t B, int64_t T, int64_t C, int64_t V, int64_t v_begin, int64_t v_total);
// x[r] += wpe[(row0 + r) % T] for x [R, C]; dwpe[(row0 + r) % T] += dx[r], rows in order. x, dx of
// `act`; wpe of `wt` (f32 or act); dwpe fp32. 16-bit x: widened, added in fp32, rounded once.
void position_forward(void* x, const void* wpe, DType act, DType wt, int64_t R, int64_t C, int64_t row0,
                      int64_t T);
void position_backward(float* dwpe, const void* dx, DType act, int64_t R, int64_t C, int64_t row0, int64_t T);

// ---- layernorm ----------------------------------------------------------------------------
// in/out/dout/din of `act` (f32, f16, bf16), weight/bias of `wt` (f32 or act); 16-bit values widened,
// computed as fp32 is, each 16-bit output rounded once (din += too).
void layernorm_forward(void* out, float* mean, float* rstd, const void* in, DType act, const void* weight,
                       const void* bias, DType wt, int64_t N, int64_t C, float eps);
void layernorm_backward(void* din, float* dweight, float* dbias, const void* dout, const void* in, DType act,
                        const void* weight, DType wt, const float* mean, const float* rstd, int64_t N, int64_t C);
// residual_out = a + b, ln_out = layernorm(residual_out), activations of dtype `act` (f32/f16/bf16),
// weight/bias of `wt`: bit for bit add followed by layernorm_forward (kernels/ops.h).
void residual_layernorm_forward(void* residual_out, void* ln_out, float* mean, float* rstd, const void* a,
                                const void* b, DType act, const void* weight, const void* bias, DType wt,
                                int64_t N, int64_t C, float eps);

// ---- matmul (bias / din / dweight / dbias may be nullptr; in too when dweight is) ------------------
// Pointers typed by t (kernels/matmul_types.h). tf32: the device's MathMode::tf32 when the op was
// enqueued (fp32 GEMM inputs rounded to TF32).
void matmul_forward(void* out, const void* in, const void* weight, const void* bias, MatmulTypes t,
                    int64_t N, int64_t C, int64_t OC, bool tf32 = false);
// overwrite_din: din = dout @ weight (beta 0) instead of +=.
void matmul_backward(void* din, float* dweight, float* dbias, const void* dout, const void* in,
                     const void* weight, MatmulTypes t, int64_t N, int64_t C, int64_t OC,
                     bool overwrite_din = false, bool tf32 = false);
// The fused GELU epilogues (ops.h matmul_gelu_forward / matmul_backward_dgelu).
void matmul_gelu_forward(void* out_gelu, void* pre_gelu, const void* in, const void* weight, const void* bias,
                         MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32 = false);
void matmul_backward_dgelu(void* dpre, float* dbias, const void* dout, const void* weight, const void* pre_gelu,
                           MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32 = false);

// x[N, C] += bias; dbias[C] += column sums of dout (matmul_backward's reduction, same bits). x, dout
// of `act`; bias of `wt` (f32 or act); dbias fp32. 16-bit x: widened, added in fp32, rounded once.
void bias_forward(void* x, const void* bias, DType act, DType wt, int64_t N, int64_t C);
void bias_backward(float* dbias, const void* dout, DType act, int64_t N, int64_t C);

// ---- attention ------------------------------------------------------------------------------
void attention_forward(float* out, float* preatt, float* att, const float* qkv, int64_t B,
                       int64_t T, int64_t C, int64_t NH);
void attention_backward(float* dqkv, float* dpreatt, float* datt, const float* dout,
                        const float* qkv, const float* att, int64_t B, int64_t T, int64_t C,
                        int64_t NH);

// Tiled causal attention (kernels/ops.h flash_attention_*); scratch: B*NH*T floats. qkv, out,
// dout, dqkv of `dtype` (f32, f16, bf16); accumulate false overwrites dqkv.
void flash_attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                             int64_t C, int64_t NH, DType dtype);
void flash_attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                              const float* lse, float* scratch, int64_t B, int64_t T, int64_t C,
                              int64_t NH, DType dtype, bool accumulate);
// The last n positions' attention over the cache qkv [S, 3C] (kernels/ops.h decode_attention).
void decode_attention(void* out, const void* qkv, int64_t n, int64_t S, int64_t C, int64_t NH, DType dtype);

// ---- activations ------------------------------------------------------------------------------
void gelu_forward(float* out, const float* in, int64_t n);
void gelu_forward(void* out, const void* in, DType dtype, int64_t n);
void gelu_backward(float* din, const float* in, const float* dout, int64_t n);  // din +=
void gelu_backward(void* din, const void* in, const void* dout, DType dtype, int64_t n);
void relu_forward(float* out, const float* in, int64_t n);
void relu_forward(void* out, const void* in, DType dtype, int64_t n);
void relu_backward(float* din, const float* in, const float* dout, int64_t n);  // din +=
void relu_backward(void* din, const void* in, const void* dout, DType dtype, int64_t n);

// ---- classifier ---------------------------------------------------------------------------------
// logits [N, ld] of `dtype` (f32, bf16, f16), columns [V, ld) padding. Throws zt::Error when a
// target is >= V. dloss_scale (may be nullptr) multiplies dloss when the kernel runs.
void classifier_forward_backward(void* logits, DType dtype, float* losses, const int32_t* targets, int64_t N,
                                 int64_t ld, int64_t V, float dloss, bool compute_grad,
                                 const float* dloss_scale);
// The LM head over logits rows of ld >= V elements (ops.h lm_head_forward/backward), logits,
// dlogits, in, wte, din of `act`, dwte fp32; tf32 rounds fp32 GEMM inputs as matmul_forward/backward
// do. 16-bit: inputs widened, fp32 products, each 16-bit output rounded once.
void lm_head_forward(void* logits, const void* in, const void* wte, DType act, int64_t N, int64_t C, int64_t V,
                     int64_t ld, bool tf32);
void lm_head_backward(void* din, float* dwte, const void* dlogits, const void* in, const void* wte, DType act,
                      int64_t N, int64_t C, int64_t V, int64_t ld, bool tf32);

// ---- vocabulary-parallel cross-entropy over a shard logits [N, V] of ids [v_begin, v_begin+V) --
// logits of `dtype` (f32, bf16 or f16: widened exactly; vocab_loss_grad rounds each gradient once).
// out[N] = row maxima.
void row_max(float* out, const void* logits, DType dtype, int64_t N, int64_t V, int64_t v_begin, int64_t v_total);
// out[0..N) = sum exp(logits - max) (double, fixed lane order, rounded to fp32); out[N..2N) = the
// target's logit when this shard holds it, else 0; both 0 for ignored rows. Throws zt::Error when
// a target is >= v_total.
void vocab_partials(float* out, const void* logits, DType dtype, const float* max, const int32_t* targets,
                    int64_t N, int64_t V, int64_t v_begin, int64_t v_total);
// Losses and (compute_grad) dlogits in place, with classifier_forward_backward's arithmetic.
void vocab_loss_grad(void* logits, DType dtype, float* losses, const float* max, const float* sumexp,
                     const float* target_logit, const int32_t* targets, int64_t N, int64_t V,
                     int64_t v_begin, int64_t v_total, float dloss, bool compute_grad,
                     const float* dloss_scale);

// ---- optimizers
// -----------------------------------------------------------------------------------
void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, float bias_correction1,
                  float bias_correction2, float grad_scale);
void sgd_update(float* params, const float* grads, float* momentum_buf, int64_t n, float lr,
                float momentum, float weight_decay, bool nesterov, float grad_scale);

// ---- reductions
// ------------------------------------------------------------------------------------- Squares
// summed in double within blocks of kSumSquaresBlock elements, block sums added in index order (in
// double): the same bits for any thread count.
constexpr int64_t kSumSquaresBlock = 4096;
void sum_squares(float* out, const float* x, int64_t n);
// out[0] = sum(x) with sum_squares' blocking and order (in double), rounded once.
void sum(float* out, const float* x, int64_t n);
// out[j] = in[0, j] (+ or max) in[1, j] ... in[S-1, j], fp32, slices in index order.
void reduce_slices(float* out, const float* in, int64_t S, int64_t n, bool take_max);

}  // namespace zt::cpu_kernels
