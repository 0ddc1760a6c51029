// The sweep directory through the real binary (issue #31's reproductions 3, 4, 6-10): foreign
// directories, / and $HOME refused; a FIFO or symbolic link in place of any sweep file refused
// without blocking; a kill right after a pause is recorded repaired on the rerun; identity by the
// resolved flags; the sweep lock; launchers refused; --tp trials as train runs them; damaged
// files one sentence. Every refusal is checked to leave every file it could reach unchanged.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "sweep/journal.h"
#include "test_util.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- the records, as bytes (journal.h) --------------------------------------------------------

sweep::JournalRecord report(int trial, int step, std::optional<double> loss, bool go) {
  sweep::JournalRecord r;
  r.kind = sweep::JournalRecord::Kind::kReport;
  r.trial = trial;
  r.step = step;
  r.loss = loss;
  r.go = go;
  return r;
}

using test_util::invalid_argument_message;

TEST(SweepJournal, LinesRoundTripATornTailIsReportedDamageElsewhereIsOneSentence) {
  sweep::JournalRecord result;
  result.kind = sweep::JournalRecord::Kind::kResult;
  result.trial = 1;
  result.result.values = {{"lr", "1e-3"}, {"embd", "64"}};
  result.result.status = sweep::TrialStatus::kStopped;
  result.result.reason = "ASHA: \"quoted\" reason";
  result.result.steps = 4;
  result.result.final_loss = 5.25;
  result.result.best_val = result.result.last_val = 0.1 + 0.2;  // not a short decimal: bits must survive
  result.result.val_curve = {{2, 5.5}, {4, 0.1 + 0.2}};
  const std::vector<sweep::JournalRecord> records = {report(0, 2, 5.125, false), report(1, 2, std::nullopt, true),
                                                     result};
  std::string text;
  for (const auto& r : records) text += sweep::journal_line(r);
  const sweep::ParsedJournal p = sweep::parse_journal(text, 2, "j");
  ASSERT_EQ(p.records.size(), 3u);
  EXPECT_FALSE(p.torn_tail);
  EXPECT_EQ(p.valid_bytes, text.size());
  EXPECT_EQ(p.records[0].loss, 5.125);
  EXPECT_FALSE(p.records[1].loss.has_value());
  EXPECT_TRUE(p.records[1].go);
  const sweep::TrialOutcome& t = p.records[2].result;
  EXPECT_EQ(t.values, result.result.values);
  EXPECT_EQ(t.status, sweep::TrialStatus::kStopped);
  EXPECT_EQ(t.reason, result.result.reason);
  EXPECT_EQ(t.last_val, 0.1 + 0.2);
  EXPECT_EQ(t.val_curve, result.result.val_curve);
  // A kill inside the last append: without its newline, or with its bytes cut (checksum fails).
  for (const std::string& tail : {sweep::journal_line(report(0, 4, 1.0, true)).substr(0, 30),
                                  sweep::journal_line(report(0, 4, 1.0, true)).replace(40, 1, "9")}) {
    const sweep::ParsedJournal torn = sweep::parse_journal(text + tail, 2, "j");
    EXPECT_TRUE(torn.torn_tail);
    EXPECT_EQ(torn.valid_bytes, text.size());
    EXPECT_EQ(torn.records.size(), 3u);
  }
  // The same damage before the end, a trial outside the sweep, a foreign event: one sentence.
  std::string flipped = text;
  flipped[text.find('\n') + 25] ^= 1;
  EXPECT_NE(invalid_argument_message([&] { sweep::parse_journal(flipped, 2, "j"); }).find("damaged at line 2"), std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { sweep::parse_journal(text, 1, "j"); }).find("line 2 is not a record"), std::string::npos);
  // Record rules behind a checksum (verify = false reaches them without computing one).
  for (const auto& [body, why] : std::vector<std::pair<std::string, std::string>>{
           {R"({"event":"launch","trial":0})", "not one of start, report"},
           {R"({"event":"report","trial":0,"step":"2","loss":1,"continue":true})", "\"step\" is not a whole number"},
           {R"({"event":"report","trial":0,"step":2,"loss":1,"continue":1})", "not true or false"},
           {R"({"event":"start","trial":-1})", "outside 0..1"},
           {R"([1, 2])", "not a JSON object"}}) {
    const std::string line = "0000000000000000 " + body + "\n";
    EXPECT_NE(invalid_argument_message([&] { sweep::parse_journal(line + line, 2, "j", false); }).find(why), std::string::npos)
        << body;
  }
}

TEST(SweepJournal, SweepRecordIsChecksummedAndIdentityDifferencesAreNamed) {
  const json a = sweep::make_identity({"max-steps = 4", "batch-size = 8"}, {{{"lr", "1e-3"}}, {{"lr", "2e-3"}}});
  const std::string text = sweep::format_sweep_record({a, "--space lr=1e-3,2e-3"});
  const sweep::SweepRecord r = sweep::parse_sweep_record(text, "s");
  EXPECT_EQ(r.identity, a);
  EXPECT_EQ(r.command, "--space lr=1e-3,2e-3");
  std::string edited = text;
  edited.replace(edited.find("max-steps = 4"), 13, "max-steps = 5");
  EXPECT_NE(invalid_argument_message([&] { sweep::parse_sweep_record(edited, "s"); }).find("checksum"), std::string::npos);
  EXPECT_NE(invalid_argument_message([&] { sweep::parse_sweep_record(R"({"command": "x", "space": []})", "s"); }).find("older"),
            std::string::npos);
  EXPECT_EQ(sweep::identity_difference(a, a), "");
  const json b = sweep::make_identity({"batch-size = 8", "max-steps = 5"}, {{{"lr", "1e-3"}}, {{"lr", "2e-3"}}});
  EXPECT_EQ(sweep::identity_difference(a, b), "--max-steps was 4 and is now 5");
  const json c = sweep::make_identity({"batch-size = 8", "max-steps = 4"}, {{{"lr", "1e-3"}}, {{"lr", "3e-3"}}});
  EXPECT_NE(sweep::identity_difference(a, c).find("trial-001"), std::string::npos);
}

// ---- through the binary ------------------------------------------------------------------------

struct Proc {
  int exit_code = -1;  // -1: killed by a signal (term_signal)
  int term_signal = 0;
  std::string out, err;
};

std::string slurp(const fs::path& p) { return test_util::read_text(p.string()); }

// Runs zerotrain in `cwd` with extra environment variables; gives up (and fails) after 60 s, so a
// sweep that blocks on a FIFO is a failure, not a hung test.
Proc run(const fs::path& cwd, const std::vector<std::string>& args,
         const std::vector<std::pair<std::string, std::string>>& env = {}) {
  static int counter = 0;
  const fs::path io = fs::temp_directory_path() / ("zt_sweep_files_io_" + std::to_string(::getpid()));
  fs::create_directories(io);
  const fs::path out = io / ("out" + std::to_string(counter)), err = io / ("err" + std::to_string(counter++));
  const pid_t pid = fork();
  if (pid == 0) {
    if (chdir(cwd.c_str()) != 0) _exit(120);
    if (!freopen(out.c_str(), "w", stdout) || !freopen(err.c_str(), "w", stderr)) _exit(121);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv = {const_cast<char*>(ZEROTRAIN_BIN)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(ZEROTRAIN_BIN, argv.data());
    _exit(122);
  }
  int status = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "zerotrain did not end within 60 s (blocked?)";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  Proc p;
  if (WIFEXITED(status)) p.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) p.term_signal = WTERMSIG(status);
  p.out = slurp(out);
  p.err = slurp(err);
  fs::remove_all(io);
  return p;
}

// Every entry under `root` except the sweeps' lock files (they hold the last holder's pid):
// compared before and after a command, the command changed nothing it could reach.
std::map<std::string, std::string> fingerprint(const fs::path& root) {
  return test_util::tree_fingerprint(root, {sweep::kSweepLockFileName});
}

// One sentence on stderr: one line, no library internals.
void expect_one_sentence(const Proc& p, const std::string& must_contain, const std::string& what) {
  EXPECT_EQ(p.exit_code, 2) << what << "\n" << p.err;
  EXPECT_EQ(std::count(p.err.begin(), p.err.end(), '\n'), 1) << what << ": " << p.err;
  EXPECT_NE(p.err.find(must_contain), std::string::npos) << what << ": " << p.err;
  for (const char* leak : {"type_error", "check failed", "parse_error", "internal"})
    EXPECT_EQ(p.err.find(leak), std::string::npos) << what << ": " << p.err;
}

std::string leaderboard_of(const std::string& out) {
  const size_t at = out.find("leaderboard");
  return at == std::string::npos ? "" : out.substr(at);
}

// A small ASHA sweep (3 trials, rungs at 1 and 2 of 4 steps) on one device: one trial at a time,
// so its journal's order, and its leaderboard, are the same on every run.
std::vector<std::string> asha_args(const std::string& dir) {
  return {"sweep", "--layers", "1", "--embd", "32", "--heads", "2", "--seq-len", "16", "--eval-batches", "1",
          "--sample-tokens", "0", "--devices", "cpu:1", "--space", "lr=1e-3,3e-3,2e-3", "--max-steps", "4",
          "--scheduler", "asha", "--eta", "2", "--min-steps", "1", "--sweep-dir", dir, "--quiet"};
}

class SweepFiles : public ::testing::Test {
 protected:
  // One uninterrupted sweep for the whole suite: the reference and the directory the cases copy.
  static void SetUpTestSuite() {
    tmp_ = new test_util::TempDir("sweep_files");
    fs::create_directories(tmp_->path("ref"));
    ref_ = new Proc(run(tmp_->path("ref"), asha_args("w")));
    ASSERT_EQ(ref_->exit_code, 0) << ref_->err;
  }
  static void TearDownTestSuite() {
    delete ref_;
    delete tmp_;
  }
  void SetUp() override {
    ASSERT_EQ(ref_->exit_code, 0);
    work_ = tmp_->root() / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::create_directories(work_);
  }
  // A copy of the reference sweep at work_/name.
  std::string copy_of_ref(const std::string& name) const {
    fs::copy(tmp_->path("ref") + "/w", work_ / name, fs::copy_options::recursive);
    return name;
  }
  static test_util::TempDir* tmp_;
  static Proc* ref_;
  fs::path work_;
};
test_util::TempDir* SweepFiles::tmp_ = nullptr;
Proc* SweepFiles::ref_ = nullptr;

// Reproduction 3.
TEST_F(SweepFiles, ForeignDirectoriesRootAndHomeAreRefusedUntouched) {
  fs::create_directories(work_ / "u/trial-000");
  std::ofstream(work_ / "u/trial-000/metrics.jsonl") << "my notes\n";
  std::ofstream(work_ / "u/results.jsonl") << "{\"mine\": 1}\n";
  fs::create_directories(work_ / "home");
  std::ofstream(work_ / "home/.profile") << "export A=1\n";
  const auto before = fingerprint(work_);
  expect_one_sentence(run(work_, asha_args("u")), "holds no sweep", "a foreign directory");
  expect_one_sentence(run(work_, asha_args((work_ / "home").string()), {{"HOME", (work_ / "home").string()}}),
                      "home directory", "$HOME");
  EXPECT_EQ(fingerprint(work_), before);
  const bool root_had = fs::exists("/sweep.json") || fs::exists("/.sweep.lock");
  expect_one_sentence(run(work_, asha_args("/")), "root directory", "/");
  if (!root_had) {
    EXPECT_FALSE(fs::exists("/sweep.json") || fs::exists("/.sweep.lock"));
  }
}

// Reproduction 4: no blocking on a FIFO, nothing written through a symbolic link.
TEST_F(SweepFiles, FifoOrSymlinkInPlaceOfASweepFileIsRefusedWithoutBlocking) {
  std::ofstream(work_ / "shard.bin") << "token data";
  // (Every other sweep file goes through the same two checks.)
  for (const char* name : {"results.jsonl", "sweep.journal", "trial-001/metrics.run.jsonl"}) {
    const std::string dir = copy_of_ref(std::string("fifo-") + std::to_string(std::hash<std::string>()(name) % 1000));
    fs::remove(work_ / dir / name);
    ASSERT_EQ(mkfifo((work_ / dir / name).c_str(), 0644), 0);
    const auto before = fingerprint(work_);
    expect_one_sentence(run(work_, asha_args(dir)), "FIFO", name);
    EXPECT_EQ(fingerprint(work_), before) << name;
  }
  for (const char* name : {"results.jsonl", "trial-000/metrics.jsonl"}) {
    const std::string dir = copy_of_ref(std::string("link-") + std::to_string(std::hash<std::string>()(name) % 1000));
    fs::remove(work_ / dir / name);
    fs::create_symlink(fs::absolute(work_ / "shard.bin"), work_ / dir / name);
    const auto before = fingerprint(work_);
    expect_one_sentence(run(work_, asha_args(dir)), "symbolic link", name);
    EXPECT_EQ(fingerprint(work_), before) << name;
    EXPECT_EQ(slurp(work_ / "shard.bin"), "token data");
  }
}

// Reproduction 6: killed right after the journal records a pause (before the rung's checkpoint),
// and right after the first promotion; the rerun repairs the trial and ends as the uninterrupted
// sweep did. The kill points are found in the reference journal (one device: the same order).
TEST_F(SweepFiles, KilledRightAfterAPauseOrPromotionIsRepairedOnTheRerun) {
  const std::string journal = slurp(tmp_->path("ref") + "/w/" + sweep::kJournalFileName);
  const sweep::ParsedJournal parsed = sweep::parse_journal(journal, 3, "reference");
  std::vector<int> points;
  for (size_t i = 0; i < parsed.records.size(); ++i) {
    const sweep::JournalRecord& r = parsed.records[i];
    const bool pause = r.kind == sweep::JournalRecord::Kind::kReport && !r.go;
    const bool promote = r.kind == sweep::JournalRecord::Kind::kPromote;
    if ((pause && points.empty()) || (promote && points.size() == 1)) points.push_back(static_cast<int>(i) + 1);
  }
  ASSERT_EQ(points.size(), 2u) << "the reference sweep must pause and promote a trial:\n" << journal;
  for (int k : points) {
    const std::string dir = "k" + std::to_string(k);
    const Proc killed = run(work_, asha_args(dir), {{"ZT_TEST_SWEEP_KILL_AFTER", std::to_string(k)}});
    ASSERT_EQ(killed.term_signal, SIGKILL) << "after record " << k << ": " << killed.err;
    const Proc rerun = run(work_, asha_args(dir));
    ASSERT_EQ(rerun.exit_code, 0) << rerun.err;
    EXPECT_EQ(leaderboard_of(rerun.out), leaderboard_of(ref_->out)) << "killed after journal record " << k;
    EXPECT_EQ(slurp(work_ / dir / "results.jsonl"), slurp(tmp_->path("ref") + "/w/results.jsonl"));
    EXPECT_EQ(rerun.out.find("stopped at step 0"), std::string::npos) << rerun.out;
  }
}

// Reproduction 7.
TEST_F(SweepFiles, IdentityIsTheResolvedFlagsNotTheCommandLine) {
  std::ofstream(work_ / "space.json") << R"({"lr": [1e-3, 2e-3]})";
  const std::vector<std::string> args = {"sweep", "--layers", "1", "--embd", "32", "--heads", "2", "--seq-len", "16",
                                         "--eval-batches", "1", "--sample-tokens", "0", "--devices", "cpu:1",
                                         "--space-file", "space.json", "--max-steps", "2", "--sweep-dir", "s",
                                         "--quiet"};
  ASSERT_EQ(run(work_, args).exit_code, 0);
  const auto done = fingerprint(work_);
  // Flags reordered, --quiet dropped, a default given explicitly: the same sweep, nothing rerun.
  const Proc same = run(work_, {"sweep", "--max-steps", "2", "--sweep-dir", "s", "--space-file", "space.json",
                                "--devices", "cpu:1", "--seq-len", "16", "--heads", "2", "--embd", "32", "--layers",
                                "1", "--sample-tokens", "0", "--eval-batches", "1", "--batch-size", "8"});
  EXPECT_EQ(same.exit_code, 0) << same.err;
  EXPECT_NE(same.out.find("(2 done before)"), std::string::npos) << same.out;
  EXPECT_EQ(fingerprint(work_), done);
  // Another search space in the same file, another step count: a different sweep.
  std::ofstream(work_ / "space.json") << R"({"lr": [1e-3, 3e-3]})";
  const auto before = fingerprint(work_);
  expect_one_sentence(run(work_, args), "different sweep", "changed --space-file");
  std::vector<std::string> longer = args;
  longer[18] = "3";
  expect_one_sentence(run(work_, longer), "--max-steps was 2 and is now 3", "changed --max-steps");
  EXPECT_EQ(fingerprint(work_), before);
}

// Reproduction 8: the lock, held here as a running sweep holds it.
TEST_F(SweepFiles, ASecondSweepOnTheDirectoryIsRefused) {
  const std::string dir = copy_of_ref("busy");
  fs::create_directories(work_ / "fresh");
  for (const std::string& d : {dir, std::string("fresh")}) {
    const int fd = ::open((work_ / d / sweep::kSweepLockFileName).c_str(), O_RDWR | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
    const auto before = fingerprint(work_);
    expect_one_sentence(run(work_, asha_args(d)), "in use by another running sweep", d);
    EXPECT_EQ(fingerprint(work_), before);
    ::close(fd);
  }
}

// Reproduction 9 (the launcher's environment, as mpirun -np 2 sets it).
TEST_F(SweepFiles, UnderALauncherTheSweepIsRefusedBeforeAnyTrial) {
  const auto before = fingerprint(work_);
  expect_one_sentence(run(work_, asha_args("m"), {{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}}),
                      "without mpirun", "mpirun");
  EXPECT_EQ(fingerprint(work_), before);
  EXPECT_FALSE(fs::exists(work_ / "m"));
}

// Reproduction 10, first half: a --tp 2 trial on 2 devices is the train run of the same flags.
TEST_F(SweepFiles, TensorParallelTrialsRunAsTrainDoes) {
  const std::vector<std::string> common = {"--layers", "1", "--embd", "32", "--heads", "2", "--seq-len", "16",
                                           "--eval-batches", "1", "--sample-tokens", "0", "--tp", "2", "--quiet"};
  std::vector<std::string> sw = {"sweep", "--devices", "cpu:2", "--devices-per-trial", "2", "--space", "lr=2e-3",
                                 "--max-steps", "3", "--sweep-dir", "tp"};
  sw.insert(sw.end(), common.begin(), common.end());
  const Proc s = run(work_, sw);
  ASSERT_EQ(s.exit_code, 0) << s.err;
  std::vector<std::string> tr = {"train", "--devices", "cpu:2", "--lr", "2e-3", "--steps", "3", "--metrics", "m.jsonl"};
  tr.insert(tr.end(), common.begin(), common.end());
  ASSERT_EQ(run(work_, tr).exit_code, 0);
  const auto losses = [](const fs::path& p) {
    std::vector<std::string> out;  // the loss as written: bitwise
    std::istringstream in(slurp(p));
    for (std::string line; std::getline(in, line);) {
      const json j = json::parse(line);
      if (j.contains("step") && !j.contains("event") && j.contains("loss")) out.push_back(j["loss"].dump());
    }
    return out;
  };
  const auto a = losses(work_ / "tp/trial-000/metrics.jsonl"), b = losses(work_ / "m.jsonl");
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b);
}

// Reproduction 10, second half: damaged sweep files are one sentence and exit 2, unchanged.
TEST_F(SweepFiles, DamagedSweepFilesAreOneSentence) {
  using sweep::JournalRecord;
  struct Case {
    std::string name, file, must_contain;
    std::function<std::string(const std::string&)> damage;
  };
  const auto flip_line_2 = [](const std::string& text) {
    std::string t = text;
    const size_t at = t.find('\n') + 20;  // inside line 2's JSON
    t[at] = t[at] == 'x' ? 'y' : 'x';
    return t;
  };
  const auto foreign_record = [](const std::string& text) {
    JournalRecord r;
    r.kind = JournalRecord::Kind::kStart;
    r.trial = 99;  // no such trial, with a valid checksum
    return sweep::journal_line(r) + text;
  };
  const auto typed_identity = [](const std::string&) {
    return sweep::format_sweep_record({json{{"flags", 5}, {"trials", json::array()}}, "x"});
  };
  const std::vector<Case> cases = {
      {"flipped", sweep::kJournalFileName, "damaged at line 2", flip_line_2},
      {"foreign", sweep::kJournalFileName, "not a record of this sweep", foreign_record},
      {"types", sweep::kSweepFileName, "is damaged", typed_identity},
      {"old", sweep::kSweepFileName, "older ZeroTrain",
       [](const std::string&) { return std::string(R"({"command": "--space lr=1e-3", "space": []})"); }},
  };
  for (const Case& c : cases) {
    const std::string dir = copy_of_ref(c.name);
    const fs::path f = work_ / dir / c.file;
    const std::string damaged = c.damage(slurp(f));
    std::ofstream(f, std::ios::binary | std::ios::trunc) << damaged;
    const auto before = fingerprint(work_);
    expect_one_sentence(run(work_, asha_args(dir)), c.must_contain, c.name);
    EXPECT_EQ(fingerprint(work_), before) << c.name;
  }
  // A torn last line (a kill inside the append) is not damage: cut off, and the sweep goes on.
  const std::string dir = copy_of_ref("torn");
  std::ofstream(work_ / dir / sweep::kJournalFileName, std::ios::app) << "0123456789abcdef {\"event\":\"res";
  const Proc p = run(work_, asha_args(dir));
  EXPECT_EQ(p.exit_code, 0) << p.err;
  EXPECT_EQ(slurp(work_ / dir / sweep::kJournalFileName), slurp(tmp_->path("ref") + "/w/" + sweep::kJournalFileName));
}

}  // namespace
}  // namespace zt
