// Internal helpers of the CPU kernels: work grains for parallel_for, fixed-order row sums, and
// the function-multiversioning attribute for compute-bound loops.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/dtype.h"
#include "core/parallel.h"
#include "kernels/storage_types.h"
#include "core/status.h"

// Compute-bound loops (exp-heavy softmax, GELU) get an AVX2 clone chosen at load time, since the
// library is built for baseline x86-64. Bits do not change between clones: kernels are compiled
// with -ffp-contract=off, so no FMA contraction, and vectorisation does not reorder the math.
// (ifunc resolvers run before ThreadSanitizer initialises, so TSan builds go without clones.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define ZT_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ZT_CPU_CLONES
#endif

namespace zt::cpu_kernels::detail {

// Elements per parallel_for chunk for streaming elementwise loops (large enough to amortise a
// task hand-off, small enough to balance).
constexpr int64_t kElemGrain = int64_t{1} << 15;

// Rows per chunk for row-wise kernels over rows of `row_len` elements.
inline int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, kElemGrain / std::max<int64_t>(1, row_len));
}

// Sum of x[0..n) in double with a fixed lane pattern (8 interleaved partial sums, combined in
// a fixed order): deterministic, and fast because the lanes break the dependency chain.
template <typename F>
inline double lane_sum(int64_t n, F&& term) {
  constexpr int kLanes = 8;
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += term(i + l);
  for (; i < n; ++i) acc[i % kLanes] += term(i);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// max of x[0..n), n >= 1. 8 lanes break the dependency chain (and vectorise); max is exact, so
// the lane order does not change the result.
inline float max_of(const float* x, int64_t n) {
  constexpr int kLanes = 8;
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = x[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
  for (; i < n; ++i) lanes[0] = x[i] > lanes[0] ? x[i] : lanes[0];
  float mx = lanes[0];
  for (int l = 1; l < kLanes; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  return mx;
}

using zt::detail::with_storage_type;  // kernels/storage_types.h

// BLAS takes int dimensions; ops never get near 2^31 per dimension, but say so if they do.
inline int blas_int(int64_t v) {
  ZT_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), "BLAS dimension ", v,
           " is outside the int range");
  return static_cast<int>(v);
}

// Row-major C[M,N] = alpha op(A)[M,K] op(B)[K,N] + beta C: the only way the CPU kernels multiply
// matrices (kernels/cpu/blas.cc). OpenBLAS's bits depend on how a product is partitioned (its
// edge micro-kernels round differently) and so on its thread count; we therefore run OpenBLAS
// single-threaded and split C into FIXED kGemmTileM x kGemmTileN tiles, one sgemm call per tile,
// spread over parallel_for: the same bits for any thread count, run to run.
constexpr int64_t kGemmTileM = 128;
constexpr int64_t kGemmTileN = 512;
// With `bias` ([N], broadcast over rows), C = alpha op(A) op(B) + bias and beta is ignored; each
// tile writes its bias block just before its product (no separate pass over C).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
           const float* bias = nullptr);
// One single-threaded sgemm call, for callers already inside parallel_for (attention heads).
void sgemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc);

}  // namespace zt::cpu_kernels::detail
