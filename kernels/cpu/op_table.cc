// The CPU backend's op table: every entry enqueues the synchronous kernel (kernels/cpu/,
// the optimizers' multi-tensor kernels in kernels/cpu/multi_tensor.h) on the CPU stream's worker, through cpu::enqueue's checked downcast.
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/multi_tensor.h"
#include "kernels/op_table.h"
#include "kernels/optimizer_types.h"
#include "runtime/cpu/cpu_device.h"

namespace zt {

namespace {

// The arguments are plain values (pointers, sizes, scalars), captured by copy: the kernel runs
// later, on the stream's worker.
#define ZT_CPU_ENTRY(ns, op) \
  t.op = [](Stream& s, auto... a) { cpu::enqueue(s, [=] { ns::op(a...); }, #op); }

// The optimizers' multi-segment updates and the gradient check. The worker gets a copy of the
// host list: the caller's may be gone by the time it runs.
void add_multi_tensor_updates(OpTable& t) {
  t.adamw_multi = [](Stream& s, const optim::OptimizerSegment* host, size_t count, const optim::OptimizerSegment*,
                     int64_t, DType param_dtype, DType grad_dtype, const optim::AdamWArgs& a,
                     const optim::StepScalars& sc, uint64_t step) {
    cpu::enqueue(
        s,
        [list = std::vector<optim::OptimizerSegment>(host, host + count), param_dtype, grad_dtype, a, sc, step] {
          optim::cpu_kernels::adamw_multi(list, param_dtype, grad_dtype, a, sc, step);
        },
        "adamw_multi");
  };
  t.sgd_multi = [](Stream& s, const optim::OptimizerSegment* host, size_t count, const optim::OptimizerSegment*,
                   int64_t, DType param_dtype, DType grad_dtype, const optim::SgdConfig& hp,
                   const optim::StepScalars& sc) {
    cpu::enqueue(
        s,
        [list = std::vector<optim::OptimizerSegment>(host, host + count), param_dtype, grad_dtype, hp, sc] {
          optim::cpu_kernels::sgd_multi(list, param_dtype, grad_dtype, hp, sc);
        },
        "sgd_multi");
  };
  t.unscale_check = [](Stream& s, const optim::GradSegment* host, size_t count, const optim::GradSegment*, int64_t,
                       DType grad_dtype, const float* inv_loss_scale, float* norms_out, int num_out,
                       float* found_inf) {
    cpu::enqueue(
        s,
        [list = std::vector<optim::GradSegment>(host, host + count), grad_dtype, inv_loss_scale, norms_out, num_out,
         found_inf] {
          optim::cpu_kernels::unscale_check(list, grad_dtype, inv_loss_scale, norms_out, num_out, found_inf);
        },
        "unscale_check");
  };
}

OpTable make_cpu_table() {
  OpTable t;
  t.backend = Backend::kCpu;
  ZT_CPU_ENTRY(cpu_kernels, fill);
  ZT_CPU_ENTRY(cpu_kernels, scale);
  ZT_CPU_ENTRY(cpu_kernels, add);
  ZT_CPU_ENTRY(cpu_kernels, cast);
  ZT_CPU_ENTRY(cpu_kernels, accumulate);
  // One address space: reading a peer device's memory is the same loop (same bits).
  t.accumulate_peer = [](Stream& s, void* dst, const void* src, DType dtype, int64_t n) {
    cpu::enqueue(s, [=] { cpu_kernels::accumulate(dst, src, dtype, n); }, "accumulate_peer");
  };
  ZT_CPU_ENTRY(cpu_kernels, encoder_forward);
  ZT_CPU_ENTRY(cpu_kernels, encoder_backward);
  ZT_CPU_ENTRY(cpu_kernels, layernorm_forward);
  ZT_CPU_ENTRY(cpu_kernels, layernorm_backward);
  // The device's math mode as it is when the op is enqueued (runtime/device.h MathMode).
#define ZT_CPU_MATMUL_ENTRY(op)                                            \
  t.op = [](Stream& s, auto... a) {                                        \
    const bool tf32 = s.device().math_mode().tf32;                         \
    cpu::enqueue(s, [=] { cpu_kernels::op(a..., tf32); }, #op);            \
  }
  ZT_CPU_MATMUL_ENTRY(matmul_forward);
  ZT_CPU_MATMUL_ENTRY(matmul_backward);
  ZT_CPU_MATMUL_ENTRY(matmul_gelu_forward);
  ZT_CPU_MATMUL_ENTRY(matmul_backward_dgelu);
#undef ZT_CPU_MATMUL_ENTRY
  ZT_CPU_ENTRY(cpu_kernels, attention_forward);
  ZT_CPU_ENTRY(cpu_kernels, attention_backward);
  ZT_CPU_ENTRY(cpu_kernels, flash_attention_forward);
  ZT_CPU_ENTRY(cpu_kernels, flash_attention_backward);
  ZT_CPU_ENTRY(cpu_kernels, decode_attention);
  ZT_CPU_ENTRY(cpu_kernels, gelu_forward);
  ZT_CPU_ENTRY(cpu_kernels, gelu_backward);
  ZT_CPU_ENTRY(cpu_kernels, relu_forward);
  ZT_CPU_ENTRY(cpu_kernels, relu_backward);
  ZT_CPU_ENTRY(cpu_kernels, classifier_forward_backward);
  ZT_CPU_ENTRY(cpu_kernels, adamw_update);
  ZT_CPU_ENTRY(cpu_kernels, sgd_update);
  ZT_CPU_ENTRY(cpu_kernels, sum_squares);
  ZT_CPU_ENTRY(cpu_kernels, sum);
  ZT_CPU_ENTRY(cpu_kernels, position_forward);
  ZT_CPU_ENTRY(cpu_kernels, position_backward);
  ZT_CPU_ENTRY(cpu_kernels, bias_forward);
  ZT_CPU_ENTRY(cpu_kernels, bias_backward);
  ZT_CPU_ENTRY(cpu_kernels, row_max);
  ZT_CPU_ENTRY(cpu_kernels, vocab_partials);
  ZT_CPU_ENTRY(cpu_kernels, vocab_loss_grad);
  ZT_CPU_ENTRY(cpu_kernels, reduce_slices);
  ZT_CPU_ENTRY(optim::cpu_kernels, loss_scale_update);
  ZT_CPU_ENTRY(optim::cpu_kernels, clip_factor);
  ZT_CPU_ENTRY(cpu_kernels, residual_layernorm_forward);
  // No attention library on the CPU: the fused entries always decline, the tiled kernels serve.
  t.fused_attention_forward = [](Stream&, void*, float*, const void*, int64_t, int64_t, int64_t, int64_t,
                                 DType) { return false; };
  t.fused_attention_backward = [](Stream&, void*, const void*, const void*, const void*, const float*, int64_t,
                                  int64_t, int64_t, int64_t, DType, bool) { return false; };
  // The LM head over padded logits rows: TF32 rounding as matmul_forward/backward.
  t.lm_head_forward = [](Stream& s, void* logits, const void* in, const void* wte, DType act, int64_t N,
                         int64_t C, int64_t V, int64_t ld) {
    const bool tf32 = s.device().math_mode().tf32;
    cpu::enqueue(
        s, [=] { cpu_kernels::lm_head_forward(logits, in, wte, act, N, C, V, ld, tf32); }, "lm_head_forward");
  };
  t.lm_head_backward = [](Stream& s, void* din, float* dwte, const void* dlogits, const void* in, const void* wte,
                          DType act, int64_t N, int64_t C, int64_t V, int64_t ld) {
    const bool tf32 = s.device().math_mode().tf32;
    cpu::enqueue(
        s, [=] { cpu_kernels::lm_head_backward(din, dwte, dlogits, in, wte, act, N, C, V, ld, tf32); },
        "lm_head_backward");
  };

  add_multi_tensor_updates(t);
  return t;
}

#undef ZT_CPU_ENTRY

}  // namespace

const OpTable& cpu_op_table() {
  static const OpTable table = make_cpu_table();
  return table;
}

}  // namespace zt
