// Bad luck that must not cost a user files or a finished run (#31 reproductions 1, 2, 12, 13, 14;
// 11 is tests/train/test_mpi_stop.cc, under mpirun): each case runs `zerotrain` in a scratch
// directory and checks, by xxHash64 checksums of every file, that nothing outside the run's own
// directories changed; the hang watchdog (12) is tested at unit level on run_ranks.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/file_io.h"
#include "comm/communicator.h"
#include "core/heartbeat.h"
#include "runtime/runtime.h"
#include "sanitizer.h"
#include "test_util.h"
#include "train/world.h"

namespace zt {
namespace {

namespace fs = std::filesystem;

using test_util::read_text;

// Every entry under root but the run lock (it holds whoever took it last: not part of anyone's data).
std::map<std::string, std::string> checksums(const fs::path& root) {
  return test_util::tree_fingerprint(root, {".run.lock"});
}

struct Outcome {
  int code = -1;
  std::string out, err;
};

class BadLuck : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() /
            ("zt_luck_" + std::to_string(::getpid()) + "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    fs::create_directories(base_ / "work");
    fs::create_directories(base_ / "io");
  }
  void TearDown() override { fs::remove_all(base_); }

  fs::path work() const { return base_ / "work"; }

  // Runs the binary in work() (HOME=work(): nothing of the real home is touched), stdout and
  // stderr into files outside it.
  Outcome run(const std::string& args) {
    const fs::path out = base_ / "io" / "out", err = base_ / "io" / "err";
    const std::string cmd = "cd '" + work().string() + "' && HOME='" + work().string() + "' " + ZEROTRAIN_BIN + " " +
                            args + " >'" + out.string() + "' 2>'" + err.string() + "'";
    const int status = std::system(cmd.c_str());
    Outcome r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_text(out);
    r.err = read_text(err);
    return r;
  }

  // Refused: exit 2, one "zerotrain: ..." line holding `contains`, and not a byte changed under work().
  void expect_refused(const std::string& args, const std::string& contains) {
    SCOPED_TRACE(args);
    const auto before = checksums(work());
    const Outcome r = run(args);
    EXPECT_EQ(r.code, 2) << r.err;
    // A flag the command line parser rejects is its "--flag: ..." line and a fixed hint line.
    std::string e = r.err;
    const std::string hint = "\nRun with --help for more information.\n";
    if (e.rfind("--", 0) == 0 && e.size() > hint.size() && e.compare(e.size() - hint.size(), hint.size(), hint) == 0)
      e = "zerotrain: " + e.substr(0, e.size() - hint.size() + 1);
    EXPECT_EQ(e.rfind("zerotrain: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << r.err;
    EXPECT_NE(e.find(contains), std::string::npos) << "expected '" << contains << "' in: " << r.err;
    EXPECT_EQ(r.out.find("\"step\""), std::string::npos) << "a step ran";
    EXPECT_EQ(checksums(work()), before);
  }

  fs::path base_;
};

// Under ThreadSanitizer (each run of the binary several times slower) only the case that trains
// with a lease held runs through the binary: the others are file logic on one thread, which the
// other presets check.
#define ZT_SKIP_UNDER_TSAN()                                                                  \
  if (test::kThreadSanitizer) GTEST_SKIP() << "single-threaded file logic: checked without TSan"

const std::string kTiny =
    "train --layers 1 --embd 32 --heads 2 --seq-len 16 --eval-batches 1 --sample-tokens 0 --devices cpu:2 --quiet ";

// Reproduction 1: a user's folder with a step name inside --checkpoint-dir is refused before step
// 1 (not "left alone" and then replaced by the step-1 save): in a directory without an owner, and
// in the run's own directory (its lineage continuing) alike.
TEST_F(BadLuck, AUsersStepFolderInTheCheckpointDirectoryIsNeverReplaced) {
  fs::create_directories(work() / "f" / "step-00000001");
  std::ofstream(work() / "f" / "step-00000001" / "notes.txt") << "my notes\n";
  expect_refused(kTiny + "--steps 2 --save-every 1 --checkpoint-dir f", "no owner record");
  fs::rename(work() / "f" / "step-00000001", work() / "notes");
  const Outcome first = run(kTiny + "--steps 2 --save-every 2 --checkpoint-dir f");
  ASSERT_EQ(first.code, 0) << first.err;
  fs::rename(work() / "notes", work() / "f" / "step-00000001");
  expect_refused(kTiny + "--steps 2 --save-every 1 --checkpoint-dir f", "step-00000001");
  expect_refused(kTiny + "--steps 4 --save-every 1 --checkpoint-dir f --resume auto", "move it out");
  EXPECT_EQ(read_text(work() / "f" / "step-00000001" / "notes.txt"), "my notes\n");
}

// Reproduction 2: with owner.json removed, a fresh run (or a resumed one) does not adopt the
// directory, and the other run's checkpoints are not pruned.
TEST_F(BadLuck, ADirectoryWhoseOwnerRecordWasRemovedIsNotAdopted) {
  ZT_SKIP_UNDER_TSAN();
  const Outcome first = run(kTiny + "--steps 2 --save-every 1 --keep 0 --checkpoint-dir d");
  ASSERT_EQ(first.code, 0) << first.err;
  fs::remove(work() / "d" / "owner.json");
  expect_refused(kTiny + "--steps 2 --save-every 1 --keep 1 --checkpoint-dir d", "no owner record");
  expect_refused(kTiny + "--steps 4 --save-every 1 --keep 1 --checkpoint-dir d --resume auto",
                 "--resume d/step-N --checkpoint-dir NEW");
  std::ofstream(work() / "d" / "owner.json") << "{\"format\": ";
  expect_refused(kTiny + "--steps 2 --checkpoint-dir d", "not a valid owner record");
  // The way out the sentence names: resume one of them into a new directory.
  const Outcome moved = run(kTiny + "--steps 3 --checkpoint-dir e --resume d/step-00000002");
  EXPECT_EQ(moved.code, 0) << moved.err;
  EXPECT_TRUE(fs::exists(work() / "e" / "step-00000003" / "manifest.json"));
}

// `/` and the home directory are nobody's checkpoint directory.
TEST_F(BadLuck, TheRootAndTheHomeDirectoryAreRefused) {
  ZT_SKIP_UNDER_TSAN();
  std::ofstream(work() / "diary.txt") << "dear diary\n";
  expect_refused(kTiny + "--steps 2 --checkpoint-dir " + work().string(), "is the home directory");
  expect_refused(kTiny + "--steps 2 --checkpoint-dir " + work().string() + "/", "is the home directory");
  const bool had_lock = fs::exists("/.run.lock"), had_owner = fs::exists("/owner.json");
  expect_refused(kTiny + "--steps 2 --checkpoint-dir /", "file system's root");
  EXPECT_EQ(fs::exists("/.run.lock"), had_lock);
  EXPECT_EQ(fs::exists("/owner.json"), had_owner);
}

// Reproduction 14: numbers beyond the type they become are refused with the real reason.
TEST_F(BadLuck, NumbersBeyondTheirTypeAreRefusedWithTheRealReason) {
  ZT_SKIP_UNDER_TSAN();
  expect_refused(kTiny + "--steps 2 --hang-timeout 1e10", "at most 1e9 seconds");
  expect_refused(kTiny + "--steps 2 --comm-timeout 1e30", "at most 1e9 seconds");
  expect_refused(kTiny + "--steps 9223372036854775807", "at most 2147483647");
  // Parsed by hand (not by a flag check): the same, with the reason rather than "a bad number".
  expect_refused(kTiny + "--steps 2 --device-memory 99999999999999999999GiB", "is above 1e18 bytes");
  expect_refused(kTiny + "--steps 2 --inject-fault device=0,step=99999999999", "above 1000000000");
  expect_refused(kTiny + "--steps 2 --loss-scale 1e39", "above 3.4e38, the largest fp32 number");
  expect_refused(kTiny + "--steps 2 --profile-steps 1:99999999999", "has a step above 2147483647");
  expect_refused("train --model mlp --devices cpu:2 --quiet --steps 2 --hidden 99999999999", "is above 1048576");
}

// Reproduction 13: `plan --largest` lists only what `plan` (and so `train`) of that shape accepts:
// with --pp 2 no ZeRO-3 or offload row, and every row's model fits by `plan` itself.
TEST_F(BadLuck, PlanLargestListsOnlyWhatPlanAccepts) {
  ZT_SKIP_UNDER_TSAN();
  const auto before = checksums(work());
  for (const std::string memory : {"1GiB", "2GiB"}) {
    SCOPED_TRACE(memory);
    const Outcome table = run("plan --largest --pp 2 --device-memory " + memory);
    ASSERT_EQ(table.code, 0) << table.err;
    // "2      full       none       9 x 640      77.1 M  ..."
    const std::regex row(R"(^([0-3])\s+(none|selective|full)\s+(none|optimizer)\s+(none fits|(\d+) x (\d+))\s)");
    int rows = 0;
    std::istringstream in(table.out);
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (!std::regex_search(line, m, row)) continue;
      ++rows;
      EXPECT_NE(m[1], "3") << "ZeRO-3, which --pp refuses: " << line;
      EXPECT_EQ(m[3], "none") << "offload, which --pp refuses: " << line;
      if (m[4] == "none fits") continue;
      const int width = std::stoi(m[6]);
      const Outcome plan = run("plan --pp 2 --device-memory " + memory + " --layers " + std::string(m[5]) + " --embd " +
                           std::to_string(width) + " --heads " + std::to_string(width / 64) +
                           " --vocab 50257 --seq-len 1024 --zero-stage " + std::string(m[1]) + " --recompute " +
                           std::string(m[2]));
      EXPECT_EQ(plan.code, 0) << line << "\n" << plan.err;
      EXPECT_NE(plan.out.find("verdict: fits"), std::string::npos) << line << "\n" << plan.out;
    }
    EXPECT_EQ(rows, 9) << "stages 0-2 x recompute none/selective/full:\n" << table.out;
  }
  EXPECT_EQ(checksums(work()), before);
}

// ---- reproduction 12: the hang watchdog measures progress, not time --------------------------

struct WatchdogFixture {
  std::unique_ptr<Runtime> rt = Runtime::create_cpu(2);
  std::vector<Device*> devs = {&rt->device(0), &rt->device(1)};
  Communicator comm{devs};
};

// A rank that keeps working (a heartbeat every 50 ms) for 1.2 s is slow, not hung: a 0.8 s
// --hang-timeout does not fire, where the old rule (the whole call within the timeout) did.
TEST(HangWatchdog, ASlowRankThatKeepsBeatingIsNotHung) {
  WatchdogFixture f;
  std::atomic<int> fired{0};
  run_ranks(
      2,
      [&](int r) {
        for (int i = 0; r == 0 && i < 24; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          heartbeat();
        }
      },
      f.comm, std::chrono::milliseconds(800), [&] { ++fired; });
  EXPECT_EQ(fired.load(), 0);
}

// A rank that beats a few times and then stops answering is hung: the watchdog fires once and
// releases it (as abandoning a device releases whoever waits on it).
TEST(HangWatchdog, ARankThatStopsBeatingIsHung) {
  WatchdogFixture f;
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  std::atomic<int> fired{0};
  run_ranks(
      2,
      [&](int r) {
        if (r != 0) return;
        for (int i = 0; i < 3; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          heartbeat();
        }
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return released; });
      },
      f.comm, std::chrono::milliseconds(300), [&] {
        ++fired;
        std::lock_guard<std::mutex> lock(mu);
        released = true;
        cv.notify_all();
      });
  EXPECT_EQ(fired.load(), 1);
}

}  // namespace
}  // namespace zt
