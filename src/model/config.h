// Model configurations and presets (gpt-tiny, gpt2-124m ... gpt2-1558m, mlp), with overrides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zt {

enum class ModelKind { kGpt, kMlp };

// Activation recomputation (--recompute): none keeps every activation backward reads; selective
// drops the cheap, large ones (GELU output, layernorm outputs; attention keeps no T x T matrix to
// drop) and recomputes them in the backward; full keeps only each block's input and re-runs the block's
// forward in its backward. Same ops in the same order, so the bits do not change.
enum class Recompute { kNone, kSelective, kFull };
const char* recompute_name(Recompute r);          // "none", "selective", "full"
Recompute parse_recompute(const std::string& s);  // throws kInvalidArgument

struct ModelConfig {
  ModelKind kind = ModelKind::kGpt;
  std::string preset;
  // GPT
  int layers = 0, heads = 0, embd = 0;
  int seq_len = 0;  // maximum context (the position-embedding table's length)
  int vocab = 0;
  // MLP classifier
  int input_dim = 0;
  std::vector<int> hidden;
  int classes = 0;

  int64_t num_parameters() const;  // exact count, as the flat buffers hold them
  std::string describe() const;    // "gpt: 4 layers, 4 heads, 128 wide, 64 context, vocab 256"
};

// Optional overrides from flags; 0 / empty = keep the preset's value.
struct ModelOverrides {
  int layers = 0, heads = 0, embd = 0, seq_len = 0, vocab = 0;
  std::vector<int> hidden;
};

// Names accepted by --model.
const std::vector<std::string>& model_preset_names();
// Throws zt::Error(kInvalidArgument) for an unknown preset or inconsistent overrides
// (embd not divisible by heads, non-positive sizes).
ModelConfig make_model_config(const std::string& preset, const ModelOverrides& o = {});

// The GPT-2 shape family `zerotrain plan --largest` searches, smallest first: GPT-2's published
// depths and widths (small 12 x 768, medium 24 x 1024, large 36 x 1280, XL 48 x 1600) as anchors,
// two smaller ones below them (3 x 256, 6 x 512) and, beyond XL, the same progression (12 more
// layers, width x 1.25); between two anchors three intermediate members, depth and width
// interpolated (width a multiple of 64). Heads = width / 64, vocab 50257, context `context`.
// Width grows with every member and depth never shrinks, so every tensor, and with it the memory
// of any run, is monotone along the family (what the binary search relies on). Ends before the
// parameter limit (2^40).
std::vector<ModelConfig> gpt2_shape_family(int context);
// "GPT-2 small" .. "GPT-2 XL" for the anchors of that name, else "".
std::string gpt2_shape_name(const ModelConfig& c);

}  // namespace zt
