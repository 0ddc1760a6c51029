// Opening, validating and memory-mapping llm.c token shards.
#include "data/token_shards.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"

namespace zt {

// A read-only mapping of one whole shard; unmapped when the dataset goes.
struct TokenShardData::Mapping {
  void* addr = nullptr;
  size_t length = 0;
  ~Mapping() {
    if (addr) ::munmap(addr, length);
  }
};

namespace {

bool is_validation_file(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  return name.find("val") != std::string::npos;
}

std::vector<std::string> expand(const std::string& pattern) {
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

uint64_t validate_token_shard(std::span<const uint8_t> bytes, int vocab_size, const std::string& name) {
  const uint64_t size = bytes.size();
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
  const uint8_t* tokens = bytes.data() + kShardHeaderBytes;
  const auto limit = static_cast<uint32_t>(vocab_size);
  for (uint64_t i = 0; i < count; ++i) {
    uint16_t token;  // memcpy: a buffer need not be 2-byte aligned
    std::memcpy(&token, tokens + 2 * i, sizeof(token));
    if (token >= limit) [[unlikely]] {
      ZT_THROW(ErrorKind::kInvalidArgument, name, ": token ", token, " at position ", i,
               " is out of range for vocab ", vocab_size);
    }
  }
  return count;
}

void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (!f) ZT_THROW(ErrorKind::kIo, path, ": cannot create the token shard (", std::strerror(errno), ")");
  bool ok = std::fwrite(header, sizeof(header), 1, f.get()) == 1;
  if (!tokens.empty()) ok = ok && std::fwrite(tokens.data(), 2, tokens.size(), f.get()) == tokens.size();
  ok = std::fclose(f.release()) == 0 && ok;
  if (!ok) ZT_THROW(ErrorKind::kIo, path, ": writing the token shard failed (", std::strerror(errno), ")");
}

TokenShardData::TokenShardData(const std::string& pattern, uint64_t seed, int vocab_size)
    : TokenWindows(seed, vocab_size, pattern), pattern_(pattern) {
  ZT_REQUIRE(vocab_size > 0 && vocab_size <= 65536, "token shards hold uint16 ids, so the vocabulary "
             "size must be in [1, 65536] (got ", vocab_size, ")");
  const std::vector<std::string> paths = expand(pattern);
  struct Shard {
    const uint16_t* tokens;
    uint64_t count;
    bool validation;
  };
  std::vector<Shard> shards;
  for (const std::string& path : paths) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      ZT_THROW(ErrorKind::kInvalidArgument, path, ": cannot open the token shard (", std::strerror(errno), ")");
    }
    struct stat st {};
    const int stat_rc = ::fstat(fd, &st);
    if (stat_rc != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      ZT_THROW(ErrorKind::kInvalidArgument, path, ": is not a regular file, so it cannot be a token shard");
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size < kShardHeaderBytes) {
      ::close(fd);
      ZT_THROW(ErrorKind::kInvalidArgument, path, ": the file is ", size, " bytes, shorter than the ",
               kShardHeaderBytes, "-byte llm.c shard header (truncated or not a token shard)");
    }
    void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (addr == MAP_FAILED) {
      ZT_THROW(ErrorKind::kIo, path, ": cannot memory-map the token shard (", std::strerror(map_errno), ")");
    }
    auto mapping = std::make_unique<Mapping>();
    mapping->addr = addr;
    mapping->length = size;
    mappings_.push_back(std::move(mapping));

    const uint64_t count = validate_token_shard(
        std::span<const uint8_t>(static_cast<const uint8_t*>(addr), size), vocab_size, path);
    const auto* tokens = reinterpret_cast<const uint16_t*>(static_cast<const char*>(addr) + kShardHeaderBytes);
    shards.push_back(Shard{tokens, count, is_validation_file(path)});
  }

  const bool named_split = std::any_of(shards.begin(), shards.end(), [](const Shard& s) { return s.validation; });
  if (named_split) {
    for (size_t k = 0; k < shards.size(); ++k) {
      const int split = shards[k].validation ? 1 : 0;
      files_[split].push_back(paths[k]);
      segments_[split].push_back(TokenSegment{nullptr, shards[k].tokens, shards[k].count});
    }
    ZT_REQUIRE(!files_[0].empty(), pattern, ": every matching shard is a validation shard (its name "
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
        segments_[0].push_back(TokenSegment{nullptr, s.tokens, train_part});
      }
      if (train_part < s.count) {
        files_[1].push_back(paths[k]);
        segments_[1].push_back(TokenSegment{nullptr, s.tokens + train_part, s.count - train_part});
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
