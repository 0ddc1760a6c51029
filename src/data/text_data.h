// A text file as a byte-level dataset: every byte is a token (vocab 256); the last 10% of the file
// is the validation split.
#pragma once

#include <string>
#include <vector>

#include "data/language_data.h"

namespace zt {

class TextFileData : public TokenWindows {
 public:
  // Reads the file through InputFile: throws kInvalidArgument naming the file when it is missing,
  // unreadable, not a regular file (a directory, FIFO or device such as /dev/zero), empty or over
  // 16 GiB; kIo when it shrinks while being read.
  TextFileData(const std::string& path, uint64_t seed);

  std::string describe() const override;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<uint8_t> bytes_;
};

}  // namespace zt
