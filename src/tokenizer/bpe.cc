// Byte-level BPE: loading, training, encoding, decoding, saving (see bpe.h).
#include "tokenizer/bpe.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <queue>
#include <set>
#include <nlohmann/json.hpp>

#include "core/files.h"
#include "core/status.h"
#include "tokenizer/byte_level.h"

namespace zt {

namespace {

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

std::string read_text_file(const std::string& path, const char* kind) {
  const std::vector<uint8_t> raw = InputFile::open(path, kind).read_all(uint64_t{1} << 31);
  return std::string(raw.begin(), raw.end());
}

std::string hex_cp(uint32_t cp) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "U+%04X", cp);
  return buf;
}

// GPT-2's and Hugging Face's special tokens look like <|endoftext|>, <s>, <pad>.
bool looks_special(const std::string& bytes) { return bytes.size() >= 3 && bytes.front() == '<' && bytes.back() == '>'; }

}  // namespace

// Pieces already encoded, as GPT-2's encoder keeps them: most text repeats its words. The ids
// live in one arena; the map is bounded (cleared when full) so memory stays flat on huge corpora.
struct BpeTokenizer::Cache {
  static constexpr size_t kMaxEntries = size_t{1} << 20;
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, Hash, std::equal_to<>> map;
  std::vector<int32_t> arena;
};

BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

void BpeTokenizer::build_tables() {
  merge_of_.clear();
  merge_of_.reserve(merges_.size() * 2);
  std::unordered_map<std::string, int32_t> id_of;
  for (size_t i = 0; i < token_bytes_.size(); ++i) id_of.emplace(token_bytes_[i], static_cast<int32_t>(i));
  for (int b = 0; b < 256; ++b) byte_id_[b] = id_of.at(std::string(1, static_cast<char>(b)));
  for (size_t r = 0; r < merges_.size(); ++r) {
    const auto [a, b] = merges_[r];
    merge_of_.emplace(pair_key(a, b),
                      std::make_pair(static_cast<int32_t>(r), id_of.at(token_bytes_[static_cast<size_t>(a)] +
                                                                      token_bytes_[static_cast<size_t>(b)])));
  }
  const auto e = id_of.find(kEndOfText);
  eot_ = e == id_of.end() ? std::nullopt : std::optional<int>(e->second);
  cache_ = std::make_unique<Cache>();
}

BpeTokenizer BpeTokenizer::load(const std::string& vocab_path, const std::string& merges_path, int max_vocab) {
  BpeTokenizer t;
  // vocab.json: {"symbols": id, ...}
  const std::string vtext = read_text_file(vocab_path, "vocab.json");
  nlohmann::json vj = nlohmann::json::parse(vtext, nullptr, /*allow_exceptions=*/false);
  ZT_REQUIRE(!vj.is_discarded() && vj.is_object(), vocab_path,
             " is not a JSON object of token -> id (is it a complete GPT-2 vocab.json?)");
  int64_t max_id = -1;
  for (auto it = vj.begin(); it != vj.end(); ++it) {
    ZT_REQUIRE(it.value().is_number_integer() && it.value().get<int64_t>() >= 0 && it.value().get<int64_t>() < (int64_t{1} << 31),
               vocab_path, ": token '", it.key(), "' has id ", it.value().dump(), ", not a whole number >= 0");
    max_id = std::max(max_id, it.value().get<int64_t>());
  }
  ZT_REQUIRE(max_id >= 0, vocab_path, " holds no tokens");
  ZT_REQUIRE(max_vocab <= 0 || max_id < max_vocab, vocab_path, " has ", max_id + 1, " token ids (up to ", max_id,
             "), more than the ", max_vocab, " a uint16 token shard can hold (ids 0 to ", max_vocab - 1, ")");
  ZT_REQUIRE(static_cast<size_t>(max_id) + 1 == vj.size(), vocab_path, " has ", vj.size(), " tokens but ids up to ", max_id,
             "; the ids must be 0 to N-1, each once");
  t.token_bytes_.assign(static_cast<size_t>(max_id) + 1, std::string());
  std::vector<bool> seen(t.token_bytes_.size(), false);
  std::unordered_map<std::string, int32_t> id_of;
  for (auto it = vj.begin(); it != vj.end(); ++it) {
    const auto id = static_cast<size_t>(it.value().get<int64_t>());
    ZT_REQUIRE(!seen[id], vocab_path, ": id ", id, " is given to two tokens");
    seen[id] = true;
    std::string bytes;
    uint32_t bad = 0;
    ZT_REQUIRE(symbols_to_bytes(it.key(), &bytes, &bad), vocab_path, ": token '", it.key(), "' holds ", hex_cp(bad),
               ", which is no byte's symbol in GPT-2's byte-level alphabet; this is not a byte-level BPE vocab.json");
    ZT_REQUIRE(!bytes.empty(), vocab_path, ": the empty string is not a token");
    t.token_bytes_[id] = bytes;
    id_of.emplace(bytes, static_cast<int32_t>(id));
  }
  for (int b = 0; b < 256; ++b)
    ZT_REQUIRE(id_of.count(std::string(1, static_cast<char>(b))), vocab_path, " lacks the symbol '",
               byte_symbol(static_cast<uint8_t>(b)), "' of byte ", b, "; a byte-level vocabulary holds all 256");

  // merges.txt: an optional "#version" line, then "left right" per line, by rank.
  const std::string mtext = read_text_file(merges_path, "merges.txt");
  std::unordered_map<uint64_t, int> rank_of;
  std::vector<bool> produced(t.token_bytes_.size(), false);
  size_t pos = 0;
  int line_no = 0;
  while (pos < mtext.size()) {
    size_t eol = mtext.find('\n', pos);
    const bool last = eol == std::string::npos;
    if (last) eol = mtext.size();
    std::string_view line(mtext.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line_no == 1 && line.starts_with("#version")) continue;
    if (line.empty() && last) break;
    const size_t sp = line.find(' ');
    ZT_REQUIRE(sp != std::string_view::npos && sp > 0 && sp + 1 < line.size() &&
                   line.find(' ', sp + 1) == std::string_view::npos,
               merges_path, ": line ", line_no, " ('", std::string(line), "') is not two symbols separated by one space",
               last ? " (the file looks truncated)" : "");
    std::string bytes[2];
    const std::string_view parts[2] = {line.substr(0, sp), line.substr(sp + 1)};
    int32_t ids[2];
    for (int k = 0; k < 2; ++k) {
      uint32_t bad = 0;
      ZT_REQUIRE(symbols_to_bytes(parts[k], &bytes[k], &bad), merges_path, ": line ", line_no, " holds ", hex_cp(bad),
                 ", which is no byte's symbol in GPT-2's byte-level alphabet");
      const auto f = id_of.find(bytes[k]);
      ZT_REQUIRE(f != id_of.end(), merges_path, ": line ", line_no, " merges '", std::string(parts[k]),
                 "', which is not in ", vocab_path, " (do the two files belong together?)");
      ids[k] = f->second;
    }
    const auto f = id_of.find(bytes[0] + bytes[1]);
    ZT_REQUIRE(f != id_of.end(), merges_path, ": line ", line_no, " merges into '", std::string(parts[0]),
               std::string(parts[1]), "', which is not in ", vocab_path, " (do the two files belong together?)");
    ZT_REQUIRE(rank_of.emplace(pair_key(ids[0], ids[1]), line_no).second, merges_path, ": line ", line_no,
               " repeats the merge of line ", rank_of[pair_key(ids[0], ids[1])]);
    produced[static_cast<size_t>(f->second)] = true;
    t.merges_.emplace_back(ids[0], ids[1]);
  }
  // Every token longer than a byte comes from a merge, or is a special token: one that none makes
  // means merges.txt lost its end.
  int orphans = 0;
  std::string first_orphan;
  for (size_t id = 0; id < t.token_bytes_.size(); ++id)
    if (t.token_bytes_[id].size() > 1 && !produced[id] && !looks_special(t.token_bytes_[id]))
      if (orphans++ == 0) first_orphan = bytes_to_symbols(t.token_bytes_[id]);
  ZT_REQUIRE(orphans == 0, merges_path, " has ", t.merges_.size(), " merges but ", orphans, " token",
             orphans == 1 ? "" : "s", " of ", vocab_path, " (first: '", first_orphan,
             "') come from no merge; merges.txt looks truncated");
  t.build_tables();
  return t;
}

BpeTokenizer BpeTokenizer::load_dir(const std::string& dir, int max_vocab) {
  return load(dir + "/vocab.json", dir + "/merges.txt", max_vocab);
}

std::optional<BpeTokenizer> load_tokenizer_if_present(const std::string& dir, int max_vocab) {
  struct stat st {};
  if (::stat((dir + "/vocab.json").c_str(), &st) != 0 || ::stat((dir + "/merges.txt").c_str(), &st) != 0)
    return std::nullopt;
  return BpeTokenizer::load_dir(dir, max_vocab);
}

std::string data_directory(const std::string& spec) {
  const size_t slash = spec.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : spec.substr(0, slash);
}

std::optional<int> tokenizer_vocab_beside(const std::string& spec) {
  const bool shards = spec.ends_with(".bin") || spec.find_first_of("*?[") != std::string::npos;
  if (!shards) return std::nullopt;
  const auto tok = load_tokenizer_if_present(data_directory(spec), kMaxShardVocab);
  return tok ? std::optional<int>(tok->vocab_size()) : std::nullopt;
}

BpeTokenizer BpeTokenizer::train(const std::vector<std::string_view>& texts, int n_merges) {
  ZT_REQUIRE(n_merges >= 0 && n_merges <= kMaxShardVocab - 257, "--train-merges ", n_merges,
             " must be from 0 to ", kMaxShardVocab - 257, " (256 bytes + merges + <|endoftext|> must fit uint16 ids)");
  // Distinct pieces with their counts, in a fixed order (the map's), so training is deterministic.
  std::map<std::string, int64_t, std::less<>> counts;
  for (std::string_view text : texts)
    split_gpt2(text, [&](size_t off, size_t len) {
      const std::string_view p = text.substr(off, len);
      auto it = counts.find(p);
      if (it == counts.end()) counts.emplace(std::string(p), 1);
      else ++it->second;
    });
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> freq;
  for (const auto& [p, c] : counts) {
    std::vector<int32_t> w;
    for (char ch : p) w.push_back(static_cast<uint8_t>(ch));
    words.push_back(std::move(w));
    freq.push_back(c);
  }
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> where;  // may list a word twice, or stale
  for (size_t w = 0; w < words.size(); ++w)
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      const uint64_t k = pair_key(words[w][i], words[w][i + 1]);
      pair_count[k] += freq[w];
      where[k].push_back(static_cast<uint32_t>(w));
    }
  // Max-heap of (count, pair) with lazy deletion: an entry whose count is no longer current is skipped.
  using Entry = std::pair<int64_t, uint64_t>;
  auto worse = [](const Entry& x, const Entry& y) { return x.first != y.first ? x.first < y.first : x.second > y.second; };
  std::priority_queue<Entry, std::vector<Entry>, decltype(worse)> heap(worse);
  for (const auto& [k, c] : pair_count) heap.emplace(c, k);

  BpeTokenizer t;
  std::unordered_map<std::string, int32_t> id_of;  // two merges may spell one token (ab+c, a+bc)
  for (int b = 0; b < 256; ++b) {
    t.token_bytes_.emplace_back(1, static_cast<char>(b));
    id_of.emplace(t.token_bytes_.back(), b);
  }
  std::vector<int> last_visit(words.size(), -1);
  while (static_cast<int>(t.merges_.size()) < n_merges && !heap.empty()) {
    const auto [c, k] = heap.top();
    heap.pop();
    const auto cur = pair_count.find(k);
    if (cur == pair_count.end() || cur->second != c) continue;  // stale
    if (c < 2) break;
    const auto a = static_cast<int32_t>(k >> 32), b = static_cast<int32_t>(k & 0xFFFFFFFFu);
    const int m = static_cast<int>(t.merges_.size());
    t.merges_.emplace_back(a, b);
    std::string merged = t.token_bytes_[static_cast<size_t>(a)] + t.token_bytes_[static_cast<size_t>(b)];
    const auto [slot, fresh] = id_of.emplace(merged, static_cast<int32_t>(t.token_bytes_.size()));
    const int32_t id = slot->second;
    if (fresh) t.token_bytes_.push_back(std::move(merged));
    std::set<uint64_t> changed;
    const std::vector<uint32_t> list = std::move(where[k]);
    where.erase(k);
    for (uint32_t w : list) {
      if (last_visit[w] == m) continue;
      last_visit[w] = m;
      std::vector<int32_t>& sym = words[w];
      bool has = false;
      for (size_t i = 0; i + 1 < sym.size() && !has; ++i) has = sym[i] == a && sym[i + 1] == b;
      if (!has) continue;
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        const uint64_t p = pair_key(sym[i], sym[i + 1]);
        pair_count[p] -= freq[w];
        changed.insert(p);
      }
      std::vector<int32_t> out;
      for (size_t i = 0; i < sym.size(); ++i) {
        if (i + 1 < sym.size() && sym[i] == a && sym[i + 1] == b) {
          out.push_back(id);
          ++i;
        } else {
          out.push_back(sym[i]);
        }
      }
      sym.swap(out);
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        const uint64_t p = pair_key(sym[i], sym[i + 1]);
        pair_count[p] += freq[w];
        changed.insert(p);
        if (p != k) where[p].push_back(w);
      }
    }
    for (uint64_t p : changed) {
      const auto f = pair_count.find(p);
      if (f->second <= 0) pair_count.erase(f);
      else heap.emplace(f->second, p);
    }
  }
  t.token_bytes_.emplace_back(kEndOfText);
  t.build_tables();
  return t;
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.size() == 1) {
    out->push_back(byte_id_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  // Hugging Face's Word::merge_all: a heap of (rank, position), lowest first; an entry is skipped
  // once either of its symbols has been merged away.
  struct Sym {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  const auto n = static_cast<int32_t>(piece.size());
  std::vector<Sym> s(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) s[static_cast<size_t>(i)] = {byte_id_[static_cast<uint8_t>(piece[static_cast<size_t>(i)])], i - 1, i + 1, true};
  struct Merge {
    int32_t rank, pos, new_id;
    bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Merge, std::vector<Merge>, std::greater<>> q;
  for (int32_t i = 0; i + 1 < n; ++i) {
    const auto f = merge_of_.find(pair_key(s[static_cast<size_t>(i)].id, s[static_cast<size_t>(i + 1)].id));
    if (f != merge_of_.end()) q.push({f->second.first, i, f->second.second});
  }
  while (!q.empty()) {
    const Merge top = q.top();
    q.pop();
    Sym& cur = s[static_cast<size_t>(top.pos)];
    if (!cur.alive || cur.next >= n) continue;
    Sym& right = s[static_cast<size_t>(cur.next)];
    const auto f = merge_of_.find(pair_key(cur.id, right.id));
    if (f == merge_of_.end() || f->second.second != top.new_id) continue;  // an expired entry
    cur.id = top.new_id;
    right.alive = false;
    cur.next = right.next;
    if (cur.next < n) s[static_cast<size_t>(cur.next)].prev = top.pos;
    if (cur.prev >= 0) {
      const auto g = merge_of_.find(pair_key(s[static_cast<size_t>(cur.prev)].id, cur.id));
      if (g != merge_of_.end()) q.push({g->second.first, cur.prev, g->second.second});
    }
    if (cur.next < n) {
      const auto g = merge_of_.find(pair_key(cur.id, s[static_cast<size_t>(cur.next)].id));
      if (g != merge_of_.end()) q.push({g->second.first, top.pos, g->second.second});
    }
  }
  for (int32_t i = 0; i < n; i = s[static_cast<size_t>(i)].next) out->push_back(s[static_cast<size_t>(i)].id);
}

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>* out) {
  Cache& c = *cache_;
  split_gpt2(text, [&](size_t off, size_t len) {
    const std::string_view p = text.substr(off, len);
    if (len == 1) {
      out->push_back(byte_id_[static_cast<uint8_t>(p[0])]);
      return;
    }
    const auto f = c.map.find(p);
    if (f != c.map.end()) {
      out->insert(out->end(), c.arena.begin() + f->second.first,
                  c.arena.begin() + f->second.first + f->second.second);
      return;
    }
    const size_t before = out->size();
    encode_piece(p, out);
    if (c.map.size() >= Cache::kMaxEntries || c.arena.size() > (size_t{1} << 26)) {
      c.map.clear();
      c.arena.clear();
    }
    c.map.emplace(std::string(p), std::make_pair(static_cast<uint32_t>(c.arena.size()),
                                                 static_cast<uint32_t>(out->size() - before)));
    c.arena.insert(c.arena.end(), out->begin() + static_cast<std::ptrdiff_t>(before), out->end());
  });
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids) {
    ZT_REQUIRE(id >= 0 && id < vocab_size(), "token id ", id, " is outside the tokenizer's vocabulary of ", vocab_size());
    s += token_bytes_[static_cast<size_t>(id)];
  }
  return s;
}

std::string BpeTokenizer::decode_text(const std::vector<int32_t>& ids) const {
  const std::string raw = decode(ids);
  std::string s;
  for (size_t i = 0; i < raw.size();) {
    size_t len;
    if (detail::decode_utf8(raw, i, &len) == 0xFFFFFFFFu) s += "\xEF\xBF\xBD";
    else s.append(raw, i, len);
    i += len;
  }
  return s;
}

void BpeTokenizer::save(const std::string& dir) const {
  // Ordered by id, as GPT-2's file is; nlohmann writes the symbols as UTF-8.
  nlohmann::ordered_json v = nlohmann::ordered_json::object();
  for (size_t id = 0; id < token_bytes_.size(); ++id) {
    const std::string& b = token_bytes_[id];
    v[eot_ && static_cast<size_t>(*eot_) == id ? b : bytes_to_symbols(b)] = id;
  }
  write_file_atomic(dir + "/vocab.json", v.dump() + "\n", "vocab.json");
  std::string m = "#version: 0.2\n";
  for (const auto& [a, b] : merges_)
    m += bytes_to_symbols(token_bytes_[static_cast<size_t>(a)]) + " " + bytes_to_symbols(token_bytes_[static_cast<size_t>(b)]) + "\n";
  write_file_atomic(dir + "/merges.txt", m, "merges.txt");
}

}  // namespace zt
