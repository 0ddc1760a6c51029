// The zerotrain binary as a user meets it: every bad input gets one clear sentence on stderr and
// exit code 2 before any training starts; `info` and a short `train` succeed.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code;
  std::string output;  // stdout and stderr
};

RunResult run(const std::string& args) {
  const std::string cmd = std::string(ZEROTRAIN_BIN) + " " + args + " 2>&1";
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("zt_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& bytes) {
    std::ofstream(path(name), std::ios::binary) << bytes;
  }
  // An llm.c shard: 256 int32 header (magic, version, count) then uint16 tokens.
  std::string shard(int magic, int version, const std::vector<uint16_t>& tokens, int claimed_count = -1) {
    std::vector<int32_t> header(256, 0);
    header[0] = magic;
    header[1] = version;
    header[2] = claimed_count >= 0 ? claimed_count : static_cast<int>(tokens.size());
    std::string s(reinterpret_cast<const char*>(header.data()), header.size() * 4);
    s.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
    return s;
  }
  void expect_usage_error(const std::string& args, const std::string& expect) {
    const RunResult r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(expect), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << "training started: " << r.output;
  }
  fs::path dir_;
};

TEST_F(Cli, InfoSucceeds) {
  const RunResult r = run("info --devices cpu:3");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cpu:2"), std::string::npos) << r.output;
}

TEST_F(Cli, BadFlagsAndNumbers) {
  expect_usage_error("train --bogus", "--bogus");
  expect_usage_error("train --steps -5", "--steps");
  expect_usage_error("train --steps abc", "--steps");
  expect_usage_error("train --lr -1", "--lr");
  expect_usage_error("train --model gpt-huge", "unknown model preset 'gpt-huge'");
  expect_usage_error("train --batch-size 8 --micro-batch-size 3", "not a multiple of --micro-batch-size 3");
  expect_usage_error("train --train-seq-len 65", "above the model's context of 64");
  expect_usage_error("train --devices gpu:1", "invalid device selection 'gpu:1'");
  expect_usage_error("frobnicate", "frobnicate");
  expect_usage_error("info --devices cpu:0", "between 1 and 64");
  expect_usage_error("train --precision fp8", "--precision");
  expect_usage_error("train --loss-scale lots", "--loss-scale must be dynamic, none or a positive number");
  expect_usage_error("train --precision bf16 --on-scale-collapse bf16", "--precision fp16 runs only");
  expect_usage_error("train --min-scale 8 --initial-scale 4", "--min-scale");
  expect_usage_error("train --inject-fault device=x,step=3", "--inject-fault 'device=x,step=3' has a bad number");
  expect_usage_error("train --inject-fault step=3", "needs device=D");
  expect_usage_error("train --resume auto", "--resume auto needs --checkpoint-dir");
  expect_usage_error("train --resume " + path("nowhere"), "nowhere");
  expect_usage_error("train --init-from " + path("missing.safetensors"), "missing.safetensors");
}

TEST_F(Cli, Fp16ScaleCollapseExitsThreeOrContinuesInBf16) {
  // A scale at which every fp16 gradient overflows, with no room to back off.
  const std::string base = "train --steps 4 --layers 1 --embd 32 --heads 2 --sample-tokens 0 --precision fp16 "
                           "--initial-scale 1e9 --min-scale 1e9 --max-scale 1e9";
  const RunResult stop = run(base);
  EXPECT_EQ(stop.exit_code, 3) << stop.output;
  EXPECT_NE(stop.output.find("loss scale collapsed"), std::string::npos) << stop.output;
  EXPECT_NE(stop.output.find("step 1 skipped"), std::string::npos) << stop.output;
  const RunResult go = run(base + " --on-scale-collapse bf16");
  EXPECT_EQ(go.exit_code, 0) << go.output;
  EXPECT_NE(go.output.find("continuing in bf16"), std::string::npos) << go.output;
  EXPECT_NE(go.output.find("step 4/4"), std::string::npos) << go.output;
}

TEST_F(Cli, BadDataFiles) {
  expect_usage_error("train --data " + path("missing.txt"), "missing.txt");
  write("empty.txt", "");
  expect_usage_error("train --data " + path("empty.txt"), "empty.txt");
  write("short.txt", "hello");
  expect_usage_error("train --data " + path("short.txt"), "short.txt");
  std::vector<uint16_t> tokens(1000, 7);
  write("magic_train.bin", shard(12345, 1, tokens));
  expect_usage_error("train --data " + path("magic_train.bin"), "magic");
  write("version_train.bin", shard(20240520, 2, tokens));
  expect_usage_error("train --data " + path("version_train.bin"), "version");
  write("trunc_train.bin", shard(20240520, 1, tokens, 2000));
  expect_usage_error("train --data " + path("trunc_train.bin"), "trunc_train.bin");
  tokens[17] = 300;  // gpt-tiny's vocabulary is 256
  write("vocab_train.bin", shard(20240520, 1, tokens));
  expect_usage_error("train --data " + path("vocab_train.bin"), "300");
}

TEST_F(Cli, ShortTrainingRunWritesMetrics) {
  const std::string metrics = path("m.jsonl");
  const RunResult r = run("train --steps 12 --layers 1 --embd 32 --heads 2 --sample-tokens 20 --metrics " + metrics);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("summary:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sample"), std::string::npos) << r.output;
  std::ifstream in(metrics);
  std::string line;
  int steps = 0, evals = 0, summaries = 0;
  while (std::getline(in, line)) {
    if (line.find("\"event\":\"summary\"") != std::string::npos) {
      ++summaries;
      for (const char* key : {"\"steps\":12", "\"final_loss\"", "\"val_loss\"", "\"tokens_per_s\"",
                              "\"peak_bytes_per_device\"", "\"entropy_floor\""})
        EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
    } else if (line.find("\"event\":\"eval\"") != std::string::npos) {
      ++evals;
    } else {
      ++steps;
      for (const char* key : {"\"step\"", "\"loss\"", "\"lr\"", "\"tokens_per_s\"", "\"grad_norm\""})
        EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
    }
  }
  EXPECT_EQ(steps, 12);
  EXPECT_GE(evals, 1);
  EXPECT_EQ(summaries, 1);
}

}  // namespace
