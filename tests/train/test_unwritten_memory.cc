// The CPU backend's stand-in for compute-sanitizer's initcheck: every training layout runs once on
// fresh pool memory of zero pages (what large host blocks are) and once on memory filled with 0xff
// bytes (NaN in f32, f16 and bf16; a GPU pool's memory holds whatever was there), and must give the
// same bits. A buffer that some kernel reads before anything wrote it (an accumulation into a
// gradient nobody zeroed, padding a GEMM reads) turns the second run's losses or weights into NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "memory/raw_allocator.h"
#include "test_util.h"
#include "pipeline/schedule.h"
#include "sanitizer.h"
#include "train/trainer.h"
#include "train_checks.h"

namespace zt {
namespace {

// Fills every host block allocated while it lives (the runtime's devices are made by train()).
class FreshMemoryFill {
 public:
  explicit FreshMemoryFill(int byte) { HostRawAllocator::set_fill_for_tests(byte); }
  ~FreshMemoryFill() { HostRawAllocator::set_fill_for_tests(-1); }
  FreshMemoryFill(const FreshMemoryFill&) = delete;
  FreshMemoryFill& operator=(const FreshMemoryFill&) = delete;
};

// A 2-layer, 32-wide GPT over a vocabulary of 300 (padded rows), 2 steps of 2 micro-batches.
TrainConfig small_run(int devices, int stage, Precision p) {
  TrainConfig c = test_util::tiny_train_config(devices, stage, 2);
  c.overrides.layers = 2;
  c.overrides.embd = 32;
  c.overrides.heads = 4;
  c.overrides.seq_len = 16;
  c.overrides.vocab = 300;
  c.train_seq_len = 16;
  c.micro_batch_size = 2;
  c.batch_size = 4 * devices;
  c.weight_decay = 0.1f;
  c.precision = p;
  return c;
}

void expect_fill_blind(const TrainConfig& c, const std::string& what) {
  SCOPED_TRACE(what);
  const TrainResult zeros = train(c);
  TrainResult filled;
  {
    const FreshMemoryFill fill(0xff);
    filled = train(c);
  }
  ASSERT_EQ(zeros.losses.size(), static_cast<size_t>(c.steps));
  ASSERT_EQ(filled.losses.size(), zeros.losses.size());
  for (size_t i = 0; i < zeros.losses.size(); ++i) {
    EXPECT_TRUE(std::isfinite(filled.losses[i])) << "step " << i << " read memory nothing wrote";
    EXPECT_EQ(std::memcmp(&zeros.losses[i], &filled.losses[i], sizeof(double)), 0)
        << "step " << i << ": " << zeros.losses[i] << " vs " << filled.losses[i];
  }
  test::expect_same_state(zeros, filled, what);
}

// Under a sanitizer (several times slower) the layouts with the most buffers only: ZeRO-3 with
// recompute, tensor parallelism, the split pipeline backward.
constexpr bool kSanitized = test::kThreadSanitizer || test::kAddressSanitizer;

TEST(UnwrittenMemory, FillingFreshPoolMemoryChangesNoBit) {
  const bool all = !kSanitized;
  if (all) expect_fill_blind(small_run(1, 0, Precision::kFp32), "one device, fp32");
  if (all) expect_fill_blind(small_run(2, 2, Precision::kBf16), "ZeRO-2 on two devices, bf16");
  {
    TrainConfig c = small_run(2, 3, Precision::kFp16);
    c.recompute = Recompute::kFull;
    expect_fill_blind(c, "ZeRO-3 on two devices, fp16 (loss scaling), full recompute");
  }
  {
    TrainConfig c = small_run(2, 1, Precision::kBf16);
    c.tensor_parallel = 2;
    expect_fill_blind(c, "tensor parallel 2 with sequence parallelism, bf16");
    c.sequence_parallel = false;
    c.recompute = Recompute::kSelective;
    if (all) expect_fill_blind(c, "tensor parallel 2 without sequence parallelism, selective recompute, bf16");
  }
  {
    TrainConfig c = small_run(2, 1, Precision::kBf16);
    c.pipeline_parallel = 2;
    c.pp_schedule = PipeSchedule::kZbH1;
    expect_fill_blind(c, "two pipeline stages, zb-h1 (split backward), bf16");
    c.pp_schedule = PipeSchedule::k1F1B;
    c.precision = Precision::kFp32;
    if (all) expect_fill_blind(c, "two pipeline stages, 1f1b, fp32");
  }
  if (all) {
    TrainConfig c = small_run(2, 1, Precision::kBf16);
    c.optimizer = OptimizerKind::kSgd;
    c.offload_optimizer = true;
    c.offload_fraction = 0.5f;
    expect_fill_blind(c, "half the optimizer offloaded, SGD, bf16");
  }
}

// The check itself: a fill reaches the pool's memory (else the test above would pass vacuously).
TEST(UnwrittenMemory, FillReachesFreshBlocks) {
  HostRawAllocator raw;
  const FreshMemoryFill fill(0xff);
  const size_t bytes = size_t{32} << 20;  // large enough to come from mmap's zero pages
  auto* p = static_cast<unsigned char*>(raw.allocate(bytes));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p[0], 0xff);
  EXPECT_EQ(p[bytes - 1], 0xff);
  raw.deallocate(p, bytes);
}

}  // namespace
}  // namespace zt
