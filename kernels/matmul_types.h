// The dtypes of one matmul-family call (kernels/ops.h "matmul"), shared by the op table and both
// backends' kernels: which tensors may be 16-bit, and which stay fp32 (weight/bias gradients).
#pragma once

#include "core/dtype.h"

namespace zt {

// in: in, weight and dout (f32, or one 16-bit type: A and B of the GEMM share it);
// out: out, din, pre_gelu, out_gelu, dpre (f32 or `in`'s 16-bit type);
// bias: the forward bias (f32 or `in`'s 16-bit type). dweight and dbias are always f32.
struct MatmulTypes {
  DType in = DType::kF32;
  DType out = DType::kF32;
  DType bias = DType::kF32;
};

}  // namespace zt
