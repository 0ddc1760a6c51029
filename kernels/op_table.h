// The op table: one per backend (as ggml-backend's ggml_backend_i), the entry points behind
// kernels/ops.h and optimizers/optimizers.h. ops.cc / optimizers.cc validate once, then ask the
// stream's backend for a kernel (find_kernel); where it has none they use a generic fallback
// composed of other ops, or refuse with one sentence naming the op, the dtypes and the backend.
//
// Adding an op: one line in ZT_OPS, one entry below (raw pointers and sizes, already validated),
// one registration line per backend in kernels/<backend>/op_table.cc. A backend-specific fast
// path is an entry that one backend fills and another leaves null; the public function tries it
// and falls back. A non-null entry takes every dtype ops.cc accepts for its op. Backend types never appear here: each
// backend's registration file does its own checked downcast of the Stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/dtype.h"
#include "kernels/matmul_types.h"
#include "runtime/backend.h"
#include "runtime/stream.h"

namespace zt::optim {
struct OptimizerSegment;
struct GradSegment;
struct AdamWArgs;
struct SgdConfig;
struct StepScalars;
struct LossScaleConfig;
struct LossScaleState;
}  // namespace zt::optim

namespace zt {

// Every op of the tables: (enumerator, name as it appears in messages and on the trace).
// The dtypes a refusal names (require_kernel, refuse_op) are those of its floating tensors: cast {dst,
// src}; accumulate, accumulate_peer {dtype}; adamw_multi / sgd_multi {param, grad}; unscale_check {grad};
// loss_scale_update, clip_factor {}; matmul_forward / matmul_backward / matmul_gelu_forward /
// matmul_backward_dgelu {in, out, bias} of their MatmulTypes; layernorm_forward, layernorm_backward,
// residual_layernorm_forward {activation dtype, weight dtype}; lm_head_* {activation dtype};
// flash_attention_*, fused_attention_*, decode_attention {qkv's dtype: f32, f16 or bf16}; classifier_forward_backward
// {logits}; fill, add, encoder_forward / encoder_backward, gelu_forward / gelu_backward, relu_forward /
// relu_backward {activation dtype: f32, f16 or bf16}; position_forward, bias_forward {activation dtype,
// parameter dtype}; position_backward, bias_backward {activation dtype}; row_max, vocab_partials,
// vocab_loss_grad {logits}; every other op {f32}.
#define ZT_OPS(X)                                              \
  X(kFill, fill)                                               \
  X(kScale, scale)                                             \
  X(kAdd, add)                                                 \
  X(kCast, cast)                                               \
  X(kAccumulate, accumulate)                                   \
  X(kAccumulatePeer, accumulate_peer)                          \
  X(kEncoderForward, encoder_forward)                          \
  X(kEncoderBackward, encoder_backward)                        \
  X(kLayernormForward, layernorm_forward)                      \
  X(kLayernormBackward, layernorm_backward)                    \
  X(kMatmulForward, matmul_forward)                            \
  X(kMatmulBackward, matmul_backward)                          \
  X(kAttentionForward, attention_forward)                      \
  X(kAttentionBackward, attention_backward)                    \
  X(kFlashAttentionForward, flash_attention_forward)           \
  X(kFlashAttentionBackward, flash_attention_backward)         \
  X(kGeluForward, gelu_forward)                                \
  X(kGeluBackward, gelu_backward)                              \
  X(kReluForward, relu_forward)                                \
  X(kReluBackward, relu_backward)                              \
  X(kClassifierForwardBackward, classifier_forward_backward)   \
  X(kAdamwUpdate, adamw_update)                                \
  X(kSgdUpdate, sgd_update)                                    \
  X(kSumSquares, sum_squares)                                  \
  X(kSum, sum)                                                \
  X(kAdamwMulti, adamw_multi)                                  \
  X(kSgdMulti, sgd_multi)                                      \
  X(kUnscaleCheck, unscale_check)                              \
  X(kLossScaleUpdate, loss_scale_update)                       \
  X(kClipFactor, clip_factor)                                  \
  X(kPositionForward, position_forward)                        \
  X(kPositionBackward, position_backward)                      \
  X(kBiasForward, bias_forward)                                \
  X(kBiasBackward, bias_backward)                              \
  X(kRowMax, row_max)                                          \
  X(kVocabPartials, vocab_partials)                            \
  X(kVocabLossGrad, vocab_loss_grad)                           \
  X(kReduceSlices, reduce_slices)                              \
  X(kMatmulGeluForward, matmul_gelu_forward)                   \
  X(kMatmulBackwardDgelu, matmul_backward_dgelu)               \
  X(kResidualLayernormForward, residual_layernorm_forward)     \
  X(kFusedAttentionForward, fused_attention_forward)           \
  X(kFusedAttentionBackward, fused_attention_backward)         \
  X(kLmHeadForward, lm_head_forward)                           \
  X(kLmHeadBackward, lm_head_backward)                          \
  X(kDecodeAttention, decode_attention)

enum class OpId {
#define ZT_OP_ENUM(id, name) id,
  ZT_OPS(ZT_OP_ENUM)
#undef ZT_OP_ENUM
      kCount
};
const char* op_name(OpId op);

struct OpTable {
  Backend backend = Backend::kCpu;

  // ---- entries (nullptr: no kernel); arguments as kernels/cpu/cpu_ops.h, after validation ------
  // fill, add, the encoder and GELU: every floating pointer except encoder_backward's dwte/dwpe
  // (fp32) is of `dtype` (f32, f16 or bf16); 16-bit values are widened, computed as fp32 and
  // rounded once (ops.h).
  void (*fill)(Stream&, void* x, DType dtype, int64_t n, float value) = nullptr;
  void (*scale)(Stream&, float* x, int64_t n, float alpha) = nullptr;
  void (*add)(Stream&, void* out, const void* a, const void* b, DType dtype, int64_t n) = nullptr;
  void (*cast)(Stream&, void* dst, DType dst_type, const void* src, DType src_type, int64_t n) = nullptr;
  void (*accumulate)(Stream&, void* dst, const void* src, DType dtype, int64_t n) = nullptr;
  // src: another device's memory this device can access (ops.h accumulate_peer). No fallback:
  // without it the collectives stage through receive buffers (comm/communicator.cc).
  void (*accumulate_peer)(Stream&, void* dst, const void* src, DType dtype, int64_t n) = nullptr;
  // V = rows of the wte shard, which holds ids [v_begin, v_begin + V) of v_total (> 0); wpe/dwpe
  // may be nullptr (no position term).
  void (*encoder_forward)(Stream&, void* out, const int32_t* tokens, const void* wte, const void* wpe, DType dtype,
                          int64_t B, int64_t T, int64_t C, int64_t V, int64_t v_begin, int64_t v_total) = nullptr;
  void (*encoder_backward)(Stream&, float* dwte, float* dwpe, const void* dout, DType dtype, const int32_t* tokens,
                           int64_t B, int64_t T, int64_t C, int64_t V, int64_t v_begin,
                           int64_t v_total) = nullptr;
  // x, dx of `act` (f32, f16 or bf16); wpe of `wt` (f32 or `act`); dwpe fp32.
  void (*position_forward)(Stream&, void* x, const void* wpe, DType act, DType wt, int64_t R, int64_t C,
                           int64_t row0, int64_t T) = nullptr;
  void (*position_backward)(Stream&, float* dwpe, const void* dx, DType act, int64_t R, int64_t C, int64_t row0,
                            int64_t T) = nullptr;
  // The layernorm family: in, out, dout, din of `act` (f32, f16 or bf16), weight and bias of `wt`
  // (f32 or `act`); mean, rstd, dweight, dbias fp32 (ops.h layernorm_forward/backward).
  void (*layernorm_forward)(Stream&, void* out, float* mean, float* rstd, const void* in, DType act,
                            const void* weight, const void* bias, DType wt, int64_t N, int64_t C,
                            float eps) = nullptr;
  void (*layernorm_backward)(Stream&, void* din, float* dweight, float* dbias, const void* dout, const void* in,
                             DType act, const void* weight, DType wt, const float* mean, const float* rstd,
                             int64_t N, int64_t C) = nullptr;
  // The matmul family takes the dtypes of kernels/matmul_types.h (pointers typed by `t`); `in`
  // may be nullptr in matmul_backward when dweight is (ops.cc's fallbacks ask for din alone);
  // overwrite_din: din = dout @ weight instead of += (ops.h matmul_backward).
  void (*matmul_forward)(Stream&, void* out, const void* in, const void* weight, const void* bias,
                         MatmulTypes t, int64_t N, int64_t C, int64_t OC) = nullptr;
  void (*matmul_backward)(Stream&, void* din, float* dweight, float* dbias, const void* dout,
                          const void* in, const void* weight, MatmulTypes t, int64_t N, int64_t C,
                          int64_t OC, bool overwrite_din) = nullptr;
  // x, dout of `act` (f32, f16 or bf16); bias of `wt` (f32 or `act`); dbias fp32.
  void (*bias_forward)(Stream&, void* x, const void* bias, DType act, DType wt, int64_t N, int64_t C) = nullptr;
  void (*bias_backward)(Stream&, float* dbias, const void* dout, DType act, int64_t N, int64_t C) = nullptr;
  void (*attention_forward)(Stream&, float* out, float* preatt, float* att, const float* qkv, int64_t B,
                            int64_t T, int64_t C, int64_t NH) = nullptr;
  void (*attention_backward)(Stream&, float* dqkv, float* dpreatt, float* datt, const float* dout,
                             const float* qkv, const float* att, int64_t B, int64_t T, int64_t C,
                             int64_t NH) = nullptr;
  // qkv, out, dout, dqkv of `dtype` (f32, f16, bf16); lse, scratch fp32. scratch:
  // flash_attention_scratch_bytes(B, T, C, NH) bytes. accumulate false: dqkv is overwritten.
  void (*flash_attention_forward)(Stream&, void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                                  int64_t C, int64_t NH, DType dtype) = nullptr;
  void (*flash_attention_backward)(Stream&, void* dqkv, const void* dout, const void* qkv,
                                   const void* out, const float* lse, float* scratch, int64_t B,
                                   int64_t T, int64_t C, int64_t NH, DType dtype, bool accumulate) = nullptr;
  // out [n, C], qkv [S, 3C] of `dtype` (f32, f16, bf16), 1 <= n <= S (ops.h decode_attention).
  void (*decode_attention)(Stream&, void* out, const void* qkv, int64_t n, int64_t S, int64_t C, int64_t NH,
                           DType dtype) = nullptr;
  // out/din, in, dout of `dtype`; din += (a 16-bit din: read, added in fp32, rounded once).
  void (*gelu_forward)(Stream&, void* out, const void* in, DType dtype, int64_t n) = nullptr;
  void (*gelu_backward)(Stream&, void* din, const void* in, const void* dout, DType dtype, int64_t n) = nullptr;
  void (*relu_forward)(Stream&, void* out, const void* in, DType dtype, int64_t n) = nullptr;
  void (*relu_backward)(Stream&, void* din, const void* in, const void* dout, DType dtype, int64_t n) = nullptr;
  // logits [N, ld] of `logits_dtype` (f32, bf16 or f16), the first V <= ld columns real (the rest
  // a padded vocabulary's: no probability, dlogits 0).
  void (*classifier_forward_backward)(Stream&, void* logits, DType logits_dtype, float* losses,
                                      const int32_t* targets, int64_t N, int64_t ld, int64_t V,
                                      float dloss, bool compute_grad, const float* dloss_scale) = nullptr;
  // Vocabulary-parallel cross-entropy over a shard logits [N, V] holding ids [v_begin, v_begin + V)
  // of v_total (> 0).
  // V: the shard's columns; columns at ids >= v_total (padding) take no part (vocab ops, ops.h).
  // logits of `dtype` (f32, bf16 or f16; vocab_loss_grad writes the gradient in it, rounded once);
  // out, max, sumexp, target_logit, losses fp32.
  void (*row_max)(Stream&, float* out, const void* logits, DType dtype, int64_t N, int64_t V, int64_t v_begin,
                  int64_t v_total) = nullptr;
  void (*vocab_partials)(Stream&, float* out, const void* logits, DType dtype, const float* max,
                         const int32_t* targets, int64_t N, int64_t V, int64_t v_begin, int64_t v_total) = nullptr;
  void (*vocab_loss_grad)(Stream&, void* logits, DType dtype, float* losses, const float* max, const float* sumexp,
                          const float* target_logit, const int32_t* targets, int64_t N, int64_t V,
                          int64_t v_begin, int64_t v_total, float dloss, bool compute_grad,
                          const float* dloss_scale) = nullptr;
  // out[n] = sum (take_max false) or max (true) over in[S, n] in slice order.
  void (*reduce_slices)(Stream&, float* out, const float* in, int64_t S, int64_t n, bool take_max) = nullptr;
  void (*adamw_update)(Stream&, float* params, const float* grads, float* m, float* v, int64_t n, float lr,
                       float beta1, float beta2, float eps, float weight_decay, float bias_correction1,
                       float bias_correction2, float grad_scale) = nullptr;
  void (*sgd_update)(Stream&, float* params, const float* grads, float* momentum_buf, int64_t n, float lr,
                     float momentum, float weight_decay, bool nesterov, float grad_scale) = nullptr;
  void (*sum_squares)(Stream&, float* out, const float* x, int64_t n) = nullptr;
  void (*sum)(Stream&, float* out, const float* x, int64_t n) = nullptr;

  // Optimizer ops (optimizers/optimizers.h). A segment list comes as its host copy (`host`,
  // `count` entries; may be gone once the entry returns) and its device copy (may be null on
  // the CPU backend); `chunks` = the list's multi_tensor_chunks total, > 0.
  void (*adamw_multi)(Stream&, const optim::OptimizerSegment* host, size_t count,
                      const optim::OptimizerSegment* device, int64_t chunks, DType param_dtype,
                      DType grad_dtype, const optim::AdamWArgs& a, const optim::StepScalars& sc,
                      uint64_t step) = nullptr;
  void (*sgd_multi)(Stream&, const optim::OptimizerSegment* host, size_t count,
                    const optim::OptimizerSegment* device, int64_t chunks, DType param_dtype, DType grad_dtype,
                    const optim::SgdConfig& hp, const optim::StepScalars& sc) = nullptr;
  void (*unscale_check)(Stream&, const optim::GradSegment* host, size_t count, const optim::GradSegment* device,
                        int64_t chunks, DType grad_dtype, const float* inv_loss_scale, float* norms_out,
                        int num_out, float* found_inf) = nullptr;
  void (*loss_scale_update)(Stream&, optim::LossScaleState* state, const float* found_inf,
                            const optim::LossScaleConfig& c) = nullptr;
  void (*clip_factor)(Stream&, const float* parts, const float* include, int ranks, int row, float max_norm,
                      double* out, float* clip, float* found_inf) = nullptr;
  // Fused GEMM epilogues (ops.h matmul_gelu_forward / matmul_backward_dgelu); bias, dbias may be
  // nullptr. Without them ops.cc composes matmul_forward/_backward, gelu_forward/_backward, cast.
  void (*matmul_gelu_forward)(Stream&, void* out_gelu, void* pre_gelu, const void* in, const void* weight,
                              const void* bias, MatmulTypes t, int64_t N, int64_t C, int64_t OC) = nullptr;
  void (*matmul_backward_dgelu)(Stream&, void* dpre, float* dbias, const void* dout, const void* weight,
                                const void* pre_gelu, MatmulTypes t, int64_t N, int64_t C, int64_t OC) = nullptr;
  // residual_out, ln_out, a, b: `act` (f32/f16/bf16); weight, bias: `wt` (f32 or `act`); mean,
  // rstd fp32 (ops.h residual_layernorm_forward).
  void (*residual_layernorm_forward)(Stream&, void* residual_out, void* ln_out, float* mean, float* rstd,
                                     const void* a, const void* b, DType act, const void* weight,
                                     const void* bias, DType wt, int64_t N, int64_t C, float eps) = nullptr;

  // A library's fused causal attention, the flash_attention_* contract (same lse, so either half may
  // pair with the tiled other half). Returns false having launched nothing when it does not serve
  // this call (dtype, shape, library absent or unusable): ops.cc then runs flash_attention_*.
  bool (*fused_attention_forward)(Stream&, void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                                  int64_t C, int64_t NH, DType dtype) = nullptr;
  bool (*fused_attention_backward)(Stream&, void* dqkv, const void* dout, const void* qkv, const void* out,
                                   const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                                   bool accumulate) = nullptr;
  // Not an op (no OpId): what the library's fused attention asks for at a shape, its plans built
  // now for the device's later calls (ops.h fused_attention_workspace): false when the library is
  // absent or cannot start; else each direction's workspace bytes, -1 where it declines.
  bool (*fused_attention_workspace)(Stream&, int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                                    bool deterministic, int64_t* forward, int64_t* backward) = nullptr;
  // The LM head over a padded vocabulary (ops.h lm_head_forward/backward): logits/dlogits rows of
  // ld >= V elements, only the first V columns written or read. logits, dlogits, in, wte, din of
  // `act` (f32, f16 or bf16); dwte fp32; din or dwte may be nullptr.
  void (*lm_head_forward)(Stream&, void* logits, const void* in, const void* wte, DType act, int64_t N,
                          int64_t C, int64_t V, int64_t ld) = nullptr;
  void (*lm_head_backward)(Stream&, void* din, float* dwte, const void* dlogits, const void* in, const void* wte,
                           DType act, int64_t N, int64_t C, int64_t V, int64_t ld) = nullptr;

  bool has_entry(OpId op) const;
};

// Backend registration: each backend's table, built once (kernels/cpu/op_table.cc,
// kernels/cuda/op_table.cc; the latter exists only in builds with CUDA).
const OpTable& cpu_op_table();
const OpTable& cuda_op_table();

// The table in use for a backend; nullptr when this build has none (CUDA with ZT_CUDA=OFF).
const OpTable* op_table(Backend backend);

// The table of s's backend if it has a kernel for `op`, else nullptr (the caller falls back).
const OpTable* find_kernel(Stream& s, OpId op);
// find_kernel, or a zt::Error(kInvalidArgument): "<op>: the <backend> backend has no kernel for
// <dtypes> and no fallback applies".
const OpTable& require_kernel(Stream& s, OpId op, std::initializer_list<DType> dtypes);
[[noreturn]] void refuse_op(Stream& s, OpId op, std::initializer_list<DType> dtypes);

// Tests: replaces a backend's table for this object's lifetime (e.g. one with an entry removed,
// to run a fallback). Not synchronized with launches: install it while nothing launches.
class ScopedOpTable {
 public:
  ScopedOpTable(Backend backend, const OpTable* table);
  ~ScopedOpTable();
  ScopedOpTable(const ScopedOpTable&) = delete;
  ScopedOpTable& operator=(const ScopedOpTable&) = delete;

 private:
  Backend backend_;
  const OpTable* previous_;
};

}  // namespace zt
