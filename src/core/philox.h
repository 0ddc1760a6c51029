// Philox4x32-10 counter-based RNG (Salmon et al., SC'11; the generator cuRAND and PyTorch use).
// Every random number is a pure function of (seed, stream, index): a loop over elements may be
// split across any number of threads or CUDA blocks and still produce the same values.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "core/host_device.h"

namespace zt {

// Names a stream: FNV-1a of a string ("zt/data/sequence/train"), so each use of the seed draws
// from its own stream and adding a use never shifts another's numbers.
constexpr uint64_t fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

struct Philox4x32 {
  uint32_t v[4];
};

namespace philox_detail {
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

ZT_HOST_DEVICE ZT_FORCEINLINE void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}
}  // namespace philox_detail

// One Philox4x32-10 block: 4 random words from a 128-bit counter and a 64-bit key.
ZT_HOST_DEVICE ZT_FORCEINLINE Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t k0, uint32_t k1) {
  using namespace philox_detail;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kM0, ctr.v[0], hi0, lo0);
    mulhilo(kM1, ctr.v[2], hi1, lo1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// The 4 words at block `block` of stream `stream` for `seed`. Streams separate independent uses
// (initialisation of each tensor, dropout of each layer, stochastic rounding, data shuffles).
ZT_HOST_DEVICE ZT_FORCEINLINE Philox4x32 philox_block(uint64_t seed, uint64_t stream, uint64_t block) {
  Philox4x32 ctr{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                  static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// The index-th 32-bit word of (seed, stream).
ZT_HOST_DEVICE ZT_FORCEINLINE uint32_t philox_u32(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox_block(seed, stream, index >> 2).v[index & 3];
}

// Uniform in (0, 1]: never 0, so log() is safe. 24 random bits, exact in float.
ZT_HOST_DEVICE ZT_FORCEINLINE float u32_to_unit_float(uint32_t x) {
  return static_cast<float>((x >> 8) + 1u) * 5.9604644775390625e-8f;  // 2^-24
}

ZT_HOST_DEVICE ZT_FORCEINLINE float philox_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return u32_to_unit_float(philox_u32(seed, stream, index));
}

// Standard normal for element `index`: Box-Muller on words 2*(index%2) and 2*(index%2)+1 of block
// index/2, so each block yields two normals and element i never depends on any other element.
ZT_HOST_DEVICE ZT_FORCEINLINE float philox_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const Philox4x32 r = philox_block(seed, stream, index >> 1);
  const int lane = static_cast<int>(index & 1) * 2;
  const float u1 = u32_to_unit_float(r.v[lane]);
  const float u2 = u32_to_unit_float(r.v[lane + 1]);
  const float radius = sqrtf(-2.0f * logf(u1));
  return radius * cosf(6.28318530717958647692f * u2);
}

}  // namespace zt
