// Token datasets for language models: the LanguageData interface, the window sampler every
// on-disk and synthetic dataset shares (TokenWindows), and the factory behind --data.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace zt {

class InputFile;

// Fashion-MNIST's 10k test set plays the validation role for image data.
enum class Split : uint8_t { kTrain = 0, kValidation = 1 };
const char* split_name(Split split);  // "train" / "validation"

// Sampling contract (every LanguageData honours it, resume and multi-device runs rely on it):
//  - step s has a global batch of G sequences, numbered 0..G-1;
//  - sequence i of step s is a pure function of (seed, split, s, i) and the data, independent of
//    G, of which rows a call asks for and of what was fetched before. A device (or a gradient-
//    accumulation micro-step) asks for its own contiguous range [first, first + count);
//  - each row is T+1 consecutive tokens x[0..T]: inputs = x[0..T), targets = x[1..T].
class LanguageData {
 public:
  virtual ~LanguageData() = default;

  // Token ids lie in [0, vocab_size()).
  virtual int vocab_size() const = 0;
  // One line for logs: "synthetic order-2 Markov corpus (2097152 bytes, seed 1337)".
  virtual std::string describe() const = 0;
  virtual uint64_t num_tokens(Split split) const = 0;
  // Throws zt::Error(kInvalidArgument), one sentence naming the data, when a split cannot supply a
  // sequence of T+1 tokens. Call at set-up, before training; batch() checks it again.
  virtual void validate(int T) const = 0;
  // Fills rows r = 0..count-1 with sequence first + r of step `step`; inputs and targets are
  // [count, T] row-major.
  virtual void batch(Split split, uint64_t step, int64_t first, int count, int T, int32_t* inputs,
                     int32_t* targets) const = 0;
  void batch(Split split, uint64_t step, int B, int T, int32_t* inputs, int32_t* targets) const {
    batch(split, step, 0, B, T, inputs, targets);
  }

  // Where the data source is known exactly (synthetic): the best loss any model can reach, in nats
  // per token, for an infinite context (entropy_rate) and averaged over a window of T targets.
  virtual std::optional<double> entropy_rate() const { return std::nullopt; }
  virtual std::optional<double> loss_floor(int T) const { return std::nullopt; }
};

// A run of tokens that no sequence crosses (a shard, or one split's slice of a file). Exactly one
// of u8 / u16 / file is set; the memory or the open file is owned by the dataset holding the
// segment. A file segment holds little-endian uint16 tokens from byte file_offset on and is read
// with pread when sampled (never mapped: a file truncated while training gives zt::Error(kIo), not
// SIGBUS).
struct TokenSegment {
  const uint8_t* u8 = nullptr;
  const uint16_t* u16 = nullptr;
  uint64_t size = 0;
  const InputFile* file = nullptr;
  uint64_t file_offset = 0;
  int32_t at(uint64_t i) const;
  // Tokens [first, first + n) into out; file tokens are checked against vocab_size again (the
  // file may have been rewritten since it was validated).
  void read(uint64_t first, size_t n, int32_t* out, int vocab_size) const;
};

// Where a sampled sequence starts: segment index within its split, and token offset within it.
struct WindowStart {
  int segment = 0;
  uint64_t offset = 0;
};

// The shared sampler: a split is a list of segments; sequence i of step s starts at window
// r = philox(seed, split, s, i) mod W, where W = sum over segments of max(0, size - T) counts every
// start whose T+1 tokens fit inside one segment. Steps and sequence indices must be < 2^32.
class TokenWindows : public LanguageData {
 public:
  int vocab_size() const override { return vocab_size_; }
  uint64_t num_tokens(Split split) const override;
  void validate(int T) const override;
  void batch(Split split, uint64_t step, int64_t first, int count, int T, int32_t* inputs,
             int32_t* targets) const override;
  using LanguageData::batch;

  uint64_t seed() const { return seed_; }
  uint64_t num_windows(Split split, int T) const;
  WindowStart window_start(Split split, uint64_t step, int64_t index, int T) const;
  const std::vector<TokenSegment>& segments(Split split) const {
    return segments_[static_cast<int>(split)];
  }

 protected:
  TokenWindows(uint64_t seed, int vocab_size, std::string source)
      : seed_(seed), vocab_size_(vocab_size), source_(std::move(source)) {}
  // Subclasses fill segments_ and split_what_ in their constructors.
  std::vector<TokenSegment> segments_[2];
  // How each split was formed, for error messages: "last 10% of the file".
  std::string split_what_[2];
  // A dataset opened for evaluation alone (no training split): validate() checks validation only.
  bool validation_only_ = false;

 private:
  // Cumulative window counts per segment (validates T first); ends.back() is W.
  std::vector<uint64_t> window_ends(Split split, int T) const;
  static WindowStart locate(const std::vector<uint64_t>& ends, uint64_t random);

  uint64_t seed_;
  int vocab_size_;
  std::string source_;  // names the data in errors: a path, a glob, "synthetic"
};

// The random 64-bit value that picks sequence `index` of `step` in `split` (exposed for tests).
uint64_t sequence_random(uint64_t seed, Split split, uint64_t step, uint64_t index);

// spec: "synthetic" (the built-in corpus), a glob or path ending in .bin (llm.c token shards), or
// the path of a text file (bytes as tokens). A path that exists is always that file, even when its
// name holds glob characters; only a path that does not exist is read as a shard pattern.
// vocab_hint is the model's vocabulary: token shards are checked against it (<= 0: GPT-2's 50257);
// byte data needs at least 256.
std::unique_ptr<LanguageData> open_language_data(const std::string& spec, uint64_t seed,
                                                 int vocab_hint);

}  // namespace zt
