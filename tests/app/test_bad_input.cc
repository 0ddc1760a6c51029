// Bad input and bad luck, through the real binary: each case runs `zerotrain` in a scratch
// directory and checks the exit code, that stderr is one sentence, and that files which must
// survive (existing checkpoints, devices, inputs) are byte-identical afterwards. The table grows
// with every family of inputs that ever broke the promise (README "Bad input").
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "sanitizer.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Proc {
  int exit_code = -1;  // -1 when killed by a signal
  int term_signal = 0;
  std::string out, err;
};

// Runs the binary in `cwd` with a time limit, stdout and stderr going to the given files (stdout
// to /dev/full is a full disk); `during(pid)` runs while it does (signals, a second run). Proc::out
// and Proc::err hold what the files under `cwd` received; those files are then removed.
Proc run_io(const fs::path& cwd, const fs::path& out, const fs::path& err, const std::vector<std::string>& args,
            double timeout_s = 120, const std::function<void(pid_t)>& during = {}) {
  const bool own_out = out.parent_path() == cwd;
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
  if (own_out) {
    p.out = zt::test_util::read_text(out);
    fs::remove(out);
  }
  p.err = zt::test_util::read_text(err);
  fs::remove(err);
  return p;
}

Proc run_in(const fs::path& cwd, const std::vector<std::string>& args, double timeout_s = 120,
            const std::function<void(pid_t)>& during = {}) {
  return run_io(cwd, cwd / ".stdout", cwd / ".stderr", args, timeout_s, during);
}

// Waits until `path` holds at least one line (the first step's metrics record: training runs).
void wait_for_line(const fs::path& path, double timeout_s = 60) {
  const auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < timeout_s) {
    if (zt::test_util::read_text(path).find('\n') != std::string::npos) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << path << " stayed empty";
}

// Every regular file under root (or root itself) with its bytes; other kinds by their type.
std::map<std::string, std::string> fingerprint(const fs::path& root) {
  std::map<std::string, std::string> fp;
  if (!fs::exists(fs::symlink_status(root))) return fp;
  auto one = [&](const fs::path& p) {
    // Lock files hold whoever took the lock last (a refused run may have): not part of the data.
    if (p.filename() == ".run.lock" || p.filename() == ".lock") return;
    const fs::file_status st = fs::symlink_status(p);
    if (fs::is_regular_file(st)) fp[p.string()] = "file:" + zt::test_util::read_text(p);
    else if (fs::is_symlink(st)) fp[p.string()] = "link:" + fs::read_symlink(p).string();
    else if (fs::is_directory(st)) fp[p.string()] = "dir";
    else fp[p.string()] = "other:" + std::to_string(static_cast<int>(st.type()));
  };
  one(root);
  if (fs::is_directory(fs::symlink_status(root)))
    for (const auto& e : fs::recursive_directory_iterator(root)) one(e.path());
  return fp;
}

// The paths whose fingerprint differs (added, removed or changed), for a readable failure.
std::string changed(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  std::string out;
  for (const auto& [k, v] : a)
    if (!b.count(k)) out += " removed " + k;
    else if (b.at(k) != v) out += " changed " + k;
  for (const auto& [k, v] : b)
    if (!a.count(k)) out += " added " + k;
  return out;
}

// One sentence: a single "zerotrain: ..." line, not an internal error or a sanitizer report. A
// flag the command line parser rejects is its "--flag: ..." line and its fixed hint line.
void expect_one_sentence(const Proc& p, const std::string& contains) {
  EXPECT_EQ(p.term_signal, 0) << "killed by signal " << p.term_signal << "\n" << p.err;
  std::string e = p.err;
  const std::string hint = "\nRun with --help for more information.\n";
  if (e.rfind("--", 0) == 0 && e.size() > hint.size() && e.compare(e.size() - hint.size(), hint.size(), hint) == 0)
    e = "zerotrain: " + e.substr(0, e.size() - hint.size() + 1);
  EXPECT_EQ(e.rfind("zerotrain: ", 0), 0u) << e;
  EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
  EXPECT_EQ(e.find("internal error"), std::string::npos) << e;
  EXPECT_NE(e.find(contains), std::string::npos) << "expected '" << contains << "' in: " << e;
}

const std::vector<std::string> kSmall = {"--layers", "1", "--embd", "32", "--heads", "2", "--seq-len", "16",
                                         "--sample-tokens", "0", "--eval-batches", "1"};

// `train` with the small model; a flag of kSmall given in `extra` (flag, value) replaces its value
// there, since a repeated flag is itself a usage error.
std::vector<std::string> small(std::vector<std::string> extra) {
  std::vector<std::string> a = {"train"};
  a.insert(a.end(), kSmall.begin(), kSmall.end());
  for (size_t i = 0; i < extra.size(); ++i) {
    bool replaced = false;
    for (size_t k = 1; k + 1 <= kSmall.size() && i + 1 < extra.size(); k += 2)
      if (a[k] == extra[i]) {
        a[k + 1] = extra[++i];
        replaced = true;
        break;
      }
    if (!replaced) a.push_back(extra[i]);
  }
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

// A signal during an endless evaluation (--eval-batches 2000000000 after every step) ends it after
// the batches some rank began — every rank runs as many, so tensor parallelism's collectives pair
// up — and the run stops after the next step with its checkpoint and exit code.
TEST_F(BadInput, ASignalEndsAnEndlessEvaluation) {
  const Proc p = run_in(dir_, small({"--steps", "100000", "--eval-every", "1", "--eval-batches", "2000000000",
                                     "--devices", "cpu:2", "--tensor-parallel", "2", "--checkpoint-dir", "d",
                                     "--save-every", "1000", "--metrics", "m.jsonl"}),
                        120, [&](pid_t pid) {
                          wait_for_line(dir_ / "m.jsonl");
                          kill(pid, SIGTERM);
                        });
  EXPECT_EQ(p.exit_code, 128 + SIGTERM) << p.err;
  EXPECT_NE(p.out.find("interrupted by a stop signal"), std::string::npos) << p.out;
  EXPECT_TRUE(fs::exists(dir_ / "d" / "latest"));
}

// A second signal exits at once; the checkpoints that were complete stay untouched.
TEST_F(BadInput, ASecondSignalExitsAtOnceWithoutHarm) {
  // The second signal's _exit abandons the rank threads on purpose, whatever they are doing; under
  // ThreadSanitizer (whose _exit interceptor reports threads not yet joined, exit code 66) that is
  // not a leak to report. Other sanitizer options stay as the preset set them.
  const char* tsan = std::getenv("TSAN_OPTIONS");
  const std::string tsan_before = tsan ? tsan : "";
  setenv("TSAN_OPTIONS", (tsan_before + " report_thread_leaks=0").c_str(), 1);
  struct Restore {
    std::string v;
    bool had;
    ~Restore() { had ? setenv("TSAN_OPTIONS", v.c_str(), 1) : unsetenv("TSAN_OPTIONS"); }
  } restore{tsan_before, tsan != nullptr};
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


// ---- the reproductions of issue 12, one table per family ---------------------------------------

// One run of the binary with the exit code it must give, a phrase its one sentence must hold, and
// the paths (relative to the scratch directory) that must be byte-identical afterwards.
struct Case {
  std::string name;
  std::vector<std::string> args;
  int exit_code;
  std::string says;
  std::vector<std::string> unchanged = {};
};

void make_text(const fs::path& p, size_t bytes = 4096) {
  std::ofstream f(p, std::ios::binary);
  for (size_t i = 0; i < bytes; ++i) f.put(static_cast<char>('a' + (i * 7 + i / 13) % 26));
}

// An llm.c token shard written by hand from the format (not by the code under test).
void make_shard(const fs::path& p, size_t tokens, int vocab) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens);
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size() * 4));
  for (size_t i = 0; i < tokens; ++i) {
    const uint16_t t = static_cast<uint16_t>((i * 31 + i / 7) % static_cast<size_t>(vocab));
    f.write(reinterpret_cast<const char*>(&t), 2);
  }
}

bool is_char_device(const fs::path& p) { return fs::is_character_file(fs::symlink_status(p)); }

// Runs every case after `prepare`, checking code, sentence, that the named paths did not change,
// and then `after`.
void run_cases(const fs::path& dir, const std::vector<Case>& cases, const std::function<void()>& prepare = {},
               const std::function<void()>& after = {}) {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    if (prepare) prepare();
    std::map<std::string, std::map<std::string, std::string>> before;
    for (const std::string& u : c.unchanged) before[u] = fingerprint(dir / u);
    const Proc p = run_in(dir, c.args, 60);
    EXPECT_EQ(p.exit_code, c.exit_code) << p.err;
    expect_one_sentence(p, c.says);
    for (const std::string& u : c.unchanged) EXPECT_EQ(changed(before[u], fingerprint(dir / u)), "") << u;
    if (after) after();
  }
}

// 8: an empty value is a mistake, never "the default" or the current directory.
TEST_F(BadInput, EmptyValuesAreRefused) {
  std::vector<Case> cases;
  for (const char* flag : {"--resume", "--checkpoint-dir", "--init-from", "--metrics", "--trace", "--plot"})
    cases.push_back({flag, small({"--steps", "2", flag, ""}), 2, flag});
  run_cases(dir_, cases);
  EXPECT_TRUE(fs::is_empty(dir_)) << "a refused run wrote something";
}

// 5 and --lr 1e308: shapes and numbers that overflow are refused before anything is allocated;
// planning 100k layers finishes (the time is the planner's test, not this one).
TEST_F(BadInput, OverflowingShapesAndNumbersAreRefused) {
  const std::vector<Case> cases = {
      {"layers", small({"--steps", "2", "--layers", "2147483647"}), 2, "--layers"},
      {"embd", {"train", "--layers", "1", "--embd", "2147483647", "--heads", "1", "--seq-len", "16", "--steps", "2"}, 2,
       "--embd"},
      {"lr 1e308", small({"--steps", "2", "--lr", "1e308"}), 2, "--lr"},
  };
  run_cases(dir_, cases);
  // Sanitizers: 1000 layers. The plan is one thread's arithmetic, which TSan has nothing to check in
  // (100k layers took 40 s there, 12 s under ASan); UBSan sees its products at 30000 layers of a
  // wider model (more parameters than 100k of these) in Plan.WorkIsLinearInTheLayers. Release plans 100k.
  const char* layers = zt::test::kSanitized ? "1000" : "100000";
  const Proc p = run_in(dir_, {"plan", "--layers", layers, "--embd", "32", "--heads", "2", "--seq-len", "16"}, 120);
  EXPECT_EQ(p.exit_code, 0) << p.err;
}

// 4: inputs that are not regular files: a FIFO would block open(), /dev/zero and /dev/urandom
// would be read until memory ran out. Each is refused at once, naming the path.
TEST_F(BadInput, InputsThatAreNotRegularFilesAreRefused) {
  ASSERT_EQ(mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  const std::vector<Case> cases = {
      {"fifo", small({"--steps", "2", "--data", "fifo"}), 2, "fifo", {"fifo"}},
      {"fifo shard", small({"--steps", "2", "--data", "fifo.bin"}), 2, "fifo.bin"},
      {"/dev/zero", small({"--steps", "2", "--data", "/dev/zero"}), 2, "/dev/zero"},
      {"/dev/urandom", small({"--steps", "2", "--data", "/dev/urandom"}), 2, "/dev/urandom"},
      {"fifo init-from", small({"--steps", "2", "--init-from", "fifo"}), 2, "fifo", {"fifo"}},
  };
  ASSERT_EQ(mkfifo((dir_ / "fifo.bin").c_str(), 0600), 0);
  run_cases(dir_, cases);
  EXPECT_TRUE(fs::is_fifo(dir_ / "fifo"));
}

// 2: a token shard truncated while a run reads it is an I/O error naming the file (no SIGBUS).
TEST_F(BadInput, AShardTruncatedDuringTrainingIsAnIoErrorNamingIt) {
  fs::create_directories(dir_ / "shards");
  make_shard(dir_ / "shards" / "tok_train_000.bin", 20000, 256);
  make_shard(dir_ / "shards" / "tok_val_000.bin", 2000, 256);
  const Proc p = run_in(dir_, small({"--steps", "100000", "--vocab", "256", "--data", "shards/*.bin", "--eval-every",
                                     "100000", "--quiet", "--metrics", "m.jsonl"}),
                        120, [&](pid_t) {
                          wait_for_line(dir_ / "m.jsonl");
                          fs::resize_file(dir_ / "shards" / "tok_train_000.bin", 0);
                        });
  EXPECT_EQ(p.exit_code, 1) << p.err;
  expect_one_sentence(p, "tok_train_000.bin");
}

// 3 and 6 (outputs): a device node, a FIFO or a symbolic link at an output path is refused and left
// as it was; a full disk is an I/O error, never exit 0 with nothing written.
TEST_F(BadInput, OutputsThatAreNotRegularFilesAreRefusedAndLeftAlone) {
  make_checkpoints();
  ASSERT_EQ(mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  make_text(dir_ / "target.safetensors", 100);
  fs::create_symlink("target.safetensors", dir_ / "link.safetensors");
  const std::vector<Case> cases = {
      {"export /dev/full", {"export", "--checkpoint", "d", "--out", "/dev/full"}, 2, "/dev/full", {"d"}},
      {"export fifo", {"export", "--checkpoint", "d", "--out", "fifo"}, 2, "fifo", {"d", "fifo"}},
      {"export symlink", {"export", "--checkpoint", "d", "--out", "link.safetensors"}, 2, "link.safetensors",
       {"d", "link.safetensors", "target.safetensors"}},
      {"plot /dev/full", small({"--steps", "2", "--plot", "/dev/full"}), 2, "/dev/full"},
      {"metrics /dev/full", small({"--steps", "2", "--metrics", "/dev/full"}), 2, "/dev/full"},
      {"trace fifo", small({"--steps", "2", "--trace", "fifo"}), 2, "fifo", {"fifo"}},
  };
  run_cases(dir_, cases);
  EXPECT_TRUE(is_char_device("/dev/full"));
  EXPECT_TRUE(fs::is_fifo(fs::symlink_status(dir_ / "fifo")));
}

// 6: JSON logs to a stdout that cannot take them: exit 1 with the sentence, not exit 0.
TEST_F(BadInput, JsonLogsToAFullStdoutAreAnIoError) {
  const Proc p = run_io(dir_, "/dev/full", dir_ / ".stderr", small({"--steps", "2", "--log-format", "json"}), 60);
  EXPECT_EQ(p.exit_code, 1) << p.err;
  expect_one_sentence(p, "standard output");
  EXPECT_TRUE(is_char_device("/dev/full"));
}

// Also: an output over an input or over another output is refused and the input is unchanged; a
// name with glob characters that exists is that file, not a pattern.
TEST_F(BadInput, OutputsOverInputsOrEachOtherAreRefused) {
  make_text(dir_ / "book.txt");
  const std::vector<Case> cases = {
      {"plot over data", small({"--steps", "2", "--data", "book.txt", "--plot", "book.txt"}), 2, "book.txt",
       {"book.txt"}},
      {"metrics over data", small({"--steps", "2", "--data", "book.txt", "--metrics", "./book.txt"}), 2, "book.txt",
       {"book.txt"}},
      {"metrics and trace", small({"--steps", "2", "--metrics", "F", "--trace", "F"}), 2, "F"},
  };
  run_cases(dir_, cases);
  EXPECT_FALSE(fs::exists(dir_ / "F"));
}

TEST_F(BadInput, ATextFileWithGlobCharactersInItsNameIsThatFile) {
  make_text(dir_ / "a[1]*.txt");
  std::ofstream(dir_ / "a1x.txt") << "";  // what the pattern would match: empty, so it would fail
  const Proc p = run_in(dir_, small({"--steps", "2", "--data", "a[1]*.txt", "--quiet"}), 60);
  EXPECT_EQ(p.exit_code, 0) << p.err;
  // The pattern alone (no such file) still reaches the glob and finds the empty file.
  fs::remove(dir_ / "a[1]*.txt");
  const Proc q = run_in(dir_, small({"--steps", "2", "--data", "a[1]*.txt", "--quiet"}), 60);
  EXPECT_EQ(q.exit_code, 2) << q.err;
}

// 7: a checkpoint directory belongs to one run. Another seed or model is refused (also with
// --resume auto for another model), and nothing in the directory changes.
TEST_F(BadInput, AnotherRunCannotWriteIntoOrResumeACheckpointDirectory) {
  make_checkpoints();
  make_text(dir_ / "book.txt");
  const std::vector<Case> cases = {
      {"another seed", small({"--steps", "2", "--checkpoint-dir", "d", "--seed", "7"}), 2, "d", {"d"}},
      {"another model", small({"--steps", "2", "--checkpoint-dir", "d", "--layers", "2"}), 2, "d", {"d"}},
      {"another data", small({"--steps", "2", "--checkpoint-dir", "d", "--data", "book.txt"}), 2, "d", {"d"}},
      {"resume another model", small({"--steps", "4", "--checkpoint-dir", "d", "--resume", "auto", "--layers", "2"}), 2,
       "another model", {"d"}},
      {"resume other heads", small({"--steps", "4", "--checkpoint-dir", "d", "--resume", "auto", "--heads", "4"}), 2,
       "another model", {"d"}},
      {"init-from with resume auto",
       small({"--steps", "4", "--checkpoint-dir", "d", "--resume", "auto", "--init-from", "w.safetensors"}), 2,
       "--init-from", {"d", "w.safetensors"}},
  };
  const Proc e = run_in(dir_, {"export", "--checkpoint", "d", "--out", "w.safetensors"});
  ASSERT_EQ(e.exit_code, 0) << e.err;
  run_cases(dir_, cases);
}

// 7: a second run into a directory a live run holds is refused at start; the first run's
// checkpoints are untouched and the first run still finishes.
TEST_F(BadInput, ASecondConcurrentRunIntoOneDirectoryIsRefused) {
  std::map<std::string, std::string> before;
  Proc second;
  const Proc first = run_in(dir_, small({"--steps", "100000", "--checkpoint-dir", "d", "--save-every", "100000",
                                         "--quiet", "--metrics", "m.jsonl"}),
                            120, [&](pid_t pid) {
                              wait_for_line(dir_ / "m.jsonl");
                              before = fingerprint(dir_ / "d");
                              second = run_io(dir_, dir_ / ".stdout2", dir_ / ".stderr2",
                                              small({"--steps", "2", "--checkpoint-dir", "d", "--resume", "auto",
                                                     "--metrics", "m2.jsonl"}),
                                              60);
                              EXPECT_EQ(changed(before, fingerprint(dir_ / "d")), "");
                              kill(pid, SIGTERM);
                            });
  EXPECT_EQ(second.exit_code, 2) << second.err;
  expect_one_sentence(second, "d");
  EXPECT_EQ(zt::test_util::read_text(dir_ / "m2.jsonl").find("\"step\""), std::string::npos);
  EXPECT_EQ(first.exit_code, 128 + SIGTERM) << first.err;
  EXPECT_TRUE(fs::exists(dir_ / "d" / "latest"));
}

// 7: a step directory without a manifest is not ours to delete.
TEST_F(BadInput, PruningLeavesAStepDirectoryWithoutAManifestAlone) {
  make_checkpoints();
  fs::create_directories(dir_ / "d" / "step-00000099");
  make_text(dir_ / "d" / "step-00000099" / "notes.txt", 100);
  const auto before = fingerprint(dir_ / "d" / "step-00000099");
  const Proc p = run_in(dir_, small({"--steps", "4", "--checkpoint-dir", "d", "--resume", "auto", "--save-every", "1",
                                     "--keep", "1", "--quiet"}));
  EXPECT_EQ(p.exit_code, 0) << p.err;
  EXPECT_EQ(changed(before, fingerprint(dir_ / "d" / "step-00000099")), "");
  EXPECT_TRUE(fs::exists(dir_ / "d" / "step-00000004" / "manifest.json"));
  EXPECT_FALSE(fs::exists(dir_ / "d" / "step-00000001"));
}

// 10: checkpoint paths that cannot work fail before step 1 with exit 2 and leave d alone.
TEST_F(BadInput, UnusableCheckpointPathsFailBeforeTheFirstStep) {
  make_checkpoints();
  std::vector<Case> cases = {
      {"resume a file", small({"--steps", "4", "--checkpoint-dir", "d", "--resume", "d/latest", "--metrics", "m.jsonl"}),
       2, "d/latest", {"d"}},
      {"checkpoint-dir a file", small({"--steps", "4", "--checkpoint-dir", "d/latest", "--metrics", "m.jsonl"}), 2,
       "d/latest", {"d"}},
      {"checkpoint-dir through a file",
       small({"--steps", "4", "--checkpoint-dir", "d/latest/x", "--metrics", "m.jsonl"}), 2, "d/latest", {"d"}},
  };
  // As root chmod does not stop writes; sysfs refuses new files and directories to everyone.
  if (fs::is_directory("/sys/kernel")) {
    cases.push_back({"read-only checkpoint-dir",
                     small({"--steps", "4", "--checkpoint-dir", "/sys/kernel", "--metrics", "m.jsonl"}), 2,
                     "/sys/kernel is not empty", {"d"}});
    cases.push_back({"uncreatable checkpoint-dir",
                     small({"--steps", "4", "--checkpoint-dir", "/sys/zt-ckpt", "--metrics", "m.jsonl"}), 2,
                     "/sys/zt-ckpt cannot be created", {"d"}});
  } else {
    std::printf("note: no /sys here; the read-only --checkpoint-dir cases are skipped\n");
  }
  run_cases(dir_, cases, [&] { fs::remove(dir_ / "m.jsonl"); },
            [&] { EXPECT_EQ(zt::test_util::read_text(dir_ / "m.jsonl").find("\"step\""), std::string::npos) << "a step ran"; });
}

// 9: three devices with the default batch, and the README's resume of a 2-device run onto three
// devices at stage 3.
TEST_F(BadInput, ThreeDevicesTrainAndResumeATwoDeviceRun) {
  const Proc p = run_in(dir_, small({"--devices", "cpu:3", "--steps", "2", "--quiet"}));
  EXPECT_EQ(p.exit_code, 0) << p.err;
  make_checkpoints();
  const Proc r = run_in(dir_, small({"--steps", "4", "--checkpoint-dir", "d", "--resume", "auto", "--devices", "cpu:3",
                                     "--zero-stage", "3", "--quiet"}));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir_ / "d" / "step-00000004" / "manifest.json"));
}

}  // namespace

// --tensor-parallel T that does not divide the devices or the heads (the width and the MLP follow
// from the heads; the vocabulary is padded), a model it cannot split, or sequence parallelism over a micro-batch of too few tokens: one
// sentence naming the numbers and the nearest valid T.
namespace {
TEST_F(BadInput, TensorParallelDegreesThatDoNotDivideAreRefused) {
  run_cases(dir_, {
      {"devices", small({"--steps", "2", "--devices", "cpu:4", "--tensor-parallel", "3"}), 2,
       "does not divide the 4 devices; the nearest valid degree is 2"},
      {"heads", small({"--steps", "2", "--devices", "cpu:4", "--tp", "4"}), 2,
       "does not divide the model's heads (2); the nearest valid degree is 2"},
      {"mlp", {"train", "--model", "mlp", "--steps", "2", "--devices", "cpu:2", "--tp", "2"}, 2, "GPT models only"},
      {"sequence tokens", small({"--steps", "2", "--devices", "cpu:2", "--tp", "2", "--batch-size", "1",
                                 "--train-seq-len", "15"}), 2, "multiple of 2"},
  });
  EXPECT_TRUE(fs::is_empty(dir_)) << "a refused run wrote something";
}

// --comm nccl on simulated devices (every CPU build, and a CUDA build without a GPU) is refused
// before any device with the sentence naming the devices; an unknown engine is a usage error.
TEST_F(BadInput, CommNcclOnCpuDevicesIsRefusedBeforeAnyDevice) {
  run_cases(dir_, {
      {"cpu devices", small({"--steps", "2", "--devices", "cpu:2", "--comm", "nccl"}), 2,
       "--comm nccl needs CUDA devices; this run uses cpu:2"},
      {"unknown engine", small({"--steps", "2", "--devices", "cpu:2", "--comm", "mpi"}), 2, "--comm"},
  });
  EXPECT_TRUE(fs::is_empty(dir_)) << "a refused run wrote something";
}
}  // namespace
