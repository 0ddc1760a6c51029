// How one global batch of rows is divided over the devices and micro-batches of a step. Pure
// arithmetic: the trainer, its data prefetchers and the memory plan all read the same split.
//
// The batch's rows are cut into `accum * ranks` contiguous chunks, chunk c = m * ranks + r going to
// rank r for micro-batch m. When the batch divides evenly (the only shape a run may start with,
// see run-shape resolution) every chunk has `micro` rows and chunk c starts at row c * micro: the
// layout the trainer has always used, so the bits of such runs do not change. After a device is
// lost the survivors may not divide the batch: the chunks then differ by at most one row (the
// first `batch % chunks` are one longer), every rank runs micro-batches of the longest chunk's
// size, and the shorter chunks are padded with rows whose targets are "ignore" (loss 0, gradient
// 0). Every real position keeps the weight 1 / (batch * T) in the step's objective, so a step still
// optimises the mean loss over the same sequences; only the floating-point summation order (which
// rows share a device and a GEMM) differs from an evenly split run.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/status.h"

namespace zt {

struct BatchSplit {
  int batch = 0;   // global rows per step
  int ranks = 0;   // devices
  int accum = 0;   // micro-batches per step
  int micro = 0;   // rows each rank runs per micro-batch (the longest chunk; workspace size)

  int chunks() const { return accum * ranks; }
  // Real rows of rank r in micro-batch m, and where they start in the step's global batch.
  int rows(int m, int r) const {
    const int c = m * ranks + r, base = batch / chunks(), extra = batch % chunks();
    return base + (c < extra ? 1 : 0);
  }
  int first_row(int m, int r) const {
    const int c = m * ranks + r, base = batch / chunks(), extra = batch % chunks();
    return c * base + std::min(c, extra);
  }
  bool even() const { return batch % chunks() == 0; }
};

// The split a run starts with: `micro` rows per rank per micro-batch, batch = ranks * accum * micro.
inline BatchSplit even_split(int batch, int ranks, int micro) {
  ZT_CHECK(ranks >= 1 && micro >= 1 && batch % (ranks * micro) == 0, "batch ", batch, " over ", ranks, " x ", micro);
  return BatchSplit{batch, ranks, batch / (ranks * micro), micro};
}

// The split over `ranks` devices with micro-batches of at most `max_micro` rows: as few
// micro-batches as that allows; uneven when the batch does not divide (see above). Needs
// batch >= ranks so that no rank is left without rows.
inline BatchSplit split_batch(int batch, int ranks, int max_micro) {
  ZT_CHECK(ranks >= 1 && max_micro >= 1 && batch >= ranks, "batch ", batch, " over ", ranks, " devices");
  if (batch % ranks == 0 && (batch / ranks) % max_micro == 0) return even_split(batch, ranks, max_micro);
  const int per_rank = (batch + ranks - 1) / ranks;
  const int accum = (per_rank + max_micro - 1) / max_micro;
  const int chunks = accum * ranks;
  return BatchSplit{batch, ranks, accum, (batch + chunks - 1) / chunks};
}

}  // namespace zt
