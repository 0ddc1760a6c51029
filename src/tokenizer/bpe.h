// Byte-level BPE as GPT-2 defines it (and Hugging Face tokenizers' ByteLevel BPE reproduces): the
// text split by GPT-2's pattern, each piece's bytes merged by rank. Loads GPT-2's vocab.json +
// merges.txt, learns merges from a corpus, writes both files, encodes (with a piece cache) and decodes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace zt {

// The most token ids a uint16 llm.c shard can hold (ids 0..65535).
inline constexpr int kMaxShardVocab = 65536;
inline constexpr const char* kEndOfText = "<|endoftext|>";

class BpeTokenizer {
 public:
  // Reads vocab.json + merges.txt. Refuses (zt::Error kInvalidArgument, one sentence naming the
  // file): malformed JSON, an id out of range or repeated, ids that are not 0..N-1, a string that is
  // not byte-level (a code point that stands for no byte), a missing byte symbol, a merges line
  // that is not two symbols, a merge of or into a token vocab.json lacks, a repeated merge, tokens no
  // merge produces (a truncated merges.txt; <...> special tokens excepted), and, with
  // max_vocab > 0, more than max_vocab ids.
  static BpeTokenizer load(const std::string& vocab_path, const std::string& merges_path, int max_vocab);
  // dir/vocab.json + dir/merges.txt.
  static BpeTokenizer load_dir(const std::string& dir, int max_vocab);
  // Learns `merges` merges from the pieces of `texts` (ids 0..255: the bytes, 256 + i: merge i,
  // then <|endoftext|>). The most frequent pair wins; ties go to the smallest (left, right) ids.
  // Stops early when no pair occurs twice.
  static BpeTokenizer train(const std::vector<std::string_view>& texts, int merges);

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  int vocab_size() const { return static_cast<int>(token_bytes_.size()); }
  int num_merges() const { return static_cast<int>(merges_.size()); }
  std::optional<int> end_of_text() const { return eot_; }
  const std::string& token_bytes(int id) const { return token_bytes_.at(static_cast<size_t>(id)); }

  // Appends the ids of `text` to *out. Not thread-safe (the piece cache).
  void encode(std::string_view text, std::vector<int32_t>* out);
  std::vector<int32_t> encode(std::string_view text) {
    std::vector<int32_t> v;
    encode(text, &v);
    return v;
  }
  // The ids of one piece (no splitting), merged by rank exactly as Hugging Face's BPE merges them.
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
  // The bytes of the ids (a token split mid-character gives invalid UTF-8; see decode_text).
  std::string decode(const std::vector<int32_t>& ids) const;
  // decode() with every invalid UTF-8 sequence replaced by U+FFFD (for printing).
  std::string decode_text(const std::vector<int32_t>& ids) const;

  // Writes dir/vocab.json and dir/merges.txt (Hugging Face / GPT-2 format), each atomically.
  void save(const std::string& dir) const;

 private:
  BpeTokenizer() = default;
  void build_tables();

  std::vector<std::string> token_bytes_;                 // id -> bytes
  std::vector<std::pair<int32_t, int32_t>> merges_;      // rank -> (left, right)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merge_of_;  // (left, right) -> (rank, new id)
  int32_t byte_id_[256] = {};
  std::optional<int> eot_;
  struct Cache;
  std::unique_ptr<Cache> cache_;
};

// The directory's tokenizer when dir/vocab.json and dir/merges.txt exist, else nullopt (a bad
// file still throws).
std::optional<BpeTokenizer> load_tokenizer_if_present(const std::string& dir, int max_vocab);
// The vocabulary size of the tokenizer beside token shards (`spec` ends in .bin or is a glob, and
// vocab.json + merges.txt sit in its directory), else nullopt.
std::optional<int> tokenizer_vocab_beside(const std::string& spec);
// The directory of a --data spec (a path or glob): its part before the last '/', or ".".
std::string data_directory(const std::string& spec);

}  // namespace zt
