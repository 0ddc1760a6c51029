// The GEMMs of the fp32 GEMM attention (kernels/cuda/gemm_attention.cu) as data: per chunk (batch
// row b, heads [h0, h0 + nh)) each cuBLAS strided-batched call's transposes, sizes, scalars and
// operands as offsets into named buffers. The CUDA launcher maps the buffers to device pointers and
// calls cuBLAS; a CPU test runs the same plan through a column-major reference GEMM in float64
// (tests/kernels/test_flash_attention.cc), so a wrong transpose, leading dimension or stride fails
// in CI, not first on a GPU. Host code, except row_width (ZT_HOST_DEVICE: the CUDA row kernels
// use the same rule).
//
// Row-major <-> cuBLAS: a row-major [R, K] matrix with row stride ld is, read column-major, the
// [K, R] matrix X^T with leading dimension ld; so the row-major Y = A B is the column-major
// Y^T = B^T A^T. Scores are [nh, T, T] row-major per chunk (row i: query, column j: key).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/host_device.h"

namespace zt::gemm_attention {

// What an operand points into: qkv [B, T, 3C], out and dout [B, T, C], dqkv [B, T, 3C], and the
// chunk's two score buffers [nh, T, T] (S then P; dP then dS).
enum class Buf { kQkv, kOut, kDout, kDqkv, kScores, kGrads };
struct Operand {
  Buf buf;
  int64_t offset, ld, stride;  // in floats: the first matrix, its leading dimension, the batch stride
};
// Column-major C_i[m, n] = alpha op(A_i) op(B_i) + beta C_i for i < batch (cublasGemmStridedBatchedEx).
struct Gemm {
  bool ta, tb;
  int64_t m, n, k;
  float alpha;
  Operand a, b;
  float beta;
  Operand c;
  int64_t batch;
};

struct Dims {
  int64_t B, T, C, NH, hs, group;  // group: heads per chunk (the last chunk of a row may hold fewer)
  // Causal blocking: score rows in blocks of row_block queries; block [r0, r1) computes and reads
  // only key columns [0, r1), so the GEMMs skip the blocks above the diagonal (row_block = T: the
  // whole square, one block).
  int64_t row_block;
  float scale;
};
// `splits` row blocks (1: the full square): row_block = ceil(T / splits) rounded up to 64 rows.
inline Dims dims(int64_t B, int64_t T, int64_t C, int64_t NH, int64_t group, int64_t splits = 1) {
  const int64_t rows = (T + std::max<int64_t>(splits, 1) - 1) / std::max<int64_t>(splits, 1);
  const int64_t row_block = splits <= 1 ? T : std::min(T, (rows + 63) / 64 * 64);
  return {B, T, C, NH, C / NH, group, std::max<int64_t>(row_block, 1),
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(C / NH)))};
}
// The columns of score row t (query t) that the GEMMs write and the row kernels touch: its row
// block's end (row_block = T: the whole row). Above the diagonal inside that block the row kernels
// write 0 (P and dS). Host and device: the plan, its CPU test and the CUDA row kernels share it.
ZT_HOST_DEVICE inline int64_t row_width(int64_t t, int64_t T, int64_t row_block) {
  const int64_t end = (t / row_block + 1) * row_block;
  return end < T ? end : T;
}
inline int64_t row_width(const Dims& d, int64_t t) { return row_width(t, d.T, d.row_block); }

struct Chunk {
  int64_t b, h0, nh;
  // The chunk's first lse row ([B, NH, T]) and first head's column in out/dout rows ([B, T, C]).
  int64_t lse_offset(const Dims& d) const { return (b * d.NH + h0) * d.T; }
  int64_t head_offset(const Dims& d) const { return b * d.T * d.C + h0 * d.hs; }
};
inline std::vector<Chunk> chunks(const Dims& d) {
  std::vector<Chunk> r;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h0 = 0; h0 < d.NH; h0 += d.group) r.push_back({b, h0, std::min(d.group, d.NH - h0)});
  return r;
}

// A direction's GEMMs around its row kernel: `before` runs first, then the row kernel over the
// chunk's nh * T score rows, then `after`.
struct Phases {
  std::vector<Gemm> before, after;
};

namespace detail {
// The chunk's q, k, v ([T, hs] per head, rows 3C apart, heads hs apart), out/dout and dq/dk/dv.
inline Operand qkv_part(const Dims& d, const Chunk& c, int part, Buf buf = Buf::kQkv) {
  return {buf, c.b * d.T * 3 * d.C + part * d.C + c.h0 * d.hs, 3 * d.C, d.hs};
}
inline Operand rows_of(const Dims& d, const Chunk& c, Buf buf) { return {buf, c.head_offset(d), d.C, d.hs}; }
inline Operand scores(const Dims& d, Buf buf) { return {buf, 0, d.T, d.T * d.T}; }
// o moved by `rows` rows (of q/k/v, out/dout: row t at t ld; of the scores' column-major [T2, T]
// view: query t at t ld) and `cols` elements along a row.
inline Operand at(Operand o, int64_t rows, int64_t cols = 0) {
  o.offset += rows * o.ld + cols;
  return o;
}
// Row blocks [r0, r1) of the queries: the causal blocks (one block [0, T) without splits).
template <typename F>
void for_row_blocks(const Dims& d, F&& f) {
  for (int64_t r0 = 0; r0 < d.T; r0 += d.row_block) f(r0, std::min(d.T, r0 + d.row_block));
}
// S^T[r1, r1 - r0] = scale K[0:r1] Q[r0:r1]^T for each row block: the scores of its queries
// against the keys up to the block's end, into `into`'s rows r0.. (the row kernels mask the rest).
inline void scores_gemms(const Dims& d, const Chunk& c, std::vector<Gemm>& out) {
  for_row_blocks(d, [&](int64_t r0, int64_t r1) {
    out.push_back({true, false, r1, r1 - r0, d.hs, d.scale, qkv_part(d, c, 1), at(qkv_part(d, c, 0), r0), 0.0f,
                   at(scores(d, Buf::kScores), r0), c.nh});
  });
}
}  // namespace detail

// Forward: before, the scores; then the causal softmax of kScores in place (nh * T rows, lse at
// c.lse_offset, row t's first row_width(t) columns); after, per row block out^T[hs, r1 - r0] =
// V^T[hs, 0:r1] P^T[0:r1, r0:r1].
inline Phases forward_gemms(const Dims& d, const Chunk& c) {
  using namespace detail;
  Phases p;
  scores_gemms(d, c, p.before);
  for_row_blocks(d, [&](int64_t r0, int64_t r1) {
    p.after.push_back({false, false, d.hs, r1 - r0, r1, 1.0f, qkv_part(d, c, 2), at(scores(d, Buf::kScores), r0), 0.0f,
                       at(rows_of(d, c, Buf::kOut), r0), c.nh});
  });
  return p;
}

// Backward: before, the scores again and per row block dP^T[r1, r1 - r0] = V[0:r1] dout[r0:r1]^T;
// then the row kernel (P = exp(S - lse) and dS = P (dP - D) in place over row_width(t) columns, D
// from out and dout at c.head_offset); after, per row block dQ^T[hs, r1 - r0] = scale K^T[hs, 0:r1]
// dS^T[0:r1, r0:r1], and per key block [c0, c1) (the same blocks) the rows at and below it:
// dV^T[hs, c1 - c0] = dout^T[hs, c0:T] P[c0:T, c0:c1] and dK^T = scale Q^T[hs, c0:T] dS[c0:T,
// c0:c1]. beta 1 accumulates into dqkv, 0 overwrites it.
inline Phases backward_gemms(const Dims& d, const Chunk& c, bool accumulate) {
  using namespace detail;
  const float beta = accumulate ? 1.0f : 0.0f;
  const Operand q = qkv_part(d, c, 0), k = qkv_part(d, c, 1), v = qkv_part(d, c, 2), dy = rows_of(d, c, Buf::kDout);
  const Operand P = scores(d, Buf::kScores), G = scores(d, Buf::kGrads);
  Phases p;
  scores_gemms(d, c, p.before);
  for_row_blocks(d, [&](int64_t r0, int64_t r1) {
    p.before.push_back({true, false, r1, r1 - r0, d.hs, 1.0f, v, at(dy, r0), 0.0f, at(G, r0), c.nh});
  });
  for_row_blocks(d, [&](int64_t c0, int64_t c1) {
    const int64_t below = d.T - c0;
    p.after.push_back({false, true, d.hs, c1 - c0, below, 1.0f, at(dy, c0), at(P, c0, c0), beta,
                       at(qkv_part(d, c, 2, Buf::kDqkv), c0), c.nh});
    p.after.push_back({false, false, d.hs, c1 - c0, c1, d.scale, k, at(G, c0), beta,
                       at(qkv_part(d, c, 0, Buf::kDqkv), c0), c.nh});
    p.after.push_back({false, true, d.hs, c1 - c0, below, d.scale, at(q, c0), at(G, c0, c0), beta,
                       at(qkv_part(d, c, 1, Buf::kDqkv), c0), c.nh});
  });
  return p;
}

}  // namespace zt::gemm_attention
