// What the one-device and the tensor-parallel GPT share about pipeline chunks (model-internal):
// a chunk's blocks, how a stage's chunks take their blocks from a PipelineStageSpec, the visit
// orders over chunks, and which part of a backward one call runs.
#pragma once

#include <functional>
#include <vector>

#include "core/status.h"
#include "model/model.h"

namespace zt {

// One chunk of a stage model and the local blocks it runs.
struct GptChunk {
  int first_layer = 0, layers = 0;
  bool embedding = false, head = false;
  int emb_block = -1;             // embedding chunks: the block of wte (or the rank's shard) and wpe
  std::vector<int> layer_blocks;  // the block of each of its layers
  int lnf_block = -1;             // head chunks: ln_f, and the block whose wte is the LM head
  int head_block = -1;
};

// Which parts of a backward one call runs: both (backward()), or the zero-bubble split.
enum class BackPass { kFused, kInput, kWeight };

// A stage's chunks; take(logical) adds a local copy of logical block `logical` (0: embeddings,
// 1..L: layers, L + 1: ln_f) and returns its index, called in layout order: the embeddings if a
// chunk embeds, each chunk's layers, then ln_f and (when the stage does not embed) the tied head.
inline std::vector<GptChunk> gpt_stage_chunks(const ModelConfig& c, const PipelineStageSpec& spec,
                                              const std::function<int(int)>& take) {
  std::vector<GptChunk> chunks;
  bool embeds = false, heads = false;
  for (const PipelineChunk& pc : spec.chunks) embeds |= pc.embedding, heads |= pc.head;
  const int emb = embeds ? take(0) : -1;
  for (const PipelineChunk& pc : spec.chunks) {
    ZT_CHECK(pc.layers >= 1 && pc.first_layer >= 0 && pc.first_layer + pc.layers <= c.layers,
             "pipeline chunk of layers ", pc.first_layer, "+", pc.layers, " in a ", c.layers, "-layer model");
    GptChunk k;
    k.first_layer = pc.first_layer, k.layers = pc.layers, k.embedding = pc.embedding, k.head = pc.head;
    k.emb_block = pc.embedding ? emb : -1;
    for (int l = 0; l < pc.layers; ++l) k.layer_blocks.push_back(take(pc.first_layer + l + 1));
    chunks.push_back(k);
  }
  if (heads) {
    const int lnf = take(c.layers + 1), head = embeds ? emb : take(0);
    for (GptChunk& k : chunks)
      if (k.head) k.lnf_block = lnf, k.head_block = head;
  }
  return chunks;
}

// Each chunk's visits in chunk order (forward) and reverse chunk order (backward); a whole
// model's are GPT-2's (gpt_forward_order / gpt_backward_order).
inline std::vector<int> chunks_forward_order(const std::vector<GptChunk>& chunks) {
  std::vector<int> o;
  for (const GptChunk& k : chunks) {
    if (k.embedding) o.push_back(k.emb_block);
    o.insert(o.end(), k.layer_blocks.begin(), k.layer_blocks.end());
    if (k.head) o.push_back(k.lnf_block), o.push_back(k.head_block);
  }
  return o;
}
inline std::vector<int> chunks_backward_order(const std::vector<GptChunk>& chunks) {
  std::vector<int> o;
  for (auto k = chunks.rbegin(); k != chunks.rend(); ++k) {
    if (k->head) o.push_back(k->head_block), o.push_back(k->lnf_block);
    o.insert(o.end(), k->layer_blocks.rbegin(), k->layer_blocks.rend());
    if (k->embedding) o.push_back(k->emb_block);
  }
  return o;
}

}  // namespace zt
