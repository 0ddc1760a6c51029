// CUDA launchers behind optimizers/optimizers.h (implemented in kernels/cuda/multi_tensor.cu).
// Includes no CUDA header, so optimizers.cc may call them. Contract, as kernels/cuda/cuda_ops.h:
// `stream` is a cudaStream_t; every pointer (segment lists included) is device memory of that
// stream's GPU; launches are asynchronous and each is followed by an error check; arguments are
// validated by optimizers.cc. Workspaces are two-phase (CUB style): optimizers.cc asks for the
// size, allocates it from the device pool on `stream` and frees it after the launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/multi_tensor_elem.h"
#include "kernels/optimizer_types.h"

namespace zt::optim::cuda_kernels {

// total_chunks = sum over segments of multi_tensor_chunks(n) (from the host copy of the list,
// which must hold the same entries as the device copy), > 0.
size_t update_workspace_bytes(int64_t num_segs);
void adamw_multi(void* stream, const OptimizerSegment* segs, int64_t num_segs, int64_t total_chunks,
                 DType param_dtype, DType grad_dtype, const AdamWArgs& a, const StepScalars& sc,
                 uint64_t step, void* workspace, size_t workspace_bytes);
void sgd_multi(void* stream, const OptimizerSegment* segs, int64_t num_segs, int64_t total_chunks,
               DType param_dtype, DType grad_dtype, const SgdConfig& hp, const StepScalars& sc,
               void* workspace, size_t workspace_bytes);

// num_segs and total_chunks may be 0 (the outputs are still written).
size_t unscale_check_workspace_bytes(int64_t num_segs, int64_t total_chunks);
void unscale_check(void* stream, const GradSegment* segs, int64_t num_segs, int64_t total_chunks,
                   DType grad_dtype, const float* inv_loss_scale, float* norms_out, int num_out,
                   float* found_inf, void* workspace, size_t workspace_bytes);

void loss_scale_update(void* stream, LossScaleState* state, const float* found_inf,
                       const LossScaleConfig& c);

// One thread: a handful of ranks times a few hundred floats, in the fixed order of the host loop.
void clip_factor(void* stream, const float* parts, const float* include, int ranks, int row, float max_norm,
                 double* out, float* clip, float* found_inf);

}  // namespace zt::optim::cuda_kernels
