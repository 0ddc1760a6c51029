// GPT-2 byte-level BPE: the pre-tokenizer split on tricky text (expected pieces from Python's
// `regex` module with GPT-2's pattern), merges by rank against GPT-2's reference algorithm written
// out here, training, save/load round trips, and the refusal of bad tokenizer files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"

namespace zt {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  split_gpt2(text, [&](size_t off, size_t len) { out.push_back(text.substr(off, len)); });
  return out;
}

using Pieces = std::vector<std::string>;

// Expected values: regex.findall(GPT-2's pattern, text) in Python.
TEST(Gpt2Split, Contractions) {
  EXPECT_EQ(split("I'm can't we'll they're I've he'd it's 'S 'LL"),
            (Pieces{"I", "'m", " can", "'t", " we", "'ll", " they", "'re", " I", "'ve", " he", "'d", " it", "'s", " '",
                    "S", " '", "LL"}));
  EXPECT_EQ(split("x''s"), (Pieces{"x", "''", "s"}));
  EXPECT_EQ(split("'"), (Pieces{"'"}));
  EXPECT_EQ(split("'sup"), (Pieces{"'s", "up"}));
}

TEST(Gpt2Split, WhitespaceRuns) {
  EXPECT_EQ(split("x''s  a   b\n\nc \t d  "),
            (Pieces{"x", "''", "s", " ", " a", "  ", " b", "\n", "\n", "c", " \t", " d", "  "}));
  EXPECT_EQ(split(" "), (Pieces{" "}));
  EXPECT_EQ(split("a "), (Pieces{"a", " "}));
  EXPECT_EQ(split("\n a"), (Pieces{"\n", " a"}));
  EXPECT_EQ(split("a\r\n\r\nb"), (Pieces{"a", "\r\n\r", "\n", "b"}));
}

TEST(Gpt2Split, DigitsAndPunctuation) {
  EXPECT_EQ(split("abc123 4567 ,,, !? ?'s"), (Pieces{"abc", "123", " 4567", " ,,,", " !?", " ?'", "s"}));
  EXPECT_EQ(split("3.14159e-10"), (Pieces{"3", ".", "14159", "e", "-", "10"}));
}

TEST(Gpt2Split, NonAsciiAndEmoji) {
  EXPECT_EQ(split("héllo wörld naïve 東京タワー Привет мир"),
            (Pieces{"héllo", " wörld", " naïve", " 東京タワー", " Привет", " мир"}));
  EXPECT_EQ(split("emoji 👍🏽 ok🎉! \u00a0nbsp\u3000ideo"),
            (Pieces{"emoji", " 👍🏽", " ok", "🎉!", " ", "\u00a0", "nbsp", "\u3000", "ideo"}));
  // A combining mark is neither letter nor number; ½ ⅷ ² are numbers (No, Nl).
  EXPECT_EQ(split("e\u0301 combining ½ ⅷ ²"), (Pieces{"e", "\u0301", " combining", " ½", " ⅷ", " ²"}));
}

TEST(Gpt2Split, PiecesCoverInvalidUtf8) {
  const std::string text = "ab\xff\xfe cd \xc3 \xe6\x9d";
  std::string joined;
  for (const auto& p : split(text)) joined += p;
  EXPECT_EQ(joined, text);
}

TEST(ByteLevel, SymbolsAreGpt2s) {
  EXPECT_EQ(byte_symbol(' '), "\u0120");   // Ġ
  EXPECT_EQ(byte_symbol('\n'), "\u010A");  // Ċ
  EXPECT_EQ(byte_symbol('A'), "A");
  EXPECT_EQ(byte_symbol(0xAD), "\u0143");  // the soft hyphen is not printable
  EXPECT_EQ(byte_symbol(0xFF), "\u00FF");
  for (int b = 0; b < 256; ++b) {
    std::string bytes;
    ASSERT_TRUE(symbols_to_bytes(byte_symbol(static_cast<uint8_t>(b)), &bytes));
    EXPECT_EQ(bytes, std::string(1, static_cast<char>(b)));
  }
}

// A temporary directory with vocab.json and merges.txt written from text.
struct TokDir {
  fs::path dir;
  TokDir() {
    dir = fs::temp_directory_path() / ("zt_tok_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::create_directories(dir);
  }
  ~TokDir() { fs::remove_all(dir); }
  static int& counter() {
    static int c = 0;
    return c;
  }
  void write(const std::string& name, const std::string& text) const { std::ofstream(dir / name, std::ios::binary) << text; }
  // vocab.json: the 256 byte symbols (id = byte) then `extra` tokens (symbol strings) in order.
  void vocab(const std::vector<std::string>& extra, const std::string& prefix_entries = "") const {
    std::string j = "{" + prefix_entries;
    int id = 0;
    auto add = [&](const std::string& sym) {
      if (j.size() > 1) j += ",";
      std::string esc;
      for (char c : sym) {
        if (c == '"' || c == '\\') esc += '\\';
        esc += c;
      }
      j += "\"" + esc + "\":" + std::to_string(id++);
    };
    for (int b = 0; b < 256; ++b) add(byte_symbol(static_cast<uint8_t>(b)));
    for (const auto& e : extra) add(e);
    write("vocab.json", j + "}");
  }
};

std::string expect_refused(const TokDir& d, int max_vocab = kMaxShardVocab) {
  try {
    BpeTokenizer::load_dir(d.dir.string(), max_vocab);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.message();
  }
  ADD_FAILURE() << "the tokenizer was accepted";
  return "";
}

TEST(Bpe, MergesApplyByRankNotByPosition) {
  TokDir d;
  d.vocab({"bc", "ab", "abc"});
  d.write("merges.txt", "#version: 0.2\nb c\na bc\na b\n");
  BpeTokenizer t = BpeTokenizer::load_dir(d.dir.string(), kMaxShardVocab);
  // b c has rank 0 although a b comes first in the text: abc = a + bc.
  EXPECT_EQ(t.encode("abc"), (std::vector<int32_t>{258}));
  EXPECT_EQ(t.encode("ab"), (std::vector<int32_t>{257}));
  EXPECT_EQ(t.encode("abcab"), (std::vector<int32_t>{258, 257}));

  TokDir e;  // a b first: abc = ab + c (no "ab c" merge)
  e.vocab({"ab", "bc"});
  e.write("merges.txt", "a b\nb c\n");
  BpeTokenizer u = BpeTokenizer::load_dir(e.dir.string(), kMaxShardVocab);
  EXPECT_EQ(u.encode("abc"), (std::vector<int32_t>{256, 'c'}));
  EXPECT_EQ(u.encode("bcab"), (std::vector<int32_t>{257, 256}));
}

TEST(Bpe, EqualRanksMergeLeftmostFirst) {
  TokDir d;
  d.vocab({"aa"});
  d.write("merges.txt", "a a\n");
  BpeTokenizer t = BpeTokenizer::load_dir(d.dir.string(), kMaxShardVocab);
  EXPECT_EQ(t.encode("aaa"), (std::vector<int32_t>{256, 'a'}));
  EXPECT_EQ(t.encode("aaaa"), (std::vector<int32_t>{256, 256}));
}

// GPT-2's encoder.py bpe(): merge every occurrence of the lowest-ranked pair, repeat.
std::vector<std::string> gpt2_reference_bpe(const std::string& piece, const std::map<std::pair<std::string, std::string>, int>& ranks) {
  std::vector<std::string> w;
  for (char c : piece) w.emplace_back(1, c);
  while (w.size() > 1) {
    int best = INT32_MAX;
    std::pair<std::string, std::string> bigram;
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      const auto f = ranks.find({w[i], w[i + 1]});
      if (f != ranks.end() && f->second < best) best = f->second, bigram = f->first;
    }
    if (best == INT32_MAX) break;
    std::vector<std::string> out;
    for (size_t i = 0; i < w.size(); ++i) {
      if (i + 1 < w.size() && w[i] == bigram.first && w[i + 1] == bigram.second) {
        out.push_back(w[i] + w[i + 1]);
        ++i;
      } else {
        out.push_back(w[i]);
      }
    }
    w.swap(out);
  }
  return w;
}

std::string corpus(uint32_t seed, size_t words) {
  static const char* kWords[] = {"the", "quick", "brown", "fox", "don't", "jumped", "over", "lazy", "dog's", "1984",
                                 "naïve", "東京", "Привет", "👍", "  ", "\n", "It's", "3.14", "!!", "we'll"};
  std::mt19937 rng(seed);
  std::string s;
  for (size_t i = 0; i < words; ++i) {
    s += kWords[rng() % (sizeof kWords / sizeof *kWords)];
    s += rng() % 5 ? " " : "";
  }
  return s;
}

TEST(Bpe, TrainedMergesEncodeAsGpt2sReference) {
  const std::string text = corpus(1, 4000);
  BpeTokenizer t = BpeTokenizer::train({text}, 300);
  ASSERT_GT(t.num_merges(), 50);
  EXPECT_EQ(t.vocab_size(), 256 + t.num_merges() + 1 - 0);  // no two merges spell one token here
  ASSERT_TRUE(t.end_of_text());
  EXPECT_EQ(t.token_bytes(*t.end_of_text()), kEndOfText);
  // Reference ranks from the saved merges.txt (what a Python user would load).
  TokDir d;
  t.save(d.dir.string());
  std::ifstream m(d.dir / "merges.txt");
  std::string line;
  std::getline(m, line);
  EXPECT_EQ(line, "#version: 0.2");
  std::map<std::pair<std::string, std::string>, int> ranks;
  int rank = 0;
  while (std::getline(m, line)) {
    const size_t sp = line.find(' ');
    std::string a, b;
    ASSERT_TRUE(symbols_to_bytes(line.substr(0, sp), &a));
    ASSERT_TRUE(symbols_to_bytes(line.substr(sp + 1), &b));
    ranks[{a, b}] = rank++;
  }
  EXPECT_EQ(rank, t.num_merges());
  BpeTokenizer loaded = BpeTokenizer::load_dir(d.dir.string(), kMaxShardVocab);
  EXPECT_EQ(loaded.vocab_size(), t.vocab_size());
  const std::string other = corpus(2, 2000);  // unseen text: the merges are applied, not memorised
  std::vector<int32_t> ids;
  split_gpt2(other, [&](size_t off, size_t len) {
    const std::string piece = other.substr(off, len);
    ids.clear();
    t.encode_piece(piece, &ids);
    std::vector<std::string> got;
    for (int32_t id : ids) got.push_back(t.token_bytes(id));
    ASSERT_EQ(got, gpt2_reference_bpe(piece, ranks)) << "piece '" << piece << "'";
  });
  EXPECT_EQ(loaded.encode(other), t.encode(other));
}

TEST(Bpe, TrainingTakesTheMostFrequentPairFirst) {
  BpeTokenizer t = BpeTokenizer::train({"aaaa aaaa bc bc bc"}, 2);
  // Pieces "aaaa", " aaaa", " bc" x3: (a, a) occurs 6 times; then (' ', b) and (b, c) 3 times each,
  // (aa, aa) twice: the tie goes to the smaller ids, (' ', b).
  EXPECT_EQ(t.token_bytes(256), "aa");
  EXPECT_EQ(t.token_bytes(257), " b");
  EXPECT_EQ(t.num_merges(), 2);
  EXPECT_EQ(t.encode("aaaa bc"), (std::vector<int32_t>{256, 256, 257, 'c'}));
}

TEST(Bpe, DecodeInvertsEncodeOnAnyBytes) {
  BpeTokenizer t = BpeTokenizer::train({corpus(3, 3000)}, 200);
  std::mt19937 rng(7);
  for (int k = 0; k < 20; ++k) {
    std::string s = corpus(10 + static_cast<uint32_t>(k), 50);
    for (int j = 0; j < 10; ++j) s[rng() % s.size()] = static_cast<char>(rng());  // invalid UTF-8 too
    EXPECT_EQ(t.decode(t.encode(s)), s);
  }
  EXPECT_EQ(t.decode_text({'a', 0xE6}), "a\xEF\xBF\xBD");  // a cut character prints as U+FFFD
}

TEST(BpeRefuses, TruncatedMergesLine) {
  TokDir d;
  d.vocab({"ab", "abc"});
  d.write("merges.txt", "#version: 0.2\na b\nab");
  EXPECT_NE(expect_refused(d).find("line 3 ('ab') is not two symbols separated by one space (the file looks truncated)"),
            std::string::npos);
}

TEST(BpeRefuses, MergesThatLostTheirEnd) {
  TokDir d;
  d.vocab({"ab", "abc", "<|endoftext|>"});
  d.write("merges.txt", "#version: 0.2\na b\n");
  const std::string msg = expect_refused(d);
  EXPECT_NE(msg.find("1 token"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'abc'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("merges.txt looks truncated"), std::string::npos) << msg;
}

TEST(BpeRefuses, UnknownByteSymbols) {
  TokDir d;
  d.vocab({"ab", "\u4e00x"});  // 一 stands for no byte
  d.write("merges.txt", "a b\n");
  EXPECT_NE(expect_refused(d).find("holds U+4E00, which is no byte's symbol"), std::string::npos);
  TokDir e;
  e.vocab({"ab"});
  e.write("merges.txt", "a b\n\u4e00 b\n");
  EXPECT_NE(expect_refused(e).find("line 2 holds U+4E00"), std::string::npos);
}

TEST(BpeRefuses, MissingTokensAndBytes) {
  TokDir d;
  d.vocab({"ab"});
  d.write("merges.txt", "a b\nab c\n");
  EXPECT_NE(expect_refused(d).find("merges into 'abc', which is not in"), std::string::npos);
  TokDir e;
  e.write("vocab.json", "{\"a\":0}");
  e.write("merges.txt", "");
  EXPECT_NE(expect_refused(e).find("lacks the symbol"), std::string::npos);
  TokDir f;
  f.write("vocab.json", "{\"a\":0,");
  f.write("merges.txt", "");
  EXPECT_NE(expect_refused(f).find("is not a JSON object"), std::string::npos);
}

TEST(BpeRefuses, VocabularyBeyondUint16) {
  TokDir d;
  d.vocab({}, "\"<|big|>\":65536");  // ids 0..255 and 65536: refused before the gap check
  d.write("merges.txt", "");
  EXPECT_NE(expect_refused(d).find("more than the 65536 a uint16 token shard can hold"), std::string::npos);
  // The same vocabulary without the shard limit fails on its gap instead.
  EXPECT_NE(expect_refused(d, 0).find("ids must be 0 to N-1"), std::string::npos);
}

}  // namespace
}  // namespace zt
