// Helpers shared by the collective and group tests: element access by dtype, one pool buffer per
// rank (NaN-poisonable), and small integers whose sums over <= 8 ranks are exact in every dtype.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"
#include "memory/caching_allocator.h"
#include "runtime/runtime.h"

namespace zt::commtest {

// The zt::Error fn throws (a test failure when it throws none).
inline Error error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a zt::Error";
  return Error(ErrorKind::kInternal, "none");
}

// ---- element access by dtype ----------------------------------------------------------------

inline void store(DType t, void* base, int64_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(base)[i] = v;
      return;
    case DType::kF16:
      static_cast<Half*>(base)[i] = from_float<Half>(v);
      return;
    case DType::kBF16:
      static_cast<BFloat16*>(base)[i] = from_float<BFloat16>(v);
      return;
    case DType::kI32:
      static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v);
      return;
  }
}

// The stored bits, widened (fp32 bits, or the 16-bit pattern).
inline uint32_t bits_at(DType t, const void* base, int64_t i) {
  switch (t) {
    case DType::kF32:
    case DType::kI32: {
      uint32_t u;
      std::memcpy(&u, static_cast<const char*>(base) + i * 4, 4);
      return u;
    }
    case DType::kF16:
    case DType::kBF16:
      return static_cast<const uint16_t*>(base)[i];
  }
  return 0;
}

inline float load(DType t, const void* base, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kF16:
      return to_float(static_cast<const Half*>(base)[i]);
    case DType::kBF16:
      return to_float(static_cast<const BFloat16*>(base)[i]);
    case DType::kI32:
      return static_cast<float>(static_cast<const int32_t*>(base)[i]);
  }
  return 0;
}

// Rounds to the storage type and back (what a store + load does).
inline float round_to(DType t, float v) {
  switch (t) {
    case DType::kF16:
      return to_float(from_float<Half>(v));
    case DType::kBF16:
      return to_float(from_float<BFloat16>(v));
    default:
      return v;
  }
}

// Bits of `v` stored as t.
inline uint32_t bits_of(DType t, float v) {
  uint32_t storage = 0;
  store(t, &storage, 0, v);
  return bits_at(t, &storage, 0);
}

// ---- buffers on the simulated devices ------------------------------------------------------------

// One full buffer per rank, from each device's pool; host code may touch it while no stream does
// (device memory of the CPU backend is host memory).
struct RankBuffers {
  std::vector<DeviceBuffer> mem;
  std::vector<TensorView> views;
  DType dtype = DType::kF32;
  int64_t numel = 0;

  RankBuffers(const std::vector<Device*>& devices, DType t, int64_t n) : dtype(t), numel(n) {
    for (Device* d : devices) {
      mem.emplace_back(d->memory(), static_cast<size_t>(n) * dtype_size(t), d->compute(), "test");
      views.push_back(TensorView{mem.back().data(), t, Shape{n}, d->index()});
    }
  }
  void* data(int r) const { return mem[static_cast<size_t>(r)].data(); }
  void fill(const std::function<float(int rank, int64_t i)>& value) {
    for (size_t r = 0; r < mem.size(); ++r)
      for (int64_t i = 0; i < numel; ++i) store(dtype, mem[r].data(), i, value(static_cast<int>(r), i));
  }
  void poison() {
    // 0xFF bytes: NaN in every float type, so an unwritten element fails a bitwise compare.
    for (auto& m : mem) std::memset(m.data(), 0xFF, m.size());
  }
  std::vector<uint32_t> bits(int r) const {
    std::vector<uint32_t> out(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) out[static_cast<size_t>(i)] = bits_at(dtype, data(r), i);
    return out;
  }
};

inline std::vector<Device*> first_devices(Runtime& rt, int n) {
  std::vector<Device*> out;
  for (int i = 0; i < n; ++i) out.push_back(&rt.device(i));
  return out;
}

// Small integers: every partial sum over <= 8 ranks is exact in bf16 and fp16 too.
inline float small_int(int rank, int64_t i) {
  return static_cast<float>(static_cast<int>((rank * 31 + i * 7 + (i >> 5)) % 9) - 4);
}

inline float small_int_sum(int world, int64_t i) {
  float s = 0;
  for (int r = 0; r < world; ++r) s += small_int(r, i);
  return s;
}

}  // namespace zt::commtest
