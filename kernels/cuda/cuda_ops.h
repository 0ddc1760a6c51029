// Raw-pointer CUDA launchers behind kernels/ops.h: kernels/ops.cc validates shapes and dtypes, then
// calls these with the stream's cudaStream_t (as void*) and the same arguments the CPU kernels of
// kernels/cpu/cpu_ops.h take. Includes no CUDA header, so any translation unit may call it.
//
// Contract for every function (implemented in kernels/cuda/*.cu):
//  - `stream` is a cudaStream_t; all pointers are device memory of that stream's GPU. Launches are
//    asynchronous on `stream` (no host synchronisation) and are followed by an error check that
//    throws zt::Error naming the op.
//  - Shapes and semantics are exactly those documented in kernels/ops.h (row-major, contiguous;
//    backward ops ACCUMULATE (+=) into gradient outputs; forward outputs are overwritten).
//  - Sizes are already validated (all > 0 except where noted; C % NH == 0; T <= maxT).
//  - Matrix products use cuBLAS/cuBLASLt; device-wide reductions use CUB. Results must be
//    run-to-run deterministic (no floating-point atomics in reductions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "kernels/matmul_types.h"

namespace zt {
class Stream;
}  // namespace zt

namespace zt::cuda_ops {

// ---- elementwise / utility (n may be 0: no launch) ---------------------------------------
// fill, add, the encoder and GELU take `dtype` (f32, f16, bf16) for their activation pointers
// (kernels/ops.h): 16-bit values widened, computed as the fp32 kernel computes, rounded once with
// core/dtype.h's conversions (the CPU kernels' bits up to nvcc's FMA contraction).
void fill(void* stream, void* x, DType dtype, int64_t n, float value);
void scale(void* stream, float* x, int64_t n, float alpha);
// out may alias a and/or b.
void add(void* stream, void* out, const void* a, const void* b, DType dtype, int64_t n);
// dst[i] = round(float(dst[i]) + float(src[i])), dtype f32/f16/bf16 (f32: exactly add).
void accumulate(void* stream, void* dst, const void* src, DType dtype, int64_t n);
// accumulate with src in a peer GPU's memory (peer access enabled), read directly over the link
// with 128-bit loads where both pointers allow (kernels/cuda/comm_ops.cu); the same bits.
void accumulate_peer(void* stream, void* dst, const void* src, DType dtype, int64_t n);

// ---- encoder: out[B,T,C] = wte[tokens[b,t] - v_begin] (0 when another shard holds the token) +
// wpe[t] (skipped when wpe == nullptr); wte [V,C] holds ids [v_begin, v_begin + V) of v_total,
// wpe [>=T, C]; out, wte, wpe of `dtype` ----------------------------------------------------------
void encoder_forward(void* stream, void* out, const int32_t* tokens, const void* wte, const void* wpe,
                     DType dtype, int64_t B, int64_t T, int64_t C, int64_t V, int64_t v_begin,
                     int64_t v_total);
// dwte[tokens[b,t] - v_begin] += dout[b,t] for the shard's tokens; dwpe[t] += dout[b,t] (skipped
// when dwpe == nullptr). Repeated tokens accumulate in position order, dwpe's rows in batch order
// (encoder_backward.cu: the bits of the CPU kernel's sequential loop). dout of `dtype`, dwte/dwpe
// fp32. Uses the stream's workspace (cublas_handle.h) for the sort.
void encoder_backward(void* stream, float* dwte, float* dwpe, const void* dout, DType dtype,
                      const int32_t* tokens, int64_t B, int64_t T, int64_t C, int64_t V,
                      int64_t v_begin, int64_t v_total);
// x[r] += wpe[(row0 + r) % T] for x [R, C]; dwpe[(row0 + r) % T] += dx[r], rows in increasing r.
// x, dx of `act`; wpe of `wt` (f32 or `act`), dwpe fp32.
void position_forward(void* stream, void* x, const void* wpe, DType act, DType wt, int64_t R, int64_t C,
                      int64_t row0, int64_t T);
void position_backward(void* stream, float* dwpe, const void* dx, DType act, int64_t R, int64_t C, int64_t row0,
                       int64_t T);

// ---- layernorm: in/out [N,C], weight/bias [C], mean/rstd [N]; in/out/dout/din of `act` (f32, f16,
// bf16), weight/bias of `wt` (f32 or act), widened where read, 16-bit outputs rounded once -------
void layernorm_forward(void* stream, void* out, float* mean, float* rstd, const void* in, DType act,
                       const void* weight, const void* bias, DType wt, int64_t N, int64_t C, float eps);
// din [N,C] += (16-bit: read, added in fp32, rounded once), dweight [C] +=, dbias [C] +=.
void layernorm_backward(void* stream, void* din, float* dweight, float* dbias, const void* dout, const void* in,
                        DType act, const void* weight, DType wt, const float* mean, const float* rstd, int64_t N,
                        int64_t C);
// residual_out = a + b, ln_out = layernorm(residual_out), activations of dtype `act` (f32/f16/bf16),
// weight/bias of `wt`: layernorm_forward's kernel and arithmetic, so bit for bit add followed by
// layernorm_forward.
void residual_layernorm_forward(void* stream, void* residual_out, void* ln_out, float* mean, float* rstd,
                                const void* a, const void* b, DType act, const void* weight, const void* bias,
                                DType wt, int64_t N, int64_t C, float eps);

// ---- matmul family (kernels/ops.h; pointers typed by MatmulTypes, kernels/matmul_types.h) -----
// The fast path, cuBLASLt with its epilogues (lt_matmul.cu): false, with nothing launched, where
// cuBLASLt refuses a problem (or ZT_CUBLASLT=off); the caller then runs the plain path below.
// The bias gradient cuBLASLt writes goes to the stream workspace's tail (GemmContext::bias_scratch,
// lt_bias_scratch_bytes(n) bytes, n = OC for matmul_backward, C for matmul_backward_dgelu); a
// larger n takes the plain path.
size_t lt_bias_scratch_bytes(int64_t n);
bool lt_matmul_forward(void* stream, void* out, const void* in, const void* weight, const void* bias, MatmulTypes t,
                       int64_t N, int64_t C, int64_t OC, bool tf32);
bool lt_matmul_backward(void* stream, void* din, float* dweight, float* dbias, const void* dout, const void* in,
                        const void* weight, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool overwrite_din,
                        bool tf32);
bool lt_matmul_gelu_forward(void* stream, void* out_gelu, void* pre_gelu, const void* in, const void* weight,
                            const void* bias, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32);
bool lt_matmul_backward_dgelu(void* stream, void* dpre, float* dbias, const void* dout, const void* weight,
                              const void* pre_gelu, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32);

// The plain path (blas_ops.cu): cublasGemmEx with fp32 accumulation (TF32 tensor cores under
// tf32 for fp32 inputs) and our epilogue kernels, at the rounding points of ops.h. scratch: the
// *_scratch_bytes of the call (an fp32 result bound for a 16-bit output; 0 bytes: nullptr).
size_t matmul_forward_scratch_bytes(MatmulTypes t, int64_t N, int64_t OC);
void matmul_forward(void* stream, void* out, const void* in, const void* weight, const void* bias, MatmulTypes t,
                    int64_t N, int64_t C, int64_t OC, bool tf32, void* scratch);
// din += (16-bit din: one rounding of din + product; overwrite_din: din = the product), dweight +=,
// dbias += (column sums of dout).
void matmul_backward(void* stream, void* din, float* dweight, float* dbias, const void* dout, const void* in,
                     const void* weight, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool overwrite_din,
                     bool tf32);
size_t matmul_gelu_forward_scratch_bytes(MatmulTypes t, int64_t N, int64_t OC);
void matmul_gelu_forward(void* stream, void* out_gelu, void* pre_gelu, const void* in, const void* weight,
                         const void* bias, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32, void* scratch);
size_t matmul_backward_dgelu_scratch_bytes(MatmulTypes t, int64_t N, int64_t C);
void matmul_backward_dgelu(void* stream, void* dpre, float* dbias, const void* dout, const void* weight,
                           const void* pre_gelu, MatmulTypes t, int64_t N, int64_t C, int64_t OC, bool tf32,
                           void* scratch);

// x[N,C] += bias[C]; dbias[C] += sum_rows(dout) with the plain matmul_backward's dbias kernel (same bits).
// x, dout of `act` (f32, f16, bf16); bias of `wt` (f32 or `act`); dbias fp32.
void bias_forward(void* stream, void* x, const void* bias, DType act, DType wt, int64_t N, int64_t C);
void bias_backward(void* stream, float* dbias, const void* dout, DType act, int64_t N, int64_t C);

// ---- causal self-attention: qkv [B,T,3C], out [B,T,C], preatt/att [B,NH,T,T], hs = C/NH -----
// preatt = q k^T / sqrt(hs) (entries above the diagonal: unspecified); att = causal softmax
// (entries above the diagonal written as 0); out = att @ v.
void attention_forward(void* stream, float* out, float* preatt, float* att, const float* qkv,
                       int64_t B, int64_t T, int64_t C, int64_t NH);
// dqkv [B,T,3C] +=; dpreatt/datt [B,NH,T,T] are scratch (overwritten, unspecified after).
void attention_backward(void* stream, float* dqkv, float* dpreatt, float* datt, const float* dout,
                        const float* qkv, const float* att, int64_t B, int64_t T, int64_t C,
                        int64_t NH);

// Causal softmax over the rows of [rows, T] scores (query t = r % T; one warp per row): att[r, j] =
// exp(preatt - m) / l for j <= t (m the row's maximum, l the sum in double), 0 above the diagonal
// up to the end of t's block of row_block rows (row_block = T: the whole row; columns past it are
// neither read nor written); lse[r] = m + log l unless lse is null. att may be preatt (in place).
// attention_forward's and the GEMM attention's softmax.
void causal_softmax(void* stream, float* att, const float* preatt, float* lse, int64_t rows, int64_t T,
                    int64_t row_block);

// Tiled causal attention (kernels/ops.h flash_attention_*; kernels/cuda/flash_attention.cu):
// one block per (batch, head, query tile) forward, per (batch, head, key tile) for dK/dV; lse
// [B,NH,T]; scratch: B*NH*T floats (D = rowsum(dout * out)). Head size <= 128. qkv, out, dout,
// dqkv of `dtype` (f32, f16, bf16); accumulate false overwrites dqkv.
void flash_attention_forward(void* stream, void* out, float* lse, const void* qkv, int64_t B,
                             int64_t T, int64_t C, int64_t NH, DType dtype);
void flash_attention_backward(void* stream, void* dqkv, const void* dout, const void* qkv,
                              const void* out, const float* lse, float* scratch, int64_t B,
                              int64_t T, int64_t C, int64_t NH, DType dtype, bool accumulate);
// The last n positions' attention over a KV cache qkv [S, 3C] (kernels/ops.h decode_attention;
// kernels/cuda/decode_attention.cu): one block per (head, row), S <= 8,192.
void decode_attention(void* stream, void* out, const void* qkv, int64_t n, int64_t S, int64_t C, int64_t NH,
                      DType dtype);

// Fused causal attention through cuDNN's SDPA graphs (kernels/cuda/cudnn_attention.cc), f16/bf16,
// the flash_attention_* contract (accumulate false overwrites dqkv); `deterministic` picks cuDNN's
// deterministic backward (MathMode::deterministic_attention). available(): whether cuDNN serves
// this call on s's GPU (`native`: s's cudaStream_t), building and caching the shape's forward and
// backward graphs on first use and taking the stream's block for them (no launch); false for fp32
// (gemm_attention_* serve it), without cuDNN (in this build or at run time), for a shape cuDNN does not support or whose
// workspace the device's pool cannot hold, with one line per run saying what the fallback costs
// (T >= 256). The launchers run only after available() said yes: the workspace (and the
// backward's staging dqkv for +=) live in one block of s's device pool that the stream holds until
// it is destroyed (ops::flash_attention_library_bytes of the workspaces cuDNN asked for, of the
// largest shape it served; taken by available(), so a launch allocates nothing and a captured
// graph replays it).
bool cudnn_attention_available(Stream& s, void* native, bool backward, int64_t B, int64_t T, int64_t C, int64_t NH,
                               DType dtype, bool deterministic);
// The run's one line (first call at T >= 256 only) saying that the tiled kernel serves a 16-bit
// attention call cuDNN does not, why, and what it costs: cuDNN declining the shape or its
// workspace, operands it cannot take (op_table.cc), a build without cuDNN.
void announce_attention_fallback(bool backward, int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                                 bool deterministic, const std::string& why);
// What cuDNN asks for at this shape (ops::fused_attention_workspace): false when cuDNN cannot start
// on s's GPU (or is absent); else each direction's workspace, -1 where cuDNN declines it. The
// graphs stay built for later calls.
bool cudnn_attention_workspace(Stream& s, int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                               bool deterministic, int64_t* forward, int64_t* backward);
void cudnn_attention_forward(Stream& s, void* native, void* out, float* lse, const void* qkv, int64_t B,
                             int64_t T, int64_t C, int64_t NH, DType dtype, bool deterministic);
void cudnn_attention_backward(Stream& s, void* native, void* dqkv, const void* dout, const void* qkv,
                              const void* out, const float* lse, int64_t B, int64_t T, int64_t C,
                              int64_t NH, DType dtype, bool accumulate, bool deterministic);

// fp32 causal attention through cuBLAS (kernels/cuda/gemm_attention.cu), the flash_attention_*
// contract: batched GEMMs per batch row and group of heads (TF32 tensor cores with tf32), row
// kernels for the masked softmax. available(): whether it serves (B, T, C, NH) on s (`native`: s's
// cudaStream_t), taking s's attention block of ops::flash_attention_library_bytes for f32 first (no
// launch); false, for the run, where the pool cannot give it, with one line when T >= 256. The
// launchers run only after available() said yes, so they allocate nothing.
bool gemm_attention_available(Stream& s, void* native, int64_t B, int64_t T, int64_t C, int64_t NH);
void gemm_attention_forward(Stream& s, void* native, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                            int64_t C, int64_t NH, bool tf32);
void gemm_attention_backward(Stream& s, void* native, float* dqkv, const float* dout, const float* qkv,
                             const float* out, const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                             bool tf32, bool accumulate);

// ---- activations over n elements (n may be 0) -----------------------------------------------
// Per-element math: zt::gelu_forward_elem / gelu_grad_elem / relu_*_elem in kernels/elementwise.h.
void gelu_forward(void* stream, void* out, const void* in, DType dtype, int64_t n);
void gelu_backward(void* stream, void* din, const void* in, const void* dout, DType dtype,
                   int64_t n);  // din +=
void relu_forward(void* stream, void* out, const void* in, DType dtype, int64_t n);
void relu_backward(void* stream, void* din, const void* in, const void* dout, DType dtype,
                   int64_t n);  // din +=

// ---- fused classifier: logits [N,ld] (dlogits in place when compute_grad), losses [N] ---------
// logits f32, bf16 or f16; columns [V, ld) are padding (dlogits 0). targets [N] int32; target < 0 =
// ignored row (loss 0, gradient row 0 when compute_grad). dloss_scale: nullptr, or one device fp32
// read by the kernel; dlogits use dloss * *dloss_scale.
void classifier_forward_backward(void* stream, void* logits, DType dtype, float* losses,
                                 const int32_t* targets, int64_t N, int64_t ld, int64_t V, float dloss,
                                 bool compute_grad, const float* dloss_scale);
// ---- LM head over logits rows of ld >= V elements (blas_ops.cu; ops.h lm_head_forward/backward):
// logits, dlogits, in, wte, din of `act` (f32, f16, bf16), dwte fp32 -------------------------------
void lm_head_forward(void* stream, void* logits, const void* in, const void* wte, DType act, int64_t N, int64_t C,
                     int64_t V, int64_t ld, bool tf32);
void lm_head_backward(void* stream, void* din, float* dwte, const void* dlogits, const void* in, const void* wte,
                      DType act, int64_t N, int64_t C, int64_t V, int64_t ld, bool tf32);
// The same GEMMs on cuBLASLt (lt_matmul.cu): false, having launched nothing, where cuBLASLt
// refuses one (op_table.cc then runs the plain path above).
bool lt_lm_head_forward(void* stream, void* logits, const void* in, const void* wte, DType act, int64_t N, int64_t C,
                        int64_t V, int64_t ld, bool tf32);
bool lt_lm_head_backward(void* stream, void* din, float* dwte, const void* dlogits, const void* in, const void* wte,
                         DType act, int64_t N, int64_t C, int64_t V, int64_t ld, bool tf32);

// ---- vocabulary-parallel cross-entropy over a shard logits [N,V] of ids [v_begin, v_begin+V) of
// v_total; semantics of kernels/ops.h (a target >= v_total makes the row's sum/loss NaN); logits
// of `dtype` (f32, bf16, f16), statistics and losses fp32 -------------------------------------------
void row_max(void* stream, float* out, const void* logits, DType dtype, int64_t N, int64_t V, int64_t v_begin,
             int64_t v_total);
void vocab_partials(void* stream, float* out, const void* logits, DType dtype, const float* max,
                    const int32_t* targets, int64_t N, int64_t V, int64_t v_begin, int64_t v_total);
void vocab_loss_grad(void* stream, void* logits, DType dtype, float* losses, const float* max,
                     const float* sumexp, const float* target_logit, const int32_t* targets,
                     int64_t N, int64_t V, int64_t v_begin, int64_t v_total, float dloss,
                     bool compute_grad, const float* dloss_scale);

// ---- optimizers over n fp32 elements (n may be 0) --------------------------------------------
// Per-element math: zt::adamw_elem / sgd_elem in kernels/elementwise.h. bias_correction1/2 =
// 1 - beta^step, computed once on the host by ops.cc (zt::adamw_bias_correction), so both
// backends use the same values.
void adamw_update(void* stream, float* params, const float* grads, float* m, float* v, int64_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float bias_correction1, float bias_correction2, float grad_scale);
void sgd_update(void* stream, float* params, const float* grads, float* momentum_buf, int64_t n,
                float lr, float momentum, float weight_decay, bool nesterov, float grad_scale);

// ---- reductions ---------------------------------------------------------------------------------
// Two-phase (CUB style): ops.cc asks for the workspace size, allocates it from the device pool on
// `stream`, and passes it in. n may be 0 (out[0] = 0).
size_t sum_squares_workspace_bytes(int64_t n);
// out[0] (device fp32) = sum(x^2), accumulated in double/fixed order: deterministic run to run.
void sum_squares(void* stream, float* out, const float* x, int64_t n, void* workspace,
                 size_t workspace_bytes);
// out[0] = sum(x), the same passes without squaring (workspace: sum_squares_workspace_bytes(n)).
void sum(void* stream, float* out, const float* x, int64_t n, void* workspace, size_t workspace_bytes);
// out[j] = in[0,j] (+ or max) in[1,j] ... in[S-1,j] for in [S,n], fp32, slices in index order.
void reduce_slices(void* stream, float* out, const float* in, int64_t S, int64_t n, bool take_max);

}  // namespace zt::cuda_ops
