// Using a trained GPT checkpoint on one device of any backend: its weights (consolidated by the
// checkpoint layer whatever device count, ZeRO stage or tensor/pipeline layout wrote them) loaded
// into the model training runs (model/gpt.cc) in fp32 or 16 bits; `zerotrain eval`'s loss through
// that model's forward, `zerotrain generate`'s tokens through a KV cache built from the same ops.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "model/config.h"
#include "model/model.h"
#include "runtime/device.h"

namespace zt {

class LanguageData;

// A GPT on one device: the plain (one-device) model of make_model in `dtype`'s activations, its
// parameters in device memory (fp32, or the fp32 weights rounded once to bf16/f16, as a 16-bit
// training run's working copy).
struct DeviceGpt {
  ModelConfig mc;
  std::string checkpoint;  // the checkpoint directory read (empty for make_device_gpt)
  int64_t step = 0;
  nlohmann::json meta;     // its manifest's meta (sampler, eval, ...)
  Device* device = nullptr;
  DType dtype = DType::kF32;
  std::unique_ptr<Model> model;
  std::unique_ptr<ParamAccess> params;
};

// spec: a checkpoint directory, or a checkpoint root (its newest complete checkpoint). Refuses a
// checkpoint that is not a GPT's (kInvalidArgument). dtype: f32, bf16 or f16.
DeviceGpt load_device_gpt(const std::string& spec, Device& device, DType dtype);
// From gpt_layout's blocks in host memory (tests).
DeviceGpt make_device_gpt(const ModelConfig& mc, const std::vector<std::vector<float>>& blocks, Device& device,
                          DType dtype);

// The KV cache of one sequence: per layer the qkv rows [capacity, 3C] of positions [0, length())
// in the model's dtype (queries too: the QKV GEMM writes its rows straight into the cache, and
// ops::decode_attention reads c_attn's layout), and the step buffers for up to `capacity` new rows.
class KvCache {
 public:
  explicit KvCache(DeviceGpt& model);  // capacity: the model's context
  ~KvCache();
  int length() const { return len_; }
  int capacity() const { return cap_; }
  void clear() { len_ = 0; }
  // Runs `n` tokens at positions length() .. +n-1 (a prefill, or one decode step), appending their
  // qkv rows: per layer the ops of the model's layer forward (layernorm, QKV GEMM, attention over
  // the cache by ops::decode_attention, projection, residual + layernorm, GEMM + GELU, GEMM, add),
  // then ln_f and the tied LM head. logits: [n, vocab] (all_rows) or [vocab] for the last position,
  // fp32 (16-bit logits widened exactly). Synchronizes the device's compute stream.
  void forward(const int32_t* tokens, int n, float* logits, bool all_rows);

 private:
  struct Buffers;
  DeviceGpt& m_;
  int cap_, len_ = 0;
  std::unique_ptr<Buffers> b_;
};

// The model's own forward (Model::forward, the one training and its evaluation run) over tokens
// at positions 0.. (at most the context): logits of every position, [tokens, vocab] fp32. No
// cache: each call recomputes the window (the reference the KV cache is tested against;
// generate's --dump-logits).
std::vector<float> full_forward_logits(DeviceGpt& model, const std::vector<int32_t>& tokens);

struct GenerateOptions {
  int max_new_tokens = 100;
  float temperature = 0.8f;  // 0: greedy (argmax)
  int top_k = 40;            // 0: every token
  uint64_t seed = 1337;
  bool use_cache = true;     // false: the model's full forward over the window every token (tests)
  // When set, the V fp32 logits each new token was drawn from are appended here in order
  // ([max_new_tokens, V]: what the sampler saw; generate's --dump-step-logits, GPU-vs-CPU checks).
  std::vector<float>* step_logits = nullptr;
};
// The prompt's ids followed by max_new_tokens drawn ids. Past the context, the window slides: each
// new token recomputes the last seq_len tokens (as nanoGPT crops its context).
std::vector<int32_t> generate(DeviceGpt& model, const std::vector<int32_t>& prompt, const GenerateOptions& o);

struct EvalReport {
  double loss = 0;  // mean cross-entropy per target token (nats)
  int batches = 0, rows = 0, seq_len = 0;
  uint64_t tokens = 0;
};
// The validation loss over the batches the run's evaluation reads: batch e = sequences 0..rows-1
// of validation step e (the sampler's contract), e < batches, T = seq_len, through Model::forward
// (train=false) as the run's evaluation runs it, the per-position losses summed in double in
// order. Rows go through the forward `micro` at a time (0: all rows, or as many as keep a
// forward at most 16,384 tokens, dividing rows); a one-device run's evaluation with the same
// micro-batch gives the same bits.
EvalReport evaluate_device(DeviceGpt& model, const LanguageData& data, int batches, int rows, int seq_len,
                           int micro = 0);

// The data a checkpoint is evaluated on: `spec` as train's --data opens it, except that token
// shards whose names all contain "val" form the validation split on their own.
std::unique_ptr<LanguageData> open_eval_data(const std::string& spec, uint64_t seed, int vocab);

}  // namespace zt
