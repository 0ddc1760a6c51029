// Synchronous CPU kernels behind optimizers/optimizers.h; optimizers.cc enqueues them on a CPU
// stream (with a copy of the segment list) after validating the arguments. Semantics are those
// of optimizers.h; the device scalars (inverse loss scale, skip flag, loss-scale state) are read
// when these functions run, i.e. in stream order.
#pragma once

#include <cstdint>
#include <span>

#include "core/dtype.h"
#include "kernels/multi_tensor_elem.h"
#include "kernels/optimizer_types.h"

namespace zt::optim::cpu_kernels {

void adamw_multi(std::span<const OptimizerSegment> segs, DType param_dtype, DType grad_dtype,
                 const AdamWArgs& a, const StepScalars& sc, uint64_t step);
void sgd_multi(std::span<const OptimizerSegment> segs, DType param_dtype, DType grad_dtype,
               const SgdConfig& hp, const StepScalars& sc);
// found_inf may be nullptr (not written); inv_loss_scale nullptr = 1.
void unscale_check(std::span<const GradSegment> segs, DType grad_dtype, const float* inv_loss_scale,
                   float* norms_out, int num_out, float* found_inf);
void loss_scale_update(LossScaleState* state, const float* found_inf, const LossScaleConfig& c);
void clip_factor(const float* parts, const float* include, int ranks, int row, float max_norm, double* out,
                 float* clip, float* found_inf);

}  // namespace zt::optim::cpu_kernels
