// Opening and validating llm.c token shards; sampled tokens are read with pread (token_shards.h).
#include "data/token_shards.h"

#include <algorithm>
#include <cstring>

#include <glob.h>
#include <sys/stat.h>

#include "core/files.h"
#include "core/status.h"

namespace zt {

namespace {

constexpr size_t kValidateChunkBytes = size_t{1} << 20;

bool is_validation_file(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  return name.find("val") != std::string::npos;
}

std::vector<std::string> expand(const std::string& pattern) {
  // A path that exists is that file, whatever characters its name holds; only a path that does
  // not exist is expanded as a pattern.
  struct stat st {};
  if (::stat(pattern.c_str(), &st) == 0) return {pattern};
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> paths;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  const bool literal = pattern.find_first_of("*?[") == std::string::npos;
  ZT_REQUIRE(!literal || rc != GLOB_NOMATCH, pattern, ": the token shard file does not exist; check "
             "the path");
  ZT_REQUIRE(rc != GLOB_NOMATCH && !paths.empty(), pattern,
             ": no file matches this token-shard pattern; check the path (llm.c shards look like "
             "data/fineweb_train_000001.bin)");
  ZT_REQUIRE(rc == 0, pattern, ": cannot expand this token-shard pattern (a directory on the way "
             "is unreadable)");
  std::sort(paths.begin(), paths.end());  // glob sorts already; make the order a guarantee
  return paths;
}

}  // namespace

namespace {

// Header checks against the file's size; returns the token count. `bytes` holds at least the
// header when size >= kShardHeaderBytes.
uint64_t validate_shard_header(std::span<const uint8_t> bytes, uint64_t size, const std::string& name) {
  ZT_REQUIRE(size >= kShardHeaderBytes, name, ": the file is ", size, " bytes, shorter than the ",
             kShardHeaderBytes, "-byte llm.c shard header (truncated or not a token shard)");
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  ZT_REQUIRE(header[0] == kShardMagic, name, ": the header's magic number is ", header[0],
             ", not ", kShardMagic, "; this is not an llm.c token shard");
  ZT_REQUIRE(header[1] == kShardVersion, name, ": the shard has version ", header[1],
             "; only version ", kShardVersion, " (uint16 GPT-2 tokens) is supported");
  ZT_REQUIRE(header[2] >= 0, name, ": the header declares a negative token count (", header[2], ")");
  const uint64_t count = static_cast<uint64_t>(header[2]);
  const uint64_t expected = kShardHeaderBytes + 2 * count;  // count < 2^31: no overflow
  ZT_REQUIRE(size == expected, name, ": the header declares ", count, " tokens, so the file should be ",
             expected, " bytes, but it is ", size, " bytes (",
             size < expected ? "truncated" : "trailing data", ")");
  return count;
}

// Tokens first..first+n (little-endian uint16 at `tokens`) must be < vocab_size.
void validate_shard_tokens(const uint8_t* tokens, uint64_t first, uint64_t n, int vocab_size,
                           const std::string& name) {
  const auto limit = static_cast<uint32_t>(vocab_size);
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t token = tokens[2 * i] | (uint32_t{tokens[2 * i + 1]} << 8);
    if (token >= limit) [[unlikely]] {
      ZT_THROW(ErrorKind::kInvalidArgument, name, ": token ", token, " at position ", first + i,
               " is out of range for vocab ", vocab_size);
    }
  }
}

}  // namespace

uint64_t validate_token_shard(std::span<const uint8_t> bytes, int vocab_size, const std::string& name) {
  const uint64_t count = validate_shard_header(bytes, bytes.size(), name);
  validate_shard_tokens(bytes.data() + kShardHeaderBytes, 0, count, vocab_size, name);
  return count;
}

void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  AtomicFile f(path, "token shard");
  f.write(header, sizeof(header));
  f.write(tokens.data(), 2 * tokens.size());
  f.commit();
}

TokenShardData::TokenShardData(const std::string& pattern, uint64_t seed, int vocab_size, bool validation_only)
    : TokenWindows(seed, vocab_size, pattern), pattern_(pattern) {
  ZT_REQUIRE(vocab_size > 0 && vocab_size <= 65536, "token shards hold uint16 ids, so the vocabulary "
             "size must be in [1, 65536] (got ", vocab_size, ")");
  const std::vector<std::string> paths = expand(pattern);
  struct Shard {
    const InputFile* file;
    uint64_t count;
    bool validation;
  };
  std::vector<Shard> shards;
  std::vector<uint8_t> chunk(kValidateChunkBytes);
  for (const std::string& path : paths) {
    files_open_.push_back(std::make_unique<InputFile>(InputFile::open(path, "token shard")));
    const InputFile& file = *files_open_.back();
    const uint64_t size = file.size();
    const size_t head = static_cast<size_t>(std::min<uint64_t>(size, kShardHeaderBytes));
    file.read_at(0, chunk.data(), head);
    const uint64_t count = validate_shard_header(std::span<const uint8_t>(chunk.data(), head), size, path);
    // Every token is checked once here, a chunk at a time, so a bad file fails before training.
    for (uint64_t first = 0; first < count;) {
      const uint64_t n = std::min<uint64_t>(count - first, kValidateChunkBytes / 2);
      file.read_at(kShardHeaderBytes + 2 * first, chunk.data(), static_cast<size_t>(2 * n));
      validate_shard_tokens(chunk.data(), first, n, vocab_size, path);
      first += n;
    }
    shards.push_back(Shard{&file, count, is_validation_file(path)});
  }

  const bool named_split = std::any_of(shards.begin(), shards.end(), [](const Shard& s) { return s.validation; });
  if (named_split) {
    for (size_t k = 0; k < shards.size(); ++k) {
      const int split = shards[k].validation ? 1 : 0;
      files_[split].push_back(paths[k]);
      segments_[split].push_back(TokenSegment{nullptr, nullptr, shards[k].count, shards[k].file, kShardHeaderBytes});
    }
    validation_only_ = files_[0].empty() && validation_only;
    ZT_REQUIRE(!files_[0].empty() || validation_only, pattern, ": every matching shard is a validation shard (its name "
               "contains 'val'); the pattern must also match training shards");
    split_what_[0] = "shards without 'val' in the name";
    split_what_[1] = "shards with 'val' in the name";
  } else {
    uint64_t total = 0;
    for (const Shard& s : shards) total += s.count;
    const uint64_t n_train = total - total / 10;
    uint64_t seen = 0;
    for (size_t k = 0; k < shards.size(); ++k) {
      const Shard& s = shards[k];
      const uint64_t train_part = std::min(s.count, n_train > seen ? n_train - seen : 0);
      if (train_part > 0) {
        files_[0].push_back(paths[k]);
        segments_[0].push_back(TokenSegment{nullptr, nullptr, train_part, s.file, kShardHeaderBytes});
      }
      if (train_part < s.count) {
        files_[1].push_back(paths[k]);
        segments_[1].push_back(
            TokenSegment{nullptr, nullptr, s.count - train_part, s.file, kShardHeaderBytes + 2 * train_part});
      }
      seen += s.count;
    }
    split_what_[0] = "first 90% of the tokens; no shard name contains 'val'";
    split_what_[1] = "last 10% of the tokens; no shard name contains 'val'";
  }
}

TokenShardData::~TokenShardData() = default;

std::string TokenShardData::describe() const {
  return "llm.c token shards " + pattern_ + " (" + std::to_string(files_[0].size()) + " train / " +
         std::to_string(files_[1].size()) + " validation files, " + std::to_string(num_tokens(Split::kTrain)) +
         " + " + std::to_string(num_tokens(Split::kValidation)) + " tokens, vocab " +
         std::to_string(vocab_size()) + ")";
}

}  // namespace zt
