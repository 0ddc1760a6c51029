// llm.c token shards (.bin): a 256 x int32 header {magic 20240520, version 1, token count, 0...}
// followed by `count` little-endian uint16 GPT-2 token ids. Shards are opened through InputFile and
// fully validated when opened (header, exact size, every token < vocab), so a bad file fails
// before the first step; sampled windows are then read with pread, never memory-mapped, so a shard
// truncated or rewritten during training gives zt::Error(kIo) instead of SIGBUS.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/files.h"
#include "data/language_data.h"

namespace zt {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr int kShardHeaderInts = 256;
inline constexpr size_t kShardHeaderBytes = kShardHeaderInts * sizeof(int32_t);
inline constexpr int kGpt2VocabSize = 50257;

// Validates a whole shard held in memory (header, exact size, every token < vocab_size) and
// returns its token count; throws kInvalidArgument naming `name` and the problem. TokenShardData
// runs it on every mapped file; the fuzz target runs it on arbitrary bytes.
uint64_t validate_token_shard(std::span<const uint8_t> bytes, int vocab_size, const std::string& name);

// Writes a valid shard (tests, tools).
void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens);

// Split: shards whose file name contains "val" (llm.c's *_val_*.bin) form the validation split and
// the others the training split; when no name contains "val", the last 10% of all tokens (in
// sorted file order) is validation. Every shard is one segment: no sequence crosses two files.
class TokenShardData : public TokenWindows {
 public:
  // pattern: a single path (a path that exists is that file, even with '*', '?' or '[' in its
  // name) or else a glob(3) pattern. Throws kInvalidArgument, naming the file and the
  // problem, for no match, a short or oversized file, a wrong magic or version, or a token >= vocab.
  // validation_only: shards that all have "val" in their names are accepted as a validation split
  // with no training split (`zerotrain eval --data 'tok/*val*.bin'`).
  TokenShardData(const std::string& pattern, uint64_t seed, int vocab_size, bool validation_only = false);
  ~TokenShardData() override;

  std::string describe() const override;
  // The shard files of each split, sorted.
  const std::vector<std::string>& files(Split split) const { return files_[static_cast<int>(split)]; }

 private:
  std::string pattern_;
  std::vector<std::string> files_[2];
  std::vector<std::unique_ptr<InputFile>> files_open_;  // the segments point at these
};

}  // namespace zt
