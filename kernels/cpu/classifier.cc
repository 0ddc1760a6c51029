// CPU kernels for the fused classifier (softmax, cross-entropy and dlogits in place; f32/bf16/f16
// logits, padded vocabulary), the LM head's GEMMs over padded rows, and the vocabulary-parallel
// form (row_max, vocab_partials, vocab_loss_grad), whose arithmetic matches to about an ulp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
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

namespace {

// One row's loss and (compute_grad) dlogits in place over its V real columns, in fp32 with a
// double sum. The fp32 logits run this on the row itself, so the padded layout leaves their bits
// as they were; a 16-bit row runs it on an fp32 copy.
float row_loss_grad(float* x, int64_t V, int32_t target, float dloss, bool compute_grad) {
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
  return static_cast<float>(std::log(sum) - (double{x_target} - mx));
}

// Rows [r0, r1) of logits [N, ld] of element type T; `row` (V floats) is the fp32 copy of a
// 16-bit row, unused for fp32.
template <typename T>
void classifier_rows(T* logits, float* losses, const int32_t* targets, int64_t r0, int64_t r1, int64_t ld,
                     int64_t V, float dloss, bool compute_grad, float* row) {
  for (int64_t r = r0; r < r1; ++r) {
    T* x = logits + r * ld;
    const int32_t target = targets[r];
    if (target >= V) [[unlikely]]
      ZT_THROW(ErrorKind::kInvalidArgument, "classifier_forward_backward: target ", target,
               " of row ", r, " is outside [0, ", V, ") (negative targets mean 'ignore')");
    if (target < 0) {
      losses[r] = 0.0f;
      if (compute_grad) std::fill(x, x + ld, from_float<T>(0.0f));
      continue;
    }
    if constexpr (std::is_same_v<T, float>) {
      losses[r] = row_loss_grad(x, V, target, dloss, compute_grad);
    } else {
      for (int64_t i = 0; i < V; ++i) row[i] = to_float(x[i]);
      losses[r] = row_loss_grad(row, V, target, dloss, compute_grad);
      if (compute_grad)
        for (int64_t i = 0; i < V; ++i) x[i] = from_float<T>(row[i]);
    }
    // Padding: no probability, no gradient.
    if (compute_grad) std::fill(x + V, x + ld, from_float<T>(0.0f));
  }
}

template <typename T>
void classifier_all(T* logits, float* losses, const int32_t* targets, int64_t N, int64_t ld, int64_t V,
                    float dloss, bool compute_grad) {
  parallel_for(N, detail::row_grain(ld), [=](int64_t r0, int64_t r1) {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : static_cast<size_t>(V));
    classifier_rows(logits, losses, targets, r0, r1, ld, V, dloss, compute_grad, row.data());
  });
}

}  // namespace

void classifier_forward_backward(void* logits, DType dtype, float* losses, const int32_t* targets, int64_t N,
                                 int64_t ld, int64_t V, float dloss_arg, bool compute_grad,
                                 const float* dloss_scale) {
  // Read here, when the stream runs the op: the scale is written by earlier work on the stream.
  const float dloss = dloss_scale != nullptr ? dloss_arg * *dloss_scale : dloss_arg;
  switch (dtype) {
    case DType::kF32:
      return classifier_all(static_cast<float*>(logits), losses, targets, N, ld, V, dloss, compute_grad);
    case DType::kBF16:
      return classifier_all(static_cast<BFloat16*>(logits), losses, targets, N, ld, V, dloss, compute_grad);
    case DType::kF16:
      return classifier_all(static_cast<Half*>(logits), losses, targets, N, ld, V, dloss, compute_grad);
    default:
      ZT_THROW(ErrorKind::kInvalidArgument, "classifier_forward_backward: logits of ", dtype_name(dtype),
               " (f32, bf16 or f16 only)");
  }
}

namespace {
// A GEMM operand rounded to TF32 as matmul's kernels round theirs (cpu/matmul.cc), or the original.
const float* tf32_operand(const float* x, int64_t n, bool tf32, std::vector<float>& copy) {
  if (!tf32) return x;
  copy.resize(static_cast<size_t>(n));
  float* dst = copy.data();
  parallel_for(n, detail::kElemGrain, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dst[i] = round_to_tf32(x[i]);
  });
  return dst;
}
}  // namespace

namespace {
// rows [N, V] of fp32 <-> the first V columns of rows [N, ld] of T (the padding untouched).
template <typename T>
void round_rows(T* dst, int64_t ld, const float* src, int64_t N, int64_t V) {
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < V; ++i) dst[r * ld + i] = from_float<T>(src[r * V + i]);
  });
}
template <typename T>
void widen_rows(float* dst, const T* src, int64_t ld, int64_t N, int64_t V) {
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < V; ++i) dst[r * V + i] = to_float(src[r * ld + i]);
  });
}
std::vector<float> widened(const void* x, DType t, int64_t n) {
  std::vector<float> w(static_cast<size_t>(n));
  cast(w.data(), DType::kF32, x, t, n);
  return w;
}
}  // namespace

// fp32: matmul_forward/backward's products with ldc / lda = ld: detail::sgemm tiles C the same way
// for any leading dimension, so with ld == V these are matmul's bits. 16-bit: the same products on
// widened copies (real columns only), rounded once into the 16-bit outputs: matmul's rounding points.
void lm_head_forward(void* logits, const void* in, const void* wte, DType act, int64_t N, int64_t C, int64_t V,
                     int64_t ld, bool tf32) {
  if (act == DType::kF32) {
    std::vector<float> a_copy, w_copy;
    const float* a = tf32_operand(static_cast<const float*>(in), N * C, tf32, a_copy);
    const float* w = tf32_operand(static_cast<const float*>(wte), V * C, tf32, w_copy);
    detail::sgemm(false, true, N, V, C, 1.0f, a, C, w, C, 0.0f, static_cast<float*>(logits), ld);
    return;
  }
  const std::vector<float> a = widened(in, act, N * C), w = widened(wte, act, V * C);
  std::vector<float> out(static_cast<size_t>(N * V));
  detail::sgemm(false, true, N, V, C, 1.0f, a.data(), C, w.data(), C, 0.0f, out.data(), V);
  detail::with_storage_type(act, "lm_head_forward", [&](auto t) {
    round_rows(static_cast<decltype(t)*>(logits), ld, out.data(), N, V);
  });
}

void lm_head_backward(void* din, float* dwte, const void* dlogits, const void* in, const void* wte, DType act,
                      int64_t N, int64_t C, int64_t V, int64_t ld, bool tf32) {
  if (act == DType::kF32) {
    std::vector<float> g_copy, w_copy, a_copy;
    // Padded columns may hold anything (they are never read): rounding them is harmless.
    const float* g = tf32_operand(static_cast<const float*>(dlogits), N * ld, tf32, g_copy);
    if (din != nullptr) {
      const float* w = tf32_operand(static_cast<const float*>(wte), V * C, tf32, w_copy);
      detail::sgemm(false, false, N, C, V, 1.0f, g, ld, w, C, 1.0f, static_cast<float*>(din), C);
    }
    if (dwte != nullptr) {
      const float* a = tf32_operand(static_cast<const float*>(in), N * C, tf32, a_copy);
      detail::sgemm(true, false, V, C, N, 1.0f, g, ld, a, C, 1.0f, dwte, C);
    }
    return;
  }
  std::vector<float> g(static_cast<size_t>(N * V));
  detail::with_storage_type(act, "lm_head_backward", [&](auto t) {
    widen_rows(g.data(), static_cast<const decltype(t)*>(dlogits), ld, N, V);
  });
  if (din != nullptr) {
    const std::vector<float> w = widened(wte, act, V * C);
    std::vector<float> d = widened(din, act, N * C);
    detail::sgemm(false, false, N, C, V, 1.0f, g.data(), V, w.data(), C, 1.0f, d.data(), C);
    cast(din, act, d.data(), DType::kF32, N * C);
  }
  if (dwte != nullptr) {
    const std::vector<float> a = widened(in, act, N * C);
    detail::sgemm(true, false, V, C, N, 1.0f, g.data(), V, a.data(), C, 1.0f, dwte, C);
  }
}

namespace {
// The shard's real columns: those at ids < total (the rest is a padded vocabulary's tail).
int64_t real_columns(int64_t V, int64_t v_begin, int64_t v_total) {
  return std::clamp<int64_t>(v_total - v_begin, 0, V);
}
}  // namespace

namespace {
// Row r of a shard's logits as fp32: the row itself for fp32, else its real columns widened
// (exactly) into `buf` (real floats, the caller's per-chunk scratch).
template <typename T>
const float* wide_row(const T* x, int64_t real, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    buf.resize(static_cast<size_t>(real));
    for (int64_t i = 0; i < real; ++i) buf[static_cast<size_t>(i)] = to_float(x[i]);
    return buf.data();
  }
}

template <typename T>
void row_max_typed(float* out, const T* logits, int64_t N, int64_t V, int64_t real) {
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    std::vector<float> buf;
    for (int64_t r = r0; r < r1; ++r)
      out[r] = real > 0 ? detail::max_of(wide_row(logits + r * V, real, buf), real)
                        : -std::numeric_limits<float>::infinity();
  });
}

void check_target(const char* op, int32_t target, int64_t row, int64_t v_total) {
  if (target >= v_total) [[unlikely]]
    ZT_THROW(ErrorKind::kInvalidArgument, op, ": target ", target, " of row ", row,
             " is outside the vocabulary [0, ", v_total, ") (negative targets mean 'ignore')");
}

template <typename T>
void vocab_partials_typed(float* out, const T* logits, const float* max, const int32_t* targets, int64_t N,
                          int64_t V, int64_t v_begin, int64_t v_total, int64_t real) {
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    std::vector<float> buf;
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t target = targets[r];
      check_target("vocab_partials", target, r, v_total);
      if (target < 0) {
        out[r] = 0.0f;
        out[N + r] = 0.0f;
        continue;
      }
      const T* x = logits + r * V;
      out[r] = real > 0 ? static_cast<float>(exp_sum(wide_row(x, real, buf), real, max[r])) : 0.0f;
      const int64_t local = target - v_begin;
      out[N + r] = local >= 0 && local < V ? to_float(x[local]) : 0.0f;
    }
  });
}

// 16-bit logits: the fp32 row's gradient computed on a widened copy, each element rounded once.
template <typename T>
void vocab_loss_grad_typed(T* logits, float* losses, const float* max, const float* sumexp,
                           const float* target_logit, const int32_t* targets, int64_t N, int64_t V,
                           int64_t v_begin, int64_t v_total, float dloss, bool compute_grad, int64_t real) {
  parallel_for(N, detail::row_grain(V), [=](int64_t r0, int64_t r1) {
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(real));
    for (int64_t r = r0; r < r1; ++r) {
      T* xs = logits + r * V;
      const int32_t target = targets[r];
      check_target("vocab_loss_grad", target, r, v_total);
      if (target < 0) {
        losses[r] = 0.0f;
        if (compute_grad) std::fill(xs, xs + V, from_float<T>(0.0f));
        continue;
      }
      const double sum = sumexp[r];
      const float mx = max[r];
      losses[r] = static_cast<float>(std::log(sum) - (double{target_logit[r]} - mx));
      if (!compute_grad) continue;
      float* x;
      if constexpr (std::is_same_v<T, float>) {
        x = xs;
      } else {
        x = buf.data();
        for (int64_t i = 0; i < real; ++i) x[i] = to_float(xs[i]);
      }
      // As classifier_forward_backward: exp in place, one scale, the target element fixed up.
      const float inv_sum = static_cast<float>(1.0 / sum);
      exp_row(x, real, mx);
      const int64_t local = target - v_begin;
      const bool here = local >= 0 && local < real;
      const float e_target = here ? x[local] : 0.0f;
      scale_row(x, real, inv_sum * dloss);
      if (here) x[local] = (e_target * inv_sum - 1.0f) * dloss;
      if constexpr (!std::is_same_v<T, float>)
        for (int64_t i = 0; i < real; ++i) xs[i] = from_float<T>(x[i]);
      std::fill(xs + real, xs + V, from_float<T>(0.0f));  // padding: no probability, no gradient
    }
  });
}
}  // namespace

void row_max(float* out, const void* logits, DType dtype, int64_t N, int64_t V, int64_t v_begin,
             int64_t v_total) {
  const int64_t real = real_columns(V, v_begin, v_total);
  detail::with_storage_type(dtype, "row_max", [=](auto t) {
    row_max_typed(out, static_cast<const decltype(t)*>(logits), N, V, real);
  });
}

void vocab_partials(float* out, const void* logits, DType dtype, const float* max, const int32_t* targets,
                    int64_t N, int64_t V, int64_t v_begin, int64_t v_total) {
  const int64_t real = real_columns(V, v_begin, v_total);
  detail::with_storage_type(dtype, "vocab_partials", [=](auto t) {
    vocab_partials_typed(out, static_cast<const decltype(t)*>(logits), max, targets, N, V, v_begin, v_total, real);
  });
}

void vocab_loss_grad(void* logits, DType dtype, float* losses, const float* max, const float* sumexp,
                     const float* target_logit, const int32_t* targets, int64_t N, int64_t V,
                     int64_t v_begin, int64_t v_total, float dloss_arg, bool compute_grad,
                     const float* dloss_scale) {
  // Read here, when the stream runs the op: the scale is written by earlier work on the stream.
  const float dloss = dloss_scale != nullptr ? dloss_arg * *dloss_scale : dloss_arg;
  const int64_t real = real_columns(V, v_begin, v_total);
  detail::with_storage_type(dtype, "vocab_loss_grad", [=](auto t) {
    vocab_loss_grad_typed(static_cast<decltype(t)*>(logits), losses, max, sumexp, target_logit, targets, N, V,
                          v_begin, v_total, dloss, compute_grad, real);
  });
}

}  // namespace zt::cpu_kernels
