// The CPU kernels' matrix products: single-threaded OpenBLAS calls over fixed tiles of the output
// (see detail::sgemm in cpu_common.h for why the tiling is fixed).
#include <cblas.h>

#include <mutex>

#include "kernels/cpu/cpu_common.h"

namespace zt::cpu_kernels::detail {

namespace {

// OpenBLAS's own threads are switched off once, process-wide, before the first product: threads
// come from parallel_for (a fixed partition), and several simulated devices call BLAS at once.
void use_single_threaded_blas() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

void call_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, blas_int(M), blas_int(N), blas_int(K), alpha, A,
              blas_int(lda), B, blas_int(ldb), beta, C, blas_int(ldc));
}

}  // namespace

void sgemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc) {
  if (M == 0 || N == 0) return;
  use_single_threaded_blas();
  call_sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
           const float* bias) {
  if (M == 0 || N == 0) return;
  use_single_threaded_blas();
  const int64_t tiles_m = (M + kGemmTileM - 1) / kGemmTileM;
  const int64_t tiles_n = (N + kGemmTileN - 1) / kGemmTileN;
  parallel_for(tiles_m * tiles_n, 1, [=](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = (t / tiles_n) * kGemmTileM, j = (t % tiles_n) * kGemmTileN;
      // Rows i.. of op(A) and columns j.. of op(B), as offsets into the stored matrices.
      const int64_t m = std::min(kGemmTileM, M - i), n = std::min(kGemmTileN, N - j);
      const float* a = trans_a ? A + i : A + i * lda;
      const float* b = trans_b ? B + j * ldb : B + j;
      float* c = C + i * ldc + j;
      if (bias != nullptr)
        for (int64_t r = 0; r < m; ++r) std::copy(bias + j, bias + j + n, c + r * ldc);
      call_sgemm(trans_a, trans_b, m, n, K, alpha, a, lda, b, ldb, bias != nullptr ? 1.0f : beta, c,
                 ldc);
    }
  });
}

}  // namespace zt::cpu_kernels::detail
