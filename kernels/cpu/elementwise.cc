// CPU kernels for elementwise ops: fill, scale, add, cast, accumulate, GELU, ReLU. fill, add and
// GELU also over 16-bit activations (widened, computed as fp32, rounded once: kernels/ops.h).
#include <algorithm>
#include <type_traits>

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

void fill(void* x, DType dtype, int64_t n, float value) {
  detail::with_storage_type(dtype, "fill", [=](auto tag) {
    using T = decltype(tag);
    auto* p = static_cast<T*>(x);
    const T v = from_float<T>(value);
    parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) { std::fill(p + b, p + e, v); });
  });
}

void add(void* out, const void* a, const void* b, DType dtype, int64_t n) {
  detail::with_storage_type(dtype, "add", [=](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(out);
    const auto* pa = static_cast<const T*>(a);
    const auto* pb = static_cast<const T*>(b);
    parallel_for(n, kElemGrain, [=](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) o[i] = from_float<T>(to_float(pa[i]) + to_float(pb[i]));
    });
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

// 16-bit GELU: each chunk is widened kWidenBlock elements at a time into fp32 stack buffers, the
// fp32 range function runs on them, and each output is rounded once (din: read, +=, rounded).
// Blocks are read before they are written, so out may alias in.
constexpr int64_t kWidenBlock = 256;

template <typename T>
void widen(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}
template <typename T>
void narrow(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

template <typename T>
void gelu_forward_16(T* out, const T* in, int64_t n) {
  parallel_for(n, kElemGrain / 4, [=](int64_t b, int64_t e) {
    float x[kWidenBlock], y[kWidenBlock];
    for (int64_t i0 = b; i0 < e; i0 += kWidenBlock) {
      const int64_t m = std::min(kWidenBlock, e - i0);
      widen(x, in + i0, m);
      gelu_forward_range(y, x, 0, m);
      narrow(out + i0, y, m);
    }
  });
}

template <typename T>
void gelu_backward_16(T* din, const T* in, const T* dout, int64_t n) {
  parallel_for(n, kElemGrain / 4, [=](int64_t b, int64_t e) {
    float d[kWidenBlock], x[kWidenBlock], g[kWidenBlock];
    for (int64_t i0 = b; i0 < e; i0 += kWidenBlock) {
      const int64_t m = std::min(kWidenBlock, e - i0);
      widen(d, din + i0, m);
      widen(x, in + i0, m);
      widen(g, dout + i0, m);
      gelu_backward_range(d, x, g, 0, m);
      narrow(din + i0, d, m);
    }
  });
}

// ReLU over 16-bit values, widened and narrowed per block as GELU's (the forward value is exact).
template <typename T>
void relu_forward_16(T* out, const T* in, int64_t n) {
  parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) {
    float x[kWidenBlock];
    for (int64_t i0 = b; i0 < e; i0 += kWidenBlock) {
      const int64_t m = std::min(kWidenBlock, e - i0);
      widen(x, in + i0, m);
      for (int64_t i = 0; i < m; ++i) x[i] = relu_forward_elem(x[i]);
      narrow(out + i0, x, m);
    }
  });
}

// din += relu'(in) * dout in fp32, rounded once.
template <typename T>
void relu_backward_16(T* din, const T* in, const T* dout, int64_t n) {
  parallel_for(n, kElemGrain, [=](int64_t b, int64_t e) {
    float d[kWidenBlock], x[kWidenBlock], g[kWidenBlock];
    for (int64_t i0 = b; i0 < e; i0 += kWidenBlock) {
      const int64_t m = std::min(kWidenBlock, e - i0);
      widen(d, din + i0, m);
      widen(x, in + i0, m);
      widen(g, dout + i0, m);
      for (int64_t i = 0; i < m; ++i) d[i] += relu_grad_elem(x[i], g[i]);
      narrow(din + i0, d, m);
    }
  });
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

void gelu_forward(void* out, const void* in, DType dtype, int64_t n) {
  detail::with_storage_type(dtype, "gelu_forward", [=](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      gelu_forward(static_cast<float*>(out), static_cast<const float*>(in), n);
    } else {
      gelu_forward_16(static_cast<T*>(out), static_cast<const T*>(in), n);
    }
  });
}

void gelu_backward(void* din, const void* in, const void* dout, DType dtype, int64_t n) {
  detail::with_storage_type(dtype, "gelu_backward", [=](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      gelu_backward(static_cast<float*>(din), static_cast<const float*>(in), static_cast<const float*>(dout), n);
    } else {
      gelu_backward_16(static_cast<T*>(din), static_cast<const T*>(in), static_cast<const T*>(dout), n);
    }
  });
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

void relu_forward(void* out, const void* in, DType dtype, int64_t n) {
  detail::with_storage_type(dtype, "relu_forward", [=](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      relu_forward(static_cast<float*>(out), static_cast<const float*>(in), n);
    } else {
      relu_forward_16(static_cast<T*>(out), static_cast<const T*>(in), n);
    }
  });
}

void relu_backward(void* din, const void* in, const void* dout, DType dtype, int64_t n) {
  detail::with_storage_type(dtype, "relu_backward", [=](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      relu_backward(static_cast<float*>(din), static_cast<const float*>(in), static_cast<const float*>(dout), n);
    } else {
      relu_backward_16(static_cast<T*>(din), static_cast<const T*>(in), static_cast<const T*>(dout), n);
    }
  });
}

}  // namespace zt::cpu_kernels
