// Consolidated weights in safetensors format: `zerotrain export` writes a checkpoint's fp32 master
// weights under GPT-2's tensor names (Hugging Face layout: the Conv1D matrices attn.c_attn,
// attn.c_proj, mlp.c_fc and mlp.c_proj stored [in, out], transposed from our [out, in]), and
// `--init-from` reads such a file (or one from the Python ecosystem) into a model's blocks.
#pragma once

#include <string>

#include <nlohmann/json.hpp>
#include <vector>

#include "model/config.h"
#include "model/layout.h"

namespace zt {

struct ExportReport {
  std::string checkpoint;  // the checkpoint directory exported
  int64_t step = 0;
  size_t tensors = 0;
  uint64_t bytes = 0;
};

// spec: a checkpoint directory, or a checkpoint root (its newest complete checkpoint). Throws
// kInvalidArgument for a missing/corrupt checkpoint (naming the file) or an unwritable output.
ExportReport export_safetensors(const std::string& spec, const std::string& out_path);

// A checkpoint directory, or a checkpoint root's newest complete checkpoint; throws kInvalidArgument.
std::string resolve_checkpoint_dir(const std::string& spec);
// The model configuration in a checkpoint's meta (`where` names it in errors).
ModelConfig config_from_meta(const nlohmann::json& meta, const std::string& where);

// `zerotrain export --format hf`: a directory transformers' GPT2LMHeadModel.from_pretrained loads:
// config.json (GPT2Config), model.safetensors (export_safetensors: GPT-2's names, Conv1D weights
// [in, out], wte exactly V rows, lm_head tied), and the tokenizer's vocab.json, merges.txt and a
// tokenizer_config.json (GPT2Tokenizer) from `tokenizer_dir`, or when empty from beside the token
// shards the run trained on, when there is one.
struct HfExportReport {
  ExportReport weights;
  std::vector<std::string> files;  // written into the directory
};
HfExportReport export_hf(const std::string& spec, const std::string& out_dir, const std::string& tokenizer_dir);

// Reads every tensor of `layout` from a safetensors file (names as GPT-2's, optionally prefixed
// "transformer."; f32, bf16 or f16), into one host vector per block (padding zero). Tensors of the
// file the model does not have are listed in *ignored. Throws kInvalidArgument naming the file
// and the tensor for a missing tensor, a wrong shape or dtype, or a malformed file.
std::vector<std::vector<float>> read_safetensors_weights(const std::string& path, const ModelConfig& mc,
                                                         const ParamLayout& layout,
                                                         std::vector<std::string>* ignored = nullptr);

}  // namespace zt
