// Fixtures shared by the test binaries: a scratch directory, whole-file reads and writes, the check
// of a refused call, running the zerotrain binary, a seeded Philox generator, and the small training
// configuration (and model shapes) the trainer tests start from.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "core/philox.h"
#include "core/status.h"
#include "train/trainer.h"

namespace zt::test_util {

// A fresh directory under the system temp dir (unique per process, name and object), removed with
// everything in it when the object goes.
class TempDir {
 public:
  explicit TempDir(const std::string& name = "tmp")
      : root_(std::filesystem::temp_directory_path() /
              ("zt_" + name + "_" + std::to_string(::getpid()) + "_" + std::to_string(next_id()))) {
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
  std::string str() const { return root_.string(); }
  std::string path(const std::string& name) const { return (root_ / name).string(); }
  // Names in the directory, sorted, hidden ones included (a leftover temporary file shows up here).
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(root_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  static int next_id() {
    static std::atomic<int> counter{0};
    return counter++;
  }
  std::filesystem::path root_;
};

// Runs f, which must throw zt::Error(kInvalidArgument), and returns its message ("" and a failure
// when it does not throw).
template <typename F>
std::string invalid_argument_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.message();
    return e.message();
  }
  ADD_FAILURE() << "expected zt::Error(kInvalidArgument)";
  return "";
}

// Runs f, which must throw zt::Error(kInvalidArgument) whose message contains every part.
template <typename F>
void expect_invalid(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected zt::Error(kInvalidArgument) mentioning '" << *parts.begin() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    for (const std::string& p : parts) EXPECT_NE(e.message().find(p), std::string::npos) << e.message();
  }
}

// A whole file as text, or as bytes (empty when it cannot be opened).
inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}
// Writes (replaces) a file with these bytes.
inline void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}
inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  write_file(path, bytes.data(), bytes.size());
}
inline void write_file(const std::string& path, const std::string& text) { write_file(path, text.data(), text.size()); }

// Every entry under root by its path relative to root: "dir", "link:" + target, "file:" + bytes or
// "other" (FIFOs, sockets), except the entries named in `skip` (lock files that hold their last
// holder's pid). Taken before and after a command to show that it changed nothing it could reach.
inline std::map<std::string, std::string> tree_fingerprint(const std::filesystem::path& root,
                                                           std::initializer_list<std::string> skip = {}) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> m;
  for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
    const fs::path& p = it->path();
    if (std::find(skip.begin(), skip.end(), p.filename().string()) != skip.end()) continue;
    const std::string rel = fs::relative(p, root).string();
    const fs::file_status st = it->symlink_status();
    if (fs::is_symlink(st)) m[rel] = "link:" + fs::read_symlink(p).string();
    else if (fs::is_regular_file(st)) m[rel] = "file:" + read_text(p.string());
    else if (fs::is_directory(st)) m[rel] = "dir";
    else m[rel] = "other";
  }
  return m;
}

struct RunResult {
  int exit_code;       // -1 when the process did not exit normally
  std::string output;  // stdout (and stderr unless it was dropped)
};

// Runs a shell command line and collects its stdout (its redirections decide about stderr).
inline RunResult run_command(const std::string& cmd) {
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// Runs `binary args` through the shell and collects its output.
inline RunResult run_binary(const std::string& binary, const std::string& args, bool with_stderr = true) {
  return run_command(binary + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null"));
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
// gpt-tiny with a test's shape (layers, width, heads, context).
inline void set_model_shape(TrainConfig& c, int layers, int embd, int heads, int seq_len) {
  c.overrides.layers = layers;
  c.overrides.embd = embd;
  c.overrides.heads = heads;
  c.overrides.seq_len = seq_len;
}
// The shape of the sanitizer builds' tiny runs: a step takes milliseconds under TSan and ASan.
inline void set_sanitizer_shape(TrainConfig& c, int layers = 1) { set_model_shape(c, layers, 32, 2, 16); }
// A schedule that does not depend on the run's length: a run of k steps is a prefix of a run of
// k + 1 steps (resume and skip tests compare such prefixes).
inline void set_length_independent_schedule(TrainConfig& c) {
  c.schedule = LrSchedule::kConstant;
  c.warmup_steps = 0;
}

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
