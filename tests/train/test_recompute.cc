// --recompute through the trainer: selective and full recomputation give per-step losses and final
// master weights, working parameters and moments bitwise identical to none at every ZeRO stage, in
// fp32 and bf16, with and without gradient accumulation, with tensor parallelism; the summary counts the recompute time and
// the trace shows one "recompute h.N" range per layer and backward.
#include <gtest/gtest.h>

#include "sanitizer.h"
#include "test_util.h"
#include "train_checks.h"

#include <fstream>
#include <map>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "train/report.h"
#include "train/trace.h"
#include "train/trainer.h"

namespace zt {
namespace {

// A 2-layer GPT small enough for TSan; batch 8 over `devices`, micro-batch `micro`.
TrainConfig small_run(int devices, int stage, Precision precision, int micro, Recompute r) {
  TrainConfig c = test_util::tiny_train_config(devices, stage, test::kThreadSanitizer ? 2 : 3);
  c.overrides.layers = 2;
  c.overrides.embd = 32;
  c.overrides.heads = 2;
  c.overrides.seq_len = 16;
  c.train_seq_len = 16;
  c.batch_size = 8;
  c.micro_batch_size = micro;
  c.precision = precision;
  c.recompute = r;
  return c;
}

void expect_same_run(const TrainResult& a, const TrainResult& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << ", step " << i + 1;
  test::expect_same_state(a, b, what);
}

struct Setup {
  int devices, micro;
  Precision precision;
};

// Every stage against none at the same stage; a setup per precision and accumulation shape.
void check_modes_match_none(const Setup& s) {
  for (int stage = 0; stage <= 3; ++stage) {
    const TrainResult none = train(small_run(s.devices, stage, s.precision, s.micro, Recompute::kNone));
    ASSERT_FALSE(none.final_params.empty());
    for (Recompute r : {Recompute::kSelective, Recompute::kFull}) {
      const std::string what = std::string(recompute_name(r)) + ", stage " + std::to_string(stage) + ", " +
                               std::to_string(s.devices) + " devices, micro-batch " + std::to_string(s.micro);
      expect_same_run(none, train(small_run(s.devices, stage, s.precision, s.micro, r)), what);
    }
  }
}

TEST(Recompute, Fp32EveryStageBitwiseIdenticalToNone) { check_modes_match_none({2, 4, Precision::kFp32}); }

TEST(Recompute, Bf16EveryStageBitwiseIdenticalToNone) { check_modes_match_none({2, 4, Precision::kBf16}); }

// Micro-batch 1 of 2 rows per device: two backward passes accumulate into the same gradients, and
// recomputation must add each gradient once per micro-batch (not once per re-run forward).
TEST(Recompute, GradientAccumulationBitwiseIdenticalToNone) {
  check_modes_match_none({4, 1, Precision::kFp32});
}

// Tensor parallelism (2 data x 2 tensor, micro-batch 1: accumulation): the re-run layers run their
// collectives again inside the backward, and every mode still gives none's bits, with and without
// sequence parallelism, fp32 and bf16.
TEST(Recompute, TensorParallelBitwiseIdenticalToNone) {
  for (const auto& [precision, sequence, stage] :
       {std::tuple{Precision::kFp32, true, 3}, std::tuple{Precision::kFp32, false, 1}, std::tuple{Precision::kBf16, true, 2}}) {
    auto run = [&](Recompute r) {
      TrainConfig c = small_run(4, stage, precision, 1, r);
      c.tensor_parallel = 2;
      c.sequence_parallel = sequence;
      return train(c);
    };
    const TrainResult none = run(Recompute::kNone);
    ASSERT_FALSE(none.final_params.empty());
    for (Recompute r : {Recompute::kSelective, Recompute::kFull})
      expect_same_run(none, run(r), std::string(recompute_name(r)) + ", TP 2, stage " + std::to_string(stage) +
                                        (sequence ? "" : ", no SP") + (precision == Precision::kBf16 ? ", bf16" : ""));
  }
}

TEST(Recompute, SummaryCountsRecomputeTime) {
  const TrainResult none = train(small_run(2, 3, Precision::kFp32, 4, Recompute::kNone));
  EXPECT_EQ(none.time_split.recompute, 0.0);
  const TrainResult full = train(small_run(2, 3, Precision::kFp32, 4, Recompute::kFull));
  EXPECT_GT(full.time_split.recompute, 0.0);
  // Stream time of work that the compute phase waited for.
  EXPECT_LT(full.time_split.recompute, full.time_split.compute);
  RunReport rep;
  rep.phases = full.time_split;
  EXPECT_NE(format_summary(rep).find("recompute"), std::string::npos);
  EXPECT_GT(report_json(rep)["time_split"]["recompute_s"].get<double>(), 0.0);
}

// Each backward of each layer re-runs inside its own range, nested in that block's backward range,
// on each device's host-ranges track.
TEST(Recompute, TraceShowsARecomputeRangePerLayerAndBackward) {
  test_util::TempDir dir("recompute_trace");
  TrainConfig c = small_run(2, 3, Precision::kFp32, 2, Recompute::kSelective);  // 2 micro-batches
  c.trace_path = dir.path("trace.json");
  const TrainResult r = train(c);
  std::ifstream f(c.trace_path);
  const nlohmann::json j = nlohmann::json::parse(f);
  std::map<std::pair<int, std::string>, int> count;  // (device, name) -> ranges
  for (const auto& e : j["traceEvents"])
    if (e.value("tid", -1) == TraceRecorder::kHostTid && e.value("ph", "") == "X")
      ++count[{e["pid"].get<int>(), e["name"].get<std::string>()}];
  const int backwards = static_cast<int>(r.losses.size()) * 2;
  for (int d = 0; d < 2; ++d)
    for (int l = 0; l < 2; ++l) {
      const std::string h = "h." + std::to_string(l);
      EXPECT_EQ((count[{d, "recompute " + h}]), backwards) << "device " << d << ", " << h;
      EXPECT_EQ((count[{d, "backward " + h}]), backwards) << "device " << d << ", " << h;
    }
}

}  // namespace
}  // namespace zt
