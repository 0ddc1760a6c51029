// dtype conversions: bit-for-bit against an independent float64 rounding reference built from a
// table of every representable value and, when the CUDA headers are present, against CUDA's own
// host implementations of __float2half_rn / __float2bfloat16_rn / __half2float / __bfloat162float.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"

#if ZT_TEST_HAVE_CUDA_HEADERS
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace zt {
namespace {

// Exact value of a binary16 / bfloat16 bit pattern, decoded with float64 arithmetic.
double half_value_ref(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  const double s = sign ? -1.0 : 1.0;
  if (exp == 0x1f) return man ? std::numeric_limits<double>::quiet_NaN() : s * INFINITY;
  if (exp == 0) return s * std::ldexp(man, -24);
  return s * std::ldexp(1024 + man, exp - 25);
}

double bf16_value_ref(uint16_t b) {
  const int sign = b >> 15, exp = (b >> 7) & 0xff, man = b & 0x7f;
  const double s = sign ? -1.0 : 1.0;
  if (exp == 0xff) return man ? std::numeric_limits<double>::quiet_NaN() : s * INFINITY;
  if (exp == 0) return s * std::ldexp(man, -133);
  return s * std::ldexp(128 + man, exp - 134);
}

// Round-to-nearest-even into a format given as the ascending values of its non-negative finite
// bit patterns 0..max_finite, with the next power of two standing for +inf (IEEE overflow rule).
struct RoundingTable {
  std::vector<double> values;  // values[bits] for bits = 0 .. max_finite + 1 (the last is "inf")
  uint16_t inf_bits;

  uint16_t round(float f) const {
    if (std::isnan(f)) return 0x7fff;
    const double x = std::fabs(static_cast<double>(f));
    const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    if (std::isinf(f)) return sign | inf_bits;
    auto it = std::lower_bound(values.begin(), values.end(), x);
    uint16_t bits;
    if (it == values.end()) {
      bits = inf_bits;
    } else if (*it == x) {
      bits = static_cast<uint16_t>(it - values.begin());
    } else {
      const auto hi = static_cast<uint16_t>(it - values.begin());
      const uint16_t lo = hi - 1;
      const double dlo = x - values[lo], dhi = values[hi] - x;
      bits = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
    }
    return sign | bits;
  }
};

RoundingTable half_table() {
  RoundingTable t{{}, 0x7c00};
  for (uint32_t b = 0; b < 0x7c00; ++b) t.values.push_back(half_value_ref(static_cast<uint16_t>(b)));
  t.values.push_back(65536.0);
  return t;
}

RoundingTable bf16_table() {
  RoundingTable t{{}, 0x7f80};
  for (uint32_t b = 0; b < 0x7f80; ++b) t.values.push_back(bf16_value_ref(static_cast<uint16_t>(b)));
  t.values.push_back(std::ldexp(1.0, 128));
  return t;
}

// Inputs that stress rounding: every representable value, every midpoint between neighbours and
// the floats just either side of it, specials, and random bit patterns over the whole float range.
std::vector<float> rounding_inputs(const RoundingTable& t) {
  std::vector<float> in;
  for (size_t b = 0; b + 1 < t.values.size(); ++b) {
    const float mid = static_cast<float>((t.values[b] + t.values[b + 1]) / 2);  // exact in float
    for (float v : {static_cast<float>(t.values[b]), mid, std::nextafter(mid, 0.0f),
                    std::nextafter(mid, INFINITY)}) {
      in.push_back(v);
      in.push_back(-v);
    }
  }
  for (float v : {0.0f, -0.0f, INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()})
    in.push_back(v);
  std::mt19937 rng(20240520);
  for (int i = 0; i < 1'000'000; ++i) in.push_back(bits_as_float(rng()));
  return in;
}

[[maybe_unused]] uint32_t canonical_bits(float f) { return float_as_bits(f); }

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(parse_dtype("bf16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("fp16"), DType::kF16);
  EXPECT_EQ(parse_dtype("float32"), DType::kF32);
  EXPECT_STREQ(dtype_name(DType::kF16), "fp16");
  EXPECT_THROW(parse_dtype("fp8"), std::exception);
}

TEST(DType, EveryHalfPatternDecodesExactlyAndRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float f = half_bits_to_float(h);
    const double ref = half_value_ref(h);
    if (std::isnan(ref)) {
      ASSERT_EQ(float_as_bits(f), 0x7fffffffu) << std::hex << b;
      ASSERT_EQ(float_to_half_bits(f), 0x7fff);
    } else {
      ASSERT_EQ(static_cast<double>(f), ref) << std::hex << b;
      ASSERT_EQ(std::signbit(f), (b & 0x8000) != 0) << std::hex << b;
      ASSERT_EQ(float_to_half_bits(f), h) << std::hex << b;
    }
  }
}

TEST(DType, EveryBf16PatternDecodesExactlyAndRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto v = static_cast<uint16_t>(b);
    const float f = bf16_bits_to_float(v);
    const double ref = bf16_value_ref(v);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f));
      ASSERT_EQ(float_to_bf16_bits(f), 0x7fff) << std::hex << b;
    } else {
      ASSERT_EQ(static_cast<double>(f), ref) << std::hex << b;
      ASSERT_EQ(float_to_bf16_bits(f), v) << std::hex << b;
    }
  }
}

TEST(DType, FloatToHalfRoundsToNearestEvenLikeTheReference) {
  const RoundingTable t = half_table();
  for (float f : rounding_inputs(t))
    ASSERT_EQ(float_to_half_bits(f), t.round(f)) << "f=" << f << " bits=" << std::hex << float_as_bits(f);
}

TEST(DType, FloatToBf16RoundsToNearestEvenLikeTheReference) {
  const RoundingTable t = bf16_table();
  for (float f : rounding_inputs(t))
    ASSERT_EQ(float_to_bf16_bits(f), t.round(f)) << "f=" << f << " bits=" << std::hex << float_as_bits(f);
}

TEST(DType, OverflowAndSpecials) {
  EXPECT_EQ(float_to_half_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half_bits(65519.99f), 0x7bff);
  EXPECT_EQ(float_to_half_bits(65520.0f), 0x7c00);  // the tie rounds to even: infinity
  EXPECT_EQ(float_to_half_bits(-1e10f), 0xfc00);
  EXPECT_EQ(float_to_half_bits(5.9604645e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half_bits(2.9802322e-8f), 0x0000);  // half of it: tie to even zero
  EXPECT_EQ(float_to_half_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(bits_as_float(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(float_to_bf16_bits(bits_as_float(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::quiet_NaN()), 0x7fff);
}

#if ZT_TEST_HAVE_CUDA_HEADERS

TEST(DTypeVsCuda, EveryPatternDecodesLikeCudaIntrinsics) {
  for (uint32_t b = 0; b < 65536; ++b) {
    __half_raw hr;
    hr.x = static_cast<unsigned short>(b);
    ASSERT_EQ(canonical_bits(half_bits_to_float(static_cast<uint16_t>(b))),
              canonical_bits(__half2float(__half(hr))))
        << std::hex << b;
    __nv_bfloat16_raw br;
    br.x = static_cast<unsigned short>(b);
    ASSERT_EQ(canonical_bits(bf16_bits_to_float(static_cast<uint16_t>(b))),
              canonical_bits(__bfloat162float(__nv_bfloat16(br))))
        << std::hex << b;
  }
}

TEST(DTypeVsCuda, FloatToHalfMatchesFloat2HalfRn) {
  for (float f : rounding_inputs(half_table())) {
    const __half_raw r = __float2half_rn(f);
    ASSERT_EQ(float_to_half_bits(f), r.x) << "f=" << f << " bits=" << std::hex << float_as_bits(f);
  }
}

TEST(DTypeVsCuda, FloatToBf16MatchesFloat2Bfloat16Rn) {
  for (float f : rounding_inputs(bf16_table())) {
    const __nv_bfloat16_raw r = __float2bfloat16_rn(f);
    ASSERT_EQ(float_to_bf16_bits(f), r.x) << "f=" << f << " bits=" << std::hex << float_as_bits(f);
  }
}

#else
TEST(DTypeVsCuda, EveryPatternDecodesLikeCudaIntrinsics) {
  GTEST_SKIP() << "built without the CUDA headers; the float64 table reference still runs";
}
#endif

}  // namespace
}  // namespace zt
