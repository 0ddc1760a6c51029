// The sweep runner and `zerotrain sweep`: each trial's records equal the same run alone, failing
// trials leave the others bitwise unchanged, packing never shares a device, ASHA-stopped trials are
// prefixes of the full run, a SIGKILLed sweep rerun finishes like an uninterrupted one, bad input.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/runtime.h"
#include "sweep/asha.h"
#include "sweep/runner.h"
#include "test_util.h"
#include "train/trainer.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using sweep::SweepResult;
using sweep::SweepSpec;
using sweep::TrialOutcome;
using sweep::TrialValues;

// gpt-tiny shrunk: a step takes milliseconds.
TrainConfig tiny() {
  TrainConfig c;
  test_util::set_model_shape(c, 2, 32, 2, 32);
  c.eval_every = 4;
  c.eval_batches = 2;
  c.sample_tokens = 0;
  c.quiet = true;
  return c;
}

// The per-step and per-evaluation numbers of a metrics file (timings left out), in order.
struct Records {
  std::vector<std::pair<int, double>> loss, grad_norm, lr, val;
};

Records read_records(const std::string& path) {
  Records r;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    const json j = json::parse(line);
    if (!j.contains("step")) continue;
    const int step = j["step"].get<int>();
    const std::string ev = j.value("event", std::string());
    if (ev == "eval") {
      r.val.emplace_back(step, j["val_loss"].get<double>());
    } else if (ev.empty()) {
      r.loss.emplace_back(step, j["loss"].is_null() ? NAN : j["loss"].get<double>());
      r.grad_norm.emplace_back(step, j["grad_norm"].is_null() ? NAN : j["grad_norm"].get<double>());
      r.lr.emplace_back(step, j["lr"].get<double>());
    }
  }
  return r;
}

// Bitwise equality of the doubles (JSON numbers round-trip exactly).
bool same(const std::vector<std::pair<int, double>>& a, const std::vector<std::pair<int, double>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].first != b[i].first || std::memcmp(&a[i].second, &b[i].second, sizeof(double)) != 0) return false;
  return true;
}

void expect_same_records(const Records& a, const Records& b, const std::string& what) {
  EXPECT_FALSE(a.loss.empty()) << what;
  EXPECT_TRUE(same(a.loss, b.loss)) << what << ": training losses differ";
  EXPECT_TRUE(same(a.grad_norm, b.grad_norm)) << what << ": gradient norms differ";
  EXPECT_TRUE(same(a.lr, b.lr)) << what << ": learning rates differ";
  EXPECT_TRUE(same(a.val, b.val)) << what << ": validation losses differ";
}

std::string trial_metrics(const std::string& dir, int id) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "/trial-%03d/metrics.jsonl", id);
  return dir + buf;
}

// A sweep of `configs` (one trial each, values named by lr for the table) on `devices` simulated devices.
SweepSpec make_spec(const std::string& dir, const std::vector<TrainConfig>& configs, int devices, int per_trial,
                    int max_steps) {
  SweepSpec s;
  s.dir = dir;
  s.command = "test " + dir;
  for (size_t i = 0; i < configs.size(); ++i) {
    TrialValues t;
    t.id = static_cast<int>(i);
    char lr[32];
    std::snprintf(lr, sizeof lr, "%g", configs[i].lr);
    t.values = {{"lr", lr}};
    s.trials.push_back(t);
  }
  s.configs = configs;
  s.devices = devices;
  s.devices_per_trial = per_trial;
  s.max_steps = max_steps;
  s.live = false;
  return s;
}

TrainConfig with_lr(TrainConfig c, float lr) {
  c.lr = lr;
  return c;
}

// No two trials held one device at the same time (by the runner's event order).
void expect_disjoint(const SweepResult& r) {
  for (const TrialOutcome& a : r.trials)
    for (const TrialOutcome& b : r.trials) {
      if (a.id >= b.id || a.devices.empty() || b.devices.empty()) continue;
      const bool overlap_in_time = a.acquired_seq < b.released_seq && b.acquired_seq < a.released_seq;
      if (!overlap_in_time) continue;
      for (int d : a.devices)
        EXPECT_EQ(std::count(b.devices.begin(), b.devices.end(), d), 0)
            << "trials " << a.id << " and " << b.id << " both held device " << d;
    }
}

TEST(SweepRun, EachTrialEqualsTheSameRunAloneAndPackingIsDisjoint) {
  test_util::TempDir tmp("sweep_alone");
  const int steps = 8;
  std::vector<TrainConfig> configs = {with_lr(tiny(), 1e-3f), with_lr(tiny(), 3e-3f), with_lr(tiny(), 1e-2f)};
  const SweepResult r = sweep::run_sweep(make_spec(tmp.path("sweep"), configs, 4, 2, steps));
  ASSERT_EQ(r.trials.size(), 3u);
  expect_disjoint(r);
  // 2 slots of 2 devices for 3 trials: the third ran on devices a finished trial released.
  int reused = 0;
  for (const TrialOutcome& t : r.trials) {
    EXPECT_EQ(t.status, sweep::TrialStatus::kFinished) << t.reason;
    EXPECT_EQ(t.devices.size(), 2u);
    EXPECT_EQ(t.steps, steps);
    for (const TrialOutcome& u : r.trials)
      if (u.id != t.id && u.released_seq <= t.acquired_seq && u.devices == t.devices) ++reused;
  }
  EXPECT_GE(reused, 1);
  for (size_t i = 0; i < configs.size(); ++i) {
    TrainConfig alone = configs[i];
    alone.devices = "cpu:2";
    alone.steps = steps;
    alone.metrics_path = tmp.path("alone" + std::to_string(i) + ".jsonl");
    const TrainResult a = train(alone);
    expect_same_records(read_records(trial_metrics(tmp.path("sweep"), static_cast<int>(i))),
                        read_records(alone.metrics_path), "trial " + std::to_string(i));
    ASSERT_TRUE(r.trials[i].final_loss);
    EXPECT_EQ(*r.trials[i].final_loss, a.final_loss);
    EXPECT_EQ(*r.trials[i].last_val, a.val_loss);
  }
}

TEST(SweepRun, TrialDeviceSubsets) {
  SweepSpec s;
  EXPECT_EQ(sweep::subset_spec(s, {2, 3}), "cpu:2");
  s.backend = Backend::kCuda;
  s.cuda_ordinals = {0, 1, 2, 3};
  EXPECT_EQ(sweep::subset_spec(s, {1, 3}), "cuda:1,3");
  s.cuda_ordinals = {0, 0, 0, 0};  // --devices cuda:0x4
  EXPECT_EQ(sweep::subset_spec(s, {2, 3}), "cuda:0x2");
  s.cuda_ordinals = {5, 5, 7, 7};  // --devices cuda:5x2,7x2
  EXPECT_EQ(sweep::subset_spec(s, {1, 2, 3}), "cuda:5,7x2");
  EXPECT_EQ(parse_device_spec(sweep::subset_spec(s, {1, 2, 3})).cuda_ordinals, (std::vector<int>{5, 7, 7}));
}

// Trials ending while the runner joins others (short trials, many slots) are all collected.
TEST(SweepRun, ManyShortConcurrentTrialsAllEnd) {
  test_util::TempDir tmp("sweep_many");
  std::vector<TrainConfig> configs;
  for (int i = 0; i < 12; ++i) configs.push_back(with_lr(tiny(), 1e-3f * static_cast<float>(i + 1)));
  const SweepResult r = sweep::run_sweep(make_spec(tmp.path("sweep"), configs, 4, 1, 2));
  ASSERT_EQ(r.trials.size(), 12u);
  expect_disjoint(r);
  for (const TrialOutcome& t : r.trials) {
    EXPECT_EQ(t.status, sweep::TrialStatus::kFinished) << t.reason;
    EXPECT_EQ(t.steps, 2);
    ASSERT_EQ(t.devices.size(), 1u);
    EXPECT_LT(t.devices[0], 4);
  }
}

TEST(SweepRun, FailingTrialsLeaveTheOthersBitwiseEqual) {
  test_util::TempDir tmp("sweep_fail");
  const int steps = 8;
  const TrainConfig good1 = with_lr(tiny(), 2e-3f), good2 = with_lr(tiny(), 5e-3f);
  TrainConfig faulty = with_lr(tiny(), 3e-3f);
  faulty.inject_faults.push_back({0, 3, false});  // its device fails at step 3, no snapshots
  TrainConfig diverging = with_lr(tiny(), 1e30f);
  diverging.max_skipped_steps = 1;
  TrainConfig unfit = with_lr(tiny(), 1e-3f);
  unfit.device_memory = size_t{64} << 10;  // 64 KiB per device: the plan refuses it
  const SweepResult clean = sweep::run_sweep(make_spec(tmp.path("clean"), {good1, good2}, 2, 1, steps));
  const SweepResult mixed =
      sweep::run_sweep(make_spec(tmp.path("mixed"), {good1, faulty, diverging, unfit, good2}, 2, 1, steps));
  ASSERT_EQ(mixed.trials.size(), 5u);
  expect_disjoint(mixed);
  EXPECT_EQ(mixed.trials[1].status, sweep::TrialStatus::kFailed);
  EXPECT_NE(mixed.trials[1].reason.find("device failed"), std::string::npos) << mixed.trials[1].reason;
  EXPECT_EQ(mixed.trials[2].status, sweep::TrialStatus::kFailed);
  EXPECT_NE(mixed.trials[2].reason.find("diverged"), std::string::npos) << mixed.trials[2].reason;
  EXPECT_EQ(mixed.trials[3].status, sweep::TrialStatus::kDoesNotFit);
  EXPECT_TRUE(mixed.trials[3].devices.empty()) << "an unfit trial must never run";
  EXPECT_FALSE(fs::exists(tmp.path("mixed") + "/trial-003"));
  expect_same_records(read_records(trial_metrics(tmp.path("mixed"), 0)), read_records(trial_metrics(tmp.path("clean"), 0)),
                      "trial before the failures");
  expect_same_records(read_records(trial_metrics(tmp.path("mixed"), 4)), read_records(trial_metrics(tmp.path("clean"), 1)),
                      "trial after the failures");
  // Every trial has its line in results.jsonl.
  std::ifstream f(tmp.path("mixed") + "/results.jsonl");
  std::map<int, std::string> status;
  for (std::string line; std::getline(f, line);) {
    const json j = json::parse(line);
    status[j["trial"].get<int>()] = j["status"].get<std::string>();
  }
  EXPECT_EQ(status.size(), 5u);
  EXPECT_EQ(status[3], "does not fit");
}

TEST(SweepRun, AshaStoppedTrialsArePrefixesOfTheFullRun) {
  test_util::TempDir tmp("sweep_asha");
  const int steps = 12;
  std::vector<TrainConfig> configs;
  for (float lr : {1e-4f, 3e-3f, 1e-2f, 2e-2f}) configs.push_back(with_lr(tiny(), lr));
  SweepSpec s = make_spec(tmp.path("sweep"), configs, 1, 1, steps);  // one at a time: the decisions are deterministic
  s.asha = true;
  s.eta = 2;
  s.min_steps = 3;
  const SweepResult r = sweep::run_sweep(s);
  int stopped = 0, finished = 0;
  for (const TrialOutcome& t : r.trials) {
    TrainConfig alone = configs[static_cast<size_t>(t.id)];
    alone.devices = "cpu:1";
    alone.steps = steps;
    alone.eval_steps = {3, 6};  // the rungs below 12: 3, 6
    alone.metrics_path = tmp.path("alone" + std::to_string(t.id) + ".jsonl");
    train(alone);
    Records full = read_records(alone.metrics_path), part = read_records(trial_metrics(s.dir, t.id));
    if (t.status == sweep::TrialStatus::kStopped) {
      ++stopped;
      EXPECT_TRUE(t.steps == 3 || t.steps == 6) << t.steps;
      const auto prefix = [&](std::vector<std::pair<int, double>>& v) {
        std::erase_if(v, [&](const auto& e) { return e.first > t.steps; });
      };
      prefix(full.loss), prefix(full.grad_norm), prefix(full.lr), prefix(full.val);
    } else {
      ++finished;
      EXPECT_EQ(t.status, sweep::TrialStatus::kFinished) << t.reason;
    }
    expect_same_records(part, full, "trial " + std::to_string(t.id));
  }
  EXPECT_GE(stopped, 1);
  EXPECT_GE(finished, 1);
  EXPECT_LT(r.steps_trained, static_cast<int64_t>(steps) * 4);
}

// ASHA's end state (Li et al., Algorithm 2): when the sweep is out of work, no trial stopped at a
// rung is in that rung's top floor(n/eta): every promotion the reports allow was made, including
// one that only the last report allowed. Checked by replaying rungs.jsonl into an independent Asha.
TEST(SweepRun, AshaLeavesNoPromotableTrialBehind) {
  test_util::TempDir tmp("sweep_asha_end");
  std::vector<TrainConfig> configs;
  for (float lr : {3e-3f, 1e-4f, 2e-2f, 1e-2f, 5e-4f, 6e-3f, 2e-4f, 1e-3f, 4e-3f}) configs.push_back(with_lr(tiny(), lr));
  SweepSpec s = make_spec(tmp.path("sweep"), configs, 1, 1, 9);
  s.asha = true;
  s.eta = 3;
  s.min_steps = 1;
  const SweepResult r = sweep::run_sweep(s);
  sweep::Asha replay(1, 9, 3);
  std::ifstream f(s.dir + "/rungs.jsonl");
  int promotions = 0;
  for (std::string line; std::getline(f, line);) {
    const json j = json::parse(line);
    if (j.value("promote", false)) {
      replay.promote(j["trial"].get<int>(), j["step"].get<int>()), ++promotions;
    } else {
      EXPECT_EQ(replay.report(j["trial"].get<int>(), j["step"].get<int>(), j["loss"].get<double>()),
                j["continue"].get<bool>());
    }
  }
  EXPECT_TRUE(replay.promotable().empty()) << "a paused trial was left behind at step "
                                           << replay.promotable().front().second;
  EXPECT_EQ(replay.recorded(0), 9);
  EXPECT_GE(promotions, 1) << "with 9 trials arriving one at a time, some wait and are promoted later";
  int finished = 0;
  for (const TrialOutcome& t : r.trials) finished += t.status == sweep::TrialStatus::kFinished;
  EXPECT_EQ(finished, 1) << "9 trials, eta 3: one reaches --max-steps through the rungs";
}

// ---- through the binary ------------------------------------------------------------------------

std::vector<std::string> sweep_args(const std::string& dir) {
  return {"sweep",        "--layers",     "2",          "--embd",      "32",    "--heads",     "2",
          "--seq-len",    "32",           "--devices",  "cpu:1",       "--eval-every", "5",   "--eval-batches",
          "2",            "--space",      "lr=1e-4,3e-3,1e-2,1e-3,6e-3", "--scheduler", "asha", "--eta", "2",
          "--min-steps",  "5",            "--max-steps", "40",         "--sweep-dir", dir,     "--quiet"};
}

pid_t spawn(const std::vector<std::string>& args, const std::string& out) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (!freopen(out.c_str(), "w", stdout) || !freopen("/dev/null", "w", stderr)) _exit(121);
    std::vector<char*> argv = {const_cast<char*>(ZEROTRAIN_BIN)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(ZEROTRAIN_BIN, argv.data());
    _exit(122);
  }
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

size_t lines_in(const std::string& path) {
  std::ifstream f(path);
  size_t n = 0;
  for (std::string line; std::getline(f, line);) n += !line.empty();
  return n;
}

std::map<int, json> results_by_trial(const std::string& dir) {
  std::map<int, json> out;
  std::ifstream f(dir + "/results.jsonl");
  for (std::string line; std::getline(f, line);) {
    json j = json::parse(line);
    out[j["trial"].get<int>()] = j;
  }
  return out;
}

std::string leaderboard_of(const std::string& stdout_text) {
  const size_t at = stdout_text.find("leaderboard");
  return at == std::string::npos ? "" : stdout_text.substr(at);
}

TEST(SweepBinary, SigkillThenTheSameCommandFinishesLikeAnUninterruptedSweep) {
  test_util::TempDir tmp("sweep_kill");
  const std::string whole = tmp.path("whole"), killed = tmp.path("killed");
  ASSERT_EQ(wait_exit(spawn(sweep_args(whole), tmp.path("whole.out"))), 0);
  const pid_t pid = spawn(sweep_args(killed), tmp.path("killed1.out"));
  const auto t0 = std::chrono::steady_clock::now();
  // After the first trial's line and the second trial's first rung checkpoint (it continues past
  // rung 5: the rerun must resume it from there).
  while ((lines_in(killed + "/results.jsonl") < 1 || !fs::exists(killed + "/trial-001/ckpt/step-00000005")) &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  kill(pid, SIGKILL);
  EXPECT_EQ(wait_exit(pid), -1) << "the sweep finished before the kill; make it longer";
  const size_t before = lines_in(killed + "/results.jsonl");
  EXPECT_LT(before, 5u);
  ASSERT_EQ(wait_exit(spawn(sweep_args(killed), tmp.path("killed2.out"))), 0);
  const auto a = results_by_trial(whole), b = results_by_trial(killed);
  ASSERT_EQ(a.size(), 5u);
  ASSERT_EQ(b.size(), 5u) << "a trial is missing or repeated";
  EXPECT_EQ(lines_in(killed + "/results.jsonl"), lines_in(whole + "/results.jsonl")) << "a finished trial was run again";
  for (const auto& [id, ja] : a) {
    const json& jb = b.at(id);
    for (const char* k : {"status", "steps", "final_loss", "last_val_loss", "best_val_loss", "val_curve"})
      EXPECT_EQ(ja[k], jb[k]) << "trial " << id << " " << k;
    expect_same_records(read_records(trial_metrics(whole, id)), read_records(trial_metrics(killed, id)),
                        "trial " + std::to_string(id));
  }
  EXPECT_EQ(leaderboard_of(test_util::read_text(tmp.path("whole.out"))), leaderboard_of(test_util::read_text(tmp.path("killed2.out"))));
}

// Runs a shell command; returns its exit code and what it wrote to stderr (stdout dropped).
std::pair<int, std::string> stderr_of(const std::string& cmd) {
  std::FILE* p = popen((cmd + " 2>&1 >/dev/null").c_str(), "r");
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(SweepBinary, BadInputIsOneSentenceAndExitTwoBeforeAnyTrial) {
  test_util::TempDir tmp("sweep_bad");
  const std::string base = std::string(ZEROTRAIN_BIN) + " sweep --layers 2 --embd 32 --heads 2 --seq-len 32 --max-steps 4 "
                           "--devices cpu:2 --sweep-dir " + tmp.path("d");
  struct Case {
    std::string args, must_contain;
  };
  const std::vector<Case> cases = {
      {"--space lrr=1e-3,1e-2", "lr"},                        // unknown flag, nearest name
      {"--space lr=log:1e-2..1e-4 --trials 3", "lr"},         // empty range
      {"--space lr=1e-3,-1", "--lr"},                         // outside --lr's own range
      {"--space warmup-steps=int:-5..3 --trials 2", "warmup-steps"},  // a range end outside the flag's range
      {"--space lr=1e-3 --devices-per-trial 3", "--devices-per-trial"},
      {"--space devices=cpu:1", "devices"},                   // the sweep owns it
      {"--space lr=1e-3 --metrics m.jsonl", "--metrics"},
  };
  for (const Case& c : cases) {
    const auto [code, err] = stderr_of(base + " " + c.args);
    EXPECT_EQ(code, 2) << c.args << "\n" << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << c.args << ": " << err;
    EXPECT_NE(err.find(c.must_contain), std::string::npos) << c.args << ": " << err;
    EXPECT_FALSE(fs::exists(tmp.path("d") + "/trial-000")) << c.args << ": a trial started";
  }
  // The same directory with another command: one sentence, exit 2, nothing run.
  ASSERT_EQ(stderr_of(base + " --space lr=1e-3 --quiet").first, 0);
  const auto [code, err] = stderr_of(base + " --space lr=2e-3 --quiet");
  EXPECT_EQ(code, 2);
  EXPECT_NE(err.find("different sweep"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

}  // namespace
}  // namespace zt
