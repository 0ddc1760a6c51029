// The ops of optimizers/optimizers.h: validate the lists and scalars (a zt::Error naming the op),
// then launch through the op table of the stream's backend (kernels/op_table.h; the CPU entries
// copy the host list, CUDA's read its device copy). Nothing here waits for the work. Also the
// host-side loss-scale state and transition.
#include "optimizers/optimizers.h"

#include <cmath>
#include <vector>

#include "core/status.h"
#include "kernels/cpu/multi_tensor.h"
#include "kernels/elementwise.h"
#include "kernels/multi_tensor_elem.h"
#include "kernels/op_table.h"

namespace zt::optim {

namespace {

bool floating(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

void check_dtype(const char* op, const char* what, DType t) {
  ZT_REQUIRE(floating(t), op, ": the ", what, " dtype is ", dtype_name(t),
             " but must be fp32, bf16 or fp16");
}

// Validates every segment; returns the list's chunk count (0: nothing to do).
int64_t check_segments(const char* op, std::span<const OptimizerSegment> segs, DType param_dtype,
                       bool needs_v) {
  int64_t chunks = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const OptimizerSegment& seg = segs[i];
    ZT_REQUIRE(seg.n >= 0, op, ": segment ", i, " has n = ", seg.n, "; sizes must be >= 0");
    if (seg.n == 0) continue;
    const char* missing = seg.param == nullptr            ? "param"
                          : seg.grad == nullptr           ? "grad"
                          : seg.master == nullptr         ? "master"
                          : seg.m == nullptr              ? "m"
                          : (needs_v && seg.v == nullptr) ? "v"
                                                          : nullptr;
    ZT_REQUIRE(missing == nullptr, op, ": segment ", i, " (n = ", seg.n, ") has a null ", missing,
               " pointer; every buffer of a non-empty segment must be set",
               needs_v ? "" : " (only v may be null for SGD)");
    ZT_REQUIRE(param_dtype == DType::kF32 || seg.param != static_cast<void*>(seg.master), op,
               ": segment ", i, " has its ", dtype_name(param_dtype),
               " working copy at the fp32 master's address; a 16-bit param needs its own buffer");
    chunks += multi_tensor_chunks(seg.n);
  }
  return chunks;
}

// CUDA kernels read the device copy of the list; needed whenever something will be launched.
void check_device_list(Stream& s, const char* op, const void* device_list, bool launches) {
  ZT_REQUIRE(s.backend() != Backend::kCuda || !launches || device_list != nullptr, op,
             ": the segment list has no device copy (segs.device is null), which CUDA kernels "
             "read; copy the list to the device once and pass it");
}

void check_loss_scale_config(const char* op, const LossScaleConfig& c) {
  ZT_REQUIRE(c.growth >= 1.0f && std::isfinite(c.growth), op, ": growth ", c.growth,
             " must be a finite factor >= 1");
  ZT_REQUIRE(c.backoff > 0.0f && c.backoff <= 1.0f, op, ": backoff ", c.backoff,
             " must be in (0, 1]");
  ZT_REQUIRE(c.growth_interval >= 1, op, ": growth_interval ", c.growth_interval,
             " must be >= 1 step");
  ZT_REQUIRE(c.hysteresis >= 1, op, ": hysteresis ", c.hysteresis, " must be >= 1");
  ZT_REQUIRE(c.min_scale > 0.0f && std::isfinite(c.max_scale) && c.min_scale <= c.max_scale, op,
             ": the scale range [", c.min_scale, ", ", c.max_scale,
             "] must be finite with 0 < min_scale <= max_scale");
}

// What adamw_multi and sgd_multi check before launching; returns the list's chunk count.
// The checks every update makes (device or host); returns the chunks of work (0: nothing to do).
int64_t check_host_update(const char* op, std::span<const OptimizerSegment> segs, DType param_dtype,
                          DType grad_dtype, int step, bool needs_v) {
  check_dtype(op, "param", param_dtype);
  check_dtype(op, "grad", grad_dtype);
  ZT_REQUIRE(step >= 1, op, ": step ", step, " must be >= 1 (it counts from 1)");
  return check_segments(op, segs, param_dtype, needs_v);
}

int64_t check_update(Stream& s, const char* op, SegmentList<OptimizerSegment> segs, DType param_dtype,
                     DType grad_dtype, int step, bool needs_v) {
  const int64_t chunks = check_host_update(op, segs.host, param_dtype, grad_dtype, step, needs_v);
  check_device_list(s, op, segs.device, chunks > 0);
  return chunks;
}

}  // namespace

void adamw_multi(Stream& s, SegmentList<OptimizerSegment> segs, DType param_dtype, DType grad_dtype,
                 const AdamWConfig& hp, const StepScalars& sc) {
  constexpr const char* op = "adamw_multi";
  const int64_t chunks = check_update(s, op, segs, param_dtype, grad_dtype, hp.step, /*needs_v=*/true);
  if (chunks == 0 && sc.update_count == nullptr) return;
  const AdamWArgs a{hp.lr,
                    hp.beta1,
                    hp.beta2,
                    hp.eps,
                    adamw_bias_correction(hp.beta1, hp.step),
                    adamw_bias_correction(hp.beta2, hp.step)};
  require_kernel(s, OpId::kAdamwMulti, {param_dtype, grad_dtype})
      .adamw_multi(s, segs.host.data(), segs.host.size(), segs.device, chunks, param_dtype, grad_dtype, a, sc,
                   static_cast<uint64_t>(hp.step));
}

void sgd_multi(Stream& s, SegmentList<OptimizerSegment> segs, DType param_dtype, DType grad_dtype,
               const SgdConfig& hp, const StepScalars& sc) {
  constexpr const char* op = "sgd_multi";
  const int64_t chunks = check_update(s, op, segs, param_dtype, grad_dtype, hp.step, /*needs_v=*/false);
  if (chunks == 0 && sc.update_count == nullptr) return;
  require_kernel(s, OpId::kSgdMulti, {param_dtype, grad_dtype})
      .sgd_multi(s, segs.host.data(), segs.host.size(), segs.device, chunks, param_dtype, grad_dtype, hp, sc);
}

void adamw_host(std::span<const OptimizerSegment> segs, DType param_dtype, DType grad_dtype, const AdamWConfig& hp,
                const StepScalars& sc) {
  if (check_host_update("adamw_host", segs, param_dtype, grad_dtype, hp.step, /*needs_v=*/true) == 0 &&
      sc.update_count == nullptr)
    return;
  const AdamWArgs a{hp.lr,
                    hp.beta1,
                    hp.beta2,
                    hp.eps,
                    adamw_bias_correction(hp.beta1, hp.step),
                    adamw_bias_correction(hp.beta2, hp.step)};
  cpu_kernels::adamw_multi(segs, param_dtype, grad_dtype, a, sc, static_cast<uint64_t>(hp.step));
}

void sgd_host(std::span<const OptimizerSegment> segs, DType param_dtype, DType grad_dtype, const SgdConfig& hp,
              const StepScalars& sc) {
  if (check_host_update("sgd_host", segs, param_dtype, grad_dtype, hp.step, /*needs_v=*/false) == 0 &&
      sc.update_count == nullptr)
    return;
  cpu_kernels::sgd_multi(segs, param_dtype, grad_dtype, hp, sc);
}

void unscale_check(Stream& s, SegmentList<GradSegment> segs, DType grad_dtype,
                   const float* inv_loss_scale, float* norms_out, int num_out, float* found_inf) {
  constexpr const char* op = "unscale_check";
  check_dtype(op, "grad", grad_dtype);
  ZT_REQUIRE(num_out >= 0, op, ": num_out ", num_out, " must be >= 0");
  ZT_REQUIRE(num_out == 0 || norms_out != nullptr, op, ": norms_out is null but num_out is ",
             num_out);
  int64_t chunks = 0;
  for (size_t i = 0; i < segs.host.size(); ++i) {
    const GradSegment& seg = segs.host[i];
    ZT_REQUIRE(seg.n >= 0, op, ": segment ", i, " has n = ", seg.n, "; sizes must be >= 0");
    ZT_REQUIRE(seg.out >= 0 && seg.out < num_out, op, ": segment ", i, " adds to norms_out[",
               seg.out, "] but norms_out has ", num_out, " entries");
    ZT_REQUIRE(seg.n == 0 || seg.grad != nullptr, op, ": segment ", i, " (n = ", seg.n,
               ") has a null grad pointer");
    chunks += multi_tensor_chunks(seg.n);
  }
  if (num_out == 0 && found_inf == nullptr) return;
  check_device_list(s, op, segs.device, !segs.host.empty());
  require_kernel(s, OpId::kUnscaleCheck, {grad_dtype})
      .unscale_check(s, segs.host.data(), segs.host.size(), segs.device, chunks, grad_dtype, inv_loss_scale,
                     norms_out, num_out, found_inf);
}

LossScaleState initial_loss_scale_state(float scale, const LossScaleConfig& c) {
  check_loss_scale_config("initial_loss_scale_state", c);
  ZT_REQUIRE(scale >= c.min_scale && scale <= c.max_scale, "initial_loss_scale_state: scale ",
             scale, " must be within [min_scale, max_scale] = [", c.min_scale, ", ", c.max_scale,
             "]");
  return LossScaleState{scale, 1.0f / scale, 0.0f, static_cast<float>(c.hysteresis), 0.0f, 0.0f};
}

void loss_scale_transition(LossScaleState& st, bool overflow, const LossScaleConfig& c) {
  loss_scale_transition_elem(st, overflow, c);
}

void loss_scale_update(Stream& s, LossScaleState* state, const float* found_inf,
                       const LossScaleConfig& c) {
  constexpr const char* op = "loss_scale_update";
  check_loss_scale_config(op, c);
  ZT_REQUIRE(state != nullptr && found_inf != nullptr, op,
             ": state and found_inf must both point to device memory");
  require_kernel(s, OpId::kLossScaleUpdate, {}).loss_scale_update(s, state, found_inf, c);
}

void clip_factor(Stream& s, const float* parts, const float* include, int ranks, int row, float max_norm,
                 double* out, float* clip, float* found_inf) {
  constexpr const char* op = "clip_factor";
  ZT_REQUIRE(ranks >= 1 && row >= 2, op, ": ", ranks, " ranks of ", row,
             " floats; need at least one rank of a loss sum and a flag");
  ZT_REQUIRE(parts != nullptr && include != nullptr && out != nullptr && clip != nullptr, op,
             ": parts, include, out and clip must point to device memory");
  ZT_REQUIRE(max_norm >= 0.0f, op, ": max_norm ", max_norm, " must be >= 0 (0: no clipping)");
  require_kernel(s, OpId::kClipFactor, {}).clip_factor(s, parts, include, ranks, row, max_norm, out, clip, found_inf);
}

}  // namespace zt::optim
