// CPU kernels for elementwise ops: fill, scale, add, cast, accumulate, GELU, ReLU.
#include "kernels/elementwise.h"

#include "core/status.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/cpu_ops.h"

namespace zt::cpu_kernels {

using detail::kElemGrain;

void fill(float* x, int64_t n, float value) {
  parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) { std::fill(x + b, x + e, value); });
}

void scale(float* x, int64_t n, float alpha) {
  parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) x[i] *= alpha;
  });
}

void add(float* out, const float* a, const float* b, int64_t n) {
  parallel_for(n, kElemGrain, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = a[i] + b[i];
  });
}

namespace {

template <typename Dst, typename Src>
void cast_typed(void* dst, const void* src, int64_t n) {
  auto* d = static_cast<Dst*>(dst);
  const auto* s = static_cast<const Src*>(src);
  parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) d[i] = from_float<Dst>(to_float(s[i]));
  });
}

template <typename Src>
void cast_from(void* dst, DType dst_type, const void* src, int64_t n) {
  switch (dst_type) {
    case DType::kF32:
      return cast_typed<float, Src>(dst, src, n);
    case DType::kF16:
      return cast_typed<Half, Src>(dst, src, n);
    case DType::kBF16:
      return cast_typed<BFloat16, Src>(dst, src, n);
    case DType::kI32:
      break;
  }
  ZT_CHECK(false, "cast: unsupported destination dtype ", dtype_name(dst_type));
}

template <typename T>
void accumulate_typed(void* dst, const void* src, int64_t n) {
  auto* d = static_cast<T*>(dst);
  const auto* s = static_cast<const T*>(src);
  parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) d[i] = from_float<T>(to_float(d[i]) + to_float(s[i]));
  });
}

ZT_CPU_CLONES void gelu_forward_range(float* out, const float* in, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) out[i] = gelu_forward_elem(in[i]);
}

ZT_CPU_CLONES void gelu_backward_range(float* din, const float* in, const float* dout, int64_t b,
                                       int64_t e) {
  for (int64_t i = b; i < e; ++i) din[i] += gelu_grad_elem(in[i]) * dout[i];
}

}  // namespace

void cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n) {
  switch (src_type) {
    case DType::kF32:
      return cast_from<float>(dst, dst_type, src, n);
    case DType::kF16:
      return cast_from<Half>(dst, dst_type, src, n);
    case DType::kBF16:
      return cast_from<BFloat16>(dst, dst_type, src, n);
    case DType::kI32:
      break;
  }
  ZT_CHECK(false, "cast: unsupported source dtype ", dtype_name(src_type));
}

void accumulate(void* dst, const void* src, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::kF32:
      return accumulate_typed<float>(dst, src, n);
    case DType::kF16:
      return accumulate_typed<Half>(dst, src, n);
    case DType::kBF16:
      return accumulate_typed<BFloat16>(dst, src, n);
    case DType::kI32:
      break;
  }
  ZT_CHECK(false, "accumulate: unsupported dtype ", dtype_name(dtype));
}

void gelu_forward(float* out, const float* in, int64_t n) {
  parallel_for(n, kElemGrain / 4, [=](int64_t b, int64_t e) { gelu_forward_range(out, in, b, e); });
}

void gelu_backward(float* din, const float* in, const float* dout, int64_t n) {
  parallel_for(n, kElemGrain / 4,
               [=](int64_t b, int64_t e) { gelu_backward_range(din, in, dout, b, e); });
}

void relu_forward(float* out, const float* in, int64_t n) {
  parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = relu_forward_elem(in[i]);
  });
}

void relu_backward(float* din, const float* in, const float* dout, int64_t n) {
  parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) din[i] += relu_grad_elem(in[i], dout[i]);
  });
}

}  // namespace zt::cpu_kernels
