// The shared window sampler and the --data factory.
#include "data/language_data.h"

#include <algorithm>
#include <limits>

#include <sys/stat.h>

#include "core/files.h"
#include "core/philox.h"
#include "core/status.h"
#include "data/synthetic_data.h"
#include "data/text_data.h"
#include "data/token_shards.h"

namespace zt {

namespace {


// Philox streams of the sampler; named hashes keep them apart from every other use of the seed.
constexpr uint64_t kSequenceStream[2] = {fnv1a("zt/data/sequence/train"),
                                         fnv1a("zt/data/sequence/validation")};
constexpr uint64_t kMaxCounter = uint64_t{1} << 32;

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int32_t TokenSegment::at(uint64_t i) const {
  if (u8) return u8[i];
  if (u16) return u16[i];
  uint8_t b[2];
  file->read_at(file_offset + 2 * i, b, 2);
  return b[0] | (b[1] << 8);
}

void TokenSegment::read(uint64_t first, size_t n, int32_t* out, int vocab_size) const {
  if (u8) {
    for (size_t t = 0; t < n; ++t) out[t] = u8[first + t];
  } else if (u16) {
    for (size_t t = 0; t < n; ++t) out[t] = u16[first + t];
  } else {
    // Reuses out's storage: 2n bytes of uint16 fit in its 4n bytes; widened from the back.
    auto* raw = reinterpret_cast<uint8_t*>(out);
    file->read_at(file_offset + 2 * first, raw, 2 * n);
    for (size_t t = n; t-- > 0;) out[t] = raw[2 * t] | (raw[2 * t + 1] << 8);
    for (size_t t = 0; t < n; ++t)
      if (out[t] >= vocab_size) [[unlikely]]
        ZT_THROW(ErrorKind::kIo, file->path(), ": token ", out[t], " at position ", first + t,
                 " is out of range for vocab ", vocab_size, ", although the file was valid when it was "
                 "opened; it was rewritten while in use, so restore it and rerun");
  }
}

const char* split_name(Split split) { return split == Split::kTrain ? "train" : "validation"; }

uint64_t sequence_random(uint64_t seed, Split split, uint64_t step, uint64_t index) {
  const Philox4x32 r = philox_block(seed, kSequenceStream[static_cast<int>(split)], (step << 32) | index);
  return (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
}

uint64_t TokenWindows::num_tokens(Split split) const {
  uint64_t n = 0;
  for (const TokenSegment& s : segments(split)) n += s.size;
  return n;
}

uint64_t TokenWindows::num_windows(Split split, int T) const {
  uint64_t w = 0;
  for (const TokenSegment& s : segments(split))
    if (s.size > static_cast<uint64_t>(T)) w += s.size - static_cast<uint64_t>(T);
  return w;
}

void TokenWindows::validate(int T) const {
  ZT_REQUIRE(T >= 1, "the sequence length must be at least 1 (got ", T, ")");
  for (Split split : {Split::kTrain, Split::kValidation}) {
    if (num_windows(split, T) > 0 || (validation_only_ && split == Split::kTrain)) continue;
    uint64_t longest = 0;
    for (const TokenSegment& s : segments(split)) longest = std::max(longest, s.size);
    const int i = static_cast<int>(split);
    ZT_THROW(ErrorKind::kInvalidArgument, source_, ": the ", split_name(split), " split (",
             split_what_[i], ") is shorter than T+1 = ", T + 1, " tokens (",
             segments(split).size() > 1 ? "its longest piece has " : "it has ", longest,
             "), so it cannot supply one sequence of length ", T,
             "; use more data or a shorter sequence length");
  }
}

std::vector<uint64_t> TokenWindows::window_ends(Split split, int T) const {
  validate(T);
  const auto& segs = segments(split);
  std::vector<uint64_t> ends(segs.size());
  uint64_t w = 0;
  for (size_t k = 0; k < segs.size(); ++k) {
    if (segs[k].size > static_cast<uint64_t>(T)) w += segs[k].size - static_cast<uint64_t>(T);
    ends[k] = w;
  }
  return ends;
}

WindowStart TokenWindows::locate(const std::vector<uint64_t>& ends, uint64_t random) {
  // 64 random bits: the modulo bias is below W / 2^64, far under anything measurable.
  const uint64_t r = random % ends.back();
  const size_t k = static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), r) - ends.begin());
  return WindowStart{static_cast<int>(k), r - (k == 0 ? 0 : ends[k - 1])};
}

static void check_counters(uint64_t step, int64_t first, int64_t count) {
  ZT_REQUIRE(count >= 0 && first >= 0, "a batch needs first >= 0 and count >= 0 (got first=", first,
             ", count=", count, ")");
  ZT_REQUIRE(step < kMaxCounter, "step ", step, " is beyond the data sampler's range of 2^32 steps");
  ZT_REQUIRE(static_cast<uint64_t>(first) + static_cast<uint64_t>(count) <= kMaxCounter,
             "sequence indices [", first, ", ", first + count,
             ") exceed the data sampler's range [0, 2^32)");
}

WindowStart TokenWindows::window_start(Split split, uint64_t step, int64_t index, int T) const {
  check_counters(step, index, 1);
  return locate(window_ends(split, T), sequence_random(seed_, split, step, static_cast<uint64_t>(index)));
}

void TokenWindows::batch(Split split, uint64_t step, int64_t first, int count, int T,
                         int32_t* inputs, int32_t* targets) const {
  check_counters(step, first, count);
  const std::vector<uint64_t> ends = window_ends(split, T);
  const auto& segs = segments(split);
  std::vector<int32_t> window(static_cast<size_t>(T) + 1);
  for (int row = 0; row < count; ++row) {
    const WindowStart w =
        locate(ends, sequence_random(seed_, split, step, static_cast<uint64_t>(first + row)));
    const TokenSegment& seg = segs[static_cast<size_t>(w.segment)];
    seg.read(w.offset, window.size(), window.data(), vocab_size_);
    int32_t* in = inputs + static_cast<size_t>(row) * T;
    int32_t* tg = targets + static_cast<size_t>(row) * T;
    std::copy(window.begin(), window.end() - 1, in);
    std::copy(window.begin() + 1, window.end(), tg);
  }
}

std::unique_ptr<LanguageData> open_language_data(const std::string& spec, uint64_t seed,
                                                 int vocab_hint) {
  ZT_REQUIRE(!spec.empty(), "the data spec is empty; pass 'synthetic', a text file, or a glob of "
             "llm.c .bin token shards");
  std::unique_ptr<LanguageData> data;
  if (spec == "synthetic") {
    data = std::make_unique<SyntheticData>(seed);
  } else if (ends_with(spec, ".bin") || (has_glob_chars(spec) && !path_exists(spec))) {
    // A path that exists is that file even when its name holds glob characters.
    return std::make_unique<TokenShardData>(spec, seed, vocab_hint > 0 ? vocab_hint : kGpt2VocabSize);
  } else {
    data = std::make_unique<TextFileData>(spec, seed);
  }
  ZT_REQUIRE(vocab_hint <= 0 || vocab_hint >= data->vocab_size(), spec, ": the data has ",
             data->vocab_size(), " byte tokens but the model's vocabulary has only ", vocab_hint,
             "; use a vocabulary of at least ", data->vocab_size());
  return data;
}

}  // namespace zt
