// Using a trained GPT checkpoint on the host (fp32, OpenBLAS): its weights consolidated by the
// checkpoint layer whatever device count, ZeRO stage or tensor/pipeline layout wrote them, a
// forward with a KV cache for `zerotrain generate`, and the loss over the evaluation's batches
// for `zerotrain eval`.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/layout.h"

namespace zt {

class LanguageData;

// A GPT's weights on the host, as gpt_layout names them ([out, in] matrices).
struct HostGpt {
  ModelConfig mc;
  std::string checkpoint;  // the checkpoint directory read
  int64_t step = 0;
  nlohmann::json meta;     // its manifest's meta (sampler, eval, ...)
  ParamLayout layout;                      // gpt_layout(mc)
  std::vector<std::vector<float>> blocks;  // its blocks' fp32 master weights
  // Tensor `name` of the layout (throws kInternal if absent).
  const float* tensor(const std::string& name) const;
};

// spec: a checkpoint directory, or a checkpoint root (its newest complete checkpoint). Refuses a
// checkpoint that is not a GPT's (kInvalidArgument).
HostGpt load_host_gpt(const std::string& spec);

// Keys and values of every layer for positions [0, length()), [layers][seq_len][embd] each.
class KvCache {
 public:
  explicit KvCache(const ModelConfig& mc);
  int length() const { return len_; }
  int capacity() const { return cap_; }
  void clear() { len_ = 0; }

 private:
  friend void gpt_forward(const HostGpt&, KvCache&, const int32_t*, int, float*, bool);
  int cap_, len_ = 0;
  int64_t C_;
  std::vector<float> k_, v_;
};

// Runs `n` tokens at positions cache.length() .. +n-1 (at most the context), appending their keys
// and values; logits: [n, vocab] (all_rows) or [vocab] for the last position only.
void gpt_forward(const HostGpt& model, KvCache& cache, const int32_t* tokens, int n, float* logits, bool all_rows);

struct GenerateOptions {
  int max_new_tokens = 100;
  float temperature = 0.8f;  // 0: greedy (argmax)
  int top_k = 40;            // 0: every token
  uint64_t seed = 1337;
  bool use_cache = true;     // false: recompute the whole window every token (tests compare the two)
};
// The prompt's ids followed by max_new_tokens drawn ids. Past the context, the window slides: each
// new token recomputes the last seq_len tokens (as nanoGPT crops its context).
std::vector<int32_t> generate(const HostGpt& model, const std::vector<int32_t>& prompt, const GenerateOptions& o);

struct EvalReport {
  double loss = 0;  // mean cross-entropy per target token (nats)
  int batches = 0, rows = 0, seq_len = 0;
  uint64_t tokens = 0;
};
// The validation loss over the batches the run's evaluation reads: batch e = sequences 0..rows-1
// of validation step e (the sampler's contract), e < batches, T = seq_len.
EvalReport evaluate_host(const HostGpt& model, const LanguageData& data, int batches, int rows, int seq_len);

// The data a checkpoint is evaluated on: `spec` as train's --data opens it, except that token
// shards whose names all contain "val" form the validation split on their own.
std::unique_ptr<LanguageData> open_eval_data(const std::string& spec, uint64_t seed, int vocab);

}  // namespace zt
