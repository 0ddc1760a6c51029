// The GPT's padded vocabulary through the trainer: wte's padding rows stay exactly zero under AdamW
// with weight decay at every ZeRO stage (shard boundaries inside the padding), checkpoints and
// exports hold the real vocabulary, and the GEMM-tile check (MathMode::gemm_tiles) holds for 16-bit
// runs of every GPT layout (one device, ZeRO-3, tensor parallelism with and without sequence
// parallelism, pipeline stages); the MLP's 10-class output is not on whole tiles and is refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "data/image_data.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "sanitizer.h"
#include "test_util.h"
#include "train/export.h"
#include "train/trainer.h"
#include "train_checks.h"
#include "zero/engine.h"
#include "zero/shard_plan.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A 1-layer, 16-wide GPT over a vocabulary of 300 (padded to 384 rows; the synthetic data's 256
// byte tokens fit): 2 sequences of 8 tokens a device and step, AdamW with weight decay.
TrainConfig odd_vocab_run(int devices, int stage, int steps, Precision p) {
  TrainConfig c = test_util::tiny_train_config(devices, stage, steps);
  c.overrides.layers = 1;
  c.overrides.embd = 16;
  c.overrides.heads = 2;
  c.overrides.seq_len = 8;
  c.overrides.vocab = 300;
  c.train_seq_len = 8;
  c.batch_size = 2 * devices;
  c.micro_batch_size = 2;
  c.weight_decay = 0.1f;
  c.precision = p;
  return c;
}

constexpr int64_t kV = 300, kVp = 384, kC = 16;
constexpr bool kSanitized = test::kThreadSanitizer || test::kAddressSanitizer;

// wte's padding rows [V, Vp) of block 0 (the local layout: wte first, [Vp, C]) are exactly zero.
int64_t padding_not_zero(const std::vector<float>& block0) {
  int64_t bad = 0;
  for (int64_t i = kV * kC; i < kVp * kC; ++i) bad += block0.at(static_cast<size_t>(i)) != 0.0f;
  return bad;
}

// On 5 devices block 0 (384 x 16 wte + 8 x 16 wpe = 6272 elements, padded to 6320 for the shards)
// is cut every 1264 elements: the last cut (row 316) falls inside the padding rows (300..383), so
// two ranks each update part of the padding, and neither moves it.
TEST(PaddedVocab, WtePaddingStaysZeroUnderAdamWWithWeightDecayAtEveryStage) {
  const ModelConfig mc = make_model_config("gpt-tiny", odd_vocab_run(1, 0, 1, Precision::kFp32).overrides);
  ASSERT_EQ(ops::padded_vocab(mc.vocab), kVp);
  const ShardRange last = shard_range(make_model(mc)->layout().block(0).numel, 4, 5);
  ASSERT_GT(last.begin, kV * kC);  // a shard boundary inside wte's padding rows
  ASSERT_LT(last.begin, kVp * kC);
  for (const Precision p : {Precision::kFp32, Precision::kBf16}) {
    // Under a sanitizer stage 3 only (what it checks, the threads and memory of the shards, is the
    // same at each stage).
    for (int stage = kSanitized ? 3 : 1; stage <= 3; ++stage) {
      SCOPED_TRACE(::testing::Message() << "stage " << stage << (p == Precision::kBf16 ? ", bf16" : ", fp32"));
      const TrainResult r = train(odd_vocab_run(5, stage, 3, p));
      ASSERT_EQ(r.final_local_params.size(), r.final_params.size());
      ASSERT_EQ(r.final_local_params[0].size(), static_cast<size_t>(make_model(mc)->layout().block(0).numel));
      EXPECT_EQ(padding_not_zero(r.final_local_params[0]), 0) << "master weights";
      EXPECT_EQ(padding_not_zero(r.final_local_working[0]), 0) << "working parameters";
      // The real rows trained (the logical blocks are the real vocabulary's, as gpt_layout's).
      EXPECT_EQ(r.final_params[0].size(), static_cast<size_t>(gpt_layout(mc).block(0).numel));
      EXPECT_EQ(std::memcmp(r.final_params[0].data(), r.final_local_params[0].data(), kV * kC * 4), 0);
    }
  }
}

// The memory plan counts what the engine holds: GPT-2's wte of 50,304 rows (47 x 768 more
// parameters than the 124,439,808 real ones, each padded block rounded up to its shard alignment).
TEST(PaddedVocab, ThePlanCountsThePaddedRows) {
  const ModelConfig mc = make_model_config("gpt2-124m");
  const auto model = make_model(mc);
  ZeroOptions o;
  o.stage = 0;
  const ModelStateBytes planned = plan_engine_memory(*model, 1, o).state;
  const int64_t padded = mc.num_parameters() + (50304 - 50257) * 768;
  EXPECT_GE(planned.params, static_cast<size_t>(padded) * 4);
  EXPECT_LE(planned.params, static_cast<size_t>(padded + 64 * model->layout().num_blocks()) * 4);
}

// Checkpoints hold the real vocabulary's rows (the arrays of a checkpoint written before the
// padding, so such checkpoints resume unchanged); the export writes wte as [V, C], and --init-from
// reads it back into the padded model bit for bit.
TEST(PaddedVocab, CheckpointsAndExportsHoldTheRealVocabulary) {
  const fs::path root = fs::path(::testing::TempDir()) / ("zt_padded_vocab_" + std::to_string(::getpid()));
  fs::remove_all(root);
  TrainConfig a = odd_vocab_run(2, 3, 2, Precision::kBf16);
  a.checkpoint_dir = (root / "ckpt").string();
  const TrainResult saved = train(a);
  ASSERT_FALSE(saved.checkpoints.empty());
  const ModelConfig mc = make_model_config("gpt-tiny", a.overrides);
  const CheckpointReader reader = CheckpointReader::open(saved.checkpoints.back());
  EXPECT_EQ(reader.array("embeddings/master").numel, static_cast<uint64_t>(gpt_layout(mc).block(0).numel));

  const std::string out = (root / "w.safetensors").string();
  export_safetensors(saved.checkpoints.back(), out);
  EXPECT_EQ(SafetensorsFile::open(out).at("wte.weight").shape, (std::vector<int64_t>{kV, kC}));

  // --init-from starts from exactly those weights (a first step skipped by a NaN keeps them).
  TrainConfig c = odd_vocab_run(1, 1, 1, Precision::kFp32);
  c.init_from = out;
  c.test.gradient_faults.push_back({1, 0, 0, 0, std::numeric_limits<float>::quiet_NaN()});
  const TrainResult r = train(c);
  EXPECT_TRUE(test::same_bits(r.final_params, saved.final_params));
  EXPECT_EQ(padding_not_zero(r.final_local_params[0]), 0);

  // Resuming the checkpoint continues the run.
  TrainConfig b = a;
  b.steps = 3;
  b.resume = ResumeFrom::newest();
  const TrainResult resumed = train(b);
  EXPECT_EQ(resumed.start_step, 2);
  EXPECT_EQ(padding_not_zero(resumed.final_local_params[0]), 0);
  fs::remove_all(root);
}

// With gemm_tiles on, a bf16 run of every GPT layout checks every GEMM (M, N, K multiples of 8,
// 16-byte-aligned operands) and completes: the LM head over the padded vocabulary (300 -> 384 rows,
// 192 per rank at tensor degree 2) passes where the unpadded one (V = 300) would be refused
// (kernels/test_lm_head_padded.cc shows that refusal).
TEST(PaddedVocab, GemmTilesHoldForEveryGptLayoutIn16Bits) {
  struct Layout {
    const char* name;
    int devices, stage, tensor, pipeline;
    bool sequence;
  };
  const Layout layouts[] = {{"one device", 1, 0, 1, 1, true},
                            {"ZeRO-3 on 2 devices", 2, 3, 1, 1, true},
                            {"tensor 2, sequence parallel", 2, 1, 2, 1, true},
                            {"tensor 2, no sequence parallelism", 2, 1, 2, 1, false},
                            {"pipeline 2 stages", 2, 1, 1, 2, true},
                            {"pipeline 2 x tensor 2", 4, 1, 2, 2, true}};
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.name);
    TrainConfig c = odd_vocab_run(l.devices, l.stage, 2, Precision::kBf16);
    c.overrides.layers = 2;
    c.overrides.embd = 32;
    c.overrides.heads = 4;
    c.batch_size = 4;
    c.micro_batch_size = 2;  // 16 rows a GEMM (8 a rank's with sequence parallelism)
    c.tensor_parallel = l.tensor;
    c.sequence_parallel = l.sequence;
    c.pipeline_parallel = l.pipeline;
    c.test.keep_final_params = false;
    c.gemm_tiles = true;
    const uint64_t before = ops::gemm_tiles_checked();
    const TrainResult r = train(c);
    EXPECT_EQ(r.steps, 2);
    EXPECT_GT(ops::gemm_tiles_checked(), before) << "no 16-bit GEMM was checked";
  }
}

// The MLP is not held to the tiles: its output layer has 10 classes (OC 10), so a run with the
// check on stops at that GEMM with the sentence naming it.
TEST(PaddedVocab, GemmTilesRefuseTheMlpsTenClassOutput) {
  if (!fs::exists(kFashionMnistDir)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TrainConfig c = test_util::tiny_train_config(1, 0, 1);
  c.model = "mlp";
  c.data = "fashion-mnist";
  c.batch_size = 16;
  c.precision = Precision::kBf16;
  c.test.keep_final_params = false;
  c.gemm_tiles = true;
  test::expect_train_error(c, ErrorKind::kInvalidArgument, "OC 10");
}

}  // namespace
}  // namespace zt
