// Local <-> logical element runs of tensor-parallel parameter blocks.
#include "model/tensor_split.h"

#include <algorithm>

#include "core/status.h"

namespace zt {

int64_t TensorMap::replicated_from(int block) const {
  const auto& pl = places.at(static_cast<size_t>(block));
  const ParamBlock& lb = local->block(block);
  size_t k = pl.size();
  while (k > 0 && pl[k - 1].split == TensorSplit::kReplicated) --k;
  for (size_t i = 0; i < k; ++i)
    ZT_CHECK(pl[i].split != TensorSplit::kReplicated, "block ", lb.name, ": replicated tensors must come last");
  return k == pl.size() ? lb.numel : lb.tensors[k].offset;
}

namespace {

// Logical element of local element i (0-based inside the local tensor) and how many local
// elements from i on map to consecutive logical elements.
struct Run {
  int64_t logical, count;
};

Run run_at(const ParamTensor& lt, const ParamTensor& gt, TensorSplit split, int t, int T, int64_t i) {
  const int64_t n = lt.numel;
  // Elements per logical row (1 for vectors).
  const int64_t width = gt.shape.ndim() > 1 ? gt.numel / gt.shape[0] : 1;
  switch (split) {
    case TensorSplit::kReplicated: return {i, n - i};
    case TensorSplit::kRows: {
      // A padded tensor's tail rows (beyond the logical tensor) map nowhere.
      const int64_t at = t * n + i;
      return at < gt.numel ? Run{at, std::min(n - i, gt.numel - at)} : Run{-1, n - i};
    }
    case TensorSplit::kCols: {
      const int64_t lw = width / T, row = i / lw, col = i % lw;
      return {row * width + t * lw + col, lw - col};
    }
    case TensorSplit::kQkvRows: {
      const int64_t part = n / 3, which = i / part, within = i % part;
      return {which * (gt.numel / 3) + t * part + within, part - within};
    }
  }
  ZT_THROW(ErrorKind::kInternal, "unknown tensor split");
}

}  // namespace

void TensorMap::for_each_run(int t, int block, int64_t begin, int64_t end,
                             const std::function<void(int, int64_t, int64_t, int64_t)>& fn) const {
  const ParamBlock& lb = local->block(block);
  const auto& pl = places.at(static_cast<size_t>(block));
  for (size_t k = 0; k < lb.tensors.size(); ++k) {
    const ParamTensor& lt = lb.tensors[k];
    const int64_t lo = std::max(begin, lt.offset), hi = std::min(end, lt.offset + lt.numel);
    const ParamTensor& gt = logical->block(pl[k].block).tensors.at(static_cast<size_t>(pl[k].tensor));
    for (int64_t i = lo; i < hi;) {
      const Run r = run_at(lt, gt, pl[k].split, t, degree, i - lt.offset);
      const int64_t count = std::min(r.count, hi - i);
      if (r.logical >= 0) fn(pl[k].block, gt.offset + r.logical, i, count);
      i += count;
    }
  }
}

std::vector<float> TensorMap::local_block(int t, int block, const std::vector<const float*>& logical_blocks) const {
  std::vector<float> out(static_cast<size_t>(local->block(block).numel), 0.0f);
  for_each_run(t, block, 0, local->block(block).numel, [&](int lb, int64_t lo, int64_t li, int64_t n) {
    std::copy_n(logical_blocks[static_cast<size_t>(lb)] + lo, n, out.data() + li);
  });
  return out;
}

}  // namespace zt
