// Layout bookkeeping and the deterministic host-side initialisation.
#include "model/layout.h"

#include <algorithm>

#include "core/parallel.h"
#include "core/philox.h"
#include "core/status.h"

namespace zt {

int ParamLayout::add_block(std::string name) {
  blocks_.push_back(ParamBlock{std::move(name), {}, 0});
  return static_cast<int>(blocks_.size()) - 1;
}

void ParamLayout::add_tensor(int block, std::string name, Shape shape, ParamInit init,
                             float init_std, bool weight_decay, int64_t init_numel) {
  ParamBlock& b = blocks_.at(static_cast<size_t>(block));
  ParamTensor t{std::move(name), shape, (b.numel + kAlign - 1) / kAlign * kAlign, shape.numel(), init, init_std,
                weight_decay, init_numel};
  ZT_CHECK(init_numel >= -1 && init_numel <= t.numel, "tensor ", t.name, ": init_numel ", init_numel, " of ", t.numel);
  b.numel = t.offset + t.numel;
  b.tensors.push_back(std::move(t));
}

int64_t ParamLayout::total_parameters() const {
  int64_t n = 0;
  for (const auto& b : blocks_)
    for (const auto& t : b.tensors) n += t.numel;
  return n;
}

std::pair<int, const ParamTensor*> ParamLayout::find(const std::string& name) const {
  for (size_t b = 0; b < blocks_.size(); ++b)
    for (const auto& t : blocks_[b].tensors)
      if (t.name == name) return {static_cast<int>(b), &t};
  ZT_THROW(ErrorKind::kInvalidArgument, "the model has no parameter tensor named '", name, "'");
}

void init_block_host(const ParamBlock& block, uint64_t seed, float* out) {
  std::fill(out, out + block.numel, 0.0f);  // padding is zero
  for (const auto& t : block.tensors) {
    float* dst = out + t.offset;
    const int64_t n = t.init_numel >= 0 ? t.init_numel : t.numel;  // padding rows stay zero
    switch (t.init) {
      case ParamInit::kZeros: break;
      case ParamInit::kOnes: std::fill(dst, dst + n, 1.0f); break;
      case ParamInit::kNormal: {
        const uint64_t stream = fnv1a(t.name);
        const float std = t.init_std;
        parallel_for(n, 1 << 14, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) dst[i] = std * philox_normal(seed, stream, static_cast<uint64_t>(i));
        });
        break;
      }
    }
  }
}

}  // namespace zt
