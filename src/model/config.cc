// Presets follow GPT-2's published shapes (Radford et al., 2019); gpt-tiny is sized to train
// in a couple of minutes on 2 CPU cores.
#include "model/config.h"

#include <sstream>

#include "core/status.h"

namespace zt {

const std::vector<std::string>& model_preset_names() {
  static const std::vector<std::string> names = {"gpt-tiny",  "gpt2-124m",  "gpt2-350m",
                                                 "gpt2-774m", "gpt2-1558m", "mlp"};
  return names;
}

int64_t ModelConfig::num_parameters() const {
  if (kind == ModelKind::kMlp) {
    int64_t n = 0, in = input_dim;
    for (int h : hidden) {
      n += in * h + h;
      in = h;
    }
    return n + in * classes + classes;
  }
  const int64_t C = embd, L = layers;
  const int64_t per_layer = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) +
                            (4 * C * C + C);
  return int64_t{vocab} * C + int64_t{seq_len} * C + L * per_layer + 2 * C;
}

std::string ModelConfig::describe() const {
  std::ostringstream os;
  if (kind == ModelKind::kMlp) {
    os << "mlp: " << input_dim;
    for (int h : hidden) os << "-" << h;
    os << "-" << classes;
  } else {
    os << "gpt: " << layers << " layers, " << heads << " heads, " << embd << " wide, " << seq_len
       << " context, vocab " << vocab;
  }
  return os.str();
}

ModelConfig make_model_config(const std::string& preset, const ModelOverrides& o) {
  ModelConfig c;
  c.preset = preset;
  auto gpt = [&](int L, int H, int C, int T, int V) {
    c.kind = ModelKind::kGpt;
    c.layers = L, c.heads = H, c.embd = C, c.seq_len = T, c.vocab = V;
  };
  if (preset == "gpt-tiny") {
    gpt(4, 4, 128, 64, 256);
  } else if (preset == "gpt2-124m") {
    gpt(12, 12, 768, 1024, 50257);
  } else if (preset == "gpt2-350m") {
    gpt(24, 16, 1024, 1024, 50257);
  } else if (preset == "gpt2-774m") {
    gpt(36, 20, 1280, 1024, 50257);
  } else if (preset == "gpt2-1558m") {
    gpt(48, 25, 1600, 1024, 50257);
  } else if (preset == "mlp") {
    c.kind = ModelKind::kMlp;
    c.input_dim = 784;
    c.hidden = {256, 128};
    c.classes = 10;
  } else {
    std::string names;
    for (const auto& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
    ZT_THROW(ErrorKind::kInvalidArgument, "unknown model preset '", preset, "'; choose one of ", names);
  }
  auto positive = [](int v, const char* flag) {
    ZT_REQUIRE(v >= 0, flag, " must be positive, got ", v);
  };
  positive(o.layers, "--layers");
  positive(o.heads, "--heads");
  positive(o.embd, "--embd");
  positive(o.seq_len, "--seq-len");
  positive(o.vocab, "--vocab");
  if (c.kind == ModelKind::kGpt) {
    if (o.layers) c.layers = o.layers;
    if (o.heads) c.heads = o.heads;
    if (o.embd) c.embd = o.embd;
    if (o.seq_len) c.seq_len = o.seq_len;
    if (o.vocab) c.vocab = o.vocab;
    ZT_REQUIRE(c.embd % c.heads == 0, "--embd ", c.embd, " must be divisible by --heads ", c.heads);
  } else {
    ZT_REQUIRE(!(o.layers || o.heads || o.embd || o.seq_len || o.vocab),
               "--layers/--heads/--embd/--seq-len/--vocab apply to GPT models, not to ", preset,
               "; use --hidden for the MLP");
    if (!o.hidden.empty()) c.hidden = o.hidden;
    for (int h : c.hidden) ZT_REQUIRE(h > 0, "--hidden sizes must be positive, got ", h);
  }
  // The parameter count in 128 bits: flag-sized shapes (--embd 2147483647, --layers 2147483647)
  // overflow 64-bit products and must be refused before anything is sized from them.
  __int128 params = 0;
  if (c.kind == ModelKind::kGpt) {
    const __int128 C = c.embd;
    params = __int128{c.vocab} * C + __int128{c.seq_len} * C + __int128{c.layers} * (12 * C * C + 13 * C) + 2 * C;
  } else {
    __int128 in = c.input_dim;
    for (int h : c.hidden) params += in * h + h, in = h;
    params += in * c.classes + c.classes;
  }
  constexpr int64_t kMaxParameters = int64_t{1} << 40;
  ZT_REQUIRE(params <= kMaxParameters, "the model ", c.describe(), " has ", static_cast<long double>(params),
             " parameters, above the limit of ", kMaxParameters, " (2^40); lower --layers, --embd, --vocab or --seq-len");
  return c;
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
    case Recompute::kNone: break;
  }
  return "none";
}

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::kNone;
  if (s == "selective") return Recompute::kSelective;
  if (s == "full") return Recompute::kFull;
  ZT_REQUIRE(false, "--recompute '", s, "' must be none, selective or full");
  return Recompute::kNone;
}

}  // namespace zt
