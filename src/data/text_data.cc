// Reading a text file into memory as byte tokens.
#include "data/text_data.h"

#include "core/files.h"
#include "core/status.h"

namespace zt {

namespace {
// The whole file is held in memory; beyond this, llm.c token shards are the format to use.
constexpr uint64_t kMaxTextFileBytes = uint64_t{16} << 30;
}  // namespace

TextFileData::TextFileData(const std::string& path, uint64_t seed)
    : TokenWindows(seed, 256, path), path_(path) {
  bytes_ = InputFile::open(path, "text file").read_all(kMaxTextFileBytes);
  ZT_REQUIRE(!bytes_.empty(), path, ": the text file is empty; a byte-level dataset needs at least "
             "T+1 bytes of text in each split");
  const uint64_t n_val = bytes_.size() / 10;
  const uint64_t n_train = bytes_.size() - n_val;
  segments_[0].push_back(TokenSegment{bytes_.data(), nullptr, n_train});
  segments_[1].push_back(TokenSegment{bytes_.data() + n_train, nullptr, n_val});
  split_what_[0] = "first 90% of the file";
  split_what_[1] = "last 10% of the file";
}

std::string TextFileData::describe() const {
  return "text file " + path_ + " (" + std::to_string(bytes_.size()) + " bytes as tokens, vocab 256)";
}

}  // namespace zt
