// Reading a text file into memory as byte tokens.
#include "data/text_data.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include <sys/stat.h>

#include "core/status.h"

namespace zt {

TextFileData::TextFileData(const std::string& path, uint64_t seed)
    : TokenWindows(seed, 256, path), path_(path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    ZT_THROW(ErrorKind::kInvalidArgument, path, ": cannot open the text file (", std::strerror(errno),
             "); check the path given as the data spec");
  }
  ZT_REQUIRE(!S_ISDIR(st.st_mode), path, ": is a directory, not a text file; pass a file, a glob of "
             ".bin shards, or 'synthetic'");
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) {
    ZT_THROW(ErrorKind::kInvalidArgument, path, ": cannot open the text file (", std::strerror(errno), ")");
  }
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f.get())) > 0) bytes_.insert(bytes_.end(), buf, buf + got);
  if (std::ferror(f.get())) {
    ZT_THROW(ErrorKind::kIo, path, ": reading the text file failed (", std::strerror(errno), ")");
  }
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
