// CPU kernels for the GPT-2 encoder (token + position embedding), forward and backward.
#include <algorithm>

#include "core/status.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"

namespace zt::cpu_kernels {

namespace {

// Columns per backward work item: each item owns those columns of dwte/dwpe for every row, so
// repeated tokens accumulate in (b, t) order whatever the thread count.
constexpr int64_t kEncoderColumnBlock = 64;

void check_token(int32_t token, int64_t V, int64_t row, int64_t T, const char* op) {
  if (token < 0 || token >= V) [[unlikely]]
    ZT_THROW(ErrorKind::kInvalidArgument, op, ": token id ", token, " at (b=", row / T,
             ", t=", row % T, ") is outside the vocabulary [0, ", V, ")");
}

}  // namespace

void encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                     int64_t B, int64_t T, int64_t C, int64_t V) {
  parallel_for(B * T, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      check_token(tokens[r], V, r, T, "encoder_forward");
      const float* w = wte + tokens[r] * C;
      const float* p = wpe + (r % T) * C;
      float* o = out + r * C;
      for (int64_t c = 0; c < C; ++c) o[c] = w[c] + p[c];
    }
  });
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                      int64_t T, int64_t C, int64_t V) {
  for (int64_t r = 0; r < B * T; ++r) check_token(tokens[r], V, r, T, "encoder_backward");
  const int64_t num_blocks = (C + kEncoderColumnBlock - 1) / kEncoderColumnBlock;
  parallel_for(num_blocks, 1, [=](int64_t blk0, int64_t blk1) {
    const int64_t c0 = blk0 * kEncoderColumnBlock;
    const int64_t c1 = std::min(C, blk1 * kEncoderColumnBlock);
    for (int64_t r = 0; r < B * T; ++r) {
      const float* d = dout + r * C;
      float* gw = dwte + tokens[r] * C;
      float* gp = dwpe + (r % T) * C;
      for (int64_t c = c0; c < c1; ++c) {
        gw[c] += d[c];
        gp[c] += d[c];
      }
    }
  });
}

}  // namespace zt::cpu_kernels
