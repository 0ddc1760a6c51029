// Fixtures shared by the test binaries: a scratch directory, running the zerotrain binary, a
// seeded Philox generator, and the small training configuration the trainer tests start from.
#pragma once

#include <algorithm>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/philox.h"
#include "train/trainer.h"

namespace zt::test_util {

// A fresh directory under the system temp dir (unique per process and name), removed with
// everything in it when the object goes.
class TempDir {
 public:
  explicit TempDir(const std::string& name = "tmp")
      : root_(std::filesystem::temp_directory_path() / ("zt_" + name + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& root() const { return root_; }
  std::string path(const std::string& name) const { return (root_ / name).string(); }

 private:
  std::filesystem::path root_;
};

struct RunResult {
  int exit_code;       // -1 when the process did not exit normally
  std::string output;  // stdout (and stderr unless it was dropped)
};

// Runs `binary args` through the shell and collects its output.
inline RunResult run_binary(const std::string& binary, const std::string& args, bool with_stderr = true) {
  const std::string cmd = binary + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// Philox-based: every value is a pure function of (seed, stream, index); each call draws a new
// stream, so every buffer of a test is independent.
class Rng {
 public:
  explicit Rng(uint64_t seed) : seed_(seed) {}
  std::vector<float> normal(int64_t n, float stddev = 1.0f, float mean = 0.0f) {
    const uint64_t stream = next_stream_++;
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = mean + stddev * philox_normal(seed_, stream, i);
    return v;
  }
  std::vector<float> uniform(int64_t n, float lo, float hi) {
    const uint64_t stream = next_stream_++;
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = lo + (hi - lo) * philox_uniform(seed_, stream, i);
    return v;
  }
  std::vector<int32_t> ints(int64_t n, int32_t lo, int32_t hi) {  // [lo, hi)
    const uint64_t stream = next_stream_++;
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      v[static_cast<size_t>(i)] = lo + static_cast<int32_t>(philox_u32(seed_, stream, i) % static_cast<uint32_t>(hi - lo));
    return v;
  }

 private:
  uint64_t seed_;
  uint64_t next_stream_ = 1;
};

// The quiet, short trainer run the trainer tests build on: `devices` simulated CPU devices, the
// given stage and steps, no sample, evaluation only at the end over one batch, and the final
// parameters kept for comparison. Each test then sets its model size and batch. The learning rate
// and warmup are the tests' own (lr 3e-3, 2% warmup), not the default job's, so that retuning the
// defaults does not move the tolerances these tests were written against.
inline TrainConfig tiny_train_config(int devices, int stage, int steps) {
  TrainConfig c;
  c.lr = 3e-3f;
  c.warmup_steps = std::max(1, steps / 50);
  c.devices = "cpu:" + std::to_string(devices);
  c.zero_stage = stage;
  c.steps = steps;
  c.quiet = true;
  c.sample_tokens = 0;
  c.eval_every = 0;
  c.eval_batches = 1;
  c.test.keep_final_params = true;
  return c;
}

}  // namespace zt::test_util
