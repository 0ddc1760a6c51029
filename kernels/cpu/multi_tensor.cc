// CPU kernels of the multi-tensor optimizer ops: every segment is cut into kMultiTensorChunk
// element chunks and parallel_for runs over the chunks of the whole list. The loops are
// templated on (param dtype, grad dtype, write working copy, stochastic rounding) so that the
// inner loop has no per-element branch on a dtype and vectorises; built with the CPU kernels'
// flags (no FMA contraction), so the bits equal ops::adamw_update / sgd_update on fp32.
#include "kernels/cpu/multi_tensor.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/status.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/elementwise.h"
#include "kernels/multi_tensor_elem.h"

namespace zt::optim::cpu_kernels {

namespace {

using zt::cpu_kernels::detail::kElemGrain;

// chunk_begin[s] = index of segment s's first chunk over the whole list; size segs + 1.
template <typename Segment>
std::vector<int64_t> chunk_prefix(std::span<const Segment> segs) {
  std::vector<int64_t> prefix(segs.size() + 1, 0);
  for (size_t s = 0; s < segs.size(); ++s)
    prefix[s + 1] = prefix[s] + multi_tensor_chunks(segs[s].n);
  return prefix;
}

// Runs f(segment index, chunk index, begin, end) for every chunk of the list, over parallel_for.
// Chunks are independent; nothing here depends on how parallel_for splits them.
template <typename Segment, typename F>
void for_each_chunk(std::span<const Segment> segs, const std::vector<int64_t>& prefix, F&& f) {
  const int64_t total = prefix.back();
  const int64_t grain = std::max<int64_t>(1, kElemGrain / kMultiTensorChunk);
  parallel_for(total, grain, [&](int64_t c0, int64_t c1) {
    size_t s = static_cast<size_t>(std::upper_bound(prefix.begin(), prefix.end(), c0) -
                                   prefix.begin() - 1);
    for (int64_t c = c0; c < c1; ++c) {
      while (prefix[s + 1] <= c) ++s;  // skips empty segments
      const int64_t begin = (c - prefix[s]) * kMultiTensorChunk;
      const int64_t end = std::min(segs[s].n, begin + kMultiTensorChunk);
      f(s, c, begin, end);
    }
  });
}

bool skip_step(const StepScalars& sc) { return sc.found_inf != nullptr && *sc.found_inf != 0.0f; }

// inv_loss_scale * clip, formed once per op: each gradient is multiplied by this one factor
// (inside adamw_elem / sgd_elem, exactly as ops::adamw_update's grad_scale).
float grad_factor(const StepScalars& sc) {
  return (sc.inv_loss_scale != nullptr ? *sc.inv_loss_scale : 1.0f) * (sc.clip != nullptr ? *sc.clip : 1.0f);
}

// ---- AdamW -------------------------------------------------------------------------------------

struct AdamWRange {
  AdamWArgs a;
  float weight_decay, grad_scale;
  uint64_t seed, step, rng_offset;
};

template <typename P, typename G, bool kWriteParam, bool kStochastic>
ZT_CPU_CLONES void adamw_range(P* __restrict param, const G* __restrict grad,
                               float* __restrict master, float* __restrict m, float* __restrict v,
                               int64_t b, int64_t e, AdamWRange r) {
  const AdamWArgs a = r.a;
  for (int64_t i = b; i < e; ++i) {
    adamw_elem(master[i], to_float(grad[i]), m[i], v[i], a.lr, a.beta1, a.beta2, a.eps,
               r.weight_decay, a.bias_correction1, a.bias_correction2, r.grad_scale);
    if constexpr (kWriteParam)
      param[i] = working_from_master<P, kStochastic>(master[i], r.seed, r.step, r.rng_offset + static_cast<uint64_t>(i));
  }
}

using AdamWRangeFn = void (*)(void*, const void*, float*, float*, float*, int64_t, int64_t,
                              AdamWRange);

template <typename P, typename G, bool kWriteParam, bool kStochastic>
void adamw_range_erased(void* param, const void* grad, float* master, float* m, float* v, int64_t b,
                        int64_t e, AdamWRange r) {
  adamw_range<P, G, kWriteParam, kStochastic>(static_cast<P*>(param), static_cast<const G*>(grad),
                                              master, m, v, b, e, r);
}

// ---- SGD ---------------------------------------------------------------------------------------

struct SgdRange {
  float lr, momentum, weight_decay, grad_scale;
  bool nesterov;
  uint64_t seed, step, rng_offset;
};

template <typename P, typename G, bool kWriteParam, bool kStochastic, bool kNesterov>
ZT_CPU_CLONES void sgd_range(P* __restrict param, const G* __restrict grad,
                             float* __restrict master, float* __restrict buf, int64_t b, int64_t e,
                             SgdRange r) {
  for (int64_t i = b; i < e; ++i) {
    sgd_elem(master[i], to_float(grad[i]), buf[i], r.lr, r.momentum, r.weight_decay, kNesterov,
             r.grad_scale);
    if constexpr (kWriteParam)
      param[i] = working_from_master<P, kStochastic>(master[i], r.seed, r.step, r.rng_offset + static_cast<uint64_t>(i));
  }
}

using SgdRangeFn = void (*)(void*, const void*, float*, float*, int64_t, int64_t, SgdRange);

template <typename P, typename G, bool kWriteParam, bool kStochastic>
void sgd_range_erased(void* param, const void* grad, float* master, float* buf, int64_t b,
                      int64_t e, SgdRange r) {
  if (r.nesterov) {
    sgd_range<P, G, kWriteParam, kStochastic, true>(
        static_cast<P*>(param), static_cast<const G*>(grad), master, buf, b, e, r);
  } else {
    sgd_range<P, G, kWriteParam, kStochastic, false>(
        static_cast<P*>(param), static_cast<const G*>(grad), master, buf, b, e, r);
  }
}

// The typed loop for one (param, grad) dtype pair, write-param flag and rounding mode: all
// dispatch happens here, once per chunk, never per element.
template <template <typename, typename, bool, bool> class Pick>
auto pick(DType param_dtype, DType grad_dtype, bool write_param, bool stochastic) {
  auto by_grad = [&]<typename P>() {
    auto by_flags = [&]<typename G>() {
      if (!write_param) return Pick<P, G, false, false>::fn;
      return stochastic ? Pick<P, G, true, true>::fn : Pick<P, G, true, false>::fn;
    };
    switch (grad_dtype) {
      case DType::kF16:
        return by_flags.template operator()<Half>();
      case DType::kBF16:
        return by_flags.template operator()<BFloat16>();
      default:
        return by_flags.template operator()<float>();
    }
  };
  switch (param_dtype) {
    case DType::kF16:
      return by_grad.template operator()<Half>();
    case DType::kBF16:
      return by_grad.template operator()<BFloat16>();
    default:
      return by_grad.template operator()<float>();
  }
}

template <typename P, typename G, bool kWriteParam, bool kStochastic>
struct PickAdamW {
  static constexpr AdamWRangeFn fn = &adamw_range_erased<P, G, kWriteParam, kStochastic>;
};
template <typename P, typename G, bool kWriteParam, bool kStochastic>
struct PickSgd {
  static constexpr SgdRangeFn fn = &sgd_range_erased<P, G, kWriteParam, kStochastic>;
};

// A segment's working copy is written unless it is the fp32 master itself.
bool writes_param(const OptimizerSegment& seg, DType param_dtype) {
  return param_dtype != DType::kF32 || seg.param != static_cast<void*>(seg.master);
}

// ---- unscale_check -----------------------------------------------------------------------------

// Sum of (g * inv)^2 over one chunk, in double with the fixed 8-lane order of lane_sum.
template <typename G>
ZT_CPU_CLONES double chunk_sum_squares(const G* __restrict grad, int64_t b, int64_t e, float inv) {
  const G* g = grad + b;
  return zt::cpu_kernels::detail::lane_sum(e - b, [=](int64_t i) {
    const double u = to_float(g[i]) * inv;
    return u * u;
  });
}

template <typename G>
void unscale_check_typed(std::span<const GradSegment> segs, float inv, float* norms_out,
                         int num_out, float* found_inf) {
  const std::vector<int64_t> prefix = chunk_prefix(segs);
  std::vector<double> partial(static_cast<size_t>(prefix.back()));
  double* partial_data = partial.data();
  for_each_chunk(segs, prefix, [&](size_t s, int64_t c, int64_t b, int64_t e) {
    partial_data[c] = chunk_sum_squares(static_cast<const G*>(segs[s].grad), b, e, inv);
  });
  // Chunks in order within a segment, segments in list order into their output. A finite
  // gradient's square is below 2^256 in double, so a sum is non-finite iff an element was.
  std::vector<double> norms(static_cast<size_t>(num_out), 0.0);
  bool non_finite = false;
  for (size_t s = 0; s < segs.size(); ++s) {
    double sum = 0.0;
    for (int64_t c = prefix[s]; c < prefix[s + 1]; ++c) sum += partial[c];
    non_finite = non_finite || !std::isfinite(sum);
    norms[static_cast<size_t>(segs[s].out)] += sum;
  }
  for (int k = 0; k < num_out; ++k) norms_out[k] = static_cast<float>(norms[k]);
  if (found_inf != nullptr) *found_inf = non_finite ? 1.0f : 0.0f;
}

}  // namespace

void adamw_multi(std::span<const OptimizerSegment> segs, DType param_dtype, DType grad_dtype,
                 const AdamWArgs& config_args, const StepScalars& sc, uint64_t config_step) {
  if (skip_step(sc)) return;
  // The step from the device counter: the bias corrections as the host computes them.
  const uint64_t step = sc.update_count != nullptr ? uint64_t{*sc.update_count} + 1 : config_step;
  AdamWArgs a = config_args;
  if (sc.update_count != nullptr) {
    a.bias_correction1 = adamw_bias_correction(a.beta1, step);
    a.bias_correction2 = adamw_bias_correction(a.beta2, step);
  }
  const float grad_scale = grad_factor(sc);
  const bool stochastic = sc.rounding == Rounding::kStochastic;
  const AdamWRangeFn write_fn = pick<PickAdamW>(param_dtype, grad_dtype, true, stochastic);
  const AdamWRangeFn master_fn = pick<PickAdamW>(param_dtype, grad_dtype, false, stochastic);
  const std::vector<int64_t> prefix = chunk_prefix(segs);
  for_each_chunk(segs, prefix, [&](size_t s, int64_t, int64_t b, int64_t e) {
    const OptimizerSegment& seg = segs[s];
    const AdamWRange r{a, seg.weight_decay, grad_scale, sc.seed, step, seg.rng_offset};
    (writes_param(seg, param_dtype) ? write_fn : master_fn)(seg.param, seg.grad, seg.master, seg.m,
                                                            seg.v, b, e, r);
  });
  if (sc.update_count != nullptr) ++*sc.update_count;  // after every read of it (parallel_for joined)
}

void sgd_multi(std::span<const OptimizerSegment> segs, DType param_dtype, DType grad_dtype,
               const SgdConfig& hp, const StepScalars& sc) {
  if (skip_step(sc)) return;
  const float grad_scale = grad_factor(sc);
  const bool stochastic = sc.rounding == Rounding::kStochastic;
  const SgdRangeFn write_fn = pick<PickSgd>(param_dtype, grad_dtype, true, stochastic);
  const SgdRangeFn master_fn = pick<PickSgd>(param_dtype, grad_dtype, false, stochastic);
  const std::vector<int64_t> prefix = chunk_prefix(segs);
  const uint64_t step = sc.update_count != nullptr ? uint64_t{*sc.update_count} + 1 : static_cast<uint64_t>(hp.step);
  for_each_chunk(segs, prefix, [&](size_t s, int64_t, int64_t b, int64_t e) {
    const OptimizerSegment& seg = segs[s];
    const SgdRange r{hp.lr,   hp.momentum, seg.weight_decay, grad_scale, hp.nesterov,
                     sc.seed, step,        seg.rng_offset};
    (writes_param(seg, param_dtype) ? write_fn : master_fn)(seg.param, seg.grad, seg.master, seg.m,
                                                            b, e, r);
  });
  if (sc.update_count != nullptr) ++*sc.update_count;
}

void unscale_check(std::span<const GradSegment> segs, DType grad_dtype, const float* inv_loss_scale,
                   float* norms_out, int num_out, float* found_inf) {
  const float inv = inv_loss_scale != nullptr ? *inv_loss_scale : 1.0f;
  switch (grad_dtype) {
    case DType::kF16:
      return unscale_check_typed<Half>(segs, inv, norms_out, num_out, found_inf);
    case DType::kBF16:
      return unscale_check_typed<BFloat16>(segs, inv, norms_out, num_out, found_inf);
    case DType::kF32:
      return unscale_check_typed<float>(segs, inv, norms_out, num_out, found_inf);
    case DType::kI32:
      break;
  }
  ZT_CHECK(false, "unscale_check: unsupported gradient dtype ", dtype_name(grad_dtype));
}

void loss_scale_update(LossScaleState* state, const float* found_inf, const LossScaleConfig& c) {
  loss_scale_transition_elem(*state, *found_inf != 0.0f, c);
}

void clip_factor(const float* parts, const float* include, int ranks, int row, float max_norm, double* out,
                 float* clip, float* found_inf) {
  clip_factor_elem(parts, include, ranks, row, max_norm, out, clip, found_inf);
}

}  // namespace zt::optim::cpu_kernels
