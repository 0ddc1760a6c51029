// libFuzzer target: a whole safetensors file in memory -> parse_safetensors. Accepted headers must
// keep the parser's promises: tensors tile the data section exactly, and each one's bytes equal
// numel * element size; every tensor's bytes are then read (ASan catches any out-of-bounds).
#include <cstddef>
#include <cstdint>
#include <span>

#include "checkpoint/safetensors.h"
#include "core/status.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  zt::SafetensorsHeader h;
  try {
    h = zt::parse_safetensors(std::span<const uint8_t>(data, size), "fuzz.safetensors");
  } catch (const zt::Error&) {
    return 0;
  }
  if (h.data_offset + h.data_bytes != size) __builtin_trap();
  uint64_t next = 0;
  volatile uint8_t sink = 0;
  for (const zt::SafetensorsEntry& t : h.tensors) {
    if (t.begin != next || t.end > h.data_bytes) __builtin_trap();
    if (t.numel() * zt::storage_dtype_size(t.dtype) != t.bytes()) __builtin_trap();
    for (uint64_t i = t.begin; i < t.end; ++i) sink = sink ^ data[h.data_offset + i];
    next = t.end;
  }
  if (next != h.data_bytes) __builtin_trap();
  return 0;
}
