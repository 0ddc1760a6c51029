// `zerotrain tokenize` (see tokenize_cmd.h). Every input and the tokenizer are read and checked
// before anything is written; each shard and tokenizer file is then written atomically.
#include "tokenize_cmd.h"

#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>

#include "cli_checks.h"
#include "core/files.h"
#include "core/format.h"
#include "core/status.h"
#include "data/token_shards.h"
#include "tokenizer/bpe.h"

namespace zt {

namespace {

// The validation split: the last tokens of the stream, val_fraction of them (nanoGPT's 0.0005
// by default) but at least kMinValTokens, or a tenth of a small corpus, so evaluation has windows.
constexpr uint64_t kMinValTokens = 65536;

std::string shard_name(const std::string& dir, const char* split, size_t i) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s_%06zu.bin", split, i);
  return dir + "/" + buf;
}

}  // namespace

TokenizeCommand::TokenizeCommand(CLI::App& app) {
  sub_ = app.add_subcommand("tokenize", "Text files to llm.c token shards (uint16, train/val split) with GPT-2's "
                                        "byte-level BPE; the tokenizer (vocab.json, merges.txt) is written beside them");
  sub_->add_option("inputs", inputs_, "Text files (UTF-8); each is one document, preceded by <|endoftext|> when the "
                                      "vocabulary has it")->required();
  sub_->add_option("--out", out_, "Directory for train_NNNNNN.bin, val_NNNNNN.bin, vocab.json, merges.txt (created)")
      ->required()->check(zt_cli::non_empty());
  sub_->add_option("--vocab", vocab_, "GPT-2's vocab.json (with --merges)")->check(zt_cli::non_empty());
  sub_->add_option("--merges", merges_, "GPT-2's merges.txt (with --vocab)")->check(zt_cli::non_empty());
  sub_->add_option("--tokenizer", tokenizer_, "A directory holding vocab.json and merges.txt")->check(zt_cli::non_empty());
  sub_->add_option("--train-merges", train_merges_, "Learn this many merges from the inputs instead of loading a tokenizer")
      ->check(zt_cli::whole(0, kMaxShardVocab - 257));
  sub_->add_option("--val-fraction", val_fraction_, "Fraction of the tokens (the last ones) for validation; at least "
                                                    "65536 tokens, or a tenth of a smaller corpus; 0: no val shard")
      ->capture_default_str()->check(CLI::Range(0.0, 0.5));
  sub_->add_option("--shard-tokens", shard_tokens_, "Tokens per training shard (llm.c: 100M)")
      ->capture_default_str()->check(zt_cli::whole(1, INT32_MAX));
}

int TokenizeCommand::run() {
  const int sources = (!vocab_.empty() || !merges_.empty() ? 1 : 0) + (!tokenizer_.empty() ? 1 : 0) + (train_merges_ >= 0 ? 1 : 0);
  ZT_REQUIRE(sources == 1, "tokenize needs exactly one tokenizer source: --vocab FILE --merges FILE, --tokenizer DIR, "
             "or --train-merges N");
  ZT_REQUIRE(vocab_.empty() == merges_.empty(), "--vocab and --merges go together (GPT-2's vocab.json and merges.txt)");
  while (out_.size() > 1 && out_.back() == '/') out_.pop_back();
  struct stat st {};
  ZT_REQUIRE(::stat(out_.c_str(), &st) != 0 || S_ISDIR(st.st_mode), "--out ", out_, " exists and is not a directory");

  // Read every input first: a missing or unreadable file fails before anything is written.
  std::vector<std::string> texts;
  uint64_t in_bytes = 0;
  for (const std::string& path : inputs_) {
    const std::vector<uint8_t> raw = InputFile::open(path, "text file").read_all(uint64_t{1} << 34);
    texts.emplace_back(raw.begin(), raw.end());
    in_bytes += raw.size();
  }
  std::optional<BpeTokenizer> tok;
  if (train_merges_ >= 0) {
    std::vector<std::string_view> views(texts.begin(), texts.end());
    tok.emplace(BpeTokenizer::train(views, train_merges_));
  } else if (!tokenizer_.empty()) {
    tok.emplace(BpeTokenizer::load_dir(tokenizer_, kMaxShardVocab));
  } else {
    tok.emplace(BpeTokenizer::load(vocab_, merges_, kMaxShardVocab));
  }

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> ids;
  ids.reserve(in_bytes / 3 + texts.size());
  for (const std::string& text : texts) {
    if (tok->end_of_text()) ids.push_back(*tok->end_of_text());
    tok->encode(text, &ids);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t total = ids.size();
  ZT_REQUIRE(total >= 2, "the inputs hold no text to tokenize");
  uint64_t n_val = static_cast<uint64_t>(std::llround(val_fraction_ * static_cast<double>(total)));
  if (val_fraction_ > 0) n_val = std::max({n_val, std::min(kMinValTokens, total / 10), uint64_t{1}});
  const uint64_t n_train = total - n_val;
  ZT_REQUIRE(n_train >= 1, "the inputs are too short to leave training tokens after the validation split");

  // Writing: the directory, the tokenizer, the shards (each atomic), then shards of an earlier run
  // in DIR beyond the ones written here are removed so the globs see this corpus only.
  if (::stat(out_.c_str(), &st) != 0)
    ZT_REQUIRE(::mkdir(out_.c_str(), 0777) == 0 || errno == EEXIST, "cannot create --out directory ", out_, ": ",
               errno_text(errno));
  tok->save(out_);
  std::set<std::string> written;
  auto write = [&](const std::string& path, uint64_t first, uint64_t n) {
    std::vector<uint16_t> v(ids.begin() + static_cast<std::ptrdiff_t>(first), ids.begin() + static_cast<std::ptrdiff_t>(first + n));
    write_token_shard(path, v);
    written.insert(path);
  };
  size_t train_shards = 0;
  for (uint64_t first = 0; first < n_train; first += static_cast<uint64_t>(shard_tokens_))
    write(shard_name(out_, "train", train_shards++), first, std::min<uint64_t>(static_cast<uint64_t>(shard_tokens_), n_train - first));
  if (n_val > 0) write(shard_name(out_, "val", 0), n_train, n_val);
  for (const char* split : {"train", "val"}) {
    glob_t g{};
    if (::glob((out_ + "/" + split + "_[0-9][0-9][0-9][0-9][0-9][0-9].bin").c_str(), 0, nullptr, &g) == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i)
        if (!written.count(g.gl_pathv[i])) ::unlink(g.gl_pathv[i]);
    ::globfree(&g);
  }

  std::printf("tokenized %zu file%s (%s) into %llu tokens at %.1f MB/s; vocabulary %d (%d merges%s)\n", texts.size(),
              texts.size() == 1 ? "" : "s", format_bytes(static_cast<double>(in_bytes)).c_str(),
              static_cast<unsigned long long>(total), seconds > 0 ? static_cast<double>(in_bytes) / seconds / 1e6 : 0.0,
              tok->vocab_size(), tok->num_merges(), tok->end_of_text() ? ", <|endoftext|> before each file" : "");
  if (train_merges_ > tok->num_merges())
    std::printf("note: learned %d of the %d merges asked for: no pair of tokens occurs twice more in the inputs\n",
                tok->num_merges(), train_merges_);
  const std::string val = n_val ? ", " + out_ + "/val_000000.bin (" + std::to_string(n_val) + " tokens)" : "";
  std::printf("wrote %s/train_*.bin (%zu shard%s, %llu tokens)%s, %s/vocab.json, %s/merges.txt\n", out_.c_str(),
              train_shards, train_shards == 1 ? "" : "s", static_cast<unsigned long long>(n_train), val.c_str(),
              out_.c_str(), out_.c_str());
  std::printf("train on them with: zerotrain train --data '%s/*.bin' (the model's vocabulary becomes %d)\n",
              out_.c_str(), tok->vocab_size());
  return 0;
}

}  // namespace zt
