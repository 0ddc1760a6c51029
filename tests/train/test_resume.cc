// Checkpoints through the trainer: resume is bit-exact (save at k, resume, continue to n equals
// one run to n: losses and parameter/master/moment bytes) at N = 1, 2, 4, every ZeRO stage, fp32
// and bf16; a checkpoint saved by N devices at stage s loads on M devices at stage t with the
// gathered fp32 master weights and moments bitwise equal and the loss continuing; a corrupt
// newest checkpoint makes --resume auto fall back to the previous one and say so; the same with
// --offload optimizer on either side, and in-process recovery with it.
#include <gtest/gtest.h>

#include "sanitizer.h"
#include "test_util.h"
#include "train_checks.h"

#include <unistd.h>

#include <cstring>
#include <limits>
#include <map>
#include <filesystem>
#include <fstream>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "train/export.h"
#include "train/plan.h"
#include "core/status.h"
#include "model/model.h"
#include "train/trainer.h"
#include "train/world.h"

namespace zt {
namespace {

namespace fs = std::filesystem;

class Resume : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("zt_resume_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir(const std::string& sub) const { return (dir_ / sub).string(); }
  fs::path dir_;
};

TrainConfig tiny(int devices, int stage, int steps, Precision p) {
  TrainConfig c = test_util::tiny_train_config(devices, stage, steps);
  test_util::set_model_shape(c, 2, 64, 2, 32);
  c.batch_size = 12;  // splits over 1, 2, 3 and 4 devices
  c.precision = p;
  return c;
}

using test::expect_same_state;
using test::expect_train_error;
using test::same_bits;

TEST_F(Resume, IsBitExactAtEveryDeviceCountStageAndPrecision) {
  const int kSave = 3, kEnd = 6;
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    for (int n : {1, 2, 4}) {
      for (int stage = 0; stage <= 3; ++stage) {
        if (n == 1 && stage > 0) continue;  // one device: every stage is the same layout
        SCOPED_TRACE(std::string(p == Precision::kFp32 ? "fp32" : "bf16") + ", N=" + std::to_string(n) + ", stage " +
                     std::to_string(stage));
        const std::string root = dir("p" + std::to_string(static_cast<int>(p)) + "n" + std::to_string(n) + "s" +
                                     std::to_string(stage));
        TrainConfig whole = tiny(n, stage, kEnd, p);
        whole.checkpoint_dir = root;
        whole.save_every = kSave;
        whole.keep = 0;
        const TrainResult full = train(whole);
        ASSERT_EQ(full.checkpoints.size(), 2u);  // step 3 and the end
        TrainConfig resumed = tiny(n, stage, kEnd, p);
        resumed.resume = ResumeFrom::checkpoint(full.checkpoints[0]);
        const TrainResult rest = train(resumed);
        EXPECT_EQ(rest.start_step, kSave);
        ASSERT_EQ(rest.losses.size(), static_cast<size_t>(kEnd - kSave));
        for (int i = 0; i < kEnd - kSave; ++i)
          EXPECT_EQ(rest.losses[static_cast<size_t>(i)], full.losses[static_cast<size_t>(kSave + i)]) << "step " << kSave + i + 1;
        expect_same_state(rest, full, "resumed vs uninterrupted");
      }
    }
  }
}

TEST_F(Resume, FromOtherDeviceCountsAndStagesGathersTheSameStateAndContinues) {
  struct Case {
    int from_n, from_stage, to_n, to_stage;
  };
  const Case cases[] = {{4, 2, 2, 2}, {2, 2, 4, 2}, {4, 1, 1, 0}, {3, 3, 4, 1}, {2, 1, 2, 3}, {4, 3, 2, 0}};
  for (const Case& k : cases) {
    SCOPED_TRACE(std::to_string(k.from_n) + " devices stage " + std::to_string(k.from_stage) + " -> " +
                 std::to_string(k.to_n) + " devices stage " + std::to_string(k.to_stage));
    const std::string root = dir("r" + std::to_string(k.from_n) + std::to_string(k.from_stage) + std::to_string(k.to_n) +
                                 std::to_string(k.to_stage));
    TrainConfig a = tiny(k.from_n, k.from_stage, 4, Precision::kFp32);
    a.checkpoint_dir = root;
    const TrainResult saved = train(a);  // saves at the end (step 4)
    ASSERT_EQ(saved.checkpoints.size(), 1u);

    // Two more steps on the new layout and on the old one: the first loss is computed from the
    // restored weights, so the two agree up to the new device count's reduction order.
    TrainConfig b = tiny(k.to_n, k.to_stage, 6, Precision::kFp32);
    b.checkpoint_dir = root;
    b.resume = ResumeFrom::newest();
    const TrainResult moved = train(b);
    TrainConfig same = tiny(k.from_n, k.from_stage, 6, Precision::kFp32);
    same.resume = ResumeFrom::checkpoint(saved.checkpoints[0]);
    const TrainResult stayed = train(same);
    ASSERT_EQ(moved.start_step, 4);
    ASSERT_EQ(moved.losses.size(), 2u);
    EXPECT_NEAR(moved.losses[0], stayed.losses[0], 1e-5 * stayed.losses[0]) << "loss continues across the reshard";
    EXPECT_NEAR(moved.losses[1], stayed.losses[1], 1e-4 * stayed.losses[1]);
    EXPECT_LT(moved.losses[0], saved.losses.front()) << "it did not start over";
  }
}

// AdamW's step count lives on the devices (one counter per rank): a resume onto another device
// count and stage sets every new rank's counter from the checkpoint's update count (a skipped
// step before the checkpoint makes it differ from the step), and the run counts on from there.
TEST_F(Resume, TheDevicesUpdateCountFollowsAReshardedResume) {
  TrainConfig a = tiny(4, 2, 4, Precision::kFp32);
  a.checkpoint_dir = dir("count");
  a.test.gradient_faults.push_back({2, 0, 0, 0, std::numeric_limits<float>::quiet_NaN()});
  a.test.keep_final_params = true;
  const TrainResult saved = train(a);
  ASSERT_EQ(saved.skipped_steps, std::vector<int>{2});
  EXPECT_EQ(saved.final_update_counts, std::vector<int64_t>(4, 3));
  TrainConfig b = tiny(2, 3, 6, Precision::kFp32);
  b.resume = ResumeFrom::checkpoint(saved.checkpoints.at(0));
  b.test.keep_final_params = true;
  const TrainResult moved = train(b);
  ASSERT_EQ(moved.start_step, 4);
  EXPECT_EQ(moved.final_update_counts, std::vector<int64_t>(2, 5)) << "3 updates before the checkpoint, 2 after";
}

TEST_F(Resume, ReshardedLoadRestoresMasterAndMomentsBitwise) {
  // Save on 4 devices at stage 1; resume elsewhere for one step that an injected NaN skips, so the
  // final state is exactly what was loaded.
  const std::string root = dir("bits");
  TrainConfig a = tiny(4, 1, 3, Precision::kBf16);
  a.checkpoint_dir = root;
  const TrainResult saved = train(a);
  for (auto [n, stage] : {std::pair{2, 3}, std::pair{3, 0}, std::pair{1, 2}}) {
    SCOPED_TRACE(std::to_string(n) + " devices, stage " + std::to_string(stage));
    TrainConfig b = tiny(n, stage, 4, Precision::kBf16);
    b.resume = ResumeFrom::checkpoint(saved.checkpoints[0]);
    b.test.gradient_faults.push_back({4, 0, 0, 0, std::numeric_limits<float>::quiet_NaN()});
    const TrainResult r = train(b);
    ASSERT_EQ(r.skipped_steps, std::vector<int>{4});
    // Nothing changed since the load: the gathered state equals what the 4 devices saved.
    expect_same_state(r, saved, "loaded elsewhere vs saved");
  }
}

TEST_F(Resume, AutoFallsBackPastACorruptNewestCheckpointAndSaysSo) {
  const std::string root = dir("fallback");
  TrainConfig a = tiny(2, 2, 4, Precision::kFp32);
  a.checkpoint_dir = root;
  a.save_every = 2;
  a.keep = 0;
  const TrainResult saved = train(a);
  ASSERT_EQ(saved.checkpoints.size(), 2u);
  // Flip one byte in the middle of the newest checkpoint's second shard file.
  const std::string victim = saved.checkpoints[1] + "/" + format_rank_file(1);
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekg(0, std::ios::end);
    const auto size = static_cast<std::streamoff>(f.tellg());
    f.seekg(size / 2);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(size / 2);
    f.write(&c, 1);
  }
  TrainConfig b = tiny(2, 2, 5, Precision::kFp32);
  b.checkpoint_dir = root;
  b.resume = ResumeFrom::newest();
  b.test.keep_final_params = false;
  const TrainResult r = train(b);
  EXPECT_EQ(r.start_step, 2);
  ASSERT_EQ(saved.losses.size(), 4u);
  ASSERT_EQ(r.losses.size(), 3u);
  ASSERT_EQ(r.resume_notes.size(), 1u);
  EXPECT_NE(r.resume_notes[0].find("rank-00001.bin"), std::string::npos) << r.resume_notes[0];
  EXPECT_EQ(r.losses.front(), saved.losses[2]) << "step 3 from the step-2 checkpoint";

  // Named explicitly, the corrupt checkpoint is refused with the file's name, never loaded.
  TrainConfig c = b;
  c.resume = ResumeFrom::checkpoint(saved.checkpoints[1]);
  expect_train_error(c, ErrorKind::kInvalidArgument, "rank-00001.bin");
}

TEST_F(Resume, ConvertingToAnotherDeviceCountAndStageRewritesEveryArrayBitwise) {
  // --steps equal to the checkpoint's step: load (resharded) and save again.
  TrainConfig a = tiny(2, 2, 3, Precision::kBf16);
  a.checkpoint_dir = dir("a");
  a.test.keep_final_params = false;
  const TrainResult saved = train(a);
  TrainConfig b = tiny(3, 3, 3, Precision::kBf16);
  b.resume = ResumeFrom::checkpoint(saved.checkpoints[0]);
  b.checkpoint_dir = dir("b");
  b.test.keep_final_params = false;
  const TrainResult conv = train(b);
  ASSERT_EQ(conv.checkpoints.size(), 1u);
  const CheckpointReader ra = CheckpointReader::open(saved.checkpoints[0]);
  const CheckpointReader rb = CheckpointReader::open(conv.checkpoints[0]);
  EXPECT_EQ(rb.meta().at("devices"), 3);
  ASSERT_EQ(ra.manifest().arrays.size(), rb.manifest().arrays.size());
  for (const ManifestArray& arr : ra.manifest().arrays) {
    ASSERT_TRUE(rb.has_array(arr.name)) << arr.name;
    const size_t bytes = arr.numel * storage_dtype_size(arr.dtype);
    std::vector<uint8_t> x(bytes), y(bytes);
    ra.read(arr.name, 0, arr.numel, x.data());
    rb.read(arr.name, 0, arr.numel, y.data());
    EXPECT_EQ(x, y) << arr.name;
  }
}

// A save after a step that also took the recovery snapshot (--snapshot-every dividing --save-every)
// writes that snapshot rather than copying every shard to the host a second time: the metrics
// record says so, and both checkpoints hold the bits and meta of a run without --snapshot-every.
TEST_F(Resume, ASaveAtASnapshotStepSharesTheSnapshotAndWritesTheSameBits) {
  fs::create_directories(dir_);
  TrainConfig a = tiny(2, 2, 6, Precision::kBf16);
  a.test.keep_final_params = false;
  a.save_every = 4;
  a.checkpoint_dir = dir("plain");
  TrainConfig b = a;
  b.checkpoint_dir = dir("shared");
  b.snapshot_every = 2;
  b.metrics_path = dir("metrics.jsonl");
  const TrainResult ra = train(a), rb = train(b);
  ASSERT_EQ(ra.checkpoints.size(), 2u);
  ASSERT_EQ(rb.checkpoints.size(), 2u);
  std::map<int, bool> from_snapshot;  // step -> the record's flag
  std::vector<size_t> snapshot_bytes;
  std::ifstream in(b.metrics_path);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("event", "") == "checkpoint") from_snapshot[j.at("step").get<int>()] = j.at("from_snapshot").get<bool>();
    if (j.value("event", "") == "snapshot") snapshot_bytes.push_back(j.at("bytes").get<size_t>());
  }
  // What `zerotrain plan` says a snapshot holds in host memory is what the snapshots held.
  PlanInputs pin;
  pin.working = DType::kBF16;
  const size_t planned = snapshot_host_bytes(make_model_config("gpt-tiny", b.overrides), pin);
  EXPECT_EQ(snapshot_bytes, (std::vector<size_t>{planned, planned, planned})) << "steps 0, 2 and 4";
  // Step 6 is the last: no recovery snapshot is taken after it, so its save copies from the devices.
  EXPECT_EQ(from_snapshot, (std::map<int, bool>{{4, true}, {6, false}}));
  for (size_t k = 0; k < 2; ++k) {
    const CheckpointReader x = CheckpointReader::open(ra.checkpoints[k]);
    const CheckpointReader y = CheckpointReader::open(rb.checkpoints[k]);
    nlohmann::json mx = x.meta(), my = y.meta();
    mx.erase("checkpoint_owner");  // each directory's own
    my.erase("checkpoint_owner");
    EXPECT_EQ(mx, my) << ra.checkpoints[k];
    ASSERT_EQ(x.manifest().arrays.size(), y.manifest().arrays.size());
    for (const ManifestArray& arr : x.manifest().arrays) {
      ASSERT_TRUE(y.has_array(arr.name)) << arr.name;
      const size_t bytes = arr.numel * storage_dtype_size(arr.dtype);
      std::vector<uint8_t> u(bytes, 0xAB), v(bytes, 0xCD);
      x.read(arr.name, 0, arr.numel, u.data());
      y.read(arr.name, 0, arr.numel, v.data());
      EXPECT_EQ(u, v) << ra.checkpoints[k] << " " << arr.name;
    }
  }
  // fp32 with SGD: masters and one moment, no 16-bit copy.
  TrainConfig c = tiny(2, 1, 1, Precision::kFp32);
  c.test.keep_final_params = false;
  c.optimizer = OptimizerKind::kSgd;
  c.snapshot_every = 1;
  c.metrics_path = dir("metrics-sgd.jsonl");
  train(c);
  std::ifstream sgd(c.metrics_path);
  size_t held = 0;
  for (std::string line; std::getline(sgd, line);)
    if (const nlohmann::json j = nlohmann::json::parse(line); j.value("event", "") == "snapshot") held = j.at("bytes");
  pin.working = DType::kF32;
  pin.sgd = true;
  EXPECT_EQ(held, snapshot_host_bytes(make_model_config("gpt-tiny", c.overrides), pin));
}

// --offload optimizer keeps master weights and moments in host memory; checkpoints read and write
// them through the same engine accessors, so a checkpoint saved with offload resumes without it
// and the reverse, on other device counts and stages, bit for bit.
struct OffloadSide {
  int n, stage;
  bool offload;
  float fraction;
};
TrainConfig with_offload(TrainConfig c, const OffloadSide& s) {
  c.offload_optimizer = s.offload;
  c.offload_fraction = s.fraction;
  return c;
}
std::string describe(const OffloadSide& s) {
  return std::to_string(s.n) + " devices stage " + std::to_string(s.stage) +
         (s.offload ? " offload " + std::to_string(s.fraction) : " no offload");
}

TEST_F(Resume, WithAndWithoutOffloadReshardedLoadsTheSameBits) {
  const std::pair<OffloadSide, OffloadSide> cases[] = {{{4, 2, true, 1.0f}, {2, 1, false, 1.0f}},
                                                        {{2, 1, false, 1.0f}, {4, 3, true, 0.5f}},
                                                        {{4, 3, true, 0.5f}, {3, 2, true, 1.0f}},
                                                        // 6 ranks: the last two hold no element of the small blocks
                                                        {{2, 2, false, 1.0f}, {6, 3, true, 0.5f}}};
  int i = 0;
  for (const auto& [from, to] : cases) {
    SCOPED_TRACE(describe(from) + " -> " + describe(to));
    TrainConfig a = with_offload(tiny(from.n, from.stage, 3, Precision::kBf16), from);
    a.checkpoint_dir = dir("o" + std::to_string(i++));
    const TrainResult saved = train(a);
    ASSERT_EQ(saved.checkpoints.size(), 1u);
    // One more step that an injected NaN skips: the final state is exactly what was loaded.
    TrainConfig b = with_offload(tiny(to.n, to.stage, 4, Precision::kBf16), to);
    b.resume = ResumeFrom::checkpoint(saved.checkpoints[0]);
    b.test.gradient_faults.push_back({4, 0, 0, 0, std::numeric_limits<float>::quiet_NaN()});
    const TrainResult r = train(b);
    ASSERT_EQ(r.skipped_steps, std::vector<int>{4});
    expect_same_state(r, saved, "loaded elsewhere vs saved");
  }
}

TEST_F(Resume, WithOffloadIsBitExactAndContinuesAsTheDeviceOptimizer) {
  const int kSave = 3, kEnd = 5;
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    if (test::kSanitized && p == Precision::kFp32) continue;  // CI's 2 cores: bf16 covers the paths
    for (int stage = 1; stage <= 3; ++stage) {
      const OffloadSide side{2, stage, true, stage == 2 ? 0.5f : 1.0f};
      SCOPED_TRACE(std::string(p == Precision::kFp32 ? "fp32, " : "bf16, ") + describe(side));
      TrainConfig whole = with_offload(tiny(2, stage, kEnd, p), side);
      whole.checkpoint_dir = dir("w" + std::to_string(static_cast<int>(p)) + std::to_string(stage));
      whole.save_every = kSave;
      whole.keep = 0;
      const TrainResult full = train(whole);
      ASSERT_EQ(full.checkpoints.size(), 2u);
      for (bool offload : {true, false}) {
        TrainConfig resumed = tiny(2, stage, kEnd, p);
        resumed.offload_optimizer = offload;
        resumed.offload_fraction = side.fraction;
        resumed.resume = ResumeFrom::checkpoint(full.checkpoints[0]);
        const TrainResult rest = train(resumed);
        ASSERT_EQ(rest.losses.size(), static_cast<size_t>(kEnd - kSave));
        for (int k = 0; k < kEnd - kSave; ++k)
          EXPECT_EQ(rest.losses[static_cast<size_t>(k)], full.losses[static_cast<size_t>(kSave + k)]) << "step " << kSave + k + 1;
        expect_same_state(rest, full, offload ? "resumed with offload" : "resumed without offload");
      }
    }
  }
}

// With the delayed update (--offload-delay-update) too: the snapshot applies the pending update as a
// checkpoint does, and the run goes on from it on the other devices.
TEST(FaultTolerance, RecoveryWorksWithOffload) {
  for (bool delay : {false, true}) {
    SCOPED_TRACE(delay ? "delayed update" : "update in its step");
    TrainConfig c = tiny(4, 2, 14, Precision::kBf16);
    c.test.keep_final_params = false;
    c.offload_optimizer = true;
    c.offload_fraction = 0.5f;
    c.offload_delay_update = delay;
    const TrainResult clean = train(c);
    c.snapshot_every = 5;
    c.inject_faults = {{2, 8, false}};
    const TrainResult r = train(c);
    ASSERT_EQ(r.recoveries.size(), 1u);
    EXPECT_EQ(r.recoveries[0].resumed_from_step, 5);
    EXPECT_EQ(r.devices, 3);
    ASSERT_EQ(r.losses.size(), 14u) << "every step reported once";
    for (int i = 0; i < 5; ++i)
      EXPECT_EQ(r.losses[static_cast<size_t>(i)], clean.losses[static_cast<size_t>(i)]) << "step " << i + 1;
    EXPECT_NEAR(r.final_loss / clean.final_loss, 1.0, 0.01) << r.final_loss << " vs " << clean.final_loss;
  }
}

TEST(FaultTolerance, ADeviceFailingMidRunIsDroppedAndTrainingFinishesOnTheOthers) {
  for (bool hang : {false, true}) {
    SCOPED_TRACE(hang ? "hang" : "error");
    TrainConfig c = tiny(4, 2, 30, Precision::kFp32);
    c.test.keep_final_params = false;
    const TrainResult clean = train(c);
    c.snapshot_every = 5;
    c.inject_faults = {{2, 13, hang}};
    c.hang_timeout_s = 2;
    const TrainResult r = train(c);
    ASSERT_EQ(r.recoveries.size(), 1u);
    const Recovery& rec = r.recoveries[0];
    EXPECT_EQ(rec.failed_at_step, 13);
    EXPECT_EQ(rec.device, "cpu:2");
    EXPECT_EQ(rec.resumed_from_step, 10) << "at most --snapshot-every steps of work lost";
    EXPECT_EQ(rec.devices_after, 3);
    EXPECT_EQ(r.devices, 3);
    ASSERT_EQ(r.losses.size(), 30u) << "every step reported once";
    EXPECT_NEAR(r.final_loss / clean.final_loss, 1.0, 0.01) << r.final_loss << " vs " << clean.final_loss;
    if (hang) {
      EXPECT_EQ(rec.cause, "stopped answering");
    }
  }
}

// The watchdog's decision (train/world.h hang_response). An injected hang is released by
// abandon() on every backend; a real one on the CPU backend abandons the devices that did not
// drain (none when all did not: which one stopped cannot be told). A real GPU that does not drain
// cannot be released (its waiters sit inside the CUDA runtime): the process ends rather than hang.
// Devices that all drained mean the hang is on the host side (a communicator wait): the abort
// releases it on both backends.
TEST(FaultTolerance, HangResponseAbandonsWhatCanBeReleasedAndEndsTheProcessForAStuckGpu) {
  using V = std::vector<bool>;
  using I = std::vector<int>;
  for (Backend b : {Backend::kCpu, Backend::kCuda}) {
    SCOPED_TRACE(b == Backend::kCuda ? "cuda" : "cpu");
    HangResponse h = hang_response(b, V{false, false, true, false}, V{true, true, true, true});
    EXPECT_EQ(h.abandon, I{2});
    EXPECT_FALSE(h.end_process);
    h = hang_response(b, V{false, false, false}, V{false, false, false});
    EXPECT_EQ(h.abandon, I{});
    EXPECT_FALSE(h.end_process);
  }
  HangResponse h = hang_response(Backend::kCpu, V{false, false, false}, V{false, true, false});
  EXPECT_EQ(h.abandon, I{1});
  EXPECT_FALSE(h.end_process);
  h = hang_response(Backend::kCpu, V{false, false}, V{true, true});
  EXPECT_EQ(h.abandon, I{});
  EXPECT_FALSE(h.end_process);
  h = hang_response(Backend::kCuda, V{false, false, false}, V{false, true, false});
  EXPECT_EQ(h.abandon, I{1});
  EXPECT_TRUE(h.end_process);
  h = hang_response(Backend::kCuda, V{false, false}, V{true, true});
  EXPECT_EQ(h.abandon, (I{0, 1}));
  EXPECT_TRUE(h.end_process);
}

// The survivors need not divide the global batch: its rows are split unevenly (train/batch_split.h)
// and every real position keeps its weight, so the run still optimises the same objective.
TEST(FaultTolerance, SurvivorsThatDoNotDivideTheBatchSplitItUnevenly) {
  struct Case {
    int devices, micro;
    std::vector<FaultInjection> faults;
    int after;
  };
  for (const Case& k : {Case{4, 4, {{1, 12, false}}, 3}, Case{8, 2, {{1, 8, false}, {4, 17, false}}, 6}}) {
    SCOPED_TRACE(std::to_string(k.devices) + " devices, " + std::to_string(k.faults.size()) + " faults");
    TrainConfig c = tiny(k.devices, 2, 30, Precision::kFp32);
    c.test.keep_final_params = false;
    c.batch_size = 16;
    c.micro_batch_size = k.micro;
    const TrainResult clean = train(c);
    c.snapshot_every = 5;
    c.inject_faults = k.faults;
    const TrainResult r = train(c);
    ASSERT_EQ(r.recoveries.size(), k.faults.size());
    EXPECT_EQ(r.devices, k.after);
    EXPECT_EQ(r.recoveries.back().devices_after, k.after);
    ASSERT_EQ(r.losses.size(), clean.losses.size()) << "every step reported once";
    // Until the first fault's snapshot, both runs are the same run.
    const int same = r.recoveries[0].resumed_from_step;
    for (int i = 0; i < same; ++i) {
      EXPECT_EQ(r.losses[static_cast<size_t>(i)], clean.losses[static_cast<size_t>(i)]) << i;
    }
    EXPECT_NEAR(r.final_loss / clean.final_loss, 1.0, 0.01) << r.final_loss << " vs " << clean.final_loss;
  }
}

TEST(FaultTolerance, WithoutSnapshotsAFailedDeviceEndsTheRunWithItsError) {
  TrainConfig c = tiny(2, 1, 6, Precision::kFp32);
  c.test.keep_final_params = false;
  c.inject_faults = {{1, 3, false}};
  expect_train_error(c, ErrorKind::kDevice, "cpu:1");
}

TEST_F(Resume, ExportWritesGpt2SafetensorsAndInitFromReadsThemBack) {
  const std::string root = dir("export");
  TrainConfig a = tiny(2, 3, 3, Precision::kBf16);
  a.checkpoint_dir = root;
  const TrainResult saved = train(a);
  const std::string out = dir("model.safetensors");
  const ExportReport rep = export_safetensors(root, out);
  EXPECT_EQ(rep.step, 3);
  // GPT-2 names and Hugging Face's [in, out] layout for the Conv1D matrices.
  const SafetensorsFile f = SafetensorsFile::open(out);
  const SafetensorsEntry& qkv = f.at("h.1.attn.c_attn.weight");
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{64, 192}));
  EXPECT_EQ(f.at("wte.weight").shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const ModelConfig mc = make_model_config("gpt-tiny", a.overrides);
  const auto model = make_model(mc);
  const auto weights = read_safetensors_weights(out, mc, model->layout());
  // Element (o, i) of our [out, in] matrix is element (i, o) of the file's.
  const auto [b, t] = model->layout().find("h.1.attn.c_attn.weight");
  const std::vector<uint8_t> raw = f.read("h.1.attn.c_attn.weight");
  float v = 0;
  std::memcpy(&v, raw.data() + (5 * 192 + 7) * 4, 4);  // file (i=5, o=7)
  EXPECT_EQ(v, saved.final_params[static_cast<size_t>(b)][static_cast<size_t>(t->offset + 7 * 64 + 5)]);
  for (size_t k = 0; k < weights.size(); ++k)
    EXPECT_EQ(std::memcmp(weights[k].data(), saved.final_params[k].data(), weights[k].size() * 4), 0) << "block " << k;

  // --init-from starts from exactly those weights (a first step skipped by a NaN keeps them).
  TrainConfig c = tiny(4, 1, 1, Precision::kFp32);
  c.init_from = out;
  c.test.gradient_faults.push_back({1, 0, 0, 0, std::numeric_limits<float>::quiet_NaN()});
  const TrainResult r = train(c);
  EXPECT_TRUE(same_bits(r.final_params, saved.final_params));

  // A model of another shape is refused with the tensor named.
  TrainConfig wrong = c;
  wrong.overrides.embd = 32;
  expect_train_error(wrong, ErrorKind::kInvalidArgument, "shape");
}

}  // namespace
}  // namespace zt
