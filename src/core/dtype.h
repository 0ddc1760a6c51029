// Element types (f32, f16, bf16) and their conversions, shared by host loops and CUDA kernels.
// Conversions are pure integer code, bit-identical to CUDA's host __float2half_rn /
// __float2bfloat16_rn / __half2float / __bfloat162float (round-to-nearest-even, overflow to inf,
// NaN -> canonical 0x7fff), so the CPU and CUDA backends agree bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/host_device.h"

namespace zt {

// kI32 holds token ids and class labels; the floating types hold everything else.
enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3 };

constexpr size_t dtype_size(DType t) { return t == DType::kF32 || t == DType::kI32 ? 4 : 2; }
const char* dtype_name(DType t);
// Accepts "fp32"/"f32"/"float32", "fp16"/"f16"/"float16"/"half", "bf16"/"bfloat16".
DType parse_dtype(std::string_view name);

// Storage types: just the bits, so they are trivially copyable and identical on host/device.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

ZT_HOST_DEVICE ZT_FORCEINLINE uint32_t float_as_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
ZT_HOST_DEVICE ZT_FORCEINLINE float bits_as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// float -> IEEE binary16, round to nearest even.
ZT_HOST_DEVICE ZT_FORCEINLINE uint16_t float_to_half_bits(float f) {
  const uint32_t x = float_as_bits(f);
  const uint32_t u = x & 0x7fffffffu;
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t result;
  uint32_t remainder;  // the discarded bits, left-aligned: > 0x80000000 rounds up
  if (u >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(u == 0x7f800000u ? (sign | 0x7c00u) : 0x7fffu);
  } else if (u > 0x477fefffu) {  // rounds to a magnitude above 65504: overflow to inf
    result = sign | 0x7bffu;
    remainder = 0x80000000u;  // with the odd 0x7bff this always rounds up to 0x7c00
  } else if (u >= 0x38800000u) {  // normal half
    remainder = u << 19;
    result = sign | ((u - 0x38000000u) >> 13);
  } else if (u < 0x33000001u) {  // rounds to zero (<= 2^-25)
    remainder = u;
    result = sign;
  } else {  // subnormal half
    const uint32_t exponent = u >> 23;
    const uint32_t shift = 0x7eu - exponent;
    const uint32_t mantissa = (u & 0x7fffffu) | 0x800000u;
    remainder = mantissa << (32u - shift);
    result = (sign | (mantissa >> shift)) & 0xffffu;
  }
  if (remainder > 0x80000000u || (remainder == 0x80000000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(result);
}

// IEEE binary16 -> float, exact; NaN becomes the canonical quiet NaN 0x7fffffff.
ZT_HOST_DEVICE ZT_FORCEINLINE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_as_float(mantissa ? 0x7fffffffu : (sign | 0x7f800000u));
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24 is exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_as_float(sign | float_as_bits(magnitude));
  }
  return bits_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> bfloat16, round to nearest even; NaN -> 0x7fff.
ZT_HOST_DEVICE ZT_FORCEINLINE uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = float_as_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  const uint32_t rounding_bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding_bias) >> 16);
}

ZT_HOST_DEVICE ZT_FORCEINLINE float bf16_bits_to_float(uint16_t b) {
  return bits_as_float(static_cast<uint32_t>(b) << 16);
}

// float -> TF32 (fp32's 8-bit exponent, 10-bit mantissa), returned as a float whose low 13
// mantissa bits are zero: round to nearest even, overflow to inf, inf/NaN unchanged. The rounding
// point of --tf32 GEMM inputs (kernels/ops.h, MathMode); tensor cores may round ties differently.
ZT_HOST_DEVICE ZT_FORCEINLINE float round_to_tf32(float f) {
  const uint32_t x = float_as_bits(f);
  if ((x & 0x7f800000u) == 0x7f800000u) return f;
  const uint32_t rounding_bias = 0xfffu + ((x >> 13) & 1u);
  return bits_as_float((x + rounding_bias) & ~0x1fffu);
}

ZT_HOST_DEVICE ZT_FORCEINLINE float to_float(float v) { return v; }
ZT_HOST_DEVICE ZT_FORCEINLINE float to_float(Half v) { return half_bits_to_float(v.bits); }
ZT_HOST_DEVICE ZT_FORCEINLINE float to_float(BFloat16 v) { return bf16_bits_to_float(v.bits); }

// from_float<T>(x): round-to-nearest-even conversion into storage type T.
template <typename T>
ZT_HOST_DEVICE ZT_FORCEINLINE T from_float(float v);
template <>
ZT_HOST_DEVICE ZT_FORCEINLINE float from_float<float>(float v) { return v; }
template <>
ZT_HOST_DEVICE ZT_FORCEINLINE Half from_float<Half>(float v) { return Half{float_to_half_bits(v)}; }
template <>
ZT_HOST_DEVICE ZT_FORCEINLINE BFloat16 from_float<BFloat16>(float v) {
  return BFloat16{float_to_bf16_bits(v)};
}

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct DTypeOf<Half> {
  static constexpr DType value = DType::kF16;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::kBF16;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kI32;
};

}  // namespace zt
