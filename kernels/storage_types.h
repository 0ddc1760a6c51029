// The host-side dtype switches of the kernels templated on their storage type, shared by the CPU
// kernels (kernels/cpu/) and the CUDA launchers (kernels/cuda/): one place that maps a DType (or an
// activation/parameter pair) onto float, Half or BFloat16.
#pragma once

#include "core/dtype.h"
#include "core/status.h"

namespace zt::detail {

// fn(T{}) with T the storage type of a floating dtype (float, Half, BFloat16); `op` names the
// kernel in the internal error for a dtype without one (kI32).
template <typename F>
inline void with_storage_type(DType dtype, const char* op, F&& fn) {
  switch (dtype) {
    case DType::kF32:
      return fn(float{});
    case DType::kF16:
      return fn(Half{});
    case DType::kBF16:
      return fn(BFloat16{});
    case DType::kI32:
      break;
  }
  ZT_CHECK(false, op, ": unsupported dtype ", dtype_name(dtype));
}

// f(T*, W*) (null pointers naming the types) for activations `act` and parameters `wt`: f32/f32, or
// a 16-bit act with f32 or act parameters (the pairs ops.cc accepts for the layernorm ops).
template <typename F>
inline void dispatch_norm_types(const char* op, DType act, DType wt, F&& f) {
  if (act == DType::kF32 && wt == DType::kF32) return f(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  if (act == DType::kBF16 && wt == DType::kF32)
    return f(static_cast<BFloat16*>(nullptr), static_cast<float*>(nullptr));
  if (act == DType::kBF16 && wt == DType::kBF16)
    return f(static_cast<BFloat16*>(nullptr), static_cast<BFloat16*>(nullptr));
  if (act == DType::kF16 && wt == DType::kF32) return f(static_cast<Half*>(nullptr), static_cast<float*>(nullptr));
  if (act == DType::kF16 && wt == DType::kF16) return f(static_cast<Half*>(nullptr), static_cast<Half*>(nullptr));
  ZT_CHECK(false, op, ": unsupported dtypes ", dtype_name(act), " activations with ", dtype_name(wt),
           " parameters");
}

}  // namespace zt::detail
