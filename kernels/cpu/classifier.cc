// CPU kernels for the fused classifier (per row softmax, cross-entropy loss and dlogits in place)
// and its vocabulary-parallel form in three ops (row_max, vocab_partials, vocab_loss_grad), which
// follow the classifier's arithmetic so that one shard gives its results to about an ulp.
#include <algorithm>
#include <cmath>
#include <limits>

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

// x[i] = exp(x[i] - mx)
ZT_CPU_CLONES void exp_row(float* x, int64_t V, float mx) {
  for (int64_t i = 0; i < V; ++i) x[i] = exp_elem(x[i] - mx);
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

namespace {
// The shard's real columns: those at ids < total (the rest is a padded vocabulary's tail).
int64_t real_columns(int64_t V, int64_t v_begin, int64_t v_total) {
  return std::clamp<int64_t>(v_total - v_begin, 0, V);
}
}  // namespace

void row_max(float* out, const float* logits, int64_t N, int64_t V, int64_t v_begin, int64_t v_total) {
  const int64_t real = real_columns(V, v_begin, v_total);
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      out[r] = real > 0 ? detail::max_of(logits + r * V, real) : -std::numeric_limits<float>::infinity();
  });
}

namespace {
void check_target(const char* op, int32_t target, int64_t row, int64_t v_total) {
  if (target >= v_total) [[unlikely]]
    ZT_THROW(ErrorKind::kInvalidArgument, op, ": target ", target, " of row ", row,
             " is outside the vocabulary [0, ", v_total, ") (negative targets mean 'ignore')");
}
}  // namespace

void vocab_partials(float* out, const float* logits, const float* max, const int32_t* targets,
                    int64_t N, int64_t V, int64_t v_begin, int64_t v_total) {
  const int64_t real = real_columns(V, v_begin, v_total);
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t target = targets[r];
      check_target("vocab_partials", target, r, v_total);
      if (target < 0) {
        out[r] = 0.0f;
        out[N + r] = 0.0f;
        continue;
      }
      const float* x = logits + r * V;
      out[r] = real > 0 ? static_cast<float>(exp_sum(x, real, max[r])) : 0.0f;
      const int64_t local = target - v_begin;
      out[N + r] = local >= 0 && local < V ? x[local] : 0.0f;
    }
  });
}

void vocab_loss_grad(float* logits, float* losses, const float* max, const float* sumexp,
                     const float* target_logit, const int32_t* targets, int64_t N, int64_t V,
                     int64_t v_begin, int64_t v_total, float dloss_arg, bool compute_grad,
                     const float* dloss_scale) {
  // Read here, when the stream runs the op: the scale is written by earlier work on the stream.
  const float dloss = dloss_scale != nullptr ? dloss_arg * *dloss_scale : dloss_arg;
  const int64_t real = real_columns(V, v_begin, v_total);
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = logits + r * V;
      const int32_t target = targets[r];
      check_target("vocab_loss_grad", target, r, v_total);
      if (target < 0) {
        losses[r] = 0.0f;
        if (compute_grad) std::fill(x, x + V, 0.0f);
        continue;
      }
      const double sum = sumexp[r];
      const float mx = max[r];
      losses[r] = static_cast<float>(std::log(sum) - (double{target_logit[r]} - mx));
      if (!compute_grad) continue;
      // As classifier_forward_backward: exp in place, one scale, the target element fixed up.
      const float inv_sum = static_cast<float>(1.0 / sum);
      exp_row(x, real, mx);
      const int64_t local = target - v_begin;
      const bool here = local >= 0 && local < real;
      const float e_target = here ? x[local] : 0.0f;
      scale_row(x, real, inv_sum * dloss);
      if (here) x[local] = (e_target * inv_sum - 1.0f) * dloss;
      std::fill(x + real, x + V, 0.0f);  // padding: no probability, no gradient
    }
  });
}

}  // namespace zt::cpu_kernels
