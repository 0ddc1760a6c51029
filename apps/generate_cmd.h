// `zerotrain generate --checkpoint DIR --prompt TEXT` (text from a trained GPT, KV cache) and
// `zerotrain eval --checkpoint DIR --data GLOB` (its loss and perplexity over the batches the run's
// evaluation reads). Both run on one device of either backend in fp32 or 16 bits (train/generate.h),
// from a checkpoint of any device count, ZeRO stage or tensor/pipeline layout.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "train/trainer.h"

namespace zt {

class GenerateCommand {
 public:
  explicit GenerateCommand(CLI::App& app);
  bool parsed() const { return sub_->parsed(); }
  int run();

 private:
  CLI::App* sub_;
  std::string checkpoint_, prompt_, tokenizer_, dump_logits_, dump_step_logits_;
  std::string devices_ = "all";
  Precision precision_ = Precision::kAuto;
  bool json_ = false;  // --log-format json
  int max_new_tokens_ = 100, top_k_ = 40;
  float temperature_ = 0.8f;
  uint64_t seed_ = 1337;
};

class EvalCommand {
 public:
  explicit EvalCommand(CLI::App& app);
  bool parsed() const { return sub_->parsed(); }
  int run();

 private:
  CLI::App* sub_;
  std::string checkpoint_, data_;
  std::string devices_ = "all";
  Precision precision_ = Precision::kAuto;
  bool json_ = false;  // --log-format json
  int batches_ = 0, rows_ = 0;
};

}  // namespace zt
