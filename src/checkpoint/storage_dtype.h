// Element types of stored arrays (checkpoint manifests, safetensors files): a superset of the
// compute dtypes, because files also carry integer state and other tools' tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "core/dtype.h"

namespace zt {

enum class StorageDType : uint8_t { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU64, kU32, kU16, kU8, kBool };

size_t storage_dtype_size(StorageDType t);
// Manifest spelling: "f32", "bf16", "i32", "u8", "bool" ...
const char* storage_dtype_name(StorageDType t);
std::optional<StorageDType> parse_storage_dtype(std::string_view name);
// safetensors spelling: "F32", "BF16", "I32", "U8", "BOOL" ...
const char* safetensors_dtype_name(StorageDType t);
std::optional<StorageDType> parse_safetensors_dtype(std::string_view name);

StorageDType to_storage_dtype(DType t);

}  // namespace zt
