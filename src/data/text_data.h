// A text file as a byte-level dataset: every byte is a token (vocab 256); the last 10% of the file
// is the validation split.
#pragma once

#include <string>
#include <vector>

#include "data/language_data.h"

namespace zt {

class TextFileData : public TokenWindows {
 public:
  // Throws kInvalidArgument naming the file when it is missing, unreadable, a directory or empty.
  TextFileData(const std::string& path, uint64_t seed);

  std::string describe() const override;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<uint8_t> bytes_;
};

}  // namespace zt
