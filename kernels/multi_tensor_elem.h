// Per-element math of the mixed-precision optimizer ops, shared by the CPU loops
// (kernels/cpu/multi_tensor.cc) and the CUDA kernels (kernels/cuda/multi_tensor.cu): the chunking of multi-tensor lists,
// rounding of the fp32 master into the 16-bit working copy (nearest-even or stochastic), and the
// dynamic loss-scale transition. One definition, so both backends compute the same thing.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/host_device.h"
#include "core/philox.h"

namespace zt::optim {

// Both backends cut every segment of a list into chunks of kMultiTensorChunk elements (the last
// one shorter): a CPU task / CUDA block covers one chunk, and unscale_check's partial sums are
// per chunk, combined chunk by chunk in segment order. The chunking fixes the summation order,
// so the norms do not depend on the thread count or the GPU.
constexpr int64_t kMultiTensorChunk = int64_t{1} << 14;

ZT_HOST_DEVICE ZT_FORCEINLINE int64_t multi_tensor_chunks(int64_t n) {
  return (n + kMultiTensorChunk - 1) / kMultiTensorChunk;
}

// AdamW hyper-parameters as both backends' kernels take them: the bias corrections 1 - beta^step
// are computed once on the host (zt::adamw_bias_correction), as for ops::adamw_update.
struct AdamWArgs {
  float lr, beta1, beta2, eps, bias_correction1, bias_correction2;
};

// ---- stochastic rounding -----------------------------------------------------------------------
// x rounds to one of its two neighbouring representable values, the upper (in magnitude) with
// probability equal to x's distance from the lower divided by their spacing, so the rounding is
// unbiased: E[round(x)] = x. `r` is a uniform 32-bit random word. NaN -> canonical NaN (as the
// nearest-even conversions); beyond the largest finite value the upper neighbour is infinity.

// The random word of element `index` (= segment rng_offset + i) at optimizer step `step`.
ZT_HOST_DEVICE ZT_FORCEINLINE uint32_t stochastic_rounding_bits(uint64_t seed, uint64_t step,
                                                                uint64_t index) {
  return philox_u32(seed, step, index);
}

// bf16 keeps the high 16 bits of the float: adding 16 random bits below them carries into the
// kept part with probability (discarded bits) / 2^16, exactly the distance ratio (the float's bits
// are linear in its value between two neighbouring bf16 values).
ZT_HOST_DEVICE ZT_FORCEINLINE uint16_t float_to_bf16_bits_stochastic(float x, uint32_t r) {
  const uint32_t u = float_as_bits(x);
  const uint32_t rounded = (u + (r & 0xffffu)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fffu)
                                         : static_cast<uint16_t>(rounded);
}

// f16 has normal and subnormal ranges with different spacings relative to fp32, so the
// neighbours are found by value: lo = the half at or below |x| (from the nearest-even result), hi
// = the next half up (65536 past the largest finite half, i.e. the step to infinity); the
// fraction (|x| - lo) / (hi - lo) is exact (the spacing is a power of two) and is compared with 24
// random bits.
ZT_HOST_DEVICE ZT_FORCEINLINE uint16_t float_to_half_bits_stochastic(float x, uint32_t r) {
  const uint32_t u = float_as_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const float ax = bits_as_float(u & 0x7fffffffu);
  if (!(ax == ax)) return 0x7fffu;  // NaN
  uint16_t lo = float_to_half_bits(ax);
  const float nearest = half_bits_to_float(lo);
  if (nearest == ax) return static_cast<uint16_t>(sign | lo);  // exact (includes inf and 0)
  if (nearest > ax) --lo;
  const float lo_value = half_bits_to_float(lo);
  const float hi_value =
      lo == 0x7bffu ? 65536.0f : half_bits_to_float(static_cast<uint16_t>(lo + 1));
  const float fraction = (ax - lo_value) / (hi_value - lo_value);
  const bool up =
      static_cast<float>(r >> 8) < fraction * 16777216.0f;  // P = fraction (2^-24 steps)
  return static_cast<uint16_t>(sign | (lo + (up ? 1 : 0)));
}

// The working copy's value from the fp32 master, nearest-even (core/dtype.h) or stochastic.
template <typename T>
ZT_HOST_DEVICE ZT_FORCEINLINE T round_stochastic(float x, uint32_t r);
template <>
ZT_HOST_DEVICE ZT_FORCEINLINE float round_stochastic<float>(float x, uint32_t) {
  return x;
}
template <>
ZT_HOST_DEVICE ZT_FORCEINLINE BFloat16 round_stochastic<BFloat16>(float x, uint32_t r) {
  return BFloat16{float_to_bf16_bits_stochastic(x, r)};
}
template <>
ZT_HOST_DEVICE ZT_FORCEINLINE Half round_stochastic<Half>(float x, uint32_t r) {
  return Half{float_to_half_bits_stochastic(x, r)};
}

// The 16-bit working copy of a master weight: round to nearest even, or stochastically with the
// bits keyed by (seed, step, global element index). One definition for the CPU and CUDA updates.
template <typename P, bool kStochastic>
ZT_HOST_DEVICE ZT_FORCEINLINE P working_from_master(float master, uint64_t seed, uint64_t step, uint64_t index) {
  if constexpr (kStochastic) {
    return round_stochastic<P>(master, stochastic_rounding_bits(seed, step, index));
  } else {
    return from_float<P>(master);
  }
}

// ---- dynamic loss scaling -------------------------------------------------------------------
// The transition of optimizers.h (LossScaleState / LossScaleConfig), written once for the host
// function, the CPU stream op and the CUDA kernel. Every operation is a single fp32 rounding, so
// host and device agree bit for bit. A collapsed state stays collapsed.
template <typename State, typename Config>
ZT_HOST_DEVICE ZT_FORCEINLINE void loss_scale_transition_elem(State& st, bool overflow,
                                                              const Config& c) {
  if (overflow) {
    st.good_steps = 0.0f;
    st.skipped += 1.0f;
    if (st.hysteresis_left > 1.0f) {
      st.hysteresis_left -= 1.0f;
    } else if (st.scale <= c.min_scale) {
      st.collapsed = 1.0f;
    } else {
      const float backed_off = st.scale * c.backoff;
      st.scale = backed_off > c.min_scale ? backed_off : c.min_scale;
    }
  } else {
    st.good_steps += 1.0f;
    if (st.good_steps >= static_cast<float>(c.growth_interval)) {
      const float grown = st.scale * c.growth;
      st.scale = grown < c.max_scale ? grown : c.max_scale;
      st.good_steps = 0.0f;
      st.hysteresis_left = static_cast<float>(c.hysteresis);
    }
  }
  st.inv_scale = 1.0f / st.scale;
}

// ---- the step's global scalars ----------------------------------------------------------------
// clip_factor of optimizers.h, written once for the CPU stream op and the one-thread CUDA kernel:
// a sequential loop in double (no reassociation), sqrt and one division correctly rounded on both.
ZT_HOST_DEVICE ZT_FORCEINLINE void clip_factor_elem(const float* parts, const float* include, int ranks, int row,
                                                    float max_norm, double* out, float* clip, float* found_inf) {
  const int partials = row - 2;
  double sq = 0.0, loss = 0.0;
  bool flagged = false;
  for (int g = 0; g < ranks; ++g) {
    const float* p = parts + static_cast<int64_t>(g) * row;
    const float* in = include + static_cast<int64_t>(g) * row;
    for (int k = 0; k < partials; ++k)
      if (in[k] != 0.0f) sq += static_cast<double>(p[k]);
    if (in[partials] != 0.0f) loss += static_cast<double>(p[partials]);
    flagged = flagged || p[partials + 1] > 0.0f;
  }
  const double norm = sqrt(sq);
  // loss - loss is 0 exactly when loss is finite (inf - inf and NaN give NaN).
  const bool skipped = flagged || !(loss - loss == 0.0);
  out[0] = norm;
  out[1] = loss;
  out[2] = skipped ? 1.0 : 0.0;
  *clip = !skipped && max_norm > 0.0f && norm > static_cast<double>(max_norm)
              ? static_cast<float>(static_cast<double>(max_norm) / norm)
              : 1.0f;
  if (found_inf != nullptr && skipped && !(*found_inf > 0.0f)) *found_inf = 1.0f;
}

}  // namespace zt::optim
