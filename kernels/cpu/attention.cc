// CPU kernels for causal multi-head self-attention (GPT-2 layout: qkv [B,T,3C]). Per (batch,
// head): scores and the products with V are OpenBLAS sgemm calls over blocks of query rows that
// stop at the causal boundary of the block (so about half of the T x T products are skipped), and
// the softmax and its backward are vectorised row loops. The flash_attention_* kernels below do
// the same math tile by tile with an online softmax and never hold more than two tiles per task;
// for 16-bit activations they widen one head at a time into fp32 and round each output once.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/parallel.h"
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

// ---- tiled (flash-style) attention -----------------------------------------------------------
// Tasks are (batch, head, tile) triples with fixed tile bounds, and each task's sums run in a fixed
// order inside one thread, so the bits do not depend on the thread count. Query and key tiles are
// the same size and aligned, so every row of a visited tile sees at least one key (the diagonal).

namespace {

constexpr int64_t kFlashTile = 64;

struct FlashLayout {
  int64_t B, T, C, NH, hs, ld, tiles;
  float scale;
  FlashLayout(int64_t B_, int64_t T_, int64_t C_, int64_t NH_)
      : B(B_), T(T_), C(C_), NH(NH_), hs(C_ / NH_), ld(3 * C_),
        tiles((T_ + kFlashTile - 1) / kFlashTile),
        scale(static_cast<float>(1.0 / std::sqrt(static_cast<double>(C_ / NH_)))) {}
  // head h of batch b: q (k, v at +C, +2C) with row stride ld; out/dout rows with stride C.
  int64_t qkv_off(int64_t b, int64_t h) const { return b * T * ld + h * hs; }
  int64_t out_off(int64_t b, int64_t h) const { return b * T * C + h * hs; }
  int64_t row_off(int64_t b, int64_t h) const { return (b * NH + h) * T; }  // lse, D
};

// S[r, c] = scale q_{i0+r} . k_{j0+c} for an nr x nc tile (row stride kFlashTile).
void score_tile(float* S, const float* q, const float* k, int64_t i0, int64_t nr, int64_t j0,
                int64_t nc, const FlashLayout& L) {
  detail::sgemm_serial(false, true, nr, nc, L.hs, L.scale, q + i0 * L.ld, L.ld, k + j0 * L.ld,
                       L.ld, 0.0f, S, kFlashTile);
}

// P[r, c] = exp(S[r, c] - lse_r) for keys at or below the diagonal, 0 above it.
ZT_CPU_CLONES void probs_tile(float* P, const float* lse, int64_t i0, int64_t nr, int64_t j0,
                              int64_t nc) {
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t visible = std::min(nc, i0 + r - j0 + 1);
    float* row = P + r * kFlashTile;
    for (int64_t c = 0; c < visible; ++c) row[c] = exp_elem(row[c] - lse[r]);
    for (int64_t c = std::max<int64_t>(visible, 0); c < nc; ++c) row[c] = 0.0f;
  }
}

// One online-softmax step of a row over a key tile: the running max m and sum l absorb the
// tile's scores, o (the row's unnormalised output) is rescaled to the new max, and row becomes
// exp(score - max) for the visible keys and 0 for the masked ones up to nc.
ZT_CPU_CLONES void online_softmax_row(float* row, int64_t visible, int64_t nc, float* m, float* l,
                                      float* o, int64_t hs) {
  const float mx = std::max(*m, detail::max_of(row, visible));
  const float corr = exp_elem(*m - mx);  // 0 on the first tile (m = -inf)
  for (int64_t c = 0; c < visible; ++c) row[c] = exp_elem(row[c] - mx);
  const double sum = detail::lane_sum(visible, [row](int64_t c) { return double{row[c]}; });
  for (int64_t c = visible; c < nc; ++c) row[c] = 0.0f;
  *l = *l * corr + static_cast<float>(sum);
  *m = mx;
  for (int64_t i = 0; i < hs; ++i) o[i] *= corr;
}

void flash_head_forward(float* out, float* lse, const float* qkv, int64_t i0,
                        const FlashLayout& L) {
  const int64_t i1 = std::min(L.T, i0 + kFlashTile), nr = i1 - i0, hs = L.hs;
  const float* q = qkv;
  const float* k = qkv + L.C;
  const float* v = qkv + 2 * L.C;
  alignas(64) float S[kFlashTile * kFlashTile];
  float m[kFlashTile], l[kFlashTile];
  std::fill(m, m + nr, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nr, 0.0f);
  for (int64_t r = 0; r < nr; ++r) std::fill(out + (i0 + r) * L.C, out + (i0 + r) * L.C + hs, 0.0f);
  for (int64_t j0 = 0; j0 < i1; j0 += kFlashTile) {
    const int64_t nc = std::min(i1, j0 + kFlashTile) - j0;
    score_tile(S, q, k, i0, nr, j0, nc, L);
    for (int64_t r = 0; r < nr; ++r)  // visible >= 1: tiles are aligned
      online_softmax_row(S + r * kFlashTile, std::min(nc, i0 + r - j0 + 1), nc, &m[r], &l[r],
                         out + (i0 + r) * L.C, hs);
    // out[i0:i1] += P @ v[j0:j0+nc]
    detail::sgemm_serial(false, false, nr, hs, nc, 1.0f, S, kFlashTile, v + j0 * L.ld, L.ld, 1.0f,
                         out + i0 * L.C, L.C);
  }
  for (int64_t r = 0; r < nr; ++r) {
    const float inv = 1.0f / l[r];
    float* o = out + (i0 + r) * L.C;
    for (int64_t i = 0; i < hs; ++i) o[i] *= inv;
    lse[i0 + r] = m[r] + std::log(l[r]);
  }
}

// dS = P * (dP - D) in place of dP, where dP = dout_i v_j^T.
ZT_CPU_CLONES void dscores_tile(float* dP, const float* P, const float* dout, const float* v, const float* D,
                  int64_t i0, int64_t nr, int64_t j0, int64_t nc, const FlashLayout& L) {
  detail::sgemm_serial(false, true, nr, nc, L.hs, 1.0f, dout + i0 * L.C, L.C, v + j0 * L.ld, L.ld,
                       0.0f, dP, kFlashTile);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t c = 0; c < nc; ++c)
      dP[r * kFlashTile + c] = P[r * kFlashTile + c] * (dP[r * kFlashTile + c] - D[i0 + r]);
}

// One (query tile i0, key tile j0) step of the backward, shared by both schedules so their calls
// are the same: P and dS of the tile (dS left for the caller's dq), then dv and dk of the keys.
void kv_tile_step(float* P, float* dS, float* dqkv, const float* dout, const float* qkv, const float* lse,
                  const float* D, int64_t i0, int64_t nr, int64_t j0, int64_t nc, const FlashLayout& L) {
  const float* q = qkv;
  const float* k = qkv + L.C;
  const float* v = qkv + 2 * L.C;
  float* dk = dqkv + L.C;
  float* dv = dqkv + 2 * L.C;
  score_tile(P, q, k, i0, nr, j0, nc, L);
  probs_tile(P, lse + i0, i0, nr, j0, nc);
  // dv[j] += P^T dout_i
  detail::sgemm_serial(true, false, nc, L.hs, nr, 1.0f, P, kFlashTile, dout + i0 * L.C, L.C, 1.0f, dv + j0 * L.ld,
                       L.ld);
  dscores_tile(dS, P, dout, v, D, i0, nr, j0, nc, L);
  // dk[j] += scale dS^T q_i
  detail::sgemm_serial(true, false, nc, L.hs, nr, L.scale, dS, kFlashTile, q + i0 * L.ld, L.ld, 1.0f,
                       dk + j0 * L.ld, L.ld);
}

// dk, dv of keys [j0, j0 + tile): every query tile at or below the diagonal, in order.
void flash_head_backward_kv(float* dqkv, const float* dout, const float* qkv, const float* lse,
                            const float* D, int64_t j0, const FlashLayout& L) {
  const int64_t nc = std::min(L.T, j0 + kFlashTile) - j0;
  alignas(64) float P[kFlashTile * kFlashTile];
  alignas(64) float dS[kFlashTile * kFlashTile];
  for (int64_t i0 = j0; i0 < L.T; i0 += kFlashTile) {
    const int64_t nr = std::min(L.T, i0 + kFlashTile) - i0;
    kv_tile_step(P, dS, dqkv, dout, qkv, lse, D, i0, nr, j0, nc, L);
  }
}

// dq of queries [i0, i0 + tile): every key tile up to the diagonal, in order.
void flash_head_backward_q(float* dqkv, const float* dout, const float* qkv, const float* lse,
                           const float* D, int64_t i0, const FlashLayout& L) {
  const int64_t i1 = std::min(L.T, i0 + kFlashTile), nr = i1 - i0;
  const float* q = qkv;
  const float* k = qkv + L.C;
  const float* v = qkv + 2 * L.C;
  alignas(64) float P[kFlashTile * kFlashTile];
  alignas(64) float dS[kFlashTile * kFlashTile];
  for (int64_t j0 = 0; j0 < i1; j0 += kFlashTile) {
    const int64_t nc = std::min(i1, j0 + kFlashTile) - j0;
    score_tile(P, q, k, i0, nr, j0, nc, L);
    probs_tile(P, lse + i0, i0, nr, j0, nc);
    dscores_tile(dS, P, dout, v, D, i0, nr, j0, nc, L);
    // dq[i] += scale dS k_j
    detail::sgemm_serial(false, false, nr, L.hs, nc, L.scale, dS, kFlashTile, k + j0 * L.ld, L.ld,
                         1.0f, dqkv + i0 * L.ld, L.ld);
  }
}

// dq, dk and dv of one head in one task, without the two-pass schedule's second recomputation
// of P and dS. Per output row it makes the same sgemm calls on the same operands in the same
// order (dk_j, dv_j over query tiles ascending; dq_i over key tiles ascending), so its bits equal
// the two passes': which schedule runs may depend on the thread count, the result does not.
void flash_head_backward_fused(float* dqkv, const float* dout, const float* qkv, const float* lse,
                               const float* D, const FlashLayout& L) {
  const float* k = qkv + L.C;
  alignas(64) float P[kFlashTile * kFlashTile];
  alignas(64) float dS[kFlashTile * kFlashTile];
  for (int64_t j0 = 0; j0 < L.T; j0 += kFlashTile) {
    const int64_t nc = std::min(L.T, j0 + kFlashTile) - j0;
    for (int64_t i0 = j0; i0 < L.T; i0 += kFlashTile) {
      const int64_t nr = std::min(L.T, i0 + kFlashTile) - i0;
      kv_tile_step(P, dS, dqkv, dout, qkv, lse, D, i0, nr, j0, nc, L);
      detail::sgemm_serial(false, false, nr, L.hs, nc, L.scale, dS, kFlashTile, k + j0 * L.ld,
                           L.ld, 1.0f, dqkv + i0 * L.ld, L.ld);
    }
  }
}

void flash_forward_f32(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C,
                       int64_t NH) {
  const FlashLayout L(B, T, C, NH);
  parallel_for(B * NH * L.tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t bh = task / L.tiles, b = bh / NH, h = bh % NH;
      flash_head_forward(out + L.out_off(b, h), lse + L.row_off(b, h), qkv + L.qkv_off(b, h),
                         (task % L.tiles) * kFlashTile, L);
    }
  });
}

void flash_backward_f32(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, float* scratch, int64_t B, int64_t T, int64_t C, int64_t NH,
                        bool accumulate) {
  const FlashLayout L(B, T, C, NH);
  if (!accumulate)  // overwrite = accumulate into zeros (every column is some head's q, k or v)
    parallel_for(B * T, 64, [=](int64_t r0, int64_t r1) {
      std::fill(dqkv + r0 * 3 * C, dqkv + r1 * 3 * C, 0.0f);
    });
  float* D = scratch;  // [B, NH, T]: rowsum(dout * out), the softmax backward's dot per row
  parallel_for(B * NH, 1, [&](int64_t bh0, int64_t bh1) {
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / NH, h = bh % NH;
      for (int64_t t = 0; t < T; ++t) {
        const float* dy = dout + L.out_off(b, h) + t * C;
        const float* y = out + L.out_off(b, h) + t * C;
        double acc = 0.0;
        for (int64_t i = 0; i < L.hs; ++i) acc += double{dy[i]} * y[i];
        D[L.row_off(b, h) + t] = static_cast<float>(acc);
      }
    }
  });
  if (B * NH >= parallel_threads()) {  // enough heads to keep every thread busy
    parallel_for(B * NH, 1, [&](int64_t bh0, int64_t bh1) {
      for (int64_t bh = bh0; bh < bh1; ++bh) {
        const int64_t b = bh / NH, h = bh % NH;
        flash_head_backward_fused(dqkv + L.qkv_off(b, h), dout + L.out_off(b, h),
                                  qkv + L.qkv_off(b, h), lse + L.row_off(b, h),
                                  D + L.row_off(b, h), L);
      }
    });
    return;
  }
  // dk/dv and dq write disjoint columns of dqkv: two passes, each over (batch, head, tile).
  parallel_for(B * NH * L.tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t bh = task / L.tiles, b = bh / NH, h = bh % NH;
      flash_head_backward_kv(dqkv + L.qkv_off(b, h), dout + L.out_off(b, h), qkv + L.qkv_off(b, h),
                             lse + L.row_off(b, h), D + L.row_off(b, h),
                             (task % L.tiles) * kFlashTile, L);
    }
  });
  parallel_for(B * NH * L.tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t bh = task / L.tiles, b = bh / NH, h = bh % NH;
      flash_head_backward_q(dqkv + L.qkv_off(b, h), dout + L.out_off(b, h), qkv + L.qkv_off(b, h),
                            lse + L.row_off(b, h), D + L.row_off(b, h),
                            (task % L.tiles) * kFlashTile, L);
    }
  });
}

// ---- 16-bit activations: one head per task, widened into fp32 [T, 3hs] / [T, hs] buffers and
// run through the fp32 head functions with a one-head layout (C = hs, NH = 1), so the math is the
// fp32 kernels'; each output element is rounded once. Per task O(T * hs) floats, no T x T.

template <typename E>
void widen_head(float* dst, const E* src, int64_t T, int64_t src_ld, int64_t parts, int64_t part_stride,
                int64_t hs) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t i = 0; i < hs; ++i)
        dst[(t * parts + p) * hs + i] = to_float(src[t * src_ld + p * part_stride + i]);
}

template <typename E>
void flash_forward_16(E* out, float* lse, const E* qkv, int64_t B, int64_t T, int64_t C, int64_t NH) {
  const FlashLayout L(B, T, C, NH), H(1, T, C / NH, 1);
  const int64_t hs = H.hs;
  parallel_for(B * NH, 1, [&](int64_t bh0, int64_t bh1) {
    std::vector<float> q(static_cast<size_t>(T * 3 * hs)), o(static_cast<size_t>(T * hs));
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / NH, h = bh % NH;
      widen_head(q.data(), qkv + L.qkv_off(b, h), T, L.ld, 3, C, hs);
      for (int64_t i0 = 0; i0 < T; i0 += kFlashTile)
        flash_head_forward(o.data(), lse + L.row_off(b, h), q.data(), i0, H);
      E* dst = out + L.out_off(b, h);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < hs; ++i) dst[t * C + i] = from_float<E>(o[t * hs + i]);
    }
  });
}

template <typename E>
void flash_backward_16(E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse, float* scratch,
                       int64_t B, int64_t T, int64_t C, int64_t NH, bool accumulate) {
  const FlashLayout L(B, T, C, NH), H(1, T, C / NH, 1);
  const int64_t hs = H.hs;
  parallel_for(B * NH, 1, [&](int64_t bh0, int64_t bh1) {
    std::vector<float> q(static_cast<size_t>(T * 3 * hs)), dq(q.size()), dy(static_cast<size_t>(T * hs)),
        y(dy.size());
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / NH, h = bh % NH;
      widen_head(q.data(), qkv + L.qkv_off(b, h), T, L.ld, 3, C, hs);
      widen_head(dy.data(), dout + L.out_off(b, h), T, C, 1, 0, hs);
      widen_head(y.data(), out + L.out_off(b, h), T, C, 1, 0, hs);
      float* D = scratch + L.row_off(b, h);
      for (int64_t t = 0; t < T; ++t) {
        double acc = 0.0;
        for (int64_t i = 0; i < hs; ++i) acc += double{dy[t * hs + i]} * y[t * hs + i];
        D[t] = static_cast<float>(acc);
      }
      std::fill(dq.begin(), dq.end(), 0.0f);
      flash_head_backward_fused(dq.data(), dy.data(), q.data(), lse + L.row_off(b, h), D, H);
      E* dst = dqkv + L.qkv_off(b, h);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t p = 0; p < 3; ++p)
          for (int64_t i = 0; i < hs; ++i) {
            E& e = dst[t * L.ld + p * C + i];
            const float g = dq[(t * 3 + p) * hs + i];
            e = from_float<E>(accumulate ? to_float(e) + g : g);
          }
    }
  });
}

}  // namespace

void flash_attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t C,
                             int64_t NH, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return flash_forward_f32(static_cast<float*>(out), lse, static_cast<const float*>(qkv), B, T, C, NH);
    case DType::kF16:
      return flash_forward_16(static_cast<Half*>(out), lse, static_cast<const Half*>(qkv), B, T, C, NH);
    case DType::kBF16:
      return flash_forward_16(static_cast<BFloat16*>(out), lse, static_cast<const BFloat16*>(qkv), B, T, C, NH);
    default:
      break;
  }
  ZT_CHECK(false, "flash_attention_forward: unsupported dtype ", dtype_name(dtype));
}

// One task per (row, head): scores in fp32, exp_elem (the CUDA kernel's exp too), the softmax sum
// in double (the CUDA kernel's block reduction sums in fp32), out accumulated in fp32 over the keys
// in order and rounded once to T (kernels/cuda/decode_attention.cu).
void decode_attention(void* out_v, const void* qkv_v, int64_t n, int64_t S, int64_t C, int64_t NH, DType dtype) {
  detail::with_storage_type(dtype, "decode_attention", [=](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(out_v);
    const T* qkv = static_cast<const T*>(qkv_v);
    const int64_t hs = C / NH, ld = 3 * C;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    parallel_for(n * NH, 1, [=](int64_t b, int64_t e) {
      std::vector<float> p(static_cast<size_t>(S)), acc(static_cast<size_t>(hs));
      for (int64_t task = b; task < e; ++task) {
        const int64_t i = task / NH, h = task % NH, t = S - n + i;  // query position t attends 0..t
        const T* q = qkv + t * ld + h * hs;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= t; ++j) {
          const T* k = qkv + j * ld + C + h * hs;
          float dot = 0.0f;
          for (int64_t d = 0; d < hs; ++d) dot += to_float(q[d]) * to_float(k[d]);
          p[static_cast<size_t>(j)] = dot * scale;
          mx = std::max(mx, p[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= t; ++j) sum += p[static_cast<size_t>(j)] = exp_elem(p[static_cast<size_t>(j)] - mx);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j <= t; ++j) {
          const T* v = qkv + j * ld + 2 * C + h * hs;
          const float w = p[static_cast<size_t>(j)];
          for (int64_t d = 0; d < hs; ++d) acc[static_cast<size_t>(d)] += w * to_float(v[d]);
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t d = 0; d < hs; ++d) out[i * C + h * hs + d] = from_float<T>(acc[static_cast<size_t>(d)] * inv);
      }
    });
  });
}

void flash_attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                              const float* lse, float* scratch, int64_t B, int64_t T, int64_t C,
                              int64_t NH, DType dtype, bool accumulate) {
  switch (dtype) {
    case DType::kF32:
      return flash_backward_f32(static_cast<float*>(dqkv), static_cast<const float*>(dout),
                                static_cast<const float*>(qkv), static_cast<const float*>(out), lse, scratch, B,
                                T, C, NH, accumulate);
    case DType::kF16:
      return flash_backward_16(static_cast<Half*>(dqkv), static_cast<const Half*>(dout),
                               static_cast<const Half*>(qkv), static_cast<const Half*>(out), lse, scratch, B, T,
                               C, NH, accumulate);
    case DType::kBF16:
      return flash_backward_16(static_cast<BFloat16*>(dqkv), static_cast<const BFloat16*>(dout),
                               static_cast<const BFloat16*>(qkv), static_cast<const BFloat16*>(out), lse, scratch,
                               B, T, C, NH, accumulate);
    default:
      break;
  }
  ZT_CHECK(false, "flash_attention_backward: unsupported dtype ", dtype_name(dtype));
}

}  // namespace zt::cpu_kernels
