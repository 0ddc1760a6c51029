// Bad input and bad luck, through the real binary: each case runs `zerotrain` in a scratch
// directory and checks the exit code, that stderr is one sentence, and that files which must
// survive (existing checkpoints, devices, inputs) are byte-identical afterwards. The table grows
// with every family of inputs that ever broke the promise (README "Bad input").
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Proc {
  int exit_code = -1;  // -1 when killed by a signal
  int term_signal = 0;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs the binary in `cwd` with a time limit; `during(pid)` runs while it does (signals).
Proc run_in(const fs::path& cwd, const std::vector<std::string>& args, double timeout_s = 120,
            const std::function<void(pid_t)>& during = {}) {
  const fs::path out = cwd / ".stdout", err = cwd / ".stderr";
  const pid_t pid = fork();
  if (pid == 0) {
    if (chdir(cwd.c_str()) != 0) _exit(120);
    if (!freopen(out.c_str(), "w", stdout) || !freopen(err.c_str(), "w", stderr)) _exit(121);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(ZEROTRAIN_BIN));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(ZEROTRAIN_BIN, argv.data());
    _exit(122);
  }
  if (during) during(pid);
  Proc p;
  int status = 0;
  const auto t0 = Clock::now();
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::duration<double>(Clock::now() - t0).count() > timeout_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "timed out after " << timeout_s << " s";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status)) p.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) p.term_signal = WTERMSIG(status);
  p.out = slurp(out);
  p.err = slurp(err);
  fs::remove(out);
  fs::remove(err);
  return p;
}

// Waits until `path` holds at least one line (the first step's metrics record: training runs).
void wait_for_line(const fs::path& path, double timeout_s = 60) {
  const auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < timeout_s) {
    if (slurp(path).find('\n') != std::string::npos) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << path << " stayed empty";
}

// Every regular file under root (or root itself) with its bytes; other kinds by their type.
std::map<std::string, std::string> fingerprint(const fs::path& root) {
  std::map<std::string, std::string> fp;
  if (!fs::exists(fs::symlink_status(root))) return fp;
  auto one = [&](const fs::path& p) {
    const fs::file_status st = fs::symlink_status(p);
    if (fs::is_regular_file(st)) fp[p.string()] = "file:" + slurp(p);
    else if (fs::is_symlink(st)) fp[p.string()] = "link:" + fs::read_symlink(p).string();
    else if (fs::is_directory(st)) fp[p.string()] = "dir";
    else fp[p.string()] = "other:" + std::to_string(static_cast<int>(st.type()));
  };
  one(root);
  if (fs::is_directory(fs::symlink_status(root)))
    for (const auto& e : fs::recursive_directory_iterator(root)) one(e.path());
  return fp;
}

// One sentence: a single "zerotrain: ..." line, not an internal error or a sanitizer report.
void expect_one_sentence(const Proc& p, const std::string& contains) {
  EXPECT_EQ(p.term_signal, 0) << "killed by signal " << p.term_signal << "\n" << p.err;
  const std::string& e = p.err;
  EXPECT_EQ(e.rfind("zerotrain: ", 0), 0u) << e;
  EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
  EXPECT_EQ(e.find("internal error"), std::string::npos) << e;
  EXPECT_NE(e.find(contains), std::string::npos) << "expected '" << contains << "' in: " << e;
}

const std::vector<std::string> kSmall = {"--layers", "1", "--embd", "32", "--heads", "2", "--seq-len", "16",
                                         "--sample-tokens", "0", "--eval-batches", "1"};

std::vector<std::string> small(std::vector<std::string> extra) {
  std::vector<std::string> a = {"train"};
  a.insert(a.end(), kSmall.begin(), kSmall.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("zt_bad_" + std::to_string(::getpid()) + "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;

  // A checkpoint directory with two complete checkpoints of a small run ("d"), for the cases that
  // must leave it untouched.
  void make_checkpoints() {
    const Proc p = run_in(dir_, small({"--steps", "2", "--checkpoint-dir", "d", "--save-every", "1", "--quiet"}));
    ASSERT_EQ(p.exit_code, 0) << p.err;
  }
};

// Issue: an error while a checkpoint save was in flight destroyed what the saver's callback used
// (heap corruption, exit 134). Now: the error's sentence and exit code, and every checkpoint that
// was complete stays complete and resumable.
TEST_F(BadInput, AnErrorWhileASaveRunsIsReportedAndLeavesCompleteCheckpoints) {
  const Proc p = run_in(dir_, small({"--steps", "10", "--checkpoint-dir", "d", "--save-every", "1", "--quiet",
                                     "--inject-fault", "device=1,step=5"}));
  EXPECT_EQ(p.exit_code, 1) << p.err;
  expect_one_sentence(p, "cpu:1");
  const Proc r = run_in(dir_, small({"--steps", "6", "--checkpoint-dir", "d", "--resume", "auto", "--quiet"}));
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST_F(BadInput, ADivergenceWhileSavingStopsWithExitCode3) {
  const Proc p = run_in(dir_, small({"--steps", "40", "--checkpoint-dir", "d", "--save-every", "1", "--quiet", "--lr",
                                     "1e30", "--grad-clip", "0", "--max-skipped-steps", "2"}));
  EXPECT_EQ(p.exit_code, 3) << p.err;
  expect_one_sentence(p, "consecutive steps were skipped");
  // The newest checkpoint is complete and loads (it holds the diverged weights, so the resumed run
  // diverges again — at the first step, not at the checkpoint).
  const Proc r = run_in(dir_, small({"--steps", "40", "--checkpoint-dir", "d", "--resume", "auto", "--quiet",
                                     "--max-skipped-steps", "1"}));
  EXPECT_EQ(r.exit_code, 3) << r.err;
  expect_one_sentence(r, "consecutive steps were skipped");
}

// The first SIGINT/SIGTERM finishes the step, saves it and exits 128 + signal with one line; the
// run resumes from that checkpoint.
TEST_F(BadInput, ASignalStopsAfterTheStepWithACheckpoint) {
  for (const int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(sig == SIGINT ? "SIGINT" : "SIGTERM");
    fs::remove_all(dir_ / "d");
    fs::remove(dir_ / "m.jsonl");
    const Proc p = run_in(dir_, small({"--steps", "100000", "--checkpoint-dir", "d", "--save-every", "1000", "--quiet",
                                       "--metrics", "m.jsonl"}),
                          120, [&](pid_t pid) {
                            wait_for_line(dir_ / "m.jsonl");
                            kill(pid, sig);
                          });
    EXPECT_EQ(p.exit_code, 128 + sig) << p.err;
    expect_one_sentence(p, sig == SIGINT ? "stopped by SIGINT" : "stopped by SIGTERM");
    EXPECT_NE(p.err.find("--resume auto"), std::string::npos) << p.err;
    ASSERT_TRUE(fs::exists(dir_ / "d" / "latest"));
    fs::remove(dir_ / "m.jsonl");
    const Proc r = run_in(dir_, small({"--steps", "100000", "--checkpoint-dir", "d", "--resume", "auto", "--quiet",
                                       "--metrics", "m.jsonl"}),
                          120, [&](pid_t pid) {
                            wait_for_line(dir_ / "m.jsonl");
                            kill(pid, sig);
                          });
    EXPECT_EQ(r.exit_code, 128 + sig) << r.err;
  }
}

// A second signal exits at once; the checkpoints that were complete stay untouched.
TEST_F(BadInput, ASecondSignalExitsAtOnceWithoutHarm) {
  make_checkpoints();
  const auto before = fingerprint(dir_ / "d" / "step-00000001");
  const Proc p = run_in(dir_, small({"--steps", "100000", "--checkpoint-dir", "d", "--resume", "auto", "--save-every",
                                     "1", "--keep", "0", "--quiet", "--metrics", "m.jsonl"}),
                        120, [&](pid_t pid) {
                          wait_for_line(dir_ / "m.jsonl");
                          kill(pid, SIGTERM);
                          kill(pid, SIGTERM);
                        });
  EXPECT_EQ(p.exit_code, 128 + SIGTERM) << p.err;
  EXPECT_EQ(fingerprint(dir_ / "d" / "step-00000001"), before);
  const Proc r = run_in(dir_, small({"--steps", "3", "--checkpoint-dir", "d", "--resume", "d/step-00000001", "--quiet"}));
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// A lost device does not end a run because the batch does not divide over the survivors.
TEST_F(BadInput, RecoveryNeverRefusesForArithmetic) {
  const Proc p = run_in(dir_, small({"--devices", "cpu:4", "--batch-size", "16", "--micro-batch-size", "4",
                                     "--snapshot-every", "5", "--inject-fault", "device=1,step=12", "--steps", "16",
                                     "--metrics", "m.jsonl"}));
  EXPECT_EQ(p.exit_code, 0) << p.err;
  EXPECT_NE(p.out.find("onto 3 devices"), std::string::npos) << p.out;
}

}  // namespace
