// CPU kernels for the GPT-2 encoder (token + position embedding, optionally over one vocabulary
// shard; fp32 or 16-bit activations) and the position embedding alone (sequence-parallel rows),
// forward and backward.
#include <algorithm>
#include <type_traits>

#include "core/status.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"

namespace zt::cpu_kernels {

namespace {

// Columns per backward work item: each item owns those columns of dwte/dwpe for every row, so
// repeated tokens accumulate in (b, t) order whatever the thread count.
constexpr int64_t kEncoderColumnBlock = 64;

void check_token(int32_t token, int64_t total, int64_t row, int64_t T, const char* op) {
  if (token < 0 || token >= total) [[unlikely]]
    ZT_THROW(ErrorKind::kInvalidArgument, op, ": token id ", token, " at (b=", row / T,
             ", t=", row % T, ") is outside the vocabulary [0, ", total, ")");
}

// Runs fn(c0, c1) over fixed blocks of kEncoderColumnBlock columns of [0, C), in parallel.
template <typename F>
void for_column_blocks(int64_t C, F&& fn) {
  const int64_t num_blocks = (C + kEncoderColumnBlock - 1) / kEncoderColumnBlock;
  parallel_for(num_blocks, 1, [&](int64_t blk0, int64_t blk1) {
    fn(blk0 * kEncoderColumnBlock, std::min(C, blk1 * kEncoderColumnBlock));
  });
}

// Every element is the fp32 expression of the widened rows, rounded once to S (for float: the
// expression itself; a row copy widens and rounds back, which keeps every non-NaN value's bits).
template <typename S>
void encoder_forward_typed(S* out, const int32_t* tokens, const S* wte, const S* wpe, int64_t B, int64_t T,
                           int64_t C, int64_t V, int64_t v_begin, int64_t v_total) {
  parallel_for(B * T, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      check_token(tokens[r], v_total, r, T, "encoder_forward");
      const int64_t local = tokens[r] - v_begin;
      S* o = out + r * C;
      if (local >= 0 && local < V) {
        const S* w = wte + local * C;
        if (wpe != nullptr) {
          const S* p = wpe + (r % T) * C;
          for (int64_t c = 0; c < C; ++c) o[c] = from_float<S>(to_float(w[c]) + to_float(p[c]));
        } else {
          for (int64_t c = 0; c < C; ++c) o[c] = from_float<S>(to_float(w[c]));
        }
      } else if (wpe != nullptr) {
        // Another shard holds the token: only the position term (0 + p, as the formula says).
        const S* p = wpe + (r % T) * C;
        for (int64_t c = 0; c < C; ++c) o[c] = from_float<S>(0.0f + to_float(p[c]));
      } else {
        std::fill(o, o + C, from_float<S>(0.0f));
      }
    }
  });
}

// dout of S, widened exactly; dwte/dwpe fp32, rows added in (b, t) order per column block.
template <typename S>
void encoder_backward_typed(float* dwte, float* dwpe, const S* dout, const int32_t* tokens, int64_t B,
                            int64_t T, int64_t C, int64_t V, int64_t v_begin, int64_t v_total) {
  for (int64_t r = 0; r < B * T; ++r) check_token(tokens[r], v_total, r, T, "encoder_backward");
  for_column_blocks(C, [=](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < B * T; ++r) {
      const S* d = dout + r * C;
      const int64_t local = tokens[r] - v_begin;
      if (local >= 0 && local < V) {
        float* gw = dwte + local * C;
        for (int64_t c = c0; c < c1; ++c) gw[c] += to_float(d[c]);
      }
      if (dwpe != nullptr) {
        float* gp = dwpe + (r % T) * C;
        for (int64_t c = c0; c < c1; ++c) gp[c] += to_float(d[c]);
      }
    }
  });
}

}  // namespace

void encoder_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, DType dtype,
                     int64_t B, int64_t T, int64_t C, int64_t V, int64_t v_begin, int64_t v_total) {
  detail::with_storage_type(dtype, "encoder_forward", [=](auto tag) {
    using S = decltype(tag);
    encoder_forward_typed(static_cast<S*>(out), tokens, static_cast<const S*>(wte), static_cast<const S*>(wpe), B,
                          T, C, V, v_begin, v_total);
  });
}

void encoder_backward(float* dwte, float* dwpe, const void* dout, DType dtype, const int32_t* tokens,
                      int64_t B, int64_t T, int64_t C, int64_t V, int64_t v_begin, int64_t v_total) {
  detail::with_storage_type(dtype, "encoder_backward", [=](auto tag) {
    using S = decltype(tag);
    encoder_backward_typed(dwte, dwpe, static_cast<const S*>(dout), tokens, B, T, C, V, v_begin, v_total);
  });
}

void position_forward(void* x, const void* wpe, DType act, DType wt, int64_t R, int64_t C, int64_t row0,
                      int64_t T) {
  zt::detail::dispatch_norm_types("position_forward", act, wt, [=](auto* xs, auto* ws) {
    using S = std::remove_pointer_t<decltype(xs)>;
    using W = std::remove_pointer_t<decltype(ws)>;
    S* xt = static_cast<S*>(x);
    const W* wt_ = static_cast<const W*>(wpe);
    parallel_for(R, detail::row_grain(C), [=](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const W* p = wt_ + ((row0 + r) % T) * C;
        S* o = xt + r * C;
        for (int64_t c = 0; c < C; ++c) o[c] = from_float<S>(to_float(o[c]) + to_float(p[c]));
      }
    });
  });
}

void position_backward(float* dwpe, const void* dx, DType act, int64_t R, int64_t C, int64_t row0, int64_t T) {
  detail::with_storage_type(act, "position_backward", [=](auto tag) {
    using S = decltype(tag);
    const S* dxs = static_cast<const S*>(dx);
    // Each column block adds its columns of every row in row order, so every dwpe element sums its
    // rows in increasing i (the order encoder_backward uses), whatever the thread count.
    for_column_blocks(C, [=](int64_t c0, int64_t c1) {
      for (int64_t r = 0; r < R; ++r) {
        const S* d = dxs + r * C;
        float* gp = dwpe + ((row0 + r) % T) * C;
        for (int64_t c = c0; c < c1; ++c) gp[c] += to_float(d[c]);
      }
    });
  });
}

}  // namespace zt::cpu_kernels
