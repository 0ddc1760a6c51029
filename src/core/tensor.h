// Shapes and non-owning tensor views. A view is (pointer, dtype, shape, device index); storage is
// owned elsewhere (flat parameter buffers, the device pool). Views are always contiguous, row-major.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "core/status.h"

namespace zt {

class Shape {
 public:
  static constexpr int kMaxDims = 6;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);

  int ndim() const { return ndim_; }
  int64_t operator[](int i) const;
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "[4, 8, 64]"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

constexpr int kHostDevice = -1;  // device index of a view into host memory

template <typename P>
struct BasicTensorView {
  P* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  int device = kHostDevice;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }

  template <typename T>
  T* as() const {
    ZT_CHECK(DTypeOf<std::remove_const_t<T>>::value == dtype, "view holds ", dtype_name(dtype));
    return static_cast<T*>(data);
  }
};

using TensorView = BasicTensorView<void>;
struct ConstTensorView : BasicTensorView<const void> {
  ConstTensorView() = default;
  ConstTensorView(const void* d, DType t, Shape s, int dev) : BasicTensorView<const void>{d, t, s, dev} {}
  ConstTensorView(const TensorView& v)  // NOLINT: implicit, like T* -> const T*
      : BasicTensorView<const void>{v.data, v.dtype, v.shape, v.device} {}
};

}  // namespace zt
