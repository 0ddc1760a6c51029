// Names and sizes of stored element types.
#include "checkpoint/storage_dtype.h"

#include <array>

namespace zt {
namespace {

struct DTypeRow {
  StorageDType type;
  size_t size;
  const char* manifest_name;
  const char* safetensors_name;
};

constexpr std::array<DTypeRow, 13> kRows = {{
    {StorageDType::kF64, 8, "f64", "F64"},
    {StorageDType::kF32, 4, "f32", "F32"},
    {StorageDType::kF16, 2, "f16", "F16"},
    {StorageDType::kBF16, 2, "bf16", "BF16"},
    {StorageDType::kI64, 8, "i64", "I64"},
    {StorageDType::kI32, 4, "i32", "I32"},
    {StorageDType::kI16, 2, "i16", "I16"},
    {StorageDType::kI8, 1, "i8", "I8"},
    {StorageDType::kU64, 8, "u64", "U64"},
    {StorageDType::kU32, 4, "u32", "U32"},
    {StorageDType::kU16, 2, "u16", "U16"},
    {StorageDType::kU8, 1, "u8", "U8"},
    {StorageDType::kBool, 1, "bool", "BOOL"},
}};

const DTypeRow& row(StorageDType t) {
  for (const DTypeRow& r : kRows)
    if (r.type == t) return r;
  return kRows[1];  // unreachable for valid enumerators
}

}  // namespace

size_t storage_dtype_size(StorageDType t) { return row(t).size; }
const char* storage_dtype_name(StorageDType t) { return row(t).manifest_name; }
const char* safetensors_dtype_name(StorageDType t) { return row(t).safetensors_name; }

std::optional<StorageDType> parse_storage_dtype(std::string_view name) {
  for (const DTypeRow& r : kRows)
    if (name == r.manifest_name) return r.type;
  return std::nullopt;
}

std::optional<StorageDType> parse_safetensors_dtype(std::string_view name) {
  for (const DTypeRow& r : kRows)
    if (name == r.safetensors_name) return r.type;
  return std::nullopt;
}

StorageDType to_storage_dtype(DType t) {
  switch (t) {
    case DType::kF32: return StorageDType::kF32;
    case DType::kF16: return StorageDType::kF16;
    case DType::kBF16: return StorageDType::kBF16;
    case DType::kI32: return StorageDType::kI32;
  }
  return StorageDType::kF32;
}

}  // namespace zt
