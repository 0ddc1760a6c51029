// Host GPT inference (train/generate.h): the forward against a float64 reference written out here,
// the KV cache against recomputing the whole forward every token (greedy generation must pick the
// same tokens, also past the context), and sampling's determinism in the seed.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "model/model.h"
#include "train/generate.h"

namespace zt {
namespace {

HostGpt random_gpt(uint32_t seed) {
  HostGpt m;
  ModelOverrides o;
  o.layers = 2;
  o.heads = 2;
  o.embd = 32;
  o.seq_len = 16;
  o.vocab = 50;
  m.mc = make_model_config("gpt-tiny", o);
  m.layout = gpt_layout(m.mc);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.4f);  // large enough that the logits are far from ties
  for (const auto& b : m.layout.blocks()) {
    m.blocks.emplace_back(static_cast<size_t>(b.numel));
    for (float& v : m.blocks.back()) v = nd(rng);
  }
  return m;
}

// GPT-2's forward in float64, naively: logits [n, V] of tokens at positions 0..n-1.
std::vector<double> reference_logits(const HostGpt& m, const std::vector<int32_t>& tok) {
  const int64_t C = m.mc.embd, V = m.mc.vocab, NH = m.mc.heads, hs = C / NH;
  const int n = static_cast<int>(tok.size());
  auto W = [&](const std::string& name) { return m.tensor(name); };
  std::vector<double> x(static_cast<size_t>(n * C));
  for (int i = 0; i < n; ++i)
    for (int64_t c = 0; c < C; ++c) x[i * C + c] = double(W("wte.weight")[tok[i] * C + c]) + W("wpe.weight")[i * C + c];
  auto ln = [&](const std::vector<double>& in, const float* w, const float* b) {
    std::vector<double> out(in.size());
    for (int i = 0; i < n; ++i) {
      double mu = 0, var = 0;
      for (int64_t c = 0; c < C; ++c) mu += in[i * C + c];
      mu /= C;
      for (int64_t c = 0; c < C; ++c) var += (in[i * C + c] - mu) * (in[i * C + c] - mu);
      const double r = 1 / std::sqrt(var / C + 1e-5);
      for (int64_t c = 0; c < C; ++c) out[i * C + c] = (in[i * C + c] - mu) * r * w[c] + b[c];
    }
    return out;
  };
  auto lin = [&](const std::vector<double>& in, int64_t IC, const float* w, const float* b, int64_t OC) {
    std::vector<double> out(static_cast<size_t>(n * OC));
    for (int i = 0; i < n; ++i)
      for (int64_t o = 0; o < OC; ++o) {
        double s = b ? b[o] : 0.0;
        for (int64_t k = 0; k < IC; ++k) s += in[i * IC + k] * double(w[o * IC + k]);
        out[i * OC + o] = s;
      }
    return out;
  };
  for (int l = 0; l < m.mc.layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    const auto qkv = lin(ln(x, W(p + "ln_1.weight"), W(p + "ln_1.bias")), C, W(p + "attn.c_attn.weight"),
                         W(p + "attn.c_attn.bias"), 3 * C);
    std::vector<double> att(x.size(), 0.0);
    for (int i = 0; i < n; ++i)
      for (int64_t h = 0; h < NH; ++h) {
        std::vector<double> s(static_cast<size_t>(i + 1));
        double mx = -1e300, z = 0;
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t e = 0; e < hs; ++e) d += qkv[i * 3 * C + h * hs + e] * qkv[j * 3 * C + C + h * hs + e];
          s[j] = d / std::sqrt(double(hs));
          mx = std::max(mx, s[j]);
        }
        for (int j = 0; j <= i; ++j) z += s[j] = std::exp(s[j] - mx);
        for (int j = 0; j <= i; ++j)
          for (int64_t e = 0; e < hs; ++e) att[i * C + h * hs + e] += s[j] / z * qkv[j * 3 * C + 2 * C + h * hs + e];
      }
    const auto proj = lin(att, C, W(p + "attn.c_proj.weight"), W(p + "attn.c_proj.bias"), C);
    for (size_t e = 0; e < x.size(); ++e) x[e] += proj[e];
    auto fc = lin(ln(x, W(p + "ln_2.weight"), W(p + "ln_2.bias")), C, W(p + "mlp.c_fc.weight"), W(p + "mlp.c_fc.bias"), 4 * C);
    for (double& f : fc) f = 0.5 * f * (1 + std::tanh(std::sqrt(2 / M_PI) * (f + 0.044715 * f * f * f)));
    const auto out = lin(fc, 4 * C, W(p + "mlp.c_proj.weight"), W(p + "mlp.c_proj.bias"), C);
    for (size_t e = 0; e < x.size(); ++e) x[e] += out[e];
  }
  return lin(ln(x, W("ln_f.weight"), W("ln_f.bias")), C, W("wte.weight"), nullptr, V);
}

TEST(HostGpt, ForwardMatchesFloat64Reference) {
  const HostGpt m = random_gpt(1);
  std::vector<int32_t> tok = {3, 17, 42, 0, 49, 8, 8, 23, 11, 5, 30, 2};
  const auto ref = reference_logits(m, tok);
  KvCache cache(m.mc);
  std::vector<float> got(ref.size(), NAN);
  gpt_forward(m, cache, tok.data(), static_cast<int>(tok.size()), got.data(), true);
  double max_ref = 0;
  for (double r : ref) max_ref = std::max(max_ref, std::fabs(r));
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], 1e-5 * max_ref + 1e-5) << "logit " << i;
  EXPECT_EQ(cache.length(), static_cast<int>(tok.size()));
}

TEST(HostGpt, KvCacheEqualsTheFullForward) {
  const HostGpt m = random_gpt(2);
  const std::vector<int32_t> tok = {7, 1, 33, 33, 12, 48, 0, 19, 26};
  const int V = m.mc.vocab;
  KvCache one_by_one(m.mc);
  std::vector<float> step(static_cast<size_t>(V)), full(static_cast<size_t>(V) * tok.size());
  for (size_t t = 0; t < tok.size(); ++t) {
    gpt_forward(m, one_by_one, &tok[t], 1, step.data(), false);
    KvCache fresh(m.mc);
    gpt_forward(m, fresh, tok.data(), static_cast<int>(t + 1), full.data(), true);
    for (int v = 0; v < V; ++v) ASSERT_NEAR(step[v], full[t * V + v], 1e-4) << "position " << t << ", logit " << v;
  }
}

TEST(HostGpt, GreedyGenerationWithTheCacheEqualsRecomputing) {
  for (uint32_t seed : {3u, 4u, 5u}) {
    const HostGpt m = random_gpt(seed);
    GenerateOptions o;
    o.temperature = 0;
    o.max_new_tokens = 30;  // past the 16-token context: the window slides
    const std::vector<int32_t> prompt = {static_cast<int32_t>(seed), 9, 4};
    const auto cached = generate(m, prompt, o);
    o.use_cache = false;
    const auto recomputed = generate(m, prompt, o);
    EXPECT_EQ(cached, recomputed) << "seed " << seed;
    ASSERT_EQ(cached.size(), prompt.size() + 30);
    EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), cached.begin()));
  }
}

TEST(HostGpt, SamplingIsAFunctionOfTheSeed) {
  const HostGpt m = random_gpt(6);
  GenerateOptions o;
  o.max_new_tokens = 20;
  o.temperature = 1.0f;
  o.top_k = 0;
  const auto a = generate(m, {1}, o), b = generate(m, {1}, o);
  EXPECT_EQ(a, b);
  o.seed = 99;
  EXPECT_NE(generate(m, {1}, o), a);
  o.top_k = 1;  // top-1 is greedy whatever the temperature
  GenerateOptions g = o;
  g.temperature = 0;
  EXPECT_EQ(generate(m, {1}, o), generate(m, {1}, g));
}

}  // namespace
}  // namespace zt
