// Element-type conversion on a CUDA stream (between f32, f16 and bf16), bit-identical to the host conversions
// in src/core/dtype.h. Includes no CUDA header, so any translation unit may call it.
#pragma once

#include <cstddef>

#include "core/dtype.h"
#include "runtime/stream.h"

namespace zt {

// Converts n elements of src_type at `src` into dst_type at `dst`, asynchronously on `stream`
// (a CUDA stream; both buffers device memory of its GPU, or memory it can access). Equal types
// (any dtype) are a plain copy; otherwise both must be f32, f16 or bf16. The buffers must not
// overlap unless dst == src and the types are equal.
void launch_cast(Stream& stream, void* dst, DType dst_type, const void* src, DType src_type,
                 size_t n);

}  // namespace zt
