// The split of a global batch over devices and micro-batches (train/batch_split.h), checked
// against a direct enumeration of the rows.
#include <gtest/gtest.h>

#include <vector>

#include "train/batch_split.h"

namespace zt {
namespace {

// Every row of the batch is in exactly one chunk, chunks are contiguous in (m, r) order, no chunk
// exceeds the micro-batch, and sizes differ by at most one.
void expect_tiles(const BatchSplit& s) {
  std::vector<int> seen(static_cast<size_t>(s.batch), 0);
  int next = 0, lo = s.batch, hi = 0;
  for (int m = 0; m < s.accum; ++m)
    for (int r = 0; r < s.ranks; ++r) {
      EXPECT_EQ(s.first_row(m, r), next);
      const int n = s.rows(m, r);
      EXPECT_LE(n, s.micro);
      lo = std::min(lo, n), hi = std::max(hi, n);
      for (int i = 0; i < n; ++i) ++seen[static_cast<size_t>(next + i)];
      next += n;
    }
  EXPECT_EQ(next, s.batch);
  for (int v : seen) EXPECT_EQ(v, 1);
  EXPECT_LE(hi - lo, 1);
}

TEST(BatchSplit, EvenSplitIsTheClassicLayout) {
  const BatchSplit s = even_split(16, 4, 2);
  EXPECT_EQ(s.accum, 2);
  EXPECT_TRUE(s.even());
  for (int m = 0; m < 2; ++m)
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(s.rows(m, r), 2);
      EXPECT_EQ(s.first_row(m, r), m * 4 * 2 + r * 2);  // rows [m*N*B + r*B, +B)
    }
  expect_tiles(s);
}

TEST(BatchSplit, AnyBatchOverAnyDeviceCountTiles) {
  for (int batch = 1; batch <= 40; ++batch)
    for (int ranks = 1; ranks <= std::min(batch, 9); ++ranks)
      for (int micro = 1; micro <= 6; ++micro) {
        SCOPED_TRACE(std::to_string(batch) + "/" + std::to_string(ranks) + "/" + std::to_string(micro));
        const BatchSplit s = split_batch(batch, ranks, micro);
        EXPECT_LE(s.micro, micro);
        EXPECT_GE(s.micro, 1);
        // As few micro-batches as the micro-batch size allows.
        EXPECT_EQ(s.accum, ((batch + ranks - 1) / ranks + micro - 1) / micro);
        expect_tiles(s);
        if (batch % ranks == 0 && (batch / ranks) % micro == 0) {
          EXPECT_TRUE(s.even());
        }
      }
}

TEST(BatchSplit, SixteenOverThreeDevices) {
  const BatchSplit s = split_batch(16, 3, 4);  // 4 devices with micro-batches of 4, one lost
  EXPECT_EQ(s.accum, 2);
  EXPECT_EQ(s.micro, 3);
  EXPECT_EQ((std::vector<int>{s.rows(0, 0), s.rows(0, 1), s.rows(0, 2), s.rows(1, 0), s.rows(1, 1), s.rows(1, 2)}),
            (std::vector<int>{3, 3, 3, 3, 2, 2}));
}

}  // namespace
}  // namespace zt
