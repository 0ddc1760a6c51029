// `zerotrain tokenize INPUT... --out DIR`: text files to llm.c token shards (train/val split) with
// GPT-2's byte-level BPE, loaded (--vocab/--merges, --tokenizer) or learned (--train-merges N); the
// tokenizer's vocab.json + merges.txt are written beside the shards.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace zt {

class TokenizeCommand {
 public:
  explicit TokenizeCommand(CLI::App& app);
  bool parsed() const { return sub_->parsed(); }
  int run();

 private:
  CLI::App* sub_;
  std::vector<std::string> inputs_;
  std::string out_, vocab_, merges_, tokenizer_;
  int train_merges_ = -1;
  double val_fraction_ = 0.0005;
  long long shard_tokens_ = 100'000'000;
};

}  // namespace zt
