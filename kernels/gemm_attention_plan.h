// The GEMMs of the fp32 GEMM attention (kernels/cuda/gemm_attention.cu) as data: per chunk (batch
// row b, heads [h0, h0 + nh)) each cuBLAS strided-batched call's transposes, sizes, scalars and
// operands as offsets into named buffers. The CUDA launcher maps the buffers to device pointers and
// calls cuBLAS; a CPU test runs the same plan through a column-major reference GEMM in float64
// (tests/kernels/test_flash_attention.cc), so a wrong transpose, leading dimension or stride fails
// in CI, not first on a GPU. Host code only, no CUDA.
//
// Row-major <-> cuBLAS: a row-major [R, K] matrix with row stride ld is, read column-major, the
// [K, R] matrix X^T with leading dimension ld; so the row-major Y = A B is the column-major
// Y^T = B^T A^T. Scores are [nh, T, T] row-major per chunk (row i: query, column j: key).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

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
  float scale;
};
inline Dims dims(int64_t B, int64_t T, int64_t C, int64_t NH, int64_t group) {
  return {B, T, C, NH, C / NH, group, static_cast<float>(1.0 / std::sqrt(static_cast<double>(C / NH)))};
}

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

namespace detail {
// The chunk's q, k, v ([T, hs] per head, rows 3C apart, heads hs apart), out/dout and dq/dk/dv.
inline Operand qkv_part(const Dims& d, const Chunk& c, int part, Buf buf = Buf::kQkv) {
  return {buf, c.b * d.T * 3 * d.C + part * d.C + c.h0 * d.hs, 3 * d.C, d.hs};
}
inline Operand rows_of(const Dims& d, const Chunk& c, Buf buf) { return {buf, c.head_offset(d), d.C, d.hs}; }
inline Operand scores(const Dims& d, Buf buf) { return {buf, 0, d.T, d.T * d.T}; }
}  // namespace detail

// S^T[T2, T] = scale K[T2, hs] Q^T[hs, T] into `into` (the full square; the row kernels mask it).
inline Gemm scores_gemm(const Dims& d, const Chunk& c) {
  using namespace detail;
  return {true, false, d.T, d.T, d.hs, d.scale, qkv_part(d, c, 1), qkv_part(d, c, 0), 0.0f, scores(d, Buf::kScores),
          c.nh};
}

// Forward: [0] the scores; then the causal softmax of kScores in place (nh * T rows, lse at
// c.lse_offset); [1] out^T[hs, T] = V^T[hs, T2] P^T[T2, T].
inline std::array<Gemm, 2> forward_gemms(const Dims& d, const Chunk& c) {
  using namespace detail;
  return {scores_gemm(d, c),
          Gemm{false, false, d.hs, d.T, d.T, 1.0f, qkv_part(d, c, 2), scores(d, Buf::kScores), 0.0f,
               rows_of(d, c, Buf::kOut), c.nh}};
}

// Backward: [0] the scores again; [1] dP^T[T2, T] = V[T2, hs] dout^T[hs, T]; then the row kernel
// (P = exp(S - lse) and dS = P (dP - D) in place, D from out and dout at c.head_offset); [2]
// dV^T[hs, T2] = dout^T[hs, T] P[T, T2]; [3] dQ^T[hs, T] = scale K^T[hs, T2] dS^T[T2, T]; [4]
// dK^T[hs, T2] = scale Q^T[hs, T] dS[T, T2]. beta 1 accumulates into dqkv, 0 overwrites it.
inline std::array<Gemm, 5> backward_gemms(const Dims& d, const Chunk& c, bool accumulate) {
  using namespace detail;
  const float beta = accumulate ? 1.0f : 0.0f;
  const Operand q = qkv_part(d, c, 0), k = qkv_part(d, c, 1), v = qkv_part(d, c, 2), dy = rows_of(d, c, Buf::kDout);
  const Operand P = scores(d, Buf::kScores), G = scores(d, Buf::kGrads);
  return {scores_gemm(d, c),
          Gemm{true, false, d.T, d.T, d.hs, 1.0f, v, dy, 0.0f, G, c.nh},
          Gemm{false, true, d.hs, d.T, d.T, 1.0f, dy, P, beta, qkv_part(d, c, 2, Buf::kDqkv), c.nh},
          Gemm{false, false, d.hs, d.T, d.T, d.scale, k, G, beta, qkv_part(d, c, 0, Buf::kDqkv), c.nh},
          Gemm{false, true, d.hs, d.T, d.T, d.scale, q, G, beta, qkv_part(d, c, 1, Buf::kDqkv), c.nh}};
}

}  // namespace zt::gemm_attention
