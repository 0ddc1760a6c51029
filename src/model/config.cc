// Presets follow GPT-2's published shapes (Radford et al., 2019); gpt-tiny is sized to train
// in a couple of minutes on 2 CPU cores.
#include "model/config.h"

#include <sstream>
#include <utility>

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

namespace {

constexpr int kGpt2Vocab = 50257;
constexpr int kHeadWidth = 64;
// GPT-2's four published shapes (Radford et al., 2019).
struct Gpt2Shape {
  int layers, embd;
  const char* name;
};
constexpr Gpt2Shape kGpt2Shapes[] = {{12, 768, "GPT-2 small"}, {24, 1024, "GPT-2 medium"}, {36, 1280, "GPT-2 large"},
                                     {48, 1600, "GPT-2 XL"}};

}  // namespace

std::vector<ModelConfig> gpt2_shape_family(int context) {
  ZT_REQUIRE(context >= 1, "the context of the GPT-2 shape family must be at least 1 token, got ", context);
  std::vector<std::pair<int, int>> anchors = {{3, 256}, {6, 512}};
  for (const Gpt2Shape& s : kGpt2Shapes) anchors.push_back({s.layers, s.embd});
  // Beyond XL until the parameter limit: +12 layers, width x 1.25 rounded to the head width.
  constexpr int64_t kMaxParameters = int64_t{1} << 40;
  auto params = [&](int64_t L, int64_t C) {
    return int64_t{kGpt2Vocab} * C + int64_t{context} * C + L * (12 * C * C + 13 * C) + 2 * C;
  };
  while (params(anchors.back().first, anchors.back().second) < kMaxParameters) {
    const auto [L, C] = anchors.back();
    const int next = static_cast<int>((static_cast<int64_t>(C) * 5 / 4 + kHeadWidth / 2) / kHeadWidth * kHeadWidth);
    anchors.push_back({L + 12, next});
  }
  std::vector<ModelConfig> family;
  auto add = [&](int L, int C) {
    if (params(L, C) > kMaxParameters) return;
    ModelConfig c;
    c.kind = ModelKind::kGpt;
    c.preset = "gpt2-family";
    c.layers = L, c.embd = C, c.heads = C / kHeadWidth, c.seq_len = context, c.vocab = kGpt2Vocab;
    family.push_back(c);
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
