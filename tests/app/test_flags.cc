// zerotrain's flags through the real binary: --config files (TOML and JSON) and the command line
// over them, the last value of a repeated flag, --print-config reproducing a run bit for bit, and
// flags refused with one sentence and exit code 2 before anything is written (an empty `--flag=`,
// a flag that does nothing in the combination, numbers beyond what their type holds).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;

struct Out {
  int code = -1;
  std::string out, err;
};

// Runs `zerotrain args` in `cwd` through the shell; stderr goes to a file beside cwd (not in it,
// so that "nothing was written" can be checked on cwd).
Out zerotrain(const fs::path& cwd, const std::string& args) {
  const fs::path err = cwd.string() + ".stderr";
  const std::string cmd = "cd '" + cwd.string() + "' && " + ZEROTRAIN_BIN + " " + args + " 2>'" + err.string() + "'";
  Out o;
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return o;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) o.out.append(buf, n);
  const int status = pclose(p);
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  o.err = zt::test_util::read_text(err);
  fs::remove(err);
  return o;
}

// One sentence: a single "zerotrain: ..." line, or CLI11's "--flag: ..." line and its fixed hint.
void expect_one_sentence(const Out& o, const std::string& contains) {
  std::string e = o.err;
  const std::string hint = "\nRun with --help for more information.\n";
  if (e.rfind("--", 0) == 0 && e.size() > hint.size() && e.compare(e.size() - hint.size(), hint.size(), hint) == 0)
    e = "zerotrain: " + e.substr(0, e.size() - hint.size() + 1);
  EXPECT_EQ(e.rfind("zerotrain: ", 0), 0u) << e;
  EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
  EXPECT_NE(e.find(contains), std::string::npos) << "expected '" << contains << "' in: " << e;
}

const std::string kTiny =
    "--layers 1 --embd 32 --heads 2 --seq-len 16 --eval-batches 1 --sample-tokens 0 --devices cpu:2";

// The metrics records without their timings (and the summary's time-derived fields).
std::vector<nlohmann::json> records(const fs::path& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(zt::test_util::read_text(path));
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("event", "") == "checkpoint") continue;  // a run with --checkpoint-dir saved one
    for (auto it = j.begin(); it != j.end();) {
      const std::string& k = it.key();
      const bool timing = k.find("time") != std::string::npos || k.find("_s") == k.size() - 2 ||
                          k.find("per_s") != std::string::npos || k.find("ms") != std::string::npos ||
                          k == "mfu" || k.find("seconds") != std::string::npos || k.find("phase") != std::string::npos;
      it = timing ? j.erase(it) : std::next(it);
    }
    out.push_back(j);
  }
  return out;
}

int steps_in(const fs::path& metrics) {
  int n = 0;
  for (const nlohmann::json& j : records(metrics)) n += j.contains("step") && !j.contains("event") ? 1 : 0;
  return n;
}

// A run that must be refused: exit 2, one sentence holding `says`, and nothing written in its
// directory but the `files` it was given.
struct Refusal {
  std::string args, says;
  std::vector<std::pair<std::string, std::string>> files = {};
};

class Flags : public ::testing::Test {
 protected:
  fs::path dir() const { return dir_.root(); }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir() / name) << text; }
  // Each case in a directory of its own, several at once (a refusal is quick; the binary's start
  // is most of its time).
  void expect_refused(const std::vector<Refusal>& cases) {
    constexpr size_t kAtOnce = 8;
    for (size_t first = 0; first < cases.size(); first += kAtOnce) {
      std::vector<std::future<Out>> runs;
      const size_t end = std::min(cases.size(), first + kAtOnce);
      for (size_t i = first; i < end; ++i) {
        const fs::path d = dir() / ("case-" + std::to_string(i));
        fs::create_directories(d);
        for (const auto& [name, text] : cases[i].files) std::ofstream(d / name) << text;
        runs.push_back(std::async(std::launch::async, [d, args = cases[i].args] { return zerotrain(d, args); }));
      }
      for (size_t i = first; i < end; ++i) {
        const Refusal& c = cases[i];
        SCOPED_TRACE(c.args);
        const Out o = runs[i - first].get();
        EXPECT_EQ(o.code, 2) << o.err;
        expect_one_sentence(o, c.says);
        size_t entries = 0;
        for (const auto& e : fs::directory_iterator(dir() / ("case-" + std::to_string(i)))) {
          ++entries;
          bool given = false;
          for (const auto& f : c.files) given = given || f.first == e.path().filename().string();
          EXPECT_TRUE(given) << "a refused run wrote " << e.path();
        }
        EXPECT_EQ(entries, c.files.size());
      }
    }
  }
  zt::test_util::TempDir dir_{"flags"};
};

// Issue 32: `$BASE --steps 400` overrides the --steps in $BASE (argparse's and torchrun's rule).
TEST_F(Flags, ARepeatedFlagTakesItsLastValue) {
  const Out o = zerotrain(dir(), "train " + kTiny + " --steps 5 --steps 3 --quiet --quiet=false --quiet --metrics m.jsonl");
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_EQ(steps_in(dir() / "m.jsonl"), 3);
  EXPECT_EQ(o.out, "") << "--quiet given last was not the value used";
}

// A TOML file with sections (torchtitan's layout) and a JSON file; the command line overrides both.
TEST_F(Flags, TheCommandLineOverridesAConfigFile) {
  write("run.toml",
        "# a small run\nlayers = 1\nembd = 32\nheads = 2\nseq_len = 16\n[training]\nsteps = 5\nquiet = true\n"
        "devices = \"cpu:2\"\nsample-tokens = 0\neval-batches = 1\nlr = 3e-3\n");
  Out o = zerotrain(dir(), "train --config run.toml --steps 2 --metrics a.jsonl");
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_EQ(steps_in(dir() / "a.jsonl"), 2);
  EXPECT_EQ(o.out, "");
  write("run.json", R"({"layers": 1, "embd": 32, "heads": 2, "seq-len": 16, "steps": 3, "quiet": true,
                       "devices": "cpu:2", "sample-tokens": 0, "eval-batches": 1, "metrics": "b.jsonl"})");
  o = zerotrain(dir(), "train --config run.json");
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_EQ(steps_in(dir() / "b.jsonl"), 3);
}

// plan reads the same files (and sweep: the flags of apps/run_flags.h plus its own).
TEST_F(Flags, PlanReadsAConfigFile) {
  write("plan.toml", "model = 'gpt-tiny'\ndevices = 'cpu:4'\nzero-stage = 3\nbatch-size = 16\n");
  const Out o = zerotrain(dir(), "plan --config plan.toml --zero-stage 1");
  ASSERT_EQ(o.code, 0) << o.err;
  EXPECT_NE(o.out.find("4 devices, ZeRO stage 1"), std::string::npos) << o.out;
}

// Issue 32: --print-config, then --config of what it printed, reproduces the metrics bit for bit;
// the file a run with --checkpoint-dir leaves there is the same, and printing it again gives it back.
TEST_F(Flags, PrintConfigThenConfigReproducesTheRun) {
  const std::string run = "train " + kTiny + " --steps 5 --lr 3e-3 --seed 7 --warmup-steps 2 --batch-size 4 --zero-stage 3 --quiet";
  Out p = zerotrain(dir(), run + " --metrics a.jsonl --print-config");
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_FALSE(fs::exists(dir() / "a.jsonl")) << "--print-config trained";
  write("run.toml", p.out);
  EXPECT_NE(p.out.find("steps = 5\n"), std::string::npos) << p.out;
  EXPECT_NE(p.out.find("zero-stage = 3\n"), std::string::npos) << p.out;
  // What --precision auto resolved to here (bf16 on GPUs), as a comment.
  EXPECT_NE(p.out.find("#   precision = 'fp32'\n"), std::string::npos) << p.out;
  EXPECT_EQ(p.out.find("pp-schedule ="), std::string::npos) << "a flag that does not apply was written:\n" << p.out;
  Out a = zerotrain(dir(), run + " --metrics a.jsonl --checkpoint-dir ck");
  ASSERT_EQ(a.code, 0) << a.err;
  Out b = zerotrain(dir(), "train --config run.toml --metrics b.jsonl");
  ASSERT_EQ(b.code, 0) << b.err;
  const auto ra = records(dir() / "a.jsonl"), rb = records(dir() / "b.jsonl");
  ASSERT_EQ(ra.size(), rb.size());
  ASSERT_GE(ra.size(), 6u);
  for (size_t i = 0; i < ra.size(); ++i) EXPECT_EQ(ra[i].dump(), rb[i].dump()) << "record " << i;
  // The checkpoint directory's copy: the same flags (plus --checkpoint-dir) and a fixed point.
  const std::string saved = zt::test_util::read_text(dir() / "ck" / "config.toml");
  EXPECT_NE(saved.find("checkpoint-dir = 'ck'\n"), std::string::npos) << saved;
  EXPECT_NE(saved.find("lr = 0.003\n"), std::string::npos) << saved;
  Out again = zerotrain(dir(), "train --config ck/config.toml --print-config");
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(again.out, saved);
}

TEST_F(Flags, BadConfigFilesAreRefusedNamingTheKey) {
  auto in = [](const std::string& file, const std::string& text, const std::string& says) {
    return Refusal{"train --config " + file + " --steps 2 --metrics m.jsonl", says, {{file, text}}};
  };
  expect_refused({
      in("c.toml", "stpes = 3\n", "unknown key 'stpes', not a train flag; did you mean 'steps'?"),
      in("c.toml", "steps = \"3\"\n", "c.toml: steps must be a whole number, not a string"),
      in("c.toml", "steps = 2.5\n", "steps must be a whole number"),
      in("c.toml", "quiet = 1\n", "quiet must be true or false"),
      in("c.toml", "lr = [1, 2]\n", "lr takes one value, not a list"),
      in("c.toml", "model = true\n", "model must be a string"),
      in("c.toml", "steps = 3\n[training]\nsteps = 4\n", "a second time"),
      in("c.toml", "steps = \n", "is not valid TOML"),
      in("c.toml", "config = \"x.toml\"\n", "cannot name another"),
      in("c.toml", "data = \"\"\n", "data is empty"),
      in("c.json", R"({"steps": 3, "lrr": 0.1})", "unknown key 'lrr'"),
      in("c.json", "[1, 2]", "one JSON object"),
      in("c.yaml", "steps: 3\n", "must end in .toml or .json"),
      {"train --config missing.toml --steps 2", "missing.toml"},
      // A value the flag's own check refuses is refused as on the command line.
      in("c.toml", "steps = -3\n", "--steps"),
  });
}

// Issue 31, 5: `--metrics= --quiet` wrote a file named --quiet and lost --quiet.
TEST_F(Flags, AnEmptyValueAfterTheEqualsSignIsRefused) {
  std::vector<Refusal> cases;
  for (const std::string flag : {"--metrics=", "--trace=", "--checkpoint-dir=", "--steps="})
    cases.push_back({"train " + kTiny + " --steps 2 " + flag + " --quiet", flag + " has an empty value"});
  cases.push_back({"sweep " + kTiny + " --space lr=1e-3,2e-3 --sweep-dir= --quiet", "--sweep-dir= has an empty value"});
  cases.push_back({"plan --trace= --quiet", "--trace= has an empty value"});
  expect_refused(cases);
}

// Issue 31, what to build 6: a flag that changes nothing in the combination is refused with the
// flag that would make it count.
TEST_F(Flags, FlagsThatDoNothingAreRefusedWithWhatEnablesThem) {
  const std::string t = "train " + kTiny + " --steps 2 --quiet ";
  const std::string sweep = "sweep " + kTiny + " --steps 4 --space lr=1e-3,2e-3 --sweep-dir s ";
  expect_refused({
      {t + "--pp-schedule gpipe", "--pp-schedule does nothing in this run: it needs --pipeline-parallel 2"},
      {t + "--offload-fraction 0.5", "--offload-fraction does nothing in this run: it needs --offload optimizer"},
      {t + "--offload-delay-update", "--offload-delay-update does nothing in this run: it needs --offload optimizer"},
      {t + "--no-sequence-parallel", "it needs --tensor-parallel 2 or more"},
      {t + "--scale-window 10", "--scale-window does nothing in this run: it needs dynamic loss scaling"},
      {t + "--stochastic-rounding", "needs 16-bit parameters"},
      {t + "--temperature 0.5", "--temperature does nothing in this run: it needs text samples"},
      {t + "--save-every 1", "--save-every does nothing in this run: it needs --checkpoint-dir"},
      {t + "--lr-schedule constant --min-lr 1e-4", "--min-lr does nothing"},
      {t + "--hidden 64", "--hidden does nothing in this run: it needs --model mlp"},
      {"plan " + kTiny + " --pp-schedule zb-h1", "--pp-schedule does nothing"},
      {sweep + "--min-steps 2", "--min-steps does nothing in this sweep: it needs --scheduler asha"},
      {sweep + "--offload-fraction 0.5", "--offload-fraction does nothing"},
  });
  // Where they count, the same flags are accepted (plan: nothing is trained), also in a sweep
  // whose swept value makes the flag count in some trials (refused above when no trial uses it).
  const Out ok = zerotrain(dir(), "plan " + kTiny + " --layers 2 --devices cpu:4 --pp 2 --pp-schedule gpipe");
  EXPECT_EQ(ok.code, 0) << ok.err;
}

// Issue 31, 14 and what to build 5/6: values refused with the real reason, before anything runs.
TEST_F(Flags, NumbersBeyondTheirTypeAndImpossibleValuesAreRefused) {
  const std::string t = "train " + kTiny + " --steps 2 --quiet ";
  expect_refused({
      {t + "--hang-timeout 1e10", "at most 1e9 seconds"},
      {t + "--comm-timeout 1e30", "at most 1e9 seconds"},
      {t + "--hang-timeout 0.0001", "from 0.001"},
      {"train " + kTiny + " --steps 9223372036854775807", "at most 2147483647"},
      {t + "--eval-every 3000000000", "at most 2147483647"},
      {t + "--inject-fault device=0,step=3", "step=3 is past the run's last step (2)"},
      {t + "--inject-fault device=2,step=1", "device=2 is not a device of this run"},
      {t + "--lr 1e-3 --min-lr 2e-3", "--min-lr 0.002 is above --lr 0.001"},
      {t + "--min-lr 0.01", "is above --lr"},  // the default lr (1.88e-3)
  });
}

}  // namespace
