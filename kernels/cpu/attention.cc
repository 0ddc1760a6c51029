// CPU kernels for causal multi-head self-attention (GPT-2 layout: qkv [B,T,3C]). Per (batch,
// head): scores and the products with V are OpenBLAS sgemm calls over blocks of query rows that
// stop at the causal boundary of the block (so about half of the T x T products are skipped), and
// the softmax and its backward are vectorised row loops.
#include <cmath>

#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/elementwise.h"

namespace zt::cpu_kernels {

namespace {

// Query rows per sgemm block: a function of T only (so of no thread count). Products within a block
// run to the block's last key, so the part of the diagonal block above the diagonal is computed and
// discarded (masked to 0 where it is used); larger blocks waste more of that but make fewer, larger
// sgemm calls, which pays off for long sequences (head size ~64 makes each call short in K).
int64_t attention_block(int64_t T) { return T >= 512 ? 128 : 64; }

struct HeadLayout {
  int64_t T, C, hs;
  float scale;  // 1/sqrt(hs)
};

// Softmax of preatt row t over keys [0, t]; att row gets 0 above the diagonal.
ZT_CPU_CLONES void softmax_causal_row(float* att_row, const float* pre_row, int64_t t, int64_t T) {
  const float mx = detail::max_of(pre_row, t + 1);
  for (int64_t i = 0; i <= t; ++i) att_row[i] = exp_elem(pre_row[i] - mx);
  const double sum = detail::lane_sum(t + 1, [att_row](int64_t i) { return double{att_row[i]}; });
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i <= t; ++i) att_row[i] *= inv;
  for (int64_t i = t + 1; i < T; ++i) att_row[i] = 0.0f;
}

// dpre[t2] = att[t2] (datt[t2] - sum_t3 att[t3] datt[t3]) for t2 <= t, 0 for t < t2 < end.
ZT_CPU_CLONES void softmax_causal_row_backward(float* dpre_row, const float* att_row,
                                               const float* datt_row, int64_t t, int64_t end) {
  const float dot = static_cast<float>(
      detail::lane_sum(t + 1, [=](int64_t i) { return double{att_row[i]} * datt_row[i]; }));
  for (int64_t i = 0; i <= t; ++i) dpre_row[i] = att_row[i] * (datt_row[i] - dot);
  for (int64_t i = t + 1; i < end; ++i) dpre_row[i] = 0.0f;
}

void head_forward(float* out, float* preatt, float* att, const float* qkv, const HeadLayout& L) {
  const int64_t T = L.T, C = L.C, hs = L.hs, ld = 3 * C, blk = attention_block(T);
  const float* q = qkv;
  const float* k = qkv + C;
  const float* v = qkv + 2 * C;
  for (int64_t i0 = 0; i0 < T; i0 += blk) {
    const int64_t i1 = std::min(T, i0 + blk);
    // preatt[i0:i1, 0:i1] = scale * q[i0:i1] @ k[0:i1]^T
    detail::sgemm_serial(false, true, i1 - i0, i1, hs, L.scale, q + i0 * ld, ld, k, ld, 0.0f,
                         preatt + i0 * T, T);
    for (int64_t t = i0; t < i1; ++t) softmax_causal_row(att + t * T, preatt + t * T, t, T);
    // out[i0:i1] = att[i0:i1, 0:i1] @ v[0:i1]   (att is 0 above the diagonal)
    detail::sgemm_serial(false, false, i1 - i0, hs, i1, 1.0f, att + i0 * T, T, v, ld, 0.0f,
                         out + i0 * C, C);
  }
}

void head_backward(float* dqkv, float* dpreatt, float* datt, const float* dout, const float* qkv,
                   const float* att, const HeadLayout& L) {
  const int64_t T = L.T, C = L.C, hs = L.hs, ld = 3 * C, blk = attention_block(T);
  const float* q = qkv;
  const float* k = qkv + C;
  const float* v = qkv + 2 * C;
  float* dq = dqkv;
  float* dk = dqkv + C;
  float* dv = dqkv + 2 * C;
  for (int64_t i0 = 0; i0 < T; i0 += blk) {
    const int64_t i1 = std::min(T, i0 + blk);
    // datt[i0:i1, 0:i1] = dout[i0:i1] @ v[0:i1]^T
    detail::sgemm_serial(false, true, i1 - i0, i1, hs, 1.0f, dout + i0 * C, C, v, ld, 0.0f,
                         datt + i0 * T, T);
    for (int64_t t = i0; t < i1; ++t)
      softmax_causal_row_backward(dpreatt + t * T, att + t * T, datt + t * T, t, i1);
    // dq[i0:i1] += scale * dpreatt[i0:i1, 0:i1] @ k[0:i1]
    detail::sgemm_serial(false, false, i1 - i0, hs, i1, L.scale, dpreatt + i0 * T, T, k, ld, 1.0f,
                         dq + i0 * ld, ld);
  }
  // Keys j0:j1 receive gradient from queries t >= j0 (the part above the diagonal is 0 in att and
  // dpreatt). Run after all query blocks: dpreatt rows below j1 are complete.
  for (int64_t j0 = 0; j0 < T; j0 += blk) {
    const int64_t j1 = std::min(T, j0 + blk);
    // dv[j0:j1] += att[j0:T, j0:j1]^T @ dout[j0:T]
    detail::sgemm_serial(true, false, j1 - j0, hs, T - j0, 1.0f, att + j0 * T + j0, T,
                         dout + j0 * C, C, 1.0f, dv + j0 * ld, ld);
    // dk[j0:j1] += scale * dpreatt[j0:T, j0:j1]^T @ q[j0:T]
    detail::sgemm_serial(true, false, j1 - j0, hs, T - j0, L.scale, dpreatt + j0 * T + j0, T,
                         q + j0 * ld, ld, 1.0f, dk + j0 * ld, ld);
  }
}

}  // namespace

void attention_forward(float* out, float* preatt, float* att, const float* qkv, int64_t B,
                       int64_t T, int64_t C, int64_t NH) {
  const HeadLayout L{T, C, C / NH,
                     static_cast<float>(1.0 / std::sqrt(static_cast<double>(C / NH)))};
  parallel_for(B * NH, 1, [=](int64_t bh0, int64_t bh1) {
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / NH, h = bh % NH;
      head_forward(out + b * T * C + h * L.hs, preatt + bh * T * T, att + bh * T * T,
                   qkv + b * T * 3 * C + h * L.hs, L);
    }
  });
}

void attention_backward(float* dqkv, float* dpreatt, float* datt, const float* dout,
                        const float* qkv, const float* att, int64_t B, int64_t T, int64_t C,
                        int64_t NH) {
  const HeadLayout L{T, C, C / NH,
                     static_cast<float>(1.0 / std::sqrt(static_cast<double>(C / NH)))};
  parallel_for(B * NH, 1, [=](int64_t bh0, int64_t bh1) {
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / NH, h = bh % NH;
      head_backward(dqkv + b * T * 3 * C + h * L.hs, dpreatt + bh * T * T, datt + bh * T * T,
                    dout + b * T * C + h * L.hs, qkv + b * T * 3 * C + h * L.hs, att + bh * T * T,
                    L);
    }
  });
}

}  // namespace zt::cpu_kernels
