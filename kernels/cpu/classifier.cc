// CPU kernel for the fused classifier: per row softmax, cross-entropy loss and dlogits in place.
#include <cmath>

#include "core/status.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/elementwise.h"

namespace zt::cpu_kernels {

namespace {

ZT_CPU_CLONES double exp_sum(const float* x, int64_t V, float mx) {
  return detail::lane_sum(V, [=](int64_t i) { return double{exp_elem(x[i] - mx)}; });
}

// x[i] = exp(x[i] - mx); returns the sum (double, fixed lane order).
ZT_CPU_CLONES double exp_in_place(float* x, int64_t V, float mx) {
  for (int64_t i = 0; i < V; ++i) x[i] = exp_elem(x[i] - mx);
  return detail::lane_sum(V, [=](int64_t i) { return double{x[i]}; });
}

ZT_CPU_CLONES void scale_row(float* x, int64_t V, float alpha) {
  for (int64_t i = 0; i < V; ++i) x[i] *= alpha;
}

}  // namespace

void classifier_forward_backward(float* logits, float* losses, const int32_t* targets, int64_t N,
                                 int64_t V, float dloss_arg, bool compute_grad,
                                 const float* dloss_scale) {
  // Read here, when the stream runs the op: the scale is written by earlier work on the stream.
  const float dloss = dloss_scale != nullptr ? dloss_arg * *dloss_scale : dloss_arg;
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = logits + r * V;
      const int32_t target = targets[r];
      if (target >= V) [[unlikely]]
        ZT_THROW(ErrorKind::kInvalidArgument, "classifier_forward_backward: target ", target,
                 " of row ", r, " is outside [0, ", V, ") (negative targets mean 'ignore')");
      if (target < 0) {
        losses[r] = 0.0f;
        if (compute_grad) std::fill(x, x + V, 0.0f);
        continue;
      }
      const float mx = detail::max_of(x, V);
      const float x_target = x[target];
      double sum;
      if (compute_grad) {
        // dlogits = (softmax - onehot) * dloss, with one exp per element.
        sum = exp_in_place(x, V, mx);
        const float inv_sum = static_cast<float>(1.0 / sum);
        const float e_target = x[target];
        scale_row(x, V, inv_sum * dloss);
        x[target] = (e_target * inv_sum - 1.0f) * dloss;
      } else {
        sum = exp_sum(x, V, mx);
      }
      losses[r] = static_cast<float>(std::log(sum) - (double{x_target} - mx));
    }
  });
}

}  // namespace zt::cpu_kernels
