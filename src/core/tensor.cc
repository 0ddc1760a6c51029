// Shape arithmetic and printing.
#include "core/tensor.h"

namespace zt {

Shape::Shape(std::initializer_list<int64_t> dims) {
  ZT_CHECK(dims.size() <= kMaxDims, "a shape has at most ", kMaxDims, " dims, got ", dims.size());
  for (int64_t d : dims) {
    ZT_CHECK(d >= 0, "negative dimension ", d);
    dims_[ndim_++] = d;
  }
}

int64_t Shape::operator[](int i) const {
  ZT_CHECK(i >= 0 && i < ndim_, "dim ", i, " of a ", ndim_, "-d shape");
  return dims_[i];
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + "]";
}

}  // namespace zt
