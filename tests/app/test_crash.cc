// Crash safety of checkpoints with a real training process: zerotrain saves a checkpoint every
// step and is killed with SIGKILL at a random instant (often in the middle of writing one), again
// and again; every time, --resume auto finds the newest complete checkpoint, which validates, and
// no directory that looks like a checkpoint is incomplete. ZT_CRASH_TRIALS raises the trial count
// (bench/crash_trials.sh runs many more).
// Also: a run that fails (a device error, divergence) while a background save is in flight exits
// with its own code and sentence, never a heap-corruption abort.
#include <gtest/gtest.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "sanitizer.h"
#include "test_util.h"

namespace zt {
namespace {

namespace fs = std::filesystem;

pid_t spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    // The child only execs: nothing else is safe after fork in a threaded process.
    const int devnull = ::open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
      dup2(devnull, 1);
      dup2(devnull, 2);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

std::vector<std::string> train_args(const std::string& root, int steps, bool resume) {
  std::vector<std::string> a = {ZEROTRAIN_BIN, "train", "--layers", "1", "--embd", "32", "--heads", "2",
                                "--devices", "cpu:2", "--zero-stage", "2", "--steps", std::to_string(steps),
                                "--sample-tokens", "0", "--eval-every", "0", "--eval-batches", "1",
                                "--checkpoint-dir", root, "--save-every", "1", "--keep", "2", "--quiet"};
  if (resume) a.insert(a.end(), {"--resume", "auto"});
  return a;
}

TEST(CrashSafety, SigkillDuringCheckpointWritesNeverLosesTheNewestCompleteOne) {
  // 50 trials (about half of them land inside a save); 20 under ASan, where each trial's start-up is
  // slower (32 s for 50) and the kill instants are the same kind: release runs the 50.
  const char* env = std::getenv("ZT_CRASH_TRIALS");
  const int trials = env ? std::max(1, std::atoi(env)) : test::kSanitized ? 20 : 50;
  const fs::path root = fs::temp_directory_path() / ("zt_crash_" + std::to_string(::getpid()));
  fs::remove_all(root);
  std::mt19937 rng(20261130);
  std::uniform_int_distribution<int> delay_ms(0, 120);
  int killed_mid_run = 0, with_checkpoint = 0, mid_save = 0;
  int64_t last_step = 0;
  for (int t = 0; t < trials; ++t) {
    SCOPED_TRACE("trial " + std::to_string(t));
    // Each trial resumes from what the previous ones left and is killed again.
    const auto before = read_latest(root.string());
    const pid_t pid = spawn(train_args(root.string(), 1000000, /*resume=*/true));
    ASSERT_GT(pid, 0);
    // Once the run is saving (a new checkpoint was committed), kill it at a random instant: with a
    // save after every step, most instants fall inside one.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (read_latest(root.string()) == before && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
    kill(pid, SIGKILL);
    const int code = wait_exit(pid);
    killed_mid_run += code == -SIGKILL;
    ASSERT_TRUE(code == -SIGKILL) << "the run ended by itself with " << code;

    // A staging directory left behind: this kill landed in the middle of a save.
    if (fs::exists(root))
      for (const auto& e : fs::directory_iterator(root))
        if (e.path().filename().string().rfind(".tmp-", 0) == 0) {
          ++mid_save;
          break;
        }
    // Every directory named step-N is complete and valid; `latest` names one of them.
    const auto listed = list_checkpoints(root.string());
    for (const auto& e : listed) {
      ASSERT_TRUE(e.has_manifest) << e.path << " has no manifest";
      EXPECT_NO_THROW(CheckpointReader::open(e.path)) << e.path;
    }
    std::vector<std::string> notes;
    const auto got = resolve_resume(root.string(), ResumeFrom::newest(), &notes);
    EXPECT_TRUE(notes.empty()) << notes.front();
    if (!got) {
      EXPECT_TRUE(listed.empty());
      continue;
    }
    ++with_checkpoint;
    ASSERT_FALSE(listed.empty());
    EXPECT_EQ(got->step, listed.back().step) << "resume auto did not pick the newest complete checkpoint";
    EXPECT_GE(got->step, last_step) << "a complete checkpoint was lost";
    last_step = got->step;
  }
  EXPECT_EQ(killed_mid_run, trials);
  EXPECT_EQ(with_checkpoint, trials) << "every trial waited for a checkpoint before the kill";
  std::printf("%d trials: %d killed in the middle of a save, %d with a checkpoint to resume (newest step %lld)\n",
              trials, mid_save, with_checkpoint, static_cast<long long>(last_step));
  // And the survivor trains on.
  const int code = wait_exit(spawn(train_args(root.string(), static_cast<int>(last_step) + 2, /*resume=*/true)));
  EXPECT_EQ(code, 0);
  fs::remove_all(root);
}


TEST(CrashSafety, AFailureWhileASaveIsInFlightExitsWithItsCodeNotAnAbort) {
  const fs::path root = fs::temp_directory_path() / ("zt_inflight_" + std::to_string(::getpid()));
  const std::string common = "train --layers 1 --embd 32 --heads 2 --seq-len 16 --devices cpu:2 --sample-tokens 0 "
                             "--eval-every 0 --eval-batches 1 --save-every 1 --checkpoint-dir " + root.string();
  struct Case {
    const char* what;
    std::string args;
    int code;
  };
  const Case cases[] = {
      {"a device error", common + " --steps 10 --inject-fault device=1,step=5", 1},
      {"divergence", common + " --steps 30 --max-skipped-steps 2 --lr 1e30 --grad-clip 0", 3},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    fs::remove_all(root);
    const auto [code, out] = zt::test_util::run_binary(ZEROTRAIN_BIN, c.args);
    EXPECT_EQ(code, c.code) << out;
    EXPECT_EQ(out.find("malloc"), std::string::npos) << out;
    EXPECT_NE(out.find("zerotrain: "), std::string::npos) << "no sentence on stderr:\n" << out;
    // What was committed before the failure is complete.
    for (const auto& e : list_checkpoints(root.string())) EXPECT_NO_THROW(CheckpointReader::open(e.path)) << e.path;
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace zt
