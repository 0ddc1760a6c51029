// Mixed-precision optimizer ops over flat shards: the fused multi-tensor AdamW / SGD update (fp32
// master weights and moments, 16-bit working copy re-derived in the same pass), the fused
// unscale + non-finite check + squared-norm pass over gradient shards, and the device-side
// dynamic loss-scale update. Every op runs asynchronously on the stream (CPU backend: on the
// stream's worker; CUDA: kernels); the skip flag and the loss scale are read from device memory
// when the op executes, so deciding to skip a step or to change the scale needs no host sync.
//
// Multi-tensor lists: one op call covers every segment of a shard (one CUDA launch per list).
// The engine builds its lists once (its buffers are resident) and keeps a device copy.
#pragma once

#include <cstdint>
#include <span>

#include "core/dtype.h"
#include "kernels/optimizer_types.h"
#include "runtime/stream.h"

namespace zt::optim {

// Per element, in fp32: g = grad * inv_loss_scale * clip; the AdamW (adamw_elem, decoupled decay)
// or SGD (sgd_elem) update of master and moments; then param = round(master) in `param_dtype`
// (nearest-even or stochastic). With param_dtype f32 and param == master, the master is the param.
// Bits equal the per-tensor ops::adamw_update / sgd_update on the same fp32 values.
// Precisely: the factor inv_loss_scale * clip (each read from device memory, a null one as 1) is
// formed once (one fp32 product) and passed as adamw_elem's / sgd_elem's grad_scale, so the bits
// are those of ops::adamw_update(..., grad_scale
// = inv_loss_scale * clip); with a power-of-two loss scale that is also grad * inv * clip exactly.
// Stochastic rounding draws philox_u32(seed, step, rng_offset + i) for element i of a segment
// (kernels/multi_tensor_elem.h): reproducible, independent of threads and chunking.
// Validation (zt::Error naming the op): dtypes f32/bf16/f16; for every segment with n > 0 non-null
// param, grad, master, m (and v for AdamW; SGD ignores v, which may be null); a 16-bit param must
// not be the master's memory; on CUDA `segs.device` must be set. Empty lists launch nothing
// (but still count the update when `sc.update_count` is set).
void adamw_multi(Stream& s, SegmentList<OptimizerSegment> segs, DType param_dtype, DType grad_dtype,
                 const AdamWConfig& hp, const StepScalars& sc);
void sgd_multi(Stream& s, SegmentList<OptimizerSegment> segs, DType param_dtype, DType grad_dtype,
               const SgdConfig& hp, const StepScalars& sc);

// The host update of optimizer offload: the same per-element loops (adamw_elem / sgd_elem, chunked
// by kMultiTensorChunk, vectorised, over parallel_for) as the CPU backend's adamw_multi /
// sgd_multi, run synchronously on the calling thread over host memory. `sc`'s pointers are host
// floats: the caller copies the device's overflow flag and inverse loss scale first, so the host
// update reads the very values the device update reads and the bits are the device optimizer's
// (with the CUDA backend: as far as its kernels' per-element math is the same, no FMA contraction).
// Validation as adamw_multi / sgd_multi.
void adamw_host(std::span<const OptimizerSegment> segs, DType param_dtype, DType grad_dtype, const AdamWConfig& hp,
                const StepScalars& sc);
void sgd_host(std::span<const OptimizerSegment> segs, DType param_dtype, DType grad_dtype, const SgdConfig& hp,
              const StepScalars& sc);


// One pass over every segment: norms_out[k] = sum over segments with out == k, in list order, of
// (grad * inv_loss_scale)^2 accumulated in fp32-or-wider in a fixed order that does not depend on
// thread count (norms_out entries with no segment are set to 0); found_inf[0] = 1 if any element
// is inf or NaN, else 0 (overwritten). num_out = entries of norms_out. Deterministic.
// inv_loss_scale nullptr = 1; found_inf may be nullptr (then only the norms are written); every
// segment's `out` must be in [0, num_out). An element is checked after unscaling (grad * inv):
// a finite gradient that overflows when multiplied by an inverse scale > 1 counts as non-finite.
// Partial sums are per kMultiTensorChunk chunk (multi_tensor_elem.h) in double, chunks added in
// order per segment: the CPU and CUDA orders inside a chunk differ, so the backends can differ in
// the last bits, each deterministic.
void unscale_check(Stream& s, SegmentList<GradSegment> segs, DType grad_dtype, const float* inv_loss_scale,
                   float* norms_out, int num_out, float* found_inf);

// Dynamic loss scaling, state in device memory (LossScaleState, 6 floats; kernels/optimizer_types.h). Runs after the step's
// optimizer op on the same stream. On overflow (found_inf != 0): good_steps = 0; if hysteresis_left
// > 1 it is decremented, else, if scale <= min_scale the state becomes collapsed (collapsed = 1),
// else scale = max(scale * backoff, min_scale). Without overflow: ++good_steps; when it reaches
// growth_interval, scale = min(scale * growth, max_scale), good_steps = 0, hysteresis_left =
// hysteresis. inv_scale = 1/scale (exact for powers of two). skipped counts overflowed steps.
// Also: a backoff does not restore hysteresis_left (only growth does); collapsed stays 1 once set
// (the scale no longer changes on overflow; the caller is expected to stop); a NaN found_inf counts
// as an overflow. Every step is a single fp32 operation, so device and host agree bit for bit.
// Validation: growth >= 1, backoff in (0, 1], growth_interval >= 1, hysteresis >= 1,
// 0 < min_scale <= max_scale < inf, and the initial scale within [min_scale, max_scale].
// Host-side initial state for scale s0 (copy it to the device once).
LossScaleState initial_loss_scale_state(float scale, const LossScaleConfig& c);
// The same transition on the host (the reference the tests and the trainer's reporting use).
void loss_scale_transition(LossScaleState& st, bool overflow, const LossScaleConfig& c);
void loss_scale_update(Stream& s, LossScaleState* state, const float* found_inf, const LossScaleConfig& c);

// The step's global gradient norm, loss sum, skip decision and clip factor from every rank's
// scalars, on the device (no host round trip between the gradient check and the update).
// parts: `ranks` rows of `row` floats (in rank order): row - 2 gradient-norm partials
// (unscale_check's squared norms), the rank's loss sum, its overflow flag. include: the same
// shape, != 0 where a partial or loss sum counts (a tensor group's replicated parts and losses
// count once); flags always count. In double, in row-major order (rank, then entry), skipping
// entries not included — the order and arithmetic of a host loop over the same floats, so the
// bits equal it on every backend:
//   sq = sum of included partials, loss = sum of included loss sums, norm = sqrt(sq);
//   skipped = some flag > 0, or loss not finite;
//   clip = !skipped && max_norm > 0 && norm > max_norm ? float(double(max_norm) / norm) : 1.
// out (3 doubles): {norm, loss, skipped ? 1 : 0}; clip (1 float); found_inf (optional, this
// rank's combined overflow flag): set to 1 when skipped and it was not > 0, so that the update and
// the loss-scale update skip a step whose only fault is a non-finite loss.
// Validation: ranks >= 1, row >= 2, non-null parts, include, out, clip; max_norm >= 0.
void clip_factor(Stream& s, const float* parts, const float* include, int ranks, int row, float max_norm,
                 double* out, float* clip, float* found_inf);

}  // namespace zt::optim
