// Text generation from the model being trained: autoregressive, temperature + top-k, deterministic
// in the seed. Every rank runs the same forward in lockstep (stage 3 needs them all) and draws the
// same token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/world.h"

namespace zt {

// Index drawn from `logits` with temperature and top-k (k = 0: all), using the uniform u in [0, 1):
// the k largest are kept, weighted by exp((l - max) / temperature), and u picks by their CDF.
int sample_top_k(const std::vector<float>& logits, int top_k, float temperature, double u);

// `n_tokens` tokens after a start token ('\n', or GPT-2's <|endoftext|>); byte vocabularies are
// shown as text, others decoded through run.tokenizer when there is one, else as token ids. `salt` separates the draws of different samples.
std::string sample_text(World& world, const RunContext& run, int n_tokens, uint64_t salt);

}  // namespace zt
