// The CUDA backend's op table: every entry runs its launcher (kernels/cuda/cuda_ops.h,
// optimizers/cuda/multi_tensor.h) inside a cuda::TaskSpan (the checked downcast to a CUDA stream,
// and the observer's event pair). Built only with CUDA; includes no CUDA header.
#include "core/status.h"
#include "kernels/cuda/cast.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_table.h"
#include "memory/caching_allocator.h"
#include "optimizers/cuda/multi_tensor.h"
#include "optimizers/optimizers.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/device.h"

namespace zt {

namespace {

#define ZT_CUDA_ENTRY(ns, op)                    \
  t.op = [](Stream& s, auto... a) {              \
    const cuda::TaskSpan span(s, #op);           \
    ns::op(span.native(), a...);                 \
  }

// Workspace from the device pool, freed right after the launch: the pool hands it out again only
// to later work on this stream (stream-ordered reuse), which runs after these kernels.
template <typename Launch>
void with_workspace(Stream& s, size_t bytes, const char* tag, Launch&& launch) {
  CachingAllocator& pool = s.device().memory();
  void* workspace = bytes ? pool.allocate(bytes, s, tag) : nullptr;
  try {
    launch(workspace, bytes);
  } catch (...) {
    if (workspace) pool.free(workspace);
    throw;
  }
  if (workspace) pool.free(workspace);
}

OpTable make_cuda_table() {
  OpTable t;
  t.backend = Backend::kCuda;
  ZT_CUDA_ENTRY(cuda_ops, fill);
  ZT_CUDA_ENTRY(cuda_ops, scale);
  ZT_CUDA_ENTRY(cuda_ops, add);
  ZT_CUDA_ENTRY(cuda_ops, accumulate);
  ZT_CUDA_ENTRY(cuda_ops, accumulate_peer);
  ZT_CUDA_ENTRY(cuda_ops, encoder_forward);
  ZT_CUDA_ENTRY(cuda_ops, encoder_backward);
  ZT_CUDA_ENTRY(cuda_ops, layernorm_forward);
  ZT_CUDA_ENTRY(cuda_ops, layernorm_backward);
  // The device's math mode decides the GEMMs' compute type (runtime/device.h MathMode).
  t.matmul_forward = [](Stream& s, auto... a) {
    const cuda::TaskSpan span(s, "matmul_forward");
    cuda_ops::matmul_forward(span.native(), a..., s.device().math_mode().tf32);
  };
  t.matmul_backward = [](Stream& s, auto... a) {
    const cuda::TaskSpan span(s, "matmul_backward");
    cuda_ops::matmul_backward(span.native(), a..., s.device().math_mode().tf32);
  };
  // The LM head over padded logits rows: the GEMMs' compute type as matmul_forward/backward.
  t.lm_head_forward = [](Stream& s, auto... a) {
    const cuda::TaskSpan span(s, "lm_head_forward");
    cuda_ops::lm_head_forward(span.native(), a..., s.device().math_mode().tf32);
  };
  t.lm_head_backward = [](Stream& s, auto... a) {
    const cuda::TaskSpan span(s, "lm_head_backward");
    cuda_ops::lm_head_backward(span.native(), a..., s.device().math_mode().tf32);
  };
  ZT_CUDA_ENTRY(cuda_ops, attention_forward);
  ZT_CUDA_ENTRY(cuda_ops, attention_backward);
  ZT_CUDA_ENTRY(cuda_ops, flash_attention_forward);
  ZT_CUDA_ENTRY(cuda_ops, flash_attention_backward);
  ZT_CUDA_ENTRY(cuda_ops, gelu_forward);
  ZT_CUDA_ENTRY(cuda_ops, gelu_backward);
  ZT_CUDA_ENTRY(cuda_ops, relu_forward);
  ZT_CUDA_ENTRY(cuda_ops, relu_backward);
  ZT_CUDA_ENTRY(cuda_ops, classifier_forward_backward);
  ZT_CUDA_ENTRY(cuda_ops, adamw_update);
  ZT_CUDA_ENTRY(cuda_ops, sgd_update);
  ZT_CUDA_ENTRY(optim::cuda_kernels, loss_scale_update);
  ZT_CUDA_ENTRY(cuda_ops, position_forward);
  ZT_CUDA_ENTRY(cuda_ops, position_backward);
  ZT_CUDA_ENTRY(cuda_ops, bias_forward);
  ZT_CUDA_ENTRY(cuda_ops, bias_backward);
  ZT_CUDA_ENTRY(cuda_ops, row_max);
  ZT_CUDA_ENTRY(cuda_ops, vocab_partials);
  ZT_CUDA_ENTRY(cuda_ops, vocab_loss_grad);
  ZT_CUDA_ENTRY(cuda_ops, reduce_slices);

  t.cast = [](Stream& s, void* dst, DType dst_type, const void* src, DType src_type, int64_t n) {
    const cuda::TaskSpan span(s, "cast");
    launch_cast(s, dst, dst_type, src, src_type, static_cast<size_t>(n));
  };
  t.sum = [](Stream& s, float* out, const float* x, int64_t n) {
    const cuda::TaskSpan span(s, "sum");
    with_workspace(s, cuda_ops::sum_squares_workspace_bytes(n), "sum workspace",
                   [&](void* ws, size_t bytes) { cuda_ops::sum(span.native(), out, x, n, ws, bytes); });
  };
  t.sum_squares = [](Stream& s, float* out, const float* x, int64_t n) {
    const cuda::TaskSpan span(s, "sum_squares");
    with_workspace(s, cuda_ops::sum_squares_workspace_bytes(n), "sum_squares workspace",
                   [&](void* ws, size_t bytes) { cuda_ops::sum_squares(span.native(), out, x, n, ws, bytes); });
  };
  // CUDA kernels read the device copy of a segment list (optimizers.cc checks it is set).
  t.adamw_multi = [](Stream& s, const optim::OptimizerSegment*, size_t count, const optim::OptimizerSegment* device,
                     int64_t chunks, DType param_dtype, DType grad_dtype, const optim::AdamWArgs& a,
                     const optim::StepScalars& sc, uint64_t step) {
    const cuda::TaskSpan span(s, "adamw_multi");
    const auto num_segs = static_cast<int64_t>(count);
    with_workspace(s, optim::cuda_kernels::update_workspace_bytes(num_segs), "adamw_multi workspace",
                   [&](void* ws, size_t bytes) {
                     optim::cuda_kernels::adamw_multi(span.native(), device, num_segs, chunks, param_dtype,
                                                      grad_dtype, a, sc, step, ws, bytes);
                   });
  };
  t.sgd_multi = [](Stream& s, const optim::OptimizerSegment*, size_t count, const optim::OptimizerSegment* device,
                   int64_t chunks, DType param_dtype, DType grad_dtype, const optim::SgdConfig& hp,
                   const optim::StepScalars& sc) {
    const cuda::TaskSpan span(s, "sgd_multi");
    const auto num_segs = static_cast<int64_t>(count);
    with_workspace(s, optim::cuda_kernels::update_workspace_bytes(num_segs), "sgd_multi workspace",
                   [&](void* ws, size_t bytes) {
                     optim::cuda_kernels::sgd_multi(span.native(), device, num_segs, chunks, param_dtype,
                                                    grad_dtype, hp, sc, ws, bytes);
                   });
  };
  t.unscale_check = [](Stream& s, const optim::GradSegment*, size_t count, const optim::GradSegment* device,
                       int64_t chunks, DType grad_dtype, const float* inv_loss_scale, float* norms_out,
                       int num_out, float* found_inf) {
    const cuda::TaskSpan span(s, "unscale_check");
    const auto num_segs = static_cast<int64_t>(count);
    with_workspace(s, optim::cuda_kernels::unscale_check_workspace_bytes(num_segs, chunks),
                   "unscale_check workspace", [&](void* ws, size_t bytes) {
                     optim::cuda_kernels::unscale_check(span.native(), device, num_segs, chunks, grad_dtype,
                                                        inv_loss_scale, norms_out, num_out, found_inf, ws, bytes);
                   });
  };
  return t;
}

#undef ZT_CUDA_ENTRY

}  // namespace

const OpTable& cuda_op_table() {
  static const OpTable table = make_cuda_table();
  return table;
}

}  // namespace zt
