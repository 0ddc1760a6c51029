// Presets follow GPT-2's published shapes (Radford et al., 2019); gpt-tiny is sized to train
// in a couple of minutes on 2 CPU cores.
#include "model/config.h"

#include <algorithm>
#include <iterator>
#include <sstream>
#include <utility>

#include "core/status.h"

namespace zt {

namespace {

constexpr int kGpt2Vocab = 50257;
constexpr int kHeadWidth = 64;
constexpr int64_t kMaxParameters = int64_t{1} << 40;

struct GptPreset {
  const char* name;
  int layers, heads, embd, seq_len, vocab;
};
constexpr GptPreset kGptPresets[] = {{"gpt-tiny", 4, 4, 128, 64, 256},
                                     {"gpt2-124m", 12, 12, 768, 1024, kGpt2Vocab},
                                     {"gpt2-350m", 24, 16, 1024, 1024, kGpt2Vocab},
                                     {"gpt2-774m", 36, 20, 1280, 1024, kGpt2Vocab},
                                     {"gpt2-1558m", 48, 25, 1600, 1024, kGpt2Vocab}};

constexpr std::pair<Recompute, const char*> kRecomputeNames[] = {
    {Recompute::kNone, "none"}, {Recompute::kSelective, "selective"}, {Recompute::kFull, "full"}};

// GPT-2's four published shapes (Radford et al., 2019).
struct Gpt2Shape {
  int layers, embd;
  const char* name;
};
constexpr Gpt2Shape kGpt2Shapes[] = {{12, 768, "GPT-2 small"}, {24, 1024, "GPT-2 medium"}, {36, 1280, "GPT-2 large"},
                                     {48, 1600, "GPT-2 XL"}};

// The parameter count in 128 bits: flag-sized shapes (--embd 2147483647, --layers 2147483647)
// overflow 64-bit products and must be refused before anything is sized from them.
__int128 parameter_count(const ModelConfig& c) {
  if (c.kind == ModelKind::kGpt) {
    const __int128 C = c.embd;
    return __int128{c.vocab} * C + __int128{c.seq_len} * C + __int128{c.layers} * (12 * C * C + 13 * C) + 2 * C;
  }
  __int128 n = 0, in = c.input_dim;
  for (int h : c.hidden) n += in * h + h, in = h;
  return n + in * c.classes + c.classes;
}

ModelConfig gpt_config(std::string preset, int layers, int heads, int embd, int seq_len, int vocab) {
  ModelConfig c;
  c.kind = ModelKind::kGpt, c.preset = std::move(preset);
  c.layers = layers, c.heads = heads, c.embd = embd, c.seq_len = seq_len, c.vocab = vocab;
  return c;
}

}  // namespace

const std::vector<std::string>& model_preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const GptPreset& p : kGptPresets) n.push_back(p.name);
    n.push_back("mlp");
    return n;
  }();
  return names;
}

int64_t ModelConfig::num_parameters() const { return static_cast<int64_t>(parameter_count(*this)); }

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
  const auto* gpt = std::find_if(std::begin(kGptPresets), std::end(kGptPresets),
                                 [&](const GptPreset& p) { return preset == p.name; });
  if (gpt != std::end(kGptPresets)) {
    c = gpt_config(preset, gpt->layers, gpt->heads, gpt->embd, gpt->seq_len, gpt->vocab);
  } else if (preset == "mlp") {
    c.kind = ModelKind::kMlp, c.preset = preset;
    c.input_dim = 784, c.hidden = {256, 128}, c.classes = 10;
  } else {
    std::string names;
    for (const auto& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
    ZT_THROW(ErrorKind::kInvalidArgument, "unknown model preset '", preset, "'; choose one of ", names);
  }
  for (const auto& [v, flag] : {std::pair{o.layers, "--layers"}, {o.heads, "--heads"}, {o.embd, "--embd"},
                                {o.seq_len, "--seq-len"}, {o.vocab, "--vocab"}})
    ZT_REQUIRE(v >= 0, flag, " must be positive, got ", v);
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
  const __int128 params = parameter_count(c);
  ZT_REQUIRE(params <= kMaxParameters, "the model ", c.describe(), " has ", static_cast<long double>(params),
             " parameters, above the limit of ", kMaxParameters, " (2^40); lower --layers, --embd, --vocab or --seq-len");
  return c;
}

const char* recompute_name(Recompute r) {
  for (const auto& [value, name] : kRecomputeNames)
    if (value == r) return name;
  return "none";
}

Recompute parse_recompute(const std::string& s) {
  for (const auto& [value, name] : kRecomputeNames)
    if (s == name) return value;
  ZT_THROW(ErrorKind::kInvalidArgument, "--recompute '", s, "' must be none, selective or full");
}

std::vector<ModelConfig> gpt2_shape_family(int context) {
  ZT_REQUIRE(context >= 1, "the context of the GPT-2 shape family must be at least 1 token, got ", context);
  std::vector<std::pair<int, int>> anchors = {{3, 256}, {6, 512}};
  for (const Gpt2Shape& s : kGpt2Shapes) anchors.push_back({s.layers, s.embd});
  // Beyond XL until the parameter limit: +12 layers, width x 1.25 rounded to the head width.
  auto member = [&](int L, int C) { return gpt_config("gpt2-family", L, C / kHeadWidth, C, context, kGpt2Vocab); };
  auto params = [&](int L, int C) { return parameter_count(member(L, C)); };
  while (params(anchors.back().first, anchors.back().second) < kMaxParameters) {
    const auto [L, C] = anchors.back();
    const int next = static_cast<int>((static_cast<int64_t>(C) * 5 / 4 + kHeadWidth / 2) / kHeadWidth * kHeadWidth);
    anchors.push_back({L + 12, next});
  }
  std::vector<ModelConfig> family;
  auto add = [&](int L, int C) {
    if (params(L, C) <= kMaxParameters) family.push_back(member(L, C));
  };
  constexpr int kSteps = 4;  // members per anchor interval
  for (size_t a = 0; a + 1 < anchors.size(); ++a) {
    const auto [L0, C0] = anchors[a];
    const auto [L1, C1] = anchors[a + 1];
    for (int j = 0; j < kSteps; ++j) {
      const int L = L0 + ((L1 - L0) * j + kSteps / 2) / kSteps;
      const int C = (C0 + ((C1 - C0) * j / kSteps + kHeadWidth / 2) / kHeadWidth * kHeadWidth);
      add(L, C);
    }
  }
  add(anchors.back().first, anchors.back().second);
  return family;
}

std::string gpt2_shape_name(const ModelConfig& c) {
  if (c.kind != ModelKind::kGpt || c.vocab != kGpt2Vocab) return "";
  for (const Gpt2Shape& s : kGpt2Shapes)
    if (s.layers == c.layers && s.embd == c.embd && c.heads == c.embd / kHeadWidth) return s.name;
  return "";
}

}  // namespace zt
