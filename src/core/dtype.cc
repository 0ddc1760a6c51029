// DType names and parsing.
#include "core/dtype.h"

#include "core/status.h"

namespace zt {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "int32";
  }
  return "?";
}

DType parse_dtype(std::string_view n) {
  if (n == "fp32" || n == "f32" || n == "float32") return DType::kF32;
  if (n == "fp16" || n == "f16" || n == "float16" || n == "half") return DType::kF16;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  if (n == "int32" || n == "i32") return DType::kI32;
  ZT_THROW(ErrorKind::kInvalidArgument, "unknown dtype '", n, "'; expected fp32, fp16 or bf16");
}

}  // namespace zt
