// The CUDA backend's op table: every entry runs its launcher (kernels/cuda/cuda_ops.h,
// kernels/cuda/multi_tensor.h) inside a cuda::TaskSpan (the checked downcast to a CUDA stream,
// and the observer's event pair). Built only with CUDA; includes no CUDA header.
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/status.h"
#include "kernels/cuda/cast.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/multi_tensor.h"
#include "kernels/cuda/stream_blocks.h"
#include "kernels/op_table.h"
#include "kernels/ops.h"
#include "kernels/optimizer_types.h"
#include "memory/caching_allocator.h"
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

// The matmul family's plain-path scratch (a 16-bit result's fp32 GEMM output before the epilogue):
// the stream's matmul scratch block (kernels/cuda/stream_blocks.h), kept and grown on demand, not a
// pool block per call: these ops run inside a captured micro-batch, and a capture refuses pool
// allocations, so a matmul cuBLASLt refuses must allocate nothing after its eager warm-up.
template <typename Launch>
void with_stream_scratch(Stream& s, void* native, size_t bytes, Launch&& launch) {
  launch(bytes ? cuda_ops::detail::stream_block(s, native, cuda_ops::detail::StreamBlock::kMatmulScratch, bytes)
               : nullptr);
}

bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// The matmul family: cuBLASLt with its epilogues, and where it refuses a problem the plain cuBLAS
// path (kernels/cuda/cuda_ops.h). The device's math mode decides the GEMMs' compute type
// (runtime/device.h MathMode). The plain path's scratch is the stream's matmul scratch block.
void add_matmuls(OpTable& t) {
  t.matmul_forward = [](Stream& s, void* out, const void* in, const void* w, const void* bias, MatmulTypes ty,
                        int64_t N, int64_t C, int64_t OC) {
    const cuda::TaskSpan span(s, "matmul_forward");
    const bool tf32 = s.device().math_mode().tf32;
    if (cuda_ops::lt_matmul_forward(span.native(), out, in, w, bias, ty, N, C, OC, tf32)) return;
    with_stream_scratch(s, span.native(), cuda_ops::matmul_forward_scratch_bytes(ty, N, OC), [&](void* ws) {
      cuda_ops::matmul_forward(span.native(), out, in, w, bias, ty, N, C, OC, tf32, ws);
    });
  };
  t.matmul_backward = [](Stream& s, void* din, float* dw, float* db, const void* dout, const void* in, const void* w,
                         MatmulTypes ty, int64_t N, int64_t C, int64_t OC, bool overwrite_din) {
    const cuda::TaskSpan span(s, "matmul_backward");
    const bool tf32 = s.device().math_mode().tf32;
    const bool done = cuda_ops::lt_matmul_backward(span.native(), din, dw, db, dout, in, w, ty, N, C, OC,
                                                   overwrite_din, tf32);
    if (!done) cuda_ops::matmul_backward(span.native(), din, dw, db, dout, in, w, ty, N, C, OC, overwrite_din, tf32);
  };
  t.matmul_gelu_forward = [](Stream& s, void* out, void* pre, const void* in, const void* w, const void* bias,
                             MatmulTypes ty, int64_t N, int64_t C, int64_t OC) {
    const cuda::TaskSpan span(s, "matmul_gelu_forward");
    const bool tf32 = s.device().math_mode().tf32;
    if (cuda_ops::lt_matmul_gelu_forward(span.native(), out, pre, in, w, bias, ty, N, C, OC, tf32)) return;
    with_stream_scratch(s, span.native(), cuda_ops::matmul_gelu_forward_scratch_bytes(ty, N, OC), [&](void* ws) {
      cuda_ops::matmul_gelu_forward(span.native(), out, pre, in, w, bias, ty, N, C, OC, tf32, ws);
    });
  };
  t.matmul_backward_dgelu = [](Stream& s, void* dpre, float* db, const void* dout, const void* w, const void* pre,
                               MatmulTypes ty, int64_t N, int64_t C, int64_t OC) {
    const cuda::TaskSpan span(s, "matmul_backward_dgelu");
    const bool tf32 = s.device().math_mode().tf32;
    if (cuda_ops::lt_matmul_backward_dgelu(span.native(), dpre, db, dout, w, pre, ty, N, C, OC, tf32)) return;
    with_stream_scratch(s, span.native(), cuda_ops::matmul_backward_dgelu_scratch_bytes(ty, N, C), [&](void* ws) {
      cuda_ops::matmul_backward_dgelu(span.native(), dpre, db, dout, w, pre, ty, N, C, OC, tf32, ws);
    });
  };
  // The LM head over padded logits rows: cuBLASLt, the plain cuBLAS GEMMs where it refuses; the
  // GEMMs' compute type as matmul_forward/backward.
  t.lm_head_forward = [](Stream& s, auto... a) {
    const cuda::TaskSpan span(s, "lm_head_forward");
    const bool tf32 = s.device().math_mode().tf32;
    if (!cuda_ops::lt_lm_head_forward(span.native(), a..., tf32)) cuda_ops::lm_head_forward(span.native(), a..., tf32);
  };
  t.lm_head_backward = [](Stream& s, auto... a) {
    const cuda::TaskSpan span(s, "lm_head_backward");
    const bool tf32 = s.device().math_mode().tf32;
    if (!cuda_ops::lt_lm_head_backward(span.native(), a..., tf32)) cuda_ops::lm_head_backward(span.native(), a..., tf32);
  };
}

// A library's attention where it serves the call (decided before the span, so a declined call
// leaves no task on the trace); ops.cc runs the tiled entries otherwise. fp32: the GEMM attention
// (cuBLAS; TF32 tensor cores under the device's tf32 math mode). 16 bits: cuDNN's SDPA, which wants
// 16-byte aligned operands (k and v sit C elements into each qkv row): views at odd offsets decline.
bool fp32_attention(Stream& s, DType dtype, int64_t B, int64_t T, int64_t C, int64_t NH) {
  return dtype == DType::kF32 && cuda_ops::gemm_attention_available(s, s.native_handle(), B, T, C, NH);
}

// Operands cuDNN cannot take (k and v start C elements into each qkv row: C * 2 bytes, not a
// multiple of 16, when C is not a multiple of 8; or a view at an odd offset): the tiled kernel
// serves, which the run's fallback line names (cuda_ops::announce_attention_fallback).
bool cudnn_operands_aligned(std::initializer_list<const void*> pointers, bool backward, int64_t B, int64_t T,
                            int64_t C, int64_t NH, DType dtype, bool deterministic) {
  if (aligned16(pointers)) return true;
  cuda_ops::announce_attention_fallback(backward, B, T, C, NH, dtype, deterministic,
                                        "it needs 16-byte aligned q, k, v and gradients; k starts " +
                                            std::to_string(C * dtype_size(dtype)) +
                                            " bytes into each qkv row: a width that is a multiple of 8 avoids it");
  return false;
}

void add_fused_attention(OpTable& t) {
  t.fused_attention_forward = [](Stream& s, void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                                 int64_t C, int64_t NH, DType dtype) {
    if (fp32_attention(s, dtype, B, T, C, NH)) {
      const cuda::TaskSpan span(s, "gemm_attention_forward");
      cuda_ops::gemm_attention_forward(s, span.native(), static_cast<float*>(out), lse,
                                       static_cast<const float*>(qkv), B, T, C, NH, s.device().math_mode().tf32);
      return true;
    }
    const bool det = s.device().math_mode().deterministic_attention;
    if (!cudnn_operands_aligned({out, lse, qkv, static_cast<const char*>(qkv) + C * dtype_size(dtype)}, false, B, T,
                                C, NH, dtype, det) ||
        !cuda_ops::cudnn_attention_available(s, s.native_handle(), false, B, T, C, NH, dtype, det))
      return false;
    const cuda::TaskSpan span(s, "fused_attention_forward");
    cuda_ops::cudnn_attention_forward(s, span.native(), out, lse, qkv, B, T, C, NH, dtype, det);
    return true;
  };
  t.fused_attention_backward = [](Stream& s, void* dqkv, const void* dout, const void* qkv, const void* out,
                                  const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                                  bool accumulate) {
    if (fp32_attention(s, dtype, B, T, C, NH)) {
      const cuda::TaskSpan span(s, "gemm_attention_backward");
      cuda_ops::gemm_attention_backward(s, span.native(), static_cast<float*>(dqkv), static_cast<const float*>(dout),
                                        static_cast<const float*>(qkv), static_cast<const float*>(out), lse, B, T, C,
                                        NH, s.device().math_mode().tf32, accumulate);
      return true;
    }
    const bool det = s.device().math_mode().deterministic_attention;
    if (!cudnn_operands_aligned({dqkv, dout, qkv, out, lse, static_cast<const char*>(qkv) + C * dtype_size(dtype)},
                                true, B, T, C, NH, dtype, det) ||
        !cuda_ops::cudnn_attention_available(s, s.native_handle(), true, B, T, C, NH, dtype, det))
      return false;
    const cuda::TaskSpan span(s, "fused_attention_backward");
    cuda_ops::cudnn_attention_backward(s, span.native(), dqkv, dout, qkv, out, lse, B, T, C, NH, dtype,
                                       accumulate, det);
    return true;
  };
  t.fused_attention_workspace = [](Stream& s, int64_t B, int64_t T, int64_t C, int64_t NH, DType dtype,
                                   bool deterministic, int64_t* forward, int64_t* backward) {
    if (dtype == DType::kF32) {
      const ops::AttentionWorkspace ws = ops::gemm_attention_workspace(T, NH);
      *forward = ws.forward;
      *backward = ws.backward;
      return true;
    }
    return cuda_ops::cudnn_attention_workspace(s, B, T, C, NH, dtype, deterministic, forward, backward);
  };
}

// Casts, reductions and the optimizers' multi-segment updates: pool scratch sized per call.
void add_reductions_and_updates(OpTable& t) {
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
  add_matmuls(t);
  ZT_CUDA_ENTRY(cuda_ops, attention_forward);
  ZT_CUDA_ENTRY(cuda_ops, attention_backward);
  ZT_CUDA_ENTRY(cuda_ops, flash_attention_forward);
  ZT_CUDA_ENTRY(cuda_ops, flash_attention_backward);
  ZT_CUDA_ENTRY(cuda_ops, decode_attention);
  ZT_CUDA_ENTRY(cuda_ops, gelu_forward);
  ZT_CUDA_ENTRY(cuda_ops, gelu_backward);
  ZT_CUDA_ENTRY(cuda_ops, relu_forward);
  ZT_CUDA_ENTRY(cuda_ops, relu_backward);
  ZT_CUDA_ENTRY(cuda_ops, classifier_forward_backward);
  ZT_CUDA_ENTRY(cuda_ops, adamw_update);
  ZT_CUDA_ENTRY(cuda_ops, sgd_update);
  ZT_CUDA_ENTRY(optim::cuda_kernels, loss_scale_update);
  ZT_CUDA_ENTRY(optim::cuda_kernels, clip_factor);
  ZT_CUDA_ENTRY(cuda_ops, position_forward);
  ZT_CUDA_ENTRY(cuda_ops, position_backward);
  ZT_CUDA_ENTRY(cuda_ops, bias_forward);
  ZT_CUDA_ENTRY(cuda_ops, bias_backward);
  ZT_CUDA_ENTRY(cuda_ops, row_max);
  ZT_CUDA_ENTRY(cuda_ops, vocab_partials);
  ZT_CUDA_ENTRY(cuda_ops, vocab_loss_grad);
  ZT_CUDA_ENTRY(cuda_ops, reduce_slices);
  ZT_CUDA_ENTRY(cuda_ops, residual_layernorm_forward);
  add_fused_attention(t);
  add_reductions_and_updates(t);
  return t;
}

#undef ZT_CUDA_ENTRY

}  // namespace

const OpTable& cuda_op_table() {
  static const OpTable table = make_cuda_table();
  return table;
}

}  // namespace zt
