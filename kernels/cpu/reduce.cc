// CPU kernels for reductions: sum and sum of squares (losses, gradient norms: fixed blocks, double
// partials, fixed order) and the slice-wise sum/max of gathered shards (reduce_slices, slices in index order).
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"

namespace zt::cpu_kernels {

namespace {

template <bool kSquare>
void block_sum(float* out, const float* x, int64_t n) {
  const int64_t num_blocks = (n + kSumSquaresBlock - 1) / kSumSquaresBlock;
  std::vector<double> partial(static_cast<size_t>(num_blocks));
  double* partial_data = partial.data();
  parallel_for(num_blocks, 4, [=](int64_t blk0, int64_t blk1) {
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      const float* xb = x + blk * kSumSquaresBlock;
      const int64_t len = std::min(kSumSquaresBlock, n - blk * kSumSquaresBlock);
      partial_data[blk] = detail::lane_sum(len, [xb](int64_t i) {
        const double v = xb[i];
        return kSquare ? v * v : v;
      });
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  out[0] = static_cast<float>(total);
}

}  // namespace

void sum_squares(float* out, const float* x, int64_t n) { block_sum<true>(out, x, n); }
void sum(float* out, const float* x, int64_t n) { block_sum<false>(out, x, n); }

void reduce_slices(float* out, const float* in, int64_t S, int64_t n, bool take_max) {
  parallel_for(n, detail::kElemGrain, [=](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      float acc = in[j];
      for (int64_t k = 1; k < S; ++k) {
        const float v = in[k * n + j];
        acc = take_max ? (v > acc ? v : acc) : acc + v;
      }
      out[j] = acc;
    }
  });
}

}  // namespace zt::cpu_kernels
